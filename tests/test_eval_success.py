"""Metrics, journal and reports of the evaluator, against independent references and real files."""

from __future__ import annotations

import json

import pytest
from scipy.stats import binomtest

from wamkit.config import ConfigError
from wamkit.eval.journal import Journal, read_journal, record_key
from wamkit.eval.report import markdown_table, throughput, throughput_line, write_reports
from wamkit.eval.success import summarize, wilson_interval


@pytest.mark.parametrize("k,n", [(0, 1), (0, 10), (3, 10), (7, 20), (10, 10), (481, 500), (250, 500)])
def test_wilson_matches_scipy(k, n):
    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(ref.low, abs=1e-12)
    assert hi == pytest.approx(ref.high, abs=1e-12)


def test_wilson_at_500_episodes_is_about_two_points():
    lo, hi = wilson_interval(475, 500)  # 95%, the REFERENCE.md figure of about +-1.9 points
    assert 0.035 < hi - lo < 0.04
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


def rec(task, trial, once, end=None, length=10, ret=1.0, suite="metaworld"):
    return {
        "suite": suite,
        "task": task,
        "trial": trial,
        "seed": 1000 + trial,
        "success_once": once,
        "success_at_end": once if end is None else end,
        "length": length,
        "return": ret,
        "failure": "" if once else "max_steps",
    }


def test_summarize_per_task_and_suite():
    records = [rec("a", t, t < 3) for t in range(4)] + [
        rec("b", t, t == 0, end=False, length=20) for t in range(2)
    ]
    s = summarize(records)
    a, b, all_ = s["suites"]["metaworld"]["tasks"]["a"], s["suites"]["metaworld"]["tasks"]["b"], s["all"]
    assert (a["episodes"], a["success_once"], a["rate"]) == (4, 3, 0.75)
    assert (b["success_once"], b["success_at_end"], b["mean_length"]) == (1, 0, 20.0)
    assert s["suites"]["metaworld"]["all"]["rate"] == pytest.approx(4 / 6)
    assert all_["ci95"] == pytest.approx(list(wilson_interval(4, 6)))
    table = markdown_table(s)
    assert "| metaworld | a | 4 | 75.0 |" in table and "**66.7**" in table
    assert "execution:" not in table  # the default (sync, each chunk replacing the last) goes unsaid
    # an async run's table says how its actions were executed (plan.json's execution), and under RTC
    # that its efficiency means little
    s["plan"] = {"execution": {"mode": "async", "delay_steps": 2, "chunk_blend": "rtc", "rtc_schedule": "exp",
                               "rtc_max_guidance": 5.0}}  # fmt: skip
    s["throughput"] = throughput({"wall": 10.0, "sim": 8.0, "infer": 6.0, "workers": 2, "env_steps": 100,
                                  "bound_sim": 4.0, "bound_infer": 5.0})  # fmt: skip
    table = markdown_table(s)
    assert (
        "execution: async, the env acting on for 2 steps while a request is in flight; chunks continued by "
        "real-time chunking (schedule exp, max guidance 5.0)." in table
    )
    assert "the bound is too low and the efficiency means little" in table
    s["plan"]["execution"] = {
        "mode": "sync",
        "delay_steps": 0,
        "chunk_blend": "ensemble",
        "ensemble_coeff": 0.01,
    }
    table = markdown_table(s)
    assert "execution: sync; chunks blended by temporal ensembling (m = 0.01)." in table
    assert "efficiency means little" not in table


def test_throughput_bound_and_efficiency():
    timing = {"wall": 10.0, "sim": 32.0, "infer": 6.0, "workers": 4, "env_steps": 1000}
    tp = throughput(timing)
    assert tp["busy_bound"] == 8.0 and tp["utilisation"] == pytest.approx(0.8)
    assert tp["env_steps_per_s"] == 100.0
    assert tp["bound"] is None and tp["efficiency"] is None  # not calibrated: no independent bound
    assert throughput({**timing, "sim": 8.0, "infer": 9.0})["busy_bound"] == 9.0
    # the calibrated bound is independent of the run's busy times
    tp = throughput({**timing, "bound_sim": 4.0, "bound_infer": 5.0})
    assert (tp["bound"], tp["bound_side"]) == (5.0, "inference")
    assert tp["efficiency"] == pytest.approx(0.5) and tp["utilisation"] == pytest.approx(0.8)
    assert "bound_above_run" not in tp
    # a bound above the run: the calibration overestimated that side, and the report says so
    tp = throughput({**timing, "bound_sim": 4.0, "bound_infer": 12.0})
    assert tp["efficiency"] == pytest.approx(1.2)
    assert tp["bound_above_run"] == {"side": "inference", "calibrated": 12.0, "run_busy": 6.0}
    assert "the calibration overestimated inference (12.00 s calibrated, 6.00 s busy" in throughput_line(tp)


def test_journal_appends_durably_and_refuses_twice(tmp_path):
    plan = {"suite": "metaworld", "trials": 2}
    with Journal(tmp_path, plan) as j:
        assert j.append(rec("a", 0, True))
        assert not j.append(rec("a", 0, False))  # the same episode again: ignored, first kept
        assert j.append(rec("a", 1, False))
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["success_once"] is True
    with pytest.raises(ConfigError, match="--resume"):
        Journal(tmp_path, plan)  # existing results are never overwritten silently
    with pytest.raises(ConfigError, match="trials: 2 -> 3"):
        Journal(tmp_path, {**plan, "trials": 3}, resume=True)
    with pytest.raises(ValueError, match="lacks"):
        Journal(tmp_path, plan, resume=True).append({"suite": "metaworld"})


