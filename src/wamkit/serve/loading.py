"""Build a :class:`ServedPolicy` from a serving directory or from a registered model with random weights.

A serving directory (written by ``wamkit convert``) holds ``model.safetensors`` + ``model.json`` (from
``save_pretrained``) and ``preprocess.json``: the :class:`~wamkit.actions.spec.PreprocessSpec` training
ran (stats, normalisation, clipping, gripper convention, resize, cameras). It is used as written;
nothing here fills in a default. A directory without it predates the spec and is refused.

With random init there is no data, so the server uses :meth:`PreprocessSpec.identity`: stats under
which quantile normalisation is the identity. State goes to the model unchanged and actions come back in
the model's own scale (for a rot6d representation the rot6d -> axis-angle conversion still runs), which is
what a throughput benchmark needs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from wamkit.actions.spec import PreprocessSpec, SpecError
from wamkit.config import ConfigError, ModelConfig
from wamkit.device import resolve_device as _resolve
from wamkit.files import MODEL_FILE, SPEC_FILE, STATS_FILE, WEIGHTS_FILE
from wamkit.models import ModelIO, build_model
from wamkit.serve.policy import ServedPolicy

log = logging.getLogger(__name__)
SERVING_FILES = (WEIGHTS_FILE, MODEL_FILE, SPEC_FILE)


def resolve_device(device: str) -> str:
    """``serve.device`` as a torch device string (see :mod:`wamkit.device`)."""
    return str(_resolve(device, "serve.device"))


def identity_spec(io: ModelIO) -> PreprocessSpec:
    """The spec of a model served without a dataset (see the module docstring)."""
    return PreprocessSpec.identity(
        representation=io.representation,
        cameras=io.cameras,
        image_size=io.image_size,
        state_dim=io.state_dim,
        action_dim=io.action_dim,
        chunk=io.chunk,
    )


def load_served(
    export_dir: str | Path, device: str = "auto", raw_actions: bool = False, precision: str = "auto"
) -> ServedPolicy:
    """Load a serving directory onto ``device``; a missing file is an error naming it. ``precision``:
    ``serve.precision`` (:class:`ServedPolicy`)."""
    root = Path(export_dir)
    if not root.is_dir():
        raise ConfigError(f"serving directory {root} does not exist")
    missing = [f for f in SERVING_FILES if not (root / f).is_file()]
    if missing == [SPEC_FILE] and (root / STATS_FILE).is_file():
        raise ConfigError(
            f"serving directory {root} has {STATS_FILE} but no {SPEC_FILE}: it was exported before the "
            "preprocessing spec existed. Re-export it from its training checkpoint with "
            f"`wamkit convert <run_dir>/checkpoints/step_N {root}.new` (an old checkpoint's spec is rebuilt "
            "from the config.yaml and stats.json its run saved)"
        )
    if missing:
        raise ConfigError(
            f"serving directory {root} lacks {', '.join(missing)} (expected {', '.join(SERVING_FILES)}; "
            "make one with `wamkit convert`)"
        )
    from wamkit.models.pretrained import load_pretrained

    dev = resolve_device(device)
    adapter = load_pretrained(root, device=dev)
    try:
        spec = PreprocessSpec.load(root / SPEC_FILE)
        policy = ServedPolicy(adapter, spec, raw_actions=raw_actions, source=str(root), precision=precision)
    except SpecError as err:
        raise ConfigError(str(err)) from None
    log.info("loaded %s from %s on %s", adapter.name, root, dev)
    return policy


def random_init(
    name: str,
    preset: str,
    options: dict[str, Any] | None = None,
    device: str = "auto",
    raw_actions: bool = False,
    precision: str = "auto",
    io: ModelIO | None = None,
) -> ServedPolicy:
    """An untrained model of ``io`` (default: the preset's inputs), with identity stats (for benchmarks
    and smoke runs). The weights are drawn from a fixed seed, so servers started alike serve the same
    model (the same weights hash: one evaluation may spread its stages over them)."""
    dev = resolve_device(device)
    torch.manual_seed(0)
    adapter = build_model(ModelConfig(name=name, preset=preset, options=dict(options or {})), io, device=dev)
    adapter.module.to(dev)
    adapter.module.eval()
    return ServedPolicy(
        adapter,
        identity_spec(adapter.io),
        raw_actions=raw_actions,
        source=f"random-init {name}/{preset}",
        precision=precision,
    )
