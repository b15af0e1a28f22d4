"""``wamkit collect``: run scripted experts in parallel worker processes and write a LeRobot v3 dataset.

Episode e of a task is ``EpisodeSpec(suite, task, trial=e, seed=collect.seed + e)``. Seeds are tried in
order until ``collect.episodes`` successful episodes per task are kept (all attempts with
``--keep-failed``), giving up on a task after ``2 * episodes + 10`` attempts. Every finished attempt is
journaled (``meta/wamkit_collect.jsonl``, fsynced): re-running the same command skips what is done and
never collects a (task, seed) twice.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from dataclasses import replace
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from wamkit import embodiments
from wamkit.config import ConfigError, RunConfig
from wamkit.constants import ACTION, EXECUTED_ACTION, OBS_STATE, TASK, image_key
from wamkit.envs.base import EpisodeSpec, check_env_config, render_info
from wamkit.envs.collect_journal import CollectJournal
from wamkit.envs.expert import ExpertHost
from wamkit.envs.suites import expand_tasks, resolve_env_config, suite_info
from wamkit.envs.workers import EnvWorker, WorkerDied
from wamkit.log import progress_bar

log = logging.getLogger(__name__)


# command-line flag -> dotted config key
def features_for(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """LeRobot v3 feature descriptions of a collected dataset."""
    info = suite_info(cfg.env.suite, cfg.env.state)
    names = list(embodiments.for_suite(cfg.env.suite).state_names_of(cfg.env.state))
    s = cfg.env.image_size
    feats: dict[str, dict[str, Any]] = {
        image_key(c): {"dtype": "video", "shape": [s, s, 3], "names": ["height", "width", "channel"]}
        for c in cfg.env.cameras
    }
    feats[OBS_STATE] = {"dtype": "float32", "shape": [info.state_dim], "names": names}
    feats[ACTION] = {"dtype": "float32", "shape": [info.action_dim], "names": None}
    if _noise_record(cfg.collect):  # perturbed: what the env executed, beside the expert's labels
        feats[EXECUTED_ACTION] = {"dtype": "float32", "shape": [info.action_dim], "names": None}
    return feats


def _check_collect(cfg: RunConfig) -> None:
    c = cfg.collect
    if c.episodes < 1:
        raise ConfigError(f"collect.episodes: expected >= 1 per task, got {c.episodes}")
    if c.workers < 1:
        raise ConfigError(f"collect.workers: expected >= 1, got {c.workers}")
    if not (math.isfinite(c.action_noise) and c.action_noise >= 0):
        raise ConfigError(
            f"collect.action_noise: expected a standard deviation >= 0 (the env's action units), got {c.action_noise}"
        )
    if c.action_lag < 0:
        raise ConfigError(f"collect.action_lag: expected >= 0 steps (0: no late actions), got {c.action_lag}")
    if not (math.isfinite(c.lag_prob) and 0 <= c.lag_prob <= 1):
        raise ConfigError(f"collect.lag_prob: expected a probability in [0, 1], got {c.lag_prob}")
    if (c.action_lag > 0) != (c.lag_prob > 0):
        raise ConfigError(
            f"collect.action_lag, collect.lag_prob: late actions need both (a lag > 0 and a probability > 0), "
            f"got action_lag={c.action_lag}, lag_prob={c.lag_prob}"
        )
    if c.noise_hold < 1:
        raise ConfigError(f"collect.noise_hold: expected >= 1 steps per noise draw, got {c.noise_hold}")
    if not c.out:
        raise ConfigError("collect.out: a dataset folder is needed")
    check_env_config(cfg.env)
    profile = embodiments.for_suite(cfg.env.suite)
    if profile is not None and not profile.scripted_expert:
        with_expert = [s for s, e in embodiments.suites().items() if e.scripted_expert]
        raise ConfigError(
            f"env.suite: {cfg.env.suite} has no scripted expert to collect with (its datasets come from "
            f"recorded demonstrations); suites with one: {', '.join(with_expert)}"
        )


_NOISE_KEYS = ("action_noise", "noise_hold", "action_lag", "lag_prob")


def _noise_record(c) -> dict[str, Any]:
    """What ``info.json`` records of the perturbations (:class:`~wamkit.config.CollectConfig`: DART's
    noise, late actions): nothing without them; the executed actions were perturbed, the recorded ones
    are the expert's."""
    rec: dict[str, Any] = {}
    if c.action_noise:
        rec["action_noise"] = float(c.action_noise)
    if c.action_lag:
        rec.update(action_lag=int(c.action_lag), lag_prob=float(c.lag_prob))
    if rec:
        rec["noise_hold"] = int(c.noise_hold)
    return rec