def test_journal_drops_a_torn_last_line_on_resume(tmp_path):
    plan = {"suite": "metaworld"}
    with Journal(tmp_path, plan) as j:
        for t in range(3):
            j.append(rec("a", t, True))
    path = tmp_path / "episodes.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"suite": "metaworld", "task": "a", "tri')  # a crash mid-write
    with Journal(tmp_path, plan, resume=True) as j:
        assert sorted(j.records) == sorted(record_key(rec("a", t, True)) for t in range(3))
        j.append(rec("a", 3, False))
    assert len(read_journal(path)) == 4
    assert path.read_bytes().startswith(whole) and path.read_bytes().count(b"\n") == 4
    # a broken line in the middle is corruption, not a crash: refuse rather than drop results
    lines = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join([lines[0], b"not json", *lines[1:]]))
    with pytest.raises(ValueError, match="line 2"):
        read_journal(path)


def test_reports_are_written(tmp_path):
    records = [rec("a", t, t % 2 == 0) for t in range(4)]
    events = [(0, "sim", 0.0, 1.0), (0, "infer", 1.0, 1.5), (1, "sim", 1.0, 2.0), (1, "infer", 2.0, 2.4)]
    timing = {"wall": 2.4, "sim": 2.0, "infer": 0.9, "workers": 1, "env_steps": 40}
    s = write_reports(tmp_path, records, {"suite": "metaworld"}, timing, events, stages=2)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["all"]["rate"] == 0.5 == s["all"]["rate"]
    assert on_disk["throughput"]["busy_bound"] == 2.0 and on_disk["failures"] == {"max_steps": 2}
    assert "utilisation 83%" in (tmp_path / "results.md").read_text()
    for png in ("success_per_task.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_blank_images_sends_black_frames_of_the_rendered_shape_and_is_recorded(tmp_path):
    """eval.blank_images (the vision control): the policy gets every camera image as uint8 zeros of
    the shape the env rendered, the state and task unchanged; the plan records it, so a journal is
    never resumed across the switch."""
    import json

    import numpy as np

    from tests.eval_helpers import eval_config
    from wamkit.eval.runner import run_eval

    seen: list[dict] = []

    class Policy:
        identity = None

        def __call__(self, obs_list, seeds=None):
            seen.extend(obs_list)
            return np.zeros((len(obs_list), 8, 4), np.float32), 0.001, len(obs_list)

        def close(self):
            pass

    def factory(url, env_cfg, patience):
        return Policy()

    for blank in (False, True):
        out = tmp_path / str(blank)
        seen.clear()
        cfg = eval_config("ws://unused:1", out, "eval.num_envs=1", "eval.pipeline_stages=1", "eval.workers=1",
                          "eval.trials=1", "env.max_steps=8", "eval.calibrate_s=0", f"eval.blank_images={blank}")  # fmt: skip
        run_eval(cfg, progress=False, policy_factory=factory)
        images = [o["observation.images.corner"] for o in seen]
        assert images and all(i.shape == (32, 32, 3) and i.dtype == np.uint8 for i in images)
        assert all((i == 0).all() for i in images) == blank and any(i.any() for i in images) != blank
        assert all(o["observation.state"].any() for o in seen)  # the state is sent as it is
        assert json.loads((out / "plan.json").read_text())["blank_images"] is blank


def test_each_episode_sends_the_same_noise_seeds_whatever_the_layout(tmp_path):
    """Request k of an episode carries request_seed(episode, k) (eval/episodes.py), whichever episodes
    share its model call: a policy whose actions come from the seeds alone gives bit-equal records
    with one env and with three envs sharing each call."""
    import numpy as np

    from tests.eval_helpers import eval_config, results
    from wamkit.envs.base import EpisodeSpec
    from wamkit.eval.episodes import request_seed
    from wamkit.eval.runner import run_eval

    sent: dict[str, list[list[int]]] = {}

    class Policy:
        identity = None

        def __call__(self, obs_list, seeds=None):
            assert seeds is not None and len(seeds) == len(obs_list)
            sent.setdefault(layout, []).append(list(seeds))
            acts = [np.random.default_rng(s).uniform(-1, 1, (8, 4)) for s in seeds]
            return np.stack(acts).astype(np.float32), 0.001, len(obs_list)

        def close(self):
            pass

    runs = {}
    for layout, extra in {
        "one": ("eval.num_envs=1", "eval.pipeline_stages=1", "eval.workers=1"),
        "three": ("eval.num_envs=3", "eval.pipeline_stages=1", "eval.workers=1"),
    }.items():
        out = tmp_path / layout
        cfg = eval_config("ws://unused:1", out, *extra, "eval.trials=3", "env.max_steps=12",
                          "eval.replan_interval=4", "eval.calibrate_s=0")  # fmt: skip
        run_eval(cfg, progress=False, policy_factory=lambda url, env_cfg, patience: Policy())
        runs[layout] = results(out)
    assert runs["one"] == runs["three"] and len(runs["one"]) == 3
    assert max(map(len, sent["three"])) > 1  # episodes did share calls there
    # the seeds are the episodes' named ones: 3 requests (12 steps, replan 4) per episode
    specs = [EpisodeSpec("metaworld", "reach-v3", t, 1000 + t) for t in range(3)]
    want = sorted(request_seed(spec, k) for spec in specs for k in range(3))
    for layout in runs:
        assert sorted(s for call in sent[layout] for s in call) == want
