"""The collect journal: one fsynced JSON line per finished episode attempt, so a re-run resumes.

``meta/wamkit_collect.jsonl`` in the dataset folder; each line
``{"task", "trial", "seed", "success", "kept", "steps", "episode_index"}`` (``episode_index`` is
null for a discarded attempt). A (task, seed) in the journal is never attempted again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from wamkit.files import append_jsonl_path, read_jsonl, rewrite_jsonl

JOURNAL = "meta/wamkit_collect.jsonl"


class CollectJournal:
    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / JOURNAL
        # a line torn by a crash mid-write is dropped (that attempt is redone); see wamkit.files
        self.entries: list[dict[str, Any]] = read_jsonl(self.path, repair=True)
        for n, entry in enumerate(self.entries, 1):
            missing = {"task", "seed", "kept"} - set(entry)
            if missing:
                raise ValueError(f"{self.path}: record {n}: missing key(s) {sorted(missing)}")

    def attempted(self) -> set[tuple[str, int]]:
        return {(e["task"], int(e["seed"])) for e in self.entries}

    def kept(self) -> Counter:
        """Kept episodes per task."""
        return Counter(e["task"] for e in self.entries if e["kept"])

    def append(self, entry: dict[str, Any]) -> None:
        append_jsonl_path(self.path, entry)
        self.entries.append(entry)

    def reconcile(self, committed: int) -> int:
        """Drop kept entries whose episode the writer never committed (``episode_index >= committed``:
        a crash between journaling and saving); returns the number of kept entries left."""
        good = [
            e
            for e in self.entries
            if not e["kept"] or (e.get("episode_index") is not None and e["episode_index"] < committed)
        ]
        if len(good) != len(self.entries):
            rewrite_jsonl(self.path, good)
            self.entries = good
        return sum(1 for e in self.entries if e["kept"])
