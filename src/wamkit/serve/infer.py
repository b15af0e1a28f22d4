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
import torch

from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.files import atomic_write_json, atomic_write_with
from wamkit.serve.samples import SampleError, read_frames

__all__ = ["SampleError", "read_frames", "write_video", "run_sample"]


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


def _model_inputs(policy, s: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The batch (one request) and the mode's extra inputs, in model space."""
    io, spec, views = policy.io, policy.spec, s["views"]
    batch: dict[str, Any] = {
        image_key(c): torch.from_numpy(views[i, :1].copy()) for i, c in enumerate(io.cameras)
    }
    batch[OBS_STATE] = torch.from_numpy(spec.encode_state(np.asarray([s["state"]], np.float32)))
    batch[TASK] = [s["prompt"]]
    inputs: dict[str, Any] = {}
    if s["mode"] == "policy":
        inputs["return_frames"] = True
    elif s["mode"] == "forward_dynamics":
        acts, raw = s["actions"], bool(getattr(policy, "raw_actions", False))
        dim = io.action_dim if raw else spec.env_action_dim
        if acts.shape != (io.chunk, dim):
            what = "model-space actions (--raw-actions)" if raw else "env actions"
            raise SampleError(
                f"sample '{s['name']}': field 'action_path': expected {what} [{io.chunk}, {dim}], got {list(acts.shape)}"
            )
        model = acts[None].astype(np.float32) if raw else spec.encode_actions(spec.env_to_stored(acts[None]))
        inputs["actions"] = torch.from_numpy(np.ascontiguousarray(model, np.float32))
    else:
        inputs["goal_images"] = _goal(policy, s)
    return batch, inputs


def _goal(policy, s: dict[str, Any]) -> Any:
    """Inverse dynamics: for a model that reads the whole clip (it declares ``chunk`` future frame
    offsets) {image key: the ``chunk`` frames after the observation [1, chunk, S, S, 3]} per camera;
    otherwise the server's form, the first camera's last frame [1, S, S, 3]."""
    io, views = policy.io, s["views"]
    whole = tuple(policy.adapter.future_frame_offsets) == tuple(range(1, io.chunk + 1))
    if not whole:
        return torch.from_numpy(views[0, -1][None].copy())
    if views.shape[1] < io.chunk + 1:
        raise SampleError(
            f"sample '{s['name']}': field 'vision_path': inverse_dynamics needs {io.chunk + 1} frames "
            f"(the observation and the {io.chunk} after it), the video has {views.shape[1]}"
        )
    return {
        image_key(c): torch.from_numpy(views[i, 1 : io.chunk + 1][None].copy())
        for i, c in enumerate(io.cameras)
    }


def run_sample(policy, s: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one resolved sample and write its three files; returns the ``sample_outputs.json`` object."""
    batch, inputs = _model_inputs(policy, s)
    try:
        with policy.compute():
            reply = policy.adapter.predict(batch, mode=s["mode"], seed=s["seed"], **inputs)
    except ValueError as err:
        raise SampleError(f"sample '{s['name']}': {err}") from None
    observed = _side_by_side(s["views"])
    content: dict[str, Any] = {}
    if "actions" in reply:
        acts = np.asarray(reply["actions"], np.float32)
        content["action"] = (
            acts if getattr(policy, "raw_actions", False) else policy.spec.decode_actions(acts)
        )[0].tolist()
    if "video" in reply:
        video = np.asarray(reply["video"], np.uint8)[0]
    elif "frames" in reply:  # a model that predicts one frame: the observation, then it
        pred = np.asarray(reply["frames"], np.uint8)[0]
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
