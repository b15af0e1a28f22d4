"""Asynchronous execution in the evaluator (wamkit.eval.execution): which actions an env executes while
its request is in flight, ACT's temporal ensembling, and runs that reproduce, resume, and refuse a
resume with other execution settings (real MetaWorld workers, real servers over websockets)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.eval_helpers import DELAY, eval_config, results
from wamkit.config import ConfigError, load_config
from wamkit.eval.execution import ActionExecution, ChunkPlan, ExecutionError
from wamkit.eval.journal import read_journal
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import start_server_process

H, D = 8, 2


def chunk(k: float) -> np.ndarray:
    """A chunk whose action i is (k + i, -(k + i)): where it came from reads off every value."""
    a = k + np.arange(H, dtype=np.float32)
    return np.stack([a, -a], axis=1)


def firsts(actions: list[np.ndarray]) -> list[float]:
    return [float(a[0]) for a in actions]


def test_sync_switch_executes_each_chunks_head():
    plan = ChunkPlan(ActionExecution(), replan=4)
    assert firsts(plan.receive(0, chunk(0))) == [0, 1, 2, 3]
    assert firsts(plan.receive(4, chunk(100))) == [100, 101, 102, 103]
    assert plan.request_fields(8) == {}


def test_async_runs_the_old_chunk_while_the_new_one_is_in_flight():
    plan = ChunkPlan(ActionExecution("async", delay=3), replan=4)
    assert firsts(plan.receive(0, chunk(0))) == [0, 1, 2, 3]  # the first chunk: the robot waited for it
    # asked at step 4: steps 4, 5, 6 run the old chunk's actions 4, 5, 6; step 7 the new one's action 3
    assert firsts(plan.receive(4, chunk(100))) == [4, 5, 6, 103]
    assert firsts(plan.receive(8, chunk(200))) == [104, 105, 106, 203]


def test_rtc_requests_carry_the_unexecuted_actions():
    plan = ChunkPlan(ActionExecution("async", delay=2, blend="rtc"), replan=4)
    assert plan.request_fields(0) == {}  # nothing to continue yet
    plan.receive(0, chunk(10))
    fields = plan.request_fields(4)
    assert fields["delay"] == 2 and firsts(fields["prev_actions"]) == [14, 15, 16, 17]
    assert (fields["rtc_schedule"], fields["rtc_max_guidance"]) == ("exp", 5.0)


def test_ensemble_weights_the_oldest_chunk_most():
    m = 0.5
    plan = ChunkPlan(ActionExecution("sync", blend="ensemble", ensemble_coeff=m), replan=2)
    plan.receive(0, chunk(0))
    got = firsts(plan.receive(2, chunk(100)))
    w = np.exp(-m * np.arange(2))  # i = 0: the oldest chunk (ACT, LeRobot's ACTTemporalEnsembler)
    assert got == pytest.approx([(w[0] * 2 + w[1] * 100) / w.sum(), (w[0] * 3 + w[1] * 101) / w.sum()])
    # async: a step before the new chunk arrives averages only the chunks that had
    plan = ChunkPlan(ActionExecution("async", delay=1, blend="ensemble", ensemble_coeff=m), replan=2)
    plan.receive(0, chunk(0))
    assert firsts(plan.receive(2, chunk(100)))[0] == 2


def test_settings_that_cannot_run_are_refused():
    with pytest.raises(ExecutionError, match="exceeds the model's chunk of 8"):
        plan = ChunkPlan(ActionExecution("async", delay=4), replan=6)
        plan.receive(0, chunk(0))
        plan.receive(6, chunk(1))
    with pytest.raises(ExecutionError, match="exceeds eval.replan_interval=2"):
        ActionExecution.of(
            load_config(None, ["eval.execution=async", "eval.delay_steps=3", "eval.replan_interval=2"]).eval
        )
    with pytest.raises(ConfigError, match="needs eval.execution=async"):
        load_config(None, ["eval.delay_steps=3"])
    with pytest.raises(ConfigError, match="only a wamkit server reads"):
        load_config(None, ["eval.chunk_blend=rtc", "eval.backend=openpi"])


def test_smoothness_separates_chunk_boundaries():
    plan = ChunkPlan(ActionExecution(), replan=4)
    a = plan.receive(0, chunk(0))
    plan.executed_steps(0, a)
    b = plan.receive(4, chunk(100))  # a jump of 97 at step 4
    plan.executed_steps(4, b)
    s = plan.smoothness()
    assert s["jerk_within_n"] == 4 and s["jerk_within_sum"] == 0  # constant steps of 1: no jerk
    assert s["jerk_boundary_n"] == 2 and s["jerk_boundary_sum"] > 100


ASYNC = ["eval.execution=async", "eval.delay_steps=2"]


def same_episodes(a: dict, b: dict) -> None:
    """The same outcomes; returns (sums of rewards over the steps) equal to a float32 model's rounding."""
    assert a.keys() == b.keys()
    for key in a:
        ra, rb = a[key], b[key]
        assert {k: v for k, v in ra.items() if k not in ("return", "smoothness")} == {
            k: v for k, v in rb.items() if k not in ("return", "smoothness")
        }
        assert ra["return"] == pytest.approx(rb["return"], rel=1e-6)


