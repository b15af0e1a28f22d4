"""``wamkit collect`` end to end: real experts in real worker processes, a real LeRobot v3 dataset."""

from __future__ import annotations

import json

import numpy as np
import pytest

from wamkit.cli import main as cli_main
from wamkit.config import DataConfig, EnvConfig
from wamkit.constants import ACTION, EXECUTED_ACTION, OBS_STATE, TASK, image_key
from wamkit.data import LeRobotDataset, compute_stats, make_train_dataset
from wamkit.envs import EpisodeSpec, check_render_quality, make_env
from wamkit.envs.collect_journal import JOURNAL
from wamkit.envs.suites import resolve_env_config
from wamkit.models.base import ModelIO

from .conftest import spec_of

ARGS = ["--suite", "metaworld", "--tasks", "reach-v3,push-v3", "--workers", "2", "--image-size", "32"]


def _journal(root):
    return [json.loads(line) for line in (root / JOURNAL).read_text().splitlines()]


def test_collect_writes_a_readable_dataset_and_resumes(tmp_path, capsys):
    out = tmp_path / "mw"
    assert cli_main(["collect", *ARGS, "--episodes", "2", "--out", str(out), "--render-quality", "fast"]) == 0
    assert "reach-v3: 2/2 expert successes" in capsys.readouterr().out

    ds = LeRobotDataset(out)
    assert ds.num_episodes == 4 and ds.fps == 80
    info = ds.meta.info
    assert info["wamkit"] == {
        "suite": "metaworld",
        "render_quality": "fast",
        "cameras": ["corner"],
        "gripper": "env",
    }
    check_render_quality(info, resolve_env_config(EnvConfig(render_quality="fast")))
    with pytest.raises(ValueError, match="render quality mismatch"):
        check_render_quality(info, resolve_env_config(EnvConfig(render_quality="default")))
    tasks = {ds[i][TASK] for i in range(len(ds))}
    assert tasks == {"reach the goal", "push the puck to the goal"}

    # the first frame of each episode is the env's reset observation for its (task, seed)
    env = make_env(EnvConfig(image_size=32, render_quality="fast"))
    try:
        for entry in _journal(out):
            spec = EpisodeSpec.from_dict(entry)
            obs = env.reset(spec)
            start = ds.meta.episodes[entry["episode_index"]].from_index
            frame = ds[start]
            np.testing.assert_array_equal(frame[OBS_STATE].numpy(), obs[OBS_STATE])
            np.testing.assert_allclose(frame[ACTION].numpy(), env.expert_action(obs), atol=1e-6)
            assert frame[TASK] == obs[TASK]
            # video is lossy: compare loosely, but a wrong or flipped frame would be far off
            got, want = frame[image_key("corner")].numpy().astype(int), obs[image_key("corner")].astype(int)
            err, flipped = np.abs(got - want).mean(), np.abs(got - want[::-1, ::-1]).mean()
            assert err < 12 and err < 0.5 * flipped, (err, flipped)
            assert entry["steps"] == ds.meta.episodes[entry["episode_index"]].length
    finally:
        env.close()

    # resume: asking for 3 per task collects exactly one more per task, never a seed twice
    one_worker = [a if a != "--workers" else "collect.workers=1" for a in ARGS if a != "2"]
    argv = ["collect", *one_worker, "--episodes", "3", "--out", str(out), "--render-quality", "fast"]
    assert cli_main(argv) == 0
    journal = _journal(out)
    seeds = [(e["task"], e["seed"]) for e in journal]
    assert len(seeds) == len(set(seeds)) == 6
    assert LeRobotDataset(out).num_episodes == 6
    assert sorted(e["episode_index"] for e in journal) == list(range(6))
    assert "0 new episodes" in (cli_main(["collect", *ARGS, "--episodes", "3", "--out", str(out),
                                          "--render-quality", "fast"]) == 0 and capsys.readouterr().out)  # fmt: skip

    # a journal edited by hand no longer accounts for the dataset's episodes: refused, and the finished
    # dataset stays finished and readable
    journal_path = out / "meta" / "wamkit_collect.jsonl"
    lines = journal_path.read_text().splitlines(keepends=True)
    journal_path.write_text("".join(lines[:-1]))
    assert cli_main(["collect", *ARGS, "--episodes", "4", "--out", str(out), "--render-quality", "fast"]) == 2
    assert "it was changed by hand" in capsys.readouterr().err
    assert LeRobotDataset(out).num_episodes == 6
    journal_path.write_text("".join(lines))

    # a different look cannot be appended to the same dataset
    assert (
        cli_main(["collect", *ARGS, "--episodes", "4", "--out", str(out), "--render-quality", "default"]) == 2
    )
    assert "render_quality" in capsys.readouterr().err


