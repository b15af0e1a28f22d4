"""Action representations: one record each, the only place that knows how a kind of action is encoded.

A representation maps stored actions (..., D_env) to what a model trains on (..., D_model) and back,
says how wide the model side is for a given env width, and names the model-side features. The gripper
is always the *last* channel on both sides, passed through unchanged (its convention is the data's;
see :mod:`wamkit.actions.gripper`). Adding a representation is one :func:`register` call.

- ``raw``: actions as stored (MetaWorld's 4-D ``[dx, dy, dz, gripper]``, ...).
- ``libero_rot6d``: 7-D delta-pose ``[dpos, axis-angle, g]`` <-> 10-D ``[dpos, rot6d, g]``
  (:mod:`wamkit.actions.pose`); named after the first suite that used it, which its saved files keep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from wamkit.actions import pose
from wamkit.constants import IDLE_FRAMES


class RepresentationError(ValueError):
    """An unknown representation, or actions of the wrong width for one."""


@dataclass(frozen=True)
class Representation:
    """How one kind of action is encoded for a model."""

    name: str
    doc: str
    to_model: Callable[[np.ndarray], np.ndarray]  # (..., D_env) -> (..., D_model)
    to_env: Callable[[np.ndarray], np.ndarray]  # (..., D_model) -> (..., D_env)
    env_dim: int | None  # the only env width it takes; None: any
    model_names: Callable[[Sequence[str] | None, int], list[str]]  # (env names, env dim) -> model names
    dim_change: int = 0  # D_model - D_env
    # the sample extras (wamkit.constants, e.g. idle_frames) defined for its actions: what the data
    # stage can compute beside a sample of this representation
    extras: tuple[str, ...] = ()

    def model_dim(self, env_dim: int) -> int:
        """D_model for stored actions of width ``env_dim`` (refuses a width it cannot take)."""
        self.check_env_dim(env_dim)
        return env_dim + self.dim_change

    def env_dim_of(self, model_dim: int) -> int:
        """D_env of a model that outputs ``model_dim`` channels."""
        return model_dim - self.dim_change

    def check_env_dim(self, env_dim: int) -> None:
        if self.env_dim is not None and env_dim != self.env_dim:
            raise RepresentationError(
                f"representation {self.name!r} takes {self.env_dim}-D actions ({self.doc}); the data has {env_dim}-D"
            )


REGISTRY: dict[str, Representation] = {}


def register(rep: Representation) -> Representation:
    if rep.name in REGISTRY:
        raise ValueError(f"representation {rep.name!r} is registered twice")
    REGISTRY[rep.name] = rep
    return rep


def get_representation(name: str) -> Representation:
    if name not in REGISTRY:
        raise RepresentationError(
            f"representation {name!r} is unknown; expected one of {', '.join(REGISTRY)}"
        )
    return REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def _identity(a: np.ndarray) -> np.ndarray:
    return np.asarray(a)


def _raw_names(env_names: Sequence[str] | None, dim: int) -> list[str]:
    if env_names is not None and len(env_names) == dim and all(isinstance(n, str) for n in env_names):
        return list(env_names)
    return [f"a{i}" for i in range(dim)]


register(
    Representation(
        name="raw",
        doc="actions as stored",
        to_model=_identity,
        to_env=_identity,
        env_dim=None,
        model_names=_raw_names,
    )
)
register(
    Representation(
        name="libero_rot6d",
        doc="delta pose [dpos, axis-angle, g] <-> [dpos, rot6d, g]",
        to_model=pose.to_rot6d_action,
        to_env=pose.from_rot6d_action,
        env_dim=pose.ENV_ACTION_DIM,
        model_names=lambda _names, _dim: ["dx", "dy", "dz", *[f"rot6d_{i}" for i in range(6)], "gripper"],
        dim_change=pose.ROT6D_ACTION_DIM - pose.ENV_ACTION_DIM,
        extras=(IDLE_FRAMES,),  # idle frames are counted on its 10-D chunks (wamkit.actions.idle)
    )
)
