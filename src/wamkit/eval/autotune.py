"""``--pipeline auto``: measure simulation and inference on a warm-up, then pick the stage count P.

The warm-up resets N envs on the first episodes, applies two rounds of chunks (the first one warms
caches and is not measured) and times:

- ``t_step``: worker busy seconds per env step (IPC included);
- ``t_infer(b)``: the server's inference seconds for one request of b observations, for every
  candidate batch b = N / P.

For each P dividing N, one *cycle* (every stage simulates k = replan_interval steps and asks once) takes
at least each of: the workers' share of the simulation ``N k t_step / W``, the server's share
``P t_infer(N/P)``, and one stage's own loop ``k t_step ceil((N/P) / W) + t_infer(N/P)``. The predicted
cycle is their maximum; the P with the shortest one wins (the smaller P on a tie). The warm-up's envs
are reset again by the real run, so it changes no result.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from wamkit.config import EvalConfig
from wamkit.envs.base import EpisodeSpec
from wamkit.eval.executors import Executor
from wamkit.eval.scheduler import layout

log = logging.getLogger(__name__)


def predict_cycle(p: int, num_envs: int, workers: int, k: int, t_step: float, t_infer: float) -> float:
    """Seconds per cycle with ``p`` stages (see the module docstring); ``t_infer`` at batch N/p."""
    b = num_envs // p
    sim_share = num_envs * k * t_step / workers
    stage_loop = k * t_step * math.ceil(b / workers) + t_infer
    return max(sim_share, p * t_infer, stage_loop)


def _advance(ex: Executor, slots: list[tuple[int, int]], chunks: np.ndarray) -> tuple[list[dict], float]:
    """Apply one chunk per slot; return the last observations and the summed worker busy time."""
    by_worker: dict[int, list[int]] = {}
    for i, (w, _) in enumerate(slots):
        by_worker.setdefault(w, []).append(i)
    calls = {
        w: ex.call(w, ex.generation(w), "advance", {"actions": {slots[i][1]: chunks[i] for i in idx}})
        for w, idx in by_worker.items()
    }
    obs: list[dict] = [{} for _ in slots]
    busy = 0.0
    for w, fut in calls.items():
        res, dt = fut.result()
        busy += dt
        for i in by_worker[w]:
            obs[i] = res[slots[i][1]]["obs"]
    return obs, busy


def choose_stages(
    ex: Executor,
    make_policy: Callable[[], Callable],
    episodes: list[EpisodeSpec],
    num_envs: int,
    ecfg: EvalConfig,
) -> tuple[int, dict[str, Any]]:
    """Measure on a warm-up and return ``(P, report)``; ``report`` holds the measurements and predictions."""
    workers = ex.num_workers
    k = ecfg.replan_interval
    slots = layout(num_envs, 1, workers)[0][0]
    specs = [episodes[i % len(episodes)] for i in range(num_envs)]
    by_worker: dict[int, dict[int, EpisodeSpec]] = {}
    for (w, s), spec in zip(slots, specs):
        by_worker.setdefault(w, {})[s] = spec
    futs = {w: ex.call(w, ex.generation(w), "reset", d) for w, d in by_worker.items()}
    first = {w: f.result()[0] for w, f in futs.items()}
    obs = [first[w][s] for w, s in slots]
    policy = make_policy()
    try:
        steps = busy = 0.0
        for round_ in range(2):
            chunks, _ = policy(obs)
            chunks = np.asarray(chunks)[:, :k]
            obs, dt = _advance(ex, slots, chunks)
            if round_ == 1:
                steps, busy = chunks.shape[0] * chunks.shape[1], dt
        t_step = busy / max(1.0, steps)
        candidates = [p for p in range(1, num_envs + 1) if num_envs % p == 0 and p <= 8]
        t_infer = {}
        for p in candidates:
            b = num_envs // p
            t_infer[p] = statistics.median(policy(obs[:b])[1] for _ in range(3))
    finally:
        close = getattr(policy, "close", None)
        if close is not None:
            close()
    cycles = {p: predict_cycle(p, num_envs, workers, k, t_step, t_infer[p]) for p in candidates}
    best = min(candidates, key=lambda p: (round(cycles[p], 6), p))
    report = {"t_step": t_step, "t_infer": t_infer, "cycle": cycles, "chosen": best}
    log.info(
        "pipeline auto: %.1f ms per env step, inference %s ms -> P=%d (predicted cycle %s ms)",
        1000 * t_step,
        {p: round(1000 * t, 1) for p, t in t_infer.items()},
        best,
        {p: round(1000 * c, 1) for p, c in cycles.items()},
    )
    return best, report
