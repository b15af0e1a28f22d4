"""The Cosmos3 sampler against diffusers' UniPCMultistepScheduler, one scheduler per tensor as
Cosmos3OmniPipeline runs them, on random model outputs (fp32, CPU): bit-identical where the config is
reproduced, diffusers itself where it is not; and the initial noise of a batch, request by request."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.models.cosmos3.inference import Cosmos3Inference, Prepared  # noqa: E402
from wamkit.models.cosmos3.recipe import native_sigmas, sampling_scheduler  # noqa: E402
from wamkit.models.cosmos3.sampler import DiffusersUniPC, UniPC, unipc_sampler  # noqa: E402

SHAPES = [(3, 8, 5, 4, 6), (3, 16, 10)]  # vision latents [B, C, T, h, w] and actions [B, chunk, D]


def run(sampler, samples, outputs):
    """Every step's samples, given each step's model outputs."""
    xs = []
    for t, vs in zip(sampler.timesteps, outputs):
        xs.append([x.clone() for x in sampler.step(t, vs)])
    assert len(xs) == len(outputs) and len(sampler.timesteps) == len(outputs)
    return xs


def reference(scheduler, sigmas, samples, outputs):
    """Two diffusers schedulers, stepped as the pipeline steps them."""
    sch = copy.deepcopy(scheduler)
    sch.set_timesteps(sigmas=sigmas)
    schedulers = [copy.deepcopy(sch) for _ in samples]
    xs, x = [], list(samples)
    for t, vs in zip(sch.timesteps, outputs):
        x = [s.step(v, t, xi, return_dict=False)[0] for s, v, xi in zip(schedulers, vs, x)]
        xs.append(x)
    return sch.timesteps, xs


def draws(steps: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randn(s, generator=g, dtype=dtype) for s in SHAPES]
    outputs = [[torch.randn(s, generator=g, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    return samples, outputs


def changed(change: dict):
    """Our scheduler with some config changed (diffusers would reset keys named in _use_default_values)."""
    cfg = {k: v for k, v in sampling_scheduler(None, 5.0).config.items() if not k.startswith("_")}
    scheduler = type(sampling_scheduler(None, 5.0)).from_config({**cfg, **change})
    assert all(scheduler.config[k] == v for k, v in change.items())
    return scheduler


def ours_vs_diffusers(scheduler, steps, dtype=torch.float32, device="cpu"):
    sigmas = native_sigmas(scheduler, steps)
    samples, outputs = draws(steps, dtype=dtype)
    samples, outputs = [x.to(device) for x in samples], [[v.to(device) for v in vs] for vs in outputs]
    sampler = unipc_sampler(scheduler, sigmas, torch.device(device), samples)
    got = run(sampler, samples, outputs)
    timesteps, want = reference(scheduler, sigmas, samples, outputs)
    np.testing.assert_array_equal(sampler.timesteps.cpu().numpy(), timesteps.cpu().numpy())
    for k, (a, b) in enumerate(zip(got, want)):
        for x, y, shape in zip(a, b, SHAPES):
            assert x.shape == shape and x.device == y.device
            np.testing.assert_array_equal(x.cpu().numpy(), y.cpu().numpy(), err_msg=f"step {k}")
    return sampler


@pytest.mark.parametrize("steps", [1, 2, 3, 30])
def test_our_config_is_diffusers_bit_for_bit(steps):
    """The scheduler our adapter samples with (recipe.sampling_scheduler): UniPC order 2, bh2, flow
    sigmas shifted by 5, lower-order final steps."""
    scheduler = sampling_scheduler(None, 5.0)
    assert isinstance(ours_vs_diffusers(scheduler, steps), UniPC)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_our_config_is_diffusers_bit_for_bit_on_cuda():
    """The coefficients computed on the GPU, the timesteps copied there without a wait."""
    assert isinstance(ours_vs_diffusers(sampling_scheduler(None, 5.0), 30, device="cuda"), UniPC)


@pytest.mark.parametrize(
    "change",
    [
        {"solver_order": 1},
        {"disable_corrector": [0, 4]},
        {"flow_shift": 3.0, "num_train_timesteps": 500},
        {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
        {"lower_order_final": False},  # a second-order last step to sigma 0: infinite, as in diffusers
    ],
)
def test_other_reproduced_configs_are_diffusers_bit_for_bit(change):
    with np.errstate(invalid="ignore"):
        assert isinstance(ours_vs_diffusers(changed(change), 12), UniPC)


@pytest.mark.parametrize(
    "change",
    [
        {"thresholding": True, "sample_max_value": 1.5},  # per sample: not element-wise
        {"solver_order": 3},
        {"solver_type": "bh1"},  # diffusers' last step is NaN (inf * 0)
        {"prediction_type": "epsilon"},
        {"predict_x0": False, "prediction_type": "epsilon"},
    ],
)
def test_configs_not_reproduced_fall_back_to_diffusers(change):
    # the fallback is diffusers itself, so the comparison holds by construction: the choice is the test
    assert isinstance(ours_vs_diffusers(changed(change), 6), DiffusersUniPC)


def test_samples_other_than_float32_fall_back_to_diffusers():
    assert isinstance(ours_vs_diffusers(sampling_scheduler(None, 5.0), 4, torch.float64), DiffusersUniPC)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_step_is_element_wise_work_only():
    """No host read, no copy, no solve per step: nothing that makes a GPU wait for the host."""
    samples, outputs = draws(5)
    scheduler = sampling_scheduler(None, 5.0)
    sampler = unipc_sampler(scheduler, native_sigmas(scheduler, 5), torch.device("cpu"), samples)
    steps = list(zip(sampler.timesteps, outputs))
    sampler.step(*steps[0])
    with Ops() as ops:
        for t, vs in steps[1:]:
            sampler.step(t, vs)
    assert ops.names <= {"mul", "sub", "div", "add", "cat", "view", "split_with_sizes", "narrow"}, ops.names


def test_the_noise_of_request_i_is_drawn_from_seed_plus_i():
    """As Cosmos3OmniPipeline draws one request's noise (vision latents, then actions), whatever else
    is in the batch; given actions and the held-frame masks come along."""
    host = SimpleNamespace(device=torch.device("cpu"))
    acts = torch.randn(3, 16, 10)
    prep = Prepared(torch.zeros(3, 8, 1, 4, 6), (0, 2), acts, (1,), velocity=None)
    noise_v, noise_a, act, cond_v, cond_a = Cosmos3Inference._draw(host, [5, 6, 7], (3, 8, 5, 4, 6), prep)
    for i in range(3):
        g = torch.Generator("cpu").manual_seed(5 + i)
        assert torch.equal(noise_v[i : i + 1], torch.randn((1, 8, 5, 4, 6), generator=g))
        assert torch.equal(noise_a[i], torch.randn((16, 10), generator=g))
    assert torch.equal(act, acts)
    assert cond_v.flatten().tolist() == [1, 0, 1, 0, 0] and cond_v.shape == (5, 1, 1)
    assert cond_a.flatten().tolist() == [0, 1] + [0] * 14 and cond_a.shape == (16, 1)


@pytest.mark.parametrize("steps", [1, 4, 30])
def test_the_euler_option_is_diffusers_flow_euler_step(steps):
    """``model.options.sampler=euler``: on the recipe's shifted sigmas, the plain flow step of diffusers'
    ``FlowMatchEulerDiscreteScheduler`` (given the same sigmas, no shift of its own): samples equal to
    float32 rounding of the step width. The model is given UniPC's timesteps (sigma x N cut to an
    integer, as under the recipe's sampler), each within one of the Euler scheduler's float ones."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from wamkit.models.cosmos3.sampler import EulerFlow, flow_sampler

    sch = sampling_scheduler(None, 5.0)
    sigmas = native_sigmas(sch, steps)
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    ours = flow_sampler("euler", sch, sigmas, torch.device("cpu"), [x.clone()])
    assert isinstance(ours, EulerFlow) and len(ours.timesteps) == steps
    ref = FlowMatchEulerDiscreteScheduler(num_train_timesteps=sch.config.num_train_timesteps, shift=1.0)
    ref.set_timesteps(sigmas=ours._sigmas[:-1])
    gap = ref.timesteps.float() - ours.timesteps.float()
    assert ours.timesteps.dtype == torch.int64 and bool(((gap >= 0) & (gap < 1)).all()), gap
    a, b = x.clone(), x.clone()
    for k, t in enumerate(ours.timesteps):
        (a,) = ours.step(t, [torch.sin(a * (k + 1))])
        b = ref.step(torch.sin(b * (k + 1)), ref.timesteps[k], b, return_dict=False)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.allclose(a, x)  # it moved
