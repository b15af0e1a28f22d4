"""Success rates with Wilson 95% intervals, per task and per suite, from journal records.

A record is one finished episode (see :mod:`wamkit.eval.journal`): it carries ``suite``, ``task``,
``trial``, ``success_once`` (the task's success flag was true at any step), ``success_at_end`` (true at
the last step), ``length`` (policy steps) and ``return`` (summed reward).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` in [0, 1] for ``successes`` out of ``n``.

    Unlike the normal approximation it stays inside [0, 1] and is honest at 0/n and n/n; at n = 500
    and p near 0.5 its half-width is about 0.044, near p = 0.95 about 0.019. ``n = 0`` gives (0, 1).
    """
    if n < 0 or successes < 0 or successes > n:
        raise ValueError(f"wilson_interval: need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends, no rounding residue
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


@dataclass
class Rate:
    """Success statistics of a group of episodes (one task, or a whole suite)."""

    episodes: int
    success_once: int
    success_at_end: int
    rate: float  # success_once / episodes: the protocol's headline number
    ci95: tuple[float, float]  # Wilson interval of ``rate``
    rate_at_end: float
    mean_length: float  # policy steps
    mean_return: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ci95"] = list(self.ci95)
        return d


def rate_of(records: Iterable[dict[str, Any]]) -> Rate:
    recs = list(records)
    n = len(recs)
    once = sum(bool(r["success_once"]) for r in recs)
    end = sum(bool(r["success_at_end"]) for r in recs)
    return Rate(
        episodes=n,
        success_once=once,
        success_at_end=end,
        rate=once / n if n else 0.0,
        ci95=wilson_interval(once, n),
        rate_at_end=end / n if n else 0.0,
        mean_length=sum(r["length"] for r in recs) / n if n else 0.0,
        mean_return=sum(r["return"] for r in recs) / n if n else 0.0,
    )


def summarize(
    records: Iterable[dict[str, Any]], categories: dict[str, dict[str, str]] | None = None
) -> dict[str, Any]:
    """``{"suites": {suite: {"all": Rate, "tasks": {task: Rate}}}, "all": Rate}`` as plain dicts.

    Tasks keep the order in which they first appear; a suite's rate pools its episodes (so a task with
    more trials weighs more, as the protocols count it). ``categories``: suite -> task -> category,
    for suites whose tasks fall in categories (a robustness suite's perturbations); such a suite also
    gets ``"categories": {category: Rate}``, pooled the same way.
    """
    recs = list(records)
    by_suite: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in recs:
        by_suite.setdefault(r["suite"], {}).setdefault(str(r["task"]), []).append(r)
    suites = {}
    for suite, tasks in by_suite.items():
        pooled = [r for rs in tasks.values() for r in rs]
        suites[suite] = {
            "all": rate_of(pooled).to_dict(),
            "tasks": {task: rate_of(rs).to_dict() for task, rs in tasks.items()},
        }
        of = (categories or {}).get(suite)
        if of:
            grouped: dict[str, list[dict[str, Any]]] = {}
            for task, rs in tasks.items():
                grouped.setdefault(of.get(task, "uncategorised"), []).extend(rs)
            suites[suite]["categories"] = {c: rate_of(rs).to_dict() for c, rs in grouped.items()}
    return {"suites": suites, "all": rate_of(recs).to_dict()}


def failure_reasons(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """How many failed episodes ended for each reason (``"max_steps"``, ``"terminated"``,
    ``"env_error"``, ...); an ``env_error``'s message is left out here (see :func:`env_error_episodes`)."""
    counts: dict[str, int] = {}
    for r in records:
        if not r["success_once"]:
            reason = (r.get("failure") or "unknown").split(":", 1)[0]
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def env_error_episodes(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episodes recorded as ``env_error`` failures: ``{"episode", "error", "attempts"}`` each."""
    out = []
    for r in records:
        kind, _, message = (r.get("failure") or "").partition(": ")
        if kind == "env_error":
            key = f"{r['suite']}/{r['task']}/{r['trial']}/{r['seed']}"
            out.append({"episode": key, "error": message, "attempts": int(r.get("env_errors", 1))})
    return sorted(out, key=lambda e: e["episode"])
