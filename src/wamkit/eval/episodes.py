"""Which episodes an evaluation runs, named so that a rerun evaluates exactly the same ones.

Episodes are tasks × trials; trial ``t`` of every task has ``seed = eval.seed + t`` (LIBERO also starts
trial ``t`` from the task's stored ``initial_states[t]``). They are listed trial-major (trial 0 of every
task, then trial 1, ...) so that a partial run covers every task evenly.
"""

from __future__ import annotations

from typing import Any

from wamkit.config import ConfigError, EnvConfig, EvalConfig
from wamkit.envs.base import EpisodeSpec


def suite_tasks(env_cfg: EnvConfig) -> list[str]:
    """The suite's task names for ``env.tasks`` (groups such as MT10 and LIBERO indices resolved), or
    every task of the suite when it is empty."""
    from wamkit.envs import expand_tasks, suite_info

    if env_cfg.tasks:
        return list(expand_tasks(env_cfg.suite, [str(t) for t in env_cfg.tasks]))
    return list(suite_info(env_cfg.suite).tasks)


def plan_episodes(env_cfg: EnvConfig, eval_cfg: EvalConfig) -> list[EpisodeSpec]:
    if eval_cfg.trials < 1:
        raise ConfigError(f"eval.trials: expected >= 1 trial per task, got {eval_cfg.trials}")
    tasks = suite_tasks(env_cfg)
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"env.tasks: a task is listed twice in {tasks}")
    return [
        EpisodeSpec(suite=env_cfg.suite, task=task, trial=t, seed=eval_cfg.seed + t)
        for t in range(eval_cfg.trials)
        for task in tasks
    ]


def plan_record(env_cfg: EnvConfig, eval_cfg: EvalConfig, server: dict[str, Any]) -> dict[str, Any]:
    """What makes the episodes' results what they are; ``--resume`` refuses a different one.

    Throughput settings (num_envs, stages, workers, executor) are left out on purpose: they change how
    fast episodes run, never their results.
    """
    return {
        "suite": env_cfg.suite,
        "tasks": suite_tasks(env_cfg),
        "cameras": list(env_cfg.cameras),
        "image_size": env_cfg.image_size,
        "render_quality": env_cfg.render_quality,
        "max_steps": env_cfg.max_steps,
        "trials": eval_cfg.trials,
        "seed": eval_cfg.seed,
        "replan_interval": eval_cfg.replan_interval,
        "server": server,
    }
