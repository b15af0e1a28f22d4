"""The evaluator's env host: :class:`~wamkit.envs.host.EnvHost` plus two calls that never let one env's
error take the others down.

Applying ``replan_interval`` actions one IPC round trip each would put a barrier across workers after
every env step; ``advance`` applies each slot's actions in the worker and answers once. Both executors
use this class (an ``EnvWorker`` host factory, or the body of a Ray actor).

An exception raised by a simulator inside ``start`` or ``advance`` is caught per slot: that slot's
answer is ``{"error": "<Type>: <message>"}``, its env is rebuilt (a simulator that raised may be left in
any state), and the other slots of the call are answered as usual. The scheduler decides what to do
with the episode (rerun it from the start, or record it as an ``env_error``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from wamkit.constants import OBS_IMAGES
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.host import EnvHost
from wamkit.envs.suites import make_env

log = logging.getLogger(__name__)
ERROR = "error"


def describe(err: BaseException) -> str:
    """One line naming an env's exception, for the journal."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class ChunkHost(EnvHost):
    def _failed(self, slot: int, err: Exception) -> dict[str, str]:
        """Rebuild the slot's env after an exception and say what it was."""
        log.warning("env slot %d raised %s; rebuilding it", slot, describe(err))
        self.specs.pop(slot, None)
        try:
            self.envs[slot].close()
        except Exception as close_err:  # noqa: BLE001 - a broken env may fail to close; it is replaced anyway
            log.warning("env slot %d: close failed (%s)", slot, describe(close_err))
        self.envs[slot] = make_env(self.env_cfg)
        return {ERROR: describe(err)}

    def start(self, slot_specs: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """``reset`` per slot, answering ``{"obs": first observation}`` or ``{"error": message}``."""
        out: dict[int, dict[str, Any]] = {}
        for slot, spec in slot_specs.items():
            spec = EpisodeSpec.from_dict(spec) if isinstance(spec, dict) else spec
            try:
                out[slot] = {"obs": self.reset({slot: spec})[slot]}
            except Exception as err:  # noqa: BLE001 - the simulator's own error: recorded, not fatal
                out[slot] = self._failed(slot, err)
        return out

    def advance(self, payload: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Apply action chunks; stop a slot early when its episode terminates or is truncated.

        ``payload``: ``{"actions": {slot: float [k, action_dim]}, "film": [slots]}``. Returns per slot
        ``{"obs": last observation, "rewards": [k'] floats, "successes": [k'] bools, "terminated",
        "truncated", "frames": [k'] image dicts (only for filmed slots)}`` where k' <= k steps were
        applied, or ``{"error": message}`` when the slot's env raised.
        """
        film = set(payload.get("film", ()))
        out: dict[int, dict[str, Any]] = {}
        for slot, chunk in payload["actions"].items():
            chunk = np.asarray(chunk)
            if chunk.ndim != 2:
                raise ValueError(
                    f"advance: slot {slot} actions must be [k, action_dim], got {list(chunk.shape)}"
                )
            try:
                out[slot] = self._apply(slot, chunk, slot in film)
            except Exception as err:  # noqa: BLE001 - the simulator's own error: recorded, not fatal
                out[slot] = self._failed(slot, err)
        return out

    def _apply(self, slot: int, chunk: np.ndarray, film: bool) -> dict[str, Any]:
        rewards: list[float] = []
        successes: list[bool] = []
        frames: list[dict[str, Any]] = []
        terminated = truncated = False
        obs: dict[str, Any] = {}
        for action in chunk:
            obs, reward, terminated, truncated, info = self.step({slot: action})[slot]
            rewards.append(float(reward))
            successes.append(bool(info.get("success", False)))
            if film:
                frames.append({k: v for k, v in obs.items() if k.startswith(OBS_IMAGES)})
            if terminated or truncated:
                break
        return {
            "obs": obs,
            "rewards": rewards,
            "successes": successes,
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "frames": frames,
        }
