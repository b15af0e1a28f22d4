"""``eval.backend=vllm_omni``: vLLM-Omni serving a Cosmos3 checkpoint (``vllm serve <Cosmos3 dir> --omni``).

vLLM-Omni's action mode is a video job (``entrypoints/openai/api_server.py:2632-2680``): ``POST /v1/videos``
with a multipart form (``entrypoints/openai/video/generation/helpers.py:852-977``), answered with the
job (``VideoResponse``, ``protocol/videos.py:372-430``), then ``GET /v1/videos/{id}`` until its
``status`` is ``completed`` (a failed job is its record at an HTTP error status, with ``error.message``,
``api_server.py:2833-2843``); the actions are in ``action.data``
(``VideoAction``, ``protocol/videos.py:332-340``), in the model's normalised space. The form::

    prompt       the caption, written by the client as training wrote it (the server only re-stamps
                 its duration, fps, resolution and aspect ratio, pipeline_cosmos3.py:220-249)
    input_reference  the composed frame, PNG
    width, height    the model's action canvas for that frame
    num_frames   chunk + 1;  fps;  num_inference_steps;  seed (when eval.backend_options.seed is set)
    extra_params JSON: action_mode "policy", domain_name, raw_action_dim, action_chunk_size
                 (model_extras/cosmos3.py:6-45 lists what Cosmos3 reads there)

One job holds one observation, so a stage's B observations go as B concurrent jobs over up to
``eval.backend_options.connections`` connections (default: one per observation, at most 8); the
engine's own scheduler may batch jobs that overlap. A finished job is deleted
(``DELETE /v1/videos/{id}``) so the server's store does not grow with the evaluation.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from wamkit.eval.backends.base import BackendError, HttpEndpoint, connections, png_bytes
from wamkit.eval.backends.cosmos3 import Cosmos3Client

NAME = "vllm_omni"
VIDEOS = "/v1/videos"
MODELS = "/v1/models"
MAX_CONNECTIONS = 8
POLL_S = (0.01, 0.25)  # first and longest wait between two looks at a job


def form(client: Cosmos3Client, obs: dict[str, Any], seed: int | None = None) -> tuple[dict[str, str], bytes]:
    """One observation's job: the form fields and the composed frame as PNG."""
    frame = client.frame(obs)
    h, w = client.canvas(frame)
    extra = {
        "action_mode": "policy",
        "domain_name": client.domain_name,
        "raw_action_dim": client.spec.action_dim,
        "action_chunk_size": client.chunk,
    }
    fields = {
        "prompt": client.caption(client.task(obs), (h, w)),
        "width": str(w),
        "height": str(h),
        "num_frames": str(client.chunk + 1),
        "fps": f"{float(client.options['fps']):g}",
        "num_inference_steps": str(client.steps),
        "extra_params": json.dumps(extra),
    }
    if seed is not None:
        fields["seed"] = str(int(seed))
    return fields, png_bytes(frame)


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart/form-data body and its content type."""
    boundary = f"wamkit-{uuid.uuid4().hex}"
    out = bytearray()
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        out += value.encode() + b"\r\n"
    for name, (filename, data, ctype) in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                f"Content-Type: {ctype}\r\n\r\n").encode()  # fmt: skip
        out += data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), f"multipart/form-data; boundary={boundary}"


def action_of(job: Any, backend: str = NAME, url: str = "") -> np.ndarray:
    """The [H, D] actions of a completed job (``action.data`` shaped by ``action.shape``)."""
    action = job.get("action") if isinstance(job, dict) else None
    if not isinstance(action, dict) or "data" not in action:
        raise BackendError(backend, url, "action.data: missing from the completed job")
    try:
        a = np.asarray(action["data"], np.float32)
        if action.get("shape"):
            a = a.reshape([int(s) for s in action["shape"]])
    except (TypeError, ValueError) as err:
        raise BackendError(backend, url, f"action.data: does not fit action.shape ({err})") from None
    while a.ndim > 2 and a.shape[0] == 1:  # [1, H, D] for a job of one observation
        a = a[0]
    return a


class VllmOmniPolicy:
    def __init__(self, target: Any, patience: Any):
        self.url, self.patience = target.url, patience
        self.client = Cosmos3Client.load(NAME, target)
        self.http = HttpEndpoint(NAME, target.url, patience)
        self.width = connections(NAME, target, MAX_CONNECTIONS)
        self.seed = target.options.get("seed")
        models = self.http.json("GET", MODELS, field="models")  # an unreachable server fails here
        cards = models.get("data") if isinstance(models, dict) else None
        self.metadata = {"models": cards or []}
        said = {
            k: cards[0][k] for k in ("id", "root") if cards and isinstance(cards[0], dict) and cards[0].get(k)
        }
        self.identity = self.client.identity(said)
        self._pool: ThreadPoolExecutor | None = None

    def _job(self, obs: dict[str, Any]) -> np.ndarray:
        fields, png = form(self.client, obs, self.seed)
        body, ctype = multipart(fields, {"input_reference": ("observation.png", png, "image/png")})
        status, _, data = self.http.request("POST", VIDEOS, body, {"Content-Type": ctype})
        job = self.http.answer(VIDEOS, status, data, "job")
        vid = job.get("id") if isinstance(job, dict) else None
        if not isinstance(vid, str) or not vid:
            raise BackendError(NAME, self.url, f"{VIDEOS} id: missing from the job")
        t0, wait = time.monotonic(), POLL_S[0]
        try:
            while job.get("status") not in ("completed", "failed"):
                limit = self.patience.reply_timeout_s
                if limit and time.monotonic() - t0 > limit:
                    raise TimeoutError(
                        f"eval.backend={NAME}: job {vid} at {self.url} not completed within {limit:g} s "
                        "(eval.server_timeout_s)"
                    )
                time.sleep(wait)
                wait = min(wait * 2, POLL_S[1])
                job = self.http.json("GET", f"{VIDEOS}/{vid}", field="job")
                if not isinstance(job, dict):
                    raise BackendError(NAME, self.url, f"{VIDEOS}/{vid}: expected a JSON object")
            if job["status"] == "failed":
                err = job.get("error") or {}
                msg = err.get("message") if isinstance(err, dict) else err
                raise BackendError(NAME, self.url, f"{VIDEOS}/{vid} status: failed ({msg or 'no message'})")
            return action_of(job, NAME, self.url)
        finally:
            # the job's answer is in; a store that keeps it is the server's business
            with contextlib.suppress(OSError):
                self.http.request("DELETE", f"{VIDEOS}/{vid}")

    def __call__(
        self, obs_list: list[dict[str, Any]], seeds: list[int] | None = None
    ) -> tuple[np.ndarray, float, int]:
        t0 = time.perf_counter()
        if len(obs_list) == 1:
            raw = [self._job(obs_list[0])]
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.width, thread_name_prefix="vllm-omni")
            raw = list(self._pool.map(self._job, obs_list))
        shapes = {a.shape for a in raw}
        if len(shapes) > 1:
            raise BackendError(NAME, self.url, f"action.data: chunks of different shapes {sorted(shapes)}")
        actions = self.client.decode(np.stack(raw), len(raw), "action.data", normalized=True)
        return actions, time.perf_counter() - t0, len(obs_list)

    def close(self) -> None:
        self.http.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def connect(target: Any, patience: Any) -> VllmOmniPolicy:
    return VllmOmniPolicy(target, patience)
