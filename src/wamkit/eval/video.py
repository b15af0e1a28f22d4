"""mp4 videos of selected episodes, written with PyAV (H.264, yuv420p).

Frames are the observation images the policy saw (uint8 [H, W, 3], upright); several cameras are
placed side by side. Which videos are kept: :class:`VideoBudget`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.constants import image_key
from wamkit.files import atomic_path

# filmed candidates: the first this many times eval.videos trials of a task (while it has room)
CANDIDATES = 4


class VideoBudget:
    """``eval.videos`` videos a task at most, shared by its successes and failures: an outcome takes at
    most half of them (rounded up), so where a task both succeeds and fails within its first
    ``CANDIDATES x eval.videos`` trials, its videos show both (with ``eval.videos: 1``, whichever
    finished first). An episode is filmed (its frames held while it runs) while its task has room;
    whether it is kept is decided when it finishes, in the order episodes finish. Thread-safe (the
    pipeline's stage threads finish episodes)."""

    def __init__(self, per_task: int, finished: Iterable[dict[str, Any]] = ()):
        self.per_task, self.per_outcome = per_task, (per_task + 1) // 2
        self._kept: Counter[tuple[str, bool]] = Counter(
            (str(r["task"]), bool(r["success_once"])) for r in finished if r.get("video")
        )  # a resumed run's videos count
        self._lock = threading.Lock()

    def _room(self, task: str) -> bool:
        return self._kept[(task, True)] + self._kept[(task, False)] < self.per_task

    def film(self, task: str, trial: int) -> bool:
        """Whether to hold this episode's frames."""
        with self._lock:
            return trial < CANDIDATES * self.per_task and self._room(task)

    def keep(self, task: str, success: bool) -> bool:
        """Whether a filmed episode that ended so is written (and counted)."""
        with self._lock:
            if not self._room(task) or self._kept[(task, success)] >= self.per_outcome:
                return False
            self._kept[(task, success)] += 1
            return True


def frame_of(obs: dict, cameras: list[str]) -> np.ndarray:
    """The cameras of one observation side by side: uint8 [H, W * len(cameras), 3]."""
    return np.concatenate([np.asarray(obs[image_key(c)], dtype=np.uint8) for c in cameras], axis=1)


def write_mp4(frames: list[np.ndarray], path: str | Path, fps: int = 20) -> Path:
    """Encode ``frames`` (uint8 [H, W, 3], all the same size) to ``path``; odd sizes are padded."""
    if not frames:
        raise ValueError(f"write_mp4: no frames for {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames[0].shape[:2]
    ph, pw = h + h % 2, w + w % 2  # yuv420p needs even sizes
    import av  # only when a video is written: the evaluator runs without PyAV otherwise

    # staged beside it and renamed into place; a failed write leaves neither a partial file nor its temp
    with atomic_path(path) as tmp, av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = pw, ph, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast"}
        for img in frames:
            if img.shape[:2] != (h, w):
                raise ValueError(f"write_mp4: frame of shape {img.shape} differs from the first {(h, w, 3)}")
            if (ph, pw) != (h, w):
                img = np.pad(img, ((0, ph - h), (0, pw - w), (0, 0)))
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
