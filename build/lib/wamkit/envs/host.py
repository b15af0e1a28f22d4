"""EnvHost: K envs in the current process behind one batched call.

It knows nothing about processes: :class:`wamkit.envs.workers.EnvWorker` runs one in a spawned
child, and the evaluator's Ray executor wraps the same class in an actor.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.config import EnvConfig
from wamkit.envs.base import EpisodeSpec, Obs, StepResult
from wamkit.envs.suites import make_env


class EnvHost:
    """``num_envs`` envs addressed by slot 0..K-1. Each batch call touches only the slots it names."""

    def __init__(self, env_cfg: EnvConfig, num_envs: int) -> None:
        if num_envs < 1:
            raise ValueError(f"EnvHost: num_envs must be >= 1, got {num_envs}")
        self.env_cfg = env_cfg
        self.envs = [make_env(env_cfg) for _ in range(num_envs)]
        self.specs: dict[int, EpisodeSpec] = {}

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < len(self.envs):
            raise IndexError(f"EnvHost: slot {slot} out of range 0..{len(self.envs) - 1}")
        return slot

    def reset(self, slot_specs: dict[int, EpisodeSpec]) -> dict[int, Obs]:
        """Start the named episode in each given slot; returns each slot's first observation."""
        out = {}
        for slot, spec in slot_specs.items():
            if isinstance(spec, dict):
                spec = EpisodeSpec.from_dict(spec)
            out[slot] = self.envs[self._slot(slot)].reset(spec)
            self.specs[slot] = spec
        return out

    def step(self, slot_actions: dict[int, np.ndarray]) -> dict[int, StepResult]:
        """Apply one action per given slot; returns ``{slot: (obs, reward, terminated, truncated, info)}``."""
        out = {}
        for slot, action in slot_actions.items():
            if self._slot(slot) not in self.specs:
                raise RuntimeError(f"EnvHost: slot {slot} stepped before reset")
            out[slot] = self.envs[slot].step(action)
        return out

    def expert_actions(self, slot_obs: dict[int, Obs]) -> dict[int, np.ndarray]:
        """The scripted expert's action per slot, for the given observations."""
        return {slot: self.envs[self._slot(slot)].expert_action(obs) for slot, obs in slot_obs.items()}

    def max_steps(self, slots: list[int] | None = None) -> dict[int, int]:
        """Each reset slot's episode step limit."""
        names = self.specs if slots is None else {s: self.specs[s] for s in slots}
        return {s: self.envs[s].max_steps(spec) for s, spec in names.items()}

    def gl_info(self, payload: Any = None) -> dict[str, str]:
        """Which GL device slot 0 renders with (vendor/renderer/version; {} before its first render)."""
        info = getattr(self.envs[0], "gl_info", None)
        return info() if info is not None else {}

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []
