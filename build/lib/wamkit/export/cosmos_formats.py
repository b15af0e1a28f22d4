"""Cosmos3 weights in the three layouts that exist upstream, converted both ways, each write verified.

Layouts (names of the tensors; ``<k>`` is a cosmos network key, e.g.
``language_model.model.layers.0.self_attn.q_proj_moe_gen.weight``):

- ``cosmos-pt``: a torch ``full_weights.pt`` as RLinf's Cosmos3 SFT saves it: ``omni.net.<k>`` (the
  trained weights) and ``omni.net_ema.<k>`` (their EMA). ``net.<k>`` / ``net_ema.<k>`` are read too.
- ``cosmos-dcp``: a torch DCP directory as cosmos-framework's ``convert_model_to_dcp`` writes it: the
  checkpoint in ``<dir>/model/`` with flat keys ``net.<k>`` (and ``net_ema.<k>``).
- ``diffusers``: a ``Cosmos3OmniTransformer`` folder (``transformer/`` of a pipeline folder, or a bare
  one): ``config.json`` + ``*.safetensors`` under diffusers' names.

The key mapping between cosmos and diffusers names is written once (:data:`ATTENTION_RENAMES`,
:data:`TOP_RENAMES`), as diffusers' Cosmos3 conversion script and cosmos-framework's
``convert_model_to_diffusers`` apply it; the vision encoder (``model.visual.*``) has no diffusers
counterpart and is left out. cosmos nets carry action heads ``max_action_dim`` = 64 wide: writing a
cosmos layout pads narrower heads with zeros (exact, see :func:`pad_heads`), reading keeps the width.

Every output is written beside its target (``<out>.tmp``), read back and compared bit for bit with
what was meant to be written, then renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from wamkit.files import atomic_write_with, commit_dir, fresh_tmp_dir

# cosmos attention names -> diffusers names, inside a decoder layer (the *_moe_gen ones first: the
# plain names are substrings of them).
ATTENTION_RENAMES = (
    (".q_proj_moe_gen.", ".add_q_proj."),
    (".k_proj_moe_gen.", ".add_k_proj."),
    (".v_proj_moe_gen.", ".add_v_proj."),
    (".o_proj_moe_gen.", ".to_add_out."),
    (".q_norm_moe_gen.", ".norm_added_q."),
    (".k_norm_moe_gen.", ".norm_added_k."),
    (".q_proj.", ".to_q."),
    (".k_proj.", ".to_k."),
    (".v_proj.", ".to_v."),
    (".o_proj.", ".to_out."),
    (".q_norm.", ".norm_q."),
    (".k_norm.", ".norm_k."),
)
# cosmos network prefixes -> diffusers prefixes (the language model's inner ``model.`` is dropped).
TOP_RENAMES = (
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("vae2llm.", "proj_in."),
    ("llm2vae.", "proj_out."),
    ("time_embedder.mlp.0.", "time_embedder.linear_1."),
    ("time_embedder.mlp.2.", "time_embedder.linear_2."),
    ("action2llm.", "action_proj_in."),
    ("llm2action.", "action_proj_out."),
    ("action_modality_embed", "action_modality_embed"),
    ("sound2llm.", "audio_proj_in."),
    ("llm2sound.", "audio_proj_out."),
    ("sound_modality_embed", "audio_modality_embed"),
)
VISION_ENCODER = ("language_model.model.visual.", "language_model.visual.")
FORMATS = ("cosmos-pt", "cosmos-dcp", "diffusers")
DCP_SUBDIR = "model"


class FormatError(ValueError):
    """A checkpoint is not in the layout it claims, or a conversion failed verification."""


def _rename(key: str, pairs) -> str:
    for old, new in pairs:
        if old in key:
            return key.replace(old, new, 1)
    return key


def cosmos_to_diffusers_key(key: str) -> str:
    """A cosmos network key (no ``net.`` prefix) as diffusers names it; FormatError if unknown."""
    for old, new in TOP_RENAMES:
        if key.startswith(old):
            out = new + key[len(old) :]
            return _rename(out, ATTENTION_RENAMES) if old == "language_model.model." else out
    raise FormatError(f"cosmos key '{key}' has no diffusers Cosmos3OmniTransformer counterpart")


def diffusers_to_cosmos_key(key: str) -> str:
    """The inverse of :func:`cosmos_to_diffusers_key`."""
    for old, new in TOP_RENAMES[1:]:
        if key.startswith(new):
            return old + key[len(new) :]
    if key.startswith(("layers.", "embed_tokens.", "norm.", "norm_moe_gen.")):
        inverse = tuple((new, old) for old, new in ATTENTION_RENAMES)
        return "language_model.model." + _rename(key, inverse)
    raise FormatError(f"diffusers key '{key}' has no cosmos counterpart")


def from_cosmos(net: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A cosmos network state dict (no prefix) -> diffusers names (the vision encoder left out)."""
    return {cosmos_to_diffusers_key(k): v for k, v in net.items() if not k.startswith(VISION_ENCODER)}


