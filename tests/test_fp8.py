"""FP8 linear layers (serve.precision=fp8): e4m3 weights per output row, activations per row, one
torch._scaled_mm. Checked on the CPU (torch's CPU _scaled_mm), against the bf16 layer they replace."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from wamkit.config import ModelConfig
from wamkit.models import build_model
from wamkit.models.cosmos3 import DEFAULT_IO
from wamkit.models.fp8 import E4M3, Fp8Linear, quantize_linears, unsupported


def _cpu_fp8_or_skip():
    try:
        a = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(
            a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"this torch build has no CPU FP8 matmul ({err})")


def test_an_fp8_layer_is_within_e4m3_rounding_of_the_layer_it_replaces():
    """e4m3 keeps 3 mantissa bits: each operand's rounding error is uniform within 2^-4 of its value
    (rms 2^-3 / sqrt(12) = 3.6%), so the product's relative rms error is about 5% for random data;
    the bound 8% fails a wrong scale (100%+) and 0.5% fails a layer that was not quantized."""
    _cpu_fp8_or_skip()
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(256, 128, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(128, generator=g))
    x = torch.randn(3, 7, 256, generator=g).to(torch.bfloat16)
    want = lin(x).float()
    got = Fp8Linear(lin)(x)
    assert got.shape == (3, 7, 128) and got.dtype == torch.bfloat16
    err = ((got.float() - want).norm() / (want - lin.bias.float()).norm()).item()
    assert 0.005 < err < 0.08, err


def test_the_generation_towers_linears_are_quantized_and_the_rest_kept():
    _cpu_fp8_or_skip()
    ad = build_model(
        ModelConfig(name="cosmos3", preset="tiny", options={"num_inference_steps": 2}), DEFAULT_IO
    )
    und_before = ad.module.layers[0].self_attn.to_q
    n = ad.use_fp8()
    layer = ad.module.layers[0]
    per_layer = 4 + 3  # q, k, v, out; the MLP's gate, up, down
    assert n == per_layer * len(ad.module.layers)
    assert isinstance(layer.self_attn.add_q_proj, Fp8Linear) and isinstance(
        layer.mlp_moe_gen.down_proj, Fp8Linear
    )
    assert layer.self_attn.to_q is und_before and not isinstance(ad.module.proj_in, Fp8Linear)
    assert ad.compile_fields() is None  # on the CPU nothing is compiled; on CUDA the key says fp8


def test_fp8_is_refused_without_fp8_tensor_cores():
    assert "compute capability >= 8.9" in unsupported(torch.device("cpu"))
    a = nn.Linear(32, 32)
    assert (
        quantize_linears(nn.Sequential(a, nn.Linear(30, 32)), lambda name, m: True) == 1
    )  # 30: not a multiple of 16


def test_the_bench_refuses_fp8_paths_where_fp8_cannot_run():
    import argparse

    from wamkit.bench import cosmos3 as bench

    for path in ("fast+compile+fp8", "fast+compile+fp8_torchao"):
        with pytest.raises(SystemExit, match=re.escape(f"--paths {path}: FP8 needs a CUDA GPU")):
            bench._paths(argparse.Namespace(paths=f"fast,{path}"), torch.device("cpu"))


def test_the_torchao_backend_says_what_is_missing(monkeypatch):
    import sys

    from wamkit.models.fp8 import quantize_linears_torchao

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(RuntimeError, match="FP8 through torchao needs the torchao package"):
        quantize_linears_torchao(nn.Sequential(nn.Linear(32, 32)))


@pytest.mark.parametrize("dtype, autocast", [("bfloat16", None), ("float32", torch.bfloat16)])
def test_served_fp8_autocasts_only_fp32_weights_and_caches_no_casts(monkeypatch, dtype, autocast):
    """Served FP8 runs the rest of the model as ``auto`` would: bf16 weights as they are (Cosmos3's
    bf16 build keeps its time embedder in fp32, trainable: an autocast around it would cache bf16
    copies, freed when the context exits, under a CUDA graph captured inside it), fp32 weights under
    bf16 autocast with the cast cache off."""
    from wamkit.models import fp8
    from wamkit.serve.loading import identity_spec
    from wamkit.serve.policy import ServedPolicy

    monkeypatch.setattr(fp8, "unsupported", lambda device: "")  # as on a GPU with FP8 tensor cores
    ad = build_model(
        ModelConfig(name="cosmos3", preset="tiny", options={"num_inference_steps": 2, "dtype": dtype}),
        DEFAULT_IO,
    )
    assert any(p.dtype == torch.float32 for p in ad.module.parameters())  # the time embedder
    policy = ServedPolicy(ad, identity_spec(ad.io), precision="fp8")
    assert ad.fp8 and policy.autocast is autocast
    assert policy.identity()["autocast"] == "fp8"
    with policy.compute():
        assert torch.is_autocast_enabled("cpu") is (autocast is not None)
        if autocast is not None:
            assert not torch.is_autocast_cache_enabled()
