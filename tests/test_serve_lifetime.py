"""A server an evaluation starts ends with the evaluation, even one killed before its clean-up runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.eval_helpers import DELAY

PARENT = textwrap.dedent(
    """
    import sys, time
    from wamkit.eval.server_proc import start_server_process
    with start_server_process({args!r}) as srv:
        print(srv.proc.pid, flush=True)
        time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a dead child of the killed parent is re-parented and reaped by init; until then it is a zombie
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_started_server_ends_when_its_starter_is_killed(sig):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(args=DELAY)], stdout=subprocess.PIPE, text=True
    )
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.send_signal(sig)  # neither runs the with-block's clean-up: SIGTERM's default action kills
        parent.wait(10)
        deadline = time.monotonic() + 20
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid), "the server outlived the process that started it"
    finally:
        parent.kill()
