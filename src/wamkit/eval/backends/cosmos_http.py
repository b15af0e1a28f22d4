"""``eval.backend=cosmos_http``: cosmos-framework's policy server
(``python -m cosmos_framework.scripts.action_policy_server_libero --checkpoint-path <model> --port 8000``).

Its protocol ``cosmos-libero-eval-v1`` takes a batch: ``POST /predict_batch`` with
``{"items": [{"image": <base64 PNG>, "prompt": task, "domain_name": ..., "image_size": S}, ...]}``
(``_ActionHandler.do_POST`` and ``ActionModelService._prep_policy_item``; the single-item ``/predict`` answers
410), so a stage's observations go as one request and the server runs them as one diffusion
forward (``predict_policy_batch``). The server builds the caption and the canvas itself (from
``prompt`` and the image, resized to height ``image_size``), and answers ``{"actions": [[H, D], ...]}``,
un-normalised when it was started with the action statistics (``GET /info`` says so in
``action_stats_path``). A failure is ``{"actions": [], "error": ...}``, with HTTP 200 unless the server
runs with ``http_400_on_error``.

The client sends the composed frame (both cameras side by side, each at the spec's ``image_size``),
and decodes the actions with the run's spec (the normalisation, when ``/info`` says the server did
not undo it; rot6d -> axis-angle; the gripper). ``/info``'s run, checkpoint and fingerprint are what
the plan records.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from wamkit.eval.backends.base import BackendError, HttpEndpoint, png_base64
from wamkit.eval.backends.cosmos3 import Cosmos3Client

NAME = "cosmos_http"
PREDICT = "/predict_batch"
INFO = "/info"
# /info fields that name what the server serves (the rest are sampling settings)
IDENTITY_KEYS = ("protocol_version", "run_name", "checkpoint", "checkpoint_fingerprint",
                 "action_stats_sha256", "num_steps", "action_chunk_size", "raw_action_dim")  # fmt: skip


def request(client: Cosmos3Client, obs_list: list[dict[str, Any]], seed: int | None = None) -> dict[str, Any]:
    items = []
    for obs in obs_list:
        frame = client.frame(obs)
        item = {"image": png_base64(frame), "prompt": client.task(obs), "domain_name": client.domain_name,
                "image_size": int(frame.shape[0])}  # fmt: skip
        if seed is not None:
            item["seed"] = int(seed)
        items.append(item)
    return {"items": items}


class CosmosHttpPolicy:
    def __init__(self, target: Any, patience: Any):
        self.url = target.url
        self.client = Cosmos3Client.load(NAME, target)
        self.http = HttpEndpoint(NAME, target.url, patience)
        info = self.http.json("GET", INFO, field="info")  # an unreachable server fails here
        if not isinstance(info, dict):
            raise BackendError(NAME, self.url, f"{INFO}: expected a JSON object")
        self.metadata = info
        self.normalized = not info.get("action_stats_path")
        chunk = info.get("action_chunk_size")
        if chunk is not None and int(chunk) != self.client.chunk:
            raise BackendError(
                NAME, self.url,
                f"{INFO} action_chunk_size: {chunk}, the run's preprocessing says chunk {self.client.chunk}",
            )  # fmt: skip
        self.seed = target.options.get("seed")
        said = {k: info[k] for k in IDENTITY_KEYS if info.get(k) is not None}
        self.identity = self.client.identity(said)

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        t0 = time.perf_counter()
        reply = self.http.json("POST", PREDICT, request(self.client, obs_list, self.seed))
        if not isinstance(reply, dict):
            raise BackendError(NAME, self.url, f"{PREDICT}: expected a JSON object")
        if reply.get("error"):
            raise BackendError(NAME, self.url, f"{PREDICT} error: {reply['error']}")
        if "actions" not in reply:
            raise BackendError(NAME, self.url, f"{PREDICT}: reply lacks 'actions' (keys: {sorted(reply)})")
        actions = self.client.decode(reply["actions"], len(obs_list), "actions", self.normalized)
        latency = reply.get("latency_ms") or {}
        rtt = time.perf_counter() - t0
        infer_s = (
            float(latency["inference"]) / 1000.0
            if isinstance(latency, dict) and "inference" in latency
            else rtt
        )
        return actions, infer_s, len(obs_list)

    def close(self) -> None:
        self.http.close()


def connect(target: Any, patience: Any) -> CosmosHttpPolicy:
    return CosmosHttpPolicy(target, patience)
