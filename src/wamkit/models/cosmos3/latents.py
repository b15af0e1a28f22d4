"""The latent cache: the Wan-VAE latents of every training clip, encoded once instead of on every step.

Cosmos3 SFT trains toward the VAE latents of each sample's 17-frame clip; encoding them costs most of a
step (docs/results-log.md, "Cosmos3 SFT with cached latents"). ``wamkit cache-latents`` writes them once,
and a run with ``model.options.latent_cache=<folder>`` reads them instead of encoding.

A cache folder (default ``<data.root>/latents/cosmos3-<digest>``, the digest of what follows):

    manifest.json                    {"format": "wamkit-latents", "version": 2, "fingerprint": {...},
                                      "dtype": "bfloat16", "shard_size": 256, "suites": {name: rows},
                                      "contents": {name: {part: {"files", "bytes", "sha256"}}}}
    <suite>/shard-000000.safetensors {"latents": [n, C, T, h, w]}: rows [k * shard_size, ... + n) of
                                      that suite (the row order of the suite's LeRobot dataset)

The **fingerprint** is everything a latent depends on (:data:`FINGERPRINT_FIELDS`): the VAE's weights
hash and dtype, the canvas tier, the image size and resize kernel, the cameras and which dataset
features feed them, the chunk and the future-frame offsets, the fps. A run whose settings give another
fingerprint is refused with the fields that differ. Stored latents are ``dtype`` (bfloat16 by default,
half the disk; the on-the-fly encode is fp32: docs/cosmos3.md says what that changes).

The **contents** name the data itself (:func:`dataset_contents`): per suite, a digest of its LeRobot
dataset's files, so a run whose data has the same suite names and lengths but other frames (another
dataset, a re-collected one) is refused naming the suite and the part that differs, rather than pairing
its frames with another dataset's targets. ``meta/info.json``, ``meta/tasks.parquet`` and
``meta/episodes/`` are hashed whole (small); each file under ``data/`` and ``videos/`` by its path,
its size and the sha256 of its first and last MiB (:data:`EDGE_BYTES`), so a 100 GB dataset is checked
in seconds. A change that keeps a file's size and both ends is not seen; mtimes are not used (a copy
changes them). A rewrite of the same frames (re-encoded videos, another parquet writer) counts as other
data: build the cache again.

**Crash protocol**: the manifest is written before any shard; each shard is written whole through
:func:`wamkit.files.atomic_write_with` (temp file, fsync, rename), so a shard file exists only complete.
A build killed at any point is finished by running it again: shards that exist (with a readable header
of the right length) are kept, the others are written. A reader opens every shard header first and
names the first missing or unreadable file.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from wamkit.config import ConfigError
from wamkit.files import atomic_write_json, atomic_write_with, fsync_dir, read_json

log = logging.getLogger(__name__)

LATENTS = "video_latents"  # batch key: float [B, C, T, h, w], the clean latents of each sample's clip
MANIFEST = "manifest.json"
FORMAT, VERSION = "wamkit-latents", 2  # 2: the data contents recorded
TENSOR = "latents"  # the tensor's name inside a shard file
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# The model's side of the fingerprint (Cosmos3Adapter.latent_fingerprint) and the data's
# (data_fingerprint): a run checks each side where it knows it (the adapter at build, the loader when
# it opens the cache); the writer records both.
MODEL_FIELDS = ("encoder", "vae_sha256", "vae_dtype", "resolution_tier", "image_size", "cameras", "chunk",
                "future_frame_offsets")  # fmt: skip
DATA_FIELDS = ("image_size", "resize", "cameras", "camera_sources", "chunk", "fps")
FINGERPRINT_FIELDS = tuple(dict.fromkeys(MODEL_FIELDS + DATA_FIELDS))
# A suite's contents, part by part: the files hashed whole, and the folders whose files are named by
# path, size and their two ends (the module docstring says why)
WHOLE_FILES = {"info": ("meta/info.json",), "episodes": ("meta/tasks.parquet", "meta/episodes")}
EDGE_FILES = {"data": "data", "videos": "videos"}
EDGE_BYTES = 1 << 20


class LatentCacheError(ConfigError):
    """A latent cache is missing, incomplete, corrupt, or was built with other settings; the message
    names the file or the fields."""


def data_fingerprint(spec, fps: float) -> dict[str, Any]:
    """The data's side of the fingerprint from the run's preprocessing spec (image transform, cameras)."""
    return {
        "image_size": int(spec.image_size),
        "resize": spec.resize,
        "cameras": list(spec.cameras),
        "camera_sources": list(spec.camera_sources),
        "chunk": int(spec.chunk),
        "fps": float(fps),
    }


def _files(root: Path, rel: str) -> list[Path]:
    path = root / rel
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _edges_sha256(path: Path, size: int) -> str:
    """sha256 of a file's first and last :data:`EDGE_BYTES` (the whole file when it is smaller)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            h.update(f.read())
    return h.hexdigest()


