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
from wamkit.models.base import PlacesTextTower
from wamkit.serve.policy import ServedPolicy

log = logging.getLogger(__name__)
SERVING_FILES = (WEIGHTS_FILE, MODEL_FILE, SPEC_FILE)


def as_device(device: torch.device | str) -> torch.device:
    """``serve.device`` as a device: a device as it is (the command resolved it, once), a setting's
    string resolved here (:func:`wamkit.device.resolve_device`) for a caller that has not."""
    return device if isinstance(device, torch.device) else _resolve(device, "serve.device")


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


def check_serving_dir(export_dir: str | Path) -> Path:
    """``export_dir`` as a serving directory, checked before anything reads it: it exists, and holds
    the files of one (:data:`SERVING_FILES`) or is LeRobot's own pretrained folder; else a
    :class:`ConfigError` naming what is missing and how to make it."""
    root = Path(export_dir)
    if not root.is_dir():
        raise ConfigError(f"serving directory {root} does not exist")
    from wamkit.models.lerobot.adapter import is_lerobot_folder

    if is_lerobot_folder(root):
        return root
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
    return root


def load_served(
    export_dir: str | Path,
    device: torch.device | str = "auto",
    raw_actions: bool = False,
    precision: str = "auto",
    text_tower: str = "device",
    sampling_steps: int = 0,
) -> ServedPolicy:
    """Load a serving directory onto ``device``; a missing file is an error naming it. ``precision``:
    ``serve.precision`` (:class:`ServedPolicy`); ``text_tower``: ``serve.text_tower`` resolved
    (device | host: :func:`place`); ``sampling_steps``: ``serve.sampling_steps``."""
    root = check_serving_dir(export_dir)
    from wamkit.models.lerobot.adapter import is_lerobot_folder

    if is_lerobot_folder(root):  # LeRobot's own pretrained folder, served as it is (docs/lerobot.md)
        from wamkit.models.pretrained import load_pretrained

        dev = as_device(device)
        adapter = load_pretrained(root, device=dev)
        log.info(
            "loaded LeRobot's %s from %s on %s (its processors normalise)", adapter.config.type, root, dev
        )
        # serve.precision=auto: fp32, as lerobot-eval runs a folder (bf16 autocast only with its use_amp)
        auto = "bf16" if adapter.config.use_amp and torch.device(dev).type == "cuda" else "fp32"
        return ServedPolicy(adapter, identity_spec(adapter.io), raw_actions=raw_actions, source=str(root),
                            precision=auto if precision == "auto" else precision,
                            sampling_steps=sampling_steps)  # fmt: skip
    from wamkit.models.pretrained import load_pretrained

    dev = as_device(device)
    adapter = load_pretrained(root, device="cpu" if text_tower == "host" else dev)
    place(adapter, dev, text_tower)
    try:
        spec = PreprocessSpec.load(root / SPEC_FILE)
        policy = ServedPolicy(
            adapter, spec, raw_actions=raw_actions, source=str(root), precision=precision,
            sampling_steps=sampling_steps,
        )  # fmt: skip
    except SpecError as err:
        raise ConfigError(str(err)) from None
    log.info("loaded %s from %s on %s", adapter.name, root, dev)
    return policy


def place(adapter: Any, device: torch.device | str, text_tower: str) -> None:
    """``serve.text_tower=host``: the model, built in host memory, keeps its text tower there and puts
    the rest on ``device`` (:class:`~wamkit.models.base.PlacesTextTower`); ``device``: nothing to do."""
    if text_tower == "device":
        return
    if not isinstance(adapter, PlacesTextTower):
        raise ConfigError(
            f"serve.text_tower=host: model {adapter.name!r} has no separate text tower; use device or auto"
        )
    adapter.place_text_tower(torch.device(device))
    log.info(
        "serve.text_tower=host: the text tower rests in host memory, streamed to %s per new prompt", device
    )


def random_init(
    name: str,
    preset: str,
    options: dict[str, Any] | None = None,
    device: torch.device | str = "auto",
    raw_actions: bool = False,
    precision: str = "auto",
    io: ModelIO | None = None,
    text_tower: str = "device",
    sampling_steps: int = 0,
) -> ServedPolicy:
    """An untrained model of ``io`` (default: the preset's inputs), with identity stats (for benchmarks
    and smoke runs). The weights are drawn from a fixed seed, so servers started alike serve the same
    model (the same weights hash: one evaluation may spread its stages over them), whatever their
    ``text_tower`` (resolved: device | host, :func:`place`)."""
    dev = as_device(device)
    torch.manual_seed(0)
    cfg = ModelConfig(name=name, preset=preset, options=dict(options or {}))
    if text_tower == "host":  # built in host memory as it would be on dev (its dtype, its draws)
        draws = {"weights_device": dev} if torch.device(dev).type != "cpu" else {}
        adapter = build_model(cfg, io, device="cpu", **draws)
    else:
        adapter = build_model(cfg, io, device=dev)
        adapter.module.to(dev)
    place(adapter, dev, text_tower)
    adapter.module.eval()
    return ServedPolicy(
        adapter,
        identity_spec(adapter.io),
        raw_actions=raw_actions,
        source=f"random-init {name}/{preset}",
        precision=precision,
        sampling_steps=sampling_steps,
    )
