"""``wamkit infer``: batch inference from sample JSON files (cosmos-framework's format), in-process.

    wamkit infer -i "samples/*.json" -o out/ EXPORT_DIR
    wamkit infer -i "samples/*.json" -o out/ --model delay --random-init

The fields a sample may hold are in :mod:`wamkit.serve.samples`; cosmos' own sample files are read as
they are (fields wamkit does not use are kept and reported). Per sample, ``OUT/<name>/`` gets the
three files cosmos-framework writes:

- ``sample_args.json``: the sample's fields as given plus every resolved default, ``output_dir``, and
  ``wamkit`` (model, source, ``unused_fields``);
- ``sample_outputs.json``: ``{"args": <sample_args>, "status": "success", "message": null,
  "stack_trace": null, "outputs": [{"content": {...}, "files": [".../vision.mp4"]}]}``; ``content``
  holds ``action`` [chunk, D] env-ready actions (policy, inverse dynamics);
- ``vision.mp4``, in every mode: the model's predicted clip when it predicts frames (policy and
  forward dynamics: the observation and the chunk future frames), else the observation (policy) or the
  observed clip (inverse dynamics); the cameras side by side.

An invalid sample is reported by file and field and skipped; the exit code is 1 if any failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import av
import numpy as np

from wamkit.constants import OBS_STATE, PROMPT, image_key
from wamkit.files import atomic_write_json, atomic_write_with
from wamkit.models.base import ReturnsFrames
from wamkit.serve.policy import FD_ACTIONS, GOAL_IMAGE, RETURN_FRAMES
from wamkit.serve.samples import SampleError, read_frames

__all__ = ["SampleError", "read_frames", "request", "run_sample", "write_video"]


def write_video(path: Path, frames: np.ndarray, fps: float) -> None:
    """uint8 [T, H, W, 3] -> H.264 mp4 (yuv420p; an odd H or W loses its last row or column)."""
    frames = frames[:, : frames.shape[1] // 2 * 2, : frames.shape[2] // 2 * 2]

    def write(tmp: Path) -> None:
        with av.open(str(tmp), "w", format="mp4") as container:
            codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
            stream = container.add_stream(codec, rate=max(round(fps), 1))
            stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
            for frame in frames:
                image = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
                container.mux(stream.encode(image))
            container.mux(stream.encode())

    atomic_write_with(path, write)


def _side_by_side(views: np.ndarray) -> np.ndarray:
    """[n_cams, T, H, W, 3] -> [T, H, n_cams * W, 3]."""
    return np.concatenate(list(views), axis=2)


def request(policy, s: dict[str, Any]) -> dict[str, Any]:
    """The sample as one request to the served policy, in the form a websocket client sends: the first
    frame of each camera, the state in env units, the prompt, the mode and the seed; the env actions of
    forward dynamics; the goal of inverse dynamics (each camera's ``chunk`` frames after the observation
    for a model that reads the whole clip, else each camera's last frame); the predicted frames asked for
    in policy mode where the model predicts them."""
    io, views, mode = policy.io, s["views"], s["mode"]
    obs: dict[str, Any] = {image_key(c): views[i, 0] for i, c in enumerate(io.cameras)}
    obs[OBS_STATE] = np.asarray(s["state"], np.float32)
    obs.update({PROMPT: s["prompt"], "mode": mode, "seed": int(s["seed"])})
    if mode == "policy" and isinstance(policy.adapter, ReturnsFrames):
        obs[RETURN_FRAMES] = True
    elif mode == "forward_dynamics":
        raw = bool(policy.raw_actions)
        dim = io.action_dim if raw else policy.spec.env_action_dim
        if s["actions"].shape != (io.chunk, dim):
            what = "model-space actions (--raw-actions)" if raw else "env actions"
            raise SampleError(
                f"sample '{s['name']}': field 'action_path': expected {what} [{io.chunk}, {dim}], got {list(s['actions'].shape)}"
            )
        obs[FD_ACTIONS] = np.asarray(s["actions"], np.float32)
    elif mode == "inverse_dynamics":
        whole = tuple(policy.adapter.future_frame_offsets) == tuple(range(1, io.chunk + 1))
        if whole and views.shape[1] < io.chunk + 1:
            raise SampleError(
                f"sample '{s['name']}': field 'vision_path': inverse_dynamics needs {io.chunk + 1} frames "
                f"(the observation and the {io.chunk} after it), the video has {views.shape[1]}"
            )
        for i, c in enumerate(io.cameras):
            obs[f"{GOAL_IMAGE}.{c}"] = views[i, 1 : io.chunk + 1] if whole else views[i, -1]
    return obs


def run_sample(policy, s: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one resolved sample through the served policy's own ``prepare`` and ``run`` (what a server
    does with a request) and write its three files; returns the ``sample_outputs.json`` object."""
    try:
        reply = policy.run([policy.prepare(request(policy, s))])[0]
    except ValueError as err:  # RequestError, and a model's own refusal
        raise SampleError(f"sample '{s['name']}': {err}") from None
    observed = _side_by_side(s["views"])
    content: dict[str, Any] = {}
    if "actions" in reply:
        content["action"] = np.asarray(reply["actions"], np.float32).tolist()
    if "video" in reply:
        video = np.asarray(reply["video"], np.uint8)
    elif "frames" in reply:  # a model that predicts one frame: the observation, then it
        pred = np.asarray(reply["frames"], np.uint8)
        video = np.stack([observed[0], pred]) if pred.shape == observed[0].shape else pred[None]
    else:
        video = observed if s["mode"] == "inverse_dynamics" else observed[:1]
    out.mkdir(parents=True, exist_ok=True)
    write_video(out / "vision.mp4", video, s["fps"])
    args = _sample_args(policy, s, out)
    atomic_write_json(out / "sample_args.json", args)
    outputs = {
        "args": args,
        "status": "success",
        "message": None,
        "stack_trace": None,
        "outputs": [{"content": content, "files": [str(out / "vision.mp4")]}],
    }
    atomic_write_json(out / "sample_outputs.json", outputs)
    return outputs


def _sample_args(policy, s: dict[str, Any], out: Path) -> dict[str, Any]:
    resolved = {k: v for k, v in s.items() if k not in ("mode", "unused", "raw", "views", "actions")}
    meta = {
        "model": policy.adapter.name,
        "source": policy.source,
        "mode": s["mode"],
        "autocast": policy.identity()["autocast"],
        "unused_fields": s["unused"],
    }
    return {**s["raw"], **resolved, "output_dir": str(out), "wamkit": meta}
