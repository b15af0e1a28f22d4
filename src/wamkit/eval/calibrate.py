"""Calibration: simulation and inference measured apart, before the timed part, for an independent bound.

A run's efficiency is its wall time against a bound. If the bound came from the run's own busy times,
a schedule that made simulation or inference slower (IPC per call, contention, a cold server) would
raise its own bound and still look efficient. So before the clock starts, on the very envs of the run
and against the very server, :func:`calibrate` measures:

- ``t_step``: one worker's busy seconds per env step, with no server in the loop: every slot applies
  ``replan_interval`` actions per call (actions from one warm-up reply), all workers at once, IPC
  included; ``t_reset``: the same per episode start; each the median over rounds. The slots come
  started by :func:`start_envs`, which builds their simulators: the run needs them anyway, so that
  is done before the calibration and not counted in its time;
- ``latency(b)``: the server's seconds for one request of ``b`` observations (its reported model time,
  the round trip when it reports none), for each batch size the run can send; every size is sent once
  untimed first (a cold first call of a shape is compilation or allocation, not inference), then timed
  a few times; the median is kept. Sizes in between are interpolated linearly. With S servers every
  server is measured (and so warmed) in turn, each in 1/S of the inference half.

:func:`independent_bound` turns them into ``max(sim, infer)`` for the work the run did:
``sim = (t_step × env steps + t_reset × episode starts) / workers`` and ``infer = Σ latency(B)`` over
the server's model calls (a request of ``b`` observations served in a call of ``B`` counts
``latency(B) × b / B``, so a call that merged several stages' requests counts once), each request at
its own server's latency, divided by S: S servers answer S requests at once. A server that drops out
mid-run therefore shows as lost efficiency, not as a lower capacity.

The budget, ``eval.calibrate_s``, covers everything :func:`calibrate` does: the inference side
(connections, the warm-up reply, cold, warm and timed calls) takes at most half, the simulation side
(the timed starts and chunks) what is left, and at least half. Each side stops before a call or round
that would end past its deadline, and does no less than its floor however long that takes: per server
and batch size a cold call, ``WARM_CALLS`` warm calls and one timed call; one timed start of every
slot and one timed chunk. A run whose floor exceeds the budget (a simulator that takes seconds per
start, a model that takes seconds per call) calibrates for its floor; the log line says how long.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from wamkit.envs.base import EpisodeSpec
from wamkit.eval.backends.base import as_connection
from wamkit.eval.chunk_host import ERROR
from wamkit.eval.executors import EnvWorkerPool
from wamkit.eval.scheduler import layout

log = logging.getLogger(__name__)
MAX_TIMED_CALLS = 10  # per batch size: enough for a median
WARM_CALLS = 2  # untimed calls per batch size after its first, at least
MAX_SIM_ROUNDS = 200


def interpolate(table: dict[int, float], b: float) -> float:
    """Seconds for a call of ``b`` observations: piecewise linear through the measured sizes, extended
    along the nearest segment (or proportionally, when one size was measured)."""
    sizes = sorted(table)
    if len(sizes) == 1:
        return table[sizes[0]] * b / sizes[0]
    if b in table:
        return table[int(b)]
    i = 1
    while i < len(sizes) - 1 and sizes[i] < b:
        i += 1
    lo, hi = sizes[i - 1], sizes[i]
    slope = (table[hi] - table[lo]) / (hi - lo)
    return max(0.0, table[lo] + slope * (b - lo))


@dataclass
class Calibration:
    t_step: float  # one worker's busy seconds per env step
    t_reset: float  # one worker's busy seconds per episode start
    # batch size -> server seconds per request of that many observations (the servers' mean)
    latency: dict[int, float]
    seconds: float = 0.0  # how long the calibration took
    server_latency: list[dict[int, float]] = field(default_factory=list)  # per server, when several

    def latency_at(self, b: float, server: int | None = None) -> float:
        """Seconds for a call of ``b`` observations (:func:`interpolate`), at server ``server``'s
        latency when it was measured apart, else the servers' mean."""
        if server is not None and server < len(self.server_latency):
            return interpolate(self.server_latency[server], b)
        return interpolate(self.latency, b)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["latency"] = {str(b): s for b, s in sorted(self.latency.items())}
        out["server_latency"] = [{str(b): s for b, s in sorted(t.items())} for t in self.server_latency]
        return out


