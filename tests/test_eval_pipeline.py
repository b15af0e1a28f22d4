"""The pipelined evaluator end to end: real MetaWorld workers, a real delay server over websockets.

The ``delay`` model's actions are a deterministic function of the observation, and MetaWorld episodes
are reproducible from their name, so every run of the same episodes must give the same records, however
they were scheduled, whichever executor ran them, and whatever was killed along the way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest

from tests.eval_helpers import DELAY, eval_config, results
from wamkit.config import ConfigError
from wamkit.eval.journal import read_journal
from wamkit.eval.runner import run_eval
from wamkit.eval.server_proc import start_server_process

TASKS = ["reach-v3"]  # one task: building a MetaWorld task costs seconds per env
TRIALS = 6


@pytest.fixture(scope="module")
def server():
    with start_server_process(DELAY) as srv:
        yield srv


def config(server, out, *extra):
    cases = [f"env.tasks={','.join(TASKS)}", "env.image_size=64", f"eval.trials={TRIALS}"]
    return eval_config(server.url, out, *cases, "eval.calibrate_s=3", *extra)


def finished(out) -> int:
    """Whole lines in the journal now (safe to call while it is being written)."""
    path = out / "episodes.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def journal_keys(out) -> list[str]:
    lines = (out / "episodes.jsonl").read_text().splitlines()
    return [f"{r['suite']}/{r['task']}/{r['trial']}/{r['seed']}" for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def reference(server, tmp_path_factory):
    """An undisturbed local run of every episode, with one video per task."""
    out = tmp_path_factory.mktemp("reference")
    summary = run_eval(config(server, out, "eval.videos=1"), progress=False)
    return out, summary


def test_undisturbed_run_records_every_episode_once(reference):
    out, summary = reference
    keys = journal_keys(out)
    assert len(keys) == len(set(keys)) == len(TASKS) * TRIALS
    assert {k.split("/")[1] for k in keys} == set(TASKS)
    assert {int(k.split("/")[3]) - int(k.split("/")[2]) for k in keys} == {1000}  # seed = eval.seed + trial
    rec = next(iter(read_journal(out / "episodes.jsonl").values()))
    assert rec["length"] <= 16 and set(rec["timing"]) >= {"sim", "infer", "wall"}
    assert summary["all"]["episodes"] == len(TASKS) * TRIALS
    tp = summary["throughput"]
    assert tp["env_steps"] >= sum(r["length"] for r in read_journal(out / "episodes.jsonl").values())
    assert tp["busy_bound"] == max(tp["sim"] / tp["workers"], tp["infer"]) and tp["wall"] > 0
    assert tp["utilisation"] == tp["busy_bound"] / tp["wall"]
    # calibrated before the timed part: an independent bound beside the utilisation
    assert tp["bound"] == max(tp["bound_sim"], tp["bound_infer"]) > 0
    assert tp["efficiency"] == tp["bound"] / tp["wall"]
    assert tp["calibration"]["t_step"] > 0 and set(tp["calibration"]["latency"]) == {"1", "2"}
    # two stages took turns: each one both simulated and waited on the server
    events = json.loads((out / "timeline.json").read_text())["events"]
    assert {(s, k) for s, k, _, _ in events} == {(0, "sim"), (0, "infer"), (1, "sim"), (1, "infer")}
    # one video per task (eval.videos=1): whichever of the first trials finished first, so the name
    # follows the stages' timing; its seed is its trial's
    videos = [p.name for p in (out / "videos").rglob("*.mp4")]
    assert len(videos) == len(TASKS)
    for name in videos:
        trial, seed = name.removesuffix(".mp4").split("_")
        assert int(trial.removeprefix("trial")) < 4 * 1 and int(seed.removeprefix("seed")) == 1000 + int(
            trial[5:]
        )
    for name in ("summary.json", "results.md", "success_per_task.png", "timeline.png"):
        assert (out / name).is_file()


def test_a_video_that_cannot_be_written_loses_no_episode(server, reference, tmp_path, caplog):
    """A video is a by-product: where it cannot be written (here ``videos`` is a file, so no folder can
    be made; a full disk or a PyAV without the encoder fail alike), the run says so and journals every
    episode, with no video field and no temp file left."""
    (tmp_path / "videos").write_text("not a folder")
    with caplog.at_level("WARNING", logger="wamkit.eval.runner"):
        summary = run_eval(config(server, tmp_path, "eval.videos=1"), progress=False)
    assert summary["all"]["episodes"] == len(TASKS) * TRIALS
    assert results(tmp_path) == results(reference[0])
    assert not any("video" in r for r in read_journal(tmp_path / "episodes.jsonl").values())
    said = [r.getMessage() for r in caplog.records if "was not written" in r.getMessage()]
    assert said and all("videos/reach-v3/trial" in m for m in said), said
    assert (tmp_path / "videos").read_text() == "not a folder"


@pytest.mark.slow
def test_other_schedules_give_the_same_results(server, reference, tmp_path):
    """P=1 over one env and one worker instead of P=2 over two: same episodes, same records."""
    run_eval(config(server, tmp_path, "eval.pipeline_stages=1", "eval.num_envs=1"), progress=False)
    assert results(tmp_path) == results(reference[0])


def test_sigkill_env_workers_mid_run(server, reference, tmp_path):
    """Kill both env workers with SIGKILL while episodes run: each episode is recorded exactly once,
    with the results of the undisturbed run."""
    killed: list[int] = []

    def killer(pipeline):
        def run():
            for worker, after in ((0, 1), (1, 2)):  # once 1 (then 2) episodes are in the journal
                while finished(tmp_path) < after and not pipeline._stop.is_set():
                    time.sleep(0.02)
                os.kill(pipeline.ex.pid(worker), signal.SIGKILL)
                killed.append(worker)

        threading.Thread(target=run, daemon=True).start()

    run_eval(config(server, tmp_path), progress=False, on_pipeline=killer)
    assert killed == [0, 1]
    keys = journal_keys(tmp_path)
    assert len(keys) == len(set(keys)) == len(TASKS) * TRIALS
    assert results(tmp_path) == results(reference[0])
    records = read_journal(tmp_path / "episodes.jsonl").values()
    assert sum(r["restarts"] for r in records) >= 1  # episodes in flight were rerun from the start
    assert json.loads((tmp_path / "summary.json").read_text())["throughput"]["worker_restarts"] == 2


@pytest.mark.slow
def test_watchdog_replaces_a_hung_worker(server, reference, tmp_path):
    """SIGSTOP freezes a worker (alive, silent): the watchdog kills and replaces it."""
    stopped: list[int] = []

    def freezer(pipeline):
        def run():
            while not finished(tmp_path) and not pipeline._stop.is_set():
                time.sleep(0.02)
            pid = pipeline.ex.pid(1)
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)

        threading.Thread(target=run, daemon=True).start()

    run_eval(config(server, tmp_path, "eval.watchdog_s=15"), progress=False, on_pipeline=freezer)
    assert len(stopped) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(stopped[0], 0)  # the frozen process was killed and reaped
    assert results(tmp_path) == results(reference[0])


def test_resume_runs_only_the_missing_episodes(server, reference, tmp_path):
    ref_out = reference[0]
    shutil.copy(ref_out / "plan.json", tmp_path / "plan.json")
    lines = (ref_out / "episodes.jsonl").read_text().splitlines(keepends=True)
    kept = lines[:2]
    (tmp_path / "episodes.jsonl").write_text("".join(kept) + lines[2][:30])  # crashed mid-write
    ran: list[dict] = []

    def spy(pipeline):
        inner = pipeline.on_finish
        pipeline.on_finish = lambda rec, frames: (ran.append(rec), inner(rec, frames))

    summary = run_eval(config(server, tmp_path), resume=True, progress=False, on_pipeline=spy)
    assert len(ran) == len(lines) - 2
    assert (tmp_path / "episodes.jsonl").read_text().startswith("".join(kept))
    assert results(tmp_path) == results(ref_out)
    got, want = dict(summary["all"]), dict(reference[1]["all"])
    assert got.pop("mean_return") == pytest.approx(want.pop("mean_return"))  # summed in another order
    assert got == want
    # nothing left to run: a second resume starts no episode
    ran.clear()
    run_eval(config(server, tmp_path), resume=True, progress=False, on_pipeline=spy)
    assert ran == []


@pytest.mark.slow
def test_ray_executor_gives_identical_results(server, reference, tmp_path):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'wamkit[ray]')")
    try:
        summary = run_eval(config(server, tmp_path, "eval.executor=ray"), progress=False)
    finally:
        ray.shutdown()
    assert summary["throughput"]["executor"] == "ray"
    assert results(tmp_path) == results(reference[0])


@pytest.mark.slow
def test_pipeline_auto_picks_a_divisor(server, reference, tmp_path):
    summary = run_eval(config(server, tmp_path, "eval.pipeline_stages=0"), progress=False)
    assert summary["throughput"]["stages"] in (1, 2)
    assert results(tmp_path) == results(reference[0])


def test_bad_configs_name_the_keys(server, tmp_path):
    with pytest.raises(ConfigError, match=r"eval.num_envs=6 is not divisible by eval.pipeline_stages=4"):
        run_eval(config(server, tmp_path, "eval.num_envs=6", "eval.pipeline_stages=4"), progress=False)
    assert not (tmp_path / "episodes.jsonl").exists()
    with pytest.raises(ConfigError, match="eval.replan_interval"):
        run_eval(config(server, tmp_path, "eval.replan_interval=0"), progress=False)
    with pytest.raises(ConfigError, match="env.cameras"):
        run_eval(config(server, tmp_path, "env.cameras=[topview]"), progress=False)


@pytest.mark.slow
def test_server_restart_mid_run_is_survived(reference, tmp_path):
    """The server process is stopped mid-run and a new one starts on the same port a little later:
    the stages reconnect (with backoff) and the results are those of the undisturbed run."""
    args = DELAY
    restarted, done, threads = threading.Event(), threading.Event(), []
    with start_server_process(args) as first:
        url, port = first.url, first.port

        def restarter(pipeline):
            def run():
                while finished(tmp_path) < 2 and not pipeline._stop.is_set():
                    time.sleep(0.02)
                first.stop()
                # the thread that starts a server outlives it: the kernel ends a server whose starting
                # thread ends (serve/lifetime.py, PR_SET_PDEATHSIG)
                with start_server_process(args, port=port):
                    restarted.set()
                    done.wait()

            threads.append(threading.Thread(target=run, daemon=True))
            threads[0].start()

        cfg = config(first, tmp_path)
        try:
            run_eval(cfg, progress=False, on_pipeline=restarter)
        finally:
            done.set()
            for t in threads:
                t.join(30)
        assert restarted.is_set() and cfg.eval.server_url == url
    assert results(tmp_path) == results(reference[0])


def test_a_worker_that_does_not_start_in_time_is_not_left_running(monkeypatch):
    """A worker still spawning or building its envs when its start-up time runs out fails the
    executor, and its process is killed rather than left building envs for nobody."""
    import multiprocessing

    from wamkit.eval import executors

    monkeypatch.setattr(executors, "STARTUP_S", 0.001)  # a spawned interpreter takes far longer
    env_cfg = eval_config("ws://127.0.0.1:1", "unused", "env.image_size=64").env
    before = set(multiprocessing.active_children())
    ex = executors.local_executor(env_cfg, [1], watchdog_s=0.001)
    try:
        deadline = time.monotonic() + 60
        while ex._fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "env worker 0 failed to start" in str(ex._fatal)
        time.sleep(0.5)  # a killed process is reaped by the next active_children()
        assert [p for p in multiprocessing.active_children() if p not in before] == []
    finally:
        ex.close()
