"""Env worker processes: each runs an :class:`~wamkit.envs.host.EnvHost` in a ``spawn``-started child.

The parent never touches a simulator or a GL context; it sends ``(method, payload)`` messages over a
pipe and reads the replies in order. ``submit`` returns at once, ``result`` waits, so one caller can
keep many workers busy (``multiprocessing.connection.wait`` on their ``connection``).

Failure model:

- an exception inside a host method comes back as :class:`WorkerError` (the worker lives on);
- a worker that exits or is killed raises :class:`WorkerDied` naming the worker and the episodes it
  hosted, so a caller can start a new worker and re-run those episodes;
- the child exits as soon as its pipe closes, so it cannot outlive its parent, even a killed one;
- the child ignores SIGINT (a Ctrl-C reaches the whole process group): the parent ends it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from wamkit.config import EnvConfig
from wamkit.envs.base import EpisodeSpec, render_environ, use_headless_gl
from wamkit.envs.host import EnvHost

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """Env worker ``worker_id`` is gone; ``episodes`` were running in it (their results are lost)."""

    def __init__(self, worker_id: int, episodes: list[EpisodeSpec], detail: str = "") -> None:
        self.worker_id, self.episodes = worker_id, list(episodes)
        names = ", ".join(f"{e.task}/trial {e.trial}/seed {e.seed}" for e in self.episodes) or "none"
        super().__init__(
            f"env worker {worker_id} died{f' ({detail})' if detail else ''}; its episodes: {names}"
        )

    def __reduce__(self):
        return (WorkerDied, (self.worker_id, self.episodes))


class WorkerError(RuntimeError):
    """A host method raised inside worker ``worker_id``; ``remote_traceback`` is the child's trace."""

    def __init__(self, worker_id: int, method: str, remote_traceback: str) -> None:
        self.worker_id, self.method, self.remote_traceback = worker_id, method, remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else "?"
        super().__init__(
            f"env worker {worker_id}: {method}() failed: {last}\n--- worker traceback ---\n{remote_traceback}"
        )


