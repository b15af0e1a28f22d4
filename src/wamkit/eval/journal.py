"""The results journal: one JSON line per finished episode, flushed and fsynced before it counts.

``<out_dir>/episodes.jsonl`` is the source of truth of a run; every report is computed from it. A line
is written only when an episode has finished, so a crash loses at most the episodes in flight, and
``--resume`` runs exactly the episodes whose key is missing. A line cut short by a crash (no trailing
newline, or not valid JSON) is dropped on open and the file is truncated back to the last whole line.

``<out_dir>/plan.json`` records what makes the episodes what they are (suite, tasks, trials, seed
rule and seed, render look, max steps, replan interval, the simulator stack's versions, ...): resuming with a different plan would mix two evaluations, so it is
refused with a message naming the differing keys.

Record fields: ``suite, task, trial, seed`` (the episode's name), ``success_once, success_at_end``
(bool), ``length`` (policy steps, settle steps excluded), ``return`` (summed reward), ``failure``
("" on success, else e.g. ``"max_steps"``, ``"terminated"``), ``restarts`` (times the episode was
rerun from the start after its worker died), ``stage``, ``worker``, ``timing`` (seconds:
``sim``, ``infer``, ``wall``, and ``start``/``end`` on the run's monotonic clock).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from wamkit.config import ConfigError
from wamkit.files import atomic_write_json

log = logging.getLogger(__name__)

JOURNAL = "episodes.jsonl"
PLAN = "plan.json"
KEY_FIELDS = ("suite", "task", "trial", "seed")
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
        if resume and self.plan_path.exists():
            old = json.loads(self.plan_path.read_text())
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            if diff:
                details = "; ".join(f"{k}: {old.get(k)!r} -> {plan.get(k)!r}" for k in diff)
                raise ConfigError(
                    f"--resume: {self.plan_path} was written for other episodes ({details}); "
                    "resume with the same settings or use another eval.out_dir"
                )
        atomic_write_json(self.plan_path, plan, sort_keys=True)
        self.records: dict[str, dict[str, Any]] = read_journal(self.path, repair=True) if resume else {}
        self._fh = open(self.path, "a" if resume else "w", encoding="utf-8")  # noqa: SIM115

    def done(self, key: str) -> bool:
        return key in self.records

    def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` durably; return False (and write nothing) if its episode is already in."""
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"journal record lacks {missing}: {record}")
        key = record_key(record)
        line = json.dumps(record, sort_keys=True, default=_plain)
        with self._lock:
            if key in self.records:
                log.warning("episode %s finished twice; keeping the first record", key)
                return False
            self._fh.write(line + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
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


def _plain(value: Any) -> Any:
    """numpy scalars -> Python numbers for ``json.dumps``."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"journal: cannot write {type(value).__name__} {value!r} as JSON")


def read_journal(path: str | Path, repair: bool = False) -> dict[str, dict[str, Any]]:
    """Records of ``path`` by episode key (first record wins). With ``repair``, a torn last line is cut.

    A malformed line that is not the last one means the file was edited or corrupted: that raises
    ``ValueError`` naming the line, rather than silently dropping results.
    """
    path = Path(path)
    if not path.exists():
        return {}
    raw = path.read_bytes()
    records: dict[str, dict[str, Any]] = {}
    good_end = 0
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        last = i == len(lines) - 1
        if last and line == b"":
            break
        try:
            if last:  # no trailing newline: the write was cut short
                raise ValueError("line has no newline")
            rec = json.loads(line)
            missing = [k for k in REQUIRED if k not in rec]
            if missing:
                raise ValueError(f"lacks {missing}")
        except ValueError as err:
            if last or (i == len(lines) - 2 and lines[-1] == b""):
                log.warning("%s: dropping a torn last line (%s)", path, err)
                break
            raise ValueError(f"{path}: line {i + 1} is not a valid episode record: {err}") from None
        good_end += len(line) + 1
        key = record_key(rec)
        if key in records:
            log.warning("%s: episode %s appears twice; keeping the first record", path, key)
            continue
        records[key] = rec
    if repair and good_end < len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
            fh.flush()
            os.fsync(fh.fileno())
    return records
