"""Executors: env workers behind one interface, local processes or Ray actors.

An :class:`EnvWorkerPool` owns W workers, each an :class:`~wamkit.envs.host.EnvHost` of K slots living in a
spawned process (``local``, :class:`wamkit.envs.workers.EnvWorker`) or a Ray actor (``ray``). The
scheduler only calls ``call(worker, generation, method, payload)`` and gets a
``concurrent.futures.Future`` resolving to ``(result, busy_seconds)``; it never knows which kind it has.

One dispatcher thread per worker sends that worker's calls one at a time (a worker is one process, its
calls are serial anyway) and measures each call's busy time, so the executor's ``busy_s`` is the total
simulation time that the throughput bound divides by W.

Failures: a worker that dies (``WorkerDied``) or answers nothing within ``watchdog_s`` (hung) is killed
and replaced by a fresh one; its *generation* goes up by one, the failed call and every queued call
issued for the old generation fail with :class:`WorkerLost`, and the scheduler reruns the episodes that
lived there from the start.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from wamkit.config import EnvConfig, to_dict

log = logging.getLogger(__name__)
STARTUP_S = 300.0  # how long a new worker may take to spawn and build its envs


class WorkerLost(RuntimeError):
    """A call did not complete because its worker died, hung or was replaced."""

    def __init__(self, worker: int, reason: str):
        super().__init__(f"env worker {worker} lost: {reason}")
        self.worker = worker
        self.reason = reason


class TooManyRestarts(RuntimeError):
    pass


class WorkerHandle(Protocol):
    """What both kinds of worker offer (the shape of :class:`wamkit.envs.workers.EnvWorker`)."""

    def submit(self, method: str, payload: Any) -> None: ...

    def result(self, timeout: float | None = None) -> Any: ...

    def kill(self) -> None: ...

    @property
    def alive(self) -> bool: ...


def _died_types() -> tuple[type[BaseException], ...]:
    from wamkit.envs.workers import WorkerDied

    return (WorkerDied,)


class EnvWorkerPool:
    """W workers with K env slots each; see the module docstring.

    ``env_cfg`` and ``slots_per_worker`` say what the workers were built for (None: unknown), so a
    caller that hands one executor to several runs (``run_eval(env_workers=...)``) can be refused when
    a run needs other envs."""

    def __init__(
        self,
        make_worker: Callable[[int], WorkerHandle],
        num_workers: int,
        watchdog_s: float = 300.0,
        max_restarts: int | None = None,
        kind: str = "local",
        env_cfg: EnvConfig | None = None,
        slots_per_worker: list[int] | None = None,
    ):
        self.kind = kind
        self.env_cfg = env_cfg
        self.slots_per_worker = slots_per_worker
        self.num_workers = num_workers
        self.watchdog_s = watchdog_s
        self.max_restarts = max_restarts if max_restarts is not None else 3 * num_workers + 3
        self.restarts = 0
        # what one env took, measured by the first run on these workers (wamkit.eval.process_memory)
        self.env_memory: Any = None
        self.busy_s = [0.0] * num_workers
        self._make = make_worker
        self._gen = [0] * num_workers
        self._handles: list[WorkerHandle | None] = [None] * num_workers
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(num_workers)]
        self._lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), name=f"env-worker-{w}", daemon=True)
            for w in range(num_workers)
        ]
        for t in self._threads:
            t.start()

    def _start(self, w: int) -> WorkerHandle:
        """A fresh worker, answered once: start-up (spawn, imports, building the envs) is not watched
        by the watchdog, whose limit is for one call of a running worker."""
        handle = self._make(w)
        try:
            handle.submit("max_steps", [])
            handle.result(timeout=max(self.watchdog_s, STARTUP_S))
        except BaseException:  # a worker that failed or hung in its start is not left running
            try:
                handle.kill()
            except (OSError, RuntimeError) as err:
                log.warning("env worker %d: kill after a failed start failed (%s)", w, err)
            raise
        return handle

    def generation(self, worker: int) -> int:
        return self._gen[worker]

    def nodes(self) -> list[Any]:
        """Where each worker runs now: a Ray actor's ``{"node_id", "ip"}``, None for a local process."""
        return [getattr(h, "node", None) for h in self._handles]

    def pid(self, worker: int) -> int:
        """The process id of worker ``worker`` now (tests SIGKILL it)."""
        h = self._handles[worker]
        return h.process.pid if hasattr(h, "process") else h.pid

    def call(self, worker: int, generation: int, method: str, payload: Any) -> Future:
        fut: Future = Future()
        if self._fatal is not None:
            fut.set_exception(self._fatal)
        else:
            self._queues[worker].put((generation, method, payload, fut))
        return fut

    def _serve(self, w: int) -> None:
        died = (RayWorkerDied,) if self.kind == "ray" else _died_types()
        try:
            self._handles[w] = self._start(w)
        except BaseException as err:
            self._fatal = RuntimeError(f"env worker {w} failed to start: {err}")
            self._fatal.__cause__ = err
        while True:
            job = self._queues[w].get()
            if job is None:
                return
            gen, method, payload, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            if self._fatal is not None:
                fut.set_exception(self._fatal)
                continue
            if gen != self._gen[w]:
                fut.set_exception(WorkerLost(w, f"call for generation {gen}, worker is at {self._gen[w]}"))
                continue
            t0 = time.perf_counter()
            try:
                self._handles[w].submit(method, payload)
                res = self._handles[w].result(timeout=self.watchdog_s)
            except TimeoutError:
                fut.set_exception(self._replace(w, f"no answer to '{method}' within {self.watchdog_s:g} s"))
                continue
            except died as err:
                fut.set_exception(self._replace(w, f"died during '{method}' ({err})"))
                continue
            except BaseException as err:  # an error raised by the env itself: the caller decides
                fut.set_exception(err)
                continue
            dt = time.perf_counter() - t0
            self.busy_s[w] += dt
            fut.set_result((res, dt))

    def _replace(self, w: int, reason: str) -> BaseException:
        log.warning("env worker %d %s; starting a fresh one", w, reason)
        with self._lock:
            self.restarts += 1
            if self.restarts > self.max_restarts:
                self._fatal = TooManyRestarts(
                    f"env workers were restarted {self.restarts} times (limit {self.max_restarts}); "
                    f"last: worker {w} {reason}"
                )
                return self._fatal
        try:
            self._handles[w].kill()
        except (OSError, RuntimeError) as err:
            log.warning("env worker %d: kill failed (%s)", w, err)
        try:
            self._handles[w] = self._start(w)
        except BaseException as err:
            self._fatal = RuntimeError(f"env worker {w} could not be restarted: {err}")
            return self._fatal
        self._gen[w] += 1
        return WorkerLost(w, reason)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)
        for h in self._handles:
            if h is None:
                continue
            close = getattr(h, "close", None)
            try:
                close() if close is not None else h.kill()
            except (OSError, RuntimeError) as err:
                log.warning("closing an env worker failed: %s", err)

    def __enter__(self) -> EnvWorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# local: spawned processes
