"""The SFT dataset: per-sample batches in the format of :mod:`wamkit.models.base`.

``make_train_dataset(data_cfg, spec)`` reads one v3 dataset, or a folder of several (one per suite),
and yields dicts with camera images (uint8 [H, W, 3], resized by the spec), the normalised state, the
encoded action chunk [chunk, D], ``action_is_pad`` and the task string; with ``future_offsets`` also
``observation.future_images.<cam>``, uint8 [K, H, W, 3]: the frames at those offsets after the current
one (clamped to the episode's last frame); with ``extras`` the per-sample values a model asks for
(:data:`SAMPLE_EXTRAS`: ``executed_action``, the chunk the env executed, for a model that continues
committed actions). Every transform is the :class:`PreprocessSpec`'s own, the very object the
server runs. Every sub-dataset's fps must equal the spec's.
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamkit import embodiments
from wamkit.actions.idle import count_idle_frames
from wamkit.actions.representations import REGISTRY, get_representation
from wamkit.actions.spec import PreprocessSpec, SpecError
from wamkit.config import ConfigError, DataConfig
from wamkit.constants import (
    ACTION,
    ACTION_IS_PAD,
    EXECUTED_ACTION,
    IDLE_FRAMES,
    OBS_STATE,
    TASK,
    future_image_key,
    image_key,
)
from wamkit.data.dataset import LeRobotDataset
from wamkit.data.meta import INFO, DatasetError, DatasetMeta

log = logging.getLogger(__name__)


def _idle_frames(raw: dict[str, Any], spec: PreprocessSpec) -> int:
    """Idle frames of the sample's real (non-padded) action steps, before normalisation."""
    steps = raw[ACTION].numpy()[~raw[f"{ACTION}_is_pad"].numpy()]
    return count_idle_frames(get_representation(spec.representation).to_model(steps), spec.fps)


def _executed_action(raw: dict[str, Any], spec: PreprocessSpec) -> torch.Tensor:
    """The chunk the env executed, encoded as the action chunk is: the dataset's ``executed_action``
    column where a perturbed collection wrote one, else the recorded actions themselves."""
    return torch.from_numpy(spec.encode_actions(raw.get(EXECUTED_ACTION, raw[ACTION]).numpy()))


# name -> its function of the raw sample and the spec (the representations it is defined for say so:
# Representation.extras; those in ANY_REPRESENTATION are defined for all)
SAMPLE_EXTRAS = {IDLE_FRAMES: _idle_frames, EXECUTED_ACTION: _executed_action}
ANY_REPRESENTATION = (EXECUTED_ACTION,)


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
    # the training mix of the embodiment these suites belong to (its profile's), to name what is missing
    mix = next(
        (e for e in map(embodiments.get, embodiments.names()) if set(names) & set(e.training_suites)), None
    )
    missing = [s for s in mix.training_suites if s not in names] if mix is not None else []
    log.warning(
        "data.suites is empty: auto-detected suites %s under %s%s; list them in data.suites to be explicit",
        names, root, f" ({mix.name}'s full training mix also has {missing})" if missing else "",
    )  # fmt: skip
    if cfg.suite_weights and len(cfg.suite_weights) != len(found):
        raise ConfigError(
            f"data.suite_weights: {len(cfg.suite_weights)} weights for auto-detected suites {names}"
        )
    return {p.name: p for p in found}


