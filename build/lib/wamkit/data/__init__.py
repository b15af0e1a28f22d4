"""LeRobot datasets (v3, and v2.1 read natively): read, write, convert, statistics, the SFT pipeline.

- :class:`LeRobotDataset`: the reader (pyarrow + PyAV), mirroring upstream's class.
- :class:`LeRobotDatasetWriter`: create / add_frame / save_episode / finalize; ``open`` to append.
- :func:`compute_stats`: the stats file in the training representation (``wamkit stats``).
- :func:`make_train_dataset`, :func:`make_train_loader`, :func:`collate`: the training pipeline.
"""

from wamkit.data.dataset import LeRobotDataset
from wamkit.data.dataset_stats import compute_stats
from wamkit.data.loader import TrainLoader, collate, make_train_loader
from wamkit.data.meta import DatasetError, DatasetMeta
from wamkit.data.sft_dataset import TrainDataset, make_train_dataset, suite_roots
from wamkit.data.writer import LeRobotDatasetWriter

__all__ = [
    "DatasetError",
    "DatasetMeta",
    "LeRobotDataset",
    "LeRobotDatasetWriter",
    "TrainDataset",
    "TrainLoader",
    "collate",
    "compute_stats",
    "make_train_dataset",
    "make_train_loader",
    "suite_roots",
]
