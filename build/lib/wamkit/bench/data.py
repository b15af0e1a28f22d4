"""``wamkit bench data ROOT``: reader samples/s per worker process against bare PyAV decoding.

Every measurement reads the same samples, in the same order, in this one process (what one DataLoader
worker does), in two orders:

- **random**: uniformly drawn rows. The reader builds full samples (the cameras + a 16-step action
  chunk with its padding mask + state + task); the bound seeks to each frame and decodes it with PyAV
  directly, nothing else (one colour converter reused, as a careful PyAV user would).
- **training**: the loader's own order (:class:`wamkit.data.loader.SampleStream`: file-local windows,
  each batch of ``--batch`` read in index order, as a worker reads it). The bound is the least decoding
  any reader could do for those batches: per batch and file, the frames sorted, each decoded once,
  seeking only across gaps of more than ``--gap`` frames.

The ratio reader_time / bare_time is the reader's overhead over decoding (target <= 1.25). The bare
figure with PyAV's per-call ``frame.to_ndarray(format="rgb24")`` (a new converter every frame, what
the bound used before) is printed too, for comparison with older results.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import VideoReformatter

from wamkit.constants import ACTION
from wamkit.data.dataset import LeRobotDataset
from wamkit.data.loader import DEFAULT_WINDOW, SampleStream

Targets = list[list[tuple[Path, float]]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="a LeRobot v3.0 or v2.1 dataset with at least one video camera")
    parser.add_argument("--samples", type=int, default=300, help="samples per measurement (default: 300)")
    parser.add_argument("--cameras", type=int, default=2, help="cameras per sample (default: 2)")
    parser.add_argument("--chunk", type=int, default=16, help="action chunk length (default: 16)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds; the best is kept (default: 2)"
    )
    parser.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW,
        help=f"the training order's window (default: {DEFAULT_WINDOW}, the loader's)",
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=32, help="the training order's batch (default: 32)")
    parser.add_argument("--gap", type=int, default=8, help="the sorted bound seeks across gaps above this")
    parser.add_argument("--seed", type=int, default=0)


def _targets(ds: LeRobotDataset, rows: np.ndarray) -> Targets:
    """Per sample, the (video file, timestamp) of each camera: what the bare decoder must produce."""
    return [[ds.video_target(key, int(row)) for key in ds.camera_keys] for row in rows]


def _open(path: Path, containers: dict) -> av.container.InputContainer:
    c = containers.get(path)
    if c is None:
        c = containers[path] = av.open(str(path))
        c.streams.video[0].thread_count = 1
    return c


def bare_decode(targets: Targets, tol: float = 1e-4, reuse_converter: bool = True) -> float:
    """Seconds to seek + decode every target frame to RGB with PyAV, files opened once (the bound)."""
    containers: dict[Path, av.container.InputContainer] = {}
    rgb = VideoReformatter()
    start = time.perf_counter()
    for per in targets:
        for path, ts in per:
            c = _open(path, containers)
            s = c.streams.video[0]
            c.seek(int(ts / s.time_base), stream=s, backward=True, any_frame=False)
            for frame in c.decode(s):
                if float(frame.pts * s.time_base) >= ts - tol:
                    if reuse_converter:
                        rgb.reformat(frame, format="rgb24").to_ndarray()
                    else:
                        frame.to_ndarray(format="rgb24")
                    break
    elapsed = time.perf_counter() - start
    for c in containers.values():
        c.close()
    return elapsed


def sorted_decode(targets: Targets, batch: int, gap: int, tol: float = 1e-4) -> float:
    """Seconds to decode, batch by batch, the distinct target frames of each file in time order, each
    once per batch, converting one RGB array per request (the least work for those batches: a loader
    can reorder only within a batch). Decodes on through gaps of up to ``gap`` frames, else seeks."""
    containers: dict[Path, av.container.InputContainer] = {}
    rgb = VideoReformatter()
    start = time.perf_counter()
    for b in range(0, len(targets), batch):
        wanted: dict[Path, Counter[float]] = defaultdict(Counter)
        for per in targets[b : b + batch]:
            for path, ts in per:
                wanted[path][round(ts, 6)] += 1
        for path, times in wanted.items():
            _decode_sorted(_open(path, containers), times, gap, tol, rgb)
    elapsed = time.perf_counter() - start
    for c in containers.values():
        c.close()
    return elapsed


def _decode_sorted(c, times: Counter[float], gap: int, tol: float, rgb: VideoReformatter) -> None:
    s = c.streams.video[0]
    dt = 1.0 / float(s.average_rate or 30)
    frames, last = None, None
    for ts in sorted(times):
        if frames is None or ts - last > gap * dt:  # type: ignore[operator]
            c.seek(int(ts / s.time_base), stream=s, backward=True, any_frame=False)
            frames = c.decode(s)
        for frame in frames:
            last = float(frame.pts * s.time_base)
            if last >= ts - tol:
                for _ in range(times[ts]):
                    rgb.reformat(frame, format="rgb24").to_ndarray()
                break


def training_order(size: int, n: int, batch: int, window: int, seed: int) -> np.ndarray:
    """The first ``n`` samples a one-process loader reads: its stream, each batch in index order."""
    stream = SampleStream([size], [1.0], seed, window).indices(0, n)
    return np.concatenate([sorted(stream[i : i + batch]) for i in range(0, n, batch)]).astype(np.int64)


def reader_time(root, cameras: list[str], chunk: int, rows: np.ndarray, fps: int) -> tuple[float, dict]:
    ds = LeRobotDataset(root, delta_timestamps={ACTION: [k / fps for k in range(chunk)]}, cameras=cameras)
    start = time.perf_counter()
    for row in rows:
        item = ds[int(row)]
    return time.perf_counter() - start, item


def _best(measure, rounds: int) -> float:
    return min(measure() for _ in range(max(1, rounds)))


def main(args: argparse.Namespace) -> int:
    probe = LeRobotDataset(args.root)
    cams = [k for k in probe.camera_keys if k in probe.meta.video_keys][: args.cameras]
    if not cams:
        print(f"wamkit bench data: {args.root} has no video cameras")
        return 1
    probe = LeRobotDataset(args.root, cameras=cams)
    n, fps = args.samples, probe.fps
    orders = {
        "random": np.random.default_rng(args.seed).integers(0, len(probe), size=n),
        "training": training_order(len(probe), n, args.batch, args.window, args.seed),
    }
    reader_time(args.root, cams, args.chunk, orders["random"][:10], fps)  # warm-up: imports, page cache
    results = {}
    for name, rows in orders.items():
        targets = _targets(probe, rows)
        bare, reader = [], []
        for _ in range(max(1, args.rounds)):  # alternate, so both sides see the same machine load
            bare.append(
                bare_decode(targets) if name == "random" else sorted_decode(targets, args.batch, args.gap)
            )
            t, item = reader_time(args.root, cams, args.chunk, rows, fps)
            reader.append(t)
        results[name] = (min(bare), min(reader))
    naive = _best(lambda: bare_decode(_targets(probe, orders["random"]), reuse_converter=False), args.rounds)
    shape = tuple(item[cams[0]].shape)
    print(f"dataset {args.root}: {len(probe)} frames, {probe.num_episodes} episodes, {fps} fps")
    print(f"{n} samples x {len(cams)} cameras {shape} + {args.chunk}-step action chunk, one process")
    print(f"  random order, bare PyAV (to_ndarray per frame)  : {n / naive:8.1f} samples/s")
    for name, (b, r) in results.items():
        bound = "seek+decode each" if name == "random" else "sorted, once per batch"
        label = f"{name} order (window {args.window})" if name == "training" else "random order"
        print(f"  {label}, bare PyAV ({bound}): {n / b:8.1f} samples/s  ({1e3 * b / n:.2f} ms/sample)")
        print(f"  {label}, wamkit LeRobotDataset  : {n / r:8.1f} samples/s  ({1e3 * r / n:.2f} ms/sample)")
        print(f"  {label}, reader / bare time     : {r / b:8.3f}  (overhead {100 * (r / b - 1):+.1f}%; target <= +25%)")  # fmt: skip
    return 0
