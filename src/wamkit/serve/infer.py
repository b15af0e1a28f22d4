"""``wamkit infer``: batch inference from JSON sample files, in-process (no server).

    wamkit infer -i "samples/*.json" -o out/ EXPORT_DIR
    wamkit infer -i "samples/*.json" -o out/ --model delay --random-init

Each sample file is one JSON object (paths are relative to the file):

==================  ==========================================================================
``model_mode``      ``policy`` (default) | ``forward_dynamics`` | ``inverse_dynamics``
``name``            output folder name (default: the file's stem)
``prompt``          the instruction (default ``""``)
``vision_path``     an image (png, jpg) or a video (mp4, ...): the observation is its first frame;
                    ``inverse_dynamics`` needs a video and takes its last frame as the goal.
                    The same frame is given to every camera of the model.
``action_path``     ``forward_dynamics`` only: env actions [chunk, D] as JSON (a list of lists) or .npy
``state``           the robot state [state_dim] in env units (default: the stats file's mean)
``domain_name``     recorded in sample_args.json (models with per-domain heads read it)
``action_chunk_size`` must equal the model's chunk (default: the model's)
``fps``             frame rate of vision.mp4 (default: the stats file's fps, else 10)
``image_size``      frames are read and written at this size (default: the model's image size)
``seed``            sampling seed (default 0)
==================  ==========================================================================

Per sample, ``OUT/<name>/`` gets ``sample_args.json`` (every field with its resolved default),
``sample_outputs.json`` (``actions`` [chunk, D] env-ready, or the frame count) and ``vision.mp4``
(input frame then predicted frame, for ``forward_dynamics``). An invalid sample is reported by file
and field and skipped; the others still run; the exit code is 1 if any sample failed.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path
from typing import Any

import av
import numpy as np

from wamkit.actions.images import resize_images
from wamkit.constants import OBS_STATE, image_key
from wamkit.serve.cli import add_model_arguments, build_policy, resolve_config
from wamkit.serve.policy import FD_ACTIONS, GOAL_IMAGE, MODES, RequestError, ServedPolicy

FIELDS = (
    "model_mode",
    "name",
    "prompt",
    "vision_path",
    "action_path",
    "state",
    "domain_name",
    "action_chunk_size",
    "fps",
    "image_size",
    "seed",
)


class SampleError(ValueError):
    """A sample file is invalid; the message names the file and the field."""


def read_frames(path: Path) -> np.ndarray:
    """All frames of an image or a video, uint8 [T, H, W, 3]."""
    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise ValueError("holds no frames")
    return np.stack(frames)


def write_video(path: Path, frames: np.ndarray, fps: float) -> None:
    """uint8 [T, H, W, 3] -> H.264 mp4 (yuv420p; H and W must be even)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(
            "libx264" if "libx264" in av.codecs_available else "mpeg4", rate=round(fps)
        )
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
            )
        container.mux(stream.encode())


