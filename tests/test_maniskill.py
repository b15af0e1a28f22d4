"""The maniskill suite against ManiSkill3 itself: ``wamkit collect`` as typed, its actions against what
ManiSkill's own motion-planning script and replay tool make of the same seeds, an evaluation against a
random-init server, and the errors of bad input. ManiSkill3 runs in ``.venv-maniskill`` (``make
setup-maniskill``): the project's venv starts its env workers with that Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from wamkit.config import ConfigError, EnvConfig
from wamkit.envs.suites import expand_tasks, resolve_env_config

from .child_env import served_tiny, user_shell_env
from .conftest import REPO

MANISKILL_PY = REPO / ".venv-maniskill" / "bin" / "python"
needs_maniskill = pytest.mark.skipif(
    not MANISKILL_PY.is_file(), reason="ManiSkill3's venv is built by `make setup-maniskill`"
)


def _wamkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``wamkit ARGS`` as typed in the README's activated shell (no rendering variables), from ``cwd``."""
    cmd = [str(Path(sys.executable).parent / "wamkit"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=user_shell_env(), cwd=cwd)


def _episodes(root: Path) -> dict[int, dict[str, np.ndarray]]:
    import pyarrow.parquet as pq

    out: dict[int, dict[str, list]] = {}
    for f in sorted((root / "data").rglob("*.parquet")):
        t = pq.read_table(f).to_pydict()
        for i, ep in enumerate(t["episode_index"]):
            d = out.setdefault(ep, {"action": [], "observation.state": []})
            d["action"].append(t["action"][i])
            d["observation.state"].append(t["observation.state"][i])
    return {ep: {k: np.asarray(v, np.float32) for k, v in d.items()} for ep, d in out.items()}


@needs_maniskill
def test_collect_matches_maniskills_own_planner_and_replay_tool(tmp_path):
    """``wamkit collect --suite maniskill`` as typed: two PickCube episodes (seeds 0, 1), the planner's
    rate printed, LeRobot's feature layout at ManiSkill's 20 Hz. Then ManiSkill's own tools on the same
    seeds, in its venv: ``mani_skill.examples.motionplanning.panda.run`` (the solutions, in
    ``pd_joint_pos``) and ``mani_skill.trajectory.replay_trajectory -c pd_ee_delta_pose`` (the conversion).
    Each recorded episode's actions are the converted trajectory's first actions (wamkit's episode ends
    at the first success, the tool's at the plan's end), equal to float32 roundings, and its first state
    is the tool's first ``qpos`` and ``qvel``."""
    out = tmp_path / "data"
    run = _wamkit(
        "collect", "--suite", "maniskill", "--tasks", "PickCube-v1", "--episodes", "2", "--image-size", "32",
        "--workers", "1", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "PickCube-v1: the motion planner solved 2/2 (100%)" in run.stdout, run.stdout
    assert "PickCube-v1: 2/2 expert successes (100%)" in run.stdout, run.stdout
    journal = [json.loads(line) for line in (out / "meta" / "wamkit_collect.jsonl").read_text().splitlines()]
    assert [e["planner_solved"] for e in journal] == [True, True]
    info = json.loads((out / "meta" / "info.json").read_text())
    feats = info["features"]
    assert info["fps"] == 20 and info["robot_type"] == "panda"
    assert feats["observation.images.base_camera"]["shape"] == [32, 32, 3]
    assert feats["observation.state"]["shape"] == [18] and feats["action"]["shape"] == [7]
    ours = _episodes(out)

    record = tmp_path / "ms"
    tool = [str(MANISKILL_PY), "-m"]
    env = {**user_shell_env(), "PYTHONWARNINGS": "ignore"}
    subprocess.run(
        [*tool, "mani_skill.examples.motionplanning.panda.run", "-e", "PickCube-v1", "-n", "2", "-b", "cpu",
         "--record-dir", str(record), "--traj-name", "mp"],
        check=True, capture_output=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    traj = record / "PickCube-v1" / "motionplanning" / "mp.h5"
    subprocess.run(
        [*tool, "mani_skill.trajectory.replay_trajectory", "--traj-path", str(traj), "-c", "pd_ee_delta_pose",
         "-o", "state_dict", "--save-traj", "-b", "physx_cpu"],
        check=True, capture_output=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    converted = next(traj.parent.glob("mp.state_dict.pd_ee_delta_pose.*.h5"))
    script = (
        "import h5py, json, sys, numpy as np\n"
        "f = h5py.File(sys.argv[1])\n"
        "out = {}\n"
        "for k in sorted(f, key=lambda k: int(k.split('_')[1])):\n"
        "    a = f[k]['obs']['agent']\n"
        "    out[k] = {'actions': f[k]['actions'][:].tolist(),\n"
        "              'state0': np.concatenate([a['qpos'][0], a['qvel'][0]]).tolist()}\n"
        "print(json.dumps(out))\n"
    )
    dump = subprocess.run([str(MANISKILL_PY), "-c", script, str(converted)], check=True, capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    theirs = json.loads(dump.stdout)
    assert sorted(theirs) == ["traj_0", "traj_1"]
    for ep in (0, 1):
        mine, ref = ours[ep], theirs[f"traj_{ep}"]
        ref_actions = np.asarray(ref["actions"], np.float32)
        n = len(mine["action"])
        assert 0 < n <= len(ref_actions), (n, len(ref_actions))
        np.testing.assert_allclose(mine["action"], ref_actions[:n], rtol=0, atol=1e-5)
        np.testing.assert_allclose(
            mine["observation.state"][0], np.asarray(ref["state0"], np.float32), atol=1e-6
        )


@needs_maniskill
def test_eval_one_episode_against_a_random_init_server(tmp_path):
    """docs/maniskill.md's evaluation as typed: one short PushCube episode through the pipelined
    evaluator, its workers in ManiSkill's venv (the run records that venv's mani-skill); the same server
    evaluated on MetaWorld is refused naming the state and action sizes."""
    with served_tiny(tmp_path, "--suite", "maniskill") as url:
        common = [f"eval.server_url={url}", "env.image_size=32", "env.max_steps=8", "eval.trials=1"]
        common += ["eval.num_envs=1", "eval.videos=0", "--pipeline", "1", "--no-progress"]
        run = _wamkit("eval", "env.suite=maniskill", "env.tasks=PushCube-v1", f"eval.out_dir={tmp_path / 'a'}",
                      *common, cwd=tmp_path)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert "| maniskill | PushCube-v1 | 1 |" in run.stdout
        summary = json.loads((tmp_path / "a" / "summary.json").read_text())
        assert summary["stack"]["mani-skill"] == "3.0.1" and summary["stack"]["sapien"] == "3.0.3"
        wrong = _wamkit("eval", "env.tasks=reach-v3", "env.cameras=base_camera", f"eval.out_dir={tmp_path / 'm'}",
                        *common, cwd=tmp_path)  # fmt: skip
        assert wrong.returncode != 0
        assert "state_dim: model 18, env 39; env_action_dim: model 7, env 4" in wrong.stderr


def test_unknown_tasks_and_control_modes_name_what_to_change():
    """Bad input, refused before any simulator starts (the project's venv has no ManiSkill3): a task
    without a motion-planning solution lists those with one; a control mode names whether the
    demonstrations could be converted to it, and the one to set; another suite takes none."""
    with pytest.raises(ConfigError, match=r"'OpenCabinetDrawer-v1' is not a ManiSkill3 task with a motion-planning "
                       r"solution \(valid: PickCube-v1, StackCube-v1, PegInsertionSide-v1, PushCube-v1"):  # fmt: skip
        expand_tasks("maniskill", ["OpenCabinetDrawer-v1"])
    with pytest.raises(ConfigError, match=r"did you mean 'PickCube-v1'"):
        expand_tasks("maniskill", ["PickCube-v2"])
    cfg = EnvConfig(suite="maniskill", tasks=["PickCube-v1"], cameras=["base_camera"])
    cfg.control_mode = "pd_ee_pose"
    with pytest.raises(ConfigError, match=r"env.control_mode: 'pd_ee_pose': the planners' pd_joint_pos "
                       r"demonstrations cannot be converted to it.*set env.control_mode=pd_ee_delta_pose"):  # fmt: skip
        resolve_env_config(cfg)
    cfg.control_mode = "pd_ee_delta_pos"
    with pytest.raises(ConfigError, match=r"can convert .* to it, but the maniskill suite's action layout is "
                       r"pd_ee_delta_pose's 7 numbers"):  # fmt: skip
        resolve_env_config(cfg)
    cfg.control_mode = "pd_ee_delta_pose"
    assert resolve_env_config(cfg).control_mode == "pd_ee_delta_pose"
    with pytest.raises(ConfigError, match=r"metaworld acts in one control mode.*env.control_mode=auto"):
        resolve_env_config(EnvConfig(control_mode="pd_ee_delta_pose"))


def test_a_missing_maniskill_venv_is_named_with_the_command_that_builds_it(monkeypatch, tmp_path):
    """Where neither ``$WAMKIT_MANISKILL_PYTHON``, this Python nor the checkout's ``.venv-maniskill`` has
    ManiSkill3, the worker is not started: the error names ``make setup-maniskill``; a variable naming
    no Python is refused by name."""
    from wamkit.envs import maniskill_env

    monkeypatch.setattr(maniskill_env, "_repo_venv_python", lambda: tmp_path / "none" / "python")
    monkeypatch.delenv(maniskill_env.PYTHON_VAR, raising=False)
    if maniskill_env.importlib.util.find_spec("mani_skill") is None:
        with pytest.raises(ConfigError, match=r"make setup-maniskill.*WAMKIT_MANISKILL_PYTHON"):
            maniskill_env.worker_python()
    monkeypatch.setenv(maniskill_env.PYTHON_VAR, str(tmp_path / "nopython"))
    with pytest.raises(ConfigError, match=r"WAMKIT_MANISKILL_PYTHON=.*nopython: no such Python"):
        maniskill_env.worker_python()


def _gpu_cfg(url: str, out: Path, *extra: str):
    from wamkit.config import load_config

    return load_config(None, [
        f"eval.server_url={url}", f"eval.out_dir={out}", "env.suite=maniskill", "env.tasks=[PickCube-v1]",
        "env.cameras=[base_camera]", "env.image_size=32", "env.max_steps=6", "eval.trials=3",
        "eval.num_envs=2", "eval.workers=2", "eval.pipeline_stages=2", "eval.replan_interval=4",
        "eval.videos=1", "eval.calibrate_s=0", *extra,
    ])  # fmt: skip


@needs_maniskill
def test_the_gpu_executor_runs_the_process_executors_episodes(tmp_path):
    """``eval.executor=gpu`` on ManiSkill's CPU simulator (one sub-scene a worker: this machine has no
    CUDA; the host factory is the only change), through docs/maniskill.md's dry run of ``wamkit bench
    gpu-sim`` as typed: the same episodes as the process executor, each started from its seed's state
    (lengths equal; returns within float32 roundings, the batched env's states being ManiSkill's own set
    from the CPU env's), the horizon reached mid-chunk (6 steps, chunks of 4), one stage per worker; then
    ``--resume`` after a lost journal record runs that episode alone, to the same return (an episode is
    named by its seed alone)."""
    from wamkit.eval.journal import read_journal

    out, runs = tmp_path / "gs.json", tmp_path / "runs"
    flags = ["--num-envs", "2", "--stages", "2", "--workers", "2", "--sim", "physx_cpu", "--image-size", "32",
             "--max-steps", "6", "--replan-interval", "4", "--episodes-per-env", "2"]  # fmt: skip
    run = _wamkit(
        "bench", "gpu-sim", *flags, "--device", "cpu", "--json", str(out), "--out", str(runs), cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["complete"] and [r["executor"] for r in result["runs"]] == ["local", "gpu"]
    assert all(r["env_steps"] == 24 and r["episodes"] == 4 for r in result["runs"])
    assert "| 2 |" in run.stdout and "x |" in run.stdout
    local = read_journal(runs / "local_2" / "episodes.jsonl")
    journal = runs / "gpu_2" / "episodes.jsonl"
    gpu = read_journal(journal)
    assert sorted(local) == sorted(gpu) and len(gpu) == 4
    for key, r in gpu.items():
        assert r["length"] == local[key]["length"] == 6 and r["failure"] == "max_steps"
        assert r["return"] == pytest.approx(local[key]["return"], abs=1e-3)
        assert r["worker"] == r["stage"]  # by stage: a worker steps one stage's envs

    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))  # a crash before the last episode was written
    # resumed from the bench's own config, in a process of the README's shell as the bench ran (the stack
    # a run records is that process's)
    resume = (
        "from wamkit.envs.base import use_headless_gl; use_headless_gl()  # as every wamkit command does\n"
        "import sys; from pathlib import Path; from wamkit.bench.gpu_sim import add_arguments, eval_config, host_factory\n"
        "import argparse; from wamkit.eval.runner import run_eval\n"
        "p = argparse.ArgumentParser(); add_arguments(p); args = p.parse_args(sys.argv[3:])\n"
        "cfg = eval_config(sys.argv[1], Path(sys.argv[2]), args, 2, 'gpu')\n"
        "run_eval(cfg, resume=True, progress=False, host_factory=host_factory(args, 'gpu'))\n"
    )
    with served_tiny(tmp_path, "--suite", "maniskill") as url:
        again = subprocess.run([sys.executable, "-c", resume, url, str(runs / "gpu_2"), *flags], capture_output=True,
                               text=True, timeout=600, env=user_shell_env(), cwd=tmp_path)  # fmt: skip
        assert again.returncode == 0, again.stderr[-2000:]
    assert len(journal.read_text().splitlines()) == 4  # only the lost episode ran again
    assert {k: r["return"] for k, r in read_journal(journal).items()} == {
        k: r["return"] for k, r in gpu.items()
    }
    bad = _wamkit("bench", "gpu-sim", "--num-envs", "4", "--stages", "2", "--sim", "physx_cpu", cwd=tmp_path)
    assert bad.returncode != 0 and "--num-envs must be --stages (2)" in bad.stderr


def test_the_gpu_executor_refuses_what_it_cannot_run(tmp_path):
    """One line naming what to change, before any worker starts: a suite without a GPU simulator, a task
    whose episode is not all in ManiSkill's simulation state, two tasks in one run, a stage count other
    than the worker count, and (on a machine without CUDA) the GPU itself."""
    from wamkit.eval.runner import start_env_workers

    url, out = "ws://127.0.0.1:9", tmp_path / "x"
    with pytest.raises(ConfigError, match=r"suite 'metaworld' has no GPU simulator .*eval.executor=local"):
        start_env_workers(eval_cfg := _gpu_cfg(url, out, "env.suite=metaworld", "env.tasks=[reach-v3]",
                                                "env.cameras=[corner]", "eval.executor=gpu"))  # fmt: skip
    assert eval_cfg.eval.executor == "gpu"
    with pytest.raises(ConfigError, match=r"PegInsertionSide-v1 keep part of an episode outside .*GPU executor "
                       r"tasks: PickCube-v1, StackCube-v1"):  # fmt: skip
        start_env_workers(_gpu_cfg(url, out, "env.tasks=[PegInsertionSide-v1]", "eval.executor=gpu"))
    with pytest.raises(
        ConfigError, match=r"one task per run .*evaluate PickCube-v1, PushCube-v1 one at a time"
    ):
        start_env_workers(_gpu_cfg(url, out, "env.tasks=[PickCube-v1,PushCube-v1]", "eval.executor=gpu"))
    with pytest.raises(ConfigError, match=r"set eval.pipeline_stages=2 to match eval.workers=2"):
        _gpu_cfg(url, out, "eval.executor=gpu", "eval.pipeline_stages=1")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(
            ConfigError, match=r"eval.executor=gpu: no CUDA device here .*eval.executor=local"
        ):
            start_env_workers(_gpu_cfg(url, out, "eval.executor=gpu"))
