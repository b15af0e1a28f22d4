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

``--processes 1,2`` measures scaling instead: the trainer step alone, once per process count, each
under its own ``torchrun --standalone --nproc_per_node=N`` (fresh processes: no memory or compiled
state carries from one count to the next; NCCL on GPUs, gloo on a CPU). samples/s counts every
process's micro-batch; the scaling ratio is N-process samples/s / 1-process samples/s at the same
micro-batch per process. ``--micro-batch 32,64`` runs each count at each micro-batch, and the N-process
rows are also compared with the best 1-process row (a bigger micro-batch on one device is the
alternative a second device must beat): every count runs at the first micro-batch, the others on one
process only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wamkit.bench.procs import kill_tree
from wamkit.bench.timing import profile_table, timed
from wamkit.models.base import CachesLatents, compile_blocks
from wamkit.models.synthetic import synthetic_batch

log = logging.getLogger(__name__)

H200_BF16_PEAK = 989e12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="registered model name (default: tiny)")
    parser.add_argument("--preset", default="small", help="the model's size preset (default: small)")
    parser.add_argument(
        "--micro-batch",
        type=_int_list,
        default=[8],
        help="samples per step and process (default: 8); with --processes a list, e.g. 32,64: every "
        "process count runs the first, 1 process also runs the others (the best 1-process row)",
    )
    parser.add_argument(
        "--processes",
        type=_int_list,
        default=None,
        help="scaling: the trainer step under torchrun with each process count, e.g. 1,2",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per torchrun launch (--processes; default 600)"
    )
    # internal: a process launched by --processes writes its measurement here (rank 0) and exits
    parser.add_argument("--worker-json", default="", help=argparse.SUPPRESS)
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
    parser.add_argument(
        "--reshard-after-forward",
        type=_reshard_list,
        default=["auto"],
        metavar="MODES",
        help="train.reshard_after_forward (auto, always, never); with --processes a list, e.g. auto,never: "
        "every N-process row runs once per mode, the 1-process rows with the first",
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        default=1,
        help="micro-batches per trainer step (gradient accumulation; default 1): the optimizer, EMA and "
        "offload costs are spread over them as in a run of the recipe's global batch",
    )
    parser.add_argument(
        "--warmup-accumulation",
        type=int,
        default=0,
        metavar="N",
        help="micro-batches per warm-up step (default: --accumulation): a warm-up step compiles, fills the "
        "allocator and makes the optimizer's state in its first micro-batches; the timed steps keep "
        "--accumulation",
    )
    parser.add_argument("--ema", action="store_true", help="the trainer step updates an EMA (train.ema)")
    parser.add_argument(
        "--offload",
        default="auto",
        choices=("auto", "none", "ema", "optimizer"),
        help="train.offload for the trainer step (default auto: the memory plan's choice)",
    )
    parser.add_argument(
        "--latents",
        action="store_true",
        help="models that encode a video target (cosmos3): train from latents encoded once, as a "
        "latent cache gives them (wamkit cache-latents), not through the VAE at every step",
    )
    parser.add_argument(
        "--device-memory",
        default="",
        metavar="SIZE",
        help="cap this process's CUDA memory at SIZE (e.g. 80GB; torch.cuda.set_per_process_memory_fraction) "
        "and plan for it, as on a card of that size; a row whose plan does not fit says so; each trainer "
        "row also prints the driver-reported peak (the device's memory in use, CUDA context included)",
    )
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="the trainer rows train peft's LoRA adapters of rank R (train.lora.rank, alpha = R) and the "
        "model's heads instead of the full model; the bare row, full SFT's forward+backward, is skipped",
    )
    parser.add_argument(
        "--lora-base",
        default="bf16",
        choices=("bf16", "int8"),
        help="train.lora.base with --lora-rank: the adapted layers' frozen weights in the compute dtype "
        "(bf16) or torchao's weight-only int8",
    )
    parser.add_argument(
        "--text-kv",
        action="store_true",
        help="cosmos3: a third row, the trainer step reading its captions' text keys/values from a text "
        "cache (wamkit cache-text; the understanding tower out of the model), beside the stock one",
    )


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2")
    return values


