"""``wamkit cache-latents CONFIG [section.key=value ...] [--out DIR]``: encode every training clip of a
run once (the Wan-VAE latents Cosmos3 SFT trains toward) and print the override that makes the run read
them. Killed half-way, the same command finishes the cache (see :mod:`wamkit.models.cosmos3.latents`).
"""

from __future__ import annotations

import argparse

from wamkit.config import load_config


def _positive(text: str) -> int:
    """An argparse type: a positive integer (argparse names the flag when it refuses one)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="the run's YAML preset (as given to wamkit train)")
    parser.add_argument("overrides", nargs="*", help="the run's dotted overrides, e.g. data.root=...")
    parser.add_argument("--out", help="cache folder (default: <data.root>/latents/<encoder>-<digest>)")
    parser.add_argument(
        "--device", default="auto", help="where the VAE runs: auto | cpu | cuda (default: auto)"
    )
    parser.add_argument("--batch", type=_positive, default=8, help="clips per VAE call (default: 8)")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="stored latents (default: bfloat16, half the disk; float32 reproduces the encode exactly)",
    )
    parser.add_argument(
        "--shard-size", type=_positive, default=256, help="clips per shard file (default: 256)"
    )
    parser.add_argument(
        "--max-shards",
        type=_positive,
        default=None,
        help="stop after writing this many shards (rerun to finish)",
    )
    parser.add_argument(
        "--part",
        default="0/1",
        help="K/N: write only every N-th shard from the K-th (N processes, e.g. one per GPU, fill one "
        "folder; default 0/1)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _part(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit()) or not 0 <= int(k) < int(n):
        raise SystemExit(f"wamkit cache-latents: --part {text!r}; expected K/N with 0 <= K < N, e.g. 0/8")
    return int(k), int(n)


def main(args: argparse.Namespace) -> int:
    from wamkit.train.latent_cache import cache_latents

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no preset, only overrides
        config, overrides = None, [config, *overrides]
    report = cache_latents(
        load_config(config, overrides),
        args.out,
        device=args.device,
        batch_size=args.batch,
        dtype=args.dtype,
        shard_size=args.shard_size,
        max_shards=args.max_shards,
        part=_part(args.part),
        progress=not args.no_progress,
    )
    if report["remaining"]:
        print(f"{report['path']}: {report['remaining']} shards still to write; run the same command again")
        return 0
    if args.part != "0/1":
        print(f"{report['path']}: part {args.part} done ({report['written']} shards written now)")
        return 0
    print(
        f"{report['path']}: {report['rows']} clips cached; train with model.options.latent_cache={report['path']}"
    )
    return 0
