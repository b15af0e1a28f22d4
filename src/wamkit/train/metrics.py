"""What a user sees of a run: TensorBoard scalars, a per-step loss JSONL, a progress bar.

Everything here runs on rank 0 only. Per-step values arrive in batches at log intervals (the trainer
keeps them on the device in between, so logging never stalls the GPU each step).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wamkit.files import LOSSES_FILE, append_jsonl, read_jsonl, rewrite_jsonl
from wamkit.log import progress_bar

LOSSES_JSONL = LOSSES_FILE


def truncate_losses(run_dir: str | os.PathLike, last_step: int) -> None:
    """Keep the JSONL records of steps <= ``last_step`` (a resumed run rewrites the rest).

    A line cut short by a kill is dropped, so the file again reads as one uninterrupted run.
    """
    path = Path(run_dir) / LOSSES_JSONL
    if path.is_file():
        keep = [r for r in read_jsonl(path) if r.get("step", last_step + 1) <= last_step]
        rewrite_jsonl(path, keep)


def read_losses(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-step records of a run: ``[{"step": 1, "loss": ..., <named parts>...}, ...]``."""
    path = Path(run_dir) / LOSSES_JSONL
    return read_jsonl(path)


class RunLogger:
    """TensorBoard writer + losses.jsonl + a progress bar, for rank 0; ``last`` holds the records of the
    last log interval (the run's summary averages them)."""

    def __init__(self, run_dir: Path, start_step: int, max_steps: int, enabled: bool):
        self.enabled = enabled
        self.last: list[dict[str, float]] = []
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(run_dir / "tb"))
        self.jsonl = open(run_dir / LOSSES_JSONL, "a")  # noqa: SIM115 (closed in close())
        self.bar = progress_bar(total=max_steps, initial=start_step, desc="train", unit="step")

    def steps(self, records: list[dict[str, float]]) -> None:
        """One record per optimizer step: ``step`` and the named losses (already averaged over ranks)."""
        if not self.enabled:
            return
        for rec in records:
            append_jsonl(self.jsonl, rec)
            for k, v in rec.items():
                if k != "step":
                    self.tb.add_scalar(f"train/{k}", v, rec["step"])
        if records:
            self.last = list(records)
            self.bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", refresh=False)
            self.bar.update(len(records))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.enabled:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.enabled:
            self.tb.flush()
            self.tb.close()
            self.jsonl.close()
            self.bar.close()
