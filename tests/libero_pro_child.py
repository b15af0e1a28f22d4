"""What the LIBERO-PRO tests run in a process of its own (``python tests/libero_pro_child.py WHAT``):
LIBERO-PRO's ``libero`` cannot be imported where LIBERO 0.1.1's already is, as in the test process.
Each command prints one JSON line and exits 0; an assertion that fails exits non-zero with its
message on stderr."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import numpy as np

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

from wamkit.config import EnvConfig  # noqa: E402
from wamkit.constants import OBS_STATE, TASK, image_key  # noqa: E402
from wamkit.envs import EpisodeSpec, make_env  # noqa: E402
from wamkit.envs import libero_pro_env as pro  # noqa: E402
from wamkit.envs.suites import resolve_env_config  # noqa: E402

SIZE = 64
NOOP = np.array([0, 0, 0, 0, 0, 0, -1], dtype=np.float64)


def _upstream(suite: str, task_id: int, trials: int, seed: int = 7):
    """LIBERO-PRO's own benchmark and env, run as its evaluation runner runs them
    (libero/evaluation/runner.py): the task's env built once and seeded once, then per trial in
    order reset(), set_init_state(init[t]), 10 no-op steps. Returns the task, its initial states, the
    env's instruction and each trial's raw observation."""
    pro.import_libero_pro()
    from libero.libero import benchmark, get_libero_path
    from libero.libero.envs import OffScreenRenderEnv

    bench = benchmark.get_benchmark_dict()[suite]()
    task, init = bench.get_task(task_id), bench.get_task_init_states(task_id)
    bddl = os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)
    with contextlib.redirect_stdout(io.StringIO()):
        env = OffScreenRenderEnv(bddl_file_name=bddl, camera_heights=SIZE, camera_widths=SIZE)
    env.seed(seed)
    out = []
    try:
        for t in range(trials):
            env.reset()
            obs = env.set_init_state(init[t])
            for _ in range(10):
                obs, _, _, _ = env.step(NOOP)
            out.append({k: np.array(v) for k, v in obs.items()})
        language = str(env.language_instruction)
    finally:
        env.close()
    return bench, task, init, language, out


def metadata() -> dict:
    """Every perturbed suite's task names (in order), instructions (as its env reads its bddl) and
    initial states, as upstream's benchmark gives them, against the backend's."""
    pro.import_libero_pro()
    from libero.libero import benchmark
    from libero.libero.envs.bddl_utils import get_problem_info

    from wamkit.embodiments.libero_pro import UPSTREAM

    checked = 0
    for suite in UPSTREAM:
        bench = benchmark.get_benchmark_dict()[suite]()
        ours = pro.tasks_of(suite)
        assert [t.name for t in ours] == bench.get_task_names(), suite
        for i, t in enumerate(ours):
            init = bench.get_task_init_states(i)
            mine = pro.initial_states(t)
            assert mine.dtype == init.dtype and np.array_equal(mine, init), f"{suite} task {i}"
            told = get_problem_info(str(pro.bddl_path(suite, t.upstream)))["language_instruction"]
            assert t.language == told, (suite, i, t.language, told)
            checked += 1
    return {"tasks": checked}


def reset(suite: str, task_id: int, trials: int) -> dict:
    """wamkit's env against upstream's, trials in the reverse order, the simulator disturbed between:
    states to 1e-4, both cameras' pixels equal after the 180-degree flip, the instruction equal."""
    from robosuite.utils.transform_utils import quat2axisangle

    _, task, _, language, ref = _upstream(suite, task_id, trials)
    env = make_env(EnvConfig(suite=suite, cameras=["agentview", "wrist"], image_size=SIZE))
    differ = {}
    try:
        for t in reversed(range(trials)):
            obs = env.reset(EpisodeSpec(suite, str(task_id), t, 7))
            raw = ref[t]
            state = np.concatenate(
                [
                    raw["robot0_eef_pos"],
                    quat2axisangle(raw["robot0_eef_quat"].copy()),
                    raw["robot0_gripper_qpos"],
                ]
            )
            np.testing.assert_allclose(
                obs[OBS_STATE], state, atol=1e-4, err_msg=f"{suite} {task_id} trial {t}"
            )
            for cam, rs in (("agentview", "agentview"), ("wrist", "robot0_eye_in_hand")):
                flipped = raw[f"{rs}_image"][::-1, ::-1]
                differ[f"{t}/{cam}"] = int((obs[image_key(cam)] != flipped).any(axis=-1).sum())
            assert obs[TASK] == language, (obs[TASK], language)
            for _ in range(5):
                env.step(np.array([0.5, -0.5, 0.3, 0.2, 0, 0, 1.0]))
    finally:
        env.close()
    return {"task": task.name, "language": language, "filename_language": task.language, "differ": differ}


def check(root: str) -> dict:
    """Roll out trials 0-2 of one combined-suite task with a scripted motion, write them as a dataset
    (and once more with the gripper inverted), and run ``wamkit check`` on both."""
    from wamkit.check import check_dataset
    from wamkit.constants import ACTION
    from wamkit.data import LeRobotDatasetWriter
    from wamkit.envs import render_info

    suite, task, cams = "libero_pro_10", "swap/0", ["agentview", "wrist"]
    cfg = EnvConfig(suite=suite, tasks=[task], cameras=cams, image_size=SIZE)
    env = make_env(cfg)
    try:
        eps = []
        for trial in range(3):
            obs = env.reset(EpisodeSpec(suite, task, trial, 7))
            frames = []
            for t in range(16):
                action = np.array([0.3, -0.2, -0.4, 0.0, 0.0, 0.1, 1.0 if 5 <= t < 10 else -1.0])
                frames.append((obs, action))
                obs, *_ = env.step(action)
            eps.append(frames)
        out = {}
        for name, sign in (("correct", 1.0), ("inverted_gripper", -1.0)):
            feats = {image_key(c): {"dtype": "video", "shape": [SIZE, SIZE, 3], "names": None} for c in cams}
            feats[OBS_STATE] = {"dtype": "float32", "shape": [8], "names": None}
            feats[ACTION] = {"dtype": "float32", "shape": [7], "names": None}
            path = os.path.join(root, name)
            w = LeRobotDatasetWriter.create(
                path, 20, feats, robot_type="panda", extra_info=render_info(resolve_env_config(cfg))
            )
            for frames in eps:
                for o, a in frames:
                    a = a.astype(np.float32).copy()
                    a[6] *= sign
                    w.add_frame(
                        {
                            OBS_STATE: o[OBS_STATE],
                            ACTION: a,
                            TASK: o[TASK],
                            **{image_key(c): o[image_key(c)] for c in cams},
                        }
                    )
                w.save_episode()
            w.finalize()
            report = check_dataset(path, suite, env=env)
            out[name] = {
                "clean": report.clean,
                "findings": {f.check: f.level for f in report.findings},
                "text": report.text(),
            }
    finally:
        env.close()
    return out


def refuses() -> dict:
    """A process that imported LIBERO 0.1.1's ``libero`` is refused, naming both."""
    from wamkit.envs.libero_env import prepare_libero

    prepare_libero()
    import libero.libero  # noqa: F401

    try:
        pro.import_libero_pro()
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


if __name__ == "__main__":
    what, args = sys.argv[1], sys.argv[2:]
    if what == "reset":
        result = reset(args[0], int(args[1]), int(args[2]))
    elif what == "check":
        result = check(args[0])
    else:
        result = {"metadata": metadata, "refuses": refuses}[what]()
    print(json.dumps(result))
