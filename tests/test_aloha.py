"""The aloha suite against gym-aloha itself: the same episode from the same seed (state bit for bit, the
top camera's pixels), the scripted expert solving transfer_cube, ``wamkit collect`` and ``wamkit check``
as typed, and the errors of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wamkit.config import ConfigError, EnvConfig
from wamkit.constants import OBS_STATE, image_key
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.suites import make_env

from .child_env import served_tiny, user_shell_env

pytest.importorskip("gym_aloha")


def _env(task: str, size: int = 32, cameras=("top",)):
    return make_env(EnvConfig(suite="aloha", tasks=[task], cameras=list(cameras), image_size=size))


@pytest.mark.parametrize(
    "task, gym_id", [("transfer_cube", "AlohaTransferCube-v0"), ("insertion", "AlohaInsertion-v0")]
)
def test_an_episode_is_gym_alohas_episode_of_the_same_seed(task, gym_id):
    """Reset by seed and stepped by the same actions, wamkit's env and gym-aloha's ``AlohaEnv`` hold the
    same state bit for bit (the same classes run the same physics), and wamkit's 480-row ``top`` image
    is gym-aloha's 640 x 480 frame with every fourth column of each four dropped (the same renderer)."""
    import gym_aloha  # noqa: F401  (registers the envs)
    import gymnasium as gym

    theirs = gym.make(f"gym_aloha/{gym_id}", obs_type="pixels_agent_pos")
    ours = _env(task, size=480)
    try:
        seed = 3
        ref, _ = theirs.reset(seed=seed)
        obs = ours.reset(EpisodeSpec("aloha", task, 0, seed))
        np.testing.assert_array_equal(obs[OBS_STATE], ref["agent_pos"].astype(np.float32))
        cols = ((np.arange(480) + 0.5) * 640 / 480).astype(int)
        diff = np.abs(obs[image_key("top")].astype(int) - ref["pixels"]["top"][:, cols].astype(int))
        assert diff.mean() < 1.0, f"top camera differs from gym-aloha's by {diff.mean():.2f} grey levels"
        rng = np.random.default_rng(0)
        for _ in range(10):
            action = ref["agent_pos"] + rng.normal(0, 0.05, 14)
            ref, r_ref, *_ = theirs.step(action)
            obs, r, *_ = ours.step(action)
            np.testing.assert_array_equal(obs[OBS_STATE], ref["agent_pos"].astype(np.float32))
            assert r == r_ref
    finally:
        theirs.close()
        ours.close()


@pytest.mark.parametrize("task", ["transfer_cube", "insertion"])
def test_the_scripted_expert_solves_both_tasks(task):
    """The expert's joint targets, replayed in the joint-space scene, reach the task's highest reward
    (the cube held by the left gripper off the table; the peg touching the socket's pin) on seeds it is
    measured to solve (docs/aloha.md gives its rate over 300 seeds)."""
    env = _env(task, size=16)
    try:
        for seed in (0, 1):
            obs = env.reset(EpisodeSpec("aloha", task, seed, seed))
            for _ in range(env.max_steps(None)):
                obs, reward, terminated, truncated, info = env.step(env.expert_action(obs))
                if terminated or truncated:
                    break
            assert info["success"] and reward == 4, f"seed {seed}: the expert ended at reward {reward}"
    finally:
        env.close()


def test_unknown_tasks_and_cameras_name_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"env.tasks: unknown ALOHA task 'transfer'.*transfer_cube, insertion"
    ):
        _env("transfer").reset(EpisodeSpec("aloha", "transfer", 0, 0))
    with pytest.raises(
        ConfigError, match=r"env.cameras: unknown ALOHA camera 'corner' \(valid: top, angle, vis\)"
    ):
        _env("insertion", cameras=("corner",))


