"""``wamkit check DATASET --suite SUITE``: report where a dataset and a simulated suite disagree.

``wamkit check --pins EMBODIMENT`` instead checks the installed simulator stack against the
drift pins kept next to the env backends. Exit status 1 when an error (or a drift) is found.
"""

from __future__ import annotations

import argparse

from wamkit.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", nargs="?", help="a LeRobot v3 dataset folder")
    from wamkit import embodiments

    p.add_argument("--suite", help=f"the suite to compare with ({', '.join(embodiments.suites())})")
    p.add_argument(
        "--tasks", type=int, default=2, help="tasks of the dataset to reset the env for (default 2)"
    )
    p.add_argument("--trials", type=int, default=2, help="trials per task to reset (default 2)")
    p.add_argument("--replay", type=int, default=5, help="episodes to replay open-loop when the dataset has a "
                   "collect journal (default 5; 0: none)")  # fmt: skip
    p.add_argument("--json", dest="json_out", help="also write the report as JSON to this file")
    pinned = [n for n in embodiments.names() if embodiments.get(n).drift is not None]
    p.add_argument("--pins", choices=pinned, help="check the simulator stack against the "
                   "drift pins of this backend instead of a dataset")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.pins:
        from wamkit.envs.drift import check_pins

        problems = check_pins(args.pins)
        print("\n".join(problems) or f"{args.pins}: the installed simulator stack reproduces every drift pin")
        return 1 if problems else 0
    if not args.dataset or not args.suite:
        raise ConfigError("give a DATASET and --suite (or --pins BACKEND)")
    from wamkit.check import check_dataset
    from wamkit.envs import suites

    if args.suite not in suites():
        raise ConfigError(f"--suite: unknown suite '{args.suite}' (valid: {', '.join(suites())})")
    report = check_dataset(args.dataset, args.suite, tasks=args.tasks, trials=args.trials, replay=args.replay)
    print(report.text(), end="")
    if args.json_out:
        from wamkit.files import atomic_write_json

        atomic_write_json(args.json_out, report.to_dict())
    return 1 if report.errors else 0
