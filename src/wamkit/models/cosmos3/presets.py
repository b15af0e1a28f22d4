"""Cosmos3 size presets and the adapter's options (``model.options``), with their checks.

Transformer configs are ``Cosmos3OmniTransformer`` constructor arguments; VAE configs are
``AutoencoderKLWan`` arguments (the Wan2.2 layout: 12 input channels after a 2x2 patchify, 16x
spatial and 4x temporal compression). A config must satisfy ``sum(rope_axes_dim) == head_dim / 2``
and ``patch_latent_dim == latent_channel * latent_patch_size**2``, with ``latent_channel`` equal
to the VAE's ``z_dim``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID

from wamkit import embodiments
from wamkit.config import ConfigError, from_dict
from wamkit.models.cosmos3 import RECIPE_EMBODIMENT, AttentionMode, StepGraph

_RECIPE = embodiments.get(RECIPE_EMBODIMENT)

_NANO = dict(
    head_dim=128,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=36,
    latent_channel=48,
    latent_patch_size=2,
    patch_latent_dim=192,
    rope_axes_dim=[24, 20, 20],
)
_WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
    scale_factor_temporal=4,
)

# name -> (transformer kwargs, VAE kwargs). Random weights; a real model comes from model.pretrained.
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # ~0.5M parameters besides the 151,936-token embedding and LM head (kept at Qwen3's size so that
    # the real tokenizer's ids are valid): forward + backward in well under a second on a CPU.
    "tiny": (
        dict(
            head_dim=16,
            hidden_size=64,
            intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=4,
            latent_channel=8,
            latent_patch_size=2,
            patch_latent_dim=32,
            rope_axes_dim=[4, 2, 2],
        ),
        dict(_WAN22_VAE, base_dim=4, decoder_base_dim=4, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=0),
    ),
    # Cosmos3-Nano's shape (36 layers, hidden 4096, 32/8 heads, head_dim 128; ~15B parameters).
    "nano": (dict(_NANO), dict(_WAN22_VAE)),
    # Nano width at 8 layers (~4.4B parameters): SFT fits one 141 GB GPU without sharding.
    "nano_l8": (dict(_NANO, num_hidden_layers=8), dict(_WAN22_VAE)),
    # Trained from scratch (docs/cosmos3.md "A Cosmos3 trained from scratch"): Nano's layer layout
    # (4:1 grouped-query heads, 3x MLP) at 512 wide and 8 layers, 25M parameters per tower, and a
    # 16-channel VAE of Wan2.2's layout, random and frozen (an encoder of random features: no VAE
    # weights can be loaded here). Sized for one GPU on the MetaWorld demo (its training time and
    # success: docs/benchmarks.md, "Cosmos3 trained from scratch on the demo's tasks").
    "small": (
        dict(
            head_dim=64,
            hidden_size=512,
            intermediate_size=1536,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=8,
            latent_channel=16,
            latent_patch_size=2,
            patch_latent_dim=64,
            rope_axes_dim=[12, 10, 10],
        ),
        dict(_WAN22_VAE, base_dim=16, decoder_base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    ),
    # small's shape at 128 wide and 4 layers: what a 2-core CPU trains (tests/test_cosmos3_learns.py)
    "mini": (
        dict(
            head_dim=32,
            hidden_size=128,
            intermediate_size=384,
            num_attention_heads=4,
            num_key_value_heads=1,
            num_hidden_layers=4,
            latent_channel=8,
            latent_patch_size=2,
            patch_latent_dim=32,
            rope_axes_dim=[6, 5, 5],
        ),
        dict(_WAN22_VAE, base_dim=4, decoder_base_dim=4, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=0),
    ),
}

# The options an embodiment's profile sets when the config leaves them out (resolve_options): a profile
# with a Cosmos3 domain gives its own, any other data takes the recipe's defaults below.
EMBODIMENT_OPTIONS = ("domain_name", "view_point", "view_description", "fps")

ViewPoint = Literal["ego_view", "third_person_view", "wrist_view", "concat_view"]


@dataclass
class Cosmos3Options:
    """``model.options`` of the cosmos3 adapter, their defaults and checks (the one place they are
    defined); built by :func:`resolve_options` with :func:`wamkit.config.from_dict`, as tiny's are."""

    # A diffusers folder whose transformer *config*, VAE, scheduler and tokenizer are used, with fresh
    # transformer weights (a saved model is rebuilt from it, then its own weights are loaded). Set
    # automatically from model.pretrained, so a model trained from real weights keeps their VAE.
    base: str = ""
    # embodiment whose action-head row is used (diffusers' domain table): the recipe's, from its profile
    domain_name: str = _RECIPE.cosmos3_domain
    resolution_tier: Literal[256, 480, 704, 720] = 256  # the pipeline's action canvas tier
    view_point: ViewPoint = "concat_view"  # framing sentence of the action caption (cameras side by side)
    # appended to the framing sentence: which half of the side-by-side frame is which camera
    view_description: str = _RECIPE.cosmos3_view_description
    fps: float = float(_RECIPE.fps)  # dataset frame rate: in the caption and the mRoPE temporal positions
    caption_dropout: float = 0.1  # training: probability that the whole caption is replaced by ""
    train_shift: float = 3.0  # training noise levels: waver distribution warped by this shift (256 tier)
    num_inference_steps: int = 30
    # the sampler's update on the same shifted flow sigmas: "unipc", the recipe's (diffusers'
    # UniPCMultistepScheduler, bh2); "euler", the plain flow step x + (sigma_next - sigma) v (diffusers'
    # FlowMatchEulerDiscreteScheduler.step), for comparing step counts (docs/cosmos3.md)
    sampler: Literal["unipc", "euler"] = "unipc"
    # native flow schedule's shift for sampling, unless model.pretrained's scheduler config is a
    # native flow schedule with its own flow_shift
    sampling_shift: float = 5.0
    action_loss_weight: float = (
        1.0  # loss = action_loss_weight * action loss + vision_loss_weight * vision loss
    )
    vision_loss_weight: float = 1.0
    action_lr_mult: float = 5.0  # learning-rate multiplier of the action heads
    # auto: keep the heads model.pretrained holds (sliced to io.action_dim), initialise them only when it
    # has none | true: initialise fresh heads even so (cosmos' recipe from the base model) | false: refuse
    # a folder without heads
    reinit_action_heads: Literal["auto", True, False] = "auto"
    # the robot's state as one held (clean) token in front of the action chunk, through the domain's
    # action input head (zero-padded to the action width; state_dim <= action_dim): Cosmos3 has no
    # state input of its own, the published recipe none (false). The loss and the output skip it
    state_token: bool = False
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    gradient_checkpointing: bool = False
    # how packed requests attend inside themselves: "mask" (one masked call per pathway), "loop"
    # (one flash call per request and pathway) or "flex" (one flex-attention call per pathway that skips
    # the masked-out blocks; compiled on CUDA; on the CPU its calls with gradients take "mask", flex
    # attention having no CPU backward); "auto": flex on CUDA (faster than mask in SFT:
    # docs/results-log.md, "Cosmos3 SFT with cached latents"), mask elsewhere. A single request always takes
    # the stock path. models/cosmos3/packing.py
    attention: AttentionMode = "auto"
    # policy inference (serve, infer, eval): true = the fast path (text keys/values cached per prompt,
    # requests on a batch axis; models/cosmos3/kv_step.py), false = diffusers' forward over packed requests.
    # The other modes always take diffusers' forward.
    fast_inference: bool = True
    # prompts whose per-layer text keys/values the fast path keeps (LRU; Nano bf16: ~19 MB per prompt)
    text_cache_size: int = 128
    # the fast path's denoising step on CUDA: "none" (eager), "cuda_graph" (captured once per batch
    # bucket), "compile" (experimental: the whole step torch.compile'd, mode reduce-overhead, no faster
    # than compile_layers and a minute of compiling per bucket on a first start), "compile_layers" (one decoder layer compiled, shared by all layers, the
    # step captured around it as a CUDA graph: as fast as compile, compiled in seconds per bucket),
    # "auto" (compile_layers); compiles are kept between starts (wamkit.models.compile_cache); ignored
    # on CPU. Timings: docs/benchmarks.md, "Cosmos3" and "Cosmos3-Nano server start"
    step_graph: StepGraph = "auto"
    # training: a folder written by `wamkit cache-latents` for this run's data and settings; sft_loss
    # then reads each clip's VAE latents from it instead of encoding them ("": encode on every step).
    # Not saved with the model (models/cosmos3/latents.py)
    latent_cache: str = ""
    # training: a folder written by `wamkit cache-text` for this run's captions and weights; sft_loss then
    # reads each caption's per-layer text keys/values from it and runs only the generation tower ("":
    # the understanding tower runs on every micro-batch). Not saved with the model
    # (models/cosmos3/text_kv.py)
    text_kv_cache: str = ""

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"model.options.{key}: {why}")

        domain_id(self.domain_name)
        for key in ("fps", "train_shift", "sampling_shift", "action_lr_mult"):
            if getattr(self, key) <= 0:
                raise bad(key, f"must be > 0, got {getattr(self, key)}")
        for key in ("action_loss_weight", "vision_loss_weight"):
            if getattr(self, key) < 0:
                raise bad(key, f"must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise bad("caption_dropout", f"must be in [0, 1], got {self.caption_dropout}")
        for key in ("num_inference_steps", "text_cache_size"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def embodiment_options(embodiment: str) -> dict[str, Any]:
    """What the profile of ``embodiment`` (a name in :mod:`wamkit.embodiments`, ``""`` for none) sets
    among :data:`EMBODIMENT_OPTIONS`: nothing unless it has a Cosmos3 domain."""
    e = embodiments.get(embodiment) if embodiment in embodiments.names() else None
    if e is None or not e.cosmos3_domain:
        return {}
    return {
        "domain_name": e.cosmos3_domain,
        "view_point": e.cosmos3_view_point or Cosmos3Options.view_point,
        "view_description": e.cosmos3_view_description,
        "fps": float(e.fps),
    }


def domain_id(name: str) -> int:
    """The action-head row of Cosmos3 domain ``name``: diffusers' table, else the embodiment profile
    that declares it (``cosmos3_domain_id``); :class:`ConfigError` for any other name."""
    if name in _EMBODIMENT_TO_DOMAIN_ID:
        return _EMBODIMENT_TO_DOMAIN_ID[name]
    e = embodiments.for_cosmos3_domain(name)
    if e is None or e.cosmos3_domain_id is None:
        profiles = map(embodiments.get, embodiments.names())
        own = (p.cosmos3_domain for p in profiles if p.cosmos3_domain_id is not None)
        known = sorted({*_EMBODIMENT_TO_DOMAIN_ID, *own})
        raise ConfigError(
            f"model.options.domain_name: {name!r} is no Cosmos3 domain; expected one of {known}"
        )
    return e.cosmos3_domain_id


def resolve_options(options: dict[str, Any], embodiment: str = "") -> Cosmos3Options:
    """Defaults, then what ``embodiment``'s profile sets (:func:`embodiment_options`), then
    ``options``; raises :class:`ConfigError` naming ``model.options.<key>``."""
    return from_dict(Cosmos3Options, {**embodiment_options(embodiment), **options}, prefix="model.options")


def check_transformer_config(cfg: dict[str, Any], source: str) -> None:
    """The two shape constraints of a Cosmos3 config, with the numbers that break them (missing keys
    take ``Cosmos3OmniTransformer``'s defaults)."""
    rope = list(
        cfg.get("rope_axes_dim") or (cfg.get("rope_scaling") or {}).get("mrope_section") or [24, 20, 20]
    )
    head_dim, p = cfg.get("head_dim", 128), cfg.get("latent_patch_size", 2)
    if sum(rope) * 2 != head_dim:
        raise ConfigError(f"{source}: sum(rope_axes_dim)={sum(rope)} must equal head_dim/2={head_dim / 2}")
    latent, patch_dim = cfg.get("latent_channel", 48), cfg.get("patch_latent_dim", 192)
    if patch_dim != latent * p * p:
        raise ConfigError(
            f"{source}: patch_latent_dim={patch_dim} must equal latent_channel*patch^2={latent * p * p}"
        )