def _worker_main(
    conn: Connection, env_cfg: EnvConfig, num_envs: int, worker_id: int, host_factory: Callable[..., Any]
) -> None:
    """The child's loop: build the host, then answer messages until 'close' or the pipe closes."""
    # Ctrl-C and `timeout -s INT` signal the whole process group; the parent decides when a worker ends
    # (its 'close', or its pipe closing), so an interrupted run closes its envs in order and its
    # executor does not take the workers for dead and start new ones while it shuts down
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_headless_gl()
    try:
        host = host_factory(env_cfg, num_envs)
    except BaseException:  # noqa: BLE001 - the parent gets the full trace as a WorkerError
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", os.getpid()))
    try:
        while True:
            try:
                method, payload = conn.recv()
            except (EOFError, OSError):
                return  # parent gone: exit, never linger as an orphan
            if method == "close":
                conn.send(("ok", None))
                return
            try:
                if method.startswith("_"):
                    raise AttributeError(f"'{method}' is private")
                reply = ("ok", getattr(host, method)(payload))
            except Exception:  # noqa: BLE001 - reported to the parent, which raises WorkerError
                reply = ("err", traceback.format_exc())
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                return
    finally:
        host.close()


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set ``values`` in ``os.environ`` for the duration (a child started inside inherits them)."""
    with _ENVIRON_LOCK:
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _ForeignProcess:
    """An env worker started with another Python (a suite whose simulator lives in a venv of its own):
    ``python -m wamkit.envs.workers FD``, talking over one end of a socket pair as a spawned child talks
    over its pipe. Offers what :class:`EnvWorker` uses of a ``multiprocessing.Process``."""

    def __init__(self, python: str, args: tuple, name: str) -> None:
        parent, child = socket.socketpair()
        fd = child.fileno()
        try:
            self._popen = subprocess.Popen(
                [python, "-m", "wamkit.envs.workers", str(fd)], pass_fds=[fd], stdin=subprocess.DEVNULL
            )
        except OSError as err:
            parent.close()
            raise RuntimeError(f"{name}: could not start {python}: {err}") from None
        finally:
            child.close()
        self.name, self.pid = name, self._popen.pid
        self.conn = Connection(parent.detach())
        self.conn.send(args)  # the child's first message: what _worker_main takes

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()


def worker_python(env_cfg: EnvConfig) -> str | None:
    """The Python an env worker of ``env_cfg.suite`` starts with: None for this one (a spawned child),
    or the interpreter its backend names (``worker_python()``: a simulator in a venv of its own)."""
    from wamkit.envs.suites import backend

    fn = getattr(backend(env_cfg.suite), "worker_python", None)
    return fn() if fn is not None else None


class EnvWorker:
    """A spawned process hosting ``num_envs`` envs. ``host_factory(env_cfg, num_envs)`` builds the host
    in the child (default :class:`EnvHost`; it must be importable by name, e.g. a module-level class).
    A suite whose backend names another Python (:func:`worker_python`) gets a child started with it.
    """

    def __init__(
        self,
        env_cfg: EnvConfig,
        num_envs: int,
        worker_id: int = 0,
        host_factory: Callable[..., Any] = EnvHost,
    ) -> None:
        self.worker_id, self.num_envs = worker_id, num_envs
        python = worker_python(env_cfg)
        if python is not None:
            with _environ(render_environ(env_cfg.render_gpu)):
                self.process: Any = _ForeignProcess(
                    python, (env_cfg, num_envs, worker_id, host_factory), f"env worker {worker_id}"
                )
            self._conn = self.process.conn
        else:
            ctx = mp.get_context("spawn")  # a forked child of a process with a GL context hangs
            self._conn, child_conn = ctx.Pipe(duplex=True)
            self.process = ctx.Process(
                target=_worker_main,
                args=(child_conn, env_cfg, num_envs, worker_id, host_factory),
                name=f"wamkit-env-{worker_id}",
                daemon=True,  # terminated by multiprocessing at a normal parent exit
            )
            with _environ(render_environ(env_cfg.render_gpu)):  # a spawned child copies it at start
                self.process.start()
            child_conn.close()  # only the child holds that end: its EOF tells us the child is gone
        self._pending: list[str] = ["__init__"]  # methods whose replies are not read yet, in order
        self.episodes: dict[int, EpisodeSpec] = {}  # slot -> episode currently hosted
        self._closed = False

    @property
    def connection(self) -> Connection:
        """The parent's end of the pipe (readable when a reply waits): for ``connection.wait``."""
        return self._conn

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def pending(self) -> int:
        """Submitted calls whose results have not been read yet."""
        return len([m for m in self._pending if m != "__init__"])

    def _died(self, detail: str = "") -> WorkerDied:
        self.process.join(timeout=1.0)
        code = self.process.exitcode
        detail = detail or (f"exit code {code}" if code is not None else "pipe closed")
        return WorkerDied(self.worker_id, list(self.episodes.values()), detail)

    def submit(self, method: str, payload: Any = None) -> None:
        """Queue ``host.method(payload)`` in the worker; returns at once. ``reset`` payloads
        (``{slot: EpisodeSpec}``) are remembered so a death can name the lost episodes."""
        if self._closed:
            raise RuntimeError(f"env worker {self.worker_id} is closed")
        if method == "reset":
            self.episodes.update(payload)
        try:
            self._conn.send((method, payload))
        except (BrokenPipeError, OSError) as err:
            raise self._died(f"send failed: {err}") from None
        self._pending.append(method)

    def _recv(self, timeout: float | None) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            try:
                if self._conn.poll(wait):
                    return self._conn.recv()
            except (EOFError, OSError):
                raise self._died() from None
            if not self.process.is_alive():
                raise self._died()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"env worker {self.worker_id}: no reply within {timeout:.1f} s")

    def result(self, timeout: float | None = None) -> Any:
        """The value of the oldest submitted call. Raises :class:`WorkerError` if it raised,
        :class:`WorkerDied` if the worker is gone, ``TimeoutError`` after ``timeout`` seconds."""
        while self._pending and self._pending[0] == "__init__":
            status, value = self._recv(timeout)
            self._pending.pop(0)
            if status != "ok":
                raise WorkerError(self.worker_id, "EnvHost.__init__", value)
        if not self._pending:
            raise RuntimeError(f"env worker {self.worker_id}: result() without a submitted call")
        status, value = self._recv(timeout)
        method = self._pending.pop(0)
        if status != "ok":
            raise WorkerError(self.worker_id, method, value)
        return value

    def call(self, method: str, payload: Any = None, timeout: float | None = None) -> Any:
        """``submit`` then ``result``: a blocking call."""
        self.submit(method, payload)
        return self.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not within ``timeout`` seconds."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):  # already exiting: the join reaps it
                self._conn.send(("close", None))
            self.process.join(timeout)
        if self.process.is_alive():
            log.warning("env worker %d did not exit within %.0f s; killing it", self.worker_id, timeout)
            self.kill()
        self._conn.close()

    def kill(self) -> None:
        """SIGKILL the worker and reap it (no zombie left behind)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)

    def __enter__(self) -> EnvWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _foreign_main(fd: int) -> None:
    """A worker started with another Python (:class:`_ForeignProcess`): read what to host, then serve."""
    conn = Connection(fd)
    try:
        env_cfg, num_envs, worker_id, host_factory = conn.recv()
    except (EOFError, OSError):
        return
    _worker_main(conn, env_cfg, num_envs, worker_id, host_factory)


if __name__ == "__main__":
    _foreign_main(int(sys.argv[1]))
