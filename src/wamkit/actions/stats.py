"""The stats file: per-feature statistics plus the metadata that says what they describe.

One JSON format, shipped inside every checkpoint and serving directory so training and serving normalise
identically::

    {
      "format": "wamkit-stats/1",
      "metadata": {"representation": "raw", "fps": 80, "chunk": 16, "action_dim": 4,
                   "feature_names": {"action": ["dx", ...]}, "render_quality": "fast", ...},
      "features": {"action": {"mean": [...], "std": [...], "min": [...], "max": [...],
                              "q01": [...], "q99": [...], "count": 12345}, ...}
    }

Loading stats for a run whose fps or representation differs is an error naming the field.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.config import UserError
from wamkit.files import atomic_write_json, read_json

FORMAT = "wamkit-stats/1"
STAT_KEYS = ("mean", "std", "min", "max", "q01", "q99")
TINY_RANGE = 1e-4  # q99 - q01 below this amplifies errors after quantile normalisation


class StatsError(UserError, ValueError):
    """A stats file is malformed or does not fit the run."""


@dataclass
class FeatureStats:
    """Statistics of one feature, each a list of ``dim`` floats; ``count`` frames (or chunk steps)."""

    mean: list[float]
    std: list[float]
    min: list[float]
    max: list[float]
    q01: list[float]
    q99: list[float]
    count: int

    @property
    def dim(self) -> int:
        return len(self.mean)

    def tiny_dims(self, threshold: float = TINY_RANGE) -> list[int]:
        """Dimensions whose q99 - q01 is below ``threshold`` (quantile normalisation blows them up)."""
        return [i for i, (a, b) in enumerate(zip(self.q01, self.q99)) if b - a < threshold]

    @classmethod
    def from_array(cls, x: np.ndarray) -> FeatureStats:
        """Exact statistics of ``x`` (N, D) held in memory. See :class:`StatsAccumulator` for streams."""
        x = np.asarray(x, np.float64).reshape(len(x), -1)
        if len(x) == 0:
            raise StatsError("cannot compute statistics of zero samples")
        q01, q99 = np.quantile(x, [0.01, 0.99], axis=0)
        return cls(
            mean=x.mean(0).tolist(),
            std=x.std(0).tolist(),
            min=x.min(0).tolist(),
            max=x.max(0).tolist(),
            q01=q01.tolist(),
            q99=q99.tolist(),
            count=int(len(x)),
        )


class StatsAccumulator:
    """Streaming statistics with bounded memory.

    Mean, std, min and max are exact (float64 sums with Chan's parallel update). Quantiles come from a
    uniform reservoir sample of at most ``reservoir`` rows, drawn with a seeded generator, so the result
    is deterministic for a given seed and input order.
    """

    def __init__(self, dim: int, reservoir: int = 100_000, seed: int = 0):
        self.dim = dim
        self.count = 0
        self.mean = np.zeros(dim)
        self.m2 = np.zeros(dim)
        self.min = np.full(dim, np.inf)
        self.max = np.full(dim, -np.inf)
        self.capacity = reservoir
        self.sample = np.empty((0, dim))
        self.rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64).reshape(-1, self.dim)
        n = len(x)
        if n == 0:
            return
        if not np.all(np.isfinite(x)):
            raise StatsError("non-finite values in the data")
        bmean, bm2 = x.mean(0), ((x - x.mean(0)) ** 2).sum(0)
        total = self.count + n
        delta = bmean - self.mean
        self.mean = self.mean + delta * n / total
        self.m2 = self.m2 + bm2 + delta**2 * self.count * n / total
        self.min = np.minimum(self.min, x.min(0))
        self.max = np.maximum(self.max, x.max(0))
        # Reservoir sampling (Algorithm R, vectorised per batch).
        room = self.capacity - len(self.sample)
        if room > 0:
            self.sample = np.concatenate([self.sample, x[:room]])
        rest = x[max(room, 0) :]
        if len(rest):
            seen = self.count + max(room, 0) + np.arange(1, len(rest) + 1)
            slots = (self.rng.random(len(rest)) * seen).astype(np.int64)
            keep = slots < self.capacity
            self.sample[slots[keep]] = rest[keep]
        self.count = total

    def result(self) -> FeatureStats:
        if self.count == 0:
            raise StatsError("cannot compute statistics of zero samples")
        q01, q99 = np.quantile(self.sample, [0.01, 0.99], axis=0)
        return FeatureStats(
            mean=self.mean.tolist(),
            std=np.sqrt(self.m2 / self.count).tolist(),
            min=self.min.tolist(),
            max=self.max.tolist(),
            q01=q01.tolist(),
            q99=q99.tolist(),
            count=int(self.count),
        )


@dataclass
class StatsFile:
    """Per-feature stats and the metadata that says what they describe."""

    features: dict[str, FeatureStats]
    metadata: dict[str, Any] = field(default_factory=dict)

    # Metadata fields a run may insist on; a mismatch means the numbers describe other data.
    CHECKED = ("fps", "representation", "chunk", "action_dim", "render_quality")

    def __getitem__(self, feature: str) -> FeatureStats:
        if feature not in self.features:
            raise StatsError(f"stats file has no feature '{feature}' (has: {', '.join(self.features)})")
        return self.features[feature]

    def check(self, source: str = "stats file", **expected: Any) -> None:
        """Raise if a metadata field differs from what the run expects (``None`` values are skipped)."""
        for key, want in expected.items():
            if want is None:
                continue
            have = self.metadata.get(key)
            if have is None:
                raise StatsError(f"{source}: metadata has no '{key}'; this run needs {key}={want!r}")
            if have != want:
                raise StatsError(f"{source}: metadata {key}={have!r} but this run has {key}={want!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "metadata": self.metadata,
            "features": {
                k: {**{s: getattr(v, s) for s in STAT_KEYS}, "count": v.count}
                for k, v in self.features.items()
            },
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a crash mid-write leaves the old file, never half a file)."""
        return atomic_write_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: Any, source: str = "stats file") -> StatsFile:
        if not isinstance(data, dict):
            raise StatsError(f"{source}: expected a JSON object at the top level")
        from wamkit.actions.stats_cosmos import is_cosmos_stats, stats_from_cosmos  # imports this module

        if is_cosmos_stats(data):  # cosmos-framework / RLinf action stats (global / global_raw)
            return stats_from_cosmos(data, source)
        if data.get("format") != FORMAT:
            raise StatsError(f"{source}: 'format' is {data.get('format')!r}, expected {FORMAT!r}")
        meta, feats = data.get("metadata", {}), data.get("features")
        if not isinstance(meta, dict):
            raise StatsError(f"{source}: 'metadata' must be an object")
        if not isinstance(feats, dict) or not feats:
            raise StatsError(f"{source}: 'features' must be a non-empty object")
        out = {}
        for name, f in feats.items():
            where = f"{source}: features.{name}"
            if not isinstance(f, dict):
                raise StatsError(f"{where}: expected an object with {', '.join(STAT_KEYS)}, count")
            missing = [k for k in (*STAT_KEYS, "count") if k not in f]
            if missing:
                raise StatsError(f"{where}: missing {', '.join(missing)}")
            vals = {}
            for k in STAT_KEYS:
                v = f[k]
                if not isinstance(v, list) or not all(isinstance(e, int | float) for e in v):
                    raise StatsError(f"{where}.{k}: expected a list of numbers")
                if not all(math.isfinite(e) for e in v):
                    raise StatsError(f"{where}.{k}: non-finite value")
                vals[k] = [float(e) for e in v]
            dims = {k: len(v) for k, v in vals.items()}
            if len(set(dims.values())) != 1:
                raise StatsError(f"{where}: lists differ in length {dims}")
            if not isinstance(f["count"], int) or f["count"] <= 0:
                raise StatsError(f"{where}.count: expected a positive integer")
            if any(s < 0 for s in vals["std"]):
                raise StatsError(f"{where}.std: negative value")
            if any(lo > hi for lo, hi in zip(vals["q01"], vals["q99"])):
                raise StatsError(f"{where}: q01 exceeds q99")
            out[name] = FeatureStats(**vals, count=f["count"])
        return cls(features=out, metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike, **expected: Any) -> StatsFile:
        """Read and validate a stats file; ``expected`` metadata (e.g. ``fps=20``) must match."""
        path = Path(path)
        stats = cls.from_json(read_json(path, StatsError, "a stats file"), source=str(path))
        stats.check(source=str(path), **expected)
        return stats
