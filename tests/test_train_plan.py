"""The training memory plan by arithmetic: Cosmos3-Nano's counts and the bytes of each category, the
offload it picks, its refusal, and ``wamkit train --plan`` as a user runs it. Integer arithmetic on a
model built on the meta device: not among the numerics tests that run twice (tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.train import memory, plan_search  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture(scope="module")
def nano_sizes() -> memory.ModelSizes:
    """Cosmos3-Nano's counts, from the preset built on the meta device (nothing allocated)."""
    cfg = ModelConfig(name="cosmos3", preset="nano", options={"gradient_checkpointing": True})
    return memory.model_sizes(build_model(cfg, None, device="meta"))


def _inp(**kw) -> memory.PlanInput:
    base = dict(world_size=1, device_bytes=int(139.8 * GIB), host_bytes=128 * 10**9, procs_per_host=1,
                device_type="cuda", precision="bf16", micro_batch=8, checkpointing=True, ema=True,
                offload="auto", reshard="auto", global_batch=2048)  # fmt: skip
    return memory.PlanInput(**{**base, **kw})


def test_nano_counts_and_the_bytes_of_each_category(nano_sizes):
    s = nano_sizes
    assert (
        s.total == 15_158_979_072 and round(s.frozen / 1e9, 3) == 8.191 and round(s.trained / 1e9, 3) == 6.968
    )
    plan = memory.plan_for(_inp(), s, "none", "never")
    rows = {c: (b, w) for c, b, w in plan.rows}
    assert rows["frozen weights"] == (s.frozen * 2, "device")  # once, in bf16
    assert rows["trained master (fp32)"][0] == rows["gradients (fp32)"][0] == s.trained * 4
    assert rows["optimizer moments"] == (s.trained * 8, "device") and rows["EMA (fp32)"][0] == s.trained * 4
    assert rows["gathered weights"][0] == s.total * 2  # kept gathered from forward to backward
    # 119 GiB of state before activations and the EMA: the issue's own arithmetic
    state = sum(
        rows[k][0]
        for k in ("frozen weights", "trained master (fp32)", "gradients (fp32)", "optimizer moments")
    )
    assert round(state / GIB, 1) == 119.1
    # 8 ranks shard every category; reducing on the last micro-batch accumulates unsharded gradients
    eight = memory.plan_for(_inp(world_size=8, procs_per_host=8), s, "none", "always")
    by = {c: b for c, b, _ in eight.rows}
    assert by["frozen weights"] == s.frozen * 2 // 8 and by["optimizer moments"] == s.trained * 8 // 8
    assert by["gradients (fp32)"] == s.trained * 4
    every = memory.plan_for(_inp(world_size=8, procs_per_host=8), s, "none", "always", "every")
    assert {c: b for c, b, _ in every.rows}["gradients (fp32)"] == s.trained * 4 // 8


def test_auto_offloads_on_one_h200_and_not_on_eight(nano_sizes):
    one = memory.make_plan(_inp(), nano_sizes)
    assert one.fits and one.offload != "none"  # the state alone does not fit one H200
    moved = {c for c, _, w in one.rows if w == "host"}
    assert "EMA (fp32)" in moved
    eight = memory.make_plan(_inp(world_size=8, procs_per_host=8, device_bytes=80 * 10**9), nano_sizes)
    assert eight.fits and eight.offload == "none"
    assert "offload=none" in eight.table() and "does not fit" not in eight.table()


def test_a_plan_that_fits_nowhere_says_what_would(nano_sizes):
    small = _inp(device_bytes=24 * GIB, host_bytes=64 * GIB, offload="none")
    plan = memory.make_plan(small, nano_sizes)
    assert not plan.fits
    msg = str(plan_search.refusal(plan, plan_search.Modes(nano_sizes)))
    assert "does not fit" in msg and "frozen weights" in msg and "GiB" in msg
    assert "processes" in msg  # more ranks shard the state
    assert memory.make_plan(_inp(world_size=8, procs_per_host=8, device_bytes=24 * GIB,
                                 host_bytes=64 * GIB), nano_sizes).fits is False  # fmt: skip


def test_sizes_parse_with_their_units():
    assert memory.parse_size("80GB", "x") == 80 * 10**9
    assert memory.parse_size("139.8GiB", "x") == int(139.8 * GIB)
    assert memory.parse_size("24", "x") == 24 * GIB
    with pytest.raises(ConfigError, match="--device-memory: 'lots' is not a size"):
        memory.parse_size("lots", "--device-memory")


@pytest.mark.slow
def test_train_plan_prints_without_data_or_weights(capsys):
    from wamkit.cli import main as wamkit

    cfg = str(REPO / "configs" / "libero_10_cosmos3.yaml")
    assert wamkit(["train", cfg, "--plan", "--world-size", "8", "--device-memory", "80GB",
                   "--host-memory", "1000GB"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "8 process(es)" in out and "offload=none" in out and "15.159B parameters" in out
    assert "is not here" in out  # neither the dataset nor the base folder exists on this machine
    assert wamkit(["train", cfg, "--plan", "--device-memory", "24GiB", "--host-memory", "32GiB"]) == 2
    assert "does not fit" in capsys.readouterr().err


@pytest.mark.slow
def test_full_nano_sft_fits_one_80gb_gpu_reading_a_text_cache(capsys):
    """The recipe on one 80 GB GPU and a 128 GB host: refused with the understanding tower on the
    device, planned to fit when the run reads its captions' keys/values (the tower left out)."""
    from wamkit.cli import main as wamkit

    cfg = str(REPO / "configs" / "libero_10_cosmos3.yaml")
    one_gpu = ["--plan", "--world-size", "1", "--device-memory", "80GB", "--host-memory", "128GB"]
    assert wamkit(["train", cfg, *one_gpu]) == 2
    assert "frozen weights                 15.26  device" in capsys.readouterr().err
    assert wamkit(["train", cfg, "model.options.text_kv_cache=/nowhere/text_kv", *one_gpu]) == 0
    out = capsys.readouterr().out
    assert "text_kv_cache /nowhere/text_kv is not here: planned as a run reading it" in out
    assert "(0.000B frozen, 6.968B trained)" in out and "frozen weights                  0.00  device" in out
    device = float(out.split("device total ")[1].split(" GiB")[0])
    host = float(out.split("host total ")[1].split(" GiB")[0])
    assert device <= 74.5 and host * 1.073741824 <= 120  # GiB of 80 GB; the host bound in GB
