"""``wamkit bench gpu-sim``: the evaluator's env-steps/s with ManiSkill3 simulated on the GPU
(``eval.executor=gpu``) beside the process executor (``local``), at several env counts, in one run.

For each N in ``--num-envs`` the same episodes (``--episodes-per-env`` x N of ``--task``, seeds
``eval.seed`` + trial) run through the real evaluator twice, against one served model (``--model``,
random weights; ``tiny`` small by default): the process executor with N envs over ``--workers`` processes
(one CPU simulator each) in ``--process-stages`` stages, then the GPU executor with N envs over
``--stages`` processes (one stage each, its envs simulated together). Simulators are built before the
clock starts (``run_eval(prebuild=True)``). Printed per N: env-steps/s of each and their ratio, and
each run's success (the two start every episode from the same state, :mod:`wamkit.envs.maniskill_batch`).

A process run that the host cannot hold (the evaluator measures one env's memory and refuses an N that
does not fit) is reported as such, and the ratio is then taken against the largest N it ran.

``--sim physx_cpu`` runs the GPU executor's path on ManiSkill's CPU simulator (one env a worker: N must
equal ``--stages``), for a machine without CUDA; its figures say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from wamkit import embodiments
from wamkit.config import ConfigError, ServeConfig, load_config
from wamkit.files import atomic_write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", default="PickCube-v1", help="a ManiSkill3 task (default: PickCube-v1)")
    parser.add_argument(
        "--num-envs", default="16,64,256", help="env counts, comma-separated (default: 16,64,256)"
    )
    parser.add_argument("--episodes-per-env", type=int, default=2, help="episodes per env (default: 2)")
    parser.add_argument(
        "--stages", type=int, default=2, help="GPU executor: stages = worker processes (default: 2)"
    )
    parser.add_argument(
        "--workers", type=int, default=0, help="process executor: worker processes (default: the CPU count)"
    )
    parser.add_argument("--process-stages", type=int, default=2, help="process executor: stages (default: 2)")
    parser.add_argument("--image-size", type=int, default=128, help="rendered px (default: 128, ManiSkill's)")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="episode steps (default 0: the task's horizon)"
    )
    parser.add_argument("--replan-interval", type=int, default=8, help="actions per request (default: 8)")
    parser.add_argument("--model", default="tiny", help="the served model, random weights (default: tiny)")
    parser.add_argument("--preset", default="small", help="its preset (default: small)")
    parser.add_argument("--device", default="auto", help="the server's device: auto | cpu | cuda")
    parser.add_argument(
        "--executors", default="local,gpu", help="which executors, in order (default: local,gpu)"
    )
    parser.add_argument(
        "--sim", default="physx_cuda", choices=["physx_cuda", "physx_cpu"],
        help="the GPU executor's simulator (physx_cpu: a dry run without CUDA, one env a worker)",
    )  # fmt: skip
    parser.add_argument("--out", help="run folders here (default: a temporary folder)")
    parser.add_argument("--json", help="write the figures here")


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ConfigError(f"--num-envs: expected env counts >= 1, comma-separated, got {text!r}")
    return counts


def eval_config(url: str, out: Path, args: argparse.Namespace, n: int, executor: str):
    """The run config of N envs on ``executor`` (``local``: ``--workers`` processes in
    ``--process-stages`` stages; ``gpu``: ``--stages`` processes, one stage each)."""
    if executor == "gpu":
        workers = stages = args.stages
    else:
        workers, stages = min(args.workers or os.cpu_count() or 1, n), args.process_stages
    return load_config(None, [
        f"eval.server_url={url}", f"eval.out_dir={out}", "env.suite=maniskill", f"env.tasks=[{args.task}]",
        f"env.cameras=[{','.join(embodiments.for_suite('maniskill').default_cameras)}]", f"env.image_size={args.image_size}", f"env.max_steps={args.max_steps}",
        f"eval.trials={n * args.episodes_per_env}", f"eval.num_envs={n}", f"eval.workers={workers}",
        f"eval.pipeline_stages={stages}", f"eval.executor={executor}", f"eval.replan_interval={args.replan_interval}",
        "eval.videos=0", "eval.calibrate_s=0",
    ])  # fmt: skip


def host_factory(args: argparse.Namespace, executor: str):
    """The GPU executor's host on ``--sim`` (None: the executor's own)."""
    from wamkit.eval.gpu_host import BatchChunkHost

    if executor == "gpu" and args.sim == "physx_cpu":
        return functools.partial(BatchChunkHost, sim_backend="physx_cpu")
    return None


def _run(url: str, out: Path, args: argparse.Namespace, n: int, executor: str) -> dict[str, Any]:
    from wamkit.eval.runner import run_eval

    cfg = eval_config(url, out, args, n, executor)
    workers, stages = cfg.eval.workers, cfg.eval.pipeline_stages
    try:
        summary = run_eval(cfg, progress=False, prebuild=True, host_factory=host_factory(args, executor))
    except ConfigError as err:  # the host cannot hold N envs of the process executor: said, not fatal
        if executor != "local":
            raise
        return {"executor": executor, "num_envs": n, "refused": str(err).splitlines()[0]}
    t = summary["throughput"]
    return {
        "executor": executor, "num_envs": n, "workers": workers, "stages": stages, "wall_s": t["wall"],
        "env_steps": t["env_steps"], "env_steps_per_s": t["env_steps_per_s"],
        "success": summary["all"]["success_once"], "episodes": summary["all"]["episodes"],
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    rows = ["| N | process env-steps/s | GPU env-steps/s | GPU / process | success (process, GPU) |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    best = None
    for n in result["num_envs"]:
        by = {r["executor"]: r for r in result["runs"] if r["num_envs"] == n}
        loc, gpu = by.get("local", {}), by.get("gpu", {})
        if "env_steps_per_s" in loc:
            best = loc
        rate = lambda r: f"{r['env_steps_per_s']:.0f}" if "env_steps_per_s" in r else r.get("refused", "-")  # noqa: E731
        ratio = "-"
        if best and "env_steps_per_s" in gpu:
            ratio = f"{gpu['env_steps_per_s'] / best['env_steps_per_s']:.1f}x"
            if best is not loc:
                ratio += f" (against N={best['num_envs']})"
        succ = ", ".join(f"{r['success']}/{r['episodes']}" if "success" in r else "-" for r in (loc, gpu))
        rows.append(f"| {n} | {rate(loc)} | {rate(gpu)} | {ratio} | {succ} |")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    from wamkit.eval.server_proc import start_server_process

    counts = _counts(args.num_envs)
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    if not executors or set(executors) - {"local", "gpu"}:
        raise ConfigError(f"--executors: expected local and/or gpu, got {args.executors!r}")
    if args.sim == "physx_cpu" and any(n != args.stages for n in counts):
        raise ConfigError(
            f"--sim physx_cpu: one env a worker, so --num-envs must be --stages ({args.stages})"
        )
    result: dict[str, Any] = {
        "task": args.task,
        "num_envs": counts,
        "sim": args.sim,
        "runs": [],
        "complete": False,
    }
    with contextlib.ExitStack() as stack:
        root = Path(args.out) if args.out else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        root.mkdir(parents=True, exist_ok=True)
        cmd = ["--model", args.model, "--preset", args.preset, "--random-init", "--suite", "maniskill"]
        serve = ServeConfig(device=args.device)
        url = stack.enter_context(start_server_process(cmd, log_path=root / "server.log", serve=serve)).url
        result["server"] = f"{args.model} {args.preset}, random weights, {args.device}"
        for n in counts:
            for executor in executors:
                run = _run(url, root / f"{executor}_{n}", args, n, executor)
                result["runs"].append(run)
                print(json.dumps(run), flush=True)
                if args.json:
                    atomic_write_json(Path(args.json), result)
    result["complete"] = True
    result["table"] = table(result)
    if args.json:
        atomic_write_json(Path(args.json), result)
    print(f"\nManiSkill3 {args.task}, {result['server']}; GPU executor: {args.stages} processes ({args.sim})")
    print(result["table"])
    return 0
