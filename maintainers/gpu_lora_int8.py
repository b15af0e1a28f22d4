"""LoRA over an int8 base on one GPU (docs/cosmos3.md "An int8 base"; maintainers, not a test).

    carry .whl/serve .whl/av .whl/ao:  source maintainers/gpu_env.sh && python3 maintainers/gpu_lora_int8.py

``PRESET BASE STEPS``: the trainer (``wamkit train``'s loop, FSDP2's bf16 compute over fp32 adapters and
heads) on the LIBERO fixture, rank 16, micro-batch 2: its losses, wall time and the peak GPU memory the
process allocated. Without arguments: tiny over 12 steps and nano_l8 over 4, each for a bf16 and an int8
base in its own process (a clean peak), one JSON line each. An int8 base of a random preset other than
tiny is refused by the trainer (its checkpoints would hold the quantized weights), so nano_l8 reads a
random-weight diffusers folder written first (``export PRESET FOLDER``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(preset: str, base: str, steps: str = "12", pretrained: str = "") -> dict:
    from wamkit.config import load_config
    from wamkit.train.loop import train
    from wamkit.train.metrics import read_losses

    out = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(
        ROOT / "configs" / "libero_10_cosmos3.yaml",
        [
            f"model.preset={preset}", f"model.pretrained={pretrained}", f"data.root={ROOT}/tests/fixtures/libero_tiny",
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
        "what": "run", "preset": preset, "base": base, "pretrained": bool(pretrained), "losses": losses,
        "wall_s": time.perf_counter() - t0,
        # the trainer's own path (FSDP2's bf16 compute over fp32 adapters and heads), one process
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip


def random_base(preset: str, folder: Path) -> str:
    """A random-weight diffusers folder of ``preset``: an int8 base is refused for a random preset other
    than tiny (its checkpoints would hold the quantized weights), so the run reads one from disk."""
    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.models.cosmos3.components import export_diffusers

    export_diffusers(build_model(ModelConfig(name="cosmos3", preset=preset), None, device="cuda"), folder)
    return str(folder)


if __name__ == "__main__":
    if sys.argv[1:2] == ["export"]:
        random_base(sys.argv[2], Path(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) > 1:
        preset, base, steps = sys.argv[1:4]
        print(json.dumps(run(preset, base, steps, *sys.argv[4:5])), flush=True)
        sys.exit(0)
    # one JSON line each, also in $OUT/lora_int8.jsonl (what a device call returns)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp())
    with tempfile.TemporaryDirectory() as tmp:
        folder = ""
        for preset, steps in (("tiny", "12"), ("nano_l8", "4")):
            if preset != "tiny":  # its export in a process of its own, so the runs' peaks are clean
                folder = str(Path(tmp) / preset)
                subprocess.run([sys.executable, __file__, "export", preset, folder], check=True)
            for base in ("bf16", "int8"):
                done = subprocess.run(
                    [sys.executable, __file__, preset, base, steps, folder], capture_output=True, text=True
                )
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                line = (
                    lines[-1]
                    if lines
                    else json.dumps({"preset": preset, "base": base, "failed": done.stderr[-2500:]})
                )
                print(line, flush=True)
                with open(out / "lora_int8.jsonl", "a") as f:
                    f.write(line + "\n")