def _batch(adapter, micro_batch: int, device: torch.device, latents: bool) -> dict[str, Any]:
    """The synthetic batch of one step; with ``latents``, its video targets encoded once (on ``device``)
    and handed over as a latent cache's rows are, the future frames dropped."""
    batch = synthetic_batch(adapter.io, micro_batch, len(adapter.future_frame_offsets), device)
    if not latents:
        return batch
    if not isinstance(adapter, CachesLatents):
        raise SystemExit(f"--latents: model {adapter.name!r} has no video target to encode")
    from wamkit.constants import future_image_key
    from wamkit.models.cosmos3.latents import LATENTS

    def rows(i: int) -> dict[str, Any]:  # sample i alone: the VAE's activations for one clip at a time
        def cut(v):
            return v[i : i + 1] if isinstance(v, (torch.Tensor, list)) and len(v) == micro_batch else v

        return {k: cut(v) for k, v in batch.items()}

    with torch.no_grad():  # one clip at a time: a 24 GB card holding the model has no room for the batch's
        lat = torch.cat(
            [adapter.encode_clips(rows(i), device).to(device, torch.float32) for i in range(micro_batch)]
        )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    batch = {k: v for k, v in batch.items() if not k.startswith(future_image_key(""))}
    batch[LATENTS] = lat
    return batch


def _measure_bare(cfg, device: torch.device, bf16: bool, args: argparse.Namespace, micro_batch: int):
    """Seconds per bare forward+backward, FLOPs per sample, parameter count (the model is freed).

    A model the trainer builds on the meta device (cosmos3) is built here straight on ``device`` in its
    compute dtype, as serving builds it: a 15B model never passes through host memory."""
    from wamkit.models import build_model
    from wamkit.models.registry import builds_on_meta

    torch.manual_seed(0)
    if builds_on_meta(cfg.name) and device.type == "cuda":
        bare = build_model(cfg, None, device=device)
    else:
        bare = build_model(cfg, None)
        bare.module.to(device)
    if args.compile:  # the same regional compilation as the trainer's, so the two rows compare
        compile_blocks(bare)
    batch = _batch(bare, micro_batch, device, args.latents)

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            bare.sft_loss(batch)["loss"].backward()
        for p in bare.module.parameters():
            p.grad = None

    t = timed(step, device, args.steps, args.warmup)
    n_params = sum(p.numel() for p in bare.module.parameters())
    return t, bare.flops_per_sample(), n_params  # the model goes with this frame


def _counts(cfg) -> tuple[float, int]:
    """FLOPs per sample and parameters of ``cfg``'s model, built on the meta device (nothing allocated)."""
    from wamkit.models import build_model

    meta = build_model(cfg, None, device="meta")
    return meta.flops_per_sample(), sum(p.numel() for p in meta.module.parameters())


def _profile(step, device: torch.device, rows: int) -> None:
    """One step under torch.profiler: the ``rows`` costliest ops by device time (CPU time on a CPU)."""
    print(profile_table(step, device, rows))


def _reshard_list(value: str) -> list[str]:
    from wamkit.config import RESHARD_CHOICES

    modes = list(dict.fromkeys(v.strip() for v in value.split(",")))
    bad = [repr(m) for m in modes if m not in RESHARD_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)} in {value!r}: expected a comma list of {', '.join(RESHARD_CHOICES)}"
        )
    return modes


def _run_config(args: argparse.Namespace, micro_batch: int, world: int, reshard: str):
    """The trainer's settings this benchmark measures (what a run of them would hold)."""
    from wamkit.config import RunConfig

    cfg = RunConfig()
    cfg.model = _model_config(args)
    t = cfg.train
    t.precision, t.micro_batch, t.compile, t.reshard_after_forward = (
        args.precision,
        micro_batch,
        args.compile,
        reshard,
    )
    t.global_batch = micro_batch * world * args.accumulation
    t.ema, t.offload, t.device = args.ema, args.offload, args.device
    if args.lora_rank:
        t.lora.rank, t.lora.base = args.lora_rank, args.lora_base
    return cfg


