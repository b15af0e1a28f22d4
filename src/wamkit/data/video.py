"""MP4 decoding and encoding with PyAV.

Decoding: :class:`VideoFrames` keeps one open container per file (a small LRU), opened lazily in the
process that first asks, so DataLoader workers never share a decoder inherited through ``fork``. A frame
is found by its timestamp in seconds: seek to the key frame at or before it, then decode forward. Reading
frames in order continues the open decoder instead of seeking again.

Encoding: :class:`VideoEncoder` writes H.264 (libx264, which PyAV's wheels ship) in yuv420p, one frame
per ``1/fps`` seconds, to a temporary name that :meth:`VideoEncoder.close` renames into place.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from wamkit.data.meta import DatasetError
from wamkit.files import fsync_dir, tmp_path

# How far ahead of the last decoded frame we keep decoding rather than seek (in frames): reading in
# order continues the decoder; anything further seeks (cheap with lerobot's 2-frame GOPs).
_FORWARD_FRAMES = 1.5


_INHERITED: list = []  # decoders a forked process inherited; kept alive on purpose, never used


class _OpenVideo:
    def __init__(self, path: Path):
        try:
            self.container = av.open(str(path))
        except (av.error.FFmpegError, OSError) as err:
            raise DatasetError(f"{path}: cannot open video (missing, truncated or corrupt?): {err}") from None
        if not self.container.streams.video:
            raise DatasetError(f"{path}: has no video stream")
        self.stream = self.container.streams.video[0]
        self.stream.thread_count = 1  # threads: no latency per seek, and nothing held across fork()
        self.path = path
        self.tb = float(self.stream.time_base)
        self.frame_dt = 1.0 / float(self.stream.average_rate or 30)
        self.frames = None  # the running decode generator
        self.last_time = None
        self.last_image: np.ndarray | None = None

    def _restart(self, ts: float) -> None:
        self.container.seek(int(ts / self.tb), stream=self.stream, backward=True, any_frame=False)
        self.frames = self.container.decode(self.stream)
        self.last_time = None

    def frame_at(self, ts: float, tol: float) -> np.ndarray:
        if self.last_time is not None and abs(self.last_time - ts) <= tol:
            return self.last_image.copy()  # type: ignore[union-attr]  # the caller may own the first one
        ahead = ts - self.last_time if self.last_time is not None else -1.0
        if self.frames is None or not 0 < ahead <= _FORWARD_FRAMES * self.frame_dt:
            self._restart(ts)
        try:
            for frame in self.frames:  # type: ignore[union-attr]
                t = frame.pts * self.tb
                if t < ts - tol:
                    continue
                if t > ts + tol:
                    self.frames = None
                    raise DatasetError(
                        f"{self.path}: no frame at t={ts:.4f}s (the next frame is at t={t:.4f}s; tolerance {tol}s)"
                    )
                self.last_time = t
                self.last_image = frame.to_ndarray(format="rgb24")  # a fresh, writable array
                return self.last_image
        except av.error.FFmpegError as err:
            self.frames = None
            raise DatasetError(
                f"{self.path}: decoding failed near t={ts:.4f}s (truncated or corrupt?): {err}"
            ) from None
        self.frames = None
        raise DatasetError(
            f"{self.path}: video ends before t={ts:.4f}s (truncated, or the episode metadata is wrong)"
        )

    def close(self) -> None:
        self.container.close()


class VideoFrames:
    """Frames by (file, timestamp), with lazily opened decoders owned by the current process."""

    def __init__(self, max_open: int = 16):
        self.max_open = max_open
        self._open: OrderedDict[Path, _OpenVideo] = OrderedDict()
        self._pid = os.getpid()

    def frame(self, path: Path, ts: float, tol: float) -> np.ndarray:
        """The RGB frame (H, W, 3) uint8 shown at ``ts`` seconds (within ``tol``) of ``path``."""
        if self._pid != os.getpid():
            # A forked worker must never touch, nor free, the parent's decoders: freeing one joins
            # decoder threads (dav1d keeps its own pool) that do not exist in the child, and hangs.
            _INHERITED.append(self._open)
            self._open = OrderedDict()
            self._pid = os.getpid()
        video = self._open.get(path)
        if video is None:
            video = _OpenVideo(path)
            self._open[path] = video
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)[1].close()
        else:
            self._open.move_to_end(path)
        return video.frame_at(ts, tol)

    def close(self) -> None:
        for video in self._open.values():
            video.close()
        self._open.clear()

    def __getstate__(self):  # pickled into spawned workers: start with no open files
        return {"max_open": self.max_open}

    def __setstate__(self, state):
        self.__init__(state["max_open"])


class VideoEncoder:
    """Encode RGB frames (H, W, 3) uint8 to ``path`` as H.264 / yuv420p at ``fps``.

    ``gop`` is the key-frame interval: small values make random access (training) cheap at some cost
    in file size (lerobot uses 2). H and W must be even (yuv420p halves the chroma planes).
    """

    CODEC = "libx264"
    PIX_FMT = "yuv420p"

    def __init__(self, path: Path, fps: int, height: int, width: int, gop: int = 2, crf: int = 18):
        if height % 2 or width % 2:
            raise ValueError(
                f"{path}: video frames must have even height and width for yuv420p, got {height}x{width}"
            )
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        self.shape = (height, width, 3)
        self.container = av.open(str(self.tmp), mode="w")
        self.stream = self.container.add_stream(self.CODEC, rate=fps)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = self.PIX_FMT
        self.stream.time_base = Fraction(1, fps)
        self.stream.codec_context.gop_size = gop
        self.stream.options = {"crf": str(crf), "preset": "veryfast", "bf": "0"}
        self.count = 0

    def add(self, image: np.ndarray) -> None:
        if image.shape != self.shape or image.dtype != np.uint8:
            raise ValueError(
                f"{self.path}: expected a uint8 frame of shape {self.shape}, got {image.dtype} {image.shape}"
            )
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
        frame.pts = self.count
        self.count += 1
        self.container.mux(self.stream.encode(frame))

    def close(self) -> Path:
        """Flush, close and move the file into place; returns its path."""
        self.container.mux(self.stream.encode(None))
        self.container.close()
        with open(self.tmp, "rb") as fh:  # the crash protocol of wamkit.files: fsync, rename, fsync dir
            os.fsync(fh.fileno())
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.path

    def abort(self) -> None:
        self.container.close()
        self.tmp.unlink(missing_ok=True)
