"""``eval.backend=wamkit`` (the default): wamkit's own server (``wamkit serve``), batched requests over
the OpenPI websocket protocol.

The evaluator never imports a model; it reaches one through :mod:`wamkit.serve.client` only, so any
server that speaks the protocol (wamkit's, openpi's, SGLang's ``/openpi/policy``) can be evaluated.

A stage's request holds its B observations with a leading batch axis: ``observation.images.<cam>``
uint8 [B, H, W, 3] for each camera the server asks for (its metadata ``inputs.image_keys``; all
rendered cameras if it does not say), ``observation.state`` float32 [B, state_dim] and ``prompt`` a list
of B strings. The reply's ``actions`` are env-ready chunks [B, H, action_dim].

A wamkit server also sends its preprocessing spec (metadata ``preprocess``: fps, state and action
widths, cameras; see :mod:`wamkit.actions.spec`). When the env's suite is known, a spec that does not
fit it (a model trained on 10 FPS data evaluated at 20, a 4-D MetaWorld model on a 7-D arm, frames of
the fast look evaluated on the default one) is refused before any episode runs. Other servers send no spec and are taken as they are.

A wamkit server also names what it serves (metadata ``identity``: model name, weights hash, stats
hash, action transform); :func:`served_identity` reads it for ``plan.json``, so ``--resume`` against a
server serving something else is refused.

How long a connection waits for its server is a :class:`~wamkit.eval.backends.base.Patience`: with one server, a dropped
connection is reopened (with backoff) and the request sent again; with several,
:meth:`~wamkit.eval.backends.base.Patience.failover` gives up at once so that the stage can move to another server (:mod:`wamkit.eval.servers`). A request
that gets no reply within ``reply_timeout_s`` fails like a dropped one (the client's own timeout,
:meth:`wamkit.serve.client.PolicyClient.infer`: no other thread closes a connection a stage may be
reconnecting).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from wamkit.config import ConfigError
from wamkit.constants import OBS_STATE, PROMPT, TASK, image_key
from wamkit.eval.backends.base import BackendError, Patience, check_actions


def check_spec_fits(spec: dict[str, Any], suite: Any, url: str, render_quality: str | None = None) -> None:
    """Refuse a served model whose preprocessing spec does not fit the env's suite (a SuiteInfo) or the
    env's resolved render look (a model trained on frames of one look is evaluated on that look)."""
    wants = {"fps": suite.fps, "state_dim": suite.state_dim, "env_action_dim": suite.action_dim}
    if render_quality is not None:
        wants["render_quality"] = render_quality
    diff = [
        f"{k}: model {spec.get(k)!r}, env {v!r}"
        for k, v in wants.items()
        if spec.get(k) is not None and spec.get(k) != v
    ]
    if diff:
        raise ConfigError(
            f"the model served at {url} was trained on data that does not fit suite {suite.suite!r} "
            f"({'; '.join(diff)}); {_fix(spec, suite, diff)}"
        )


def _fix(spec: dict[str, Any], suite: Any, diff: list[str]) -> str:
    """What to change: ``env.state`` where only the state's size differs and the suite's other state
    (full or proprio) has the model's size; else the suite."""
    from wamkit import embodiments

    emb = embodiments.for_suite(suite.suite)
    if emb is not None and len(diff) == 1 and diff[0].startswith("state_dim"):
        for state in ("full", "proprio"):
            if len(emb.state_dims(state)) == spec.get("state_dim") != suite.state_dim:
                return f"the suite is right, its state is not: set env.state={state}"
    return "evaluate it on the suite its data came from"