def batch_sizes(num_envs: int, stages: int, servers: int = 1) -> list[int]:
    """The request sizes a run can send: 1 (a last straggler), N/P, N (merged calls); with ``stages``
    0 (auto), N/P for every candidate P."""
    if stages:
        return sorted({1, num_envs // stages, num_envs})
    return sorted({1} | {num_envs // p for p in auto_candidates(num_envs, servers)})


def auto_candidates(num_envs: int, servers: int = 1) -> list[int]:
    """The stage counts ``--pipeline auto`` chooses from: divisors of N up to 8 (up to S with more
    servers) that are multiples of the S servers, so that every server serves as many stages."""
    top = max(8, servers)
    return [p for p in range(1, num_envs + 1) if num_envs % p == 0 and p % servers == 0 and p <= top]


def independent_bound(
    cal: Calibration,
    workers: int,
    env_steps: int,
    resets: int,
    requests: list[tuple[int, ...]],
    servers: int = 1,
) -> dict[str, float]:
    """``bound_sim`` and ``bound_infer`` (seconds) of the work a run did; see the module docstring.
    ``requests``: ``(observations, model call size[, server index, ...])`` per request."""
    sim = (cal.t_step * env_steps + cal.t_reset * resets) / max(1, workers)
    infer = sum(cal.latency_at(r[1], r[2] if len(r) > 2 else None) * r[0] / r[1] for r in requests)
    return {"bound_sim": sim, "bound_infer": infer / max(1, servers)}


def _by_worker(slots: list[tuple[int, int]], items: list[Any]) -> dict[int, dict[int, Any]]:
    out: dict[int, dict[int, Any]] = {}
    for (w, s), item in zip(slots, items):
        out.setdefault(w, {})[s] = item
    return out


def _call_all(ex: EnvWorkerPool, method: str, per_worker: dict[int, Any]) -> tuple[dict[int, Any], float]:
    """One call per worker, all at once; ``({worker: result}, summed busy seconds)``."""
    futs = {w: ex.call(w, ex.generation(w), method, payload) for w, payload in per_worker.items()}
    results, busy = {}, 0.0
    for w, fut in futs.items():
        results[w], dt = fut.result()
        busy += dt
    return results, busy


class CalibrationEnvs:
    """The run's slots, started on its first episodes (:func:`start_envs`), stepped with fixed chunks."""

    def __init__(self, ex: EnvWorkerPool, num_envs: int, episodes: list[EpisodeSpec]):
        self.ex = ex
        self.slots = layout(num_envs, 1, ex.num_workers)[0][0]
        self.specs = [episodes[i % len(episodes)] for i in range(num_envs)]
        self.obs: list[dict[str, Any] | None] = [None] * num_envs

    def start(self, which: list[int]) -> float:
        """Start the episodes of slots ``which``; return the summed busy seconds."""
        if not which:
            return 0.0
        slots = [self.slots[i] for i in which]
        res, busy = _call_all(self.ex, "start", _by_worker(slots, [self.specs[i] for i in which]))
        for i, (w, s) in zip(which, slots):
            self.obs[i] = res[w][s].get("obs")
        return busy

    def advance(self, chunks: np.ndarray) -> tuple[int, float]:
        """Apply one chunk to every live slot; ``(steps applied, busy seconds)``. Ended slots are marked."""
        live = [i for i, o in enumerate(self.obs) if o is not None]
        slots = [self.slots[i] for i in live]
        payload = {w: {"actions": d} for w, d in _by_worker(slots, [chunks[i] for i in live]).items()}
        res, busy = _call_all(self.ex, "advance", payload)
        steps = 0
        for i, (w, s) in zip(live, slots):
            out = res[w][s]
            if ERROR in out or out["terminated"] or out["truncated"]:
                self.obs[i] = None
            else:
                self.obs[i] = out["obs"]
            steps += len(out.get("rewards", ()))
        return steps, busy

    def ended(self) -> list[int]:
        return [i for i, o in enumerate(self.obs) if o is None]


def start_envs(ex: EnvWorkerPool, num_envs: int, episodes: list[EpisodeSpec]) -> CalibrationEnvs:
    """Start every slot on one of the run's first episodes (slot ``i`` on ``episodes[i % len]``; an env
    that raised gets one more chance), which builds the simulators the run needs anyway; the
    calibration then steps these slots. Fails when every env raised."""
    envs = CalibrationEnvs(ex, num_envs, episodes)
    envs.start(list(range(num_envs)))
    envs.start(envs.ended())
    if len(envs.ended()) == num_envs:
        raise RuntimeError("calibration: every env raised on its first episode")
    return envs


def calibrate(
    envs: CalibrationEnvs,
    servers: dict[str, Callable[[], Callable]],
    sizes: list[int],
    budget_s: float,
    replan_interval: int,
) -> Calibration:
    """Measure ``t_step``, ``t_reset`` and ``latency(b)`` for ``b`` in ``sizes`` on each server
    (``servers``: URL -> policy factory) on ``envs`` from :func:`start_envs`, in about ``budget_s``
    seconds (module docstring). A server that fails (refused, dropped, no reply within its
    connection's reply timeout) stops the calibration with an error naming its URL."""
    t0 = time.perf_counter()
    obs = [o for o in envs.obs if o is not None]
    num_envs = len(envs.slots)
    chunks: np.ndarray | None = None
    per_server: list[dict[int, float]] = []
    for k, (url, make_policy) in enumerate(servers.items()):
        with _server(url, make_policy) as policy:
            cold: set[int] = set()
            if chunks is None:  # the simulation side steps with the actions of one warm-up reply
                reply = policy(_batch(obs, num_envs), list(range(num_envs)))
                chunks = np.asarray(reply[0])[:, :replan_interval]
                cold = {num_envs}  # the warm-up was that size's cold call
            until = t0 + budget_s / 2 * (k + 1) / len(servers)
            per_server.append(_time_server(policy, obs, sizes, until, cold))
    assert chunks is not None
    # the simulation side: what is left of the budget, and at least its half
    t_step, t_reset = _time_sim(envs, chunks, max(t0 + budget_s, time.perf_counter() + budget_s / 2))
    latency = {b: statistics.fmean(t[b] for t in per_server) for b in sizes}
    several = per_server if len(per_server) > 1 else []
    cal = Calibration(t_step, t_reset, latency, time.perf_counter() - t0, several)
    log.info(
        "calibration (%.1f s, eval.calibrate_s=%g): %.2f ms per env step, %.1f ms per episode start, "
        "server %s ms by batch size",
        cal.seconds,
        budget_s,
        1000 * t_step,
        1000 * t_reset,
        [{b: round(1000 * s, 1) for b, s in t.items()} for t in per_server],
    )
    return cal


def _batch(obs: list[dict], b: int) -> list[dict]:
    return [obs[i % len(obs)] for i in range(b)]


def _fits(last_s: float, until: float) -> bool:
    """Whether one more call (round) as long as the last one ends by ``until``."""
    return time.perf_counter() + last_s <= until


@contextlib.contextmanager
def _server(url: str, make_policy: Callable[[], Callable]) -> Iterator[Callable]:
    """One calibration connection to ``url``, closed at the end; its failures name ``url``."""
    try:
        policy = as_connection(make_policy())  # a caller's bare function is one too
        try:
            yield policy
        finally:
            policy.close()
    except TimeoutError as err:
        raise TimeoutError(
            f"calibration: the server at {url} did not reply ({err}); a hung server stops the run "
            "before any episode, and a slow one needs a larger eval.server_timeout_s"
        ) from err
    except OSError as err:
        raise ConnectionError(f"calibration: the server at {url} failed: {err}") from err


def _time_sim(envs: CalibrationEnvs, chunks: np.ndarray, until: float) -> tuple[float, float]:
    """``(t_step, t_reset)``: a timed start of every slot, then timed chunks (ended slots started
    again, timed) while one more round ends by ``until``; at least one chunk.

    The slots stand at an episode start (:func:`start_envs`), so the first timed start is a restart
    as in the run, and the simulators have run a start's steps and renders before any chunk is timed.
    Each figure is the median over rounds of a round's busy seconds per step (per start), so a spell of
    another process on a shared machine moves it less than a mean would."""
    per_start = [envs.start(list(range(len(envs.slots)))) / len(envs.slots)]
    per_step: list[float] = []
    rounds, last = 0, 0.0
    while rounds < MAX_SIM_ROUNDS and (not per_step or _fits(last, until)):
        t = time.perf_counter()
        ended = envs.ended()
        if ended:
            per_start.append(envs.start(ended) / len(ended))
        n, busy = envs.advance(chunks)
        rounds += 1
        if n:
            per_step.append(busy / n)
        last = time.perf_counter() - t
    if not per_step:
        log.warning("calibration: no env step could be timed (every env raised); the bound omits steps")
    return statistics.median(per_step or [0.0]), statistics.median(per_start)


def _time_server(
    policy: Callable, obs: list[dict], sizes: list[int], until: float, cold: set[int]
) -> dict[int, float]:
    """Median server seconds per request of each size, each size in an equal share of the time left
    until ``until``: a cold first call of the shape (compilation, allocation; skipped for the sizes in
    ``cold``, already sent once), then ``WARM_CALLS`` more or a fifth of what is left of its share,
    whichever lasts longer (the server and GPU busy again before anything is timed), then timed calls
    while one more ends within the share (at least one, at most ``MAX_TIMED_CALLS``)."""
    latency = {}
    for i, b in enumerate(sizes):
        share_end = time.perf_counter() + max(0.0, until - time.perf_counter()) / (len(sizes) - i)
        batch, seeds = _batch(obs, b), list(range(b))  # seeded as the evaluator's requests are
        if b not in cold:
            policy(batch, seeds)
        warm, warm_until = 0, time.perf_counter() + max(0.0, share_end - time.perf_counter()) / 5
        while warm < WARM_CALLS or time.perf_counter() < warm_until:
            policy(batch, seeds)
            warm += 1
        times: list[float] = []
        last = 0.0
        while not times or (len(times) < MAX_TIMED_CALLS and _fits(last, share_end)):
            t = time.perf_counter()
            times.append(float(policy(batch, seeds)[1]))
            last = time.perf_counter() - t
        latency[b] = statistics.median(times)
    return latency
