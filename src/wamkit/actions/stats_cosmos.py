"""Action statistics as cosmos-framework (and RLinf, which reuses them) write them, read as a stats file.

The upstream layout (cosmos-framework's
``data/generator/action/normalizer_stats/<embodiment>_native_frame_wise_relative_rot6d.json``)::

    {"metadata": {"embodiment_type": <embodiment>, "pose_convention": "frame_wise_relative",
                  "rotation_format": "6d", "action_dim": 10, "chunk_length": 16,
                  "skip_rotation_dims": [3, ..., 8], "num_samples_stats": 10000, ...},
     "global":     {"mean": [...], "std": [...], "min": [...], "max": [...], "q01": [...], "q99": [...]},
     "global_raw": {...the same keys...}}

``global`` has the rotation dimensions (``skip_rotation_dims``) replaced by an identity range
(q01 = -1, q99 = 1: rot6d left unnormalised); ``global_raw`` holds their real statistics. cosmos'
robot SFT recipe normalises with ``global_raw`` (``action_normalization="quantile_rot"``), so that is
the block read here when present, ``global`` otherwise. The file describes actions only (Cosmos3 has no
proprio input), so the stats file has the single feature ``action``.

The file's ``embodiment_type`` is looked up among the embodiment profiles' ``cosmos3_domain``. When
one names it, the file is frame-wise relative rot6d and its width is that profile's representation's,
the metadata takes the profile's: ``representation``, ``fps`` (the rate of the dataset conversion
cosmos computed its bundled statistics on), and ``gripper`` = ``open_1`` when the gripper channel lies
in [0, 1] (NVIDIA's convention: 1 = open). Otherwise ``representation`` is ``cosmos_<embodiment>``.
Always set: ``chunk``, ``action_dim`` and ``cosmos`` (the upstream metadata, kept).
"""

from __future__ import annotations

from typing import Any

from wamkit import embodiments
from wamkit.actions.representations import get_representation
from wamkit.actions.stats import STAT_KEYS, FeatureStats, StatsError, StatsFile

BLOCKS = ("global_raw", "global")  # preferred first


def is_cosmos_stats(data: Any) -> bool:
    """True for a cosmos-framework action-stats object (a ``global`` or ``global_raw`` block of
    per-dimension statistics, and no wamkit ``format`` field)."""
    if not isinstance(data, dict) or "format" in data:
        return False
    return any(isinstance(data.get(b), dict) and "q01" in data[b] for b in BLOCKS)


def _block(data: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    for name in BLOCKS:
        if isinstance(data.get(name), dict):
            return name, data[name]
    raise StatsError(f"{source}: no 'global_raw' or 'global' block of action statistics")


def _feature(block: dict[str, Any], count: int, where: str) -> FeatureStats:
    missing = [k for k in STAT_KEYS if k not in block]
    if missing:
        raise StatsError(f"{where}: missing {', '.join(missing)}")
    vals = {}
    for k in STAT_KEYS:
        v = block[k]
        if not isinstance(v, list) or not v or not all(isinstance(e, int | float) for e in v):
            raise StatsError(f"{where}.{k}: expected a list of numbers")
        vals[k] = [float(e) for e in v]
    dims = {len(v) for v in vals.values()}
    if len(dims) != 1:
        raise StatsError(f"{where}: lists differ in length {sorted(dims)}")
    return FeatureStats(**vals, count=count)


def _native_profile(meta: dict[str, Any], dim: int) -> embodiments.Embodiment | None:
    """The profile whose representation this file's actions are in (see the module docstring)."""
    profile = embodiments.for_cosmos3_domain(str(meta.get("embodiment_type", "")))
    if (
        profile is None
        or meta.get("pose_convention", "frame_wise_relative") != "frame_wise_relative"
        or meta.get("rotation_format", "6d") != "6d"
    ):
        return None
    rep = get_representation(profile.representation)
    return profile if rep.env_dim_of(dim) == profile.action_dim else None


def stats_from_cosmos(data: dict[str, Any], source: str = "cosmos stats") -> StatsFile:
    """A :class:`StatsFile` from a cosmos-framework action-stats object (see the module docstring)."""
    meta = data.get("metadata", {})
    if not isinstance(meta, dict):
        raise StatsError(f"{source}: 'metadata' must be an object")
    name, block = _block(data, source)
    count = meta.get("num_samples_stats") or meta.get("max_samples") or 1
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        count = 1
    action = _feature(block, count, f"{source}: {name}")
    declared = meta.get("action_dim")
    if declared is not None and declared != action.dim:
        raise StatsError(f"{source}: metadata.action_dim={declared} but '{name}' has {action.dim} dims")
    profile = _native_profile(meta, action.dim)
    out: dict[str, Any] = {
        "representation": profile.representation
        if profile
        else f"cosmos_{meta.get('embodiment_type', 'unknown')}",
        "action_dim": action.dim,
        "source_format": "cosmos-action-stats",
        "cosmos_block": name,
        "cosmos": meta,
    }
    if isinstance(meta.get("chunk_length"), int):
        out["chunk"] = meta["chunk_length"]
    if profile:
        out["fps"] = profile.fps
        if action.min[-1] >= 0.0 and action.max[-1] <= 1.0:
            out["gripper"] = "open_1"
    return StatsFile(features={"action": action}, metadata=out)
