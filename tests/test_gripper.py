"""Gripper conventions: the maps to the env command, and detection from a dataset's actions."""

import numpy as np
import pytest

from wamkit.actions.gripper import CONVENTIONS, GripperError, detect_gripper, get_convention


def test_open_1_is_rlinf_mapping():
    # RLinf maps a Cosmos3 LIBERO output g (1 = open) to the env by -sign(2g - 1); 0.5 opens.
    g = np.array([0.0, 0.2, 0.5, 0.8, 1.0])
    assert get_convention("open_1").to_env(g).tolist() == [1.0, 1.0, -1.0, -1.0, -1.0]
    assert get_convention("open_1").from_env(np.array([-1.0, 1.0])).tolist() == [1.0, 0.0]


def test_close_1_and_env():
    assert get_convention("close_1").to_env(np.array([0.0, 1.0])).tolist() == [-1.0, 1.0]
    g = np.array([-1.0, -0.3, 0.7, 1.0], np.float32)
    out = get_convention("env").to_env(g)
    assert out.dtype == np.float32 and np.array_equal(out, g)


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_round_trip_of_env_commands(name):
    conv = get_convention(name)
    cmds = np.array([-1.0, 1.0, 1.0, -1.0])
    assert np.array_equal(conv.to_env(conv.from_env(cmds)), cmds)


def test_unknown_name_is_named():
    with pytest.raises(GripperError, match="'flip'.*env, open_1, close_1"):
        get_convention("flip")


def _episode(open_value: float, close_value: float, n: int = 200, seed: int = 0):
    """A gripper that alternates open/close commands; the finger width follows one step later."""
    rng = np.random.default_rng(seed)
    closing = (np.arange(n) // 20) % 2 == 1
    g = np.where(closing, close_value, open_value)
    width = np.empty(n)
    width[0] = 0.08
    for t in range(1, n):
        step = -0.01 if closing[t - 1] else 0.01
        width[t] = np.clip(width[t - 1] + step + rng.normal(0, 1e-4), 0.0, 0.08)
    return g, width


def test_detect_range_and_polarity():
    g, w = _episode(-1.0, 1.0)
    assert detect_gripper(g, w)[0] == "env"
    g, w = _episode(1.0, 0.0)
    name, why = detect_gripper(g, w)
    assert name == "open_1" and "opening" in why
    g, w = _episode(0.0, 1.0)
    name, why = detect_gripper(g, w)
    assert name == "close_1" and "closing" in why
    name, why = detect_gripper(g)  # no finger state: the published [0, 1] convention, said so
    assert name == "open_1" and "assuming" in why


def test_detect_passes_unknown_channels_through():
    name, why = detect_gripper(np.array([0.0, 2.0]))
    assert name == "env" and "passed through unchanged" in why
    with pytest.raises(GripperError, match="no gripper values"):
        detect_gripper(np.array([]))
