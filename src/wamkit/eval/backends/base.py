"""What every backend shares: the target a connection is made for, and its errors.

A connection is a callable ``policy(obs_list) -> (actions [B, H, D] float32, server seconds, call
size)`` with ``metadata`` (what the server said about itself), ``identity`` (what it serves, for
``plan.json`` and ``--resume``; None when the server cannot tell) and ``close()``.

Errors: a reply that is wrong (a malformed body, actions of the wrong shape or width) raises
:class:`BackendError`, which names the backend, the URL and the field, and stops the run (sending it
again would get the same answer). A server that cannot be reached, drops the connection or answers
not within ``eval.server_timeout_s`` raises ``ConnectionError`` / ``TimeoutError`` after the
:class:`~wamkit.eval.remote.Patience` retries: with several servers its stages move to another one,
with one the run stops; either way every episode already journaled stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


class BackendError(RuntimeError):
    """A server's answer that is wrong: names the backend, the URL and what was wrong."""

    def __init__(self, backend: str, url: str, message: str):
        super().__init__(f"eval.backend={backend} at {url}: {message}")
        self.backend, self.url = backend, url


@dataclass(frozen=True)
class Target:
    """What one connection is for: the server and what the env renders and expects back."""

    url: str
    cameras: tuple[str, ...]  # the env's rendered cameras, in order
    suite: Any = None  # the env's SuiteInfo (fps, state and action widths), when known
    look: str | None = None  # the env's resolved render look
    options: dict[str, Any] = field(default_factory=dict)  # eval.backend_options


def check_actions(backend: str, url: str, actions: Any, n: int, dim: int | None, where: str) -> np.ndarray:
    """``actions`` as float32 [n, H, dim] (a single [H, dim] for n == 1 too), or a BackendError naming
    ``where`` (the reply field) and what was wrong."""
    try:
        a = np.asarray(actions, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise BackendError(backend, url, f"{where}: not a numeric array ({err})") from None
    if a.ndim == 2 and n == 1:
        a = a[None]
    if a.ndim != 3 or a.shape[0] != n or a.shape[1] < 1:
        raise BackendError(
            backend, url, f"{where}: shape {list(a.shape)}, expected [{n}, horizon, action_dim]"
        )
    if dim is not None and a.shape[2] != dim:
        raise BackendError(backend, url, f"{where}: action width {a.shape[2]}, expected {dim}")
    if not np.isfinite(a).all():
        raise BackendError(backend, url, f"{where}: holds NaN or infinite values")
    return a