def test_two_workers_write_the_dataset_one_worker_writes(tmp_path):
    """Episodes are journaled and written in the order they were handed out, not as workers finish."""
    runs = {}
    for n in (1, 2):
        out = tmp_path / f"w{n}"
        # door-open's expert fails seed 11 (all of its 400 steps) and needs 94 for seed 12: of two workers
        # started together, the one given seed 12 finishes first
        argv = ["collect", *ARGS[:2], "--tasks", "door-open-v3", "--workers", str(n), "--image-size", "32",
                "--episodes", "2", "collect.seed=11", "env.max_steps=400", "--render-quality", "fast", "--out", str(out)]  # fmt: skip
        assert cli_main(argv) == 0
        ds = LeRobotDataset(out)
        order = [(e["seed"], e["success"], e["episode_index"], e["steps"]) for e in _journal(out)]
        runs[n] = order, ds.numeric(ACTION), ds.numeric(OBS_STATE)
    assert [o[:3] for o in runs[1][0]] == [(11, False, None), (12, True, 0), (13, True, 1)]
    assert runs[1][0][0][3] == 400 and runs[1][0][1][3] < 100
    assert runs[2][0] == runs[1][0]
    np.testing.assert_array_equal(runs[2][1], runs[1][1])
    np.testing.assert_array_equal(runs[2][2], runs[1][2])


def test_crash_between_journal_and_commit_is_redone(tmp_path):
    """A journal line whose episode the writer never committed is dropped on resume and redone."""
    out = tmp_path / "mw"
    args = ["collect", *ARGS[:2], "--tasks", "reach-v3", "--workers", "1", "--image-size", "32"]
    assert cli_main([*args, "--episodes", "1", "--out", str(out)]) == 0
    ghost = {"suite": "metaworld", "task": "reach-v3", "trial": 1, "seed": 1, "success": True, "kept": True,
             "steps": 40, "episode_index": 1}  # fmt: skip
    with open(out / JOURNAL, "a") as f:
        f.write(json.dumps(ghost) + "\n" + '{"suite": "metaworld", "ta')  # and a torn last line
    assert cli_main([*args, "--episodes", "2", "--out", str(out)]) == 0
    journal = _journal(out)
    assert [(e["seed"], e["episode_index"]) for e in journal] == [(0, 0), (1, 1)]
    assert LeRobotDataset(out).num_episodes == 2


