"""``wamkit cache-text CONFIG [section.key=value ...] --out DIR``: run a Cosmos3 run's frozen
understanding tower once per caption its data can draw and keep the per-layer text keys/values, then
print the override that makes the run read them (see :mod:`wamkit.models.cosmos3.text_kv`). Killed
half-way, the same command finishes the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="the run's YAML preset (as given to wamkit train)")
    parser.add_argument("overrides", nargs="*", help="the run's dotted overrides, e.g. data.root=...")
    parser.add_argument("--out", required=True, help="cache folder (created; a rerun finishes it)")
    parser.add_argument(
        "--device",
        default="auto",
        help="where the understanding tower runs: auto | cpu | cuda (default: auto)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_tasks(cfg) -> list[str]:
    """Every task instruction of the run's data (each suite of ``data.root``)."""
    from wamkit.data.meta import DatasetMeta

    root = Path(cfg.data.root)
    roots = [root / s for s in cfg.data.suites] if cfg.data.suites else [root]
    return sorted({t for r in roots for t in DatasetMeta(r).tasks.values()})


def cache_text(cfg, out: str | Path, device: str = "auto", progress: bool = True) -> dict:
    """Write (or finish) the text key/value cache of ``cfg``'s run in ``out``; returns ``{"path",
    "captions", "written"}``. The model is built as the trainer builds it (seeded with
    ``train.seed``), in the compute dtype of ``train.precision``."""
    import torch

    from wamkit.config import ConfigError
    from wamkit.data import LeRobotDataset
    from wamkit.device import resolve_device
    from wamkit.log import progress_bar
    from wamkit.models import build_model
    from wamkit.models.cosmos3 import text_kv
    from wamkit.train.data_setup import first_dataset_root, io_from_dataset

    if cfg.model.name != "cosmos3":
        raise ConfigError(f"model.name: {cfg.model.name!r} has no text keys/values to cache (cosmos3 has)")
    root = first_dataset_root(cfg)
    ds = LeRobotDataset(root)
    io = io_from_dataset(cfg, ds.features, str(root / "meta" / "info.json"), ds.meta.info.get("robot_type"))
    options = {k: v for k, v in cfg.model.options.items() if k != text_kv.OPTION}
    torch.manual_seed(cfg.train.seed)  # the trainer seeds so before building: the same random weights
    adapter = build_model(dataclasses.replace(cfg.model, options=options), io)
    dev = resolve_device(device)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    adapter.module.to(dev, dtype)
    captions = adapter.training_captions(run_tasks(cfg))
    log.info("text cache %s: %d captions, encoding on %s in %s", out, len(captions), dev, dtype)
    bar = progress_bar(total=len(captions), unit="caption", desc="cache-text", disable=not progress)

    def tick(done: int, todo: int) -> None:  # update(): at most a line per interval off a terminal
        bar.update(len(captions) - todo + done - bar.n)

    with torch.no_grad():
        report = text_kv.build(
            out, adapter.text_fingerprint(dtype), captions, adapter.encode_caption, progress=tick
        )
    bar.close()
    return report


def main(args: argparse.Namespace) -> int:
    from wamkit.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no preset, only overrides
        config, overrides = None, [config, *overrides]
    report = cache_text(load_config(config, overrides), args.out, args.device, not args.no_progress)
    print(
        f"{report['path']}: {report['captions']} captions cached ({report['written']} written now); "
        f"train with model.options.text_kv_cache={report['path']}"
    )
    return 0
