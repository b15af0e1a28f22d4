"""Convert a LeRobot dataset between v2.1 and v3.0, copying video streams, and verify the result.

``convert_dataset(src, dst, to)``:

- **v2.1 -> v3.0** (the layout of lerobot's own converter, ``convert_dataset_v21_to_v30.py``):
  consecutive episodes are joined into data files of up to ``data_mb`` and, per camera, video files of up
  to ``video_mb`` (by source file size, the same greedy rule); video packets are copied with shifted
  timestamps (:func:`wamkit.data.remux.join_videos`), re-encoded only where the parts' streams differ.
  ``meta/episodes`` gets each episode's files and time spans and its ``episodes_stats.jsonl`` stats as
  ``stats/<feature>/<stat>`` columns; ``meta/tasks.parquet`` the task text as an index named ``task``.
- **v3.0 -> v2.1**: every episode is split out into its own data file and, per camera, its own mp4
  starting at t = 0 (packets copied where the episode starts on a key frame, else re-encoded);
  ``meta/episodes.jsonl``, ``tasks.jsonl`` and ``episodes_stats.jsonl`` from the v3 tables.

Crash protocol: everything is written under ``<dst>.tmp/``, each file through a temporary name and a
rename (:mod:`wamkit.files`). ``<dst>.tmp/wamkit_convert.jsonl`` is the journal: the plan first, then one
durable record per finished output file (a *unit*), so a rerun skips finished units and redoes at most
the one that was cut short. When all units are in, the metadata is written, the result is verified
(:func:`verify`: both datasets read back frame by frame), the report ``meta/wamkit_convert.json`` and
``meta/info.json`` are written, the journal is removed and ``<dst>.tmp`` is renamed to ``<dst>``: that
rename is the commit point, so ``<dst>`` exists only as a verified, complete dataset.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wamkit.constants import EPISODE_INDEX
from wamkit.data import lerobot_stats as ls
from wamkit.data import meta_v21 as v21
from wamkit.data.convert_verify import verify
from wamkit.data.meta import (
    CODEBASE_VERSION,
    EPISODES_DIR,
    INFO,
    TASKS,
    V21,
    DatasetError,
    DatasetMeta,
    episode_meta_files,
    read_parquet,
)
from wamkit.data.remux import Part, cut_video, join_videos
from wamkit.data.writer import CHUNKS_SIZE, DATA_PATH, VIDEO_PATH, tasks_table
from wamkit.files import (
    append_jsonl_path,
    atomic_write_json,
    atomic_write_text,
    atomic_write_with,
    read_jsonl,
)

log = logging.getLogger(__name__)

JOURNAL = "wamkit_convert.jsonl"
REPORT = "meta/wamkit_convert.json"
DATA_MB, VIDEO_MB = 100, 200  # lerobot's defaults for v3 file sizes


def convert_dataset(src: str | Path, dst: str | Path, to: str | None = None,
                    data_mb: float = DATA_MB, video_mb: float = VIDEO_MB) -> dict[str, Any]:  # fmt: skip
    """Convert ``src`` to version ``to`` (default: the other one) at ``dst``; returns the report."""
    src, dst = Path(src), Path(dst)
    meta = DatasetMeta(src)
    to = to or (V21 if meta.version == CODEBASE_VERSION else CODEBASE_VERSION)
    if to == meta.version or to not in (V21, CODEBASE_VERSION):
        raise DatasetError(f"{src}: is {meta.version}; cannot convert it to {to!r} (choose v2.1 or v3.0)")
    if dst.exists():
        raise DatasetError(f"{dst}: already exists; choose a new destination")
    work = dst.with_name(dst.name + ".tmp")
    plan = {"source": str(src.resolve()), "from": meta.version, "to": to, "data_mb": data_mb,
            "video_mb": video_mb, "episodes": len(meta.episodes), "frames": sum(e.length for e in meta.episodes.values())}  # fmt: skip
    done = _start_journal(work, plan)
    units = (
        _to_v3(meta, work, done, data_mb, video_mb) if to == CODEBASE_VERSION else _to_v21(meta, work, done)
    )
    if to == CODEBASE_VERSION:
        info = _write_v3_meta(meta, work, units, data_mb, video_mb)
    else:
        info = _write_v21_meta(meta, work)
    atomic_write_json(work / INFO, info, indent=4)
    reencoded = {(int(e), k) for u in units.values() for e, k in u.get("reencoded", [])}
    report = {**plan, "copied_videos": sum(1 for u in units.values() if u.get("copied")),
              "reencoded_videos": sum(1 for u in units.values() if u.get("copied") is False),
              "verify": verify(src, work, reencoded)}  # fmt: skip
    atomic_write_json(work / REPORT, report)
    (work / JOURNAL).unlink()
    work.rename(dst)  # the commit point
    return report


def _start_journal(work: Path, plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The units finished by an earlier run of the same plan (a different plan is refused)."""
    records = read_jsonl(work / JOURNAL, repair=True)
    if not records:
        if work.exists():
            shutil.rmtree(work)  # no plan committed: nothing of it counts
        work.mkdir(parents=True)
        append_jsonl_path(work / JOURNAL, {"plan": plan})
        return {}
    if records[0].get("plan") != plan:
        raise DatasetError(
            f"{work}: holds an unfinished conversion with plan {records[0].get('plan')}; this one is {plan}. "
            "Rerun it with the same source and options, or remove the folder"
        )
    done = {r["unit"]: r for r in records[1:]}
    log.info("%s: resuming, %d units already done", work, len(done))
    return done


