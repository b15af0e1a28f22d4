"""Rotation conversions, vectorised over any leading axes.

Conventions:
- axis-angle ``r`` (..., 3): rotation by ``|r|`` radians about ``r / |r|``; results have ``|r|`` in [0, pi].
- matrix ``R`` (..., 3, 3): acts on column vectors, ``x' = R @ x``.
- quaternion (..., 4): the order is always named, ``"xyzw"`` (scipy, MuJoCo's ``xquat`` is ``wxyz``)
  or ``"wxyz"``. ``q`` and ``-q`` are the same rotation; every function here treats them alike.
- rot6d (..., 6): the first two *columns* of ``R``, ``[R[:, 0], R[:, 1]]``; decoded by Gram-Schmidt.

NumPy functions return the input's float dtype (float32 or float64); internally they compute in float64
so that float32 callers get float32-rounding accuracy, not float32-cancellation accuracy. The ``*_torch``
variants keep the tensor's dtype and device and are differentiable.
"""

from __future__ import annotations

import numpy as np
import torch

QuatOrder = str  # "xyzw" | "wxyz"

# Below this angle (radians) the series expansions are used; their truncation error is < 1e-17.
_SMALL = 1e-4


def _out_dtype(x: np.ndarray) -> np.dtype:
    return x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float64)


def _as64(x) -> tuple[np.ndarray, np.dtype]:
    x = np.asarray(x)
    return x.astype(np.float64, copy=False), _out_dtype(x)


def _check_last(x: np.ndarray, n: int, name: str) -> None:
    if x.shape[-1:] != (n,):
        raise ValueError(f"{name}: expected shape (..., {n}), got {x.shape}")


def _to_wxyz(q: np.ndarray, order: QuatOrder) -> np.ndarray:
    if order == "wxyz":
        return q
    if order == "xyzw":
        return q[..., [3, 0, 1, 2]]
    raise ValueError(f"quaternion order must be 'xyzw' or 'wxyz', got {order!r}")


def _from_wxyz(q: np.ndarray, order: QuatOrder) -> np.ndarray:
    if order == "wxyz":
        return q
    if order == "xyzw":
        return q[..., [1, 2, 3, 0]]
    raise ValueError(f"quaternion order must be 'xyzw' or 'wxyz', got {order!r}")


# ---- quaternion <-> axis-angle ---------------------------------------------------------------------


def axis_angle_to_quat(r, order: QuatOrder = "xyzw") -> np.ndarray:
    """Axis-angle (..., 3) -> unit quaternion (..., 4) with w >= 0."""
    r, dtype = _as64(r)
    _check_last(r, 3, "axis_angle_to_quat")
    theta = np.linalg.norm(r, axis=-1, keepdims=True)
    half = 0.5 * theta
    # sin(theta/2)/theta, with its series below _SMALL
    safe = np.where(theta < _SMALL, 1.0, theta)
    k = np.where(theta < _SMALL, 0.5 - theta**2 / 48.0, np.sin(half) / safe)
    q = np.concatenate([np.cos(half), r * k], axis=-1)
    q = np.where(q[..., :1] < 0, -q, q)  # |r| > pi wraps: keep w >= 0
    return _from_wxyz(q, order).astype(dtype)


def quat_to_axis_angle(q, order: QuatOrder = "xyzw") -> np.ndarray:
    """Quaternion (..., 4) -> axis-angle (..., 3), angle in [0, pi].

    Antipodal-safe: ``q`` and ``-q`` give the same result. Need not be normalised (must be non-zero).
    """
    q, dtype = _as64(q)
    _check_last(q, 4, "quat_to_axis_angle")
    q = _to_wxyz(q, order)
    norm = np.linalg.norm(q, axis=-1, keepdims=True)
    if np.any(norm == 0):
        raise ValueError("quat_to_axis_angle: zero quaternion")
    q = q / norm
    q = np.where(q[..., :1] < 0, -q, q)  # the antipodal sign: same rotation, take w >= 0
    w, v = q[..., :1], q[..., 1:]
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    angle = 2.0 * np.arctan2(n, w)
    # angle / n; for small n (w ~ 1): 2/w * (1 - (n/w)^2 / 3)
    small = n < _SMALL
    safe_n = np.where(small, 1.0, n)
    safe_w = np.where(small, w, 1.0)  # w ~ 1 wherever the series is used
    scale = np.where(small, 2.0 / safe_w * (1.0 - (n / safe_w) ** 2 / 3.0), angle / safe_n)
    return (v * scale).astype(dtype)


# ---- quaternion <-> matrix -------------------------------------------------------------------------


def quat_to_matrix(q, order: QuatOrder = "xyzw") -> np.ndarray:
    """Quaternion (..., 4) -> rotation matrix (..., 3, 3). Normalises first."""
    q, dtype = _as64(q)
    _check_last(q, 4, "quat_to_matrix")
    q = _to_wxyz(q, order)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    w, x, y, z = np.moveaxis(q, -1, 0)
    R = np.stack(
        [
            1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w),
            2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w),
            2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y),
        ],
        axis=-1,
    )  # fmt: skip
    return R.reshape(q.shape[:-1] + (3, 3)).astype(dtype)


