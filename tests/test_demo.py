"""`wamkit demo` end to end in a small form: real MetaWorld, real files, a real server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
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
    "train.ema=true",
    "train.micro_batch=4",
    "train.global_batch=4",
    "data.num_workers=0",
    "eval.trials=2",
    "eval.num_envs=2",
    "eval.workers=1",
    "eval.videos=1",
]


STAGES = ("collect", "stats", "train", "export", "eval", "eval_blind", "chance", "report")


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
    for stage in STAGES:
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
    for stage in STAGES:
        assert f"[demo] {stage}: already done, skipped" in again.stdout
    assert "| reach-v3 |" in again.stdout  # the table is printed again from the finished stage


def test_demo_report_holds_the_runs_numbers(first_run):
    """report.html (and report.json beside it): the loss curve, success per task with intervals equal
    to the evaluation's summary, the blind-camera control from its own evaluation, rollout GIFs of
    filmed episodes, forward dynamics; the demo's last line points to it."""
    import re

    from PIL import Image

    out, run = first_run
    report = out / "report"
    page = (report / "report.html").read_text()
    figures = json.loads((report / "report.json").read_text())
    summary = json.loads((out / "eval" / "summary.json").read_text())
    blind = json.loads((out / "eval_blind" / "summary.json").read_text())
    assert (
        figures["overall"] == summary["all"] and figures["tasks"] == summary["suites"]["metaworld"]["tasks"]
    )
    assert figures["blind_overall"] == blind["all"]
    assert json.loads((out / "eval_blind" / "plan.json").read_text())["blank_images"] is True
    chance = json.loads((out / "stages" / "chance.done").read_text())
    assert figures["chance"]["all"] == chance["all"] and chance["all"]["episodes"] == blind["all"]["episodes"]
    c = chance["all"]
    shown = re.search(r'<b id="chance">([^<]*)</b>', page).group(1)
    assert shown.startswith(f"{100 * c['rate']:.1f}% ({c['successes']}/{c['episodes']}")
    for r, where in ((summary["all"], "overall"), (blind["all"], "blind")):
        lo, hi = r["ci95"]
        shown = re.search(rf'<b id="{where}">([^<]*)</b>', page).group(1)
        assert shown.startswith(f"{100 * r['rate']:.1f}% ({r['success_once']}/{r['episodes']}")
        assert f"{100 * lo:.1f}–{100 * hi:.1f}" in shown
    for task in summary["suites"]["metaworld"]["tasks"]:
        assert f"<td>{task}</td>" in page
    with Image.open(report / "loss.png") as img:
        assert img.size[0] > 100
    assert figures["losses"]["action_loss_first"] > 0
    assert figures["rollouts"], "no filmed episode became a GIF"
    for r in figures["rollouts"]:
        with Image.open(report / r["gif"]) as gif:
            assert gif.n_frames > 1
        assert f'src="{r["gif"]}"' in page
    fd = figures["forward_dynamics"]
    assert fd is not None, "the preset's model predicts frames"
    assert (report / "forward_dynamics.png").is_file() and fd["predictions"] > 0
    per = fd["per_prediction"]
    assert len(per) == fd["predictions"]
    assert fd["model_rmse"] == pytest.approx(np.sqrt(np.mean([p["model_mse"] for p in per])))
    assert fd["copy_error"] == pytest.approx(np.mean([p["copy_error"] for p in per]))
    assert f'<b id="fd-rmse">model {fd["model_rmse"]:.1f}</b>, copy {fd["copy_rmse"]:.1f}' in page
    assert f'<b id="fd-mae">model {fd["model_error"]:.1f}</b>, copy {fd["copy_error"]:.1f}' in page
    # the policy sees: its state is the robot's own (hand and gripper), objects and goals are not in it
    assert figures["state"] == "proprio"
    info = json.loads((out / "data" / "meta" / "info.json").read_text())
    assert info["features"]["observation.state"]["names"] == ["hand_x", "hand_y", "hand_z", "gripper"]
    assert run.stdout.rstrip().splitlines()[-1].startswith(f"Report: {report / 'report.html'}")


def test_demo_refuses_a_bad_override(tmp_path):
    run = _demo(tmp_path, "train.max_step=3")
    assert run.returncode == 2
    assert "unknown key 'train.max_step'" in run.stderr and "max_steps" in run.stderr
    assert not (tmp_path / "stages").exists()  # nothing started


def test_a_demonstration_replayed_on_its_own_seed_solves_it(first_run):
    """The chance level's replay is faithful: MetaWorld is deterministic given the seed, so the
    recorded actions of a training episode, played open loop on that episode's seed, solve it again."""
    from dataclasses import replace

    from wamkit.config import load_config
    from wamkit.constants import ACTION
    from wamkit.data import LeRobotDataset
    from wamkit.demo_report import _replays
    from wamkit.envs.collect_journal import CollectJournal

    out, _ = first_run
    cfg = load_config(out / "config.yaml")
    ds = LeRobotDataset(out / "data")
    actions, episode = ds.numeric(ACTION), ds.numeric("episode_index").reshape(-1)
    entry = next(e for e in CollectJournal(out / "data").entries if e.get("kept"))
    jobs = [(entry["task"], entry["trial"], entry["seed"], actions[episode == entry["episode_index"]])]
    assert _replays(replace(cfg.env, image_size=8), jobs) == [True]


def test_demo_serves_the_ema_of_the_trained_weights(first_run):
    """With train.ema on (SMALL sets it), the export stage serves the EMA, not the last weights."""
    import torch

    from wamkit.export.checkpoint import load_checkpoint_weights
    from wamkit.serve.loading import load_served

    out, _ = first_run
    ckpt = json.loads((out / "stages" / "train.done").read_text())["checkpoint"]
    served = load_served(out / "serve", device="cpu").adapter.module.state_dict()
    ema = load_checkpoint_weights(ckpt, ema=True).module.state_dict()
    last = load_checkpoint_weights(ckpt).module.state_dict()
    assert served.keys() == ema.keys()
    # the same float32 values, copied: equal bit for bit
    assert all(torch.equal(served[k], ema[k].to(served[k].dtype)) for k in served)
    assert not all(torch.equal(ema[k], last[k]) for k in ema), "the EMA equals the last weights"
