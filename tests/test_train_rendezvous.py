"""Two torchrun "nodes" on one machine (c10d rendezvous, one process each, gloo) resume a checkpoint
that a one-process run wrote: DCP reshards the weights, optimizer state and EMA onto two ranks; the
step, the schedule and the lineage continue; the data order and RNG streams start afresh (per-rank state
exists only for the world size that wrote it; the trainer says so)."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.child_env import child_env, start_logged
from tests.exactness import assert_rounding_close
from tests.test_train_support import ToyAdapter, ToyLoader
from wamkit.config import DataConfig
from wamkit.constants import ACTION
from wamkit.train.metrics import read_losses

ARGS = [
    "train.max_steps=8", "train.micro_batch=2", "train.global_batch=4", "train.save_interval=4",
    "train.log_interval=1", "train.keep_last=5", "train.ema=true", "train.warmup_steps=2",
]  # fmt: skip
TRAIN = ["-m", "tests.test_train_support", *ARGS]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(rank: int, port: int, run: Path) -> subprocess.Popen:
    """Node ``rank``'s launcher, its log in ``node<rank>.log`` beside ``run`` (a pipe left unread while
    the other node is waited on could fill, and stall both in their collectives)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
        "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=wamkit_two_nodes",
        f"--node_rank={rank}", *TRAIN, f"train.run_dir={run}", "--resume", "auto",
    ]  # fmt: skip
    return start_logged(cmd, run.parent / f"node{rank}.log", env=child_env())


def _weights(step_dir: Path, out: Path) -> dict:
    dcp_to_torch_save(step_dir, out)
    return torch.load(out, weights_only=False)


def _first_step_loss(saved_model: dict) -> float:
    """Step 5 of a 2-process run from step 4's weights, computed here without the trainer: rank r's
    batch 0 and rank r's fresh loss noise (the seeds of wamkit.train.loop), averaged over the ranks."""
    toy = ToyAdapter()
    toy.module.load_state_dict(saved_model)
    losses = []
    for rank in (0, 1):
        torch.manual_seed(0 + 1_000_003 * (rank + 1))  # train.seed=0: the loop's per-rank noise seed
        batch = next(ToyLoader(2, DataConfig().seed, rank, 2))
        assert batch[ACTION].shape[0] == 2
        with torch.no_grad():
            losses.append(toy.sft_loss(batch)["loss"].item())
    return sum(losses) / 2


@pytest.mark.slow
def test_two_node_rendezvous_resumes_a_one_process_checkpoint(tmp_path):
    one = tmp_path / "one"
    first = subprocess.run(
        [sys.executable, *TRAIN, f"train.run_dir={one}"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "1 process(es)" in first.stderr and "= 2 x 1 x 2" in first.stderr  # accumulation 2 on one rank
    # two copies of the run as the one process left it at step 4
    nodes, alone = tmp_path / "nodes", tmp_path / "alone"
    for run in (nodes, alone):
        shutil.copytree(one, run)
        shutil.rmtree(run / "checkpoints" / "step_000008")

    port = _free_port()
    launchers = [_node(rank, port, nodes) for rank in (0, 1)]
    try:
        for p in launchers:
            p.wait(timeout=300)
    finally:
        for p in launchers:  # a failed or timed-out wait leaves no launcher running
            if p.poll() is None:
                p.kill()
                p.wait()
    errs = [(tmp_path / f"node{rank}.log").read_text() for rank in (0, 1)]
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(e[-2000:] for e in errs)
    log = "\n".join(errs)
    assert "2 process(es)" in log and "= 2 x 2 x 1" in log  # the same global batch, no accumulation
    assert "step_000004 at step 4" in log and "written by another number of processes" in log

    # the step counter and the schedule continue; steps 1-4 are the one-process run's own
    want, got = read_losses(one), read_losses(nodes)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert got[:4] == want[:4]
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    assert all(math.isfinite(r[k]) for r in got for k in r)
    # the weights loaded are the saved ones: step 5's loss is theirs on step 5's batches. Two process
    # layouts run other kernels (a batch of 2 per process, not 4, and the mean over ranks), so they
    # agree to the rounding of the toy's width-long sums, not to the bit (tests/exactness.py)
    saved = _weights(one / "checkpoints" / "step_000004", tmp_path / "saved.pt")
    assert_rounding_close(got[4]["loss"], _first_step_loss(saved["model"]), length=64)
    # and the continuation is sane: the same data distribution as the one-process run's steps 5-8
    mean = lambda rows: sum(r["loss"] for r in rows) / len(rows)  # noqa: E731
    assert abs(mean(got[4:]) - mean(want[4:])) < 0.25 * mean(want[4:])

    # two nodes are one 2-process job: a standalone 2-process resume logs and saves the same
    solo = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *TRAIN,
         f"train.run_dir={alone}", "--resume", "auto"],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert solo.returncode == 0, solo.stderr[-3000:]
    assert read_losses(alone) == got
    a = _weights(nodes / "checkpoints" / "step_000008", tmp_path / "a.pt")
    b = _weights(alone / "checkpoints" / "step_000008", tmp_path / "b.pt")
    for part in ("model", "ema", "optim"):
        assert a[part].keys() == b[part].keys(), part
    for part in ("model", "ema"):  # the EMA holds the trained weights only
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"
    # a frozen weight went 1 shard -> 2 shards -> saved again, untouched
    assert torch.equal(a["model"]["frozen.weight"], saved["model"]["frozen.weight"])
