"""wamkit's simulated envs as a LeRobot env type, so that LeRobot's own evaluator runs on them.

LeRobot's env configs take plug-ins (``--env.discover_packages_path``, ``lerobot/configs/parser.py``):
importing this package registers the env type ``wamkit``, which builds wamkit's env (the same camera,
image size, look, state and horizon a wamkit run uses) behind Gymnasium's interface as LeRobot's own
MetaWorld env presents it (``lerobot/envs/metaworld.py``). ``lerobot-eval`` and ``wamkit eval`` then
evaluate one checkpoint on one env::

    lerobot-eval --policy.path=FOLDER --env.type=wamkit --env.discover_packages_path=wamkit.envs.lerobot_plugin \\
        --env.config=configs/demo.yaml --env.task=door-open-v3 --eval.n_episodes=30 --eval.batch_size=10

- ``--env.config``: a wamkit preset or YAML; its ``env`` section builds the env and its ``eval.seed``
  numbers the trials (LeRobot seeds episode i of a task ``--seed`` + i; under ``env.seed_rule=per_trial``
  wamkit seeds trial t ``eval.seed`` + t, so with ``--seed`` = ``eval.seed`` the two run the same
  episodes). ``--env.task``: tasks separated by commas (default: the config's ``env.tasks``).
- Observations are LeRobot's env convention: ``pixels`` a dict camera → uint8 [H, W, 3] (LeRobot's
  ``preprocess_observation`` makes them ``observation.images.<camera>``), ``agent_pos`` the state.
- ``info["is_success"]`` on every step; ``terminated`` on the first successful step and ``truncated`` at
  the horizon, as wamkit's env says. Several envs run as LeRobot runs its own MetaWorld envs: one
  vector env per task, created lazily, each env frozen once its episode ends
  (``lerobot.envs.utils._LazyAsyncVectorEnv``); one env runs in process.

It needs LeRobot (``make setup-lerobot``); ``wamkit bench lerobot-eval`` uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from lerobot.configs.types import FeatureType, PolicyFeature
from lerobot.envs.configs import EnvConfig

from wamkit.config import ConfigError, RunConfig, load_config
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.envs.base import EpisodeSpec, use_headless_gl
from wamkit.envs.suites import expand_tasks, make_env, resolve_env_config, suite_info

ENV_TYPE = "wamkit"

use_headless_gl()  # env workers import this module before MuJoCo: render offscreen there too


def _load(config: str) -> RunConfig:
    if not config:
        raise ConfigError("--env.config: name a wamkit preset or YAML file (its env section builds the env)")
    return load_config(config)


class WamkitTaskEnv(gym.Env):
    """One task of a wamkit suite behind Gymnasium's interface, observations as LeRobot's envs give them."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, config: str, task: str) -> None:
        super().__init__()
        run = _load(config)
        self.cfg = resolve_env_config(run.env)
        self.base_seed = run.eval.seed
        info = suite_info(self.cfg.suite, self.cfg.state)
        self.metadata = {**self.metadata, "render_fps": info.fps}
        self.task = task
        self.task_description = ""  # the instruction, known once an episode is reset
        self._env = make_env(self.cfg)  # no simulator and no GL context until the first reset
        self._max_episode_steps = self._env.max_steps(EpisodeSpec(self.cfg.suite, task, 0, self.base_seed))
        size = (self.cfg.image_size, self.cfg.image_size, 3)
        self.observation_space = spaces.Dict(
            {
                "pixels": spaces.Dict(
                    {c: spaces.Box(0, 255, shape=size, dtype=np.uint8) for c in self.cfg.cameras}
                ),
                "agent_pos": spaces.Box(-np.inf, np.inf, shape=(info.state_dim,), dtype=np.float32),
            }
        )
        self.action_space = spaces.Box(-1.0, 1.0, shape=(info.action_dim,), dtype=np.float32)
        self._seed: int | None = None
        self._frame: np.ndarray | None = None

    def _convert(self, obs: dict[str, Any]) -> dict[str, Any]:
        pixels = {c: obs[image_key(c)] for c in self.cfg.cameras}
        self._frame = pixels[self.cfg.cameras[0]]
        self.task_description = obs.get(TASK, self.task_description)
        return {"pixels": pixels, "agent_pos": np.asarray(obs[OBS_STATE], dtype=np.float32)}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        if seed is None:  # an unseeded reset repeats the last episode (wamkit's episodes are named by seed)
            seed = self.base_seed if self._seed is None else self._seed
        self._seed = int(seed)
        trial = max(self._seed - self.base_seed, 0)
        obs = self._env.reset(EpisodeSpec(self.cfg.suite, self.task, trial, self._seed))
        return self._convert(obs), {"is_success": False, "task": self.task}

    def step(self, action: np.ndarray):
        obs, reward, terminated, truncated, info = self._env.step(np.asarray(action, dtype=np.float32))
        out = {"is_success": bool(info.get("success", False)), "task": self.task}
        return self._convert(obs), float(reward), bool(terminated), bool(truncated), out

    def render(self) -> np.ndarray | None:
        """The last observation's first camera (what ``lerobot-eval``'s videos show)."""
        return self._frame

    def close(self) -> None:
        self._env.close()


def _make(config: str, task: str) -> WamkitTaskEnv:
    return WamkitTaskEnv(config, task)


@EnvConfig.register_subclass(ENV_TYPE)
@dataclass
class LeRobotPluginEnvConfig(EnvConfig):
    """``--env.type=wamkit``: ``config`` a wamkit preset or YAML, ``task`` its tasks (commas)."""

    task: str | None = None
    config: str = "demo"
    fps: int = 30
    features: dict[str, PolicyFeature] = field(default_factory=dict)
    features_map: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        run = _load(self.config)
        env = resolve_env_config(run.env)
        info = suite_info(env.suite, env.state)
        self.tasks = (
            expand_tasks(env.suite, [t.strip() for t in self.task.split(",") if t.strip()])
            if self.task
            else list(env.tasks)
        )
        self.fps = info.fps
        size = (env.image_size, env.image_size, 3)
        self.features = {
            "action": PolicyFeature(type=FeatureType.ACTION, shape=(info.action_dim,)),
            "agent_pos": PolicyFeature(type=FeatureType.STATE, shape=(info.state_dim,)),
            **{f"pixels/{c}": PolicyFeature(type=FeatureType.VISUAL, shape=size) for c in env.cameras},
        }
        self.features_map = {
            "action": "action",
            "agent_pos": OBS_STATE,
            **{f"pixels/{c}": image_key(c) for c in env.cameras},
        }

    @property
    def gym_kwargs(self) -> dict:
        return {"config": self.config}

    def create_envs(self, n_envs: int, use_async_envs: bool = False):
        from lerobot.envs.utils import _LazyAsyncVectorEnv

        if n_envs < 1:
            raise ValueError(f"n_envs must be at least 1, got {n_envs}")
        out: dict[str, dict[int, Any]] = {}
        spaces_of: tuple | None = None
        for task in self.tasks:
            fns = [partial(_make, self.config, task) for _ in range(n_envs)]
            if use_async_envs and n_envs > 1:
                vec = _LazyAsyncVectorEnv(fns, *(spaces_of or (None, None, None)))
                spaces_of = spaces_of or (vec.observation_space, vec.action_space, vec.metadata)
            else:
                vec = gym.vector.SyncVectorEnv(fns)
            out[task] = {0: vec}
        return out
