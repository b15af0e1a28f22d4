"""Both sides of a convention check, read once: what a dataset holds, and what the env produces.

:class:`DataView` reads a LeRobot dataset's states, actions, episode starts and the first frame of each
episode (and, for datasets written by ``wamkit collect``, the episode names of its journal).
:class:`EnvProbe` resets the env for a few episodes and keeps the state and frames after reset, and how
the fingers answer a gripper command (the env's own polarity, measured, not assumed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wamkit import embodiments
from wamkit.config import EnvConfig
from wamkit.constants import ACTION, EPISODE_INDEX, EXECUTED_ACTION, OBS_STATE, TASK, image_key
from wamkit.envs.base import EpisodeSpec
from wamkit.envs.collect_journal import JOURNAL

IMAGE_PREFIX = "observation.images."


@dataclass
class DataView:
    root: Path
    fps: int
    info: dict[str, Any]
    states: np.ndarray  # [N, S] float64, episode order
    actions: np.ndarray  # [N, A]
    episode_of_row: np.ndarray  # [N]
    starts: list[int]  # first row of each episode, in ``episodes`` order
    episodes: list[int]
    tasks: list[str]  # task text of each episode
    # camera name -> uint8 [F, H, W, 3]: the first frame of each episode of ``framed``
    first_frames: dict[str, np.ndarray]
    framed: list[int] = field(default_factory=list)  # positions in ``episodes`` of first_frames' rows
    journal: dict[int, EpisodeSpec] = field(default_factory=dict)  # episode index -> its spec
    solved: set[int] = field(default_factory=set)  # journaled episodes the expert solved
    # [N, A]: what the env was given, where a perturbed collection (action noise, late actions) recorded
    # it beside the expert's labels in ``actions``; None where the labels are what was executed
    executed: np.ndarray | None = None

    @property
    def cameras(self) -> list[str]:
        return list(self.first_frames)


def _journal_specs(root: Path, suite: str) -> tuple[dict[int, EpisodeSpec], set[int]]:
    """The journal's kept episodes, index -> spec, and the indices of those the expert solved."""
    path = root / JOURNAL
    if not path.is_file():
        return {}, set()
    out, solved = {}, set()
    for line in path.read_text().splitlines():
        entry = json.loads(line) if line.strip() else {}
        if entry.get("kept") and entry.get("episode_index") is not None:
            out[int(entry["episode_index"])] = EpisodeSpec(
                suite, entry["task"], entry["trial"], entry["seed"]
            )
            if entry.get("success"):
                solved.add(int(entry["episode_index"]))
    return out, solved


def read_dataset(root: str | Path, suite: str, max_episodes: int = 20, per_task: int = 4) -> DataView:
    """States and actions of every frame; first frames of the first ``per_task`` episodes of each task,
    ``max_episodes`` in all (a dataset usually holds one task's episodes, then the next task's)."""
    from wamkit.data import LeRobotDataset

    ds = LeRobotDataset(root)
    ep_of_row = ds.numeric(EPISODE_INDEX).reshape(-1)
    starts = [ds.episode_bounds(r)[0] for r in np.flatnonzero(np.r_[True, ep_of_row[1:] != ep_of_row[:-1]])]
    episodes = [int(ep_of_row[s]) for s in starts]
    frames: dict[str, list[np.ndarray]] = {}
    tasks, framed = [], []
    for i, s in enumerate(starts):
        item = ds[s]
        tasks.append(item[TASK])
        if len(framed) >= max_episodes or tasks.count(item[TASK]) > per_task:
            continue
        framed.append(i)
        for key in ds.camera_keys:
            frames.setdefault(key.removeprefix(IMAGE_PREFIX), []).append(item[key].numpy())
    journal, solved = _journal_specs(Path(root), suite)
    return DataView(
        root=Path(root),
        fps=ds.fps,
        info=ds.meta.info,
        states=ds.numeric(OBS_STATE).astype(np.float64),
        actions=ds.numeric(ACTION).astype(np.float64),
        episode_of_row=ep_of_row,
        starts=starts,
        episodes=episodes,
        tasks=tasks,
        first_frames={c: np.stack(v) for c, v in frames.items()},
        framed=framed,
        journal=journal,
        solved=solved,
        executed=ds.numeric(EXECUTED_ACTION).astype(np.float64)
        if EXECUTED_ACTION in ds.meta.features
        else None,
    )


