"""Gripper conventions: how a dataset stores the gripper, and how that maps to the env's command.

The convention is a property of the *data* (recorded in the stats file's metadata as ``"gripper"`` and
in the preprocessing spec), never of the code: the model trains on the values the data holds, and the
preprocessing spec (:mod:`wamkit.actions.spec`) maps its output to the env command (and an env command
back, for checks and replays).

- ``env``: the stored value *is* the env command. robosuite: -1 = open, +1 = close
  (continuous values in between pass through); MetaWorld's 4th action channel likewise.
- ``open_1``: g in [0, 1], 1 = open, 0 = close (NVIDIA's published LeRobot data of robosuite
  suites, hence the Cosmos3 checkpoints trained on it). The env command is ``-sign(2g - 1)`` with the undecided 0.5 going to -1 (open): the
  mapping RLinf applies to Cosmos3 outputs; its inverse maps -1 -> 1 and +1 -> 0.
- ``close_1``: g in [0, 1], 1 = close. Env command ``sign(2g - 1)`` (0.5 -> open), inverse -1 -> 0.

:func:`detect_gripper` infers the convention from a dataset's gripper actions (range) and, where the
state holds finger positions, from which action value precedes the fingers opening (polarity).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT = "env"


class GripperError(ValueError):
    """An unknown convention name, or data that fits none."""


def _floats(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype.kind == "f" else x.astype(np.float64)


def _sign_open_low(g: np.ndarray) -> np.ndarray:
    """+1 where g > 0.5 (close), else -1 (open; the undecided 0.5 opens)."""
    return np.where(g > 0.5, 1.0, -1.0).astype(g.dtype)


@dataclass(frozen=True)
class GripperConvention:
    """One way of storing the gripper: its name, stored values for open and close, and the maps."""

    name: str
    open_value: float
    close_value: float
    doc: str

    def to_env(self, g):
        """Stored / model values (...) -> env command (-1 = open, +1 = close)."""
        g = _floats(g)
        if self.name == DEFAULT:
            return g
        closing = g if self.close_value > self.open_value else 1.0 - g
        return _sign_open_low(closing)

    def from_env(self, g_env):
        """Env command (-1 = open, +1 = close) -> stored values; commands are read by their sign."""
        g_env = _floats(g_env)
        if self.name == DEFAULT:
            return g_env
        closed = g_env > 0
        return np.where(closed, self.close_value, self.open_value).astype(g_env.dtype)


CONVENTIONS: dict[str, GripperConvention] = {
    c.name: c
    for c in (
        GripperConvention("env", -1.0, 1.0, "the env command itself: -1 = open, +1 = close"),
        GripperConvention("open_1", 1.0, 0.0, "g in [0, 1], 1 = open (Cosmos3's published data)"),
        GripperConvention("close_1", 0.0, 1.0, "g in [0, 1], 1 = close"),
    )
}


def get_convention(name: str) -> GripperConvention:
    if name not in CONVENTIONS:
        raise GripperError(
            f"gripper convention {name!r} is unknown; expected one of {', '.join(CONVENTIONS)}"
        )
    return CONVENTIONS[name]


def polarity(g, finger_width, episodes=None) -> float | None:
    """Correlation between the gripper value and the change of finger width that follows it.

    The fingers open after an "open" command, so a positive value means "high = open". ``g`` and
    ``finger_width`` are per-frame series; ``episodes`` (the episode of each frame) keeps the steps
    from one episode's last frame to the next one's first out. None when it cannot tell (too few steps,
    a constant command or fingers that never move).
    """
    g, w = np.asarray(g, np.float64).ravel(), np.asarray(finger_width, np.float64).ravel()
    if len(g) != len(w):
        return None
    same = np.ones(max(len(g) - 1, 0), bool) if episodes is None else np.diff(np.asarray(episodes)) == 0
    a, dw = g[:-1][same], np.diff(w)[same]
    if len(a) < 3 or a.std() < 1e-9 or dw.std() < 1e-9:
        return None
    return float(np.corrcoef(a, dw)[0, 1])


def detect_gripper(actions_gripper, finger_width=None, episodes=None) -> tuple[str, str]:
    """``(convention name, evidence)`` for a dataset's gripper action channel.

    Range decides between ``env`` (values below 0 occur) and the [0, 1] conventions; among those, the
    polarity against ``finger_width`` (e.g. the two finger joints' difference) decides when it is clear
    (|correlation| >= 0.1), otherwise ``open_1`` (the one published [0, 1] convention) is assumed and
    the evidence says so. A last channel with values outside [-1, 1] is no gripper encoding known here:
    it is passed through unchanged (``env``), and the evidence says that too.
    """
    g = np.asarray(actions_gripper, np.float64).ravel()
    if g.size == 0:
        raise GripperError("no gripper values to detect a convention from")
    lo, hi = float(g.min()), float(g.max())
    span = f"gripper actions range over [{lo:.3g}, {hi:.3g}]"
    if lo < -1.0 - 1e-6 or hi > 1.0 + 1e-6:
        return "env", f"{span}: outside [-1, 1], not a known gripper encoding; passed through unchanged"
    if lo < -1e-6:
        return "env", f"{span}: negative values, so the env command itself (-1 open, +1 close)"
    corr = polarity(g, finger_width, episodes) if finger_width is not None else None
    if corr is not None and abs(corr) >= 0.1:
        name = "open_1" if corr > 0 else "close_1"
        return (
            name,
            f"{span}; high values precede the fingers {'opening' if corr > 0 else 'closing'} (r={corr:.2f})",
        )
    why = "no finger state to tell polarity" if corr is None else f"polarity unclear (r={corr:.2f})"
    return "open_1", f"{span} within [0, 1]; {why}: assuming 1 = open (NVIDIA's convention)"
