"""``wamkit runs RUN_DIR``: each TensorBoard scalar's count, last step and last value, read from the
event files (what a user checks over ssh without a browser).

A resumed run appends new event files and may log a step again (the steps after the last checkpoint
of a killed run are re-done); the newest write of a step wins and each step counts once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def read_scalars(run_dir: str | Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from every event file under ``run_dir`` (files in write order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(run_dir)
    files = sorted(root.rglob("events.out.tfevents.*"), key=lambda p: (p.stat().st_mtime, p.name))
    out: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            series = out.setdefault(tag, {})
            for ev in acc.Scalars(tag):
                series[ev.step] = ev.value
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a training run directory (its tb/ holds the event files)")


def main(args: argparse.Namespace) -> int:
    root = Path(args.run_dir)
    if not root.is_dir():
        print(f"wamkit runs: {root} is not a directory", file=sys.stderr)
        return 2
    scalars = read_scalars(root)
    if not scalars:
        print(
            f"wamkit runs: no TensorBoard scalars under {root} (expected tb/events.out.tfevents.*)",
            file=sys.stderr,
        )
        return 1
    width = max(len(t) for t in scalars)
    print(f"{'scalar':<{width}}  {'count':>6}  {'last step':>9}  last value")
    for tag in sorted(scalars):
        series = scalars[tag]
        last = max(series)
        print(f"{tag:<{width}}  {len(series):>6}  {last:>9}  {series[last]:.6g}")
    return 0
