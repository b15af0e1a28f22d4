"""LIBERO backend, for real (skipped, with the reason shown, only when the extra is not installed)."""

from __future__ import annotations

import importlib.util

import mujoco
import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from wamkit.config import ConfigError, EnvConfig
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.envs import EpisodeSpec, make_env, suite_info

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        importlib.util.find_spec("libero") is None,
        reason="LIBERO extra not installed: run `make setup-libero`",
    ),
]


def test_state_axis_angle_is_robosuites_not_antipodal_safe():
    """The state's axis-angle is the rotation of the eef quaternion, by robosuite's convention: q and -q
    give different vectors (the published LIBERO data was recorded that way)."""
    from wamkit.envs.libero_env import state_from_obs

    rng = np.random.default_rng(0)
    for q in Rotation.random(20, random_state=1).as_quat():  # xyzw, as robosuite gives it
        raw = {
            "robot0_eef_pos": rng.normal(size=3),
            "robot0_eef_quat": q,
            "robot0_gripper_qpos": rng.normal(size=2),
        }
        a = state_from_obs(raw)
        b = state_from_obs({**raw, "robot0_eef_quat": -q})
        assert a.dtype == np.float32 and a.shape == (8,)
        np.testing.assert_allclose(a[[0, 1, 2, 6, 7]], b[[0, 1, 2, 6, 7]])
        assert np.abs(a[3:6] - b[3:6]).max() > 1e-3  # the sign of w decides the angle: no flip
        for aa in (a[3:6], b[3:6]):
            np.testing.assert_allclose(
                Rotation.from_rotvec(aa).as_matrix(), Rotation.from_quat(q).as_matrix(), atol=1e-5
            )


def test_suite_tables():
    assert {s: suite_info(s).max_steps for s in ("libero_spatial", "libero_object", "libero_goal", "libero_10")} == {
        "libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
    }  # fmt: skip
    info = suite_info("libero_90")
    assert (len(info.tasks), info.max_steps, info.state_dim, info.action_dim, info.fps) == (90, 400, 8, 7, 20)
    assert info.cameras == ("agentview", "wrist")
    with pytest.raises(ConfigError, match="env.cameras"):
        make_env(EnvConfig(suite="libero_goal", cameras=["corner"]))


def test_goal_task_protocol_and_success_flag():
    """turn_on_the_stove: init state, settle steps, rotated cameras, 8-D state, gripper convention,
    and the success flag raised by the task's own predicate when the stove knob is really turned."""
    cfg = EnvConfig(suite="libero_goal", cameras=["agentview", "wrist"], image_size=64, render_quality="fast")
    env = make_env(cfg)
    try:
        spec = EpisodeSpec("libero_goal", "turn_on_the_stove", 0, 0)
        obs = env.reset(spec)
        assert obs[TASK] == "turn on the stove"
        assert obs[OBS_STATE].dtype == np.float32 and obs[OBS_STATE].shape == (8,)
        raw = env._raw
        for cam, rs_name in (("agentview", "agentview"), ("wrist", "robot0_eye_in_hand")):
            img = obs[image_key(cam)]
            assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
            np.testing.assert_array_equal(img, raw[f"{rs_name}_image"][::-1, ::-1])
        np.testing.assert_allclose(obs[OBS_STATE][:3], raw["robot0_eef_pos"], atol=1e-6)
        rot = Rotation.from_rotvec(obs[OBS_STATE][3:6]).as_matrix()
        np.testing.assert_allclose(rot, Rotation.from_quat(raw["robot0_eef_quat"]).as_matrix(), atol=1e-4)
        # 10 settle steps ran after the init state (robosuite counts them); none is a policy step
        assert env._env.env.timestep == 10
        ctx = env._env.sim._render_context_offscreen
        assert ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] == 0 and ctx.con.offSamples == 0

        # the same trial again: the same stored initial state
        again = env.reset(spec)
        np.testing.assert_allclose(again[OBS_STATE], obs[OBS_STATE], atol=1e-5)

        # gripper: +1 closes (the fingers move together), -1 opens
        open_width = obs[OBS_STATE][6] - obs[OBS_STATE][7]
        for _ in range(4):
            obs, _, terminated, truncated, info = env.step(np.array([0, 0, 0, 0, 0, 0, 1.0]))
        assert obs[OBS_STATE][6] - obs[OBS_STATE][7] < open_width - 0.005
        assert info == {"success": False, "steps": 4} and not terminated and not truncated

        m, d = env._env.sim.model._model, env._env.sim.data._data
        knob = m.jnt_qposadr[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, "flat_stove_1_button")]
        d.qpos[knob] = 1.0  # inside the stove's turn-on range [0.5, 2.1]
        obs, reward, terminated, truncated, info = env.step(np.zeros(7))
        assert info["success"] is True and terminated and reward == 1.0
        with pytest.raises(ValueError, match="trial must be in 0..49"):
            env.reset(EpisodeSpec("libero_goal", "turn_on_the_stove", 50, 0))
    finally:
        env.close()


@pytest.mark.slow
def test_every_libero_10_task_creates_resets_steps_and_renders():
    cfg = EnvConfig(suite="libero_10", cameras=["agentview", "wrist"], image_size=64, render_quality="fast")
    env = make_env(cfg)
    try:
        for i, task in enumerate(suite_info("libero_10").tasks):
            obs = env.reset(EpisodeSpec("libero_10", str(i), 0, 0))
            assert env._task == task
            first = obs[image_key("agentview")]
            assert first.std() > 5, f"{task}: a blank agentview image"
            obs, _, terminated, truncated, info = env.step(np.array([0.5, 0, 0, 0, 0, 0, -1.0]))
            assert info["success"] is False and not terminated and not truncated, task
            assert obs[image_key("wrist")].shape == (64, 64, 3)
    finally:
        env.close()
