"""What the evaluator tests share: a delay server's arguments, a small MetaWorld evaluation's config
and an episode journal read without its scheduling fields."""

from __future__ import annotations

from pathlib import Path

from wamkit.config import RunConfig, load_config
from wamkit.eval.journal import read_journal

DELAY = ["--model", "delay", "--random-init", "--device", "cpu", "--option", "delay_ms=5"]
SCHEDULING = ("timing", "stage", "worker", "restarts", "video")  # how an episode ran, not what happened
SMALL = [
    "env.tasks=reach-v3",
    "env.image_size=32",
    "env.max_steps=16",
    "eval.trials=2",
    "eval.num_envs=2",
    "eval.pipeline_stages=2",
    "eval.workers=2",
    "eval.replan_interval=4",
    "eval.videos=0",
    "eval.calibrate_s=1",
]


def eval_config(urls: str | list[str], out: Path, *extra: str) -> RunConfig:
    """A small evaluation of ``urls`` (one URL or several) into ``out``; ``extra`` overrides win."""
    url = urls if isinstance(urls, str) else ",".join(urls)
    return load_config(None, [f"eval.server_url={url}", f"eval.out_dir={out}", *SMALL, *extra])


def results(out: Path) -> dict[str, dict]:
    """Journal records by episode key, without the scheduling fields."""
    return {
        key: {k: v for k, v in r.items() if k not in SCHEDULING}
        for key, r in read_journal(out / "episodes.jsonl").items()
    }
