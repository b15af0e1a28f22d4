"""Numbers you can trust: an efficiency against a bound measured apart from the run, no results of two
models mixed in one journal, and an env that raises does not end the run.

Real MetaWorld workers and real delay servers over websockets; the failures are injected where they
happen in practice (a per-call overhead in the executor's workers, a simulator that raises).
"""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from tests.eval_helpers import DELAY
from tests.eval_helpers import eval_config as config
from wamkit.config import ConfigError
from wamkit.eval.calibrate import Calibration, independent_bound
from wamkit.eval.chunk_host import ChunkHost
from wamkit.eval.journal import read_journal, server_diff
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import start_server_process

BROKEN, FLAKY = 2, 3  # trials whose env raises always / once (calibration uses trials 0 and 1)


@pytest.fixture(scope="module")
def server():
    with start_server_process(DELAY) as srv:
        yield srv


# -- the bound ---------------------------------------------------------------------------------------


def test_latency_is_interpolated_and_a_merged_call_counts_once():
    cal = Calibration(t_step=0.01, t_reset=0.1, latency={1: 0.022, 4: 0.028, 8: 0.036})
    assert cal.latency_at(2) == pytest.approx(0.024) and cal.latency_at(8) == 0.036
    assert cal.latency_at(16) == pytest.approx(0.052)  # extended along the last segment
    # 4 requests of 2 served by one call of 8 cost one call; alone, each costs a call of 2
    merged = independent_bound(cal, 2, env_steps=100, resets=4, requests=[(2, 8)] * 4)
    alone = independent_bound(cal, 2, env_steps=100, resets=4, requests=[(2, 2)] * 4)
    assert merged == pytest.approx({"bound_sim": (1.0 + 0.4) / 2, "bound_infer": 0.036})
    assert alone["bound_infer"] == pytest.approx(4 * 0.024)


def _slow_workers(overhead_s: float):
    """on_pipeline hook: every call to an env worker now costs ``overhead_s`` more, inside the time the
    executor counts as simulation (as IPC or contention that a schedule adds would)."""

    def inject(pipeline):
        for handle in pipeline.ex._handles:
            submit = handle.submit
            handle.submit = lambda method, payload, _submit=submit: (
                time.sleep(overhead_s),
                _submit(method, payload),
            )

    return inject


def test_a_slowed_schedule_shows_lost_efficiency_not_a_higher_bound(server, tmp_path):
    summary = run_eval(config(server.url, tmp_path), progress=False, on_pipeline=_slow_workers(0.1))
    tp = summary["throughput"]
    # the run's own busy times include the overhead, so its utilisation still looks good; the bound
    # calibrated before the overhead does not, so the efficiency shows what the schedule lost
    assert tp["sim"] / tp["workers"] >= 2 * tp["bound_sim"]
    assert tp["efficiency"] < 0.5 * tp["utilisation"]
    assert tp["efficiency"] < 0.6


def test_pipeline_auto_chooses_from_a_warm_calibration(server, tmp_path):
    summary = run_eval(config(server.url, tmp_path, "eval.pipeline_stages=0"), progress=False)
    tp = summary["throughput"]
    assert tp["stages"] in (1, 2) and set(tp["calibration"]["latency"]) == {"1", "2"}
    with pytest.raises(ConfigError, match="eval.calibrate_s"):
        config(server.url, tmp_path, "eval.pipeline_stages=0", "eval.calibrate_s=0")


# -- no silent mixing --------------------------------------------------------------------------------


def test_server_diff_names_what_differs():
    a = {
        "url": "ws://a",
        "identity": {"model": "delay", "weights_sha256": "1", "action_transform": {"raw": False}},
    }
    b = {
        "url": "ws://b",
        "identity": {"model": "tiny", "weights_sha256": "2", "action_transform": {"raw": False}},
    }
    assert server_diff(a, {**a, "url": "ws://b"}) == []  # the same model elsewhere: fine
    assert server_diff(a, b) == ["model: 'delay' -> 'tiny'", "weights_sha256: '1' -> '2'"]
    assert server_diff({"url": "ws://a"}, {"url": "ws://b", "identity": None}) == [
        "url: 'ws://a' -> 'ws://b'"
    ]
    assert server_diff(None, b) == []
    # an identity written before the autocast field existed was a server without autocast
    assert server_diff(a, {**a, "identity": {**a["identity"], "autocast": "off"}}) == []
    assert server_diff(a, {**a, "identity": {**a["identity"], "autocast": "bf16"}}) == [
        "autocast: 'off' -> 'bf16'"
    ]
    # one written before the sampler's steps were named: compared where the journal's server named them
    steps = {**a, "identity": {**a["identity"], "sampler": {"steps": 30, "distilled": None}}}
    assert server_diff(a, steps) == []
    fewer = {**a, "identity": {**a["identity"], "sampler": {"steps": 4, "distilled": None}}}
    assert server_diff(steps, fewer) == ["sampler.steps: 30 -> 4"]


