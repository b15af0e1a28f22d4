"""The collect journal: one fsynced JSON line per finished episode attempt, so a re-run resumes.

``meta/wamkit_collect.jsonl`` in the dataset folder; each line
``{"task", "trial", "seed", "success", "kept", "steps", "episode_index"}`` (``episode_index`` is
null for a discarded attempt). A (task, seed) in the journal is never attempted again.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

JOURNAL = "meta/wamkit_collect.jsonl"


class Journal:
    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / JOURNAL
        self.entries: list[dict[str, Any]] = []
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            for n, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError as err:
                    if n == len(lines):  # torn by a crash mid-write: drop it, that attempt is redone
                        self.path.write_text("".join(ln + "\n" for ln in lines[:-1]))
                        break
                    raise ValueError(f"{self.path}:{n}: not a JSON line ({err})") from None
                missing = {"task", "seed", "kept"} - set(entry)
                if missing:
                    raise ValueError(f"{self.path}:{n}: missing key(s) {sorted(missing)}")
                self.entries.append(entry)

    def attempted(self) -> set[tuple[str, int]]:
        return {(e["task"], int(e["seed"])) for e in self.entries}

    def kept(self) -> Counter:
        """Kept episodes per task."""
        return Counter(e["task"] for e in self.entries if e["kept"])

    def append(self, entry: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
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
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(e) + "\n" for e in good))
            os.replace(tmp, self.path)
            self.entries = good
        return sum(1 for e in self.entries if e["kept"])
