"""ALOHA backend (gym-aloha 0.1.5's scenes and tasks on dm-control; ``make test`` installs them).

Conventions (docs/aloha.md cites gym-aloha's file for each):

- tasks: ``transfer_cube`` and ``insertion``, gym-aloha's joint-space tasks (``tasks/sim.py``):
  their scene, reward and controls are gym-aloha's own classes, run through dm-control's
  ``control.Environment`` with gym-aloha's control step (``DT`` = 0.02 s);
- episode: ``seed`` places the objects by gym-aloha's own samplers (``sample_box_pose(seed)``,
  ``sample_insertion_pose(seed)``), as its ``AlohaEnv.reset(seed)`` does, so seed s is the same episode
  here, in gym-aloha and in LeRobot's evaluation; ``trial`` is only a label;
- state, float32 [14]: gym-aloha's ``qpos`` observation (``agent_pos``): per arm six joint angles and
  the normalised gripper position (0 closed, 1 open), left arm first;
- action, float [14]: joint-position targets in the same layout, grippers 0 = close, 1 = open;
- ``terminated`` = ``info["success"]`` = the reward reached the task's maximum (4), gym-aloha's
  ``is_success``; ``truncated`` at ``max_steps`` (400);
- images: ``top``, ``angle``, ``vis`` (``front_close``), rendered by wamkit's renderer from the same
  MuJoCo model and state as gym-aloha's ``physics.render``; gym-aloha frames them 640 x 480, wamkit
  renders that 4:3 frame at ``env.image_size`` rows and squeezes it to a square. The task's own
  observation (three 640 x 480 renders a step) is not made: only the cameras asked for are rendered.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wamkit.config import ConfigError, EnvConfig, _suggest
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.embodiments.aloha import PROFILE
from wamkit.envs.base import EpisodeSpec, Obs, StepResult, SuiteInfo

SUITE = "aloha"
MAX_STEPS = PROFILE.suites[SUITE]
FPS = PROFILE.fps
STATE_DIM = PROFILE.state_dim
ACTION_DIM = PROFILE.action_dim
PROTOCOL = PROFILE.protocol
STATE_NAMES = PROFILE.state_names
AXIS_ANGLE_DIMS: tuple[int, ...] = PROFILE.axis_angle_dims
ACTION_NAMES = PROFILE.action_names
STATE_SOURCE = PROFILE.state_source
CAMERAS = PROFILE.cameras
GRIPPERS = PROFILE.grippers

# one instruction per task (wamkit's words: gym-aloha's tasks carry none)
INSTRUCTIONS = {
    "transfer_cube": "pick up the cube with the right arm and hand it over to the left arm",
    "insertion": "pick up the peg and the socket and insert the peg into the socket",
}
TASKS = tuple(INSTRUCTIONS)


def finger_width(states: np.ndarray) -> np.ndarray:
    """The grippers' opening of 14-D ALOHA states: the mean of both normalised gripper positions
    (grows as the fingers open)."""
    return states[..., list(GRIPPERS)].mean(axis=-1)


def suite_info(suite: str = SUITE) -> SuiteInfo:
    return SuiteInfo(
        SUITE, TASKS, MAX_STEPS, STATE_DIM, ACTION_DIM, FPS, PROFILE.default_cameras, PROFILE.robot_type
    )


def task_texts(suite: str = SUITE) -> dict[str, str]:
    return dict(INSTRUCTIONS)


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """``tasks`` checked against ALOHA's two; an unknown name raises naming ``env.tasks`` and the valid ones."""
    for t in tasks:
        if t not in INSTRUCTIONS:
            raise ConfigError(
                f"env.tasks: unknown ALOHA task '{t}'{_suggest(t, TASKS)} (valid: {', '.join(TASKS)})"
            )
    return list(dict.fromkeys(tasks))


def object_poses(task: str, seed: int) -> np.ndarray:
    """The objects' starting poses of an episode seeded ``seed``, drawn by gym-aloha's own samplers:
    the cube's (x, y, z, qw, qx, qy, qz), or the peg's then the socket's (14 numbers)."""
    from gym_aloha.utils import sample_box_pose, sample_insertion_pose

    if task == "transfer_cube":
        return np.asarray(sample_box_pose(seed), np.float64)
    return np.concatenate(sample_insertion_pose(seed)).astype(np.float64)


def _joint_task(task: str):
    """gym-aloha's joint-space task of ``task``, making no observation of its own (wamkit's env reads
    the state and renders only the cameras asked for)."""
    from gym_aloha.tasks.sim import InsertionTask, TransferCubeTask

    base = TransferCubeTask if task == "transfer_cube" else InsertionTask

    class Task(base):
        def get_observation(self, physics):
            return {}

    return Task()


def joint_scene(task: str):
    """``(physics, task)`` of gym-aloha's joint-space scene of ``task``."""
    from dm_control import mujoco as dm_mujoco
    from gym_aloha.constants import ASSETS_DIR

    xml = ASSETS_DIR / f"bimanual_viperx_{task}.xml"
    return dm_mujoco.Physics.from_xml_path(str(xml)), _joint_task(task)


