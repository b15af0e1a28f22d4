"""The training dataset: per-sample batches in the format of :mod:`wamkit.models.base`.

``make_train_dataset(data_cfg, io, codec)`` reads one v3 dataset, or a folder of several (one per
suite), and yields dicts with camera images (uint8 [H, W, 3], resized to ``io.image_size``), the
normalised state, the encoded action chunk [chunk, D], ``action_is_pad`` and the task string; with
``future_frames=True`` also ``observation.future_images.<cam>``, the frame ``chunk`` steps ahead
(clamped to the episode's last frame). Every sub-dataset's fps must equal the stats file's.
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wamkit.actions.codec import ActionCodec
from wamkit.actions.stats import StatsError
from wamkit.config import ConfigError, DataConfig
from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, image_key
from wamkit.data.dataset import LeRobotDataset
from wamkit.data.meta import INFO, DatasetError, DatasetMeta

log = logging.getLogger(__name__)

FUTURE_IMAGES = "observation.future_images"
LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")


def future_key(camera: str) -> str:
    return f"{FUTURE_IMAGES}.{camera}"


def suite_roots(cfg: DataConfig) -> dict[str, Path]:
    """``{suite: folder}``: the configured suites, ``root`` itself, or (fallback, with a warning) every
    sub-folder of ``root`` that holds a dataset."""
    root = Path(cfg.root)
    if cfg.suites:
        if cfg.suite_weights and len(cfg.suite_weights) != len(cfg.suites):
            raise ConfigError(
                f"data.suite_weights: {len(cfg.suite_weights)} weights for {len(cfg.suites)} suites {cfg.suites}"
            )
        out = {s: root / s for s in cfg.suites}
        for p in out.values():
            if not (p / INFO).is_file():
                raise DatasetError(f"data.suites: {p} is not a finished LeRobot v3 dataset ({INFO} missing)")
        return out
    if (root / INFO).is_file():
        return {root.name: root}
    found = sorted(p for p in root.iterdir() if (p / INFO).is_file()) if root.is_dir() else []
    if not found:
        raise DatasetError(f"data.root: {root} is not a LeRobot v3 dataset and holds none ({INFO} missing)")
    names = [p.name for p in found]
    missing = [s for s in LIBERO_SUITES if s not in names]
    log.warning(
        "data.suites is empty: auto-detected suites %s under %s%s; list them in data.suites to be explicit",
        names, root, f" (a full LIBERO layout also has {missing})" if missing else "",
    )  # fmt: skip
    if cfg.suite_weights and len(cfg.suite_weights) != len(found):
        raise ConfigError(
            f"data.suite_weights: {len(cfg.suite_weights)} weights for auto-detected suites {names}"
        )
    return {p.name: p for p in found}


class TrainDataset(torch.utils.data.Dataset):
    """Samples of several suites, concatenated; ``suite_sizes`` and ``weights`` drive the sampler."""

    def __init__(self, suites: dict[str, LeRobotDataset], weights: list[float], cameras: dict[str, str],
                 io, codec: ActionCodec, future_frames: bool):  # fmt: skip
        self.suites = suites
        self.names = list(suites)
        self.suite_sizes = [len(d) for d in suites.values()]
        self.offsets = np.cumsum([0, *self.suite_sizes]).tolist()
        self.weights = weights
        self.cameras = cameras  # model camera name -> dataset feature key
        self.io, self.codec, self.future_frames = io, codec, future_frames

    def __len__(self) -> int:
        return self.offsets[-1]

    def _resize(self, img: torch.Tensor) -> torch.Tensor:
        size = self.io.image_size
        if img.shape[-3:-1] == (size, size):
            return img
        x = img.movedim(-1, -3).float()
        x = F.interpolate(x.reshape(-1, *x.shape[-3:]), size=(size, size), mode="bilinear", antialias=True)
        x = x.reshape(*img.shape[:-3], 3, size, size).movedim(-3, -1)
        return x.round().clamp(0, 255).to(torch.uint8)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = bisect.bisect_right(self.offsets, i) - 1
        raw = self.suites[self.names[s]][i - self.offsets[s]]
        out: dict[str, Any] = {
            OBS_STATE: torch.from_numpy(self.codec.encode_state(raw[OBS_STATE].numpy())),
            ACTION: torch.from_numpy(self.codec.encode_actions(raw[ACTION].numpy())),
            ACTION_IS_PAD: raw[f"{ACTION}_is_pad"],
            TASK: raw[TASK],
        }
        for cam, key in self.cameras.items():
            frames = raw[key]
            if self.future_frames:  # frames = [now, now + chunk]
                out[image_key(cam)] = self._resize(frames[0])
                out[future_key(cam)] = self._resize(frames[1])
            else:
                out[image_key(cam)] = self._resize(frames)
        return out


def make_train_dataset(
    data_cfg: DataConfig, io, codec: ActionCodec, future_frames: bool = False
) -> TrainDataset:
    """The map-style training dataset for ``data_cfg`` and the model's ``io`` (see the module docstring)."""
    if codec.representation != io.representation:
        raise StatsError(
            f"stats file representation {codec.representation!r} but the model trains on {io.representation!r}"
        )
    roots = suite_roots(data_cfg)
    chunk = data_cfg.chunk
    if chunk != io.chunk:
        raise ConfigError(f"data.chunk: {chunk} but the model's action chunk is {io.chunk}")
    # data.cameras[i] is the dataset camera that feeds the model's camera io.cameras[i]
    wanted = list(data_cfg.cameras) or list(io.cameras)
    if len(wanted) != len(io.cameras):
        raise ConfigError(
            f"data.cameras: {wanted} must name one dataset camera per model camera {list(io.cameras)}"
        )
    suites: dict[str, LeRobotDataset] = {}
    cameras: dict[str, str] = {}
    for name, root in roots.items():
        meta = DatasetMeta(root)
        codec.stats.check(source=f"stats file (for dataset {root})", fps=meta.fps)
        keys = []
        for cam in wanted:
            key = cam if cam in meta.camera_keys else image_key(cam)
            if key not in meta.camera_keys:
                raise DatasetError(
                    f"{root}: has no camera '{cam}' (cameras: {meta.camera_keys}); set data.cameras"
                )
            keys.append(key)
        cameras = dict(zip(io.cameras, keys))
        delta: dict[str, list[float]] = {ACTION: [k / meta.fps for k in range(chunk)]}
        if future_frames:
            delta.update({k: [0.0, chunk / meta.fps] for k in keys})
        suites[name] = LeRobotDataset(root, delta_timestamps=delta, cameras=keys)
    weights = list(data_cfg.suite_weights) or [float(len(d)) for d in suites.values()]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.suite_weights: expected non-negative weights with a positive sum, got {weights}"
        )
    return TrainDataset(suites, weights, cameras, io, codec, future_frames)