def dataset_contents(root: str | Path) -> dict[str, dict[str, Any]]:
    """What names a LeRobot dataset's contents: ``{part: {"files", "bytes", "sha256"}}`` for the parts
    of :data:`WHOLE_FILES` and :data:`EDGE_FILES` (see the module docstring)."""
    root, out = Path(root), {}
    parts = [(name, rels, True) for name, rels in WHOLE_FILES.items()]
    parts += [(name, (rel,), False) for name, rel in EDGE_FILES.items()]
    for name, rels, whole in parts:
        h, files, size = hashlib.sha256(), 0, 0
        for path in (p for rel in rels for p in _files(root, rel)):
            n = path.stat().st_size
            body = hashlib.sha256(path.read_bytes()).hexdigest() if whole else _edges_sha256(path, n)
            h.update(f"{path.relative_to(root).as_posix()}|{n}|{body}\n".encode())
            files, size = files + 1, size + n
        out[name] = {"files": files, "bytes": size, "sha256": h.hexdigest()}
    return out


def _content_differences(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Per suite of ``want``, the parts whose digest differs from ``have``'s, each with both sides."""

    def show(d: dict[str, Any]) -> str:
        return f"{d['files']} files, {d['bytes']} bytes, sha256 {d['sha256'][:12]}"

    out = []
    for suite, parts in want.items():
        if suite not in have:
            out.append(f"suite {suite!r}: the cache records no contents for it")
            continue
        diff = [
            f"{name} (cache: {show(have[suite][name]) if name in have[suite] else 'none'}; "
            f"this run: {show(d)})"
            for name, d in parts.items()
            if have[suite].get(name) != d
        ]
        if diff:
            out.append(f"suite {suite!r}: other data: " + ", ".join(diff))
    return out


def digest(fingerprint: dict[str, Any], dtype: str) -> str:
    """The default folder name of a cache: ``cosmos3-`` and 12 hex digits of its fingerprint and dtype."""
    text = json.dumps({"fingerprint": fingerprint, "dtype": dtype}, sort_keys=True)
    return f"{fingerprint.get('encoder', 'latents')}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _differences(have: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [f"{k}: cache {have.get(k)!r}, this run {want[k]!r}" for k in want if have.get(k) != want[k]]


def shard_path(root: Path, suite: str, k: int) -> Path:
    return root / suite / f"shard-{k:06d}.safetensors"


def _shard_rows(rows: int, shard_size: int, k: int) -> int:
    return min(shard_size, rows - k * shard_size)


def _read_header(path: Path) -> tuple[list[int], str]:
    """``(shape, dtype)`` of a shard's tensor, or LatentCacheError naming the file."""
    if not path.is_file():
        raise LatentCacheError(
            f"{path} is missing: the latent cache is incomplete; run `wamkit cache-latents` with the "
            "run's config again to finish it"
        )
    try:
        with safe_open(str(path), framework="pt") as f:
            sl = f.get_slice(TENSOR)
            return list(sl.get_shape()), str(sl.get_dtype())
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise LatentCacheError(
            f"{path}: not a readable latent shard ({err}); delete it and run `wamkit cache-latents` again"
        ) from None


def _shard_ok(path: Path, rows: int, dtype: str) -> bool:
    try:
        shape, got = _read_header(path)
    except LatentCacheError:
        return False
    return shape[0] == rows and got == {"bfloat16": "BF16", "float32": "F32"}[dtype]


class LatentCacheWriter:
    """Writes one cache folder; ``todo()`` lists the shards still missing, ``write`` commits one.

    An existing folder must hold a manifest of the same fingerprint, dtype, shard size and suites (it is
    then resumed); otherwise LatentCacheError names what differs.
    """

    def __init__(self, root: str | Path, fingerprint: dict[str, Any], dtype: str, shard_size: int,
                 suites: dict[str, int], contents: dict[str, Any] | None = None):  # fmt: skip
        if dtype not in DTYPES:
            raise ValueError(f"latent cache dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        if shard_size < 1:
            raise ValueError(f"latent cache shard size: expected a positive number of rows, got {shard_size}")
        self.root, self.dtype, self.shard_size = Path(root), dtype, shard_size
        self.suites = dict(suites)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": fingerprint,
            "dtype": dtype,
            "shard_size": shard_size,
            "suites": self.suites,
            "contents": dict(contents or {}),  # {suite: dataset_contents(its root)}; {} for synthetic data
        }
        path = self.root / MANIFEST
        if path.is_file():
            old = read_json(path, LatentCacheError)
            diff = _differences(old.get("fingerprint", {}), fingerprint) + _differences(
                old, {k: manifest[k] for k in ("format", "version", "dtype", "shard_size", "suites")}
            )
            if not diff:
                diff = _content_differences(old.get("contents", {}), manifest["contents"])
            if diff:
                raise LatentCacheError(
                    f"{path}: this folder holds a latent cache built with other settings ("
                    + "; ".join(diff)
                    + "); pick another folder or delete this one"
                )
            log.info("latent cache %s exists: resuming it", self.root)
        else:  # n processes (--part) may create it at once: each stages its own file, renames are atomic
            staged = atomic_write_json(self.root / f".{MANIFEST}.{os.getpid()}", manifest)
            os.replace(staged, path)
            fsync_dir(self.root)

    def shards(self) -> list[tuple[str, int, range]]:
        """Every shard of the cache: ``(suite, k, rows)``."""
        out = []
        for suite, rows in self.suites.items():
            for k in range(math.ceil(rows / self.shard_size)):
                start = k * self.shard_size
                out.append((suite, k, range(start, start + _shard_rows(rows, self.shard_size, k))))
        return out

    def todo(self) -> list[tuple[str, int, range]]:
        """The shards not yet written whole (a file with a bad header is written again)."""
        out = []
        for suite, k, rows in self.shards():
            path = shard_path(self.root, suite, k)
            if path.exists() and _shard_ok(path, len(rows), self.dtype):
                continue
            if path.exists():
                log.warning("%s: unreadable or of the wrong length; writing it again", path)
            out.append((suite, k, rows))
        return out

    def write(self, suite: str, k: int, latents: torch.Tensor) -> Path:
        """Commit shard ``k`` of ``suite``: latents [n, C, T, h, w] (any float dtype; stored as ``dtype``)."""
        want = _shard_rows(self.suites[suite], self.shard_size, k)
        if latents.shape[0] != want:
            raise ValueError(f"shard {k} of {suite}: {latents.shape[0]} rows, expected {want}")
        t = latents.detach().to("cpu", DTYPES[self.dtype]).contiguous()
        path = shard_path(self.root, suite, k)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write_with(path, lambda tmp: save_file({TENSOR: t}, str(tmp)))


class LatentCache:
    """A complete cache folder, opened for reading: ``get(suite, row)`` -> float32 [C, T, h, w].

    Opening reads the manifest and every shard's header, so a missing, truncated or foreign file is
    named at the start of a run rather than when the sampler first reaches it."""

    def __init__(self, root: str | Path, max_open: int = 16):
        self.root = Path(root)
        m = read_json(
            self.root / MANIFEST,
            LatentCacheError,
            missing="model.options.latent_cache must name a folder written by `wamkit cache-latents`",
        )
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise LatentCacheError(
                f"{self.root / MANIFEST}: format {m.get('format')!r} version {m.get('version')!r}; "
                f"expected {FORMAT!r} version {VERSION}; build it again with `wamkit cache-latents`"
            )
        self.fingerprint: dict[str, Any] = m["fingerprint"]
        self.dtype, self.shard_size = m["dtype"], int(m["shard_size"])
        self.suites: dict[str, int] = dict(m["suites"])
        self.contents: dict[str, Any] = dict(m["contents"])
        self.shape: list[int] | None = None
        for suite, rows in self.suites.items():
            for k in range(math.ceil(rows / self.shard_size)):
                self._check_shard(shard_path(self.root, suite, k), _shard_rows(rows, self.shard_size, k))
        self._open: OrderedDict[Path, Any] = OrderedDict()
        self.max_open = max_open

    def _check_shard(self, path: Path, rows: int) -> None:
        shape, _ = _read_header(path)
        if shape[0] != rows or (self.shape is not None and shape[1:] != self.shape):
            raise LatentCacheError(
                f"{path}: holds {shape} but the cache expects [{rows}, *{self.shape or 'C, T, h, w'}]; "
                "delete it and run `wamkit cache-latents` again"
            )
        self.shape = shape[1:]

    def check(self, want: dict[str, Any], who: str) -> None:
        """Refuse a run whose fingerprint fields ``want`` differ from the cache's, naming them."""
        diff = _differences(self.fingerprint, want)
        if diff:
            raise LatentCacheError(
                f"model.options.latent_cache: {self.root} was built with other settings than this run's "
                f"{who} (" + "; ".join(diff) + "); build a cache for this run with `wamkit cache-latents`"
            )

    def check_suites(self, sizes: dict[str, int]) -> None:
        """The run's suites and their row counts must be the cache's."""
        if sizes != self.suites:
            raise LatentCacheError(
                f"model.options.latent_cache: {self.root} holds suites {self.suites} (rows each) but the "
                f"run's data has {sizes}; build a cache for this data with `wamkit cache-latents`"
            )

    def check_contents(self, contents: dict[str, Any]) -> None:
        """The run's suites must hold the data the cache was built from (:func:`dataset_contents`)."""
        diff = _content_differences(self.contents, contents)
        if diff:
            raise LatentCacheError(
                f"model.options.latent_cache: {self.root} was built from other data than this run's ("
                + "; ".join(diff)
                + "); build a cache for this data with `wamkit cache-latents`"
            )

    def get(self, suite: str, row: int) -> torch.Tensor:
        k, j = divmod(row, self.shard_size)
        path = shard_path(self.root, suite, k)
        try:
            if path not in self._open:
                if len(self._open) >= self.max_open:
                    self._open.popitem(last=False)
                self._open[path] = safe_open(str(path), framework="pt")
            self._open.move_to_end(path)
            return self._open[path].get_slice(TENSOR)[j : j + 1][0].float()
        except (SafetensorError, OSError) as err:
            raise LatentCacheError(f"{path}: reading row {j} failed ({err})") from None

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own handles
        return {**self.__dict__, "_open": OrderedDict()}


class CachedLatentsDataset(torch.utils.data.Dataset):
    """A training dataset (``wamkit.data.sft_dataset.TrainDataset``) whose samples also carry
    :data:`LATENTS` from ``cache``: sample ``i`` is row ``i - offsets[s]`` of suite ``names[s]``."""

    def __init__(self, dataset, cache: LatentCache):
        self.dataset, self.cache = dataset, cache
        self.names, self.offsets = list(dataset.names), list(dataset.offsets)
        self.suite_sizes, self.weights = dataset.suite_sizes, dataset.weights  # the sampler reads them
        cache.check_suites(dict(zip(self.names, self.suite_sizes)))
        cache.check_contents(suite_contents(dataset))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = bisect.bisect_right(self.offsets, i) - 1
        sample = self.dataset[i]
        sample[LATENTS] = self.cache.get(self.names[s], i - self.offsets[s])
        return sample


def suite_contents(dataset) -> dict[str, Any]:
    """``{suite: dataset_contents(root)}`` of a training dataset's suites (LeRobot datasets)."""
    return {name: dataset_contents(ds.root) for name, ds in dataset.suites.items()}


def open_training_dataset(dataset, folder: str | Path, spec, fps: float) -> CachedLatentsDataset:
    """The run's training dataset with each sample's cached latents; the cache must fit the run's data
    settings, suites and contents (the adapter checks the model's side when it is built)."""
    cache = LatentCache(folder)
    cache.check(data_fingerprint(spec, fps), "data settings")
    return CachedLatentsDataset(dataset, cache)


def writer_for(dataset, model_fingerprint: dict[str, Any], spec, fps: float, *, out: str | Path | None,
               parent: str | Path, dtype: str, shard_size: int) -> LatentCacheWriter:  # fmt: skip
    """The writer of ``dataset``'s cache: ``out``, or ``parent / digest(...)`` when ``out`` is None."""
    fingerprint = {**model_fingerprint, **data_fingerprint(spec, fps)}
    root = Path(out) if out else Path(parent) / digest(fingerprint, dtype)
    suites = dict(zip(dataset.names, dataset.suite_sizes))
    return LatentCacheWriter(root, fingerprint, dtype, shard_size, suites, suite_contents(dataset))
