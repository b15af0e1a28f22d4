"""ManiSkill3 backend (mani-skill 3.0.1 on SAPIEN 3.0.3; ``make setup-maniskill`` builds its venv).

ManiSkill3 lives in a venv of its own (``.venv-maniskill``: its motion planner, mplib 0.1.1, needs
numpy < 2), so this module is imported in two places: in the evaluating or collecting process, which
reads only its constants and :func:`worker_python` and never imports ``mani_skill``, and in the env
workers, started with that venv's Python, which build :class:`ManiSkillEnv`.

Conventions (docs/maniskill.md cites ManiSkill's file for each):

- tasks: ManiSkill's Panda tasks with a motion-planning solution
  (``mani_skill/examples/motionplanning/panda/run.py``'s ``MP_SOLUTIONS``), built with ``gym.make`` on
  the CPU simulator (``physx_cpu``), one env per task, ``num_envs=1``;
- episode: ``env.reset(seed=spec.seed)``: the seed places the objects, as ManiSkill's own evaluation and
  its motion-planning script seed them; ``trial`` is only a label;
- state, float32 [18]: ``obs["agent"]["qpos"]`` then ``obs["agent"]["qvel"]``;
- action, float [7]: the ``pd_ee_delta_pose`` controller's normalised action (the embodiment's profile);
- ``terminated`` = ``info["success"]`` (the task's ``evaluate()``), ``truncated`` at the task's horizon;
- images: each task's ``base_camera`` sensor at ``env.image_size`` square, ManiSkill's ``default``
  shader (``fast``: its ``minimal`` shader), rendered by SAPIEN's Vulkan renderer: the GPU where CUDA
  is, Mesa's lavapipe on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.config import ConfigError, EnvConfig, _suggest
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.embodiments.maniskill import PROFILE
from wamkit.envs.base import EpisodeSpec, Obs, StepResult, SuiteInfo

log = logging.getLogger(__name__)

SUITE = "maniskill"
CAMERAS = PROFILE.cameras
ACTION_DIM = PROFILE.action_dim

# the control mode the demonstrations are converted to and the policies act in: one action layout over
# every task (PegInsertionSide needs the hand's rotation, which pd_ee_delta_pos cannot command)
CONTROL_MODE = "pd_ee_delta_pose"
# what ManiSkill's motion planners act in, and what its conversion (mani_skill/trajectory/utils/actions/
# conversion.py, from_pd_joint_pos) turns their actions into
PLANNER_MODE = "pd_joint_pos"
CONVERTIBLE = ("pd_joint_delta_pos", "pd_joint_target_delta_pos", "pd_joint_vel", "pd_ee_delta_pos",
               "pd_ee_delta_pose", "pd_ee_target_delta_pos", "pd_ee_target_delta_pose")  # fmt: skip

# task -> (horizon, instruction). Horizons: ManiSkill's diffusion-policy baselines (examples/baselines/
# diffusion_policy/baselines.sh: --max_episode_steps 100 / 200 / 300 / 100); the tasks past those four,
# twice their registered max_episode_steps. Instructions: wamkit's words (ManiSkill's tasks carry none).
TASK_INFO: dict[str, tuple[int, str]] = {
    "PickCube-v1": (100, "pick up the red cube and move it to the green goal point"),
    "StackCube-v1": (200, "stack the red cube on top of the green cube"),
    "PegInsertionSide-v1": (300, "pick up the peg and insert it into the hole in the box from the side"),
    "PushCube-v1": (100, "push the cube to the red and white target"),
    "PullCube-v1": (100, "pull the cube back to the red and white target"),
    "LiftPegUpright-v1": (100, "lift the peg lying on the table and stand it upright"),
    "PlugCharger-v1": (400, "insert the charger into the receptacle on the wall"),
}
TASKS = tuple(TASK_INFO)
MAX_STEPS = PROFILE.suites[SUITE]
SHADERS = {"default": "default", "fast": "minimal"}
PYTHON_VAR = "WAMKIT_MANISKILL_PYTHON"
# the module of the suite's batched simulator (``make_batch``: N sub-scenes stepped together on the GPU),
# which the GPU executor's workers import; the suites without one name none
BATCH_BACKEND = "wamkit.envs.maniskill_batch"
VENV = ".venv-maniskill"


def finger_width(states: np.ndarray) -> np.ndarray:
    """The fingers' opening of 18-D ManiSkill Panda states: the two finger joints' sum (metres)."""
    return states[..., 7] + states[..., 8]


def suite_info(suite: str = SUITE) -> SuiteInfo:
    p = PROFILE
    return SuiteInfo(
        SUITE, TASKS, MAX_STEPS, p.state_dim, p.action_dim, p.fps, p.default_cameras, p.robot_type
    )


def task_texts(suite: str = SUITE) -> dict[str, str]:
    return {t: text for t, (_, text) in TASK_INFO.items()}


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """``tasks`` checked against the tasks with a motion-planning solution; an unknown one raises
    naming ``env.tasks`` and the valid ones."""
    for t in tasks:
        if t not in TASK_INFO:
            raise ConfigError(
                f"env.tasks: '{t}' is not a ManiSkill3 task with a motion-planning solution"
                f"{_suggest(t, TASKS)} (valid: {', '.join(TASKS)})"
            )
    return list(dict.fromkeys(tasks))


# the tasks the GPU executor runs: those whose episode is all in the simulation state, so that a sub-scene
# can start from the CPU simulator's state of a seed (wamkit.envs.maniskill_batch); PegInsertionSide draws
# its sizes when the scene is built, PlugCharger computes its goal at the episode's start
GPU_TASKS = ("PickCube-v1", "StackCube-v1", "PushCube-v1", "PullCube-v1", "LiftPegUpright-v1")


def check_gpu_tasks(tasks: list[str]) -> None:
    """Refuse tasks the batched simulator cannot start from a seed's CPU state, naming those it can."""
    expand_tasks(SUITE, tasks)
    bad = [t for t in tasks if t not in GPU_TASKS]
    if bad:
        raise ConfigError(
            f"env.tasks: {', '.join(bad)} keep part of an episode outside ManiSkill's simulation state "
            f"(sizes drawn when the scene is built, or a goal computed at the episode's start), so the GPU "
            f"executor cannot start them from their seeds; use eval.executor=local for them (GPU "
            f"executor tasks: {', '.join(GPU_TASKS)})"
        )
    if len(set(tasks)) > 1:
        raise ConfigError(
            f"env.tasks: the GPU executor simulates one task per run (one scene of N sub-scenes per "
            f"process), got {len(set(tasks))}: evaluate {', '.join(dict.fromkeys(tasks))} one at a time"
        )


