"""Several servers for one evaluation: real delay servers in their own processes, real sockets, real
MetaWorld workers. Whole stages go to each server; results equal a one-server run's; a server killed
mid-run hands its stages to the other without losing or repeating an episode; servers that serve
different models are refused before any episode runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from websockets.sync.server import serve as sync_serve

from tests.eval_helpers import DELAY, eval_config, results
from wamkit.config import ConfigError, load_config
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.eval.autotune import choose_stages
from wamkit.eval.backends.base import Patience
from wamkit.eval.backends.wamkit import RemotePolicy
from wamkit.eval.calibrate import Calibration, auto_candidates, independent_bound
from wamkit.eval.journal import read_journal
from wamkit.eval.runner import run_eval
from wamkit.eval.scheduler import Pipeline
from wamkit.eval.server_proc import start_server_process
from wamkit.serve.codec import packb

TRIALS = 6


@pytest.fixture(scope="module")
def servers():
    with start_server_process(DELAY) as a, start_server_process(DELAY) as b:
        yield a, b


def config(urls, out, *extra):
    return eval_config(urls, out, f"eval.trials={TRIALS}", "eval.num_envs=4", *extra)


def keys_in_order(out) -> list[str]:
    lines = (out / "episodes.jsonl").read_text().splitlines()
    return [f"{r['task']}/{r['trial']}" for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def one_server(servers, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_server")
    run_eval(config([servers[0].url], out), progress=False)
    return out


def _keep(pipelines: list[Pipeline]):
    return pipelines.append


def test_two_servers_serve_whole_stages_with_the_results_of_one(servers, one_server, tmp_path):
    pipelines: list[Pipeline] = []
    urls = [s.url for s in servers]
    summary = run_eval(config(urls, tmp_path), progress=False, on_pipeline=_keep(pipelines))
    assert results(tmp_path) == results(one_server)
    assert len(keys_in_order(tmp_path)) == len(set(keys_in_order(tmp_path))) == TRIALS
    # no server dropped, so every request of stage i went to server i mod 2, whole (the stage's N/P = 2
    # observations at most), and both stages asked
    requests = pipelines[0].requests
    assert [server for _, _, server, _ in requests] == [stage % 2 for _, _, _, stage in requests]
    assert {stage for _, _, _, stage in requests} == {0, 1}
    assert all(b <= 2 for b, _, _, _ in requests)
    tp = summary["throughput"]
    assert tp["servers"] == 2 and tp["servers_dropped"] == []
    # each server's idle time is split by cause, and within the run
    idle = tp["server_idle"]
    assert idle["idle"] == pytest.approx(idle["simulation"] + idle["transit"] + idle["fill_drain"])
    assert 0.0 < idle["idle"] < tp["wall"] and min(idle.values()) >= 0.0
    # both servers were calibrated (and so warmed); the bound's inference side divides over them
    assert len(tp["calibration"]["server_latency"]) == 2
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["server"]["urls"] == urls and plan["server"]["identity"]["model"] == "delay"


def test_a_killed_server_hands_its_stages_to_the_other(one_server, tmp_path):
    """Server b is SIGKILLed once it has answered two requests, mid-episode: its stage moves to server
    a, the request in flight is sent again there, and every episode is recorded once, with the results
    of the undisturbed run and no episode restarted."""
    pipelines: list[Pipeline] = []
    killed = threading.Event()
    with start_server_process(DELAY) as a, start_server_process(DELAY) as b:

        def killer(pipeline):
            pipelines.append(pipeline)

            def run():
                while not pipeline._stop.is_set():
                    if sum(server == 1 for _, _, server, _ in pipeline.requests) >= 2:
                        os.kill(b.proc.pid, signal.SIGKILL)
                        killed.set()
                        return
                    time.sleep(0.01)

            threading.Thread(target=run, daemon=True).start()

        summary = run_eval(config([a.url, b.url], tmp_path), progress=False, on_pipeline=killer)
    assert killed.is_set()
    keys = keys_in_order(tmp_path)
    assert len(keys) == len(set(keys)) == TRIALS
    assert results(tmp_path) == results(one_server)
    assert all(r["restarts"] == 0 for r in read_journal(tmp_path / "episodes.jsonl").values())
    dropped = summary["throughput"]["servers_dropped"]
    assert [(d["url"], d["stages"]) for d in dropped] == [(b.url, [1])]
    # stage 0 stayed on server a (index 0); stage 1 asked server b (1) until the kill, then only a
    served = {
        stage: [server for _, _, server, st in pipelines[0].requests if st == stage] for stage in (0, 1)
    }
    assert set(served[0]) == {0}
    before = served[1].index(0)
    assert before >= 2 and set(served[1][:before]) == {1} and set(served[1][before:]) == {0}


def test_servers_serving_different_models_are_refused(servers, tmp_path):
    tiny = ["--model", "tiny", "--preset", "small", "--random-init", "--device", "cpu"]
    with start_server_process(tiny) as other:
        urls = [servers[0].url, other.url]
        with pytest.raises(
            ConfigError, match=rf"{other.url} serves another model .*model: 'delay' -> 'tiny'"
        ):
            run_eval(config(urls, tmp_path), progress=False)
    assert not (tmp_path / "episodes.jsonl").read_text()  # refused before any episode ran


def test_server_settings_are_checked_where_they_are_defined(tmp_path):
    urls = ["ws://127.0.0.1:1", "ws://127.0.0.1:2"]
    assert config(urls, tmp_path).eval.server_urls == urls  # comma-separated
    yaml_list = load_config(None, [f"eval.server_url=[{', '.join(urls)}]"]).eval
    assert yaml_list.server_urls == urls and load_config(
        None, ["eval.server_url=ws://x:1"]
    ).eval.server_urls == ["ws://x:1"]
    with pytest.raises(ConfigError, match="eval.pipeline_stages=1 is fewer than the 2 servers"):
        config(urls, tmp_path, "eval.pipeline_stages=1")
    with pytest.raises(ConfigError, match="listed twice"):
        config([urls[0], urls[0]], tmp_path)
    # an http:// address for the websocket protocol: refused in one line, not retried as ws://http://...
    with pytest.raises(ConfigError, match=r"eval.server_url: http://x:8000 is an http:// address, and "
                       r"eval.backend=wamkit speaks websocket: give ws://x:8000"):  # fmt: skip
        config(["http://x:8000"], tmp_path, "eval.pipeline_stages=1")
    assert config(["x:8000"], tmp_path, "eval.pipeline_stages=1").eval.server_urls == ["x:8000"]
    with pytest.raises(ConfigError, match="eval.num_envs=3 is not a multiple of the 2 servers"):
        config(urls, tmp_path, "eval.pipeline_stages=0", "eval.num_envs=3")


def test_auto_and_the_bound_count_every_server():
    assert auto_candidates(16) == [1, 2, 4, 8] and auto_candidates(16, 2) == [2, 4, 8]
    assert auto_candidates(12, 4) == [4]  # 12 stages would exceed 8
    # inference-bound: 40 ms per request whatever its size; one server wants few stages, and two
    # servers halve the inference side of the cycle and of the bound
    cal = Calibration(t_step=0.0001, t_reset=0.0, latency={1: 0.04, 8: 0.04, 16: 0.04})
    assert choose_stages(cal, 16, 2, 8)[0] == 1 and choose_stages(cal, 16, 2, 8, servers=2)[0] == 2
    reqs = [(8, 8, 0), (8, 8, 1)] * 5
    one = independent_bound(cal, 2, env_steps=1600, resets=0, requests=reqs)
    two = independent_bound(cal, 2, env_steps=1600, resets=0, requests=reqs, servers=2)
    assert one["bound_infer"] == pytest.approx(0.4) and two["bound_infer"] == pytest.approx(0.2)
    # each request at its own server's calibrated latency
    per = Calibration(0.001, 0.0, {8: 0.03}, server_latency=[{8: 0.02}, {8: 0.04}])
    assert independent_bound(per, 2, 0, 0, [(8, 8, 0), (8, 8, 1)], 2)["bound_infer"] == pytest.approx(0.03)


@contextlib.contextmanager
def _stopped(proc):
    """The server process frozen (SIGSTOP): it accepts connections but answers nothing."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@pytest.mark.slow
