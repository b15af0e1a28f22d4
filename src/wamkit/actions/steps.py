"""Preprocessing steps: the registered transforms a :class:`~wamkit.actions.spec.PreprocessSpec` runs.

Each step is a small frozen object acting on one feature (``action``, ``observation.state`` or
``images``), with a ``forward`` (env data toward the model) and, where one exists, an exact
``inverse``. ``preprocess.json`` lists the steps with their parameters; the training dataset and the
server run the very same objects, built from that list. A new transform is a new :class:`Step`
subclass and one :func:`register_step` line, not a new file format.

The action steps run in their listed order toward the model and in reverse back to the env:

    env command --gripper--> stored action --representation--> normalize --> clip --> model action

A step marked ``env_side`` (the gripper mapping) sits between env commands and actions as the data
stores them: ``encode_actions`` (which takes stored actions) starts after it. A ``scaling`` step
(normalisation, clipping) is left out when a server has already undone the normalisation itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from wamkit.actions.gripper import CONVENTIONS, get_convention
from wamkit.actions.images import RESIZE_METHODS, resize_images
from wamkit.actions.normalize import make_normalizer
from wamkit.actions.representations import get_representation
from wamkit.actions.representations import names as representation_names
from wamkit.actions.stats import StatsFile
from wamkit.constants import ACTION, OBS_STATE

IMAGES = "images"  # the feature of image steps: every camera's frames
NORMALIZATIONS = ("quantile", "mean_std", "min_max", "none")


class StepError(ValueError):
    """A step's parameters are missing or wrong (the message names the step and the field)."""


