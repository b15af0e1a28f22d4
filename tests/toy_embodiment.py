"""A toy embodiment and its env backend (what a profile module and a module under wamkit.envs would
hold), registered by tests/test_embodiments.py at test time."""

from __future__ import annotations

import numpy as np

from wamkit import embodiments
from wamkit.config import EnvConfig
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.envs.base import EpisodeSpec, SuiteInfo

PROFILE = embodiments.Embodiment(
    name="toy",
    env_backend=__name__,
    suites={"toy_line": 12},
    robot_type="point",
    fps=10,
    cameras={"top": "top"},
    default_cameras=("top",),
    state_names=("x",),
    state_source="the point's position",
    axis_angle_dims=(),
    action_names=("dx",),
    gripper="none",
    protocol=embodiments.SuiteProtocol(render_quality="fast", seed_rule="per_trial", trials=3),
    request_images=("toy/top_camera",),  # its (imagined) reference client's keys
    request_state="toy/position",
)


def suite_info(suite: str) -> SuiteInfo:
    p = PROFILE
    return SuiteInfo(suite, ("reach",), p.suites[suite], p.state_dim, p.action_dim, p.fps, p.default_cameras,
                     p.robot_type)  # fmt: skip


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    return ["reach"]


class ToyEnv:
    """A point on a line, to be moved to x = 1."""

    def __init__(self, cfg: EnvConfig):
        self.suite, self.cfg, self.x = cfg.suite, cfg, 0.0

    def _obs(self):
        img = np.zeros((self.cfg.image_size, self.cfg.image_size, 3), np.uint8)
        return {image_key("top"): img, OBS_STATE: np.array([self.x], np.float32), TASK: "reach 1"}

    def reset(self, spec: EpisodeSpec):
        self.x = float(np.random.default_rng(spec.seed).uniform(-1, 0))
        return self._obs()

    def step(self, action):
        self.x += float(action[0])
        done = abs(self.x - 1.0) < 0.05
        return self._obs(), float(done), done, False, {"success": done}

    def max_steps(self, spec):
        return PROFILE.suites[spec.suite]

    def close(self):
        pass


def make(cfg: EnvConfig) -> ToyEnv:
    return ToyEnv(cfg)
