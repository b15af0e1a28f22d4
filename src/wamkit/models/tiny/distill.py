"""Step distillation of ``tiny``: a student that reaches in k Euler steps what its teacher reaches in many.

The method is piecewise rectified flow (PeRFlow: Yan et al. 2024, arXiv 2405.07510), in its simplest
form. The student's k-step sampler splits the flow time [1, 0] into k windows (the model's shifted grid,
:func:`wamkit.models.tiny.adapter.shifted_times`). For each training sample, the teacher integrates its
own ODE from noise through every window with ``teacher_steps / k`` Euler sub-steps (rounded up), and the
student, initialised from the teacher, learns to cross each window in one step: its velocity at a
window's start point is regressed on the teacher's average velocity over the window, (x_end - x_start) /
(t_end - t_start). Windows are chained along the teacher's path, so the student learns each window from
the states the teacher actually passes through.

Why this method: it needs nothing beyond the teacher (no discriminator, no second network, no
reflow dataset to generate ahead, as InstaFlow's reflow does, arXiv 2309.06380), it is exact for any k
from 1 up (k = 1 is Luhman and Luhman's one-step distillation, arXiv 2101.02388), the student keeps the
teacher's architecture and sampler (only its step count changes), and its cost is the teacher's
many-step inference on each batch, which for a flow policy is a small multiple of a training step.

Only the policy mode is distilled (the mode a robot runs); the frame tokens a policy denoises with its
actions are distilled with them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from wamkit.constants import TASK


def window_times(steps: int, teacher_steps: int, shift: float) -> list[list[float]]:
    """The teacher's sub-grid of each of the student's ``steps`` windows: ``ceil(teacher_steps /
    steps)`` Euler steps each, uniform in the unshifted time and warped as the model's grid is, so
    window ``i`` runs from the student's ``t_i`` to ``t_{i+1}`` exactly."""
    sub = max(1, math.ceil(teacher_steps / steps))
    u = np.linspace(1.0, 0.0, steps * sub + 1)
    t = shift * u / (1.0 + (shift - 1.0) * u)
    return [[float(v) for v in t[i * sub : (i + 1) * sub + 1]] for i in range(steps)]


def _velocity(
    model: Any, state: torch.Tensor, cache: Any, x_act: torch.Tensor, x_frm: torch.Tensor | None,
    t_now: float, now: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One policy-mode velocity of ``model`` (a :class:`~wamkit.models.tiny.adapter.TinyAdapter`), built as
    its ``predict`` builds it."""
    b = x_act.shape[0]
    t = torch.full((b,), t_now, device=x_act.device)
    gen: dict[str, Any] = {"actions": x_act, "t_actions": t, "state": state}
    if x_frm is not None:
        gen["frames"] = x_frm
        gen["t_frames"] = torch.ones_like(t) if model.cfg.world_residual else t
        if now is not None:
            gen["frames_now"] = now
    v_act, v_frm = model.module(gen=gen, cache=cache)
    return v_act.float(), None if v_frm is None else v_frm.float()


def distill_loss(
    student: Any, teacher: Any, batch: dict[str, Any], steps: int, teacher_steps: int
) -> dict[str, torch.Tensor]:
    """``{"distill_action_loss", "distill_frame_loss" (noisy frames), "loss"}``: the student's velocity
    against the teacher's average velocity over each of the ``steps`` windows (module docstring)."""
    b, dev = len(batch[TASK]), student.device
    diffused = student.module.n_frame and not student.cfg.world_residual
    prefix = student._prefix(batch)
    cache = student.module(prefix=prefix)
    now = student._current_frame(batch) if student.module.n_frame and student.cfg.world_residual else None
    with torch.no_grad():
        t_prefix = teacher._prefix(batch)
        t_cache = teacher.module(prefix=t_prefix)
    x_act = torch.randn((b, student.io.chunk, student.io.action_dim), device=dev)
    x_frm = None
    if student.module.n_frame:
        shape = (b, student.module.n_frame, student.module.frame_dim)
        x_frm = torch.randn(shape, device=dev) if diffused else torch.zeros(shape, device=dev)
    act_loss = torch.zeros((), device=dev)
    frm_loss = torch.zeros((), device=dev)
    for grid in window_times(steps, teacher_steps, student.cfg.time_shift):
        with torch.no_grad():  # the teacher across the window
            y_act, y_frm = x_act, x_frm
            for s0, s1 in zip(grid[:-1], grid[1:]):
                v_a, v_f = _velocity(teacher, t_prefix["state"], t_cache, y_act, y_frm, s0, now)
                y_act = y_act + (s1 - s0) * v_a
                if diffused:
                    y_frm = y_frm + (s1 - s0) * v_f
        width = grid[-1] - grid[0]
        v_a, v_f = _velocity(student, prefix["state"], cache, x_act, x_frm, grid[0], now)
        act_loss = act_loss + (v_a - (y_act - x_act) / width).pow(2).mean()
        if diffused:
            frm_loss = frm_loss + (v_f - (y_frm - x_frm) / width).pow(2).mean()
        x_act, x_frm = y_act, y_frm
    out = {"distill_action_loss": act_loss / steps}
    loss = out["distill_action_loss"]
    if diffused:
        out["distill_frame_loss"] = frm_loss / steps
        # the actions attend to the frames they are denoised with: the frames are distilled even where
        # the teacher's frame loss had no weight
        loss = loss + (student.cfg.world_weight or 1.0) * out["distill_frame_loss"]
    out["loss"] = loss
    return out
