"""LoRA over an int8 base on one GPU (docs/cosmos3.md "An int8 base"; maintainers, not a test).

    carry .whl/serve .whl/av .whl/ao:  source maintainers/gpu_env.sh && python3 maintainers/gpu_lora_int8.py

``PRESET BASE STEPS``: the trainer (``wamkit train``'s loop, FSDP2's bf16 compute over fp32 adapters and
heads) on the LIBERO fixture, rank 16, micro-batch 2: its losses, wall time and the peak GPU memory the
process allocated. Without arguments: tiny over 12 steps and nano_l8 over 4, each for a bf16 and an int8
base in its own process (a clean peak), one JSON line each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(preset: str, base: str, steps: str = "12") -> dict:
    from wamkit.config import load_config
    from wamkit.train.loop import train
    from wamkit.train.metrics import read_losses

    out = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(
        ROOT / "configs" / "libero_10_cosmos3.yaml",
        [
            f"model.preset={preset}", "model.pretrained=", f"data.root={ROOT}/tests/fixtures/libero_tiny",
            "data.num_workers=0", f"train.max_steps={steps}", "train.micro_batch=2", "train.global_batch=2",
            "train.precision=bf16", "train.device=cuda", "train.compile=false", "train.warmup_steps=0",
            "train.lr=0.002", f"train.save_interval={steps}", "train.log_interval=1", "train.lora.rank=16",
            f"train.lora.base={base}", f"train.run_dir={out}",
        ],
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(cfg)
    losses = [round(r["loss"], 5) for r in read_losses(out)]
    return {
        "what": "run", "preset": preset, "base": base, "losses": losses,
        "wall_s": time.perf_counter() - t0,
        # the trainer's own path (FSDP2's bf16 compute over fp32 adapters and heads), one process
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1:
        preset, base, steps = sys.argv[1:4]
        print(json.dumps(run(preset, base, steps)), flush=True)
        sys.exit(0)
    for preset, steps in (("tiny", "12"), ("nano_l8", "4")):
        for base in ("bf16", "int8"):
            done = subprocess.run(
                [sys.executable, __file__, preset, base, steps], capture_output=True, text=True
            )
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else f"{preset} {base} failed: {done.stderr[-2500:]}", flush=True)
