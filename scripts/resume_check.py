"""Kill a multi-process training run with SIGKILL and check that ``--resume auto`` continues it exactly.

    python scripts/resume_check.py --processes 2 --device cuda --precision bf16

Three ``wamkit train`` jobs under ``torchrun --standalone --nproc_per_node=N`` on the LIBERO fixture
(``tests/fixtures/libero_tiny``) with the built-in ``tiny`` model:

1. *full*: an uninterrupted run of ``--steps`` steps;
2. *cut*: the same run, its whole process group (launcher and workers: a machine that dies) killed
   with SIGKILL once a random step after the first checkpoint is logged;
3. *cut* again with ``--resume auto``, to the end.

It prints the largest per-step difference of every logged value (loss, its parts, gradient norm, lr)
and of the final weights and EMA weights between *full* and *cut*, against ``--tolerance`` (default 0:
bit for bit), then converts *cut*'s last checkpoint to a serving directory with ``wamkit convert`` and
runs one prediction from it on the CPU. Exit status 0 when everything holds. The last line is a JSON
summary. Both runs start together (on a CPU they share the cores; the result must not depend on it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # this checkout's wamkit, installed or not
FIXTURE = REPO / "tests" / "fixtures" / "libero_tiny"

from wamkit.bench.procs import kill_tree  # noqa: E402 - after the path above


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=2, help="processes per run (default 2)")
    p.add_argument("--device", default="auto", help="train.device: auto | cpu | cuda (default auto)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="train.precision")
    p.add_argument("--steps", type=int, default=24, help="train.max_steps (default 24)")
    p.add_argument("--save-interval", type=int, default=8, help="train.save_interval (default 8)")
    p.add_argument("--micro-batch", type=int, default=2, help="per process; 2 accumulation steps")
    p.add_argument("--kill-step", type=int, default=0, help="kill once this step is logged (0: random)")
    p.add_argument("--tolerance", type=float, default=0.0, help="largest allowed difference (default 0)")
    p.add_argument("--out", default="", help="work directory (default: a temporary one, removed)")
    p.add_argument("overrides", nargs="*", help="more dotted overrides for wamkit train")
    args = p.parse_args(argv)
    if not 0 < args.save_interval < args.steps:
        p.error("--save-interval must be below --steps: the kill comes after the first checkpoint")
    return args


def train_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    n, mb = args.processes, args.micro_batch
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
        "-m", "wamkit", "train",
        f"data.root={FIXTURE}", "data.representation=libero_rot6d", "data.num_workers=1",
        "model.options.width=64", "model.options.depth=2", "model.options.heads=2",
        f"train.max_steps={args.steps}", f"train.micro_batch={mb}", f"train.global_batch={mb * n * 2}",
        f"train.save_interval={args.save_interval}", "train.log_interval=1", "train.warmup_steps=3",
        "train.ema=true", "train.keep_last=2", f"train.precision={args.precision}",
        f"train.device={args.device}", f"train.run_dir={run_dir}", *args.overrides,
    ]  # fmt: skip


def env() -> dict[str, str]:
    # the checkout's wamkit, whether or not it is installed; one thread per process (cores are shared)
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.is_file() else ""


def kill_at(
    proc: subprocess.Popen, run_dir: Path, step: int, max_steps: int, log: Path, timeout: float
) -> str:
    """Kill once ``step`` is logged; return the newest checkpoint left (the run must not have finished)."""
    from wamkit.train.checkpoint import list_checkpoints, step_dir_name

    losses, deadline = run_dir / "losses.jsonl", time.monotonic() + timeout
    while not (losses.is_file() and len(losses.read_text().splitlines()) >= step):
        if proc.poll() is not None:
            raise SystemExit(
                f"the run to kill ended (exit {proc.returncode}) before step {step}:\n{tail(log)}"
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"the run to kill did not reach step {step} in {timeout:.0f} s:\n{tail(log)}")
        time.sleep(0.005)
    kill_tree(proc)
    done = [p.name for p in list_checkpoints(run_dir / "checkpoints")]
    if proc.returncode != -signal.SIGKILL or not done or step_dir_name(max_steps) in done:
        raise SystemExit(f"the kill at step {step} came too late (exit {proc.returncode}); use more --steps")
    return done[-1]


def run_to_end(argv: list[str], log: Path, timeout: float) -> None:
    proc = start(argv, log)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise SystemExit(f"{log.stem} took over {timeout:.0f} s:\n{tail(log)}") from None
    if code != 0:
        raise SystemExit(f"{log.stem} failed (exit {code}):\n{tail(log)}")


def loss_diffs(full: Path, cut: Path) -> dict[str, float]:
    """The largest |full - cut| of every logged value over the steps (both runs must log every step)."""
    from wamkit.train.metrics import read_losses

    want, got = read_losses(full), read_losses(cut)
    steps = [r["step"] for r in want]
    if steps != [r["step"] for r in got] or not steps:
        raise SystemExit(f"logged steps differ: full {steps}, cut {[r['step'] for r in got]}")
    keys = [k for k in want[0] if k != "step"]
    return {k: max(abs(a[k] - b[k]) for a, b in zip(want, got)) for k in keys}


def weight_diffs(full: Path, cut: Path, work: Path) -> dict[str, float]:
    """The largest |full - cut| over the final checkpoints' model and EMA weights."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from wamkit.train.checkpoint import list_checkpoints

    final = {}
    for name, run in (("full", full), ("cut", cut)):
        dcp_to_torch_save(list_checkpoints(run / "checkpoints")[-1], work / f"{name}.pt")
        final[name] = torch.load(work / f"{name}.pt", weights_only=False)
    out = {}
    for part in ("model", "ema"):
        a, b = final["full"][part], final["cut"][part]
        if a.keys() != b.keys() or not a:
            raise SystemExit(f"the final checkpoints hold different {part} tensors")
        out[part] = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    return out


