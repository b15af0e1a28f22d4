"""The cosmos3 adapter: NVIDIA Cosmos3 (diffusers ``Cosmos3OmniTransformer``) behind wamkit's protocol.

The robot SFT example, as cosmos-framework builds it (docs/cosmos3.md cites each fact):

- video: the current frame and the ``chunk`` = 16 frames after it (``future_frame_offsets`` 1..16, the
  data stage's ``observation.future_images.<cam>`` [B, 16, H, W, 3]), each frame the cameras side by
  side (``io.cameras`` order, left to right), put on the pipeline's action canvas (``resolution_tier``)
  and encoded by the Wan VAE into 5 latent frames; the first is the clean condition.
- text: the structured JSON action caption (:func:`recipe.action_prompt`): framing sentence plus the
  view description, the task, ``idle_frame`` "k out of 16" (k from the batch's ``idle_frames`` when the
  data stage supplies it, else the field is left out as cosmos does), duration, fps, canvas size; no
  system prompt. In training the caption is dropped (``""``) with probability ``caption_dropout``; at
  inference ``idle_frame`` is "0 out of 16".
- actions: ``io.chunk`` tokens of ``io.action_dim`` (10-D ``[dpos, rot6d, g]`` for a delta-pose arm, already
  normalised, the gripper in the data's own convention) through the ``domain_name`` row of the heads.
- noise: one sigma per sample for vision and actions, waver-distributed and shifted by ``train_shift``
  (:func:`recipe.train_sigmas`); ``x_t = (1 - s) x0 + s noise``, velocity target ``noise - x0``.
- loss: ``action_loss_weight`` x action MSE (padding excluded) + ``vision_loss_weight`` x MSE of the
  future latent frames.
- trained: the generation tower, time embedder, vae<->llm projections and the action heads
  (``lr_mult = action_lr_mult``); the understanding tower and the embeddings are frozen.

The state is not a model input in the recipe (Cosmos3 has none); with ``options.state_token`` it is
one held token in front of the action chunk, through the domain's action input head. ``predict`` lives in
:class:`wamkit.models.cosmos3.inference.Cosmos3Inference`; policy mode takes the fast path of
:mod:`wamkit.models.cosmos3.kv_step` unless ``options.fast_inference`` is false.

With ``options.latent_cache`` (a folder written by ``wamkit cache-latents``) the batch carries the clip
latents (:data:`latents.LATENTS`) and ``sft_loss`` skips the VAE; the cache's fingerprint is checked
against this model's at build (:mod:`wamkit.models.cosmos3.latents`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from diffusers import Cosmos3OmniPipeline

from wamkit.actions.cosmos3 import action_prompt, side_by_side
from wamkit.actions.representations import get_representation
from wamkit.config import ConfigError
from wamkit.constants import ACTION, ACTION_IS_PAD, IDLE_FRAMES, OBS_STATE, TASK, future_image_key, image_key
from wamkit.device import to_device
from wamkit.models.base import (
    LATENT_CACHE_OPTION,
    ActivationShape,
    LoraTargets,
    ModelIO,
    ParamGroup,
    ServingFootprint,
    weights_sha256,
)
from wamkit.models.cosmos3 import latents
from wamkit.models.cosmos3.encoding import Canvas, ClipEncoder
from wamkit.models.cosmos3.fast_policy import TEXT_BUCKET, FastPolicy
from wamkit.models.cosmos3.inference import Cosmos3Inference
from wamkit.models.cosmos3.kv_step import TextKV, _gen_layer, build_context, encode_text, gen_step
from wamkit.models.cosmos3.latents import LATENTS, LatentCache
from wamkit.models.cosmos3.packing import PackedLayout, RequestSegments, install_processor, pack
from wamkit.models.cosmos3.presets import domain_id
from wamkit.models.cosmos3.recipe import train_sigmas
from wamkit.models.cosmos3.text_kv import OPTION as TEXT_KV_OPTION
from wamkit.models.cosmos3.text_kv import TextKVDiskCache
from wamkit.models.cosmos3.towers import GEN_LINEARS, param_role, train_flops

NUM_TRAIN_TIMESTEPS = 1000  # the model's timestep = sigma * 1000 (then x timestep_scale inside)
log = logging.getLogger(__name__)


def _np_images(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


class Cosmos3Adapter(Cosmos3Inference):
    """Cosmos3 through diffusers. ``module`` is the ``Cosmos3OmniTransformer``; the VAE, scheduler and
    tokenizer are frozen helpers, and ``pipe`` is a ``Cosmos3OmniPipeline`` over them whose segment
    builders, tokenizer template and VAE encoding are reused as they are."""

    name = "cosmos3"
    # the packed sequence's length follows the batch's captions (and caption dropout): train.compile
    # compiles the blocks for dynamic shapes (wamkit.models.base.compile_blocks)
    varying_shapes = True

    @property
    def sampling_steps(self) -> int:
        """UniPC steps of a request (``num_inference_steps``; ``serve.sampling_steps``)."""
        return int(self.options.num_inference_steps)

    @sampling_steps.setter
    def sampling_steps(self, steps: int) -> None:
        self.options.num_inference_steps = int(steps)

    def __init__(self, io, preset, pretrained, options, transformer, vae, scheduler, tokenizer):
        self.io: ModelIO = io
        self.preset, self.pretrained, self.options = preset, pretrained, options
        self.module = transformer
        self.vae, self.scheduler, self.tokenizer = vae, scheduler, tokenizer
        self.pipe = Cosmos3OmniPipeline(
            transformer=transformer,
            text_tokenizer=tokenizer,
            vae=vae,
            scheduler=scheduler,
            enable_safety_checker=False,
            default_use_system_prompt=False,  # cosmos trains the action captions without one
            use_native_flow_schedule=True,  # the sigma grid cosmos samples with (recipe.native_sigmas)
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.clip_encoder = ClipEncoder(self.pipe)  # the pipeline's preprocessing and encode, batched
        self.domain_id = domain_id(options.domain_name)
        self.processor = install_processor(transformer, options.attention)
        # policy mode's default path (options.fast_inference): cached text keys/values, batched requests
        self.fast = FastPolicy(transformer, int(options.text_cache_size), options.step_graph)
        self._text: dict[str, dict[str, Any]] = {}
        self._segments: dict[tuple, RequestSegments] = {}
        self._nominal: PackedLayout | None = None
        # the training clip: the current frame and the chunk frames after it (cosmos' 17-frame window)
        self.future_frame_offsets: tuple[int, ...] = tuple(range(1, io.chunk + 1))
        # the caption's idle_frame count, computed by the data stage from the raw chunk
        self.sample_extras: tuple[str, ...] = (
            (IDLE_FRAMES,) if IDLE_FRAMES in get_representation(io.representation).extras else ()
        )
        # idle_frame at inference: 0 as cosmos' policy server, for a model trained on captions that carry
        # the field; None leaves it out (the prompt diffusers' pipeline builds), as training did for
        # data without idle counts: a caption the model never saw in training would condition it on
        # text it cannot read (a from-scratch model served so failed every episode)
        self.inference_idle_frames: int | None = 0 if self.sample_extras else None
        self.fp8 = False  # use_fp8(): the generation tower's linear layers quantized (serving only)
        self._warned_idle = False
        for name, p in transformer.named_parameters():
            p.requires_grad_(param_role(name) != "frozen")
        if options.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self._vae_sha256: str | None = None
        if options.latent_cache:  # refused now, not at the first step, if built with other settings
            LatentCache(options.latent_cache).check(self.latent_fingerprint(), "model")
        self._frozen_sha: str | None = None
        self.dropped: frozenset[str] = frozenset()  # frozen tensors left out of the module (text cache)
        self.text_kv: TextKVDiskCache | None = None
        self._text_kv_dtype_checked: torch.dtype | None = None

    def use_text_kv(self, folder: str) -> None:
        """Train with the text keys/values of ``folder`` (``model.options.text_kv_cache``; called by the
        builder once the weights' source is known): refused now if the cache was built with other
        weights or settings; the understanding tower then leaves the model."""
        self.text_kv = TextKVDiskCache(folder)
        # taken now, while the frozen weights are whole (sharded, they are no longer hashed here)
        self._text_fingerprint = self.text_fingerprint()
        self.text_kv.check(self._text_fingerprint)
        self.drop_understanding_tower()
        # each decoder layer's forward becomes its generation half (kv_step._gen_layer): the trainer calls
        # the layer itself, so FSDP2's per-layer hooks gather its shards as for the stock forward, and
        # gradient checkpointing recomputes that half alone
        for layer in self.module.layers:
            layer.forward = types.MethodType(_gen_layer, layer)

    # -- protocol: structure --------------------------------------------------------------------
    def param_groups(self) -> list[ParamGroup]:
        groups = {
            "generation": ParamGroup("generation"),
            "generation_no_decay": ParamGroup("generation_no_decay", weight_decay=False),
            "action_heads": ParamGroup("action_heads", lr_mult=float(self.options.action_lr_mult)),
        }
        for name, p in self.module.named_parameters():
            role = param_role(name)
            if role == "action_heads":
                groups["action_heads"].params.append(p)
            elif role == "generation":
                groups["generation" if p.ndim >= 2 else "generation_no_decay"].params.append(p)
        return list(groups.values())

    def blocks(self) -> list[torch.nn.Module]:
        """The ``Cosmos3VLTextMoTDecoderLayer``s: FSDP2 shards each one (diffusers' ``_no_split_modules``)."""
        return list(self.module.layers)

    def lora_targets(self) -> LoraTargets:
        """``train.lora``: adapters in every decoder layer's generation-tower linear layers (the
        attention projections and the MLP); the action heads, which the recipe initialises afresh,
        train in full. The time embedder, the vae<->llm projections and the norms stay as the base has
        them."""
        return LoraTargets(modules=GEN_LINEARS, full_groups=("action_heads",))

    def config_dict(self) -> dict[str, Any]:
        # the latent cache is this run's training data, not part of the model: a served or exported
        # model must not need the folder
        options = {
            k: v for k, v in self.options.to_dict().items() if k not in (LATENT_CACHE_OPTION, TEXT_KV_OPTION)
        }
        return {
            "name": self.name,
            "preset": self.preset,
            "pretrained": self.pretrained,
            "options": options,
            "io": self.io.to_dict(),
        }

    # -- serving: what warm-up compiles, and what its compiled code depends on --------------------------
    def warm_wanted(self) -> bool:
        """Does a server gain from running every batch bucket once before it answers? Yes when the
        fast path captures or compiles its steps (CUDA): a bucket's first request would wait for it."""
        return bool(self.options.fast_inference) and self.fast.usable() and self.fast.mode() != "none"

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        """Warm-up requests denoise in 2 steps, not ``num_inference_steps``: every step runs the same
        compiled (and captured) velocity, so a bucket's first step compiles it and the rest of a full
        request would only add seconds to the start (6 s at Nano's batch 32)."""
        steps = self.options.num_inference_steps
        self.options.num_inference_steps = min(2, int(steps))
        try:
            yield
        finally:
            self.options.num_inference_steps = steps

    def use_fp8(self, backend: str = "scaled_mm") -> int:
        """Serve with the generation tower's linear layers in FP8 (``serve.precision=fp8``,
        :mod:`wamkit.models.fp8`): per layer its q/k/v/out projections and MLP. The understanding
        tower runs once per prompt (its keys/values are cached), so FP8 would save little there and
        cost accuracy in every cached prompt; the heads and the patch projections stay too (small, at
        the edges). ``backend``: ``scaled_mm`` (wamkit's ``Fp8Linear``, the serving one) or
        ``torchao`` (its float8 recipe on the same layers, for the benchmark). Returns how many layers
        were quantized."""
        from wamkit.models.fp8 import quantize_linears, quantize_linears_torchao

        gen_parts = ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj", "self_attn.to_add_out",
                     "mlp_moe_gen.")  # fmt: skip
        quantize = {"scaled_mm": quantize_linears, "torchao": quantize_linears_torchao}[backend]
        n = quantize(self.module.layers, lambda name, m: name.split(".", 1)[1].startswith(gen_parts))
        self.fp8 = True
        self.fast.clear()  # captured steps hold the old weights
        return n

    def place_text_tower(self, device: torch.device) -> None:
        """``serve.text_tower=host``: everything but the understanding tower onto ``device`` (the
        generation tower, heads, projections, rotary tables, VAE); the tower stays in host memory, its
        decoder layers pinned, and a new prompt's keys/values stream it layer by layer
        (:mod:`wamkit.models.cosmos3.host_tower`). Call it on a model built in host memory."""
        from wamkit.models.cosmos3.host_tower import StreamedTextTower, tower_parameter_names

        if not self.options.fast_inference:
            raise ConfigError(
                "serve.text_tower=host reads the text through cached keys/values, which "
                "model.options.fast_inference=false turns off: set it true, or serve.text_tower=device"
            )
        device = torch.device(device)
        host = tower_parameter_names(self.module)
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if name not in host:
                    p.data = p.data.to(device)
            self.module.rotary_emb.to(device)
        self.vae.to(device)
        self.fast.text_tower = StreamedTextTower(self.module, device)
        self.fast.clear()

    def serving_footprint(self, max_batch: int, device_type: str) -> ServingFootprint:
        """What serving this model at ``max_batch`` keeps, in bytes, its weights built on a
        ``device_type`` device (in the dtype :func:`resolve_dtype` gives there: a serving directory is
        built on the CPU, so fp32 under ``dtype: auto``): read from the parameters' shapes (a model on the meta
        device will do) and the nominal request (:meth:`_nominal_request`). The batch figures are
        estimates, as :mod:`wamkit.serve.plan` says."""
        from wamkit.models.cosmos3.fast_policy import batch_bucket
        from wamkit.models.cosmos3.host_tower import tower_parameter_names

        dtype = resolve_dtype(self.options.dtype, torch.device(device_type))
        e = torch.empty((), dtype=dtype).element_size()
        tower = tower_parameter_names(self.module)
        params = dict(self.module.named_parameters())
        und = sum(p.numel() for n, p in params.items() if n in tower)
        layer = max(
            sum(p.numel() for n, p in params.items() if n in tower and n.startswith(f"layers.{i}."))
            for i in range(len(self.module.layers))
        )
        c = self.module.config
        und_len, gen_len = self.token_counts()
        kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * e  # keys + values
        u_pad = -(-und_len // TEXT_BUCKET) * TEXT_BUCKET
        nb = batch_bucket(max_batch)
        # a batch's text keys/values: the call's own context, plus the captured step of each bucket up
        # to nb keeping its copy (1 + 2 + ... + nb < 2 nb): 3 nb requests' worth at most
        context = 3 * nb * u_pad * kv_token
        # one layer's working set at the largest bucket: hidden-wide tensors (input, q, attention
        # output, residual) and the MLP's gate, up and product; the captured steps' pools keep about
        # one each, the buckets below nb together about as much again
        tokens = nb * gen_len
        work = 2 * tokens * (4 * c.hidden_size + 3 * c.intermediate_size) * e
        return ServingFootprint(
            weights=sum(p.numel() for n, p in params.items() if n not in tower) * e,
            text_tower=und * e,
            text_layer=layer * e,
            vae=sum(p.numel() for p in self.vae.parameters()) * e,
            text_prompt=und_len * kv_token,
            text_cache_size=int(self.options.text_cache_size),
            batch=context + work,
            dtype=str(dtype).removeprefix("torch."),
        )

    def compile_fields(self) -> dict[str, Any] | None:
        """The model's part of the compile cache's key (wamkit.models.compile_cache), or None when
        nothing is compiled: the transformer's architecture, dtype and the step's settings."""
        if not self.warm_wanted() or self.fast.mode() not in ("compile", "compile_layers"):
            return None
        return {
            "model": self.name,
            # the architecture (diffusers' private keys left out: `_use_default_values` is a set, listed
            # in another order by every process)
            "transformer": {k: v for k, v in self.module.config.items() if not k.startswith("_")},
            "dtype": str(self.dtype),
            "fp8": self.fp8,
            "io": self.io.to_dict(),
            "step_graph": self.fast.mode(),
            "attention": self.fast.attention,
            "text_bucket": TEXT_BUCKET,
            "resolution_tier": self.options.resolution_tier,
        }

    # -- protocol: built on the meta device (wamkit.models.weights) ------------------------------------
    def set_weight_source(self, make) -> None:
        """``make(device)`` gives the source the transformer's weights stream from (built on meta)."""
        self._weight_source = make

    def set_weight_law(self, law) -> None:
        """Random weights: ``law.identity(name)`` says what each tensor is drawn from
        (:class:`~wamkit.models.cosmos3.components.RandomWeights`); the frozen hash is taken over these,
        the same whether the model was built on meta or drawn whole."""
        self._weight_law = law

    def load_weights(self, device: torch.device, wrap=None) -> int:
        """Fill the (sharded, materialised) transformer from its source; returns bytes read. The rotary
        frequencies, a non-persistent buffer no file holds, are computed again on ``device``.
        ``wrap(source) -> source``: the trainer's view of the source, for a module it changed after
        the build (LoRA: the adapted layers' tensors under peft's names, the adapters' initial values)."""
        from wamkit.models.cosmos3.components import _rebuild_rotary
        from wamkit.models.weights import fill

        make = getattr(self, "_weight_source", None)
        if make is None:
            raise RuntimeError("cosmos3: load_weights needs a model built on the meta device")
        source = make(device) if wrap is None else wrap(make(device))
        n = fill(self.module, source, self.pretrained or f"the {self.preset} preset", self.dropped)
        _rebuild_rotary(self.module, device)
        return n

    def base_reference(self, whole: bool = False) -> dict[str, Any] | None:
        """What the frozen weights are, for checkpoints that leave them out (wamkit.train.base_weights):
        the safetensors files of ``pretrained``, or the tiny preset (regenerated exactly anywhere, pinned
        by the hash of its frozen tensors); None for other random presets (a checkpoint keeps them).
        ``whole``: the tiny preset's hash covers every tensor, the trained towers' too (a LoRA run's
        checkpoints leave out the adapted layers' weights as well); asked before LoRA renames them."""
        from wamkit.models.cosmos3.components import pipeline_root

        if self.pretrained:
            root, tdir = pipeline_root(self.pretrained)
            files = sorted(str(f.relative_to(root)) for f in tdir.glob("*.safetensors"))
            return {"kind": "diffusers", "path": str(root.resolve()), "files": files}
        if self.preset == "tiny" and not self.options.base:
            if not whole:
                return {"kind": "preset", "preset": "tiny", "sha256": self._frozen_sha256()}
            h = hashlib.sha256(f"{self._frozen_sha256()}|{self._hash_params(trained=True)}".encode())
            return {"kind": "preset", "preset": "tiny", "sha256": h.hexdigest(), "whole": True}
        return None

    def _frozen_sha256(self) -> str:
        """sha256 over the frozen tensors (name, shape, fp32 bytes, in name order), read from the
        weights' source when the module is still on the meta device; a random preset's (not tiny's):
        over each tensor's law instead (:meth:`set_weight_law`). Taken once: the tower may be dropped
        afterwards, :meth:`drop_understanding_tower`."""
        if self._frozen_sha is None:
            self._frozen_sha = self._hash_params(trained=False)
        return self._frozen_sha

    def drop_understanding_tower(self, force: bool = False) -> None:
        """With the text keys/values read from a cache, the understanding tower (each layer's text
        half, the token embeddings, the LM head and final norm) is never run: take it out of the module,
        so it is neither sharded nor placed on a device. Only where a checkpoint need not hold it (the
        base is named: :meth:`base_reference`; ``force``: a memory plan's model, never trained); the
        frozen hash is taken first."""
        if not force and self.base_reference() is None:
            log.info(
                "cosmos3: the understanding tower stays in the model (this random preset's checkpoints keep it)"
            )
            return
        before = {n for n, p in self.module.named_parameters() if param_role(n) == "frozen"}
        for layer in self.module.layers:
            for part in ("to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k", "k_norm_und_for_gen"):
                setattr(layer.self_attn, part, None)
            layer.mlp = layer.input_layernorm = layer.post_attention_layernorm = None
        for name, _ in list(self.module.named_children()):
            if name in ("embed_tokens", "lm_head", "norm") or name.startswith("audio_"):
                setattr(self.module, name, None)
        kept = {n for n, _ in self.module.named_parameters()}
        if before & kept:
            raise RuntimeError(
                f"cosmos3: frozen parameters left after dropping the understanding tower: {sorted(before & kept)[:3]}"
            )
        self.dropped = self.dropped | before  # a second call (a plan's, a benchmark's) adds nothing

    def _hash_params(self, trained: bool) -> str:
        """sha256 over the frozen tensors (``trained``: the others), as :meth:`_frozen_sha256` says."""
        make = getattr(self, "_weight_source", None)
        src = make(torch.device("cpu")) if make is not None and self.device.type == "meta" else None
        # random frozen weights: their law and seed (set_weight_law), not their drawn bytes
        identity = None if trained else getattr(getattr(self, "_weight_law", None), "identity", None)
        h = hashlib.sha256()
        for name, p in sorted(self.module.named_parameters()):
            if (param_role(name) == "frozen") == trained:
                continue
            law = identity(name) if identity is not None else None
            if law is not None:
                h.update(f"{name}|{list(p.shape)}|{law}|".encode())
                continue
            t = src.read(name, 0, p.shape[0]) if src is not None else p.detach()
            t = t.float().contiguous().cpu()
            h.update(f"{name}|{list(t.shape)}|".encode())
            h.update(t.view(torch.uint8).numpy())
        return h.hexdigest()

    @property
    def gradient_checkpointing(self) -> bool:
        return bool(self.options.gradient_checkpointing)

    def activation_shape(self):
        """Per-sample token counts and widths for the memory plan (:mod:`wamkit.train.memory`)."""
        und, gen = self.token_counts()
        c = self.module.config
        return ActivationShape(
            tokens=und + gen,
            grad_tokens=gen,
            hidden=int(c.hidden_size),
            kv_dim=int(c.num_key_value_heads) * int(c.head_dim),
            intermediate=int(c.intermediate_size),
            layers=int(c.num_hidden_layers),
        )

    def token_counts(self) -> tuple[int, int]:
        """(understanding, generation) tokens of one nominal request (no device work)."""
        texts, hw, shape = self._nominal_request()
        req = self._requests(texts, hw, shape, (0,), ())[0]
        return req.und_len, req.gen_len

    def export_extra(self, out_dir, spec: Any = None) -> None:
        """``wamkit convert --to extra``: a diffusers pipeline folder, verified by reloading it (the
        spec travels beside it as every export's does)."""
        from wamkit.models.cosmos3.components import export_diffusers, verify_export

        export_diffusers(self, out_dir)
        verify_export(self, out_dir)

    @property
    def device(self) -> torch.device:
        """Where the model computes (its input projection's device: with ``serve.text_tower=host`` the
        understanding tower's weights rest in host memory, :meth:`place_text_tower`)."""
        return self.module.proj_in.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the input projections: under FSDP2 mixed precision, read inside the
        root's forward, it is the unsharded ``param_dtype`` (bf16), not the fp32 master weights'."""
        return self.module.proj_in.weight.dtype

    # -- inputs -> latents and segments -----------------------------------------------------------
    def _views(self, batch: dict[str, Any], prefix: str | None = None) -> list[np.ndarray]:
        """Per sample, the cameras side by side: uint8 [H, n_cams * W, 3]."""
        keys = [f"{prefix}.{c}" if prefix else image_key(c) for c in self.io.cameras]
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"batch lacks {', '.join(missing)} (cameras {list(self.io.cameras)})")
        return list(side_by_side([_np_images(batch[k]) for k in keys]))

    def _encode(self, clips: list[list[np.ndarray]], device: torch.device | None = None) -> torch.Tensor:
        """Clips (per sample, a list of uint8 frames) -> cropped normalised latents [B, C, T, h, w] fp32,
        encoded on ``device`` (default: the transformer's), as the pipeline encodes them (``encoding``)."""
        dev = torch.device(device or self.device)
        vae_dev = next(self.vae.parameters()).device
        if vae_dev != dev:
            self.vae.to(dev)
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            return self.clip_encoder(clips, self.options.resolution_tier, dev)

    def _canvas(self, frame: np.ndarray) -> Canvas:
        """The action canvas of frames of ``frame``'s shape (cached per shape and tier)."""
        return self.clip_encoder.canvas(frame.shape[:2], self.options.resolution_tier)

    def _canvas_hw(self, frame: np.ndarray) -> tuple[int, int]:
        return self._canvas(frame).size

    def prompt(self, task: str, hw: tuple[int, int], idle_frames: int | None) -> str:
        """The caption text of one request on a canvas of ``hw`` = (height, width)."""
        return action_prompt(
            task,
            view_point=self.options.view_point,
            view_description=self.options.view_description,
            num_frames=self.io.chunk + 1,
            fps=float(self.options.fps),
            height=hw[0],
            width=hw[1],
            idle_frames=idle_frames,
            chunk=self.io.chunk,
        )

    def _text_segment(self, text: str, hw: tuple[int, int]) -> dict[str, Any]:
        key = (text, hw)
        if key not in self._text:
            # no system prompt and no flat templates: cosmos tokenises the JSON caption as it is
            ids, _ = self.pipe.tokenize_prompt(
                text,
                num_frames=self.io.chunk + 1,
                height=hw[0],
                width=hw[1],
                fps=float(self.options.fps),
                use_system_prompt=False,
                add_resolution_template=False,
                add_duration_template=False,
            )
            self._text[key] = self.pipe._prepare_text_segment(ids, device="cpu")
        return self._text[key]

    def _layout(self, texts: list[str], hw, latent_shape, vision_cond, action_cond) -> PackedLayout:
        """The packed layout of len(texts) requests (caption texts); ``latent_shape`` = (C, T, h, w)."""
        return pack(self._requests(texts, hw, latent_shape, vision_cond, action_cond), self.device)

    def _requests(
        self, texts: list[str], hw, latent_shape, vision_cond, action_cond
    ) -> list[RequestSegments]:
        """Each request's segments (request-local indices), as the pipeline's builders make them."""
        reqs = []
        for caption in texts:
            text = self._text_segment(caption, hw)
            key = (
                text["und_len"],
                float(text["vision_start_temporal_offset"]),
                latent_shape,
                vision_cond,
                action_cond,
            )
            if key not in self._segments:
                vis = self.pipe._prepare_vision_segment(
                    input_vision_tokens=torch.empty((1, *latent_shape), device="meta"),
                    has_image_condition=True,
                    mrope_offset=text["vision_start_temporal_offset"],
                    vision_fps=float(self.options.fps),
                    curr=text["und_len"],
                    device="cpu",
                    condition_frame_indexes=list(vision_cond),
                )
                act = self.pipe._prepare_action_segment(
                    input_action_tokens=torch.empty((self.action_len, self.io.action_dim), device="meta"),
                    condition_frame_indexes=list(action_cond),
                    mrope_offset=text["vision_start_temporal_offset"],
                    action_fps=float(self.options.fps),
                    curr=text["und_len"] + vis["num_vision_tokens"],
                    device="cpu",
                )
                self._segments[key] = RequestSegments(text, vis, act)
            reqs.append(RequestSegments(text, self._segments[key].vision, self._segments[key].action))
        return reqs

    @property
    def held_actions(self) -> int:
        """Held tokens in front of the action chunk: 1 with ``options.state_token`` (the state), else 0."""
        return int(bool(self.options.state_token))

    @property
    def action_len(self) -> int:
        """Tokens of the action stream: the held state token (``options.state_token``), then the chunk."""
        return self.held_actions + self.io.chunk

    def _state_tokens(self, batch: dict[str, Any], dev: torch.device) -> torch.Tensor:
        """The state token of each sample, [B, held_actions, action_dim] fp32: the model-space state
        (as the preprocessing spec normalised it) zero-padded to the action width; [B, 0, D] without
        ``options.state_token``."""
        state = torch.as_tensor(batch[OBS_STATE], dtype=torch.float32)
        out = torch.zeros(state.shape[0], self.held_actions, self.io.action_dim)
        if self.held_actions:
            out[:, 0, : state.shape[1]] = state
        return to_device(out, dev)

    def _latent_frames(self) -> int:
        return self.io.chunk // int(self.vae.config.scale_factor_temporal) + 1

    def _run(self, layout: PackedLayout, lat_v: torch.Tensor, t_v: torch.Tensor, lat_a: torch.Tensor, t_a):
        """One transformer call over all requests; returns predicted velocities [N, C, T, h, w], [N, chunk, D]."""
        dt, n = self.dtype, layout.n
        # Left set after the call on purpose: gradient checkpointing re-runs the layers' forward during
        # backward, and the recomputation must attend within the same requests.
        self.processor.prepare(layout, lat_v.device)
        preds_v, _, preds_a = self.module(
            **layout.forward_kwargs(
                [lat_v[i : i + 1].to(dt) for i in range(n)],
                t_v,
                [lat_a[i].to(dt) for i in range(n)],
                t_a,
                [torch.full((1,), self.domain_id, device=lat_a.device)] * n,
            )
        )
        return torch.cat(preds_v).float(), torch.stack(preds_a).float()

    # -- protocol: training -----------------------------------------------------------------------
    def _clips(self, batch: dict[str, Any], views: list[np.ndarray]) -> list[list[np.ndarray]]:
        """Per sample the ``chunk + 1`` frames (current, then the future frames), views side by side."""
        keys = [future_image_key(c) for c in self.io.cameras]
        if keys[0] not in batch:  # no future frames given: the target is a still scene
            return [[v] * (self.io.chunk + 1) for v in views]
        fut = [_np_images(batch[k]) for k in keys]
        want = (len(views), self.io.chunk)
        for k, f in zip(keys, fut):
            if f.ndim != 5 or tuple(f.shape[:2]) != want:
                raise ValueError(
                    f"{k}: expected uint8 [B, K, H, W, 3] with B, K = {want}, got {list(f.shape)}"
                )
        side = np.concatenate(fut, axis=3)  # [B, K, H, n_cams * W, 3]
        return [[v, *side[i]] for i, v in enumerate(views)]

    def encode_clips(self, batch: dict[str, Any], device: torch.device | None = None) -> torch.Tensor:
        """The clean video latents ``sft_loss`` trains toward: fp32 [B, C, T, h, w] of each sample's
        clip (what ``wamkit cache-latents`` stores)."""
        return self._encode(self._clips(batch, self._views(batch)), device)

    def latent_fingerprint(self) -> dict[str, Any]:
        """The model's side of a latent cache's fingerprint (:data:`latents.MODEL_FIELDS`)."""
        if self._vae_sha256 is None:
            self._vae_sha256 = weights_sha256(self.vae)
        return {
            "encoder": self.name,
            "vae_sha256": self._vae_sha256,
            "vae_dtype": str(next(self.vae.parameters()).dtype).removeprefix("torch."),
            "resolution_tier": int(self.options.resolution_tier),
            "image_size": int(self.io.image_size),
            "cameras": list(self.io.cameras),
            "chunk": int(self.io.chunk),
            "future_frame_offsets": list(self.future_frame_offsets),
        }

    def latent_cache_writer(self, dataset, spec, fps: float, *, out, parent, dtype: str, shard_size: int):
        """The protocol's :class:`~wamkit.models.base.CachesLatents`: see :func:`latents.writer_for`."""
        return latents.writer_for(dataset, self.latent_fingerprint(), spec, fps, out=out, parent=parent,
                                  dtype=dtype, shard_size=shard_size)  # fmt: skip

    def latent_dataset(self, dataset, folder, spec, fps: float):
        """The protocol's :class:`~wamkit.models.base.CachesLatents`: samples carry :data:`LATENTS`."""
        return latents.open_training_dataset(dataset, folder, spec, fps)

    # -- the text key/value cache (models/cosmos3/text_kv.py) -------------------------------------------
    def _run_hw(self) -> tuple[int, int]:
        """The canvas of this model's training frames (its cameras side by side at ``io.image_size``)."""
        n, size = len(self.io.cameras), int(self.io.image_size)
        return self._canvas_hw(np.zeros((size, n * size, 3), np.uint8))

    def training_captions(self, tasks: list[str]) -> list[str]:
        """Every caption a training run over ``tasks`` can draw: each task with each ``idle_frame``
        count a chunk can have (0 .. chunk; none when the data carry no counts), and the dropped
        caption ``""`` when caption dropout is on."""
        hw = self._run_hw()
        counts = range(self.io.chunk + 1) if self.sample_extras else [None]
        out = {self.prompt(task, hw, k) for task in tasks for k in counts}
        if float(self.options.caption_dropout) > 0:
            out.add("")
        return sorted(out)

    def text_fingerprint(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """What a caption's text keys/values depend on besides its text: the frozen weights, the
        tokenizer, and the settings the captions are built with; ``dtype``: the compute dtype (a run
        checks it at its first step, inside the trainer's mixed precision)."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        vocab = backend.to_str() if backend is not None else repr(sorted(tok.get_vocab().items()))
        out = {
            "understanding_sha256": self._frozen_sha256(),
            "tokenizer_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
            "view_point": self.options.view_point,
            "view_description": self.options.view_description,
            "fps": float(self.options.fps),
            "chunk": int(self.io.chunk),
            "canvas": list(self._run_hw()),
        }
        if dtype is not None:
            out["dtype"] = str(dtype).removeprefix("torch.")
        return out

    def encode_caption(self, caption: str) -> TextKV:
        """One caption's per-layer text keys/values, computed by the understanding tower as it is
        (device and dtype of the module)."""
        text = self._text_segment(caption, self._run_hw())
        dev = self.device
        return encode_text(
            self.module, to_device(text["input_ids"], dev), to_device(text["text_mrope_ids"], dev)
        )

    def _run_cached(self, texts: list[str], hw, latent_shape, action_cond, x_v, x_a, t):
        """``_run``'s velocities with the text keys/values read from ``text_kv`` and only the
        generation tower run (kv_step.gen_step, one timestep per request)."""
        dev, dt = x_v.device, self.dtype
        if self._text_kv_dtype_checked != dt:
            dtype = {"dtype": str(dt).removeprefix("torch.")}  # the compute dtype, inside mixed precision
            self.text_kv.check({**self._text_fingerprint, **dtype})
            self._text_kv_dtype_checked = dt
        segs = self._requests(texts, hw, latent_shape, (0,), action_cond)
        kvs = []
        for c in texts:
            kv = self.text_kv.get(c, dev)
            kvs.append(TextKV(kv.keys.to(dt), kv.values.to(dt)))
        gen_pos = [torch.cat([s.vision["vision_mrope_ids"], s.action["action_mrope_ids"]], 1) for s in segs]
        _, t_lat, h, w = latent_shape
        p = self.module.config.latent_patch_size
        ctx = build_context(self.module, kvs, gen_pos, t_lat, -(-h // p) * -(-w // p), (0,), action_cond,
                            self.domain_id)  # fmt: skip
        return gen_step(self.module, ctx, x_v, x_a, t, layer_fn=self._cached_layer)

    def _cached_layer(self, layer, gen, text_k, text_v, ctx):
        if self.options.gradient_checkpointing and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(layer, gen, text_k, text_v, ctx, use_reentrant=False)
        return layer(gen, text_k, text_v, ctx)

    def _train_texts(self, batch: dict[str, Any], hw: tuple[int, int]) -> list[str]:
        """Captions with cosmos' idle-frame field and caption dropout (``""``)."""
        idle = batch.get(IDLE_FRAMES)
        if idle is None and not self._warned_idle:
            log.warning("cosmos3: the batch has no %r; captions leave idle_frame out", IDLE_FRAMES)
            self._warned_idle = True
        drop = torch.rand(len(batch[TASK])) < float(self.options.caption_dropout)
        texts = []
        for i, task in enumerate(batch[TASK]):
            k = None if idle is None else int(idle[i])
            texts.append("" if drop[i] else self.prompt(task, hw, k))
        return texts

    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        b = self.io.check_batch(batch, training=True)
        dev = self.device
        views = self._views(batch)
        if LATENTS in batch:  # from the latent cache: the VAE is skipped
            x0_v = torch.as_tensor(batch[LATENTS]).to(dev, torch.float32)
        else:
            x0_v = self._encode(self._clips(batch, views))
        # host fields cross from pinned memory without waiting for the GPU (a no-op when already there)
        x0_a = to_device(torch.as_tensor(batch[ACTION], dtype=torch.float32), dev)
        held = self._state_tokens(batch, dev)  # clean tokens in front of the chunk (state_token)
        n_held = held.shape[1]
        pad = batch.get(ACTION_IS_PAD)
        keep = (
            torch.ones(x0_a.shape[:2], device=dev)
            if pad is None
            else (~to_device(torch.as_tensor(pad), dev)).float()
        )

        sigma = train_sigmas(b, float(self.options.train_shift), dev)
        eps_v, eps_a = torch.randn_like(x0_v), torch.randn_like(x0_a)
        s_v = sigma.view(b, 1, 1, 1, 1)
        x_v = (1 - s_v) * x0_v + s_v * eps_v
        x_v[:, :, 0] = x0_v[:, :, 0]  # the current frame is the clean condition
        x_a = (1 - sigma.view(b, 1, 1)) * x0_a + sigma.view(b, 1, 1) * eps_a
        x_a = torch.cat([held, x_a], dim=1)

        hw = self._canvas_hw(views[0])
        cond_a = tuple(range(n_held))
        texts = self._train_texts(batch, hw)
        t = sigma * NUM_TRAIN_TIMESTEPS
        if self.text_kv is not None:
            v_v, v_a = self._run_cached(texts, hw, tuple(x0_v.shape[1:]), cond_a, x_v, x_a, t)
        else:
            layout = self._layout(texts, hw, tuple(x0_v.shape[1:]), (0,), cond_a)
            t_v = _per_token(t, layout.num_noisy_vision_tokens)
            t_a = _per_token(t, layout.num_noisy_action_tokens)
            v_v, v_a = self._run(layout, x_v, t_v, x_a, t_a)
        v_a = v_a[:, n_held:]

        loss_v = (v_v[:, :, 1:] - (eps_v - x0_v)[:, :, 1:]).square().mean()
        err_a = (v_a - (eps_a - x0_a)).square().mean(-1)
        loss_a = (err_a * keep).sum() / keep.sum().clamp(min=1.0)
        w_a, w_v = float(self.options.action_loss_weight), float(self.options.vision_loss_weight)
        return {
            "loss": w_a * loss_a + w_v * loss_v,
            "flow_matching_loss_action": loss_a.detach(),
            "flow_matching_loss_vision": loss_v.detach(),
        }

    # -- protocol: accounting ---------------------------------------------------------------------
    def _nominal_request(self) -> tuple[list[str], tuple[int, int], tuple[int, ...]]:
        """One request of ``io``'s size with a typical benchmark task: its caption, canvas and latent shape."""
        frame = np.zeros((self.io.image_size, self.io.image_size * len(self.io.cameras), 3), np.uint8)
        canvas = self._canvas(frame)
        hw = canvas.size
        h, w = canvas.latent_hw(int(self.vae.config.scale_factor_spatial))
        shape = (self.module.config.latent_channel, self._latent_frames(), h, w)
        task = "put both the alphabet soup and the tomato sauce in the basket"
        return [self.prompt(task, hw, 0)], hw, shape

    def nominal_layout(self) -> PackedLayout:
        """The layout of one request of ``io``'s size with a typical benchmark task (for FLOP counts)."""
        if self._nominal is None:
            texts, hw, shape = self._nominal_request()
            self._nominal = self._layout(texts, hw, shape, (0,), ())
        return self._nominal

    def flops_per_sample(self) -> float:
        """Training FLOPs of one nominal sample (see :func:`towers.train_flops`)."""
        lay = self.nominal_layout()
        return train_flops(self.module, lay.und_len, lay.sequence_length - lay.und_len)


def _per_token(values: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``values[i]`` repeated ``counts[i]`` times, without waiting for the GPU (the counts cross from
    pinned memory and the output size is given, where ``torch.tensor(counts, device=...)`` and an
    unsized ``repeat_interleave`` each wait)."""
    repeats = to_device(torch.tensor(counts), values.device)
    return values.repeat_interleave(repeats, output_size=sum(counts))


def resolve_dtype(option: str, device: torch.device) -> torch.dtype:
    """``auto``: bf16 for a model built on a GPU (serving, benchmarks), fp32 on the CPU (where the
    trainer builds it: FSDP2's mixed precision then computes in bf16 and keeps fp32 master weights)."""
    if option == "bfloat16":
        return torch.bfloat16
    if option not in ("auto", "float32"):
        raise ConfigError(f"model.options.dtype: {option!r}; expected auto, float32 or bfloat16")
    return torch.bfloat16 if option == "auto" and torch.device(device).type == "cuda" else torch.float32
