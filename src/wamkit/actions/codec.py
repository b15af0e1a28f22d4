"""The action/state transforms between env space and model space, shared by training and serving.

``ActionCodec.encode_actions`` turns stored actions into what a model trains on (representation change,
then normalisation); ``decode_actions`` is its exact inverse on the model's output, giving env-ready
actions. The very same object, built from the stats file shipped with a checkpoint, runs in the data
pipeline and in the server, so the two cannot drift.

Representations:
- ``raw``: actions as stored (e.g. MetaWorld's 4-D ``[dx, dy, dz, gripper]``).
- ``libero_rot6d``: LIBERO's 7-D ``[dpos, axis-angle, g_env]`` <-> 10-D ``[dpos, rot6d, g_env]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wamkit.actions import libero
from wamkit.actions.normalize import make_normalizer
from wamkit.actions.stats import StatsError, StatsFile
from wamkit.constants import ACTION, OBS_STATE

REPRESENTATIONS = ("raw", "libero_rot6d")


def to_representation(actions: np.ndarray, representation: str) -> np.ndarray:
    """Stored actions (..., D_env) -> training representation (..., D_model)."""
    if representation == "raw":
        return np.asarray(actions)
    if representation == "libero_rot6d":
        return libero.to_rot6d_action(actions)
    raise ValueError(f"representation {representation!r} is unknown; expected one of {REPRESENTATIONS}")


def from_representation(actions: np.ndarray, representation: str) -> np.ndarray:
    """Training representation (..., D_model) -> env actions (..., D_env)."""
    if representation == "raw":
        return np.asarray(actions)
    if representation == "libero_rot6d":
        return libero.from_rot6d_action(actions)
    raise ValueError(f"representation {representation!r} is unknown; expected one of {REPRESENTATIONS}")


@dataclass(frozen=True)
class ActionCodec:
    """Env space <-> model space for actions and state, from one stats file."""

    stats: StatsFile
    normalization: str = "quantile"
    clip: bool = False

    def __post_init__(self) -> None:
        rep = self.stats.metadata.get("representation")
        if rep not in REPRESENTATIONS:
            raise StatsError(f"stats metadata 'representation' is {rep!r}; expected one of {REPRESENTATIONS}")

    @property
    def representation(self) -> str:
        return self.stats.metadata["representation"]

    def _norm(self, feature: str, clip: bool = False):
        return make_normalizer(self.normalization, self.stats[feature], clip)

    def encode_actions(self, actions: np.ndarray) -> np.ndarray:
        """Stored/env actions (..., D_env) -> normalised model actions (..., D_model), float32."""
        a = to_representation(np.asarray(actions, np.float64), self.representation)
        return np.asarray(self._norm(ACTION, self.clip).normalize(a), np.float32)

    def decode_actions(self, model_actions: np.ndarray) -> np.ndarray:
        """Normalised model actions (..., D_model) -> env-ready actions (..., D_env), float32."""
        a = self._norm(ACTION).unnormalize(np.asarray(model_actions, np.float64))
        return np.asarray(from_representation(a, self.representation), np.float32)

    def encode_state(self, state: np.ndarray) -> np.ndarray:
        """Raw state (..., S) -> normalised state, float32 (no clipping: states may leave the range)."""
        return np.asarray(self._norm(OBS_STATE).normalize(np.asarray(state, np.float64)), np.float32)