def serve_once(run_dir: Path, work: Path) -> list[int]:
    """``wamkit convert`` the run's last checkpoint, load it on the CPU, predict once: the action shape."""
    import numpy as np

    from wamkit.bench.serve import make_obs
    from wamkit.serve.loading import load_served

    serve_dir = work / "serve"
    done = subprocess.run(
        [sys.executable, "-m", "wamkit", "convert", str(run_dir), "--out", str(serve_dir)],
        env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"wamkit convert failed:\n{done.stderr[-3000:]}")
    policy = load_served(serve_dir, "cpu")
    actions = policy.infer(make_obs(policy.metadata()["inputs"], None))["actions"]
    if not np.isfinite(actions).all():
        raise SystemExit("the served model predicts non-finite actions")
    return list(actions.shape)


def check(args: argparse.Namespace, work: Path) -> dict:
    full, cut = work / "full", work / "cut"
    # after the first checkpoint, a checkpoint interval before the end (the kill must land mid-run)
    step = args.kill_step or random.randint(
        args.save_interval + 1, max(args.save_interval + 1, args.steps - args.save_interval)
    )
    t0 = time.monotonic()
    ref = start(train_argv(args, full), work / "full.log")
    victim = start(train_argv(args, cut), work / "cut.log")
    try:
        left = kill_at(victim, cut, step, args.steps, work / "cut.log", timeout=600)
    finally:
        if victim.poll() is None:
            kill_tree(victim)
    if ref.wait(timeout=600) != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{tail(work / 'full.log')}")
    run_to_end([*train_argv(args, cut), "--resume", "auto"], work / "resumed.log", timeout=600)
    resumed = next(line for line in (work / "resumed.log").read_text().splitlines() if "resumed from" in line)
    losses, weights = loss_diffs(full, cut), weight_diffs(full, cut, work)
    worst = max([*losses.values(), *weights.values()])
    return {
        "processes": args.processes, "device": args.device, "precision": args.precision,
        "steps": args.steps, "killed_at_step": step, "checkpoint_left": left, "resumed": resumed.split("resumed from ")[-1],
        "max_diff": {**{f"loss.{k}": v for k, v in losses.items()}, **{f"weights.{k}": v for k, v in weights.items()}},
        "max_abs_diff": worst, "tolerance": args.tolerance, "ok": worst <= args.tolerance,
        "served_action_shape": serve_once(cut, work), "seconds": round(time.monotonic() - t0, 1),
    }  # fmt: skip


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=False)
        result = check(args, Path(args.out))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = check(args, Path(tmp))
    print(f"{args.processes} process(es), {args.precision} on {args.device}: killed with SIGKILL at step "
          f"{result['killed_at_step']}, resumed from {result['resumed']}")  # fmt: skip
    for key, value in result["max_diff"].items():
        print(f"  max |full - resumed| {key:<16} {value:.3g}")
    verdict = "OK" if result["ok"] else "FAILED"
    print(f"max difference {result['max_abs_diff']:.3g}, tolerance {args.tolerance:.3g}: {verdict}; "
          f"served from the resumed run's checkpoint: actions {result['served_action_shape']}")  # fmt: skip
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
