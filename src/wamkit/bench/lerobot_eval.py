"""``wamkit bench lerobot-eval``: one LeRobot checkpoint evaluated by ``lerobot-eval`` and by ``wamkit eval``,
side by side, on the same env and episodes (docs/lerobot.md "Against lerobot-eval").

Both run as a user types them, as subprocesses timed from start to exit (Python's start, loading the
policy, building the envs and every episode). The env is wamkit's (the config's camera, image size, look,
state and horizon); ``lerobot-eval`` gets it through the plug-in ``wamkit.envs.lerobot_plugin``. The
episodes coincide: LeRobot seeds episode i of a task ``--seed`` + i, and wamkit, under
``env.seed_rule=per_trial``, trial t ``eval.seed`` + t. Each executes the policy's ``n_action_steps``
actions of a chunk (``eval.replan_interval``). LeRobot steps its envs lock-step, a batch of ``--envs``
until the last is done (each env in a process of its own), and its tasks one after another; wamkit
pipelines the same number of envs over every task, in ``--workers`` processes (by default one per env up
to the CPU count: the processes lerobot-eval has, where the cores are there to run them).

On ALOHA, ``lerobot-eval`` runs LeRobot's own env (``--env.type=aloha``: gym-aloha's ``AlohaEnv``, one
task a run) rather than the plug-in; its seeds place the objects as wamkit's do (gym-aloha's samplers),
but it renders 480 x 640 frames, where wamkit renders that frame squeezed to the policy's square size, so
the policy sees other pixels and the episodes are not expected to end alike: the bench says so and
compares the success rates. Its envs step in one process there (LeRobot 0.6.1's async envs cannot make
gym-aloha's envs: they start in forkserver processes where its ids are not registered).

It prints one table: wall time, success with its 95% (Wilson) interval, per task, the speed-up, and how
many episodes ended alike (success, and return within 1e-3 relative: the same trajectory to float32
roundings, the two batching the policy's calls differently). Everything stays under ``--out``; a
second run there measures again and replaces the first's results (the input is checked before).

    wamkit bench lerobot-eval --policy runs/demo_act/lerobot --trials 30 --envs 16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from wamkit.config import ConfigError

PLUGIN = "wamkit.envs.lerobot_plugin"
RETURN_RTOL = 1e-3
# suites lerobot-eval runs with an env of LeRobot's own (``--env.type``) instead of the plug-in: wamkit's
# task -> the gym id LeRobot's env config takes (``lerobot/envs/configs.py``, ``AlohaEnv``)
OWN_ENVS = {"aloha": {"transfer_cube": "AlohaTransferCube-v0", "insertion": "AlohaInsertion-v0"}}
# what LeRobot's own ALOHA env renders (gym-aloha's AlohaEnv defaults; LeRobot's config passes no size)
ALOHA_FRAME = (480, 640)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        required=True,
        help="a LeRobot pretrained folder (lerobot-train's, or wamkit convert --to extra)",
    )
    parser.add_argument(
        "--config", default="demo", help="preset or YAML whose env and eval both use (default: demo)"
    )
    parser.add_argument("--trials", type=int, default=10, help="episodes per task (default: 10)")
    parser.add_argument(
        "--envs", type=int, default=10, help="envs stepped at once by each evaluator (default: 10)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="wamkit's env worker processes (default 0: one per env up to the CPU count, as lerobot-eval "
        "runs each env in a process of its own)",
    )
    parser.add_argument("--device", default="cpu", help="the policy's device in both (default: cpu)")
    parser.add_argument(
        "--out", default="runs/bench_lerobot_eval", help="outputs (default: runs/bench_lerobot_eval)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. env.max_steps=200")


def _lerobot_eval() -> list[str]:
    """``lerobot-eval``: the module its console script runs (``lerobot.scripts.lerobot_eval:main``), so that
    an install without console scripts (``pip --target``) runs it too."""
    import importlib.util

    if importlib.util.find_spec("lerobot") is None:
        raise ConfigError(
            "wamkit bench lerobot-eval: LeRobot is not installed in this Python; run it in LeRobot's venv "
            "(make setup-lerobot, then source .venv-lerobot/bin/activate)"
        )
    return [sys.executable, "-m", "lerobot.scripts.lerobot_eval"]


def _run(cmd: list[str], log: Path, env: dict[str, str]) -> float:
    print(f"[lerobot-eval bench] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{cmd[0]} exited with {rc} after {seconds:.0f} s (log: {log}):\n{tail}")
    return seconds


def _wamkit_episodes(out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    eps = {}
    for line in (out / "episodes.jsonl").read_text().splitlines():
        e = json.loads(line)
        eps[(e["task"], int(e["seed"]))] = {"success": bool(e["success_once"]), "return": float(e["return"])}
    return eps


def _lerobot_episodes(
    out: Path, seed: int, task: str | None = None
) -> tuple[dict[tuple[str, int], dict[str, Any]], float]:
    """Episode i of a task ran with seed ``seed`` + i (``scripts/lerobot_eval.py``, ``eval_policy``).
    ``task``: wamkit's name of the one task an env of LeRobot's own ran (its group is named otherwise)."""
    info = json.loads((out / "eval_info.json").read_text())
    eps = {}
    for t in info["per_task"]:
        m = t["metrics"]
        for i, (success, ret) in enumerate(zip(m["successes"], m["sum_rewards"], strict=True)):
            eps[(task or t["task_group"], seed + i)] = {"success": bool(success), "return": float(ret)}
    return eps, float(info["overall"]["eval_s"])


def _rate(eps: dict[tuple[str, int], dict[str, Any]], task: str | None = None) -> tuple[int, int]:
    picked = [e for (t, _), e in eps.items() if task is None or t == task]
    return sum(e["success"] for e in picked), len(picked)


def main(args: argparse.Namespace) -> int:
    from wamkit.config import load_config, save_config
    from wamkit.envs.suites import expand_tasks
    from wamkit.models.lerobot.adapter import folder_io, is_lerobot_folder

    policy = Path(args.policy).resolve()
    if not is_lerobot_folder(policy):
        raise ConfigError(
            f"--policy: {args.policy} is not a LeRobot pretrained folder (config.json with a policy type, "
            "policy_preprocessor.json, no wamkit model.json)"
        )
    if args.trials < 1 or args.envs < 1:
        raise ConfigError(f"--trials and --envs: at least 1, got {args.trials} and {args.envs}")
    if args.workers < 0:
        raise ConfigError(
            f"--workers: at least 1, or 0 for one per env up to the CPU count, got {args.workers}"
        )
    workers = args.workers or min(args.envs, os.cpu_count() or 1)
    if args.trials % args.envs:
        raise ConfigError(
            f"--trials {args.trials} is not a multiple of --envs {args.envs}: lerobot-eval would run "
            f"{-(-args.trials // args.envs) * args.envs} episodes a task and keep {args.trials}"
        )
    exe = _lerobot_eval()
    _, io = folder_io(policy)
    steps = int(json.loads((policy / "config.json").read_text()).get("n_action_steps", 1))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(
        args.config,
        [
            # the config's two pipeline stages need an even --envs: an odd one runs in one stage (an
            # override given after --policy still wins)
            f"eval.pipeline_stages={2 if args.envs % 2 == 0 else 1}",
            *args.overrides,
            f"eval.trials={args.trials}",
            f"eval.num_envs={args.envs}",
            f"eval.workers={workers}",
            f"eval.replan_interval={steps}",
            "env.seed_rule=per_trial",
            "eval.videos=0",
            f"eval.serve_dir={policy}",
            f"eval.out_dir={out / 'wamkit'}",
            f"serve.device={args.device}",
        ],
    )
    if list(cfg.env.cameras) != list(io.cameras) or cfg.env.image_size != io.image_size:
        raise ConfigError(
            f"--policy {policy}: cameras {list(io.cameras)} at {io.image_size} px; the config's env has "
            f"env.cameras={list(cfg.env.cameras)} at env.image_size={cfg.env.image_size}"
        )
    tasks = expand_tasks(cfg.env.suite, list(cfg.env.tasks))
    own = OWN_ENVS.get(cfg.env.suite)
    if own is not None and len(tasks) != 1:
        raise ConfigError(
            f"env.tasks: LeRobot's own {cfg.env.suite} env runs one task per lerobot-eval; give one of "
            f"{', '.join(own)} (got {', '.join(tasks)})"
        )
    config_path = save_config(cfg, out / "config.yaml")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if own is not None:
        from wamkit.envs.base import render_environ

        env = {**render_environ(-1), **env}  # gym-aloha renders through dm-control, offscreen
        env_args = [
            f"--env.type={cfg.env.suite}",
            f"--env.task={own[tasks[0]]}",
            f"--env.episode_length={cfg.env.max_steps or 400}",
            # LeRobot 0.6.1 makes async envs in forkserver processes, where gym-aloha's ids are not
            # registered (gymnasium's NamespaceNotFound: gym_aloha): its envs step in one process
            "--eval.use_async_envs=false",
        ]
    else:
        env_args = [
            "--env.type=wamkit",
            f"--env.discover_packages_path={PLUGIN}",
            f"--env.config={config_path}",
            f"--env.task={','.join(tasks)}",
        ]
    for d in ("wamkit", "lerobot"):  # each run starts from nothing: no journal resumed, no folder refused
        shutil.rmtree(out / d, ignore_errors=True)

    # wamkit first: a cache the first run warms (files, the policy's weights) helps the second, LeRobot
    wall_wamkit = _run(
        [sys.executable, "-m", "wamkit", "eval", str(config_path), "--no-progress"], out / "wamkit.log", env
    )
    wall_lerobot = _run(
        [
            *exe,
            f"--policy.path={policy}",
            f"--policy.device={args.device}",
            *env_args,
            f"--eval.n_episodes={args.trials}",
            f"--eval.batch_size={args.envs}",
            f"--seed={cfg.eval.seed}",
            f"--output_dir={out / 'lerobot'}",
        ],
        out / "lerobot.log",
        env,
    )
    mine = _wamkit_episodes(out / "wamkit")
    theirs, eval_s = _lerobot_episodes(out / "lerobot", cfg.eval.seed, tasks[0] if own else None)
    if set(mine) != set(theirs):
        raise RuntimeError(
            f"the two ran different episodes: wamkit {len(mine)}, lerobot-eval {len(theirs)}; only in wamkit "
            f"{sorted(set(mine) - set(theirs))[:5]}, only in lerobot-eval {sorted(set(theirs) - set(mine))[:5]}"
        )
    summary = json.loads((out / "wamkit" / "summary.json").read_text())
    same_success = sum(mine[k]["success"] == theirs[k]["success"] for k in mine)
    same_return = sum(
        abs(mine[k]["return"] - theirs[k]["return"]) <= RETURN_RTOL * max(1.0, abs(theirs[k]["return"]))
        for k in mine
    )
    result = {
        "policy": str(policy),
        "tasks": tasks,
        "trials": args.trials,
        "envs": args.envs,
        "workers": cfg.eval.workers,
        "device": args.device,
        "rows": [
            {"evaluator": "lerobot-eval", "wall_s": wall_lerobot, "evaluating_s": eval_s, "success": _rate(theirs),
             "per_task": {t: _rate(theirs, t) for t in tasks}},
            {"evaluator": "wamkit eval", "wall_s": wall_wamkit, "evaluating_s": summary["throughput"]["wall"],
             "success": _rate(mine), "per_task": {t: _rate(mine, t) for t in tasks}},
        ],
        "episodes": len(mine),
        "same_success": same_success,
        "same_return": same_return,
        "lerobot_env": f"LeRobot's own --env.type={cfg.env.suite}" if own else f"wamkit's, through {PLUGIN}",
        "note": (
            f"LeRobot's {cfg.env.suite} env renders {ALOHA_FRAME[0]} x {ALOHA_FRAME[1]} frames; wamkit renders that "
            f"frame squeezed to {io.image_size} x {io.image_size}, the size the policy was trained at: the "
            "policy sees other pixels, so episodes are not expected to end alike; and lerobot-eval steps its "
            "envs in one process (--eval.use_async_envs=false: LeRobot 0.6.1's async envs start in forkserver "
            "processes where gym-aloha's ids are not registered)"
            if own else ""
        ),
    }  # fmt: skip
    (out / "lerobot_eval.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """The markdown table and the per-episode agreement line."""
    from wamkit.eval.success import wilson_interval

    tasks = result["tasks"]
    base = result["rows"][0]["wall_s"]
    lines = [
        f"| evaluator | envs | wall s | evaluating s | speed-up | success, 95% CI | {' | '.join(tasks)} |",
        f"| --- | ---: | ---: | ---: | ---: | ---: |{' ---: |' * len(tasks)}",
    ]
    for r in result["rows"]:
        k, n = r["success"]
        lo, hi = wilson_interval(k, n)
        per = " | ".join(f"{100 * a / b:.1f}%" for a, b in (r["per_task"][t] for t in tasks))
        lines.append(
            f"| {r['evaluator']} | {result['envs']} | {r['wall_s']:.1f} | {r['evaluating_s']:.1f} | "
            f"{base / r['wall_s']:.2f}× | {100 * k / n:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) | {per} |"
        )
    n = result["episodes"]
    lines.append(
        f"\nlerobot-eval runs each env in a process of its own (AsyncVectorEnv), a task at a time; wamkit "
        f"eval runs its {result['envs']} envs in {result['workers']} worker processes, over every task."
    )
    lines.append(
        f"\nPer episode: {result['same_success']} of {n} ended alike (success or failure), "
        f"{result['same_return']} of {n} with the same return (within {RETURN_RTOL:g} relative)."
    )
    if result.get("note"):
        lines.append(f"\n{result['lerobot_env']}: {result['note']}.")
    return "\n".join(lines)
