"""A LIBERO smoke evaluation: real LIBERO envs in worker processes, the delay server's LIBERO preset
(two cameras, 8-D state, rot6d actions decoded to LIBERO's 7-D) over websockets."""

from __future__ import annotations

import importlib.util
import json

import pytest

from wamkit.config import load_config
from wamkit.eval.journal import read_journal
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import start_server_process

pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        importlib.util.find_spec("libero") is None,
        reason="LIBERO is not installed (make setup-libero installs the extra)",
    ),
]


@pytest.mark.slow  # a LIBERO evaluation (35 s)
def test_libero_smoke_eval(tmp_path):
    args = ["--model", "delay", "--preset", "libero", "--random-init", "--device", "cpu"]
    with start_server_process(args) as srv:
        cfg = load_config(
            None,
            [
                f"eval.server_url={srv.url}",
                f"eval.out_dir={tmp_path}",
                "env.suite=libero_spatial",
                "env.tasks=['0']",  # "env.tasks=0" would read as the integer 0
                "env.cameras=[agentview, wrist]",
                "env.image_size=64",
                "env.max_steps=12",
                "eval.trials=2",
                "eval.num_envs=1",  # building a LIBERO env takes tens of seconds here: one is enough
                "eval.pipeline_stages=1",
                "eval.workers=1",
                "eval.replan_interval=4",
                "eval.videos=1",
            ],
        )
        summary = run_eval(cfg, progress=False)
    records = list(read_journal(tmp_path / "episodes.jsonl").values())
    # openpi's seed rule: every trial carries the task env's seed 7 (trial t: after t earlier resets)
    assert sorted((r["trial"], r["seed"]) for r in records) == [(0, 7), (1, 7)]
    task = records[0]["task"]
    assert task.startswith("pick_up_the_black_bowl") and all(r["task"] == task for r in records)
    for r in records:  # random actions do not solve the task: each episode runs to max_steps
        assert (r["length"], r["success_once"], r["failure"]) == (12, False, "max_steps")
    assert summary["suites"]["libero_spatial"]["all"]["episodes"] == 2
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["tasks"] == [task]
    # the protocol is recorded: seed rule, the look (LIBERO's default), the simulator stack
    assert (plan["seed_rule"], plan["seed"], plan["render_quality"]) == ("openpi", 7, "default")
    for stack in (plan["stack"], summary["stack"], summary["plan"]["stack"]):
        assert (stack["libero"], stack["robosuite"], stack["mujoco"]) == ("0.1.1", "1.4.0", "3.3.0")
        assert stack["metaworld"] == "3.1.1"
    assert (tmp_path / "videos" / task / "trial0_seed7.mp4").stat().st_size > 0


@pytest.mark.slow
def test_the_documented_cpu_smoke_run(tmp_path):
    """docs/libero.md's smoke block as a user types it in a plain shell (no MUJOCO_GL, another
    working directory), run as written: the evaluation waits for the server started beside it, the
    random-init server takes LIBERO's shapes, the episode runs."""
    import os
    import sys
    from pathlib import Path

    from .child_env import run_shell_block, user_shell_env
    from .conftest import REPO

    page = (REPO / "docs" / "libero.md").read_text()
    block = page.split("test_the_documented_cpu_smoke_run -->\n```bash\n", 1)[1].split("```", 1)[0]
    env = user_shell_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the activated venv
    run = run_shell_block(block, tmp_path, env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| **libero_10** | **all** | **1** |" in run.stdout, run.stdout
    records = list(read_journal(tmp_path / "runs" / "libero_smoke" / "episodes.jsonl").values())
    assert [(r["length"], r["success_once"]) for r in records] == [(40, False)]
