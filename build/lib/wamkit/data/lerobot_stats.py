"""Per-episode feature statistics in lerobot's layout, and their aggregation into ``meta/stats.json``.

Numeric features: lists of ``dim`` floats. Camera features: per channel, shape [3, 1, 1], of pixel values
scaled to [0, 1] (what lerobot writes). Each stat is computed over the episode's frames; aggregation
weights by ``count`` (means and quantiles) and pools variances, as lerobot does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
STATS = ("min", "max", "mean", "std", "count", *QUANTILES)


def array_stats(x: np.ndarray) -> dict[str, np.ndarray]:
    """Stats over axis 0 of ``x`` (N, ...); ``count`` is [N]."""
    x = np.asarray(x, np.float64)
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0), "count": np.array([len(x)])}
    qs = np.quantile(x, list(QUANTILES.values()), axis=0)
    out.update({k: q for k, q in zip(QUANTILES, qs)})
    return out


def image_stats(pixels: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats of uint8 pixels (N, H, W, 3) -> values [3, 1, 1] in [0, 1]; count = frames."""
    flat = pixels.reshape(-1, 3).astype(np.float64) / 255.0
    stats = array_stats(flat)
    out = {k: v.reshape(3, 1, 1) for k, v in stats.items() if k != "count"}
    out["count"] = np.array([len(pixels)])
    return out


def aggregate(per_episode: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Combine the stats of several episodes of one feature."""
    counts = np.array([float(s["count"][0]) for s in per_episode])
    w = counts / counts.sum()

    def wsum(key: str) -> np.ndarray:
        return sum(wi * np.asarray(s[key], np.float64) for wi, s in zip(w, per_episode))

    mean = wsum("mean")
    var = sum(
        wi * (np.asarray(s["std"]) ** 2 + (np.asarray(s["mean"]) - mean) ** 2)
        for wi, s in zip(w, per_episode)
    )
    out = {
        "min": np.min([s["min"] for s in per_episode], axis=0),
        "max": np.max([s["max"] for s in per_episode], axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(counts.sum())]),
    }
    # quantiles: only those every episode has (v2.1 writers stored min/max/mean/std/count alone)
    out.update({k: wsum(k) for k in QUANTILES if all(k in s for s in per_episode)})
    return out


def to_jsonable(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    return {f: {k: np.asarray(v).tolist() for k, v in s.items()} for f, s in stats.items()}