def _unit(work: Path, done: dict, name: str, make) -> dict[str, Any]:
    """Run ``make() -> record`` unless the journal already has ``name``; journal it when done."""
    if name in done:
        return done[name]
    record = {"unit": name, **make()}
    append_jsonl_path(work / JOURNAL, record)
    done[name] = record
    return record


def _groups(sizes: list[tuple[int, int]], limit_mb: float) -> list[list[int]]:
    """Consecutive episodes ``(episode, bytes)`` grouped greedily below ``limit_mb`` (at least one each)."""
    groups: list[list[int]] = []
    total = 0.0
    for ep, size in sizes:
        mb = size / 2**20
        if groups and total + mb < limit_mb:
            groups[-1].append(ep)
            total += mb
        else:
            groups.append([ep])
            total = mb
    return groups


def _chunk_file(i: int) -> tuple[int, int]:
    return i // CHUNKS_SIZE, i % CHUNKS_SIZE


# -- v2.1 -> v3.0 ---------------------------------------------------------------------------------
def _to_v3(meta: DatasetMeta, work: Path, done: dict, data_mb: float, video_mb: float) -> dict[str, dict]:
    eps = meta.episodes
    units: dict[str, dict] = {}
    sizes = [(e, info.data_file.stat().st_size) for e, info in eps.items()]
    for i, group in enumerate(_groups(sizes, data_mb)):
        chunk, file = _chunk_file(i)
        path = work / DATA_PATH.format(chunk_index=chunk, file_index=file)
        units[f"data/{i}"] = _unit(work, done, f"data/{i}", lambda g=group, p=path: _join_data(meta, g, p))
    for key in meta.video_keys:
        sizes = [(e, info.videos[key][0].stat().st_size) for e, info in eps.items()]
        for i, group in enumerate(_groups(sizes, video_mb)):
            chunk, file = _chunk_file(i)
            path = work / VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file)
            name = f"video/{key}/{i}"
            units[name] = _unit(work, done, name, lambda g=group, p=path, k=key: _join_video(meta, g, k, p))
    return units


def _join_data(meta: DatasetMeta, group: list[int], path: Path) -> dict[str, Any]:
    tables = [read_parquet(meta.episodes[e].data_file) for e in group]
    metadata = tables[0].schema.metadata
    table = pa.concat_tables([t.replace_schema_metadata(None) for t in tables]).replace_schema_metadata(
        metadata
    )
    atomic_write_with(path, lambda tmp: pq.write_table(table, tmp))
    return {"episodes": group}


def _join_video(meta: DatasetMeta, group: list[int], key: str, path: Path) -> dict[str, Any]:
    parts = [Part(meta.episodes[e].videos[key][0], meta.episodes[e].length) for e in group]
    spans, copied = join_videos(parts, path, meta.fps)
    return {"episodes": group, "spans": spans, "copied": copied,
            "reencoded": [] if copied else [[e, key] for e in group]}  # fmt: skip


def _write_v3_meta(meta: DatasetMeta, work: Path, units: dict, data_mb: float, video_mb: float) -> dict:
    stats = v21.read_episodes_stats(meta.root)
    rows: dict[int, dict[str, Any]] = {}
    where = {
        e: int(n.split("/")[1]) for n, u in units.items() if n.startswith("data/") for e in u["episodes"]
    }
    for e, info in meta.episodes.items():
        chunk, file = _chunk_file(where[e])
        rows[e] = {"episode_index": e, "tasks": info.tasks, "length": info.length,
                   "data/chunk_index": chunk, "data/file_index": file,
                   "dataset_from_index": info.from_index, "dataset_to_index": info.to_index}  # fmt: skip
    for name, unit in units.items():
        if not name.startswith("video/"):
            continue
        key, i = name[len("video/") :].rsplit("/", 1)
        chunk, file = _chunk_file(int(i))
        for e, (t0, t1) in zip(unit["episodes"], unit["spans"]):
            rows[e].update({f"videos/{key}/chunk_index": chunk, f"videos/{key}/file_index": file,
                            f"videos/{key}/from_timestamp": t0, f"videos/{key}/to_timestamp": t1})  # fmt: skip
    for row in rows.values():
        for feature, values in stats.get(row["episode_index"], {}).items():
            row.update({f"stats/{feature}/{s}": v for s, v in values.items()})
        row["meta/episodes/chunk_index"], row["meta/episodes/file_index"] = 0, 0
    table = pa.Table.from_pylist(list(rows.values()))
    atomic_write_with(work / EPISODES_DIR / "chunk-000/file-000.parquet", lambda t: pq.write_table(table, t))
    atomic_write_with(
        work / TASKS, lambda t: pq.write_table(tasks_table({v: k for k, v in meta.tasks.items()}), t)
    )
    per_feature: dict[str, list] = {}
    for values in stats.values():
        for feature, s in values.items():
            per_feature.setdefault(feature, []).append({k: np.asarray(v) for k, v in s.items()})
    agg = {f: ls.aggregate(v) for f, v in per_feature.items()}
    atomic_write_text(work / "meta/stats.json", json.dumps(ls.to_jsonable(agg), indent=4))
    info = {k: v for k, v in meta.info.items() if k not in ("total_chunks", "total_videos")}
    info.update(codebase_version=CODEBASE_VERSION, data_files_size_in_mb=data_mb, video_files_size_in_mb=video_mb,
                data_path=DATA_PATH, video_path=VIDEO_PATH if meta.video_keys else None)  # fmt: skip
    for feature in info["features"].values():
        if feature["dtype"] != "video":
            feature.setdefault("fps", meta.fps)  # as lerobot's converter adds it
    return info


