"""MetaWorld backend (the default suite): 50 Sawyer tasks, each with a scripted expert.

Conventions (what datasets written by ``wamkit collect`` hold):

- state: MetaWorld's full 39-D observation, float32: hand xyz (3), gripper opening (1), object 1
  pos + quat (7), object 2 pos + quat (7), the same 18 numbers of the previous step, goal xyz (3).
  The goal is observable: without it a policy cannot tell where to reach or push.
- action: 4-D ``[dx, dy, dz, gripper]`` in [-1, 1]; xyz moves the mocap target by 1 cm per unit;
  gripper -1 = open, +1 = close (MetaWorld's grab effort).
- fps: 80, MetaWorld's control rate (frame_skip 5 x 2.5 ms timestep; its ``render_fps``).
- episode: ``seed`` seeds the object and goal placement (``trial`` is only a label); the same spec
  gives the same initial state, bit for bit. ``terminated`` is True on the first successful step
  (MetaWorld itself never terminates); ``truncated`` at ``max_steps`` (500, MetaWorld's limit).
- task names: MetaWorld's (``reach-v3``), or the benchmark groups ``MT10`` / ``MT50`` (expanded).
"""

from __future__ import annotations

import warnings
from typing import Any

import mujoco
import numpy as np

from wamkit.config import ConfigError, EnvConfig, _suggest
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.embodiments.metaworld import PROFILE
from wamkit.envs.base import EpisodeSpec, Obs, StepResult, SuiteInfo
from wamkit.envs.render import CameraRenderer

SUITE = "metaworld"
MAX_STEPS = PROFILE.suites[SUITE]
FPS = PROFILE.fps
STATE_DIM = PROFILE.state_dim
ACTION_DIM = PROFILE.action_dim
PROTOCOL = PROFILE.protocol
STATE_NAMES = PROFILE.state_names
AXIS_ANGLE_DIMS: tuple[int, ...] = PROFILE.axis_angle_dims
ACTION_NAMES = PROFILE.action_names
STATE_SOURCE = PROFILE.state_source


def finger_width(states: np.ndarray) -> np.ndarray:
    """The gripper opening of 39-D MetaWorld states (state[3], grows as the fingers open)."""
    return states[..., 3]


CAMERAS = tuple(PROFILE.cameras)

MT10 = (
    "reach-v3",
    "push-v3",
    "pick-place-v3",
    "door-open-v3",
    "drawer-open-v3",
    "drawer-close-v3",
    "button-press-topdown-v3",
    "peg-insert-side-v3",
    "window-open-v3",
    "window-close-v3",
)

