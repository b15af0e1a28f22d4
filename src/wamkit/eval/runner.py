"""One evaluation run: plan the episodes, reach a server, run the pipeline, journal, report.

``run_eval(cfg)`` is what ``wamkit eval`` calls. The output folder ``eval.out_dir`` receives
``episodes.jsonl`` (the journal), ``plan.json``, ``summary.json``, ``results.md``, ``timeline.json``,
the plots and ``videos/<task>/trial<t>_seed<s>.mp4``.

Order of a run: plan and journal (a resume with other settings is refused) -> reach the server(s),
check that they all serve one model (:func:`wamkit.eval.servers.same_model`) and that it is the
journal's (``plan.json`` ``server.identity``) -> start the env workers -> unless
``eval.calibrate_s=0``, start every env slot once (building its simulator), then calibrate
(:mod:`wamkit.eval.calibrate`; also picks P for ``--pipeline auto``) -> the timed pipeline ->
reports, with the efficiency against the calibrated bound beside the utilisation.

Env workers a caller keeps: :func:`start_env_workers` starts the workers a run of ``cfg`` would, and
``run_eval(cfg, env_workers=...)`` uses them instead of starting its own, neither closing them nor
skipping anything else (the calibration included), so several runs of the same envs and shape (the
benchmark's repeats) build their simulators once. Results cannot change: every episode resets its env
from the episode's seed, whatever the env ran before (as within one run, where a slot's env serves
episode after episode; ``tests/test_eval_reset.py``, ``tests/test_bench_eval_reuse.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.config import ConfigError, EnvConfig, EvalConfig, RunConfig, ServeConfig
from wamkit.constants import image_key
from wamkit.envs.base import EpisodeSpec
from wamkit.eval.backends import backend_module, connect
from wamkit.eval.backends.base import Patience, PolicyConnection, Target, as_connection
from wamkit.eval.calibrate import Calibration, batch_sizes, calibrate, independent_bound, start_envs
from wamkit.eval.episodes import plan_episodes, plan_record
from wamkit.eval.execution import ActionExecution
from wamkit.eval.executors import EnvWorkerPool, make_executor
from wamkit.eval.journal import Journal, episode_key
from wamkit.eval.process_memory import check_env_memory
from wamkit.eval.report import write_reports
from wamkit.eval.scheduler import Pipeline, layout, server_idle
from wamkit.eval.servers import ServerPool, same_model
from wamkit.eval.video import VideoBudget, frame_of, write_mp4
from wamkit.files import atomic_write_json
from wamkit.log import progress_bar

log = logging.getLogger(__name__)
STOP_WAIT_S = 10.0  # how long a stopped (interrupted) pipeline waits for its stage threads
# plan.json's and the log's words for servers that name nothing (identity None)
UNIDENTIFIED = (
    "the server says nothing of what it serves: plan.json records where it was reached, and --resume "
    "cannot tell whether the model behind that address changed"
)


def check_eval_config(ecfg: EvalConfig) -> None:
    """What only a run needs (ranges are checked when the config is built: EvalConfig.__post_init__)."""
    backend_module(ecfg.backend)  # a name not registered is refused with the names that are
    if not ecfg.server_urls and not ecfg.serve_dir:
        raise ConfigError(
            "eval.server_url or eval.serve_dir: one is needed (a ws:// URL, or a serving directory)"
        )
    if ecfg.backend != "wamkit" and not ecfg.server_urls:
        raise ConfigError(
            f"eval.backend={ecfg.backend}: give the engine's eval.server_url (eval.serve_dir starts a "
            "wamkit server, for eval.backend=wamkit)"
        )


def server_location(ecfg: EvalConfig) -> dict[str, Any]:
    """Where plan.json says the model was reached: the URL (the URLs, with several servers), or the
    serving directory (resolved). With an identity, only the identity is compared on ``--resume``: how
    many servers answered is a throughput setting, like the stage count."""
    urls = ecfg.server_urls
    engine = {} if ecfg.backend == "wamkit" else {"backend": ecfg.backend}
    if len(urls) == 1:
        return {"url": urls[0], **engine}
    if urls:
        return {"urls": urls, **engine}
    return {"serve_dir": str(Path(ecfg.serve_dir).resolve())}


@contextlib.contextmanager
def reach_servers(ecfg: EvalConfig, serve: ServeConfig | None = None) -> Iterator[list[str]]:
    """Yield the server URLs: ``eval.server_url``, or a local server started from ``eval.serve_dir`` in
    its own process (log in ``<out_dir>/server.log``), stopped on exit, with the run's whole ``serve``
    section (:func:`wamkit.eval.server_proc.serve_section_args`)."""
    if ecfg.server_urls:
        yield ecfg.server_urls
        return
    from wamkit.eval.server_proc import start_server_process

    if not Path(ecfg.serve_dir).is_dir():
        raise ConfigError(
            f"eval.serve_dir: {ecfg.serve_dir} is not a directory (a serving directory is expected)"
        )
    serve = serve or ServeConfig()
    if serve.raw_actions:
        raise ConfigError(
            "serve.raw_actions=true: the server an evaluation starts must reply with env-ready actions; "
            "set serve.raw_actions=false"
        )
    Path(ecfg.out_dir).mkdir(parents=True, exist_ok=True)
    log_path = Path(ecfg.out_dir) / "server.log"
    with start_server_process([ecfg.serve_dir], log_path=log_path, serve=serve) as srv:
        yield [srv.url]


class Progress:
    """Episodes done, success so far and ETA (tqdm), fed from the stage threads."""

    def __init__(self, total: int, enabled: bool):
        self.bar = progress_bar(total=total, desc="eval", unit="ep", disable=not enabled)
        self.done = self.success = 0
        self._lock = threading.Lock()

    def update(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.done += 1
            self.success += bool(record["success_once"])
            self.bar.set_postfix_str(f"success {100 * self.success / self.done:.1f}%", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def run_eval(
    cfg: RunConfig,
    resume: bool = False,
    progress: bool = True,
    policy_factory: Callable[[str, EnvConfig, Patience], Callable] | None = None,
    on_pipeline: Callable[[Pipeline], None] | None = None,
    prebuild: bool = False,
    host_factory: Callable | None = None,
    env_workers: EnvWorkerPool | None = None,
) -> dict[str, Any]:
    """Evaluate ``cfg.env`` against the server of ``cfg.eval``; return the summary (also on disk).

    ``policy_factory(url, env_cfg, patience)`` makes one connection to one server, with the interface of
    :mod:`wamkit.eval.backends.base` (default the backend of ``eval.backend``);
    ``on_pipeline`` sees the pipeline once it runs (tests use it to kill workers). ``prebuild`` resets
    every env once on every task before the clock starts, so the measured wall time holds no simulator
    construction (the benchmark uses it; results do not change). ``host_factory`` replaces the env
    host class of the local executor's workers (tests inject failing envs with it). ``env_workers``:
    workers from :func:`start_env_workers` for this run's envs and shape, owned (closed) by the caller.
    """
    from wamkit.envs.suites import resolve_env_config

    # the env's "auto" settings resolved once, here: everything below (plan, journal, workers, envs)
    # gets them resolved
    cfg = dataclasses.replace(cfg, env=resolve_env_config(cfg.env))
    env_cfg, ecfg = cfg.env, cfg.eval
    check_eval_config(ecfg)
    if env_workers is not None:
        _check_env_workers(env_workers, cfg, host_factory)
    episodes = plan_episodes(env_cfg, ecfg)
    from wamkit.envs import suite_info

    info, look = suite_info(env_cfg.suite, env_cfg.state), env_cfg.render_quality

    def connect_backend(url: str, e: EnvConfig, patience: Patience):
        target = Target(url, tuple(e.cameras), info, look, dict(ecfg.backend_options))
        return connect(ecfg.backend, target, patience)

    make_policy = _connections(policy_factory or connect_backend)
    if ecfg.blank_images:
        make_policy = _blanked(make_policy)
    out = Path(ecfg.out_dir)
    resume = resume or ecfg.resume
    with contextlib.ExitStack() as servers:
        urls: list[str] | None = None
        if ecfg.delay_steps == "auto":  # a recorded value on --resume, else measured on the server
            d = recorded_delay(out) if resume else None
            if d is None:
                urls = servers.enter_context(reach_servers(ecfg, cfg.serve))
                d = measure_delay(make_policy, urls[0], env_cfg, ecfg)
            ecfg = dataclasses.replace(ecfg, delay_steps=d)
            cfg = dataclasses.replace(cfg, eval=ecfg)
        plan = plan_record(env_cfg, ecfg, server_location(ecfg))
        with Journal(out, plan, resume=resume) as journal:
            todo = [e for e in episodes if not journal.done(episode_key(e.suite, e.task, e.trial, e.seed))]
            log.info("%d episodes planned, %d to run", len(episodes), len(todo))
            timing, events, stages = None, [], ecfg.pipeline_stages or 1
            if todo:
                if urls is None:
                    urls = servers.enter_context(reach_servers(ecfg, cfg.serve))
                # fail fast (no server, cameras the env does not render, servers serving different
                # models, another model than the journal's) before workers start
                probes = [
                    _probe(make_policy, url, env_cfg, ecfg.server_timeout_s, ecfg.chunk_blend) for url in urls
                ]
                identity = same_model(urls, [said for said, _ in probes])
                _warn_image_size(env_cfg, urls[0], probes[0][1])  # one model (same_model): one warning
                server = {**server_location(ecfg), "identity": identity}
                if identity is None:
                    server["unidentified"] = UNIDENTIFIED
                    log.warning("%s: %s", ", ".join(urls), UNIDENTIFIED)
                journal.check_server(server)
                workers = functools.partial(_open_workers, cfg, host_factory, env_workers)
                timing, events, stages = _run(
                    cfg, todo, journal, urls, make_policy, progress, on_pipeline, prebuild, workers
                )
            summary = write_reports(out, list(journal.records.values()), journal.plan, timing, events, stages)
    all_ = summary["all"]
    log.info(
        "success %.1f%% (95%% CI %.1f-%.1f) over %d episodes; results in %s",
        100 * all_["rate"],
        100 * all_["ci95"][0],
        100 * all_["ci95"][1],
        all_["episodes"],
        out,
    )
    for suite, s in summary["suites"].items():
        for category, r in s.get("categories", {}).items():
            log.info(
                "%s, %s: success %.1f%% (95%% CI %.1f-%.1f) over %d episodes",
                suite, category, 100 * r["rate"], 100 * r["ci95"][0], 100 * r["ci95"][1], r["episodes"],
            )  # fmt: skip
    return summary


def recorded_delay(out: Path) -> int | None:
    """The delay an earlier run in ``out`` resolved ``auto`` to (its plan.json), if any."""
    from wamkit.eval.journal import PLAN

    try:
        d = json.loads((out / PLAN).read_text()).get("execution", {}).get("delay_steps")
    except (OSError, ValueError, AttributeError):
        return None
    return d if isinstance(d, int) else None


def measure_delay(make_policy, url: str, env_cfg: EnvConfig, ecfg: EvalConfig, repeats: int = 5) -> int:
    """``eval.delay_steps=auto``: the server's round trip for one stage's batch (the median of
    ``repeats`` after one warm-up call, blank frames of the env's cameras and size), times the
    embodiment's control rate, rounded up."""
    from wamkit.constants import OBS_STATE, TASK
    from wamkit.envs import suite_info

    info = suite_info(env_cfg.suite, env_cfg.state)
    size = env_cfg.image_size
    obs = {image_key(c): np.zeros((size, size, 3), np.uint8) for c in env_cfg.cameras}
    obs |= {OBS_STATE: np.zeros(info.state_dim, np.float32), TASK: info.tasks[0] if info.tasks else ""}
    batch = max(1, ecfg.num_envs // max(1, ecfg.pipeline_stages))
    policy = make_policy(url, env_cfg, Patience(reply_timeout_s=ecfg.server_timeout_s))
    try:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            policy([obs] * batch, list(range(batch)))
            times.append(time.perf_counter() - t0)
    finally:
        policy.close()
    latency = float(np.median(times[1:]))
    d = max(1, int(np.ceil(latency * info.fps - 1e-9)))
    log.info(
        "eval.delay_steps=auto: %.1f ms a request of %d at %g Hz -> %d control steps",
        1000 * latency, batch, info.fps, d,
    )  # fmt: skip
    return d


def slots_per_worker(ecfg: EvalConfig) -> list[int]:
    """Env slots on each worker: ``eval.num_envs`` over ``min(eval.workers, eval.num_envs)`` workers
    (a worker without envs would only cost memory); the stage count does not change it."""
    return layout(ecfg.num_envs, 1, min(ecfg.workers, ecfg.num_envs))[1]


def start_env_workers(cfg: RunConfig, host_factory: Callable | None = None) -> EnvWorkerPool:
    """The env workers a run of ``cfg`` would start (``eval.executor``, local or Ray), for a caller to
    hand to every run of the same envs and shape (``run_eval(env_workers=...)``) and to close
    (``with start_env_workers(cfg) as workers:``). Their envs are built as the first call reaches them;
    their restart limit (``EnvWorkerPool.max_restarts``) counts over every run they serve."""
    from wamkit.envs.suites import resolve_env_config

    ecfg, env_cfg = cfg.eval, resolve_env_config(cfg.env)  # as run_eval resolves it
    return make_executor(
        ecfg.executor, env_cfg, slots_per_worker(ecfg), ecfg.watchdog_s, host_factory, ecfg.ray_address
    )


def _check_env_workers(workers: EnvWorkerPool, cfg: RunConfig, host_factory: Callable | None) -> None:
    """Refuse a caller's workers that are not what this run would start (other envs, another layout)."""
    if host_factory is not None:
        raise ValueError("run_eval: host_factory is for the workers it starts; give it to start_env_workers")
    want = {"env": cfg.env, "slots per worker": slots_per_worker(cfg.eval), "executor": cfg.eval.executor}
    have = {"env": workers.env_cfg, "slots per worker": workers.slots_per_worker, "executor": workers.kind}
    wrong = [k for k in want if want[k] != have[k]]
    if wrong:
        raise ValueError(
            "run_eval: env_workers were started for another run: "
            + "; ".join(f"{k}: {have[k]} here, {want[k]} wanted" for k in wrong)
        )


def _open_workers(
    cfg: RunConfig, host_factory: Callable | None, env_workers: EnvWorkerPool | None
) -> contextlib.AbstractContextManager[EnvWorkerPool]:
    """The run's env workers: the caller's (left open), else fresh ones (closed at the end)."""
    if env_workers is not None:
        return contextlib.nullcontext(env_workers)
    return start_env_workers(cfg, host_factory)


class _BlankImages:
    """A policy connection that sends every camera image black (``eval.blank_images``): the same
    shapes and dtype, all zeros; everything else as given."""

    def __init__(self, inner: PolicyConnection) -> None:
        self._inner = inner
        self.metadata, self.identity = inner.metadata, inner.identity

    def __call__(self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None) -> Any:
        prefix = image_key("")
        blank = [{k: np.zeros_like(v) if k.startswith(prefix) else v for k, v in o.items()} for o in obs_list]
        return self._inner(blank, seeds)

    def close(self) -> None:
        self._inner.close()


def _connections(make_policy) -> Callable[..., PolicyConnection]:
    """``make_policy`` (a backend's ``connect``, or a caller's factory of bare functions) making
    :class:`PolicyConnection` objects, which everything below calls without asking what they offer."""
    return lambda *args, **kwargs: as_connection(make_policy(*args, **kwargs))


def _blanked(make_policy):
    return lambda *args, **kwargs: _BlankImages(make_policy(*args, **kwargs))


def _probe(
    make_policy, url: str, env_cfg: EnvConfig, reply_s: float, blend: str = "switch"
) -> tuple[dict[str, Any] | None, int | None]:
    """Connect once (checks the server's inputs against the env) and return what it says it serves
    and the image size its model takes (None where it does not say); a server that connects but
    answers nothing within ``reply_s`` (eval.server_timeout_s) fails here, and so does one whose model
    cannot do real-time chunking when ``blend`` is ``rtc``."""
    probe = make_policy(url, env_cfg, Patience(reply_timeout_s=reply_s))
    try:
        meta = probe.metadata
        if blend == "rtc" and not meta.get("real_time_chunking"):
            raise ConfigError(
                f"eval.chunk_blend=rtc: the model served at {url} ({meta.get('model', 'unnamed')}) takes no "
                "prev_actions (its metadata lacks real_time_chunking); use eval.chunk_blend=switch or ensemble"
            )
        inputs = meta.get("inputs") or {}
        size = inputs.get("image_size") if isinstance(inputs, dict) else None
        # the identity is the connection's own reading of what its server says
        return probe.identity, size if isinstance(size, int) else None
    finally:
        probe.close()


def _warn_image_size(env_cfg: EnvConfig, url: str, served: int | None) -> None:
    """A model evaluated on frames of another size than it takes: the server resizes them, which runs,
    but the policy then sees frames rendered at another resolution than its training data's."""
    if served is not None and served != env_cfg.image_size:
        log.warning(
            "env.image_size=%d: the model served at %s takes %d px images, so the server resizes each "
            "%d px frame; set env.image_size=%d to render what the model was trained on",
            env_cfg.image_size, url, served, env_cfg.image_size, served,
        )  # fmt: skip


def _run(
    cfg,
    todo: list[EpisodeSpec],
    journal: Journal,
    urls: list[str],
    make_policy,
    progress,
    on_pipeline,
    prebuild,
    open_workers: Callable[[], contextlib.AbstractContextManager[EnvWorkerPool]],
):
    env_cfg, ecfg = cfg.env, cfg.eval
    num_envs = ecfg.num_envs
    per_worker = slots_per_worker(ecfg)
    workers = len(per_worker)
    out = Path(ecfg.out_dir)
    fps = _video_fps(env_cfg)
    bar = Progress(len(todo), progress)
    videos = VideoBudget(ecfg.videos, journal.records.values())

    def on_finish(record: dict[str, Any], frames) -> None:
        if frames and videos.keep(str(record["task"]), bool(record["success_once"])):
            name = f"videos/{record['task']}/trial{record['trial']}_seed{record['seed']}.mp4"
            try:
                write_mp4(frames, out / name, fps=fps)
                record["video"] = name
            except Exception as err:  # noqa: BLE001 -- a video is a by-product: the episode is journaled
                log.warning("episode %s/%s: its video %s was not written (%s: %s)", record["task"],
                            record["trial"], name, type(err).__name__, err)  # fmt: skip
        if journal.append(record):
            bar.update(record)

    with open_workers() as executor:
        restarts = executor.restarts  # a caller's workers may come from earlier runs
        t_warm = time.perf_counter()
        if executor.env_memory is None:
            # measured on one env before the others are built, by the first run on these workers: a
            # num_envs the host cannot hold is refused here, not found out by the OOM killer half-way
            executor.env_memory = check_env_memory(executor, per_worker[0], todo[0], num_envs)
        env_memory = executor.env_memory
        if prebuild:
            _prebuild(executor, per_worker, todo)
        # calibration: patient connections, one server after the other, as long a reply timeout as
        # the run's (a server that hangs here stops the run, naming its URL)
        patience = Patience(reply_timeout_s=ecfg.server_timeout_s)
        per_server = {url: functools.partial(make_policy, url, env_cfg, patience) for url in urls}
        stages, cal = _calibrate(executor, per_server, todo, ecfg, workers)
        stage_slots, _ = layout(num_envs, stages, workers, by_stage=ecfg.executor == "gpu")
        pool = ServerPool(urls, lambda url, pat: make_policy(url, env_cfg, pat), stages, patience)
        pipeline = Pipeline(
            executor,
            stage_slots,
            pool.stage_policy,
            ecfg.replan_interval,
            on_finish,
            film=lambda spec: videos.film(spec.task, spec.trial),
            frame=lambda obs: frame_of(obs, list(env_cfg.cameras)),
            max_env_retries=ecfg.env_retries,
            servers=len(urls),
            execution=ActionExecution.of(ecfg),
        )
        if on_pipeline is not None:
            on_pipeline(pipeline)
        executor.busy_s = [0.0] * executor.num_workers  # the bound covers the timed part only
        t0 = time.perf_counter()
        warmup = t0 - t_warm
        try:
            pipeline.run(todo)
        finally:
            # interrupted: its stage threads stop calling workers a caller may keep
            left = pipeline.stop(wait_s=STOP_WAIT_S)
            if left:
                log.warning("stage threads %s still running %.0f s after the stop", left, STOP_WAIT_S)
            bar.close()
        wall = time.perf_counter() - t0
        timing = {
            "wall": wall,
            "sim": sum(executor.busy_s),
            "infer": pipeline.infer_s,
            "workers": workers,
            "num_envs": num_envs,
            "stages": stages,
            "env_steps": pipeline.env_steps,
            "executor": ecfg.executor,
            "servers": len(urls),
            "servers_dropped": pool.report(),
            "worker_restarts": executor.restarts - restarts,
            "warmup_s": warmup,
            "resets": pipeline.resets,
            "requests": len(pipeline.requests),
            # per server: idle seconds waiting for simulation, in transit, in fill and drain
            "server_idle": server_idle(pipeline.request_spans, wall),
            **_bound(cal, workers, pipeline),
        }
        if env_memory is not None:
            timing["env_memory"] = env_memory.to_dict()
        if ecfg.executor == "ray":  # where the env actors ran (node id and address)
            timing["worker_nodes"] = executor.nodes()
    atomic_write_json(out / "timeline.json", {"stages": stages, "events": pipeline.events}, indent=None)
    return timing, pipeline.events, stages


def _calibrate(
    executor, per_server: dict[str, Callable], todo: list[EpisodeSpec], ecfg: EvalConfig, workers: int
) -> tuple[int, Calibration | None]:
    """``(stages, calibration)``: the calibration unless ``eval.calibrate_s=0``, and P chosen from it
    for ``--pipeline auto`` (``eval.pipeline_stages=0``, which EvalConfig refuses without one).
    ``per_server``: URL -> policy factory (each server is measured, and so warmed)."""
    stages, n, cal, s = ecfg.pipeline_stages, ecfg.num_envs, None, len(per_server)
    if ecfg.executor == "gpu":  # one stage per worker, fixed; its slots step together, not one by one
        log.info("eval.executor=gpu: %d stages, one per worker; no calibration", stages)
        return stages, None
    if ecfg.calibrate_s > 0:
        t0 = time.perf_counter()
        envs = start_envs(executor, n, todo)  # the run's simulators: built here, not in the calibration
        log.info(
            "%d env slot(s) started in %.1f s before the calibration (a slot's first start builds its "
            "simulator)", n, time.perf_counter() - t0,
        )  # fmt: skip
        sizes = batch_sizes(n, stages, s)
        cal = calibrate(envs, per_server, sizes, ecfg.calibrate_s, ecfg.replan_interval)
    if stages == 0:
        from wamkit.eval.autotune import choose_stages

        assert cal is not None
        stages, _ = choose_stages(cal, n, workers, ecfg.replan_interval, s)
    elif stages % s:
        log.warning(
            "%d stages over %d servers: stage i goes to server i mod %d, so some serve one stage more",
            stages,
            s,
            s,
        )
    return stages, cal


def _bound(cal: Calibration | None, workers: int, pipeline: Pipeline) -> dict[str, Any]:
    """The calibration and the independent bound's two sides for the work the pipeline did."""
    if cal is None:
        return {}
    sides = independent_bound(
        cal, workers, pipeline.env_steps, pipeline.resets, pipeline.requests, pipeline.servers
    )
    return {"calibration": cal.to_dict(), **sides}


def _prebuild(executor, per_worker: list[int], todo: list[EpisodeSpec]) -> None:
    """Start every slot once per task (the first planned episode of each), building its simulators."""
    first: dict[str, EpisodeSpec] = {}
    for spec in todo:
        first.setdefault(spec.task, spec)
    for spec in first.values():
        futs = [
            executor.call(w, executor.generation(w), "start", {s: spec for s in range(n)})
            for w, n in enumerate(per_worker)
        ]
        for f in futs:
            f.result()


def _video_fps(env_cfg: EnvConfig) -> int:
    from wamkit.envs import suite_info

    return min(30, int(suite_info(env_cfg.suite).fps))
