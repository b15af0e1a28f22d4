"""``wamkit bench cosmos3-sft``: Cosmos3 SFT steps/s and MFU, three ways side by side in one run.

A size preset with random weights (default ``nano_l8``: Nano width, 8 layers; 4.35B parameters, 1.57B
trained) is built as the trainer runs it: fp32 weights (the master copy), bf16 autocast on CUDA, the
Wan VAE in fp32 with autocast off. A step is the adapter's ``sft_loss`` + backward + AdamW over B
synthetic samples of the recipe's embodiment (two ``--image-size`` views side by side, the current frame and 16 future
frames, a 16-step action chunk). For each batch size, three rows by default:

- ``transformer``: the clip latents already on the device: the transformer's step alone;
- ``encode``: from the clips' uint8 frames, the VAE encoding 17 frames per sample in every step (a run
  without a latent cache);
- ``cached``: the latents of a latent cache folder on disk (a run with ``model.options.latent_cache``;
  the folder is written once before timing, ``--cache-dir``), read as the trainer reads them: a
  ``DataLoader`` whose ``--loader-workers`` processes call ``LatentCache.get`` per sample ahead of the
  step, pinned (``data.loader``'s settings), the step copying the batch to the device. Its readers
  start afresh when the row's timing starts, so no batch read while other rows ran is counted: a
  reader slower than the step shows in the row;
- ``cached_inline`` (only when asked for): the same rows read inside the timed step, on the training
  thread, then pinned and copied (what the step costs when nothing reads ahead).

``--paths`` picks among them. ``--attention`` takes a comma list of packed-attention modes
(``model.options.attention``: mask, loop, flex, or auto: flex on CUDA, mask elsewhere; default auto);
each row then runs once per mode, on the same model
(the mode is the attention processor's, switched between rows), and after each batch a line gives
each mode's samples/s over the first mode's, per path.

Every row of a batch size runs ``--warmup`` untimed steps before any of them is timed (``--steps``
steps each; flex attention compiles in them). ``--repeats R`` times every row R times, the rows
interleaved in ``--paths`` order, and prints each row's median run. Columns: ms per step, samples/s,
MFU (the adapter's training FLOPs per nominal sample against the H100/H200 dense bf16 peak; CUDA
only), peak GPU memory, samples/s over the transformer row's (same attention mode), the attention mode.
The VAE encode of one batch alone is printed after each batch's rows. ``--profile N`` prints a
``torch.profiler`` table of N steps of each row ``--profile-path`` names (a comma list, default the
transformer step), top ops by device time on CUDA (then a second table by host time and the count of
the step's host waits for the GPU with the lines that asked), CPU time otherwise. ``wamkit bench
cosmos3 --sft`` runs this at one batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wamkit.bench.timing import host_waits, profile_table, timed
from wamkit.device import resolve_device, to_device
from wamkit.models.base import compile_blocks

PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16
PATHS = ("transformer", "encode", "cached", "cached_inline")
DEFAULT_PATHS = ("transformer", "encode", "cached")
LOADER_WORKERS = 8  # the cached row's reader processes by default (the Cosmos3 recipes' num_workers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="nano_l8", help="cosmos3 size preset (default: nano_l8)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: cuda if available)")
    parser.add_argument("--batches", default="8,32", help="comma-separated batch sizes (default: 8,32)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per row (default: 4)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="time every row this many times, the rows of a batch interleaved (transformer, encode, "
        "cached, transformer, ...), and print each row's median: no row owes its figure to its place "
        "in the order (default: 1)",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps of every row before timing a batch (default: 2)"
    )
    parser.add_argument("--image-size", type=int, default=256, help="camera image size (default: 256)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights (default: float32, the trainer's master weights; compute is bf16 autocast on CUDA)",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute each layer in backward (less memory)"
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each decoder layer, as train.compile does"
    )
    parser.add_argument(
        "--attention",
        default="auto",
        help="comma-separated packed-attention modes, rows of each side by side: mask | loop | flex | "
        "auto (the model's default: flex on CUDA, mask elsewhere; default: auto)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(DEFAULT_PATHS),
        help=f"comma-separated rows of {', '.join(PATHS)} (default: {','.join(DEFAULT_PATHS)})",
    )
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    parser.add_argument("--cache-dir", help="latent cache folder for the cached row (default: a temp dir)")
    parser.add_argument(
        "--loader-workers",
        type=int,
        default=LOADER_WORKERS,
        help=f"reader processes of the cached row's DataLoader (default: {LOADER_WORKERS})",
    )
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N steps (0: none)")
    parser.add_argument(
        "--profile-path",
        default="transformer",
        help=f"the rows to profile, a comma list of {', '.join(PATHS)} (default: transformer)",
    )
    parser.add_argument("--profile-batch", type=int, default=0, help="batch to profile (0: the largest)")
    parser.add_argument("--profile-rows", type=int, default=15, help="ops listed in the profile")
    parser.add_argument("--json", help="write every row here")


@dataclass
class Row:
    path: str
    batch: int
    step_s: float
    samples_per_s: float
    mfu: float | None
    peak_gib: float | None
    vs_transformer: float | None = None
    attention: str = "mask"


class SftBench:
    """One adapter and optimizer; ``step(path, b)`` runs one SFT step of a row at batch ``b``."""

    def __init__(self, preset: str, image_size: int, device: torch.device, options: dict[str, Any],
                 cache_dir: Path):  # fmt: skip
        from wamkit.config import ModelConfig
        from wamkit.models import build_model
        from wamkit.models.cosmos3 import DEFAULT_IO

        self.device = device
        self.io = dataclasses.replace(DEFAULT_IO, image_size=image_size)
        cfg = ModelConfig(name="cosmos3", preset=preset, options=options)
        self.ad = build_model(cfg, self.io, device=device)
        self.groups = [g for g in self.ad.param_groups() if g.params]
        self.opt = torch.optim.AdamW(
            [
                {"params": g.params, "lr": 1e-5 * g.lr_mult, "weight_decay": 0.01 if g.weight_decay else 0.0}
                for g in self.groups
            ],
            fused=device.type == "cuda",
        )
        self.cache_dir = cache_dir
        self.cache = None
        self._loaders: dict[int, Any] = {}  # batch size -> iterator of loader-read, pinned batches
        self._dataloaders: dict[int, Any] = {}
        self.loader_workers = LOADER_WORKERS
        self.batches: dict[int, dict[str, Any]] = {}
        self.latents: dict[int, torch.Tensor] = {}

    def batch(self, b: int) -> dict[str, Any]:
        """B synthetic samples: random uint8 views and future frames, random actions, the benchmark's tasks."""
        if b not in self.batches:
            from wamkit.bench.cosmos3 import make_batch
            from wamkit.constants import ACTION, ACTION_IS_PAD, IDLE_FRAMES, future_image_key

            io, rng = self.io, np.random.default_rng(b)
            batch = make_batch(io, b)
            s = io.image_size
            for c in io.cameras:
                fut = rng.integers(0, 256, (b, io.chunk, s, s, 3), dtype=np.uint8)
                batch[future_image_key(c)] = torch.from_numpy(fut)
            batch[ACTION] = torch.from_numpy(
                rng.uniform(-1, 1, (b, io.chunk, io.action_dim)).astype(np.float32)
            )
            batch[ACTION_IS_PAD] = torch.zeros(b, io.chunk, dtype=torch.bool)
            batch[IDLE_FRAMES] = torch.zeros(b, dtype=torch.int64)
            self.batches[b] = batch
        return self.batches[b]

    def encode(self, b: int) -> torch.Tensor:
        with torch.no_grad():
            return self.ad.encode_clips(self.batch(b))

    def prepare(self, batches: list[int]) -> None:
        """Encode each batch once, and write the largest one's latents as a cache folder on disk."""
        from wamkit.models.cosmos3.latents import LatentCache, LatentCacheWriter

        for b in batches:
            self.latents[b] = self.encode(b)
        top = max(batches)
        writer = LatentCacheWriter(
            self.cache_dir, self.ad.latent_fingerprint(), "bfloat16", 256, {"bench": top}
        )
        for suite, k, rows in writer.todo():
            writer.write(suite, k, self.latents[top][rows.start : rows.stop])
        self.cache = LatentCache(self.cache_dir)

    def _inputs(self, path: str, b: int) -> dict[str, Any]:
        from wamkit.constants import future_image_key
        from wamkit.models.cosmos3.latents import LATENTS

        batch = self.batch(b)
        if path == "encode":
            return batch
        lean = {k: v for k, v in batch.items() if not k.startswith(future_image_key(""))}
        if path == "transformer":
            lean[LATENTS] = self.latents[b]
        elif path == "cached":
            lean[LATENTS] = to_device(next(self._loader(b)), self.device)  # pinned by the loader
        else:
            rows = torch.stack([self.cache.get("bench", i) for i in range(b)])
            lean[LATENTS] = to_device(rows, self.device)  # pinned, not waiting, as the loader's batches
        return lean

    def _loader(self, b: int):
        """Batches of the cache's first ``b`` rows, read by worker processes ahead of the step and pinned
        on a GPU, as :class:`wamkit.data.loader.TrainLoader` hands the trainer its batches."""
        if b not in self._loaders:
            self._dataloaders[b] = torch.utils.data.DataLoader(
                _CacheRows(self.cache),
                batch_sampler=_Repeat(b),
                num_workers=self.loader_workers,
                prefetch_factor=2,
                persistent_workers=True,
                pin_memory=self.device.type == "cuda",
            )
            self._loaders[b] = iter(self._dataloaders[b])
        return self._loaders[b]

    def restart_loader(self, b: int) -> None:
        """Drop the batches the readers read ahead (while other rows ran) and start them again."""
        if b in self._dataloaders:
            self._loaders[b] = iter(self._dataloaders[b])

    def close(self) -> None:
        """Stop the cached row's reader processes."""
        self._loaders.clear()  # a DataLoader iterator stops its workers when it is dropped
        self._dataloaders.clear()

    def step(self, path: str, b: int) -> None:
        dev = self.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = self.ad.sft_loss(self._inputs(path, b))["loss"]
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


