"""``wamkit bench cosmos3``: Cosmos3 policy inference, stock and fast paths side by side in one run.

The model is a size preset with random weights (``nano``: Cosmos3-Nano's shape, 36 layers, hidden
4096; ~15.2B parameters) on requests of its recipe's embodiment: two ``--image-size`` views side by side, a
task of its benchmark suite per request (four different tasks, so a batch mixes prompt lengths), a 16-step chunk. For each
batch size every path predicts the very same batch with the same seed:

- ``stock``: diffusers' ``Cosmos3OmniTransformer.forward`` over the packed requests (text and
  generation tokens every step; packed attention by ``--stock-attention``);
- ``fast``: cached text keys/values, requests on a batch axis (``models/cosmos3/kv_step.py``), eager;
- ``fast+cuda_graph`` / ``fast+compile``: the fast step captured per batch bucket (CUDA only);
  ``fast+compile`` masks each request's text padding inside a flex-attention kernel (grouped-query),
  ``fast+compile_sdpa`` compiles the SDPA step instead (text keys/values expanded to every head);
- ``fast+rtc``: the fast path with real-time chunking (``wamkit.models.rtc``): every request carries
  half a chunk of leftover actions, a quarter of them committed, and each denoising step adds a
  vector-Jacobian product through the step (eager: a captured graph cannot be differentiated). Its
  ``max|da|`` is the guidance's effect, not an error; its cost beside ``fast`` is what RTC costs.

Columns: seconds per prediction (``--steps`` denoising steps, VAE encode included), obs/s, ms per
denoising step (the step function alone, median of 5 calls), TFLOP/s of the transformer work that path does per step (the fast path skips the text
tokens), peak GPU memory during the prediction, obs/s over stock's at that batch, and the largest
action difference from stock (a check: bf16 rounding gives ~1e-2, a broken path ~1), and the ms a
prediction spends before its steps (VAE encode of the observations, the requests' segments, the step
function and its text keys/values): s/pred minus steps × ms/step minus that is the sampler's own work.

``--profile`` prints a ``torch.profiler`` summary of one denoising step per path (top ops by device
time on CUDA, CPU time otherwise). ``--sft`` adds the SFT benchmark of :mod:`wamkit.bench.cosmos3_sft`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from wamkit.bench.timing import profile_table, timed
from wamkit.device import resolve_device
from wamkit.models.cosmos3 import ATTENTION_MODES

TASKS = [
    "put both the alphabet soup and the tomato sauce in the basket",
    "turn on the stove and put the moka pot on it",
    "put the black bowl in the bottom drawer of the cabinet and close it",
    "pick up the book and place it in the back compartment of the caddy",
]
PATHS = ("stock", "fast", "fast+cuda_graph", "fast+compile", "fast+compile_sdpa", "fast+compile_layers",
         "fast+compile+fp8", "fast+compile+fp8_torchao", "fast+rtc")  # fmt: skip
RTC = "fast+rtc"
FP8 = "fast+compile+fp8"  # the generation tower's linears in FP8 (serve.precision=fp8): run after the others
# the same layers through torchao's float8 recipe (the model rebuilt for it when FP8 ran before)
FP8_TORCHAO = "fast+compile+fp8_torchao"
FP8_BACKENDS = {FP8: "scaled_mm", FP8_TORCHAO: "torchao"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="nano", help="cosmos3 size preset (default: nano; tiny for a check)"
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (auto: cuda if available)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32"
    )
    parser.add_argument("--steps", type=int, default=30, help="denoising steps per prediction (default: 30)")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default: 1,8,32)")
    parser.add_argument(
        "--paths",
        default="auto",
        help=f"comma-separated, from {', '.join(PATHS)} (auto: stock,fast and on CUDA fast+cuda_graph)",
    )
    parser.add_argument(
        "--stock-attention",
        default="loop",
        choices=ATTENTION_MODES,
        help="the stock path's packed attention (model.options.attention; default: loop, the stock "
        "rows' baseline; auto, the model's default, is flex on CUDA)",
    )
    parser.add_argument("--image-size", type=int, default=256, help="camera image size (default: 256)")
    parser.add_argument("--repeats", type=int, default=1, help="timed predictions per row (default: 1)")
    parser.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="profile one denoising step of each path")
    parser.add_argument(
        "--profile-batch", type=int, default=0, help="batch to profile (default: the largest)"
    )
    parser.add_argument("--profile-rows", type=int, default=15, help="ops listed per profile")
    parser.add_argument(
        "--sft", action="store_true", help="also SFT samples/s and MFU (wamkit.bench.cosmos3_sft)"
    )
    parser.add_argument("--sft-preset", default="nano_l8", help="preset of the SFT benchmark")
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-steps", type=int, default=4)
    parser.add_argument(
        "--accuracy",
        type=int,
        default=0,
        metavar="N",
        help="instead of the timed rows: N requests of the served shape (two cameras, 8-D state) predicted in fp32 (eager fast path), "
        "bf16 (fast+compile, the weights cast) and FP8 (fast+compile+fp8); the action and future-latent "
        "differences between them",
    )
    parser.add_argument("--json", help="write every row here")


@dataclass
class Row:
    path: str
    batch: int
    s_per_pred: float
    obs_per_s: float
    ms_per_step: float
    tflops: float
    peak_gib: float | None
    vs_stock: float | None = None
    max_action_diff: float | None = None
    stock_action_max: float | None = None  # the stock actions' largest magnitude: the diff's scale
    prepare_ms: float | None = None  # the prediction's work before the steps (VAE encode, requests)


def make_batch(io, b: int, seed: int = 0) -> dict[str, Any]:
    """B synthetic requests: random uint8 views, zero state, the four TASKS in turn."""
    from wamkit.constants import OBS_STATE, TASK, image_key

    rng = np.random.default_rng(seed)
    s = io.image_size
    batch: dict[str, Any] = {
        image_key(c): torch.from_numpy(rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8)) for c in io.cameras
    }
    batch[OBS_STATE] = torch.zeros(b, io.state_dim)
    batch[TASK] = [TASKS[i % len(TASKS)] for i in range(b)]
    return batch


def _use_path(ad, path: str, stock_attention: str) -> None:
    """Point the adapter at one path (the same weights and caches; FP8 quantizes them, for good)."""
    if path in FP8_BACKENDS and not ad.fp8:
        ad.use_fp8(FP8_BACKENDS[path])
    ad.options.fast_inference = path != "stock"
    graph = path.split("+")[1] if "+" in path and path != RTC else "none"
    if path in FP8_BACKENDS:  # as served: the default step (one compiled layer, the step captured)
        graph = "compile_layers"
    # fast+compile masks the text padding in a flex-attention kernel; fast+compile_sdpa keeps the
    # captured SDPA step (text keys/values expanded to every head), for comparison
    ad.fast.step_graph, ad.fast.attention = (
        graph.removesuffix("_sdpa"),
        "sdpa" if graph.endswith("_sdpa") else "auto",
    )
    ad.processor.mode = stock_attention


def request_flops(ad) -> tuple[float, float]:
    """Transformer FLOPs of one step of one nominal request: ``(understanding, generation)``. Counted
    before FP8 swaps the linear layers the count walks (they do the same matmuls)."""
    from wamkit.models.cosmos3.towers import forward_flops

    lay = ad.nominal_layout()
    return forward_flops(ad.module, lay.und_len, lay.sequence_length - lay.und_len)


def _step_flops(per_request: tuple[float, float], path: str, b: int) -> float:
    """Transformer FLOPs of one step for B nominal requests: the fast path runs no text tokens."""
    und, gen = per_request
    return b * (gen if path != "stock" else und + gen)


def rtc_rows(ad, b: int) -> dict[str, np.ndarray]:
    """Real-time chunking inputs for B requests: half a chunk of leftover actions (zeros, model space),
    a quarter of the chunk committed, the paper's mask and clip."""
    from wamkit.models.rtc import request_rows

    h, dim = ad.io.chunk, ad.io.action_dim
    return request_rows([np.zeros((h // 2, dim), np.float32)] * b, [h // 4] * b, h, dim)


def _predict(ad, batch, steps: int, path: str = "") -> dict[str, np.ndarray]:
    ad.options.num_inference_steps = steps
    extra = {"rtc": rtc_rows(ad, len(batch["task"]))} if path == RTC else {}
    return ad.predict(batch, seed=0, **extra)


@torch.no_grad()
def step_inputs(ad, batch: dict):
    """The step function ``predict`` would run for ``batch`` (the adapter's current path), and inputs of
    its shapes: ``(velocity, lat_v, lat_a, t)``."""
    prep = ad._prepare(batch, "policy", {})
    b, c, _, h, w = prep.x0.shape
    dev = prep.x0.device
    lat_v = torch.randn(b, c, ad._latent_frames(), h, w, device=dev)
    lat_a = torch.randn(b, ad.io.chunk, ad.io.action_dim, device=dev)
    return prep.velocity, lat_v, lat_a, torch.tensor(500.0, device=dev)


@torch.no_grad()
def step_seconds(ad, batch: dict, device: torch.device, calls: int = 5, guided: bool = False) -> float:
    """Median seconds of one denoising step (the step function alone, after a warm-up call); ``guided``:
    the real-time chunking step (the velocity and its vector-Jacobian product)."""
    velocity, lat_v, lat_a, t = step_inputs(ad, batch)
    step = lambda: velocity(lat_v, lat_a, t)  # noqa: E731
    if guided:
        from wamkit.models.rtc import guide_input

        b = len(batch["task"])
        guide = guide_input(rtc_rows(ad, b), "policy", b, ad.io.chunk, ad.io.action_dim, ad.device)
        step = lambda: ad._guided(velocity, lat_v, lat_a, t, guide)  # noqa: E731
    step()
    return float(np.median([timed(step, device) for _ in range(calls)]))


def measure(ad, path: str, batch: dict, args, device: torch.device, per_request) -> tuple[Row, np.ndarray]:
    """One row: a warm-up prediction (kernels, caches, graph capture), the timed ones, the step alone."""
    b = len(batch["task"])
    _predict(ad, batch, 2, path)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out: dict[str, np.ndarray] = {}
    full = timed(lambda: out.update(_predict(ad, batch, args.steps, path)), device, args.repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    step_s = step_seconds(ad, batch, device, guided=path == RTC)
    flops = _step_flops(per_request, path, b)
    row = Row(path, b, full, b / full, step_s * 1e3, flops / step_s / 1e12, peak)
    row.prepare_ms = prepare_seconds(ad, batch, device) * 1e3
    return row, out["actions"]


@torch.no_grad()
def prepare_seconds(ad, batch: dict, device: torch.device, calls: int = 3) -> float:
    """Median seconds of a prediction's work before its denoising steps: the observations through the
    VAE, the requests' segments, the step function chosen (text keys/values from the cache)."""
    return float(np.median([timed(lambda: ad._prepare(batch, "policy", {}), device) for _ in range(calls)]))


@torch.no_grad()
def profile_step(ad, batch: dict, rows: int, device: torch.device) -> str:
    """A torch.profiler table of one denoising step of the adapter's current path."""
    velocity, lat_v, lat_a, t = step_inputs(ad, batch)
    return profile_table(lambda: velocity(lat_v, lat_a, t), device, rows)


def _paths(args, device: torch.device) -> list[str]:
    if args.paths == "auto":
        return ["stock", "fast"] + (["fast+cuda_graph"] if device.type == "cuda" else [])
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"wamkit bench cosmos3: unknown path {unknown[0]!r}; expected {', '.join(PATHS)}")
    fp8 = [p for p in paths if p in FP8_BACKENDS]
    if fp8:
        from wamkit.models.fp8 import unsupported

        why = unsupported(device)
        if why:
            raise SystemExit(f"wamkit bench cosmos3: --paths {fp8[0]}: {why}")
    return paths


def _print_row(r: Row) -> None:
    peak = f"{r.peak_gib:>8.1f}" if r.peak_gib is not None else f"{'-':>8}"
    vs = f"{r.vs_stock:>7.2f}x" if r.vs_stock is not None else f"{'-':>8}"
    diff = f"{r.max_action_diff:>9.1e}" if r.max_action_diff is not None else f"{'-':>9}"
    prep = f"{r.prepare_ms:>8.1f}" if r.prepare_ms is not None else f"{'-':>8}"
    print(
        f"{r.path:<16} {r.batch:>5}  {r.s_per_pred:>8.3f}  {r.obs_per_s:>7.2f}  {r.ms_per_step:>8.1f}  "
        f"{r.tflops:>7.1f}  {peak}  {vs}  {diff}  {prep}",
        flush=True,
    )


def build(args, device: torch.device):
    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import DEFAULT_IO

    io = dataclasses.replace(DEFAULT_IO, image_size=args.image_size)
    opts = {"dtype": args.dtype, "num_inference_steps": args.steps}
    return build_model(ModelConfig(name="cosmos3", preset=args.preset, options=opts), io, device=device)


def _diff(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return {"max": float(d.max()), "mean": float(d.mean())}


@torch.no_grad()
def accuracy(args, device: torch.device) -> dict[str, Any]:
    """FP8 against bf16, and bf16 against fp32 (the yardstick of what rounding alone does), over
    ``args.accuracy`` requests of the recipe's shape: the same weights (built in fp32, then cast to bf16, then
    the generation tower quantized), the same seeds. Actions in the model's normalised space; latents:
    the generated future frames."""
    from wamkit.models.cosmos3.components import _cast

    n, per = args.accuracy, 32
    ad = build(argparse.Namespace(**{**vars(args), "dtype": "float32"}), device)
    ad.options.num_inference_steps = args.steps
    batches = [make_batch(ad.io, min(per, n - i), seed=100 + i) for i in range(0, n, per)]

    def run(path: str) -> tuple[np.ndarray, np.ndarray]:
        _use_path(ad, path, args.stock_attention)
        t0 = time.perf_counter()
        outs = [ad.predict(b, seed=i, return_latents=True) for i, b in enumerate(batches)]
        print(f"  {path} ({ad.dtype}): {n} requests in {time.perf_counter() - t0:.0f} s", flush=True)
        return (
            np.concatenate([o["actions"] for o in outs]),
            np.concatenate([o["latents"][:, :, 1:] for o in outs]),
        )

    fp32 = run("fast")
    _cast(ad.module, torch.bfloat16)
    ad.fast.clear()
    bf16 = run("fast+compile")
    fp8 = run(FP8)
    out = {"requests": n, "steps": args.steps}
    print(
        f"{'pair':<14} {'max|da|':>9} {'mean|da|':>9} {'max|dz|':>9} {'mean|dz|':>9}   (normalised actions a, future latents z)"
    )
    for name, (x, y) in {
        "bf16 vs fp32": (bf16, fp32),
        "fp8 vs bf16": (fp8, bf16),
        "fp8 vs fp32": (fp8, fp32),
    }.items():
        da, dz = _diff(x[0], y[0]), _diff(x[1], y[1])
        out[name] = {"actions": da, "latents": dz}
        print(
            f"{name:<14} {da['max']:>9.2e} {da['mean']:>9.2e} {dz['max']:>9.2e} {dz['mean']:>9.2e}",
            flush=True,
        )
    return out


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.accuracy:
        results = accuracy(args, device)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    paths = _paths(args, device)
    batches = [int(b) for b in args.batches.split(",") if b]
    start = time.perf_counter()
    ad = build(args, device)
    n_params = sum(p.numel() for p in ad.module.parameters())
    gib = sum(p.numel() * p.element_size() for p in ad.module.parameters()) / 2**30
    lay = ad.nominal_layout()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu, {torch.get_num_threads()} threads"
    )
    print(
        f"cosmos3/{args.preset}: {n_params / 1e9:.2f}B parameters ({gib:.1f} GiB {ad.dtype}), built in "
        f"{time.perf_counter() - start:.0f} s; {name}; {args.steps} denoising steps; a request is "
        f"{lay.und_len} text + {lay.sequence_length - lay.und_len} generation tokens; stock attention "
        f"{args.stock_attention}",
        flush=True,
    )
    print(
        f"{'path':<16} {'batch':>5}  {'s/pred':>8}  {'obs/s':>7}  {'ms/step':>8}  {'TFLOP/s':>7}  "
        f"{'peak GiB':>8}  {'vs stock':>8}  {'max|da|':>9}  {'prep ms':>8}"
    )
    rows: list[Row] = []
    stock: dict[int, tuple[Row, np.ndarray]] = {}
    per_request = request_flops(ad)
    # the FP8 rows last, every batch, and each group profiled before the next: quantizing the weights
    # cannot be undone
    for group in ([p for p in paths if p not in FP8_BACKENDS], [p for p in paths if p == FP8],
                  [p for p in paths if p == FP8_TORCHAO]):  # fmt: skip
        if not group:
            continue
        if group[0] == FP8_TORCHAO and ad.fp8:  # the same weights again, quantized the other way
            del ad
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            ad = build(args, device)
        for b in batches:
            batch = make_batch(ad.io, b)
            for path in group:
                _use_path(ad, path, args.stock_attention)
                row, actions = measure(ad, path, batch, args, device, per_request)
                if path == "stock":
                    stock[b] = (row, actions)
                elif b in stock:
                    row.vs_stock = row.obs_per_s / stock[b][0].obs_per_s
                    row.max_action_diff = float(np.abs(actions - stock[b][1]).max())
                    row.stock_action_max = float(np.abs(stock[b][1]).max())
                rows.append(row)
                _print_row(row)
        if args.profile:
            pb = args.profile_batch or max(batches)
            for path in group:
                _use_path(ad, path, args.stock_attention)
                print(f"\nprofile: {path}, batch {pb}, one denoising step")
                print(profile_step(ad, make_batch(ad.io, pb), args.profile_rows, device), flush=True)
    results: dict[str, Any] = {"preset": args.preset, "device": name, "steps": args.steps, "params": n_params}
    results["rows"] = [asdict(r) for r in rows]
    if args.sft:
        from wamkit.bench.cosmos3_sft import bench_sft

        del ad
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results["sft"] = bench_sft(args, device)
    print(f"done in {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0
