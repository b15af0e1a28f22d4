"""The demo's report from a real run: MetaWorld data collected, a world model trained a few steps and
converted, a real evaluation of it (its own server process), the forward-dynamics picture rendered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.eval.video import VideoBudget

WAMKIT = Path(sys.executable).parent / "wamkit"
TASKS = "reach-v3,button-press-topdown-v3"
SMALL = ["env.image_size=32", f"env.tasks=[{TASKS}]"]


def _wamkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}
    return subprocess.run([str(WAMKIT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """data/, train/ (4 steps of the demo's world model), serve/ and ev/ (2 trials a task, 12 steps)."""
    root = tmp_path_factory.mktemp("report")
    steps = [
        ("collect", "--config", "demo", "--tasks", TASKS, "--episodes", "2", "--workers", "1",
         "--image-size", "32", "--out", "data"),
        ("train", "demo", *SMALL, "data.root=data", "train.run_dir=train", "train.max_steps=4",
         "train.save_interval=4", "train.log_interval=2", "train.micro_batch=4", "train.global_batch=4"),
        ("convert", "train", "--out", "serve"),
        ("eval", "demo", *SMALL, "eval.serve_dir=serve", "eval.out_dir=ev", "eval.trials=2",
         "eval.num_envs=2", "eval.workers=1", "eval.pipeline_stages=1", "env.max_steps=12",
         "eval.calibrate_s=0.5"),
    ]  # fmt: skip
    for args in steps:
        done = _wamkit(*args, cwd=root)
        assert done.returncode == 0, (args[0], done.stderr[-3000:])
    return root


def test_a_task_keeps_videos_of_both_outcomes_within_its_budget():
    budget = VideoBudget(2)
    assert [budget.keep("a", True), budget.keep("a", True), budget.keep("a", False)] == [True, False, True]
    assert not budget.film("a", 0) and not budget.keep("a", False)  # full: two videos
    assert budget.film("b", 7) and not budget.film("b", 8)  # candidates: the first 4 x 2 trials
    one = VideoBudget(1)
    assert one.keep("a", False) and not one.keep("a", True)
    resumed = VideoBudget(2, [{"task": "a", "success_once": False, "video": "v.mp4"}])
    assert not resumed.keep("a", False) and resumed.keep("a", True)


@pytest.mark.slow  # its fixture trains and evaluates the demo's model (about a minute with the next test)
def test_the_evaluation_films_failures_within_its_budget(run):
    """An untrained policy fails every episode: each task keeps one failure (half of eval.videos=2;
    the other half waits for a success), and the journal names exactly the videos on disk."""
    from wamkit.eval.journal import read_journal

    records = list(read_journal(run / "ev" / "episodes.jsonl").values())
    assert len(records) == 4 and not any(r["success_once"] for r in records)
    named = sorted(r["video"] for r in records if r.get("video"))
    on_disk = sorted(str(p.relative_to(run / "ev")) for p in (run / "ev" / "videos").rglob("*.mp4"))
    assert named == on_disk and sorted(Path(v).parent.name for v in named) == sorted(TASKS.split(","))


@pytest.mark.slow  # the same trained run as the test above
def test_the_report_lays_out_forward_dynamics_on_a_screen_and_explains_its_errors(run):
    from PIL import Image

    from wamkit.config import load_config
    from wamkit.demo_report import forward_dynamics, write_report

    cfg = load_config("demo", [*SMALL, f"train.run_dir={run / 'train'}", f"eval.out_dir={run / 'ev'}"])
    png = run / "out" / "report" / "forward_dynamics.png"
    fd = forward_dynamics(cfg, run / "serve", png, per_task=2, starts=(0, 4, 8, 12))
    assert fd is not None and fd["predictions"] == 16  # 2 tasks x 2 seeds x 4 starts
    labels = [e["label"] for e in fd["episodes"]]
    assert len(set(labels)) == 4 and all(f"seed {e['seed']}" in e["label"] for e in fd["episodes"])
    assert {p["seed"] for p in fd["per_prediction"]} == {1000, 1001}
    with Image.open(png) as img:
        width, height = img.size
    assert width <= 1920 and height <= 1080 and width > height, img.size  # 4 rows of 12 panels

    evaluated = json.loads((run / "ev" / "summary.json").read_text())
    page = write_report(run / "out", cfg, evaluated, None, {}, fd).read_text()
    assert page.count('<figure class="fail">') == 2 and '<figure class="ok">' not in page
    assert "0 success(es) and 2 failure(s) filmed" in page
    meaning = page.split('<ul id="fd-meaning">')[1].split("</ul>")[0]
    rmse, mae = meaning.split("<b>Mean absolute</b>")
    closer = "the model is closer than the copy"
    assert (closer in rmse) == (fd["model_rmse"] < fd["copy_rmse"])
    assert (closer in mae) == (fd["model_error"] < fd["copy_error"])
    assert "lose to the copy" in mae and "minimises" in rmse