class _CacheRows(torch.utils.data.Dataset):
    """Row ``i`` of the benchmark's latent cache (each worker opens its own file handles)."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.cache.get("bench", i)


class _Repeat(torch.utils.data.Sampler):
    """Batches of rows ``0 .. b-1``, without end."""

    def __init__(self, b: int):
        self.b = b

    def __iter__(self):
        while True:
            yield list(range(self.b))


def measure(bench: SftBench, path: str, b: int, steps: int, attention: str) -> Row:
    """One row, timed after every row of the batch was warmed up (see :func:`warm`)."""
    dev = bench.device
    bench.ad.processor.mode = attention
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    if path == "cached":
        bench.restart_loader(b)
    s = timed(lambda: bench.step(path, b), dev, steps)
    mfu = bench.ad.flops_per_sample() * b / s / PEAK_BF16 if dev.type == "cuda" else None
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    return Row(path, b, s, b / s, mfu, peak, attention=attention)


def median_row(runs: list[Row]) -> Row:
    """The run with the median step time (the slower middle one of an even count); its own figures."""
    return sorted(runs, key=lambda r: r.step_s)[len(runs) // 2]


def warm(bench: SftBench, b: int, steps: int, rows: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Run ``steps`` untimed steps of every row ``(attention, path)`` at batch ``b`` before timing any:
    the first calls of a batch size pay for kernel selection (and flex attention's compilation), the
    caption and layout caches and the allocator's growth, which would otherwise land in whichever row
    comes first. Returns the rows that ran out of memory."""
    oom = set()
    for attention, path in rows:
        bench.ad.processor.mode = attention
        try:
            for _ in range(steps):
                bench.step(path, b)
        except torch.OutOfMemoryError:
            bench.opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            oom.add((attention, path))
    return oom