def end_effector_scene(task: str, objects: np.ndarray):
    """``(physics, task)`` of gym-aloha's mocap-driven end-effector scene of ``task`` with its objects
    placed at ``objects`` (gym-aloha's own end-effector tasks draw the poses from an unseeded generator;
    here they are the episode's)."""
    from dm_control import mujoco as dm_mujoco
    from gym_aloha.constants import ASSETS_DIR
    from gym_aloha.tasks.sim_end_effector import InsertionEndEffectorTask, TransferCubeEndEffectorTask

    base = TransferCubeEndEffectorTask if task == "transfer_cube" else InsertionEndEffectorTask
    poses = np.asarray(objects, np.float64)

    class Task(base):
        def initialize_episode(self, physics):
            self.initialize_robots(physics)
            physics.data.qpos[16 : 16 + len(poses)] = poses  # after the two arms' 16 joints
            # the base task's own start (dm-control's), past the parent's unseeded placement
            super(base, self).initialize_episode(physics)

        def get_observation(self, physics):
            return {}

    xml = ASSETS_DIR / f"bimanual_viperx_end_effector_{task}.xml"
    return dm_mujoco.Physics.from_xml_path(str(xml)), Task()


class _TaskSim:
    """One task's joint-space simulator (dm-control's environment over gym-aloha's task) and renderer."""

    def __init__(self, task: str, cfg: EnvConfig) -> None:
        from dm_control.rl import control
        from gym_aloha.constants import DT

        from wamkit.envs.render import CameraRenderer

        self.physics, self.task = joint_scene(task)
        self.env = control.Environment(
            self.physics, self.task, float("inf"), control_timestep=DT, flat_observation=False
        )
        cams = [CAMERAS[c] for c in cfg.cameras]
        self.renderer = CameraRenderer(
            self.physics.model.ptr, cams, cfg.image_size, cfg.render_quality, rotate_180=set(),
            aspect=PROFILE.camera_aspect,
        )  # fmt: skip
        self.names = dict(zip(cams, cfg.cameras))

    def close(self) -> None:
        self.renderer.close()
        self.physics.free()


class AlohaEnv:
    """gym-aloha's two bimanual tasks behind the :class:`~wamkit.envs.base.Env` interface."""

    suite = SUITE

    def __init__(self, cfg: EnvConfig) -> None:
        from wamkit.envs.suites import check_env_start

        check_env_start(cfg, "AlohaEnv", CAMERAS, "ALOHA")
        self.cfg = cfg
        self._sims: dict[str, _TaskSim] = {}
        self._sim: _TaskSim | None = None
        self._spec: EpisodeSpec | None = None
        self._steps = 0
        self._plan: np.ndarray | None = None  # the expert's joint targets of this episode

    def max_steps(self, spec: EpisodeSpec) -> int:
        return self.cfg.max_steps or MAX_STEPS

    def _obs(self) -> Obs:
        from gym_aloha.tasks.sim import BimanualViperXTask

        sim = self._sim
        assert sim is not None and self._spec is not None
        frames = sim.renderer.render(sim.physics.data.ptr)
        obs: Obs = {image_key(sim.names[c]): img for c, img in frames.items()}
        obs[OBS_STATE] = BimanualViperXTask.get_qpos(sim.physics).astype(np.float32)
        obs[TASK] = INSTRUCTIONS[self._spec.task]
        return obs

    def reset(self, spec: EpisodeSpec) -> Obs:
        from gym_aloha.tasks import sim as aloha_sim

        if spec.suite != SUITE:
            raise ValueError(f"episode {spec}: suite '{spec.suite}' given to the {SUITE} env")
        expand_tasks(SUITE, [spec.task])
        if spec.task not in self._sims:
            self._sims[spec.task] = _TaskSim(spec.task, self.cfg)
        self._sim, self._spec, self._steps, self._plan = self._sims[spec.task], spec, 0, None
        # gym-aloha's tasks read the objects' poses from this module-level slot at their reset (its
        # AlohaEnv.reset sets it the same way)
        aloha_sim.BOX_POSE[0] = object_poses(spec.task, spec.seed)
        self._sim.task.random.seed(spec.seed)
        self._sim.env.reset()
        return self._obs()

    def step(self, action: np.ndarray) -> StepResult:
        if self._sim is None:
            raise RuntimeError("step() before reset(): call reset(spec) first")
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (ACTION_DIM,):
            raise ValueError(
                f"action: expected shape [{ACTION_DIM}] (two arms' joint targets and grippers), "
                f"got {list(action.shape)}"
            )
        from dm_control.rl.control import PhysicsError

        self._steps += 1
        try:
            ts = self._sim.env.step(action)
        except PhysicsError as err:  # the simulation diverged: the episode ends, failed, and says why
            info = {"success": False, "steps": self._steps, "reward": 0.0, "physics_error": str(err)}
            return self._obs(), 0.0, False, True, info
        reward = float(ts.reward or 0.0)
        success = reward >= self._sim.task.max_reward
        info: dict[str, Any] = {"success": success, "steps": self._steps, "reward": reward}
        truncated = self._steps >= self.max_steps(self._spec) and not success
        return self._obs(), reward, success, truncated, info

    def expert_action(self, obs: Obs) -> np.ndarray:
        """The scripted expert's joint targets for the current step, float32 [14]
        (:mod:`wamkit.envs.aloha_expert`; planned from the episode's object poses at its first call)."""
        if self._sim is None or self._spec is None:
            raise RuntimeError("expert_action() before reset()")
        if self._plan is None:
            from wamkit.envs.aloha_expert import joint_targets

            self._plan = joint_targets(self._spec.task, object_poses(self._spec.task, self._spec.seed))
        return self._plan[min(self._steps, len(self._plan) - 1)].astype(np.float32)

    def gl_info(self) -> dict[str, str]:
        return dict(self._sim.renderer.gl_info) if self._sim is not None else {}

    def close(self) -> None:
        for sim in self._sims.values():
            sim.close()
        self._sims.clear()
        self._sim = None


def make(cfg: EnvConfig) -> AlohaEnv:
    return AlohaEnv(cfg)
