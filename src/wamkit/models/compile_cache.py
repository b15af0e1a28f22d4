"""Compiled code kept on disk between starts, with torch's own machinery.

A served model that compiles its steps (Cosmos3's ``step_graph="compile"``) pays minutes of inductor
and autotuning per batch bucket on its first start. :class:`CompileCache` keeps what that produced —
torch's cache artifacts (``torch.compiler.save_cache_artifacts``: inductor's FX graphs and kernels,
AOTAutograd's graphs, autotuning choices) — in one file per key, and hot-loads it on the next start
(``torch.compiler.load_cache_artifacts``), so a second start compiles from cache hits.

The key is everything that changes the code: what the adapter says about itself
(``compile_fields()``: model, architecture, dtype, step mode), the torch, triton, diffusers and wamkit
versions, and the device (name, compute capability). Its hash names the entry's folder,
``<root>/<slug>-<hash>/`` holding ``artifacts.bin`` and ``manifest.json`` (the key's fields, the
artifacts' sha256, the buckets warmed). So an entry is never loaded for another key; when none exists
for this key but one does for the same model under another key, the log says which fields differ
(``stale``). An entry whose bytes do not match their sha256, or that torch cannot read, is not loaded
(``corrupt``) and is written again after this start's compiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from pathlib import Path
from typing import Any

from wamkit.files import atomic_write_bytes, atomic_write_json, read_json
from wamkit.versions import installed_versions

log = logging.getLogger(__name__)

FORMAT = "wamkit-compile-cache/1"
ARTIFACTS, MANIFEST = "artifacts.bin", "manifest.json"


def environment(device: Any) -> dict[str, Any]:
    """The fields of the key that come from the machine: library versions and the device."""
    import torch

    from wamkit import __version__

    dev = torch.device(device)
    out: dict[str, Any] = {
        "torch": torch.__version__,
        **installed_versions(("triton", "diffusers")),
        "wamkit": __version__,
        "python": platform.python_version(),
        "device": dev.type,
    }
    if dev.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(dev)
        out["capability"] = list(torch.cuda.get_device_capability(dev))
        out["cuda"] = torch.version.cuda
    else:
        out["cpu"] = platform.machine()
    return out


def key_of(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


class CompileCache:
    """One model's compiled code on disk (module docstring). ``slug`` names the model in folder names."""

    def __init__(self, root: str | Path, slug: str, fields: dict[str, Any]):
        self.root = Path(root).expanduser()
        self.slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in slug)
        self.fields = json.loads(json.dumps(fields, sort_keys=True, default=str))
        self.key = key_of(self.fields)
        self.dir = self.root / f"{self.slug}-{self.key[:16]}"
        self.loaded: str = "none"  # what load() found: hit | missing | stale | corrupt

    def load(self) -> bool:
        """Hot-load this key's entry; False (and the log says why) when there is none to load."""
        import torch

        manifest, blob = self.dir / MANIFEST, self.dir / ARTIFACTS
        if not manifest.is_file() or not blob.is_file():
            self.loaded = "missing"
            why = self._stale_reason()
            if why:
                self.loaded = "stale"
                log.info("compile cache: %s is stale (%s); compiling again", self.root / self.slug, why)
            else:
                log.info(
                    "compile cache: no entry at %s yet; compiling (it is written after warm-up)", self.dir
                )
            return False
        try:
            meta = read_json(manifest)
            data = blob.read_bytes()
            if meta.get("format") != FORMAT or meta.get("key") != self.key:
                raise ValueError(f"{manifest}: format or key does not match")
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise ValueError(f"{blob}: sha256 does not match {manifest}")
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as err:  # noqa: BLE001 - any unreadable entry is recompiled, never trusted
            self.loaded = "corrupt"
            log.warning("compile cache: %s is corrupt (%s); compiling again and rewriting it", self.dir, err)
            return False
        self.loaded = "hit"
        n = 0
        for v in vars(info).values() if info is not None else ():
            if isinstance(v, dict):
                n += sum(len(x) for x in v.values() if isinstance(x, list | tuple))
            elif isinstance(v, list | tuple):
                n += len(v)
        log.info("compile cache: loaded %d artifacts (%d bytes) from %s", n, len(data), self.dir)
        return True

    def _stale_reason(self) -> str:
        """For a missing entry: the fields in which another entry of this model differs."""
        if not self.root.is_dir():
            return ""
        for other in sorted(self.root.glob(f"{self.slug}-*/{MANIFEST}")):
            try:
                old = read_json(other).get("fields") or {}
            except Exception:  # noqa: BLE001
                continue
            diff = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in self.fields.items() if old.get(k) != v]
            diff += [f"{k}: {old[k]!r} -> None" for k in old if k not in self.fields]
            if diff:
                return "; ".join(diff[:4])
        return ""

    def save(self, buckets: list[int] | None = None) -> Path | None:
        """Write what this process compiled (and loaded) under this key; None if torch has nothing."""
        import torch

        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return None
        data, _ = out
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.dir / ARTIFACTS, data)
        atomic_write_json(
            self.dir / MANIFEST,
            {
                "format": FORMAT,
                "key": self.key,
                "fields": self.fields,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
                "buckets": sorted(buckets or []),
            },  # fmt: skip
        )
        log.info("compile cache: wrote %d bytes to %s", len(data), self.dir)
        return self.dir