# One short instruction per task (the MetaWorld paper's task descriptions, shortened).
INSTRUCTIONS = {
    "assembly-v3": "pick up the nut and place it onto the peg",
    "basketball-v3": "dunk the basketball into the basket",
    "bin-picking-v3": "grasp the puck from one bin and place it into the other bin",
    "box-close-v3": "grasp the cover and close the box with it",
    "button-press-topdown-v3": "press the button from the top",
    "button-press-topdown-wall-v3": "press the button from the top, past the wall",
    "button-press-v3": "press the button",
    "button-press-wall-v3": "press the button behind the wall",
    "coffee-button-v3": "push the button on the coffee machine",
    "coffee-pull-v3": "pull the mug from the coffee machine",
    "coffee-push-v3": "push the mug under the coffee machine",
    "dial-turn-v3": "rotate the dial 180 degrees",
    "disassemble-v3": "pick the nut off the peg",
    "door-close-v3": "close the door",
    "door-lock-v3": "lock the door by turning the lock",
    "door-open-v3": "open the door",
    "door-unlock-v3": "unlock the door by turning the lock",
    "hand-insert-v3": "insert the gripper into the hole",
    "drawer-close-v3": "push the drawer closed",
    "drawer-open-v3": "open the drawer",
    "faucet-open-v3": "rotate the faucet counter-clockwise",
    "faucet-close-v3": "rotate the faucet clockwise",
    "hammer-v3": "hammer the nail into the wall",
    "handle-press-side-v3": "press the handle down sideways",
    "handle-press-v3": "press the handle down",
    "handle-pull-side-v3": "pull the handle up sideways",
    "handle-pull-v3": "pull the handle up",
    "lever-pull-v3": "pull the lever up",
    "pick-place-wall-v3": "pick up the puck and place it at the goal behind the wall",
    "pick-out-of-hole-v3": "pick the puck out of the hole",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "plate-slide-v3": "slide the plate into the cabinet",
    "plate-slide-side-v3": "slide the plate sideways into the cabinet",
    "plate-slide-back-v3": "slide the plate back out of the cabinet",
    "plate-slide-back-side-v3": "slide the plate sideways out of the cabinet",
    "peg-insert-side-v3": "insert the peg sideways into the hole",
    "peg-unplug-side-v3": "unplug the peg sideways",
    "soccer-v3": "kick the ball into the goal",
    "stick-push-v3": "grasp the stick and push the box with it",
    "stick-pull-v3": "grasp the stick and pull the box with it",
    "push-v3": "push the puck to the goal",
    "push-wall-v3": "push the puck to the goal past the wall",
    "push-back-v3": "push the puck back to the goal",
    "reach-v3": "reach the goal",
    "reach-wall-v3": "reach the goal past the wall",
    "shelf-place-v3": "pick up the puck and place it on the shelf",
    "sweep-into-v3": "sweep the puck into the hole",
    "sweep-v3": "sweep the puck off the table",
    "window-open-v3": "push the window open",
    "window-close-v3": "push the window closed",
}
TASKS = tuple(INSTRUCTIONS)


def suite_info(suite: str = SUITE) -> SuiteInfo:
    return SuiteInfo(
        SUITE, TASKS, MAX_STEPS, STATE_DIM, ACTION_DIM, FPS, PROFILE.default_cameras, PROFILE.robot_type
    )


def task_texts(suite: str = SUITE) -> dict[str, str]:
    """Task name -> the instruction the env reports (what ``wamkit collect`` stores as the task)."""
    return dict(INSTRUCTIONS)


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """Task names with ``MT10`` / ``MT50`` expanded; unknown names raise naming ``env.tasks``."""
    out: list[str] = []
    for t in tasks:
        group = {"MT10": MT10, "MT50": TASKS}.get(t.upper())
        if group is None and t not in INSTRUCTIONS:
            raise ConfigError(
                f"env.tasks: unknown MetaWorld task '{t}'{_suggest(t, TASKS)} (or use MT10 / MT50)"
            )
        out.extend(group or [t])
    return list(dict.fromkeys(out))


class _TaskSim:
    """One MetaWorld task's simulator, goal observable, seeded per episode, and its renderer."""

    def __init__(self, task: str, cfg: EnvConfig) -> None:
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS
        from metaworld.policies import ENV_POLICY_MAP

        env = ALL_V3_ENVIRONMENTS[task]()  # render_mode None: no GL context here
        env._partially_observable = False  # the 39-D observation carries the goal
        del env.sawyer_observation_space  # a cached property that depends on observability
        env._set_task_called = True
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True  # placement drawn from env.np_random, which reset() seeds
        env.max_path_length = 10**9  # our own max_steps decides truncation
        self.env = env
        self.expert = ENV_POLICY_MAP[task]()
        self.renderer = CameraRenderer(env.model, list(cfg.cameras), cfg.image_size, cfg.render_quality)

    def close(self) -> None:
        self.renderer.close()
        self.env.close()


