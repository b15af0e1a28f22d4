"""Pure action math shared by the data pipeline, the models and the server.

- :mod:`wamkit.actions.rotations`: axis-angle, matrix, quaternion (xyzw / wxyz), rot6d.
- :mod:`wamkit.actions.pose`: 7-D delta-pose actions <-> 10-D rot6d actions, frame-wise relative <->
  absolute chunks.
- :mod:`wamkit.actions.normalize`: quantile, mean/std and min/max normalizers with exact inverses.
- :mod:`wamkit.actions.representations`: one record per action representation.
- :mod:`wamkit.actions.gripper`: gripper conventions of datasets and their map to the env command.
- :mod:`wamkit.actions.images`: the one image resize kernel of training and serving.
- :mod:`wamkit.actions.stats`: the stats file format (computing one from a dataset is
  :mod:`wamkit.data.dataset_stats`; lerobot's own ``meta/stats.json`` is :mod:`wamkit.data.lerobot_stats`).
- :mod:`wamkit.actions.spec`: the preprocessing spec, all of the above as one saved object.
"""

from wamkit.actions import normalize, rotations, stats
from wamkit.actions.stats import FeatureStats, StatsAccumulator, StatsError, StatsFile

__all__ = [
    "normalize",
    "rotations",
    "stats",
    "FeatureStats",
    "StatsAccumulator",
    "StatsError",
    "StatsFile",
]
