"""The ``wamkit`` command. Each subcommand is imported only when used.

One convention: ``wamkit X`` lives in ``wamkit/<stage>/cli_X.py`` (``wamkit collect`` in
``envs/cli_collect.py``, ``wamkit convert-dataset`` in ``data/cli_convert_dataset.py``), which exposes
``add_arguments(parser)`` and ``main(args) -> int`` and holds no logic of its own beyond parsing and
printing. Two exceptions follow from what they are: ``wamkit demo`` spans every stage and is
``wamkit/demo.py``; ``wamkit bench NAME`` runs the benchmark module ``wamkit/bench/NAME.py``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import signal
import sys
import traceback

from wamkit import __version__
from wamkit.config import ConfigError, UserError
from wamkit.envs.base import use_headless_gl
from wamkit.log import LEVELS, setup_logging

# name -> (module, one-line help). Order is the flow of data.
COMMANDS: dict[str, tuple[str, str]] = {
    "collect": (
        "wamkit.envs.cli_collect",
        "run scripted experts in a simulator and write a LeRobot v3 dataset",
    ),
    "check": (
        "wamkit.check.cli_check",
        "does a dataset agree with a suite's conventions? (state, gripper, images, fps)",
    ),
    "stats": ("wamkit.data.cli_stats", "compute the normalisation stats file of a dataset"),
    "convert-dataset": (
        "wamkit.data.cli_convert_dataset",
        "LeRobot dataset v2.1 <-> v3.0, video streams copied, verified",
    ),
    "cache-latents": (
        "wamkit.train.cli_cache_latents",
        "encode a run's video targets once (Cosmos3 latents)",
    ),
    "cache-text": (
        "wamkit.train.cli_cache_text",
        "encode a run's captions once (Cosmos3 text keys/values)",
    ),
    "train": ("wamkit.train.cli_train", "supervised fine-tuning (one process, or FSDP2 under torchrun)"),
    "runs": ("wamkit.train.cli_runs", "print the scalars of a training run from its event files"),
    "convert": (
        "wamkit.export.cli_convert",
        "checkpoint -> serving directory (safetensors + config + preprocessing spec), etc.",
    ),
    "serve": (
        "wamkit.serve.cli_serve",
        "serve a model over the OpenPI websocket protocol with dynamic batching",
    ),
    "infer": ("wamkit.serve.cli_infer", "batch inference from JSON sample files"),
    "eval": ("wamkit.eval.cli_eval", "pipelined closed-loop evaluation in simulated benchmarks"),
    "bench": ("wamkit.bench.cli_bench", "throughput benchmarks that print ratios measured in one run"),
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
            parser.set_defaults(_command_parser=_innermost(p, argv or []))
    return parser


def _innermost(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the deepest subcommand ``argv`` names (``bench eval``'s, under ``bench``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((t for t in argv if t in action.choices), None)
            if chosen is not None:
                return _innermost(action.choices[chosen], argv)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed with the command's dotted overrides (``key=value``) taken before or after its
    options: argparse fills a command's ``overrides`` only from the words before its first option, and
    leaves the later ones over. A left-over word that is no override is refused by the command's own
    parser, which shows its own usage."""
    args, extra = parser.parse_known_args(argv)
    command_parser = getattr(args, "_command_parser", parser)
    overrides = [t for t in extra if "=" in t and not t.startswith("-")]
    rest = [t for t in extra if t not in overrides]
    if rest or (overrides and not isinstance(getattr(args, "overrides", None), list)):
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        # in the order typed: those before the first option, then the later ones
        args.overrides = [*args.overrides, *overrides]
    return args


def _command_in(argv: list[str]) -> str | None:
    for token in argv:
        if token in COMMANDS:
            return token
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    use_headless_gl()  # before a command imports MuJoCo, which reads MUJOCO_GL once, on import
    parser = build_parser(_command_in(argv), argv)
    args = parse(parser, argv)
    # Ctrl-C stops a command however it was started: a background job of a non-interactive shell
    # (`nohup make test &`) starts with SIGINT ignored, which Python would otherwise keep
    signal.signal(signal.SIGINT, signal.default_int_handler)
    setup_logging(args.log_level)
    # PyOpenGL (imported by MuJoCo for EGL) logs a harmless INFO line about its optional accelerator
    logging.getLogger("OpenGL.acceleratesupport").setLevel(logging.WARNING)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        module = _load(args.command)
        return int(module.main(args) or 0)
    except UserError as err:  # its message names the key, file or URL: a traceback would bury it
        if args.log_level == "debug":
            traceback.print_exc()
        kind = "config error: " if isinstance(err, ConfigError) else ""
        print(f"wamkit {args.command}: {kind}{err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wamkit: interrupted", file=sys.stderr)
        return 130
