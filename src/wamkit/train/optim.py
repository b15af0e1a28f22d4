"""Optimiser, learning-rate schedule and power EMA of the trained weights.

The schedule is a pure function of the step (no hidden state), so resuming needs only the step count.
"""

from __future__ import annotations

import math

import torch

from wamkit.models.base import ParamGroup
from wamkit.train.offload import HostAdamW, PinnedArena, host_like, local, stream_update


def lr_factor(step: int, schedule: str, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based).

    Linear warmup from ``1/warmup_steps`` to 1 over ``warmup_steps`` steps, then ``constant``, linear decay
    (``lambda_linear``) or half-cosine (``cosine``) down to ``min_lr_ratio`` at ``max_steps``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(max_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if schedule == "lambda_linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if schedule == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule: {schedule!r} is unknown; expected constant, lambda_linear or cosine")


def build_optimizer(
    groups: list[ParamGroup],
    lr: float,
    weight_decay: float,
    betas: list[float],
    fused: bool = False,
    host_device: torch.device | None = None,
) -> torch.optim.AdamW:
    """AdamW with one torch param group per :class:`ParamGroup`.

    Each torch group keeps ``base_lr = lr * lr_mult`` so the schedule can scale it; groups with
    ``weight_decay=False`` (norms, biases, embeddings by the adapter's choice) get zero decay. Frozen
    parameters (``requires_grad=False``) are refused: they must never enter the optimizer.
    ``fused`` (CUDA): one kernel for all parameters of a group instead of a chain of per-tensor ops
    dispatched through DTensor, the largest cost of a step after forward and backward.
    ``host_device``: the moments live in host memory and stream through this device at each step
    (:class:`wamkit.train.offload.HostAdamW`, ``train.offload=optimizer``).
    """
    torch_groups, seen = [], set()
    for g in groups:
        params = list(g.params)
        for p in params:
            if not p.requires_grad:
                raise ValueError(f"param group '{g.name}' holds a frozen parameter (requires_grad=False)")
            if id(p) in seen:
                raise ValueError(f"param group '{g.name}' repeats a parameter of an earlier group")
            seen.add(id(p))
        if not params:
            continue
        torch_groups.append(
            {
                "params": params,
                "name": g.name,
                "lr": lr * g.lr_mult,
                "base_lr": lr * g.lr_mult,
                "weight_decay": weight_decay if g.weight_decay else 0.0,
            }
        )
    if not torch_groups:
        raise ValueError("the model has no trainable parameters (every param group is empty)")
    if len(betas) != 2:
        raise ValueError(f"train.betas: expected two numbers, got {betas}")
    kind = {"fused": True} if fused else {}  # fused is CUDA-only; the CPU keeps torch's default
    if host_device is not None:
        return HostAdamW(
            torch_groups, device=host_device, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **kind
        )
    return torch.optim.AdamW(torch_groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay, **kind)


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> float:
    """Scale every group's ``base_lr`` by ``factor``; return the first group's learning rate."""
    for g in optimizer.param_groups:
        g["lr"] = g["base_lr"] * factor
    return optimizer.param_groups[0]["lr"]


def edm2_gamma(sigma_rel: float) -> float:
    """The exponent of EDM2's power-function EMA for a relative width ``sigma_rel`` (Karras et al. 2024,
    eq. 3: ``sigma_rel = sqrt((g + 1) / ((g + 2)^2 (g + 3)))``), by bisection (it falls as g grows)."""
    if not 0.0 < sigma_rel < 0.5:
        raise ValueError(f"train.ema_rate: expected a relative width in (0, 0.5), got {sigma_rel}")

    def width(g: float) -> float:
        return math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3)))

    lo, hi = -0.999, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if width(mid) > sigma_rel else (lo, mid)
    return (lo + hi) / 2


def ema_decay(step: int, kind: str, power: float, rate: float) -> float:
    """Decay of the EMA update after optimizer step ``step`` (0-based; t = step + 1 steps taken).

    - ``inverse_power``: ``1 - t ** -power`` (``train.ema_power``);
    - ``edm2``: EDM2's power function ``(1 - 1/t) ** (gamma + 1)``, gamma from the relative width
      ``train.ema_rate`` (cosmos' robot SFT recipe: 0.1, gamma = 6.94). Both start by copying the weights.
    """
    t = step + 1
    if kind == "inverse_power":
        return 1.0 - t**-power
    if kind == "edm2":
        return (1.0 - 1.0 / t) ** (edm2_gamma(rate) + 1.0)
    raise ValueError(f"train.ema_type: {kind!r} is unknown; expected inverse_power or edm2")


class PowerEMA:
    """Exponential moving average of the trained weights with a power-law decay (:func:`ema_decay`).

    Early steps average with a small decay (the EMA follows the weights quickly), later ones approach 1.
    Shadows are kept in fp32 with the parameters' own layout (DTensor shards under FSDP2), so the EMA is
    sharded like the model and saved by DCP alongside it. Only trained parameters have one: a frozen
    parameter's EMA is the parameter itself. ``device`` given: the shadows live in host memory and each
    update streams them through that device (``train.offload``, :mod:`wamkit.train.offload`), with the
    same ``_foreach_lerp_`` as on the device.
    """

    def __init__(self, named_params: dict[str, torch.nn.Parameter], power: float, kind: str = "inverse_power",
                 rate: float = 0.1, device: torch.device | None = None):  # fmt: skip
        if power <= 0:
            raise ValueError(f"train.ema_power: expected a positive number, got {power}")
        ema_decay(0, kind, power, rate)  # refuse a bad kind or rate now, not at the first step
        self.power, self.kind, self.rate = power, kind, rate
        self.params = named_params
        self.device = device
        if device is None:
            self.shadow = {k: p.detach().clone().float() for k, p in named_params.items()}
        else:
            self.shadow = {}
            arena = PinnedArena()
            for k, p in named_params.items():
                h = host_like(p, arena=arena)
                local(h).copy_(local(p.detach()))
                self.shadow[k] = h

    @property
    def on_host(self) -> bool:
        return self.device is not None

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = ema_decay(step, self.kind, self.power, self.rate)
        names = list(self.params)
        if self.device is None:
            current = [self.params[k].detach().float() for k in names]
            torch._foreach_lerp_([self.shadow[k] for k in names], current, 1.0 - decay)  # one launch chain
            return

        def lerp(idx, copies):
            current = [local(self.params[names[i]].detach()).float() for i in idx]
            torch._foreach_lerp_([c[0] for c in copies], current, 1.0 - decay)

        stream_update([[self.shadow[k]] for k in names], self.device, lerp)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.shadow

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            self.shadow[k].copy_(v)
