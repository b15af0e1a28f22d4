"""``LeRobotDatasetWriter``: write a LeRobot v3 dataset that lerobot 0.6.1 reads.

Each episode gets its own data file, episode-metadata file and one mp4 per camera
(``chunk = episode // chunks_size``, ``file = episode % chunks_size``), so saving an episode never
rewrites an earlier one. ``save_episode`` makes the episode durable in this order: videos, data file,
then the episode-metadata file, each written under a temporary name and renamed into place; the
metadata file is the commit point. A crash leaves at most orphan files of an unsaved episode, which
the next ``save_episode`` overwrites.

Completion marker: ``meta/info.json`` exists only once :meth:`finalize` has run. Until then the writer's
state lives in ``meta/wamkit_partial.json`` and readers refuse the folder (see :mod:`wamkit.data.meta`).
``open(root)`` on a finished dataset removes ``meta/info.json`` again until the next ``finalize``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from wamkit.constants import EPISODE_INDEX, FRAME_INDEX, INDEX, TASK, TASK_INDEX, TIMESTAMP
from wamkit.data import lerobot_stats as es
from wamkit.data.meta import (
    CODEBASE_VERSION,
    EPISODES_DIR,
    INFO,
    PARTIAL,
    TASKS,
    DatasetError,
    episode_meta_files,
    read_parquet,
)
from wamkit.data.video import VideoEncoder
from wamkit.files import atomic_write_bytes, atomic_write_with

CHUNKS_SIZE = 1000
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
EPISODE_META_PATH = EPISODES_DIR + "/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
_NUMERIC = {
    "float32": np.float32,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
}
_DEFAULTS = {
    TIMESTAMP: {"dtype": "float32", "shape": [1], "names": None},
    FRAME_INDEX: {"dtype": "int64", "shape": [1], "names": None},
    EPISODE_INDEX: {"dtype": "int64", "shape": [1], "names": None},
    INDEX: {"dtype": "int64", "shape": [1], "names": None},
    TASK_INDEX: {"dtype": "int64", "shape": [1], "names": None},
}
_IMAGE_STATS_STRIDE = 4  # every 4th pixel row/column feeds the camera stats


def _atomic_write(path: Path, data: bytes | str) -> None:
    atomic_write_bytes(path, data.encode() if isinstance(data, str) else data)


def _write_table(path: Path, table: pa.Table) -> None:
    atomic_write_with(path, lambda tmp: pq.write_table(table, tmp))


def _check_features(features: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, feat in features.items():
        where = f"features['{key}']"
        if not isinstance(feat, dict) or "dtype" not in feat or "shape" not in feat:
            raise DatasetError(f"{where}: expected a dict with 'dtype' and 'shape'")
        dtype, shape = feat["dtype"], list(feat["shape"])
        if dtype in ("video", "image"):
            if len(shape) != 3 or shape[2] != 3:
                raise DatasetError(f"{where}: a {dtype} feature needs shape [H, W, 3], got {shape}")
            if dtype == "video" and (shape[0] % 2 or shape[1] % 2):
                raise DatasetError(f"{where}: video height and width must be even (yuv420p), got {shape}")
        elif dtype not in _NUMERIC:
            raise DatasetError(
                f"{where}: dtype {dtype!r} is not supported; expected video, image or {list(_NUMERIC)}"
            )
        if key in _DEFAULTS or key == TASK:
            raise DatasetError(f"{where}: '{key}' is written by the writer itself; leave it out")
        out[key] = {"dtype": dtype, "shape": shape, "names": feat.get("names")}
    return out


class LeRobotDatasetWriter:
    """Append episodes frame by frame; see the module docstring for the on-disk protocol."""

    def __init__(self, root: Path, info: dict[str, Any], gop: int = 2, crf: int = 18):
        self.root = root
        self.info = info
        self.gop, self.crf = gop, crf
        self.features = info["features"]
        self.tasks: dict[str, int] = {}
        self.num_episodes = 0
        self.num_frames = 0
        self._frames: list[dict[str, Any]] = []
        self._encoders: dict[str, VideoEncoder] = {}
        self._pixels: dict[str, list[np.ndarray]] = {}

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        root: str | Path,
        fps: int,
        features: dict[str, Any],
        robot_type: str | None = None,
        extra_info: dict[str, Any] | None = None,
    ) -> LeRobotDatasetWriter:
        """Start a new dataset in ``root`` (which must not exist or be empty).

        ``features``: ``{"observation.images.corner": {"dtype": "video", "shape": [H, W, 3], "names":
        [...]}, "observation.state": {"dtype": "float32", "shape": [S], "names": None}, ...}``.
        ``extra_info`` is stored in ``meta/info.json`` under ``"wamkit"``.
        """
        root = Path(root)
        if root.exists() and any(root.iterdir()):
            raise DatasetError(
                f"{root}: already exists and is not empty; use LeRobotDatasetWriter.open to append"
            )
        if not isinstance(fps, int) or fps <= 0:
            raise DatasetError(f"fps: expected a positive integer, got {fps!r}")
        feats = _check_features(features)
        for feat in feats.values():
            if feat["dtype"] == "video":
                h, w, _ = feat["shape"]
                feat["info"] = {
                    "video.height": h, "video.width": w, "video.codec": "h264", "video.pix_fmt": "yuv420p",
                    "video.is_depth_map": False, "video.fps": fps, "video.channels": 3, "has_audio": False,
                }  # fmt: skip
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": robot_type,
            "total_episodes": 0,
            "total_frames": 0,
            "total_tasks": 0,
            "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": 100,
            "video_files_size_in_mb": 200,
            "fps": fps,
            "splits": {},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if any(f["dtype"] == "video" for f in feats.values()) else None,
            "features": {**feats, **copy.deepcopy(_DEFAULTS)},
        }
        if extra_info:
            info["wamkit"] = dict(extra_info)
        root.mkdir(parents=True, exist_ok=True)
        _atomic_write(root / PARTIAL, json.dumps(info, indent=4))
        return cls(root, info)

    @classmethod
    def open(cls, root: str | Path) -> LeRobotDatasetWriter:
        """Re-open a partial or finished dataset to append episodes (a finished one becomes partial)."""
        root = Path(root)
        if (root / PARTIAL).is_file():
            writer = cls(root, json.loads((root / PARTIAL).read_text()))
            writer._recover()
        elif (root / INFO).is_file():
            info = json.loads((root / INFO).read_text())
            writer = cls(root, info)
            writer._recover()  # checked while the dataset is still complete: a refusal leaves it so
            _atomic_write(root / PARTIAL, json.dumps(info, indent=4))
            (root / INFO).unlink()  # no longer complete until finalize()
        else:
            raise DatasetError(f"{root}: neither {PARTIAL} nor {INFO} exists; nothing to open")
        return writer

    def _recover(self) -> None:
        """Rebuild counts and the task table from the committed episode-metadata files."""
        for stale in (self.root / EPISODES_DIR).glob("chunk-*/file-*.tmp.parquet"):
            stale.unlink()  # a write a kill interrupted: its episodes were never committed
        files = episode_meta_files(self.root)
        rows = []
        for path in files:
            rows += read_parquet(path, columns=["episode_index", "tasks", "length"]).to_pylist()
        rows.sort(key=lambda r: r["episode_index"])
        if [r["episode_index"] for r in rows] != list(range(len(rows))):
            raise DatasetError(f"{self.root / EPISODES_DIR}: episode indices are not 0..{len(rows) - 1}")
        for r in rows:
            for task in r["tasks"]:
                self.tasks.setdefault(task, len(self.tasks))
        self.num_episodes = len(rows)
        self.num_frames = sum(r["length"] for r in rows)

    # -- frames and episodes ---------------------------------------------------------------------
    def _paths(self, episode: int) -> tuple[int, int]:
        return episode // CHUNKS_SIZE, episode % CHUNKS_SIZE

    def add_frame(self, frame: dict[str, Any]) -> None:
        """Add one frame: every feature (images uint8 [H, W, 3]) plus ``"task"`` (str)."""
        missing = [k for k in [*self.features, TASK] if k not in frame and k not in _DEFAULTS]
        extra = [k for k in frame if k not in self.features and k != TASK]
        if missing or extra:
            raise DatasetError(
                f"add_frame: missing {missing}, unexpected {extra}; features are {list(self.features)}"
            )
        if not isinstance(frame[TASK], str) or not frame[TASK]:
            raise DatasetError(f"add_frame: '{TASK}' must be a non-empty string, got {frame[TASK]!r}")
        row: dict[str, Any] = {TASK: frame[TASK]}
        chunk, file = self._paths(self.num_episodes)
        for key, feat in self.features.items():
            if key in _DEFAULTS:
                continue
            value = np.asarray(frame[key])
            if feat["dtype"] in ("video", "image"):
                if value.dtype != np.uint8 or list(value.shape) != feat["shape"]:
                    raise DatasetError(
                        f"add_frame: '{key}' must be uint8 {feat['shape']}, got {value.dtype} {list(value.shape)}"
                    )
                if feat["dtype"] == "video":
                    if key not in self._encoders:
                        path = self.root / self.info["video_path"].format(
                            video_key=key, chunk_index=chunk, file_index=file
                        )
                        h, w, _ = feat["shape"]
                        self._encoders[key] = VideoEncoder(path, self.info["fps"], h, w, self.gop, self.crf)
                    self._encoders[key].add(value)
                else:
                    row[key] = _png(value)
                s = _IMAGE_STATS_STRIDE
                self._pixels.setdefault(key, []).append(value[::s, ::s])
            else:
                if value.size != int(np.prod(feat["shape"])):
                    raise DatasetError(
                        f"add_frame: '{key}' must have shape {feat['shape']}, got {list(value.shape)}"
                    )
                row[key] = value.astype(_NUMERIC[feat["dtype"]]).reshape(feat["shape"])
        self._frames.append(row)

    def save_episode(self) -> int:
        """Write the buffered frames as the next episode; durable once this returns. Returns its index."""
        if not self._frames:
            raise DatasetError("save_episode: no frames were added since the last save")
        ep, n, fps = self.num_episodes, len(self._frames), self.info["fps"]
        chunk, file = self._paths(ep)
        for enc in self._encoders.values():
            enc.close()
        tasks = list(dict.fromkeys(f[TASK] for f in self._frames))
        new_tasks = dict(self.tasks)
        for t in tasks:
            new_tasks.setdefault(t, len(new_tasks))
        columns: dict[str, Any] = {}
        for key, feat in self.features.items():
            if key in _DEFAULTS or feat["dtype"] == "video":
                continue
            if feat["dtype"] == "image":
                columns[key] = pa.array([{"bytes": f[key], "path": None} for f in self._frames],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))  # fmt: skip
            else:
                columns[key] = _numeric_column(np.stack([f[key] for f in self._frames]), feat)
        columns[TIMESTAMP] = pa.array(np.arange(n, dtype=np.float32) / np.float32(fps))
        columns[FRAME_INDEX] = pa.array(np.arange(n, dtype=np.int64))
        columns[EPISODE_INDEX] = pa.array(np.full(n, ep, np.int64))
        columns[INDEX] = pa.array(np.arange(self.num_frames, self.num_frames + n, dtype=np.int64))
        columns[TASK_INDEX] = pa.array(np.array([new_tasks[f[TASK]] for f in self._frames], np.int64))
        data_path = self.root / DATA_PATH.format(chunk_index=chunk, file_index=file)
        _write_table(data_path, pa.table(columns))

        meta: dict[str, Any] = {
            "episode_index": [ep], "tasks": [tasks], "length": [n],
            "data/chunk_index": [chunk], "data/file_index": [file],
            "dataset_from_index": [self.num_frames], "dataset_to_index": [self.num_frames + n],
        }  # fmt: skip
        for key in self._encoders:
            meta.update({f"videos/{key}/chunk_index": [chunk], f"videos/{key}/file_index": [file]})
            meta.update({f"videos/{key}/from_timestamp": [0.0], f"videos/{key}/to_timestamp": [n / fps]})
        for key, feat in self.features.items():
            if feat["dtype"] in ("video", "image"):
                stats = es.image_stats(np.stack(self._pixels[key]))
            else:
                stats = es.array_stats(np.asarray(columns[key].to_pylist(), np.float64).reshape(n, -1))
            for name, value in stats.items():
                meta[f"stats/{key}/{name}"] = [np.asarray(value).tolist()]
        meta["meta/episodes/chunk_index"], meta["meta/episodes/file_index"] = [chunk], [file]
        _write_table(self.root / EPISODE_META_PATH.format(chunk_index=chunk, file_index=file), pa.table(meta))

        self.tasks = new_tasks
        self.num_episodes += 1
        self.num_frames += n
        self._frames, self._encoders, self._pixels = [], {}, {}
        return ep

    def discard_episode(self) -> None:
        """Drop the frames added since the last save (e.g. a failed demonstration)."""
        for enc in self._encoders.values():
            enc.abort()
        self._frames, self._encoders, self._pixels = [], {}, {}

    def finalize(self) -> None:
        """Write ``meta/tasks.parquet``, ``meta/stats.json`` and, last, ``meta/info.json``."""
        if self._frames:
            raise DatasetError(
                "finalize: frames were added but not saved; call save_episode() or discard_episode()"
            )
        if self.num_episodes == 0:
            raise DatasetError(f"{self.root}: finalize: the dataset has no episodes")
        _write_table(self.root / TASKS, tasks_table(self.tasks))
        per_feature: dict[str, list[dict[str, np.ndarray]]] = {}
        for path in episode_meta_files(self.root):
            table = read_parquet(path)
            for row in table.to_pylist():
                for key in self.features:
                    if f"stats/{key}/mean" in row:
                        stats = {s: np.asarray(row[f"stats/{key}/{s}"]) for s in es.STATS}
                        per_feature.setdefault(key, []).append(stats)
        stats = {k: es.aggregate(v) for k, v in per_feature.items()}
        _atomic_write(self.root / "meta/stats.json", json.dumps(es.to_jsonable(stats), indent=4))
        info = dict(self.info)
        info.update(
            total_episodes=self.num_episodes,
            total_frames=self.num_frames,
            total_tasks=len(self.tasks),
            splits={"train": f"0:{self.num_episodes}"},
        )
        _atomic_write(self.root / INFO, json.dumps(info, indent=4))
        (self.root / PARTIAL).unlink(missing_ok=True)


def _numeric_column(values: np.ndarray, feat: dict[str, Any]) -> pa.Array:
    values = values.astype(_NUMERIC[feat["dtype"]])
    size = int(np.prod(feat["shape"]))
    if feat["shape"] == [1]:
        return pa.array(values.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), size)


def _png(image: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


def tasks_table(tasks: dict[str, int]) -> pa.Table:
    """``task_index`` with the task string as the pandas index, as lerobot writes (and reads) it."""
    table = pa.table(
        {"task_index": pa.array(list(tasks.values()), pa.int64()), "task": pa.array(list(tasks))}
    )
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64", "metadata": None},
            {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object", "metadata": None},
        ],
        "attributes": {}, "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.3.3",
    }  # fmt: skip
    return table.replace_schema_metadata({"pandas": json.dumps(pandas_meta)})