def to_cosmos(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {diffusers_to_cosmos_key(k): v for k, v in sd.items()}


def pad_heads(sd: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Action heads zero-padded to ``width`` channels (cosmos' ``max_action_dim``); the inverse of
    :func:`wamkit.models.cosmos3.components.slice_heads`. Exact: padded inputs are zero and padded
    outputs are discarded."""
    bias = sd.get("action_proj_out.bias.weight")
    if bias is None or bias.shape[1] == width:
        return sd
    domains, narrow = bias.shape
    hidden = sd["action_proj_in.bias.weight"].shape[1]
    if narrow > width:
        raise FormatError(f"action heads are {narrow} wide, more than --action-width {width}")
    out = dict(sd)
    w_in = sd["action_proj_in.fc.weight"].view(domains, narrow, hidden)
    out["action_proj_in.fc.weight"] = torch.cat(
        [w_in, w_in.new_zeros(domains, width - narrow, hidden)], 1
    ).reshape(domains, -1)
    w_out = sd["action_proj_out.fc.weight"].view(domains, hidden, narrow)
    out["action_proj_out.fc.weight"] = torch.cat(
        [w_out, w_out.new_zeros(domains, hidden, width - narrow)], 2
    ).reshape(domains, -1)
    out["action_proj_out.bias.weight"] = torch.cat([bias, bias.new_zeros(domains, width - narrow)], 1)
    return out


def _pick(sd: dict[str, torch.Tensor], ema: bool, source: str) -> dict[str, torch.Tensor]:
    """The ``net`` (or ``net_ema``) weights of a cosmos model state dict, prefix removed."""
    for outer in ("omni.", ""):
        prefix = f"{outer}net_ema." if ema else f"{outer}net."
        net = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        if net:
            return net
    have = sorted({k.split(".")[0] + "." + k.split(".")[1] for k in sd if "." in k})[:5]
    want = "net_ema" if ema else "net"
    raise FormatError(f"{source}: no '{want}.*' (or 'omni.{want}.*') weights (prefixes found: {have})")


def detect_format(path: str | os.PathLike) -> str:
    """``cosmos-pt`` (a file), ``cosmos-dcp`` (a DCP directory) or ``diffusers`` (a transformer folder)."""
    p = Path(path)
    if p.is_file():
        return "cosmos-pt"
    if (p / ".metadata").is_file() or (p / DCP_SUBDIR / ".metadata").is_file():
        return "cosmos-dcp"
    if (p / "transformer" / "config.json").is_file() or (p / "config.json").is_file():
        return "diffusers"
    raise FormatError(f"{p}: neither a full_weights.pt, a DCP directory nor a diffusers folder")


# -- reading ---------------------------------------------------------------------------------------
def read_cosmos_pt(path: str | os.PathLike, ema: bool = False) -> dict[str, torch.Tensor]:
    """diffusers-named weights from a ``full_weights.pt`` (tensors only; no pickle is executed)."""
    try:
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises UnpicklingError or RuntimeError for foreign objects
        raise FormatError(f"{path}: not a plain tensor state dict ({type(err).__name__}: {err})") from None
    if not isinstance(sd, dict):
        raise FormatError(f"{path}: expected a dict of tensors, got {type(sd).__name__}")
    return from_cosmos(_pick(sd, ema, str(path)))


def _dcp_dir(path: Path) -> Path:
    return path / DCP_SUBDIR if (path / DCP_SUBDIR / ".metadata").is_file() else path


def _dcp_load(ckpt: Path, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    state = {}
    for k, m in meta.items():
        if (keys is None or k in keys) and hasattr(m, "size"):
            state[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state


def read_cosmos_dcp(path: str | os.PathLike, ema: bool = False) -> dict[str, torch.Tensor]:
    """diffusers-named weights from a cosmos DCP directory (``<dir>/model`` or the DCP itself)."""
    ckpt = _dcp_dir(Path(path))
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    prefix = "net_ema." if ema else "net."
    keys = [k for k in meta if k.startswith(prefix)]
    if not keys:
        raise FormatError(f"{ckpt}: no '{prefix}*' tensors in the DCP checkpoint")
    return from_cosmos({k[len(prefix) :]: v for k, v in _dcp_load(ckpt, keys).items()})


def transformer_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / "transformer" if (p / "transformer" / "config.json").is_file() else p


def read_diffusers(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    tdir = transformer_dir(path)
    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{tdir}: no *.safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def read_any(path: str | os.PathLike, ema: bool = False) -> dict[str, torch.Tensor]:
    """diffusers-named weights from any of the three layouts (``ema`` for the cosmos ones)."""
    fmt = detect_format(path)
    if fmt == "diffusers":
        if ema:
            raise FormatError(f"{path}: a diffusers folder holds one set of weights; --ema does not apply")
        return read_diffusers(path)
    return read_cosmos_pt(path, ema) if fmt == "cosmos-pt" else read_cosmos_dcp(path, ema)


# -- writing (each verified by reading back) -------------------------------------------------------
def verify_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: Path) -> None:
    if set(expected) != set(got):
        raise FormatError(f"{where}: reloaded names differ: {sorted(set(expected) ^ set(got))[:5]}")
    for k, v in expected.items():
        w = got[k]
        if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v, w):
            raise FormatError(f"{where}: tensor '{k}' differs after reload")


def write_cosmos_pt(sd: dict[str, torch.Tensor], out: str | os.PathLike, width: int = 64) -> Path:
    """``full_weights.pt`` with ``omni.net.<k>`` keys (heads padded to ``width``); verified."""
    out = Path(out)
    padded = pad_heads(sd, width)
    obj = {f"omni.net.{k}": v.contiguous() for k, v in to_cosmos(padded).items()}

    def write(tmp: Path) -> None:
        torch.save(obj, str(tmp))
        verify_same(padded, read_cosmos_pt(tmp), tmp)

    return atomic_write_with(out, write)


def _fresh_dir(out: Path) -> Path:
    return fresh_tmp_dir(out)


def _commit_dir(tmp: Path, out: Path, overwrite: bool) -> Path:
    try:
        return commit_dir(tmp, out, overwrite)
    except FileExistsError as err:
        shutil.rmtree(tmp)
        raise FormatError(str(err)) from None


def write_cosmos_dcp(
    sd: dict[str, torch.Tensor], out: str | os.PathLike, width: int = 64, overwrite: bool = False
) -> Path:
    """A DCP directory ``<out>/model`` with ``net.<k>`` keys (heads padded to ``width``); verified."""
    out = Path(out)
    padded = pad_heads(sd, width)
    tmp = _fresh_dir(out)
    state = {f"net.{k}": v.contiguous() for k, v in to_cosmos(padded).items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp / DCP_SUBDIR), no_dist=True)
    verify_same(padded, read_cosmos_dcp(tmp), tmp)
    return _commit_dir(tmp, out, overwrite)


def _transformer_config(sd: dict[str, torch.Tensor], config_dir: Path) -> dict:
    """The transformer config of ``config_dir`` with the action-head fields of ``sd``."""
    cfg_file = transformer_dir(config_dir) / "config.json"
    if not cfg_file.is_file():
        raise FormatError(f"{config_dir}: no transformer config.json to describe the architecture (--base)")
    cfg = {k: v for k, v in json.loads(cfg_file.read_text()).items() if not k.startswith("_")}
    bias = sd.get("action_proj_out.bias.weight")
    cfg.update(action_gen=bias is not None, action_dim=None if bias is None else int(bias.shape[1]))
    if bias is not None:
        cfg["num_embodiment_domains"] = int(bias.shape[0])
    return cfg


def write_diffusers(
    sd: dict[str, torch.Tensor], out: str | os.PathLike, base: str | os.PathLike, overwrite: bool = False
) -> Path:
    """A diffusers folder: ``transformer/`` (``base``'s architecture, ``sd``'s weights) plus, when
    ``base`` is a pipeline folder, its other components copied; verified by reading the weights back."""
    from diffusers import Cosmos3OmniTransformer

    out, base = Path(out), Path(base)
    cfg = _transformer_config(sd, base)
    tmp = _fresh_dir(out)
    with torch.device("meta"):
        tr = Cosmos3OmniTransformer.from_config(cfg)
    result = tr.load_state_dict(sd, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise FormatError(
            f"weights do not fit {base}'s architecture: missing {result.missing_keys[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    tr.save_pretrained(str(tmp / "transformer"), safe_serialization=True, max_shard_size="5GB")
    if (base / "transformer").is_dir():
        for item in base.iterdir():
            if item.name not in ("transformer", "wamkit.json") and not item.name.startswith("."):
                copy = shutil.copytree if item.is_dir() else shutil.copyfile
                copy(item, tmp / item.name)
    verify_same(sd, read_diffusers(tmp), tmp)
    return _commit_dir(tmp, out, overwrite)
