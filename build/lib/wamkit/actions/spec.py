"""The preprocessing spec: everything between env data and model tensors, as one object and one file.

A model is only correct with the exact transforms it was trained with. :class:`PreprocessSpec` holds
all of them — action representation, normalisation kind and clipping, the stats, the gripper
convention, chunk length, fps, image size and resize method, camera order — and *is* the transform:
the training dataset and the server call the same instance's ``encode_state`` / ``encode_actions`` /
``decode_actions`` / ``resize_images``, so the two cannot drift.

It is written once, by training (``<run_dir>/preprocess.json``), copied into every checkpoint, serving
directory and export, and read back from there by ``serve``, ``infer``, ``convert`` and (through the
server's metadata) ``eval``. Nothing downstream fills in a missing field: a file without one is refused.

File format (``preprocess.json``)::

    {"format": "wamkit-preprocess/1", "representation": "libero_rot6d", "normalization": "quantile",
     "clip": false, "gripper": "env", "chunk": 16, "fps": 20, "image_size": 128,
     "resize": "bilinear_antialias", "cameras": ["agentview", "wrist"],
     "camera_sources": ["observation.images.image", "observation.images.wrist_image"],
     "state_dim": 8, "action_dim": 10, "env_action_dim": 7, "stats": {<a wamkit-stats/1 file>}}

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

from wamkit.actions.gripper import CONVENTIONS, get_convention
from wamkit.actions.images import RESIZE_METHODS, resize_images
from wamkit.actions.normalize import make_normalizer
from wamkit.actions.representations import get_representation
from wamkit.actions.stats import FeatureStats, StatsError, StatsFile
from wamkit.constants import ACTION, OBS_STATE
from wamkit.files import SPEC_FILE, atomic_write_json, read_json

FORMAT = "wamkit-preprocess/1"
NORMALIZATIONS = ("quantile", "mean_std", "min_max", "none")
_FIELDS = ("representation", "normalization", "clip", "gripper", "chunk", "fps", "image_size", "resize",
           "cameras", "camera_sources", "state_dim", "action_dim", "env_action_dim")  # fmt: skip


class SpecError(ValueError):
    """A preprocessing spec is missing, malformed, or does not fit the model or data it meets."""


def _need(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise SpecError(f"{where}: {msg}")


@dataclass(frozen=True)
class PreprocessSpec:
    """Env data <-> model tensors (see the module docstring). Build with :meth:`create` or :meth:`load`."""

    representation: str
    normalization: str
    clip: bool
    gripper: str
    chunk: int
    fps: float | None  # None only for a model served without data (random init)
    image_size: int
    resize: str
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
        """A spec from a stats file and the training settings; representation, fps and the gripper
        convention come from the stats metadata (``gripper`` overrides the latter).

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
        action_dim = stats[ACTION].dim
        return cls(
            representation=rep.name, normalization=normalization, clip=bool(clip), gripper=grip,
            chunk=int(chunk), fps=meta.get("fps"), image_size=int(image_size), resize=resize,
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

    def validate(self, where: str = "preprocessing spec") -> None:
        rep = get_representation(self.representation)
        _need(self.normalization in NORMALIZATIONS, where,
              f"normalization {self.normalization!r} is not one of {', '.join(NORMALIZATIONS)}")  # fmt: skip
        _need(self.gripper in CONVENTIONS, where,
              f"gripper {self.gripper!r} is not one of {', '.join(CONVENTIONS)}")  # fmt: skip
        _need(self.resize in RESIZE_METHODS, where,
              f"resize {self.resize!r} is not one of {', '.join(RESIZE_METHODS)}")  # fmt: skip
        for name in ("chunk", "image_size", "state_dim", "action_dim"):
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
    def _norm(self, feature: str, clip: bool = False):
        """The normalizer of ``feature``, built once per spec (it runs for every sample and request)."""
        cache = self.__dict__.setdefault("_normalizers", {})  # frozen: the cache is not a field
        key = (feature, clip)
        if key not in cache:
            cache[key] = make_normalizer(self.normalization, self.stats[feature], clip)
        return cache[key]

    def encode_state(self, state) -> np.ndarray:
        """Raw state (..., state_dim) -> normalised float32 (never clipped: states may leave the range)."""
        return np.asarray(self._norm(OBS_STATE).normalize(np.asarray(state, np.float64)), np.float32)

    def encode_actions(self, stored) -> np.ndarray:
        """Actions as the data stores them (..., env_action_dim) -> normalised model actions, float32."""
        a = get_representation(self.representation).to_model(np.asarray(stored, np.float64))
        return np.asarray(self._norm(ACTION, self.clip).normalize(a), np.float32)

    def decode_actions(self, model_actions, normalized: bool = True) -> np.ndarray:
        """Normalised model actions (..., action_dim) -> env commands (..., env_action_dim), float32.
        ``normalized=False``: the actions are already in the data's units (a server that undid the
        normalisation itself); only the representation and the gripper are changed."""
        a = np.asarray(model_actions, np.float64)
        if normalized:
            a = self._norm(ACTION).unnormalize(a)
        a = np.array(get_representation(self.representation).to_env(a), np.float64)
        a[..., -1] = get_convention(self.gripper).to_env(a[..., -1])
        return a.astype(np.float32)

    def env_to_stored(self, env_actions) -> np.ndarray:
        """Env commands (..., env_action_dim) -> actions in the data's gripper convention."""
        a = np.array(env_actions, np.float64)
        a[..., -1] = get_convention(self.gripper).from_env(a[..., -1])
        return a

    def resize_images(self, img):
        """uint8 frames [..., H, W, 3] (NumPy or torch) -> [..., image_size, image_size, 3]."""
        return resize_images(img, self.image_size, self.resize)

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
        """Every field but the stats arrays (which are named by their hash): for metadata and plans."""
        out = {k: getattr(self, k) for k in _FIELDS}
        out["cameras"], out["camera_sources"] = list(self.cameras), list(self.camera_sources)
        # the look the training frames were rendered with, where the data recorded it
        out["render_quality"] = self.stats.metadata.get("render_quality")
        return {**out, "stats_sha256": self.stats_hash()}

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, **self.summary(), "stats": self.stats.to_json()}
        del out["stats_sha256"], out["render_quality"]  # both are read from the stats themselves
        return out

    @classmethod
    def from_json(cls, data: Any, source: str = "preprocessing spec") -> PreprocessSpec:
        _need(isinstance(data, dict), source, "expected a JSON object at the top level")
        _need(
            data.get("format") == FORMAT, source, f"'format' is {data.get('format')!r}, expected {FORMAT!r}"
        )
        missing = [k for k in (*_FIELDS, "stats") if k not in data]
        _need(not missing, source, f"missing {', '.join(missing)}")
        try:
            stats = StatsFile.from_json(data["stats"], source=f"{source}: stats")
        except StatsError as err:
            raise SpecError(str(err)) from None
        kw = {k: data[k] for k in _FIELDS}
        kw["cameras"], kw["camera_sources"] = tuple(kw["cameras"]), tuple(kw["camera_sources"])
        try:
            return cls(**kw, stats=stats)
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
