"""SFT on the LIBERO-shaped fixture with the tiny cosmos3 config: the loss goes down, and FSDP2
sharding per decoder layer over 2 gloo processes computes the same loss and trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.config import DataConfig, ModelConfig, RunConfig  # noqa: E402
from wamkit.constants import ACTION, ACTION_IS_PAD, future_image_key  # noqa: E402
from wamkit.data.dataset_stats import compute_stats  # noqa: E402
from wamkit.data.loader import collate  # noqa: E402
from wamkit.data.sft_dataset import make_train_dataset  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.train.data_setup import build_spec  # noqa: E402

from .conftest import FIXTURES

FIXTURE = FIXTURES / "libero_tiny"
IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")


def fixture_batch(indices: list[int]) -> dict:
    cfg = DataConfig(root=str(FIXTURE), chunk=16, representation="libero_rot6d")
    spec = build_spec(RunConfig(data=cfg), IO, compute_stats(FIXTURE, "libero_rot6d", 16))
    adapter_wants = (tuple(range(1, 17)), ("idle_frames",))  # what the cosmos3 adapter declares
    ds = make_train_dataset(cfg, spec, *adapter_wants)  # current frame + 16 real future frames
    return collate([ds[i] for i in indices])


def test_sft_steps_lower_the_loss_on_the_libero_fixture():
    torch.set_num_threads(2)
    batch = fixture_batch([0, 90])  # frames of the first and last episodes (two tasks)
    assert (
        batch[ACTION].shape == (2, 16, 10)
        and future_image_key("image") in batch
        and batch[ACTION_IS_PAD].any()
    )
    assert batch[future_image_key("image")].shape == (2, 16, 64, 64, 3)
    assert batch["idle_frames"].dtype == torch.int64 and batch["idle_frames"].shape == (2,)
    torch.manual_seed(0)
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), IO)
    groups = adapter.param_groups()
    opt = torch.optim.AdamW([{"params": g.params, "lr": 5e-3 * g.lr_mult} for g in groups if g.params])

    def loss_at(seed: int, train: bool = False) -> dict:
        torch.manual_seed(seed)  # the same sigma and noise before and after training
        out = adapter.sft_loss(batch)
        if train:
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
        return {k: float(v.detach()) for k, v in out.items()}

    frozen = adapter.module.layers[0].mlp.up_proj.weight.clone()
    before = loss_at(123, train=True)  # the first step's loss, before its update
    assert set(before) == {"loss", "flow_matching_loss_action", "flow_matching_loss_vision"}
    for step in range(3):
        loss_at(step, train=True)
    with torch.no_grad():
        after = loss_at(123)
    assert after["loss"] < 0.8 * before["loss"], (before, after)
    assert after["flow_matching_loss_action"] < before["flow_matching_loss_action"]
    assert torch.equal(adapter.module.layers[0].mlp.up_proj.weight, frozen)  # understanding tower frozen


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        torch.set_num_threads(1)
        batch = fixture_batch([90])
        adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), IO)
        torch.manual_seed(5)
        with torch.no_grad():
            ref = float(adapter.sft_loss(batch)["loss"])
        for block in adapter.blocks():
            fully_shard(block)
        fully_shard(adapter.module)
        weight = adapter.module.layers[0].mlp_moe_gen.up_proj.weight
        sharded = isinstance(weight, DTensor) and weight.to_local().shape[0] * world == weight.shape[0]
        opt = torch.optim.SGD([p for g in adapter.param_groups() for p in g.params], lr=0.05)
        before = adapter.module.layers[0].mlp_moe_gen.up_proj.weight.to_local().clone()
        torch.manual_seed(5)
        loss = adapter.sft_loss(batch)["loss"]
        loss.backward()
        has_grad = adapter.module.layers[0].mlp_moe_gen.up_proj.weight.grad is not None
        frozen_grad = adapter.module.layers[0].mlp.up_proj.weight.grad is None
        opt.step()
        moved = not torch.equal(adapter.module.layers[0].mlp_moe_gen.up_proj.weight.to_local(), before)
        result = dict(
            ref=ref,
            loss=float(loss.detach()),
            moved=moved,
            sharded=sharded,
            grad=has_grad,
            frozen=frozen_grad,
        )
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_per_decoder_layer_on_two_gloo_processes(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["sharded"] and r["grad"] and r["frozen"]
        assert_rounding_close(r["loss"], r["ref"], length=192 * 4)  # sharding changes only the sums' order
        assert r["moved"]  # the optimizer step updated this rank's shard
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
