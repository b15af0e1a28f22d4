"""Cosmos3's request conventions, shared by the model adapter and the clients of other Cosmos3 engines.

The adapter (:mod:`wamkit.models.cosmos3`) trains and serves with these; the evaluator's backends for
SGLang, vLLM-Omni and cosmos-framework's HTTP server (:mod:`wamkit.eval.backends`) build their
requests with the very same functions, so a caption or a canvas is never written down twice.

- :func:`action_prompt`: the structured JSON action caption cosmos trains on (diffusers'
  ``Cosmos3OmniPipeline._build_action_json_prompt`` plus the embodiment's view description and the
  ``idle_frame`` entry; docs/cosmos3.md cites both).
- :func:`side_by_side`: one observation's cameras as one frame, left to right in the model's camera
  order (cosmos' ``concat_view`` layout).
- :func:`action_canvas`: the (height, width) diffusers places a frame of a given size on, for a
  resolution tier (``_prepare_action_video_conditioning``: the nearest aspect-ratio bin).

diffusers is imported only by the functions that need it (the ``cosmos3`` extra).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np


def action_prompt(
    description: str,
    *,
    view_point: str | None,
    view_description: str,
    num_frames: int,
    fps: float,
    height: int,
    width: int,
    idle_frames: int | None,
    chunk: int,
) -> str:
    """The JSON caption cosmos trains on, as the string that gets tokenised.

    ``height`` x ``width``: the action canvas (after padding); ``num_frames``: the clip length
    (chunk + 1). ``idle_frames=None`` leaves the ``idle_frame`` field out (cosmos does the same when a
    sample has no idle count); ``view_description=""`` leaves the framing as diffusers writes it.
    """
    from diffusers import Cosmos3OmniPipeline

    base = json.loads(
        Cosmos3OmniPipeline._build_action_json_prompt(
            description, view_point=view_point, num_frames=num_frames, fps=fps, height=height, width=width
        )
    )
    framing = base.get("cinematography", {}).get("framing")
    if framing and view_description:
        sep = " " if framing.endswith(".") else ". "
        base["cinematography"]["framing"] = framing + sep + view_description.rstrip()
    if idle_frames is not None:
        base["actions"][0]["idle_frame"] = f"{int(idle_frames)} out of {int(chunk)}."
    return json.dumps(base)


def side_by_side(frames: list[Any]) -> np.ndarray:
    """Cameras' uint8 frames [..., H, W, 3] (same H) -> one frame [..., H, sum W, 3], left to right."""
    return np.concatenate([np.asarray(f) for f in frames], axis=-2)


def action_canvas(frame_hw: tuple[int, int], tier: int) -> tuple[int, int]:
    """The (height, width) of the action canvas of a frame of ``frame_hw`` at resolution ``tier``."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _ACTION_RESOLUTION_BINS
    from diffusers.video_processor import VideoProcessor

    if str(tier) not in _ACTION_RESOLUTION_BINS:
        raise ValueError(
            f"resolution tier {tier!r}; expected one of {sorted(map(int, _ACTION_RESOLUTION_BINS))}"
        )
    h, w = VideoProcessor.classify_height_width_bin(
        int(frame_hw[0]), int(frame_hw[1]), _ACTION_RESOLUTION_BINS[str(tier)]
    )
    return int(h), int(w)
