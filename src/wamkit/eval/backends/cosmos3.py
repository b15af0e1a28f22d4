"""What the clients of the Cosmos3 engines (SGLang, vLLM-Omni, cosmos-framework) do that the engine does not.

Those engines take one composed image and a task per observation and answer the model's actions, in
its normalised space unless the server was given the action statistics. The rest of the run's
preprocessing is the client's, read from the files training wrote (``eval.backend_options.serving_dir``:
a serving directory, checkpoint or export holding ``preprocess.json`` and ``model.json``) and applied
with the code that trained the model, never declared again:

- the views: each camera resized as the spec says (``PreprocessSpec.resize_images``), then side by
  side in the model's camera order (:func:`wamkit.actions.cosmos3.side_by_side`);
- the canvas the engine places that frame on (:func:`wamkit.actions.cosmos3.action_canvas`, at the
  model's ``resolution_tier``) and, for an engine that takes it from the client, the caption
  (:func:`wamkit.actions.cosmos3.action_prompt`, with the model's view point, view description and fps);
- the model's ``domain_name``, chunk length and number of denoising steps;
- the way back (``PreprocessSpec.decode_actions``): the normalisation undone with the run's stats
  (unless the server did it), rot6d -> axis-angle (the representation), the gripper convention.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.actions.cosmos3 import action_canvas, action_prompt, side_by_side
from wamkit.actions.spec import PreprocessSpec, SpecError
from wamkit.constants import TASK, image_key
from wamkit.eval.backends.base import BackendError, check_actions
from wamkit.eval.backends.wamkit import check_spec_fits
from wamkit.files import MODEL_FILE, SPEC_FILE

# model.json options the clients read (a model saved by wamkit's cosmos3 adapter has them all)
_OPTIONS = ("domain_name", "resolution_tier", "view_point", "view_description", "fps", "num_inference_steps")


@dataclass(frozen=True)
class Cosmos3Client:
    """The run's preprocessing as a Cosmos3 engine's client applies it (module docstring)."""

    backend: str
    url: str
    source: Path
    spec: PreprocessSpec
    options: dict[str, Any]

    @classmethod
    def load(cls, backend: str, target: Any) -> Cosmos3Client:
        raw = target.options.get("serving_dir")
        if not raw:
            raise BackendError(
                backend, target.url,
                "eval.backend_options.serving_dir: give the directory of the run's saved preprocessing "
                f"(a serving directory, checkpoint or export holding {SPEC_FILE} and {MODEL_FILE})",
            )  # fmt: skip
        src = Path(raw).expanduser()
        for name in (SPEC_FILE, MODEL_FILE):
            if not (src / name).is_file():
                raise BackendError(
                    backend, target.url, f"eval.backend_options.serving_dir: {src / name} does not exist"
                )
        try:
            spec = PreprocessSpec.load(src / SPEC_FILE)
        except (SpecError, ValueError) as err:
            raise BackendError(backend, target.url, f"{src / SPEC_FILE}: {err}") from None
        where = src / MODEL_FILE
        try:
            model = json.loads(where.read_text())
        except (OSError, ValueError) as err:
            raise BackendError(backend, target.url, f"{where}: not a readable JSON file ({err})") from None
        if not isinstance(model, dict) or model.get("name") != "cosmos3":
            name = model.get("name") if isinstance(model, dict) else None
            raise BackendError(
                backend, target.url, f"{where}: 'name' is {name!r}; this backend serves Cosmos3 models"
            )
        options = dict(model.get("options") or {})
        missing = [k for k in _OPTIONS if k not in options]
        if missing:
            raise BackendError(backend, target.url, f"{where}: options lack {', '.join(missing)}")
        steps = target.options.get("num_inference_steps")
        if steps is not None:
            options["num_inference_steps"] = int(steps)
        if target.suite is not None:
            check_spec_fits(spec.summary(), target.suite, target.url, target.look)
        return cls(backend, target.url, src, spec, options)

    # -- observations -> what the engine takes ------------------------------------------------------
    def frame(self, obs: dict[str, Any]) -> np.ndarray:
        """One observation's cameras, each resized as training did, side by side: uint8 [S, n S, 3]."""
        keys = [image_key(c) for c in self.spec.cameras]
        missing = [k for k in keys if k not in obs]
        if missing:
            raise BackendError(
                self.backend, self.url,
                f"the env renders no {', '.join(missing)}; the model takes cameras {list(self.spec.cameras)}",
            )  # fmt: skip
        return side_by_side([self.spec.resize_images(np.asarray(obs[k], np.uint8)) for k in keys])

    def canvas(self, frame: np.ndarray) -> tuple[int, int]:
        """(height, width) of the action canvas the model was trained on, for ``frame``."""
        return action_canvas(frame.shape[:2], int(self.options["resolution_tier"]))

    def caption(self, task: str, hw: tuple[int, int]) -> str:
        """The caption of one request as training wrote it (idle frames 0, as at inference)."""
        o = self.options
        return action_prompt(
            task,
            view_point=o["view_point"],
            view_description=o["view_description"],
            num_frames=self.chunk + 1,
            fps=float(o["fps"]),
            height=hw[0],
            width=hw[1],
            idle_frames=0,
            chunk=self.chunk,
        )

    @staticmethod
    def task(obs: dict[str, Any]) -> str:
        return str(obs[TASK])

    @property
    def chunk(self) -> int:
        return int(self.spec.chunk)

    @property
    def domain_name(self) -> str:
        return str(self.options["domain_name"])

    @property
    def steps(self) -> int:
        return int(self.options["num_inference_steps"])

    # -- the engine's answer -> env actions ---------------------------------------------------------
    def decode(self, actions: Any, n: int, where: str, normalized: bool) -> np.ndarray:
        """The engine's actions (n of [H, action_dim]) -> env commands [n, H, env_action_dim]."""
        a = check_actions(self.backend, self.url, actions, n, self.spec.action_dim, where)
        return self.spec.decode_actions(a, normalized=normalized)

    def identity(self, server: dict[str, Any] | None) -> dict[str, Any] | None:
        """For plan.json and ``--resume``: what the server says it serves, and the preprocessing the
        client applies (its stats' hash), or None when the server says nothing."""
        if not server:
            return None
        return {"backend": self.backend, "server": server, "client_stats_sha256": self.spec.stats_hash()}
