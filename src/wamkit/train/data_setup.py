"""The trainer's view of the data stage: ModelIO, the preprocessing spec and a resumable loader.

The ModelIO comes from the dataset (cameras, image size, state dim; action dim after the
representation change), the chunk and representation from ``data.*``. The spec (stats, normalisation,
clipping, gripper convention, resize, camera order) is built once here, written to
``<run_dir>/preprocess.json`` and from there into every checkpoint; the loader runs that very object.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from wamkit import embodiments
from wamkit.actions.representations import get_representation
from wamkit.actions.spec import PreprocessSpec
from wamkit.actions.stats import StatsFile
from wamkit.config import ConfigError, EnvConfig, RunConfig
from wamkit.constants import ACTION, OBS_STATE, camera_of, image_key
from wamkit.files import SPEC_FILE, STATS_FILE
from wamkit.models.base import LATENT_CACHE_OPTION, CachesLatents, ModelAdapter, ModelIO

log = logging.getLogger(__name__)


def dataset_roots(cfg: RunConfig) -> list[Path]:
    """The dataset folders the run trains on: ``data.suites`` under ``data.root``, ``data.root``
    itself, or the sub-folders of ``data.root`` that hold one (:func:`wamkit.data.sft_dataset.suite_roots`).
    A root that is not a folder comes back as itself, for the reader to name what is missing."""
    root = Path(cfg.data.root)
    if not cfg.data.suites and (not root.is_dir() or (root / "meta" / "info.json").is_file()):
        return [root]
    from wamkit.data.sft_dataset import suite_roots

    return list(suite_roots(cfg.data).values())


def first_dataset_root(cfg: RunConfig) -> Path:
    return dataset_roots(cfg)[0]


def io_from_dataset(
    cfg: RunConfig, features: dict[str, Any], source: str, robot_type: str | None = None
) -> ModelIO:
    """ModelIO of a LeRobot v3 ``features`` mapping (``meta/info.json``) under ``cfg.data``.
    ``robot_type``: the dataset's (its ``info.json``'s), checked against ``env.suite``'s embodiment."""
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
    size = int(features[image_key(cams[0])]["shape"][0])
    raw_dim = int(features[ACTION]["shape"][0])
    state_dim = int(features[OBS_STATE]["shape"][0])
    profile = embodiments.for_suite(cfg.env.suite)
    _check_embodiment(cfg, profile, robot_type, state_dim, raw_dim, source)
    try:
        action_dim = get_representation(cfg.data.representation).model_dim(raw_dim)
    except ValueError as err:
        raise ConfigError(f"data.representation: {err} ({source})") from None
    return ModelIO(
        cameras=tuple(cams),
        image_size=size,
        state_dim=state_dim,
        action_dim=int(action_dim),
        chunk=cfg.data.chunk,
        representation=cfg.data.representation,
        embodiment=profile.name if profile else "",
    )


def _check_embodiment(
    cfg: RunConfig, profile, robot_type: str | None, state_dim: int, action_dim: int, source: str
) -> None:
    """Refuse data of one robot trained as another's: ``env.suite`` set to a suite whose embodiment is
    not the dataset's (its ``robot_type`` names another registered embodiment) and whose state and
    action sizes are not the data's. ``env.suite`` left at its default (MetaWorld) names no embodiment
    on purpose, so data of any robot trains as before."""
    if profile is None or not robot_type or cfg.env.suite == EnvConfig().suite:
        return
    owner = next((e for e in map(embodiments.get, embodiments.names()) if e.robot_type == robot_type), None)
    if owner is None or owner.name == profile.name:
        return
    if (state_dim, action_dim) != (profile.state_dim, profile.action_dim):
        raise ConfigError(
            f"env.suite={cfg.env.suite}: {source} is {owner.name} data (robot_type '{robot_type}', state "
            f"{state_dim}, action {action_dim}); the {profile.name} embodiment takes state "
            f"{profile.state_dim}, action {profile.action_dim}: set env.suite to one of {owner.name}'s "
            f"suites ({', '.join(owner.suites)})"
        )


