"""The convention checker: does a LeRobot dataset agree with a simulated suite? (``wamkit check``)

It sits above ``envs/`` and ``data/`` (it reads a dataset and builds an env) and reports, before anyone
trains or evaluates, each mismatch with the setting that fixes it: state dimensions the data never
covers where the env starts (an antipodal quaternion flip, another state source or quaternion order),
the gripper's range and polarity, image orientation, fps, action dimension and range, render look;
for datasets written by ``wamkit collect`` it also replays recorded actions open-loop.
"""

from __future__ import annotations

from pathlib import Path

from wamkit import embodiments
from wamkit.check.checks import (
    check_action,
    check_fps,
    check_gripper,
    check_images,
    check_render,
    check_state,
)
from wamkit.check.probe import DataView, EnvProbe, env_config, probe_env, read_dataset, state_option
from wamkit.check.replay import check_replay
from wamkit.check.report import Finding, Report
from wamkit.envs.base import EpisodeSpec, episode_seed

__all__ = ["DataView", "EnvProbe", "Finding", "Report", "check_dataset", "plan_probe", "read_dataset"]


def plan_probe(
    data: DataView, suite: str, seed_rule: str, tasks: int = 2, trials: int = 2
) -> list[EpisodeSpec]:
    """The env episodes to compare with: the journal's (the same episodes) when there is one, its first
    ``trials`` of each of its first ``tasks`` tasks; else trials 0.. of the dataset's first ``tasks``
    tasks the suite knows (else the suite's first tasks)."""
    from wamkit.envs.suites import backend

    named = [data.journal[ep] for ep in (data.episodes[i] for i in data.framed) if ep in data.journal]
    if named:
        # the journal lists a task's episodes together: its first few would all be one task's
        per_task: dict[str, list[EpisodeSpec]] = {}
        for spec in named:
            per_task.setdefault(spec.task, []).append(spec)
        return [s for specs in list(per_task.values())[:tasks] for s in specs[:trials]]
    by_text = {text: name for name, text in backend(suite).task_texts(suite).items()}
    names = (
        list(dict.fromkeys(by_text[t] for t in data.tasks if t in by_text))[:tasks]
        or list(by_text.values())[:tasks]
    )
    return [EpisodeSpec(suite, n, t, episode_seed(seed_rule, 0, t)) for n in names for t in range(trials)]


def _env_cameras(data: DataView, suite: str) -> list[str]:
    known = embodiments.for_suite(suite).cameras
    return [c for c in data.cameras if c in known] or [next(iter(known))]


def check_dataset(
    root: str | Path, suite: str, env=None, tasks: int = 2, trials: int = 2, replay: int = 0
) -> Report:
    """Compare the dataset at ``root`` with ``suite``; ``env``: an env of that suite to reuse (built here
    otherwise, at the dataset's image size and the suite's protocol look). ``replay``: episodes to play
    back open-loop when the dataset has a collect journal."""
    from wamkit.envs.suites import backend, make_env, resolve_env_config

    data = read_dataset(root, suite)
    size = next(iter(data.first_frames.values())).shape[1] if data.first_frames else 64
    state = state_option(data, suite)
    cfg = resolve_env_config(env_config(suite, _env_cameras(data, suite), size, "auto", state))
    own = env is None
    env = make_env(cfg) if own else env
    try:
        specs = plan_probe(data, suite, cfg.seed_rule, tasks, trials)
        probe = probe_env(env, specs, [c for c in cfg.cameras if c in data.first_frames])
        report = Report(str(root), suite, probe.describe())
        mod = backend(suite)
        check_fps(data, probe, report)
        profile = embodiments.for_suite(suite)
        check_action(data, probe, report, profile.action_names, profile.absolute_actions)
        check_gripper(data, probe, report, mod.finger_width, profile.gripper_close, profile.gripper_open)
        kept = profile.state_dims(state)  # the dims the dataset's state holds, of the suite's whole state
        axis = tuple(kept.index(d) for d in profile.axis_angle_dims if d in kept)
        check_state(data, probe, report, profile.state_names_of(state), axis, profile.state_source)
        check_images(data, probe, report)
        check_render(data, report, cfg.render_quality)
        check_replay(env, data, report, replay)
    finally:
        if own:
            env.close()
    return report
