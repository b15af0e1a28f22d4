"""Clients of the OpenPI websocket protocol: :class:`PolicyClient` (blocking) and :class:`AsyncPolicyClient`.

Both work against any server that speaks the protocol (wamkit's, openpi's ``serve_policy``, SGLang's
``/openpi/policy``): they read the metadata sent on connect, send msgpack-numpy observation dicts and
read msgpack-numpy replies; a text frame is the server's error and raises :class:`ServerError`.

Connecting retries with exponential backoff (``backoff_s`` doubling up to ``max_backoff_s``) until
``connect_timeout_s``. A request whose connection dropped before its reply (a restarting server, a
network blip, another request's error closing the shared connection) is sent again once on a fresh
connection; inference requests are idempotent. A request the server *refused* is not retried.

``PolicyClient.infer(obs, timeout_s=T)`` waits at most T seconds for a reply (per attempt). A reply
that has not come by then is taken as a lost connection: the connection is closed (a late reply must
never answer the next request), the request sent again on a fresh one while retries last, and then
:class:`TimeoutError` is raised in the calling thread (an ``OSError``, as ``ConnectionError`` is).

:class:`RealTimeClient` is what a robot program calls at its control rate: it executes one chunk while
requesting the next, with real-time chunking's fields when the server takes them (docs/serve.md).

``AsyncPolicyClient`` allows many concurrent ``infer`` calls on one connection: they are sent in call
order and the server answers in the same order, so each caller gets its own reply.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from typing import Any

import numpy as np
import websockets.sync.client
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from wamkit.config import UserError
from wamkit.serve.codec import packb, unpackb

log = logging.getLogger(__name__)
_CONNECT_ERRORS = (OSError, InvalidHandshake, TimeoutError, asyncio.TimeoutError)


class ServerError(UserError, RuntimeError):
    """The server answered a request with an error (a text frame): the message names the server and
    gives its words (a request it refuses, a shape it does not take); the ``wamkit`` command prints it
    in one line, and the server's own log holds the rest."""


class ServerUnreachable(UserError, ConnectionError):
    """No server answered at the URL within the connect timeout; the message names the URL."""


class _Dropped(ConnectionError):
    """The connection went away before this request's reply arrived."""


def normalize_url(url: str) -> str:
    """``host:port`` -> ``ws://host:port``; ``ws://`` / ``wss://`` URLs (with any path) unchanged."""
    return url if url.startswith(("ws://", "wss://")) else f"ws://{url}"


def _decode_reply(message: str | bytes, url: str = "") -> dict[str, Any]:
    if isinstance(message, str):
        raise ServerError(f"the server at {url} answered: {message}" if url else message)
    return unpackb(message)


class _Backoff:
    def __init__(self, url: str, timeout_s: float, backoff_s: float, max_backoff_s: float):
        self.url, self.timeout_s, self.deadline = url, timeout_s, time.monotonic() + timeout_s
        self.delay, self.max_delay, self.attempt = backoff_s, max_backoff_s, 0

    def next_delay(self, err: BaseException) -> float:
        """Seconds to wait before the next attempt; raises ServerUnreachable once the time is up."""
        self.attempt += 1
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ServerUnreachable(
                f"cannot connect to {self.url} after {self.attempt} attempts in {self.timeout_s:g} s: {err}; "
                "is a server (wamkit serve) listening there?"
            ) from err
        if self.attempt == 1 and left > 1.0:  # a wait a person would notice: say what it waits for
            log.info("waiting for a server at %s (%s); giving up in %.0f s", self.url, err, left)
        delay = min(self.delay, left)
        log.debug("connecting to %s failed (%s); retrying in %.2f s", self.url, err, delay)
        self.delay = min(self.delay * 2, self.max_delay)
        return delay


