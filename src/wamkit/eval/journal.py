"""The results journal: one JSON line per finished episode, flushed and fsynced before it counts.

``<out_dir>/episodes.jsonl`` is the source of truth of a run; every report is computed from it. A line
is written only when an episode has finished, so a crash loses at most the episodes in flight, and
``--resume`` runs exactly the episodes whose key is missing. A line cut short by a crash (no trailing
newline, or not valid JSON) is dropped on open and the file is truncated back to the last whole line.

``<out_dir>/plan.json`` records what makes the episodes what they are (suite, tasks, trials, seed
rule and seed, render look, max steps, replan interval, the simulator stack's versions, ...):
resuming with a different plan would mix two evaluations, so it is refused with a message naming the
differing keys. A key added to the plan later is read, in a plan written before it, as the value every
earlier run had (:data:`ADDED_PLAN_KEYS`). Its ``server`` entry holds where the model was
reached and, from a server that says, what it serves (``identity``: model name, weights hash, stats
hash, action transform). It is checked once the server is reached (:meth:`Journal.check_server`):
resuming against a server whose identity differs is refused, naming the differing fields; where
either run's server named no identity, the location (URL or serving directory) must match instead.

Record fields: ``suite, task, trial, seed`` (the episode's name), ``success_once, success_at_end``
(bool), ``length`` (policy steps, settle steps excluded), ``return`` (summed reward), ``failure``
("" on success, else e.g. ``"max_steps"``, ``"terminated"``), ``restarts`` (times the episode was
rerun from the start after its worker died), ``stage``, ``worker``, ``timing`` (seconds:
``sim``, ``infer``, ``wall``, and ``start``/``end`` on the run's monotonic clock), ``env_errors``
(times the episode's env raised; past ``eval.env_retries`` the episode is recorded with
``failure: "env_error: <message>"``).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from wamkit.config import ConfigError
from wamkit.eval.execution import SYNC_RECORD
from wamkit.files import append_jsonl, atomic_write_json, read_jsonl

log = logging.getLogger(__name__)

JOURNAL = "episodes.jsonl"
PLAN = "plan.json"
SERVER = "server"  # the plan's entry checked by check_server, not on open
KEY_FIELDS = ("suite", "task", "trial", "seed")
# Plan keys added after plans were first written, with the value every run before them had: a plan
# that lacks one is compared as if it recorded that value (before env.render_gpu, workers rendered on
# EGL's choice of device, which is -1), so --resume of an older run is not refused for the key alone.
# A key added to plan_record (episodes.py) whose old runs all had one value belongs here.
ADDED_PLAN_KEYS: dict[str, Any] = {
    "render_gpu": -1,
    "state": "full",
    "blank_images": False,
    "execution": SYNC_RECORD,
}
# The same for the server identity's fields (before serve.precision, no server used autocast).
ADDED_IDENTITY_KEYS: dict[str, Any] = {"autocast": "off"}
# Identity fields added later with no value to assume for a server that predates them: compared only
# where the journal's server named them (the sampler's steps: before serve.sampling_steps, a serving
# directory was always served at its own)
LATER_IDENTITY_PREFIXES = ("sampler.",)
REQUIRED = KEY_FIELDS + ("success_once", "success_at_end", "length", "return")


def episode_key(suite: str, task: Any, trial: int, seed: int) -> str:
    """The stable name of an episode, e.g. ``metaworld/reach-v3/3/1003``."""
    return f"{suite}/{task}/{int(trial)}/{int(seed)}"


def record_key(record: dict[str, Any]) -> str:
    return episode_key(*(record[k] for k in KEY_FIELDS))


class Journal:
    """Append-only episode records under ``out_dir``; safe to call from several threads."""

    def __init__(self, out_dir: str | Path, plan: dict[str, Any], resume: bool = False):
        self.dir = Path(out_dir)
        self.path = self.dir / JOURNAL
        self.plan_path = self.dir / PLAN
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0 and not resume:
            raise ConfigError(
                f"eval.out_dir: {self.dir} already holds results ({self.path}); "
                "pass --resume to finish that run, or choose another eval.out_dir"
            )
        old = json.loads(self.plan_path.read_text()) if resume and self.plan_path.exists() else None
        self._old_server = old.get(SERVER) if old is not None else None
        if old is not None:
            was, now = {**ADDED_PLAN_KEYS, **old}, {**ADDED_PLAN_KEYS, **plan}
            diff = sorted(k for k in set(was) | set(now) if k != SERVER and was.get(k) != now.get(k))
            if diff:
                details = "; ".join(f"{k}: {was.get(k)!r} -> {now.get(k)!r}" for k in diff)
                raise ConfigError(
                    f"--resume: {self.plan_path} was written for other episodes ({details}); "
                    "resume with the same settings or use another eval.out_dir"
                )
        # the server entry stays the journal's own until check_server has seen the new one
        self.plan = {**plan, SERVER: self._old_server} if self._old_server is not None else dict(plan)
        atomic_write_json(self.plan_path, self.plan, sort_keys=True)
        self.records: dict[str, dict[str, Any]] = read_journal(self.path, repair=True) if resume else {}
        self._fh = open(self.path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115

    def check_server(self, server: dict[str, Any]) -> None:
        """Refuse a server that serves something else than the journal's episodes ran against; then
        record ``server`` (location and identity) in plan.json."""
        diff = server_diff(self._old_server, server)
        if diff:
            raise ConfigError(
                f"--resume: the episodes in {self.path} ran against another model than the one served now "
                f"({'; '.join(diff)}); resume against the same model, or use another eval.out_dir"
            )
        self.plan[SERVER] = server
        atomic_write_json(self.plan_path, self.plan, sort_keys=True)

    def done(self, key: str) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` durably; return False (and write nothing) if its episode is already in."""
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"journal record lacks {missing}: {record}")
        key = record_key(record)
        with self._lock:
            if key in self.records:
                log.warning("episode %s finished twice; keeping the first record", key)
                return False
            append_jsonl(self._fh, record, sort_keys=True, default=_plain)
            self.records[key] = record
        return True

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


