"""Pretrained model directories: ``model.safetensors`` (weights) + ``model.json`` (how to rebuild).

``model.json`` holds the adapter's ``config_dict()``: ``name`` (registry name), ``preset``, ``options``
(fully resolved, so later changes to a preset's defaults do not change a saved model) and ``io``.
Works for any adapter whose ``module`` is an ordinary (unsharded) ``torch.nn.Module``; the round trip is
exact (same tensors, same predictions for a seed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from wamkit.config import ModelConfig, UserError
from wamkit.files import (
    MODEL_FILE,
    MODEL_FORMAT,
    WEIGHTS_FILE,
    atomic_write_json,
    atomic_write_with,
    model_json,
)
from wamkit.models.base import ModelAdapter, ModelIO
from wamkit.models.registry import build_model

WEIGHTS, CONFIG, FORMAT = WEIGHTS_FILE, MODEL_FILE, MODEL_FORMAT


def save_pretrained(adapter: ModelAdapter, out_dir: str | Path) -> Path:
    """Write ``adapter``'s weights and config to ``out_dir`` (created); return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.module.state_dict().items()}
    atomic_write_with(out / WEIGHTS, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    atomic_write_json(out / CONFIG, model_json(adapter.config_dict()), indent=2, sort_keys=True)
    return out


class ModelFileMissing(UserError, FileNotFoundError):
    """A model directory has no ``model.json`` (and is no LeRobot folder); the message names the path."""


class ModelFileError(UserError, ValueError):
    """A model directory's ``model.json`` is not what ``save_pretrained`` writes; the message names it."""


def read_model_json(model_dir: str | Path) -> dict[str, Any]:
    """The checked contents of ``<model_dir>/model.json``."""
    path = Path(model_dir) / CONFIG
    if not path.is_file():
        from wamkit.models.lerobot.adapter import folder_io, is_lerobot_folder

        if is_lerobot_folder(model_dir):  # LeRobot's own folder: its config.json says what it is
            policy_type, io = folder_io(Path(model_dir))
            return {"format": FORMAT, "name": "lerobot", "preset": policy_type, "options": {},
                    "io": io.to_dict(), "lerobot_folder": str(model_dir)}  # fmt: skip
        raise ModelFileMissing(f"{path} does not exist; expected a directory written by save_pretrained")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ModelFileError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelFileError(f'{path}: expected a JSON object with "format": "{FORMAT}"')
    missing = [k for k in ("name", "preset", "options", "io") if k not in meta]
    if missing:
        raise ModelFileError(f"{path}: missing keys {missing}; expected name, preset, options, io")
    return meta


def load_pretrained(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    options: dict[str, Any] | None = None,
    io: ModelIO | None = None,
) -> ModelAdapter:
    """Rebuild the adapter saved in ``model_dir`` and load its weights exactly.

    ``options`` override saved options (sampling settings such as ``num_steps``; an option that changes
    the architecture makes the weights not fit, which raises). ``io``, when given, must equal the saved
    inputs: a model cannot change its cameras, image size or dims after training.
    """
    model_dir = Path(model_dir)
    meta = read_model_json(model_dir)
    if meta.get("lerobot_folder"):  # LeRobot's own folder (read_model_json): its model loads it
        return build_model(
            ModelConfig(name=meta["name"], pretrained=meta["lerobot_folder"]), io, device=device
        )
    saved_io = ModelIO.from_dict(meta["io"])
    if io is not None and io != saved_io:
        raise ValueError(f"{model_dir / CONFIG}: the model expects inputs {saved_io}, but {io} was asked for")
    cfg = ModelConfig(
        name=meta["name"], preset=meta["preset"], options={**meta["options"], **(options or {})}
    )
    adapter = build_model(cfg, saved_io)
    path = model_dir / WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; expected the weights next to {CONFIG}")
    state = load_file(str(path))
    try:
        result = adapter.module.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes differ: an option changed the architecture
        raise ValueError(f"{path}: weights do not fit model '{meta['name']}': {err}") from err
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{path}: weights do not fit model '{meta['name']}' (preset {meta['preset']}): "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    adapter.module.to(device)
    adapter.module.eval()
    return adapter
