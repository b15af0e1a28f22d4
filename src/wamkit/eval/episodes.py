"""Which episodes an evaluation runs, named so that a rerun evaluates exactly the same ones.

Episodes are tasks × trials (``eval.trials``; 0: the suite's protocol, e.g. MetaWorld 10).
The seed of trial ``t`` follows ``env.seed_rule`` (:func:`wamkit.envs.base.episode_seed`): ``per_trial``
gives ``eval.seed + t``; ``openpi`` / ``openvla`` give every trial the seed the task's env is seeded
with once (7 / 0), and the env starts trial ``t`` from the generator state ``t`` earlier resets leave
(a suite with stored initial states also starts trial ``t`` from ``initial_states[t]``). They are listed
trial-major (trial 0 of every task, then trial 1, ...) so that a partial run covers every task evenly.

The model's noise is named too: request ``k`` of an episode carries the seed :func:`request_seed`
(a hash of the episode's name and ``k``), and a model draws each row's noise from its row's seed alone
(``models/base.py``). So an episode's actions do not depend on which other episodes share its model
call, on ``num_envs``, ``stages`` or the order episodes finish in: a rerun repeats every episode.
"""

from __future__ import annotations

import zlib
from typing import Any

from wamkit.config import ConfigError, EnvConfig, EvalConfig
from wamkit.envs.base import EpisodeSpec, ResolvedEnv, episode_seed, resolved, stack_versions
from wamkit.eval.execution import ActionExecution


def suite_tasks(env_cfg: EnvConfig) -> list[str]:
    """The suite's task names for ``env.tasks`` (groups such as MT10 and task indices resolved), or
    every task of the suite when it is empty."""
    from wamkit.envs import expand_tasks, suite_info

    if env_cfg.tasks:
        return list(expand_tasks(env_cfg.suite, [str(t) for t in env_cfg.tasks]))
    return list(suite_info(env_cfg.suite).tasks)


def trials_per_task(env_cfg: EnvConfig, eval_cfg: EvalConfig) -> int:
    """``eval.trials``, or the suite's protocol count when it is 0."""
    from wamkit.envs.suites import protocol

    if eval_cfg.trials < 0:
        raise ConfigError(
            f"eval.trials: expected >= 1 trial per task (0: the suite's), got {eval_cfg.trials}"
        )
    return eval_cfg.trials or protocol(env_cfg.suite).trials


def request_seed(spec: EpisodeSpec, k: int) -> int:
    """The seed of request ``k`` (0, 1, ... per replan) of episode ``spec``: stable across runs, Python
    versions and machines (CRC-32, not ``hash``), below 2**31."""
    name = f"{spec.suite}/{spec.task}/{spec.trial}/{spec.seed}/{k}"
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def plan_episodes(env_cfg: ResolvedEnv, eval_cfg: EvalConfig) -> list[EpisodeSpec]:
    rule = resolved(env_cfg, "plan_episodes").seed_rule
    tasks = suite_tasks(env_cfg)
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"env.tasks: a task is listed twice in {tasks}")
    return [
        EpisodeSpec(suite=env_cfg.suite, task=task, trial=t, seed=episode_seed(rule, eval_cfg.seed, t))
        for t in range(trials_per_task(env_cfg, eval_cfg))
        for task in tasks
    ]


def plan_record(env_cfg: ResolvedEnv, eval_cfg: EvalConfig, server: dict[str, Any]) -> dict[str, Any]:
    """What makes the episodes' results what they are; ``--resume`` refuses a different one.

    Throughput settings (num_envs, stages, workers, executor) are left out on purpose: they change how
    fast episodes run, never their results. ``auto`` settings are recorded as what they resolved to, and
    ``stack`` holds the simulator stack's versions (a different stack may render other pixels).
    """
    env_cfg = resolved(env_cfg, "plan_record")
    return {
        "suite": env_cfg.suite,
        "tasks": suite_tasks(env_cfg),
        "cameras": list(env_cfg.cameras),
        "image_size": env_cfg.image_size,
        "render_quality": env_cfg.render_quality,
        "render_gpu": env_cfg.render_gpu,  # which renderer draws the frames is part of the stack
        "seed_rule": env_cfg.seed_rule,
        "hard_reset": env_cfg.hard_reset,
        "state": env_cfg.state,
        "max_steps": env_cfg.max_steps,
        "trials": trials_per_task(env_cfg, eval_cfg),
        "seed": eval_cfg.seed if env_cfg.seed_rule == "per_trial" else episode_seed(env_cfg.seed_rule, 0, 0),
        "replan_interval": eval_cfg.replan_interval,
        "blank_images": eval_cfg.blank_images,
        "execution": ActionExecution.of(eval_cfg).record(),
        "server": server,
        "stack": stack_versions(),
    }
