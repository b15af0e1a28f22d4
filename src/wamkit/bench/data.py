"""``wamkit bench data ROOT``: reader samples/s per worker process against bare PyAV decoding.

Both sides read the same random samples, in the same order, in this one process (one DataLoader
worker does exactly this): the reader builds full samples (2 cameras + a 16-step action chunk with its
padding mask + state + task); the bound seeks and decodes the same frames with PyAV directly, nothing
else. The ratio reader_time / bare_time is the reader's overhead over decoding (target <= 1.25).
"""

from __future__ import annotations

import argparse
import time

import av
import numpy as np

from wamkit.constants import ACTION
from wamkit.data.dataset import LeRobotDataset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="a LeRobot v3 dataset with at least one video camera")
    parser.add_argument(
        "--samples", type=int, default=300, help="random samples per measurement (default: 300)"
    )
    parser.add_argument("--cameras", type=int, default=2, help="cameras per sample (default: 2)")
    parser.add_argument("--chunk", type=int, default=16, help="action chunk length (default: 16)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating rounds; the best is kept (default: 2)"
    )
    parser.add_argument("--seed", type=int, default=0)


def _targets(ds: LeRobotDataset, rows: np.ndarray) -> list[list[tuple[str, float]]]:
    """Per sample, the (video file, timestamp) of each camera: what the bare decoder must produce."""
    out = []
    for row in rows:
        ep = int(ds._ep_of_row[row])
        frame = int(row) - ds.episode_bounds(int(row))[0]
        info = ds.meta.episodes[ep]
        per = []
        for key in ds.camera_keys:
            chunk, file, from_ts, _ = info.videos[key]
            per.append((str(ds.meta.video_path(key, chunk, file)), from_ts + frame / ds.fps))
        out.append(per)
    return out


def bare_decode(targets: list[list[tuple[str, float]]], tol: float = 1e-4) -> float:
    """Seconds to seek + decode every target frame to RGB with PyAV, files opened once (the bound)."""
    containers: dict[str, av.container.InputContainer] = {}
    start = time.perf_counter()
    for per in targets:
        for path, ts in per:
            c = containers.get(path)
            if c is None:
                c = containers[path] = av.open(path)
                c.streams.video[0].thread_count = 1
            s = c.streams.video[0]
            c.seek(int(ts / s.time_base), stream=s, backward=True, any_frame=False)
            for frame in c.decode(s):
                if float(frame.pts * s.time_base) >= ts - tol:
                    frame.to_ndarray(format="rgb24")
                    break
    elapsed = time.perf_counter() - start
    for c in containers.values():
        c.close()
    return elapsed


def reader_time(root, cameras: list[str], chunk: int, rows: np.ndarray) -> tuple[float, dict]:
    ds = LeRobotDataset(
        root, delta_timestamps={ACTION: [k / _fps(root) for k in range(chunk)]}, cameras=cameras
    )
    start = time.perf_counter()
    for row in rows:
        item = ds[int(row)]
    return time.perf_counter() - start, item


def _fps(root) -> int:
    from wamkit.data.meta import DatasetMeta

    return DatasetMeta(root).fps


def main(args: argparse.Namespace) -> int:
    probe = LeRobotDataset(args.root)
    cams = [k for k in probe.camera_keys if k in probe.meta.video_keys][: args.cameras]
    if not cams:
        print(f"wamkit bench data: {args.root} has no video cameras")
        return 1
    probe = LeRobotDataset(args.root, cameras=cams)
    rows = np.random.default_rng(args.seed).integers(0, len(probe), size=args.samples)
    targets = _targets(probe, rows)
    reader_time(args.root, cams, args.chunk, rows[:10])  # warm-up: imports, page cache
    bare_decode(targets[:10])
    bare, reader = [], []
    for _ in range(max(1, args.rounds)):
        bare.append(bare_decode(targets))
        t, item = reader_time(args.root, cams, args.chunk, rows)
        reader.append(t)
    b, r = min(bare), min(reader)
    n = args.samples
    shape = tuple(item[cams[0]].shape)
    print(f"dataset {args.root}: {len(probe)} frames, {probe.num_episodes} episodes, {probe.fps} fps")
    print(f"{n} random samples x {len(cams)} cameras {shape} + {args.chunk}-step action chunk, one process")
    print(f"  bare PyAV seek+decode  : {n / b:8.1f} samples/s  ({1e3 * b / n:.2f} ms/sample)")
    print(f"  wamkit LeRobotDataset  : {n / r:8.1f} samples/s  ({1e3 * r / n:.2f} ms/sample)")
    print(f"  reader / bare time     : {r / b:8.3f}  (overhead {100 * (r / b - 1):+.1f}%; target <= +25%)")
    return 0