def profile_steps(bench: SftBench, path: str, b: int, n: int, rows: int) -> str:
    """torch.profiler tables of ``n`` steps of one row (after a warm-up step): by device time, and on
    a GPU also by host time."""
    return profile_table(lambda: bench.step(path, b), bench.device, rows, calls=n, host=True)


def _print_row(r: Row) -> None:
    mfu = f"{r.mfu * 100:6.1f}%" if r.mfu is not None else f"{'-':>7}"
    peak = f"{r.peak_gib:8.1f}" if r.peak_gib is not None else f"{'-':>8}"
    vs = f"{r.vs_transformer:8.2f}x" if r.vs_transformer is not None else f"{'':>9}"
    print(
        f"{r.path:<13} {r.batch:>5}  {r.step_s * 1e3:8.0f}  {r.samples_per_s:9.2f}  {mfu}  {peak}  {vs}  "
        f"{r.attention}",
        flush=True,
    )


def _print_attention_ratios(rows: list[Row], attentions: list[str]) -> None:
    """Per path, each attention mode's samples/s over the first mode's (rows of one batch)."""
    by = {(r.attention, r.path): r.samples_per_s for r in rows}
    for path in dict.fromkeys(r.path for r in rows):
        base = by.get((attentions[0], path))
        ratios = [f"{a} {by[a, path] / base:.2f}x" for a in attentions[1:] if base and (a, path) in by]
        if ratios:
            print(f"{'':<13} {path}: samples/s over {attentions[0]}'s: {', '.join(ratios)}", flush=True)


