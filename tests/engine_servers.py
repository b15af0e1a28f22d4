"""The inference engines' own request and response code, on real sockets, for the backend tests.

SGLang and vLLM-Omni need a GPU stack to run, but the modules that read a request and write an answer
do not: ``scripts/setup_engines.sh`` (run by ``make test``) unpacks the pinned wheels into ``.engines/``
and this module loads those modules from there, without their packages' ``__init__`` (which pull in
the GPU stack), in place of what they import only for type checks or for running the model:

- SGLang 0.5.23: ``multimodal_gen/runtime/entrypoints/action/protocol.py`` (msgpack, the request to
  observation, the envelope answer), ``action/cosmos3.py`` (the Cosmos3 request's validation into
  ``Cosmos3SamplingParams``, whose ``_adjust`` runs too, and the metadata) and
  ``configs/sample/cosmos3.py``. The server's configuration (``ServerArgs`` with its
  ``pipeline_config``) is a plain object holding the attributes that code reads.
- vLLM-Omni 0.30.0: ``entrypoints/openai/protocol/videos.py`` (``VideoGenerationRequest`` validates
  the form as ``_parse_video_form`` builds it, ``VideoResponse`` is the job).

Each server here is a ``ThreadingHTTPServer`` whose handler does what the engine's route does around
that code (SGLang ``action/api.py:197-239``; vLLM-Omni ``api_server.py:2632-2680``, ``2819-2860``) and
whose model is :func:`toy_actions`. cosmos-framework's LIBERO server is not on the package registry:
its stand-in follows ``cosmos_framework/scripts/action_policy_server_libero.py`` by reading, and the
backend's docs say that it could not be checked against its code.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import logging
import sys
import threading
import time
import types
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1] / ".engines"
SGLANG = ROOT / "sglang-0.5.23"
VLLM_OMNI = ROOT / "vllm-omni-0.30.0"


def _need(path: Path) -> Path:
    if not (path / ".unpacked").is_file():
        pytest.fail(f"{path} is missing: `make test` unpacks it (bash scripts/setup_engines.sh)")
    return path


def _namespace(name: str, path: Path) -> None:
    """``name`` as a package at ``path`` whose ``__init__`` is not run."""
    if name not in sys.modules:
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod


def _stub(name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


class _Unused:
    """A name a loaded module imports for annotations or isinstance only."""


_LOADED: dict[str, types.SimpleNamespace] = {}


def sglang() -> types.SimpleNamespace:
    """SGLang's action protocol, Cosmos3 request code and sampling parameters (module docstring)."""
    if "sglang" in _LOADED:
        return _LOADED["sglang"]
    root = _need(SGLANG) / "sglang"
    _namespace("sglang", root)
    for sub in ("multimodal_gen", "multimodal_gen/configs", "multimodal_gen/configs/sample",
                "multimodal_gen/configs/pipeline_configs", "multimodal_gen/runtime",
                "multimodal_gen/runtime/entrypoints", "multimodal_gen/runtime/entrypoints/action"):  # fmt: skip
        _namespace("sglang." + sub.replace("/", "."), root / sub)
    _stub("sglang.multimodal_gen.runtime.server_args", ServerArgs=_Unused)
    _stub("sglang.multimodal_gen.configs.pipeline_configs.cosmos3", Cosmos3Config=PipelineConfig)
    _stub("sglang.multimodal_gen.runtime.entrypoints.utils", prepare_request=None)
    _stub("sglang.multimodal_gen.runtime.scheduler_client", async_scheduler_client=None)
    from sglang.multimodal_gen.configs.sample.cosmos3 import Cosmos3SamplingParams
    from sglang.multimodal_gen.configs.task_type import ModelTaskType
    from sglang.multimodal_gen.runtime.entrypoints.action import cosmos3, protocol

    # its note that the 256 tier is not among its default resolutions, once per request
    logging.getLogger("sglang.multimodal_gen.configs.sample.sampling_params").setLevel(logging.ERROR)
    _LOADED["sglang"] = types.SimpleNamespace(
        protocol=protocol, cosmos3=cosmos3, SamplingParams=Cosmos3SamplingParams, TaskType=ModelTaskType
    )
    return _LOADED["sglang"]


class PipelineConfig:
    """SGLang's ``Cosmos3Config`` as its request code reads it (``configs/pipeline_configs/cosmos3.py``)."""

    action_stats_path = None
    distilled_sigmas = None
    is_edge = False
    vae_config = None  # read only to align frames over several GPUs (num_gpus > 1)

    def __init__(self, action_dim: int = 32):
        self.task_type = sglang_task_type()
        arch = types.SimpleNamespace(action_dim=action_dim)
        self.dit_config = types.SimpleNamespace(arch_config=arch)

    def get_supported_task_types(self):
        return (self.task_type,)

    def adjust_num_frames(self, num_frames: int, *, log_adjustment: bool = True) -> int:
        return num_frames  # the Cosmos3 rule rounds to 4k + 1: a chunk of 16 is 17 frames already


