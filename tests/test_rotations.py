"""Rotations against scipy's independent implementation, including the hard cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from wamkit.actions import rotations as rot

N = 100_000


def _random_axis_angles(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniform rotations plus angles within 1e-6 of pi and of 0, and exact 0 and pi."""
    axes = rng.normal(size=(n, 3))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    k = n // 4
    angles = np.concatenate(
        [
            rng.uniform(0, np.pi, n - 3 * k),
            np.pi - rng.uniform(0, 1e-6, k),  # just below pi
            rng.uniform(0, 1e-6, k),  # just above 0
            rng.choice([0.0, np.pi, 1e-12, np.pi - 1e-12], k),
        ]
    )
    return axes * angles[:, None]


def _same_rotation_aa(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance between axis-angles that accepts the two names of a half-turn (r and -r at pi)."""
    d = np.linalg.norm(a - b, axis=-1)
    ang = np.linalg.norm(b, axis=-1, keepdims=True)
    flipped = -b / np.where(ang == 0, 1, ang) * (2 * np.pi - ang)
    return np.minimum(d, np.linalg.norm(a - flipped, axis=-1))


@pytest.fixture(scope="module")
def aa64() -> np.ndarray:
    return _random_axis_angles(np.random.default_rng(0), N)


def test_axis_angle_to_matrix_matches_scipy(aa64):
    ours = rot.axis_angle_to_matrix(aa64)
    ref = Rotation.from_rotvec(aa64).as_matrix()
    assert ours.dtype == np.float64
    assert np.max(np.abs(ours - ref)) < 1e-12


def test_matrix_to_axis_angle_matches_scipy(aa64):
    R = Rotation.from_rotvec(aa64).as_matrix()
    ours = rot.matrix_to_axis_angle(R)
    ref = Rotation.from_matrix(R).as_rotvec()
    assert np.max(_same_rotation_aa(ours, ref)) < 1e-6
    assert np.all(np.linalg.norm(ours, axis=-1) <= np.pi + 1e-12)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_axis_angle_round_trips(aa64, dtype, tol):
    aa = aa64.astype(dtype)
    via_matrix = rot.matrix_to_axis_angle(rot.axis_angle_to_matrix(aa))
    via_rot6d = rot.rot6d_to_axis_angle(rot.axis_angle_to_rot6d(aa))
    via_quat = rot.quat_to_axis_angle(rot.axis_angle_to_quat(aa, "wxyz"), "wxyz")
    for out in (via_matrix, via_rot6d, via_quat):
        assert out.dtype == dtype
        err = _same_rotation_aa(out.astype(np.float64), aa.astype(np.float64))
        assert np.max(err) <= tol, np.max(err)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-6), (np.float32, 1e-4)])
def test_matrix_rot6d_round_trip(aa64, dtype, tol):
    R = Rotation.from_rotvec(aa64).as_matrix().astype(dtype)
    d6 = rot.matrix_to_rot6d(R)
    assert d6.shape == (N, 6) and d6.dtype == dtype
    # rot6d is the first two columns, not rows
    assert np.array_equal(d6[:, :3], R[:, :, 0]) and np.array_equal(d6[:, 3:], R[:, :, 1])
    assert np.max(np.abs(rot.rot6d_to_matrix(d6) - R)) <= tol


def test_rot6d_decode_is_gram_schmidt_on_noisy_input():
    rng = np.random.default_rng(1)
    R = Rotation.random(1000, random_state=2).as_matrix()
    noisy = rot.matrix_to_rot6d(R) * rng.uniform(0.5, 2.0, (1000, 1)) + rng.normal(0, 1e-3, (1000, 6))
    out = rot.rot6d_to_matrix(noisy)
    eye = np.broadcast_to(np.eye(3), out.shape)
    assert np.max(np.abs(out @ np.swapaxes(out, -1, -2) - eye)) < 1e-12  # orthonormal
    assert np.allclose(np.linalg.det(out), 1.0)
    b1 = noisy[:, :3] / np.linalg.norm(noisy[:, :3], axis=1, keepdims=True)
    assert np.allclose(out[:, :, 0], b1)  # first column keeps the first direction exactly


@pytest.mark.parametrize("order", ["xyzw", "wxyz"])
def test_quaternions_match_scipy_and_ignore_sign(aa64, order):
    q_xyzw = Rotation.from_rotvec(aa64).as_quat()  # scipy is xyzw
    q = q_xyzw if order == "xyzw" else q_xyzw[:, [3, 0, 1, 2]]
    ref = Rotation.from_quat(q_xyzw).as_rotvec()
    pos = rot.quat_to_axis_angle(q, order=order)
    neg = rot.quat_to_axis_angle(-q, order=order)
    assert np.max(_same_rotation_aa(pos, ref)) < 1e-6
    assert np.array_equal(pos, neg)  # antipodal-safe: q and -q give the very same result
    R = rot.quat_to_matrix(q, order=order)
    assert np.max(np.abs(R - Rotation.from_quat(q_xyzw).as_matrix())) < 1e-12
    back = rot.matrix_to_quat(R, order=order)
    # same rotation up to sign
    dots = np.abs(np.sum(back * q, axis=-1))
    assert np.max(np.abs(dots - 1)) < 1e-12


def test_quaternion_order_must_be_named():
    with pytest.raises(ValueError, match="xyzw"):
        rot.quat_to_axis_angle(np.array([0, 0, 0, 1.0]), order="xywz")


def test_shapes_and_errors():
    aa = np.zeros((2, 5, 3), np.float32)
    assert rot.axis_angle_to_matrix(aa).shape == (2, 5, 3, 3)
    assert rot.axis_angle_to_rot6d(aa).shape == (2, 5, 6)
    with pytest.raises(ValueError, match=r"\(\.\.\., 6\)"):
        rot.rot6d_to_matrix(np.zeros((4, 5)))


def test_torch_rot6d_matches_numpy_and_has_gradients():
    R = Rotation.random(64, random_state=3).as_matrix()
    d6 = rot.matrix_to_rot6d(R) + 0.01
    t = torch.tensor(d6, requires_grad=True)
    out = rot.rot6d_to_matrix_torch(t)
    assert np.allclose(out.detach().numpy(), rot.rot6d_to_matrix(d6), atol=1e-12)
    out.sum().backward()
    assert t.grad is not None and torch.isfinite(t.grad).all()
    assert np.allclose(rot.matrix_to_rot6d_torch(torch.tensor(R)).numpy(), rot.matrix_to_rot6d(R))
