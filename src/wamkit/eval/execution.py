"""How an env executes the chunks it is sent: synchronously, or as a robot does while the policy thinks.

``eval.execution=sync`` stops the world while a request is in flight: a request at step ``t`` is answered
before step ``t`` runs, and the env executes the first ``R`` (``eval.replan_interval``) actions of the
reply. ``async`` keeps it running: the request is sent with the observation of step ``t``, the env goes
on executing what it was last told for ``d`` (``eval.delay_steps``) steps, and the new chunk takes over
at step ``t + d`` with its action ``d`` (its first ``d`` actions were for steps already taken). The next
request goes out at ``t + R``. Time is simulated in control steps, not measured, so a run is
reproducible and its journal resumes it; the pipelined scheduler still overlaps simulation and
inference, because the ``d`` steps of the old chunk do not depend on the reply and run with the new
chunk's ``R - d`` in one ``advance`` call.

The first request of an episode is answered before the episode's first step (a robot waits for its
first chunk; the scene is at rest until then). Every request needs ``d <= R`` (one request in flight per
env) and ``R + d <= H`` (the old chunk covers the steps its successor is late for).

How consecutive chunks meet (``eval.chunk_blend``): ``switch`` executes the new chunk from its action
``d``; ``rtc`` does the same with a chunk the server sampled as an inpainting of the old chunk's
unexecuted actions (the request carries them, :mod:`wamkit.models.rtc`); ``ensemble`` is ACT's temporal
ensembling (Zhao et al. 2023; LeRobot's ``ACTTemporalEnsembler``, ``policies/act/modeling_act.py``
lines 169-257): step ``t`` executes the average of
every chunk's action for ``t`` that has arrived, weighted ``exp(-m i)`` with ``i = 0`` the oldest
chunk (``m = eval.ensemble_coeff``, ACT's 0.01).

Smoothness: the second difference of the executed actions ``a_t - 2 a_{t-1} + a_{t-2}`` (for MetaWorld's
position deltas, the end effector's jerk), its norm averaged over the windows that straddle a chunk
boundary (``t`` or ``t - 1`` is the first step of a new chunk) and over the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wamkit.config import ConfigError, EvalConfig


class ExecutionError(ConfigError):
    """Execution settings that cannot hold together (``eval.delay_steps``, ``eval.replan_interval``, the
    model's chunk): a config error, printed in one line naming the keys."""


SYNC_RECORD = {"mode": "sync", "delay_steps": 0, "chunk_blend": "switch"}  # every run before the setting


@dataclass(frozen=True)
class ActionExecution:
    """The resolved execution settings of a run (``delay_steps`` is a number here)."""

    mode: str = "sync"
    delay: int = 0
    blend: str = "switch"
    ensemble_coeff: float = 0.01
    rtc_schedule: str = "exp"
    rtc_max_guidance: float = 5.0

    @classmethod
    def of(cls, ecfg: EvalConfig, delay: int | None = None) -> ActionExecution:
        d = ecfg.delay_steps if delay is None else delay
        if not isinstance(d, int):
            raise ExecutionError(f"eval.delay_steps={d!r} must be resolved to a number before the run")
        if ecfg.execution == "async" and d > ecfg.replan_interval:
            raise ExecutionError(
                f"eval.delay_steps={d} exceeds eval.replan_interval={ecfg.replan_interval}: an env asks "
                "again every replan_interval steps and keeps one request in flight; raise the interval"
            )
        return cls(
            ecfg.execution,
            d if ecfg.execution == "async" else 0,
            ecfg.chunk_blend,
            ecfg.ensemble_coeff,
            ecfg.rtc_schedule,
            ecfg.rtc_max_guidance,
        )

    def record(self) -> dict[str, Any]:
        """plan.json's ``execution`` entry (what a run before it did: :data:`SYNC_RECORD`)."""
        out: dict[str, Any] = {"mode": self.mode, "delay_steps": self.delay, "chunk_blend": self.blend}
        if self.blend == "ensemble":
            out["ensemble_coeff"] = self.ensemble_coeff
        if self.blend == "rtc":
            out |= {"rtc_schedule": self.rtc_schedule, "rtc_max_guidance": self.rtc_max_guidance}
        return out


@dataclass
class ChunkPlan:
    """One env's chunks in one episode: what it executes next, and the smoothness of what it did."""

    ex: ActionExecution
    replan: int
    chunks: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (step it starts at, [H, D])
    executed: list[np.ndarray] = field(default_factory=list)  # the last two actions executed
    boundary: list[float] = field(default_factory=lambda: [0.0, 0.0])  # (sum of norms, windows)
    within: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _starts: set[int] = field(default_factory=set)  # steps that begin a new chunk's execution

    def request_fields(self, step: int) -> dict[str, Any]:
        """What a request sent at ``step`` carries for real-time chunking (nothing otherwise, and
        nothing for an episode's first request)."""
        if self.ex.blend != "rtc" or not self.chunks:
            return {}
        start, chunk = self.chunks[-1]
        return {
            "prev_actions": chunk[step - start :],
            "delay": self.ex.delay,
            "rtc_schedule": self.ex.rtc_schedule,
            "rtc_max_guidance": self.ex.rtc_max_guidance,
        }

    def receive(self, step: int, chunk: np.ndarray) -> list[np.ndarray]:
        """The reply to the request sent at ``step`` arrived: the actions for steps ``step .. step + R - 1``."""
        h = chunk.shape[0]
        first = not self.chunks
        d = 0 if first else self.ex.delay
        if self.replan + d > h:
            raise ExecutionError(
                f"eval.replan_interval ({self.replan}) + eval.delay_steps ({d}) exceeds the model's chunk "
                f"of {h} actions: the old chunk would run out before the new one arrives"
            )
        if not first:
            last_start, last = self.chunks[-1]
            if step + d > last_start + last.shape[0]:
                raise ExecutionError(f"the chunk of step {last_start} does not cover steps up to {step + d}")
        self.chunks.append((step, np.asarray(chunk, np.float32)))
        if self.ex.blend != "ensemble":
            self.chunks = self.chunks[-2:]
        else:  # chunks still covering a future step
            self.chunks = [(s, c) for s, c in self.chunks if s + c.shape[0] > step]
        if not first:
            self._starts.add(step + d)
        return [self._action(step + j, arrived=j >= d) for j in range(self.replan)]

    def _action(self, t: int, arrived: bool) -> np.ndarray:
        usable = self.chunks if arrived else self.chunks[:-1]
        if self.ex.blend != "ensemble":
            start, chunk = usable[-1]
            return chunk[t - start]
        covering = [c[t - s] for s, c in usable if s <= t < s + c.shape[0]]
        w = np.exp(-self.ex.ensemble_coeff * np.arange(len(covering)))
        return (np.tensordot(w, np.stack(covering), axes=1) / w.sum()).astype(np.float32)

    def executed_steps(self, start_step: int, actions: list[np.ndarray]) -> None:
        """``actions`` ran from ``start_step`` on (an episode that ended stops early): count smoothness."""
        for k, a in enumerate(actions):
            t = start_step + k
            if len(self.executed) == 2:
                jerk = float(np.linalg.norm(a - 2 * self.executed[1] + self.executed[0]))
                side = self.boundary if (t in self._starts or t - 1 in self._starts) else self.within
                side[0] += jerk
                side[1] += 1
            self.executed = [*self.executed[-1:], np.asarray(a, np.float32)]

    def smoothness(self) -> dict[str, float]:
        return {
            "jerk_boundary_sum": self.boundary[0],
            "jerk_boundary_n": int(self.boundary[1]),
            "jerk_within_sum": self.within[0],
            "jerk_within_n": int(self.within[1]),
        }


def pooled_smoothness(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """Mean jerk at chunk boundaries and within chunks over episodes' records (None if none say)."""
    got = [r["smoothness"] for r in records if isinstance(r.get("smoothness"), dict)]
    if not got:
        return None
    out = {}
    for side in ("boundary", "within"):
        n = sum(g[f"jerk_{side}_n"] for g in got)
        out[f"jerk_{side}"] = sum(g[f"jerk_{side}_sum"] for g in got) / n if n else float("nan")
    return out
