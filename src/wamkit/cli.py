"""The ``wamkit`` command. Each subcommand lives in its stage's module and is imported only when used.

A subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys

from wamkit import __version__
from wamkit.config import ConfigError
from wamkit.log import LEVELS, setup_logging

# name -> (module, one-line help). Order is the flow of data.
COMMANDS: dict[str, tuple[str, str]] = {
    "collect": ("wamkit.envs.collect", "run scripted experts in a simulator and write a LeRobot v3 dataset"),
    "check": (
        "wamkit.check.cli",
        "does a dataset agree with a suite's conventions? (state, gripper, images, fps)",
    ),
    "stats": ("wamkit.data.stats_cli", "compute the normalisation stats file of a dataset"),
    "convert-dataset": (
        "wamkit.data.cli_convert_dataset",
        "LeRobot dataset v2.1 <-> v3.0, video streams copied, verified",
    ),
    "train": ("wamkit.train.cli", "supervised fine-tuning (one process, or FSDP2 under torchrun)"),
    "runs": ("wamkit.train.runs_cli", "print the scalars of a training run from its event files"),
    "convert": (
        "wamkit.export.cli",
        "checkpoint -> serving directory (safetensors + config + preprocessing spec), etc.",
    ),
    "serve": ("wamkit.serve.cli", "serve a model over the OpenPI websocket protocol with dynamic batching"),
    "infer": ("wamkit.serve.infer", "batch inference from JSON sample files"),
    "eval": ("wamkit.eval.cli", "pipelined closed-loop evaluation in simulated benchmarks"),
    "bench": ("wamkit.bench.cli", "throughput benchmarks that print ratios measured in one run"),
    "demo": ("wamkit.demo", "the whole flow on MetaWorld with the built-in model, on a CPU"),
}

log = logging.getLogger("wamkit")


def _load(name: str):
    return importlib.import_module(COMMANDS[name][0])


def build_parser(command: str | None = None, argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wamkit",
        description="Fine-tune, serve and evaluate world action models and robot policies.",
    )
    parser.add_argument("--version", action="version", version=f"wamkit {__version__}")
    parser.add_argument(
        "--log-level", choices=LEVELS, default="info", help="logging verbosity (default: info)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            add = _load(name).add_arguments
            # a command with nested choices (bench) looks at argv to load only the chosen one
            add(p, argv or []) if "argv" in inspect.signature(add).parameters else add(p)
    return parser


def _command_in(argv: list[str]) -> str | None:
    for token in argv:
        if token in COMMANDS:
            return token
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_in(argv), argv)
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module = _load(args.command)
        return int(module.main(args) or 0)
    except ConfigError as err:
        print(f"wamkit {args.command}: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wamkit: interrupted", file=sys.stderr)
        return 130