class PolicyClient:
    """Blocking client: ``PolicyClient("ws://127.0.0.1:8000").infer(obs) -> {"actions": ...}``."""

    def __init__(
        self,
        url: str,
        connect_timeout_s: float = 30.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        retries: int = 1,
    ):
        self.url = normalize_url(url)
        self._opts = (connect_timeout_s, backoff_s, max_backoff_s)
        self.retries = retries
        self._ws: websockets.sync.client.ClientConnection | None = None
        self.metadata: dict[str, Any] = {}
        self._connect()

    def _connect(self) -> websockets.sync.client.ClientConnection:
        backoff = _Backoff(self.url, *self._opts)
        while True:
            try:
                # entered by hand: the connection outlives this call (websockets >= 17.1 warns otherwise)
                ws = websockets.sync.client.connect(
                    self.url, compression=None, max_size=None, open_timeout=10
                ).__enter__()
                self.metadata = unpackb(ws.recv())
                self._ws = ws
                return ws
            except InvalidURI:
                raise
            except (*_CONNECT_ERRORS, ConnectionClosed) as err:
                time.sleep(backoff.next_delay(err))

    def infer(self, obs: dict[str, Any], timeout_s: float = 0.0) -> dict[str, Any]:
        """Send one (single or batched) observation dict; return the decoded reply.

        ``timeout_s`` > 0: seconds each attempt waits for its reply before the connection counts as
        lost (module docstring); :class:`TimeoutError` once the retries are spent. 0 waits forever."""
        data = packb(obs)
        for attempt in range(self.retries + 1):
            ws = self._ws if self._ws is not None else self._connect()
            try:
                ws.send(data)
                message = ws.recv(timeout=timeout_s if timeout_s > 0 else None)
            except ConnectionClosed as err:
                self._ws = None
                if attempt == self.retries:
                    raise ConnectionError(f"connection to {self.url} lost: {err}") from err
                continue
            except TimeoutError as err:
                self.close()
                if attempt == self.retries:
                    raise TimeoutError(f"no reply from {self.url} within {timeout_s:g} s") from err
                log.warning("no reply from %s within %g s; sending the request again", self.url, timeout_s)
                continue
            if isinstance(message, str):
                self.close()  # the server closes after an error; the next call reconnects
            return _decode_reply(message, self.url)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._ws is not None:
            self._ws.close()
            self._ws = None

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Connection:
    """One websocket and the futures of its requests, oldest first (replies come back in order)."""

    def __init__(self, ws: ClientConnection):
        self.ws = ws
        self.waiting: collections.deque[asyncio.Future] = collections.deque()
        self.reader: asyncio.Task | None = None