def matrix_to_quat(R, order: QuatOrder = "xyzw") -> np.ndarray:
    """Rotation matrix (..., 3, 3) -> unit quaternion (..., 4) with w >= 0.

    Shepperd's method: of the four algebraically equal formulas, each element uses the one whose
    divisor is largest, so the result is accurate for every rotation (angles near pi included).
    """
    R, dtype = _as64(R)
    if R.shape[-2:] != (3, 3):
        raise ValueError(f"matrix_to_quat: expected shape (..., 3, 3), got {R.shape}")
    m00, m01, m02 = R[..., 0, 0], R[..., 0, 1], R[..., 0, 2]
    m10, m11, m12 = R[..., 1, 0], R[..., 1, 1], R[..., 1, 2]
    m20, m21, m22 = R[..., 2, 0], R[..., 2, 1], R[..., 2, 2]
    trace = m00 + m11 + m22
    # Candidate k has 4*q_k^2 = 1 + (diagonal combination); pick the largest.
    cands = np.stack(
        [
            np.stack([1 + trace, m21 - m12, m02 - m20, m10 - m01], -1),
            np.stack([m21 - m12, 1 + m00 - m11 - m22, m01 + m10, m02 + m20], -1),
            np.stack([m02 - m20, m01 + m10, 1 - m00 + m11 - m22, m12 + m21], -1),
            np.stack([m10 - m01, m02 + m20, m12 + m21, 1 - m00 - m11 + m22], -1),
        ],
        axis=-2,
    )  # (..., 4 candidates, wxyz)
    best = np.argmax(np.stack([trace, m00, m11, m22], -1), axis=-1)
    q = np.take_along_axis(cands, best[..., None, None], axis=-2)[..., 0, :]
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    q = np.where(q[..., :1] < 0, -q, q)
    return _from_wxyz(q, order).astype(dtype)


# ---- axis-angle <-> matrix -------------------------------------------------------------------------


def axis_angle_to_matrix(r) -> np.ndarray:
    """Axis-angle (..., 3) -> rotation matrix (..., 3, 3)."""
    r = np.asarray(r)
    dtype = _out_dtype(r)
    return quat_to_matrix(axis_angle_to_quat(r.astype(np.float64), "wxyz"), "wxyz").astype(dtype)


def matrix_to_axis_angle(R) -> np.ndarray:
    """Rotation matrix (..., 3, 3) -> axis-angle (..., 3), angle in [0, pi]."""
    R = np.asarray(R)
    dtype = _out_dtype(R)
    return quat_to_axis_angle(matrix_to_quat(R.astype(np.float64), "wxyz"), "wxyz").astype(dtype)


# ---- rot6d ----------------------------------------------------------------------------------------


def matrix_to_rot6d(R) -> np.ndarray:
    """Rotation matrix (..., 3, 3) -> rot6d (..., 6) = ``[R[:, 0], R[:, 1]]`` (first two columns)."""
    R = np.asarray(R)
    if R.shape[-2:] != (3, 3):
        raise ValueError(f"matrix_to_rot6d: expected shape (..., 3, 3), got {R.shape}")
    return np.concatenate([R[..., :, 0], R[..., :, 1]], axis=-1).astype(_out_dtype(R))


def rot6d_to_matrix(d6) -> np.ndarray:
    """rot6d (..., 6) -> rotation matrix (..., 3, 3) by Gram-Schmidt on the two columns."""
    d6, dtype = _as64(d6)
    _check_last(d6, 6, "rot6d_to_matrix")
    c0, c1 = d6[..., :3], d6[..., 3:]
    b1 = c0 / np.linalg.norm(c0, axis=-1, keepdims=True)
    b2 = c1 - np.sum(b1 * c1, axis=-1, keepdims=True) * b1
    b2 = b2 / np.linalg.norm(b2, axis=-1, keepdims=True)
    b3 = np.cross(b1, b2)
    return np.stack([b1, b2, b3], axis=-1).astype(dtype)


def axis_angle_to_rot6d(r) -> np.ndarray:
    """Axis-angle (..., 3) -> rot6d (..., 6)."""
    return matrix_to_rot6d(axis_angle_to_matrix(r))


def rot6d_to_axis_angle(d6) -> np.ndarray:
    """rot6d (..., 6) -> axis-angle (..., 3)."""
    return matrix_to_axis_angle(rot6d_to_matrix(d6))


def quat_to_rot6d(q, order: QuatOrder = "xyzw") -> np.ndarray:
    return matrix_to_rot6d(quat_to_matrix(q, order))


# ---- torch (differentiable; used where a loss or a model head needs them) -------------------------


def matrix_to_rot6d_torch(R: torch.Tensor) -> torch.Tensor:
    return torch.cat([R[..., :, 0], R[..., :, 1]], dim=-1)


def rot6d_to_matrix_torch(d6: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    c0, c1 = d6[..., :3], d6[..., 3:]
    b1 = c0 / c0.norm(dim=-1, keepdim=True).clamp_min(eps)
    b2 = c1 - (b1 * c1).sum(-1, keepdim=True) * b1
    b2 = b2 / b2.norm(dim=-1, keepdim=True).clamp_min(eps)
    b3 = torch.linalg.cross(b1, b2, dim=-1)
    return torch.stack([b1, b2, b3], dim=-1)
