"""Read a converted dataset back frame by frame against its source (:func:`verify`).

States, actions, indices, timestamps and tasks must be identical; so must every frame of a video whose
packets were copied. Frames of re-encoded videos cannot be, so their PSNR against the source is
reported (minimum and mean over frames, in dB). The first difference is an error naming the frame.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.constants import EPISODE_INDEX, FRAME_INDEX, TASK
from wamkit.data.dataset import LeRobotDataset
from wamkit.data.meta import DatasetError
from wamkit.data.remux import psnr


def verify(src: Path, dst: Path, reencoded: set[tuple[int, str]]) -> dict[str, Any]:
    """Compare every frame of ``dst`` with ``src``; ``reencoded`` holds the (episode, camera) pairs
    whose video was re-encoded. Returns counts and PSNR figures; raises :class:`DatasetError`."""
    a, b = LeRobotDataset(src), LeRobotDataset(dst)
    if (len(a), a.num_episodes, a.camera_keys) != (len(b), b.num_episodes, b.camera_keys):
        raise DatasetError(
            f"{dst}: {len(b)} frames, {b.num_episodes} episodes, cameras {b.camera_keys}; the source "
            f"{src} has {len(a)}, {a.num_episodes}, {a.camera_keys}"
        )
    numeric = [k for k in a.meta.numeric_keys if k in b.meta.numeric_keys]
    identical, scores = 0, []
    for i in range(len(a)):
        x, y = a[i], b[i]
        where = f"{dst}: frame {i} (episode {int(x[EPISODE_INDEX])}, frame {int(x[FRAME_INDEX])})"
        for key in numeric:
            if not np.array_equal(x[key].numpy(), y[key].numpy()):
                raise DatasetError(f"{where}: '{key}' differs from the source {src}")
        if x[TASK] != y[TASK]:
            raise DatasetError(f"{where}: task {y[TASK]!r} differs from the source's {x[TASK]!r}")
        for key in a.camera_keys:
            if (int(x[EPISODE_INDEX]), key) in reencoded:
                scores.append(psnr(x[key].numpy(), y[key].numpy()))
            elif np.array_equal(x[key].numpy(), y[key].numpy()):
                identical += 1
            else:
                raise DatasetError(
                    f"{where}: camera {key} differs from the source although its video was copied"
                )
    finite = [s for s in scores if math.isfinite(s)]
    return {
        "frames": len(a),
        "identical_camera_frames": identical,
        "reencoded_camera_frames": len(scores),
        "psnr_min_db": min(finite) if finite else None,
        "psnr_mean_db": float(np.mean(finite)) if finite else None,
    }
