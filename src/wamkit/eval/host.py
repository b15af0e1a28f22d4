"""The evaluator's env host: :class:`~wamkit.envs.host.EnvHost` plus one call that applies a whole chunk.

Applying ``replan_interval`` actions one IPC round trip each would put a barrier across workers after
every env step; ``advance`` applies each slot's actions in the worker and answers once. Both executors
use this class (an ``EnvWorker`` host factory, or the body of a Ray actor).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.constants import OBS_IMAGES
from wamkit.envs.host import EnvHost


class ChunkHost(EnvHost):
    def advance(self, payload: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Apply action chunks; stop a slot early when its episode terminates or is truncated.

        ``payload``: ``{"actions": {slot: float [k, action_dim]}, "film": [slots]}``. Returns per slot
        ``{"obs": last observation, "rewards": [k'] floats, "successes": [k'] bools, "terminated",
        "truncated", "frames": [k'] image dicts (only for filmed slots)}`` where k' <= k steps were applied.
        """
        film = set(payload.get("film", ()))
        out: dict[int, dict[str, Any]] = {}
        for slot, chunk in payload["actions"].items():
            chunk = np.asarray(chunk)
            if chunk.ndim != 2:
                raise ValueError(
                    f"advance: slot {slot} actions must be [k, action_dim], got {list(chunk.shape)}"
                )
            rewards: list[float] = []
            successes: list[bool] = []
            frames: list[dict[str, Any]] = []
            terminated = truncated = False
            obs: dict[str, Any] = {}
            for action in chunk:
                obs, reward, terminated, truncated, info = self.step({slot: action})[slot]
                rewards.append(float(reward))
                successes.append(bool(info.get("success", False)))
                if slot in film:
                    frames.append({k: v for k, v in obs.items() if k.startswith(OBS_IMAGES)})
                if terminated or truncated:
                    break
            out[slot] = {
                "obs": obs,
                "rewards": rewards,
                "successes": successes,
                "terminated": bool(terminated),
                "truncated": bool(truncated),
                "frames": frames,
            }
        return out