def test_collect_refuses_bad_input(tmp_path, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("not a dataset")
    assert cli_main(["collect", "--tasks", "reach-v3", "--out", str(tmp_path / "other")]) == 2
    assert "not a dataset written by wamkit collect" in capsys.readouterr().err
    assert cli_main(["collect", "--tasks", "rech-v3", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean 'reach-v3'" in capsys.readouterr().err
    assert cli_main(["collect", "--tasks", "reach-v3", "--episodes", "0", "--out", str(tmp_path / "y")]) == 2
    assert "collect.episodes" in capsys.readouterr().err
    assert cli_main(["collect", "--suite", "libero_10", "--out", str(tmp_path / "z")]) == 2
    assert "env.suite" in capsys.readouterr().err


def test_collect_with_a_proprioceptive_state(tmp_path):
    """env.state=proprio: the dataset's state is the robot's own, 4-D with its names; the expert
    still succeeds (it reads MetaWorld's whole observation)."""
    out = tmp_path / "own"
    args = ["collect", "--tasks", "reach-v3", "--workers", "1", "--episodes", "1", "--image-size", "32"]
    assert cli_main([*args, "--out", str(out), "env.state=proprio"]) == 0
    ds = LeRobotDataset(out)
    feature = ds.meta.info["features"]["observation.state"]
    assert feature["shape"] == [4] and feature["names"] == ["hand_x", "hand_y", "hand_z", "gripper"]
    assert ds.num_episodes == 1 and _journal(out)[0]["success"]
    assert ds[0]["observation.state"].shape == (4,)


def test_collected_gripper_convention_is_recorded_not_guessed(tmp_path):
    """A MetaWorld expert's grab effort spans [0, 1] with 1 = close: read by its range alone it would
    pass for open_1 (1 = open) and every grasp would be decoded as a release. wamkit collect records
    that its actions are the env's commands, and the stats take that."""
    import numpy as np

    from wamkit.data import compute_stats

    out = tmp_path / "push"
    args = ["collect", "--tasks", "push-v3", "--workers", "1", "--episodes", "1", "--image-size", "32"]
    assert cli_main([*args, "--out", str(out)]) == 0
    ds = LeRobotDataset(out)
    assert ds.meta.info["wamkit"]["gripper"] == "env"
    grip = np.array([ds[i]["action"][-1] for i in range(len(ds))])
    assert grip.min() >= 0.0 and grip.max() > 0.5  # the range alone cannot tell the polarity
    meta = compute_stats(out).metadata
    assert meta["gripper"] == "env" and "recorded" in meta["gripper_evidence"]
    # wamkit check reads the record too: no warning that the data is open_1, and the polarity (the
    # measured one, which a recorded convention does not replace) agrees with the env
    from wamkit.check import check_dataset

    found = check_dataset(out, "metaworld", tasks=1, trials=1).of("gripper")
    assert found and found[0].level == "ok" and "recorded as env" in found[0].message, found
    assert not [f for f in found if f.level in ("warn", "error")], found


def test_only_successes_are_kept_unless_asked(tmp_path):
    """With a 5-step limit the experts fail: nothing is kept (every attempt journaled, the task given
    up after 2 * episodes + 10 attempts); with --keep-failed the failures are written."""
    base = ["collect", "--tasks", "reach-v3", "--workers", "1", "--image-size", "32", "env.max_steps=5"]
    out = tmp_path / "none"
    assert cli_main([*base, "--episodes", "1", "--out", str(out)]) == 0
    journal = _journal(out)
    assert len(journal) == 12 and not any(e["kept"] or e["success"] for e in journal)
    assert not (out / "meta" / "info.json").exists()

    out = tmp_path / "failed"
    assert cli_main([*base, "--episodes", "2", "--keep-failed", "--out", str(out)]) == 0
    ds = LeRobotDataset(out)
    assert ds.num_episodes == 2 and len(ds) == 10
    assert [e["success"] for e in _journal(out)] == [False, False]


def test_check_reads_a_proprioceptive_dataset_as_such(tmp_path):
    from wamkit.check import check_dataset

    out = tmp_path / "own"
    args = ["collect", "--tasks", "reach-v3", "--workers", "1", "--episodes", "2", "--image-size", "32"]
    assert cli_main([*args, "--out", str(out), "env.state=proprio"]) == 0
    report = check_dataset(out, "metaworld", tasks=1, trials=2)
    assert not report.errors, report.text()
    assert any(f.check == "state" and f.level == "ok" for f in report.findings), report.text()


def test_collect_with_action_noise_records_the_experts_labels_of_the_states_noise_led_to(tmp_path, capsys):
    """`--action-noise S` (DART): the env executes the expert's action plus N(0, S) noise drawn from the
    episode's own generator, the dataset records the expert's action at each state reached. Replayed
    with the same noise, the recorded states come back; without it they differ. A dataset is resumed
    with the noise it was collected with only; a negative one is refused by name."""
    from wamkit.envs.expert import NOISE_STREAM

    out = tmp_path / "dart"
    args = ["collect", "--tasks", "reach-v3", "--workers", "1", "--episodes", "1", "--image-size", "32",
            "--render-quality", "fast", "--out", str(out)]  # fmt: skip
    assert cli_main([*args, "--action-noise", "0.3", "--noise-hold", "4"]) == 0
    ds = LeRobotDataset(out)
    assert ds.meta.info["wamkit"]["action_noise"] == 0.3 and ds.meta.info["wamkit"]["noise_hold"] == 4
    entry = _journal(out)[0]
    spec = EpisodeSpec.from_dict(entry)
    states = np.stack([ds[i][OBS_STATE].numpy() for i in range(len(ds))])
    actions = np.stack([ds[i][ACTION].numpy() for i in range(len(ds))])
    env = make_env(EnvConfig(image_size=32, render_quality="fast"))
    try:
        obs, rng = env.reset(spec), np.random.default_rng([spec.seed, NOISE_STREAM])
        for t in range(len(ds)):
            np.testing.assert_array_equal(states[t], obs[OBS_STATE])
            np.testing.assert_allclose(actions[t], env.expert_action(obs), atol=1e-6)  # the expert's label
            if t % 4 == 0:  # a draw held for 4 steps
                push = rng.normal(0.0, 0.3, actions[t].shape).astype(np.float32)
            obs = env.step(actions[t] + push)[0]
        # the recorded actions executed without the noise lead elsewhere: the noise moved the hand
        plain = [env.reset(spec)[OBS_STATE]]
        for t in range(len(ds) - 1):
            plain.append(env.step(actions[t])[0][OBS_STATE])
        assert np.abs(np.stack(plain) - states).max() > 1e-3
    finally:
        env.close()
    capsys.readouterr()
    assert cli_main([*args, "--episodes", "2"]) == 2  # resumed without the noise
    assert "collect.action_noise" in capsys.readouterr().err
    assert cli_main([*args, "--episodes", "2", "--action-noise", "0.3"]) == 2  # held another number of steps
    assert (
        "'noise_hold': 4}; this run asks for {'action_noise': 0.3, 'noise_hold': 1}"
        in capsys.readouterr().err
    )
    assert cli_main([*args, "--action-noise", "0.3", "--noise-hold", "0"]) == 2
    assert "collect.noise_hold" in capsys.readouterr().err
    assert cli_main([*args, "--action-noise", "-0.1"]) == 2
    assert "collect.action_noise" in capsys.readouterr().err
    assert LeRobotDataset(out).num_episodes == 1  # nothing written was lost


def test_collect_with_late_actions_executes_the_experts_action_of_k_steps_before_in_drawn_windows(
    tmp_path, capsys
):
    """`--action-lag K --lag-prob P --noise-hold W`: each window of W steps is late with probability P
    (drawn from the episode's own generator at the window's first step); a late window executes the
    expert's action of K steps before. Replayed by hand, the recorded states come back step for step;
    the recorded actions are the expert's labels. A resume with another lag is refused by name, and so
    is a lag without a probability."""
    from wamkit.envs.expert import NOISE_STREAM

    out = tmp_path / "late"
    args = ["collect", "--tasks", "reach-v3", "--workers", "1", "--episodes", "1", "--image-size", "32",
            "--render-quality", "fast", "--out", str(out)]  # fmt: skip
    assert cli_main([*args, "--action-lag", "6", "--lag-prob", "0.5", "--noise-hold", "4"]) == 0
    ds = LeRobotDataset(out)
    assert {k: ds.meta.info["wamkit"][k] for k in ("action_lag", "lag_prob", "noise_hold")} == {
        "action_lag": 6,
        "lag_prob": 0.5,
        "noise_hold": 4,
    }
    assert "action_noise" not in ds.meta.info["wamkit"]
    spec = EpisodeSpec.from_dict(_journal(out)[0])
    states = np.stack([ds[i][OBS_STATE].numpy() for i in range(len(ds))])
    actions = np.stack([ds[i][ACTION].numpy() for i in range(len(ds))])
    env = make_env(EnvConfig(image_size=32, render_quality="fast"))
    late_steps, executed = 0, []
    try:
        obs, rng = env.reset(spec), np.random.default_rng([spec.seed, NOISE_STREAM])
        for t in range(len(ds)):
            np.testing.assert_array_equal(states[t], obs[OBS_STATE])
            np.testing.assert_allclose(actions[t], env.expert_action(obs), atol=1e-6)
            if t % 4 == 0:
                late = rng.random() < 0.5
            late_steps += late
            executed.append(actions[max(t - 6, 0)] if late else actions[t])
            obs = env.step(executed[-1])[0]
    finally:
        env.close()
    assert 0 < late_steps < len(ds)  # some windows were late, some were not
    # what the env executed is stored beside the labels, and the data stage gives a model that asks
    # for it the executed chunk, encoded as the action chunk is
    np.testing.assert_array_equal(
        np.stack([ds[i][EXECUTED_ACTION].numpy() for i in range(len(ds))]), executed
    )
    io = ModelIO(cameras=("corner",), image_size=32, state_dim=states.shape[1], action_dim=4, chunk=4)
    codec = spec_of(compute_stats(out, "raw", chunk=4), io)
    train = make_train_dataset(DataConfig(root=str(out), chunk=4), codec, extras=(EXECUTED_ACTION,))
    for i in (0, 9, len(ds) - 5):
        np.testing.assert_array_equal(
            train[i][EXECUTED_ACTION].numpy(), codec.encode_actions(executed[i : i + 4])
        )
        np.testing.assert_array_equal(train[i][ACTION].numpy(), codec.encode_actions(actions[i : i + 4]))
    capsys.readouterr()
    assert (
        cli_main([*args, "--episodes", "2", "--action-lag", "3", "--lag-prob", "0.5", "--noise-hold", "4"])
        == 2
    )
    err = capsys.readouterr().err
    assert "collect.action_lag" in err and "collect.lag_prob" not in err.split(":")[0]
    assert cli_main([*args, "--action-lag", "3"]) == 2
    assert "collect.action_lag, collect.lag_prob" in capsys.readouterr().err
    assert cli_main([*args, "--action-lag", "3", "--lag-prob", "1.5"]) == 2
    assert "collect.lag_prob" in capsys.readouterr().err


@pytest.mark.parametrize("started_ignoring_sigint", [False, True])
def test_ctrl_c_keeps_the_episodes_collected_and_waits_for_no_rollout(tmp_path, started_ignoring_sigint):
    """Ctrl-C while both workers roll out: the run finalizes the episodes it has (a readable dataset
    that a rerun resumes) and kills the rollouts in flight instead of waiting for each worker's close
    to time out (a worker blocks sending a rollout nobody reads). Also when the command was started
    with SIGINT ignored, as a background job of a non-interactive shell is (``nohup make test &``)."""
    import signal
    import sys
    import time

    from .child_env import child_env, start_logged

    out, log = tmp_path / "mw", tmp_path / "collect.log"
    # 128 px: a rollout's frames are megabytes, far more than a pipe holds
    cmd = [sys.executable, "-m", "wamkit", "collect", *ARGS, "--image-size", "128", "--episodes", "50"]
    cmd += ["--out", str(out)]
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if started_ignoring_sigint else None
    proc = start_logged(cmd, log, env=child_env(), preexec_fn=ignore)
    try:
        deadline = time.monotonic() + 240
        while not ((out / JOURNAL).is_file() and len(_journal(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "did not exit within" not in text and "Traceback" not in text, text[-3000:]
    # finalized with what was committed (an episode being written at the Ctrl-C is dropped, and redone
    # by a rerun, as its journal line is reconciled away)
    assert LeRobotDataset(out).num_episodes >= 1
