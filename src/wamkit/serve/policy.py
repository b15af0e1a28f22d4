"""A model behind the wire: request checking, input transforms, one batched model call, replies.

:class:`ServedPolicy` turns one decoded request (an observation dict, single or batched) into a
model-space :class:`Request`, runs a list of requests as one ``predict`` call and splits the results
back. It applies the very :class:`~wamkit.actions.spec.PreprocessSpec` training ran: ``resize_images`` on
the images, ``encode_state`` on the incoming state and ``decode_actions`` on the model output (unless
``raw_actions``), so clients get env-ready actions (gripper -1 = open, +1 = close).

Request keys (one observation; a batched request puts a leading batch axis B on every array and
sends ``prompt`` as a list of B strings):

- ``observation.images.<cam>``: uint8 [H, W, 3], one per camera the model declares. Any H x W is
  accepted and resized by the spec's method (the aspect ratio is not kept) to ``io.image_size``;
- ``observation.state``: numbers [state_dim], raw env units (the server normalises them);
- ``prompt`` (or ``task``): the instruction;
- the OpenPI keys of the embodiments' reference clients are accepted too (their profiles'
  ``request_images`` and ``request_state``): e.g. ``observation/image`` and ``observation/wrist_image``
  map to the model's first and second camera, ``observation/state`` to ``observation.state``;
- optional ``mode`` (``policy`` | ``inverse_dynamics`` | ``forward_dynamics``) and ``seed``: an int
  (row i of a batched request gets ``seed + i``) or, batched, B ints, one per row. A row's seed
  fixes its noise whatever else shares the model call (see ``models/base.py``), so seeded requests
  batch with each other like unseeded ones;
- ``inverse_dynamics`` also takes the goal frame of every camera, ``goal_image.<cam>`` (same form as
  the observation images; ``goal_image`` alone names the first camera's),
  ``forward_dynamics`` takes ``actions`` [chunk, D_env] env commands (model space with ``raw_actions``);
- optional real-time chunking (models with a flow sampler; metadata ``real_time_chunking``):
  ``prev_actions`` [K, D_env] (the previous chunk's actions not yet executed, the first of them the one
  executed now), ``delay`` d (how many of them run before the reply arrives), and for batched rows with
  fewer leftovers ``prev_actions_len`` [B]; ``rtc_schedule`` and ``rtc_max_guidance`` pick the soft mask
  and the guidance clip (:meth:`ServedPolicy._rtc`, :mod:`wamkit.models.rtc`). The reply's first d
  actions are the committed ones. Rows with and without these batch together.

The metadata's ``identity`` names what is served: the model, a hash of its weights, the hash of the
spec's stats, the action transform and the autocast of its model calls (:meth:`ServedPolicy.identity`);
an evaluator records it, so results of two different models (or of one model at two precisions) are
never mixed in one journal.

Precision (``serve.precision``): ``auto`` runs a model whose weights are fp32 under bf16 autocast on a
CUDA device (a 1B model in fp32 is several times slower on a GPU; its actions differ from fp32's by
bf16 rounding, whatever precision it was trained in); weights already in a lower dtype (Cosmos3's
bf16) run as they are, and the CPU runs fp32. ``fp32`` keeps the reference numerics.

Replies: ``{"actions": float32 [chunk, D_env]}`` (``[B, chunk, D_env]`` when batched), or for
``forward_dynamics`` ``{"frames": uint8 [H, W, 3]}`` (the last predicted frame) plus, from models that
roll out the whole chunk, ``"video"``: uint8 [T, H, W, 3] (every predicted frame).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from wamkit.actions.spec import PreprocessSpec
from wamkit.config import ConfigError
from wamkit.constants import OBS_STATE, PROMPT, TASK, image_key
from wamkit.embodiments import request_aliases
from wamkit.models.base import (
    CompilesSteps,
    ReturnsFrames,
    ServesFp8,
    SetsSamplingSteps,
    StepDistilled,
    row_seeds,
    weights_digest,
)
from wamkit.models.rtc import MAX_GUIDANCE, SCHEDULES, request_rows

log = logging.getLogger(__name__)

MODES = ("policy", "inverse_dynamics", "forward_dynamics")
GOAL_IMAGE = "goal_image"  # inverse dynamics: f"{GOAL_IMAGE}.{cam}" per camera; bare: the first camera
CONTROL_KEYS = ("mode", "seed")
# real-time chunking (wamkit.models.rtc), optional: the previous chunk's actions not yet executed when the
# observation was taken, how many of them run before the reply arrives, the soft mask and the clip
RTC_KEYS = ("prev_actions", "prev_actions_len", "delay", "rtc_schedule", "rtc_max_guidance")
FD_ACTIONS = "actions"
RETURN_FRAMES = "return_frames"  # policy: also the frames the model predicts with the actions (cosmos3)
# warm-up's instruction: a long benchmark task, so that its caption falls in the text bucket of most
WARM_TASK = "put the black bowl on the plate and close the top drawer of the cabinet"


class RequestError(ValueError):
    """A request does not fit the served model; the message names the key and what was expected."""


@dataclass
class Request:
    """One client request in model space: ``n`` observations (``batched`` says how to reply)."""

    batch: dict[str, Any]  # image keys: uint8 [n, S, S, 3]; observation.state: float32 [n, state_dim]; task
    n: int
    batched: bool
    mode: str = "policy"
    seeds: list[int] | None = None  # one per row, or None: the model's global RNG
    inputs: dict[str, Any] = field(
        default_factory=dict
    )  # goal_images / actions, leading axis n (model space)

    @property
    def group(self) -> tuple[Any, ...]:
        """Requests batch together only within a group: the same mode, and all seeded or all unseeded.
        Noise is drawn per row from the row's seed, so a seeded reply equals an in-process call with
        that seed whoever else shares the model call. A request for the predicted frames
        (``return_frames``) shares a call only with others that ask for them."""
        group = (self.mode,) if self.seeds is None else (self.mode, "seeded")
        return (*group, RETURN_FRAMES) if RETURN_FRAMES in self.inputs else group


def _seeds(seed: Any, n: int, batched: bool) -> list[int] | None:
    """A request's ``seed``, checked, as one int per row (:func:`~wamkit.models.base.row_seeds`): an
    integer ``s`` gives rows ``s, s+1, ...``; a batched request may send ``n`` integers instead."""
    if seed is None:
        return None
    arr = np.asarray(seed) if isinstance(seed, int | list | tuple | np.ndarray | np.integer) else None
    if arr is not None and arr.dtype.kind in "iu" and (arr.ndim == 0 or (batched and arr.shape == (n,))):
        return row_seeds(int(arr) if arr.ndim == 0 else arr, n)
    want = f"an integer or {n} integers (one per row)" if batched else "an integer"
    raise RequestError(f"seed: expected {want}, got {seed!r}"[:300])


def _cat(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays))


def _numeric(value: Any, key: str) -> np.ndarray:
    arr = np.asarray(value) if isinstance(value, list | tuple | int | float) else value
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "biuf":
        raise RequestError(f"{key}: expected a numeric array, got {type(value).__name__}")
    return arr


def compute_device(module: torch.nn.Module) -> torch.device:
    """The device a model computes on: that of its first parameter outside host memory, else the CPU
    (a text tower served from host memory, ``serve.text_tower=host``, does not make it a CPU model)."""
    return next((p.device for p in module.parameters() if p.device.type != "cpu"), torch.device("cpu"))


def _autocast(adapter: Any, precision: str) -> tuple[torch.dtype | None, str]:
    """``(dtype, device type)`` of the autocast of ``adapter``'s model calls under ``serve.precision``
    (dtype None: no autocast)."""
    module = adapter.module
    params = next(module.parameters(), None)
    if params is None:
        return None, "cpu"
    device = compute_device(module).type
    if precision == "fp8":
        from wamkit.models.fp8 import unsupported

        why = unsupported(compute_device(module))
        if not why and not isinstance(adapter, ServesFp8):
            why = f"model {adapter.name!r} has no FP8 path (cosmos3 has)"
        if why:
            raise ConfigError(f"serve.precision=fp8: {why}; use auto, bf16 or fp32")
        # what does not run in FP8 runs in bf16: under autocast when the weights are fp32, as they
        # are for bf16 weights (the rule of "auto", on the GPU FP8 needs)
        fp32 = all(p.dtype == torch.float32 for p in module.parameters() if p.is_floating_point())
        return (torch.bfloat16 if fp32 else None), device
    if precision == "bf16" and device != "cuda":
        raise ConfigError(
            f"serve.precision=bf16 needs the model on a CUDA device; it is on {device} (use auto or fp32)"
        )
    fp32 = all(p.dtype == torch.float32 for p in module.parameters() if p.is_floating_point())
    bf16 = precision == "bf16" or (precision == "auto" and device == "cuda" and fp32)
    return (torch.bfloat16 if bf16 else None), device


def bucket_sizes(max_batch: int) -> list[int]:
    """One batch size per bucket up to ``max_batch``: the powers of two below it, then itself."""
    return [1 << i for i in range(max(max_batch, 1).bit_length()) if 1 << i < max_batch] + [max_batch]


def set_sampling_steps(adapter: Any, steps: int) -> None:
    """``serve.sampling_steps``: the sampler steps of every request. A model without a sampler is refused
    naming the key; more steps than a step-distilled model was made for are served, with a warning."""
    if not isinstance(adapter, SetsSamplingSteps):
        raise ConfigError(
            f"serve.sampling_steps={steps}: model '{adapter.name}' has no sampler steps to set "
            "(models with them: tiny, cosmos3); leave it 0"
        )
    distilled = adapter.distilled if isinstance(adapter, StepDistilled) else None
    if distilled and steps > distilled["steps"]:
        log.warning(
            "serve.sampling_steps=%d: this model was step-distilled for %d steps (from a %d-step teacher); "
            "more steps are served as asked, though they need not come closer to the teacher",
            steps, distilled["steps"], distilled["teacher_steps"],
        )  # fmt: skip
    adapter.sampling_steps = steps


class ServedPolicy:
    """A model adapter plus the preprocessing spec it was trained with, as the server and ``wamkit
    infer`` run it. A spec that does not fit the model is refused here, at start."""

    def __init__(
        self,
        adapter: Any,
        spec: PreprocessSpec,
        raw_actions: bool = False,
        source: str = "",
        precision: str = "auto",
        sampling_steps: int = 0,
    ):
        self.adapter = adapter
        self.io = adapter.io
        self.spec = spec
        self.raw_actions = raw_actions
        self.source = source
        spec.check_model(self.io, where=f"preprocessing spec of {source or adapter.name}")
        self.env_action_dim = spec.env_action_dim
        self.autocast, self._device_type = _autocast(adapter, precision)
        self.precision = precision
        if sampling_steps:
            set_sampling_steps(adapter, sampling_steps)
        self._identity: dict[str, Any] | None = None
        if precision == "fp8":  # the identity names the weights as trained, before they are quantized
            self.identity()
            adapter.use_fp8()

    def identity(self) -> dict[str, Any]:
        """What is served, for clients that must not mix two models' results (computed once)."""
        if self._identity is None:
            spec = self.spec
            self._identity = {
                "model": self.adapter.name,
                "weights_sha256": weights_digest(self.adapter.module),
                "stats_sha256": spec.stats_hash(),
                "action_transform": {
                    "representation": spec.representation,
                    "normalization": spec.normalization,
                    "clip": spec.clip,
                    "gripper": spec.gripper,
                    "env_action_dim": spec.env_action_dim,
                    "raw": self.raw_actions,
                },
                "autocast": "fp8"
                if self.precision == "fp8"
                else "bf16"
                if self.autocast is not None
                else "off",
            }
            if isinstance(self.adapter, SetsSamplingSteps):  # a sampler's steps change the actions
                self._identity["sampler"] = {
                    "steps": int(self.adapter.sampling_steps),
                    "distilled": self.adapter.distilled if isinstance(self.adapter, StepDistilled) else None,
                }
        return self._identity

    def metadata(self, **extra: Any) -> dict[str, Any]:
        """What a client needs to know, sent on connect (plain msgpack types only)."""
        io = self.io
        return {
            "server": "wamkit",
            "model": self.adapter.name,
            "source": self.source,
            "inputs": {
                "image_keys": [image_key(c) for c in io.cameras],
                "cameras": list(io.cameras),
                "image_size": io.image_size,
                "image_format": "uint8 [H, W, 3] (resized to image_size x image_size)",
                "state_key": OBS_STATE,
                "state_dim": io.state_dim,
                "prompt_key": PROMPT,
                "openpi_keys": self._aliases(),
            },
            "action_space": {
                "dim": io.action_dim if self.raw_actions else self.env_action_dim,
                "representation": io.representation,
                "raw": self.raw_actions,
                "gripper": "model space" if self.raw_actions else "env command: -1 open, +1 close",
            },
            "preprocess": self.spec.summary(),
            "identity": self.identity(),
            "chunk": io.chunk,
            "action_horizon": io.chunk,
            "modes": list(MODES),
            # requests may carry prev_actions and delay (wamkit.models.rtc)
            "real_time_chunking": bool(self.adapter.supports_rtc),
            **extra,
        }

    # -- parsing -----------------------------------------------------------------------------------
    def _aliases(self) -> dict[str, str]:
        """The request keys of the embodiments' reference clients (their profiles' ``request_images``
        and ``request_state``: openpi's keys, ...), to this model's keys; the first profile to
        name a key keeps it."""
        out: dict[str, str] = {}
        for images, state in request_aliases():
            for key, cam in zip(images, self.io.cameras):
                out.setdefault(key, image_key(cam))
            if state:
                out.setdefault(state, OBS_STATE)
        return out

    def _keymap(self) -> dict[str, str]:
        """Request key -> model key (built once: it is read for every request)."""
        cached = self.__dict__.get("_keys")
        if cached is not None:
            return cached
        cams = self.io.cameras
        keys = {image_key(c): image_key(c) for c in cams} | {OBS_STATE: OBS_STATE}
        keys |= self._aliases()
        keys |= {PROMPT: TASK, TASK: TASK, FD_ACTIONS: FD_ACTIONS, GOAL_IMAGE: f"{GOAL_IMAGE}.{cams[0]}"}
        keys |= {f"{GOAL_IMAGE}.{c}": f"{GOAL_IMAGE}.{c}" for c in cams}
        keys |= {k: k for k in (*CONTROL_KEYS, *RTC_KEYS, RETURN_FRAMES)}
        self._keys = keys
        return keys

    def prepare(self, obs: Any) -> Request:
        """Check one decoded request and bring it into model space; :class:`RequestError` if it is wrong.
        The steps, each checking and converting its own keys: the request's keys, its mode and seed,
        the state (which says whether the request is batched), the instructions, the camera images,
        then what the mode takes beyond an observation."""
        got = self._fields(obs)
        mode = got.get("mode", (None, "policy"))[1]
        if mode not in MODES:
            raise RequestError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
        state, n, batched = self._state(got)
        batch: dict[str, Any] = {OBS_STATE: self.spec.encode_state(state), TASK: self._tasks(got, n, batched)}
        for cam in self.io.cameras:
            batch[image_key(cam)] = self._images(got, image_key(cam), n, batched)
        inputs = self._mode_inputs(got, mode, n, batched)
        return Request(batch, n, batched, mode, _seeds(got.get("seed", (None, None))[1], n, batched), inputs)

    def _fields(self, obs: Any) -> dict[str, tuple[str, Any]]:
        """The request's values by model key, each with the key it came under (an alias names the key
        its client sent)."""
        if not isinstance(obs, dict):
            raise RequestError(f"a request must be a map of observation keys, got {type(obs).__name__}")
        keymap, got = self._keymap(), {}
        for key, value in obs.items():
            if not isinstance(key, str):
                raise RequestError(f"request keys must be strings, got {key!r}")
            if key not in keymap:
                raise RequestError(
                    f"unknown key {key!r}; this model takes {', '.join(image_key(c) for c in self.io.cameras)}, "
                    f"{OBS_STATE}, {PROMPT} (or the OpenPI keys {', '.join(self._aliases())}), "
                    "and optionally mode, seed"
                )
            target = keymap[key]
            if target in got:
                raise RequestError(f"{key!r} given twice (as {got[target][0]!r} and {key!r})")
            got[target] = (key, value)
        return got

    def _state(self, got: dict) -> tuple[np.ndarray, int, bool]:
        """``(state [n, state_dim], n, batched)``: a state [state_dim] is one observation, [B, state_dim]
        a batched request of B."""
        if OBS_STATE not in got:
            raise RequestError(
                f"request lacks {OBS_STATE} (or "
                f"{', '.join(k for k, v in self._aliases().items() if v == OBS_STATE)}): [state_dim={self.io.state_dim}]"
            )
        skey, state = got[OBS_STATE]
        state = _numeric(state, skey)
        if state.ndim not in (1, 2) or state.shape[-1] != self.io.state_dim:
            raise RequestError(
                f"{skey}: expected shape [{self.io.state_dim}] or [B, {self.io.state_dim}], got {list(state.shape)}"
            )
        if not np.all(np.isfinite(state)):
            raise RequestError(f"{skey}: non-finite values")
        batched = state.ndim == 2
        n = state.shape[0] if batched else 1
        if n == 0:
            raise RequestError(f"{skey}: a batched request needs at least one observation")
        return state.reshape(n, -1), n, batched

    def _tasks(self, got: dict, n: int, batched: bool) -> list[str]:
        if TASK not in got:
            raise RequestError(f"request lacks {PROMPT!r} (or {TASK!r}): the instruction")
        pkey, prompt = got[TASK]
        if not batched:
            if not isinstance(prompt, str):
                raise RequestError(f"{pkey}: expected a string, got {type(prompt).__name__}")
            return [prompt]
        if (
            not isinstance(prompt, list | tuple)
            or len(prompt) != n
            or not all(isinstance(p, str) for p in prompt)
        ):
            raise RequestError(f"{pkey}: a batched request needs a list of {n} strings, got {prompt!r:.80}")
        return list(prompt)

    def _mode_inputs(self, got: dict, mode: str, n: int, batched: bool) -> dict[str, Any]:
        """What ``mode`` takes beyond the observation: the goal images of inverse dynamics, the actions
        of forward dynamics, the real-time chunking fields, ``return_frames``; each refused in a mode
        that does not take it."""
        inputs: dict[str, Any] = {}
        goals = {c: f"{GOAL_IMAGE}.{c}" for c in self.io.cameras}
        if mode == "inverse_dynamics":
            per_cam = {image_key(c): self._goal(got, k, n, batched) for c, k in goals.items()}
            clips = any(g.ndim == 5 for g in per_cam.values())
            # one camera's single frames: the array itself (what every adapter takes); else keyed by image key
            inputs["goal_images"] = (
                next(iter(per_cam.values())) if len(per_cam) == 1 and not clips else per_cam
            )
        elif any(k in got for k in goals.values()):
            raise RequestError(f"'{GOAL_IMAGE}' belongs to mode 'inverse_dynamics', not {mode!r}")
        if mode == "forward_dynamics":
            inputs["actions"] = self._fd_actions(got, n, batched)
        elif FD_ACTIONS in got:
            raise RequestError(f"'{FD_ACTIONS}' belongs to mode 'forward_dynamics', not {mode!r}")
        if any(k in got for k in RTC_KEYS):
            inputs["rtc"] = self._rtc(got, mode, n, batched)
        if got.get(RETURN_FRAMES, (None, False))[1]:
            if mode != "policy" or not isinstance(self.adapter, ReturnsFrames):
                raise RequestError(
                    f"{RETURN_FRAMES}: the predicted frames of mode 'policy' come from models that predict "
                    f"them with the actions (cosmos3); {self.adapter.name} in mode {mode!r} does not"
                )
            inputs[RETURN_FRAMES] = True
        return inputs

    def _goal(self, got: dict, target: str, n: int, batched: bool) -> np.ndarray:
        """One camera's goal: a frame, [n, S, S, 3]; or, for a model that reads the whole clip after the
        observation (cosmos3), the ``chunk`` frames [n, chunk, S, S, 3] (sent [chunk, H, W, 3] per
        observation)."""
        if target in got:
            key, img = got[target]
            clip = isinstance(img, np.ndarray) and img.ndim == (5 if batched else 4)
            if clip and tuple(self.adapter.future_frame_offsets) == tuple(range(1, self.io.chunk + 1)):
                k = img.shape[-4]
                if k != self.io.chunk:
                    raise RequestError(
                        f"{key}: a goal clip holds the {self.io.chunk} frames after the observation, got {k}"
                    )
                frames = img.reshape(-1, *img.shape[-3:])
                got = {**got, target: (key, frames)}
                return self._images(got, target, n * k, True).reshape(n, k, *frames.shape[1:3], 3)
        return self._images(got, target, n, batched)

    def _images(self, got: dict, target: str, n: int, batched: bool) -> np.ndarray:
        if target not in got:
            raise RequestError(
                f"request lacks {target}: uint8 [H, W, 3] (the model's cameras: {', '.join(self.io.cameras)})"
            )
        key, img = got[target]
        want = "[B, H, W, 3]" if batched else "[H, W, 3]"
        if not isinstance(img, np.ndarray) or img.ndim != (4 if batched else 3) or img.shape[-1] != 3:
            shape = list(img.shape) if isinstance(img, np.ndarray) else type(img).__name__
            raise RequestError(f"{key}: expected uint8 images {want}, got {shape}")
        if img.dtype != np.uint8:
            raise RequestError(f"{key}: expected dtype uint8, got {img.dtype}")
        img = img.reshape(n, *img.shape[-3:]) if not batched else img
        if img.shape[0] != n:
            raise RequestError(f"{key}: batch axis is {img.shape[0]} but {OBS_STATE} has {n}")
        if min(img.shape[1:3]) == 0 or max(img.shape[1:3]) > 4096:
            raise RequestError(f"{key}: image size {img.shape[1]}x{img.shape[2]} is outside 1..4096")
        return self.spec.resize_images(img)

    def _fd_actions(self, got: dict, n: int, batched: bool) -> np.ndarray:
        if FD_ACTIONS not in got:
            raise RequestError(f"mode 'forward_dynamics' needs '{FD_ACTIONS}' [chunk, D] (env actions)")
        acts = _numeric(got[FD_ACTIONS][1], FD_ACTIONS)
        dim = self.io.action_dim if self.raw_actions else self.env_action_dim
        want = (n, self.io.chunk, dim) if batched else (self.io.chunk, dim)
        if tuple(acts.shape) != want or not np.all(np.isfinite(acts)):
            raise RequestError(
                f"{FD_ACTIONS}: expected finite numbers of shape {list(want)}, got {list(acts.shape)}"
            )
        acts = acts.reshape(n, self.io.chunk, dim)
        if self.raw_actions:
            return np.asarray(acts, np.float32)
        return self.spec.encode_actions(self.spec.env_to_stored(acts))

    def _rtc(self, got: dict, mode: str, n: int, batched: bool) -> dict[str, np.ndarray]:
        """The request's real-time chunking fields as the adapter's ``rtc`` input (model space).

        ``prev_actions`` [K, D] ([B, K, D] batched; env actions, or model space with ``raw_actions``):
        the previous chunk's actions not yet executed when the observation was taken, the first of them
        the one executed now; ``delay`` (an integer, [B] batched): how many of them run before the reply
        arrives (0 <= delay <= K). Batched rows with fewer leftovers pad them at the end and give their
        count in ``prev_actions_len`` [B] (0: the row is not guided). ``rtc_schedule`` (exp, linear, ones,
        zeros) and ``rtc_max_guidance`` (beta > 0) default to the paper's exp and 5."""
        name = self.adapter.name
        if not self.adapter.supports_rtc:
            fields = ", ".join(k for k in RTC_KEYS if k in got)
            raise RequestError(
                f"{fields}: real-time chunking needs a flow-matching sampler, which {name} lacks"
            )
        if mode != "policy":
            raise RequestError(f"prev_actions: real-time chunking guides mode 'policy', not {mode!r}")
        for key in ("prev_actions", "delay"):
            if key not in got:
                raise RequestError(
                    f"real-time chunking needs both prev_actions and delay; {key!r} is missing"
                )
        schedule = got.get("rtc_schedule", (None, "exp"))[1]
        if schedule not in SCHEDULES:
            raise RequestError(f"rtc_schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r:.80}")
        beta = got.get("rtc_max_guidance", (None, MAX_GUIDANCE))[1]
        if (
            isinstance(beta, bool)
            or not isinstance(beta, int | float | np.number)
            or not 0 < float(beta) < 1e6
        ):
            raise RequestError(f"rtc_max_guidance: expected a number > 0, got {beta!r:.80}")
        dim = self.io.action_dim if self.raw_actions else self.env_action_dim
        prev = _numeric(got["prev_actions"][1], "prev_actions")
        want = "[B, K, D]" if batched else "[K, D]"
        if prev.ndim != (3 if batched else 2) or prev.shape[-1] != dim or (batched and prev.shape[0] != n):
            raise RequestError(
                f"prev_actions: expected {want} with D = {dim} and B = {n}, got {list(prev.shape)}"
            )
        prev = prev.reshape(n, -1, dim)
        k = prev.shape[1]
        if k > self.io.chunk or not np.all(np.isfinite(prev)):
            raise RequestError(
                f"prev_actions: expected finite numbers and K <= the chunk ({self.io.chunk}), got K = {k}"
            )
        lens = self._rtc_ints(got, "prev_actions_len", n, batched, k, default=k)
        delays = self._rtc_ints(got, "delay", n, batched, k)
        if np.any(delays > lens):
            raise RequestError(
                f"delay: expected <= the row's unexecuted actions {lens.tolist()}, got {delays.tolist()}"
            )
        model = prev if self.raw_actions else self.spec.encode_actions(self.spec.env_to_stored(prev))
        rows = [np.asarray(model[i, : lens[i]], np.float32) if lens[i] else None for i in range(n)]
        return request_rows(rows, delays.tolist(), self.io.chunk, self.io.action_dim, schedule, float(beta))

    @staticmethod
    def _rtc_ints(
        got: dict, key: str, n: int, batched: bool, most: int, default: int | None = None
    ) -> np.ndarray:
        if key not in got:
            return np.full(n, default, np.int64)
        arr = np.asarray(got[key][1])
        ok = arr.dtype.kind in "iu" and (arr.ndim == 0 or (batched and arr.shape == (n,)))
        if not ok or np.any(arr < 0) or np.any(arr > most):
            want = f"{n} integers" if batched else "an integer"
            raise RequestError(f"{key}: expected {want} in 0..{most}, got {got[key][1]!r:.80}")
        return np.broadcast_to(arr, (n,)).astype(np.int64)

    # -- running -----------------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> list[dict[str, np.ndarray]]:
        """One ``predict`` call for all ``requests`` (same group); the replies, in the same order."""
        first = requests[0]
        if any(r.group != first.group for r in requests):
            raise ValueError(
                "requests of different modes, or seeded with unseeded, cannot share one model call"
            )
        keys = [k for k in first.batch if k != TASK]
        batch: dict[str, Any] = {
            k: torch.from_numpy(np.concatenate([r.batch[k] for r in requests])) for k in keys
        }
        batch[TASK] = [t for r in requests for t in r.batch[TASK]]
        inputs: dict[str, Any] = {}
        if any("rtc" in r.inputs for r in requests):  # rows without it: unguided (zero mask)
            requests = [r if "rtc" in r.inputs else self._unguided(r) for r in requests]
            first = requests[0]
        for name, first_value in first.inputs.items():
            if name == RETURN_FRAMES:  # a flag of the whole call (the group holds it alike)
                inputs[name] = True
            elif isinstance(first_value, dict):  # per-camera goals
                inputs[name] = {k: _cat([r.inputs[name][k] for r in requests]) for k in first_value}
            else:
                inputs[name] = _cat([r.inputs[name] for r in requests])
        with self.compute():
            seeds = None if first.seeds is None else [s for r in requests for s in r.seeds]
            out = self.adapter.predict(batch, mode=first.mode, seed=seeds, **inputs)
        if first.mode == "forward_dynamics":
            results = {"frames": np.asarray(out["frames"], np.uint8)}
            if "video" in out:
                results["video"] = np.asarray(out["video"], np.uint8)
        else:
            actions = np.asarray(out["actions"], np.float32)
            results = {"actions": actions if self.raw_actions else self.spec.decode_actions(actions)}
            if "video" in out:  # return_frames
                results["video"] = np.asarray(out["video"], np.uint8)
        replies, start = [], 0
        for r in requests:
            reply = {}
            for name, result in results.items():
                part = np.ascontiguousarray(result[start : start + r.n])
                reply[name] = part if r.batched else part[0]
            replies.append(reply)
            start += r.n
        return replies

    def _unguided(self, r: Request) -> Request:
        rtc = request_rows([None] * r.n, [0] * r.n, self.io.chunk, self.io.action_dim)
        return Request(r.batch, r.n, r.batched, r.mode, r.seeds, {**r.inputs, "rtc": rtc})

    # -- warm-up: every batch bucket run once before the first request ------------------------------
    def warm_sizes(self, max_batch: int, warm: str = "auto") -> list[int]:
        """The batch sizes ``serve.warm`` runs at start: one per bucket up to ``max_batch`` (powers of two,
        then ``max_batch``) for ``all``, and for ``auto`` when the model captures or compiles its steps
        (``warm_wanted()``); none for ``none``."""
        wanted = isinstance(self.adapter, CompilesSteps) and self.adapter.warm_wanted()
        if warm == "none" or (warm == "auto" and not wanted):
            return []
        return bucket_sizes(max_batch)

    def warm(self, sizes: list[int], cache_dir: str = "", progress: Any = None) -> dict[str, Any]:
        """Run one policy request of each size in ``sizes`` (model space, through :meth:`run`), with the
        compile cache of ``cache_dir`` (``serve.compile_cache``; "" for none) loaded before and written
        after. ``progress(done, total, size, seconds)`` after each. Returns what happened, for the log."""
        import time

        cache = self.compile_cache(cache_dir)
        if cache is not None:
            cache.load()
        seconds = []
        # a model may warm with less work than a request does (Cosmos3: fewer denoising steps)
        warming = self.adapter.warming if isinstance(self.adapter, CompilesSteps) else contextlib.nullcontext
        for i, n in enumerate(sizes):
            t0 = time.perf_counter()
            with warming():
                self.run([self.prepare(self.warm_request(n))])
            seconds.append(time.perf_counter() - t0)
            if progress is not None:
                progress(i + 1, len(sizes), n, seconds[-1])
        if cache is not None and sizes:
            cache.save(sizes)
        return {"sizes": list(sizes), "seconds": seconds, "cache": cache.loaded if cache else "off",
                "cache_dir": str(cache.dir) if cache else ""}  # fmt: skip

    def compile_cache(self, cache_dir: str) -> Any:
        """The :class:`~wamkit.models.compile_cache.CompileCache` of this model on its device, or None
        when it compiles nothing (or ``cache_dir`` is "")."""
        from wamkit.models.compile_cache import CompileCache, environment

        fields = self.adapter.compile_fields() if isinstance(self.adapter, CompilesSteps) else None
        if not fields or not cache_dir:
            return None
        device = compute_device(self.adapter.module)
        return CompileCache(cache_dir, self.adapter.name, {**fields, **environment(device)})

    def warm_request(self, n: int) -> dict[str, Any]:
        """A batched request of ``n`` blank observations (black frames, zero state) and one task."""
        s = self.spec.image_size
        obs: dict[str, Any] = {image_key(c): np.zeros((n, s, s, 3), np.uint8) for c in self.io.cameras}
        obs[OBS_STATE] = np.zeros((n, self.io.state_dim), np.float32)
        obs[PROMPT] = [WARM_TASK] * n
        return obs

    def compute(self) -> contextlib.AbstractContextManager:
        """The context of a model call: bf16 autocast when ``serve.precision`` resolved to it."""
        if self.autocast is None:
            return contextlib.nullcontext()
        # no cast cache: the bf16 copies it keeps of fp32 weights are freed when the context exits,
        # and a CUDA graph captured inside it would replay reads of that freed memory
        return torch.autocast(self._device_type, dtype=self.autocast, cache_enabled=False)

    def infer(self, obs: dict[str, Any]) -> dict[str, np.ndarray]:
        """In-process equivalent of one server round trip (no batching with others)."""
        return self.run([self.prepare(obs)])[0]
