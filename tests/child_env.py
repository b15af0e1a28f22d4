"""The environment the tests give the ``wamkit`` processes they start, and the watch on their logs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

# what a shell may say about rendering; the README's activated shell on a headless machine says none
GL_VARS = ("MUJOCO_GL", "PYOPENGL_PLATFORM", "DISPLAY", "WAYLAND_DISPLAY")


def user_shell_env() -> dict[str, str]:
    """This process's environment as the README's activated shell has it: no rendering variables."""
    return {k: v for k, v in os.environ.items() if k not in GL_VARS}


def child_env(*, user_shell: bool = False) -> dict[str, str]:
    """This process's environment with one thread per process (2 cores are shared, and no result may
    depend on the thread count) and the checkout on ``PYTHONPATH``. ``user_shell`` also drops the
    Makefile's rendering variables, as the README's activated shell has none: wamkit and LeRobot's
    plug-in env must choose offscreen rendering themselves."""
    env = user_shell_env() if user_shell else dict(os.environ)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def start_logged(cmd: list[str], log: Path, **popen) -> subprocess.Popen:
    """``cmd`` started with its stdout and stderr in the file ``log``: a pipe that nobody reads while
    the process runs would fill, and block it."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, **popen)


def wait_for_log(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 300.0) -> re.Match:
    """The first match of ``pattern`` in ``log``, the file :func:`start_logged` gave ``proc``. If
    ``proc`` exits first, or ``timeout`` seconds pass, it is killed and the test fails with the log's
    end: a reworded line or a stalled start is a failure, never a hang."""
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        text = log.read_text(errors="replace")
        if m := re.search(pattern, text):
            return m
        if code is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            why = f"it exited with code {code}" if code is not None else f"{timeout:g} s passed"
            pytest.fail(
                f"`{' '.join(map(str, proc.args))}` never logged {pattern!r} ({why}):\n{text[-3000:]}"
            )
        time.sleep(0.1)


def run_shell_block(
    script: str, cwd: Path, env: dict[str, str], timeout: float = 900
) -> subprocess.CompletedProcess:
    """A documentation block run as one bash script under ``set -euo pipefail`` (so ``cmd &``,
    ``SERVER=$!`` and ``kill $SERVER`` work as shown, and a failing command ends it), in a process group
    of its own that is killed when bash ends: a server the block started in the background, and that a
    failure left running, cannot outlive the test, keep its port or hold its output open."""
    out, err = cwd / ".block.out", cwd / ".block.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env, stdout=o,
                                stderr=e, text=True, start_new_session=True)  # fmt: skip
    try:
        code = proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


@contextlib.contextmanager
def served_tiny(tmp_path: Path, *args: str):
    """A random-init ``tiny`` (preset small) served as typed: ``wamkit serve`` from the README's shell in
    ``tmp_path``, on a free port, with ``args`` (``--suite aloha``, ``--max-message-mb 0.01``); yields its
    URL and stops it at the end."""
    import sys

    wamkit = str(Path(sys.executable).parent / "wamkit")
    log = tmp_path / "serve.log"
    cmd = [wamkit, "serve", "--model", "tiny", "--preset", "small", "--random-init", "--port", "0", *args]
    server = start_logged(cmd, log, env=user_shell_env(), cwd=tmp_path)
    try:
        yield wait_for_log(server, log, r"serving tiny on (ws://\S+)").group(1)
    finally:
        server.terminate()
        server.wait(timeout=30)
