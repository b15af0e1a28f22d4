"""`wamkit demo` end to end in a small form: real MetaWorld, real files, a real server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SMALL = [
    "env.tasks=reach-v3",
    "env.max_steps=100",
    "collect.episodes=2",
    "collect.workers=1",
    "train.max_steps=6",
    "train.save_interval=3",
    "train.log_interval=3",
    "train.warmup_steps=1",
    "train.micro_batch=4",
    "train.global_batch=4",
    "data.num_workers=0",
    "eval.trials=2",
    "eval.num_envs=2",
    "eval.workers=1",
    "eval.videos=1",
]


def _demo(out, *extra, python=sys.executable):
    """The demo with its default (packaged) preset, run from ``out``: with ``python`` the installed
    wheel's (the first run below), outside the source checkout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(python), "-m", "wamkit", "demo", *SMALL, *extra, "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=out)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, installed_wheel):
    out = tmp_path_factory.mktemp("demo")
    return out, _demo(out, python=installed_wheel)


def test_demo_runs_every_stage_and_skips_finished_ones(first_run):
    out, run = first_run
    assert run.returncode == 0, run.stderr[-3000:]
    for stage in ("collect", "stats", "train", "export", "eval"):
        assert (out / "stages" / f"{stage}.done").is_file(), stage
    # the outputs a user is pointed at exist and hold what they claim
    assert (out / "data" / "meta" / "info.json").is_file()
    assert json.loads((out / "stats.json").read_text())["metadata"]["fps"] == 80
    assert {"model.safetensors", "model.json", "preprocess.json"} <= {
        p.name for p in (out / "serve").iterdir()
    }
    summary = json.loads((out / "eval" / "summary.json").read_text())
    assert summary["all"]["episodes"] == 2
    assert list((out / "eval" / "videos").rglob("*.mp4"))
    assert list((out / "train" / "tb").rglob("events.out.tfevents.*"))
    assert "| reach-v3 |" in run.stdout and "expert success" in run.stdout
    assert "env-steps/s" in run.stdout and "bound" in run.stdout

    again = _demo(out)
    assert again.returncode == 0, again.stderr[-3000:]
    for stage in ("collect", "stats", "train", "export", "eval"):
        assert f"[demo] {stage}: already done, skipped" in again.stdout
    assert "| reach-v3 |" in again.stdout  # the table is printed again from the finished stage


def test_demo_refuses_a_bad_override(tmp_path):
    run = _demo(tmp_path, "train.max_step=3")
    assert run.returncode == 2
    assert "unknown key 'train.max_step'" in run.stderr and "max_steps" in run.stderr
    assert not (tmp_path / "stages").exists()  # nothing started
