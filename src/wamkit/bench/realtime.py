"""``wamkit bench realtime``: a served policy's held-out success and smoothness when the world does not
wait for it (docs/eval.md "Real-time execution").

One server (``--serve-dir``, started once) and one set of env workers serve every run. For each
delay ``d`` of ``--delays`` (control steps a request is in flight) and each way chunks meet
(``--blends``: switch, rtc, ensemble) it runs the config's evaluation (``--config``, default the demo's)
with ``eval.execution=async`` (``sync`` at ``d = 0``: the same thing), and prints one table: success
with its 95% interval, and the mean action jerk (the second difference of executed actions) at chunk
boundaries against within chunks. Every run's folder stays under ``--out``; a run already finished
there is read back (its journal resumes it), so an interrupted benchmark goes on where it stopped.

    wamkit bench realtime --serve-dir runs/demo/serve --out runs/bench_realtime
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from typing import Any

from wamkit.config import ConfigError

BLENDS = ("switch", "rtc", "ensemble")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--serve-dir", required=True, help="the serving directory of the policy to measure")
    parser.add_argument("--config", default="demo", help="preset or YAML of the evaluation (default: demo)")
    parser.add_argument("--delays", default="0,2,4,8", help="control steps in flight (default: 0,2,4,8)")
    parser.add_argument("--blends", default=",".join(BLENDS), help="switch,rtc,ensemble (default: all)")
    parser.add_argument("--trials", type=int, default=0, help="trials per task (default: the config's)")
    parser.add_argument(
        "--out", default="runs/bench_realtime", help="the runs' folders (default: runs/bench_realtime)"
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides (key=value), e.g. eval.replan_interval=8"
    )


def _runs(delays: list[int], blends: list[str]) -> list[tuple[str, int]]:
    return [(blend, d) for blend in blends for d in delays]


def main(args: argparse.Namespace) -> int:
    from wamkit.config import load_config
    from wamkit.eval.runner import run_eval, start_env_workers
    from wamkit.eval.server_proc import start_server_process

    try:
        delays = [int(d) for d in args.delays.split(",") if d.strip()]
    except ValueError:
        raise ConfigError(
            f"--delays: expected whole numbers separated by commas, got {args.delays!r}"
        ) from None
    blends = [b for b in args.blends.split(",") if b]
    bad = [b for b in blends if b not in BLENDS]
    if bad or not blends or not delays or min(delays) < 0:
        raise ConfigError(
            f"--blends from {', '.join(BLENDS)} and --delays >= 0; got {args.blends!r}, {args.delays!r}"
        )
    if not Path(args.serve_dir).is_dir():
        raise ConfigError(f"--serve-dir: {args.serve_dir} is not a serving directory")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = [f"eval.trials={args.trials}"] if args.trials else []
    base = load_config(args.config, [*args.overrides, *extra, "eval.videos=0"])
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(
            start_server_process([args.serve_dir], log_path=out / "server.log", serve=base.serve)
        )
        workers = stack.enter_context(start_env_workers(base))
        for blend, d in _runs(delays, blends):
            name = f"{blend}_d{d}"
            mode = ["eval.execution=async", f"eval.delay_steps={d}"] if d else ["eval.execution=sync"]
            cfg = load_config(
                args.config,
                [
                    *args.overrides,
                    *extra,
                    "eval.videos=0",
                    *mode,
                    f"eval.chunk_blend={blend}",
                    f"eval.server_url={server.url}",
                    f"eval.out_dir={out / name}",
                ],
            )
            summary = run_eval(cfg, resume=True, progress=False, env_workers=workers)
            a, sm = summary["all"], summary.get("smoothness", {})
            rows.append(
                {
                    "blend": blend,
                    "delay": d,
                    "episodes": a["episodes"],
                    "rate": a["rate"],
                    "ci95": a["ci95"],
                    **sm,
                }
            )
            print(f"[realtime] {name}: {100 * a['rate']:.1f}% of {a['episodes']}", flush=True)
    (out / "realtime.json").write_text(json.dumps({"serve_dir": args.serve_dir, "rows": rows}, indent=1))
    print(table(rows))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one row per (blend, d)."""

    def num(x: Any) -> str:
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"

    lines = [
        "| chunks meet by | d (steps) | execution | success, 95% CI | jerk at boundaries | jerk within | ratio |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lo, hi = r["ci95"]
        b, w = r.get("jerk_boundary"), r.get("jerk_within")
        ratio = f"{b / w:.2f}" if b is not None and w and not math.isnan(b) and not math.isnan(w) else ""
        lines.append(
            f"| {r['blend']} | {r['delay']} | {'async' if r['delay'] else 'sync'} | "
            f"{100 * r['rate']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) | {num(b)} | {num(w)} | {ratio} |"
        )
    return "\n".join(lines)
