"""``lerobot-eval`` on wamkit's env (the plug-in ``wamkit.envs.lerobot_plugin``) and ``wamkit bench
lerobot-eval``, which runs it beside ``wamkit eval`` on one LeRobot folder. In .venv-lerobot, as
tests/test_lerobot_policies.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lerobot = pytest.importorskip("lerobot")  # tests/conftest.py leaves this file out where it is missing

from tests.child_env import child_env  # noqa: E402
from wamkit.actions.spec import PreprocessSpec  # noqa: E402
from wamkit.actions.stats import FeatureStats, StatsFile  # noqa: E402
from wamkit.config import ModelConfig  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.base import ModelIO  # noqa: E402

# the demo's env: MetaWorld, the corner camera at 64 px, the robot's state (hand xyz, gripper)
IO = ModelIO(cameras=("corner",), image_size=64, state_dim=4, action_dim=4, chunk=16)
TASK = "drawer-open-v3"


def _folder(path: Path) -> Path:
    """A small ACT for the demo's env (random weights) exported as a LeRobot folder, its processors
    normalising by mean and std over statistics of MetaWorld's range."""
    adapter = build_model(
        ModelConfig(name="lerobot", preset="act", options={"dim_model": 64, "dim_feedforward": 128,
                                                           "n_encoder_layers": 2, "n_vae_encoder_layers": 1}),
        IO,
    )  # fmt: skip

    def feature(mean: list[float], std: list[float]) -> FeatureStats:
        lo = [m - 3 * s for m, s in zip(mean, std, strict=True)]
        hi = [m + 3 * s for m, s in zip(mean, std, strict=True)]
        return FeatureStats(mean, std, lo, hi, lo, hi, 100)

    stats = StatsFile(
        {
            "action": feature([0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.8]),
            "observation.state": feature([0.0, 0.6, 0.15, 0.5], [0.1, 0.1, 0.05, 0.3]),
        },
        {"representation": "raw", "chunk": IO.chunk, "action_dim": IO.action_dim, "gripper": "env"},
    )
    spec = PreprocessSpec.create(stats, normalization="mean_std", clip=False, image_size=64,
                                 resize="bilinear_antialias", cameras=IO.cameras, chunk=IO.chunk)  # fmt: skip
    adapter.export_extra(path, spec=spec)
    return path


def test_the_plugin_env_gives_wamkits_episode_as_lerobot_sees_it():
    """LeRobot's env factory builds the ``wamkit`` type from the plug-in; its first observation is wamkit's
    env's for the same seed (the same pixels and state), in LeRobot's key layout, and a step agrees too."""
    import lerobot.envs.configs as configs
    from lerobot.envs.factory import make_env
    from lerobot.envs.utils import preprocess_observation

    import wamkit.envs.lerobot_plugin  # noqa: F401  (registers the env type, as --env.discover_packages_path does)
    from wamkit.config import load_config
    from wamkit.envs.base import EpisodeSpec
    from wamkit.envs.suites import make_env as make_wamkit_env

    cfg = configs.EnvConfig.get_choice_class("wamkit")(task=TASK, config="demo")
    assert cfg.features_map["pixels/corner"] == "observation.images.corner"
    vec = make_env(cfg, n_envs=1)[TASK][0]
    obs, _ = vec.reset(seed=[1003])
    assert list(vec.call("task_description")) == ["open the drawer"]
    mine = make_wamkit_env(load_config("demo").env)
    try:
        want = mine.reset(EpisodeSpec("metaworld", TASK, 3, 1003))
        batch = preprocess_observation(obs)
        assert np.array_equal(obs["pixels"]["corner"][0], want["observation.images.corner"])
        assert np.array_equal(obs["agent_pos"][0], want["observation.state"])
        assert batch["observation.images.corner"].shape == (1, 3, 64, 64)
        action = np.array([0.3, -0.2, 0.1, 0.5], dtype=np.float32)
        obs, reward, terminated, truncated, info = vec.step(action[None])
        want, want_reward, *_ = mine.step(action)
        assert np.array_equal(obs["agent_pos"][0], want["observation.state"]) and reward[0] == want_reward
        assert not info["is_success"][0] and vec.call("_max_episode_steps")[0] == 300
    finally:
        vec.close()
        mine.close()