class MetaWorldEnv:
    """All 50 MetaWorld tasks behind the :class:`~wamkit.envs.base.Env` interface.

    A task's simulator is built on first use and kept, so one instance serves episodes of any task.
    """

    suite = SUITE

    def __init__(self, cfg: EnvConfig) -> None:
        from wamkit.envs.suites import check_env_start

        check_env_start(cfg, "MetaWorldEnv", CAMERAS, "MetaWorld")
        self.cfg = cfg
        # env.state: the dims of MetaWorld's observation the state keeps (the expert reads all of them)
        self._state_dims = list(PROFILE.state_dims(cfg.state))
        self._sims: dict[str, _TaskSim] = {}
        self._sim: _TaskSim | None = None
        self._spec: EpisodeSpec | None = None
        self._steps = 0
        self._raw: np.ndarray | None = None

    def max_steps(self, spec: EpisodeSpec) -> int:
        return self.cfg.max_steps or MAX_STEPS

    def _obs(self) -> Obs:
        assert self._sim is not None and self._spec is not None and self._raw is not None
        obs: Obs = {image_key(c): img for c, img in self._sim.renderer.render(self._sim.env.data).items()}
        obs[OBS_STATE] = self._raw[self._state_dims].astype(np.float32)
        obs[TASK] = INSTRUCTIONS[self._spec.task]
        return obs

    def reset(self, spec: EpisodeSpec) -> Obs:
        if spec.suite != SUITE:
            raise ValueError(f"episode {spec}: suite '{spec.suite}' given to the {SUITE} env")
        if spec.task not in INSTRUCTIONS:
            expand_tasks(SUITE, [spec.task])  # raises with a suggestion
        if spec.task not in self._sims:
            self._sims[spec.task] = _TaskSim(spec.task, self.cfg)
        self._sim, self._spec, self._steps = self._sims[spec.task], spec, 0
        self._sim.env.seed(spec.seed)
        self._raw, _ = self._sim.env.reset()
        # MetaWorld's reset moves the goal marker (model.site_pos) after its last mj_forward, so the
        # derived positions the renderer reads, and thus the first frame, would still show where this
        # env's previous episode left it: an episode would depend on what ran before it. mj_forward
        # recomputes only derived quantities (no qpos/qvel/act change), so the state is untouched.
        mujoco.mj_forward(self._sim.env.model, self._sim.env.data)
        return self._obs()

    def step(self, action: np.ndarray) -> StepResult:
        if self._sim is None:
            raise RuntimeError("step() before reset(): call reset(spec) first")
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (ACTION_DIM,):
            raise ValueError(
                f"action: expected shape [{ACTION_DIM}] ([dx, dy, dz, gripper]), got {list(action.shape)}"
            )
        raw, reward, _, _, info = self._sim.env.step(np.clip(action, -1.0, 1.0))
        self._raw, self._steps = raw, self._steps + 1
        success = bool(info.get("success", 0.0) > 0.5)
        out_info: dict[str, Any] = {"success": success, "steps": self._steps}
        truncated = self._steps >= self.max_steps(self._spec) and not success
        return self._obs(), float(reward), success, truncated, out_info

    def expert_action(self, obs: Obs) -> np.ndarray:
        """MetaWorld's scripted policy for the current task, float32 [4] in [-1, 1]. It reads the whole
        observation (objects and goal), whatever ``env.state`` gives the policy: ``obs`` must be the
        last observation of this env."""
        if self._sim is None:
            raise RuntimeError("expert_action() before reset()")
        with warnings.catch_warnings():
            # the shipped experts use gains that saturate; MetaWorld warns on every call
            warnings.simplefilter("ignore", UserWarning)
            a = self._sim.expert.get_action(np.asarray(self._raw, dtype=np.float64))
        return np.clip(np.asarray(a, dtype=np.float32), -1.0, 1.0)

    def gl_info(self) -> dict[str, str]:
        """The GL context's vendor/renderer/version strings ({} before the first render)."""
        return dict(self._sim.renderer.gl_info) if self._sim is not None else {}

    def close(self) -> None:
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()
        self._sim = None


def make(cfg: EnvConfig) -> MetaWorldEnv:
    return MetaWorldEnv(cfg)
