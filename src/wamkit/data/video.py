"""MP4 decoding and encoding with PyAV.

Decoding: :class:`VideoFrames` keeps one open container per file (a small LRU), opened lazily in the
process that first asks, so DataLoader workers never share a decoder inherited through ``fork``. A frame
is found by its timestamp in seconds. Per open file it keeps, to make nearby timestamps cheap:

- the decoder's position: a frame ahead of the last one decoded, by no more than the longest key-frame
  interval seen so far in that file, is reached by decoding forward; anything else seeks to the key
  frame at or before it and decodes from there (a seek discards the decoder's state, so decoding on is
  never slower while no key frame lies between);
- the last ``cache_frames`` decoded frames (YUV, as the decoder made them), including those decoded on
  the way to a target, so that a sampler visiting a window of nearby samples in any order decodes each
  frame about once. RGB arrays are not cached: converting again (~0.1 ms at 256 px) is cheaper than the
  page faults of keeping hundreds of fresh 200 kB arrays alive;
- one colour converter (swscale context): set up once per file, not once per frame (PyAV's
  ``frame.to_ndarray(format=...)`` builds a new one each call, which costs more than decoding a 256 px
  H.264 frame).

With ``memory_mb`` > 0 a file's frames are instead decoded whole at its first use, converted to RGB
and kept, while their total stays within ``memory_mb`` per process; a file that would pass it is read
as above. For a small dataset (the demo's: 180 episodes of 64 px, 177 MB) every frame is then decoded
once per process instead of about once per visit, and a training step waits less for its batch.

Callers receive a fresh array they own.

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
from av.video.reformatter import VideoReformatter

from wamkit.data.meta import DatasetError
from wamkit.files import fsync_dir, tmp_path

CACHE_FRAMES = 48  # decoded frames kept per open file
_MIN_FORWARD = 2  # decode forward at least this many frames rather than seek

_INHERITED: list = []  # decoders a forked process inherited; kept alive on purpose, never used


def open_input(path: Path) -> av.container.InputContainer:
    """Open ``path`` for reading, or raise a :class:`DatasetError` that names it."""
    try:
        container = av.open(str(path))
    except (av.error.FFmpegError, OSError) as err:
        raise DatasetError(f"{path}: cannot open video (missing, truncated or corrupt?): {err}") from None
    if not container.streams.video:
        container.close()
        raise DatasetError(f"{path}: has no video stream")
    return container


def _no_frame(path: Path, ts: float, tol: float, next_t: float) -> DatasetError:
    return DatasetError(
        f"{path}: no frame at t={ts:.4f}s (the next frame is at t={next_t:.4f}s; tolerance {tol}s)"
    )


def _ends_before(path: Path, ts: float) -> DatasetError:
    return DatasetError(
        f"{path}: video ends before t={ts:.4f}s (truncated, or the episode metadata is wrong)"
    )


class _OpenVideo:
    """One open file: decoder position, recently decoded frames, colour converter (module docstring)."""

    def __init__(self, path: Path, cache_frames: int = CACHE_FRAMES):
        self.container = open_input(path)
        self.stream = self.container.streams.video[0]
        self.stream.thread_count = 1  # threads: no latency per seek, and nothing held across fork()
        self.path = path
        self.tb = float(self.stream.time_base)
        rate = self.stream.average_rate or self.stream.guessed_rate or 30
        self.frame_dt = 1.0 / float(rate)
        self.rgb = VideoReformatter()
        self.frames = None  # the running decode generator
        self.pos: float | None = None  # time of the last frame it produced
        self.gop = _MIN_FORWARD  # longest key-frame interval seen (frames)
        self._last_key: float | None = None
        self.cache_frames = cache_frames
        # slot (time / frame_dt, rounded) -> (time, decoded frame); converted to RGB on each request
        self.cache: OrderedDict[int, tuple[float, av.VideoFrame]] = OrderedDict()

    def _slot(self, t: float) -> int:
        return int(round(t / self.frame_dt))

    def _cached(self, ts: float, tol: float) -> av.VideoFrame | None:
        hit = self.cache.get(self._slot(ts))
        if hit is None or abs(hit[0] - ts) > tol:
            return None
        self.cache.move_to_end(self._slot(ts))
        return hit[1]

    def _keep(self, t: float, frame: av.VideoFrame) -> None:
        if frame.key_frame:
            if self._last_key is not None and t > self._last_key:
                self.gop = max(self.gop, int(round((t - self._last_key) / self.frame_dt)))
            self._last_key = t
        self.cache[self._slot(t)] = (t, frame)
        self.cache.move_to_end(self._slot(t))
        while len(self.cache) > self.cache_frames:
            self.cache.popitem(last=False)

    def _restart(self, ts: float) -> None:
        self.container.seek(int(ts / self.tb), stream=self.stream, backward=True, any_frame=False)
        self.frames = self.container.decode(self.stream)
        self.pos = self._last_key = None

    def frame_at(self, ts: float, tol: float) -> np.ndarray:
        frame = self._cached(ts, tol)
        if frame is None:
            ahead = ts - self.pos if self.pos is not None else -1.0
            if self.frames is None or not 0 < ahead <= self.gop * self.frame_dt + tol:
                self._restart(ts)
            frame = self._decode_to(ts, tol)
        # a fresh array over a fresh buffer, owned by the caller; the cache keeps the decoded frame
        return self.rgb.reformat(frame, format="rgb24").to_ndarray()

    def _decode_to(self, ts: float, tol: float) -> av.VideoFrame:
        try:
            for frame in self.frames:  # type: ignore[union-attr]
                t = frame.pts * self.tb
                self.pos = t
                self._keep(t, frame)
                if t < ts - tol:
                    continue
                if t > ts + tol:
                    self.frames = None
                    raise _no_frame(self.path, ts, tol, t)
                return frame
        except av.error.FFmpegError as err:
            self.frames = None
            raise DatasetError(
                f"{self.path}: decoding failed near t={ts:.4f}s (truncated or corrupt?): {err}"
            ) from None
        self.frames = None
        raise _ends_before(self.path, ts)

    def close(self) -> None:
        self.cache.clear()
        self.frames = None
        self.container.close()


def _decode_whole(path: Path, budget: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Every frame of ``path`` as (times in seconds [T], RGB frames uint8 [T, H, W, 3]), or None when
    they would take more than ``budget`` bytes (told by the header's frame count, when it has one)."""
    container = open_input(path)
    try:
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if int(stream.frames or 0) * ctx.width * ctx.height * 3 > budget:
            return None
        stream.thread_count = 1
        tb = float(stream.time_base)
        rgb = VideoReformatter()
        times, frames = [], []
        for frame in container.decode(stream):
            times.append(frame.pts * tb)
            frames.append(rgb.reformat(frame, format="rgb24").to_ndarray())
    except av.error.FFmpegError as err:
        raise DatasetError(f"{path}: decoding failed (truncated or corrupt?): {err}") from None
    finally:
        container.close()
    if not frames:
        raise DatasetError(f"{path}: no video frames")
    out = np.stack(frames)
    return (np.asarray(times), out) if out.nbytes <= budget else None


