"""The OpenPI websocket server, with dynamic batching, ``/healthz`` and ``/metrics``.

Protocol (what openpi-client, openpi's ``serve_policy`` and SGLang's ``/openpi/policy`` speak), on any
websocket path:

1. on connect the server sends ``msgpack(metadata)`` (see :meth:`ServedPolicy.metadata`);
2. each binary message is one ``msgpack-numpy`` request (an observation dict, or a batched one);
3. each reply is a binary ``msgpack-numpy`` dict: ``"actions"`` (or ``"frames"``) plus
   ``"server_timing"`` (``decode_ms``, ``queue_ms``, ``infer_ms``, ``batch_size``, ``total_ms``);
4. a bad request gets a **text** frame naming the problem, then close code 1011. Other connections
   are unaffected.

Replies on one connection come back in request order. A client may send several requests before
reading (up to ``max_in_flight``); they are batched with everyone else's. Plain HTTP: ``GET /healthz``
answers 200 (503 ``warming i/n`` while :func:`run_server` warms the batch buckets, ``serve.warm``),
``GET /metrics`` the Prometheus text.

Use :func:`start_server_in_thread` (tests, the evaluator) or :func:`run_server` (the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from wamkit.config import UserError
from wamkit.serve.batcher import CallerThreadExecutor, DynamicBatcher, ModelError
from wamkit.serve.codec import CodecError, packb, unpackb
from wamkit.serve.metrics import ServerMetrics
from wamkit.serve.policy import RequestError, ServedPolicy

log = logging.getLogger(__name__)


def _error_kind(err: BaseException) -> str:
    """The ``kind`` label of an error frame and of ``wamkit_errors_total``."""
    if isinstance(err, CodecError):
        return "decode"
    if isinstance(err, RequestError):
        return "request"
    return "model" if isinstance(err, ModelError) else "internal"


class PolicyServer:
    """Serve ``policy`` on ``host:port`` (``port=0`` picks a free port; see :attr:`port` once started)."""

    def __init__(
        self,
        policy: ServedPolicy,
        host: str = "127.0.0.1",
        port: int = 8000,
        max_batch: int = 32,
        max_wait_ms: float = 2.0,
        max_message_mb: float = 64.0,
        max_in_flight: int = 16,
        model_executor: Executor | None = None,
        empty_metadata: bool = False,
    ):
        self.policy = policy
        self.host, self.port = host, port
        self.max_bytes = int(max_message_mb * 2**20)
        self.max_in_flight = max_in_flight
        self.metrics = ServerMetrics()
        # (done, total) while the model warms its batch buckets (run_server's ``warm``): /healthz
        # answers 503 "warming done/total" until it is None
        self.warming: tuple[int, int] | None = None
        self._in_flight: dict[ServerConnection, int] = {}  # requests submitted and not yet answered
        # per connection: the batcher's call count when its last reply came, the group a batch may wait
        # for it in (None: never; only one unbatched observation, openpi's synchronous client, is
        # waited for: a client sending a batch axis, as the evaluator's stages do even for one env,
        # batches itself), and when that reply came
        self._answered: dict[ServerConnection, tuple[int, tuple | None, float]] = {}
        # per connection: seconds from its last reply to its next request (a synchronous client's
        # turnaround): a batch waits only for connections expected back within its patience
        self._turnaround: dict[ServerConnection, float] = {}
        self.batcher = DynamicBatcher(
            policy.run,
            max_batch,
            max_wait_ms,
            self.metrics,
            self._any_idle,
            self._any_returning,
            executor=model_executor,
        )
        # empty: as openpi's own servers and cosmos-framework's RoboLab server send
        self.metadata = (
            {} if empty_metadata else policy.metadata(max_batch=max_batch, max_message_bytes=self.max_bytes)
        )
        self._packed_metadata = packb(self.metadata)

    def _any_idle(self) -> bool:
        return any(n == 0 for n in self._in_flight.values())

    def _any_returning(self, group: tuple, until: float) -> bool:
        """Is a connection idle that the last model call answered with one unbatched observation of
        ``group``, and that is expected back (its last turnaround) by ``until`` (perf_counter s)?"""
        calls = self.batcher.calls
        for ws, n in self._in_flight.items():
            answered = self._answered.get(ws)
            if n or answered is None or answered[0] != calls or answered[1] != group:
                continue
            if answered[2] + self._turnaround.get(ws, 0.0) <= until:
                return True
        return False

    # -- HTTP --------------------------------------------------------------------------------------
    def _http(self, connection: ServerConnection, request: Any):
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            warming = self.warming
            if warming is not None:
                return connection.respond(
                    HTTPStatus.SERVICE_UNAVAILABLE, f"warming {warming[0]}/{warming[1]}\n"
                )
            return connection.respond(HTTPStatus.OK, "OK\n")
        if path == "/metrics":
            response = connection.respond(HTTPStatus.OK, self.metrics.render())
            response.headers["Content-Type"] = "text/plain; version=0.0.4; charset=utf-8"
            return response
        return None  # a websocket handshake

    # -- websocket ---------------------------------------------------------------------------------
    @staticmethod
    def _failed(err: Exception) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_exception(err)
        return future

    def _begin(self, ws: ServerConnection, message: str | bytes) -> asyncio.Future:
        """Decode and check one message now; return a future of (reply, timing) or of the error."""
        t0 = time.perf_counter()
        try:
            if isinstance(message, str):
                raise CodecError("expected a binary msgpack frame, got a text frame")
            if len(message) > self.max_bytes:
                raise CodecError(
                    f"message of {len(message)} bytes exceeds serve.max_message_mb ({self.max_bytes} bytes)"
                )
            request = self.policy.prepare(unpackb(message))
        except (CodecError, RequestError) as err:
            return self._failed(err)
        except Exception as err:  # noqa: BLE001 -- an input we did not foresee still gets a readable error
            log.exception("unexpected failure reading a request")
            return self._failed(RequestError(f"could not read the request ({type(err).__name__}: {err})"))
        decode_ms = (time.perf_counter() - t0) * 1000.0
        answered = self._answered.get(ws)
        if answered is not None and self._in_flight[ws] == 0:  # a synchronous client, back
            self._turnaround[ws] = t0 - answered[2]

        self._in_flight[ws] += 1
        queued = self.batcher.enqueue(request)  # in the queue as soon as it counts as in flight

        async def answer():
            try:
                reply, timing = await queued
                waited_for = None if request.batched else request.group
                self._answered[ws] = (self.batcher.calls, waited_for, time.perf_counter())
            finally:
                self._in_flight[ws] -= 1
            total = time.perf_counter() - t0
            self.metrics.request_done(request.n, total)
            return {**reply, "server_timing": {"decode_ms": decode_ms, **timing, "total_ms": total * 1000.0}}

        return asyncio.ensure_future(answer())

    async def _write(self, ws: ServerConnection, pending: asyncio.Queue) -> None:
        """Send replies in request order; on an error, send it as text and close 1011."""
        alive = True
        while (future := await pending.get()) is not None:
            try:
                data = packb(await future)
            except Exception as err:  # noqa: BLE001 -- every failure becomes this client's error frame
                kind = _error_kind(err)
                self.metrics.error(kind)
                if kind == "internal":
                    log.error("internal error answering %s", ws.remote_address, exc_info=err)
                elif alive:
                    log.info("%s: %s error: %s", ws.remote_address, kind, err)
                if alive:
                    with contextlib.suppress(ConnectionClosed):
                        await ws.send(f"{kind} error: {err}")
                        await ws.close(1011, f"{kind} error")
                alive = False
                continue
            if alive:
                try:
                    await ws.send(data)
                except ConnectionClosed:
                    alive = False  # the client vanished; keep draining so the reader never blocks

    async def _handle(self, ws: ServerConnection) -> None:
        self.metrics.connection(+1)
        self._in_flight[ws] = 0
        pending: asyncio.Queue = asyncio.Queue(maxsize=self.max_in_flight)
        writer = asyncio.create_task(self._write(ws, pending))
        try:
            await ws.send(self._packed_metadata)
            async for message in ws:
                future = self._begin(ws, message)
                await pending.put(future)
                if future.done() and future.exception() is not None:
                    break  # the protocol closes the connection after an error
        except ConnectionClosed:
            pass
        finally:
            await pending.put(None)
            await writer
            del self._in_flight[ws]
            self._answered.pop(ws, None)
            self._turnaround.pop(ws, None)
            self.metrics.connection(-1)

    async def serve(self, started: Any = None, stop: asyncio.Future | None = None) -> None:
        """Run until ``stop`` resolves (forever if None); ``started(port)`` is called once bound."""
        self.batcher.start()
        try:
            async with serve(
                self._handle,
                self.host,
                self.port,
                process_request=self._http,
                compression=None,
                # Above our own limit the request gets a readable error frame; far above it websockets
                # itself refuses the frame (close 1009) before buffering it.
                max_size=2 * self.max_bytes + 2**20,
                max_queue=4,
                ping_interval=None,  # openpi clients do not answer pings while blocked in a long infer
                close_timeout=2,  # a client that never answers the closing handshake does not hold up stop()
            ) as server:
                self.port = server.sockets[0].getsockname()[1]
                log.info(
                    "serving %s on ws://%s:%d (max_batch=%d, max_wait_ms=%g)",
                    self.policy.adapter.name,
                    self.host,
                    self.port,
                    self.batcher.max_batch,
                    self.batcher.max_wait * 1000,
                )
                if started is not None:
                    started(self.port)
                await (stop if stop is not None else asyncio.get_running_loop().create_future())
                # before closing, which waits for every connection's handler: the requests still
                # queued or running get "server is shutting down" now, instead of never
                await self.batcher.stop()
        finally:
            await self.batcher.stop()


class BindError(UserError, RuntimeError):
    """The server cannot listen on its address (a port in use, a host not this machine's)."""


class ServerHandle:
    """A server running on its own event loop in a daemon thread; a context manager."""

    def __init__(self, server: PolicyServer, started: Callable[[int], Any] | None = None):
        self.server = server
        self._started = started  # also called with the bound port, on the loop's thread
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future | None = None
        self._thread = threading.Thread(target=self._main, name="wamkit-server", daemon=True)

    def _main(self) -> None:
        async def run():
            self._loop = asyncio.get_running_loop()
            self._stop = self._loop.create_future()

            def started(port: int) -> None:
                if self._started is not None:
                    self._started(port)
                self._ready.set()

            await self.server.serve(started=started, stop=self._stop)

        try:
            asyncio.run(run())
        except BaseException as err:  # noqa: BLE001 -- handed to the starting thread below
            self._error = err
            self._ready.set()

    def start(self, timeout: float = 30.0) -> ServerHandle:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server did not start within {timeout} s")
        if isinstance(self._error, OSError):  # the address: taken, or not this machine's
            where = f"{self.server.host}:{self.server.port}"
            raise BindError(
                f"server failed to start: cannot listen on {where} ({self._error}); if another server "
                "holds the port, stop it or give another (--port N; --port 0 picks a free one)"
            ) from self._error
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error}") from self._error
        return self

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"ws://{self.server.host}:{self.port}"

    @property
    def metrics(self) -> ServerMetrics:
        return self.server.metrics

    def stop(self, timeout: float = 30.0) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(lambda: self._stop.done() or self._stop.set_result(None))
        self._thread.join(timeout)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_server_in_thread(
    policy: ServedPolicy, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> ServerHandle:
    """Start a server in a background thread and return once it listens; ``handle.port`` is the bound
    port. Use as ``with start_server_in_thread(policy) as srv: PolicyClient(srv.url)...``."""
    return ServerHandle(PolicyServer(policy, host, port, **kwargs)).start()


def run_server(
    policy: ServedPolicy,
    host: str = "127.0.0.1",
    port: int = 8000,
    started: Any = None,
    warm: tuple[int, ...] | list[int] = (),
    compile_cache: str = "",
    **kwargs: Any,
) -> None:
    """Serve in the foreground until interrupted (Ctrl-C). The model runs on this (the main) thread: a
    model's intra-op parallel regions run at full speed only from the main thread
    (:mod:`wamkit.serve.batcher`); the event loop (websockets, decoding and checking requests,
    batching, answering) runs in a thread. ``started(port)`` is called once bound.
    """
    warm_up = functools.partial(warm_buckets, policy, list(warm), compile_cache)
    _run_threaded(policy, host, port, started, warm_up, **kwargs)


def warm_buckets(
    policy: ServedPolicy, sizes: list[int], cache_dir: str, server: PolicyServer | None = None
) -> dict[str, Any] | None:
    """Run each batch size of ``sizes`` once (``serve.warm``), saying so in the log and, with a
    ``server``, in its ``/healthz``; what :meth:`ServedPolicy.warm` returns (None for no sizes)."""
    if not sizes:
        return None
    log.info("warming %d batch buckets %s before answering", len(sizes), sizes)
    t0 = time.perf_counter()

    def progress(done: int, total: int, n: int, seconds: float) -> None:
        if server is not None:
            server.warming = (done, total)
        log.info("warmed batch %d (%d/%d) in %.1f s", n, done, total, seconds)

    if server is not None:
        server.warming = (0, len(sizes))
    try:
        out = policy.warm(sizes, cache_dir, progress)
    finally:
        if server is not None:
            server.warming = None
    log.info("warm in %.1f s (compile cache: %s)", time.perf_counter() - t0, out["cache"])
    return out


def _log_failure(future: Any) -> None:
    err = future.exception()
    if err is not None:  # the server stays up: each request will report what the model cannot do
        log.error("warm-up failed: %s: %s", type(err).__name__, err)


def _run_threaded(
    policy: ServedPolicy, host: str, port: int, started: Any, warm_up: Any, **kwargs: Any
) -> None:
    executor = CallerThreadExecutor()
    server = PolicyServer(policy, host, port, model_executor=executor, **kwargs)
    handle = ServerHandle(server, started)
    handle.start()
    # first in the model thread's queue: requests that come meanwhile wait behind it
    executor.submit(warm_up, server).add_done_callback(_log_failure)
    try:
        executor.run()  # until the loop stops the batcher, which shuts the executor down
    except KeyboardInterrupt:  # run() has failed what it was running and what was queued
        log.info("interrupted: stopping the server")
    finally:
        executor.shutdown()
        handle.stop()
    if handle._error is not None:
        raise RuntimeError(f"server stopped: {handle._error}") from handle._error
    if handle._thread.is_alive():
        raise RuntimeError("the server's event loop did not stop within 30 s of the model's last call")