def _open_writer(cfg: RunConfig, root: Path, journal: CollectJournal):
    """Create the dataset, or re-open it to resume after checking it was made with the same settings
    and reconciling the journal with the episodes the writer really committed."""
    from wamkit.data import LeRobotDatasetWriter  # the data stage: imported only when writing
    from wamkit.data.meta import INFO, PARTIAL

    extra, fps = render_info(cfg.env), suite_info(cfg.env.suite).fps
    # the actions recorded are the env's own commands: their gripper convention is known, not guessed
    # from their range (a MetaWorld expert's grab effort spans [0, 1] with 1 = close)
    extra["gripper"] = "env"
    noise = _noise_record(cfg.collect)
    extra.update(noise)
    meta_file = next((root / f for f in (PARTIAL, INFO) if (root / f).is_file()), None)
    if meta_file is None:
        if journal.entries or (root.exists() and any(root.iterdir())):
            raise ConfigError(f"collect.out: {root} exists and is not a dataset written by wamkit collect")
        info = suite_info(cfg.env.suite)
        return LeRobotDatasetWriter.create(
            root, fps, features_for(cfg), robot_type=info.robot_type, extra_info=extra
        )
    info = json.loads(meta_file.read_text())
    have = {k: (info.get("wamkit") or {}).get(k) for k in extra}
    made = {k: v for k, v in (info.get("wamkit") or {}).items() if k in _NOISE_KEYS}
    if made != noise:  # named apart from the look: a clean dataset's record has no noise keys at all
        differ = sorted(k for k in _NOISE_KEYS if made.get(k) != noise.get(k))
        raise ConfigError(
            f"{', '.join('collect.' + k for k in differ)}: {root} holds a dataset collected with "
            f"{made or 'no perturbation'}; this run asks for {noise or 'none'}: choose another --out, or "
            "the same perturbation to resume"
        )
    shapes = {k: (info.get("features") or {}).get(k, {}).get("shape") for k in features_for(cfg)}
    if (
        have != extra
        or info.get("fps") != fps
        or shapes != {k: f["shape"] for k, f in features_for(cfg).items()}
    ):
        raise ConfigError(
            f"collect.out: {root} holds a dataset made with {have} at {info.get('fps')} fps; this run asks "
            f"for {extra} at {fps} fps: choose another --out, or the same settings to resume"
        )
    finished = (root / INFO).is_file()
    writer = LeRobotDatasetWriter.open(root)
    kept = journal.reconcile(writer.num_episodes)
    if kept != writer.num_episodes:
        if finished:  # refused: the dataset is left as it was found, complete and readable
            writer.finalize()
        raise ConfigError(
            f"collect.out: {root} holds {writer.num_episodes} episodes but its journal "
            f"({journal.path}) accounts for {kept}; it was changed by hand: use another --out"
        )
    return writer


def _write_episode(writer, result: dict[str, Any]) -> int:
    frames = result["frames"]
    try:
        for t in range(result["steps"]):
            frame = {k: v[t] for k, v in frames.items()}
            frame[TASK] = result["task"]
            writer.add_frame(frame)
        return writer.save_episode()
    except BaseException:
        writer.discard_episode()
        raise


