"""LoRA over an int8 base (``train.lora.base=int8``, wamkit.train.lora.quantize_base) on the tiny Cosmos3:
the adapted layers' frozen weights are torchao's weight-only int8, one byte a weight and a scale and a
zero point per output row; the adapters learn through them; a run killed with SIGKILL resumes to the
uninterrupted run's losses and weights, bit for bit; `wamkit convert` merges the adapters into the int8
weights dequantized, the model the run trained; a bad base, or a resume in another format, is refused
naming the key.

Tolerances, from the format: per output row, ``q = round(W / s)`` with ``s = max|W_row| / 127.5``, so each
dequantized weight ``q s`` is within ``s / 2`` of ``W``: at most 1/255 of the row's largest weight
(the largest itself, 127.5 steps, is clamped to 127). Not bit-equal to the unquantized base, and not far from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")
pytest.importorskip("peft", reason="train.lora needs peft (the wamkit[cosmos3] extra)")
pytest.importorskip("torchao", reason="train.lora.base=int8 needs torchao (the wamkit[lora-int8] extra)")

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from wamkit.config import ConfigError, LoraConfig, load_config  # noqa: E402
from wamkit.data.synthetic import write_pattern_dataset  # noqa: E402
from wamkit.models.cosmos3.latents import LATENTS  # noqa: E402
from wamkit.models.cosmos3.towers import param_role  # noqa: E402
from wamkit.train import lora  # noqa: E402
from wamkit.train.loop import train  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

from .test_cosmos3_lora import (  # noqa: E402
    CHAIN,
    CONFIG,
    _cfg,
    _keys,
    _loss,
    _tiny,
    resume_after_sigkill,
    two_observations,
)
from .test_cosmos3_train import fixture_batch  # noqa: E402

INT8 = "train.lora.base=int8"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_pattern_dataset(tmp_path_factory.mktemp("lora_int8") / "ds", [5, 4], camera_dtype="image")


def test_int8_base_holds_a_byte_a_weight_within_half_a_step_and_the_adapters_learn_through_it():
    """In process, on a fixed batch: each adapted layer's base is int8 values plus an fp32 scale and
    an int8 zero point per output row, within s / 2 of the fp32 weight; the
    model's loss moves, a little; backward reaches the adapters through the int8 base, the loss falls,
    and the int8 weights do not change."""
    torch.set_num_threads(2)
    batch = fixture_batch([90])
    adapter = _tiny()
    with torch.no_grad():
        batch[LATENTS] = adapter.encode_clips(batch)
    plain = {n: p.detach().clone() for n, p in adapter.module.named_parameters()}
    base_loss = _loss(adapter, batch)
    spec = lora.resolve(LoraConfig(rank=4, alpha=8.0, base="int8"), adapter)
    assert spec.base == "int8" and spec.to_meta()["base"] == "int8"
    applied = lora.inject(adapter, spec, seed=0)
    weights = lora.quantize_base(adapter.module, spec)
    assert len(weights) == len(spec.targets)
    for t in spec.targets:
        w = adapter.module.get_submodule(t).get_base_layer().weight
        out, inp = w.shape
        assert w.qdata.dtype == torch.int8 and not w.requires_grad
        # the format's bytes: a byte a weight, per row an fp32 scale and an int8 zero point
        assert lora.stored_bytes(w) == out * inp + out * (4 + 1), t
        assert lora.stored_bytes(plain[f"{t}.weight"]) == 4 * out * inp
        assert not w.zero_point.any()  # symmetric
        ref = plain[f"{t}.weight"]
        s = ref.abs().amax(dim=1, keepdim=True) / 127.5  # the int8 range [-128, 127] over the row
        torch.testing.assert_close(w.scale.reshape(s.shape), s, rtol=2**-22, atol=0)  # a divide's rounding
        err = (w.dequantize() - ref).abs()
        # half a step, plus the fp32 roundings of W / s and of q s, values up to 128: 2^-17 s each
        assert (err <= s * (0.5 + 2**-16)).all(), t
        assert err.max() > 0  # quantized indeed: not the fp32 weight
    quantized_loss = _loss(adapter, batch)
    # 28 layers of weights each moved by up to 1/255 of its row's largest weight, in random directions:
    # the loss moves well inside 1% (0.07% measured), but it moves
    assert quantized_loss != base_loss
    assert abs(float(quantized_loss) - float(base_loss)) < 0.01 * float(base_loss)

    before = {n: p.detach().clone() for n, p in adapter.module.named_parameters() if ".base_layer." in n}
    opt = torch.optim.AdamW([{"params": g.params, "lr": 5e-3 if g.name == "action_heads" else 3e-2}
                             for g in applied.groups])  # fmt: skip
    for step in range(3):
        torch.manual_seed(step)
        opt.zero_grad()
        adapter.sft_loss(batch)["loss"].backward()
        grads = [p.grad for g in applied.groups if g.name == "lora" for p in g.params]
        assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
        opt.step()
    after = _loss(adapter, batch)
    assert after < 0.9 * quantized_loss, (quantized_loss, after)
    for n, p in adapter.module.named_parameters():
        if n in before:
            assert torch.equal(p.qdata, before[n].qdata) and torch.equal(p.scale, before[n].scale), n


def test_bad_base_is_refused_naming_the_key(data, tmp_path):
    with pytest.raises(ConfigError, match=r"train.lora.base: expected one of bf16, int8, got 'int4'"):
        _cfg(data, tmp_path / "x", "train.lora.base=int4")
    with pytest.raises(ConfigError, match=r"train.lora.base=int8 is set but train.lora.rank=0"):
        load_config(CONFIG, [INT8])
    # a random preset but tiny keeps its frozen weights in its checkpoints: they would hold the int8 ones
    with pytest.raises(ConfigError, match=r"train.lora.base=int8: cosmos3 preset 'mini' names no base"):
        train(_cfg(data, tmp_path / "mini", "model.preset=mini", INT8))


@pytest.mark.slow
def test_an_int8_run_trains_saves_adapters_refuses_another_base_and_converts_what_it_trained(data, tmp_path):
    from wamkit.cli import main
    from wamkit.serve.loading import load_served

    torch.set_num_threads(2)
    run = train(_cfg(data, tmp_path / "run", "train.max_steps=4", INT8))
    ref = train(_cfg(data, tmp_path / "ref", "train.max_steps=1"))
    # step 1 (before any update): the int8 base's loss near the fp32 base's, not equal (see the module)
    got, want = read_losses(run)[0]["loss"], read_losses(ref)[0]["loss"]
    assert got != want and abs(got - want) < 0.01 * want
    ckpt = run / "checkpoints" / "step_000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["base"] == "int8" and meta["base"]["whole"] is True
    model = {k.removeprefix("model.") for k in _keys(ckpt) if k.startswith("model.")}
    heads = {n for n, _ in _tiny().module.named_parameters() if param_role(n) == "action_heads"}
    adapters = {f"{t}.lora_{m}.default.weight" for t in meta["lora"]["targets"] for m in "AB"}
    assert model == heads | adapters  # no base weight, int8 or not

    with pytest.raises(ConfigError, match=r"train.lora.base is bf16 in this run but int8 in the checkpoint"):
        train(_cfg(data, run, "train.max_steps=6", "train.resume=auto"))

    assert main(["convert", str(run), "--out", str(tmp_path / "serve")]) == 0
    served = load_served(tmp_path / "serve", device="cpu").adapter
    got_w = served.module.state_dict()
    assert set(got_w) == set(_tiny().module.state_dict())  # a plain model, fp32: no int8, no peft

    # the run's model unmerged: the checkpoint's adapters on the int8 base, as training computed it
    unmerged = _tiny()
    spec = lora.LoraSpec.from_meta(meta["lora"])
    lora.inject(unmerged, spec)
    lora.quantize_base(unmerged.module, spec)
    dcp_to_torch_save(ckpt, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    result = unmerged.module.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    for t in spec.targets:  # merged into the dequantized int8 weight: one rounding of an r-term sum
        base = unmerged.module.get_submodule(t).get_base_layer().weight.dequantize()
        a, b = state[f"{t}.lora_A.default.weight"], state[f"{t}.lora_B.default.weight"]
        want_w = base.double() + spec.alpha / spec.rank * (b.double() @ a.double())
        assert_rounding_close(got_w[f"{t}.weight"], want_w, length=spec.rank + 1)
    unmerged.module.eval()
    io = served.io
    obs = two_observations(io)
    have = served.predict(obs, seed=0)["actions"]
    want_a = unmerged.predict(obs, seed=0)["actions"]
    steps = int(served.options.num_inference_steps)
    # torchao's int8 matmul scales after the product (x q^T) s, the merged layer before: x (q s)^T, one
    # more rounding per product, within each velocity's CHAIN-term bound
    assert_rounding_close(torch.as_tensor(have), torch.as_tensor(want_a), length=steps * CHAIN)


@pytest.mark.slow  # three runs (30 s); the bf16 LoRA resume is the fast check of the mechanism
def test_sigkill_at_a_random_step_then_resume_auto_gives_identical_losses_over_an_int8_base(data, tmp_path):
    """The LoRA resume test (test_cosmos3_lora.py) over an int8 base: the base is quantized again, the
    same way, at the resume, so the killed run resumed logs the uninterrupted run's losses, bit for bit."""
    resume_after_sigkill(data, tmp_path, 7, ("train.lora.dropout=0.1", INT8), "base in int8")


