"""``wamkit bench env``: simulator steps/s (step + render of every camera) in 1 process and in N
processes at once, per suite, image size and render quality, with the ratios measured in the same run.

Every measurement runs in spawned env workers (the parent never creates a GL context). Each worker
resets an episode, then steps it with seeded random actions for ``--seconds`` (resetting when an
episode ends); the N-process figure is the sum of all workers' steps over the parent's wall time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import time
from typing import Any

import numpy as np

from wamkit.config import EnvConfig
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.host import EnvHost
from wamkit.envs.suites import LIBERO_SUITES, suite_info
from wamkit.envs.workers import EnvWorker

DEFAULT_TASK = {"metaworld": "push-v3"}


class BenchHost(EnvHost):
    """An EnvHost that can time a stepping loop in its slot 0."""

    def run_steps(self, payload: dict[str, Any]) -> dict[str, float]:
        """``{"spec", "seconds"}`` -> ``{"steps", "seconds", "resets"}``: step slot 0 for that long."""
        env, spec = self.envs[0], payload["spec"]
        info = suite_info(spec.suite)
        rng = np.random.default_rng(spec.seed)
        env.reset(spec)
        steps, resets, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < payload["seconds"]:
            action = rng.uniform(-1, 1, info.action_dim) * (0.3 if spec.suite in LIBERO_SUITES else 1.0)
            _, _, terminated, truncated, _ = env.step(action)
            steps += 1
            if terminated or truncated:
                env.reset(spec)
                resets += 1
        return {"steps": steps, "seconds": time.perf_counter() - start, "resets": resets}


def add_arguments(p: argparse.ArgumentParser) -> None:
    libero = importlib.util.find_spec("libero") is not None
    p.add_argument(
        "--suites", default="metaworld,libero_10" if libero else "metaworld", help="comma-separated suites"
    )
    p.add_argument("--sizes", default="128,256", help="comma-separated square image sizes")
    p.add_argument("--qualities", default="default,fast", help="render qualities to compare")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="the 'all cores' process count")
    p.add_argument("--seconds", type=float, default=5.0, help="stepping time per measurement")
    p.add_argument("--json", help="also write the figures to this JSON file")


def _measure(env_cfg: EnvConfig, spec: EpisodeSpec, n: int, seconds: float) -> dict[str, float]:
    workers = [EnvWorker(env_cfg, 1, i, host_factory=BenchHost) for i in range(n)]
    try:
        for i, w in enumerate(workers):  # warm up: build the sim and its GL context first
            w.submit("reset", {0: EpisodeSpec(spec.suite, spec.task, spec.trial, spec.seed + i)})
        for w in workers:
            w.result(timeout=900)
        start = time.perf_counter()
        for i, w in enumerate(workers):
            w.submit(
                "run_steps",
                {"spec": EpisodeSpec(spec.suite, spec.task, spec.trial, spec.seed + i), "seconds": seconds},
            )
        results = [w.result(timeout=seconds + 900) for w in workers]
        wall = time.perf_counter() - start
    finally:
        for w in workers:
            w.close()
    steps = sum(r["steps"] for r in results)
    return {
        "steps_per_s": steps / wall,
        "per_process": float(np.mean([r["steps"] / r["seconds"] for r in results])),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for suite in [s for s in args.suites.split(",") if s]:
        info = suite_info(suite)
        spec = EpisodeSpec(suite, DEFAULT_TASK.get(suite, info.tasks[0]), 0, 0)
        for size in [int(s) for s in args.sizes.split(",") if s]:
            for quality in [q for q in args.qualities.split(",") if q]:
                cfg = EnvConfig(
                    suite=suite,
                    tasks=[spec.task],
                    cameras=list(info.cameras),
                    image_size=size,
                    render_quality=quality,
                )
                one = _measure(cfg, spec, 1, args.seconds)
                many = _measure(cfg, spec, args.processes, args.seconds)
                row = {"suite": suite, "size": size, "quality": quality, "cameras": len(info.cameras),
                       "one": one["steps_per_s"], "all": many["steps_per_s"], "processes": args.processes,
                       "all_per_process": many["per_process"]}  # fmt: skip
                rows.append(row)
                print(
                    f"{suite:<12} {size:>4}px {quality:<7} 1 proc {row['one']:8.1f} steps/s | "
                    f"{args.processes} procs {row['all']:8.1f} steps/s ({row['all'] / row['one']:.2f}x)",
                    flush=True,
                )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary table: per row 1-process and N-process steps/s, N/1, and fast/default ratios."""
    lines = [
        f"simulator steps/s (step + render of every camera; {os.cpu_count()} cores here)",
        f"{'suite':<12} {'px':>4} {'quality':<8} {'1 proc':>9} {'N procs':>9} {'N/1':>6} {'fast/default (1 | N)':>22}",
    ]
    for r in rows:
        key = (r["suite"], r["size"], "default")
        ref = next((d for d in rows if (d["suite"], d["size"], d["quality"]) == key), None)
        ratio = f"{r['one'] / ref['one']:.2f}x | {r['all'] / ref['all']:.2f}x" if ref and r is not ref else ""
        lines.append(
            f"{r['suite']:<12} {r['size']:>4} {r['quality']:<8} {r['one']:9.1f} {r['all']:9.1f} "
            f"{r['all'] / r['one']:5.2f}x {ratio:>22}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("OpenGL.acceleratesupport").setLevel(logging.WARNING)
    rows = run(args)
    print("\n" + format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
