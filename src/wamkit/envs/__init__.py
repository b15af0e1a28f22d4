"""Simulated benchmarks behind one interface: one env backend per embodiment (MetaWorld the default;
the others are extras, see wamkit.embodiments).

- :class:`EpisodeSpec` ``(suite, task, trial, seed)`` names a reproducible episode;
- :func:`make_env` builds an :class:`Env` (``reset(spec)``, ``step(action)``, ``max_steps(spec)``,
  ``expert_action(obs)``, ``close()``);
- :func:`suite_info` tells a suite's tasks, max steps, state / action dims and fps;
- :class:`EnvHost` hosts K envs behind batched ``reset`` / ``step`` calls;
  :class:`wamkit.envs.workers.EnvWorker` runs one in a spawned process;
- :func:`check_render_quality` refuses to evaluate on a different look than the training data.
"""

from wamkit.envs.base import (
    RENDER_QUALITIES,
    Env,
    EpisodeSpec,
    SuiteInfo,
    check_render_quality,
    render_info,
)
from wamkit.envs.host import EnvHost
from wamkit.envs.suites import expand_tasks, make_env, suite_info, suites

__all__ = [
    "RENDER_QUALITIES",
    "Env",
    "EnvHost",
    "EpisodeSpec",
    "SuiteInfo",
    "check_render_quality",
    "expand_tasks",
    "make_env",
    "render_info",
    "suite_info",
    "suites",
]
