"""One plan says what fits (issue 52, item 6): ``--plan`` over several device sizes picks a placement per
size (full SFT where it fits, LoRA recommended where only it does), and a refusal names settings, LoRA
and a smaller micro-batch among them, that fit when applied: each is checked by planning again with it,
through peft's real layers where the search counted LoRA by arithmetic."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")
pytest.importorskip("peft", reason="train.lora needs peft (the wamkit[cosmos3] extra)")

from wamkit.cli import main as wamkit  # noqa: E402
from wamkit.config import LoraConfig, ModelConfig  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.train import lora, memory, plan_search  # noqa: E402

from .test_cosmos3_model import IO  # noqa: E402

# the commands of docs/train.md ("What fits where"), as written there
FOUR_SIZES = ["--plan", "--world-size", "1", "--device-memory", "24GB,48GB,80GB,141GB",
              "--host-memory", "48GB,64GB,128GB,128GB"]  # fmt: skip
TEXT_KV = "model.options.text_kv_cache=/data/libero_10/text_kv"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = wamkit(["train", "libero_10_cosmos3", *argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def _picks(out: str) -> dict[str, str]:
    """The summary's line per device size ('24GB': 'LoRA rank 16, micro-batch 16 x 128, ...')."""
    summary = out.split("what fits, ")[1].splitlines()[1:]
    return {m.group(1): m.group(2) for m in (re.match(r"  (\S+) device, \S+ host: (.*)", s) for s in summary)}


def _batch(pick: str) -> tuple[int, int]:
    m = re.search(r"micro-batch (\d+) x (\d+)", pick)
    return int(m.group(1)), int(m.group(2))


def _device_total(out: str) -> float:
    return float(out.split("device total ")[1].split(" GiB")[0])


def test_four_sizes_reading_a_text_cache(capsys):
    """141 and 80 GB: the recipe's full SFT as configured (80 GB offloading its optimizer state); 48 GB:
    LoRA, recommended; 24 GB: LoRA at a smaller micro-batch whose accumulation keeps the global batch."""
    code, out, _ = _run(capsys, TEXT_KV, *FOUR_SIZES)
    assert code == 0
    picks = _picks(out)
    assert list(picks) == ["24GB", "48GB", "80GB", "141GB"]
    for size in ("141GB", "80GB"):
        assert (
            picks[size].startswith("full SFT, micro-batch 32 x 64") and "[the config as it is]" in picks[size]
        )
    assert "offload=optimizer" in picks["80GB"]
    assert (
        picks["48GB"].startswith("LoRA rank 16, micro-batch 32 x 64")
        and "[train.lora.rank=16]" in picks["48GB"]
    )
    mb, accumulation = _batch(picks["24GB"])
    assert picks["24GB"].startswith("LoRA rank 16") and mb < 32 and mb * accumulation == 2048
    assert f"[train.lora.rank=16 train.micro_batch={mb}]" in picks["24GB"]
    assert out.count("LoRA is a recommendation: this config trains in full") == 2
    # each size's table is the picked plan's, and it fits
    tables = out.split("== ")[1:]
    assert len(tables) == 4 and not any("does not fit" in t for t in tables)


# docs/cosmos3.md, "LoRA of full Nano on a 24 GB card" (2026-12-06, one H100 capped to a 24 GB card of
# 22.35 GiB): the driver's peak, CUDA context included, where the step ran; None where it ran out of memory
MEASURED = [("bf16", 8, 20.75), ("int8", 32, 21.50), ("bf16", 16, None)]


@pytest.mark.parametrize("base,micro_batch,driver_peak", MEASURED, ids=[f"{b}x{m}" for b, m, _ in MEASURED])
def test_the_lora_plan_holds_the_measured_peaks(capsys, base, micro_batch, driver_peak):
    """The plan's device total for the three LoRA steps measured on a 24 GB card: at least what the
    driver reported where the step ran (and then it fits the card, as it did), more than the card where
    it ran out of memory (and then the plan refuses it): a pick the plan prints fits when run."""
    argv = [TEXT_KV, "train.lora.rank=16", f"train.lora.base={base}", f"train.micro_batch={micro_batch}",
            "train.offload=none", "--plan", "--world-size", "1", "--device-memory", "24GB", "--host-memory", "48GB"]  # fmt: skip
    code, out, err = _run(capsys, *argv)
    planned = _device_total(out + err)
    if driver_peak is not None:
        assert code == 0 and driver_peak - 0.02 <= planned <= 22.4, (planned, driver_peak)
    else:
        assert code != 0 and planned > 22.4 and "does not fit" in out + err, planned


def test_four_sizes_with_the_tower_on_the_device(capsys):
    """Without a text cache: full SFT fits only 141 GB; LoRA is recommended at 80 and 48 GB; on 24 GB the
    bf16 base alone is larger than the card, and the size says that nothing fits, nor any change of one or
    two settings."""
    code, out, _ = _run(capsys, *FOUR_SIZES)
    assert code == 0
    picks = _picks(out)
    assert picks["141GB"].startswith("full SFT") and "[the config as it is]" in picks["141GB"]
    assert (
        picks["80GB"].startswith("LoRA rank 16, micro-batch 32 x 64")
        and "[train.lora.rank=16]" in picks["80GB"]
    )
    # the tower's weights beside the LoRA step's measured excess (train/memory.py): micro-batch 16 on 48 GB
    assert (
        picks["48GB"].startswith("LoRA rank 16, micro-batch 16 x 128")
        and "[train.lora.rank=16 train.micro_batch=16]" in picks["48GB"]
    )
    assert picks["24GB"].startswith("nothing fits")
    # with the LoRA step's measured excess, not even LoRA over two processes fits a 24 GB card then
    assert "no change of one or two of these settings fits: micro-batch, process count, LoRA" in out


