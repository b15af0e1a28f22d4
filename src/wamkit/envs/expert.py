"""Scripted-expert rollouts: whole episodes run inside a worker, returned as stacked frames."""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.constants import ACTION, EXECUTED_ACTION, OBS_STATE, TASK
from wamkit.envs.base import Env, EpisodeSpec
from wamkit.envs.host import EnvHost

# the noise generator of an episode is seeded with (its seed, this): its own stream, apart from the env's
NOISE_STREAM = 0xDA27


def rollout_expert(
    env: Env,
    spec: EpisodeSpec,
    keep_frames_on_failure: bool = True,
    action_noise: float = 0.0,
    noise_hold: int = 1,
    action_lag: int = 0,
    lag_prob: float = 0.0,
) -> dict[str, Any]:
    """Run the suite's scripted expert for one episode.

    Returns ``{"spec": dict, "success": bool, "steps": int, "frames": {key: array [T, ...]} or None}``.
    Frame t holds the observation before action t and that action (LeRobot's convention); the episode
    ends on the first successful step or at the suite's step limit. ``frames`` is None for a failed
    episode when ``keep_frames_on_failure`` is False (nothing to ship back).

    ``action_noise`` > 0 (DART, ``collect.action_noise``): the env executes the expert's action plus
    Gaussian noise of that standard deviation (the env clips it to its bounds), drawn from a generator
    seeded with ``(spec.seed, NOISE_STREAM)`` at steps 0, ``noise_hold``, 2 ``noise_hold``, ... and
    held in between; frame t records the expert's own action, the label of the state the noise led to.

    ``action_lag`` K > 0 with ``lag_prob`` p > 0 (``collect.action_lag``): the episode's steps fall in
    windows of ``noise_hold`` steps; the same generator draws, at each window's first step, whether the
    window is late (probability p), and in a late window the env executes the expert's action of K
    steps before (step 0's before step K), as a robot acting on a chunk planned K steps ago does: the
    hand goes on the way it was going, past where the expert would stop. Frames record the expert's own
    actions, so the dataset holds its way back. With both, the noise is added to the late action.

    With either perturbation, frame t also holds ``executed_action`` (what the env was given at t,
    before its own clipping): a policy trained to continue committed actions is conditioned on those.
    """
    obs = env.reset(spec)
    frames: dict[str, list[Any]] = {k: [] for k in obs if k != TASK}
    frames[ACTION] = []
    success, steps = False, 0
    lagging = action_lag > 0 and lag_prob > 0
    noise = np.random.default_rng([spec.seed, NOISE_STREAM]) if action_noise > 0 or lagging else None
    push, late = None, False
    executed_log: list[Any] = []
    for t in range(env.max_steps(spec)):
        action = env.expert_action(obs)
        for k in frames:
            frames[k].append(action if k == ACTION else obs[k])
        executed = action
        if noise is not None:
            if t % noise_hold == 0:
                if lagging:
                    late = bool(noise.random() < lag_prob)
                if action_noise > 0:
                    push = noise.normal(0.0, action_noise, np.shape(action)).astype(np.float32)
            if late:
                executed = frames[ACTION][max(t - action_lag, 0)]
            if push is not None:
                executed = executed + push
            executed_log.append(executed)
        obs, _, terminated, truncated, info = env.step(executed)
        steps += 1
        success = success or bool(info["success"])
        if terminated or truncated:
            break
    out_frames = None
    if success or keep_frames_on_failure:
        out_frames = {k: np.stack(v) for k, v in frames.items()}
        out_frames[OBS_STATE] = out_frames[OBS_STATE].astype(np.float32)
        out_frames[ACTION] = out_frames[ACTION].astype(np.float32)
        if executed_log:
            out_frames[EXECUTED_ACTION] = np.stack(executed_log).astype(np.float32)
    report = getattr(env, "expert_report", None)  # a suite's expert may say more (a planner's own rate)
    return {
        "spec": spec.to_dict(),
        "success": success,
        "steps": steps,
        "task": obs[TASK],
        "frames": out_frames,
        **(report() if report is not None else {}),
    }


class ExpertHost(EnvHost):
    """An :class:`EnvHost` that can also run whole expert episodes in slot 0 (used by ``collect``)."""

    def rollout(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload = {"spec": EpisodeSpec, "keep_failed": bool, "action_noise": float, "noise_hold":
        int, "action_lag": int, "lag_prob": float}`` ->
        :func:`rollout_expert`'s result."""
        spec = payload["spec"]
        self.specs[0] = spec
        return rollout_expert(
            self.envs[0],
            spec,
            keep_frames_on_failure=payload.get("keep_failed", False),
            action_noise=float(payload.get("action_noise", 0.0)),
            noise_hold=int(payload.get("noise_hold", 1)),
            action_lag=int(payload.get("action_lag", 0)),
            lag_prob=float(payload.get("lag_prob", 0.0)),
        )
