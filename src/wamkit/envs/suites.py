"""Which module builds which suite: every registered embodiment's suites (``wamkit.embodiments``), to
its env backend. Backends are imported only when used, so a user of one simulator never imports another's
(an optional extra); an embodiment registered later (a plug-in, a test's toy) is seen at once."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import replace

from wamkit import embodiments
from wamkit.config import ConfigError, EnvConfig, _suggest
from wamkit.envs.base import Env, ResolvedEnv, SuiteInfo, SuiteProtocol, check_env_config


def suites() -> list[str]:
    return list(embodiments.suites())


def _backend(suite: str):
    known = {s: e.env_backend for s, e in embodiments.suites().items()}
    if suite not in known:
        raise ConfigError(
            f"env.suite: unknown suite '{suite}'{_suggest(suite, known)} (valid: {', '.join(known)})"
        )
    return importlib.import_module(known[suite])


def backend(suite: str):
    """The backend module of ``suite``: ``suite_info``, ``expand_tasks``, ``make``, ``finger_width`` and
    what else it offers (``task_categories``, ``worker_python``, ``site_paths``); its conventions as data
    are its embodiment's profile (``wamkit.embodiments``)."""
    return _backend(suite)


def suite_info(suite: str, state: str = "full") -> SuiteInfo:
    """Tasks, max steps, state / action dims, fps and cameras of ``suite``; the state dim is that of
    ``env.state`` (``full``: the suite's whole state, ``proprio``: the robot's own part)."""
    info = _backend(suite).suite_info(suite)
    dims = embodiments.for_suite(suite).state_dims(state)
    return info if len(dims) == info.state_dim else replace(info, state_dim=len(dims))


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """The suite's task names for ``tasks`` (groups such as ``MT10`` expanded); errors name env.tasks."""
    mod = _backend(suite)
    return mod.expand_tasks(suite, tasks)


def task_categories(suite: str) -> dict[str, str]:
    """Task name -> its category, where the suite's own metadata groups its tasks (a robustness suite's
    perturbations); ``{}`` for a suite that has none."""
    fn = getattr(_backend(suite), "task_categories", None)
    return dict(fn(suite)) if fn is not None else {}


def protocol(suite: str) -> SuiteProtocol:
    """The suite's protocol defaults (render look, seed rule, trials per task): its profile's."""
    _backend(suite)  # an unknown suite is refused by name
    return embodiments.for_suite(suite).protocol


def fill_suite_defaults(env_cfg: EnvConfig) -> None:
    """Give ``env_cfg`` its suite's default cameras and tasks (all of them) where it still holds
    :class:`EnvConfig`'s own defaults, which are MetaWorld's (``corner``, ``reach-v3``); in place."""
    if env_cfg.suite == "metaworld":
        return
    info = suite_info(env_cfg.suite)
    if env_cfg.cameras == EnvConfig().cameras:
        env_cfg.cameras = list(info.cameras)
    if env_cfg.tasks == EnvConfig().tasks:
        env_cfg.tasks = list(info.tasks)


def unresolved(env_cfg: EnvConfig) -> list[str]:
    """The ``env.*`` settings of ``env_cfg`` still ``auto``."""
    return [f"env.{k}" for k in ("render_quality", "seed_rule") if getattr(env_cfg, k) == "auto"]


def require_resolved(env_cfg: EnvConfig, where: str) -> None:
    """Refuse an env config whose ``auto`` settings were not resolved (an env backend's constructor
    takes what :func:`make_env` resolved; it does not resolve them again)."""
    left = unresolved(env_cfg)
    if left:
        raise ConfigError(
            f"{where}: {', '.join(left)} still 'auto'; build envs with wamkit.envs.make_env (or resolve "
            "the config with resolve_env_config first)"
        )


def check_env_start(cfg: EnvConfig, where: str, cameras, simulator: str) -> None:
    """What every backend's env checks as it is built: a config resolved where the run started, and
    cameras its simulator has (a :class:`ConfigError` naming ``env.cameras`` and the valid ones)."""
    require_resolved(cfg, where)
    unknown = [c for c in cfg.cameras if c not in cameras]
    if unknown:
        names = ", ".join(f"'{c}'" for c in unknown)
        raise ConfigError(
            f"env.cameras: unknown {simulator} camera{'s' if len(unknown) > 1 else ''} {names}"
            f"{_suggest(unknown[0], cameras)} (valid: {', '.join(cameras)})"
        )


def resolve_env_config(env_cfg: EnvConfig) -> ResolvedEnv:
    """``env_cfg`` with ``auto`` values replaced by the suite's protocol, as a :class:`ResolvedEnv` (a
    copy; a config already resolved comes back as it is, so a run resolves its config once, at its
    start); a seed rule the suite cannot honour raises :class:`ConfigError` naming ``env.seed_rule``."""
    if isinstance(env_cfg, ResolvedEnv):
        return env_cfg
    check_env_config(env_cfg)
    if env_cfg.control_mode != "auto":
        check = getattr(_backend(env_cfg.suite), "check_control_mode", None)
        if check is None:
            raise ConfigError(
                f"env.control_mode: {env_cfg.control_mode!r}: {env_cfg.suite} acts in one control mode, its "
                "profile's actions; leave env.control_mode=auto"
            )
        check(env_cfg.control_mode)
    proto = protocol(env_cfg.suite)
    quality = proto.render_quality if env_cfg.render_quality == "auto" else env_cfg.render_quality
    rule = proto.seed_rule if env_cfg.seed_rule == "auto" else env_cfg.seed_rule
    if rule != "per_trial" and not embodiments.for_suite(env_cfg.suite).stored_initial_states:
        raise ConfigError(
            f"env.seed_rule: {rule} seeds a task once and relies on stored initial states; "
            f"{env_cfg.suite} draws each episode's placement from its seed: use per_trial"
        )
    fields = {f.name: getattr(env_cfg, f.name) for f in dataclasses.fields(env_cfg)}
    return ResolvedEnv(**{**fields, "render_quality": quality, "seed_rule": rule})


def batch_backend(suite: str):
    """The module of ``suite``'s batched simulator (its backend's ``BATCH_BACKEND``: ``make_batch``,
    ``check_batch``), imported; a :class:`ConfigError` for a suite without one."""
    name = getattr(_backend(suite), "BATCH_BACKEND", None)
    if name is None:
        with_one = [n for n in embodiments.suites() if getattr(_backend(n), "BATCH_BACKEND", None)]
        raise ConfigError(
            f"eval.executor=gpu: suite '{suite}' has no GPU simulator (suites with one: {', '.join(with_one)}); "
            "use eval.executor=local"
        )
    return importlib.import_module(name)


def make_env(env_cfg: EnvConfig) -> Env:
    """Build one env of ``env_cfg.suite`` (``auto`` settings resolved by the suite's protocol). Creates
    no GL context (that happens on the first render)."""
    env_cfg = resolve_env_config(env_cfg)
    mod = _backend(env_cfg.suite)
    apart = getattr(mod, "worker_python", lambda: None)()
    if apart is not None:  # its simulator lives in another Python
        raise ConfigError(
            f"env.suite={env_cfg.suite}: its simulator runs only in env workers started with {apart}; "
            "this command builds its env in its own process, which cannot import it"
        )
    return mod.make(env_cfg)
