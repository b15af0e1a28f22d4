"""Weights read straight into each process's shard: a model built on the meta device and sharded there
is filled tensor by tensor, each process reading from disk only the rows of dim 0 it holds.

A *source* names tensors, gives their shapes, and reads rows ``[start, stop)`` of one on demand:

- :class:`SafetensorsWeights`: safetensors files (a diffusers folder's shards), memory-mapped; the
  index is built from their headers, and a file shorter than its header says is refused at once;
- :class:`StateDictWeights`: tensors already in memory (a small model built whole, fresh heads).

:func:`fill` copies every parameter's local part from a source, after checking that the source holds
every tensor in the shape the model wants, and names the file and the tensor when it does not. FSDP2
shards dim 0 (``Shard(0)``, the first ``ceil(n / world)`` rows on rank 0, and so on); the local rows of a
DTensor come from DTensor's own layout arithmetic.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor, Shard

from wamkit.config import ConfigError


class WeightSource(Protocol):
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's full shape."""
        ...

    def where(self, name: str) -> str:
        """The file (or description) a tensor comes from, for error messages."""
        ...

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of dim 0 (the whole tensor for a 0-d one), on the CPU."""
        ...


def _safetensors_header(path: Path) -> dict:
    """The header of a safetensors file, checked against the file's length."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConfigError(f"{path}: not a safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ConfigError(f"{path}: truncated: its header is {n} bytes but the file has {size}")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    need = 8 + n + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if size < need:
        worst = max(header, key=lambda k: int(header[k]["data_offsets"][1]))
        raise ConfigError(
            f"{path}: truncated: its tensors need {need} bytes but the file has {size} "
            f"(tensor '{worst}' ends past the end)"
        )
    return header


class SafetensorsWeights:
    """Tensors of safetensors files; every header is read (and checked) when the source is made."""

    def __init__(self, files: list[Path]):
        if not files:
            raise ConfigError("no safetensors files to read weights from")
        self._file: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        for f in files:
            for name, meta in _safetensors_header(f).items():
                if name in self._file:
                    raise ConfigError(f"{f}: tensor '{name}' is also in {self._file[name]}")
                self._file[name] = f
                self._shape[name] = tuple(int(d) for d in meta["shape"])
        self._open: dict[Path, object] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shape)

    def where(self, name: str) -> str:
        return str(self._file[name])

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        from safetensors import safe_open

        f = self._file[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), framework="pt", device="cpu")
        if not self._shape[name]:  # a 0-d tensor has no rows to slice
            return self._open[f].get_tensor(name)
        return self._open[f].get_slice(name)[start:stop]


class StateDictWeights:
    """Tensors already in memory, under a description for messages."""

    def __init__(self, tensors: dict[str, torch.Tensor], what: str):
        self._t, self._what = tensors, what

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self._t.items()}

    def where(self, name: str) -> str:
        return self._what

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        t = self._t[name]
        return t if t.ndim == 0 else t[start:stop]


class Overlay:
    """``top``'s tensors where it has them, ``base``'s elsewhere (e.g. fresh heads over a folder)."""

    def __init__(self, base: WeightSource, top: WeightSource):
        self.base, self.top = base, top
        self._top = set(top.shapes())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {**self.base.shapes(), **self.top.shapes()}

    def where(self, name: str) -> str:
        return (self.top if name in self._top else self.base).where(name)

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        return (self.top if name in self._top else self.base).read(name, start, stop)


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that this process holds of ``p`` (all of a plain tensor)."""
    if not isinstance(p, DTensor) or p.ndim == 0:
        return 0, (p.shape[0] if p.ndim else 0)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for i, pl in enumerate(p.placements):
        if not pl.is_replicate() and not (isinstance(pl, Shard) and pl.dim == 0):
            raise NotImplementedError(f"placement {pl} on mesh dim {i}: only Shard(0) and Replicate are read")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]), int(offset[0]) + int(shape[0])


def check(
    source: WeightSource,
    wanted: dict[str, tuple[int, ...]],
    folder: str,
    unused: frozenset[str] = frozenset(),
) -> None:
    """Every wanted tensor is in ``source`` with the wanted shape, and nothing else is (but ``unused``:
    tensors of the source the model left out on purpose)."""
    have = source.shapes()
    missing = [k for k in wanted if k not in have]
    if missing:
        raise ConfigError(f"{folder}: weights missing for {len(missing)} tensor(s), e.g. {missing[:5]}")
    for k, shape in wanted.items():
        if tuple(have[k]) != tuple(shape):
            raise ConfigError(
                f"{source.where(k)}: tensor '{k}' has shape {list(have[k])}; the model expects {list(shape)}"
            )
    extra = [k for k in have if k not in wanted and k not in unused]
    if extra:
        raise ConfigError(f"{source.where(extra[0])}: unexpected weights {extra[:5]} for this model")


@torch.no_grad()
def fill(
    module: torch.nn.Module, source: WeightSource, folder: str, unused: frozenset[str] = frozenset()
) -> int:
    """Copy each parameter's local rows from ``source`` (checked first); returns bytes read.
    ``unused``: tensors of the source the module left out on purpose (not read)."""
    params = dict(module.named_parameters())
    check(source, {k: tuple(p.shape) for k, p in params.items()}, folder, unused)
    read = 0
    for name, p in params.items():
        start, stop = local_rows(p)
        part = p.to_local() if isinstance(p, DTensor) else p
        rows = source.read(name, start, stop)
        part.copy_(rows.to(part.dtype).reshape(part.shape))
        read += rows.nbytes
    return read
