"""Full-size SFT's placement: a run refused by its memory plan before anything is allocated, weights
streamed into each rank's FSDP2 shard from safetensors, and the optimizer/EMA offload giving the same
numbers (the plan's arithmetic itself: tests/test_train_plan.py)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

from wamkit.config import ConfigError, ModelConfig, RunConfig, load_config  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3.components import export_diffusers  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

from .test_cosmos3_model import IO  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def test_training_is_refused_before_anything_is_allocated(tmp_path, libero_tiny):
    from wamkit.train.loop import train

    cfg = load_config(None, [
        f"data.root={libero_tiny}", "data.representation=libero_rot6d", "data.num_workers=0",
        "model.name=cosmos3", "model.preset=tiny", f"train.run_dir={tmp_path / 'run'}",
        "train.micro_batch=2000000", "train.global_batch=2000000", "train.device=cpu",
    ])  # fmt: skip
    with pytest.raises(ConfigError, match="does not fit .nothing was built") as err:
        train(cfg)
    assert "activations (estimate)" in str(err.value) and "train.micro_batch=" in str(err.value)
    assert "train.lora.rank=16 " in str(err.value)  # named, never applied: the config trains in full
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- streamed, sharded load -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The cosmos3 tiny preset as a diffusers folder (weights in one safetensors shard)."""
    out = tmp_path_factory.mktemp("tiny_diffusers")
    export_diffusers(build_model(ModelConfig(name="cosmos3", preset="tiny"), IO), out)
    return out


def _stream_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor

        from wamkit.train.dist import DistInfo
        from wamkit.train.placement import place, plan_here

        torch.set_num_threads(1)
        cfg = RunConfig()
        cfg.model = ModelConfig(name="cosmos3", preset="tiny", pretrained=folder)
        cfg.train.device, cfg.train.micro_batch, cfg.train.global_batch = "cpu", 1, 2
        adapter = build_model(cfg.model, IO, device="meta")
        info = DistInfo(rank, world, rank, torch.device("cpu"), False)
        placed = place(adapter, info, cfg, plan_here(cfg, info, adapter))
        params = dict(adapter.module.named_parameters())
        local = params["layers.0.mlp_moe_gen.up_proj.weight"]
        sharded = isinstance(local, DTensor) and local.to_local().shape[0] * world == local.shape[0]
        full = {
            k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for k, p in params.items()
        }
        if rank == 0:
            torch.save({"weights": full, "sharded": sharded, "load_s": placed.load_s}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_stream_the_weights_one_process_loads(tiny_folder, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "streamed.pt"
    mp.spawn(_stream_worker, args=(2, port, str(tiny_folder), str(out)), nprocs=2, join=True)
    got = torch.load(out, weights_only=True)
    assert got["sharded"]
    one = build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained=str(tiny_folder)), IO)
    want = dict(one.module.named_parameters())
    assert got["weights"].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got["weights"][k], v.detach()), k  # the same bytes, read shard by shard


def _shard(folder: Path) -> Path:
    (f,) = sorted((folder / "transformer").glob("*.safetensors"))
    return f


def _meta_fill(folder: Path) -> None:
    from wamkit.models.weights import fill

    adapter = build_model(
        ModelConfig(name="cosmos3", preset="tiny", pretrained=str(folder)), IO, device="meta"
    )
    adapter.module.to_empty(device="cpu")
    fill(adapter.module, adapter._weight_source("cpu"), str(folder))


def test_a_truncated_shard_is_named_before_any_step(tiny_folder, tmp_path):
    bad = tmp_path / "cut"
    shutil.copytree(tiny_folder, bad)
    f = _shard(bad)
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 1000])
    with pytest.raises(
        ConfigError, match=rf"{f.name}: truncated: its tensors need \d+ bytes but the file has"
    ):
        _meta_fill(bad)