def check_control_mode(mode: str) -> None:
    """Refuse a control mode other than the suite's, saying whether the demonstrations could be
    converted to it at all."""
    if mode in ("auto", CONTROL_MODE):
        return
    if mode in CONVERTIBLE:
        why = (f"ManiSkill can convert the planners' {PLANNER_MODE} demonstrations to it, but the "
               f"maniskill suite's action layout is {CONTROL_MODE}'s 7 numbers")  # fmt: skip
    else:
        why = (f"the planners' {PLANNER_MODE} demonstrations cannot be converted to it (ManiSkill's "
               f"conversion reaches {', '.join(CONVERTIBLE)})")  # fmt: skip
    raise ConfigError(f"env.control_mode: '{mode}': {why}; set env.control_mode={CONTROL_MODE} (or auto)")


def _repo_venv_python() -> Path:
    return Path(__file__).resolve().parents[3] / VENV / "bin" / "python"


def worker_python() -> str | None:
    """The Python the env workers start with: ``$WAMKIT_MANISKILL_PYTHON``, else this one where it
    imports ``mani_skill`` (None: the usual spawned worker), else the checkout's ``.venv-maniskill``;
    none of them raises a :class:`ConfigError` saying how to get one."""
    chosen = os.environ.get(PYTHON_VAR)
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise ConfigError(f"{PYTHON_VAR}={chosen}: no such Python (a venv with mani-skill 3.0.1)")
        return None if os.path.realpath(chosen) == os.path.realpath(sys.executable) else chosen
    if importlib.util.find_spec("mani_skill") is not None:
        return None
    venv = _repo_venv_python()
    if venv.is_file():
        return str(venv)
    raise ConfigError(
        "env.suite=maniskill: ManiSkill3 is not installed for this Python; `make setup-maniskill` builds "
        f"{VENV} (its workers' Python), or set {PYTHON_VAR} to a Python with mani-skill 3.0.1"
    )


def site_paths() -> list[str]:
    """Where the workers' ManiSkill3 is installed (for the versions a run records)."""
    try:
        py = worker_python()
    except ConfigError:
        return []
    if py is None:
        return []
    lib = Path(py).parent.parent / "lib"
    return [str(p) for p in lib.glob("python3*/site-packages")]


