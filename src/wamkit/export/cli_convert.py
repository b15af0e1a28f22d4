"""``wamkit convert SRC --out DIR [--ema] [--to serve|dcp|extra]``.

- ``--to serve`` (default): SRC is a training checkpoint (``runs/x/checkpoints/step_000100``, or a run
  directory: its newest complete checkpoint); DIR becomes the serving directory ``wamkit serve`` loads.
- ``--to dcp``: SRC is a serving directory; DIR a model-only DCP checkpoint (warm starts).
- ``--to extra``: SRC is a serving directory; DIR the adapter's own format (cosmos3: diffusers).
- ``--to cosmos-pt|cosmos-dcp|diffusers``: SRC is Cosmos3 weights in any of these three layouts
  (detected: a ``full_weights.pt``, a cosmos ``net.*`` DCP directory, a diffusers folder); DIR the
  same weights in the other layout (see :mod:`wamkit.export.cosmos_formats`). ``--ema`` reads the
  cosmos ``net_ema`` weights; ``--base`` names the diffusers folder whose architecture (and VAE,
  scheduler, tokenizer) a diffusers output takes; ``--action-width`` pads heads for cosmos layouts.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)
COSMOS_FORMATS = ("cosmos-pt", "cosmos-dcp", "diffusers")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="checkpoint directory, run directory or serving directory")
    parser.add_argument("--out", required=True, help="output directory (written atomically)")
    parser.add_argument(
        "--to",
        choices=("serve", "dcp", "extra", *COSMOS_FORMATS),
        default="serve",
        help="output format",
    )
    parser.add_argument(
        "--ema", action="store_true", help="export the EMA weights (--to serve, cosmos sources)"
    )
    parser.add_argument("--base", help="diffusers folder giving the architecture of a --to diffusers output")
    parser.add_argument(
        "--action-width", type=int, default=64, help="action-head width of cosmos outputs (max_action_dim)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def _checkpoint_of(src: Path) -> Path:
    from wamkit.train.checkpoint import list_checkpoints

    if (src / "checkpoints").is_dir():  # a run directory
        found = list_checkpoints(src / "checkpoints")
        if not found:
            raise FileNotFoundError(f"{src}/checkpoints holds no complete checkpoint")
        return found[-1]
    return src


def convert_cosmos(args: argparse.Namespace) -> int:
    """``--to cosmos-pt|cosmos-dcp|diffusers``: one verified layout conversion."""
    from wamkit.export import cosmos_formats as cf

    try:
        src_fmt = cf.detect_format(args.src)
        sd = cf.read_any(args.src, ema=args.ema)
        if args.to == "cosmos-pt":
            out = cf.write_cosmos_pt(sd, _free(Path(args.out), args.overwrite), args.action_width)
        elif args.to == "cosmos-dcp":
            out = cf.write_cosmos_dcp(sd, args.out, args.action_width, overwrite=args.overwrite)
        else:
            base = args.base or (args.src if src_fmt == "diffusers" else None)
            if base is None:
                raise cf.FormatError("--to diffusers from a cosmos layout needs --base (a diffusers folder)")
            out = cf.write_diffusers(sd, args.out, base, overwrite=args.overwrite)
    except (cf.FormatError, FileNotFoundError, OSError) as err:
        print(f"wamkit convert: {err}", file=sys.stderr)
        return 1
    print(f"wrote {out}: {args.to} from {src_fmt} {args.src}; verified (weights reload bit-identical)")
    return 0


def _free(out: Path, overwrite: bool) -> Path:
    from wamkit.export.cosmos_formats import FormatError

    if out.exists() and not overwrite:
        raise FormatError(f"{out} exists; pass --overwrite to replace it")
    return out


def main(args: argparse.Namespace) -> int:
    from wamkit.export.checkpoint import (
        ConversionError,
        checkpoint_to_serving,
        serving_to_dcp,
        serving_to_extra,
    )

    if Path(args.out).exists() and not args.overwrite:  # before minutes of loading and writing a model
        print(f"wamkit convert: {args.out} exists; pass --overwrite to replace it", file=sys.stderr)
        return 1
    if args.to in COSMOS_FORMATS:
        return convert_cosmos(args)
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
