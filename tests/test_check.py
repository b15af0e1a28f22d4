"""The convention checker on datasets written by wamkit's own writer from real env rollouts: a correct
one is clean, and each deliberate mistake (antipodal-flipped quaternion, inverted gripper, unflipped
images) is caught with a fix. A MetaWorld dataset from ``wamkit collect`` is also replayed open-loop."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from wamkit.actions.rotations import quat_to_axis_angle
from wamkit.check import check_dataset
from wamkit.cli import main as cli_main
from wamkit.config import EnvConfig
from wamkit.constants import ACTION, OBS_STATE, TASK, image_key
from wamkit.envs import EpisodeSpec, make_env, render_info
from wamkit.envs.suites import resolve_env_config

needs_libero = pytest.mark.skipif(
    importlib.util.find_spec("libero") is None, reason="LIBERO extra not installed: run `make setup-libero`"
)
SUITE, TASK_ID, SIZE, FRAMES = "libero_10", "0", 64, 16
CAMS = ["agentview", "wrist"]


def _script(t: int) -> np.ndarray:
    """Move down and sideways, close the gripper, then open it: the fingers move both ways."""
    grip = 1.0 if 5 <= t < 10 else -1.0
    return np.array([0.3, -0.2, -0.4, 0.0, 0.0, 0.1, grip])


def _rollouts(env, trials: range = range(3)) -> list[list[dict]]:
    """Trials (0-2) of the task by openpi's protocol: per frame the observation, raw quaternion, action."""
    eps = []
    for trial in trials:
        obs = env.reset(EpisodeSpec(SUITE, TASK_ID, trial, 7))
        frames = []
        for t in range(FRAMES):
            action = _script(t)
            frames.append({"obs": obs, "quat": np.array(env._raw["robot0_eef_quat"]), "action": action})
            obs, *_ = env.step(action)
        eps.append(frames)
    return eps


def _write(root, eps, cfg: EnvConfig, mistake: str = "") -> None:
    from wamkit.data import LeRobotDatasetWriter

    feats = {image_key(c): {"dtype": "video", "shape": [SIZE, SIZE, 3], "names": None} for c in CAMS}
    feats[OBS_STATE] = {"dtype": "float32", "shape": [8], "names": None}
    feats[ACTION] = {"dtype": "float32", "shape": [7], "names": None}
    w = LeRobotDatasetWriter.create(
        root, 20, feats, robot_type="panda", extra_info=render_info(resolve_env_config(cfg))
    )
    for frames in eps:
        for f in frames:
            state, action = f["obs"][OBS_STATE].copy(), f["action"].astype(np.float32)
            images = {image_key(c): f["obs"][image_key(c)] for c in CAMS}
            if mistake == "flipped_quaternion":  # the generic antipodal-safe conversion
                state[3:6] = quat_to_axis_angle(f["quat"], order="xyzw")
            elif mistake == "inverted_gripper":
                action[6] = -action[6]
            elif mistake == "state_in_mm":  # the position in millimetres
                state[:3] = state[:3] * 1000.0
            elif mistake == "unflipped_images":  # robosuite's raw render, not rotated by 180 degrees
                images = {c: np.ascontiguousarray(img[::-1, ::-1]) for c, img in images.items()}
            w.add_frame({OBS_STATE: state, ACTION: action, TASK: f["obs"][TASK], **images})
        w.save_episode()
    w.finalize()


@pytest.fixture(scope="module")
def libero_case(tmp_path_factory):
    cfg = EnvConfig(suite=SUITE, cameras=CAMS, image_size=SIZE)
    env = make_env(cfg)
    root = tmp_path_factory.mktemp("check")
    eps = _rollouts(env)
    for mistake in ("", "flipped_quaternion", "inverted_gripper", "unflipped_images"):
        _write(root / (mistake or "correct"), eps, cfg, mistake)
    yield env, root, eps
    env.close()


@pytest.mark.libero
@needs_libero
def test_rollouts_hold_the_flip_case(libero_case):
    """The data must exercise the mistake: some frames have w < 0 near the gripper-down pose."""
    _, _, eps = libero_case
    w = np.array([f["quat"][3] for frames in eps for f in frames])
    assert (w < 0).any()


@pytest.mark.libero
@needs_libero
def test_correct_dataset_is_clean(libero_case):
    env, root, _ = libero_case
    report = check_dataset(root / "correct", SUITE, env=env)
    assert report.clean, report.text()
    assert {f.check for f in report.findings if f.level == "ok"} >= {
        "fps",
        "action",
        "gripper",
        "state",
        "image",
    }


