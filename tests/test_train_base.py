"""Checkpoints hold what training changes: the trained weights, optimizer state and EMA, and the base's
reference with its content hash; resume and export verify the hash and refuse another base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from tests.exactness import assert_rounding_close
from wamkit.config import ConfigError, ModelConfig, load_config  # noqa: E402
from wamkit.data.synthetic import write_pattern_dataset  # noqa: E402
from wamkit.export import checkpoint_to_serving  # noqa: E402
from wamkit.export.checkpoint import ConversionError, load_checkpoint_weights  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3.components import export_diffusers  # noqa: E402
from wamkit.models.cosmos3.towers import param_role  # noqa: E402
from wamkit.train.loop import train  # noqa: E402
from wamkit.train.metrics import read_losses  # noqa: E402

from .conftest import REPO


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_pattern_dataset(tmp_path_factory.mktemp("base") / "ds", [5, 4], camera_dtype="image")


def _cfg(data: Path, run: Path, *overrides: str):
    return load_config(REPO / "configs" / "libero_10_cosmos3.yaml", [
        "model.preset=tiny", "model.pretrained=", "model.options.gradient_checkpointing=false",
        f"data.root={data}", "data.num_workers=0", "train.max_steps=4", "train.micro_batch=2",
        "train.global_batch=2", "train.precision=fp32", "train.device=cpu", "train.ema=true", "train.compile=false",
        "train.save_interval=2", "train.log_interval=1", f"train.run_dir={run}", *overrides,
    ])  # fmt: skip


def _keys(ckpt: Path) -> set[str]:
    return set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A base on disk: the tiny preset as a diffusers folder (the frozen weights a run reads)."""
    out = tmp_path_factory.mktemp("tiny_base") / "Cosmos3-tiny"
    io = build_model(ModelConfig(name="cosmos3", preset="tiny"), None).io
    export_diffusers(build_model(ModelConfig(name="cosmos3", preset="tiny"), io), out)
    return out


def test_a_checkpoint_holds_the_trained_part_and_the_base_hash(data, folder, tmp_path):
    run = tmp_path / "run"
    train(_cfg(data, run, f"model.pretrained={folder}"))
    ckpt = run / "checkpoints" / "step_000004"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["base"]["kind"] == "diffusers" and meta["base"]["path"] == str(folder.resolve())
    assert len(meta["base"]["sha256"]) == 64 and list(meta["base"]["file_sha256"]) == [
        "transformer/diffusion_pytorch_model.safetensors"
    ]
    keys = {k.removeprefix("model.") for k in _keys(ckpt) if k.startswith("model.")}
    adapter = build_model(ModelConfig(name="cosmos3", preset="tiny"), None)
    roles = {n: param_role(n) for n, _ in adapter.module.named_parameters()}
    assert keys == {n for n, r in roles.items() if r != "frozen"}  # no frozen tensor is saved
    assert {k.removeprefix("ema.") for k in _keys(ckpt) if k.startswith("ema.")} == keys
    # export: the frozen weights come from the base, the trained ones from the checkpoint
    exported = load_checkpoint_weights(ckpt)
    base = build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained=str(folder)), None)
    got, frozen = dict(exported.module.named_parameters()), dict(base.module.named_parameters())
    assert all(torch.equal(got[n], frozen[n]) for n, r in roles.items() if r == "frozen")
    moved = [n for n, r in roles.items() if r != "frozen" and not torch.equal(got[n], frozen[n])]
    assert moved  # training changed the trained part
    serving = checkpoint_to_serving(ckpt, tmp_path / "serve")
    assert (serving / "model.safetensors").is_file()


@pytest.mark.slow
def test_resume_and_export_refuse_another_base_naming_both_hashes(data, folder, tmp_path):
    run = tmp_path / "run"
    train(_cfg(data, run, f"model.pretrained={folder}", "train.max_steps=2"))
    saved = json.loads((run / "checkpoints" / "step_000002" / "meta.json").read_text())["base"]["sha256"]
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    f = other / "transformer" / "diffusion_pytorch_model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-4:] = b"\x00\x00\x80\x3f"  # one weight of the last tensor becomes 1.0
    f.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=rf"sha256 {saved[:16]}.*but this run's base is {other.resolve()}"):
        train(_cfg(data, run, f"model.pretrained={other}", "train.max_steps=4", "train.resume=auto"))
    # the checkpoint's base folder changed under it: export refuses too
    shutil.rmtree(folder.parent / "moved", ignore_errors=True)
    ckpt = run / "checkpoints" / "step_000002"
    meta_path = ckpt / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["base"]["path"] = str(other.resolve())
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(
        ConversionError, match=rf"trained on the base {other.resolve()} \(sha256 {saved[:16]}"
    ):
        load_checkpoint_weights(ckpt)


def test_the_tiny_preset_is_its_own_base_and_resumes_exactly(data, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(_cfg(data, full))
    meta = json.loads((full / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["base"]["kind"] == "preset" and meta["base"]["preset"] == "tiny"
    assert not any(k.startswith("model.embed_tokens") for k in _keys(full / "checkpoints" / "step_000004"))
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000004")
    train(_cfg(data, cut, "train.resume=auto"))
    assert read_losses(cut) == read_losses(full)  # one layout, the same kernels: to the bit


@pytest.mark.slow
def test_the_recipe_trains_with_its_layers_compiled(data, tmp_path):
    """train.compile (the recipe's setting): the trainer compiles each layer before sharding and trains
    to the eager run's losses, up to inductor's reordered fp32 sums (2 steps of a 192-wide, 4-deep
    model: one pass's sums forward and back per step, the second on weights the first updated)."""
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train(_cfg(data, eager, "train.max_steps=2"))
    torch._dynamo.reset()
    train(_cfg(data, compiled, "train.max_steps=2", "train.compile=true"))
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextMoTDecoderLayer
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    assert _debug_get_cache_entry_list(Cosmos3VLTextMoTDecoderLayer.forward.__code__)  # compiled, used
    torch._dynamo.reset()
    want, got = read_losses(eager), read_losses(compiled)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for g, w in zip(got, want):
        assert_rounding_close(g["loss"], w["loss"], length=2 * 2 * 192 * 4)
