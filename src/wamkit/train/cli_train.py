"""``wamkit train CONFIG [section.key=value ...] [--resume auto|PATH]``.

One process by default; ``torchrun --nproc_per_node=N -m wamkit train ...`` runs FSDP2 over N.
"""

from __future__ import annotations

import argparse

from wamkit.config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML preset (e.g. configs/demo.yaml); optional")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    parser.add_argument(
        "--resume",
        default=None,
        help="'auto': continue from the newest complete checkpoint of train.run_dir (fresh if none); "
        "or a checkpoint directory (overrides train.resume)",
    )


def load_train_config(args: argparse.Namespace):
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no preset, only overrides
        config, overrides = None, [config, *overrides]
    if args.resume is not None:
        overrides.append(f"train.resume={args.resume}")
    return load_config(config, overrides)


def main(args: argparse.Namespace) -> int:
    from wamkit.train.loop import train

    train(load_train_config(args))
    return 0
