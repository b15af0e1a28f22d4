"""``wamkit eval CONFIG [overrides] [--resume] [--pipeline auto|P]``."""

from __future__ import annotations

import argparse

from wamkit.config import ConfigError, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML preset: a file or a packaged preset's name; omit to use the defaults"
    )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.trials=50 eval.num_envs=16")
    parser.add_argument(
        "--resume", action="store_true", help="run only the episodes missing from the journal"
    )
    parser.add_argument(
        "--pipeline",
        default=None,
        help="'auto' (measure on a warm-up and pick the stage count) or a stage count; overrides eval.pipeline_stages",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # only overrides were given
        config, overrides = None, [config, *overrides]
    if args.pipeline is not None:
        value = args.pipeline.strip().lower()
        if value == "auto":
            overrides.append("eval.pipeline_stages=0")
        elif value.isdigit() and int(value) > 0:
            overrides.append(f"eval.pipeline_stages={int(value)}")
        else:
            raise ConfigError(f"--pipeline: expected 'auto' or a positive stage count, got {args.pipeline!r}")
    cfg = load_config(config, overrides)
    from wamkit.envs.suites import fill_suite_defaults
    from wamkit.eval.runner import run_eval

    fill_suite_defaults(cfg.env)  # the config's default camera and task are MetaWorld's
    summary = run_eval(cfg, resume=args.resume, progress=not args.no_progress)
    from wamkit.eval.report import markdown_table

    print(markdown_table(summary), end="")
    return 0
