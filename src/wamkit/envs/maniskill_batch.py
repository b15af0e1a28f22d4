"""ManiSkill3 simulated in batches: N sub-scenes of one task in one process, on the GPU (``physx_cuda``).

What the evaluator's GPU executor (:mod:`wamkit.eval.gpu_host`) steps; it lives in the env workers started
with ManiSkill's Python, as :mod:`wamkit.envs.maniskill_env` does. The parent imports only this module's
names, never ``mani_skill``.

Each episode starts from the state the CPU simulator gives its seed: a CPU env of the task (``num_envs=1``,
no rendering) is reset with the episode's seed, its whole simulation state is read
(``get_state_dict``) and the episode's sub-scene is reset to it (``reset(options={"env_idx": ...,
"reset_to_env_states": ...})``, the way ManiSkill's replay tool moves CPU trajectories to the GPU
simulator). So an episode is named by its seed alone, whatever else starts beside it, and starts where
the process executor's episode of that seed starts. ManiSkill's own batched reset cannot give that: it
seeds torch once per reset call and draws every reset sub-scene from that one stream.

That holds for tasks whose whole episode lives in the simulation state. Two of the suite's tasks keep
some outside it and are refused (:data:`wamkit.envs.maniskill_env.GPU_TASKS`): PegInsertionSide draws each sub-scene's peg and box
sizes when the scene is built, and PlugCharger computes its goal pose in its own episode start.

All sub-scenes step together. A sub-scene no episode is running in gets the hold action (no motion, the
gripper as last commanded); the executor never leaves a running episode out of a step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.config import EnvConfig
from wamkit.embodiments.maniskill import PROFILE
from wamkit.envs.base import EpisodeSpec, Obs
from wamkit.envs.maniskill_env import (
    ACTION_DIM,
    CAMERAS,
    CONTROL_MODE,
    SUITE,
    TASK_INFO,
    _make,
    _np,
    check_control_mode,
    check_gpu_tasks,
    observations,
)

SIM_BACKENDS = ("physx_cuda", "physx_cpu")  # physx_cpu: one sub-scene (ManiSkill's limit), for tests


def _stack(states: list[dict[str, Any]], device: Any) -> dict[str, Any]:
    """ManiSkill state dicts of one sub-scene each, stacked along their batch axis on ``device``."""
    import torch

    first = states[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in states], device) for k in first}
    return torch.cat([torch.as_tensor(s) for s in states], dim=0).to(device)


class ManiSkillBatchEnv:
    """``num_envs`` sub-scenes of one ManiSkill task behind slot-addressed ``reset`` and a lock-step
    ``step``. Observations are built only for the slots asked for (a copy from the device each)."""

    suite = SUITE

    def __init__(self, cfg: EnvConfig, num_envs: int, sim_backend: str = "physx_cuda") -> None:
        from wamkit.envs.suites import check_env_start

        check_env_start(cfg, "ManiSkillBatchEnv", CAMERAS, "ManiSkill3")
        check_control_mode(getattr(cfg, "control_mode", "auto"))
        if sim_backend not in SIM_BACKENDS:
            raise ValueError(f"sim_backend: expected one of {', '.join(SIM_BACKENDS)}, got {sim_backend!r}")
        if sim_backend == "physx_cpu" and num_envs != 1:
            raise ValueError(
                f"sim_backend=physx_cpu simulates one sub-scene (ManiSkill's limit), got {num_envs}"
            )
        self.cfg, self.num_envs, self.sim = cfg, num_envs, sim_backend
        self.task: str | None = None
        self._env: Any = None
        self._twin: Any = None  # the CPU env that gives each seed's initial state
        self.specs: list[EpisodeSpec | None] = [None] * num_envs
        self._hold = np.zeros((num_envs, ACTION_DIM), np.float32)
        self._hold[:, -1] = PROFILE.gripper_open
        self._last: Any = None  # the latest observation (all sub-scenes, on the device)

    def max_steps(self, spec: EpisodeSpec) -> int:
        return self.cfg.max_steps or TASK_INFO[spec.task][0]

    def _scene(self, task: str) -> None:
        if self.task == task:
            return
        if self.task is not None:
            raise ValueError(
                f"ManiSkillBatchEnv holds {self.task}; {task} needs a scene of its own (one task a run)"
            )
        check_gpu_tasks([task])
        self._twin = _make(task, CONTROL_MODE, "none", None)
        self._env = _make(task, CONTROL_MODE, "rgb", self.cfg, num_envs=self.num_envs, sim=self.sim)
        self.task = task

    def initial_state(self, spec: EpisodeSpec) -> dict[str, Any]:
        """The simulation state the CPU simulator starts ``spec``'s episode in (``reset(seed=...)``)."""
        self._twin.reset(seed=spec.seed)
        return self._twin.unwrapped.get_state_dict()

    def reset(self, slot_specs: dict[int, EpisodeSpec]) -> dict[int, Obs]:
        """Start each given slot's episode (one reset of those sub-scenes); their first observations."""
        import torch

        if not slot_specs:
            return {}
        slots = sorted(slot_specs)
        for s in slots:
            if not 0 <= s < self.num_envs:
                raise IndexError(f"ManiSkillBatchEnv: slot {s} out of range 0..{self.num_envs - 1}")
            if slot_specs[s].suite != SUITE:
                raise ValueError(
                    f"episode {slot_specs[s]}: suite '{slot_specs[s].suite}' given to the {SUITE} env"
                )
            self._scene(slot_specs[s].task)
        env = self._env.unwrapped
        states = _stack([self.initial_state(slot_specs[s]) for s in slots], env.device)
        idx = torch.tensor(slots, dtype=torch.long, device=env.device)
        raw, _ = self._env.reset(options={"env_idx": idx, "reset_to_env_states": {"env_states": states}})
        self._last = raw
        for s in slots:
            self.specs[s] = slot_specs[s]
            self._hold[s] = 0.0
            self._hold[s, -1] = PROFILE.gripper_open
        return dict(zip(slots, observations(raw, slots, self.cfg.cameras, [self.task] * len(slots))))

    def step(self, slot_actions: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """One step of every sub-scene: the given slots' actions, the hold action elsewhere. Returns
        ``(reward [N], success [N])``; :meth:`observe` reads the observations it left."""
        import torch

        if self._env is None:
            raise RuntimeError("step() before reset(): call reset first")
        actions = self._hold.copy()
        for s, a in slot_actions.items():
            a = np.asarray(a, np.float32).reshape(-1)
            if a.shape != (ACTION_DIM,):
                raise ValueError(
                    f"action: expected shape [{ACTION_DIM}] ({CONTROL_MODE}: {', '.join(PROFILE.action_names)}), "
                    f"got {list(a.shape)}"
                )
            actions[s] = a
            self._hold[s, -1] = a[-1]  # a slot left out later holds its gripper where it was sent
        env = self._env.unwrapped
        raw, reward, _, _, info = self._env.step(torch.as_tensor(actions, device=env.device))
        self._last = raw
        success = _np(info["success"]).reshape(self.num_envs).astype(bool)
        return _np(reward).reshape(self.num_envs).astype(np.float64), success

    def observe(self, slots: list[int]) -> dict[int, Obs]:
        """The observations of ``slots`` left by the latest reset or step."""
        if not slots:
            return {}
        assert self.task is not None
        return dict(zip(slots, observations(self._last, slots, self.cfg.cameras, [self.task] * len(slots))))

    def close(self) -> None:
        for env in (self._env, self._twin):
            if env is not None:
                env.close()
        self._env = self._twin = self._last = None
        self.task = None


def make_batch(cfg: EnvConfig, num_envs: int, sim_backend: str = "physx_cuda") -> ManiSkillBatchEnv:
    return ManiSkillBatchEnv(cfg, num_envs, sim_backend)


def check_batch(cfg: EnvConfig) -> None:
    """Refuse, in the evaluating process, what the batched simulator cannot run (its tasks, one a run)."""
    check_gpu_tasks(list(cfg.tasks))