class AsyncPolicyClient:
    """asyncio client: ``async with AsyncPolicyClient(url) as c: reply = await c.infer(obs)``."""

    def __init__(
        self,
        url: str,
        connect_timeout_s: float = 30.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        retries: int = 1,
    ):
        self.url = normalize_url(url)
        self._opts = (connect_timeout_s, backoff_s, max_backoff_s)
        self.retries = retries
        self.metadata: dict[str, Any] = {}
        self._conn: _Connection | None = None
        self._send_lock = asyncio.Lock()
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> AsyncPolicyClient:
        """Connect (with backoff) unless connected; read the metadata."""
        await self._connection()
        return self

    async def _connection(self) -> _Connection:
        async with self._connect_lock:
            if self._conn is not None:
                return self._conn
            backoff = _Backoff(self.url, *self._opts)
            while True:
                try:
                    ws = await connect(self.url, compression=None, max_size=None, open_timeout=10)
                    self.metadata = unpackb(await ws.recv())
                    break
                except InvalidURI:
                    raise
                except (*_CONNECT_ERRORS, ConnectionClosed) as err:
                    await asyncio.sleep(backoff.next_delay(err))
            conn = self._conn = _Connection(ws)
            conn.reader = asyncio.create_task(self._read(conn))
            return conn

    async def _read(self, conn: _Connection) -> None:
        """Hand each reply to the oldest waiting request; fail the rest when the connection ends."""
        try:
            async for message in conn.ws:
                if not conn.waiting:
                    log.warning("reply from %s with no request waiting; dropped", self.url)
                    continue
                future = conn.waiting.popleft()
                if future.done():
                    continue
                try:
                    future.set_result(_decode_reply(message, self.url))
                except (ServerError, ValueError) as err:
                    future.set_exception(err)
        except ConnectionClosed:
            pass
        finally:
            if self._conn is conn:
                self._conn = None
            while conn.waiting:
                future = conn.waiting.popleft()
                if not future.done():
                    future.set_exception(_Dropped(f"connection to {self.url} closed before the reply"))

    async def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        """Send one (single or batched) observation dict; return the decoded reply."""
        data = packb(obs)
        for attempt in range(self.retries + 1):
            conn = await self._connection()
            future = asyncio.get_running_loop().create_future()
            try:
                async with self._send_lock:
                    # Appending and sending under one lock keeps the futures in the order of the wire.
                    conn.waiting.append(future)
                    await conn.ws.send(data)
                return await future
            except (ConnectionClosed, _Dropped) as err:
                if self._conn is conn:
                    self._conn = None
                if not future.done():
                    future.cancel()
                if attempt == self.retries:
                    raise ConnectionError(f"connection to {self.url} lost: {err}") from err
        raise AssertionError("unreachable")

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.ws.close()
            if conn.reader is not None:
                await conn.reader

    async def __aenter__(self) -> AsyncPolicyClient:
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class ServerLate(RuntimeError):
    """A :class:`RealTimeClient` ran out of actions: its server answered too late, or not at all."""


