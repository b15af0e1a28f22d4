"""LeRobot dataset metadata, v3.0 and v2.1, read into one in-memory shape.

Layout of a v3.0 dataset (what lerobot 0.4 and later write, and ours)::

    meta/info.json                     fps, features, path templates, totals
    meta/tasks.parquet                 task_index -> task string (see :func:`tasks_from_table`)
    meta/episodes/chunk-XXX/file-YYY.parquet
                                       one row per episode: length, data file, per-camera video file and
                                       the episode's [from_timestamp, to_timestamp) inside that video
    data/chunk-XXX/file-YYY.parquet    one row per frame; several episodes per file
    videos/<key>/chunk-XXX/file-YYY.mp4
                                       several episodes per file, one after the other

Layout of a v2.1 dataset (lerobot 0.3.3 and earlier; :mod:`wamkit.data.meta_v21`)::

    meta/info.json, meta/tasks.jsonl, meta/episodes.jsonl, meta/episodes_stats.jsonl
    data/chunk-XXX/episode_EEEEEE.parquet           one file per episode
    videos/chunk-XXX/<key>/episode_EEEEEE.mp4       one file per episode and camera, starting at t=0

Both become :class:`DatasetMeta`: ``tasks`` and ``episodes`` (:class:`EpisodeInfo`, with resolved file
paths and each episode's time span in its video files), so nothing above this module knows the version.

Completion marker: ``meta/info.json`` is written last, atomically, by
:meth:`wamkit.data.LeRobotDatasetWriter.finalize`. While a writer is open the folder holds
``meta/wamkit_partial.json`` instead, and no reader (ours or lerobot's) takes it for a dataset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wamkit.config import UserError
from wamkit.constants import camera_of

INFO = "meta/info.json"
PARTIAL = "meta/wamkit_partial.json"
TASKS = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CODEBASE_VERSION = "v3.0"  # what the writer writes
V21 = "v2.1"
VERSIONS = (CODEBASE_VERSION, V21)  # what the reader reads
# Columns every data file carries besides the user's features.
DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")


def episode_meta_files(root: str | Path) -> list[Path]:
    """The episode-metadata files of the dataset at ``root`` (``meta/episodes/chunk-*/file-*.parquet``),
    in order, without a write's staging file (``file-005.tmp.parquet``) that a kill left behind."""
    files = (Path(root) / EPISODES_DIR).glob("chunk-*/file-*.parquet")
    return sorted(f for f in files if not f.name.endswith(".tmp.parquet"))


class DatasetError(UserError, ValueError):
    """A dataset file is missing, truncated or does not match its metadata. The message names the file."""


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read a parquet file, turning any failure into a :class:`DatasetError` that names it."""
    if not path.is_file():
        raise DatasetError(f"{path}: file is missing (referenced by the dataset metadata)")
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError, KeyError) as err:
        raise DatasetError(f"{path}: cannot read parquet (truncated or corrupt?): {err}") from None


def read_schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{path}: cannot read parquet (truncated or corrupt?): {err}") from None


@dataclass
class EpisodeInfo:
    """One episode. ``videos[key] = (mp4 path, from_ts, to_ts)``: the episode's frames are shown at
    ``from_ts + frame / fps`` seconds of that file (``from_ts`` is 0 in v2.1, one file per episode)."""

    index: int
    length: int
    data_file: Path
    from_index: int  # global frame index of the first frame (the data files' ``index`` column)
    to_index: int  # exclusive
    videos: dict[str, tuple[Path, float, float]]
    tasks: list[str] = field(default_factory=list)


class DatasetMeta:
    """The metadata of one finished v3.0 or v2.1 dataset at ``root``; ``version`` says which."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.info = read_info(self.root)
        self.version: str = self.info["codebase_version"]
        if self.version == V21:
            from wamkit.data import meta_v21

            self.tasks = meta_v21.read_tasks(self.root)
            self.episodes = meta_v21.read_episodes(self.root, self.info, self.video_keys)
        else:
            self.tasks = tasks_from_table(read_parquet(self.root / TASKS), self.root / TASKS)
            self.episodes = self._read_episodes()

    # -- info.json ---------------------------------------------------------------------------------
    @property
    def fps(self) -> int:
        return int(self.info["fps"])

    @property
    def features(self) -> dict[str, dict[str, Any]]:
        return self.info["features"]

    @property
    def video_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "video"]

    @property
    def image_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] == "image"]

    @property
    def camera_keys(self) -> list[str]:
        """Every ``observation.images.*`` feature, stored as video or as images."""
        return [
            k for k in self.features if camera_of(k) is not None and k in self.video_keys + self.image_keys
        ]

    @property
    def numeric_keys(self) -> list[str]:
        """Features stored as numbers in the data files (state, action, and the default columns)."""
        return [k for k, f in self.features.items() if f["dtype"] not in ("video", "image", "string")]

    def template_path(self, key: str, **fields: Any) -> Path:
        """``root / info[key].format(**fields)`` (``data_path`` or ``video_path``)."""
        return self.root / self.info[key].format(**fields)

    # -- v3 episodes -------------------------------------------------------------------------------
    def _read_episodes(self) -> dict[int, EpisodeInfo]:
        files = episode_meta_files(self.root)
        if not files:
            raise DatasetError(
                f"{self.root / EPISODES_DIR}: no episode metadata files (chunk-*/file-*.parquet)"
            )
        spans = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
        cols = ["episode_index", "length", "data/chunk_index", "data/file_index"]
        cols += ["dataset_from_index", "dataset_to_index"]
        cols += [f"videos/{key}/{c}" for key in self.video_keys for c in spans]
        episodes: dict[int, EpisodeInfo] = {}
        for path in files:
            names = read_schema(path).names
            missing = [c for c in cols if c not in names]
            if missing:
                raise DatasetError(f"{path}: missing columns {missing}")
            rows = read_parquet(path, columns=cols + (["tasks"] if "tasks" in names else [])).to_pydict()
            for i, ep in enumerate(rows["episode_index"]):
                videos = {}
                for key in self.video_keys:
                    chunk, file, t0, t1 = (rows[f"videos/{key}/{c}"][i] for c in spans)
                    p = self.template_path("video_path", video_key=key, chunk_index=chunk, file_index=file)
                    videos[key] = (p, float(t0), float(t1))
                data = (rows["data/chunk_index"][i], rows["data/file_index"][i])
                episodes[ep] = EpisodeInfo(
                    index=ep,
                    length=rows["length"][i],
                    data_file=self.template_path("data_path", chunk_index=data[0], file_index=data[1]),
                    from_index=rows["dataset_from_index"][i],
                    to_index=rows["dataset_to_index"][i],
                    videos=videos,
                    tasks=list(rows["tasks"][i] or []) if "tasks" in rows else [],
                )
        return dict(sorted(episodes.items()))


