"""``wamkit bench eval`` keeps its env workers across runs and reports each run as it finishes.

On LIBERO each run used to build its own workers (half a minute) and printed nothing until the last
run, so a benchmark stopped by ``timeout -s INT`` left no figure at all. Real MetaWorld envs, the real
delay server: runs on one set of workers give the episodes of fresh workers, the benchmark starts its
workers once per shape, and an interrupted benchmark prints and keeps the runs that finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

import wamkit.envs.workers as env_workers_module
from tests.eval_helpers import DELAY, eval_config, results
from wamkit.cli import main as wamkit
from wamkit.eval.runner import run_eval, start_env_workers
from wamkit.eval.server_proc import start_server_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--tasks", "reach-v3", "--trials", "2", "--max-steps", "6", "--num-envs", "2", "--workers", "2"]
TINY += [
    "--stages",
    "2",
    "--delay-ms",
    "5",
    "--per-obs-ms",
    "1",
    "--calibrate-s",
    "0.5",
    "--image-size",
    "32",
]


@pytest.fixture(scope="module")
def server():
    with start_server_process(DELAY) as srv:
        yield srv


def count_worker_starts(monkeypatch) -> list[int]:
    """Every env worker started from now on, by its number of envs (each builds its envs once)."""
    started: list[int] = []

    class Counted(env_workers_module.EnvWorker):
        def __init__(self, env_cfg, num_envs, *args, **kwargs):
            started.append(num_envs)
            super().__init__(env_cfg, num_envs, *args, **kwargs)

    monkeypatch.setattr(env_workers_module, "EnvWorker", Counted)
    return started


def test_reused_workers_give_the_episodes_of_fresh_ones(server, tmp_path, monkeypatch):
    """Two tasks over two envs: a reused env starts an episode after other episodes of either task (of
    an earlier run, and in another slot order with P=1), and must give what a fresh one gives."""
    started = count_worker_starts(monkeypatch)

    def config(name, *extra):
        return eval_config(server.url, tmp_path / name, "env.tasks=reach-v3,push-v3", *extra)

    run_eval(config("fresh"), progress=False)
    assert started == [1, 1]  # run_eval started its own two workers
    with start_env_workers(config("workers")) as workers:
        pids = []
        for name, extra in (("first", []), ("second", ["eval.pipeline_stages=1"]), ("third", [])):
            summary = run_eval(config(name, *extra), progress=False, prebuild=True, env_workers=workers)
            assert results(tmp_path / name) == results(tmp_path / "fresh"), name
            assert summary["throughput"]["calibration"]["t_step"] > 0  # each run calibrates
            assert summary["throughput"]["worker_restarts"] == 0
            pids.append([workers.pid(w) for w in range(workers.num_workers)])
        assert pids[0] == pids[1] == pids[2]  # the same two processes served every run
        with pytest.raises(ValueError, match=r"slots per worker: \[1, 1\] here, \[1\] wanted"):
            run_eval(config("other", "eval.num_envs=1", "eval.pipeline_stages=1"), env_workers=workers)
    assert started == [1, 1, 1, 1]  # two more for all three runs


@pytest.mark.slow
def test_workers_are_built_once_per_shape_and_each_run_is_printed(tmp_path, capsys, monkeypatch):
    started = count_worker_starts(monkeypatch)
    out = tmp_path / "bench.json"
    assert (
        wamkit(["bench", "eval", *TINY, "--schedules", "serial,lockstep,pipelined", "--json", str(out)]) == 0
    )
    # serial's one worker with one env, and the two workers of (b) and (c): not 2 + 4 x 2 = 10
    assert sorted(started) == [1, 1, 1]
    text = capsys.readouterr().out
    assert "episode results identical across schedules and repeats: yes" in text
    lines = [line for line in text.splitlines() if line.startswith("run ")]
    assert [line[:10] for line in lines] == ["run 1 of 2"] * 3 + ["run 2 of 2"] * 3
    assert all("env-steps/s, efficiency" in line and "utilisation" in line for line in lines)
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["repeats"] == 2
    assert [len(row["runs"]) for row in doc["runs"]] == [2, 2, 2]


@pytest.mark.slow  # a whole bench eval interrupted mid-run (45 s)
def test_an_interrupted_benchmark_prints_and_keeps_the_runs_that_finished(tmp_path):
    """SIGINT to the whole process group, as ``timeout -s INT`` sends it, once the first run is in."""
    out = tmp_path / "bench.json"
    argv = [sys.executable, "-m", "wamkit", "--log-level", "warning", "bench", "eval", *TINY]
    argv += ["--schedules", "serial,lockstep", "--json", str(out)]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    watchdog = threading.Timer(240, proc.kill)  # a hung benchmark fails the test, not the suite
    watchdog.start()
    try:
        head = []
        for line in proc.stdout:
            head.append(line)
            if line.startswith("run 1 of 2: (a)"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=200)
    finally:
        watchdog.cancel()
    text = "".join(head) + rest
    assert proc.returncode == 130, text
    assert "interrupted: medians of the runs that finished" in text
    assert "INTERRUPTED: medians of the runs that finished (2 asked per schedule)" in text
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["repeats"] == 2
    done = {row["mode"][:3]: len(row["runs"]) for row in doc["runs"]}
    printed = [line for line in text.splitlines() if line.startswith("run ")]
    assert done.get("(a)") == 1 and sum(done.values()) == len(printed)  # every printed run is kept
    table = text[text.index("INTERRUPTED") :]
    assert "1 of 2 runs" in table  # (a): one of its two runs
    if "(b)" not in done:  # the signal came during (b)'s first run, as it almost always does
        assert "(b) lock-step, 1 batched request (LeRobot)      2   no run finished" in table