class RealTimeClient:
    """The client a robot program calls at its control rate: ``act(obs)`` returns the action for now.

    It executes one chunk while the next is computed: once ``replan_interval`` actions of the current
    chunk have run (default half the chunk), ``act`` sends the observation it was given in the
    background, with the chunk's actions not yet executed and the delay ``d`` it expects (steps:
    the largest of the last ``window`` measured latencies x ``control_hz``, rounded up, or
    ``delay_steps`` when fixed) when the server does real-time chunking (its metadata says
    ``real_time_chunking``; docs/serve.md). When the reply arrives after ``e`` steps, the new chunk
    takes over at its action ``e`` (its first ``e`` were for steps the old chunk ran). The first call
    waits for its chunk (a robot waits for its first plan).

    Degrading: when the chunk runs out before the reply (a late or failed server), ``act`` holds:
    it returns ``hold_action`` (default: the chunk's last action) and logs a warning, for at most
    ``max_hold_steps`` steps (default a quarter of the chunk); then it raises :class:`ServerLate`,
    naming the server, the wait and the server's error if it failed. ``clock`` (seconds) and
    ``executor`` (where requests run; ``submit(fn, *args) -> future``) are the robot's and a thread by
    default; tests give a fake clock.
    """

    def __init__(
        self,
        policy: Any,
        control_hz: float,
        replan_interval: int = 0,
        delay_steps: int | None = None,
        rtc: bool = True,
        max_hold_steps: int | None = None,
        hold_action: Any = None,
        seed: int | None = None,
        clock: Any = time.monotonic,
        executor: Any = None,
        window: int = 10,
        timeout_s: float = 0.0,
    ):
        if control_hz <= 0:
            raise ValueError(f"control_hz: expected > 0, got {control_hz}")
        self.policy, self.hz, self.clock = policy, float(control_hz), clock
        meta = getattr(policy, "metadata", None) or {}
        self.horizon = int(meta.get("chunk") or meta.get("action_horizon") or 0)
        if self.horizon < 2:
            raise ValueError(
                f"the server at {getattr(policy, 'url', '?')} names no chunk of 2 or more actions"
            )
        self.replan = replan_interval or self.horizon // 2
        if not 1 <= self.replan < self.horizon:
            raise ValueError(f"replan_interval: expected 1..{self.horizon - 1}, got {self.replan}")
        self.fixed_delay = delay_steps
        self.rtc = bool(rtc and meta.get("real_time_chunking"))
        self.max_hold = max(1, self.horizon // 4) if max_hold_steps is None else max_hold_steps
        self.hold_action = None if hold_action is None else np.asarray(hold_action, np.float32)
        self.seed, self.timeout_s, self.window = seed, timeout_s, window
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rt-client")
        self._own_executor = executor is None
        self.chunk: Any = None
        self.index = 0  # next action of ``chunk``
        self.step = 0  # actions returned so far
        self.since_request = 0  # actions returned since the last request went out
        self.pending: tuple[Any, int, float] | None = None  # (future, step sent, clock sent)
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)
        self.requests = 0
        self.holding = 0
        self.error: BaseException | None = None

    @property
    def delay(self) -> int:
        """The delay, in control steps, the next request expects."""
        if self.fixed_delay is not None:
            return self.fixed_delay
        if not self.latencies:
            return 0
        return min(self.replan, max(0, math.ceil(max(self.latencies) * self.hz - 1e-6)))

    def _request(self, obs: dict[str, Any]) -> dict[str, Any]:
        req = dict(obs)
        if self.seed is not None:
            req["seed"] = self.seed + self.requests
        self.requests += 1
        if self.rtc and self.chunk is not None:
            left = self.chunk[self.index :]
            req["prev_actions"], req["delay"] = left, min(self.delay, len(left))
        return req

    def _infer(self, req: dict[str, Any]) -> Any:
        return np.asarray(self.policy.infer(req, timeout_s=self.timeout_s)["actions"], np.float32)

    def act(self, obs: dict[str, Any]) -> Any:
        """The action to execute now, given the observation now (one per control step)."""
        if self.chunk is None:  # the first plan: wait for it
            t0 = self.clock()
            self.chunk, self.index = self._infer(self._request(obs)), 0
            self.latencies.append(self.clock() - t0)
        else:
            self._take_reply()
        if self.pending is None and self.error is None and self.since_request >= self.replan:
            req = self._request(obs)
            self.pending = (self._executor.submit(self._infer, req), self.step, self.clock())
            self.since_request = 0
        if self.index >= len(self.chunk):
            return self._hold()
        action = self.chunk[self.index]
        self.index += 1
        self.step += 1
        self.since_request += 1
        self.holding = 0
        return action

    def _take_reply(self) -> None:
        if self.pending is None or not self.pending[0].done():
            return
        future, sent_step, sent_at = self.pending
        self.pending = None
        try:
            chunk = future.result()
        except Exception as err:  # the server is gone or refused: the chunk left runs, then hold
            self.error = err
            log.warning(
                "real-time client: the request to %s failed (%s)", getattr(self.policy, "url", "?"), err
            )
            return
        self.latencies.append(self.clock() - sent_at)
        elapsed = self.step - sent_step  # old actions executed meanwhile
        if elapsed >= len(chunk):
            log.warning("real-time client: a reply %d steps late was dropped", elapsed)
            return
        self.chunk, self.index = chunk, elapsed

    def _hold(self) -> Any:
        self.holding += 1
        waited = self.holding
        if waited > self.max_hold:
            url = getattr(self.policy, "url", "the server")
            why = f": {self.error}" if self.error is not None else ""
            raise ServerLate(
                f"no chunk from {url} for {waited - 1} steps after the last one ran out "
                f"({(waited - 1) / self.hz:.2f} s at {self.hz:g} Hz; max_hold_steps={self.max_hold}){why}"
            ) from self.error
        if waited == 1:
            log.warning("real-time client: the chunk ran out before the next reply; holding")
        self.step += 1
        return self.hold_action if self.hold_action is not None else self.chunk[-1]

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