def read_info(root: Path) -> dict[str, Any]:
    """``meta/info.json`` of a finished dataset of a version we read; errors say what is wrong."""
    info_path = root / INFO
    if not info_path.is_file():
        if (root / PARTIAL).is_file():
            raise DatasetError(
                f"{root}: dataset is not finalized ({PARTIAL} present, {INFO} absent); a writer "
                "crashed or is still running. Re-open it with LeRobotDatasetWriter.open(root) and "
                "call finalize()"
            )
        raise DatasetError(f"{info_path}: file is missing; {root} is not a LeRobot dataset")
    try:
        info: dict[str, Any] = json.loads(info_path.read_text())
    except json.JSONDecodeError as err:
        raise DatasetError(f"{info_path}: not valid JSON ({err})") from None
    for key in ("fps", "features", "data_path"):
        if key not in info:
            raise DatasetError(f"{info_path}: missing key '{key}'")
    version = info.get("codebase_version")
    if version not in VERSIONS:
        raise DatasetError(f"{info_path}: codebase_version is {version!r}; wamkit reads {list(VERSIONS)}")
    return info


def tasks_from_table(table: pa.Table, path: Path) -> dict[int, str]:
    """``{task_index: task}`` from a ``meta/tasks.parquet`` table, whoever wrote it.

    Writers keep the task text in a pandas index: lerobot 0.6 names it ``task`` (stored as column
    ``task``), the lerobot 0.4 line leaves it unnamed (stored as ``__index_level_0__``). Which column
    holds the text is read from the pandas metadata (its ``index_columns``); a table without that
    metadata must have a ``task`` column.
    """
    names = table.column_names
    if "task_index" not in names:
        raise DatasetError(f"{path}: no 'task_index' column (columns: {names})")
    text = _task_text_column(table)
    if text is None:
        raise DatasetError(
            f"{path}: no task text: expected a string pandas index (index_columns in the 'pandas' "
            f"schema metadata) or a 'task' column; columns are {names}"
        )
    idx, tasks = table.column("task_index").to_pylist(), table.column(text).to_pylist()
    return dict(zip(idx, tasks))


def _task_text_column(table: pa.Table) -> str | None:
    def is_text(name: str) -> bool:
        if name not in table.column_names:
            return False
        kind = table.schema.field(name).type
        return pa.types.is_string(kind) or pa.types.is_large_string(kind)

    raw = (table.schema.metadata or {}).get(b"pandas")
    index_columns = json.loads(raw).get("index_columns", []) if raw else []
    stored = [c for c in index_columns if isinstance(c, str) and is_text(c)]  # a RangeIndex is a dict
    if len(stored) == 1:
        return stored[0]
    return "task" if is_text("task") else None


def column_to_numpy(table: pa.Table, key: str, shape: list[int], path: Path) -> np.ndarray:
    """A numeric column as (rows, *shape), checking the per-row size against ``shape`` from info.json."""
    if key not in table.column_names:
        raise DatasetError(f"{path}: column '{key}' is missing (meta/info.json lists it as a feature)")
    col = table.column(key).combine_chunks()
    size = int(np.prod(shape))
    if (
        pa.types.is_fixed_size_list(col.type)
        or pa.types.is_list(col.type)
        or pa.types.is_large_list(col.type)
    ):
        lengths = (
            col.value_lengths().to_numpy(zero_copy_only=False)
            if not pa.types.is_fixed_size_list(col.type)
            else None
        )
        per_row = col.type.list_size if lengths is None else (int(lengths[0]) if len(lengths) else size)
        if lengths is not None and len(lengths) and not np.all(lengths == per_row):
            raise DatasetError(
                f"{path}: column '{key}' has rows of different lengths; expected {size} values each"
            )
        if per_row != size:
            raise DatasetError(
                f"{path}: column '{key}' has {per_row} values per row; meta/info.json says shape {shape}"
            )
        values = col.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(col), *shape)
    if size != 1:
        raise DatasetError(f"{path}: column '{key}' holds scalars; meta/info.json says shape {shape}")
    return col.to_numpy(zero_copy_only=False).reshape(len(col), *shape)