@pytest.mark.libero
@needs_libero
@pytest.mark.parametrize(
    ("mistake", "check", "says", "fix"),
    [
        ("flipped_quaternion", "state", "eef_ax", "no antipodal flip"),
        ("inverted_gripper", "gripper", "polarity inverted", "negate the gripper channel"),
        ("unflipped_images", "image", "rotated 180°", "img[::-1, ::-1]"),
    ],
)
def test_each_mistake_is_caught_with_its_fix(libero_case, mistake, check, says, fix):
    env, root, _ = libero_case
    report = check_dataset(root / mistake, SUITE, env=env)
    errors = [f for f in report.errors if f.check == check]
    assert errors, report.text()
    assert any(says in f.message and fix in f.fix for f in errors), report.text()
    assert {f.check for f in report.errors} == {check}, report.text()  # nothing else is blamed


@pytest.mark.slow
@pytest.mark.libero
@needs_libero
def test_data_from_initial_states_the_probe_does_not_use(libero_case, tmp_path):
    """Published LIBERO data start from other initial states than the trials the checker resets (its
    demonstrations', not the evaluation's): correct data from trials 20-22, settled or not, is not an
    ERROR; each planted mistake on such data still is. (Here, before the tests that build other envs
    in this process: the image check compares frames this module's env renders.)"""
    env, _, _ = libero_case
    cfg = EnvConfig(suite=SUITE, cameras=CAMS, image_size=SIZE)
    for start in ("init", "settled"):
        eps = _rollouts_from(env, start, range(20, 23))
        _write(tmp_path / start, eps, cfg)
        report = check_dataset(tmp_path / start, SUITE, env=env)  # probes trials 0 and 1
        assert not report.errors, report.text()
    # the planted mistakes, on data from those trials, are still each caught as itself
    eps = _rollouts(env, range(20, 23))
    for mistake, check in (("flipped_quaternion", "state"), ("inverted_gripper", "gripper"),
                           ("unflipped_images", "image"), ("state_in_mm", "state")):  # fmt: skip
        _write(tmp_path / mistake, eps, cfg, mistake)
        report = check_dataset(tmp_path / mistake, SUITE, env=env)
        assert {f.check for f in report.errors} == {check}, report.text()


