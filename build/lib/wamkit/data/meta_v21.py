"""The metadata of a LeRobot v2.1 dataset (what lerobot 0.3.3, the last v2.1 writer, leaves on disk).

- ``meta/tasks.jsonl``: ``{"task_index": int, "task": str}`` per line.
- ``meta/episodes.jsonl``: ``{"episode_index": int, "tasks": [str], "length": int}`` per line.
- ``meta/episodes_stats.jsonl``: ``{"episode_index": int, "stats": {feature: {stat: value}}}`` per line.
- One data file and one mp4 per camera for each episode, at ``info["data_path"]`` /
  ``info["video_path"]`` formatted with ``episode_chunk = episode_index // chunks_size``; each video
  starts at t = 0. Global frame indices run through the episodes in order (``from_index`` is the sum of
  the lengths before), as lerobot 0.3.3 computes them.

A line that is not JSON is an error naming the file and line: lerobot appends these files one episode
at a time, so a torn line means an interrupted writer, and the dataset is not whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wamkit.data.meta import DatasetError, EpisodeInfo

TASKS_JSONL = "meta/tasks.jsonl"
EPISODES_JSONL = "meta/episodes.jsonl"
EPISODES_STATS_JSONL = "meta/episodes_stats.jsonl"
DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
DEFAULT_CHUNKS_SIZE = 1000


def read_lines(path: Path, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` metadata file, each checked to hold ``keys``."""
    if not path.is_file():
        raise DatasetError(f"{path}: file is missing (a v2.1 dataset has one)")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(
                f"{path}: line {n} is not valid JSON ({err}); was a writer interrupted?"
            ) from None
        missing = [k for k in keys if k not in obj]
        if missing:
            raise DatasetError(f"{path}: line {n} lacks {missing}")
        out.append(obj)
    return out


def read_tasks(root: Path) -> dict[int, str]:
    return {int(r["task_index"]): r["task"] for r in read_lines(root / TASKS_JSONL, ("task_index", "task"))}


def episode_chunk(info: dict[str, Any], episode: int) -> int:
    return episode // int(info.get("chunks_size") or DEFAULT_CHUNKS_SIZE)


def read_episodes(root: Path, info: dict[str, Any], video_keys: list[str]) -> dict[int, EpisodeInfo]:
    rows = read_lines(root / EPISODES_JSONL, ("episode_index", "length"))
    rows.sort(key=lambda r: r["episode_index"])
    total = info.get("total_episodes")
    if total is not None and len(rows) != total:
        raise DatasetError(
            f"{root / EPISODES_JSONL}: lists {len(rows)} episodes; meta/info.json total_episodes is {total}"
        )
    if video_keys and not info.get("video_path"):
        raise DatasetError(f"{root / 'meta/info.json'}: video features {video_keys} but no 'video_path'")
    fps = float(info["fps"])
    episodes, start = {}, 0
    for r in rows:
        ep, n = int(r["episode_index"]), int(r["length"])
        chunk = episode_chunk(info, ep)
        data = root / info["data_path"].format(episode_chunk=chunk, episode_index=ep)
        videos = {
            key: (root / info["video_path"].format(episode_chunk=chunk, video_key=key, episode_index=ep),
                  0.0, n / fps)
            for key in video_keys
        }  # fmt: skip
        episodes[ep] = EpisodeInfo(ep, n, data, start, start + n, videos, list(r.get("tasks") or []))
        start += n
    return episodes


def read_episodes_stats(root: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """``{episode_index: {feature: {stat: value}}}`` as stored (lists; images [3][1][1])."""
    rows = read_lines(root / EPISODES_STATS_JSONL, ("episode_index", "stats"))
    return {int(r["episode_index"]): r["stats"] for r in rows}
