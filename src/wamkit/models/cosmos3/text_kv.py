"""The text keys/values of a run's captions on disk: the understanding tower run once per caption.

Cosmos3's generation tokens read the caption only through each layer's text keys and values, and
those depend on the caption's token ids alone (:mod:`wamkit.models.cosmos3.kv_step` says why, with
diffusers' lines). A training run has few distinct captions (every task instruction with each
``idle_frame`` value its data can give, and the dropped caption ``""``), so ``wamkit cache-text``
encodes each once, and a run with ``model.options.text_kv_cache=<folder>`` reads them instead of running
the frozen understanding tower, and its recompute under checkpointing, on every micro-batch.

A cache folder:

    manifest.json               {"format": "wamkit-text-kv", "version": 1, "fingerprint": {...},
                                 "captions": {digest: caption}}
    kv/<digest>.safetensors     {"keys", "values"}: [layers, KV heads, U, head_dim] of one caption

The **fingerprint** is everything the keys/values depend on: the frozen weights' hash
(``understanding_sha256``), the tokenizer, the dtype they were computed in, and the settings the
captions are built from (view point and description, fps, chunk, canvas). A run whose settings give
another fingerprint is refused with the fields that differ; a caption the run draws that the cache
lacks is refused naming it.

**Crash protocol**: the manifest (with the full caption list) is written before any caption; each
caption's file is written whole (temp file, fsync, rename). A build killed at any point is finished by
running it again: files that exist are kept, the missing ones are computed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from wamkit.config import ConfigError
from wamkit.files import atomic_write_json, atomic_write_with, read_json
from wamkit.models.cosmos3.kv_step import TextKV

log = logging.getLogger(__name__)

FORMAT, VERSION = "wamkit-text-kv", 1
MANIFEST = "manifest.json"
OPTION = "text_kv_cache"  # model.options key: the folder a run reads


class TextCacheError(ConfigError):
    """A text key/value cache that cannot serve this run (missing, foreign, stale or incomplete)."""


def caption_digest(caption: str) -> str:
    return hashlib.sha256(caption.encode()).hexdigest()[:24]


def _path(root: Path, digest: str) -> Path:
    return root / "kv" / f"{digest}.safetensors"


def _differences(have: dict[str, Any], want: dict[str, Any], only_wanted: bool = False) -> list[str]:
    keys = sorted(want) if only_wanted else sorted(set(have) | set(want))
    return [
        f"{k}: cache {have.get(k)!r}, this run {want.get(k)!r}" for k in keys if have.get(k) != want.get(k)
    ]


def _readable(path: Path) -> bool:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {"keys", "values"} <= set(f.keys())
    except (SafetensorError, OSError):
        return False


def build(
    root: str | Path,
    fingerprint: dict[str, Any],
    captions: Iterable[str],
    encode: Callable[[str], TextKV],
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write (or finish) the cache of ``captions`` in ``root``; ``encode(caption)`` computes one.

    A folder that holds another fingerprint's cache is refused (naming the fields), never mixed.
    Returns ``{"path", "captions", "written"}``."""
    root = Path(root)
    wanted = {caption_digest(c): c for c in sorted(set(captions))}
    manifest = root / MANIFEST
    if manifest.is_file():
        have = read_json(manifest, TextCacheError)
        diff = _differences(have.get("fingerprint", {}), fingerprint)
        if have.get("format") != FORMAT or have.get("version") != VERSION or diff:
            raise TextCacheError(
                f"{root}: holds a text cache of other settings ("
                + "; ".join(diff or [f"format {have.get('format')!r} version {have.get('version')!r}"])
                + "); give another --out or delete it"
            )
        wanted = {**have["captions"], **wanted}
    root.mkdir(parents=True, exist_ok=True)
    atomic_write_json(manifest, {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint,
                                 "captions": wanted})  # fmt: skip
    todo = [(d, c) for d, c in wanted.items() if not _readable(_path(root, d))]
    (root / "kv").mkdir(exist_ok=True)
    for i, (digest, caption) in enumerate(todo):
        kv = encode(caption)
        tensors = {
            "keys": kv.keys.detach().cpu().contiguous(),
            "values": kv.values.detach().cpu().contiguous(),
        }
        atomic_write_with(_path(root, digest), lambda tmp, t=tensors: save_file(t, str(tmp)))
        if progress is not None:
            progress(i + 1, len(todo))
    return {"path": str(root), "captions": len(wanted), "written": len(todo)}


class TextKVDiskCache:
    """A complete cache folder, opened for reading: ``get(caption, device)`` -> :class:`TextKV`.

    Opening reads the manifest and checks that every caption's file is there, so an incomplete cache is
    named at the start of a run. Keys/values are read on first use and kept in host memory (a run has
    a few hundred captions at most)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        m = read_json(
            self.root / MANIFEST,
            TextCacheError,
            missing=f"model.options.{OPTION} must name a folder written by `wamkit cache-text`",
        )
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise TextCacheError(
                f"{self.root / MANIFEST}: format {m.get('format')!r} version {m.get('version')!r}; "
                f"expected {FORMAT!r} version {VERSION}; build it again with `wamkit cache-text`"
            )
        self.fingerprint: dict[str, Any] = m["fingerprint"]
        self.captions: dict[str, str] = dict(m["captions"])
        missing = [d for d in self.captions if not _path(self.root, d).is_file()]
        if missing:
            raise TextCacheError(
                f"{_path(self.root, missing[0])} is missing ({len(missing)} of {len(self.captions)} captions): "
                "the text cache is incomplete; run `wamkit cache-text` with the run's config again to finish it"
            )
        self._host: dict[str, TextKV] = {}

    def check(self, want: dict[str, Any]) -> None:
        """Refuse a run whose fingerprint fields ``want`` differ from the cache's, naming them."""
        diff = _differences(self.fingerprint, want, only_wanted=True)
        if diff:
            raise TextCacheError(
                f"model.options.{OPTION}: {self.root} was built with other settings than this run's ("
                + "; ".join(diff)
                + "); build a cache for this run with `wamkit cache-text`"
            )

    def get(self, caption: str, device: torch.device) -> TextKV:
        digest = caption_digest(caption)
        if digest not in self._host:
            if digest not in self.captions:
                raise TextCacheError(
                    f"model.options.{OPTION}: {self.root} has no caption {caption!r} (this run's data "
                    "draws it); build a cache for this run's data with `wamkit cache-text`"
                )
            with safe_open(str(_path(self.root, digest)), framework="pt") as f:
                self._host[digest] = TextKV(f.get_tensor("keys"), f.get_tensor("values"))
        kv = self._host[digest]
        return TextKV(kv.keys.to(device, non_blocking=True), kv.values.to(device, non_blocking=True))
