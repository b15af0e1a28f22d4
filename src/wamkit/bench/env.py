"""``wamkit bench env``: simulator steps/s (step + render of every camera) in 1 process and in N
processes at once, per suite, image size and render quality, with the ratios measured in the same run.

Every measurement runs in spawned env workers (the parent never creates a GL context). Each worker
resets an episode, then steps it with seeded random actions for ``--seconds`` (resetting when an
episode ends); the N-process figure is the sum of all workers' steps over the parent's wall time.
``--render-gpus`` repeats every measurement with env workers rendering on each EGL device
(``env.render_gpu``), and each row names the GL renderer that drew its pixels.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import Any

import numpy as np

from wamkit import embodiments
from wamkit.config import EnvConfig
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.host import EnvHost
from wamkit.envs.suites import suite_info
from wamkit.envs.workers import EnvWorker

DEFAULT_TASK = {"metaworld": "push-v3"}


class BenchHost(EnvHost):
    """An EnvHost that can time a stepping loop in its slot 0."""

    def run_steps(self, payload: dict[str, Any]) -> dict[str, float]:
        """``{"spec", "seconds"}`` -> ``{"steps", "seconds", "resets"}``: step slot 0 for that long."""
        env, spec = self.envs[0], payload["spec"]
        info = suite_info(spec.suite)
        rng = np.random.default_rng(spec.seed)
        scale = embodiments.for_suite(spec.suite).random_action_scale
        env.reset(spec)
        steps, resets, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < payload["seconds"]:
            action = rng.uniform(-1, 1, info.action_dim) * scale
            _, _, terminated, truncated, _ = env.step(action)
            steps += 1
            if terminated or truncated:
                env.reset(spec)
                resets += 1
        return {"steps": steps, "seconds": time.perf_counter() - start, "resets": resets}


def default_suites() -> list[str]:
    """The ``bench_suite`` of every registered embodiment whose simulator packages are installed."""
    from wamkit import embodiments
    from wamkit.envs.base import installed_versions

    out = []
    for e in map(embodiments.get, embodiments.names()):
        if e.bench_suite and all(v is not None for v in installed_versions(e.packages).values()):
            out.append(e.bench_suite)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suites",
        default=",".join(default_suites()),
        help="comma-separated suites (default: each installed embodiment's benchmark suite)",
    )
    p.add_argument("--sizes", default="128,256", help="comma-separated square image sizes")
    p.add_argument("--qualities", default="default,fast", help="render qualities to compare")
    p.add_argument(
        "--processes",
        default=str(os.cpu_count() or 1),
        help="comma-separated process counts measured beside 1 process (default: all cores)",
    )
    p.add_argument(
        "--render-gpus",
        default="-1",
        help="comma-separated env.render_gpu values (-1: EGL's choice; N: EGL device N); a list that "
        "starts with -1 is written with '=': --render-gpus=-1,1 (default: -1)",
    )
    p.add_argument("--seconds", type=float, default=5.0, help="stepping time per measurement")
    p.add_argument("--json", help="also write the figures to this JSON file")


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _measure(env_cfg: EnvConfig, spec: EpisodeSpec, n: int, seconds: float) -> dict[str, Any]:
    workers = [EnvWorker(env_cfg, 1, i, host_factory=BenchHost) for i in range(n)]
    try:
        for i, w in enumerate(workers):  # warm up: build the sim and its GL context first
            w.submit("reset", {0: EpisodeSpec(spec.suite, spec.task, spec.trial, spec.seed + i)})
        for w in workers:
            w.result(timeout=900)
        gl = workers[0].call("gl_info", timeout=60)
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
        "gl": gl,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    counts = sorted({1, *_ints(args.processes, "--processes")})
    if counts[0] < 1:
        raise SystemExit(f"--processes: expected counts >= 1, got {args.processes!r}")
    rows = []
    for suite in [s for s in args.suites.split(",") if s]:
        info = suite_info(suite)
        spec = EpisodeSpec(suite, DEFAULT_TASK.get(suite, info.tasks[0]), 0, 0)
        for gpu in _ints(args.render_gpus, "--render-gpus"):
            for size in [int(s) for s in args.sizes.split(",") if s]:
                for quality in [q for q in args.qualities.split(",") if q]:
                    cfg = EnvConfig(
                        suite=suite,
                        tasks=[spec.task],
                        cameras=list(info.cameras),
                        image_size=size,
                        render_quality=quality,
                        render_gpu=gpu,
                    )
                    rates, per_process, gl = {}, {}, {}
                    for n in counts:
                        m = _measure(cfg, spec, n, args.seconds)
                        rates[n], per_process[n], gl = m["steps_per_s"], m["per_process"], gl or m["gl"]
                        print(
                            f"{suite:<12} {size:>4}px {quality:<7} gpu {gpu:>2} {n:>3} procs "
                            f"{rates[n]:9.1f} steps/s ({rates[n] / rates[1]:.2f}x of 1 proc)",
                            flush=True,
                        )
                    top = counts[-1]
                    rows.append({
                        "suite": suite, "size": size, "quality": quality, "cameras": len(info.cameras),
                        "render_gpu": gpu, "gl_renderer": gl.get("renderer", "?"),
                        "rates": {str(n): r for n, r in rates.items()},
                        "per_process": {str(n): r for n, r in per_process.items()},
                        "one": rates[1], "all": rates[top], "processes": top,
                        "all_per_process": per_process[top],
                    })  # fmt: skip
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary table: per row steps/s at each process count, N/1 for the largest N, and the
    fast/default ratios (1 process | N processes) against the same suite, size and render GPU."""
    counts = sorted({int(n) for r in rows for n in r["rates"]}) or [1]
    head = " ".join(f"{f'{n} proc' + ('s' if n > 1 else ''):>10}" for n in counts)
    lines = [
        f"simulator steps/s (step + render of every camera; {os.cpu_count()} cores here)",
        f"{'suite':<12} {'px':>4} {'quality':<8} {'gpu':>3} {head} {'N/1':>6} {'fast/default (1 | N)':>22}"
        "  renderer",
    ]
    for r in rows:
        key = (r["suite"], r["size"], "default", r["render_gpu"])
        ref = next((d for d in rows if (d["suite"], d["size"], d["quality"], d["render_gpu"]) == key), None)
        ratio = f"{r['one'] / ref['one']:.2f}x | {r['all'] / ref['all']:.2f}x" if ref and r is not ref else ""
        cells = " ".join(
            f"{r['rates'][str(n)]:10.1f}" if str(n) in r["rates"] else f"{'-':>10}" for n in counts
        )
        lines.append(
            f"{r['suite']:<12} {r['size']:>4} {r['quality']:<8} {r['render_gpu']:>3} {cells} "
            f"{r['all'] / r['one']:5.2f}x {ratio:>22}  {r['gl_renderer']}"
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
