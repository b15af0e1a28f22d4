"""GPU benchmark of the cosmos3 adapter: ``python -m wamkit.models.cosmos3.bench_gpu [--json FILE]``.

1. Policy inference with the Nano-shaped model (36 layers, hidden 4096; random weights, bf16) on
   LIBERO-sized requests (two 256x256 views, a LIBERO-10 task, chunk 16): latency and obs/s at batch
   1 / 8 / 32, 30 denoising steps, each batch in one transformer call per step; packed attention by
   block mask and by per-request loop, side by side; the per-step time and achieved TFLOP/s.
2. SFT with ``nano_l8`` (Nano width, 8 layers; fp32 master weights, bf16 autocast, AdamW): samples/s
   end to end and without the Wan-VAE encoding of the 17-frame clips, and MFU against the H200's
   989 TFLOP/s dense bf16 peak.
3. Batch 1 with the decoder layers compiled (``compile_repeated_blocks``), default mode and
   ``reduce-overhead`` (CUDA graphs), against eager.

Figures print as they are measured; the run stops at ``--budget-s`` (default 420 s) before starting a
part it cannot finish. Needs one GPU with >= 80 GB.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any

import numpy as np
import torch

PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16
TASKS = [
    "put both the alphabet soup and the tomato sauce in the basket",
    "turn on the stove and put the moka pot on it",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "pick up the book and place it in the back compartment of the caddy",
]


def log(msg: str) -> None:
    print(msg, flush=True)


def make_batch(io, b: int, seed: int = 0) -> dict[str, Any]:
    from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, image_key

    rng = np.random.default_rng(seed)
    s = io.image_size
    batch: dict[str, Any] = {
        image_key(c): torch.from_numpy(rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8)) for c in io.cameras
    }
    batch[OBS_STATE] = torch.zeros(b, io.state_dim)
    batch[TASK] = [TASKS[i % len(TASKS)] for i in range(b)]
    batch[ACTION] = torch.from_numpy(rng.uniform(-1, 1, (b, io.chunk, io.action_dim)).astype(np.float32))
    batch[ACTION_IS_PAD] = torch.zeros(b, io.chunk, dtype=torch.bool)
    return batch


def mem_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def step_flops(adapter, layout) -> float:
    """Forward FLOPs of one denoising step over a packed layout (all requests)."""
    from wamkit.models.cosmos3.towers import forward_flops

    total = 0.0
    for (us, ue), (gs, ge) in zip(layout.und_bounds, layout.gen_bounds):
        total += sum(forward_flops(adapter.module, ue - us, ge - gs))
    return total


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 1) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def bench_inference(args, results: dict, deadline: float) -> Any:
    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import DEFAULT_IO

    t0 = time.perf_counter()
    opts = {"dtype": "bfloat16", "num_inference_steps": args.steps}
    ad = build_model(
        ModelConfig(name="cosmos3", preset=args.preset, options=opts), DEFAULT_IO, device=args.device
    )
    n_params = sum(p.numel() for p in ad.module.parameters())
    log(
        f"[build] {args.preset}: {n_params / 1e9:.2f}B parameters, {mem_gib():.1f} GiB, "
        f"built in {time.perf_counter() - t0:.1f} s"
    )
    results["nano_params"] = n_params
    rows = []
    for b in args.batches:
        batch = make_batch(DEFAULT_IO, b)
        for mode in ("stock",) if b == 1 else ("mask", "loop"):
            if time.perf_counter() > deadline:
                log(f"[infer] batch {b} {mode}: skipped (time budget)")
                continue
            ad.processor.mode = "mask" if mode == "stock" else mode
            ad.options["num_inference_steps"] = 2
            ad.predict(batch, seed=0)  # warm-up: kernels, allocator, caches
            ad.options["num_inference_steps"] = args.steps
            latency = timed(lambda batch=batch: ad.predict(batch, seed=0))
            step_s, flops = step_time(ad, batch)
            row = dict(
                batch=b,
                attention=mode,
                latency_s=latency,
                obs_per_s=b / latency,
                step_ms=step_s * 1e3,
                tokens=flops[1],
                tflops=flops[0] / step_s / 1e12,
            )
            rows.append(row)
            log(
                f"[infer] batch {b:>2} {mode:<5} {flops[1]:>6} tokens: {latency * 1e3:8.0f} ms/predict "
                f"({args.steps} steps), {b / latency:6.2f} obs/s, {step_s * 1e3:7.1f} ms/step, "
                f"{flops[0] / step_s / 1e12:6.0f} TFLOP/s"
            )
    base = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        if base:
            r["obs_per_s_vs_batch1"] = r["obs_per_s"] / base["obs_per_s"]
            log(
                f"[infer] batch {r['batch']} {r['attention']}: {r['obs_per_s_vs_batch1']:.2f}x the obs/s of batch 1"
            )
    results["inference"] = rows
    return ad


def step_time(ad, batch) -> tuple[float, tuple[float, int]]:
    """Seconds of one denoising step (the transformer call alone), its FLOPs and token count."""
    views = ad._views(batch)
    x0 = ad._encode([[v] for v in views])
    c, _, h, w = x0.shape[1:]
    t_lat = ad._latent_frames()
    hw = ad._canvas_hw(views[0])
    texts = [ad.prompt(t, hw, 0) for t in batch["task"]]  # the captions predict() sends
    layout = ad._layout(texts, hw, (c, t_lat, h, w), (0,), ())
    n = layout.n
    dev = ad.device
    lat_v = torch.randn(n, c, t_lat, h, w, device=dev)
    lat_a = torch.randn(n, ad.io.chunk, ad.io.action_dim, device=dev)
    t_v = torch.full((sum(layout.num_noisy_vision_tokens),), 500.0, device=dev)
    t_a = torch.full((sum(layout.num_noisy_action_tokens),), 500.0, device=dev)
    with torch.no_grad():
        ad._run(layout, lat_v, t_v, lat_a, t_a)
        s = timed(lambda: ad._run(layout, lat_v, t_v, lat_a, t_a), repeats=5)
    return s, (step_flops(ad, layout), layout.sequence_length)


def bench_compile(ad, args, results: dict, deadline: float) -> None:
    batch = make_batch(ad.io, 1)
    eager = next((r for r in results.get("inference", []) if r["batch"] == 1), None)
    out = []
    for mode in ("default", "reduce-overhead"):
        if time.perf_counter() > deadline:
            log(f"[compile] {mode}: skipped (time budget)")
            continue
        try:
            ad.module.compile_repeated_blocks(mode=mode, dynamic=False)
            t0 = time.perf_counter()
            ad.options["num_inference_steps"] = 3
            ad.predict(batch, seed=0)  # compiles (and records graphs)
            ad.predict(batch, seed=0)
            warm = time.perf_counter() - t0
            ad.options["num_inference_steps"] = args.steps
            latency = timed(lambda: ad.predict(batch, seed=0))
            step_s, _ = step_time(ad, batch)
        except Exception as err:  # a compiler failure is a result to report, not a crash of the benchmark
            log(f"[compile] {mode}: failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
            out.append(dict(mode=mode, error=f"{type(err).__name__}: {err}"[:1000]))
            continue
        row = dict(mode=mode, latency_s=latency, obs_per_s=1 / latency, step_ms=step_s * 1e3, compile_s=warm)
        if eager:
            row["speedup_vs_eager"] = eager["latency_s"] / latency
        out.append(row)
        log(
            f"[compile] batch 1 {mode:<15}: {latency * 1e3:8.0f} ms/predict, {1 / latency:5.2f} obs/s, "
            f"{step_s * 1e3:6.1f} ms/step (eager {eager['step_ms'] if eager else float('nan'):.1f}), "
            f"{row.get('speedup_vs_eager', float('nan')):.2f}x eager; compile+warm-up {warm:.0f} s"
        )
    results["compile_batch1"] = out


def bench_sft(args, results: dict, deadline: float) -> None:
    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import DEFAULT_IO

    if time.perf_counter() > deadline:
        log("[sft] skipped (time budget)")
        return
    ad = build_model(ModelConfig(name="cosmos3", preset=args.sft_preset), DEFAULT_IO, device=args.device)
    groups = [g for g in ad.param_groups() if g.params]
    trainable = sum(p.numel() for g in groups for p in g.params)
    total = sum(p.numel() for p in ad.module.parameters())
    opt = torch.optim.AdamW(
        [
            {"params": g.params, "lr": 1e-5 * g.lr_mult, "weight_decay": 0.01 if g.weight_decay else 0.0}
            for g in groups
        ],
        fused=ad.device.type == "cuda",
    )
    batch = make_batch(DEFAULT_IO, args.sft_batch)

    def step():
        with torch.autocast(ad.device.type, dtype=torch.bfloat16, enabled=ad.device.type == "cuda"):
            out = ad.sft_loss(batch)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return out

    for _ in range(2):
        step()
    s = timed(step, repeats=args.sft_steps)
    views = ad._views(batch)
    enc = timed(lambda: ad._encode([[v] * (ad.io.chunk + 1) for v in views]), repeats=2)
    b = args.sft_batch
    fps = ad.flops_per_sample()
    model_s = s - enc if s > enc else float("nan")  # the transformer's share of a step
    row = dict(
        preset=args.sft_preset,
        params=total,
        trainable=trainable,
        batch=b,
        step_s=s,
        samples_per_s=b / s,
        vae_encode_s=enc,
        samples_per_s_without_vae=b / model_s,
        flops_per_sample=fps,
        mfu=fps * b / model_s / PEAK_BF16,
        mfu_end_to_end=fps * b / s / PEAK_BF16,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
    )
    results["sft"] = row
    log(
        f"[sft] {args.sft_preset} ({total / 1e9:.2f}B params, {trainable / 1e9:.2f}B trained), batch {b}: "
        f"{s * 1e3:.0f} ms/step = {b / s:.2f} samples/s end to end; VAE encode {enc * 1e3:.0f} ms of it; "
        f"without it {row['samples_per_s_without_vae']:.2f} samples/s, MFU {row['mfu'] * 100:.1f}% "
        f"(end to end {row['mfu_end_to_end'] * 100:.1f}%), peak {row['peak_mem_gib']:.0f} GiB"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m wamkit.models.cosmos3.bench_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--steps", type=int, default=30, help="denoising steps per prediction")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-steps", type=int, default=4)
    p.add_argument("--skip-compile", action="store_true")
    p.add_argument("--skip-sft", action="store_true")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new parts after this")
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--smoke", action="store_true", help="the same code with the tiny preset on the CPU (a check)"
    )
    args = p.parse_args(argv)
    args.preset, args.sft_preset, args.device = "nano", "nano_l8", "cuda"
    if args.smoke:
        args.preset, args.sft_preset, args.device = "tiny", "tiny", "cpu"
        args.steps, args.batches, args.sft_batch, args.sft_steps, args.skip_compile = 2, [1, 2], 2, 1, True
    elif not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; this benchmark needs one GPU with >= 80 GB", file=sys.stderr)
        return 2
    if not args.smoke and torch.cuda.mem_get_info()[1] < 80 * 2**30:
        gib = torch.cuda.mem_get_info()[1] / 2**30
        print(f"bench_gpu: the GPU has {gib:.0f} GiB; the Nano-shaped model needs >= 80", file=sys.stderr)
        return 2
    import diffusers

    start = time.perf_counter()
    deadline = start + args.budget_s
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "steps": args.steps,
    }
    log(f"[env] {results['device']}, torch {torch.__version__}, diffusers {diffusers.__version__}")
    torch.backends.cuda.matmul.allow_tf32 = True
    ad = bench_inference(args, results, deadline)
    if not args.skip_sft:
        ad.module.to("meta")  # free the 30 GB before the training model comes
        del ad
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        bench_sft(args, results, deadline)
        gc.collect()  # the training model and its optimizer went out of scope
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        ad = None
    if not args.skip_compile:
        if ad is None:
            from wamkit.config import ModelConfig
            from wamkit.models import build_model
            from wamkit.models.cosmos3 import DEFAULT_IO

            opts = {"dtype": "bfloat16", "num_inference_steps": args.steps}
            ad = build_model(
                ModelConfig(name="cosmos3", preset="nano", options=opts), DEFAULT_IO, device="cuda"
            )
        bench_compile(ad, args, results, deadline + 60)
    results["wall_s"] = time.perf_counter() - start
    log(f"[done] {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
