"""Open-loop replay of a dataset written by ``wamkit collect``: its journal names each episode
``(suite, task, trial, seed)``, so the env can start it again and play the recorded actions back: the
``executed_action`` column where a perturbed collection wrote one (its labels are the expert's, not what
the env was given), the ``action`` column otherwise."""

from __future__ import annotations

import numpy as np

from wamkit.check.probe import DataView
from wamkit.check.report import Report


def _played(data: DataView) -> tuple[str, np.ndarray]:
    """The column the replay plays, and its rows."""
    return ("action", data.actions) if data.executed is None else ("executed_action", data.executed)


def replay(env, data: DataView, episodes: int) -> tuple[int, int]:
    """Replay up to ``episodes`` journaled episodes the expert solved (a kept failure is not expected to
    succeed again); ``(successes, replayed)``."""
    named = [(i, ep) for i, ep in enumerate(data.episodes) if ep in data.solved][:episodes]
    _, played = _played(data)
    ends = data.starts[1:] + [len(played)]
    wins = 0
    for i, ep in named:
        env.reset(data.journal[ep])
        success = False
        for action in played[data.starts[i] : ends[i]]:
            _, _, terminated, truncated, info = env.step(np.asarray(action, np.float32))
            success = success or bool(info["success"])
            if terminated or truncated:
                break
        wins += success
    return wins, len(named)


def check_replay(env, data: DataView, report: Report, episodes: int) -> None:
    if not data.journal:
        report.add("replay", "info", "no collect journal (not written by wamkit collect): replay skipped")
        return
    if episodes <= 0:
        return
    if not data.solved:
        report.add("replay", "info", "the journal holds no episode the expert solved: replay skipped")
        return
    wins, n = replay(env, data, episodes)
    rate = wins / n if n else 0.0
    level = "ok" if wins == n else "warn"
    fix = (
        ""
        if wins == n
        else "the installed simulator no longer reproduces the recorded episodes: see the drift pins"
    )
    column, _ = _played(data)
    report.add(
        "replay",
        level,
        f"replayed {n} recorded episode(s) open-loop ({column}): {wins} succeeded ({rate:.0%})",
        fix,
    )