def test_bench_lerobot_eval_runs_both_evaluators_on_the_same_episodes(tmp_path):
    """``wamkit bench lerobot-eval`` as a user types it (another working directory, no MUJOCO_GL):
    LeRobot's evaluator and wamkit's on one folder, the same seeds, the same trajectories (returns within
    the bench's 1e-3: 20 steps of a policy whose two runs differ by float32 roundings)."""
    folder = _folder(tmp_path / "act")
    out = tmp_path / "bench"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("wamkit")), "bench", "lerobot-eval", "--policy", str(folder),
         "--trials", "2", "--envs", "2", "--out", str(out), f"env.tasks=[{TASK}]", "env.max_steps=20"],
        cwd=tmp_path, env=child_env(user_shell=True), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| lerobot-eval | 2 |" in run.stdout and "| wamkit eval | 2 |" in run.stdout
    result = json.loads((out / "lerobot_eval.json").read_text())
    assert result["episodes"] == 2 and result["same_success"] == 2 and result["same_return"] == 2
    theirs = json.loads((out / "lerobot" / "eval_info.json").read_text())["per_task"][0]["metrics"]
    mine = [json.loads(line) for line in (out / "wamkit" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["seed"] for e in mine) == [1000, 1001] and all(e["length"] == 20 for e in mine)
    by_seed = {e["seed"]: e["return"] for e in mine}
    np.testing.assert_allclose([by_seed[1000], by_seed[1001]], theirs["sum_rewards"], rtol=1e-3)
    assert len({round(r, 3) for r in theirs["sum_rewards"]}) == 2  # two different episodes


def test_bench_lerobot_eval_runs_lerobots_own_aloha_env(tmp_path):
    """On ALOHA, ``lerobot-eval`` runs LeRobot's own ``--env.type=aloha`` (gym-aloha's AlohaEnv at 480 x
    640) beside ``wamkit eval`` on the same seed: both run the episode to the same length, and the
    bench says why their pixels, and so their episodes, differ. One env (``--envs 1``) is taken as it
    is: the bench does not answer with the config's pipeline stages."""
    pytest.importorskip("gym_aloha")
    io = ModelIO(cameras=("top",), image_size=32, state_dim=14, action_dim=14, chunk=10)
    adapter = build_model(
        ModelConfig(name="lerobot", preset="act", options={"dim_model": 32, "dim_feedforward": 64,
                                                           "n_encoder_layers": 1, "n_vae_encoder_layers": 1}),
        io,
    )  # fmt: skip
    moments = FeatureStats([0.0] * 14, [0.5] * 14, [-1.5] * 14, [1.5] * 14, [-1.5] * 14, [1.5] * 14, 100)
    stats = StatsFile(
        {"action": moments, "observation.state": moments},
        {"representation": "raw", "chunk": io.chunk, "action_dim": 14, "gripper": "env"},
    )
    spec = PreprocessSpec.create(stats, normalization="mean_std", clip=False, image_size=32,
                                 resize="bilinear_antialias", cameras=io.cameras, chunk=io.chunk)  # fmt: skip
    folder = tmp_path / "act"
    adapter.export_extra(folder, spec=spec)
    out = tmp_path / "bench"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("wamkit")), "bench", "lerobot-eval", "--policy", str(folder),
         "--trials", "1", "--envs", "1", "--out", str(out), "env.suite=aloha", "env.tasks=[insertion]",
         "env.cameras=[top]", "env.image_size=32", "env.max_steps=8"],
        cwd=tmp_path, env=child_env(user_shell=True), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| lerobot-eval | 1 |" in run.stdout and "| wamkit eval | 1 |" in run.stdout
    assert "LeRobot's own --env.type=aloha: LeRobot's aloha env renders 480 x 640 frames" in run.stdout
    result = json.loads((out / "lerobot_eval.json").read_text())
    assert result["episodes"] == 1 and result["tasks"] == ["insertion"]
    info = json.loads((out / "lerobot" / "eval_info.json").read_text())
    assert sum(len(t["metrics"]["successes"]) for t in info["per_task"]) == 1
    mine = [json.loads(line) for line in (out / "wamkit" / "episodes.jsonl").read_text().splitlines()]
    # one env: the bench runs wamkit's evaluation in one pipeline stage (the config's two need two envs)
    assert [e["seed"] for e in mine] == [1000] and all(e["length"] == 8 for e in mine)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "nowhere"], "--policy: nowhere is not a LeRobot pretrained folder"),
        (["--trials", "3", "--envs", "2"], "--trials 3 is not a multiple of --envs 2"),
        (["env.image_size=96"], "cameras ['corner'] at 64 px; the config's env has env.cameras=['corner'] at env.image_size=96"),
    ],
)  # fmt: skip
def test_bench_lerobot_eval_refuses_bad_input_naming_it(tmp_path, args, message):
    folder = _folder(tmp_path / "act")
    argv = ["bench", "lerobot-eval", "--policy", str(folder), "--out", str(tmp_path / "b"), *args]
    run = subprocess.run(
        [str(Path(sys.executable).with_name("wamkit")), *argv],
        cwd=tmp_path, env=child_env(user_shell=True), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0 and message in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "b" / "lerobot").exists()
