"""Idle frames of an action chunk: steps where the robot holds still, as cosmos-framework counts them.

Cosmos3's action captions say how many of the chunk's frames are idle (``idle_frame``: "k out of 16"),
so the model learns when to wait. A frame is idle when its translation, its rotation and its gripper
change all stay under per-second thresholds (scaled by the data's fps), and it belongs to a run of at
least three such frames. Thresholds: cosmos-framework ``base_dataset.py`` and ``pose_utils.py`` (cited
in docs/cosmos3.md).

Input: one chunk in the delta-pose rot6d model layout (:mod:`wamkit.actions.pose`) before normalisation, ``[dpos(3), rot6d(6), g]``
[T, 10] (frame-wise relative deltas).
"""

from __future__ import annotations

import math

import numpy as np

from wamkit.actions.rotations import rot6d_to_matrix

IDLE_TRANSLATION_PER_S = 5e-3  # metres per second
IDLE_ROTATION_PER_S = math.radians(1.5)  # radians per second
IDLE_GRIPPER_STEP = 1e-2  # change of the gripper value between consecutive frames
IDLE_MIN_STREAK = 3


def rotation_angles(rot6d: np.ndarray) -> np.ndarray:
    """Geodesic angle (radians) from the identity of rotations given as rot6d [T, 6]."""
    R = rot6d_to_matrix(np.asarray(rot6d, np.float64))
    trace = np.trace(R, axis1=-2, axis2=-1)
    return np.arccos(np.clip((trace - 1.0) / 2.0, -1.0, 1.0))


def in_streaks(flags: np.ndarray, min_len: int) -> np.ndarray:
    """``flags`` kept only where they belong to a run of at least ``min_len`` consecutive True."""
    flags = np.asarray(flags, bool)
    out = np.zeros_like(flags)
    start = None
    for i, f in enumerate([*flags.tolist(), False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            if i - start >= min_len:
                out[start:i] = True
            start = None
    return out


def count_idle_frames(chunk: np.ndarray, fps: float) -> int:
    """Idle frames of one ``[dpos, rot6d, g]`` chunk [T, 10] recorded at ``fps`` (see the docstring)."""
    a = np.asarray(chunk, np.float64)
    if a.ndim != 2 or a.shape[1] != 10:
        raise ValueError(f"count_idle_frames: expected a [T, 10] chunk, got {list(a.shape)}")
    idle = np.linalg.norm(a[:, 0:3], axis=1) < IDLE_TRANSLATION_PER_S / fps
    idle &= rotation_angles(a[:, 3:9]) < IDLE_ROTATION_PER_S / fps
    g = a[:, 9]
    idle &= np.abs(np.diff(g, prepend=g[:1])) < IDLE_GRIPPER_STEP
    return int(in_streaks(idle, IDLE_MIN_STREAK).sum())