def test_the_memory_plan_counts_an_int8_base_as_it_is_stored():
    """The plan's frozen bytes for an int8 base are the bytes quantize_base stores (counted on the
    model before it is quantized, as a run plans before it fills its weights)."""
    from wamkit.train import memory

    adapter = _tiny()
    applied = lora.inject(adapter, lora.resolve(LoraConfig(rank=4, base="int8"), adapter), seed=0)
    bf16 = memory.model_sizes(adapter, applied.groups)
    planned = memory.model_sizes(adapter, applied.groups, applied.int8_weights(adapter.module))
    stored = lora.quantize_base(adapter.module, applied.spec)
    assert planned.int8_frozen == sum(w.numel() for w in stored) > 0
    assert planned.int8_bytes == sum(lora.stored_bytes(w) for w in stored)
    assert (planned.frozen, planned.trained) == (bf16.frozen, bf16.trained)
    inp = memory.PlanInput(
        world_size=1, device_bytes=80 << 30, host_bytes=128 << 30, procs_per_host=1, device_type="cuda",
        precision="bf16", micro_batch=2, checkpointing=True, ema=False, offload="none", reshard="never",
    )  # fmt: skip
    rows = {r[0]: r[1] for r in memory.plan_for(inp, planned, "none", "never").rows}
    rows_bf16 = {r[0]: r[1] for r in memory.plan_for(inp, bf16, "none", "never").rows}
    saved = rows_bf16["frozen weights"] - rows["frozen weights"]
    assert saved == 2 * planned.int8_frozen - planned.int8_bytes


