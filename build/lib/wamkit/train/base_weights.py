"""The base a checkpoint trains on top of: what it is, and the hash that pins its contents.

A checkpoint holds what training changes (the trained parameters, the optimizer state, the EMA) and a
reference to the frozen weights it was trained on, never the frozen weights themselves (8.19B of
Cosmos3-Nano's 15.16B parameters). The adapter names its base (``base_reference()``):

- ``{"kind": "diffusers", "path": ..., "files": [...]}``: safetensors files of a folder on disk, pinned
  by the sha256 of each file's bytes (hashed once per run: ``run_dir/base.json`` keeps the hashes
  keyed by size and modification time, so a resume re-reads nothing unchanged);
- ``{"kind": "preset", "preset": ..., "sha256": ...}``: weights a preset regenerates exactly anywhere
  (the hash is the adapter's, over the frozen tensors).

An adapter without a base (``None``) saves its whole model, as before. Resume and export compare the
hashes and refuse another base, naming both.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from wamkit.config import ConfigError
from wamkit.files import atomic_write_json

BASE_CACHE = "base.json"


def sha256_file(path: Path, block: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(root: Path, names: list[str], cache: Path | None) -> dict[str, str]:
    known = json.loads(cache.read_text()) if cache is not None and cache.is_file() else {}
    out, seen = {}, {}
    for name in names:
        f = root / name
        st = f.stat()
        key = str(f.resolve())
        hit = known.get(key)
        if hit and hit["size"] == st.st_size and hit["mtime_ns"] == st.st_mtime_ns:
            digest = hit["sha256"]
        else:
            digest = sha256_file(f)
        out[name] = digest
        seen[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    if cache is not None:
        atomic_write_json(cache, {**known, **seen})
    return out


def resolve(reference: dict[str, Any] | None, cache_dir: Path | None = None) -> dict[str, Any] | None:
    """The reference with its content hash: ``sha256`` over the files' hashes (diffusers) or as given."""
    if reference is None:
        return None
    ref = dict(reference)
    if ref["kind"] == "diffusers":
        root = Path(ref["path"])
        cache = cache_dir / BASE_CACHE if cache_dir is not None else None
        files = _hash_files(root, list(ref["files"]), cache)
        ref["file_sha256"] = files
        ref["sha256"] = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    elif ref["kind"] != "preset" or "sha256" not in ref:
        raise ValueError(f"a base reference of kind {ref['kind']!r} needs a sha256")
    return ref


def describe(ref: dict[str, Any]) -> str:
    where = ref.get("path") or f"preset {ref.get('preset')}"
    return f"{where} (sha256 {ref['sha256'][:16]}...)"


def check_same(saved: dict[str, Any] | None, current: dict[str, Any] | None, what: str) -> None:
    """Refuse ``what`` (a resume, an export) on another base than the checkpoint's, naming both."""
    if saved is None:
        return  # a checkpoint that holds its whole model carries its own frozen weights
    if current is None or saved["sha256"] != current["sha256"]:
        now = describe(current) if current is not None else "none"
        raise ConfigError(
            f"{what}: the checkpoint was trained on the base {describe(saved)}, but this run's base is "
            f"{now}; its frozen weights are not in the checkpoint, so it needs that very base "
            "(model.pretrained)"
        )


def file_list(tdir: Path, root: Path) -> list[str]:
    return sorted(os.path.relpath(f, root) for f in tdir.glob("*.safetensors"))
