"""Artifact file names and crash-safe writes, shared by every stage.

The crash protocol of a whole-file write: write ``<name>.tmp`` beside the target, flush and fsync it,
``os.replace`` it over the target (atomic on POSIX), then fsync the directory so the rename itself
survives a power cut. A crash at any point leaves the old file or the new one, never half of either.

The protocol of a whole directory (a serving directory, an export): write into ``<name>.tmp/``
(:func:`fresh_tmp_dir`), verify it, then :func:`commit_dir`: every file is fsynced, an old ``<name>``
is moved aside (``<name>.old``), the new one renamed into place, and only then the old one removed —
so a crash never leaves neither.

The JSONL protocol of a journal: one JSON object per line, each appended, flushed and fsynced before it
counts. A crash can leave only a torn *last* line; :func:`read_jsonl` drops it (and with ``repair``
truncates the file back to the last whole line), while a bad line in the middle is an error.

Imports only the standard library, so every stage may use it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

# Names of the files that travel between stages (a training checkpoint, a serving directory, an export).
WEIGHTS_FILE = "model.safetensors"  # the model's weights
MODEL_FILE = "model.json"  # how to rebuild the model (registry name, preset, options, io)
STATS_FILE = "stats.json"  # per-feature statistics (wamkit.actions.stats)
SPEC_FILE = "preprocess.json"  # the preprocessing spec (wamkit.actions.spec)
CONFIG_FILE = "config.yaml"  # a run's resolved config
LOSSES_FILE = "losses.jsonl"  # a training run's loss journal

MODEL_FORMAT = "wamkit-model"  # the header of model.json
MODEL_FORMAT_VERSION = 1


def model_json(config: dict[str, Any]) -> dict[str, Any]:
    """The contents of ``model.json`` for an adapter's ``config_dict()``: the header, then the config."""
    return {"format": MODEL_FORMAT, "version": MODEL_FORMAT_VERSION, **config}


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in directory ``path`` durable."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: str | os.PathLike) -> Path:
    """Where a write of ``path`` is staged: ``<name>.tmp`` beside it (``x.mp4`` -> ``x.tmp.mp4``, so
    tools that look at the suffix still recognise it)."""
    path = Path(path)
    if path.suffix in (".mp4", ".safetensors", ".parquet"):
        return path.with_name(f"{path.stem}.tmp{path.suffix}")
    return path.with_name(path.name + ".tmp")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path to write ``path`` through; on success it is fsynced and renamed into place,
    on an exception it is removed and the old ``path`` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` all or nothing (see the module docstring)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1, **kw: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, **kw) + "\n")


def atomic_write_with(path: str | os.PathLike, write: Callable[[Path], Any]) -> Path:
    """Stage ``write(tmp)`` (a writer that takes a path, e.g. safetensors' ``save_file``), then commit."""
    with atomic_path(path) as tmp:
        write(tmp)
    return Path(path)


def read_json(path: str | os.PathLike, error: type[Exception] = ValueError, missing: str = "") -> Any:
    """The JSON in ``path``; a missing file or invalid JSON raises ``error`` naming the file (and
    ``missing``, what the caller expected there)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path} does not exist" + (f" ({missing})" if missing else ""))
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: not valid JSON ({err})") from None


def fresh_tmp_dir(out: str | os.PathLike) -> Path:
    """An empty ``<out>.tmp/`` beside ``out`` (a leftover from a killed write is removed first)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every file under ``path`` and the directory itself."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def commit_dir(tmp: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Move a finished ``tmp`` directory to ``out`` (see the module docstring). An existing ``out`` is
    replaced only with ``overwrite``; otherwise FileExistsError, and ``tmp`` stays for a look."""
    tmp, out = Path(tmp), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    fsync_tree(tmp)
    aside = out.with_name(out.name + ".old")
    if aside.exists():
        shutil.rmtree(aside)
    if out.exists():
        os.replace(out, aside)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    if aside.exists():
        shutil.rmtree(aside)
    return out


def append_jsonl(fh: IO[str], obj: Any, **kw: Any) -> None:
    """Append one record to an open journal and make it durable before returning."""
    fh.write(json.dumps(obj, **kw) + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def append_jsonl_path(path: str | os.PathLike, obj: Any, **kw: Any) -> None:
    """Open, append one durable record, close (for journals written rarely)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        append_jsonl(fh, obj, **kw)


class JournalError(ValueError):
    """A journal has a bad line that is not the torn last one."""


def read_jsonl(
    path: str | os.PathLike, repair: bool = False, check: Callable[[Any], None] | None = None
) -> list[Any]:
    """The records of a JSONL journal, dropping a torn last line (and with ``repair`` truncating the file
    to its last whole line). A missing file has no records; a bad line elsewhere raises JournalError.

    The last line is torn when it has no newline after it (every append writes one), is not JSON, or
    fails ``check`` (a callable that raises ValueError for a record that is not whole).
    """
    path = Path(path)
    if not path.is_file():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out: list[Any] = []
    good_end = 0
    for i, line in enumerate(lines):
        last = i == len(lines) - 1 or (i == len(lines) - 2 and lines[-1] == b"")
        if not line.strip():
            good_end += len(line) + (1 if i < len(lines) - 1 else 0)
            continue
        try:
            if i == len(lines) - 1:
                raise ValueError("no newline after it")
            record = json.loads(line)
            if check is not None:
                check(record)
        except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
            if last:  # a write cut short
                log.warning("%s: dropping a torn last line (%s)", path, err)
                break
            raise JournalError(f"{path}: line {i + 1} is not a valid record: {err}") from None
        out.append(record)
        good_end += len(line) + 1
    if repair and good_end < len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return out


def rewrite_jsonl(path: str | os.PathLike, records: list[Any], **kw: Any) -> Path:
    """Replace a journal's contents with ``records``, atomically."""
    return atomic_write_text(path, "".join(json.dumps(r, **kw) + "\n" for r in records))
