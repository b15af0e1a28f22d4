"""``wamkit convert``: DCP checkpoint -> serving directory (weights, EMA), -> DCP again; verified and
atomic. The model is the registry's ``tiny``, trained here for a few steps on synthetic batches."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.test_train_support import tiny_data
from wamkit.config import load_config
from wamkit.export import ConversionError, checkpoint_to_serving, serving_to_dcp
from wamkit.export.cli_convert import main as convert_main
from wamkit.models.pretrained import load_pretrained
from wamkit.train import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    cfg = load_config(
        None,
        [
            f"train.run_dir={root / 'run'}",
            "model.options.width=64",
            "model.options.depth=2",
            "model.options.heads=2",
            "train.max_steps=4",
            "train.micro_batch=2",
            "train.global_batch=2",
            "train.save_interval=2",
            "train.log_interval=2",
            "train.ema=true",
            "train.ema_power=0.5",
        ],
    )
    return train(cfg, None, tiny_data)


def _reference(ckpt, tmp_path):
    dcp_to_torch_save(ckpt, tmp_path / "ref.pt")
    return torch.load(tmp_path / "ref.pt", weights_only=False)


def test_convert_cli_writes_a_verified_serving_dir_that_loads(run_dir, tmp_path, capsys):
    out = tmp_path / "serve"
    args = argparse.Namespace(src=str(run_dir), out=str(out), to="serve", ema=False, overwrite=False)
    assert convert_main(args) == 0  # a run dir: its newest checkpoint
    assert "step_000004" in capsys.readouterr().out
    ref = _reference(run_dir / "checkpoints" / "step_000004", tmp_path)["model"]
    got = load_file(out / "model.safetensors")
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert json.loads((out / "preprocess.json").read_text()) == json.loads(
        (run_dir / "preprocess.json").read_text()
    )
    adapter = load_pretrained(out)
    assert adapter.name == "tiny" and adapter.io.image_size == 64
    assert not out.with_name("serve.tmp").exists()
    assert convert_main(args) == 1  # exists: refused without --overwrite, before any work
    assert "--overwrite" in capsys.readouterr().err
    assert not out.with_name("serve.tmp").exists()  # no model-sized copy left beside it


def test_ema_export_takes_the_ema_of_trained_weights(run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_000004"
    ref = _reference(ckpt, tmp_path)
    out = checkpoint_to_serving(ckpt, tmp_path / "serve_ema", ema=True)
    got = load_file(out / "model.safetensors")
    trained = [k for k in ref["model"] if k in ref["ema"]]
    assert trained, "the EMA holds the trained weights"
    for k in ref["model"]:
        want = ref["ema"][k].to(ref["model"][k].dtype) if k in ref["ema"] else ref["model"][k]
        assert torch.equal(got[k], want), k
    assert any(not torch.equal(ref["ema"][k], ref["model"][k]) for k in trained)


def test_serving_to_dcp_and_back_is_bit_identical(run_dir, tmp_path):
    serve = checkpoint_to_serving(run_dir / "checkpoints" / "step_000002", tmp_path / "serve")
    dcp_dir = serving_to_dcp(serve, tmp_path / "dcp")
    back = _reference(dcp_dir, tmp_path)["model"]
    weights = load_file(serve / "model.safetensors")
    assert set(back) == set(weights) and all(torch.equal(back[k], weights[k]) for k in weights)


def test_incomplete_checkpoint_and_missing_ema_are_refused(run_dir, tmp_path):
    import shutil

    part = tmp_path / "step_000004"
    shutil.copytree(run_dir / "checkpoints" / "step_000004", part)
    (part / "meta.json").unlink()
    with pytest.raises(ConversionError, match="incomplete checkpoint"):
        checkpoint_to_serving(part, tmp_path / "x")
    args = argparse.Namespace(
        src=str(tmp_path / "nope"), out=str(tmp_path / "y"), to="serve", ema=False, overwrite=False
    )
    assert convert_main(args) == 2


def test_docs_list_what_a_serving_directory_holds(run_dir, tmp_path):
    """docs/convert.md's listing of a serving directory is what ``wamkit convert`` writes."""
    import re
    from pathlib import Path

    out = tmp_path / "serve"
    args = argparse.Namespace(src=str(run_dir), out=str(out), to="serve", ema=True, overwrite=False)
    assert convert_main(args) == 0
    doc = (Path(__file__).resolve().parents[1] / "docs" / "convert.md").read_text()
    listing = re.search(r"A serving directory holds (.*?)\. ", doc.replace("\n", " "))
    assert listing, "docs/convert.md no longer says what a serving directory holds"
    assert sorted(re.findall(r"`([^`]+)`", listing.group(1))) == sorted(p.name for p in out.iterdir())
    assert json.loads((out / "source.json").read_text())["ema"] is True
