"""A local inference server in its own process (``wamkit serve ... --port P``), for ``eval.serve_dir``
and the benchmark. A separate process keeps the model's threads and the GIL away from the evaluator."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from wamkit.config import ServeConfig
from wamkit.serve.lifetime import PARENT_PID_ENV

# set by start_server_process itself (--host, --port)
_PER_PROCESS = ("host", "port")


def serve_section_args(serve: ServeConfig) -> list[str]:
    """Every setting of ``serve`` but the address, as ``wamkit serve`` overrides (``--set serve.K=V``),
    so a server started for a run gets the run's whole ``serve`` section, not a chosen few of it."""
    args = []
    for f in dataclasses.fields(serve):
        if f.name not in _PER_PROCESS:
            args += ["--set", f"serve.{f.name}={json.dumps(getattr(serve, f.name))}"]
    return args


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start_server_process(
    serve_args: list[str] | str,
    timeout_s: float = 900.0,
    host: str = "127.0.0.1",
    log_path: Path | None = None,
    port: int = 0,
    env: dict[str, str] | None = None,
    serve: ServeConfig | None = None,
) -> Iterator[ServerProcess]:
    """Run ``wamkit serve <serve_args> --host H --port P`` until the block ends.

    ``serve_args`` is a serving directory, or the argument list of ``wamkit serve`` (e.g.
    ``["--model", "delay", "--random-init", "--option", "delay_ms=20"]``); ``port`` 0 picks a free one;
    ``env`` adds environment variables (e.g. ``CUDA_VISIBLE_DEVICES`` to give it one GPU); ``serve``
    (default: :class:`ServeConfig`'s defaults) is the server's whole ``serve`` section.
    Waits until ``/healthz`` answers (a large model may take minutes to build or load); a server that exits first raises with the
    end of its log.
    """
    if isinstance(serve_args, str):
        serve_args = [serve_args]
    port = port or free_port(host)
    # info: the server's start lines (what it serves, its hashes, its batching) are in its log; it logs
    # nothing per request at that level
    cmd = [sys.executable, "-m", "wamkit", "--log-level", "info", "serve", *serve_args]
    cmd += serve_section_args(serve or ServeConfig())
    cmd += ["--host", host, "--port", str(port)]
    log_file = open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {}), PARENT_PID_ENV: str(os.getpid())},
    )  # fmt: skip
    srv = ServerProcess(proc, host, port, log_file)
    try:
        srv.wait_ready(timeout_s)
        yield srv
    finally:
        srv.stop()
        log_file.close()


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_file: IO[str]):
        self.proc, self.host, self.port, self.log_file = proc, host, port, log_file

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log_file.seek(0)
                err = self.log_file.read()
                raise RuntimeError(f"the local server exited with code {self.proc.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.host}:{self.port}/healthz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the local server did not answer /healthz within {timeout_s:g} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
