"""Real-time chunking (RTC): a flow sampler guided to continue the chunk a robot is executing.

Black, Galliker and Levine, "Real-Time Execution of Action Chunking Flow Policies" (arXiv 2506.07339),
Algorithm 1. While a request is in flight the robot executes the first ``d`` actions of the new chunk's
window from the previous chunk; the new chunk is sampled as an inpainting of the previous chunk's
unexecuted actions ``Y`` [H, D] (``K`` of them, the rest padding), guided at every denoising step by a
vector-Jacobian product through the denoised estimate, with a soft mask ``W`` over the overlap and a
clipped guidance weight. No training is involved.

Conventions. The paper's flow time ``tau`` runs from 0 (noise) to 1 (data) and its velocity points to
the data. wamkit's samplers use the noise level ``t = 1 - tau`` (``x_t = (1 - t) x0 + t noise``) and the
velocity ``u = noise - x0`` (tiny; Cosmos3's sigma is the same ``t``), so with the paper's ``v = -u``:

    x0_hat = x_t - t u                      (the paper's A^1_hat = A^tau + (1 - tau) v)
    g      = (d x0_hat / d x_t)^T [W * (Y - x0_hat)]
    w      = min(beta, t / ((1 - t) r2)),   r2 = t^2 / (t^2 + (1 - t)^2)   (the paper's (1 - tau) / (tau r2_tau))
    u'     = u - w g                        (the paper's v + w g)

The soft mask (the paper's Eq. 5, ``s`` its execution horizon, here ``H - s = K``, the leftover's
length): ``W_i = 1`` for ``i < d``; ``W_i = c_i (e^{c_i} - 1) / (e - 1)`` with
``c_i = (K - i) / (K - d + 1)`` for ``d <= i < K``; ``0`` for ``i >= K``. ``linear`` uses ``c_i`` itself,
``ones`` weights the whole overlap 1, ``zeros`` only the first ``d`` (hard inpainting of the committed
actions). The paper's defaults: the exponential schedule and ``beta = 5``.

Rows of one batch carry their own ``Y``, ``W`` and ``beta``; a row whose mask is all zero gets an
exactly zero guidance (its cotangent is zero), so its velocity is the unguided one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

SCHEDULES = ("exp", "linear", "ones", "zeros")
MAX_GUIDANCE = 5.0  # the paper's beta


def soft_mask(horizon: int, leftover: int, delay: int, schedule: str = "exp") -> np.ndarray:
    """The weights ``W`` [horizon] over a new chunk for a leftover of ``leftover`` actions of which the
    first ``delay`` are executed before the chunk arrives (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"rtc schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if not 0 <= delay <= leftover <= horizon:
        raise ValueError(
            f"rtc: expected 0 <= delay ({delay}) <= unexecuted actions ({leftover}) <= chunk ({horizon})"
        )
    w = np.zeros(horizon, np.float32)
    w[:delay] = 1.0
    i = np.arange(delay, leftover)
    if schedule == "ones":
        w[delay:leftover] = 1.0
    elif schedule in ("exp", "linear") and len(i):
        c = (leftover - i) / (leftover - delay + 1)
        w[delay:leftover] = c if schedule == "linear" else c * np.expm1(c) / (math.e - 1.0)
    return w


def guidance_weight(t: float, max_guidance: torch.Tensor) -> torch.Tensor:
    """``min(beta, t / ((1 - t) r2))`` at noise level ``t`` (``beta`` per row, [B])."""
    if t >= 1.0:  # pure noise: the unclipped weight is infinite
        return max_guidance
    r2 = t * t / (t * t + (1.0 - t) ** 2)
    return torch.clamp(max_guidance, max=t / ((1.0 - t) * r2)) if t > 0 else torch.zeros_like(max_guidance)


def guided_velocity(
    velocity: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    t: float,
    target: torch.Tensor,
    weights: torch.Tensor,
    max_guidance: torch.Tensor,
) -> torch.Tensor:
    """The guided velocity ``u'`` of the noisy chunk ``x`` [B, H, D] at noise level ``t``.

    ``velocity(x)`` is the model's (differentiable) velocity; ``target`` [B, H, D] the leftover actions
    in model space, ``weights`` [B, H] the soft mask and ``max_guidance`` [B] the clip, per row."""
    with torch.enable_grad():
        xg = x.detach().float().requires_grad_(True)
        u = velocity(xg).float()
        x0 = xg - t * u
        err = (target.float() - x0) * weights.float()[..., None]
        (g,) = torch.autograd.grad(x0, xg, grad_outputs=err)
    w = guidance_weight(t, max_guidance.float().to(x.device))
    return u.detach() - w[:, None, None] * g


def held(delay: torch.Tensor, horizon: int, device: torch.device) -> torch.Tensor:
    """[B, horizon] bool: each row's first ``delay[b]`` actions (those committed before it arrives)."""
    return torch.arange(horizon, device=device)[None, :] < delay.to(device)[:, None]


def committed(x: torch.Tensor, target: torch.Tensor, delay: torch.Tensor) -> torch.Tensor:
    """The sampled chunk ``x`` [B, H, D] with each row's first ``delay[b]`` actions replaced by the
    target's: those run before the chunk arrives, so the chunk states them as they are executed."""
    return torch.where(held(delay, x.shape[1], x.device)[..., None], target.to(x.dtype), x)


def request_rows(
    leftovers: list[np.ndarray | None],
    delays: list[int],
    horizon: int,
    dim: int,
    schedule: str = "exp",
    max_guidance: float = MAX_GUIDANCE,
) -> dict[str, np.ndarray]:
    """The ``rtc`` input of ``predict`` for B rows: row b's leftover [K_b, dim] (model space; None: not
    guided) padded to ``horizon``, its soft mask, delay and clip."""
    b = len(leftovers)
    actions = np.zeros((b, horizon, dim), np.float32)
    weights = np.zeros((b, horizon), np.float32)
    delay = np.zeros(b, np.int64)
    for i, (left, d) in enumerate(zip(leftovers, delays)):
        if left is None:
            continue
        actions[i, : len(left)] = left
        weights[i] = soft_mask(horizon, len(left), d, schedule)
        delay[i] = d
    return {
        "actions": actions,
        "weights": weights,
        "delay": delay,
        "max_guidance": np.full(b, max_guidance, np.float32),
    }


def guide_input(rtc: dict | None, mode: str, b: int, chunk: int, dim: int, device: torch.device):
    """A model's checked ``rtc`` input (:func:`request_rows`: actions [B, chunk, dim] model space, weights
    [B, chunk], delay [B], max_guidance [B]) as float32 tensors on ``device``; None when absent or when
    no row is guided."""
    if rtc is None:
        return None
    if mode != "policy":
        raise ValueError(f"rtc guides the policy's chunk; mode {mode!r} has none to guide")
    want = {"actions": (b, chunk, dim), "weights": (b, chunk), "delay": (b,), "max_guidance": (b,)}
    out = {}
    for key, shape in want.items():
        if key not in rtc or tuple(np.shape(rtc[key])) != shape:
            raise ValueError(f"rtc.{key}: expected shape {list(shape)}, got {list(np.shape(rtc.get(key)))}")
        value = rtc[key]
        out[key] = (value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))).to(
            device, torch.float32
        )
    return out if bool((out["weights"] != 0).any()) else None