def served_identity(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """What the server says it serves (see :meth:`wamkit.serve.policy.ServedPolicy.identity`), or None
    for a server that does not say (openpi's, SGLang's)."""
    identity = metadata.get("identity")
    return dict(identity) if isinstance(identity, dict) and identity else None


def reply_timing(reply: dict[str, Any], rtt: float, n: int) -> tuple[float, int]:
    """``(server seconds, observations in the model call)`` of a reply to a request of ``n``.

    The seconds are the server's own ``server_timing.infer_ms`` when it reports one (the model's time,
    without queueing), else the round trip; the call size is ``server_timing.batch_size`` (larger than
    ``n`` when the server merged other requests into the same call), else ``n``.
    """
    timing = reply.get("server_timing") or {}
    infer_s = float(timing["infer_ms"]) / 1000.0 if "infer_ms" in timing else rtt
    return infer_s, max(n, int(timing.get("batch_size") or n))


def rtc_fields(obs_list: list[dict[str, Any]]) -> dict[str, Any]:
    """The batched real-time chunking fields of observations that carry ``prev_actions`` and ``delay``
    (:meth:`wamkit.eval.execution.ChunkPlan.request_fields`); rows without them are not guided."""
    left = [o.get("prev_actions") for o in obs_list]
    first = next(o for o in obs_list if "prev_actions" in o)
    k = max(len(x) for x in left if x is not None)
    dim = np.asarray(first["prev_actions"]).shape[-1]
    prev = np.zeros((len(obs_list), k, dim), np.float32)
    lens = np.zeros(len(obs_list), np.int64)
    delay = np.zeros(len(obs_list), np.int64)
    for i, (o, x) in enumerate(zip(obs_list, left)):
        if x is not None:
            prev[i, : len(x)], lens[i], delay[i] = x, len(x), int(o["delay"])
    return {
        "prev_actions": prev,
        "prev_actions_len": lens,
        "delay": delay,
        "rtc_schedule": str(first["rtc_schedule"]),
        "rtc_max_guidance": float(first["rtc_max_guidance"]),
    }


class RemotePolicy:
    """One connection (one pipeline stage): ``policy(obs_list) -> (actions [B, H, D], infer seconds,
    call size)`` (see :func:`reply_timing`)."""

    def __init__(
        self,
        url: str,
        cameras: list[str],
        suite: Any = None,
        render_quality: str | None = None,
        patience: Patience | None = None,
    ):
        patience = patience or Patience()
        self.url, self.dim = url, (suite.action_dim if suite is not None else None)
        self.client = patience.client(url)
        self.reply_timeout_s = patience.reply_timeout_s
        meta = self.client.metadata
        if suite is not None and isinstance(meta.get("preprocess"), dict):
            check_spec_fits(meta["preprocess"], suite, url, render_quality)
        wanted = (meta.get("inputs") or {}).get("image_keys")
        rendered = [image_key(c) for c in cameras]
        if wanted:
            missing = [k for k in wanted if k not in rendered]
            if missing:
                raise ConfigError(
                    f"env.cameras: the server at {url} expects {', '.join(wanted)} but the env renders "
                    f"{', '.join(rendered)}; set env.cameras to the model's cameras"
                )
            self.image_keys = list(wanted)
        else:
            self.image_keys = rendered
        self.metadata = meta

    @property
    def identity(self) -> dict[str, Any] | None:
        """What the server says it serves (:func:`served_identity`)."""
        return served_identity(self.metadata)

    def request(self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None) -> dict[str, Any]:
        """The batched request for ``obs_list``; ``seeds``: one noise seed per observation."""
        req: dict[str, Any] = {k: np.stack([o[k] for o in obs_list]) for k in self.image_keys}
        req[OBS_STATE] = np.stack([np.asarray(o[OBS_STATE], np.float32) for o in obs_list])
        req[PROMPT] = [str(o[TASK]) for o in obs_list]
        if seeds is not None:
            req["seed"] = np.asarray(seeds, np.int64)
        if any("prev_actions" in o for o in obs_list):
            req |= rtc_fields(obs_list)
        return req

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        req = self.request(obs_list, seeds)
        t0 = time.perf_counter()
        reply = self.client.infer(req, timeout_s=self.reply_timeout_s)
        rtt = time.perf_counter() - t0
        if "actions" not in reply:
            raise BackendError("wamkit", self.url, f"reply lacks 'actions' (keys: {sorted(reply)})")
        infer_s, call = reply_timing(reply, rtt, len(obs_list))
        return (
            check_actions("wamkit", self.url, reply["actions"], len(obs_list), self.dim, "actions"),
            infer_s,
            call,
        )

    def close(self) -> None:
        self.client.close()


def connect(target: Any, patience: Any) -> RemotePolicy:
    return RemotePolicy(target.url, list(target.cameras), target.suite, target.look, patience)
