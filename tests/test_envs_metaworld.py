"""MetaWorld backend, for real: reproducible episodes, observations, experts, render quality."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest

from wamkit.config import ConfigError, EnvConfig
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.envs import EpisodeSpec, check_render_quality, expand_tasks, make_env, render_info, suite_info
from wamkit.envs.suites import resolve_env_config


@pytest.fixture
def env():
    e = make_env(EnvConfig(tasks=["reach-v3", "push-v3"], image_size=64))
    yield e
    e.close()


def test_episode_spec_round_trip_and_errors():
    spec = EpisodeSpec("metaworld", "push-v3", 3, 17)
    assert EpisodeSpec.from_dict(spec.to_dict()) == spec
    assert EpisodeSpec.from_dict({"suite": "metaworld", "task": "x", "trial": "2", "seed": 4.0}).trial == 2
    with pytest.raises(ValueError, match="seed"):
        EpisodeSpec.from_dict({"suite": "metaworld", "task": "push-v3", "trial": 0})
    with pytest.raises(AttributeError):
        spec.seed = 3  # frozen


def test_suite_info_and_task_groups():
    info = suite_info("metaworld")
    assert (info.state_dim, info.action_dim, info.fps, info.max_steps) == (39, 4, 80, 500)
    assert len(info.tasks) == 50 and "reach-v3" in info.tasks
    assert len(expand_tasks("metaworld", ["MT10"])) == 10
    assert len(expand_tasks("metaworld", ["MT50", "reach-v3"])) == 50
    with pytest.raises(ConfigError, match="push-v3"):
        expand_tasks("metaworld", ["psh-v3"])
    with pytest.raises(ConfigError, match="env.suite"):
        suite_info("metaworlds")


def test_observation_layout(env):
    obs = env.reset(EpisodeSpec("metaworld", "push-v3", 0, 0))
    assert set(obs) == {image_key("corner"), OBS_STATE, TASK}
    img = obs[image_key("corner")]
    assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
    assert obs[OBS_STATE].dtype == np.float32 and obs[OBS_STATE].shape == (39,)
    assert obs[TASK] == "push the puck to the goal"
    # the goal is observable: the last three numbers are the target site of the episode
    sim = env._sims["push-v3"].env
    np.testing.assert_allclose(obs[OBS_STATE][-3:], sim._target_pos, atol=1e-6)


def test_same_spec_same_episode_in_another_env(env):
    spec = EpisodeSpec("metaworld", "push-v3", 0, 11)
    a = env.reset(spec)
    env.reset(EpisodeSpec("metaworld", "reach-v3", 1, 99))  # something else in between
    a = env.reset(spec)
    other = make_env(EnvConfig(image_size=64))
    try:
        b = other.reset(spec)
        np.testing.assert_array_equal(a[OBS_STATE], b[OBS_STATE])
        np.testing.assert_array_equal(a[image_key("corner")], b[image_key("corner")])
        for t in range(5):  # and the same actions give the same trajectory
            act = np.array([0.5, -0.3, 0.2, 1.0 if t % 2 else -1.0], np.float32)
            sa, sb = env.step(act), other.step(act)
            np.testing.assert_array_equal(sa[0][OBS_STATE], sb[0][OBS_STATE])
            assert sa[1] == sb[1]
        assert np.abs(sa[0][OBS_STATE][:3] - a[OBS_STATE][:3]).max() > 1e-3, "the hand moved"
        c = env.reset(EpisodeSpec("metaworld", "push-v3", 0, 12))
        assert np.abs(c[OBS_STATE][-3:] - a[OBS_STATE][-3:]).max() > 1e-3, "another seed, another goal"
    finally:
        other.close()


def test_corner_camera_is_upright(env):
    """The table (brown wood) fills the lower half of an upright corner view; MuJoCo renders it upside
    down because the camera's up axis points below the horizon."""
    img = env.reset(EpisodeSpec("metaworld", "push-v3", 0, 0))[image_key("corner")].astype(int)
    wood = (img[..., 0] - img[..., 2] > 40) & (img[..., 0] > img[..., 1]) & (img[..., 1] > img[..., 2])
    h = img.shape[0] // 2
    assert wood[h:].mean() > 5 * wood[:h].mean() + 0.05