def sglang_task_type():
    return sglang().TaskType.TI2V  # Cosmos3Config.task_type


def sglang_server_args(max_batch: int, model: str = "nvidia/Cosmos3-Nano") -> types.SimpleNamespace:
    return types.SimpleNamespace(
        pipeline_config=PipelineConfig(), batching_max_size=max_batch, served_model_name=model,
        model_path=f"/models/{model}", output_path=None, comfyui_mode=False, num_gpus=1, tp_size=1,
        sp_degree=1, ulysses_degree=1, ring_degree=1,
    )  # fmt: skip


def vllm_omni() -> types.SimpleNamespace:
    """vLLM-Omni's video protocol models (module docstring)."""
    if "vllm_omni" in _LOADED:
        return _LOADED["vllm_omni"]
    root = _need(VLLM_OMNI) / "vllm_omni"
    for sub in ("", "entrypoints", "entrypoints/openai", "entrypoints/openai/protocol", "inputs"):
        _namespace(("vllm_omni." + sub.replace("/", ".")).rstrip("."), root / sub)
    # inputs/data.py imports vllm and torch: its one constant the protocol needs, read from its source
    src = (root / "inputs" / "data.py").read_text()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.AnnAssign)
                and getattr(n.target, "id", "") == "DIFFUSION_QUALITY_LEVELS")  # fmt: skip
    _stub("vllm_omni.inputs.data", DIFFUSION_QUALITY_LEVELS=ast.literal_eval(node.value))
    from vllm_omni.entrypoints.openai.protocol import videos

    _LOADED["vllm_omni"] = types.SimpleNamespace(videos=videos)
    return _LOADED["vllm_omni"]


# -- the model behind every stand-in ------------------------------------------------------------------
def toy_actions(image: np.ndarray, prompt: str, horizon: int, dim: int) -> np.ndarray:
    """A deterministic chunk [horizon, dim] in the normalised space, from what the request carried:
    the frame's mean colour and the prompt's length, so a request that lost either shows."""
    level = float(np.asarray(image, np.float64).mean()) / 255.0
    h = np.arange(horizon)[:, None] / max(horizon, 1)
    d = np.arange(dim)[None, :] / max(dim, 1)
    return np.tanh(level - 0.5 + 0.3 * h - 0.2 * d + 0.01 * len(prompt)).astype(np.float32)


class Engine:
    """One stand-in server: its URL, what it was asked (``requests``), and switches for faults."""

    def __init__(self, handler: type, **state: Any):
        self.requests: list[Any] = []
        # "http" | "width" | "nan" | "garbage" | "slow" | "malformed" | "reorder" | "drop"
        self.fault: str | None = None
        self.state = state
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.httpd.engine = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Engine:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    @property
    def engine(self) -> Engine:
        return self.server.engine  # type: ignore[attr-defined]

    def log_message(self, *args: Any) -> None:
        return

    def body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def send(self, status: int, data: bytes, ctype: str = "application/json") -> None:
        if self.engine.fault == "garbage" and status == 200 and self.command == "POST":
            data = b"\x00 not a body \xff"
        if self.engine.fault == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if self.engine.state.get("close_idle"):  # as a keep-alive timeout does: closed, without a word
            self.close_connection = True

    def send_json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode())

    def stall(self) -> None:
        if self.engine.fault == "slow":
            time.sleep(self.engine.state.get("slow_s", 3.0))


