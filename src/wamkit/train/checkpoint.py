"""Atomic DCP checkpoints with exact-resume state.

A checkpoint is a directory ``run_dir/checkpoints/step_000100/`` holding:

- the DCP shards (``.metadata``, ``__*.distcp``) of ``{"model", "optim", "ema"}``, sharded as trained
  (resharding on load is DCP's job, so a checkpoint loads under another world size);
- ``rank_00000.pt`` ...: per-rank state that cannot be sharded: RNG states (python, numpy, torch, CUDA)
  and the data-loader position;
- ``model.json`` (the adapter's ``config_dict()``), ``preprocess.json`` (the preprocessing spec, stats
  inside) and ``config.yaml``: what export needs;
- ``meta.json``: step, world size and the base the frozen weights come from (the model state holds
  only the trained parameters when the adapter names its base: :mod:`wamkit.train.base_weights`),
  written last. It is the marker of completeness.

Writes go to ``.tmp_step_000100/``; every file is fsynced, then the directory is renamed into place. A
crash at any point leaves either no checkpoint or a whole one; a leftover ``.tmp_*`` is never resumed.
The shards may be written in the background (``train.async_save``): the trainer goes on with its next
micro-batches and finishes the save (waits for the shards, writes the marker, renames) before its next
optimizer step, the first moment anything saved would change; a crash in between leaves a ``.tmp_*``.
Re-saving a step that exists (after a resume) first moves the old copy aside (``.old_step_000100/``),
renames the new one into place, and only then deletes the old one; :func:`clean_stale` puts an old copy
back if a crash left it without its replacement.

Lineage: a fresh run draws an id that every checkpoint it (and every run resumed from it) writes
records in ``meta.json``. Pruning to ``train.keep_last`` only ever removes checkpoints of the current
lineage, so a run never deletes checkpoints it did not write.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from wamkit.config import ConfigError
from wamkit.files import fsync_dir, fsync_tree

log = logging.getLogger(__name__)

MARKER = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file() and _STEP_DIR.match(Path(path).name) is not None


def list_checkpoints(ckpt_root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``ckpt_root``, oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve_resume(resume: str, ckpt_root: str | os.PathLike) -> Path | None:
    """``""`` -> None; ``"auto"`` -> the newest complete checkpoint or None; a path -> that checkpoint,
    or the newest complete one of a run folder (or of its ``checkpoints/``) given instead. A path that
    is none of these is a :class:`ConfigError` naming ``train.resume``."""
    if resume == "":
        return None
    if resume == "auto":
        found = list_checkpoints(ckpt_root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ConfigError(f"train.resume (--resume) {resume}: no such checkpoint or run directory")
    if is_complete(path):
        return path
    found = list_checkpoints(path / "checkpoints") or list_checkpoints(path)
    if found:  # a run folder: its newest complete checkpoint
        return found[-1]
    raise ConfigError(
        f"train.resume (--resume) {resume}: not a complete checkpoint (no {MARKER}; an interrupted save?) "
        "nor a run folder holding one"
    )


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / MARKER).read_text())


def rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class _InPlace:
    """DCP's async stager that stages nothing: the writer thread reads the live tensors. Safe because
    the trainer changes none of them (trained weights, optimizer state, EMA) before the save is
    finished (:meth:`PendingSave.finish`, called before the next optimizer step), and a state this
    large has no host room for a staged copy (Nano on one GPU: 78 GB of moments and EMA already there)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """A checkpoint whose DCP shards are being written by a background thread; :meth:`finish` (a
    collective) waits for them, writes the per-rank files, the files and the marker, and renames."""

    def __init__(self, root: Path, step: int, rank_state, files, keep_last, lineage, meta, future, t0):
        self.root, self.step, self.rank_state, self.files = root, step, rank_state, files
        self.keep_last, self.lineage, self.meta, self.future = keep_last, lineage, meta, future
        self.t0 = t0
        self.write_s = float("nan")  # seconds from the start of the save to its shards being written
        if future is not None:
            future.add_done_callback(lambda _: setattr(self, "write_s", time.perf_counter() - self.t0))

    @property
    def tmp(self) -> Path:
        return self.root / f".tmp_{step_dir_name(self.step)}"

    def wait(self) -> None:
        """Let the background write end (a run stopping on an error), without making a checkpoint."""
        if self.future is not None:
            try:
                self.future.result()
            except Exception as err:  # noqa: BLE001 -- the run is already failing with its own error
                log.warning("the checkpoint write of step %d failed too: %s", self.step, err)

    def finish(self) -> Path:
        if self.future is not None:
            self.future.result()  # a failed write raises here, before any marker exists
        rank, world = dist.get_rank(), dist.get_world_size()
        tmp, root = self.tmp, self.root
        final = root / step_dir_name(self.step)
        torch.save(self.rank_state, tmp / f"rank_{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            for name, text in self.files.items():
                (tmp / name).write_text(text)
            fsync_tree(tmp)
            marker = {"step": self.step, "world_size": world, "lineage": self.lineage, **(self.meta or {})}
            (tmp / MARKER).write_text(json.dumps(marker))
            fsync_tree(tmp)
            aside = root / f".old_{step_dir_name(self.step)}"
            if final.exists():  # this step from before a resume: kept until the new copy is in place
                os.replace(final, aside)
            os.replace(tmp, final)
            fsync_dir(root)
            if aside.exists():
                shutil.rmtree(aside)
            ours = [p for p in list_checkpoints(root) if read_meta(p).get("lineage") == self.lineage]
            for old in ours[: -self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old)
        dist.barrier()
        return final


def begin_save(
    ckpt_root: str | os.PathLike,
    step: int,
    sharded: dict[str, Any],
    rank_state: dict[str, Any],
    files: dict[str, str],
    keep_last: int,
    lineage: str = "",
    meta: dict[str, Any] | None = None,
    writer_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Collective: start writing a checkpoint. With ``writer_group`` (a gloo group of every rank, used
    by nothing else) the DCP shards are written by a background thread and the call returns at once;
    without, they are written before it returns. Either way the checkpoint exists only once
    :meth:`PendingSave.finish` has run on every rank."""
    root = Path(ckpt_root)
    t0 = time.perf_counter()
    tmp = root / f".tmp_{step_dir_name(step)}"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a save that was killed
            shutil.rmtree(tmp)
        tmp.mkdir()
    dist.barrier()
    future = None
    if writer_group is None:
        dcp.save(sharded, checkpoint_id=str(tmp))
    else:
        # per_thread_copy_ahead=0: the writer thread copies each tensor to the host with a blocking
        # .cpu() on the tensor's own device; DCP's copy-ahead loader would issue non-blocking copies and
        # wait on the thread's current device's stream, which is GPU 0 in a new thread, not this rank's
        writer = dcp.FileSystemWriter(str(tmp), per_thread_copy_ahead=0)
        future = dcp.async_save(
            sharded, storage_writer=writer, process_group=writer_group, async_stager=_InPlace()
        )
    pending = PendingSave(root, step, rank_state, files, keep_last, lineage, meta, future, t0)
    if future is None:
        pending.write_s = time.perf_counter() - t0
    return pending


def load_checkpoint(path: str | os.PathLike, sharded: dict[str, Any]) -> dict[str, Any]:
    """Collective: load ``sharded`` in place from DCP and return this rank's per-rank state.

    Per-rank state (RNG, loader position) exists only for the world size the checkpoint was written
    with; under another world size it is absent (``{}``) and the caller says so.
    """
    path = Path(path)
    dcp.load(sharded, checkpoint_id=str(path))
    meta = read_meta(path)
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if meta["world_size"] != dist.get_world_size() or not rank_file.is_file():
        return {}
    # our own file, written by PendingSave.finish: it holds numpy RNG state and the loader's state dict
    return torch.load(rank_file, weights_only=False)


def clean_stale(ckpt_root: str | os.PathLike) -> None:
    """Undo what killed saves left (rank 0, before training): an old copy moved aside goes back if its
    replacement never arrived, else away; ``.tmp_*`` directories are removed."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return
    for p in root.glob(".old_step_*"):
        final = root / p.name.removeprefix(".old_")
        if is_complete(final):
            shutil.rmtree(p)
        else:
            log.warning(
                "restoring %s: a save of that step was killed before its new copy was in place", final
            )
            os.replace(p, final)
    for p in root.glob(".tmp_*"):
        log.info("removing incomplete checkpoint %s", p)
        shutil.rmtree(p)


def refuse_used_run_dir(run_dir: str | os.PathLike, ckpt_root: str | os.PathLike) -> None:
    """A fresh run (no ``--resume``) must not start where a run already left checkpoints or losses."""
    from wamkit.config import ConfigError
    from wamkit.files import LOSSES_FILE

    found = [p.name for p in list_checkpoints(ckpt_root)]
    losses = Path(run_dir) / LOSSES_FILE
    if losses.is_file() and losses.stat().st_size > 0:
        found.append(LOSSES_FILE)
    if found:
        raise ConfigError(
            f"train.run_dir: {run_dir} already holds {', '.join(found)}; continue that run with "
            "--resume auto, or give a new train.run_dir (nothing was changed)"
        )


def new_lineage() -> str:
    """The id of a fresh run's checkpoints (see the module docstring)."""
    return uuid.uuid4().hex[:16]