@pytest.mark.libero
@needs_libero
def test_check_command_on_the_shared_fixture(libero_tiny, capsys, tmp_path):
    """libero_tiny holds random numbers, not physics: the checker must say so (exit status 1)."""
    out = tmp_path / "report.json"
    assert cli_main(["check", str(libero_tiny), "--suite", SUITE, "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "state[3] (eef_ax)" in text and "fix:" in text
    report = json.loads(out.read_text())
    assert report["clean"] is False and any(f["check"] == "state" for f in report["findings"])


def test_metaworld_collected_dataset_is_clean_and_replays(tmp_path):
    out = tmp_path / "mw"
    argv = ["collect", "--suite", "metaworld", "--tasks", "reach-v3", "--episodes", "2", "--workers", "1"]
    assert cli_main([*argv, "--image-size", "32", "--out", str(out)]) == 0
    report = check_dataset(out, "metaworld", replay=2)
    assert report.clean, report.text()
    (replay,) = report.of("replay")
    assert replay.level == "ok" and "2 succeeded (100%)" in replay.message
    images = report.of("image")
    assert images and images[0].level == "ok" and "same episode" in images[0].message


class _Recording:
    """An env that keeps the state of every observation its steps return."""

    def __init__(self, env):
        self.env, self.states = env, []

    def reset(self, spec):
        self.states = []
        return self.env.reset(spec)

    def step(self, action):
        out = self.env.step(action)
        self.states.append(np.asarray(out[0][OBS_STATE], np.float32))
        return out


def test_a_perturbed_collection_replays_the_actions_the_env_was_given(tmp_path):
    """With late actions the labels are the expert's, not what the env executed: the replay plays the
    ``executed_action`` column and retraces the recorded states exactly; the labels part from them."""
    from dataclasses import replace

    from wamkit.check import _env_cameras
    from wamkit.check.probe import env_config, read_dataset, state_option
    from wamkit.check.replay import replay
    from wamkit.envs.suites import resolve_env_config

    out = tmp_path / "late"
    argv = ["collect", "--suite", "metaworld", "--tasks", "reach-v3", "--episodes", "1", "--workers", "1"]
    late = ["--action-lag", "4", "--lag-prob", "0.5", "--noise-hold", "4"]
    assert cli_main([*argv, *late, "--image-size", "32", "--out", str(out)]) == 0
    report = check_dataset(out, "metaworld", replay=1)
    (found,) = report.of("replay")
    assert found.level == "ok" and "(executed_action): 1 succeeded (100%)" in found.message, report.text()

    data = read_dataset(out, "metaworld")
    assert data.executed is not None and not np.array_equal(data.executed, data.actions)
    cfg = resolve_env_config(
        env_config("metaworld", _env_cameras(data, "metaworld"), 32, "auto", state_option(data, "metaworld"))
    )
    env = _Recording(make_env(cfg))
    try:
        recorded = data.states[1 : data.starts[1] if len(data.starts) > 1 else None].astype(np.float32)
        replay(env, data, 1)
        executed = np.stack(env.states)[: len(recorded)]
        replay(env, replace(data, executed=None), 1)
        labels = np.stack(env.states)[: len(recorded)]
    finally:
        env.env.close()
    assert np.array_equal(executed, recorded)
    assert not np.array_equal(labels, recorded)


def _up(t: int) -> np.ndarray:
    """Rise and open: every state of the rollout lies above where it started."""
    return np.array([0.0, 0.0, 0.6, 0.0, 0.0, 0.0, -1.0])


def _rollouts_from(env, start: str, trials: range = range(1)) -> list[list[dict]]:
    """``trials`` recorded from one of the two starts of published LIBERO data: ``"settled"``, as openpi's
    client observes the env (after reset's settle no-ops), or ``"init"``, right after
    ``set_init_state`` with no settling (as LIBERO's demonstrations were recorded)."""
    eps = []
    for trial in trials:
        obs = env.reset(EpisodeSpec(SUITE, TASK_ID, trial, 7))
        if start == "init":  # back to the stored state, and the rollout goes on from it unsettled
            obs = env._obs(env._env.set_init_state(env._init_states[trial]))
        frames = []
        for t in range(8):
            frames.append({"obs": obs, "quat": None, "action": _up(t)})
            obs, *_ = env.step(_up(t))
        eps.append(frames)
    return eps


@pytest.mark.libero
@needs_libero
def test_the_checker_knows_both_starts_of_published_data(libero_case, tmp_path):
    env, _, _ = libero_case
    cfg = EnvConfig(suite=SUITE, cameras=CAMS, image_size=SIZE)
    said = {}
    for start in ("init", "settled"):
        eps = _rollouts_from(env, start)
        _write(tmp_path / start, eps, cfg)
        report = check_dataset(tmp_path / start, SUITE, env=env, trials=1)  # the trial recorded
        assert not [f for f in report.errors if f.check == "state"], report.text()
        said[start] = " ".join(f.message for f in report.findings if f.check == "state" and f.level == "ok")
        if start == "init":
            # compared with the settled starts alone (what reset returns), this correct dataset is out of
            # range: the one-start check's false alarm, which the second start removes
            from wamkit.check.checks import _uncovered

            states = np.stack([f["obs"][OBS_STATE] for frames in eps for f in frames]).astype(np.float64)
            lo, hi = states.min(axis=0), states.max(axis=0)
            probe = {}
            for trial in range(1):
                env.reset(EpisodeSpec(SUITE, TASK_ID, trial, 7))
                for kind, o in env.reset_starts.items():
                    probe.setdefault(kind, []).append(o[OBS_STATE])
            margin = 0.05 * (hi - lo) + 1e-3
            assert _uncovered(np.stack(probe["after 10 settle steps"]), lo, hi, margin)
            assert not _uncovered(np.stack(probe["right after set_init_state"]), lo, hi, margin)
    assert "starts as the env does right after set_init_state" in said["init"], said
    assert "starts as the env does after 10 settle steps" in said["settled"], said


def test_a_range_message_never_calls_overlapping_ranges_disjoint():
    from wamkit.check.checks import check_state
    from wamkit.check.probe import DataView, EnvProbe
    from wamkit.check.report import Report

    states = np.array([[0.702, 0.0], [0.90, 0.1], [1.196, 0.2]])
    data = DataView(root=None, fps=20, info={}, states=states, actions=np.zeros((3, 7)),
                    episode_of_row=np.zeros(3, int), starts=[0], episodes=[0], tasks=["t"], first_frames={})  # fmt: skip
    env_starts = {"right after set_init_state": np.array([[0.66, 0.0], [1.18, 0.1]]),
                  "after 10 settle steps": np.array([[0.6751, 0.0], [1.18, 0.1]])}  # fmt: skip
    env = EnvProbe(suite="x", fps=20, state_dim=2, action_dim=7, specs=[], texts=[],
                   states=env_starts["after 10 settle steps"], frames={}, close_shrinks=True, starts=env_starts)  # fmt: skip
    report = Report("d", "x", "probe")
    check_state(data, env, report, ("eef_z", "b"), (), "the env's state")
    # 0.04 beyond a range of values near 1: other initial states, a warning (a unit or frame mistake
    # would be far beyond); its message says how far, as an error's would
    (err,) = [f for f in report.findings if f.check == "state" and f.level == "warn"]
    assert not report.errors
    assert "never reach" not in err.message and "disjoint" not in err.message
    assert "span 0.702..1.196" in err.message and "right after set_init_state 0.66..1.18" in err.message
    assert "below the data's lowest" in err.message and "above" not in err.message
