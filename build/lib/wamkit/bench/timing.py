"""Wall time of GPU work: every benchmark's timer (the device is synchronised around the timed calls)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, steps: int = 1, warmup: int = 0) -> float:
    """Seconds per call of ``fn``: the mean over ``steps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


def profile_table(
    fn: Callable[[], object], device: torch.device, rows: int, calls: int = 1, host: bool = False
) -> str:
    """``calls`` calls of ``fn`` under torch.profiler (after one untimed call): the ``rows`` costliest
    ops by device time (CPU time on a CPU). ``host``: on a GPU, a second table by the host's own time
    (what a host-bound step spends its time on)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
    if host and device.type == "cuda":
        by_host = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60
        )
        table += "\nby host time:\n" + by_host
    return table


def host_waits(fn: Callable[[], object], device: torch.device, top: int = 8) -> str:
    """One call of ``fn`` (after one untimed call) with CUDA's sync debug mode on: how many times the
    host waited for the GPU (``.item()``, pageable copies, unsized outputs) and the Python lines that
    asked, most first. A step that waits cannot queue work ahead of the GPU. "" on a CPU."""
    if device.type != "cuda":
        return ""
    import collections
    import warnings

    fn()
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    sites = collections.Counter(
        f"{'/'.join(w.filename.split('/')[-2:])}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    listed = ", ".join(f"{site} x{n}" for site, n in sites.most_common(top))
    return f"host waits in one call: {sum(sites.values())}" + (f" ({listed})" if listed else "")
