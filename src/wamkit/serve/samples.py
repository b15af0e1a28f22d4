"""Sample files as cosmos-framework writes them, read for ``wamkit infer`` (see :mod:`wamkit.serve.infer`).

A sample is one JSON object (paths relative to the file). Fields read here:

==================  ==========================================================================
``model_mode``      ``wam`` or ``policy`` (the same mode; ``wam`` is cosmos' name) | ``forward_dynamics``
                    | ``inverse_dynamics``; default ``wam``
``name``            output folder name (default: the file's stem)
``prompt``          the instruction (default ``""``)
``vision_path``     an image or a video on disk. Its frames are the cameras side by side (cosmos'
                    ``concat_view``: width = cameras x height) and are split into one image per
                    camera; a model with one camera takes the frame whole. Frame 0 is the observation;
                    ``inverse_dynamics`` takes the whole clip (frames 1..chunk, or just the last frame
                    for a model that reads one goal frame).
``action_path``     ``forward_dynamics``: env actions [chunk, D] (JSON list of lists, or an object with
                    ``action``/``actions``, or .npy); recorded but unused in the other modes
``state``           robot state [state_dim], env units (default: the stats' mean, else zeros)
``domain_name``     recorded (the model's own domain is fixed by its options)
``action_chunk_size`` must equal the model's chunk (default: the model's)
``fps``             frame rate of vision.mp4 (default: the stats' fps, else 10)
``seed``            sampling seed (default 0)
==================  ==========================================================================

Camera images are resized to the model's image size by its preprocessing spec (cosmos' ``image_size``
is therefore recorded, not used). Every other field (``view_point``, ``extra``, ``num_steps``, ...) is kept, written
back in ``sample_args.json`` and reported as unused; nothing is refused for being unknown. A URL is
refused with a clear message: nothing is fetched at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import av
import numpy as np

from wamkit.constants import OBS_STATE

USED = (
    "model_mode",
    "name",
    "prompt",
    "vision_path",
    "action_path",
    "state",
    "domain_name",
    "action_chunk_size",
    "fps",
    "seed",
)
MODE_ALIASES = {"wam": "policy", "policy": "policy", "forward_dynamics": "forward_dynamics",
                "inverse_dynamics": "inverse_dynamics"}  # fmt: skip
URL_PREFIXES = ("http://", "https://", "s3://", "gs://", "hf://")


class SampleError(ValueError):
    """A sample file is invalid; the message names the file and the field."""


def read_frames(path: Path) -> np.ndarray:
    """All frames of an image or a video, uint8 [T, H, W, 3]."""
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError("holds no frames")
    return np.stack(frames)


def split_views(frames: np.ndarray, n: int) -> np.ndarray | None:
    """[T, H, n*W, 3] side-by-side frames -> [n, T, H, W, 3]; None when the width does not split."""
    if n == 1:
        return frames[None]
    h, w = frames.shape[1:3]
    if w % n or abs(w // n - h) > max(1, h // 16):  # cosmos' concat_view: square views side by side
        return None
    return np.stack(np.split(frames, n, axis=2))


class _Reader:
    """Reads one sample file against a served policy; :class:`SampleError` names the bad field."""

    def __init__(self, path: Path, policy):
        self.path, self.policy, self.io = path, policy, policy.io

    def bad(self, field: str, why: str) -> SampleError:
        return SampleError(f"{self.path}: field '{field}': {why}")

    def local(self, field: str, value: Any) -> Path:
        if not isinstance(value, str) or not value:
            raise self.bad(field, "expected a file path")
        if value.startswith(URL_PREFIXES):
            raise self.bad(
                field, f"{value} is a URL; wamkit infer reads local files only (download it, give the path)"
            )
        return self.path.parent / value

    def defaults(self, raw: dict[str, Any]) -> dict[str, Any]:
        meta, stats = self.policy.spec.stats.metadata, self.policy.spec.stats
        state = stats.features[OBS_STATE].mean if OBS_STATE in stats.features else [0.0] * self.io.state_dim
        return {
            "model_mode": raw.get("model_mode", "wam"),
            "name": raw.get("name", self.path.stem),
            "prompt": raw.get("prompt", ""),
            "vision_path": raw.get("vision_path"),
            "action_path": raw.get("action_path"),
            "state": raw.get("state", list(state)),
            "domain_name": raw.get("domain_name", meta.get("domain_name", "")),
            "action_chunk_size": raw.get("action_chunk_size", self.io.chunk),
            "fps": raw.get("fps", meta.get("fps", 10)),
            "seed": raw.get("seed", 0),
        }

    def check(self, s: dict[str, Any]) -> None:
        if not isinstance(s["model_mode"], str) or s["model_mode"] not in MODE_ALIASES:
            raise self.bad("model_mode", f"{s['model_mode']!r} is not one of {', '.join(MODE_ALIASES)}")
        for key in ("name", "prompt", "domain_name"):
            if not isinstance(s[key], str):
                raise self.bad(key, "expected a string")
        if not s["name"] or "/" in s["name"] or s["name"].startswith("."):
            raise self.bad("name", f"{s['name']!r} is not a usable folder name")
        if s["action_chunk_size"] != self.io.chunk:
            raise self.bad(
                "action_chunk_size",
                f"{s['action_chunk_size']!r}, but this model predicts chunks of {self.io.chunk}",
            )
        v = s["seed"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise self.bad("seed", f"expected a non-negative integer, got {v!r}")
        if isinstance(s["fps"], bool) or not isinstance(s["fps"], int | float) or not 0 < s["fps"] <= 1000:
            raise self.bad("fps", f"expected a number in (0, 1000], got {s['fps']!r}")
        st = s["state"]
        if (
            not isinstance(st, list)
            or len(st) != self.io.state_dim
            or not all(isinstance(v, int | float) for v in st)
        ):
            raise self.bad("state", f"expected a list of {self.io.state_dim} numbers")

    def views(self, s: dict[str, Any]) -> np.ndarray:
        """[n_cams, T, S, S, 3] uint8: the vision file's frames, one image per camera, resized."""
        file = self.local("vision_path", s["vision_path"])
        try:
            frames = read_frames(file)
        except (OSError, ValueError, av.error.FFmpegError) as err:
            raise self.bad("vision_path", f"cannot read {file} as an image or video ({err})") from None
        cams = self.io.cameras
        views = split_views(frames, len(cams))
        if views is None:
            h, w = frames.shape[1:3]
            raise self.bad(
                "vision_path",
                f"a {w}x{h} frame does not split into the model's {len(cams)} cameras {list(cams)}: give "
                "the views side by side (concat_view, width = cameras x height)",
            )
        return np.stack([self.policy.spec.resize_images(v) for v in views])

    def actions(self, value: Any) -> np.ndarray:
        file = self.local("action_path", value)
        try:
            if file.suffix == ".npy":
                data = np.load(file, allow_pickle=False)
            else:
                obj = json.loads(file.read_text())
                obj = obj.get("actions", obj.get("action")) if isinstance(obj, dict) else obj
                data = np.asarray(obj)
        except (OSError, ValueError) as err:
            raise self.bad("action_path", f"cannot read {file} ({err})") from None
        if data.dtype.kind not in "iuf" or data.ndim != 2:
            raise self.bad(
                "action_path", f"{file}: expected numbers [chunk, D], got {data.dtype} {list(data.shape)}"
            )
        return data


