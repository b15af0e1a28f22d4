"""``wamkit bench train``: training samples/s and MFU, the full trainer step against a bare
forward+backward of the same model, measured side by side in one run.

- *bare*: an unsharded copy of the model, ``sft_loss`` + ``backward`` only (autocast bf16 on GPU when
  ``--precision bf16``): what the model alone costs.
- *trainer*: the trainer's step: FSDP2 (``fully_shard`` per block + root, bf16 params / fp32 reduce),
  gradient clipping, AdamW with the model's param groups.

MFU = flops_per_sample x samples/s / peak; the peak is the H200's dense bf16 989 TFLOP/s (or
``--peak-tflops``); on a CPU there is no agreed peak, so MFU is printed only with ``--peak-tflops``.
Batches are synthetic (random images/states/actions of the model's ModelIO): the data pipeline has
its own benchmark (``wamkit bench data``).
"""

from __future__ import annotations

import argparse
import time

import torch

from wamkit.models.synthetic import synthetic_batch

H200_BF16_PEAK = 989e12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="registered model name (default: tiny)")
    parser.add_argument("--preset", default="small", help="the model's size preset (default: small)")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per step (default: 8)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant (default: 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (GPU: 989)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="model option")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="print the N costliest ops of one trainer step"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile each block (train.compile)")


def _timed(fn, steps: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps


def _measure_bare(cfg, device: torch.device, bf16: bool, args: argparse.Namespace):
    """Seconds per bare forward+backward, FLOPs per sample, parameter count, ModelIO (model freed)."""
    from wamkit.models import build_model

    torch.manual_seed(0)
    bare = build_model(cfg, None)
    bare.module.to(device)
    if args.compile:  # the same regional compilation as the trainer's, so the two rows compare
        for block in bare.blocks():
            block.compile()
    batch = synthetic_batch(bare.io, args.micro_batch, len(bare.future_frame_offsets), device)

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            bare.sft_loss(batch)["loss"].backward()
        for p in bare.module.parameters():
            p.grad = None

    t = _timed(step, args.steps, args.warmup, device)
    n_params = sum(p.numel() for p in bare.module.parameters())
    return t, bare.flops_per_sample(), n_params, bare.io, len(bare.future_frame_offsets)


def _profile(step, device: torch.device, rows: int) -> None:
    """One step under torch.profiler: the ``rows`` costliest ops by device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main(args: argparse.Namespace) -> int:
    from wamkit.config import ModelConfig, parse_override
    from wamkit.models import build_model
    from wamkit.train.dist import init_distributed, shard_adapter, shutdown
    from wamkit.train.optim import build_optimizer

    options = dict(parse_override(o) for o in args.option)
    cfg = ModelConfig(name=args.model, preset=args.preset, options=options)
    info = init_distributed(args.device)
    device, bf16 = info.device, args.precision == "bf16"
    try:
        t_bare, flops, n_params, io, future = _measure_bare(cfg, device, bf16, args)
        batch = synthetic_batch(io, args.micro_batch, future, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

        torch.manual_seed(0)
        adapter = build_model(cfg, None)
        root, groups, trained = shard_adapter(adapter, device, args.precision, args.compile)
        opt = build_optimizer(groups, 1e-4, 0.01, [0.9, 0.95], fused=device.type == "cuda")
        trainable = list(trained.values())

        def trainer_step():
            root(batch)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t_train = _timed(trainer_step, args.steps, args.warmup, device)
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        if args.profile:
            _profile(trainer_step, device, args.profile)
    finally:
        shutdown(info)

    peak = args.peak_tflops * 1e12 or (H200_BF16_PEAK if device.type == "cuda" and bf16 else 0.0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model {args.model}/{args.preset}: {n_params / 1e6:.1f}M parameters, {flops / 1e9:.2f} GFLOP/sample "
          f"(fwd+bwd), micro-batch {args.micro_batch}, {args.precision} on {name}"
          + (", blocks compiled" if args.compile else ""))  # fmt: skip
    print(f"{'variant':<34} {'s/step':>9} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>7}")
    for label, t in (("bare forward+backward", t_bare), ("trainer step (FSDP2+clip+AdamW)", t_train)):
        sps = args.micro_batch / t
        achieved = flops * sps
        mfu = f"{100 * achieved / peak:6.1f}%" if peak else "    n/a"
        print(f"{label:<34} {t:>9.4f} {sps:>10.1f} {achieved / 1e12:>8.2f} {mfu}")
    print(f"trainer / bare samples/s: {t_bare / t_train:.2f}   peak device memory (trainer): {mem:.1f} GiB")
    return 0
