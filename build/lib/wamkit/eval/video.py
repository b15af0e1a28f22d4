"""mp4 videos of selected episodes, written with PyAV (H.264, yuv420p).

Frames are the observation images the policy saw (uint8 [H, W, 3], upright); several cameras are
placed side by side. Which episodes are filmed is decided by their name, so a rerun films the same ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wamkit.constants import image_key


def filmed(trial: int, videos_per_task: int) -> bool:
    """Trials 0 .. videos_per_task-1 of every task are recorded."""
    return trial < videos_per_task


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
    tmp = path.with_suffix(".tmp.mp4")
    import av  # only when a video is written: the evaluator runs without PyAV otherwise

    with av.open(str(tmp), mode="w") as container:
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
    tmp.replace(path)
    return path
