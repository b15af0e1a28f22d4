"""Normalizers with exact inverses, driven by a stats file. Work on NumPy arrays and torch tensors.

Each is a small frozen object with ``normalize`` / ``unnormalize``, so the very same instance can run in
the training data pipeline and in the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from wamkit.actions.stats import FeatureStats

NormKind = Literal["quantile", "mean_std", "min_max", "none"]
_EPS = 1e-8


def _like(arr, x):
    """``arr`` (NumPy) as the same kind, dtype and device as ``x``."""
    if isinstance(x, torch.Tensor):
        return torch.as_tensor(arr, dtype=x.dtype, device=x.device)
    return np.asarray(arr, dtype=np.asarray(x).dtype if np.asarray(x).dtype.kind == "f" else np.float64)


def _clip(y, lo: float, hi: float):
    return y.clamp(lo, hi) if isinstance(y, torch.Tensor) else np.clip(y, lo, hi)


@dataclass(frozen=True)
class _Affine:
    """y = (x - shift) / scale, with the inverse x = y * scale + shift."""

    shift: np.ndarray
    scale: np.ndarray
    clip: bool = False

    def normalize(self, x):
        y = (x - _like(self.shift, x)) / _like(self.scale, x)
        return _clip(y, -1.0, 1.0) if self.clip else y

    def unnormalize(self, y):
        return y * _like(self.scale, y) + _like(self.shift, y)

    __call__ = normalize


def quantile(stats: FeatureStats, clip: bool = False) -> _Affine:
    """``y = 2 (x - q01) / max(q99 - q01, 1e-8) - 1`` and its inverse (no clipping by default)."""
    q01, q99 = np.asarray(stats.q01, np.float64), np.asarray(stats.q99, np.float64)
    scale = np.maximum(q99 - q01, _EPS) / 2.0
    return _Affine(shift=q01 + scale, scale=scale, clip=clip)


def mean_std(stats: FeatureStats, clip: bool = False) -> _Affine:
    """``y = (x - mean) / max(std, 1e-8)``; ``clip`` limits y to [-1, 1] (rarely wanted)."""
    return _Affine(shift=np.asarray(stats.mean, np.float64), scale=np.maximum(stats.std, _EPS), clip=clip)


def min_max(stats: FeatureStats, clip: bool = False) -> _Affine:
    """``y = 2 (x - min) / max(max - min, 1e-8) - 1``."""
    lo, hi = np.asarray(stats.min, np.float64), np.asarray(stats.max, np.float64)
    scale = np.maximum(hi - lo, _EPS) / 2.0
    return _Affine(shift=lo + scale, scale=scale, clip=clip)


def identity(stats: FeatureStats | None = None, clip: bool = False) -> _Affine:
    dim = len(stats.mean) if stats is not None else 1
    return _Affine(shift=np.zeros(dim), scale=np.ones(dim), clip=clip)


_KINDS = {"quantile": quantile, "mean_std": mean_std, "min_max": min_max, "none": identity}


def make_normalizer(kind: NormKind, stats: FeatureStats, clip: bool = False) -> _Affine:
    """The normalizer named ``kind`` for one feature's stats."""
    if kind not in _KINDS:
        raise ValueError(f"normalization {kind!r} is unknown; expected one of {', '.join(_KINDS)}")
    return _KINDS[kind](stats, clip)
