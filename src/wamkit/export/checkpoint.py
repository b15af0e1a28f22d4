"""Checkpoint conversions, each verified before it is reported done.

- :func:`checkpoint_to_serving`: a DCP training checkpoint (sharded, any world size) -> a *serving
  directory* = ``save_pretrained`` output (``model.safetensors`` + ``model.json``) + ``preprocess.json``
  (the preprocessing spec training ran, stats inside).
  The DCP is read by one process with no process group (DCP reshards on load), so a checkpoint of N
  GPUs converts on a laptop. ``ema=True`` takes the EMA of the trained weights instead of the weights.
  A LoRA checkpoint (``train.lora``) has its adapters merged into the base's layers (peft's
  ``merge_and_unload``, :mod:`wamkit.train.lora`): the serving directory holds a plain model. Over an
  int8 base (``train.lora.base``) the merge is into the int8 weights dequantized, in the base's dtype.
- :func:`serving_to_dcp`: a serving directory -> a model-only DCP directory (the warm-start direction,
  for models too large to load whole on every rank).
- :func:`serving_to_extra`: a serving directory -> the adapter's own format through its optional
  ``export_extra(out_dir)`` hook (cosmos3: a diffusers directory).

Every output is written to ``<out>.tmp``, verified (reloaded and compared bit for bit), then renamed to
``<out>``; each step reads only the previous step's output, so a failed step re-runs alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from wamkit.actions.spec import PreprocessSpec, SpecError
from wamkit.actions.stats import StatsError, StatsFile
from wamkit.config import ConfigError, ModelConfig
from wamkit.files import (
    CONFIG_FILE,
    MODEL_FILE,
    SPEC_FILE,
    STATS_FILE,
    atomic_write_json,
    commit_dir,
    fresh_tmp_dir,
)
from wamkit.models.base import ExportsFormat, HasPretrainedBase, ModelAdapter, ModelIO

log = logging.getLogger(__name__)


class ConversionError(RuntimeError):
    """A conversion's input is not what it should be, or its output failed verification."""


@contextmanager
def _single_process():
    """DCP warns that it assumes one process when no group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _build_from_model_json(path: Path, base: dict[str, Any] | None = None) -> ModelAdapter:
    """The model of a checkpoint's ``model.json``; with a ``base`` (a checkpoint without its frozen
    weights), built from that base and checked against its hash."""
    from wamkit.models.pretrained import read_model_json
    from wamkit.models.registry import build_model
    from wamkit.train import base_weights

    meta = read_model_json(path)
    pretrained = base["path"] if base is not None and base["kind"] == "diffusers" else ""
    cfg = ModelConfig(
        name=meta["name"], preset=meta["preset"], pretrained=pretrained, options=meta["options"]
    )
    try:
        adapter = build_model(cfg, ModelIO.from_dict(meta["io"]))
        if base is not None:
            whole = bool(base.get("whole"))  # a LoRA run's base: the adapted layers' weights hashed too
            here = adapter.base_reference(whole=whole) if isinstance(adapter, HasPretrainedBase) else None
            base_weights.check_same(base, base_weights.resolve(here), f"{path}")
    except ConfigError as err:
        raise ConversionError(str(err)) from None
    return adapter


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()


def load_checkpoint_weights(ckpt_dir: str | os.PathLike, ema: bool = False) -> ModelAdapter:
    """Rebuild the checkpoint's model on the CPU and load its full weights (or their EMA) from DCP."""
    from wamkit.train.checkpoint import MARKER

    ckpt = Path(ckpt_dir)
    if not is_dcp_checkpoint(ckpt):
        raise ConversionError(f"{ckpt}: not a DCP checkpoint (no .metadata)")
    if not (ckpt / MARKER).is_file():
        raise ConversionError(f"{ckpt}: incomplete checkpoint (no {MARKER}): an interrupted save")
    from wamkit.train.checkpoint import read_meta
    from wamkit.train.lora import LoraSpec, inject, round_base

    meta = read_meta(ckpt)
    base = meta.get("base")
    adapter = _build_from_model_json(ckpt, base)
    # LoRA's layers as the run had them (their weights come from the checkpoint), merged below
    lora = inject(adapter, LoraSpec.from_meta(meta["lora"])) if meta.get("lora") else None
    groups = lora.groups if lora is not None else adapter.param_groups()
    keys = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata}
    whole = adapter.module.state_dict()
    # a checkpoint with a base holds the trained weights only: the frozen ones are the base's, as built
    state = {"model": {n: t for n, t in whole.items() if base is None or f"model.{n}" in keys}}
    if base is not None:
        trained = {id(p) for g in groups for p in g.params}
        names = {id(p): n for n, p in adapter.module.named_parameters()}
        lost = sorted(names[i] for i in trained if f"model.{names[i]}" not in keys)
        if lost:
            raise ConversionError(f"{ckpt}: trained weights missing from the checkpoint: {lost[:5]}")
    if ema:
        if not any(k.startswith("ema.") for k in keys):
            raise ConversionError(f"{ckpt}: --ema asked for, but the run trained without train.ema")
        trained = [n for n, p in adapter.module.named_parameters() if f"ema.{n}" in keys]
        state["ema"] = {n: torch.empty_like(state["model"][n], dtype=torch.float32) for n in trained}
    with _single_process():
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    if ema:  # frozen weights stay as trained (they never change); trained ones take their EMA
        for n, v in state["ema"].items():
            state["model"][n] = v.to(state["model"][n].dtype)
    adapter.module.load_state_dict({**whole, **state["model"]}, strict=True)
    if lora is not None:
        round_base(adapter.module, lora.spec)  # an int8 base as the run saw it: what the adapters fit
        lora.merge()
    return adapter