def collect(cfg: RunConfig, progress: bool = True) -> dict[str, Any]:
    """Collect ``cfg.collect.episodes`` expert episodes per task into ``cfg.collect.out``.

    Returns a summary: kept / attempted / successes per task, episodes per minute, wall seconds.
    Episodes are journaled and written in the order they were handed out (task by task, trial by
    trial), whichever worker finishes first: the dataset is the same for any number of workers.
    """
    _check_collect(cfg)
    tasks = expand_tasks(cfg.env.suite, cfg.env.tasks)
    # the env's "auto" settings resolved once, here: the dataset's record and the workers get them so
    env_cfg = resolve_env_config(replace(cfg.env, tasks=tasks))
    cfg = replace(cfg, env=env_cfg)
    c = cfg.collect
    root = Path(c.out)
    journal = CollectJournal(root)
    writer = _open_writer(cfg, root, journal)
    done = journal.attempted()
    kept, attempts = journal.kept(), Counter(e["task"] for e in journal.entries)
    in_flight: Counter = Counter()
    next_trial = {t: 0 for t in tasks}
    max_attempts = 2 * c.episodes + 10
    noise = {k: getattr(c, k) for k in _NOISE_KEYS}
    stats = {t: {"attempted": 0, "success": 0, "kept": 0} for t in tasks}

    def next_spec() -> EpisodeSpec | None:
        for task in tasks:
            while (
                kept[task] + in_flight[task] < c.episodes and attempts[task] + in_flight[task] < max_attempts
            ):
                e = next_trial[task]
                next_trial[task] += 1
                if (task, c.seed + e) in done:
                    continue
                return EpisodeSpec(cfg.env.suite, task, e, c.seed + e)
        return None

    total = c.episodes * len(tasks)
    bar = progress_bar(
        total=total, initial=sum(min(kept[t], c.episodes) for t in tasks), unit="ep", disable=not progress
    )
    n_workers = min(c.workers, sum(max(0, c.episodes - kept[t]) for t in tasks))  # none when all done
    workers = [EnvWorker(env_cfg, 1, i, host_factory=ExpertHost) for i in range(n_workers)]
    busy: dict[int, tuple[int, EpisodeSpec]] = {}  # worker -> (hand-out number, episode)
    finished: dict[int, tuple[EpisodeSpec, dict[str, Any], bool]] = {}  # waiting for those handed out before
    handed, committed = 0, 0
    restarts, max_restarts = 0, 2 * n_workers
    start, new_eps = time.perf_counter(), 0

    def hand_out(w: EnvWorker, spec: EpisodeSpec) -> None:
        nonlocal handed
        w.submit("rollout", {"spec": spec, "keep_failed": c.keep_failed, **noise})
        busy[w.worker_id], in_flight[spec.task] = (handed, spec), in_flight[spec.task] + 1
        handed += 1

    def commit(spec: EpisodeSpec, result: dict[str, Any], keep: bool) -> None:
        nonlocal new_eps
        # journaled before the episode is committed: a crash in between leaves a journal line
        # whose episode_index the writer never reached, which reconcile() drops on resume
        index = writer.num_episodes if keep else None
        journal.append(
            {
                **spec.to_dict(),
                "success": result["success"],
                "kept": keep,
                "steps": result["steps"],
                "episode_index": index,
                **({"planner_solved": result["planner_solved"]} if "planner_solved" in result else {}),
            }
        )
        if keep:
            _write_episode(writer, result)
            new_eps += 1

    try:
        for w in workers:
            spec = next_spec()
            if spec is None:
                break
            hand_out(w, spec)
        while busy:
            ready = wait([workers[i].connection for i in busy])
            for w in [w for w in workers if w.connection in ready and w.worker_id in busy]:
                try:
                    result = w.result()
                except WorkerDied as err:
                    restarts += 1
                    if restarts > max_restarts:
                        raise
                    log.warning("%s; restarting it and re-running the episode", err)
                    w.close(timeout=1.0)  # reaps the dead process, closes its pipe
                    workers[w.worker_id] = EnvWorker(env_cfg, 1, w.worker_id, host_factory=ExpertHost)
                    workers[w.worker_id].submit(
                        "rollout",
                        {"spec": busy[w.worker_id][1], "keep_failed": c.keep_failed, **noise},
                    )
                    continue
                number, spec = busy.pop(w.worker_id)
                in_flight[spec.task] -= 1
                attempts[spec.task] += 1
                keep = result["success"] or c.keep_failed
                st = stats[spec.task]
                st["attempted"] += 1
                st["success"] += int(result["success"])
                if "planner_solved" in result:
                    st["planner_solved"] = st.get("planner_solved", 0) + int(result["planner_solved"])
                if keep:  # counted now, so that what is handed out next does not wait for the writer
                    kept[spec.task] += 1
                    st["kept"] += 1
                    bar.update(1)
                # written in hand-out order: an episode that finished early waits for those before it
                finished[number] = (spec, result, keep)
                while committed in finished:
                    commit(*finished.pop(committed))
                    committed += 1
                nxt = next_spec()
                if nxt is not None:
                    hand_out(w, nxt)
    finally:
        bar.close()
        for i in busy:  # stopped early (Ctrl-C, an error): a rollout still running is dropped, not waited
            workers[i].kill()  # for (its reply, larger than the pipe, would block it from ever exiting)
        try:
            if writer.num_episodes:
                writer.finalize()
            else:
                log.warning("%s: no episode was kept; the dataset is left unfinished", root)
        finally:
            for w in workers:
                w.close()
    wall = time.perf_counter() - start
    for task in tasks:
        if kept[task] < c.episodes:
            log.warning(
                "%s: only %d of %d episodes succeeded after %d attempts",
                task,
                kept[task],
                c.episodes,
                attempts[task],
            )
    return {
        "out": str(root),
        "tasks": stats,
        "kept_total": sum(kept[t] for t in tasks),
        "new_episodes": new_eps,
        "wall_s": wall,
        "episodes_per_min": 60.0 * new_eps / wall if wall > 0 else 0.0,
    }