def _wamkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``wamkit ARGS`` as typed in the README's activated shell (no rendering variables), from ``cwd``."""
    cmd = [str(Path(sys.executable).parent / "wamkit"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=user_shell_env(), cwd=cwd)


def _tiny_server(tmp_path: Path):
    """A random-init ``tiny`` served for the aloha profile, as typed; yields its URL."""
    return served_tiny(tmp_path, "--suite", "aloha")


@pytest.mark.parametrize("task", ["transfer_cube", "insertion"])
def test_collect_writes_lerobots_aloha_features_and_check_agrees(task, tmp_path):
    """A short episode per task: LeRobot's ALOHA feature names and shapes at 50 fps, the expert's rate
    printed, and ``wamkit check`` finding the dataset in agreement with the env (gripper polarity
    measured with the profile's close command)."""
    out = tmp_path / "data"
    run = _wamkit(
        "collect", "--suite", "aloha", "--tasks", task, "--episodes", "1", "--image-size", "32",
        "--keep-failed", "--workers", "1", "--out", str(out), "env.max_steps=60", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"{task}: 0/1 expert successes" in run.stdout  # 60 steps: the plan has not finished
    info = json.loads((out / "meta" / "info.json").read_text())
    feats = info["features"]
    assert info["fps"] == 50 and info["robot_type"] == "aloha" and info["wamkit"]["gripper"] == "env"
    assert feats["observation.images.top"]["shape"] == [32, 32, 3]
    assert feats["observation.state"]["shape"] == [14] and feats["action"]["shape"] == [14]
    assert feats["observation.state"]["names"][6] == "left_gripper"
    check = _wamkit("check", str(out), "--suite", "aloha", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        "agree" in check.stdout
        and "polarity: the command the env reads as close precedes closing" in check.stdout
    )


def test_collect_refuses_a_suite_without_a_scripted_expert(tmp_path):
    from wamkit.config import RunConfig
    from wamkit.envs.collect import _check_collect

    cfg = RunConfig()
    cfg.env.suite, cfg.collect.out = "libero_10", str(tmp_path / "x")
    with pytest.raises(
        ConfigError, match=r"libero_10 has no scripted expert.*suites with one: metaworld, aloha"
    ):
        _check_collect(cfg)


def test_metaworld_data_trained_as_aloha_is_refused_in_one_line(tmp_path):
    """``wamkit train env.suite=aloha`` on a MetaWorld dataset (robot_type sawyer) stops before building
    anything, naming both embodiments' state and action sizes."""
    data = tmp_path / "mw"
    run = _wamkit(
        "collect", "--suite", "metaworld", "--tasks", "reach-v3", "--episodes", "1", "--image-size", "32",
        "--keep-failed", "--workers", "1", "--out", str(data), "env.max_steps=5", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    train = _wamkit(
        "train", "env.suite=aloha", f"data.root={data}", "model.name=tiny", "train.max_steps=1",
        f"train.run_dir={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    assert train.returncode != 0
    lines = [ln for ln in train.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, train.stderr
    assert "is metaworld data (robot_type 'sawyer', state 39, action 4)" in lines[0]
    assert "the aloha embodiment takes state 14, action 14" in lines[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.pt"))


def test_eval_one_episode_against_a_random_init_server(tmp_path):
    """docs/aloha.md's evaluation as typed: a random-init ``tiny`` served for the aloha profile, one
    short episode evaluated through the pipelined evaluator, the suite's camera taken by default; the
    same server evaluated on MetaWorld is refused naming the state and action sizes."""
    with _tiny_server(tmp_path) as url:
        common = [f"eval.server_url={url}", "env.image_size=32", "env.max_steps=10", "eval.trials=1"]
        common += ["eval.num_envs=1", "eval.videos=0", "--pipeline", "1", "--no-progress"]
        run = _wamkit("eval", "env.suite=aloha", "env.tasks=transfer_cube", f"eval.out_dir={tmp_path / 'a'}",
                      *common, cwd=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert "| aloha | transfer_cube | 1 |" in run.stdout
        wrong = _wamkit("eval", "env.tasks=reach-v3", "env.cameras=top", f"eval.out_dir={tmp_path / 'm'}",
                        *common, cwd=tmp_path)  # fmt: skip
        assert wrong.returncode != 0
        assert "state_dim: model 14, env 39; env_action_dim: model 14, env 4" in wrong.stderr


@pytest.mark.slow
def test_the_ray_executor_evaluates_aloha_as_the_local_one(tmp_path):
    """The same two episodes evaluated against one random-init server through the local executor and
    through Ray's: the same seeds, lengths, returns, outcomes and actions (their summed jerk)."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'wamkit[ray]')")
    with _tiny_server(tmp_path) as url:
        common = [f"eval.server_url={url}", "env.suite=aloha", "env.tasks=insertion", "env.image_size=32",
                  "env.max_steps=12", "eval.trials=2", "eval.num_envs=2", "eval.videos=0"]  # fmt: skip
        episodes = {}
        for executor in ("local", "ray"):
            out = tmp_path / executor
            run = _wamkit("eval", *common, f"eval.executor={executor}", f"eval.out_dir={out}", "--no-progress",
                          cwd=tmp_path)  # fmt: skip
            assert run.returncode == 0, run.stderr[-3000:]
            rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
            episodes[executor] = sorted(
                (r["seed"], r["length"], r["return"], r["success_once"], r["smoothness"]["jerk_within_sum"])
                for r in rows
            )
        assert json.loads((tmp_path / "ray" / "summary.json").read_text())["throughput"]["executor"] == "ray"
        assert [e[0] for e in episodes["local"]] == [1000, 1001]
        # the server may batch the two envs' requests together in one run and apart in the other: the
        # actions then differ by float32 roundings (a few ulps), the rest is equal
        assert [e[:4] for e in episodes["ray"]] == [e[:4] for e in episodes["local"]]
        assert [e[4] for e in episodes["ray"]] == pytest.approx([e[4] for e in episodes["local"]], rel=1e-5)
