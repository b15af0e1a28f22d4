"""Process trees: torchrun starts each worker in a session of its own, so neither killing the launcher
nor its process group stops the workers; these find and kill every descendant from ``/proc``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux ``/proc``; only ``pid`` elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it at once, then reap ``proc``."""
    for pid in process_tree(proc.pid):
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(pid, signal.SIGKILL)
    proc.wait()