@pytest.mark.parametrize("task", ["reach-v3", "push-v3"])
def test_expert_succeeds_and_terminates(env, task):
    obs = env.reset(EpisodeSpec("metaworld", task, 0, 0))
    for _ in range(env.max_steps(EpisodeSpec("metaworld", task, 0, 0))):
        action = env.expert_action(obs)
        assert action.shape == (4,) and np.all(np.abs(action) <= 1)
        obs, reward, terminated, truncated, info = env.step(action)
        assert isinstance(info["success"], bool) and isinstance(reward, float)
        if terminated or truncated:
            break
    assert terminated and info["success"] and not truncated, f"{task}: expert failed in {info['steps']} steps"


def test_truncation_and_bad_actions():
    env = make_env(EnvConfig(image_size=32, max_steps=3))
    try:
        env.reset(EpisodeSpec("metaworld", "push-v3", 0, 0))
        with pytest.raises(ValueError, match=r"action: expected shape \[4\]"):
            env.step(np.zeros(7))
        flags = [env.step(np.zeros(4))[3] for _ in range(3)]
        assert flags == [False, False, True]
        with pytest.raises(ValueError, match="suite"):
            env.reset(EpisodeSpec("libero_10", "push-v3", 0, 0))
    finally:
        env.close()
    with pytest.raises(ConfigError, match="env.cameras"):
        make_env(EnvConfig(cameras=["front"]))
    with pytest.raises(ConfigError, match="env.image_size"):
        make_env(EnvConfig(image_size=0))


def test_fast_render_differs_from_default_and_is_checked():
    spec = EpisodeSpec("metaworld", "reach-v3", 0, 0)
    imgs = {}
    for quality in ("default", "fast"):
        env = make_env(EnvConfig(image_size=48, render_quality=quality))
        try:
            imgs[quality] = env.reset(spec)[image_key("corner")]
            model = env._sims["reach-v3"].env.model
            renderer = env._sims["reach-v3"].renderer._renderer
            shadows = renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW]
            assert bool(shadows) == (quality == "default")
            assert (model.vis.quality.offsamples == 0) == (quality == "fast")
        finally:
            env.close()
    assert np.abs(imgs["default"].astype(int) - imgs["fast"].astype(int)).mean() > 1.0

    fast = resolve_env_config(EnvConfig(render_quality="fast"))
    info = {"fps": 80, "wamkit": render_info(fast)}
    check_render_quality(info, fast)
    check_render_quality(render_info(fast), fast)
    check_render_quality(
        {"fps": 10}, resolve_env_config(EnvConfig(render_quality="default"))
    )  # not recorded: passes
    with pytest.raises(ValueError, match="render_quality='fast'.*'default'"):
        check_render_quality(info, resolve_env_config(EnvConfig(render_quality="default")))


def test_a_proprioceptive_state_is_the_robots_own_and_the_expert_still_sees_everything():
    """env.state=proprio keeps MetaWorld's hand xyz and gripper opening (obs[0:4]); objects, goal and
    the previous step are left to the camera. The same seed gives the same episode as env.state=full."""
    from wamkit import embodiments

    assert suite_info("metaworld", "proprio").state_dim == 4 and suite_info("metaworld").state_dim == 39
    assert embodiments.get("metaworld").state_names_of("proprio") == ("hand_x", "hand_y", "hand_z", "gripper")
    assert suite_info("libero_10", "proprio").state_dim == 8  # LIBERO's state is the robot's own already
    full, own = make_env(EnvConfig(image_size=32)), make_env(EnvConfig(image_size=32, state="proprio"))
    try:
        spec = EpisodeSpec("metaworld", "reach-v3", 0, 5)
        a, b = full.reset(spec), own.reset(spec)
        assert b[OBS_STATE].shape == (4,)
        np.testing.assert_array_equal(b[OBS_STATE], a[OBS_STATE][:4])
        np.testing.assert_array_equal(b[image_key("corner")], a[image_key("corner")])
        for _ in range(200):  # the expert reads the full observation, not the policy's state
            act = own.expert_action(b)
            np.testing.assert_array_equal(act, full.expert_action(a))
            (a, *_), (b, _, done, _, info) = full.step(act), own.step(act)
            np.testing.assert_array_equal(b[OBS_STATE], a[OBS_STATE][:4])
            if done:
                break
        assert info["success"], "the expert reaches the goal with a proprioceptive policy state"
    finally:
        full.close()
        own.close()
    with pytest.raises(ConfigError, match="env.state: 'objects' is not one of full, proprio"):
        make_env(EnvConfig(state="objects"))