def resolve_sample(path: Path, policy: ServedPolicy) -> dict[str, Any]:
    """Read one sample file and fill in every default; :class:`SampleError` names the bad field."""

    def bad(field: str, why: str) -> SampleError:
        return SampleError(f"{path}: field '{field}': {why}")

    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SampleError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(raw, dict):
        raise SampleError(f"{path}: expected a JSON object with fields {', '.join(FIELDS)}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise bad(unknown[0], f"unknown (valid fields: {', '.join(FIELDS)})")
    io, meta = policy.io, policy.spec.stats.metadata
    s = {
        "model_mode": raw.get("model_mode", "policy"),
        "name": raw.get("name", path.stem),
        "prompt": raw.get("prompt", ""),
        "vision_path": raw.get("vision_path"),
        "action_path": raw.get("action_path"),
        "state": raw.get("state", policy.spec.stats[OBS_STATE].mean),
        "domain_name": raw.get("domain_name", meta.get("domain_name", "")),
        "action_chunk_size": raw.get("action_chunk_size", io.chunk),
        "fps": raw.get("fps", meta.get("fps", 10)),
        "image_size": raw.get("image_size", io.image_size),
        "seed": raw.get("seed", 0),
    }
    if s["model_mode"] not in MODES:
        raise bad("model_mode", f"{s['model_mode']!r} is not one of {', '.join(MODES)}")
    for key in ("name", "prompt", "domain_name"):
        if not isinstance(s[key], str):
            raise bad(key, "expected a string")
    if not s["name"] or "/" in s["name"] or s["name"].startswith("."):
        raise bad("name", f"{s['name']!r} is not a usable folder name")
    if s["action_chunk_size"] != io.chunk:
        raise bad(
            "action_chunk_size", f"{s['action_chunk_size']!r}, but this model predicts chunks of {io.chunk}"
        )
    for key in ("seed", "image_size"):
        if (
            isinstance(s[key], bool)
            or not isinstance(s[key], int)
            or s[key] < (1 if key == "image_size" else 0)
        ):
            raise bad(
                key,
                f"expected a {'positive' if key == 'image_size' else 'non-negative'} integer, got {s[key]!r}",
            )
    if s["image_size"] % 2:
        raise bad("image_size", f"{s['image_size']} must be even (mp4 frames)")
    if isinstance(s["fps"], bool) or not isinstance(s["fps"], int | float) or not 0 < s["fps"] <= 1000:
        raise bad("fps", f"expected a number in (0, 1000], got {s['fps']!r}")
    state = s["state"]
    if (
        not isinstance(state, list)
        or len(state) != io.state_dim
        or not all(isinstance(v, int | float) for v in state)
    ):
        raise bad("state", f"expected a list of {io.state_dim} numbers")
    if not isinstance(s["vision_path"], str):
        raise bad("vision_path", "required: the path of an image or a video")
    vision = path.parent / s["vision_path"]
    try:
        frames = read_frames(vision)
    except (OSError, ValueError, av.error.FFmpegError) as err:
        raise bad("vision_path", f"cannot read {vision} as an image or video ({err})") from None
    s["frames"] = resize_images(frames, s["image_size"])
    if s["model_mode"] == "inverse_dynamics" and len(frames) < 2:
        raise bad(
            "vision_path", "inverse_dynamics needs a video (first frame: observation, last frame: goal)"
        )
    if s["model_mode"] == "forward_dynamics":
        s["actions"] = _read_actions(path, s["action_path"], bad)
    elif s["action_path"] is not None:
        raise bad("action_path", f"only forward_dynamics takes actions, not {s['model_mode']}")
    return s


def _read_actions(path: Path, action_path: Any, bad) -> np.ndarray:
    if not isinstance(action_path, str):
        raise bad("action_path", "forward_dynamics needs the path of the actions (.json or .npy)")
    file = path.parent / action_path
    try:
        data = (
            np.load(file, allow_pickle=False)
            if file.suffix == ".npy"
            else np.asarray(json.loads(file.read_text()))
        )
    except (OSError, ValueError) as err:
        raise bad("action_path", f"cannot read {file} ({err})") from None
    if data.dtype.kind not in "iuf" or data.ndim != 2:
        raise bad("action_path", f"{file}: expected numbers [chunk, D], got {data.dtype} {list(data.shape)}")
    return data


def run_sample(policy: ServedPolicy, s: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run one resolved sample and write its three files; return the outputs."""
    frames = s.pop("frames")
    obs: dict[str, Any] = {image_key(c): frames[0] for c in policy.io.cameras}
    obs |= {
        OBS_STATE: np.asarray(s["state"], np.float32),
        "prompt": s["prompt"],
        "mode": s["model_mode"],
        "seed": s["seed"],
    }
    if s["model_mode"] == "inverse_dynamics":
        obs[GOAL_IMAGE] = frames[-1]
    if s["model_mode"] == "forward_dynamics":
        obs[FD_ACTIONS] = s.pop("actions")
    try:
        reply = policy.infer(obs)
    except RequestError as err:
        raise SampleError(f"sample '{s['name']}': {err}") from None
    out.mkdir(parents=True, exist_ok=True)
    args = {**s, "model": policy.adapter.name, "source": policy.source}
    (out / "sample_args.json").write_text(json.dumps(args, indent=1))
    if "frames" in reply:
        pred = resize_images(reply["frames"][None], s["image_size"])[0]
        write_video(out / "vision.mp4", np.stack([frames[0], pred]), s["fps"])
        outputs = {"frames": 2, "vision": "vision.mp4", "note": "frame 0: input, frame 1: predicted"}
    else:
        outputs = {"actions": reply["actions"].tolist(), "shape": list(reply["actions"].shape)}
    (out / "sample_outputs.json").write_text(json.dumps(outputs, indent=1))
    return outputs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--input", required=True, help='sample files, a glob in quotes: "samples/*.json"'
    )
    parser.add_argument("-o", "--output", required=True, help="output folder (one sub-folder per sample)")
    add_model_arguments(parser)


def main(args: argparse.Namespace) -> int:
    files = sorted(Path(p) for p in glob.glob(args.input))
    if not files:
        print(f"wamkit infer: no files match {args.input!r}")
        return 2
    cfg = resolve_config(args)
    policy = build_policy(args, cfg)
    out, failed, done, names = Path(args.output), [], 0, {}
    for path in files:
        try:
            sample = resolve_sample(path, policy)
            if sample["name"] in names:
                raise SampleError(
                    f"{path}: field 'name': {sample['name']!r} is already used by {names[sample['name']]}"
                )
            names[sample["name"]] = path
            run_sample(policy, sample, out / sample["name"])
            done += 1
        except SampleError as err:
            failed.append(str(err))
    print(f"wamkit infer: {done} sample(s) written to {out}, {len(failed)} invalid")
    for line in failed:
        print(f"  invalid: {line}")
    return 1 if failed else 0
