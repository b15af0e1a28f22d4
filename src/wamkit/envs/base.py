"""The env interface shared by every simulated suite.

An episode is named by :class:`EpisodeSpec` ``(suite, task, trial, seed)`` and is reproducible from
that name alone. Observations use the dataset key names (:mod:`wamkit.constants`):

- ``observation.images.<cam>``: uint8 [H, W, 3], upright (row 0 is the top of the picture);
- ``observation.state``: float32 [state_dim];
- ``task``: the English instruction of the task.

``step(action)`` takes an env-ready float action [action_dim] and returns
``(obs, reward, terminated, truncated, info)`` with ``info["success"]`` a bool.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from wamkit.config import ConfigError, EnvConfig
from wamkit.embodiments import SuiteProtocol  # noqa: F401  (re-exported: the protocol type)
from wamkit.versions import installed_versions  # noqa: F401  (re-exported)

RENDER_QUALITIES = ("default", "fast")
STATES = ("full", "proprio")  # env.state
# Seed rules (docs/eval.md): the base seed of the rules that seed a task's env once and reset it for
# trials 0, 1, 2, ... in order (openpi's clients seed 7, OpenVLA's 0); ``per_trial`` seeds trial
# t with ``eval.seed + t`` right before its reset.
SEQUENTIAL_SEEDS = {"openpi": 7, "openvla": 0}
SEED_RULES = (*SEQUENTIAL_SEEDS, "per_trial")

Obs = dict[str, Any]
StepResult = tuple[Obs, float, bool, bool, dict[str, Any]]


@dataclass
class ResolvedEnv(EnvConfig):
    """An env config with its ``auto`` settings resolved by the suite's protocol: what
    :func:`wamkit.envs.suites.resolve_env_config` returns, once, where a run starts (evaluation,
    collection, ``wamkit check``), and what the stages below it take (they resolve nothing again)."""

    def __post_init__(self) -> None:
        left = [f"env.{k}" for k in ("render_quality", "seed_rule") if getattr(self, k) == "auto"]
        if left:
            raise ConfigError(f"{', '.join(left)} still 'auto' in a resolved env config")


def resolved(cfg: EnvConfig, where: str) -> ResolvedEnv:
    """``cfg`` if it is resolved; else a ``TypeError`` that says who should have resolved it."""
    if not isinstance(cfg, ResolvedEnv):
        raise TypeError(
            f"{where} takes an env config resolved where the run starts "
            "(wamkit.envs.suites.resolve_env_config), not a plain EnvConfig"
        )
    return cfg


@dataclass(frozen=True)
class EpisodeSpec:
    """The name of one episode. ``trial`` indexes a stored initial state where the suite has them;
    ``seed`` seeds every random draw of the episode (MetaWorld's object and goal positions)."""

    suite: str
    task: str
    trial: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EpisodeSpec:
        missing = [k for k in ("suite", "task", "trial", "seed") if k not in d]
        if missing:
            raise ValueError(f"EpisodeSpec: missing key(s) {missing} in {d!r}")
        return cls(suite=str(d["suite"]), task=str(d["task"]), trial=int(d["trial"]), seed=int(d["seed"]))


@dataclass(frozen=True)
class SuiteInfo:
    """What a suite offers. ``max_steps`` counts policy steps (a suite's settle steps excluded);
    ``fps`` is the control rate recorded in datasets (env steps per simulated second)."""

    suite: str
    tasks: tuple[str, ...]
    max_steps: int
    state_dim: int
    action_dim: int
    fps: int
    cameras: tuple[str, ...]  # the default cameras (what collect records unless told otherwise)
    robot_type: str

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tasks"], d["cameras"] = list(self.tasks), list(self.cameras)
        return d


def episode_seed(seed_rule: str, base_seed: int, trial: int) -> int:
    """The seed of trial ``trial``: the rule's fixed seed (``openpi`` 7, ``openvla`` 0: every trial of
    a task carries it, the trial index says how many resets came before), or ``base_seed + trial``."""
    if seed_rule in SEQUENTIAL_SEEDS:
        return SEQUENTIAL_SEEDS[seed_rule]
    if seed_rule == "per_trial":
        return base_seed + trial
    raise ConfigError(f"env.seed_rule: {seed_rule!r} is not one of {SEED_RULES} (resolve 'auto' first)")


def stack_versions(packages: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """Installed versions of the simulator stack (None: not installed) and the GL backend: a change of
    any of them can change what an episode looks like (see the drift pins). ``packages``: these
    distributions only (one embodiment's ``packages``); None: every registered embodiment's."""
    import sys

    from wamkit import embodiments

    # a backend that installs its simulator apart from sys.path says where (``site_paths()``)
    backends = [sys.modules.get(embodiments.get(n).env_backend) for n in embodiments.names()]
    paths = [p for m in backends if m is not None and hasattr(m, "site_paths") for p in m.site_paths()]
    versions = installed_versions(embodiments.stack_packages() if packages is None else packages, paths)
    return {**versions, "MUJOCO_GL": os.environ.get("MUJOCO_GL")}


@runtime_checkable
class Env(Protocol):
    """One simulator instance; ``reset`` may switch it to any task of its suite."""

    suite: str

    def reset(self, spec: EpisodeSpec) -> Obs: ...

    def step(self, action: np.ndarray) -> StepResult: ...

    def max_steps(self, spec: EpisodeSpec) -> int: ...

    def expert_action(self, obs: Obs) -> np.ndarray:
        """The scripted expert's action for ``obs`` of the current episode (suites that have one)."""
        ...

    def close(self) -> None: ...


def check_env_config(cfg: EnvConfig) -> None:
    """Raise :class:`ConfigError` naming the ``env.*`` key that is out of range."""
    if cfg.render_quality not in ("auto", *RENDER_QUALITIES):
        raise ConfigError(
            f"env.render_quality: {cfg.render_quality!r} is not one of {('auto', *RENDER_QUALITIES)}"
        )
    if cfg.seed_rule not in ("auto", *SEED_RULES):
        raise ConfigError(f"env.seed_rule: {cfg.seed_rule!r} is not one of {('auto', *SEED_RULES)}")
    if cfg.image_size < 8 or cfg.image_size > 2048:
        raise ConfigError(f"env.image_size: expected 8..2048 pixels, got {cfg.image_size}")
    if not cfg.cameras:
        raise ConfigError("env.cameras: at least one camera is needed")
    if cfg.max_steps < 0:
        raise ConfigError(f"env.max_steps: expected >= 0 (0: the suite's limit), got {cfg.max_steps}")
    if cfg.state not in STATES:
        raise ConfigError(f"env.state: {cfg.state!r} is not one of {', '.join(STATES)}")
    if cfg.render_gpu < -1:
        raise ConfigError(
            f"env.render_gpu: expected -1 (EGL's choice) or a GPU index >= 0, got {cfg.render_gpu}"
        )
    if cfg.render_gpu >= 0 and os.environ.get("MUJOCO_GL", "egl") != "egl":
        raise ConfigError(
            f"env.render_gpu: {cfg.render_gpu} picks an EGL device, but MUJOCO_GL is "
            f"{os.environ['MUJOCO_GL']!r}; unset it or set MUJOCO_GL=egl"
        )


def render_environ(render_gpu: int) -> dict[str, str]:
    """The environment variables an env worker needs before it imports MuJoCo, for ``env.render_gpu``:
    EGL (unless ``MUJOCO_GL`` says otherwise) and, for a GPU index, ``MUJOCO_EGL_DEVICE_ID``, which both
    MuJoCo's and robosuite's EGL contexts read (robosuite falls back to ``CUDA_VISIBLE_DEVICES``, so a
    worker started from a process restricted to one CUDA device would otherwise render on that one)."""
    env = {"MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    if env["MUJOCO_GL"] == "egl":
        env["PYOPENGL_PLATFORM"] = os.environ.get("PYOPENGL_PLATFORM", "egl")
    if render_gpu >= 0:
        env["MUJOCO_EGL_DEVICE_ID"] = str(render_gpu)
    return env


def use_headless_gl() -> None:
    """Render offscreen in this process as the env workers do: EGL, unless ``MUJOCO_GL`` names another
    platform. MuJoCo and PyOpenGL read these variables when they are first imported, so every command
    calls this before importing them (``wamkit.cli``); a shell with no display then renders too."""
    for key, value in render_environ(-1).items():
        os.environ.setdefault(key, value)


def render_info(cfg: ResolvedEnv) -> dict[str, Any]:
    """What a dataset records about how its images were made (``extra_info`` of the writer), from a
    resolved config (``auto`` values are recorded as what they resolved to)."""
    cfg = resolved(cfg, "render_info")
    return {"suite": cfg.suite, "render_quality": cfg.render_quality, "cameras": list(cfg.cameras)}


def check_render_quality(dataset_info: dict[str, Any], env_cfg: ResolvedEnv) -> None:
    """Refuse to evaluate on images that look different from the training images.

    ``dataset_info`` is the dataset's ``meta/info.json`` (the writer keeps ``extra_info`` under
    ``"wamkit"``) or that ``extra_info`` itself. Raises ``ValueError`` naming both values when the
    dataset's ``render_quality`` differs from ``env_cfg.render_quality``; a dataset that does not record
    it (not made by ``wamkit collect``) passes.
    """
    extra = dataset_info.get("wamkit", dataset_info.get("extra_info", dataset_info))
    if not isinstance(extra, dict):
        raise ValueError(f"dataset info: 'wamkit' (extra_info) must be a mapping, got {type(extra).__name__}")
    recorded = extra.get("render_quality", dataset_info.get("render_quality"))
    if recorded is None:
        return
    env_cfg = resolved(env_cfg, "check_render_quality")
    if recorded != env_cfg.render_quality:
        raise ValueError(
            f"render quality mismatch: the dataset was rendered with render_quality={recorded!r} but "
            f"env.render_quality={env_cfg.render_quality!r}; a model trained on one look must be "
            f"evaluated on the same look (set env.render_quality={recorded})"
        )
