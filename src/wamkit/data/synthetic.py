"""Small pattern datasets for tests, docs and benchmarks, written with :class:`LeRobotDatasetWriter`.

Frames follow the pattern of the shared fixtures' small two-camera dataset: red = (episode * 40 + frame * 6) mod 256,
green = 60 * camera index, and a blue band (220) over the top (frame * 3) mod H rows. State and action
values are deterministic too: ``state[d] = episode * 1000 + frame + d / 100`` and
``action[d] = -(episode * 1000 + frame) - d / 100``, so a test can tell every frame apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from wamkit.constants import ACTION, OBS_STATE, image_key
from wamkit.data.writer import LeRobotDatasetWriter


def pattern_frame(episode: int, frame: int, camera_index: int, size: tuple[int, int]) -> np.ndarray:
    """The expected frame (H, W, 3) uint8 of the pattern."""
    h, w = size
    img = np.zeros((h, w, 3), np.uint8)
    img[..., 0] = (episode * 40 + frame * 6) % 256
    img[..., 1] = 60 * camera_index
    img[: (frame * 3) % h, :, 2] = 220
    return img


def pattern_state(episode: int, frame: int, dim: int) -> np.ndarray:
    return (episode * 1000 + frame + np.arange(dim) / 100).astype(np.float32)


def pattern_action(episode: int, frame: int, dim: int) -> np.ndarray:
    return (-(episode * 1000 + frame) - np.arange(dim) / 100).astype(np.float32)


def write_pattern_dataset(
    root: str | Path,
    lengths: list[int],
    fps: int = 20,
    cameras: tuple[str, ...] = ("image", "wrist_image"),
    size: tuple[int, int] = (64, 64),
    state_dim: int = 8,
    action_dim: int = 7,
    tasks: tuple[str, ...] = ("pick up the cube", "open the drawer"),
    camera_dtype: str = "video",
    extra_info: dict[str, Any] | None = None,
    finalize: bool = True,
    first_pattern: int = 0,
) -> Path:
    """Write episodes of the given ``lengths``; episode ``e`` has task ``tasks[e % len(tasks)]`` and
    pattern number ``first_pattern + e`` (so two datasets can hold distinguishable frames)."""
    features: dict[str, Any] = {
        image_key(c): {"dtype": camera_dtype, "shape": [*size, 3], "names": ["height", "width", "channel"]}
        for c in cameras
    }
    features[OBS_STATE] = {"dtype": "float32", "shape": [state_dim], "names": None}
    features[ACTION] = {"dtype": "float32", "shape": [action_dim], "names": None}
    writer = LeRobotDatasetWriter.create(root, fps, features, robot_type="pattern", extra_info=extra_info)
    append_pattern_episodes(writer, lengths, first_pattern, cameras, size, state_dim, action_dim, tasks)
    if finalize:
        writer.finalize()
    return Path(root)


def append_pattern_episodes(writer: LeRobotDatasetWriter, lengths: list[int], first: int, cameras, size,
                            state_dim: int, action_dim: int, tasks) -> None:  # fmt: skip
    """Add and save episodes with pattern numbers ``first, first + 1, ...`` to an open writer."""
    for e, length in enumerate(lengths, start=first):
        for f in range(length):
            frame: dict[str, Any] = {
                image_key(c): pattern_frame(e, f, i, size) for i, c in enumerate(cameras)
            }
            frame[OBS_STATE] = pattern_state(e, f, state_dim)
            frame[ACTION] = pattern_action(e, f, action_dim)
            frame["task"] = tasks[writer.num_episodes % len(tasks)]  # by the dataset episode index
            writer.add_frame(frame)
        writer.save_episode()
