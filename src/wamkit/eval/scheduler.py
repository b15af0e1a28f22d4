"""The pipelined scheduler: N env slots in P stages over W workers, one batched request per stage step.

Stage ``s`` owns N/P slots; slot ``j`` of stage ``s`` is global env ``e = s * N/P + j`` and lives on worker
``e % W`` (so every stage spreads over the workers, and the stages take turns on them). Each stage runs
in its own thread and loops:

1. **simulate**: apply up to ``replan_interval`` actions of each slot's last chunk, one batched ``step``
   call per worker per action; finished episodes are written to the journal and their slots take the
   next episode from the shared queue (``reset``);
2. **infer**: send the observations of the stage's slots as one batched request and keep the
   ``replan_interval`` actions each slot executes next (the chunk's first ones; with asynchronous
   execution the old chunk's first, :mod:`wamkit.eval.execution`).

While stage ``s`` waits for the server, stage ``s + 1`` simulates; with P = 1 the two strictly
alternate. With several servers each stage's requests go to its own server
(:mod:`wamkit.eval.servers`), which the stage's policy says with each reply. A slot whose worker was replaced (the executor's generation moved on) reruns its episode
from the start, so an episode's record never mixes two simulator states. An episode whose env raises
(the host answers ``{"error": ...}`` for its slot) is rerun from the start up to ``max_env_retries``
times; after that it is recorded as a failure with ``failure: "env_error: <message>"`` and the run goes
on.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from wamkit.envs.base import EpisodeSpec
from wamkit.eval.chunk_host import ERROR
from wamkit.eval.episodes import request_seed
from wamkit.eval.execution import ActionExecution, ChunkPlan
from wamkit.eval.executors import EnvWorkerPool, WorkerLost


class Policy(Protocol):
    """A stage's policy (:class:`wamkit.eval.servers.StagePolicy`): called with the observations and
    one noise seed per observation, it answers (actions [B, H, D], server seconds, observations in the
    model call that served them, index of the server that answered); closed when its stage ends."""

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int]
    ) -> tuple[np.ndarray, float, int, int]: ...

    def close(self) -> None: ...


ENV_ERROR = "env_error"


class EvalError(RuntimeError):
    pass


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def server_idle(requests: list[tuple[int, float, float, float]], wall: float) -> dict[str, float]:
    """Where the servers' idle time went, averaged over the servers that served a request.

    ``requests``: ``(server, sent, busy_start, busy_end)`` per request on the run's clock (``sent``:
    when its stage finished simulating and sent it). Each gap between a server's busy spans ends with
    the next request it served. The part of the gap before that request was sent is ``simulation``:
    the server had nothing to do while stages simulated. The rest is ``transit``: the request had been
    sent, but its model call had not started (network, decoding, the batcher, the previous reply's
    handling). Before the first and after the last span is ``fill_drain``. Seconds."""
    by_server: dict[int, list[tuple[float, float, float]]] = collections.defaultdict(list)
    for server, sent, b0, b1 in requests:
        by_server[server].append((b0, b1, sent))
    out = {"idle": 0.0, "simulation": 0.0, "transit": 0.0, "fill_drain": 0.0}
    for spans in by_server.values():
        spans.sort()
        end = None
        for b0, b1, sent in spans:
            if end is None:
                out["fill_drain"] += b0
            elif b0 > end:  # a gap, closed by this request's call
                waited = min(max(sent - end, 0.0), b0 - end)
                out["simulation"] += waited
                out["transit"] += b0 - end - waited
            end = b1 if end is None else max(end, b1)
        if end is not None:
            out["fill_drain"] += max(wall - end, 0.0)
    n = max(len(by_server), 1)
    out = {k: v / n for k, v in out.items()}
    out["idle"] = out["simulation"] + out["transit"] + out["fill_drain"]
    return out


def layout(
    num_envs: int, stages: int, workers: int, by_stage: bool = False
) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """``(stage_slots, slots_per_worker)``: ``stage_slots[s][j] = (worker, local slot)``. ``by_stage``:
    stage ``s`` lives on worker ``s % workers`` alone (the GPU executor, whose worker steps all its
    slots together: every slot of a worker must belong to the stage that steps it)."""
    per_stage = num_envs // stages
    counts = [0] * workers
    stage_slots: list[list[tuple[int, int]]] = []
    for s in range(stages):
        row = []
        for j in range(per_stage):
            w = s % workers if by_stage else (s * per_stage + j) % workers
            row.append((w, counts[w]))
            counts[w] += 1
        stage_slots.append(row)
    return stage_slots, counts


@dataclass
class Slot:
    stage: int
    worker: int
    slot: int
    spec: EpisodeSpec | None = None
    gen: int = -1
    needs_reset: bool = False
    obs: dict[str, Any] | None = None
    actions: list[np.ndarray] = field(default_factory=list)
    length: int = 0
    ret: float = 0.0
    success_once: bool = False
    success_last: bool = False
    restarts: int = 0
    env_errors: int = 0
    sim_s: float = 0.0
    infer_s: float = 0.0
    t_start: float = 0.0
    frames: list[np.ndarray] | None = None
    requests: int = 0  # model requests so far this episode: names the next one's seed
    plan: ChunkPlan | None = None  # the episode's chunks (eval/execution.py)

    def start(self, spec: EpisodeSpec, gen: int, film: bool, execution: ActionExecution, replan: int) -> None:
        self.spec, self.gen, self.needs_reset, self.obs, self.actions = spec, gen, True, None, []
        self.length, self.ret, self.success_once, self.success_last = 0, 0.0, False, False
        self.sim_s = self.infer_s = 0.0
        self.frames = [] if film else None
        self.requests = 0
        self.plan = ChunkPlan(execution, replan)


class Pipeline:
    """Runs ``episodes`` to completion; ``on_finish(record, frames)`` is called once per episode.

    ``policy_factory(stage)`` makes one policy per stage (each stage has its own server connection);
    ``servers`` is how many servers the stages share (their busy time is averaged over them).
    ``film(spec)`` says whether to keep an episode's frames. ``max_episode_restarts`` bounds how often
    one episode may be rerun after losing its worker before the run gives up; ``max_env_retries`` how
    often one whose env raised is rerun before it is recorded as an ``env_error`` failure.
    """

    def __init__(
        self,
        executor: EnvWorkerPool,
        stage_slots: list[list[tuple[int, int]]],
        policy_factory: Callable[[int], Policy],
        replan_interval: int,
        on_finish: Callable[[dict[str, Any], list[np.ndarray] | None], None],
        film: Callable[[EpisodeSpec], bool] = lambda spec: False,
        frame: Callable[[dict[str, Any]], np.ndarray] | None = None,
        max_episode_restarts: int = 3,
        max_env_retries: int = 2,
        servers: int = 1,
        execution: ActionExecution | None = None,
    ):
        self.ex = executor
        self.execution = execution or ActionExecution()
        self.servers = servers
        self.stages = [[Slot(s, w, k) for w, k in row] for s, row in enumerate(stage_slots)]
        self.policy_factory = policy_factory
        self.replan = replan_interval
        self.on_finish = on_finish
        self.film = film
        self.frame = frame
        self.max_episode_restarts = max_episode_restarts
        self.max_env_retries = max_env_retries
        self.events: list[tuple[int, str, float, float]] = []  # (stage, "sim"|"infer", t0, t1)
        n = len(stage_slots)
        self.stage_infer_s = [0.0] * n  # per stage: summed inference time of its requests
        # per request, on the run's clock: (server, sent, server busy from = reply - infer s, reply): the
        # servers' busy intervals (infer_s) and where they idled (server_idle)
        self.request_spans: list[tuple[int, float, float, float]] = []
        self.stage_steps = [0] * n  # per stage: env steps applied (reruns included: real work)
        self.resets = 0  # episode starts answered by an env (reruns included)
        # per request: (its observations, its model call's, the server's index, the stage's)
        self.requests: list[tuple[int, int, int, int]] = []
        self._queue: collections.deque[EpisodeSpec] = collections.deque()
        self._qlock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self.t0 = time.perf_counter()

    @property
    def infer_s(self) -> float:
        """Seconds a server was busy for this run: the union of its requests' busy intervals, averaged
        over the servers (as the workers' busy time is over the workers).

        A request's interval is ``[reply time - its inference seconds, reply time]``. When a server
        merges the requests of several stages into one model call, they all report that call's time
        and their intervals (nearly) coincide, so the call counts once, not once per stage; each union
        lies within the run, so the average never exceeds the wall time. ``stage_infer_s`` keeps the
        per-stage sums (each stage's own wait on the model)."""
        spans = collections.defaultdict(list)
        for server, _, t0, t1 in list(self.request_spans):
            spans[server].append((t0, t1))
        return sum(union_length(s) for s in spans.values()) / self.servers

    @property
    def env_steps(self) -> int:
        return sum(self.stage_steps)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def run(self, episodes: list[EpisodeSpec]) -> None:
        self._queue.extend(episodes)
        self.t0 = time.perf_counter()
        self._threads = threads = [
            threading.Thread(target=self._stage_main, args=(s,), name=f"stage-{s}", daemon=True)
            for s in range(len(self.stages))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if self._errors:
            raise self._errors[0]

    def stop(self, wait_s: float = 0.0) -> list[str]:
        """Tell the stage threads to stop after their current step and wait up to ``wait_s`` for them
        (an interrupted run whose caller keeps the env workers must not leave threads calling them).
        Returns the names of the threads still running."""
        self._stop.set()
        deadline = time.perf_counter() + wait_s
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.perf_counter()))
        return [t.name for t in self._threads if t.is_alive()]

    def _next_episode(self) -> EpisodeSpec | None:
        with self._qlock:
            return self._queue.popleft() if self._queue else None

    def _stage_main(self, s: int) -> None:
        try:
            policy = self.policy_factory(s)
            try:
                self._stage_loop(s, policy)
            finally:
                policy.close()
        except BaseException as err:
            self._errors.append(err)
            self._stop.set()

    def _stage_loop(self, s: int, policy: Policy) -> None:
        slots = self.stages[s]
        while not self._stop.is_set():
            t0 = self.now()
            self._simulate(slots)
            ready = [sl for sl in slots if sl.spec is not None and sl.obs is not None]
            if not ready and all(sl.spec is None for sl in slots):
                return
            t1 = self.now()
            self.events.append((s, "sim", t0, t1))
            if not ready:
                continue
            seeds = [request_seed(sl.spec, sl.requests) for sl in ready]
            extra = [sl.plan.request_fields(sl.length) for sl in ready]  # empty unless rtc
            obs = [{**sl.obs, **f} if f else sl.obs for sl, f in zip(ready, extra)]
            chunks, infer_s, call_batch, server = policy(obs, seeds)
            t2 = self.now()
            self.requests.append((len(ready), max(int(call_batch), len(ready)), server, s))
            self.events.append((s, "infer", t1, t2))
            self.stage_infer_s[s] += infer_s
            # within the request's round trip [t1, t2], even if the server's clock or report is off
            self.request_spans.append((server, t1, max(t1, t2 - infer_s), t2))
            chunks = np.asarray(chunks)
            if chunks.ndim != 3 or chunks.shape[0] != len(ready):
                raise EvalError(
                    f"server reply 'actions': expected shape [{len(ready)}, H, D], got {list(chunks.shape)}"
                )
            for sl, chunk in zip(ready, chunks):
                sl.actions = sl.plan.receive(sl.length, chunk)
                sl.requests += 1
                sl.infer_s += t2 - t1

    # -- simulation ------------------------------------------------------------------------------

    def _lost(self, sl: Slot) -> bool:
        return sl.spec is not None and sl.gen != self.ex.generation(sl.worker)

    def _rerun(self, sl: Slot) -> None:
        """The slot's worker was replaced: start its episode again from the beginning."""
        assert sl.spec is not None
        if sl.restarts >= self.max_episode_restarts:
            raise EvalError(
                f"episode {sl.spec} lost its env worker {sl.restarts + 1} times; giving up "
                "(the journal keeps every finished episode: fix the cause and run again with --resume)"
            )
        restarts = sl.restarts + 1
        self._start(sl, sl.spec)
        sl.restarts = restarts

    def _gather(self, calls: dict[int, Future]) -> dict[int, tuple[Any, float]]:
        """Wait for one call per worker; a lost worker's entry is missing from the result."""
        out = {}
        for w, fut in calls.items():
            try:
                out[w] = fut.result()
            except WorkerLost:
                continue
        return out

    def _by_worker(self, slots: list[Slot]) -> dict[int, list[Slot]]:
        groups: dict[int, list[Slot]] = collections.defaultdict(list)
        for sl in slots:
            groups[sl.worker].append(sl)
        return groups

    def _simulate(self, slots: list[Slot]) -> None:
        # 1. apply each slot's pending actions: one ``advance`` call per worker
        running = [sl for sl in slots if sl.spec and not sl.needs_reset and sl.actions and not self._lost(sl)]
        groups = self._by_worker(running)
        calls = {
            w: self.ex.call(
                w,
                g[0].gen,
                "advance",
                {
                    "actions": {sl.slot: np.stack(sl.actions) for sl in g},
                    "film": [sl.slot for sl in g if sl.frames is not None],
                },
            )
            for w, g in groups.items()
        }
        for w, (res, busy) in self._gather(calls).items():
            for sl in groups[w]:
                sl.sim_s += busy / len(groups[w])
                if ERROR in res[sl.slot]:
                    self._env_error(sl, res[sl.slot][ERROR])
                else:
                    self._after_chunk(sl, res[sl.slot])
        # 2. episodes lost with their worker start over; idle slots take the next episode
        for sl in slots:
            if self._lost(sl):
                self._rerun(sl)
            if sl.spec is None and not self._stop.is_set():
                spec = self._next_episode()
                if spec is not None:
                    self._start(sl, spec, self.film(spec))
                    sl.t_start = self.now()
        # 3. reset them: one ``start`` call per worker
        groups = self._by_worker([sl for sl in slots if sl.spec is not None and sl.needs_reset])
        calls = {
            w: self.ex.call(w, g[0].gen, "start", {sl.slot: sl.spec for sl in g}) for w, g in groups.items()
        }
        for w, (res, busy) in self._gather(calls).items():
            self.resets += len(groups[w])
            for sl in groups[w]:
                sl.sim_s += busy / len(groups[w])
                if ERROR in res[sl.slot]:
                    self._env_error(sl, res[sl.slot][ERROR])
                    continue
                sl.needs_reset, sl.obs = False, res[sl.slot]["obs"]
                if sl.frames is not None and self.frame is not None:
                    sl.frames.append(self.frame(sl.obs))

    def _env_error(self, sl: Slot, message: str) -> None:
        """The slot's env raised: rerun the episode from the start, or record it once retries are spent."""
        assert sl.spec is not None
        sl.env_errors += 1
        if sl.env_errors > self.max_env_retries:
            sl.success_once = sl.success_last = False  # an episode that did not run to its end fails
            self._finish(sl, f"{ENV_ERROR}: {message}")
            return
        self._start(sl, sl.spec)

    def _start(self, sl: Slot, spec: EpisodeSpec, film: bool | None = None) -> None:
        """(Re)start ``spec`` in ``sl`` from its beginning (``film`` None: as the slot was)."""
        film = sl.frames is not None if film is None else film
        sl.start(spec, self.ex.generation(sl.worker), film, self.execution, self.replan)

    def _after_chunk(self, sl: Slot, out: dict[str, Any]) -> None:
        n = len(out["rewards"])
        self.stage_steps[sl.stage] += n
        if sl.plan is not None:
            sl.plan.executed_steps(sl.length, sl.actions[:n])
        sl.obs, sl.actions = out["obs"], []
        sl.length += n
        sl.ret += float(sum(out["rewards"]))
        if n:
            sl.success_last = bool(out["successes"][-1])
            sl.success_once = sl.success_once or any(out["successes"])
        if sl.frames is not None and self.frame is not None:
            sl.frames.extend(self.frame(f) for f in out["frames"])
        if out["terminated"] or out["truncated"]:
            ended = "max_steps" if out["truncated"] else "terminated"
            self._finish(sl, "" if sl.success_once else ended)

    def _finish(self, sl: Slot, failure: str) -> None:
        assert sl.spec is not None
        record = {
            **sl.spec.to_dict(),
            "success_once": sl.success_once,
            "success_at_end": sl.success_last,
            "length": sl.length,
            "return": sl.ret,
            "failure": failure,
            "restarts": sl.restarts,
            "env_errors": sl.env_errors,
            "smoothness": sl.plan.smoothness() if sl.plan is not None else None,
            "stage": sl.stage,
            "worker": sl.worker,
            "timing": {
                "sim": sl.sim_s,
                "infer": sl.infer_s,
                "start": sl.t_start,
                "end": self.now(),
                "wall": self.now() - sl.t_start,
            },
        }
        frames = sl.frames
        sl.spec, sl.obs, sl.actions, sl.frames, sl.restarts, sl.env_errors = None, None, [], None, 0, 0
        self.on_finish(record, frames)
