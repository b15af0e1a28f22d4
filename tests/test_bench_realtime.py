"""``wamkit bench realtime`` as a user runs it: a serving directory of a flow model, the demo's
evaluation shrunk to one task and a few short episodes, every blend at two delays, one table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from wamkit.config import ModelConfig
from wamkit.models import build_model
from wamkit.models.base import ModelIO
from wamkit.models.pretrained import save_pretrained
from wamkit.serve.loading import identity_spec


@pytest.mark.slow  # six evaluations twice (35 s); make test's eval tests cover each mode
def test_bench_realtime_table(tmp_path):
    serve = tmp_path / "serve"
    io = ModelIO.of_embodiment("metaworld", state="proprio", image_size=64)
    adapter = build_model(ModelConfig(name="tiny", preset="small"), io)  # untrained: seeded actions
    save_pretrained(adapter, serve)
    identity_spec(adapter.io).save(serve / "preprocess.json")
    out = tmp_path / "bench"
    small = [
        "env.tasks=reach-v3",
        "env.max_steps=24",
        "eval.num_envs=2",
        "eval.workers=1",
        "eval.calibrate_s=0",
    ]
    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}  # as typed in the README's shell
    cmd = [
        sys.executable,
        "-m",
        "wamkit",
        "bench",
        "realtime",
        "--serve-dir",
        str(serve),
        "--trials",
        "2",
        "--delays",
        "0,4",
        "--out",
        str(out),
        *small,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((out / "realtime.json").read_text())["rows"]
    assert [(r["blend"], r["delay"]) for r in rows] == [
        (b, d) for b in ("switch", "rtc", "ensemble") for d in (0, 4)
    ]
    assert all(r["episodes"] == 2 and r["jerk_within"] >= 0 for r in rows)
    assert "| rtc | 4 | async |" in run.stdout and "| switch | 0 | sync |" in run.stdout
    plan = json.loads((out / "rtc_d4" / "plan.json").read_text())
    assert plan["execution"] == {
        "mode": "async",
        "delay_steps": 4,
        "chunk_blend": "rtc",
        "rtc_schedule": "exp",
        "rtc_max_guidance": 5.0,
    }
    # run again: every run is read back from its journal, nothing runs twice
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert again.returncode == 0 and json.loads((out / "realtime.json").read_text())["rows"] == rows
