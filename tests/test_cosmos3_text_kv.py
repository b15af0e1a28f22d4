"""The text key/value cache of Cosmos3 training (models/cosmos3/text_kv.py): a run reading each
caption's keys/values from disk computes the loss and gradients the stock forward computes; a cache of
other weights or settings, an incomplete one, or one that lacks a caption the data draw is refused by
name; a killed build is finished by running it again; `wamkit cache-text` builds it from a config."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.config import ModelConfig  # noqa: E402
from wamkit.data.meta import DatasetMeta  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3 import text_kv  # noqa: E402
from wamkit.models.cosmos3.text_kv import TextCacheError, TextKVDiskCache  # noqa: E402

from .conftest import FIXTURES  # noqa: E402
from .test_cosmos3_train import IO, fixture_batch  # noqa: E402

TASKS = sorted({t for t in fixture_batch([0, 90])["task"]})


def _adapter(seed: int = 0, **options):
    torch.manual_seed(seed)
    return build_model(
        ModelConfig(name="cosmos3", preset="tiny", options={"caption_dropout": 0.0, **options}), IO
    )


def _build(adapter, root, captions=None):
    captions = adapter.training_captions(TASKS) if captions is None else captions
    with torch.no_grad():
        return text_kv.build(root, adapter.text_fingerprint(torch.float32), captions, adapter.encode_caption)


def _loss_and_grads(adapter, batch):
    torch.manual_seed(7)  # the same noise levels and noise on both paths
    out = adapter.sft_loss(batch)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in adapter.module.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in out.items()}, grads


@pytest.mark.numerics  # float results across code paths (tests/conftest.py)
def test_cached_text_gives_the_stock_loss_and_gradients(tmp_path):
    torch.set_num_threads(2)
    batch = fixture_batch([0, 90])  # two tasks, idle-frame counts in the captions
    stock = _adapter()
    report = _build(stock, tmp_path / "kv")
    # every task with each idle-frame count 0..16; no dropped caption (dropout is off here)
    assert report == {"path": str(tmp_path / "kv"), "captions": len(TASKS) * 17, "written": len(TASKS) * 17}
    cached = _adapter(text_kv_cache=str(tmp_path / "kv"))
    want, want_grads = _loss_and_grads(stock, batch)
    got, got_grads = _loss_and_grads(cached, batch)
    for key in want:
        # the same weights and inputs, sums in another order (one SDPA call per request against the
        # packed, masked one): the longest chain is the 4 layers' sums over about 300 keys each
        assert_rounding_close(got[key], want[key], length=4 * 300)
    assert set(got_grads) == set(want_grads) and want_grads  # the same trained parameters get gradients
    for name, g in want_grads.items():
        assert_rounding_close(got_grads[name], g, length=2 * 4 * 300)  # forward and backward
    # the understanding tower is not run: its layers' text weights take part in no gradient either way
    assert all(not name.startswith("layers.0.mlp.") for name in got_grads)


def test_a_stale_foreign_or_incomplete_cache_is_refused_by_name(tmp_path):
    batch = fixture_batch([0])
    other = _adapter()  # another understanding tower (the tiny preset's frozen weights are fixed)
    with torch.no_grad():
        other.module.layers[0].mlp.up_proj.weight.add_(1.0)
    _build(other, tmp_path / "other")
    with pytest.raises(TextCacheError, match="understanding_sha256"):
        _adapter(text_kv_cache=str(tmp_path / "other"))
    # a folder holding another fingerprint's cache is never mixed with this one's
    with pytest.raises(TextCacheError, match="holds a text cache of other settings.*understanding_sha256"):
        _build(_adapter(), tmp_path / "other")

    adapter = _adapter()
    one_task = adapter.training_captions([t for t in TASKS if t != batch["task"][0]])  # not the batch's
    _build(adapter, tmp_path / "partial", one_task)
    cached = _adapter(text_kv_cache=str(tmp_path / "partial"))
    with pytest.raises(TextCacheError, match="has no caption .*build a cache for this run's data"):
        cached.sft_loss(batch)

    # killed half-way: a missing caption file is named when a run opens the cache; a rerun finishes it
    _build(adapter, tmp_path / "kv")
    victim = next((tmp_path / "kv" / "kv").iterdir())
    victim.unlink()
    with pytest.raises(TextCacheError, match=f"{victim.name} is missing.*incomplete"):
        TextKVDiskCache(tmp_path / "kv")
    assert _build(adapter, tmp_path / "kv")["written"] == 1
    TextKVDiskCache(tmp_path / "kv")
    with pytest.raises(TextCacheError, match="must name a folder written by `wamkit cache-text`"):
        _adapter(text_kv_cache=str(tmp_path / "nothing"))


@pytest.mark.slow
def test_wamkit_cache_text_builds_the_cache_a_run_reads(tmp_path):
    fixture = FIXTURES / "libero_tiny"
    overrides = [
        "model.name=cosmos3", "model.preset=tiny", f"data.root={fixture}", "data.representation=libero_rot6d",
        "data.chunk=16", "train.precision=fp32", "train.device=cpu",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "MUJOCO_GL"}
    run = subprocess.run(
        [sys.executable, "-m", "wamkit", "cache-text", *overrides, "--out", str(tmp_path / "kv"), "--no-progress",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    # the recipe's data: every task of the dataset with 17 idle-frame counts, and the dropped caption
    n = len(set(DatasetMeta(fixture).tasks.values())) * 17 + 1
    assert f"{n} captions cached ({n} written now)" in run.stdout
    assert f"model.options.text_kv_cache={tmp_path / 'kv'}" in run.stdout
    again = subprocess.run(
        [sys.executable, "-m", "wamkit", "cache-text", *overrides, "--out", str(tmp_path / "kv"), "--no-progress",
         "--device", "cpu"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0 and f"{n} captions cached (0 written now)" in again.stdout


def _fsdp_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        batch = fixture_batch([90])
        stock = _adapter()
        torch.manual_seed(5)
        with torch.no_grad():
            ref = float(stock.sft_loss(batch)["loss"])
        from wamkit.train.dist import LossModule

        adapter = _adapter(text_kv_cache=folder)
        for block in adapter.blocks():
            fully_shard(block)
        root = fully_shard(LossModule(adapter))  # as the trainer shards it: the root gathers in forward
        torch.manual_seed(5)
        loss = root(batch)["loss"]
        loss.backward()
        grad = adapter.module.layers[0].mlp_moe_gen.up_proj.weight.grad
        result = {
            "ref": ref,
            "loss": float(loss.detach()),
            "grad": grad is not None and bool(grad.to_local().abs().sum() > 0),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_cached_text_under_fsdp2_on_two_gloo_processes(tmp_path):
    """Each decoder layer's generation half runs through the layer's own call, so FSDP2's per-layer
    hooks gather its shards: the sharded loss is the unsharded stock one, and gradients reach the shards."""
    import json
    import socket

    import torch.multiprocessing as mp

    _build(_adapter(), tmp_path / "kv")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_worker, args=(2, port, str(tmp_path / "kv"), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["grad"]
        assert_rounding_close(res["loss"], res["ref"], length=4 * 300)


@pytest.mark.slow  # 2.5 min: three wamkit train runs and a convert; the in-process loss and gradients test is the fast check
def test_a_run_on_cached_text_trains_as_the_stock_run_and_converts(tmp_path):
    """`wamkit cache-text`, then `wamkit train` reading it: the tower is out of the model, the losses are
    the stock run's, and `wamkit convert` gives a serving directory whose frozen tower is the base's."""
    from wamkit.cli import main
    from wamkit.config import load_config
    from wamkit.data.synthetic import write_pattern_dataset
    from wamkit.serve.loading import load_served
    from wamkit.train.loop import train
    from wamkit.train.metrics import read_losses

    from .conftest import REPO

    torch.set_num_threads(2)
    data = write_pattern_dataset(tmp_path / "ds", [5, 4], camera_dtype="image")
    config = str(REPO / "configs" / "libero_10_cosmos3.yaml")
    common = ["model.preset=tiny", "model.pretrained=", f"data.root={data}", "data.num_workers=0"]
    assert main(["cache-text", config, *common, "train.precision=fp32", "--out", str(tmp_path / "kv"),
                 "--device", "cpu", "--no-progress"]) == 0  # fmt: skip

    def cfg(run: str, *extra: str):
        return load_config(config, [
            *common, "model.options.gradient_checkpointing=true", "train.max_steps=3", "train.micro_batch=2",
            "train.global_batch=2", "train.precision=fp32", "train.device=cpu", "train.ema=false",
            "train.log_interval=1", f"train.run_dir={tmp_path / run}", *extra,
        ])  # fmt: skip

    stock = train(cfg("stock"))
    seen = {}

    def watched(c, io):
        adapter = build_model(c.model, io)
        seen["frozen"] = [n for n, _ in adapter.module.named_parameters() if n.startswith("layers.0.mlp.")]
        return adapter

    cached = train(cfg("cached", f"model.options.text_kv_cache={tmp_path / 'kv'}"), adapter_fn=watched)
    assert seen["frozen"] == []  # the understanding tower was never in the trained model
    a, b = read_losses(stock), read_losses(cached)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ("loss", "flow_matching_loss_vision", "flow_matching_loss_action", "grad_norm"):
            # attention sums in another order (see above), forward and back, over 3 steps
            assert_rounding_close(rb[key], ra[key], length=3 * 2 * 4 * 300)
    assert main(["convert", str(cached), "--out", str(tmp_path / "serve")]) == 0
    served = load_served(tmp_path / "serve", device="cpu").adapter.module
    assert "text_kv_cache" not in (tmp_path / "serve" / "model.json").read_text()
    fresh = _adapter().module
    assert torch.equal(served.layers[0].mlp.up_proj.weight, fresh.layers[0].mlp.up_proj.weight)
    assert torch.equal(served.embed_tokens.weight, fresh.embed_tokens.weight)


@pytest.mark.slow  # a benchmark's three rows (40 s)
def test_bench_train_text_kv_adds_the_cached_row(capsys):
    """`wamkit bench train --text-kv` times the trainer step reading a text cache beside the stock one."""
    from wamkit.cli import main

    argv = ["bench", "train", "--model", "cosmos3", "--preset", "tiny", "--micro-batch", "2", "--steps", "1",
            "--warmup", "1", "--device", "cpu", "--text-kv"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "trainer step (FSDP2+clip+AdamW)" in out and "trainer step, text cache" in out
    assert "text cache / stock trainer samples/s:" in out


@pytest.mark.slow  # a benchmark's rows (25 s)
def test_bench_train_prints_a_row_its_memory_plan_refuses_and_goes_on(capsys, monkeypatch):
    """On a capped device (`--device-memory`) the stock trainer step of a large model does not fit: its
    row says so and the cached row is still measured. Here the plan refuses the first trainer row."""
    import wamkit.train.placement as placement
    from wamkit.cli import main
    from wamkit.config import ConfigError

    real, asked = placement.plan_here, []

    def refuse_the_first(*args, **kwargs):
        asked.append(1)
        if len(asked) == 1:
            raise ConfigError("the training state does not fit (nothing was built): a test's refusal")
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "plan_here", refuse_the_first)
    argv = ["bench", "train", "--model", "cosmos3", "--preset", "tiny", "--micro-batch", "2", "--steps", "1",
            "--warmup", "1", "--device", "cpu", "--text-kv"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    stock = next(line for line in out.splitlines() if line.startswith("trainer step (FSDP2+clip+AdamW)"))
    assert "does not fit" in stock
    cached = next(line for line in out.splitlines() if line.startswith("trainer step, text cache"))
    assert "does not fit" not in cached and float(cached.split()[-4]) > 0  # its s/step
    assert "text cache / stock trainer samples/s: n/a (the stock step does not fit)" in out
    with pytest.raises(SystemExit, match="--device-memory caps a CUDA device"):
        main([*argv, "--device-memory", "1GB"])


def test_a_random_presets_frozen_hash_is_its_law_whether_drawn_whole_or_on_meta():
    """A random preset's understanding hash (the text cache's `understanding_sha256`) is taken over each
    frozen tensor's law and seed, not its drawn bytes: `wamkit cache-text` draws the model whole, a run
    builds it on meta and streams it, and both must name the same cache; another seed or preset differs."""
    from wamkit.models.cosmos3.components import RandomWeights

    def sha(preset, device, seed=0):
        adapter = build_model(ModelConfig(name="cosmos3", preset=preset), IO, device=device)
        if seed:
            adapter.set_weight_law(RandomWeights(adapter.module, torch.device("cpu"), seed=seed))
        return adapter.text_fingerprint()["understanding_sha256"]

    whole, meta = sha("mini", "cpu"), sha("mini", "meta")
    assert whole == meta
    assert sha("mini", "meta", seed=1) != meta
    assert sha("small", "meta") != meta
    # the tiny preset, regenerated exactly anywhere, keeps the hash of its bytes: changing one changes it
    tiny = _adapter()
    before = tiny.text_fingerprint()["understanding_sha256"]
    tiny._frozen_sha = None
    with torch.no_grad():
        next(p for n, p in tiny.module.named_parameters() if "embed_tokens" in n).view(-1)[0] += 1.0
    assert tiny.text_fingerprint()["understanding_sha256"] != before
