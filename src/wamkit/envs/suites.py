"""Suite registry: which module builds which suite. Backends are imported only when used, so a
MetaWorld user never imports LIBERO (an optional extra)."""

from __future__ import annotations

import importlib

from wamkit.config import ConfigError, EnvConfig, _suggest
from wamkit.envs.base import Env, SuiteInfo, check_env_config

LIBERO_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
_BACKENDS = {"metaworld": "wamkit.envs.metaworld_env", **{s: "wamkit.envs.libero_env" for s in LIBERO_SUITES}}


def suites() -> list[str]:
    return list(_BACKENDS)


def _backend(suite: str):
    if suite not in _BACKENDS:
        raise ConfigError(
            f"env.suite: unknown suite '{suite}'{_suggest(suite, _BACKENDS)} (valid: {', '.join(_BACKENDS)})"
        )
    return importlib.import_module(_BACKENDS[suite])


def suite_info(suite: str) -> SuiteInfo:
    """Tasks, max steps, state / action dims, fps and cameras of ``suite``."""
    mod = _backend(suite)
    return mod.suite_info(suite) if suite in LIBERO_SUITES else mod.suite_info()


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """The suite's task names for ``tasks`` (groups such as ``MT10`` expanded); errors name env.tasks."""
    mod = _backend(suite)
    return mod.expand_tasks(suite, tasks) if suite in LIBERO_SUITES else mod.expand_tasks(tasks)


def make_env(env_cfg: EnvConfig) -> Env:
    """Build one env of ``env_cfg.suite``. Creates no GL context (that happens on the first render)."""
    check_env_config(env_cfg)
    mod = _backend(env_cfg.suite)
    return mod.make(env_cfg) if env_cfg.suite in LIBERO_SUITES else mod.MetaWorldEnv(env_cfg)
