"""Cosmos3 SFT throughput (``wamkit bench cosmos3 --sft``): samples/s and MFU of the adapter's
``sft_loss`` + AdamW on one device, end to end and without the Wan-VAE encoding of the 17-frame clips.

The default preset ``nano_l8`` (Nano width, 8 layers; 4.35B parameters, 1.57B trained) fits one H200
unsharded: fp32 master weights, bf16 autocast on CUDA. MFU is against the H200's dense bf16 peak.
"""

from __future__ import annotations

import time
from typing import Any

import torch

PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16


def _timed(fn, device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def bench_sft(args, device: torch.device) -> dict[str, Any]:
    """Measure and print one SFT row; ``args``: sft_preset, sft_batch, sft_steps, image_size."""
    import dataclasses

    import numpy as np

    from wamkit.bench.cosmos3 import make_batch
    from wamkit.config import ModelConfig
    from wamkit.constants import ACTION, ACTION_IS_PAD
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import DEFAULT_IO

    io = dataclasses.replace(DEFAULT_IO, image_size=args.image_size)
    ad = build_model(ModelConfig(name="cosmos3", preset=args.sft_preset), io, device=device)
    groups = [g for g in ad.param_groups() if g.params]
    opt = torch.optim.AdamW(
        [
            {"params": g.params, "lr": 1e-5 * g.lr_mult, "weight_decay": 0.01 if g.weight_decay else 0.0}
            for g in groups
        ],
        fused=device.type == "cuda",
    )
    b = args.sft_batch
    batch = make_batch(io, b)
    rng = np.random.default_rng(0)
    batch[ACTION] = torch.from_numpy(rng.uniform(-1, 1, (b, io.chunk, io.action_dim)).astype(np.float32))
    batch[ACTION_IS_PAD] = torch.zeros(b, io.chunk, dtype=torch.bool)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = ad.sft_loss(batch)["loss"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    s = _timed(step, device, args.sft_steps)
    views = ad._views(batch)
    enc = _timed(lambda: ad._encode([[v] * (io.chunk + 1) for v in views]), device, 2)
    model_s = s - enc if s > enc else float("nan")  # the transformer's share of a step
    fps = ad.flops_per_sample()
    row = dict(
        preset=args.sft_preset,
        params=sum(p.numel() for p in ad.module.parameters()),
        trainable=sum(p.numel() for g in groups for p in g.params),
        batch=b,
        step_s=s,
        samples_per_s=b / s,
        vae_encode_s=enc,
        samples_per_s_without_vae=b / model_s,
        mfu=fps * b / model_s / PEAK_BF16,
        mfu_end_to_end=fps * b / s / PEAK_BF16,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    )
    print(
        f"sft {args.sft_preset} ({row['params'] / 1e9:.2f}B params, {row['trainable'] / 1e9:.2f}B trained), "
        f"batch {b}: {s * 1e3:.0f} ms/step = {b / s:.2f} samples/s end to end; VAE encode {enc * 1e3:.0f} ms "
        f"of it; without it {row['samples_per_s_without_vae']:.2f} samples/s, MFU {row['mfu'] * 100:.1f}% "
        f"(end to end {row['mfu_end_to_end'] * 100:.1f}%)",
        flush=True,
    )
    return row
