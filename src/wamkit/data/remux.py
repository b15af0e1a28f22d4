"""Video streams moved between files without re-encoding, where the container allows it.

- :func:`join_videos`: several mp4 files, one after the other, into one (v2.1 episodes -> a v3 file).
  Packets are copied; each part's timestamps are shifted so that it starts where the previous one
  ended (its first frame at the part's ``from_ts``). Copying needs every part to carry the same
  stream: codec, size, pixel format, time base and codec extradata (the H.264 SPS/PPS, the AV1 sequence
  header); otherwise the file is re-encoded, and the result says so.
- :func:`cut_video`: one episode's time span out of a file (a v3 file -> a v2.1 episode). Copying needs
  the span to start on a key frame and to hold exactly the episode's frames (true of what lerobot and
  wamkit write: each episode is encoded on its own and appended); otherwise it is re-encoded.
- :func:`psnr`: the peak signal-to-noise ratio of two uint8 images, for re-encoded frames.

Every output is written to ``<name>.tmp.mp4`` and renamed into place (:mod:`wamkit.files`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from wamkit.data.meta import DatasetError
from wamkit.data.video import VideoEncoder, open_input
from wamkit.files import atomic_path

log = logging.getLogger(__name__)

# An encoder for each source codec we may have to re-encode (both ship in PyAV's wheels).
_ENCODERS = {"av1": "libsvtav1", "h264": "libx264"}


@dataclass
class Part:
    """One source of a join: ``frames`` frames of ``path`` (the whole file)."""

    path: Path
    frames: int


def _signature(stream: av.video.stream.VideoStream) -> tuple:
    ctx = stream.codec_context
    return (ctx.name, ctx.width, ctx.height, ctx.pix_fmt, stream.time_base, bytes(ctx.extradata or b""))


def _packets(container) -> list[av.Packet]:
    stream = container.streams.video[0]
    return [p for p in container.demux(stream) if p.dts is not None and p.pts is not None]


def join_videos(parts: list[Part], out: Path, fps: int) -> tuple[list[tuple[float, float]], bool]:
    """Write ``parts`` one after the other to ``out``. Returns each part's ``(from_ts, to_ts)`` in
    ``out`` (``to_ts = from_ts + frames / fps``) and whether the streams were copied (else re-encoded).
    One part's file is open at a time (a group may hold more files than a process may open)."""
    signatures = set()
    for part in parts:
        with open_input(part.path) as container:
            signatures.add(_signature(container.streams.video[0]))
    if len(signatures) == 1:
        try:
            return _copy_join(parts, out, fps), True
        except (av.error.FFmpegError, ValueError) as err:  # e.g. timestamps a muxer refuses
            log.warning("%s: stream copy failed (%s); re-encoding", out, err)
    else:
        log.warning("%s: the parts' streams differ (codec, size or extradata); re-encoding", out)
    return _reencode_join(parts, out, fps), False


def _copy_join(parts: list[Part], out: Path, fps: int) -> list[tuple[float, float]]:
    spans, offset = [], 0  # offset in time-base units
    with open_input(parts[0].path) as first_part, atomic_path(out) as tmp, av.open(str(tmp), mode="w") as dst:
        template = first_part.streams.video[0]
        tb = template.time_base
        stream = dst.add_stream_from_template(template=template, opaque=True)
        stream.time_base = tb
        for part in parts:
            with open_input(part.path) as container:
                packets = _packets(container)
                if not packets:
                    raise DatasetError(f"{part.path}: has no video packets")
                first = min(p.pts for p in packets)
                end = max(p.pts + max(p.duration or 0, 1) for p in packets)
                for p in packets:
                    p.pts, p.dts = p.pts - first + offset, p.dts - first + offset
                    p.stream = stream
                    dst.mux(p)
            start = float(offset * tb)
            spans.append((start, start + part.frames / fps))
            offset += max(end - first, _units(part.frames / fps, tb))
    return spans


def _units(seconds: float, tb: Fraction) -> int:
    return int(round(seconds / float(tb)))


def _reencode_join(parts: list[Part], out: Path, fps: int) -> list[tuple[float, float]]:
    spans, done = [], 0
    encoder = None
    for part in parts:
        for image in decode_all(part.path, part.frames):
            if encoder is None:
                encoder = _encoder_like(part.path, out, fps, image.shape)
            encoder.add(image)
        spans.append((done / fps, (done + part.frames) / fps))
        done += part.frames
    if encoder is None:
        raise DatasetError(f"{out}: nothing to write (no frames in {[str(p.path) for p in parts]})")
    encoder.close()
    return spans


def _encoder_like(src: Path, out: Path, fps: int, shape: tuple[int, ...]) -> VideoEncoder:
    with open_input(src) as c:
        codec = _ENCODERS.get(c.streams.video[0].codec_context.name, VideoEncoder.CODEC)
    return VideoEncoder(out, fps, shape[0], shape[1], codec=codec)


def decode_all(path: Path, frames: int, start: float = 0.0, tol: float = 1e-4) -> list[np.ndarray]:
    """``frames`` RGB frames of ``path`` from ``start`` seconds on, in order."""
    out: list[np.ndarray] = []
    with open_input(path) as c:
        s = c.streams.video[0]
        if start > 0:
            c.seek(int(start / s.time_base), stream=s, backward=True, any_frame=False)
        for frame in c.decode(s):
            if frame.pts * s.time_base >= start - tol:
                out.append(frame.to_ndarray(format="rgb24"))
                if len(out) == frames:
                    return out
    raise DatasetError(f"{path}: holds {len(out)} frames from t={start:.4f}s; the metadata says {frames}")


def cut_video(src: Path, span: tuple[float, float], frames: int, out: Path, fps: int) -> bool:
    """Write the ``frames`` frames of ``src`` in ``[from_ts, to_ts)`` to ``out``, starting at t = 0.
    Returns True when the packets were copied, False when they had to be re-encoded."""
    t0, t1 = span
    tol = 0.5 / fps
    with open_input(src) as c:
        s = c.streams.video[0]
        tb = float(s.time_base)
        packets = sorted(_packets(c), key=lambda p: p.dts)
        inside = [p for p in packets if t0 - tol <= p.pts * tb < t1 - tol]
        first = min((p.pts for p in inside), default=None)
        key_first = bool(inside) and min(inside, key=lambda p: p.dts).is_keyframe
        if len(inside) == frames and key_first and first is not None:
            with atomic_path(out) as tmp, av.open(str(tmp), mode="w") as dst:
                stream = dst.add_stream_from_template(template=s, opaque=True)
                stream.time_base = s.time_base
                for p in inside:
                    p.pts, p.dts = p.pts - first, p.dts - first
                    p.stream = stream
                    dst.mux(p)
            return True
    log.warning(
        "%s: span %.3f-%.3fs does not start on a key frame or holds other frames; re-encoding", src, t0, t1
    )
    images = decode_all(src, frames, start=t0)
    encoder = _encoder_like(src, out, fps, images[0].shape)
    for image in images:
        encoder.add(image)
    encoder.close()
    return False


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 images (inf when identical)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)
