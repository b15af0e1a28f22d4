"""``eval.backend=sglang``: SGLang's diffusion server with a Cosmos3 checkpoint
(``sglang serve --model-path <Cosmos3 dir> --model-type diffusion --batching-max-size N``).

A stage's observations go as **one** policy request (SGLang batches inside a request,
``multimodal_gen/runtime/entrypoints/action/cosmos3.py:171-186``), split into requests of at most the
server's ``capabilities.max_batch_size`` (its ``GET /v1/actions/metadata``, ``cosmos3.py:56-63``). The
request is ``POST /v1/actions/generations`` in msgpack (``api.py:197-233``; arrays as openpi's
msgpack-numpy, ``protocol.py:30-75``)::

    {"input": {"prompt": [task, ...], "image": [uint8 [S, 2S, 3], ...]},
     "parameters": {"action_mode": "policy", "domain_name", "raw_action_dim", "action_horizon",
                    "num_inference_steps", "height", "width", "fps", "action_view_point"},
     "runtime": {"response_format": "envelope", "output_format": "numpy"}}

(``cosmos3.py:127-232`` reads these). The image is the client's composed frame
(:mod:`wamkit.eval.backends.cosmos3`), ``height`` x ``width`` the model's action canvas for it. The server
writes the caption itself (``pipelines_core/stages/model_specific_stages/cosmos3_action.py:125-161``,
from ``prompt``, ``action_view_point``, ``fps`` and the canvas). It answers
``data[i].action.values`` [H, raw_action_dim] (``protocol.py:489-564``), normalised unless the server
was started with the action statistics (``action_stats_path``, read at
``pipelines_core/stages/model_specific_stages/cosmos3.py:2541-2556``): say so with
``eval.backend_options.server_has_stats=true`` (the request then names the run's normalisation). A request its code refuses is HTTP 400 ``{"detail": ...}``; a model error a plain-text 500.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from wamkit.eval.backends.base import BackendError, HttpEndpoint
from wamkit.eval.backends.cosmos3 import Cosmos3Client
from wamkit.serve.codec import packb, unpackb

NAME = "sglang"
GENERATIONS = "/v1/actions/generations"
METADATA = "/v1/actions/metadata"
MSGPACK = "application/msgpack"
log = logging.getLogger(__name__)


# the spec's normalisations by SGLang's names (cosmos3_action.py:183-198), for a server with the stats
NORMALIZATIONS = {"quantile": "quantile", "mean_std": "meanstd", "min_max": "minmax"}


def request(client: Cosmos3Client, obs_list: list[dict[str, Any]], seed: int | None = None,
            server_has_stats: bool = False) -> dict[str, Any]:  # fmt: skip
    """One batched policy request for ``obs_list``."""
    frames = [client.frame(o) for o in obs_list]
    h, w = client.canvas(frames[0])
    params: dict[str, Any] = {
        "action_mode": "policy",
        "domain_name": client.domain_name,
        "raw_action_dim": client.spec.action_dim,
        "action_horizon": client.chunk,
        "num_inference_steps": client.steps,
        "height": h,
        "width": w,
        "fps": int(client.options["fps"]),  # an integer: SGLang reads int(fps) (checked at connect)
        "action_view_point": client.options["view_point"],
    }
    if seed is not None:
        params["seed"] = int(seed)
    if server_has_stats:
        params["action_normalization"] = NORMALIZATIONS[client.spec.normalization]
    return {
        "input": {"prompt": [client.task(o) for o in obs_list], "image": frames},
        "parameters": params,
        "runtime": {"response_format": "envelope", "output_format": "numpy"},
    }


def actions_of(reply: Any, n: int, backend: str = NAME, url: str = "") -> list[Any]:
    """``data[i].action.values`` of an envelope reply, in input order."""
    data = reply.get("data") if isinstance(reply, dict) else None
    if not isinstance(data, list) or len(data) != n:
        got = len(data) if isinstance(data, list) else type(data).__name__
        raise BackendError(backend, url, f"data: expected a list of {n} results, got {got}")
    out: list[Any] = [None] * n
    for j, item in enumerate(data):
        action = item.get("action") if isinstance(item, dict) else None
        if not isinstance(action, dict) or "values" not in action:
            raise BackendError(backend, url, f"data[{j}].action.values: missing")
        i = item.get("input_index", j)
        if not isinstance(i, int) or not 0 <= i < n or out[i] is not None:
            raise BackendError(backend, url, f"data[{j}].input_index: {i!r} is not a fresh index below {n}")
        out[i] = action["values"]
    return out


class SGLangPolicy:
    def __init__(self, target: Any, patience: Any):
        self.url = target.url
        self.client = Cosmos3Client.load(NAME, target)
        self.http = HttpEndpoint(NAME, target.url, patience)
        self.metadata = self.http.json("GET", METADATA, field="metadata")  # an unreachable server fails here
        if not isinstance(self.metadata, dict):
            raise BackendError(NAME, self.url, f"{METADATA}: expected a JSON object")
        caps = self.metadata.get("capabilities") or {}
        self.max_batch = max(1, int(caps.get("max_batch_size") or 1))
        self.normalized = not bool(target.options.get("server_has_stats", False))
        self.seed = target.options.get("seed")
        fps = float(self.client.options["fps"])
        if fps != int(fps):
            raise BackendError(
                NAME, self.url, f"model.json fps {fps:g}: SGLang takes whole frames per second"
            )
        if not self.normalized and self.client.spec.normalization not in NORMALIZATIONS:
            raise BackendError(
                NAME, self.url,
                f"server_has_stats=true, but the run's normalisation {self.client.spec.normalization!r} is "
                f"not one SGLang undoes ({', '.join(NORMALIZATIONS)})",
            )  # fmt: skip
        if self.client.options["view_description"]:
            log.warning(
                "eval.backend=sglang: SGLang writes the caption itself, without the view description this "
                "model was trained with (%r): its captions differ from training's (docs/eval.md)",
                self.client.options["view_description"][:60],
            )
        said = {k: self.metadata[k] for k in ("model", "model_path", "policy_family") if self.metadata.get(k)}
        self.identity = self.client.identity(said)

    def _call(self, obs_list: list[dict[str, Any]]) -> np.ndarray:
        body = packb(request(self.client, obs_list, self.seed, not self.normalized))
        status, _, data = self.http.request(
            "POST", GENERATIONS, body, {"Content-Type": MSGPACK, "Accept": MSGPACK}
        )
        reply = self.http.answer(GENERATIONS, status, data, decode=unpackb)
        values = actions_of(reply, len(obs_list), NAME, self.url)
        return self.client.decode(values, len(obs_list), "data[].action.values", self.normalized)

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        t0 = time.perf_counter()
        parts = [
            self._call(obs_list[i : i + self.max_batch]) for i in range(0, len(obs_list), self.max_batch)
        ]
        return np.concatenate(parts), time.perf_counter() - t0, len(obs_list)

    def close(self) -> None:
        self.http.close()


def connect(target: Any, patience: Any) -> SGLangPolicy:
    return SGLangPolicy(target, patience)