def test_a_hung_server_is_dropped_after_the_timeout(one_server, tmp_path):
    """Server b freezes (SIGSTOP) mid-run: after eval.server_timeout_s its request goes to server a."""
    with start_server_process(DELAY) as a, start_server_process(DELAY) as b, contextlib.ExitStack() as stack:

        def freezer(pipeline):
            def run():
                while not pipeline._stop.is_set():
                    if sum(server == 1 for _, _, server, _ in pipeline.requests) >= 2:
                        stack.enter_context(_stopped(b.proc))
                        return
                    time.sleep(0.01)

            threading.Thread(target=run, daemon=True).start()

        cfg = config([a.url, b.url], tmp_path, "eval.server_timeout_s=2")
        summary = run_eval(cfg, progress=False, on_pipeline=freezer)
    assert [d["url"] for d in summary["throughput"]["servers_dropped"]] == [b.url]
    assert results(tmp_path) == results(one_server)


@contextlib.contextmanager
def _hung_server():
    """A server that sends its metadata and then answers no request; each connection's thread ends
    when the client closes it. Yields its URL and the connections it has accepted."""
    opened = []

    def handler(ws):
        opened.append(ws)
        ws.send(packb({}))
        for _ in ws:  # read, never answer
            pass

    with sync_serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}", opened
        finally:
            server.shutdown()


