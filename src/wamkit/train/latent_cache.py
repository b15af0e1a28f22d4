"""A run's latent cache, built from its config (``wamkit cache-latents``).

The build sees each sample exactly as the run's loader does (the same dataset, image preprocessing and
future frames) and encodes it with the adapter's own ``encode_clips``, the code ``sft_loss`` runs
without a cache; the model is built as the trainer builds it (on the CPU, after seeding torch with
``train.seed``), so a random-weight preset has the run's VAE. Everything model-specific (the cache
format, its fingerprint, its crash protocol) is the adapter's (:class:`wamkit.models.base.CachesLatents`;
Cosmos3's is :mod:`wamkit.models.cosmos3.latents`); a run reads the cache through the same adapter
(:func:`wamkit.train.data_setup.build_data`).

No statistics are read or computed: the cache holds image encodings only, so the samples are made with
unit statistics (the state and action values they carry are never used).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from wamkit.actions.spec import PreprocessSpec
from wamkit.config import ConfigError, RunConfig
from wamkit.data import collate
from wamkit.device import resolve_device
from wamkit.log import progress_bar
from wamkit.models.base import LATENT_CACHE_OPTION, CachesLatents, ModelIO
from wamkit.train.data_setup import build_spec, first_dataset_root, io_from_dataset

log = logging.getLogger(__name__)


def _image_spec(cfg: RunConfig, io: ModelIO) -> PreprocessSpec:
    """The run's spec as far as images go (size, resize, cameras, chunk), over unit statistics."""
    unit = PreprocessSpec.identity(
        representation=cfg.data.representation, cameras=io.cameras, image_size=io.image_size,
        state_dim=io.state_dim, action_dim=io.action_dim, chunk=cfg.data.chunk,
    ).stats  # fmt: skip
    return build_spec(cfg, io, unit)


def _setup(cfg: RunConfig):
    """``(adapter, dataset, spec, fps)`` of the run, as the trainer builds them (model on the CPU)."""
    from wamkit.data import LeRobotDataset, make_train_dataset
    from wamkit.models import build_model

    root = first_dataset_root(cfg)
    ds = LeRobotDataset(root)
    io = io_from_dataset(cfg, ds.features, str(root / "meta" / "info.json"), ds.meta.info.get("robot_type"))
    spec = _image_spec(cfg, io)
    options = {k: v for k, v in cfg.model.options.items() if k != LATENT_CACHE_OPTION}
    torch.manual_seed(cfg.train.seed)  # the trainer seeds so before building: the same random weights
    adapter = build_model(dataclasses.replace(cfg.model, options=options), io)
    if not isinstance(adapter, CachesLatents):
        raise ConfigError(f"model.name: {cfg.model.name!r} has no latent targets to cache")
    dataset = make_train_dataset(cfg.data, spec, tuple(adapter.future_frame_offsets))
    return adapter, dataset, spec, float(ds.fps)


def cache_latents(
    cfg: RunConfig,
    out: str | Path | None = None,
    *,
    device: str = "auto",
    batch_size: int = 8,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    max_shards: int | None = None,
    part: tuple[int, int] = (0, 1),
    progress: bool = True,
) -> dict[str, Any]:
    """Write (or finish) the latent cache of ``cfg``'s run; returns ``{"path", "rows", "written",
    "remaining"}`` (shards written now, shards of this part still missing: > 0 only under ``max_shards``).

    ``out``: the folder (default ``<data.root>/latents/<encoder>-<digest>``); ``batch_size``: clips per
    VAE call; ``max_shards``: stop after writing this many (a partial build, finished by a rerun);
    ``part=(k, n)``: write only shards ``k, k + n, ...`` (n processes, one per GPU, fill one folder)."""
    k_part, n_parts = part
    if not 0 <= k_part < n_parts:
        raise ValueError(f"latent cache part {k_part}/{n_parts}: expected 0 <= K < N")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size), ("max_shards", max_shards)):
        if value is not None and value < 1:
            raise ValueError(f"latent cache {name}: expected a positive number, got {value}")
    adapter, dataset, spec, fps = _setup(cfg)
    dev = resolve_device(device)
    writer = adapter.latent_cache_writer(
        dataset,
        spec,
        fps,
        out=out,
        parent=Path(cfg.data.root) / "latents",
        dtype=dtype,
        shard_size=shard_size,
    )
    root, suites = Path(writer.root), dict(zip(dataset.names, dataset.suite_sizes))
    mine = [t for i, t in enumerate(writer.shards()) if i % n_parts == k_part]
    missing = {(suite, k) for suite, k, _ in writer.todo()}
    todo = [t for t in mine if t[:2] in missing]
    total = sum(suites.values())
    pending = todo if max_shards is None else todo[:max_shards]
    log.info(
        "latent cache %s: %d of %d shards to write (part %d/%d; %d clips each, %s), encoding on %s",
        root, len(pending), len(writer.shards()), k_part, n_parts, shard_size, dtype, dev,
    )  # fmt: skip
    offsets = dict(zip(dataset.names, dataset.offsets))
    batches = [
        [offsets[suite] + r for r in rows[i : i + batch_size]]
        for suite, _, rows in pending
        for i in range(0, len(rows), batch_size)
    ]
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=batches, num_workers=cfg.data.num_workers, collate_fn=collate
    )
    size = sum(len(rows) for _, _, rows in mine)
    done = size - sum(len(rows) for _, _, rows in todo)
    bar = progress_bar(total=size, initial=done, unit="clip", desc="cache-latents", disable=not progress)
    it = iter(loader)
    for suite, k, rows in pending:
        parts = []
        while sum(len(p) for p in parts) < len(rows):
            parts.append(adapter.encode_clips(next(it), dev).cpu())
            bar.update(len(parts[-1]))
        writer.write(suite, k, torch.cat(parts))
    bar.close()
    return {"path": str(root), "rows": total, "written": len(pending), "remaining": len(todo) - len(pending)}
