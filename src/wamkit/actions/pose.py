"""Delta-pose action math: 7-D env actions, the 10-D rot6d training actions, relative <-> absolute chunks.

An arm driven by an operational-space pose controller (robosuite's OSC_POSE) takes these actions; the
embodiment profiles that do name the ``rot6d`` representation (``Embodiment.representation``).


- env action (..., 7): ``[dx, dy, dz, rx, ry, rz, g_env]``, ``r`` an axis-angle rotation delta,
  ``g_env`` -1 = open, +1 = close (robosuite's gripper command).
- training action (..., 10): ``[dx, dy, dz, rot6d(6), g]`` with the same gripper value as stored
  (a dataset's gripper convention and its map to the env command live in :mod:`wamkit.actions.gripper`).

"Frame-wise relative" actions keep the per-frame deltas; only the rotation is re-encoded.
"""

from __future__ import annotations

import numpy as np

from wamkit.actions.rotations import (
    axis_angle_to_matrix,
    axis_angle_to_rot6d,
    matrix_to_axis_angle,
    matrix_to_rot6d,
    rot6d_to_axis_angle,
    rot6d_to_matrix,
)

ENV_ACTION_DIM = 7
ROT6D_ACTION_DIM = 10


def _check(a: np.ndarray, n: int, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape[-1:] != (n,):
        raise ValueError(f"{name}: expected actions of shape (..., {n}), got {a.shape}")
    return a


def to_rot6d_action(a7) -> np.ndarray:
    """7-D ``[dpos, axis-angle, g]`` (..., 7) -> 10-D ``[dpos, rot6d, g]`` (..., 10). Steps or chunks."""
    a7 = _check(a7, ENV_ACTION_DIM, "to_rot6d_action")
    return np.concatenate([a7[..., :3], axis_angle_to_rot6d(a7[..., 3:6]), a7[..., 6:]], axis=-1)


def from_rot6d_action(a10) -> np.ndarray:
    """10-D ``[dpos, rot6d, g]`` (..., 10) -> 7-D ``[dpos, axis-angle, g]`` (..., 7)."""
    a10 = _check(a10, ROT6D_ACTION_DIM, "from_rot6d_action")
    return np.concatenate([a10[..., :3], rot6d_to_axis_angle(a10[..., 3:9]), a10[..., 9:]], axis=-1)


def relative_to_absolute(start_pos, start_rot, dpos, drot) -> tuple[np.ndarray, np.ndarray]:
    """Integrate frame-wise deltas into absolute poses.

    start_pos (..., 3), start_rot (..., 3, 3); dpos (..., T, 3) and drot (..., T, 3, 3) the deltas of
    a chunk. Positions add; rotations compose in the world frame, ``R_t = dR_t @ R_{t-1}`` (how an OSC
    controller applies a rotation delta). Returns pos (..., T, 3), rot (..., T, 3, 3).
    """
    dpos, drot = np.asarray(dpos), np.asarray(drot)
    pos = np.asarray(start_pos)[..., None, :] + np.cumsum(dpos, axis=-2)
    rots = []
    R = np.asarray(start_rot)
    for t in range(drot.shape[-3]):
        R = drot[..., t, :, :] @ R
        rots.append(R)
    return pos, np.stack(rots, axis=-3)


def absolute_to_relative(start_pos, start_rot, pos, rot) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`relative_to_absolute`: ``dpos_t = p_t - p_{t-1}``, ``dR_t = R_t R_{t-1}^T``."""
    pos, rot = np.asarray(pos), np.asarray(rot)
    prev_pos = np.concatenate([np.asarray(start_pos)[..., None, :], pos[..., :-1, :]], axis=-2)
    prev_rot = np.concatenate([np.asarray(start_rot)[..., None, :, :], rot[..., :-1, :, :]], axis=-3)
    return pos - prev_pos, rot @ np.swapaxes(prev_rot, -1, -2)


def relative_chunk_to_absolute(start_pos, start_rot, chunk7) -> np.ndarray:
    """A chunk of 7-D relative actions (..., T, 7) -> absolute targets (..., T, 10):
    ``[pos(3), rot6d(6), g]`` from the start pose."""
    chunk7 = _check(chunk7, ENV_ACTION_DIM, "relative_chunk_to_absolute")
    pos, rot = relative_to_absolute(
        start_pos, start_rot, chunk7[..., :3], axis_angle_to_matrix(chunk7[..., 3:6])
    )
    return np.concatenate([pos, matrix_to_rot6d(rot), chunk7[..., 6:]], axis=-1)


def absolute_chunk_to_relative(start_pos, start_rot, chunk10) -> np.ndarray:
    """Absolute targets (..., T, 10) ``[pos, rot6d, g]`` -> 7-D relative actions (..., T, 7)."""
    chunk10 = _check(chunk10, ROT6D_ACTION_DIM, "absolute_chunk_to_relative")
    dpos, drot = absolute_to_relative(
        start_pos, start_rot, chunk10[..., :3], rot6d_to_matrix(chunk10[..., 3:9])
    )
    return np.concatenate([dpos, matrix_to_axis_angle(drot), chunk10[..., 9:]], axis=-1)
