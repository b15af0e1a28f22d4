"""What every backend shares: the target a connection is made for, its errors, and an HTTP client
with the evaluator's patience rules.

A connection is a callable ``policy(obs_list) -> (actions [B, H, D] float32, server seconds, call
size)`` with ``metadata`` (what the server said about itself), ``identity`` (what it serves, for
``plan.json`` and ``--resume``; None when the server cannot tell) and ``close()``.

Errors: a reply that is wrong (an HTTP 4xx, a malformed body, actions of the wrong shape) raises
:class:`BackendError`, which names the backend, the URL and the field, and stops the run (sending it
again would get the same answer). A server that cannot be reached, drops the connection, answers 5xx
or not within ``eval.server_timeout_s`` raises ``ConnectionError`` / ``TimeoutError`` after the
:class:`~wamkit.eval.remote.Patience` retries: with several servers its stages move to another one,
with one the run stops; either way every episode already journaled stays.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

log = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """A server's answer that is wrong: names the backend, the URL and what was wrong."""

    def __init__(self, backend: str, url: str, message: str):
        super().__init__(f"eval.backend={backend} at {url}: {message}")
        self.backend, self.url = backend, url


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


class HttpClient:
    """One keep-alive HTTP/1.1 connection to ``base_url``, with the evaluator's patience: a refused or
    dropped connection, a 5xx or a timed-out reply is tried again ``retries`` times (reconnecting with
    backoff for up to ``connect_timeout_s``), then raised as ``ConnectionError`` / ``TimeoutError``."""

    def __init__(self, backend: str, base_url: str, patience: Any):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BackendError(backend, base_url, "eval.server_url: expected http://host:port")
        self.backend, self.url = backend, base_url.rstrip("/")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.prefix = parts.path.rstrip("/")
        self.patience = patience
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            timeout = self.patience.reply_timeout_s or None
            self._conn = cls(self.host, self.port, timeout=timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json",
        accept: str = "application/json",
    ) -> tuple[int, str, bytes]:  # fmt: skip
        """``(status, content type, body)`` of a 2xx/4xx answer (5xx and lost connections are retried)."""
        headers = {"Accept": accept}
        if body is not None:
            headers["Content-Type"] = content_type
        deadline = time.monotonic() + self.patience.connect_timeout_s
        attempt, delay = 0, 0.05
        while True:
            try:
                conn = self._connection()
                conn.request(method, self.prefix + path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                ctype = resp.getheader("Content-Type", "") or ""
                if resp.status >= 500:
                    raise ConnectionError(f"HTTP {resp.status} from {self.url}{path}: {_excerpt(data)}")
                return resp.status, ctype, data
            except TimeoutError as err:
                self.close()
                if attempt >= self.patience.retries:
                    raise TimeoutError(
                        f"eval.backend={self.backend}: no reply from {self.url}{path} within "
                        f"{self.patience.reply_timeout_s:g} s (eval.server_timeout_s)"
                    ) from err
                attempt += 1
            except (OSError, http.client.HTTPException) as err:
                self.close()
                connecting = isinstance(err, ConnectionRefusedError | socket.gaierror)
                if connecting and time.monotonic() < deadline:
                    time.sleep(delay)  # the server is starting: wait for it, as the websocket client does
                    delay = min(delay * 2, 2.0)
                    continue
                if connecting or attempt >= self.patience.retries:
                    raise ConnectionError(
                        f"eval.backend={self.backend}: {self.url}{path} unreachable or lost: {err}"
                    ) from err
                attempt += 1

    def get_json(self, path: str) -> Any:
        status, _, data = self.request("GET", path)
        return self._json(status, data, f"GET {path}")

    def post_json(self, path: str, payload: Any) -> Any:
        status, _, data = self.request("POST", path, json.dumps(payload).encode())
        return self._json(status, data, f"POST {path}")

    def _json(self, status: int, data: bytes, what: str) -> Any:
        if status >= 400:
            raise BackendError(self.backend, self.url, f"{what}: HTTP {status}: {_excerpt(data)}")
        try:
            return json.loads(data)
        except ValueError:
            raise BackendError(
                self.backend, self.url, f"{what}: the reply is not JSON: {_excerpt(data)}"
            ) from None


def _excerpt(data: bytes, n: int = 300) -> str:
    text = data.decode("utf-8", "replace").strip()
    return text if len(text) <= n else text[:n] + "..."
