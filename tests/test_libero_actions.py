"""LIBERO action conversions, gripper conventions and relative/absolute chunks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from wamkit.actions import pose as libero


def _actions(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rv = Rotation.random(n, random_state=seed).as_rotvec()
    return np.concatenate([rng.normal(size=(n, 3)), rv, rng.choice([-1.0, 1.0], (n, 1))], axis=1)


@pytest.mark.parametrize("shape", [(7,), (50, 7), (4, 16, 7)])
def test_rot6d_action_round_trip(shape):
    a7 = _actions(int(np.prod(shape[:-1])) or 1).reshape(shape)
    a10 = libero.to_rot6d_action(a7)
    assert a10.shape == shape[:-1] + (10,)
    assert np.array_equal(a10[..., :3], a7[..., :3]) and np.array_equal(a10[..., 9], a7[..., 6])
    back = libero.from_rot6d_action(a10)
    assert np.max(np.abs(back - a7)) < 1e-9


def test_rot6d_action_on_the_upstream_fixture(libero_tiny):
    """The fixture's true actions (written by lerobot) survive the 7 -> 10 -> 7 round trip."""
    truth = [json.loads(line) for line in (libero_tiny.parent / "libero_tiny.truth.jsonl").open()]
    a7 = np.array([t["action"] for t in truth], np.float32)
    back = libero.from_rot6d_action(libero.to_rot6d_action(a7))
    assert back.dtype == np.float32
    # the fixture stores axis-angles with |r| up to ~pi; compare the rotations they name
    R_in = Rotation.from_rotvec(a7[:, 3:6].astype(np.float64)).as_matrix()
    R_out = Rotation.from_rotvec(back[:, 3:6].astype(np.float64)).as_matrix()
    assert np.max(np.abs(R_in - R_out)) < 1e-5
    assert np.array_equal(back[:, [0, 1, 2, 6]], a7[:, [0, 1, 2, 6]])


def test_wrong_width_is_named():
    with pytest.raises(ValueError, match=r"\(\.\.\., 7\)"):
        libero.to_rot6d_action(np.zeros((3, 10)))


def test_relative_absolute_chunks_round_trip():
    rng = np.random.default_rng(3)
    chunk = _actions(16, seed=4)
    chunk[:, 3:6] *= 0.1  # small per-step rotations, as a controller would command
    start_pos = rng.normal(size=3)
    start_rot = Rotation.random(random_state=5).as_matrix()
    absolute = libero.relative_chunk_to_absolute(start_pos, start_rot, chunk)
    assert absolute.shape == (16, 10)
    # independent check of the composition with scipy: R_t = dR_t ... dR_1 R_0
    R = Rotation.from_matrix(start_rot)
    for t in range(16):
        R = Rotation.from_rotvec(chunk[t, 3:6]) * R
    assert np.allclose(absolute[-1, 3:9], np.concatenate([R.as_matrix()[:, 0], R.as_matrix()[:, 1]]))
    assert np.allclose(absolute[-1, :3], start_pos + chunk[:, :3].sum(0))
    back = libero.absolute_chunk_to_relative(start_pos, start_rot, absolute)
    assert np.max(np.abs(back - chunk)) < 1e-9
