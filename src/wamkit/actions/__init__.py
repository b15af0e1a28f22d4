"""Pure action math shared by the data pipeline, the models and the server.

- :mod:`wamkit.actions.rotations`: axis-angle, matrix, quaternion (xyzw / wxyz), rot6d.
- :mod:`wamkit.actions.libero`: LIBERO's 7-D actions <-> 10-D rot6d actions, gripper conventions,
  frame-wise relative <-> absolute chunks.
- :mod:`wamkit.actions.normalize`: quantile, mean/std and min/max normalizers with exact inverses.
- :mod:`wamkit.actions.stats`: the stats file format.
"""

from wamkit.actions import libero, normalize, rotations, stats
from wamkit.actions.stats import FeatureStats, StatsAccumulator, StatsError, StatsFile

__all__ = [
    "libero",
    "normalize",
    "rotations",
    "stats",
    "FeatureStats",
    "StatsAccumulator",
    "StatsError",
    "StatsFile",
]
