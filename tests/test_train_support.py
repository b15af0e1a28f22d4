"""A small adapter and a resumable synthetic loader for the trainer tests (no tests of its own).

Run as a script it is ``wamkit train`` with these two plugged in, so a subprocess can be killed and
resumed: ``python -m tests.test_train_support [overrides] [--resume auto]``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, image_key
from wamkit.models.base import ModelIO, ParamGroup

IO = ModelIO(cameras=("corner",), image_size=8, state_dim=6, action_dim=3, chunk=4)


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class ToyNet(torch.nn.Module):
    def __init__(self, io: ModelIO, width: int = 32, depth: int = 2):
        super().__init__()
        self.inp = torch.nn.Linear(io.state_dim, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, io.chunk * io.action_dim)
        self.frozen = torch.nn.Linear(width, width)  # never trained: must stay bit-identical


class ToyAdapter:
    """Implements the ModelAdapter protocol; the loss draws torch noise so RNG state matters."""

    name = "toy"
    future_frame_offsets: tuple[int, ...] = ()
    supports_rtc = False

    def __init__(self, io: ModelIO = IO, width: int = 32, depth: int = 2):
        self.io, self.width, self.depth = io, width, depth
        self.module = ToyNet(io, width, depth)

    def blocks(self):
        return list(self.module.blocks)

    def param_groups(self):
        m = self.module
        decay = [m.inp.weight, *[b.fc.weight for b in m.blocks]]
        no_decay = [m.inp.bias, *[p for b in m.blocks for p in (b.fc.bias, *b.norm.parameters())]]
        return [
            ParamGroup("body", decay),
            ParamGroup("body_no_decay", no_decay, weight_decay=False),
            ParamGroup("head", list(m.head.parameters()), lr_mult=5.0),
        ]

    def sft_loss(self, batch):
        m = self.module
        x = batch[OBS_STATE] + 0.01 * torch.randn_like(batch[OBS_STATE])
        h = m.inp(x)
        for b in m.blocks:
            h = b(h)
        pred = m.head(h).view(-1, self.io.chunk, self.io.action_dim)
        mse = (pred - batch[ACTION]).pow(2).mean()
        l1 = (pred - batch[ACTION]).abs().mean()
        return {"loss": mse + 0.1 * l1, "mse": mse, "l1": l1}

    def config_dict(self):
        options = {"width": self.width, "depth": self.depth}
        return {"name": "toy", "preset": "default", "options": options, "io": self.io.to_dict()}

    def flops_per_sample(self):
        return 6.0 * sum(p.numel() for p in self.module.parameters())


class ToyLoader:
    """Endless batches; batch ``k`` of rank ``r`` is a pure function of ``(seed, r, k)``."""

    def __init__(self, batch_size: int, seed: int, rank: int, world: int, io: ModelIO = IO):
        self.b, self.seed, self.rank, self.io = batch_size, seed, rank, io
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        g = np.random.default_rng([self.seed, self.rank, self.pos])
        self.pos += 1
        state = g.standard_normal((self.b, self.io.state_dim)).astype(np.float32)
        action = np.tanh(state[:, : self.io.action_dim, None].repeat(self.io.chunk, 2)).transpose(0, 2, 1)
        batch = {
            OBS_STATE: torch.from_numpy(state),
            ACTION: torch.from_numpy(action.copy()),
            TASK: ["t"] * self.b,
        }
        batch[ACTION_IS_PAD] = torch.zeros(self.b, self.io.chunk, dtype=torch.bool)
        for cam in self.io.cameras:
            shape = (self.b, self.io.image_size, self.io.image_size, 3)
            batch[image_key(cam)] = torch.from_numpy(g.integers(0, 256, shape, dtype=np.uint8))
        return batch

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def toy_adapter(cfg, io):
    return ToyAdapter(io)


def build_toy(cfg, io, **kwargs):
    """A registry builder: ``register_model("toy", build_toy)`` lets export rebuild the toy."""
    return ToyAdapter(io or IO, **cfg.options)


TINY_IO = ModelIO(cameras=("corner",), image_size=64, state_dim=6, action_dim=3, chunk=4)


def toy_data(cfg, rank, world, run_dir: Path, io: ModelIO = IO):
    from wamkit.serve.loading import identity_spec

    path = run_dir / "preprocess.json"
    if rank == 0:
        identity_spec(io).save(path)
    return io, path, lambda *_: ToyLoader(cfg.train.micro_batch, cfg.data.seed, rank, world, io)


def tiny_data(cfg, rank, world, run_dir: Path):
    """Synthetic batches shaped for the built-in ``tiny`` model (64 px images)."""
    return toy_data(cfg, rank, world, run_dir, TINY_IO)


def kill_at_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float, log: Path) -> None:
    """SIGKILL a training process once ``run_dir/losses.jsonl`` has ``step`` lines (fails if it exits
    first, showing the end of its stderr ``log``, or if the kill lands after the run ended)."""
    losses = run_dir / "losses.jsonl"
    deadline = time.monotonic() + timeout_s
    while not (losses.is_file() and len(losses.read_text().splitlines()) >= step):
        assert proc.poll() is None, f"training exited early: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "training did not reach the kill step in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"kill at step {step} came too late"


def killed_and_resumed(
    cmd: Callable[[Path], list[str]], full: Path, cut: Path, kill_at: int, timeout_s: float = 300
) -> str:
    """Start ``cmd(full)`` and ``cmd(cut)`` together, SIGKILL the second once it has logged ``kill_at``
    steps (:func:`kill_at_step`), let the first finish, and resume the second with ``--resume auto``;
    both must exit 0. Returns the resumed run's stderr. The caller compares what the two runs left.
    The two first runs write their stderr to files beside their folders (``<folder>.stderr``): a pipe
    nobody reads while they train would block a run whose log outgrew the pipe's buffer."""
    from tests.child_env import child_env

    logs = [run.with_name(run.name + ".stderr") for run in (full, cut)]
    with logs[0].open("w") as ref_err, logs[1].open("w") as cut_err:
        ref = subprocess.Popen(cmd(full), env=child_env(), stdout=subprocess.DEVNULL, stderr=ref_err)
        proc = subprocess.Popen(cmd(cut), env=child_env(), stdout=subprocess.DEVNULL, stderr=cut_err)
        try:
            kill_at_step(proc, cut, kill_at, timeout_s, logs[1])
            assert ref.wait(timeout=timeout_s) == 0, logs[0].read_text()[-3000:]
        finally:
            for p in (ref, proc):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    done = subprocess.run(
        [*cmd(cut), "--resume", "auto"], env=child_env(), capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def main(argv: list[str]) -> int:
    import argparse

    from wamkit.log import setup_logging
    from wamkit.train.cli_train import add_arguments, load_train_config
    from wamkit.train.loop import train

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    setup_logging("info")
    parser.add_argument("--tiny", action="store_true", help="train the registry's tiny model, not the toy")
    args = parser.parse_args(argv)
    cfg = load_train_config(args)
    train(cfg, None if args.tiny else toy_adapter, tiny_data if args.tiny else toy_data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