def _sim_device() -> tuple[str, str]:
    """(sim backend, render backend): the CPU simulator, rendered on the GPU where CUDA is."""
    import torch

    return "physx_cpu", ("gpu" if torch.cuda.is_available() else "cpu")


def _make(task: str, mode: str, obs_mode: str, cfg: EnvConfig | None, num_envs: int = 1, sim: str = ""):
    """A ManiSkill env of ``task``: ``num_envs`` sub-scenes on ``sim`` (``physx_cuda``: rendered on the
    GPU; empty: the CPU simulator, :func:`_sim_device`)."""
    # Mesa's lavapipe (the CPU-only renderer) draws with a thread per core by default; the evaluator and
    # collect already run one env worker per core, so each renders on its own thread
    os.environ.setdefault("LP_NUM_THREADS", "1")
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401  (registers the tasks)

    sim, render = (sim, "gpu") if sim == "physx_cuda" else _sim_device()
    kwargs: dict[str, Any] = {}
    if cfg is not None:
        kwargs["sensor_configs"] = dict(
            width=cfg.image_size, height=cfg.image_size, shader_pack=SHADERS[cfg.render_quality]
        )
    # the horizon is wamkit's (max_steps): gym's TimeLimit is given one it never reaches
    return gym.make(
        task, obs_mode=obs_mode, control_mode=mode, num_envs=num_envs, sim_backend=sim, render_backend=render,
        render_mode=None, max_episode_steps=100_000, **kwargs,
    )  # fmt: skip


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def observations(raw, rows: list[int], cameras, tasks: list[str]) -> list[Obs]:
    """The observations of sub-scenes ``rows`` of a ManiSkill observation ``raw`` (one copy from the
    device per key), ``tasks[i]`` the task of ``rows[i]``."""
    index = list(rows)
    images = {c: _np(raw["sensor_data"][CAMERAS[c]]["rgb"][index]).astype(np.uint8) for c in cameras}
    agent = raw["agent"]
    states = np.concatenate([_np(agent["qpos"][index]), _np(agent["qvel"][index])], axis=1).astype(np.float32)
    out = []
    for i, task in enumerate(tasks):
        obs: Obs = {image_key(c): images[c][i] for c in cameras}
        obs[OBS_STATE], obs[TASK] = states[i], TASK_INFO[task][1]
        out.append(obs)
    return out


class _Recorder:
    """A gym env's wrapper that records the actions given to ``step`` (the planners and ManiSkill's
    conversion call ``env.step`` and read ``env.unwrapped``)."""

    def __init__(self, env) -> None:
        self.env, self.actions = env, []

    def __getattr__(self, name):
        return getattr(self.env, name)

    @property
    def unwrapped(self):
        return self.env.unwrapped

    def reset(self, **kwargs):
        self.actions = []
        return self.env.reset(**kwargs)

    def step(self, action):
        self.actions.append(np.asarray(_np(action), np.float32).reshape(-1))
        return self.env.step(action)


def plan_episode(task: str, seed: int, planner_env, convert_env) -> tuple[np.ndarray | None, bool]:
    """``(actions, solved)``: the episode's expert actions in ``pd_ee_delta_pose``, float32 [T, 7]:
    ManiSkill's motion-planning solution run from ``reset(seed=seed)`` in ``pd_joint_pos``, then its
    actions converted the way its replay tool does (``from_pd_joint_pos``: each joint target turned into
    the end-effector delta that reaches it, in closed loop in ``convert_env``), None where the planner
    found no plan; ``solved``: the planner's own episode succeeded (what ManiSkill's ``run.py`` counts)."""
    from mani_skill.examples.motionplanning.panda.run import MP_SOLUTIONS
    from mani_skill.trajectory.utils.actions.conversion import from_pd_joint_pos

    planner = _Recorder(planner_env)
    try:
        result = MP_SOLUTIONS[task](planner, seed=seed, debug=False, vis=False)
    except Exception as err:  # noqa: BLE001 - ManiSkill's run.py counts a raising solution as no plan
        log.warning("%s seed %d: the motion planner raised %s: %s", task, seed, type(err).__name__, err)
        return None, False
    if isinstance(result, int) and result == -1 or not planner.actions:
        return None, False
    solved = bool(_np(result[-1]["success"]).reshape(-1)[0])
    joint_actions = list(planner.actions)
    planner_env.reset(seed=seed)
    convert = _Recorder(convert_env)
    convert.reset(seed=seed)  # both reset by the seed, as the replay tool does by default
    from_pd_joint_pos(CONTROL_MODE, joint_actions, planner_env, convert)
    return np.stack(convert.actions).astype(np.float32), solved


