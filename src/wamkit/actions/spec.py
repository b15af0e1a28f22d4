"""The preprocessing spec: everything between env data and model tensors, as one object and one file.

A model is only correct with the exact transforms it was trained with. :class:`PreprocessSpec` holds
them — a pipeline of registered steps (:mod:`wamkit.actions.steps`: gripper mapping, action
representation, normalisation with its stats, clipping, resize, ...) plus the layout they act on
(chunk length, fps, camera order, dimensions) — and *is* the transform: the training dataset and the
server call the same instance's ``encode_state`` / ``encode_actions`` / ``decode_actions`` /
``resize_images``, which run the same step objects, so the two cannot drift.

It is written once, by training (``<run_dir>/preprocess.json``), copied into every checkpoint, serving
directory and export, and read back from there by ``serve``, ``infer``, ``convert`` and (through the
server's metadata) ``eval``. Nothing downstream fills in a missing field: a file without one is refused.

File format (``preprocess.json``, format 2)::

    {"format": "wamkit-preprocess/2",
     "steps": [{"step": "gripper", "convention": "env"},
               {"step": "representation", "name": "raw"},
               {"step": "normalize", "feature": "action", "kind": "quantile"},
               {"step": "normalize", "feature": "observation.state", "kind": "quantile"},
               {"step": "resize", "size": 128, "method": "bilinear_antialias"}],
     "chunk": 16, "fps": 80, "cameras": ["corner"],
     "camera_sources": ["observation.images.corner"],
     "state_dim": 4, "action_dim": 4, "env_action_dim": 4, "stats": {<a wamkit-stats/1 file>}}

Format 1 (``wamkit-preprocess/1``: the fields ``representation``, ``normalization``, ``clip``,
``gripper``, ``image_size`` and ``resize`` in place of ``steps``) still loads, as the steps those
fields name, with identical outputs: checkpoints written before stay servable.

Conventions: ``encode_actions`` takes actions as the *data* stores them (the gripper in the data's
convention), ``decode_actions`` returns env commands (gripper -1 = open, +1 = close) and
``env_to_stored`` maps env commands back to the data's convention (forward-dynamics inputs, replays).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wamkit.actions.gripper import CONVENTIONS
from wamkit.actions.representations import get_representation
from wamkit.actions.stats import FeatureStats, StatsError, StatsFile
from wamkit.actions.steps import (
    IMAGES,
    NORMALIZATIONS,
    ClipStep,
    GripperStep,
    NormalizeStep,
    RepresentationStep,
    ResizeStep,
    Step,
    StepError,
    build_step,
    standard_steps,
)
from wamkit.config import UserError
from wamkit.constants import ACTION, OBS_STATE
from wamkit.files import SPEC_FILE, atomic_write_json, read_json

FORMAT = "wamkit-preprocess/2"
FORMAT_1 = "wamkit-preprocess/1"
_LAYOUT = ("chunk", "fps", "cameras", "camera_sources", "state_dim", "action_dim", "env_action_dim")
_FIELDS_1 = ("representation", "normalization", "clip", "gripper", "image_size", "resize")
# what summary() reports, the fields of format 1 (metadata, plans and the served identity read them)
_FIELDS = ("representation", "normalization", "clip", "gripper", "chunk", "fps", "image_size", "resize",
           "cameras", "camera_sources", "state_dim", "action_dim", "env_action_dim")  # fmt: skip
__all__ = ["FORMAT", "NORMALIZATIONS", "PreprocessSpec", "SpecError"]


class SpecError(UserError, ValueError):
    """A preprocessing spec is missing, malformed, or does not fit the model or data it meets."""


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise SpecError(f"{where}: {msg}")


def build_steps(listed: Any, stats: StatsFile, where: str) -> tuple[Step, ...]:
    """The step objects of a ``steps`` list (errors name the entry)."""
    _need(
        isinstance(listed, list) and len(listed) > 0,
        where,
        f"'steps' must be a non-empty list, got {listed!r}",
    )
    try:
        return tuple(build_step(p, stats, f"steps[{i}]") for i, p in enumerate(listed))
    except StepError as err:
        raise SpecError(f"{where}: {err}") from None


@dataclass(frozen=True)
class PreprocessSpec:
    """Env data <-> model tensors (see the module docstring). Build with :meth:`create` or :meth:`load`."""

    steps: tuple[Step, ...]
    chunk: int
    fps: float | None  # None only for a model served without data (random init)
    cameras: tuple[str, ...]
    camera_sources: tuple[str, ...]
    state_dim: int
    action_dim: int
    env_action_dim: int
    stats: StatsFile = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def create(cls, stats: StatsFile, *, normalization: str, clip: bool, image_size: int, resize: str,
               cameras, camera_sources=(), chunk: int, gripper: str | None = None,
               state_dim: int | None = None) -> PreprocessSpec:  # fmt: skip
        """A spec of the standard steps (:func:`~wamkit.actions.steps.standard_steps`) from a stats
        file and the training settings; representation, fps and the gripper convention come from the
        stats metadata (``gripper`` overrides the latter).

        A stats file of actions only (cosmos' action stats: Cosmos3 takes no state) gets unit state
        statistics of ``state_dim`` (normalisation passes the state through), recorded in its metadata
        as ``state_stats: "identity"``; without ``state_dim`` it is refused.
        """
        if OBS_STATE not in stats.features and state_dim is not None:
            unit = cls._unit(state_dim)
            stats = StatsFile(
                {**stats.features, OBS_STATE: unit}, {**stats.metadata, "state_stats": "identity"}
            )
        meta = stats.metadata
        if "representation" not in meta:
            raise SpecError("stats file metadata has no 'representation'; recompute it with `wamkit stats`")
        rep = get_representation(meta["representation"])
        grip = gripper or meta.get("gripper")
        if grip is None:
            raise SpecError(
                "stats file metadata has no 'gripper' convention; recompute it with `wamkit stats` "
                f"(which detects it) or set data.gripper to one of {', '.join(CONVENTIONS)}"
            )
        _need(normalization in NORMALIZATIONS, "preprocessing spec",
              f"normalization {normalization!r} is not one of {', '.join(NORMALIZATIONS)}")  # fmt: skip
        _need(OBS_STATE in stats.features, "preprocessing spec",
              f"the stats have no '{OBS_STATE}' (give state_dim for identity state statistics)")  # fmt: skip
        listed = standard_steps(representation=rep.name, normalization=normalization, clip=bool(clip),
                                gripper=grip, image_size=int(image_size), resize=resize)  # fmt: skip
        action_dim = stats[ACTION].dim
        return cls(
            steps=build_steps(listed, stats, "preprocessing spec"), chunk=int(chunk), fps=meta.get("fps"),
            cameras=tuple(cameras), camera_sources=tuple(camera_sources or ()),
            state_dim=stats[OBS_STATE].dim, action_dim=action_dim,
            env_action_dim=rep.env_dim_of(action_dim), stats=stats,
        )  # fmt: skip

    @classmethod
    def identity(cls, *, representation: str, cameras, image_size: int, state_dim: int, action_dim: int,
                 chunk: int) -> PreprocessSpec:  # fmt: skip
        """For a model served without data (benchmarks): stats under which quantile normalisation is
        the identity, the env gripper convention, no fps."""

        meta = {"representation": representation, "chunk": chunk, "action_dim": action_dim,
                "gripper": "env", "identity": True}  # fmt: skip
        stats = StatsFile(
            features={ACTION: cls._unit(action_dim), OBS_STATE: cls._unit(state_dim)}, metadata=meta
        )
        return cls.create(stats, normalization="quantile", clip=False, image_size=image_size,
                          resize="bilinear_antialias", cameras=cameras, chunk=chunk)  # fmt: skip

    @staticmethod
    def _unit(dim: int) -> FeatureStats:
        """Stats under which quantile (and mean/std) normalisation is the identity."""
        ones = [1.0] * dim
        return FeatureStats([0.0] * dim, ones, [-1.0] * dim, ones, [-1.0] * dim, ones, count=1)

    # -- the steps ---------------------------------------------------------------------------------
    def _of(self, feature: str) -> list[Step]:
        return [s for s in self.steps if s.feature == feature]

    def _one(self, kind: type, feature: str) -> Any:
        found = [s for s in self._of(feature) if isinstance(s, kind)]
        return found[0] if found else None

    @property
    def representation(self) -> str:
        return self._one(RepresentationStep, ACTION).representation

    @property
    def gripper(self) -> str:
        return self._one(GripperStep, ACTION).convention

    @property
    def normalization(self) -> str:
        """The action's normalisation ("none" without a normalize step)."""
        step = self._one(NormalizeStep, ACTION)
        return step.kind if step is not None else "none"

    @property
    def clip(self) -> bool:
        return self._one(ClipStep, ACTION) is not None

    @property
    def image_size(self) -> int:
        return self._one(ResizeStep, IMAGES).size

    @property
    def resize(self) -> str:
        return self._one(ResizeStep, IMAGES).method

    def validate(self, where: str = "preprocessing spec") -> None:
        for kind in (RepresentationStep, GripperStep, ResizeStep):
            n = sum(isinstance(s, kind) for s in self.steps)
            _need(n == 1, where, f"steps: expected one '{kind.name}' step, found {n}")
        for feature in (ACTION, OBS_STATE):
            n = sum(isinstance(s, NormalizeStep) for s in self._of(feature))
            _need(n <= 1, where, f"steps: at most one 'normalize' step of '{feature}', found {n}")
        actions = self._of(ACTION)
        env_side = [s.env_side for s in actions]
        _need(env_side == sorted(env_side, reverse=True), where,
              "steps: the gripper mapping (between env commands and stored actions) must come before "
              "the other action steps")  # fmt: skip
        rep = get_representation(self.representation)
        for name in ("chunk", "state_dim", "action_dim"):
            value = getattr(self, name)
            _need(
                isinstance(value, int) and value > 0,
                where,
                f"{name} must be a positive integer, got {value!r}",
            )
        _need(len(self.cameras) > 0, where, "cameras is empty")
        _need(not self.camera_sources or len(self.camera_sources) == len(self.cameras), where,
              f"camera_sources {list(self.camera_sources)} do not pair with cameras {list(self.cameras)}")  # fmt: skip
        _need(self.env_action_dim == rep.env_dim_of(self.action_dim), where,
              f"env_action_dim {self.env_action_dim} does not fit action_dim {self.action_dim} under {rep.name!r}")  # fmt: skip
        _need(self.stats[ACTION].dim == self.action_dim, where,
              f"stats 'action' has {self.stats[ACTION].dim} dims, action_dim is {self.action_dim}")  # fmt: skip
        _need(self.stats[OBS_STATE].dim == self.state_dim, where,
              f"stats '{OBS_STATE}' has {self.stats[OBS_STATE].dim} dims, state_dim is {self.state_dim}")  # fmt: skip
        stats_rep = self.stats.metadata.get("representation")
        _need(stats_rep == self.representation, where,
              f"stats describe representation {stats_rep!r}, the spec says {self.representation!r}")  # fmt: skip

    # -- the transforms ----------------------------------------------------------------------------
    def encode_state(self, state) -> np.ndarray:
        """Raw state (..., state_dim) -> normalised float32 (the state's steps, in order)."""
        x = np.asarray(state, np.float64)
        for step in self._of(OBS_STATE):
            x = step.forward(x)
        return np.asarray(x, np.float32)

    def encode_actions(self, stored) -> np.ndarray:
        """Actions as the data stores them (..., env_action_dim) -> normalised model actions, float32."""
        x = np.asarray(stored, np.float64)
        for step in self._of(ACTION):
            if not step.env_side:
                x = step.forward(x)
        return np.asarray(x, np.float32)

    def decode_actions(self, model_actions, normalized: bool = True) -> np.ndarray:
        """Normalised model actions (..., action_dim) -> env commands (..., env_action_dim), float32.
        ``normalized=False``: the actions are already in the data's units (a server that undid the
        normalisation itself); the scaling steps are skipped, the representation and the gripper
        changed."""
        x = np.asarray(model_actions, np.float64)
        for step in reversed(self._of(ACTION)):
            if normalized or not step.scaling:
                x = step.inverse(x)
        return np.asarray(x, np.float64).astype(np.float32)

    def env_to_stored(self, env_actions) -> np.ndarray:
        """Env commands (..., env_action_dim) -> actions in the data's gripper convention."""
        x = np.array(env_actions, np.float64)
        for step in self._of(ACTION):
            if step.env_side:
                x = step.forward(x)
        return x

    def resize_images(self, img):
        """uint8 frames [..., H, W, 3] (NumPy or torch) -> [..., image_size, image_size, 3]."""
        for step in self._of(IMAGES):
            img = step.forward(img)
        return img

    # -- checks ------------------------------------------------------------------------------------
    def check_model(self, io: Any, where: str = "preprocessing spec") -> None:
        """Refuse a model whose declared inputs/outputs (a ModelIO) differ from the spec's."""
        pairs = {"representation": io.representation, "chunk": io.chunk, "image_size": io.image_size,
                 "cameras": tuple(io.cameras), "state_dim": io.state_dim, "action_dim": io.action_dim}  # fmt: skip
        diff = [
            f"{k}: spec {getattr(self, k)!r}, model {v!r}" for k, v in pairs.items() if getattr(self, k) != v
        ]
        _need(not diff, where, "does not fit the model (" + "; ".join(diff) + ")")

    def stats_hash(self) -> str:
        """sha256 of the stats' canonical JSON: names the numbers a model was trained with."""
        blob = json.dumps(self.stats.to_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    # -- the file ----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Every field but the stats arrays (which are named by their hash): for metadata and plans.
        The fields of format 1 (which clients read) and the steps."""
        out = {k: getattr(self, k) for k in _FIELDS}
        out["cameras"], out["camera_sources"] = list(self.cameras), list(self.camera_sources)
        out["steps"] = [s.params() for s in self.steps]
        # the look the training frames were rendered with, where the data recorded it
        out["render_quality"] = self.stats.metadata.get("render_quality")
        return {**out, "stats_sha256": self.stats_hash()}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "steps": [s.params() for s in self.steps]}
        out.update({k: getattr(self, k) for k in _LAYOUT})
        out["cameras"], out["camera_sources"] = list(self.cameras), list(self.camera_sources)
        out["stats"] = self.stats.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any, source: str = "preprocessing spec") -> PreprocessSpec:
        _need(isinstance(data, dict), source, "expected a JSON object at the top level")
        fmt = data.get("format")
        _need(
            fmt in (FORMAT, FORMAT_1), source, f"'format' is {fmt!r}, expected {FORMAT!r} (or {FORMAT_1!r})"
        )
        fields = (*(_FIELDS_1 if fmt == FORMAT_1 else ("steps",)), *_LAYOUT, "stats")
        missing = [k for k in fields if k not in data]
        _need(not missing, source, f"missing {', '.join(missing)}")
        try:
            stats = StatsFile.from_json(data["stats"], source=f"{source}: stats")
        except StatsError as err:
            raise SpecError(str(err)) from None
        if fmt == FORMAT_1:
            one = {k: data[k] for k in _FIELDS_1}
            _need(isinstance(one["clip"], bool), source, f"clip must be true or false, got {one['clip']!r}")
            _need(one["normalization"] in NORMALIZATIONS, source,
                  f"normalization {one['normalization']!r} is not one of {', '.join(NORMALIZATIONS)}")  # fmt: skip
            listed = standard_steps(**one)
        else:
            listed = data["steps"]
        kw = {k: data[k] for k in _LAYOUT}
        for k in ("cameras", "camera_sources"):
            _need(isinstance(kw[k], list), source, f"{k} must be a list, got {kw[k]!r}")
            kw[k] = tuple(kw[k])
        steps = build_steps(listed, stats, source)
        try:
            return cls(steps=steps, **kw, stats=stats)
        except SpecError as err:
            raise SpecError(f"{source}: {err}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically; ``path`` may be a directory (then ``<dir>/preprocess.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / SPEC_FILE
        return atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PreprocessSpec:
        """Read ``path`` (a file, or a directory holding ``preprocess.json``); errors name the file."""
        path = Path(path)
        if path.is_dir():
            path = path / SPEC_FILE
        data = read_json(path, SpecError, "every checkpoint, serving directory and export has one")
        return cls.from_json(data, source=str(path))
