"""What every backend shares: the target a connection is made for, and its errors.

A connection is a callable ``policy(obs_list, seeds=None) -> (actions [B, H, D] float32, server
seconds, call size)`` with ``metadata`` (what the server said about itself), ``identity`` (what it serves, for
``plan.json`` and ``--resume``; None when the server cannot tell) and ``close()``. ``seeds`` holds the
evaluator's noise seed per observation (:func:`~wamkit.eval.episodes.request_seed`): ``wamkit`` sends
them as the request's per-row ``seed``; the other backends ignore them (their protocols seed a whole
request or nothing; ``cosmos_http`` and ``sglang`` send their target's ``seed`` option instead), so
their episodes repeat only as far as their servers' own seeding does.

Errors: a reply that is wrong (a malformed body, actions of the wrong shape or width) raises
:class:`BackendError`, which names the backend, the URL and the field, and stops the run (sending it
again would get the same answer). A server that cannot be reached, drops the connection or answers
not within ``eval.server_timeout_s`` raises ``ConnectionError`` / ``TimeoutError`` after the
:class:`Patience` retries: with several servers its stages move to another one,
with one the run stops; either way every episode already journaled stays.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wamkit.config import UserError


@runtime_checkable
class PolicyConnection(Protocol):
    """One connection to one server, as the evaluator uses it (the module docstring): every backend's
    connection is one, and :func:`as_connection` makes one of a caller's bare function."""

    metadata: dict[str, Any]  # what the server said about itself ({} where it says nothing)
    identity: dict[str, Any] | None  # what it serves, for plan.json and --resume (None: it cannot tell)

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]: ...

    def close(self) -> None: ...


class _BareConnection:
    """A caller's function ``policy(obs_list, seeds)`` (tests, ``run_eval(policy_factory=...)``) as a
    :class:`PolicyConnection`: it says nothing about its server and holds nothing to close."""

    def __init__(self, fn: Callable) -> None:
        self._fn = fn
        self.metadata: dict[str, Any] = {}
        self.identity: dict[str, Any] | None = None

    def __call__(self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None) -> Any:
        return self._fn(obs_list, seeds)

    def close(self) -> None:
        return None


def as_connection(policy: Any) -> PolicyConnection:
    """``policy`` as a :class:`PolicyConnection`: itself where it is one, else wrapped."""
    return policy if isinstance(policy, PolicyConnection) else _BareConnection(policy)


@dataclass(frozen=True)
class Patience:
    """How long one connection waits for its server before the request fails with ``ConnectionError``
    (``TimeoutError`` when the server never replied).

    ``retries``: a dropped connection is reopened this often (with backoff, for up to
    ``connect_timeout_s``) and the request sent again; ``reply_timeout_s``: seconds a request may wait
    for its reply (0: forever)."""

    retries: int = 1
    connect_timeout_s: float = 30.0
    reply_timeout_s: float = 0.0

    def client(self, url: str):
        from wamkit.serve.client import PolicyClient

        return PolicyClient(url, connect_timeout_s=self.connect_timeout_s, retries=self.retries)

    def failover(self) -> Patience:
        """The same reply timeout, no retry and a short connect: another server can take the request."""
        return replace(self, retries=0, connect_timeout_s=min(self.connect_timeout_s, FAILOVER_CONNECT_S))


FAILOVER_CONNECT_S = 5.0  # a server that refuses a new connection this long is dropped when others are up


class BackendError(UserError, RuntimeError):
    """A backend's settings or a server's answer that is wrong: names the backend, the URL and what was
    wrong, so ``wamkit eval`` prints it in one line."""

    def __init__(self, backend: str, url: str, message: str):
        super().__init__(f"eval.backend={backend} at {url}: {message}")
        self.backend, self.url = backend, url


def connections(backend: str, target: Any, default: int) -> int:
    """``eval.backend_options.connections``: how many connections to keep open, an integer >= 1."""
    value = target.options.get("connections", default)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)  # as a command line's override gives it
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BackendError(
            backend, target.url, f"eval.backend_options.connections={value!r}; expected an integer >= 1"
        )
    return value


@dataclass(frozen=True)
class Target:
    """What one connection is for: the server and what the env renders and expects back."""

    url: str
    cameras: tuple[str, ...]  # the env's rendered cameras, in order
    suite: Any = None  # the env's SuiteInfo (fps, state and action widths), when known
    look: str | None = None  # the env's resolved render look
    options: dict[str, Any] = field(default_factory=dict)  # eval.backend_options