def _verify_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: Path) -> None:
    if set(expected) != set(got):
        diff = sorted(set(expected) ^ set(got))[:5]
        raise ConversionError(f"{where}: reloaded weights have other names than written ({diff} ...)")
    for k, v in expected.items():
        w = got[k]
        if v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v.cpu(), w.cpu()):
            raise ConversionError(f"{where}: tensor '{k}' differs after reload")


def _commit(tmp: Path, out: Path, overwrite: bool) -> Path:
    try:
        return commit_dir(tmp, out, overwrite)
    except FileExistsError as err:
        raise ConversionError(str(err)) from None


def _fresh_tmp(out: Path) -> Path:
    return fresh_tmp_dir(out)


def checkpoint_spec(ckpt: Path, io: ModelIO) -> PreprocessSpec:
    """The checkpoint's ``preprocess.json``; for a checkpoint from before the spec existed, the spec is
    rebuilt from the ``config.yaml`` and ``stats.json`` that run saved beside it (what training used)."""
    if (ckpt / SPEC_FILE).is_file():
        return PreprocessSpec.load(ckpt / SPEC_FILE)
    if not ((ckpt / CONFIG_FILE).is_file() and (ckpt / STATS_FILE).is_file()):
        raise ConversionError(
            f"{ckpt}: no {SPEC_FILE} (nor the {CONFIG_FILE} + {STATS_FILE} to rebuild it from)"
        )
    from wamkit.config import load_config
    from wamkit.train.data_setup import build_spec

    log.warning(
        "%s predates %s: rebuilding it from the run's %s and %s", ckpt, SPEC_FILE, CONFIG_FILE, STATS_FILE
    )
    stats = StatsFile.load(ckpt / STATS_FILE)
    if "gripper" not in stats.metadata:  # every stats file before gripper conventions held env commands
        stats.metadata["gripper"] = "env"
    return build_spec(load_config(ckpt / CONFIG_FILE), io, stats)


def checkpoint_to_serving(
    ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, ema: bool = False, overwrite: bool = False
) -> Path:
    """DCP checkpoint -> serving directory; verified (weights reload bit-identical, the spec reads back
    equal and fits the model)."""
    from wamkit.models.pretrained import load_pretrained, save_pretrained

    ckpt, out = Path(ckpt_dir), Path(out_dir)
    adapter = load_checkpoint_weights(ckpt, ema=ema)
    try:
        spec = checkpoint_spec(ckpt, adapter.io)
        spec.check_model(adapter.io, where=f"{ckpt / SPEC_FILE}")
    except (SpecError, StatsError, ConfigError) as err:
        raise ConversionError(str(err)) from None
    tmp = _fresh_tmp(out)
    save_pretrained(adapter, tmp)
    spec.save(tmp / SPEC_FILE)
    written = {k: v.detach().clone() for k, v in adapter.module.state_dict().items()}
    _verify_same(written, load_pretrained(tmp).module.state_dict(), tmp)
    _verify_spec(spec, tmp)
    from wamkit.train.checkpoint import read_meta

    source = {"checkpoint": str(ckpt.resolve()), "ema": ema}
    lora = read_meta(ckpt).get("lora")
    if lora is not None:  # the weights hold the run's adapters, merged
        source["lora_merged"] = {k: lora[k] for k in ("rank", "alpha")}
    atomic_write_json(tmp / "source.json", source)
    return _commit(tmp, out, overwrite)


def _verify_spec(spec: PreprocessSpec, where: Path) -> None:
    back = PreprocessSpec.load(where / SPEC_FILE)
    if back.to_json() != spec.to_json():
        raise ConversionError(f"{where / SPEC_FILE}: the preprocessing spec differs after reload")


def serving_to_dcp(serve_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Serving directory -> model-only DCP (``{"model": ...}``) with model.json and preprocess.json;
    verified."""
    from wamkit.models.pretrained import load_pretrained

    src, out = Path(serve_dir), Path(out_dir)
    state = {k: v.detach().clone() for k, v in load_pretrained(src).module.state_dict().items()}
    tmp = _fresh_tmp(out)
    with _single_process():
        dcp.save({"model": state}, checkpoint_id=str(tmp), no_dist=True)
    shutil.copyfile(src / MODEL_FILE, tmp / MODEL_FILE)
    spec = PreprocessSpec.load(src / SPEC_FILE)
    spec.save(tmp / SPEC_FILE)
    _verify_spec(spec, tmp)
    back = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
    with _single_process():
        dcp.load(back, checkpoint_id=str(tmp), no_dist=True)
    _verify_same(state, back["model"], tmp)
    return _commit(tmp, out, overwrite)


def serving_to_extra(
    serve_dir: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False
) -> Path:
    """Serving directory -> the adapter's own export format via ``adapter.export_extra(out_dir)``.

    The adapter writes and verifies its format (e.g. cosmos3 reloads its diffusers directory).
    """
    from wamkit.models.pretrained import load_pretrained

    adapter = load_pretrained(serve_dir)
    if not isinstance(adapter, ExportsFormat):
        raise ConversionError(
            f"model '{adapter.name}' has no export_extra(out_dir): no other format to write"
        )
    out = Path(out_dir)
    spec = PreprocessSpec.load(Path(serve_dir) / SPEC_FILE)
    tmp = _fresh_tmp(out)
    adapter.export_extra(tmp, spec=spec)
    spec.save(tmp / SPEC_FILE)  # the export carries the transforms its model needs, like every artifact
    _verify_spec(spec, tmp)
    return _commit(tmp, out, overwrite)
