"""The trainer's view of the data stage: ModelIO, stats file and a resumable loader from a dataset.

The ModelIO comes from the dataset (cameras, image size, state dim; action dim after the
representation change), the chunk and representation from ``data.*``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from wamkit.actions.codec import ActionCodec, to_representation
from wamkit.actions.stats import StatsFile
from wamkit.config import ConfigError, RunConfig
from wamkit.constants import ACTION, OBS_STATE, camera_of
from wamkit.models.base import ModelIO

log = logging.getLogger(__name__)


def first_dataset_root(cfg: RunConfig) -> Path:
    root = Path(cfg.data.root)
    return root / cfg.data.suites[0] if cfg.data.suites else root


def io_from_dataset(cfg: RunConfig, features: dict[str, Any], source: str) -> ModelIO:
    """ModelIO of a LeRobot v3 ``features`` mapping (``meta/info.json``) under ``cfg.data``."""
    cams = [c for c in (camera_of(k) for k in features) if c is not None]
    if cfg.data.cameras:
        missing = [c for c in cfg.data.cameras if c not in cams]
        if missing:
            raise ConfigError(f"data.cameras: {missing} not in {source} (it has cameras {cams})")
        cams = list(cfg.data.cameras)
    if not cams:
        raise ConfigError(f"{source}: no camera features (observation.images.*)")
    for key in (OBS_STATE, ACTION):
        if key not in features:
            raise ConfigError(f"{source}: no '{key}' feature")
    size = int(features[f"observation.images.{cams[0]}"]["shape"][0])
    raw_dim = int(features[ACTION]["shape"][0])
    action_dim = to_representation(np.zeros((1, raw_dim)), cfg.data.representation).shape[-1]
    return ModelIO(
        cameras=tuple(cams),
        image_size=size,
        state_dim=int(features[OBS_STATE]["shape"][0]),
        action_dim=int(action_dim),
        chunk=cfg.data.chunk,
        representation=cfg.data.representation,
    )


def resolve_stats(cfg: RunConfig, run_dir: Path, fps: float, is_main: bool) -> Path:
    """The run's stats file, copied to ``run_dir/stats.json``: ``data.stats``, else the dataset's
    ``meta/wamkit_stats.json``, else computed now (rank 0; the other ranks wait)."""
    from wamkit.data import compute_stats

    out = run_dir / "stats.json"
    given = Path(cfg.data.stats) if cfg.data.stats else Path(cfg.data.root) / "meta" / "wamkit_stats.json"
    if is_main:
        if given.is_file():
            shutil.copyfile(given, out)
        elif cfg.data.stats:
            raise ConfigError(f"data.stats: {given} does not exist")
        else:
            log.info("computing stats of %s into %s", cfg.data.root, out)
            compute_stats(cfg.data.root, cfg.data.representation, cfg.data.chunk, cfg.data.seed).save(out)
    if dist.is_initialized():
        dist.barrier()
    stats = StatsFile.load(out, representation=cfg.data.representation)
    if "fps" in stats.metadata:  # stats of 20 FPS data do not fit 10 FPS data
        stats.check(source=str(out), fps=fps)
    return out


def build_data(cfg: RunConfig, rank: int, world_size: int, run_dir: Path):
    """Return ``(io, stats_path, loader, make_loader)`` from ``wamkit.data``.

    ``make_loader(future_frames)`` builds the loader; it is separate because whether a model wants
    future frames is known only once the model is built from ``io``.
    """
    from wamkit.data import LeRobotDataset, make_train_dataset, make_train_loader

    root = first_dataset_root(cfg)
    ds = LeRobotDataset(root)
    io = io_from_dataset(cfg, ds.features, str(root / "meta" / "info.json"))
    stats_path = resolve_stats(cfg, run_dir, ds.fps, rank == 0)
    codec = ActionCodec(StatsFile.load(stats_path), cfg.data.normalization, cfg.data.clip)

    def make_loader(future_frames: bool):
        dataset = make_train_dataset(cfg.data, io, codec, future_frames=future_frames)
        return make_train_loader(
            dataset, cfg.train.micro_batch, cfg.data.seed, cfg.data.num_workers, rank, world_size
        )

    return io, stats_path, make_loader
