"""THE trainer test: a run killed with SIGKILL at a random step and resumed with ``--resume auto``
logs exactly the losses of an uninterrupted run, step by step. Real CLI, real data, real model.
Plus the 2-process FSDP2 run (torchrun, gloo): sharded checkpoints, exact resume, export."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.child_env import child_env, start_logged
from tests.conftest import REPO
from tests.test_train_support import build_toy, killed_and_resumed
from wamkit.export import checkpoint_to_serving
from wamkit.models import register_model
from wamkit.train.metrics import read_losses


def _train_cmd(run_dir: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "wamkit", "train", *args, f"train.run_dir={run_dir}"]


def test_sigkill_at_random_step_then_resume_auto_gives_identical_losses(tmp_path, libero_tiny):
    args = [
        f"data.root={libero_tiny}",
        "data.representation=libero_rot6d",
        "data.num_workers=1",
        "model.options.width=64",
        "model.options.depth=2",
        "model.options.heads=2",
        "train.max_steps=12",
        "train.micro_batch=2",
        "train.global_batch=4",  # 2 accumulation steps
        "train.save_interval=4",
        "train.log_interval=1",
        "train.warmup_steps=3",
        "train.ema=true",
        "train.keep_last=2",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    # both runs start together (2 cores); each computes the same stats file
    kill_at = random.randint(5, 11)  # after the first checkpoint (step 4), before the end
    err = killed_and_resumed(lambda run: _train_cmd(run, args), full, cut, kill_at)
    assert "resumed from" in err, err[-3000:]

    want, got = read_losses(full), read_losses(cut)
    assert [r["step"] for r in want] == list(range(1, 13))
    assert [r["step"] for r in got] == list(range(1, 13)), f"killed at step {kill_at}"
    for a, b in zip(want, got):
        assert a == b, f"killed at step {kill_at}: step {a['step']} differs: {a} != {b}"
    ckpts = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert ckpts == ["step_000008", "step_000012"]  # keep_last=2, no temp dirs left
    # the final weights and their EMA are those of the uninterrupted run, bit for bit
    final = {}
    for name, run in (("full", full), ("cut", cut)):
        dcp_to_torch_save(run / "checkpoints" / "step_000012", tmp_path / f"{name}.pt")
        final[name] = torch.load(tmp_path / f"{name}.pt", weights_only=False)
    for part in ("model", "ema"):
        a, b = final["full"][part], final["cut"][part]
        assert a.keys() == b.keys() and a, part
        for k in a:
            assert torch.equal(a[k], b[k]), f"killed at step {kill_at}: {part}.{k} differs"


def test_two_process_fsdp2_checkpoints_shard_resume_exactly_and_export(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.test_train_support", f"train.run_dir={run}", "train.max_steps=6", "train.micro_batch=2",
        "train.global_batch=8", "train.save_interval=3", "train.log_interval=3", "train.keep_last=5",
        "train.ema=true",
    ]  # fmt: skip
    first = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 process(es)" in first.stderr and "= 2 x 2 x 2" in first.stderr  # accumulation 2
    step6 = run / "checkpoints" / "step_000006"
    assert sorted(p.name for p in step6.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(p.name for p in step6.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]

    # export the 2-shard checkpoint in this one process; compare with torch's own DCP reader
    register_model("toy", build_toy)
    serve = checkpoint_to_serving(step6, tmp_path / "serve")
    dcp_to_torch_save(step6, tmp_path / "full.pt")
    ref = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    exported = load_file(serve / "model.safetensors")
    assert set(exported) == set(ref)
    for k, v in ref.items():
        assert torch.equal(exported[k], v), k
    assert json.loads((serve / "preprocess.json").read_text()) == json.loads(
        (step6 / "preprocess.json").read_text()
    )

    # resume under 2 processes from step 3: the same losses as the uninterrupted run
    want = read_losses(run)
    shutil.rmtree(step6)
    again = subprocess.run(
        [*cmd, "--resume", "auto"], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step_000003" in again.stderr
    got = read_losses(run)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert got == want


@pytest.mark.slow  # two processes killed and resumed (25 s); the one-process resume is the fast check
def test_two_process_sigkill_mid_run_then_resume_auto_is_exact_and_serves(tmp_path):
    """scripts/resume_check.py, the check a GPU machine runs over NCCL, here on 2 CPU processes (gloo):
    the whole torchrun tree is killed after a random step past the first checkpoint; the resumed run
    logs the uninterrupted run's losses and ends with its weights and EMA, bit for bit; its checkpoint
    converts (``wamkit convert``) and predicts on the CPU."""
    cmd = [
        sys.executable, str(REPO / "scripts" / "resume_check.py"), "--processes", "2", "--device", "cpu",
        "--steps", "12", "--save-interval", "4", "--out", str(tmp_path / "check"),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["ok"] and result["tolerance"] == 0.0
    assert set(result["max_diff"]) >= {"loss.loss", "loss.grad_norm", "weights.model", "weights.ema"}
    assert all(v == 0.0 for v in result["max_diff"].values()), result["max_diff"]
    assert 5 <= result["killed_at_step"] <= 8 and result["checkpoint_left"] in ("step_000004", "step_000008")
    assert result["resumed"].startswith(
        str(tmp_path / "check" / "cut" / "checkpoints" / result["checkpoint_left"])
    )
    assert result["served_action_shape"][0] > 0


@pytest.mark.slow
def test_sigkill_while_an_async_save_is_writing_resumes_exactly(tmp_path, libero_tiny):
    """``train.async_save``: the shards of step N are written while step N+1's micro-batches run; a
    SIGKILL in that window leaves ``.tmp_step_N`` without its marker, and ``--resume auto`` continues
    from step N-1's checkpoint with the losses of an uninterrupted run."""
    args = [
        f"data.root={libero_tiny}", "data.representation=libero_rot6d", "data.num_workers=1",
        "model.options.width=64", "model.options.depth=2", "model.options.heads=2",
        "train.max_steps=10", "train.micro_batch=2", "train.global_batch=8", "train.save_interval=1",
        "train.log_interval=1", "train.warmup_steps=3", "train.ema=true", "train.keep_last=3",
        "train.async_save=true",
    ]  # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    # the two runs log to files: their stderr is not read while they train (a pipe could fill)
    logs = tmp_path / "full.log", tmp_path / "cut.log"
    ref = start_logged(_train_cmd(full, args), logs[0], env=child_env())
    proc = start_logged(_train_cmd(cut, args), logs[1], env=child_env())
    root, caught = cut / "checkpoints", None
    try:
        deadline = time.monotonic() + 240
        while caught is None:
            assert proc.poll() is None, (
                f"training ended before a save could be caught: {logs[1].read_text()[-2000:]}"
            )
            assert time.monotonic() < deadline, "no save in flight was seen in time"
            names = os.listdir(root) if root.is_dir() else []
            flying = [n for n in names if n.startswith(".tmp_step_") and int(n[-6:]) >= 3]
            if flying and not (root / flying[0] / "meta.json").exists():
                proc.send_signal(signal.SIGKILL)
                caught = int(flying[0][-6:])
            time.sleep(0.001)
        proc.wait()
        assert ref.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
    finally:
        for p in (ref, proc):  # a failed assertion leaves no trainer running
            if p.poll() is None:
                p.kill()
                p.wait()
    assert (root / f".tmp_step_{caught:06d}").is_dir() and not (root / f"step_{caught:06d}").exists()
    done = subprocess.run(
        [*_train_cmd(cut, args), "--resume", "auto"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {root / f'step_{caught - 1:06d}'}" in done.stderr, done.stderr[-3000:]
    assert "shards written in" in done.stderr  # the async path ran
    assert read_losses(cut) == read_losses(full), f"killed while step {caught} was being saved"
    assert not any(n.startswith(".tmp_") for n in os.listdir(root))