@dataclass
class EnvProbe:
    suite: str
    fps: int
    state_dim: int
    action_dim: int
    specs: list[EpisodeSpec]
    texts: list[str]  # the task text (instruction) of each spec
    states: np.ndarray  # [K, S] after reset
    frames: dict[str, np.ndarray]  # camera -> uint8 [K, H, W, 3] after reset
    close_shrinks: bool  # the profile's close command closes the fingers (measured)
    # every start a dataset of this suite may begin from -> [K, S] (stored initial states: right after setting one,
    # and after the settle steps, which reset returns); one entry, "reset", for an env with one start
    starts: dict[str, np.ndarray] = field(default_factory=dict)

    def describe(self) -> str:
        tasks = sorted({s.task for s in self.specs})
        return f"{len(self.specs)} env resets over {len(tasks)} task(s), {self.suite} protocol"


def env_config(
    suite: str, cameras: list[str], image_size: int, render_quality: str, state: str = "full"
) -> EnvConfig:
    return EnvConfig(
        suite=suite,
        tasks=[],
        cameras=cameras,
        image_size=image_size,
        render_quality=render_quality,
        state=state,
    )


def state_option(data: DataView, suite: str) -> str:
    """The ``env.state`` a dataset was recorded with, by its state width: ``proprio`` where that is
    the robot's own part of the suite's state and narrower than the whole, else ``full``."""
    profile = embodiments.for_suite(suite)
    own = profile.state_dims("proprio") if profile is not None else ()
    width = data.states.shape[1] if data.states.ndim == 2 else 0
    return "proprio" if profile is not None and width == len(own) < profile.state_dim else "full"


def probe_env(env, specs: list[EpisodeSpec], cameras: list[str]) -> EnvProbe:
    """Reset ``env`` for each of ``specs``; then, from the last, command the profile's gripper open value
    for a few steps and its close value for a few more, the arm held where it is."""
    from wamkit.envs.suites import backend, suite_info

    info = suite_info(env.suite)
    states, texts, frames = [], [], {c: [] for c in cameras}
    starts: dict[str, list[np.ndarray]] = {}
    for spec in specs:
        obs = env.reset(spec)
        texts.append(str(obs[TASK]))
        states.append(np.asarray(obs[OBS_STATE], np.float64))
        for c in cameras:
            frames[c].append(obs[image_key(c)])
        for kind, o in (getattr(env, "reset_starts", None) or {"reset": obs}).items():
            starts.setdefault(kind, []).append(np.asarray(o[OBS_STATE], np.float64))
    profile = embodiments.for_suite(env.suite)
    # hold the arm (zero deltas, or the joint targets it is at) and command the grippers open, then
    # closed: the fingers' opening after each says which way the close command moves them (from a
    # reset whose fingers are nearly closed, closing alone would barely move them)
    hold = profile.hold_action(states[-1] if profile.absolute_actions else None)
    widths = []
    for value in (profile.gripper_open, profile.gripper_close):
        command = hold.copy()
        command[list(profile.grippers)] = value
        for _ in range(5):
            obs, *_ = env.step(command)
        widths.append(float(backend(env.suite).finger_width(np.asarray(obs[OBS_STATE], np.float64))))
    return EnvProbe(
        suite=env.suite,
        fps=info.fps,
        state_dim=len(states[-1]),  # what the env gives (env.state: full or the robot's own)
        action_dim=info.action_dim,
        specs=list(specs),
        texts=texts,
        states=np.stack(states),
        frames={c: np.stack(v) for c, v in frames.items()},
        close_shrinks=widths[1] < widths[0],
        starts={k: np.stack(v) for k, v in starts.items()},
    )