NOT_LOCATION = ("identity", "unidentified")


def server_diff(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """``"field: old -> new"`` for what differs between two plan ``server`` entries: their identities
    where both have one, else their locations (``url`` / ``serve_dir``)."""
    if not old:
        return []
    if old.get("identity") and new.get("identity"):
        a = ADDED_IDENTITY_KEYS | _flat(old["identity"])
        b = ADDED_IDENTITY_KEYS | _flat(new["identity"])
        if not any(k.startswith(LATER_IDENTITY_PREFIXES) for k in a):
            b = {k: v for k, v in b.items() if not k.startswith(LATER_IDENTITY_PREFIXES)}
    else:  # the location; the identity and the note that there is none are not part of it
        a = {k: v for k, v in old.items() if k not in NOT_LOCATION}
        b = {k: v for k, v in new.items() if k not in NOT_LOCATION}
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _plain(value: Any) -> Any:
    """numpy scalars -> Python numbers for ``json.dumps``."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"journal: cannot write {type(value).__name__} {value!r} as JSON")


def _check_record(rec: Any) -> None:
    missing = [k for k in REQUIRED if k not in rec] if isinstance(rec, dict) else list(REQUIRED)
    if missing:
        raise ValueError(f"lacks {missing}")


def read_journal(path: str | Path, repair: bool = False) -> dict[str, dict[str, Any]]:
    """Records of ``path`` by episode key (first record wins). With ``repair``, a torn last line is cut.

    A malformed line that is not the last one means the file was edited or corrupted: that raises
    ``ValueError`` naming the line, rather than silently dropping results (:func:`wamkit.files.read_jsonl`).
    """
    records: dict[str, dict[str, Any]] = {}
    for rec in read_jsonl(path, repair=repair, check=_check_record):
        key = record_key(rec)
        if key in records:
            log.warning("%s: episode %s appears twice; keeping the first record", path, key)
            continue
        records[key] = rec
    return records
