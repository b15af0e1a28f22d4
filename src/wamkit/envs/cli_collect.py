"""``wamkit collect --suite S --tasks ... --episodes N --out DIR``: the command line of
:func:`wamkit.envs.collect.collect` (flags become dotted overrides of the ``env`` and ``collect``
config sections; a YAML preset and overrides may be given too)."""

from __future__ import annotations

import argparse
import logging

from wamkit.config import RunConfig, load_config
from wamkit.envs.collect import collect
from wamkit.envs.suites import fill_suite_defaults

_FLAGS = {
    "suite": "env.suite",
    "tasks": "env.tasks",
    "cameras": "env.cameras",
    "image_size": "env.image_size",
    "render_quality": "env.render_quality",
    "episodes": "collect.episodes",
    "out": "collect.out",
    "workers": "collect.workers",
    "seed": "collect.seed",
    "action_noise": "collect.action_noise",
    "noise_hold": "collect.noise_hold",
    "action_lag": "collect.action_lag",
    "lag_prob": "collect.lag_prob",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML preset (sections env, collect); flags and overrides win")
    p.add_argument("--suite", help="a suite with a scripted expert (default: metaworld)")
    p.add_argument("--tasks", help="comma-separated task names, or MT10 / MT50")
    p.add_argument("--cameras", help="comma-separated camera names (default: the suite's first)")
    p.add_argument("--episodes", type=int, help="episodes to keep per task")
    p.add_argument("--out", help="dataset folder (created, or resumed if it holds a collect journal)")
    p.add_argument("--workers", type=int, help="env worker processes")
    p.add_argument("--image-size", type=int, help="square image size in pixels")
    p.add_argument("--render-quality", choices=["default", "fast"], help="fast: no shadows/reflections/MSAA")
    p.add_argument("--seed", type=int, help="episode e of a task uses seed + e")
    p.add_argument("--keep-failed", action="store_true", default=None, help="also keep failed episodes")
    p.add_argument(
        "--action-noise",
        type=float,
        help="DART: Gaussian noise of this std added to the actions executed (the expert's are recorded)",
    )
    p.add_argument("--noise-hold", type=int, help="steps each noise draw (or late window) lasts (default 1)")
    p.add_argument(
        "--action-lag",
        type=int,
        help="late actions: a late window executes the expert's action of this many steps before",
    )
    p.add_argument("--lag-prob", type=float, help="probability that a window of --noise-hold steps is late")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. env.image_size=256")


def resolve_config(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides or [])
    for flag, key in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    if getattr(args, "keep_failed", None):
        overrides.append("collect.keep_failed=true")
    cfg = load_config(args.config, overrides)
    fill_suite_defaults(cfg.env)  # the config's default camera and task are MetaWorld's
    return cfg


def main(args: argparse.Namespace) -> int:
    # PyOpenGL (imported by mujoco for EGL) logs a harmless INFO line about its optional accelerator
    logging.getLogger("OpenGL.acceleratesupport").setLevel(logging.WARNING)
    cfg = resolve_config(args)
    summary = collect(cfg)
    for task, st in summary["tasks"].items():
        if st["attempted"]:
            rate = st["success"] / st["attempted"]
            if "planner_solved" in st:
                solved = st["planner_solved"]
                print(
                    f"{task}: the motion planner solved {solved}/{st['attempted']} ({solved / st['attempted']:.0%})"
                )
            print(
                f"{task}: {st['success']}/{st['attempted']} expert successes ({rate:.0%}), {st['kept']} kept"
            )
    print(
        f"{summary['new_episodes']} new episodes in {summary['wall_s']:.1f} s "
        f"({summary['episodes_per_min']:.1f} episodes/min); {summary['kept_total']} in {summary['out']}"
    )
    return 0
