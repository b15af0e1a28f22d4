"""LoRA over an int8 base on one GPU (docs/cosmos3.md "An int8 base"; maintainers, not a test).

    carry .whl/serve .whl/av .whl/ao:  source maintainers/gpu_env.sh && python3 maintainers/gpu_lora_int8.py

``run PRESET BASE``: the trainer (``wamkit train``'s loop) on the LIBERO fixture in bf16, rank 16, 12 steps:
its losses. ``memory PRESET BASE``: the preset built on the GPU in bf16 with rank-16 adapters, three
AdamW steps on one fixture batch: the GPU memory the weights take, the peak and the step time. Without
arguments, each of these for bf16 and int8 in its own process (a clean peak), one JSON line each.
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


def run(preset: str, base: str) -> dict:
    from wamkit.config import load_config
    from wamkit.train.loop import train
    from wamkit.train.metrics import read_losses

    out = Path(tempfile.mkdtemp()) / "run"
    cfg = load_config(
        ROOT / "configs" / "libero_10_cosmos3.yaml",
        [
            f"model.preset={preset}", "model.pretrained=", f"data.root={ROOT}/tests/fixtures/libero_tiny",
            "data.num_workers=0", "train.max_steps=12", "train.micro_batch=2", "train.global_batch=2",
            "train.precision=bf16", "train.device=cuda", "train.compile=false", "train.warmup_steps=0",
            "train.lr=0.002", "train.save_interval=12", "train.log_interval=1", "train.lora.rank=16",
            f"train.lora.base={base}", f"train.run_dir={out}",
        ],
    )  # fmt: skip
    t0 = time.perf_counter()
    train(cfg)
    losses = [round(r["loss"], 5) for r in read_losses(out)]
    return {
        "what": "run",
        "preset": preset,
        "base": base,
        "losses": losses,
        "wall_s": time.perf_counter() - t0,
    }


def memory(preset: str, base: str) -> dict:
    from tests.test_cosmos3_train import IO, fixture_batch

    from wamkit.config import LoraConfig, ModelConfig
    from wamkit.models import build_model
    from wamkit.models.cosmos3.latents import LATENTS
    from wamkit.train import lora

    dev = torch.device("cuda")
    torch.manual_seed(0)
    opts = {"caption_dropout": 0.0, "dtype": "bfloat16", "gradient_checkpointing": True}
    adapter = build_model(ModelConfig(name="cosmos3", preset=preset, options=opts), IO, device=dev)
    spec = lora.resolve(LoraConfig(rank=16, base=base), adapter)
    applied = lora.inject(adapter, spec)
    lora.quantize_base(adapter.module, spec)
    for g in applied.groups:  # trained in fp32, as the trainer keeps its masters
        for p in g.params:
            p.data = p.data.float()
    torch.cuda.synchronize()
    weights_gib = torch.cuda.memory_allocated(dev) / 2**30
    adapted = sum(
        lora.stored_bytes(adapter.module.get_submodule(t).get_base_layer().weight) for t in spec.targets
    )
    batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in fixture_batch([90, 91]).items()}
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        batch[LATENTS] = adapter.encode_clips(batch)
    opt = torch.optim.AdamW([p for g in applied.groups for p in g.params], lr=1e-3)
    torch.cuda.reset_peak_memory_stats(dev)
    losses, times = [], []
    for step in range(3):
        torch.manual_seed(step)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            loss = adapter.sft_loss(batch)["loss"]
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(round(float(loss), 5))
    return {
        "what": "memory", "preset": preset, "base": base, "adapted_gib": adapted / 2**30,
        "weights_gib": weights_gib, "peak_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
        "step_s": times, "losses": losses,
    }  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1:
        kind, preset, base = sys.argv[1:4]
        print(json.dumps({"run": run, "memory": memory}[kind](preset, base)), flush=True)
        sys.exit(0)
    for kind, preset in (("run", "tiny"), ("memory", "nano_l8")):
        for base in ("bf16", "int8"):
            done = subprocess.run(
                [sys.executable, __file__, kind, preset, base], capture_output=True, text=True
            )
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else f"{kind} {preset} {base} failed: {done.stderr[-2500:]}", flush=True)
