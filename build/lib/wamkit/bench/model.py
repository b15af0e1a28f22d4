"""``wamkit bench model``: forward+backward samples/s and policy-inference obs/s of one model.

Both are measured in the same run at each batch size on synthetic inputs of the model's declared shape
(``io``), after warm-up iterations. On CUDA the model runs under bf16 autocast (fp32 weights, as the
trainer's ``precision: bf16``) and the report adds MFU: achieved training FLOP/s over the GPU's bf16
dense peak (H200: 989 TFLOP/s), with FLOPs from the adapter's ``flops_per_sample()``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from wamkit.bench.timing import timed
from wamkit.config import ModelConfig, parse_override
from wamkit.models import ModelIO, build_model
from wamkit.models.synthetic import synthetic_batch

H200_BF16_PEAK_TFLOPS = 989.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="registered model name (default: tiny)")
    parser.add_argument("--preset", default="small", help="size preset (tiny: small, base, 1b)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="model option")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: cuda if available)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default: 1,8,32)")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per measurement")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before each measurement")
    parser.add_argument("--image-size", type=int, default=128, help="camera image size of the inputs")
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS, help="GPU bf16 peak")


def main(args: argparse.Namespace) -> int:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    options = dict(parse_override(o) for o in args.option)
    io = ModelIO(image_size=args.image_size)
    adapter = build_model(ModelConfig(name=args.model, preset=args.preset, options=options), io)
    adapter.module.to(device)
    io = adapter.io
    batches = [int(b) for b in args.batches.split(",") if b]
    bf16 = device.type == "cuda"
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else (lambda: contextlib.nullcontext())
    )
    params = sum(p.numel() for p in adapter.module.parameters())
    flops = adapter.flops_per_sample()
    threads = torch.get_num_threads()
    print(
        f"model {args.model}/{args.preset}: {params / 1e6:.2f}M parameters, {flops / 1e9:.3f} GFLOP per "
        f"training sample; device {device}, {'bf16 autocast' if bf16 else 'fp32'}"
        + ("" if bf16 else f", {threads} threads")
    )
    header = (
        f"{'batch':>5}  {'fwd+bwd samples/s':>18}  {'step ms':>9}  {'policy obs/s':>13}  {'predict ms':>10}"
    )
    print(header + ("  MFU" if bf16 else ""))
    rows = []
    for b in batches:
        batch = synthetic_batch(io, b, len(adapter.future_frame_offsets), device, seed=b)

        def train_step(batch=batch) -> None:
            with autocast():
                loss = adapter.sft_loss(batch)["loss"]
            loss.backward()
            for p in adapter.module.parameters():
                p.grad = None

        def infer(batch=batch) -> None:
            with autocast():
                adapter.predict(batch, seed=0)

        adapter.module.train()
        t_train = timed(train_step, device, args.steps, args.warmup)
        adapter.module.eval()
        t_pred = timed(infer, device, args.steps, args.warmup)
        rows.append((b, b / t_train, b / t_pred))
        line = (
            f"{b:>5}  {b / t_train:>18.1f}  {t_train * 1e3:>9.1f}  {b / t_pred:>13.1f}  {t_pred * 1e3:>10.1f}"
        )
        if bf16:
            line += f"  {b / t_train * flops / (args.peak_tflops * 1e12):.1%}"
        print(line)
    if len(rows) > 1:
        (b0, tr0, pr0), (b1, tr1, pr1) = rows[0], rows[-1]
        print(
            f"ratio batch {b1} / batch {b0}: fwd+bwd samples/s x{tr1 / tr0:.2f}, policy obs/s x{pr1 / pr0:.2f}"
        )
    return 0
