"""``wamkit bench soak``: does a long evaluation grow? Resident memory, file descriptors and threads of
the evaluator, every env worker and the server, over one run of many MetaWorld episodes.

One run of the real evaluator (``run_eval``: journal, pipeline, websocket server, reports) over
``--episodes`` episodes; a sampler thread reads every process from ``/proc`` every ``--interval``
seconds (:mod:`wamkit.eval.process_memory`) beside the number of episodes the journal holds. The warm-up ends
when a tenth of the episodes are done (envs built, caches filled, the journal's first records
written); growth is measured from there to the last sample taken while episodes still ran, and printed
per process with the samples at each quarter of the run between. The env memory the evaluator measured
at start-up (per env, per worker, the most envs the host holds) is printed too.

Nothing here judges the numbers: the table is the result (a few % over the warm-up is the journal's
own records and allocator noise; a steady climb quarter after quarter is a leak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from wamkit.config import ConfigError, ServeConfig, load_config
from wamkit.eval.process_memory import sample


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=1000, help="episodes (default: 1000)")
    parser.add_argument(
        "--tasks", default="reach-v3,push-v3", help="MetaWorld tasks (default: reach-v3,push-v3)"
    )
    parser.add_argument(
        "--max-steps", type=int, default=24, help="env steps per episode at most (default: 24)"
    )
    parser.add_argument("--image-size", type=int, default=32, help="camera resolution in px (default: 32)")
    parser.add_argument("--num-envs", type=int, default=8, help="envs (default: 8)")
    parser.add_argument("--workers", type=int, default=2, help="env worker processes (default: 2)")
    parser.add_argument("--delay-ms", type=float, default=5.0, help="delay server: ms per call (default: 5)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default: 1)")
    parser.add_argument("--out", default="", help="keep the run folder here (default: a temporary one)")
    parser.add_argument("--json", default="", help="write every sample here")


def _config(args, url: str, out: Path, trials: int):
    return load_config(None, [
        "env.suite=metaworld", f"env.tasks=[{args.tasks}]", f"env.image_size={args.image_size}",
        "env.render_quality=fast", f"env.max_steps={args.max_steps}", f"eval.server_url={url}",
        f"eval.out_dir={out}", f"eval.trials={trials}", f"eval.num_envs={args.num_envs}",
        "eval.pipeline_stages=2", f"eval.workers={args.workers}", "eval.replan_interval=8", "eval.videos=0",
        "eval.calibrate_s=0.5",
    ])  # fmt: skip


class Sampler:
    """A thread reading every process of the run, and the episodes done, every ``interval`` seconds."""

    def __init__(self, workers, server_pid: int, journal: Path, interval: float):
        self.workers, self.server_pid, self.journal, self.interval = workers, server_pid, journal, interval
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-sampler", daemon=True)

    def _pids(self) -> dict[str, int]:
        pids = {"evaluator": os.getpid()}
        for w in range(self.workers.num_workers):
            try:
                pids[f"env worker {w}"] = self.workers.pid(w)
            except AttributeError:  # not started yet
                continue
        pids["server"] = self.server_pid
        return pids

    def take(self) -> None:
        done = len(self.journal.read_text().splitlines()) if self.journal.is_file() else 0
        pids = self._pids()
        self.rows.append({"t": time.perf_counter(), "episodes": done, "pids": pids,
                          "samples": {n: sample(p) for n, p in pids.items()}})  # fmt: skip

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.take()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _table(first: dict, last: dict) -> str:
    lines = [
        f"{'process':<14} {'RSS start MB':>12} {'RSS end MB':>10} {'growth':>7} {'fds':>9} {'threads':>9}"
    ]
    for name, a in first["samples"].items():
        b = last["samples"].get(name)
        if a is None or b is None:
            lines.append(f"{name:<14} {'(gone)':>12}")
            continue
        again = "" if first["pids"][name] == last["pids"].get(name) else "  (restarted: another process)"
        growth = 100.0 * (b.rss - a.rss) / max(a.rss, 1)
        lines.append(
            f"{name:<14} {a.rss / 1e6:>12.1f} {b.rss / 1e6:>10.1f} {growth:>6.1f}% "
            f"{a.fds:>4}->{b.fds:<4} {a.threads:>4}->{b.threads:<4}{again}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from wamkit.eval.runner import run_eval, start_env_workers
    from wamkit.eval.server_proc import start_server_process

    tasks = [t for t in args.tasks.split(",") if t]
    trials = args.episodes // len(tasks)
    if trials < 1 or args.interval <= 0:
        raise ConfigError(f"--episodes {args.episodes}: at least one per task ({len(tasks)}); --interval > 0")
    with contextlib.ExitStack() as stack:
        root = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        cmd = ["--model", "delay", "--random-init", "--option", f"delay_ms={args.delay_ms}"]
        server = stack.enter_context(
            start_server_process(cmd, log_path=root / "server.log", serve=ServeConfig(device="cpu"))
        )
        cfg = _config(args, server.url, root / "run", trials)
        workers = stack.enter_context(start_env_workers(cfg))
        n = trials * len(tasks)
        print(f"soak: {n} MetaWorld episodes ({', '.join(tasks)}, <= {args.max_steps} steps) in one run, "
              f"{args.num_envs} envs on {workers.num_workers} workers, a {args.delay_ms:g} ms delay server, "
              f"a sample every {args.interval:g} s", flush=True)  # fmt: skip
        sampler = Sampler(workers, server.proc.pid, root / "run" / "episodes.jsonl", args.interval)
        with sampler:
            summary = run_eval(cfg, progress=False, prebuild=True, env_workers=workers)
        sampler.take()  # the end: every episode journaled, workers and server still up
    rows = [r for r in sampler.rows if len(r["pids"]) == workers.num_workers + 2]
    # the end: the last sample while episodes still ran (after the last one, the evaluator imports and
    # runs the plotting for its reports, which is not growth of the run)
    running = [r for r in rows if r["episodes"] < n] or rows
    warm = next((r for r in running if r["episodes"] >= max(1, n // 10)), running[-1])
    last = running[-1]
    t0 = rows[0]["t"]
    for q in (0.25, 0.5, 0.75):
        r = next((r for r in running if r["episodes"] >= q * n), last)
        ev = r["samples"]["evaluator"]
        print(f"  {r['episodes']:>5} episodes, {r['t'] - t0:>5.0f} s: evaluator RSS {ev.rss / 1e6:.1f} MB, "
              f"{ev.fds} fds, {ev.threads} threads", flush=True)  # fmt: skip
    print(f"after the warm-up ({warm['episodes']} episodes) -> after {last['episodes']} episodes "
          f"({len(running)} samples while episodes ran):")  # fmt: skip
    print(_table(warm, last))
    env_memory = summary["throughput"].get("env_memory")
    if env_memory:
        print(f"env memory measured at start-up: {env_memory['per_env'] / 1e6:.1f} MB per env, "
              f"{env_memory['per_worker'] / 1e6:.1f} MB per worker; at most {env_memory['max_envs']} envs "
              f"fit the {env_memory['available'] / 1e9:.1f} GB available")  # fmt: skip
    if args.json:
        out = [
            {**r, "samples": {k: (v.__dict__ if v else None) for k, v in r["samples"].items()}} for r in rows
        ]
        Path(args.json).write_text(json.dumps({"samples": out, "env_memory": env_memory}, indent=1))
    return 0
