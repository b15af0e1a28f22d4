"""UniPC sampling of several tensors at once, with no host wait per step.

diffusers' ``UniPCMultistepScheduler.step`` (``scheduling_unipc_multistep.py``, 0.42) derives each step's
coefficients from the sigmas anew, as 0-dim tensors: it copies sigmas from the host (``.to(device)``,
a copy that waits for the device), runs ~120 tiny kernels and, in the corrector, a ``linalg.solve``.
On a GPU the device idles while the host does this, once per tensor and step. Those coefficients
depend only on the sigma schedule and the config; the tensor work is, for data prediction
(``predict_x0``) of flow velocities ``v`` without thresholding and with at most one older output
(``solver_order`` <= 2), for step k with sample ``x``::

    m   = x - sigma_k v                                               (convert_model_output)
    x   = ratio' last - a_phi' m0 - a_bh' (rho' D1 + rho_t' (m - m0)) (corrector, k > 0)
    out = ratio x - a_phi m - a_bh rho D1                             (predictor)

with ``m0`` the previous converted output and ``D1 = (m_older - m0) / rk`` (absent at order 1). Every
operation is element-wise, so one update over the concatenated tensors is each tensor's own update.

:class:`UniPC` computes the coefficients with diffusers' own scalar expressions, on the same device,
once per schedule (cached), and then performs only the tensor operations, in diffusers' order: the
results are bit-identical to one diffusers scheduler per tensor (tests/test_cosmos3_sampler.py).
Any other config (thresholding is per sample, ``solver_p``, order 3, epsilon prediction, ...) gets
:class:`DiffusersUniPC`, which is that reference. :func:`unipc_sampler` chooses.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

from wamkit.device import to_device

Tensor = torch.Tensor


def exact(scheduler: UniPCMultistepScheduler) -> bool:
    """True when :class:`UniPC` reproduces this scheduler's ``step`` exactly (the module doc's case)."""
    cfg = scheduler.config
    return (
        cfg.prediction_type == "flow_prediction"
        and bool(cfg.use_flow_sigmas)
        and bool(scheduler.predict_x0)
        and not cfg.thresholding
        and scheduler.solver_p is None
        and cfg.solver_order in (1, 2)
        and cfg.solver_type == "bh2"  # bh1's last step is NaN in diffusers (inf * 0): not copied
    )


class EulerFlow:
    """The plain flow step on the scheduler's shifted sigmas: ``x + (sigma_next - sigma) v`` per tensor
    (diffusers' ``FlowMatchEulerDiscreteScheduler.step`` without stochastic sampling; its ``timesteps``
    are ``sigma * num_train_timesteps``, as UniPC's are, and the last step goes to sigma 0)."""

    def __init__(self, scheduler: UniPCMultistepScheduler, sigmas: np.ndarray, samples: Sequence[Tensor]):
        sch = copy.deepcopy(scheduler)
        sch.set_timesteps(sigmas=sigmas)  # applies the flow shift, appends the final sigma 0
        self.timesteps = sch.timesteps
        self._sigmas = [float(s) for s in sch.sigmas]
        self._x = list(samples)
        self._k = 0

    def step(self, t: Tensor, outputs: Sequence[Tensor]) -> list[Tensor]:
        dt = self._sigmas[self._k + 1] - self._sigmas[self._k]
        self._k += 1
        self._x = [x + dt * v for x, v in zip(self._x, outputs)]
        return list(self._x)


def flow_sampler(
    kind: str,
    scheduler: UniPCMultistepScheduler,
    sigmas: np.ndarray,
    device: torch.device,
    samples: Sequence[Tensor],
) -> UniPC | DiffusersUniPC | EulerFlow:
    """``model.options.sampler``: ``unipc`` (:func:`unipc_sampler`) or ``euler`` (:class:`EulerFlow`)."""
    if kind == "euler":
        return EulerFlow(scheduler, sigmas, samples)
    return unipc_sampler(scheduler, sigmas, device, samples)


def unipc_sampler(
    scheduler: UniPCMultistepScheduler, sigmas: np.ndarray, device: torch.device, samples: Sequence[Tensor]
) -> UniPC | DiffusersUniPC:
    """A sampler of ``samples`` (float32 tensors on ``device``) on ``scheduler``'s config and these
    sigmas (``set_timesteps(sigmas=...)``); ``scheduler`` itself is left as it is."""
    sch = copy.deepcopy(scheduler)
    if exact(sch) and all(s.dtype == torch.float32 for s in samples):
        sch.set_timesteps(sigmas=sigmas)  # timesteps on the host: copied without a wait below
        # diffusers starts at the timestep's index, the second one of a repeated first timestep
        if sch.index_for_timestep(sch.timesteps[0]) == 0:
            return UniPC(sch, samples, device)
    sch.set_timesteps(device=device, sigmas=sigmas)
    return DiffusersUniPC(sch, samples)


class DiffusersUniPC:
    """The reference: one diffusers scheduler per tensor, as ``Cosmos3OmniPipeline`` runs them."""

    def __init__(self, scheduler: UniPCMultistepScheduler, samples: Sequence[Tensor]):
        self.timesteps = scheduler.timesteps
        self._schedulers = [copy.deepcopy(scheduler) for _ in samples]
        self._x = list(samples)

    def step(self, t: Tensor, outputs: Sequence[Tensor]) -> list[Tensor]:
        """The samples after the step at timestep ``t`` with these model outputs (one per sample)."""
        self._x = [
            s.step(v, t, x, return_dict=False)[0] for s, v, x in zip(self._schedulers, outputs, self._x)
        ]
        return list(self._x)


@dataclass(frozen=True)
class _Update:
    """One UniP (predictor) or UniC (corrector) update; 0-dim tensors on the samples' device, named
    after diffusers' expressions."""

    ratio: Tensor  # sigma_t / sigma_s0
    a_phi: Tensor  # alpha_t * h_phi_1
    a_bh: Tensor  # alpha_t * B_h
    rk: Tensor | None  # the older output's (lambda_s1 - lambda_s0) / h; None at order 1
    rho: Tensor | None  # rhos_p[0] (predictor) or rhos_c[0] (corrector), the weight of D1
    rho_t: Tensor | None  # rhos_c[-1], the weight of the new output (corrector only)

    def predict(self, x: Tensor, m0: Tensor, older: Tensor | None) -> Tensor:
        out = self.ratio * x - self.a_phi * m0
        if self.rk is None:
            return out  # diffusers subtracts a_bh * 0 here (changes only the sign of a zero)
        return out - self.a_bh * (self.rho * ((older - m0) / self.rk))

    def correct(self, last: Tensor, m0: Tensor, older: Tensor | None, m: Tensor) -> Tensor:
        out = self.ratio * last - self.a_phi * m0
        new = self.rho_t * (m - m0)
        if self.rk is not None:  # diffusers' einsum over one older output is this one product
            new = self.rho * ((older - m0) / self.rk) + new
        return out - self.a_bh * new


def _update(sig: Tensor, t: int, s0: int, s1: int, order: int, corrector: bool) -> _Update:
    """diffusers' scalar code of ``multistep_uni_{p,c}_bh_update`` (flow sigmas, predict_x0, bh2): update
    from sigma index ``s0`` to ``t``, with the older output at ``s1``. Same operations, same order."""
    device = sig.device
    alpha_t, sigma_t = 1 - sig[t], sig[t]
    alpha_s0, sigma_s0 = 1 - sig[s0], sig[s0]
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    h = lambda_t - lambda_s0
    rks = []
    if order == 2:
        alpha_s1, sigma_s1 = 1 - sig[s1], sig[s1]
        lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
        rks.append((lambda_s1 - lambda_s0) / h)
    rk = rks[0] if rks else None
    rks.append(torch.ones((), device=device))
    rks = torch.stack(rks)
    hh = -h
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    factorial_i = 1
    B_h = torch.expm1(hh)
    R, b = [], []
    for i in range(1, order + 1):
        R.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * factorial_i / B_h)
        factorial_i *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial_i
    half = torch.ones(1, dtype=torch.float32, device=device) * 0.5
    rho = rho_t = None
    if corrector:
        rhos_c = half if order == 1 else torch.linalg.solve(torch.stack(R), torch.stack(b)).to(torch.float32)
        rho, rho_t = (rhos_c[0] if order == 2 else None), rhos_c[-1]
    elif order == 2:
        rho = half[0]
    return _Update(sigma_t / sigma_s0, alpha_t * h_phi_1, alpha_t * B_h, rk, rho, rho_t)


