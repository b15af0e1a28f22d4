"""Several servers for one evaluation: whole stages per server; a server that drops out hands its stages on.

With S servers (``eval.server_url`` a list), pipeline stage ``i`` sends its requests to server
``i mod S``: a stage's request (its batch of N/P observations) always goes whole to one server, and with
P a multiple of S every server serves P/S stages. All servers must serve the same model:
:func:`same_model` compares what each says it serves (metadata ``identity``) and refuses a mixed set,
naming the URL that differs.

A server drops out when a request to it fails with a connection error (refused, closed) or gets no reply
within ``eval.server_timeout_s``. While other servers are up, a stage's connection does not wait for
a server to come back (:meth:`~wamkit.eval.backends.base.Patience.failover`): the server is dropped for the rest
of the run, each of its stages moves to the live server serving the fewest stages, and the request that
was in flight is sent again, whole, to the stage's new server. Episodes are not restarted: a request
changes no env state (its envs wait in their workers with the observations that were sent), so the
re-sent request is the same request, and a deterministic model answers it with the same actions (a
sampling one draws a fresh sample, as the first server would have). Episodes are journaled by the env
side once they end, so none is lost or counted twice. The last server left is waited for as a single
server is (its connection reopened with backoff, the request sent again); if that fails too the run
stops, and the journal keeps every finished episode for ``--resume``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from wamkit.config import ConfigError
from wamkit.eval.backends.base import Patience, PolicyConnection
from wamkit.eval.journal import server_diff

log = logging.getLogger(__name__)

# (url, patience) -> a connection: ``policy(obs_list) -> (actions [B, H, D], server seconds, call size)``
Connect = Callable[[str, Patience], Callable]
# OSError covers ConnectionError (refused, closed, retries spent) and TimeoutError
SERVER_LOST = (OSError,)


def same_model(urls: list[str], identities: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The identity all ``urls`` serve; a :class:`ConfigError` naming the URL that serves another model.

    Servers that send no identity (openpi's, SGLang's) cannot be compared: one of them is accepted
    alone, several only if none says what it serves (then with a warning)."""
    first = identities[0]
    if len(urls) == 1:
        return first
    if all(i is None for i in identities):
        log.warning("the servers %s send no identity: that they serve one model cannot be checked", urls)
        return None
    for url, identity in zip(urls[1:], identities[1:]):
        if (identity is None) != (first is None):
            silent = url if identity is None else urls[0]
            raise ConfigError(
                f"eval.server_url: {silent} sends no identity while the other servers do, so it cannot "
                "be checked to serve the same model; evaluate with servers of one kind"
            )
        diff = server_diff({"identity": first}, {"identity": identity})
        if diff:
            raise ConfigError(
                f"eval.server_url: {url} serves another model than {urls[0]} ({'; '.join(diff)}); "
                "every server of one evaluation must serve the same model"
            )
    return first


class ServerPool:
    """The servers of one run and which stage each serves; shared by the stages' threads."""

    def __init__(self, urls: list[str], connect: Connect, stages: int, patience: Patience):
        self.urls = list(urls)
        self.patience = patience
        self._connect = connect
        self._serving = [s % len(self.urls) for s in range(stages)]  # stage -> server index
        self.dropped: dict[int, str] = {}  # server index -> why
        self.moves: list[dict[str, Any]] = []  # one per stage moved: stage, from, to (URLs)
        self._lock = threading.Lock()

    def server_of(self, stage: int) -> int:
        with self._lock:
            return self._serving[stage]

    def live(self) -> int:
        with self._lock:
            return len(self.urls) - len(self.dropped)

    def connect(self, server: int, patient: bool) -> Callable:
        """A connection to ``server``: ``patient`` (the last live server) waits for it, else it fails
        fast so that another server can take the request."""
        return self._connect(self.urls[server], self.patience if patient else self.patience.failover())

    def drop(self, server: int, reason: str) -> bool:
        """Drop ``server`` and move its stages; False (nothing dropped) when it is the last one up."""
        with self._lock:
            if server in self.dropped:
                return True  # another stage saw it go first; its stages have moved already
            live = [i for i in range(len(self.urls)) if i != server and i not in self.dropped]
            if not live:
                return False
            self.dropped[server] = reason
            for stage, serving in enumerate(self._serving):
                if serving == server:
                    load = collections.Counter(self._serving)
                    to = min(live, key=lambda i: (load[i], i))
                    self._serving[stage] = to
                    self.moves.append({"stage": stage, "from": self.urls[server], "to": self.urls[to]})
            moved = [m["stage"] for m in self.moves if m["from"] == self.urls[server]]
        log.warning("server %s dropped out (%s); its stages %s moved", self.urls[server], reason, moved)
        return True

    def report(self) -> list[dict[str, Any]]:
        """The servers that dropped out: ``url``, ``reason`` and the stages moved off them."""
        with self._lock:
            return [
                {
                    "url": self.urls[i],
                    "reason": why,
                    "stages": [m["stage"] for m in self.moves if m["from"] == self.urls[i]],
                }
                for i, why in self.dropped.items()
            ]

    def stage_policy(self, stage: int) -> StagePolicy:
        return StagePolicy(self, stage)


class StagePolicy:
    """One stage's policy: ``policy(obs_list) -> (actions, server seconds, call size, server index)``,
    on the stage's current server; a lost server's request is sent again to the next (module docstring)."""

    def __init__(self, pool: ServerPool, stage: int):
        self.pool, self.stage = pool, stage
        self.server = -1
        self.conn: PolicyConnection | None = None
        self.patient = False

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int, int]:
        while True:
            server = self.pool.server_of(self.stage)
            try:
                if self.conn is None or server != self.server:
                    self.close()
                    self.server = server
                    # set before connecting: a connect that fails is judged by its own patience, so
                    # the last server's failed reconnect stops the run instead of being retried forever
                    self.patient = self.pool.live() == 1
                    self.conn = self.pool.connect(server, self.patient)
                actions, infer_s, call = self.conn(obs_list, seeds)
                return actions, infer_s, call, server
            except SERVER_LOST as err:
                self.close()
                reason = f"{type(err).__name__}: {err}"
                if not self.pool.drop(server, reason) and self.patient:
                    raise  # the last server, waited for as a single server is: the run stops
                # otherwise: the stage's new server (or the last one, now waited for) gets the request

    def close(self) -> None:
        if self.conn is not None:
            conn, self.conn = self.conn, None
            conn.close()