def _bench_text_cache(cfg, folder, precision: str):
    """A text cache for the synthetic batch's captions, of the shapes the model's tower would give:
    the keys/values are random (a speed benchmark reads them as it reads real ones), the fingerprint
    the model's own. Returns the model config that reads it."""
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import text_kv
    from wamkit.models.registry import builds_on_meta

    torch.manual_seed(0)  # the trainer row's weights: its fingerprint
    adapter = build_model(cfg, None, device="meta") if builds_on_meta(cfg.name) else build_model(cfg, None)
    from wamkit.models.cosmos3.adapter import Cosmos3Adapter

    if not isinstance(adapter, Cosmos3Adapter):
        raise SystemExit(f"--text-kv: model {cfg.name!r} has no text keys/values to cache (cosmos3 has)")
    task = synthetic_batch(adapter.io, 1)["task"][0]
    hw = adapter._run_hw()
    captions = set(adapter.training_captions([task])) | {adapter.prompt(task, hw, None)}
    attn = adapter.module.layers[0].self_attn
    shape = (len(adapter.module.layers), attn.num_key_value_heads, attn.head_dim)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)

    def encode(caption: str):
        from wamkit.models.cosmos3.kv_step import TextKV

        u = int(adapter._text_segment(caption, hw)["input_ids"].numel())
        kv = [torch.randn(shape[0], shape[1], u, shape[2], generator=g).to(dtype) for _ in range(2)]
        return TextKV(*kv)

    text_kv.build(folder, adapter.text_fingerprint(dtype), sorted(captions), encode)
    return dataclasses.replace(cfg, options={**cfg.options, text_kv.OPTION: str(folder)})