@dataclass(frozen=True)
class _Step:
    sigma: Tensor  # 0-dim, on the host, as convert_model_output reads it
    corrector: _Update | None
    predictor: _Update


@functools.lru_cache(maxsize=16)
def _plan(
    sigmas: bytes,
    solver_order: int,
    lower_order_final: bool,
    disabled: tuple,
    device: torch.device,
) -> tuple[_Step, ...]:
    """Each step's coefficients: diffusers' ``step`` bookkeeping (warm-up orders, lower-order final
    steps, disabled correctors) on float32 ``sigmas`` (n steps + the final sigma)."""
    host = torch.frombuffer(bytearray(sigmas), dtype=torch.float32)
    sig = host.to(device)
    n = host.numel() - 1
    orders, lower = [], 0
    for k in range(n):
        order = min(solver_order, n - k) if lower_order_final else solver_order
        orders.append(min(order, lower + 1))
        lower = min(lower + 1, solver_order)
    steps = []
    for k in range(n):
        corr = None
        if k > 0 and k - 1 not in disabled:
            corr = _update(sig, k, k - 1, k - 2, orders[k - 1], True)
        steps.append(_Step(host[k], corr, _update(sig, k + 1, k, k - 1, orders[k], False)))
    return tuple(steps)


class UniPC:
    """diffusers' UniPC ``step`` over several float32 tensors at once (the module doc): one update of
    their concatenation, the coefficients computed once per schedule, no host wait."""

    def __init__(self, scheduler: UniPCMultistepScheduler, samples: Sequence[Tensor], device: torch.device):
        cfg = scheduler.config
        self.timesteps = to_device(scheduler.timesteps, device)
        device = self.timesteps.device
        disabled = tuple(sorted(int(i) for i in scheduler.disable_corrector))
        sigmas = scheduler.sigmas.to(torch.float32).numpy().tobytes()
        self._plan = _plan(sigmas, cfg.solver_order, bool(cfg.lower_order_final), disabled, device)
        self._shapes = [s.shape for s in samples]
        self._sizes = [s.numel() for s in samples]
        self._x = torch.cat([s.reshape(-1) for s in samples])
        self._outputs: list[Tensor] = []  # the last two converted model outputs, the newest last
        self._last: Tensor | None = None  # the sample before the last predictor step
        self._k = 0

    def step(self, t: Tensor, outputs: Sequence[Tensor]) -> list[Tensor]:
        """The samples after the next step with these model outputs (one per sample, float32), as
        views of one tensor. ``t`` is this step's timestep (fixed by the schedule: unused)."""
        if any(v.dtype != torch.float32 for v in outputs):
            raise TypeError(f"UniPC steps float32 model outputs, got {[v.dtype for v in outputs]}")
        p, prev, x = self._plan[self._k], self._outputs, self._x
        m = x - p.sigma * torch.cat([v.reshape(-1) for v in outputs])
        if p.corrector is not None:
            x = p.corrector.correct(self._last, prev[-1], prev[-2] if len(prev) > 1 else None, m)
        self._outputs, self._last = [*prev[-1:], m], x  # one older output is all order 2 needs
        self._x = p.predictor.predict(x, m, prev[-1] if prev else None)
        self._k += 1
        return [y.view(s) for y, s in zip(self._x.split(self._sizes), self._shapes)]
