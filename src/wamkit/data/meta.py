"""LeRobot v3 metadata: ``meta/info.json``, ``meta/tasks.parquet`` and ``meta/episodes/**``.

Layout of a v3 dataset (what lerobot 0.6.1 writes and reads)::

    meta/info.json                     fps, features, path templates, totals
    meta/tasks.parquet                 task_index -> task string
    meta/episodes/chunk-XXX/file-YYY.parquet
                                       one row per episode: length, data file, per-camera video file and
                                       the episode's [from_timestamp, to_timestamp) inside that video
    data/chunk-XXX/file-YYY.parquet    one row per frame; several episodes per file
    videos/<key>/chunk-XXX/file-YYY.mp4
                                       several episodes per file, one after the other

Completion marker: ``meta/info.json`` is written last, atomically, by
:meth:`wamkit.data.LeRobotDatasetWriter.finalize`. While a writer is open the folder holds
``meta/wamkit_partial.json`` instead, and no reader (ours or lerobot's) takes it for a dataset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wamkit.constants import camera_of

INFO = "meta/info.json"
PARTIAL = "meta/wamkit_partial.json"
TASKS = "meta/tasks.parquet"
EPISODES_DIR = "meta/episodes"
CODEBASE_VERSION = "v3.0"
# Columns every v3 data file carries besides the user's features.
DEFAULT_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")


class DatasetError(ValueError):
    """A dataset file is missing, truncated or does not match its metadata. The message names the file."""


def read_parquet(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read a parquet file, turning any failure into a :class:`DatasetError` that names it."""
    if not path.is_file():
        raise DatasetError(f"{path}: file is missing (referenced by the dataset metadata)")
    try:
        return pq.read_table(path, columns=columns)
    except (pa.ArrowInvalid, pa.ArrowKeyError, OSError, KeyError) as err:
        raise DatasetError(f"{path}: cannot read parquet (truncated or corrupt?): {err}") from None


@dataclass
class EpisodeInfo:
    """One row of ``meta/episodes``. ``videos[key] = (chunk_index, file_index, from_ts, to_ts)``."""

    index: int
    length: int
    data_file: tuple[int, int]
    from_index: int  # global frame index of the first frame (the data files' ``index`` column)
    to_index: int  # exclusive
    videos: dict[str, tuple[int, int, float, float]]


class DatasetMeta:
    """The metadata of one finished v3 dataset at ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        info_path = self.root / INFO
        if not info_path.is_file():
            if (self.root / PARTIAL).is_file():
                raise DatasetError(
                    f"{self.root}: dataset is not finalized ({PARTIAL} present, {INFO} absent); a writer "
                    "crashed or is still running. Re-open it with LeRobotDatasetWriter.open(root) and "
                    "call finalize()"
                )
            raise DatasetError(f"{info_path}: file is missing; {self.root} is not a LeRobot v3 dataset")
        try:
            self.info: dict[str, Any] = json.loads(info_path.read_text())
        except json.JSONDecodeError as err:
            raise DatasetError(f"{info_path}: not valid JSON ({err})") from None
        for key in ("fps", "features", "data_path"):
            if key not in self.info:
                raise DatasetError(f"{info_path}: missing key '{key}'")
        version = self.info.get("codebase_version")
        if version != CODEBASE_VERSION:
            raise DatasetError(f"{info_path}: codebase_version is {version!r}, expected {CODEBASE_VERSION!r}")
        self.tasks = self._read_tasks()
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

    def data_path(self, chunk: int, file: int) -> Path:
        return self.root / self.info["data_path"].format(chunk_index=chunk, file_index=file)

    def video_path(self, key: str, chunk: int, file: int) -> Path:
        return self.root / self.info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)

    # -- tasks and episodes ------------------------------------------------------------------------
    def _read_tasks(self) -> dict[int, str]:
        table = read_parquet(self.root / TASKS)
        if "task_index" not in table.column_names or "task" not in table.column_names:
            raise DatasetError(f"{self.root / TASKS}: expected columns 'task_index' and 'task'")
        idx, text = table.column("task_index").to_pylist(), table.column("task").to_pylist()
        return dict(zip(idx, text))

    def _read_episodes(self) -> dict[int, EpisodeInfo]:
        files = sorted((self.root / EPISODES_DIR).glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(
                f"{self.root / EPISODES_DIR}: no episode metadata files (chunk-*/file-*.parquet)"
            )
        cols = ["episode_index", "length", "data/chunk_index", "data/file_index"]
        cols += ["dataset_from_index", "dataset_to_index"]
        for key in self.video_keys:
            cols += [
                f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
            ]
        episodes: dict[int, EpisodeInfo] = {}
        for path in files:
            schema = _schema(path)
            missing = [c for c in cols if c not in schema.names]
            if missing:
                raise DatasetError(f"{path}: missing columns {missing}")
            rows = read_parquet(path, columns=cols).to_pydict()
            for i, ep in enumerate(rows["episode_index"]):
                videos = {
                    key: tuple(
                        rows[f"videos/{key}/{c}"][i]
                        for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
                    )
                    for key in self.video_keys
                }
                episodes[ep] = EpisodeInfo(
                    index=ep,
                    length=rows["length"][i],
                    data_file=(rows["data/chunk_index"][i], rows["data/file_index"][i]),
                    from_index=rows["dataset_from_index"][i],
                    to_index=rows["dataset_to_index"][i],
                    videos=videos,  # type: ignore[arg-type]
                )
        return dict(sorted(episodes.items()))


def _schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DatasetError(f"{path}: cannot read parquet (truncated or corrupt?): {err}") from None


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