class VideoFrames:
    """Frames by (file, timestamp), with lazily opened decoders owned by the current process; with
    ``memory_mb``, whole files decoded into memory up to that many MiB (module docstring)."""

    def __init__(self, max_open: int = 16, cache_frames: int = CACHE_FRAMES, memory_mb: float = 0.0):
        if memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0, got {memory_mb}")
        self.max_open, self.cache_frames, self.memory_mb = max_open, cache_frames, memory_mb
        self._open: OrderedDict[Path, _OpenVideo] = OrderedDict()
        self._whole: dict[Path, tuple[np.ndarray, np.ndarray] | None] = {}  # None: over the budget
        self._whole_bytes = 0
        self._pid = os.getpid()

    def _in_memory(self, path: Path) -> tuple[np.ndarray, np.ndarray] | None:
        if path not in self._whole:
            kept = _decode_whole(path, int(self.memory_mb * 2**20) - self._whole_bytes)
            self._whole[path] = kept
            self._whole_bytes += kept[1].nbytes if kept else 0
        return self._whole[path]

    def frame(self, path: Path, ts: float, tol: float) -> np.ndarray:
        """The RGB frame (H, W, 3) uint8 shown at ``ts`` seconds (within ``tol``) of ``path``."""
        if self._pid != os.getpid():
            # A forked worker must never touch, nor free, the parent's decoders: freeing one joins
            # decoder threads (dav1d keeps its own pool) that do not exist in the child, and hangs.
            _INHERITED.append(self._open)
            self._open = OrderedDict()
            self._whole, self._whole_bytes = {}, 0
            self._pid = os.getpid()
        if self.memory_mb:
            whole = self._in_memory(path)
            if whole is not None:
                times, frames = whole
                i = int(np.searchsorted(times, ts - tol))
                if i < len(times) and abs(times[i] - ts) <= tol:
                    return frames[i].copy()
                raise _ends_before(path, ts) if i >= len(times) else _no_frame(path, ts, tol, times[i])
        video = self._open.get(path)
        if video is None:
            video = _OpenVideo(path, self.cache_frames)
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
        self._whole, self._whole_bytes = {}, 0

    def __getstate__(self):  # pickled into spawned workers: start with no open files, nothing decoded
        return {"max_open": self.max_open, "cache_frames": self.cache_frames, "memory_mb": self.memory_mb}

    def __setstate__(self, state):
        self.__init__(state["max_open"], state.get("cache_frames", CACHE_FRAMES), state.get("memory_mb", 0.0))


class VideoEncoder:
    """Encode RGB frames (H, W, 3) uint8 to ``path`` as H.264 (or ``codec``) / yuv420p at ``fps``.

    ``gop`` is the key-frame interval: small values make random access (training) cheap at some cost
    in file size (lerobot uses 2). H and W must be even (yuv420p halves the chroma planes).
    ``codec``: ``libx264`` (default) or ``libsvtav1`` (what lerobot writes), both in PyAV's wheels.
    """

    CODEC = "libx264"
    PIX_FMT = "yuv420p"
    OPTIONS = {"libx264": {"preset": "veryfast", "bf": "0"}, "libsvtav1": {"preset": "8"}}

    def __init__(self, path: Path, fps: int, height: int, width: int, gop: int = 2, crf: int = 18,
                 codec: str = CODEC):  # fmt: skip
        if height % 2 or width % 2:
            raise ValueError(
                f"{path}: video frames must have even height and width for yuv420p, got {height}x{width}"
            )
        self.path = Path(path)
        self.tmp = tmp_path(self.path)
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        self.shape = (height, width, 3)
        self.container = av.open(str(self.tmp), mode="w")
        if codec not in self.OPTIONS:
            raise ValueError(f"{path}: codec {codec!r} is not one of {list(self.OPTIONS)}")
        self.stream = self.container.add_stream(codec, rate=fps)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = self.PIX_FMT
        self.stream.time_base = Fraction(1, fps)
        self.stream.codec_context.gop_size = gop
        self.stream.options = {"crf": str(crf), **self.OPTIONS[codec]}
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