def _trainer_step(cfg, device: torch.device, args: argparse.Namespace, micro_batch: int):
    """The trainer's step on a synthetic batch, placed by its memory plan as ``wamkit train`` places it
    (built on meta where the model can be, refused if it fits nowhere): ``(step_fn, parameters,
    flops per sample, plan, trained parameters)``; one step is ``--accumulation`` micro-batches, then clipping, AdamW and
    the EMA."""
    from wamkit.models import build_model
    from wamkit.models.registry import builds_on_meta
    from wamkit.train.dist import init_distributed
    from wamkit.train.optim import PowerEMA, build_optimizer
    from wamkit.train.placement import place_run

    info = init_distributed(args.device)
    run = _run_config(args, micro_batch, info.world_size, args.reshard_after_forward[0])
    torch.manual_seed(0)
    meta = builds_on_meta(cfg.name)
    adapter = build_model(cfg, None, device="meta") if meta else build_model(cfg, None)
    if cfg.name == "cosmos3" and adapter.text_kv is not None:  # a random preset keeps its tower
        adapter.drop_understanding_tower(force=True)  # nothing is saved here
    n_params, flops = sum(p.numel() for p in adapter.module.parameters()), adapter.flops_per_sample()
    # placed as wamkit train places it, LoRA included: an int8 base of a random preset, which a run
    # refuses for what its checkpoints would hold, is measured here (nothing is saved)
    _, placed = place_run(adapter, info, run)
    plan = placed.plan
    batch = _batch(adapter, micro_batch, device, args.latents)
    root, trainable = placed.root, list(placed.trained.values())
    host = device if plan.offload == "optimizer" else None
    opt = build_optimizer(
        placed.groups, 1e-4, 0.01, [0.9, 0.95], fused=device.type == "cuda", host_device=host
    )
    ema_host = device if plan.offload in ("ema", "optimizer") else None
    ema = PowerEMA(placed.trained, 0.75, device=ema_host) if args.ema else None
    counter = [0]

    def step(accum: int = args.accumulation):
        t0 = time.perf_counter()
        for micro in range(accum):
            root.set_requires_gradient_sync(plan.grad_sync == "every" or micro == accum - 1)
            (root(batch)["loss"] / accum).backward()
            if accum > 1 and (micro + 1) % max(1, accum // 4) == 0:  # a stopped run still says how far it got
                log.info("trainer step %d: micro-batch %d of %d, %.1f s", counter[0], micro + 1, accum,
                         time.perf_counter() - t0)  # fmt: skip
        torch.nn.utils.clip_grad_norm_(trainable, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ema is not None:
            ema.update(counter[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        log.info("trainer step %d done: %d micro-batches of %d in %.2f s", counter[0], accum, micro_batch,
                 time.perf_counter() - t0)  # fmt: skip
        counter[0] += 1

    return step, n_params, flops, plan, sum(p.numel() for p in trainable)  # last: what the optimizer updates


def _model_config(args: argparse.Namespace):
    from wamkit.config import ModelConfig, parse_override

    options = dict(parse_override(o) for o in args.option)
    return ModelConfig(name=args.model, preset=args.preset, options=options)


def main(args: argparse.Namespace) -> int:
    if args.processes:
        return _scaling(args)
    if len(args.micro_batch) > 1:
        raise SystemExit("wamkit bench train: a list of micro-batches needs --processes (e.g. --processes 1)")
    if len(args.reshard_after_forward) > 1:
        raise SystemExit("wamkit bench train: a list of --reshard-after-forward modes needs --processes")
    if args.worker_json:
        return _worker(args)
    from wamkit.train.dist import init_distributed, shutdown

    cfg, mb = _model_config(args), args.micro_batch[0]
    info = init_distributed(args.device)
    device, bf16 = info.device, args.precision == "bf16"
    cap, allocator_cap = _cap_device_memory(args.device_memory, device)
    try:
        try:
            if args.lora_rank:  # full SFT's forward+backward is not LoRA's "model alone"
                t_bare, flops, n_params = None, *_counts(cfg)
            else:
                t_bare, flops, n_params = _measure_bare(cfg, device, bf16, args, mb)
        except torch.OutOfMemoryError as err:  # the whole model on a capped device
            log.warning("bare forward+backward: out of memory (%s)", str(err).splitlines()[0])
            t_bare, flops, n_params = None, *_counts(cfg)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with DriverPeak(device) as driver:
            trainer = _trainer_row(cfg, device, args, mb)
        t_train, plan = trainer.seconds, trainer.plan
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        host = _host_memory()
        if args.profile and trainer.step is not None:
            _profile(trainer.step, device, args.profile)
        lora = f", LoRA r{args.lora_rank} {args.lora_base}" if args.lora_rank else ""
        rows = [("bare forward+backward", t_bare), (f"trainer step (FSDP2+clip+AdamW{lora})", t_train)]
        drivers = [driver.describe()]
        if args.text_kv:
            trainer.step = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            with (
                tempfile.TemporaryDirectory(prefix="wamkit-text-kv-") as folder,
                DriverPeak(device) as driver,
            ):
                cached = _bench_text_cache(cfg, folder, args.precision)
                text = _trainer_row(cached, device, args, mb)
                text.step = None
            rows.append((f"trainer step, text cache{lora}", text.seconds))
            drivers.append(driver.describe())
            plan = plan or text.plan
            mem_text = (
                torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
            )
    finally:
        shutdown(info)

    peak = args.peak_tflops * 1e12 or (H200_BF16_PEAK if device.type == "cuda" and bf16 else 0.0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model {args.model}/{args.preset}: {n_params / 1e6:.1f}M parameters, {flops / 1e9:.2f} GFLOP/sample "
          f"(fwd+bwd), micro-batch {mb}, {args.precision} on {name}"
          + (", blocks compiled" if args.compile else ""))  # fmt: skip
    if cap:
        print(f"a card of {cap / 1e9:.1f} GB ({cap / 2**30:.2f} GiB, CUDA context included) stood in for "
              f"(--device-memory {args.device_memory}): rows planned for it, the allocator capped at "
              f"{allocator_cap / 2**30:.2f} GiB")  # fmt: skip
    if args.lora_rank:
        print(f"LoRA rank {args.lora_rank}, base {args.lora_base}: the bare row (full SFT's forward+backward) "
              "is skipped; MFU counts full SFT's FLOPs per sample, of which LoRA skips the frozen layers' "
              "weight gradients")  # fmt: skip
    print(f"{'variant':<34} {'s/step':>9} {'samples/s':>10} {'TFLOP/s':>8} {'MFU':>7}")
    for label, t in rows:
        if t is None and args.lora_rank and label.startswith("bare"):
            print(f"{label:<34} {'skipped under LoRA':>36}")
            continue
        if t is None:
            print(f"{label:<34} {'does not fit (the log says why)':>36}")
            continue
        sps = mb / t
        achieved = flops * sps
        mfu = f"{100 * achieved / peak:6.1f}%" if peak else "    n/a"
        print(f"{label:<34} {t:>9.4f} {sps:>10.1f} {achieved / 1e12:>8.2f} {mfu}")
    if t_train is not None:
        ratio = f"{t_bare / t_train:.2f}" if t_bare is not None else "n/a"
        print(f"trainer / bare samples/s: {ratio}   peak device memory (trainer): {mem:.1f} GiB, "
              f"{drivers[0]}   host: peak RSS {host['peak_rss_gb']:.1f} GB, "
              f"RssAnon now {host['rss_anon_gb']:.1f} GB")  # fmt: skip
    if args.text_kv and rows[-1][1] is not None:
        ratio = f"{t_train / rows[-1][1]:.2f}" if t_train is not None else "n/a (the stock step does not fit)"
        print(f"text cache / stock trainer samples/s: {ratio}   peak device memory (text cache): "
              f"{mem_text:.1f} GiB, {drivers[-1]}   host: peak RSS "
              f"{_host_memory()['peak_rss_gb']:.1f} GB")  # fmt: skip
    if plan is not None:
        print(f"trainer step: {args.accumulation} micro-batch(es) per optimizer step; memory plan: offload={plan.offload}, "
              f"reshard_after_forward={plan.reshard}, planned device total {plan.device_total / 2**30:.1f} GiB")  # fmt: skip
    return 0


@dataclasses.dataclass
class _TrainerRow:
    seconds: float | None  # per micro-batch; None: its plan does not fit
    plan: Any
    step: Any = None


def _trainer_row(cfg, device: torch.device, args: argparse.Namespace, micro_batch: int) -> _TrainerRow:
    """One trainer row timed, or, where its memory plan refuses it (a capped device), its refusal
    logged and no time."""
    from wamkit.config import ConfigError

    try:
        step, _, _, plan, trained = _trainer_step(cfg, device, args, micro_batch)
    except ConfigError as err:
        log.warning("%s", err)
        return _TrainerRow(None, None)
    if args.lora_rank:
        print(f"LoRA rank {args.lora_rank}, base {args.lora_base}: {trained / 1e6:.2f}M trained parameters")
    return _TrainerRow(_timed_step(step, device, args), plan, step)


def _timed_step(step, device: torch.device, args: argparse.Namespace) -> float:
    """Seconds per micro-batch of the trainer's ``step``: ``--steps`` steps timed after ``--warmup``
    untimed ones of ``--warmup-accumulation`` micro-batches (they compile, fill the allocator and make
    the optimizer's state; the timed steps take ``--accumulation``)."""
    for _ in range(args.warmup):
        step(args.warmup_accumulation or args.accumulation)
    return timed(step, device, args.steps) / args.accumulation


def _cap_device_memory(size: str, device: torch.device) -> tuple[int, int]:
    """``--device-memory``: this process stands in for a card of ``size`` (its CUDA context counted,
    :func:`wamkit.device.emulate_card`); ``(size, the allocator's cap)`` in bytes, (0, 0): no cap."""
    if not size:
        return 0, 0
    from wamkit.config import ConfigError
    from wamkit.device import emulate_card
    from wamkit.train.memory import parse_size

    if device.type != "cuda":
        raise SystemExit(
            "wamkit bench train: --device-memory caps a CUDA device's memory; this run is on the CPU"
        )
    cap = parse_size(size, "--device-memory")
    try:  # a card larger than the device is refused there
        return cap, emulate_card(device, cap)
    except ConfigError as err:
        raise SystemExit(f"wamkit bench train: --device-memory {size}: {err}") from None


class DriverPeak:
    """The device memory the driver reports in use (``torch.cuda.mem_get_info``: the whole device,
    every CUDA context included, as ``nvidia-smi`` counts it), its largest value sampled every 20 ms
    while the block runs; nan on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak, self.outside, self._stop = device, 0, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="wamkit-driver-peak", daemon=True)

    def _sample(self) -> None:
        while True:
            before = torch.cuda.memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            after = torch.cuda.memory_reserved(self.device)
            self.peak = max(self.peak, total - free)
            # what the driver gives past the caching allocator (context, kernels, libraries' state). The
            # two counts are not read at one instant: against the larger of the allocator's readings on
            # either side, a segment freed (or taken) in between is not counted as outside it
            self.outside = max(self.outside, total - free - max(before, after))
            if self._stop.wait(0.02):
                return

    def __enter__(self) -> DriverPeak:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def peak_gib(self) -> float:
        return self.peak / 2**30 if self.device.type == "cuda" else float("nan")

    def describe(self) -> str:
        """``driver-reported 23.30 GiB (25.02 GB), 0.95 GiB of it outside the allocator``."""
        if self.device.type != "cuda":
            return "driver-reported nan GiB"
        return (f"driver-reported {self.peak / 2**30:.2f} GiB ({self.peak / 1e9:.2f} GB), "
                f"{self.outside / 2**30:.2f} GiB of it outside the allocator")  # fmt: skip


def _host_memory() -> dict[str, float]:
    """Peak resident memory of this process (file-backed pages included) and its anonymous part now."""
    import resource

    from wamkit.train.placement import rss_anon_bytes

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_rss_gb": peak / 1e9, "rss_anon_gb": rss_anon_bytes() / 1e9}


# -- scaling over processes ------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> int:
    """One launch of ``--processes``: every rank times the trainer step; the slowest rank's time counts
    (a step is over when every rank is done). Rank 0 writes the row to ``--worker-json``."""
    from wamkit.train.dist import init_distributed, shutdown

    info = init_distributed(args.device)
    device, mb = info.device, args.micro_batch[0]
    try:
        step, n_params, flops, plan, _ = _trainer_step(_model_config(args), device, args, mb)
        t = _timed_step(step, device, args)
        mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        host = _host_memory()
        worst = torch.tensor(
            [t, mem, host["peak_rss_gb"], host["rss_anon_gb"]], dtype=torch.float64, device=device
        )
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        t, mem, peak_rss, anon = worst.tolist()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        row = dict(
            processes=info.world_size, micro_batch=mb, s_step=t, samples_per_s=info.world_size * mb / t,
            peak_gib=mem, params=n_params, flops_per_sample=flops, device=name,
            peak_rss_gb=peak_rss, rss_anon_gb=anon, offload=plan.offload,
        )  # fmt: skip
        if info.is_main:
            Path(args.worker_json).write_text(json.dumps(row))
    finally:
        shutdown(info)
    # The row is written and the group destroyed; torchrun reads only the exit code. Leave without the
    # interpreter's teardown, in which a thread of torch's distributed stack now and then aborted the
    # process on this 2-core machine ("terminate called without an active exception", SIGABRT; seen
    # once in six runs of tests/test_train_scaling.py under load), failing a finished measurement.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker_argv(
    args: argparse.Namespace, processes: int, micro_batch: int, reshard: str, out: Path
) -> list[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
        "-m", "wamkit", "bench", "train", "--model", args.model, "--preset", args.preset,
        "--micro-batch", str(micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--precision", args.precision, "--device", args.device, "--worker-json", str(out),
        "--reshard-after-forward", reshard, "--accumulation", str(args.accumulation), "--offload", args.offload,
        "--warmup-accumulation", str(args.warmup_accumulation),
    ]  # fmt: skip
    if args.ema:
        argv.append("--ema")
    for opt in args.option:
        argv += ["--option", opt]
    return argv + (["--compile"] if args.compile else []) + (["--latents"] if args.latents else [])


def _worker_env(processes: int) -> dict[str, str]:
    env = dict(os.environ)
    # On a CPU the processes share the cores: each gets cores / N threads, so the ratio measures
    # splitting the work, not a change of thread count (torchrun would give 1 thread to N > 1 only).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // processes)))
    return env


def _launch(args: argparse.Namespace, processes: int, micro_batch: int, reshard: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        argv = _worker_argv(args, processes, micro_batch, reshard, out)
        proc = subprocess.Popen(
            argv, env=_worker_env(processes), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            _, stderr = proc.communicate(timeout=args.timeout)
        except BaseException as err:  # a timeout or ^C: no worker may keep its GPU
            kill_tree(proc)
            if isinstance(err, subprocess.TimeoutExpired):
                raise SystemExit(
                    f"wamkit bench train: {processes} process(es) took over {args.timeout:.0f} s"
                ) from None
            raise
        if proc.returncode != 0 or not out.is_file():
            sys.stderr.write(stderr[-4000:])
            raise SystemExit(
                f"wamkit bench train: {processes} process(es), micro-batch {micro_batch} failed "
                f"(exit {proc.returncode}): {' '.join(argv)}"
            )
        row = json.loads(out.read_text())
    if row["processes"] != processes:  # e.g. a launcher that did not start every rank
        raise SystemExit(f"wamkit bench train: asked for {processes} processes, {row['processes']} ran")
    return row


def _scaling(args: argparse.Namespace) -> int:
    if args.profile:
        raise SystemExit("wamkit bench train: --profile measures one process; leave out --processes")
    counts = sorted(set(args.processes))
    if 1 not in counts:
        counts = [1, *counts]  # the reference of every ratio
    mb, *others = dict.fromkeys(args.micro_batch)  # in order, without repeats
    modes = args.reshard_after_forward
    if len(modes) > 1 and counts == [1]:
        raise SystemExit(
            "wamkit bench train: a list of --reshard-after-forward modes compares the N-process rows; "
            "add a count above 1 to --processes (the 1-process reference rows run with the first mode)"
        )
    runs = [(1, mb, modes[0]), *((1, b, modes[0]) for b in others)]
    runs += [(n, mb, m) for n in counts if n > 1 for m in modes]
    rows = {}
    for n, b, m in runs:
        rows[n, b, m] = _launch(args, n, b, m)
        print(
            f"  measured {n} process(es) x micro-batch {b}, reshard after forward {m}: "
            f"{rows[n, b, m]['samples_per_s']:.1f} samples/s",
            flush=True,
        )
    _print_scaling(args, rows)
    return 0


def _print_scaling(args: argparse.Namespace, rows: dict) -> None:
    first = next(iter(rows.values()))
    peak = args.peak_tflops * 1e12 or (
        H200_BF16_PEAK if first["device"] != "cpu" and args.precision == "bf16" else 0.0
    )
    best1 = max((r for (n, _, _), r in rows.items() if n == 1), key=lambda r: r["samples_per_s"])
    first_mode = args.reshard_after_forward[0]
    print(f"model {args.model}/{args.preset}: {first['params'] / 1e6:.1f}M parameters, "
          f"{first['flops_per_sample'] / 1e9:.2f} GFLOP/sample (fwd+bwd), trainer step (FSDP2+clip+AdamW), "
          f"{args.precision} on {first['device']}" + (", blocks compiled" if args.compile else ""))  # fmt: skip
    print(f"{'processes':>9} {'micro-batch':>11} {'s/step':>9} {'samples/s':>10} {'per process':>11} "
          f"{'MFU':>7} {'peak GiB':>8} {'RSS GB':>7} {'scaling':>8} {'vs best 1':>9}  reshard")  # fmt: skip
    for (n, mb, mode), r in rows.items():
        sps, one = r["samples_per_s"], rows[1, mb, first_mode]["samples_per_s"]
        mfu = f"{100 * r['flops_per_sample'] * sps / n / peak:6.1f}%" if peak else "    n/a"
        mem = f"{r['peak_gib']:>8.1f}" if r["peak_gib"] == r["peak_gib"] else "     n/a"  # NaN on a CPU
        print(f"{n:>9} {mb:>11} {r['s_step']:>9.4f} {sps:>10.1f} {sps / n:>11.1f} {mfu} "
              f"{mem} {r.get('peak_rss_gb', float('nan')):>7.1f} {sps / one:>7.2f}x "
              f"{sps / best1['samples_per_s']:>8.2f}x  {mode}")  # fmt: skip
    print(
        f"scaling: N-process samples/s / 1-process samples/s at the same micro-batch per process; "
        f"vs best 1: / the best 1-process row (micro-batch {best1['micro_batch']}, "
        f"{best1['samples_per_s']:.1f} samples/s); reshard: train.reshard_after_forward (auto on one "
        f"process keeps the weights gathered, as never does); RSS GB: the largest rank's peak resident "
        f"host memory"
    )
