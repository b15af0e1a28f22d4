"""Scripted-expert rollouts: whole episodes run inside a worker, returned as stacked frames."""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.constants import ACTION, OBS_STATE, TASK
from wamkit.envs.base import Env, EpisodeSpec
from wamkit.envs.host import EnvHost


def rollout_expert(env: Env, spec: EpisodeSpec, keep_frames_on_failure: bool = True) -> dict[str, Any]:
    """Run the suite's scripted expert for one episode.

    Returns ``{"spec": dict, "success": bool, "steps": int, "frames": {key: array [T, ...]} or None}``.
    Frame t holds the observation before action t and that action (LeRobot's convention); the episode
    ends on the first successful step or at the suite's step limit. ``frames`` is None for a failed
    episode when ``keep_frames_on_failure`` is False (nothing to ship back).
    """
    obs = env.reset(spec)
    frames: dict[str, list[Any]] = {k: [] for k in obs if k != TASK}
    frames[ACTION] = []
    success, steps = False, 0
    for _ in range(env.max_steps(spec)):
        action = env.expert_action(obs)
        for k in frames:
            frames[k].append(action if k == ACTION else obs[k])
        obs, _, terminated, truncated, info = env.step(action)
        steps += 1
        success = success or bool(info["success"])
        if terminated or truncated:
            break
    out_frames = None
    if success or keep_frames_on_failure:
        out_frames = {k: np.stack(v) for k, v in frames.items()}
        out_frames[OBS_STATE] = out_frames[OBS_STATE].astype(np.float32)
        out_frames[ACTION] = out_frames[ACTION].astype(np.float32)
    return {
        "spec": spec.to_dict(),
        "success": success,
        "steps": steps,
        "task": obs[TASK],
        "frames": out_frames,
    }


class ExpertHost(EnvHost):
    """An :class:`EnvHost` that can also run whole expert episodes in slot 0 (used by ``collect``)."""

    def rollout(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload = {"spec": EpisodeSpec, "keep_failed": bool}`` -> :func:`rollout_expert`'s result."""
        spec = payload["spec"]
        self.specs[0] = spec
        return rollout_expert(self.envs[0], spec, keep_frames_on_failure=payload.get("keep_failed", False))
