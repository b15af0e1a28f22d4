"""``LeRobotDataset``: read a LeRobot v3.0 or v2.1 dataset with pyarrow and PyAV, without lerobot.

The class mirrors upstream's so user code ports over: ``len(ds)``, ``ds[i]``, ``ds.meta.info``,
``ds.fps``, ``ds.features``, ``ds.num_episodes``, ``ds.camera_keys``, ``delta_timestamps``.
One difference, on purpose: camera frames come back as **uint8 tensors [H, W, 3] (channels last, RGB,
as stored)**, not upstream's float [3, H, W] in [0, 1]; converting is the model's job, and uint8 keeps
DataLoader traffic four times smaller.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamkit.constants import EPISODE_INDEX, FRAME_INDEX, INDEX, TASK, TASK_INDEX, TIMESTAMP, image_key
from wamkit.data.meta import DatasetError, DatasetMeta, column_to_numpy, read_parquet
from wamkit.data.video import VideoFrames

log = logging.getLogger(__name__)


class LeRobotDataset(torch.utils.data.Dataset):
    """A map-style dataset over the frames of the selected episodes of the dataset at ``root``
    (LeRobot v3.0 or v2.1: the same sample dicts for both).

    ``ds[i]`` is a dict with:

    - ``observation.images.<cam>``: uint8 tensor [H, W, 3] (RGB, channels last), per selected camera;
    - every numeric feature (``observation.state`` float32 [S], ``action`` float32 [A], ...);
    - ``episode_index``, ``frame_index``, ``index``, ``task_index`` (int64 scalars), ``timestamp``
      (float32 scalar, seconds from the episode start), ``task`` (str).

    ``delta_timestamps = {key: [dt0, dt1, ...]}`` (seconds, multiples of 1/fps) turns ``key`` into a
    stack over those offsets, e.g. ``{"action": [k / fps for k in range(16)]}`` gives ``action``
    [16, A] and ``action_is_pad`` bool [16], True where the offset runs past the episode (the value
    there repeats the episode's last frame, as upstream does). Offsets before the start are clamped
    and padded likewise.

    ``episodes``: episode indices to use (default all). ``cameras``: camera names (``"wrist_image"``)
    or full keys to decode (default all); an unknown one is an error listing the dataset's cameras.
    ``frame_memory_mb``: decode whole video files into memory, up to this many MiB per process
    (:class:`wamkit.data.video.VideoFrames`); 0 decodes the frames each sample needs.
    """

    def __init__(
        self,
        root: str | Path,
        delta_timestamps: dict[str, Sequence[float]] | None = None,
        episodes: Sequence[int] | None = None,
        cameras: Sequence[str] | None = None,
        tolerance_s: float = 1e-4,
        frame_memory_mb: float = 0.0,
    ):
        self.root = Path(root)
        self.meta = DatasetMeta(self.root)
        self.tolerance_s = tolerance_s
        self.camera_keys = self._select_cameras(cameras)
        self.episodes = self._select_episodes(episodes)
        self._load_data()
        self.delta_frames = self._delta_frames(delta_timestamps or {})
        # hot-path lookups, computed once (the metadata properties rebuild lists on each call)
        self._numeric_keys = list(self.meta.numeric_keys)
        self._video_keys = set(self.meta.video_keys)
        self._shapes = {k: tuple(self.features[k]["shape"]) for k in self.camera_keys}
        self._videos = VideoFrames(memory_mb=frame_memory_mb)
        self._image_tables: dict[tuple[Path, str], Any] = {}

    # -- upstream-compatible properties ---------------------------------------------------------
    @property
    def fps(self) -> int:
        return self.meta.fps

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.meta.features

    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def num_frames(self) -> int:
        return len(self._ep_of_row)

    def __len__(self) -> int:
        return self.num_frames

    # -- set-up ---------------------------------------------------------------------------------
    def _select_cameras(self, cameras: Sequence[str] | None) -> list[str]:
        available = self.meta.camera_keys
        if cameras is None:
            return available
        keys = []
        for cam in cameras:
            key = cam if cam in available else image_key(cam)
            if key not in available:
                raise DatasetError(
                    f"{self.root}: unknown camera '{cam}'; this dataset has cameras {available} (meta/info.json)"
                )
            keys.append(key)
        return keys

    def _select_episodes(self, episodes: Sequence[int] | None) -> list[int]:
        known = self.meta.episodes
        if episodes is None:
            return list(known)
        missing = [e for e in episodes if e not in known]
        if missing:
            raise DatasetError(
                f"{self.root}: episodes {missing} are not in meta/episodes ({len(known)} episodes)"
            )
        return list(episodes)

    def _load_data(self) -> None:
        """Read the numeric columns of every data file the selected episodes use, in episode order."""
        meta = self.meta
        keys = [k for k in meta.numeric_keys]
        by_file: dict[Path, Any] = {}
        parts: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        self._rows_of_ep: dict[int, tuple[int, int]] = {}  # episode -> [start, end) rows in our arrays
        self._image_rows: dict[int, tuple[Path, int]] = {}  # episode -> (data file, its first row there)
        row = 0
        for ep in self.episodes:
            info = meta.episodes[ep]
            path = info.data_file
            if path not in by_file:
                by_file[path] = self._read_data_file(path, keys)
            cols = by_file[path]
            sel = np.flatnonzero(cols[EPISODE_INDEX].reshape(-1) == ep)
            if len(sel) != info.length:
                raise DatasetError(
                    f"{path}: has {len(sel)} rows of episode {ep}; meta/episodes says length {info.length}"
                )
            frames = cols[FRAME_INDEX].reshape(-1)[sel]
            if not np.array_equal(frames, np.arange(info.length)):
                raise DatasetError(f"{path}: episode {ep} rows are not frames 0..{info.length - 1} in order")
            for k in keys:
                parts[k].append(cols[k][sel])
            self._rows_of_ep[ep] = (row, row + info.length)
            self._image_rows[ep] = (path, int(sel[0]))
            row += info.length
        self._data = {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in parts.items()}
        self._ep_of_row = np.concatenate(
            [np.full(meta.episodes[ep].length, ep) for ep in self.episodes] or [np.zeros(0, np.int64)]
        )
        self._start_of_row = np.concatenate(
            [np.full(meta.episodes[ep].length, self._rows_of_ep[ep][0]) for ep in self.episodes]
            or [np.zeros(0, np.int64)]
        )
        for key in self.camera_keys:  # fail now, not in a worker an hour into training
            if key in meta.video_keys:
                for ep in self.episodes:
                    p = meta.episodes[ep].videos[key][0]
                    if not p.is_file():
                        raise DatasetError(f"{p}: video file is missing (camera {key}, episode {ep})")

    def _read_data_file(self, path: Path, keys: list[str]) -> dict[str, np.ndarray]:
        table = read_parquet(path, columns=None)
        return {k: column_to_numpy(table, k, self.meta.features[k]["shape"], path) for k in keys}

    def _delta_frames(self, delta: dict[str, Sequence[float]]) -> dict[str, np.ndarray]:
        out = {}
        valid = set(self.meta.numeric_keys) | set(self.camera_keys)
        for key, dts in delta.items():
            if key not in valid:
                raise DatasetError(f"delta_timestamps: unknown key '{key}' (valid: {sorted(valid)})")
            frames = np.asarray(dts, np.float64) * self.fps
            if np.any(np.abs(frames - np.round(frames)) > self.tolerance_s * self.fps):
                raise DatasetError(
                    f"delta_timestamps['{key}']: {list(dts)} are not multiples of 1/fps = {1 / self.fps:.6f}s"
                )
            out[key] = np.round(frames).astype(np.int64)
        return out

    # -- items ----------------------------------------------------------------------------------
    def _frame(self, key: str, row: int) -> np.ndarray:
        if key in self._video_keys:
            img = self._videos.frame(*self.video_target(key, row), self.tolerance_s)
        else:
            ep = int(self._ep_of_row[row])
            img = self._image(key, ep, row - self._rows_of_ep[ep][0])
        want = self._shapes[key]
        if img.shape != want:
            raise DatasetError(
                f"{self.root}: camera {key} frame has shape {img.shape}; meta/info.json says {list(want)}"
            )
        return img

    def _image(self, key: str, ep: int, frame: int) -> np.ndarray:
        from PIL import Image

        path, first = self._image_rows[ep]
        if (path, key) not in self._image_tables:
            self._image_tables[(path, key)] = read_parquet(path, columns=[key]).column(key)
        cell = self._image_tables[(path, key)][first + frame].as_py()
        data = cell["bytes"] if isinstance(cell, dict) else cell
        if data is None:
            raise DatasetError(f"{path}: image feature '{key}' of episode {ep} frame {frame} has no bytes")
        return np.array(Image.open(io.BytesIO(data)).convert("RGB"))

    def __getitem__(self, i: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a dataset of {n} frames")
        row = int(i) % n
        ep = int(self._ep_of_row[row])
        start, end = self._rows_of_ep[ep]
        item: dict[str, Any] = {}
        for key in self._numeric_keys:
            if key in self.delta_frames:
                rows, pad = self._delta_rows(key, row, start, end)
                item[key] = torch.from_numpy(self._data[key][rows])
                item[f"{key}_is_pad"] = torch.from_numpy(pad)
            else:
                item[key] = torch.from_numpy(np.asarray(self._data[key][row]))
        for key in [EPISODE_INDEX, FRAME_INDEX, INDEX, TASK_INDEX, TIMESTAMP]:
            if key in item and item[key].ndim == 1 and item[key].shape[0] == 1:
                item[key] = item[key][0]
        for key in self.camera_keys:
            if key in self.delta_frames:
                rows, pad = self._delta_rows(key, row, start, end)
                item[key] = torch.from_numpy(np.stack([self._frame(key, int(r)) for r in rows]))
                item[f"{key}_is_pad"] = torch.from_numpy(pad)
            else:
                item[key] = torch.from_numpy(self._frame(key, row))
        task_index = int(self._data[TASK_INDEX].reshape(-1)[row]) if TASK_INDEX in self._data else 0
        item[TASK] = self.meta.tasks.get(task_index, "")
        return item

    def _delta_rows(self, key: str, row: int, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        want = row + self.delta_frames[key]
        return np.clip(want, start, end - 1), (want < start) | (want >= end)

    def video_target(self, key: str, row: int) -> tuple[Path, float]:
        """The (mp4 file, seconds) holding camera ``key``'s frame of ``row``."""
        ep = int(self._ep_of_row[row])
        path, from_ts, _ = self.meta.episodes[ep].videos[key]
        return path, from_ts + (row - self._rows_of_ep[ep][0]) / self.fps

    def episode_bounds(self, row: int) -> tuple[int, int]:
        """``[start, end)`` rows of the episode that holds ``row``."""
        return self._rows_of_ep[int(self._ep_of_row[row])]

    def numeric(self, key: str) -> np.ndarray:
        """All rows of a numeric feature, (num_frames, *shape), in episode order (no decoding)."""
        return self._data[key]
