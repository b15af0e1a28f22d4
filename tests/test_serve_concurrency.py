"""Dynamic batching under many clients (every reply matched to its request), the asyncio client with many
requests on one connection, reconnect with backoff, and wamkit's clients against a foreign server."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time

import numpy as np
import pytest
from openpi_client import msgpack_numpy
from websockets.exceptions import ConnectionClosed
from websockets.sync.server import serve as sync_serve

from wamkit.serve.client import AsyncPolicyClient, PolicyClient, ServerError
from wamkit.serve.loading import random_init
from wamkit.serve.server import start_server_in_thread


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C as an interactive shell leaves it: a test run started as a background job of a
    non-interactive shell inherits SIGINT ignored, and ``_thread.interrupt_main`` then does nothing,
    so the tests that stop a server with it would wait for ever."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def policy():
    # identity stats: the reply is the delay model's formula, so each request's answer is known
    return random_init("delay", "small", {"delay_ms": 4}, device="cpu")


def request(i: int, batch: int | None = None) -> dict:
    rng = np.random.default_rng(i)
    lead = () if batch is None else (batch,)
    return {
        "observation.images.corner": rng.integers(
            0, 256, (*lead, 32, 32, 3), dtype=np.uint8
        ),  # resized to 128
        "observation.state": rng.standard_normal((*lead, 39)).astype(np.float32),
        "prompt": f"task {i}" if batch is None else [f"task {i}.{j}" for j in range(batch)],
    }


def test_run_server_runs_the_model_on_the_main_thread_and_stops_on_ctrl_c():
    # `wamkit serve` (run_server): the model's calls run on the main thread, the event loop in its own;
    # a model's intra-op parallel regions are far slower from a secondary thread (serve/batcher.py)
    import _thread
    import queue

    from wamkit.serve.server import run_server

    served = random_init("delay", "small", {"delay_ms": 4}, device="cpu")
    threads, replies, ports = [], [], queue.SimpleQueue()
    run = served.run

    def recording_run(requests):
        threads.append(threading.current_thread())
        return run(requests)

    served.run = recording_run

    def client() -> None:
        try:
            with PolicyClient(f"ws://127.0.0.1:{ports.get(timeout=60)}") as cl:
                replies.extend(cl.infer(request(i)) for i in range(3))
        finally:
            _thread.interrupt_main()  # Ctrl-C

    threading.Thread(target=client, daemon=True).start()
    run_server(served, "127.0.0.1", 0, started=ports.put, max_batch=8)  # returns on the interrupt
    assert len(replies) == 3 and all(r["actions"].shape == (16, 4) for r in replies)
    np.testing.assert_array_equal(replies[0]["actions"], served.infer(request(0))["actions"])
    assert threads and all(t is threading.main_thread() for t in threads)


def test_ctrl_c_on_the_main_thread_is_taken_between_calls():
    """SIGINT during a model call lets that call finish and hand over its result (its done-callbacks
    run: an interrupt between a future's result and its callbacks would leave a request waiting for
    ever), then run() raises KeyboardInterrupt and the queued calls fail; a second SIGINT during a call
    interrupts it at once. The SIGINT handler is restored afterwards."""
    import _thread
    import signal

    from wamkit.serve.batcher import CallerThreadExecutor, ModelError

    before = signal.getsignal(signal.SIGINT)
    ex = CallerThreadExecutor()
    woken = []

    def call():
        _thread.interrupt_main()  # Ctrl-C arrives while the model runs
        time.sleep(0.05)  # the handler runs here, on the main thread, and only takes note
        return 42

    first = ex.submit(call)
    first.add_done_callback(lambda f: woken.append(f.result()))
    second = ex.submit(lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        ex.run()
    assert first.result(timeout=1) == 42 and woken == [42]
    assert isinstance(second.exception(timeout=1), ModelError)
    assert signal.getsignal(signal.SIGINT) is before

    ex = CallerThreadExecutor()

    def stuck():
        _thread.interrupt_main()
        time.sleep(0.05)
        _thread.interrupt_main()  # the second Ctrl-C: the call itself is interrupted
        time.sleep(5)
        return 0

    slow = ex.submit(stuck)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        ex.run()
    assert time.perf_counter() - t0 < 4 and isinstance(slow.exception(timeout=1), ModelError)


def test_caller_thread_executor_fails_what_an_interrupt_leaves():
    # Ctrl-C during a model call: that call and every queued one fail (none is left unanswered, which
    # would hold its connection and the server's stop forever), and no call is taken after
    from wamkit.serve.batcher import CallerThreadExecutor, ModelError

    ex = CallerThreadExecutor()

    def interrupted():
        raise KeyboardInterrupt

    first, second = ex.submit(interrupted), ex.submit(lambda: 1)
    with pytest.raises(KeyboardInterrupt):
        ex.run()
    for future in (first, second):
        assert isinstance(future.exception(timeout=1), ModelError)
    with pytest.raises(ModelError, match="shutting down"):
        ex.submit(lambda: 2)
    # a call that raises an ordinary error fails alone and the loop goes on; shutdown ends it
    ex = CallerThreadExecutor()
    runner = threading.Thread(target=ex.run, kwargs={"poll_s": 0.05})
    runner.start()
    bad, good = ex.submit(lambda: 1 / 0), ex.submit(lambda: 3)
    assert good.result(timeout=10) == 3 and isinstance(bad.exception(timeout=10), ZeroDivisionError)
    ex.shutdown()
    runner.join(10)
    assert not runner.is_alive()


def _interrupt_under_load(served) -> int:
    """run_server with 8 clients sending nonstop, Ctrl-C once 20 replies came; the replies answered."""
    import _thread
    import queue

    from wamkit.serve.server import run_server

    ports, stop, answered = queue.SimpleQueue(), threading.Event(), []

    def client(port: int) -> None:
        with (
            contextlib.suppress(ServerError, ConnectionError, OSError, ConnectionClosed),
            PolicyClient(f"ws://127.0.0.1:{port}") as cl,
        ):
            while not stop.is_set():
                answered.append(cl.infer(request(len(answered))))

    def load() -> None:
        port = ports.get(timeout=60)
        for _ in range(8):
            threading.Thread(target=client, args=(port,), daemon=True).start()
        while len(answered) < 20:
            time.sleep(0.01)
        _thread.interrupt_main()  # Ctrl-C with batches queued and running
        stop.set()

    threading.Thread(target=load, daemon=True).start()
    # returns; raised on a hung stop
    run_server(served, "127.0.0.1", 0, started=ports.put, max_batch=4)
    return len(answered)


@pytest.mark.timeout(180)
def test_run_server_stops_on_ctrl_c_under_load():
    # Ctrl-C while clients keep sending: every request is answered or fails, and the server stops (a
    # request left unanswered held the websockets close, and the stop hung for 30 s)
    served = random_init("delay", "small", {"delay_ms": 20}, device="cpu")
    for _ in range(3):
        assert _interrupt_under_load(served) >= 20


def test_many_clients_every_reply_is_its_own(policy):
    n_clients, n_requests = 16, 12
    with start_server_in_thread(policy, max_batch=32, max_wait_ms=5.0) as srv:

        async def client(c: int) -> list[tuple[dict, dict]]:
            out = []
            async with AsyncPolicyClient(srv.url) as cl:
                for r in range(n_requests):
                    i = c * 1000 + r
                    req = request(i, batch=(1 + r % 3) if r % 4 == 0 else None)  # some batched requests
                    if r % 5 == 1:  # another mode: must never share a model call with policy requests
                        req |= {
                            "mode": "inverse_dynamics",
                            "goal_image": request(i + 1)["observation.images.corner"],
                        }
                        if "observation.state" in req and req["observation.state"].ndim == 2:
                            req["goal_image"] = np.repeat(req["goal_image"][None], len(req["prompt"]), 0)
                    out.append((req, await cl.infer(req)))
            return out

        async def run_all():
            return await asyncio.gather(*(client(c) for c in range(n_clients)))

        results = [pair for per_client in asyncio.run(run_all()) for pair in per_client]
        metrics = srv.metrics
    assert len(results) == n_clients * n_requests
    for req, reply in results:
        np.testing.assert_allclose(reply["actions"], policy.infer(req)["actions"], atol=1e-6)
    assert metrics.requests == len(results)
    assert metrics.model_calls < len(results) / 2, "the batcher did not gather concurrent requests"
    assert max(r["server_timing"]["batch_size"] for _, r in results) > 4


def test_async_client_many_requests_on_one_connection(policy):
    with start_server_in_thread(policy, max_wait_ms=5.0) as srv:

        async def run():
            async with AsyncPolicyClient(srv.url) as cl:
                reqs = [request(i) for i in range(24)]
                return reqs, await asyncio.gather(*(cl.infer(r) for r in reqs)), cl.metadata

        reqs, replies, meta = asyncio.run(run())
    assert meta["model"] == "delay"
    for req, reply in zip(reqs, replies):
        np.testing.assert_allclose(reply["actions"], policy.infer(req)["actions"], atol=1e-6)
    assert max(r["server_timing"]["batch_size"] for r in replies) > 1  # pipelined requests were batched


def _staggered_batches(delay_policy, batch: int | None, patience: float, monkeypatch) -> list[int]:
    """Batch sizes seen by 6 synchronous clients whose next requests come back staggered by 3 ms each
    (more than max_wait_ms=1 apart) after every reply, served by a model call of 60 ms."""
    from wamkit.serve import batcher

    monkeypatch.setattr(batcher, "RETURN_PATIENCE", patience)
    with start_server_in_thread(delay_policy, max_batch=32, max_wait_ms=1.0) as srv:

        async def client(c: int) -> list[int]:
            sizes = []
            async with AsyncPolicyClient(srv.url) as cl:
                for r in range(6):
                    await asyncio.sleep(0.002 + 0.003 * c)
                    sizes.append((await cl.infer(request(c * 100 + r, batch)))["server_timing"]["batch_size"])
            return sizes[2:]  # from the third request on, the previous call's duration is known

        async def run_all():
            return await asyncio.gather(*(client(c) for c in range(6)))

        return [s for per_client in asyncio.run(run_all()) for s in per_client]


def test_a_batch_waits_for_returning_one_observation_clients(monkeypatch):
    slow = random_init("delay", "small", {"delay_ms": 60}, device="cpu")
    # without patience the staggered clients fall apart into smaller batches: the check can fail
    alone = _staggered_batches(slow, None, 0.0, monkeypatch)
    assert np.mean(np.array(alone) == 6) < 0.5, alone
    sizes = _staggered_batches(slow, None, 0.5, monkeypatch)  # the default RETURN_PATIENCE
    assert np.mean(np.array(sizes) == 6) >= 0.75, sizes
    # connections that send a batch axis (here of one observation, as an evaluator stage of one env
    # does) batch for themselves: never waited for
    batched = _staggered_batches(slow, 1, 0.5, monkeypatch)
    assert np.mean(np.array(batched) == 6) < 0.5, batched


def test_a_batch_waits_only_for_clients_that_can_join_it_and_come_back_in_time(policy):
    from wamkit.serve.server import PolicyServer

    srv = PolicyServer(policy)
    srv.batcher.calls = 7
    policy_group, now = ("policy",), 100.0
    clients = {
        "back soon": (7, policy_group, now, 0.01),  # answered by the last call, returns in 10 ms
        "too late": (7, policy_group, now, 0.5),  # its turnaround is longer than the patience
        "other mode": (7, ("inverse_dynamics",), now, 0.0),  # could not join a policy batch
        "never": (7, None, now, 0.0),  # sent a batch axis, or a seed: batches itself / runs alone
        "older": (6, policy_group, now, 0.0),  # answered by an earlier call: not on its way back
    }
    for name, (calls, group, at, turnaround) in clients.items():
        srv._in_flight[name], srv._answered[name], srv._turnaround[name] = 0, (calls, group, at), turnaround

    def waited_for(until: float) -> set[str]:
        found = set()
        for name in clients:
            saved = {k: (srv._in_flight[k], srv._answered[k]) for k in clients if k != name}
            for k in saved:
                srv._in_flight[k] = 1  # only `name` is idle
            if srv._any_returning(policy_group, until):
                found.add(name)
            for k, (n, _) in saved.items():
                srv._in_flight[k] = n
        return found

    assert waited_for(now + 0.05) == {"back soon"}
    assert waited_for(now + 1.0) == {"back soon", "too late"}
    srv._in_flight["back soon"] = 1  # it sent: nothing to wait for any more
    assert not srv._any_returning(policy_group, now + 0.05)


def test_async_client_error_fails_only_the_bad_request(policy):
    with start_server_in_thread(policy) as srv:

        async def run():
            async with AsyncPolicyClient(srv.url) as cl:
                good = [cl.infer(request(i)) for i in range(4)]
                bad = cl.infer({"prompt": "x"})
                return await asyncio.gather(*good, bad, return_exceptions=True)

        results = asyncio.run(run())
    assert isinstance(results[-1], ServerError) and "lacks observation.state" in str(results[-1])
    for i, r in enumerate(results[:-1]):
        np.testing.assert_allclose(r["actions"], policy.infer(request(i))["actions"], atol=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clients_wait_for_a_late_server_and_survive_a_restart(policy):
    port = _free_port()
    started = []
    timer = threading.Timer(0.6, lambda: started.append(start_server_in_thread(policy, port=port)))
    timer.start()
    t0 = time.monotonic()
    client = PolicyClient(f"127.0.0.1:{port}", connect_timeout_s=20)  # retries with backoff meanwhile
    assert time.monotonic() - t0 >= 0.5 and client.metadata["model"] == "delay"
    assert client.infer(request(1))["actions"].shape == (16, 4)

    async def async_side():  # one event loop for the async client's whole life
        acl = AsyncPolicyClient(f"127.0.0.1:{port}")
        assert (await acl.infer(request(2)))["actions"].shape == (16, 4)
        await asyncio.to_thread(started[0].stop)  # off the loop, so the client answers the close handshake
        second = start_server_in_thread(policy, port=port)  # same port, new server: both clients reconnect
        got_sync = client.infer(request(3))["actions"]
        got_async = (await acl.infer(request(4)))["actions"]
        await acl.close()
        second.stop()
        return got_sync, got_async

    got_sync, got_async = asyncio.run(async_side())
    np.testing.assert_allclose(got_sync, policy.infer(request(3))["actions"], atol=1e-6)
    np.testing.assert_allclose(got_async, policy.infer(request(4))["actions"], atol=1e-6)
    client.close()


def test_connect_gives_up_with_a_clear_error():
    with pytest.raises(ConnectionError, match="cannot connect to ws://127.0.0.1:"):
        PolicyClient(f"127.0.0.1:{_free_port()}", connect_timeout_s=0.3)


def test_wamkit_clients_against_a_foreign_openpi_server():
    """A server written the way openpi's ``serve_policy`` is (openpi-client's msgpack_numpy, str keys)."""

    def handler(ws):
        ws.send(msgpack_numpy.packb({"policy": "foreign", "action_horizon": 4}))
        for message in ws:
            obs = msgpack_numpy.unpackb(message)
            if "observation/state" not in obs:
                ws.send("KeyError: 'observation/state'")
                ws.close(1011, "internal error")
                return
            state = np.asarray(obs["observation/state"], np.float32)
            ws.send(
                msgpack_numpy.packb(
                    {"actions": np.tile(state * 2, (4, 1)), "server_timing": {"infer_ms": 0.1}}
                )
            )

    with sync_serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        state = np.arange(8, dtype=np.float32)
        with PolicyClient(url) as client:
            assert client.metadata == {"policy": "foreign", "action_horizon": 4}
            np.testing.assert_array_equal(
                client.infer({"observation/state": state})["actions"], np.tile(state * 2, (4, 1))
            )
            with pytest.raises(ServerError, match="KeyError"):
                client.infer({"prompt": "no state"})
            assert client.infer({"observation/state": state})["actions"].shape == (4, 8)  # reconnected

        async def run():
            async with AsyncPolicyClient(url) as cl:
                return await asyncio.gather(*(cl.infer({"observation/state": state + i}) for i in range(5)))

        for i, reply in enumerate(asyncio.run(run())):
            np.testing.assert_array_equal(reply["actions"][0], (state + i) * 2)
        server.shutdown()


def test_a_reply_timeout_fails_in_the_calling_thread_and_a_late_reply_answers_nothing():
    """A server that answers connections 0 and 2 late (after 20 s) and the others at once. A reply
    timeout (2 s) raises TimeoutError in the calling thread, well before the late reply; the next
    request gets its own reply on a fresh connection, never the late one; with a retry left, the
    request is sent again on a fresh connection and answered there. The margins are seconds, so a
    loaded machine's scheduling does not decide the outcome."""
    opened: list[int] = []

    def handler(ws):
        conn = len(opened)
        opened.append(conn)
        ws.send(msgpack_numpy.packb({"policy": "late on some connections"}))
        try:
            for message in ws:
                if conn in (0, 2):
                    with contextlib.suppress(TimeoutError):
                        ws.recv(timeout=20)  # 20 s late, unless the client closes first (it must)
                ws.send(msgpack_numpy.packb({"conn": conn, "n": msgpack_numpy.unpackb(message)["n"]}))
        except ConnectionClosed:
            return  # ends with the client's connection, not after the test

    with sync_serve(handler, "127.0.0.1", 0, compression=None, max_size=None) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        with PolicyClient(url, retries=0) as client:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"no reply from {url} within 2 s"):
                client.infer({"n": 1}, timeout_s=2.0)
            assert time.monotonic() - t0 < 15  # the timeout's, not the late reply's 20 s
            assert client.infer({"n": 2}, timeout_s=5.0) == {"conn": 1, "n": 2}
        with PolicyClient(url, retries=1) as client:
            assert client.infer({"n": 3}, timeout_s=2.0) == {"conn": 3, "n": 3}
            assert client.infer({"n": 4}) == {"conn": 3, "n": 4}  # no timeout: as before
        assert opened == [0, 1, 2, 3]
        server.shutdown()