# --------------------------------------------------------------------------------------------------


def local_executor(
    env_cfg: EnvConfig, slots_per_worker: list[int], watchdog_s: float, host_factory: Callable | None = None
) -> EnvWorkerPool:
    """Spawned processes, each hosting ``host_factory(env_cfg, K)`` (default :class:`ChunkHost`; a
    replacement must be importable by the child, e.g. a module-level class)."""
    from wamkit.eval.chunk_host import ChunkHost

    return _process_pool(env_cfg, slots_per_worker, watchdog_s, host_factory or ChunkHost, "local")


def _process_pool(
    env_cfg: EnvConfig, slots_per_worker: list[int], watchdog_s: float, factory: Callable, kind: str
) -> EnvWorkerPool:
    """Worker processes (:class:`~wamkit.envs.workers.EnvWorker`), worker ``w`` hosting
    ``factory(env_cfg, slots_per_worker[w])``."""
    from wamkit.envs.workers import EnvWorker

    def make(w: int) -> WorkerHandle:
        return EnvWorker(env_cfg, slots_per_worker[w], worker_id=w, host_factory=factory)

    return EnvWorkerPool(
        make, len(slots_per_worker), watchdog_s, kind=kind, env_cfg=env_cfg, slots_per_worker=slots_per_worker
    )