def resolve_stats(cfg: RunConfig, run_dir: Path, fps: float, is_main: bool) -> Path:
    """The run's stats file, copied to ``run_dir/stats.json``: ``data.stats``, else the dataset's
    ``meta/wamkit_stats.json``, else computed now (rank 0; the other ranks wait)."""
    from wamkit.data import compute_stats

    out = run_dir / STATS_FILE
    given = Path(cfg.data.stats) if cfg.data.stats else Path(cfg.data.root) / "meta" / "wamkit_stats.json"
    if is_main:
        if given.is_file():
            # checked where it lies, so a mismatch names the file the user gave, not the run's copy
            check = StatsFile.load(given, representation=cfg.data.representation)
            if "fps" in check.metadata:
                check.check(source=str(given), fps=fps)
            shutil.copyfile(given, out)
        elif cfg.data.stats:
            raise ConfigError(f"data.stats: {given} does not exist")
        elif len(roots := dataset_roots(cfg)) > 1:
            raise ConfigError(
                f"data.stats: the run trains on {len(roots)} datasets ({', '.join(r.name for r in roots)}) and "
                f"normalises them with one stats file, which is not given and not at {given}: give "
                "data.stats=FILE (a cosmos normalizer JSON reads as it is: docs/cosmos3.md) or put "
                f"one at {given}"
            )
        else:
            log.info("computing stats of %s into %s", roots[0], out)
            compute_stats(roots[0], cfg.data.representation, cfg.data.chunk, cfg.data.seed).save(out)
    if dist.is_initialized():
        dist.barrier()
    stats = StatsFile.load(out, representation=cfg.data.representation)
    if "fps" in stats.metadata:  # stats of 20 FPS data do not fit 10 FPS data
        stats.check(source=str(out), fps=fps)
    return out


def build_spec(cfg: RunConfig, io: ModelIO, stats: StatsFile) -> PreprocessSpec:
    """The preprocessing spec of this run: ``data.*`` settings, the stats, the model's camera order."""
    return PreprocessSpec.create(
        stats,
        normalization=cfg.data.normalization,
        clip=cfg.data.clip,
        image_size=io.image_size,
        resize=cfg.data.resize,
        cameras=io.cameras,
        camera_sources=[image_key(c) for c in (cfg.data.cameras or io.cameras)],
        chunk=cfg.data.chunk,
        gripper=cfg.data.gripper or None,
        state_dim=io.state_dim,
    )


def latent_cache_of(cfg: RunConfig, adapter: ModelAdapter) -> str:
    """``model.options.latent_cache`` ("" for none); a model that reads no latent cache is refused."""
    folder = str(cfg.model.options.get(LATENT_CACHE_OPTION) or "")
    if folder and not isinstance(adapter, CachesLatents):
        raise ConfigError(
            f"model.options.{LATENT_CACHE_OPTION}: model {adapter.name!r} reads no latent cache (only "
            "models with cached training targets do, e.g. cosmos3); remove the option"
        )
    return folder


def build_data(cfg: RunConfig, rank: int, world_size: int, run_dir: Path):
    """Return ``(io, spec_path, make_loader)`` from ``wamkit.data``.

    ``make_loader(future_offsets, extras, adapter)`` builds the loader; it is separate because which
    future frames and per-sample extras a model wants is known only once the model is built from
    ``io``. With ``model.options.latent_cache`` the adapter's ``latent_dataset`` gives samples that carry
    the cached targets instead of the future frames (:class:`wamkit.models.base.CachesLatents`).
    """
    from wamkit.data import LeRobotDataset, make_train_dataset, make_train_loader

    root = first_dataset_root(cfg)
    if not (Path(root) / "meta" / "info.json").is_file():
        raise ConfigError(
            f"data.root: {root} holds no LeRobot dataset (no meta/info.json there); set data.root=DIR to a "
            "dataset's folder (wamkit collect writes one)"
        )
    ds = LeRobotDataset(root)
    io = io_from_dataset(cfg, ds.features, str(root / "meta" / "info.json"), ds.meta.info.get("robot_type"))
    stats_path = resolve_stats(cfg, run_dir, ds.fps, rank == 0)
    spec = build_spec(cfg, io, StatsFile.load(stats_path))
    spec_path = run_dir / SPEC_FILE
    if rank == 0:
        spec.save(spec_path)

    def make_loader(future_offsets: tuple[int, ...], extras: tuple[str, ...], adapter: ModelAdapter):
        cache = latent_cache_of(cfg, adapter)
        # with a latent cache the future frames are not decoded: their latents come from the cache
        dataset = make_train_dataset(cfg.data, spec, () if cache else future_offsets, extras)
        if cache:
            dataset = adapter.latent_dataset(dataset, cache, spec, ds.fps)
        pin = cfg.train.device != "cpu" and torch.cuda.is_available()  # batches go to a GPU
        return make_train_loader(
            dataset, cfg.train.micro_batch, cfg.data.seed, cfg.data.num_workers, rank, world_size,
            pin_memory=pin,
        )  # fmt: skip

    return io, spec_path, make_loader