def _choices(flag: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma list of ``allowed`` names, in the order given; exits naming the flag otherwise."""
    names = [x for x in value.split(",") if x]
    bad = [x for x in names if x not in allowed]
    if not names or bad or len(set(names)) != len(names):
        raise SystemExit(f"wamkit bench cosmos3-sft: {flag} {value!r}; expected distinct names of {allowed}")
    return names


def run(args, device: torch.device, batches: list[int]) -> dict[str, Any]:
    """Build, prepare, print every row (and the profile); return the rows as plain data."""
    from wamkit.models.cosmos3 import ATTENTION_MODES
    from wamkit.models.cosmos3.packing import resolve_attention

    attentions = _choices("--attention", args.attention, ATTENTION_MODES)
    attentions = list(dict.fromkeys(resolve_attention(a, device) for a in attentions))
    paths = _choices("--paths", args.paths, PATHS)
    profiled = _choices("--profile-path", args.profile_path, PATHS)
    start = time.perf_counter()
    options = {"dtype": args.dtype, "gradient_checkpointing": args.gradient_checkpointing,
               "attention": attentions[0]}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        bench = SftBench(
            args.preset, args.image_size, device, options, Path(args.cache_dir or tmp) / "latents"
        )
        bench.loader_workers = getattr(args, "loader_workers", LOADER_WORKERS)
        compiled = getattr(args, "compile", False)
        if compiled:  # the trainer's regional compilation (train.compile): the warm-up steps compile
            compile_blocks(bench.ad)
        try:
            ad = bench.ad
            n_params = sum(p.numel() for p in ad.module.parameters())
            trained = sum(p.numel() for g in bench.groups for p in g.params)
            name = (
                torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else f"cpu, {torch.get_num_threads()} threads"
            )
            bench.prepare(batches)
            lat = list(bench.latents[batches[0]].shape[1:])
            print(
                f"cosmos3-sft/{args.preset}: {n_params / 1e9:.2f}B parameters ({trained / 1e9:.2f}B trained), "
                f"{args.dtype} weights{', bf16 autocast' if device.type == 'cuda' else ''}; {name}; latents {lat} "
                f"per sample; gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; "
                f"{'layers compiled; ' if compiled else ''}"
                f"attention {', '.join(attentions)}; built in "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
            print(
                f"{'path':<13} {'batch':>5}  {'ms/step':>8}  {'samples/s':>9}  {'MFU':>7}  {'peak GiB':>8}  "
                f"{'vs transf.':>9}  attention"
            )
            rows: list[Row] = []
            encode_s: dict[int, float] = {}
            for b in batches:
                grid = [(a, p) for a in attentions for p in paths]
                oom, batch_rows = warm(bench, b, args.warmup, grid), []
                for attention in attentions:
                    runs: dict[str, list[Row]] = {}
                    for _ in range(args.repeats):
                        for path in paths:
                            if (attention, path) not in oom:
                                runs.setdefault(path, []).append(
                                    measure(bench, path, b, args.steps, attention)
                                )
                    for path in paths:
                        if (attention, path) in oom:  # one row too big must not lose the others
                            print(
                                f"{path:<13} {b:>5}  out of memory (try --gradient-checkpointing)  {attention}"
                            )
                            continue
                        row = median_row(runs[path])
                        base = median_row(runs["transformer"]) if "transformer" in runs else None
                        if base is not None and path != "transformer":
                            row.vs_transformer = row.samples_per_s / base.samples_per_s
                        batch_rows.append(row)
                        _print_row(row)
                rows += batch_rows
                _print_attention_ratios(batch_rows, attentions)
                encode_s[b] = timed(lambda b=b: bench.encode(b), device, 2)
                print(f"{'':<13} VAE encode of {b} clips alone: {encode_s[b] * 1e3:.0f} ms", flush=True)
            if args.profile:
                pb = args.profile_batch or max(batches)
                bench.ad.processor.mode = attentions[-1]
                for path in profiled:
                    print(f"\nprofile: {path}, batch {pb}, {args.profile} steps, attention {attentions[-1]}")
                    print(profile_steps(bench, path, pb, args.profile, args.profile_rows), flush=True)
                    waits = host_waits(lambda path=path: bench.step(path, pb), device)
                    if waits:
                        print(waits, flush=True)
        finally:
            bench.close()  # the reader processes, before the cache folder goes
    return {
        "preset": args.preset,
        "device": name,
        "params": n_params,
        "trainable": trained,
        "flops_per_sample": ad.flops_per_sample(),
        "attention": attentions,
        "compiled": compiled,
        "rows": [asdict(r) for r in rows],
        "vae_encode_s": encode_s,
    }


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.repeats < 1:
        raise SystemExit(f"wamkit bench cosmos3-sft: --repeats {args.repeats}; expected >= 1")
    if not batches or min(batches) < 1:
        raise SystemExit(f"wamkit bench cosmos3-sft: --batches {args.batches!r}; expected sizes >= 1")
    start = time.perf_counter()
    results = run(args, device, batches)
    print(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def bench_sft(args, device: torch.device) -> dict[str, Any]:
    """``wamkit bench cosmos3 --sft``: the three rows at ``args.sft_batch`` for ``args.sft_preset``."""
    sub = argparse.Namespace(
        preset=args.sft_preset, image_size=args.image_size, steps=args.sft_steps, warmup=2, dtype="float32",
        gradient_checkpointing=False, attention="mask", paths=",".join(DEFAULT_PATHS), cache_dir=None, profile=0,
        profile_path="transformer",
    )  # fmt: skip
    return run(sub, device, [args.sft_batch])