class SGLangHandler(_Handler):
    """``/v1/actions/metadata`` and ``/v1/actions/generations`` as SGLang's ``action/api.py`` serves them."""

    def do_GET(self) -> None:  # noqa: N802
        sg, args = sglang(), self.engine.state["server_args"]
        if self.path == "/v1/actions/metadata":
            self.send_json(200, sg.cosmos3.cosmos3_action_metadata(args))
        else:
            self.send_json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        sg, args = sglang(), self.engine.state["server_args"]
        if self.path != "/v1/actions/generations":
            return self.send_json(404, {"detail": "Not Found"})
        ctype = self.headers.get("Content-Type", "").lower()
        raw = self.body()
        try:
            payload = sg.protocol.unpack_msgpack(raw) if "msgpack" in ctype else json.loads(raw)
            observation = sg.protocol._action_request_to_observation(payload)
            sp = sg.cosmos3.build_cosmos3_action_sampling_params(
                payload, observation, args, sg.SamplingParams
            )
        except ValueError as exc:  # api.py: a request the code refuses is HTTP 400 {"detail": ...}
            return self.send_json(400, {"detail": str(exc)})
        self.engine.requests.append(sp)
        self.stall()
        if self.engine.state.get("fail_when", lambda: False)():
            self.engine.fault = "http"
        if self.engine.fault == "http":
            return self.send_json(400, {"detail": "Cosmos3 action batch size exceeds --batching-max-size"})
        images = sp.image_path if isinstance(sp.image_path, list) else [sp.image_path]
        prompts = sp.prompt if isinstance(sp.prompt, list) else [sp.prompt]
        dim = sp.raw_action_dim + (1 if self.engine.fault == "width" else 0)
        actions = np.stack(
            [toy_actions(np.asarray(im), p, sp.num_frames - 1, dim) for im, p in zip(images, prompts)]
        )
        if self.engine.fault == "nan":
            actions[..., 0] = np.nan
        out = {"actions": actions, "action_mode": sp.action_mode, "raw_action_dim": sp.raw_action_dim}
        wants_msgpack = "msgpack" in ctype or "msgpack" in self.headers.get("Accept", "").lower()
        reply = sg.protocol.action_generation_response(out, args, preserve_numpy=wants_msgpack)
        if self.engine.fault == "malformed":
            reply["data"] = reply["data"][:1]
        if self.engine.fault == "reorder":  # results in another order, each naming its input
            reply["data"] = reply["data"][::-1]
        if wants_msgpack:
            self.send(200, sg.protocol.pack_msgpack(reply), "application/msgpack")
        else:
            self.send_json(200, reply)