class TrainDataset(torch.utils.data.Dataset):
    """Samples of several suites, concatenated; ``suite_sizes`` and ``weights`` drive the sampler."""

    def __init__(self, suites: dict[str, LeRobotDataset], weights: list[float], cameras: dict[str, str],
                 spec: PreprocessSpec, future_offsets: tuple[int, ...], extras: tuple[str, ...] = ()):  # fmt: skip
        self.suites = suites
        self.names = list(suites)
        self.suite_sizes = [len(d) for d in suites.values()]
        self.offsets = np.cumsum([0, *self.suite_sizes]).tolist()
        self.weights = weights
        self.cameras = cameras  # model camera name -> dataset feature key
        self.spec, self.future_offsets, self.extras = spec, tuple(future_offsets), tuple(extras)

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = bisect.bisect_right(self.offsets, i) - 1
        raw = self.suites[self.names[s]][i - self.offsets[s]]
        out: dict[str, Any] = {
            OBS_STATE: torch.from_numpy(self.spec.encode_state(raw[OBS_STATE].numpy())),
            ACTION: torch.from_numpy(self.spec.encode_actions(raw[ACTION].numpy())),
            ACTION_IS_PAD: raw[f"{ACTION}_is_pad"],
            TASK: raw[TASK],
        }
        for cam, key in self.cameras.items():
            frames = raw[key]
            if self.future_offsets:  # frames = [now, now + offsets[0], now + offsets[1], ...]
                out[image_key(cam)] = self.spec.resize_images(frames[0])
                out[future_image_key(cam)] = self.spec.resize_images(frames[1:])
            else:
                out[image_key(cam)] = self.spec.resize_images(frames)
        for name in self.extras:
            out[name] = SAMPLE_EXTRAS[name](raw, self.spec)
        return out


def make_train_dataset(
    data_cfg: DataConfig,
    spec: PreprocessSpec,
    future_offsets: tuple[int, ...] = (),
    extras: tuple[str, ...] = (),
) -> TrainDataset:
    """The map-style training dataset for ``data_cfg`` under ``spec`` (see the module docstring)."""
    for name in extras:
        if name not in SAMPLE_EXTRAS:
            raise ValueError(
                f"sample extra {name!r} is unknown; the data stage offers {', '.join(SAMPLE_EXTRAS)}"
            )
        defined = [r.name for r in REGISTRY.values() if name in r.extras]
        if name not in ANY_REPRESENTATION and spec.representation not in defined:
            raise SpecError(
                f"the model asks for {name!r}, defined only for {defined} actions, "
                f"but the data is {spec.representation!r}"
            )
    roots = suite_roots(data_cfg)
    chunk = spec.chunk
    if data_cfg.chunk != chunk:
        raise ConfigError(f"data.chunk: {data_cfg.chunk} but the preprocessing spec's chunk is {chunk}")
    if any(int(k) < 1 for k in future_offsets):
        raise ValueError(f"future frame offsets must be positive, got {list(future_offsets)}")
    # data.cameras[i] is the dataset camera that feeds the model's camera spec.cameras[i]
    wanted = list(data_cfg.cameras) or list(spec.cameras)
    if len(wanted) != len(spec.cameras):
        raise ConfigError(
            f"data.cameras: {wanted} must name one dataset camera per model camera {list(spec.cameras)}"
        )
    suites: dict[str, LeRobotDataset] = {}
    cameras: dict[str, str] = {}
    for name, root in roots.items():
        meta = DatasetMeta(root)
        if spec.fps is not None and meta.fps != spec.fps:
            raise SpecError(
                f"{root}: recorded at {meta.fps} fps but the preprocessing spec (its stats) is for {spec.fps} fps"
            )
        keys = []
        for cam in wanted:
            key = cam if cam in meta.camera_keys else image_key(cam)
            if key not in meta.camera_keys:
                raise DatasetError(
                    f"{root}: has no camera '{cam}' (cameras: {meta.camera_keys}); set data.cameras"
                )
            keys.append(key)
        cameras = dict(zip(spec.cameras, keys))
        delta: dict[str, list[float]] = {ACTION: [k / meta.fps for k in range(chunk)]}
        if EXECUTED_ACTION in extras and EXECUTED_ACTION in meta.features:
            delta[EXECUTED_ACTION] = delta[ACTION]
        if future_offsets:
            delta.update({k: [0.0, *(o / meta.fps for o in future_offsets)] for k in keys})
        suites[name] = LeRobotDataset(
            root, delta_timestamps=delta, cameras=keys, frame_memory_mb=data_cfg.frame_memory_mb
        )
    weights = list(data_cfg.suite_weights) or [float(len(d)) for d in suites.values()]
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(
            f"data.suite_weights: expected non-negative weights with a positive sum, got {weights}"
        )
    return TrainDataset(suites, weights, cameras, spec, tuple(int(k) for k in future_offsets), tuple(extras))
