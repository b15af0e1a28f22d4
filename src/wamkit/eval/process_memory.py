"""What an evaluation's processes hold: resident memory, file descriptors and threads, read from
``/proc`` (Linux), and the up-front check that ``eval.num_envs`` fits the host.

The check measures instead of guessing: worker 0 builds one env before the others are built, and the
growth of its resident memory is the cost of one env (a robosuite env takes 1.7–2.4 GB, a MetaWorld
one tens of MB). ``num_envs`` envs on ``W`` workers then need about ``W x worker + num_envs x env``; a run
that would not fit the host's available memory is refused before any other env is built, with the
number of envs that would.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any

from wamkit.config import ConfigError
from wamkit.device import meminfo_bytes, proc_status, status_bytes

log = logging.getLogger(__name__)
HEADROOM = 0.9  # of the available memory: the evaluator, the server and the page cache need some too


@dataclass(frozen=True)
class ProcSample:
    pid: int
    rss: int  # bytes (VmRSS)
    fds: int
    threads: int


def sample(pid: int) -> ProcSample | None:
    """One process's figures now; None if it has gone."""
    try:
        status = proc_status(pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return ProcSample(pid, status_bytes(status, "VmRSS"), fds, int(status.get("Threads", "0")))


def available_bytes() -> int:
    """The host's MemAvailable (what can be allocated without swapping)."""
    return meminfo_bytes("MemAvailable")


@dataclass(frozen=True)
class EnvMemory:
    per_env: int
    per_worker: int
    num_envs: int
    workers: int
    available: int  # at the time of the measurement, with worker 0's env already built

    @property
    def needed(self) -> int:
        """Bytes the rest of the envs will take (worker 0's first env and every worker exist already)."""
        return (self.num_envs - 1) * self.per_env

    @property
    def fits(self) -> int:
        """The most envs this host holds beside what exists now."""
        return 1 + int(HEADROOM * self.available // max(self.per_env, 1))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "needed": self.needed, "max_envs": self.fits}


def check_env_memory(executor, worker0_slots: int, spec, num_envs: int) -> EnvMemory | None:
    """Build one env on worker 0 (``start`` of slot 0 with ``spec``), measure what it took, and refuse
    a ``num_envs`` that will not fit. None where the workers are not local processes (Ray)."""
    if executor.kind != "local" or worker0_slots < 1:
        return None
    executor.call(0, executor.generation(0), "max_steps", []).result()  # the worker is up, no env built
    pid = executor.pid(0)
    before = sample(pid)
    executor.call(0, executor.generation(0), "start", {0: spec}).result()
    after = sample(pid)
    if before is None or after is None:
        return None
    mem = EnvMemory(
        per_env=max(after.rss - before.rss, 0),
        per_worker=before.rss,
        num_envs=num_envs,
        workers=executor.num_workers,
        available=available_bytes(),
    )
    gb = 1e9
    log.info(
        "env memory: %.0f MB per env (measured on worker 0), %.0f MB per worker; the other %d env(s) "
        "need about %.2f GB of the %.2f GB available", mem.per_env / 1e6, mem.per_worker / 1e6,
        num_envs - 1, mem.needed / gb, mem.available / gb,
    )  # fmt: skip
    if num_envs > mem.fits:
        raise ConfigError(
            f"eval.num_envs={num_envs}: the envs need about {(num_envs * mem.per_env + mem.workers * mem.per_worker) / gb:.1f} GB "
            f"({mem.per_env / 1e6:.0f} MB per env, measured on worker 0 at start-up, and "
            f"{mem.per_worker / 1e6:.0f} MB per worker process), more than this host can give: "
            f"{mem.available / gb:.1f} GB available; at most {mem.fits} envs fit (eval.num_envs={mem.fits}); "
            "nothing was run"
        )
    return mem
