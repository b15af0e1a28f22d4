"""``wamkit convert SRC --out DIR [--ema] [--to serve|dcp|extra]``.

- ``--to serve`` (default): SRC is a training checkpoint (``runs/x/checkpoints/step_000100``, or a run
  directory: its newest complete checkpoint); DIR becomes the serving directory ``wamkit serve`` loads.
- ``--to dcp``: SRC is a serving directory; DIR a model-only DCP checkpoint (warm starts).
- ``--to extra``: SRC is a serving directory; DIR the adapter's own format (cosmos3: diffusers).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint directory, run directory or serving directory")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument("--to", choices=("serve", "dcp", "extra"), default="serve", help="output format")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights (--to serve)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def _checkpoint_of(src: Path) -> Path:
    from wamkit.train.checkpoint import list_checkpoints

    if (src / "checkpoints").is_dir():  # a run directory
        found = list_checkpoints(src / "checkpoints")
        if not found:
            raise FileNotFoundError(f"{src}/checkpoints holds no complete checkpoint")
        return found[-1]
    return src


def main(args: argparse.Namespace) -> int:
    from wamkit.export.convert import ConversionError, checkpoint_to_serving, serving_to_dcp, serving_to_extra

    src = Path(args.src)
    if not src.is_dir():
        print(f"wamkit convert: {src} is not a directory", file=sys.stderr)
        return 2
    if args.ema and args.to != "serve":
        print("wamkit convert: --ema applies to --to serve only", file=sys.stderr)
        return 2
    try:
        if args.to == "serve":
            ckpt = _checkpoint_of(src)
            out = checkpoint_to_serving(ckpt, args.out, ema=args.ema, overwrite=args.overwrite)
            what = f"serving directory from {ckpt}" + (" (EMA weights)" if args.ema else "")
        elif args.to == "dcp":
            out = serving_to_dcp(src, args.out, overwrite=args.overwrite)
            what = f"DCP checkpoint from {src}"
        else:
            out = serving_to_extra(src, args.out, overwrite=args.overwrite)
            what = f"adapter export from {src}"
    except (ConversionError, FileNotFoundError, ValueError) as err:
        print(f"wamkit convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}: {what}; verified (weights reload bit-identical)")
    return 0