# --------------------------------------------------------------------------------------------------
# ray: actors around the same EnvHost
# --------------------------------------------------------------------------------------------------


class RayWorkerDied(RuntimeError):
    pass


class _HostActor:
    """Ray actor body: an EnvHost and a generic ``call``. Decorated with ``ray.remote`` on first use."""

    def __init__(self, env_cfg: dict, num_envs: int):
        from wamkit.config import from_dict
        from wamkit.eval.chunk_host import ChunkHost

        self.host = ChunkHost(from_dict(EnvConfig, env_cfg), num_envs)

    def call(self, method: str, payload: Any) -> Any:
        if method.startswith("_"):
            raise AttributeError(f"'{method}' is private")
        return getattr(self.host, method)(payload)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> dict[str, str]:
        """The Ray node this actor was placed on: its id and IP address."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


class RayEnvWorker:
    """One Ray actor behind the :class:`WorkerHandle` interface (``num_cpus=1`` per actor)."""

    _remote_cls: Any = None

    def __init__(self, env_cfg: EnvConfig, num_envs: int, worker_id: int, num_cpus: float = 1.0):
        import ray

        if RayEnvWorker._remote_cls is None:
            RayEnvWorker._remote_cls = ray.remote(_HostActor)
        self.worker_id = worker_id
        self.actor = RayEnvWorker._remote_cls.options(**actor_options(env_cfg, num_cpus)).remote(
            to_dict(env_cfg), num_envs
        )
        self._ref = None
        from ray.exceptions import GetTimeoutError

        try:  # an actor that no node has a CPU for waits unplaced: bounded, as a local start is
            self.pid = ray.get(self.actor.pid.remote(), timeout=STARTUP_S)
        except GetTimeoutError:
            ray.kill(self.actor, no_restart=True)
            raise TimeoutError(
                f"env worker {worker_id}: Ray placed no actor within {STARTUP_S:g} s; the cluster has no "
                f"free CPU for it (eval.workers asks for one CPU each: see `ray status`)"
            ) from None
        self.node = ray.get(self.actor.node.remote())

    def submit(self, method: str, payload: Any) -> None:
        self._ref = self.actor.call.remote(method, payload)

    def result(self, timeout: float | None = None) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(self._ref, timeout=timeout)
        except GetTimeoutError:
            raise TimeoutError(f"ray worker {self.worker_id}: no answer in {timeout} s") from None
        except RayActorError as err:
            raise RayWorkerDied(f"ray worker {self.worker_id} died: {err}") from None
        finally:
            self._ref = None

    @property
    def alive(self) -> bool:
        return True

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def actor_options(env_cfg: EnvConfig, num_cpus: float = 1.0) -> dict[str, Any]:
    """Ray options of one env actor: one CPU, no restart (the executor replaces a lost actor), and the
    environment a local worker gets too (EGL, ``env.render_gpu``; a node's own may set none).

    The environment goes with each actor, not with ``ray.init``: a process joins Ray once, and a later
    run in it (another render GPU) must not get the first run's. Ray merges an actor's variables over
    the job's, so the job sets none."""
    from wamkit.envs.base import render_environ

    env_vars = render_environ(env_cfg.render_gpu)
    return {"num_cpus": num_cpus, "max_restarts": 0, "runtime_env": {"env_vars": env_vars}}


_ray_joined: list[str] = []  # the address this process's ray.init was given ("" : a new local cluster)


def join_ray(address: str, num_workers: int) -> None:
    """Connect this process to the Ray cluster at ``address`` (``eval.ray_address``), else the one
    ``RAY_ADDRESS`` names, else a new local one, once: Ray joins one cluster per process, so a later
    run that names another cluster is refused (it would silently run on the first)."""
    import ray

    wanted = address or os.environ.get("RAY_ADDRESS", "")
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if wanted and wanted not in (current, *_ray_joined):
            from wamkit.config import ConfigError

            raise ConfigError(
                f"eval.ray_address: {wanted} is not the Ray cluster this process is connected to "
                f"({current}); Ray joins one cluster per process, so evaluate on {wanted} in a new one"
            )
        return
    kwargs: dict[str, Any] = {"address": wanted} if wanted else {}
    if not wanted:
        # a new local cluster with room for one actor per worker; "local", because ray.init()
        # alone joins whatever cluster /tmp/ray/ray_current_cluster names, a stale one included
        kwargs.update(address="local", num_cpus=max(os.cpu_count() or 1, num_workers))
    ray.init(log_to_driver=False, include_dashboard=False, **kwargs)
    _ray_joined[:] = [wanted]


def ray_executor(
    env_cfg: EnvConfig, slots_per_worker: list[int], watchdog_s: float, address: str = ""
) -> EnvWorkerPool:
    """Actors on the Ray cluster at ``address`` (:func:`join_ray`). Each actor asks for one CPU, so a
    head started with ``--num-cpus 0`` (the GPU node of docs/eval.md) hosts none, and renders as
    ``env_cfg`` says (:func:`actor_options`)."""
    join_ray(address, len(slots_per_worker))

    def make(w: int) -> WorkerHandle:
        return RayEnvWorker(env_cfg, slots_per_worker[w], worker_id=w)

    return EnvWorkerPool(
        make,
        len(slots_per_worker),
        watchdog_s,
        kind="ray",
        env_cfg=env_cfg,
        slots_per_worker=slots_per_worker,
    )


# --------------------------------------------------------------------------------------------------
# gpu: one process per stage, each simulating its slots together on the GPU
# --------------------------------------------------------------------------------------------------


def gpu_executor(
    env_cfg: EnvConfig, slots_per_worker: list[int], watchdog_s: float, host_factory: Callable | None = None
) -> EnvWorkerPool:
    """Spawned processes (started with the suite's Python), each hosting a
    :class:`~wamkit.eval.gpu_host.BatchChunkHost` of its K slots simulated on the GPU (``host_factory``
    replaces it: tests pass one on ManiSkill's CPU simulator). Refused in one line for a suite without
    a batched simulator, tasks it cannot start from their seeds, and a machine without CUDA."""
    from wamkit.config import ConfigError
    from wamkit.envs.suites import batch_backend
    from wamkit.eval.gpu_host import BatchChunkHost

    batch_backend(env_cfg.suite).check_batch(env_cfg)
    if host_factory is None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"eval.executor=gpu: no CUDA device here (torch.cuda.is_available() is False), and "
                f"{env_cfg.suite}'s GPU simulation needs one; use eval.executor=local"
            )
    return _process_pool(env_cfg, slots_per_worker, watchdog_s, host_factory or BatchChunkHost, "gpu")


def make_executor(
    kind: str,
    env_cfg: EnvConfig,
    slots_per_worker: list[int],
    watchdog_s: float,
    host_factory: Callable | None = None,
    ray_address: str = "",
) -> EnvWorkerPool:
    """``host_factory`` (local and gpu) replaces the env host class of every worker; ``ray_address``
    (ray only) names the cluster."""
    if kind == "local":
        return local_executor(env_cfg, slots_per_worker, watchdog_s, host_factory)
    if kind == "gpu":
        return gpu_executor(env_cfg, slots_per_worker, watchdog_s, host_factory)
    if kind == "ray":
        try:
            import ray  # noqa: F401
        except ModuleNotFoundError:
            from wamkit.config import ConfigError

            raise ConfigError("eval.executor=ray needs Ray: pip install 'wamkit[ray]'") from None
        return ray_executor(env_cfg, slots_per_worker, watchdog_s, ray_address)
    from wamkit.config import ConfigError

    raise ConfigError(f"eval.executor: {kind!r} is not one of 'local', 'ray', 'gpu'")