class ManiSkillEnv:
    """ManiSkill3's Panda tasks behind the :class:`~wamkit.envs.base.Env` interface."""

    suite = SUITE

    def __init__(self, cfg: EnvConfig) -> None:
        from wamkit.envs.suites import check_env_start

        check_env_start(cfg, "ManiSkillEnv", CAMERAS, "ManiSkill3")
        check_control_mode(getattr(cfg, "control_mode", "auto"))
        self.cfg = cfg
        self._envs: dict[str, Any] = {}
        self._experts: dict[str, tuple[Any, Any]] = {}
        self._env = None
        self._spec: EpisodeSpec | None = None
        self._steps = 0
        self._plan: np.ndarray | None = None
        self._solved = False

    def max_steps(self, spec: EpisodeSpec) -> int:
        return self.cfg.max_steps or TASK_INFO[spec.task][0]

    def _obs(self, raw) -> Obs:
        assert self._spec is not None
        return observations(raw, [0], self.cfg.cameras, [self._spec.task])[0]

    def reset(self, spec: EpisodeSpec) -> Obs:
        if spec.suite != SUITE:
            raise ValueError(f"episode {spec}: suite '{spec.suite}' given to the {SUITE} env")
        expand_tasks(SUITE, [spec.task])
        if spec.task not in self._envs:
            self._envs[spec.task] = _make(spec.task, CONTROL_MODE, "rgb", self.cfg)
        self._env, self._spec, self._steps, self._plan = self._envs[spec.task], spec, 0, None
        self._solved = False
        raw, _ = self._env.reset(seed=spec.seed)
        return self._obs(raw)

    def step(self, action: np.ndarray) -> StepResult:
        if self._env is None or self._spec is None:
            raise RuntimeError("step() before reset(): call reset(spec) first")
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        if action.shape != (ACTION_DIM,):
            raise ValueError(
                f"action: expected shape [{ACTION_DIM}] ({CONTROL_MODE}: {', '.join(PROFILE.action_names)}), "
                f"got {list(action.shape)}"
            )
        self._steps += 1
        raw, reward, _, _, info = self._env.step(action[None])
        success = bool(_np(info["success"]).reshape(-1)[0])
        out: dict[str, Any] = {
            "success": success,
            "steps": self._steps,
            "reward": float(_np(reward).reshape(-1)[0]),
        }
        truncated = self._steps >= self.max_steps(self._spec) and not success
        return self._obs(raw), out["reward"], success, truncated, out

    def expert_action(self, obs: Obs) -> np.ndarray:
        """The motion planner's action for the current step, float32 [7] (:func:`plan_episode`, planned at
        the episode's first call); past its end, or where it found no plan, the hand holds still."""
        if self._env is None or self._spec is None:
            raise RuntimeError("expert_action() before reset()")
        if self._plan is None:
            task = self._spec.task
            if task not in self._experts:
                self._experts[task] = (
                    _make(task, PLANNER_MODE, "none", None),
                    _make(task, CONTROL_MODE, "none", None),
                )
            planned, self._solved = plan_episode(task, self._spec.seed, *self._experts[task])
            self._plan = planned if planned is not None else np.zeros((0, ACTION_DIM), np.float32)
        if self._steps < len(self._plan):
            return self._plan[self._steps].copy()
        hold = np.zeros(ACTION_DIM, np.float32)
        hold[-1] = self._plan[-1, -1] if len(self._plan) else PROFILE.gripper_open
        return hold

    def expert_report(self) -> dict[str, Any]:
        """What the expert's episode says beyond its success: whether ManiSkill's planner solved it in
        its own ``pd_joint_pos`` (``wamkit collect`` prints that rate beside the converted episodes')."""
        return {"planner_solved": bool(self._solved)}

    def close(self) -> None:
        for env in [*self._envs.values(), *(e for pair in self._experts.values() for e in pair)]:
            env.close()
        self._envs.clear()
        self._experts.clear()
        self._env = None


def make(cfg: EnvConfig) -> ManiSkillEnv:
    return ManiSkillEnv(cfg)
