"""``eval.backend=openpi``: any OpenPI websocket server (openpi's ``scripts/serve_policy.py``,
cosmos-framework's ``action_policy_server_robolab.py``, or wamkit's own).

Such a server takes one observation per request, in the keys of the suite's reference client (its
embodiment profile's ``request_images`` and ``request_state``, which cite the client), e.g.
``observation/image`` and ``observation/wrist_image`` (the env's
first and second camera, uint8 [H, W, 3] as rendered: the model's own transforms resize them),
``observation/state`` (the raw env state) and ``prompt``. It answers ``actions`` [H, D] (openpi) or
``action`` (cosmos-framework's RoboLab server, ``cosmos_framework/scripts/action_policy_server_robolab.py:624``)
in env units, the server having applied its own normalisation. Its metadata is whatever the server
sends on connect: ``{}`` for openpi's default (``src/openpi/serving/websocket_policy_server.py:31,52``)
and for the RoboLab server (``action_policy_server_robolab.py:646``).

A stage's B observations go as B concurrent requests over ``eval.backend_options.connections``
connections (default: one per observation, at most 8): openpi's server answers each connection in
its own task, so a server that can overlap requests does; one that runs inference in its event loop
answers them one after another, as it would anyway.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from wamkit import embodiments
from wamkit.constants import OBS_STATE, PROMPT, TASK, image_key
from wamkit.eval.backends.base import BackendError, check_actions, connections
from wamkit.eval.backends.wamkit import reply_timing, served_identity

NAME = "openpi"
REPLY_KEYS = ("actions", "action")
MAX_CONNECTIONS = 8


def request_keys(suite: Any) -> tuple[tuple[str, ...], str]:
    """``(image keys in camera order, state key)`` of the reference client of ``suite`` (a SuiteInfo,
    or None: the first registered embodiment's)."""
    profile = embodiments.for_suite(suite.suite) if suite is not None else None
    if profile is not None and profile.request_images and profile.request_state:
        return profile.request_images, profile.request_state
    return embodiments.request_aliases()[0]


def request(
    obs: dict[str, Any], cameras: tuple[str, ...], keys: tuple[tuple[str, ...], str]
) -> dict[str, Any]:
    """One observation in the reference client's keys (``keys``: :func:`request_keys`)."""
    images, state = keys
    req = {key: np.asarray(obs[image_key(cam)]) for key, cam in zip(images, cameras)}
    req[state] = np.asarray(obs[OBS_STATE], np.float32)
    req[PROMPT] = str(obs[TASK])
    return req


class OpenPIPolicy:
    """A pool of websocket connections to one OpenPI server (module docstring)."""

    def __init__(self, target: Any, patience: Any):
        self.url, self.cameras = target.url, tuple(target.cameras)
        self.patience = patience
        self.width = connections(NAME, target, MAX_CONNECTIONS)
        self.dim = target.suite.action_dim if target.suite is not None else None
        self.keys = request_keys(target.suite)
        self.clients = [patience.client(self.url)]  # connects now: an unreachable server fails here
        self.metadata: dict[str, Any] = dict(self.clients[0].metadata or {})
        self.identity = _identity(self.metadata)
        self._pool: ThreadPoolExecutor | None = None

    def _one(self, i: int, obs: dict[str, Any]) -> tuple[np.ndarray, float]:
        reply = self.clients[i].infer(
            request(obs, self.cameras, self.keys), timeout_s=self.patience.reply_timeout_s
        )
        if not isinstance(reply, dict):
            raise BackendError(NAME, self.url, f"reply: expected a map, got {type(reply).__name__}")
        key = next((k for k in REPLY_KEYS if k in reply), None)
        if key is None:
            raise BackendError(NAME, self.url, f"reply lacks 'actions' (keys: {sorted(reply)})")
        infer_s, _ = reply_timing(reply, float("nan"), 1)
        return check_actions(NAME, self.url, reply[key], 1, self.dim, key)[0], infer_s

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        n = min(len(obs_list), self.width)
        while len(self.clients) < n:
            self.clients.append(self.patience.client(self.url))
        t0 = time.perf_counter()
        if n == 1:
            results = [self._one(0, o) for o in obs_list]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.width, thread_name_prefix="openpi")
            # observation j on connection j mod n: each connection carries one request at a time
            chunks = [list(range(i, len(obs_list), n)) for i in range(n)]
            futures = [self._pool.submit(lambda i, js: [self._one(i, obs_list[j]) for j in js], i, js)
                       for i, js in enumerate(chunks)]  # fmt: skip
            by_index: dict[int, tuple[np.ndarray, float]] = {}
            for js, fut in zip(chunks, futures):
                by_index.update(zip(js, fut.result()))
            results = [by_index[j] for j in range(len(obs_list))]
        rtt = time.perf_counter() - t0
        horizons = {r[0].shape[0] for r in results}
        if len(horizons) > 1:
            raise BackendError(
                NAME, self.url, f"actions: chunks of different lengths {sorted(horizons)} in one stage"
            )
        # the server's own model time for one observation; for several, the stage's round trip: a
        # server that answers them one after another spends their sum, one that overlaps them less
        infer_s = results[0][1] if len(results) == 1 and np.isfinite(results[0][1]) else rtt
        return np.stack([r[0] for r in results]), infer_s, len(obs_list)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients = []
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _identity(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """What an OpenPI server says it serves: wamkit's identity when it is wamkit's, else the metadata
    itself when it says anything (openpi sends {} by default: nothing can be told)."""
    ident = served_identity(metadata)
    if ident is not None or not metadata:
        return ident
    # as plan.json can hold it: arrays or bytes a server may send are written as their repr
    return {"backend": NAME, "metadata": json.loads(json.dumps(metadata, default=repr))}


def connect(target: Any, patience: Any) -> OpenPIPolicy:
    return OpenPIPolicy(target, patience)
