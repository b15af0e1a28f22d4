"""``wamkit stats ROOT --representation raw --chunk 16 --out stats.json``: write a dataset's stats file
and report the dimensions whose q99 - q01 is tiny (quantile normalisation would blow them up)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from wamkit.actions import representations
from wamkit.actions.gripper import CONVENTIONS
from wamkit.actions.stats import TINY_RANGE, StatsError
from wamkit.data.dataset_stats import compute_stats
from wamkit.data.meta import DatasetError

log = logging.getLogger("wamkit.stats")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="a LeRobot v3 dataset folder")
    parser.add_argument("--representation", choices=representations.names(), default="raw",
                        help="training representation of the actions (default: raw)")  # fmt: skip
    parser.add_argument("--chunk", type=int, default=16, help="action chunk length in frames (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the quantile reservoir (default: 0)")
    parser.add_argument("--gripper", choices=list(CONVENTIONS), default=None,
                        help="the data's gripper convention (default: detected from the actions)")  # fmt: skip
    parser.add_argument("--finger-dims", default="",
                        help="two state dims holding the finger positions, e.g. 6,7 for a Panda's [eef pos, axis-angle, fingers]: lets the "
                             "detection tell which gripper value means open")  # fmt: skip
    parser.add_argument("--image-stats", action="store_true",
                        help="also per-channel statistics of every camera (decodes the videos; slow)")  # fmt: skip
    parser.add_argument("--out", default="", help="output file (default: ROOT/meta/wamkit_stats.json)")


def main(args: argparse.Namespace) -> int:
    try:
        fingers = tuple(int(d) for d in args.finger_dims.split(",")) if args.finger_dims else None
        if fingers is not None and len(fingers) != 2:
            raise DatasetError(f"--finger-dims: expected two state dims like 6,7, got {args.finger_dims!r}")
        stats = compute_stats(
            args.root, args.representation, args.chunk, args.seed, args.gripper, fingers, args.image_stats
        )
    except (DatasetError, StatsError, ValueError) as err:
        print(f"wamkit stats: {err}", file=sys.stderr)
        return 1
    out = Path(args.out) if args.out else Path(args.root) / "meta" / "wamkit_stats.json"
    stats.save(out)
    meta = stats.metadata
    print(
        f"wrote {out}: {meta['representation']}, fps {meta['fps']}, chunk {meta['chunk']}, action_dim {meta['action_dim']}"
    )
    print(f"  gripper convention: {meta['gripper']} ({meta['gripper_evidence']})")
    for name, feat in stats.features.items():
        print(f"  {name}: {feat.dim} dims over {feat.count} samples")
        tiny = feat.tiny_dims()
        if tiny:
            widths = ", ".join(f"{i} ({feat.q99[i] - feat.q01[i]:.2g})" for i in tiny)
            print(f"  warning: {name} dims with q99 - q01 < {TINY_RANGE:g}: {widths}")
    return 0
