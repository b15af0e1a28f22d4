"""``--pipeline auto``: pick the stage count P from the calibration (:mod:`wamkit.eval.calibrate`).

The calibration measured, before the timed part and on a warm server:

- ``t_step``: one worker's busy seconds per env step (IPC included);
- ``t_infer(b)``: the server's seconds for one request of b observations, for every candidate batch
  b = N / P (each size sent once untimed first, so a cold first call cannot pick the wrong P).

For each P dividing N (up to 8; with S servers, the multiples of S: each server serves P/S whole
stages), one *cycle* (every stage simulates k = replan_interval steps and asks once) takes at least each
of: the workers' share of the simulation ``N k t_step / W``, the busiest server's share
``ceil(P / S) t_infer(N/P)``, and one stage's own loop ``k t_step ceil((N/P) / W) + t_infer(N/P)``. The
predicted cycle is their maximum; the P with the shortest one wins (the smaller P on a tie).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from wamkit.eval.calibrate import Calibration, auto_candidates

log = logging.getLogger(__name__)


def predict_cycle(
    p: int, num_envs: int, workers: int, k: int, t_step: float, t_infer: float, servers: int = 1
) -> float:
    """Seconds per cycle with ``p`` stages (see the module docstring); ``t_infer`` at batch N/p."""
    b = num_envs // p
    sim_share = num_envs * k * t_step / workers
    stage_loop = k * t_step * math.ceil(b / workers) + t_infer
    return max(sim_share, math.ceil(p / servers) * t_infer, stage_loop)


def choose_stages(
    cal: Calibration, num_envs: int, workers: int, k: int, servers: int = 1
) -> tuple[int, dict[str, Any]]:
    """``(P, report)``; ``report`` holds the inputs and the predicted cycle of every candidate."""
    candidates = auto_candidates(num_envs, servers)
    t_infer = {p: cal.latency_at(num_envs // p) for p in candidates}
    cycles = {p: predict_cycle(p, num_envs, workers, k, cal.t_step, t_infer[p], servers) for p in candidates}
    best = min(candidates, key=lambda p: (round(cycles[p], 6), p))
    log.info(
        "pipeline auto: %.1f ms per env step, inference %s ms -> P=%d (predicted cycle %s ms)",
        1000 * cal.t_step,
        {p: round(1000 * t, 1) for p, t in t_infer.items()},
        best,
        {p: round(1000 * c, 1) for p, c in cycles.items()},
    )
    return best, {"t_step": cal.t_step, "t_infer": t_infer, "cycle": cycles, "chosen": best}