def test_a_server_that_cannot_bind_says_why_once():
    from wamkit.config import UserError
    from wamkit.serve.server import run_server

    served = random_init("delay", "small", device="cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="server failed to start") as err:
            run_server(served, "127.0.0.1", port)
    assert str(err.value).count("server failed to start") == 1 and "Errno" in str(err.value)
    assert isinstance(err.value, UserError)  # the command prints it in one line: the user's to fix


def test_stopping_the_batcher_fails_a_batch_still_gathering_and_what_comes_after():
    """stop() while a batch waits for more requests (a long max_wait_ms, room for more): its request
    fails with "shutting down" at once instead of waiting forever, as does one enqueued after stop()
    (a connection read it late). A hung future here would hold its connection and the server's close."""
    from wamkit.serve.batcher import DynamicBatcher, ModelError
    from wamkit.serve.policy import Request

    def one() -> Request:
        return Request(batch={}, n=1, batched=False)

    async def scenario():
        batcher = DynamicBatcher(lambda reqs: [{} for _ in reqs], max_batch=4, max_wait_ms=60_000)
        batcher.start()
        gathering = batcher.enqueue(one())
        await asyncio.sleep(0.2)  # the loop took it and waits up to 60 s for three more
        assert not gathering.done()
        await asyncio.wait_for(batcher.stop(), 10)
        late = batcher.enqueue(one())
        return await asyncio.wait_for(asyncio.gather(gathering, late, return_exceptions=True), 10)

    for error in asyncio.run(scenario()):
        assert isinstance(error, ModelError) and "shutting down" in str(error)
