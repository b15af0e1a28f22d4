"""``wamkit train CONFIG [section.key=value ...] [--resume auto|PATH]``.

One process by default; ``torchrun --nproc_per_node=N -m wamkit train ...`` runs FSDP2 over N.
``--plan`` prints the memory plan (:mod:`wamkit.train.memory`) for ``--world-size`` processes with
``--device-memory`` each and exits, without building the model's weights (it is built on the meta
device, or whole on the CPU if small) and without reading the data (the model's default inputs are
used if ``data.root`` does not exist here). Several device sizes print what fits each
(:mod:`wamkit.train.plan_cli`).
"""

from __future__ import annotations

import argparse

from wamkit.config import load_config, packaged_presets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help=f"YAML preset: a file or a packaged preset's name ({', '.join(packaged_presets())}); optional",
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=10")
    parser.add_argument(
        "--resume",
        default=None,
        help="'auto': continue from the newest complete checkpoint of train.run_dir (fresh if none); "
        "or a checkpoint directory (overrides train.resume)",
    )
    parser.add_argument(
        "--plan", action="store_true", help="print the memory plan and exit (nothing is trained or loaded)"
    )
    parser.add_argument("--world-size", type=int, default=1, help="--plan: processes (default 1)")
    parser.add_argument(
        "--device-memory",
        default="",
        help="--plan: memory of each device, e.g. 141GB, 80GiB (default: this one's); several, comma-separated "
        "(24GB,48GB,80GB,141GB): what fits each",
    )
    parser.add_argument(
        "--host-memory",
        default="",
        help="--plan: memory of each host (default: this one's); one size, or one per --device-memory size",
    )
    parser.add_argument(
        "--procs-per-host",
        type=int,
        default=0,
        help="--plan: processes per host (default: min(world size, 8))",
    )


def load_train_config(args: argparse.Namespace):
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no preset, only overrides
        config, overrides = None, [config, *overrides]
    if args.resume is not None:
        overrides.append(f"train.resume={args.resume}")
    return load_config(config, overrides)


def main(args: argparse.Namespace) -> int:
    if args.plan:
        from wamkit.train.plan_cli import print_plan

        print_plan(load_train_config(args), args.world_size, args.device_memory, args.host_memory,
                   args.procs_per_host)  # fmt: skip
        return 0
    from wamkit.train.loop import train

    train(load_train_config(args))
    return 0