def test_a_request_without_a_reply_times_out_in_the_calling_thread():
    """eval.server_timeout_s: the reply timeout is the client's own (no watcher thread closes a
    connection the stage may be reopening): each attempt waits its timeout on its own connection,
    then TimeoutError, an OSError as a lost connection's error is, so failover applies to it."""
    obs = {
        image_key("corner"): np.zeros((32, 32, 3), np.uint8),
        OBS_STATE: np.zeros(39, np.float32),
        TASK: "reach",
    }
    with _hung_server() as (url, opened):
        policy = RemotePolicy(url, ["corner"], patience=Patience(reply_timeout_s=0.3))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"no reply from {url} within 0.3 s"):
            policy([obs])
        assert time.monotonic() - t0 < 5
        assert len(opened) == 2  # the patient connection sent the request again once, on a fresh one
        policy.close()


def test_a_server_hung_in_the_calibration_stops_the_run_naming_it(tmp_path):
    """The calibration's connections have the run's reply timeout: a server that holds a calibration
    request stops the run with an error naming its URL, before any episode, instead of blocking it."""
    with _hung_server() as (url, _):
        one = ["eval.workers=1", "eval.num_envs=1", "eval.pipeline_stages=1"]
        cfg = config([url], tmp_path, "eval.server_timeout_s=0.5", *one)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"calibration: the server at {url} did not reply"):
            run_eval(cfg, progress=False)
        assert time.monotonic() - t0 < 20
    assert not (tmp_path / "episodes.jsonl").read_text()


def test_the_last_servers_failed_reconnect_stops_the_stage_instead_of_retrying_forever():
    """Two servers, both gone (refused ports): a stage that never connected drops its first server,
    moves to the last, and that one's reconnect, waited for as a single server's is, ends the stage
    with the connection error. So does a stage whose last server refuses its first connection."""
    from wamkit.eval.servers import ServerPool

    urls = []
    for _ in range(2):  # ports that were free a moment ago: nothing listens there
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            urls.append(f"ws://127.0.0.1:{s.getsockname()[1]}")
    tried = []

    def connect(url, patience):
        tried.append((url, patience.retries))
        return RemotePolicy(url, ["corner"], patience=patience)

    patience = Patience(retries=1, connect_timeout_s=0.5)
    for pool_urls, want in ((urls, [(urls[0], 0), (urls[1], 1)]), (urls[:1], [(urls[0], 1)])):
        tried.clear()
        policy = ServerPool(pool_urls, connect, stages=2, patience=patience).stage_policy(0)
        done = threading.Event()
        failure = []

        def run(policy=policy, failure=failure, done=done):
            try:
                policy([{}])
            except OSError as err:
                failure.append(err)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(20), f"the stage kept reconnecting: {tried[:6]} ..."
        assert failure and tried == want  # the first server failed fast, the last was waited for once