@pytest.fixture(scope="module")
def tiny_server():
    """A flow policy (the tiny model, untrained: its actions are a seeded function of the observation)."""
    with start_server_process(["--model", "tiny", "--random-init", "--device", "cpu"]) as srv:
        yield srv


def test_async_rtc_run_reproduces_and_resumes(tiny_server, tmp_path):
    rtc = [*ASYNC, "eval.chunk_blend=rtc", "env.image_size=64", "env.max_steps=24"]
    a = run_eval(eval_config(tiny_server.url, tmp_path / "a", *rtc), progress=False)
    run_eval(eval_config(tiny_server.url, tmp_path / "b", *rtc), progress=False)
    # simulated time: the same episodes. Not bit for bit: the server merges the stages' requests into
    # one call or not as they arrive, and the model's batched sums round differently (tests/exactness.py)
    same_episodes(results(tmp_path / "a"), results(tmp_path / "b"))
    assert a["all"]["episodes"] == 2
    rec = next(iter(read_journal(tmp_path / "a" / "episodes.jsonl").values()))
    assert rec["smoothness"]["jerk_boundary_n"] > 0
    plan = (tmp_path / "a" / "plan.json").read_text()
    assert '"chunk_blend": "rtc"' in plan and '"delay_steps": 2' in plan
    # the switch in the same settings executes other actions
    run_eval(
        eval_config(tiny_server.url, tmp_path / "s", *ASYNC, "env.image_size=64", "env.max_steps=24"),
        progress=False,
    )
    ret = {k: r["return"] for k, r in results(tmp_path / "s").items()}
    assert any(
        abs(ret[k] - r["return"]) > 1e-3 * abs(r["return"]) for k, r in results(tmp_path / "a").items()
    )
    # a resume with another delay or mode would mix two evaluations
    for other in (["eval.delay_steps=1"], ["eval.chunk_blend=switch"]):
        with pytest.raises(ConfigError, match="execution"):
            run_eval(
                eval_config(tiny_server.url, tmp_path / "a", *rtc, *other, "eval.resume=true"), progress=False
            )


def test_rtc_against_a_model_without_it_is_refused_before_any_episode(tmp_path):
    with start_server_process(DELAY) as srv, pytest.raises(ConfigError, match="takes no prev_actions"):
        run_eval(eval_config(srv.url, tmp_path, *ASYNC, "eval.chunk_blend=rtc"), progress=False)
    assert not (tmp_path / "episodes.jsonl").exists() or not read_journal(tmp_path / "episodes.jsonl")


def test_auto_delay_is_measured_recorded_and_kept_on_resume(tmp_path):
    """``auto``: the server's round trip at the run's batch x MetaWorld's 80 Hz, rounded up; a 20 ms
    model call is at least 2 control steps. A resume reads the recorded value, measuring nothing."""
    auto = ["eval.execution=async", "eval.delay_steps=auto", "eval.replan_interval=8"]
    with start_server_process([*DELAY[:-1], "delay_ms=20"]) as srv:
        run_eval(eval_config(srv.url, tmp_path, *auto), progress=False)
        d = json.loads((tmp_path / "plan.json").read_text())["execution"]["delay_steps"]
        assert 2 <= d <= 8
        (tmp_path / "episodes.jsonl").write_text("")  # every episode to run again, under the recorded d
        run_eval(eval_config(srv.url, tmp_path, *auto, "eval.resume=true"), progress=False)
    assert json.loads((tmp_path / "plan.json").read_text())["execution"]["delay_steps"] == d


def test_settings_that_cannot_hold_are_one_line_from_the_command(tmp_path):
    """``wamkit eval eval.execution=async eval.delay_steps=99`` as typed: the execution's refusal is a
    config error, printed in one line without a traceback, before any server is reached."""
    import subprocess
    import sys
    from pathlib import Path

    run = subprocess.run(
        [str(Path(sys.executable).parent / "wamkit"), "eval", "eval.execution=async", "eval.delay_steps=99",
         "eval.server_url=ws://127.0.0.1:1", f"eval.out_dir={tmp_path / 'e'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "wamkit eval: config error: eval.delay_steps=99 exceeds eval.replan_interval=8: an env asks again "
        "every replan_interval steps and keeps one request in flight; raise the interval"
    ]