def resolve_sample(path: Path, policy) -> dict[str, Any]:
    """Read one sample file, fill in every default and load its inputs.

    Returns the resolved fields plus ``mode`` (wamkit's name), ``unused`` (fields not read, kept),
    ``raw`` (the file as given), ``views`` [n_cams, T, S, S, 3] and, for forward dynamics,
    ``actions`` [chunk, D] env actions."""
    r = _Reader(path, policy)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON, and text that is not UTF-8
        raise SampleError(f"{path}: not a readable JSON file ({type(err).__name__}: {err})") from None
    if not isinstance(raw, dict):
        raise SampleError(f"{path}: expected a JSON object with fields {', '.join(USED)}")
    s = r.defaults(raw)
    r.check(s)
    s["mode"] = MODE_ALIASES[s["model_mode"]]
    s["unused"] = sorted(set(raw) - set(USED)) + (
        ["action_path"] if s["action_path"] and s["mode"] != "forward_dynamics" else []
    )
    s["raw"] = raw
    s["views"] = r.views(s)
    if s["mode"] == "inverse_dynamics" and s["views"].shape[1] < 2:
        raise r.bad(
            "vision_path", "inverse_dynamics needs a video (the observation, then the frames that follow)"
        )
    if s["mode"] == "forward_dynamics":
        if s["action_path"] is None:
            raise r.bad("action_path", "forward_dynamics needs the path of the actions (.json or .npy)")
        s["actions"] = r.actions(s["action_path"])
    return s
