"""``wamkit bench soak``: do long evaluations grow? Resident memory, file descriptors and threads of the
evaluator, every env worker and the server, over many MetaWorld episodes.

The evaluation runs in ``--rounds`` rounds of the real evaluator (``run_eval``: journal, pipeline,
websocket server, reports), all on the same env worker processes and the same server, as a long run of
many thousands of episodes keeps them; each round's episodes have their own seeds. After every round each
process is read from ``/proc`` (:mod:`wamkit.eval.memory`). The first round is the warm-up (envs built,
caches filled); growth is measured from its end to the last round's end, and printed per process:
RSS at both points and its growth in %, descriptors and threads at both points. The env memory the
evaluator measured at start-up (per env, per worker, the most envs the host holds) is printed too.

Nothing here judges the numbers: the table is the result (a growth of a few % over a warm-up is
allocator noise; a steady climb round after round is a leak).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from wamkit.config import ConfigError, load_config
from wamkit.eval.memory import ProcSample, sample


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--episodes", type=int, default=1000, help="episodes in all (default: 1000)")
    parser.add_argument(
        "--rounds", type=int, default=10, help="evaluator runs they are split into (default: 10)"
    )
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
    parser.add_argument(
        "--out", default="", help="keep the rounds' run folders here (default: a temporary one)"
    )
    parser.add_argument("--json", default="", help="write every round's figures here")


def _config(args, url: str, out: Path, trials: int, seed: int):
    return load_config(None, [
        "env.suite=metaworld", f"env.tasks=[{args.tasks}]", f"env.image_size={args.image_size}",
        "env.render_quality=fast", f"env.max_steps={args.max_steps}", f"eval.server_url={url}",
        f"eval.out_dir={out}", f"eval.trials={trials}", f"eval.seed={seed}", f"eval.num_envs={args.num_envs}",
        "eval.pipeline_stages=2", f"eval.workers={args.workers}", "eval.replan_interval=8", "eval.videos=0",
        "eval.calibrate_s=0.5",
    ])  # fmt: skip


def _processes(workers, server_pid: int) -> dict[str, int]:
    procs = {"evaluator": os.getpid()}
    procs.update({f"env worker {w}": workers.pid(w) for w in range(workers.num_workers)})
    procs["server"] = server_pid
    return procs


def _read(procs: dict[str, int]) -> dict[str, ProcSample | None]:
    return {name: sample(pid) for name, pid in procs.items()}


def _table(first: dict, last: dict, start_pids: dict, end_pids: dict) -> str:
    lines = [
        f"{'process':<14} {'RSS start MB':>12} {'RSS end MB':>10} {'growth':>7} {'fds':>9} {'threads':>9}",
    ]
    for name in first:
        a, b = first[name], last.get(name)
        if a is None or b is None:
            lines.append(f"{name:<14} {'(gone)':>12}")
            continue
        again = "" if start_pids[name] == end_pids[name] else "  (restarted: another process)"
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
    if args.rounds < 2:
        raise ConfigError("--rounds: expected >= 2 (the first is the warm-up growth is measured from)")
    per_round = args.episodes // args.rounds
    trials = per_round // len(tasks)
    if trials < 1:
        raise ConfigError(
            f"--episodes {args.episodes} over --rounds {args.rounds} and {len(tasks)} task(s): under one trial per round"
        )
    rows, t0 = [], time.perf_counter()
    with contextlib.ExitStack() as stack:
        root = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        cmd = [
            "--model",
            "delay",
            "--random-init",
            "--device",
            "cpu",
            "--option",
            f"delay_ms={args.delay_ms}",
        ]
        server = stack.enter_context(start_server_process(cmd, log_path=root / "server.log"))
        cfg0 = _config(args, server.url, root / "round0", trials, 0)
        workers = stack.enter_context(start_env_workers(cfg0))
        print(f"soak: {args.rounds} rounds of {trials * len(tasks)} MetaWorld episodes ({', '.join(tasks)}, "
              f"<= {args.max_steps} steps), {args.num_envs} envs on {workers.num_workers} workers, a "
              f"{args.delay_ms:g} ms delay server", flush=True)  # fmt: skip
        env_memory = None
        for k in range(args.rounds):
            cfg = _config(args, server.url, root / f"round{k}", trials, 1000 + 100_000 * k)
            summary = run_eval(cfg, progress=False, prebuild=k == 0, env_workers=workers)
            if k == 0:
                env_memory = summary["throughput"].get("env_memory")
            procs = _processes(workers, server.proc.pid)
            figures = _read(procs)
            rows.append({"round": k, "pids": procs, "episodes": trials * len(tasks) * (k + 1),
                         "seconds": time.perf_counter() - t0,
                         "samples": {n: (s.__dict__ if s else None) for n, s in figures.items()}})  # fmt: skip
            ev = figures["evaluator"]
            print(f"  round {k}: {rows[-1]['episodes']} episodes, {rows[-1]['seconds']:.0f} s, evaluator RSS "
                  f"{ev.rss / 1e6:.1f} MB, {ev.fds} fds, {ev.threads} threads", flush=True)  # fmt: skip
            if args.json:
                Path(args.json).write_text(json.dumps({"rounds": rows, "env_memory": env_memory}, indent=1))
    first = {n: ProcSample(**s) if s else None for n, s in rows[0]["samples"].items()}
    last = {n: ProcSample(**s) if s else None for n, s in rows[-1]["samples"].items()}
    print(
        f"after the warm-up round ({rows[0]['episodes']} episodes) -> after {rows[-1]['episodes']} episodes:"
    )
    print(_table(first, last, rows[0]["pids"], rows[-1]["pids"]))
    if env_memory:
        print(f"env memory measured at start-up: {env_memory['per_env'] / 1e6:.1f} MB per env, "
              f"{env_memory['per_worker'] / 1e6:.1f} MB per worker; at most {env_memory['max_envs']} envs "
              f"fit the {env_memory['available'] / 1e9:.1f} GB available")  # fmt: skip
    return 0