def check_actions(backend: str, url: str, actions: Any, n: int, dim: int | None, where: str) -> np.ndarray:
    """``actions`` as float32 [n, H, dim] (a single [H, dim] for n == 1 too), or a BackendError naming
    ``where`` (the reply field) and what was wrong."""
    try:
        a = np.asarray(actions, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise BackendError(backend, url, f"{where}: not a numeric array ({err})") from None
    if a.ndim == 2 and n == 1:
        a = a[None]
    if a.ndim != 3 or a.shape[0] != n or a.shape[1] < 1:
        raise BackendError(
            backend, url, f"{where}: shape {list(a.shape)}, expected [{n}, horizon, action_dim]"
        )
    if dim is not None and a.shape[2] != dim:
        raise BackendError(backend, url, f"{where}: action width {a.shape[2]}, expected {dim}")
    if not np.isfinite(a).all():
        raise BackendError(backend, url, f"{where}: holds NaN or infinite values")
    return a


class HttpEndpoint:
    """HTTP/1.1 requests to one server with the evaluator's patience (the rules of the module docstring).

    One keep-alive connection per calling thread (a backend that sends a stage's observations as
    concurrent requests gets one connection each). A server not yet reached is retried with backoff
    for ``patience.connect_timeout_s``; a request whose connection dropped, or whose reply did not come
    within ``patience.reply_timeout_s``, is sent again on a fresh connection ``patience.retries`` times
    (inference requests are idempotent); a kept-alive connection the server closed while idle is
    reopened once without counting. An HTTP error status is the server's answer: a
    :class:`BackendError` with the server's message, not retried.
    """

    def __init__(self, backend: str, url: str, patience: Any):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(backend, url, "eval.server_url: expected http://host:port[/prefix]")
        self.backend, self.url, self.patience = backend, url.rstrip("/"), patience
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.reached = False
        self._local = threading.local()
        self._lock, self._open = threading.Lock(), []  # every thread's connection, for close()

    def _connection(self, connect_s: float):
        """This thread's connection, opened now (within ``connect_s``) if it has none; then the socket
        waits ``patience.reply_timeout_s`` for each reply. ``(connection, reused)``."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=max(connect_s, 0.01))
        try:
            conn.connect()
        except TimeoutError as err:  # a connect that hangs is a server not reached, not a silent one
            conn.close()
            raise ConnectionError(f"connect timed out ({err})") from None
        except BaseException:
            conn.close()
            raise
        conn.sock.settimeout(self.patience.reply_timeout_s or None)
        self._local.conn = conn
        with self._lock:
            self._open.append(conn)
        return conn, False

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()
            with self._lock:
                if conn in self._open:
                    self._open.remove(conn)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:  # fmt: skip
        """``(status, content type, body)`` of one request; errors as the class docstring says."""
        where = f"{self.url}{path}"
        resent, backoff, stale_free = 0, 0.05, True
        deadline = time.monotonic() + self.patience.connect_timeout_s
        while True:
            reused = False
            try:
                conn, reused = self._connection(max(deadline - time.monotonic(), 0.0))
                conn.request(method, self.prefix + path, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = resp.read()
                self.reached = True
                if resp.getheader("Connection", "").lower() == "close":
                    self._drop()
                return resp.status, resp.getheader("Content-Type", "") or "", data
            except TimeoutError:  # connected, and no reply within patience.reply_timeout_s
                self._drop()
                resent += 1
                if resent > self.patience.retries:
                    raise TimeoutError(
                        f"eval.backend={self.backend}: {where} sent no reply within "
                        f"{self.patience.reply_timeout_s:g} s (eval.server_timeout_s), {resent} attempt(s)"
                    ) from None
            except (OSError, http.client.HTTPException) as err:
                self._drop()
                if reused and stale_free:  # a kept-alive connection the server had closed meanwhile
                    stale_free = False
                    continue
                if self.reached:  # a dropped connection: sent again while retries last
                    resent += 1
                    if resent > self.patience.retries:
                        raise ConnectionError(
                            f"eval.backend={self.backend}: {where} dropped the connection ({err}) "
                            f"{resent} time(s)"
                        ) from None
                    deadline = time.monotonic() + self.patience.connect_timeout_s  # to reconnect
                if time.monotonic() + backoff > deadline:
                    raise ConnectionError(
                        f"eval.backend={self.backend}: cannot reach {where} ({err}) within "
                        f"{self.patience.connect_timeout_s:g} s"
                    ) from None
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def json(self, method: str, path: str, payload: Any = None, field: str = "reply") -> Any:
        """A JSON request and its JSON answer; an error status raises with the server's message."""
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        status, _, data = self.request(method, path, body, headers)
        return self.answer(path, status, data, field)

    def answer(self, path: str, status: int, data: bytes, field: str = "reply", decode: Any = None) -> Any:
        """The decoded body of a 2xx reply (``decode``: bytes -> object, JSON by default), else a
        :class:`BackendError` naming the status and the server's own message."""
        where = f"{path} {field}"
        if not 200 <= status < 300:
            raise BackendError(self.backend, self.url, f"{path}: HTTP {status}: {error_message(data)}")
        try:
            return (decode or json.loads)(data)
        except Exception as err:  # noqa: BLE001 - any decoder's error is a malformed body
            raise BackendError(self.backend, self.url, f"{where}: not a valid body ({err})") from None

    def close(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            conn.close()
        self._local = threading.local()


def error_message(data: bytes) -> str:
    """The message of an error body: FastAPI's ``detail``, an ``error`` string or OpenAI's
    ``error.message``; else the body's first 300 characters."""
    try:
        body = json.loads(data)
    except ValueError:
        return data[:300].decode(errors="replace")
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            v = body.get(key)
            if isinstance(v, dict):
                v = v.get("message", v)
            if v:
                return str(v)
    return str(body)[:300]


def png_bytes(frame: np.ndarray) -> bytes:
    """A uint8 [H, W, 3] frame as PNG (lossless)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def png_base64(frame: np.ndarray) -> str:
    return base64.b64encode(png_bytes(frame)).decode("ascii")