def test_resume_against_another_model_is_refused(server, tmp_path):
    run_eval(config(server.url, tmp_path), progress=False)
    plan = json.loads((tmp_path / "plan.json").read_text())
    ident = plan["server"]["identity"]
    assert ident["model"] == "delay" and len(ident["weights_sha256"]) == 64
    assert ident["stats_sha256"] and ident["action_transform"]["raw"] is False
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "episodes.jsonl").write_text(lines[0])  # one episode left to run
    tiny = ["--model", "tiny", "--preset", "small", "--random-init", "--device", "cpu"]
    with contextlib.ExitStack() as stack:
        other = stack.enter_context(start_server_process(tiny))
        with pytest.raises(ConfigError, match=r"another model.*model: 'delay' -> 'tiny'.*weights_sha256"):
            run_eval(config(other.url, tmp_path), resume=True, progress=False)
        assert len(read_journal(tmp_path / "episodes.jsonl")) == 1  # nothing was added
        # the same model behind another URL is the same evaluation: the resume finishes it
        same = stack.enter_context(start_server_process(DELAY))
        summary = run_eval(config(same.url, tmp_path), resume=True, progress=False)
    assert summary["all"]["episodes"] == 2
    assert json.loads((tmp_path / "plan.json").read_text())["server"]["url"] == same.url


# -- an env that raises ------------------------------------------------------------------------------


class RaisingHost(ChunkHost):
    """Trial BROKEN's env raises at its third step every time; trial FLAKY's only the first time."""

    def __init__(self, env_cfg, num_envs):
        super().__init__(env_cfg, num_envs)
        self.steps: dict[int, int] = {}
        self.flaky_left = 1

    def reset(self, slot_specs):
        self.steps |= dict.fromkeys(slot_specs, 0)
        return super().reset(slot_specs)

    def step(self, slot_actions):
        for slot in slot_actions:
            trial = self.specs[slot].trial
            self.steps[slot] += 1
            if self.steps[slot] == 3 and (trial == BROKEN or (trial == FLAKY and self.flaky_left)):
                self.flaky_left -= trial == FLAKY
                raise RuntimeError("simulated physics blow-up\nsecond line")
        return super().step(slot_actions)


def test_an_env_that_raises_is_retried_then_recorded_and_the_run_goes_on(server, tmp_path):
    cfg = config(server.url, tmp_path, "eval.trials=4", "eval.workers=1")
    summary = run_eval(cfg, progress=False, host_factory=RaisingHost)
    records = {r["trial"]: r for r in read_journal(tmp_path / "episodes.jsonl").values()}
    assert sorted(records) == [0, 1, 2, 3]  # the run finished every episode
    broken, flaky = records[BROKEN], records[FLAKY]
    assert broken["failure"] == "env_error: RuntimeError: simulated physics blow-up"
    assert broken["env_errors"] == 1 + cfg.eval.env_retries and not broken["success_once"]
    assert flaky["env_errors"] == 1 and not flaky["failure"].startswith("env_error")
    assert flaky["length"] == 16 or flaky["success_once"]  # rerun from the start, to its end
    assert [r["env_errors"] for t, r in records.items() if t not in (BROKEN, FLAKY)] == [0, 0]
    assert summary["failures"]["env_error"] == 1 and summary["all"]["episodes"] == 4
    assert summary["env_errors"] == [
        {
            "episode": "metaworld/reach-v3/2/1002",
            "error": "RuntimeError: simulated physics blow-up",
            "attempts": 3,
        }
    ]
    assert (
        "env error, counted as a failure: metaworld/reach-v3/2/1002" in (tmp_path / "results.md").read_text()
    )