def _multipart(handler: BaseHTTPRequestHandler, raw: bytes) -> tuple[dict[str, str], dict[str, bytes]]:
    """The form fields and files of a multipart/form-data body (as FastAPI's ``Form``/``File`` read them)."""
    head = f"Content-Type: {handler.headers['Content-Type']}\r\n\r\n".encode()
    msg = BytesParser(policy=HTTP).parsebytes(head + raw)
    fields, files = {}, {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if part.get_filename() is not None:
            files[name] = part.get_payload(decode=True)
        else:
            fields[name] = part.get_payload(decode=True).decode()
    return fields, files


class VllmOmniHandler(_Handler):
    """``/v1/models`` and the ``/v1/videos`` jobs as vLLM-Omni's ``api_server.py`` serves them."""

    def do_GET(self) -> None:  # noqa: N802
        vo = vllm_omni()
        if self.path == "/v1/models":
            model = self.engine.state.get("model", "nvidia/Cosmos3-Nano")
            card = {"id": model, "object": "model", "root": f"/models/{model}"}
            return self.send_json(200, {"object": "list", "data": [card]})
        if self.path.startswith("/v1/videos/"):
            job = self.engine.state["jobs"].get(self.path.rsplit("/", 1)[1])
            if job is None:
                return self.send_json(404, {"detail": "Video not found"})
            if job["ready_at"] > time.monotonic():  # still running: as the store says meanwhile
                return self.send_json(200, vo.videos.VideoResponse(**{**job["ref"], "status": "in_progress"}).model_dump(mode="json"))  # fmt: skip
            done = job["done"].model_dump(mode="json")
            if done["status"] == "failed":  # api_server.py:2835-2843: the job, at the failure's status
                done["error"]["code"] = 500
                return self.send_json(500, done)
            return self.send_json(200, done)
        self.send_json(404, {"detail": "Not Found"})

    def do_DELETE(self) -> None:  # noqa: N802
        self.engine.state["deleted"].append(self.path.rsplit("/", 1)[1])
        self.engine.state["jobs"].pop(self.path.rsplit("/", 1)[1], None)
        self.send_json(200, {"deleted": True})

    def do_POST(self) -> None:  # noqa: N802
        vo = vllm_omni()
        if self.path != "/v1/videos":
            return self.send_json(404, {"detail": "Not Found"})
        fields, files = _multipart(self, self.body())
        try:  # as _parse_video_form: the form's fields, extra_params parsed from JSON, into the model
            data = {k: v for k, v in fields.items() if k != "extra_params"}
            data["extra_params"] = json.loads(fields["extra_params"]) if "extra_params" in fields else None
            request = vo.videos.VideoGenerationRequest(**{k: v for k, v in data.items() if v is not None})
            image = np.asarray(Image.open(io.BytesIO(files["input_reference"])).convert("RGB"))
        except (ValueError, KeyError) as exc:
            return self.send_json(
                400, {"error": {"message": str(exc), "type": "BadRequestError", "code": 400}}
            )
        self.engine.requests.append((request, image))
        extra = request.extra_params or {}
        ref = {"id": f"video_{uuid.uuid4().hex}", "model": "nvidia/Cosmos3-Nano", "prompt": request.prompt,
               "status": "queued", "size": f"{request.width}x{request.height}"}  # fmt: skip
        if self.engine.fault == "http":
            done = vo.videos.VideoResponse(**{**ref, "status": "failed", "error": {"code": "500", "message": "engine died"}})  # fmt: skip
        else:
            task = json.loads(request.prompt)["actions"][0]["description"]
            dim = int(extra["raw_action_dim"]) + (1 if self.engine.fault == "width" else 0)
            a = toy_actions(image, task.rstrip("."), int(extra["action_chunk_size"]), dim)
            if self.engine.fault == "nan":
                a[..., 0] = np.nan
            action = vo.videos.VideoAction(data=a[None].tolist(), shape=[1, *a.shape], dtype="torch.float32",
                                           raw_action_dim=dim, action_mode=extra.get("action_mode"))  # fmt: skip
            done = vo.videos.VideoResponse(**{**ref, "status": "completed", "progress": 100}, action=action)
        delay = self.engine.state.get("slow_s", 3.0) if self.engine.fault == "slow" else 0.05
        self.engine.state["jobs"][ref["id"]] = {
            "ref": ref,
            "done": done,
            "ready_at": time.monotonic() + delay,
        }
        self.send_json(200, vo.videos.VideoResponse(**ref).model_dump(mode="json"))


class CosmosHttpHandler(_Handler):
    """``/info`` and ``/predict_batch`` as cosmos-framework's LIBERO server answers them (by reading)."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/info":
            return self.send_json(200, self.engine.state["info"])
        self.send_json(404, {"error": "Not found"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/predict_batch":
            return self.send_json(404, {"error": "Not found"})
        req = json.loads(self.body())
        items = req.get("items", [])
        self.engine.requests.append(items)
        self.stall()
        if self.engine.fault == "http":
            return self.send_json(200, {"actions": [], "error": "CUDA out of memory"})
        for item in items:  # what _prep_policy_item requires of each item
            problems = [f"'{k}' must be a {t.__name__}" for k, t in (("image", str), ("prompt", str),
                        ("domain_name", str), ("image_size", int)) if not isinstance(item.get(k), t)]  # fmt: skip
            if item.get("image_size", 1) <= 0 or problems:
                return self.send_json(200, {"actions": [], "error": "; ".join(problems) or "bad image_size"})
        info, out = self.engine.state["info"], []
        for item in items:
            image = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["image"]))).convert("RGB"))
            dim = int(info["raw_action_dim"]) + (1 if self.engine.fault == "width" else 0)
            a = toy_actions(image, item["prompt"], int(info["action_chunk_size"]), dim)
            if self.engine.fault == "nan":
                a[..., 0] = np.nan
            out.append(a.tolist())
        self.send_json(200, {"actions": out, "latency_ms": {"total": 1.0, "inference": 0.5}})


@contextlib.contextmanager
def serve(kind: str, **state: Any):
    """A stand-in engine of ``kind`` (sglang | vllm_omni | cosmos_http) on a real socket."""
    handler = {"sglang": SGLangHandler, "vllm_omni": VllmOmniHandler, "cosmos_http": CosmosHttpHandler}[kind]
    if kind == "sglang":
        model = state.pop("model", "nvidia/Cosmos3-Nano")
        state.setdefault("server_args", sglang_server_args(state.pop("max_batch", 8), model))
    if kind == "vllm_omni":
        state.setdefault("jobs", {})
        state.setdefault("deleted", [])
    with Engine(handler, **state) as engine:
        yield engine


def cosmos_info(chunk: int, raw_action_dim: int, checkpoint: str = "/ckpt/iter_000020000",
                action_stats_path: str | None = None) -> dict[str, Any]:  # fmt: skip
    """``GET /info`` as ``ActionModelService.get_info`` writes it (its keys; values of a toy run)."""
    return {
        "protocol_version": "cosmos-libero-eval-v1", "run_name": "libero_sft", "checkpoint": checkpoint,
        "config_file": "config.yaml", "config_file_type": "YAML", "guidance": 1.0, "num_steps": 30,
        "fps": 20, "seed": 0, "action_chunk_size": chunk, "max_action_dim": 32,
        "raw_action_dim": raw_action_dim, "action_stats_path": action_stats_path,
        "action_stats_sha256": None, "checkpoint_fingerprint": f"sha256:{abs(hash(checkpoint)):x}",
        "action_normalization": "quantile", "format_prompt_as_json": True, "weights_variant": "regular",
        "policy_profile": {},
    }  # fmt: skip