# -- v3.0 -> v2.1 ---------------------------------------------------------------------------------
def _to_v21(meta: DatasetMeta, work: Path, done: dict) -> dict[str, dict]:
    units: dict[str, dict] = {}
    chunk_of = {e: v21.episode_chunk(meta.info, e) for e in meta.episodes}
    for e, info in meta.episodes.items():
        path = work / v21.DATA_PATH.format(episode_chunk=chunk_of[e], episode_index=e)
        units[f"data/{e}"] = _unit(work, done, f"data/{e}", lambda i=info, p=path: _split_data(i, p))
        for key in meta.video_keys:
            out = work / v21.VIDEO_PATH.format(episode_chunk=chunk_of[e], video_key=key, episode_index=e)
            name = f"video/{key}/{e}"
            units[name] = _unit(work, done, name, lambda i=info, k=key, o=out: _split_video(meta, i, k, o))
    return units


def _split_data(info, path: Path) -> dict[str, Any]:
    table = read_parquet(info.data_file)
    rows = np.flatnonzero(table.column(EPISODE_INDEX).to_numpy() == info.index)
    part = table.take(pa.array(rows))
    if len(part) != info.length:
        raise DatasetError(
            f"{info.data_file}: has {len(part)} rows of episode {info.index}; expected {info.length}"
        )
    atomic_write_with(path, lambda tmp: pq.write_table(part, tmp))
    return {"episodes": [info.index]}


def _split_video(meta: DatasetMeta, info, key: str, out: Path) -> dict[str, Any]:
    src, t0, t1 = info.videos[key]
    copied = cut_video(src, (t0, t0 + info.length / meta.fps), info.length, out, meta.fps)
    return {"episodes": [info.index], "copied": copied, "reencoded": [] if copied else [[info.index, key]]}


def _write_v21_meta(meta: DatasetMeta, work: Path) -> dict:
    lines = [json.dumps({"task_index": i, "task": t}) for i, t in sorted(meta.tasks.items())]
    atomic_write_text(work / v21.TASKS_JSONL, "".join(line + "\n" for line in lines))
    eps = [
        json.dumps({"episode_index": e, "tasks": i.tasks, "length": i.length})
        for e, i in meta.episodes.items()
    ]
    atomic_write_text(work / v21.EPISODES_JSONL, "".join(line + "\n" for line in eps))
    stats = _v3_episode_stats(meta)
    lines = [json.dumps({"episode_index": e, "stats": stats.get(e, {})}) for e in meta.episodes]
    atomic_write_text(work / v21.EPISODES_STATS_JSONL, "".join(line + "\n" for line in lines))
    info = {
        k: v for k, v in meta.info.items() if k not in ("data_files_size_in_mb", "video_files_size_in_mb")
    }
    chunks = max(v21.episode_chunk(meta.info, e) for e in meta.episodes) + 1
    info.update(codebase_version=V21, total_chunks=chunks, total_videos=len(meta.episodes) * len(meta.video_keys),
                chunks_size=int(meta.info.get("chunks_size") or v21.DEFAULT_CHUNKS_SIZE),
                data_path=v21.DATA_PATH, video_path=v21.VIDEO_PATH if meta.video_keys else None)  # fmt: skip
    info["features"] = {k: {n: v for n, v in f.items() if not (n == "fps" and f["dtype"] != "video")}
                        for k, f in meta.info["features"].items()}  # fmt: skip
    return info


def _v3_episode_stats(meta: DatasetMeta) -> dict[int, dict[str, dict[str, Any]]]:
    """``{episode: {feature: {stat: value}}}`` from the ``stats/...`` columns of ``meta/episodes``."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for path in episode_meta_files(meta.root):
        for row in read_parquet(path).to_pylist():
            per = out.setdefault(row["episode_index"], {})
            for col, value in row.items():
                if col.startswith("stats/") and value is not None:
                    feature, stat = col[len("stats/") :].rsplit("/", 1)
                    per.setdefault(feature, {})[stat] = value
    return out