class Step:
    """One registered transform (module docstring). Subclasses are frozen dataclasses whose fields
    are their parameters; ``stats`` (the spec's statistics) is handed to :meth:`build`."""

    name: ClassVar[str]
    features: ClassVar[tuple[str, ...]]  # the features it may act on; the first is its default
    env_side: ClassVar[bool] = False
    scaling: ClassVar[bool] = False

    feature: str

    def forward(self, x):
        raise NotImplementedError

    def inverse(self, x):
        raise NotImplementedError(f"step {self.name!r} has no inverse")

    def params(self) -> dict[str, Any]:
        """The step as ``preprocess.json`` lists it."""
        out: dict[str, Any] = {"step": self.name}
        if len(self.features) > 1:
            out["feature"] = self.feature
        out.update(self._params())
        return out

    def _params(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build(cls, params: dict[str, Any], stats: StatsFile, where: str) -> Step:
        raise NotImplementedError


_STEPS: dict[str, type[Step]] = {}


def register_step(cls: type[Step]) -> type[Step]:
    """Make ``cls`` loadable from ``preprocess.json`` under ``cls.name`` (usable as a decorator)."""
    if cls.name in _STEPS and _STEPS[cls.name] is not cls:
        raise ValueError(f"preprocessing step {cls.name!r} is registered twice")
    _STEPS[cls.name] = cls
    return cls


def step_names() -> tuple[str, ...]:
    return tuple(_STEPS)


def _take(params: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, default: Any = ...):
    if key not in params:
        if default is ...:
            raise StepError(f"{where}: missing '{key}'")
        return default
    value = params[key]
    if not isinstance(value, kind) or (kind in (int, float, (int, float)) and isinstance(value, bool)):
        raise StepError(f"{where}: '{key}' is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


def _check_keys(params: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(set(params) - {"step", "feature", *allowed})
    if extra:
        raise StepError(
            f"{where}: unknown key(s) {', '.join(extra)} (this step takes {', '.join(allowed) or 'none'})"
        )


def _feature(cls: type[Step], params: dict[str, Any], where: str) -> str:
    feature = params.get("feature", cls.features[0])
    if feature not in cls.features:
        raise StepError(f"{where}: feature {feature!r}; step {cls.name!r} acts on {', '.join(cls.features)}")
    return feature


def build_step(params: Any, stats: StatsFile, where: str = "step") -> Step:
    """The step ``params`` (one entry of ``preprocess.json``'s ``steps``) describes."""
    if not isinstance(params, dict) or not isinstance(params.get("step"), str):
        raise StepError(f"{where}: expected an object with a 'step' name, got {params!r}")
    cls = _STEPS.get(params["step"])
    if cls is None:
        raise StepError(f"{where}: unknown step {params['step']!r}; registered: {', '.join(_STEPS)}")
    return cls.build(params, stats, f"{where} ({params['step']})")


@register_step
@dataclass(frozen=True)
class GripperStep(Step):
    """Env gripper commands (-1 open, +1 close) <-> the data's convention, on the last action dim
    (:mod:`wamkit.actions.gripper`)."""

    name: ClassVar[str] = "gripper"
    features: ClassVar[tuple[str, ...]] = (ACTION,)
    env_side: ClassVar[bool] = True
    convention: str
    feature: str = ACTION

    def forward(self, x):  # env -> stored
        a = np.array(x, np.float64)
        a[..., -1] = get_convention(self.convention).from_env(a[..., -1])
        return a

    def inverse(self, x):  # stored -> env
        a = np.array(x, np.float64)
        a[..., -1] = get_convention(self.convention).to_env(a[..., -1])
        return a

    def _params(self):
        return {"convention": self.convention}

    @classmethod
    def build(cls, params, stats, where):
        _check_keys(params, ("convention",), where)
        conv = _take(params, "convention", str, where)
        if conv not in CONVENTIONS:
            raise StepError(f"{where}: convention {conv!r} is not one of {', '.join(CONVENTIONS)}")
        return cls(conv, _feature(cls, params, where))


@register_step
@dataclass(frozen=True)
class RepresentationStep(Step):
    """Stored actions <-> the model's action representation (:mod:`wamkit.actions.representations`)."""

    name: ClassVar[str] = "representation"
    features: ClassVar[tuple[str, ...]] = (ACTION,)
    representation: str
    feature: str = ACTION

    def forward(self, x):
        return get_representation(self.representation).to_model(np.asarray(x, np.float64))

    def inverse(self, x):
        return np.array(get_representation(self.representation).to_env(x), np.float64)

    def _params(self):
        return {"name": self.representation}

    @classmethod
    def build(cls, params, stats, where):
        _check_keys(params, ("name",), where)
        rep = _take(params, "name", str, where)
        if rep not in representation_names():
            raise StepError(
                f"{where}: representation {rep!r} is not one of {', '.join(representation_names())}"
            )
        return cls(rep, _feature(cls, params, where))


@register_step
@dataclass(frozen=True)
class NormalizeStep(Step):
    """A feature normalised by its statistics (:mod:`wamkit.actions.normalize`): quantile, mean/std,
    min/max or none, with an exact inverse."""

    name: ClassVar[str] = "normalize"
    features: ClassVar[tuple[str, ...]] = (ACTION, OBS_STATE)
    scaling: ClassVar[bool] = True
    kind: str
    feature: str = ACTION
    normalizer: Any = field(default=None, compare=False, repr=False)

    def forward(self, x):
        return self.normalizer.normalize(x)

    def inverse(self, x):
        return self.normalizer.unnormalize(x)

    def _params(self):
        return {"kind": self.kind}

    @classmethod
    def build(cls, params, stats, where):
        _check_keys(params, ("kind",), where)
        kind = _take(params, "kind", str, where)
        if kind not in NORMALIZATIONS:
            raise StepError(f"{where}: kind {kind!r} is not one of {', '.join(NORMALIZATIONS)}")
        feature = _feature(cls, params, where)
        if feature not in stats.features:
            raise StepError(f"{where}: the stats have no '{feature}' (have: {', '.join(stats.features)})")
        return cls(kind, feature, make_normalizer(kind, stats[feature]))


@register_step
@dataclass(frozen=True)
class ClipStep(Step):
    """A normalised feature limited to ``[low, high]`` on its way to the model (the inverse passes it
    through: clipping cannot be undone)."""

    name: ClassVar[str] = "clip"
    features: ClassVar[tuple[str, ...]] = (ACTION, OBS_STATE)
    scaling: ClassVar[bool] = True
    low: float = -1.0
    high: float = 1.0
    feature: str = ACTION

    def forward(self, x):
        return (
            x.clamp(self.low, self.high) if isinstance(x, torch.Tensor) else np.clip(x, self.low, self.high)
        )

    def inverse(self, x):
        return x

    def _params(self):
        return {"low": self.low, "high": self.high}

    @classmethod
    def build(cls, params, stats, where):
        _check_keys(params, ("low", "high"), where)
        low = float(_take(params, "low", (int, float), where, -1.0))
        high = float(_take(params, "high", (int, float), where, 1.0))
        if not low < high:
            raise StepError(f"{where}: low {low} must be below high {high}")
        return cls(low, high, _feature(cls, params, where))


@register_step
@dataclass(frozen=True)
class ResizeStep(Step):
    """Every camera's uint8 frames [..., H, W, 3] resized to ``size`` x ``size``
    (:mod:`wamkit.actions.images`)."""

    name: ClassVar[str] = "resize"
    features: ClassVar[tuple[str, ...]] = (IMAGES,)
    size: int
    method: str = "bilinear_antialias"
    feature: str = IMAGES

    def forward(self, x):
        return resize_images(x, self.size, self.method)

    def _params(self):
        return {"size": self.size, "method": self.method}

    @classmethod
    def build(cls, params, stats, where):
        _check_keys(params, ("size", "method"), where)
        size = _take(params, "size", int, where)
        method = _take(params, "method", str, where, "bilinear_antialias")
        if size <= 0:
            raise StepError(f"{where}: size must be a positive integer, got {size}")
        if method not in RESIZE_METHODS:
            raise StepError(f"{where}: method {method!r} is not one of {', '.join(RESIZE_METHODS)}")
        return cls(size, method, _feature(cls, params, where))


def standard_steps(*, representation: str, normalization: str, clip: bool, gripper: str, image_size: int,
                   resize: str) -> list[dict[str, Any]]:  # fmt: skip
    """The steps of format 1's fixed fields (and of :meth:`PreprocessSpec.create`), as listed in
    ``preprocess.json``: the gripper mapping, the representation, the action's normalisation (then
    its clipping), the state's normalisation, the resize."""
    steps: list[dict[str, Any]] = [
        {"step": "gripper", "convention": gripper},
        {"step": "representation", "name": representation},
        {"step": "normalize", "feature": ACTION, "kind": normalization},
    ]
    if clip:
        steps.append({"step": "clip", "feature": ACTION, "low": -1.0, "high": 1.0})
    steps.append({"step": "normalize", "feature": OBS_STATE, "kind": normalization})
    steps.append({"step": "resize", "size": image_size, "method": resize})
    return steps
