"""Build a :class:`ServedPolicy` from a serving directory or from a registered model with random weights.

A serving directory (written by ``wamkit convert``) holds ``model.safetensors`` + ``model.json`` (from
``save_pretrained``) and ``stats.json`` (a :class:`~wamkit.actions.StatsFile`). The stats metadata may
carry ``normalization`` (default ``quantile``) and ``clip`` (default false): the settings training used.

With random init there are no stats, so the server uses *identity stats*: every feature gets
q01 = -1, q99 = +1 (mean 0, std 1, min -1, max +1), which makes quantile normalisation the identity.
State goes to the model unchanged and actions come back in the model's own scale (for ``libero_rot6d``
the rot6d -> axis-angle conversion still runs), which is what a throughput benchmark needs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from wamkit.actions.codec import ActionCodec
from wamkit.actions.stats import FeatureStats, StatsFile
from wamkit.config import ConfigError, ModelConfig
from wamkit.constants import ACTION, OBS_STATE
from wamkit.models import ModelIO, build_model
from wamkit.serve.policy import ServedPolicy

log = logging.getLogger(__name__)
SERVING_FILES = ("model.safetensors", "model.json", "stats.json")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"serve.device: '{device}' asked for, but no CUDA device is visible")
    return device


def identity_stats(io: ModelIO) -> StatsFile:
    """Stats under which quantile normalisation is the identity, for a model served without a dataset."""

    def unit(dim: int) -> FeatureStats:
        return FeatureStats(
            mean=[0.0] * dim,
            std=[1.0] * dim,
            min=[-1.0] * dim,
            max=[1.0] * dim,
            q01=[-1.0] * dim,
            q99=[1.0] * dim,
            count=1,
        )

    meta = {
        "representation": io.representation,
        "chunk": io.chunk,
        "action_dim": io.action_dim,
        "identity": True,
    }
    return StatsFile(features={ACTION: unit(io.action_dim), OBS_STATE: unit(io.state_dim)}, metadata=meta)


def codec_from_stats(stats: StatsFile) -> ActionCodec:
    """The codec training used: normalisation kind and clipping come from the stats metadata."""
    return ActionCodec(
        stats,
        normalization=stats.metadata.get("normalization", "quantile"),
        clip=bool(stats.metadata.get("clip", False)),
    )


def load_served(export_dir: str | Path, device: str = "auto", raw_actions: bool = False) -> ServedPolicy:
    """Load a serving directory onto ``device``; a missing file is an error naming it."""
    root = Path(export_dir)
    if not root.is_dir():
        raise ConfigError(f"serving directory {root} does not exist")
    missing = [f for f in SERVING_FILES if not (root / f).is_file()]
    if missing:
        raise ConfigError(
            f"serving directory {root} lacks {', '.join(missing)} (expected {', '.join(SERVING_FILES)}; "
            "make one with `wamkit convert`)"
        )
    from wamkit.models.pretrained import load_pretrained

    dev = resolve_device(device)
    adapter = load_pretrained(root, device=dev)
    stats = StatsFile.load(root / "stats.json")
    policy = ServedPolicy(adapter, codec_from_stats(stats), raw_actions=raw_actions, source=str(root))
    log.info("loaded %s from %s on %s", adapter.name, root, dev)
    return policy


def random_init(
    name: str,
    preset: str,
    options: dict[str, Any] | None = None,
    device: str = "auto",
    raw_actions: bool = False,
) -> ServedPolicy:
    """An untrained model of the preset's default inputs, with identity stats (for benchmarks)."""
    dev = resolve_device(device)
    adapter = build_model(
        ModelConfig(name=name, preset=preset, options=dict(options or {})), None, device=dev
    )
    adapter.module.to(dev)
    adapter.module.eval()
    stats = identity_stats(adapter.io)
    return ServedPolicy(
        adapter, codec_from_stats(stats), raw_actions=raw_actions, source=f"random-init {name}/{preset}"
    )