def _named_overrides(err: str, first: str) -> list[str]:
    """The overrides of the refusal's first suggestion line that starts with ``first`` and needs no other
    process count."""
    for line in err.split("settings that would fit")[1].splitlines()[1:]:
        if line.startswith(f"  {first}") and "processes" not in line:
            return line.split(" (")[0].split()
    raise AssertionError(f"no suggestion starting with {first!r} in:\n{err}")


@pytest.mark.slow
def test_a_refusal_names_lora_and_a_micro_batch_that_fit_when_applied(capsys):
    """24 GB reading a text cache: full SFT is refused, naming LoRA with a smaller micro-batch (two
    changes); LoRA alone is refused naming that micro-batch (one change); both applied fit, and peft's
    real layers plan the same device total as the search's arithmetic."""
    one = ["--plan", "--world-size", "1", "--device-memory", "24GB", "--host-memory", "48GB"]
    code, _, err = _run(capsys, TEXT_KV, *one)
    assert code == 2 and "does not fit (nothing was built)" in err
    assert "settings that would fit (no single change does):" in err and "two changes together" in err
    assert "(full SFT: no change of one or two settings fits)" in err
    named = _named_overrides(err, "train.lora.rank=")
    assert named[0] == "train.lora.rank=16" and named[1].startswith("train.micro_batch=")
    # LoRA alone: refused, naming the micro-batch as one change
    code, _, err = _run(capsys, TEXT_KV, named[0], *one)
    assert code == 2 and "settings that would fit:" in err
    assert _named_overrides(err, "train.micro_batch=") == [named[1]]
    # both: it fits, with the device total the multi-size table gave from the arithmetic
    code, out, _ = _run(capsys, TEXT_KV, *named, *one)
    assert code == 0 and "does not fit" not in out and "0.046B trained" in out
    _, table, _ = _run(capsys, TEXT_KV, *FOUR_SIZES)
    searched = float(_picks(table)["24GB"].split("device ")[1].split(" of")[0])
    assert _device_total(out) == searched


def test_a_host_size_per_device_or_one_for_all(capsys):
    code, _, err = _run(capsys, "--plan", "--device-memory", "24GB,48GB", "--host-memory", "48GB,64GB,128GB")
    assert code == 2 and "--host-memory: 3 sizes for 2 device size(s)" in err
    code, _, err = _run(capsys, "--plan", "--device-memory", "24GB,lots")
    assert code == 2 and "--device-memory: 'lots' is not a size" in err


def test_lora_counted_by_arithmetic_equals_peft_layers():
    """The search counts LoRA without peft; the tiny preset with peft's layers put in counts the same."""
    cfg = ModelConfig(name="cosmos3", preset="tiny")
    plain = build_model(cfg, IO, device="meta")
    counted = plan_search.lora_sizes(plain, memory.model_sizes(plain), rank=4)
    adapted = build_model(cfg, IO, device="meta")
    put_in = lora.apply(adapted, LoraConfig(rank=4))
    assert counted == memory.model_sizes(adapted, put_in.groups, lora=True)
    assert counted.trained < memory.model_sizes(plain).trained


def _tiny_modes(config_lora_rank: int = 0) -> plan_search.Modes:
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), IO, device="meta")
    sizes = memory.model_sizes(adapter)
    return plan_search.Modes(
        sizes, config_lora_rank, None if config_lora_rank else plan_search.lora_sizes(adapter, sizes)
    )


def _tiny_inp(**kw) -> memory.PlanInput:
    base = dict(world_size=1, device_bytes=8 * 2**30, host_bytes=64 * 2**30, procs_per_host=1, device_type="cuda",
                precision="bf16", micro_batch=8, checkpointing=False, ema=True, offload="auto", reshard="auto",
                global_batch=8192)  # fmt: skip
    return memory.PlanInput(**{**base, **kw})


def test_full_sft_is_picked_where_it_fits_and_named_first_where_it_does_not():
    """The tiny preset: where full SFT fits as configured, the pick is the config (LoRA would fit too);
    at a micro-batch whose activations do not fit, the refusal names full SFT's single changes (the
    largest micro-batch that fits, its accumulation keeping the global batch; checkpointing) before
    LoRA, which needs one of them too (two changes)."""
    modes = _tiny_modes()
    picked = plan_search.pick(_tiny_inp(), modes)
    assert picked is not None and not picked.changed and picked.training == "full SFT"
    assert plan_search.pick(_tiny_inp(), plan_search.Modes(modes.lora_sizes, 16)).training == "LoRA rank 16"
    big = _tiny_inp(micro_batch=8192)
    assert not memory.make_plan(big, modes.sizes).fits
    found = plan_search.suggestions(big, modes)
    full = [p for p in found if p.lora_rank == 0]
    assert [p.settings for p in full][0] == "model.options.gradient_checkpointing=true"
    (smaller,) = [p for p in full if p.settings.startswith("train.micro_batch=")]
    i = smaller.plan.inp
    assert i.micro_batch < 8192 and i.micro_batch * i.accumulation == 8192 and smaller.plan.fits
    assert not memory.make_plan(_tiny_inp(micro_batch=2 * i.micro_batch), modes.sizes).fits  # the largest
    lora_ones = [p for p in found if p.lora_rank]
    assert lora_ones and all(
        len(p.moves) == 2 and p.settings.startswith("train.lora.rank=16 ") for p in lora_ones
    )
    assert "LoRA" in plan_search.searched(big, modes)
    assert "LoRA" not in plan_search.searched(big, _tiny_modes(config_lora_rank=16))  # the config's own
