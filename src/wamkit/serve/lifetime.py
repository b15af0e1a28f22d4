"""How long a ``wamkit serve`` process lives: as long as the process that started it, when one did."""

from __future__ import annotations

import os
import sys

# Set by ``wamkit.eval.server_proc.start_server_process`` to its own pid: the server ends when that
# process does, even one killed before its ``finally`` can stop the server (SIGKILL, or SIGTERM's
# default action).
PARENT_PID_ENV = "WAMKIT_SERVE_PARENT_PID"


def exit_with_parent() -> None:
    """In a server started by ``start_server_process``: have the kernel send SIGTERM when the
    starting process ends (Linux ``PR_SET_PDEATHSIG``), and exit now if it has already ended.
    Elsewhere, and for a server started by hand, nothing. The kernel sends it when the starting
    *thread* ends; every caller starts its server in a ``with`` block of the thread that uses it."""
    want = os.environ.pop(PARENT_PID_ENV, None)  # not inherited by what the server starts
    if not want or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1  # PR_SET_PDEATHSIG in <linux/prctl.h>
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # no such call here: the server then lives until stopped, as a hand-started one
    if os.getppid() != int(want):  # the parent died before the call above took effect
        sys.exit(f"wamkit serve: the process that started it ({want}) has ended")
