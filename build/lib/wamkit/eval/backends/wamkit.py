"""``eval.backend=wamkit``: wamkit's own server (``wamkit serve``), the default.

A stage's observations go as one batched request (its server batches across connections too); the
server applies the run's preprocessing, so the env's frames, raw state and task go as they are
(:class:`~wamkit.eval.remote.RemotePolicy`), and its metadata names what it serves.
"""

from __future__ import annotations

from typing import Any

from wamkit.eval.remote import RemotePolicy


def connect(target: Any, patience: Any) -> RemotePolicy:
    return RemotePolicy(target.url, list(target.cameras), target.suite, target.look, patience)