def _rewrite(f: Path, change) -> None:
    """Rewrite a safetensors file with ``change(tensors)`` applied (through safetensors itself)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(f))
    change(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_a_wrong_shape_or_a_missing_tensor_is_named(tiny_folder, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_folder, wrong)
    name = "layers.1.mlp_moe_gen.down_proj.weight"
    _rewrite(_shard(wrong), lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(ConfigError, match=rf"{_shard(wrong).name}: tensor '{name}' has shape \[64, 191\]; "
                       r"the model expects \[64, 192\]"):  # fmt: skip
        _meta_fill(wrong)
    gone = tmp_path / "gone"
    shutil.copytree(tiny_folder, gone)
    _rewrite(_shard(gone), lambda t: t.pop("layers.2.self_attn.to_q.weight"))
    with pytest.raises(ConfigError, match=r"weights missing for \['layers.2.self_attn.to_q.weight'\]"):
        _meta_fill(gone)
    header = struct.pack("<Q", 10**9)
    junk = tmp_path / "junk"
    shutil.copytree(tiny_folder, junk)
    _shard(junk).write_bytes(header + b"{}")
    with pytest.raises(ConfigError, match="truncated: its header is 1000000000 bytes"):
        _meta_fill(junk)


# -- offload ----------------------------------------------------------------------------------------
def _tiny_run(run: Path, libero_tiny: Path, *extra: str):
    from wamkit.train.loop import train

    cfg = load_config(None, [
        f"data.root={libero_tiny}", "data.representation=libero_rot6d", "data.num_workers=0",
        "model.options.width=64", "model.options.depth=2", "model.options.heads=2",
        "train.max_steps=4", "train.micro_batch=2", "train.global_batch=4", "train.save_interval=2",
        "train.log_interval=1", "train.warmup_steps=1", "train.ema=true", "train.device=cpu",
        f"train.run_dir={run}", *extra,
    ])  # fmt: skip
    train(cfg)


def _state(ckpt: Path, tmp: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt.parent.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


def test_offloaded_optimizer_and_ema_give_the_same_losses_and_state(tmp_path, libero_tiny):
    """The same kernels on the same shapes in the same order, the state only resting elsewhere between
    steps: equal to the bit (tests/exactness.py), after a resume of the offloaded run too."""
    plain, off = tmp_path / "plain", tmp_path / "off"
    _tiny_run(plain, libero_tiny, "train.offload=none")
    _tiny_run(off, libero_tiny, "train.offload=optimizer")
    assert "offload=optimizer" in (off / "train.log").read_text()
    assert read_losses(off) == read_losses(plain)
    a = _state(plain / "checkpoints" / "step_000004", tmp_path)
    b = _state(off / "checkpoints" / "step_000004", tmp_path)
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{part}.{k}"
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for m in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(sa[k][m], sb[k][m]), f"{k}.{m}"
    # resumed from step 2 with the state in host memory again: the same steps 3-4
    resumed = tmp_path / "resumed"
    shutil.copytree(off, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    _tiny_run(resumed, libero_tiny, "train.offload=optimizer", "train.resume=auto")
    assert read_losses(resumed) == read_losses(plain)
    assert "optimizer state loaded in place, in host memory" in (resumed / "train.log").read_text()
    assert json.loads((resumed / "checkpoints" / "step_000004" / "meta.json").read_text())["step"] == 4


def test_the_pinned_arena_cuts_tensors_from_slabs_without_rounding():
    from wamkit.train.offload import PinnedArena

    arena = PinnedArena(slab_bytes=4096, pin=False)  # pinning needs a GPU; the cutting is the same
    a, b = arena.zeros((3, 5), torch.float32), arena.zeros((7,), torch.bfloat16)
    assert a.shape == (3, 5) and b.shape == (7,) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one slab
    assert (b.data_ptr() - a.data_ptr()) % 64 == 0 and b.data_ptr() - a.data_ptr() >= a.nbytes
    a.fill_(1.0)
    assert b.abs().sum() == 0  # no overlap
    big = arena.zeros((2000,), torch.float32)  # over a quarter slab: a block of its own
    assert arena.reserved == 4096 + big.nbytes
    for _ in range(62):  # 64-byte aligned: a and b took 128 bytes, these the other 3,968
        arena.zeros((4,), torch.float32)
    assert arena.reserved == 4096 + big.nbytes
    arena.zeros((4,), torch.float32)
    assert arena.reserved == 2 * 4096 + big.nbytes  # a full slab starts the next


def test_frozen_parameters_exist_once_in_the_compute_dtype():
    """bf16 training: the frozen tower is cast before sharding (no fp32 copy), the trained part stays
    fp32 (the master weights); neither the optimizer nor the EMA ever sees a frozen parameter."""
    from wamkit.models.cosmos3.towers import param_role
    from wamkit.train.optim import PowerEMA, build_optimizer
    from wamkit.train.placement import cast_frozen

    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), IO)
    cast_frozen(adapter, torch.bfloat16)
    for name, p in adapter.module.named_parameters():
        want = torch.bfloat16 if param_role(name) == "frozen" else torch.float32
        assert p.dtype == want, name
    groups = adapter.param_groups()
    opt = build_optimizer(groups, 1e-4, 0.0, [0.9, 0.99])
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    frozen = [p for n, p in adapter.module.named_parameters() if param_role(n) == "frozen"]
    assert frozen and not any(id(p) in in_opt for p in frozen)
    trained = {n: p for n, p in adapter.module.named_parameters() if param_role(n) != "frozen"}
    assert set(PowerEMA(trained, 0.75).shadow) == set(trained)