def test_bench_train_times_the_trainers_lora_over_an_int8_base(capsys):
    """`wamkit bench train --lora-rank R --lora-base int8` times the trainer's own LoRA step: the
    optimizer updates the adapters and the heads only (as many parameters as the trainer's LoRA of the
    same model trains), and full SFT's bare forward+backward is not offered as its comparison."""
    from wamkit.cli import main
    from wamkit.config import ModelConfig
    from wamkit.models import build_model

    argv = ["bench", "train", "--model", "cosmos3", "--preset", "tiny", "--micro-batch", "2", "--steps", "1",
            "--warmup", "1", "--device", "cpu", "--lora-rank", "4", "--lora-base", "int8"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), None, device="meta")
    adapted = lora.apply(adapter, LoraConfig(rank=4, base="int8"))
    expected = sum(p.numel() for g in adapted.groups for p in g.params)
    assert f"LoRA rank 4, base int8: {expected / 1e6:.2f}M trained parameters" in out
    assert expected < 0.1 * sum(p.numel() for p in adapter.module.parameters())
    assert "bare forward+backward" in out and "skipped under LoRA" in out
    row = next(
        line for line in out.splitlines() if line.startswith("trainer step (FSDP2+clip+AdamW, LoRA r4 int8)")
    )
    assert float(row.split()[-4]) > 0  # its s/step


def test_an_int8_base_compiled_under_checkpointing_on_cuda_is_refused_before_anything_is_built(
    data, tmp_path
):
    """On CUDA the compiled layers' recompute over an int8 base differed from their forward (an H100,
    torch 2.11): the placement refuses that combination naming the keys, before a weight is allocated
    (no GPU is touched here: the refusal comes first)."""
    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.train.dist import DistInfo
    from wamkit.train.placement import place

    cfg = _cfg(
        data, tmp_path / "run", INT8, "train.compile=true", "model.options.gradient_checkpointing=true"
    )
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny", options={"gradient_checkpointing": True}),
                          None, device="meta")  # fmt: skip
    adapted = lora.apply(adapter, cfg.train.lora)
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0), started_group=False)
    with pytest.raises(
        ConfigError, match=r"train.lora.base=int8 with train.compile=true .*train.compile=false"
    ):
        place(adapter, cuda, cfg, None, adapted)
    assert all(p.is_meta for p in adapter.module.parameters())


def test_placing_an_int8_base_frees_each_bf16_weight_it_quantizes(data, tmp_path, monkeypatch):
    """Filled from meta, the adapted layers' weights are quantized in place and nothing else holds their
    full-precision tensors: on a 24 GB card Nano's bf16 weights held beside their int8 ones did not fit
    (an H100 capped at 24 GB, the CUDA context counted). Checked on the CPU with weak references taken
    as the quantization starts."""
    import gc
    import weakref

    from wamkit.config import ModelConfig
    from wamkit.models import build_model
    from wamkit.train import placement
    from wamkit.train.dist import init_distributed, shutdown

    cfg = _cfg(data, tmp_path / "run", INT8, "train.precision=fp32")
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), None, device="meta")
    refs, alive, real = [], [], lora.quantize_base

    def watched(module, spec):  # the placement's own frame is still running when it returns
        refs.extend(weakref.ref(m.weight) for m in lora._base_layers(module, spec).values())
        out = real(module, spec)
        gc.collect()
        alive.extend(r for r in refs if r() is not None)
        return out

    monkeypatch.setattr(placement, "quantize_base", watched)
    info = init_distributed("cpu")
    try:
        _, placed = placement.place_run(adapter, info, cfg)
        assert refs and not alive, f"{len(alive)} of {len(refs)} full-precision weights held"
        assert placed.root is not None
    finally:
        shutdown(info)
