"""Registry, byte tokenizer, and pretrained directories (save/load round trip)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.test_models_support import one_thread, random_batch  # noqa: F401
from wamkit.config import ConfigError, ModelConfig
from wamkit.models import ModelAdapter, ModelIO, build_model, registered_models
from wamkit.models.pretrained import load_pretrained, save_pretrained
from wamkit.models.text import PAD_ID, decode_ids, encode_texts

pytestmark = pytest.mark.usefixtures("one_thread")
IO = ModelIO(cameras=("corner", "wrist"), image_size=32, state_dim=9, action_dim=7, chunk=4)
OPTIONS = {"width": 64, "depth": 2, "heads": 2, "patch": 8, "world_weight": 0.2, "world_res": 16}


def test_registry_builds_tiny_and_names_unknown_models():
    assert "tiny" in registered_models()
    adapter = build_model(ModelConfig(name="tiny", options=OPTIONS), IO)
    assert isinstance(adapter, ModelAdapter) and adapter.io == IO
    with pytest.raises(ConfigError, match=r"model\.name: unknown model 'tinny'; did you mean 'tiny'"):
        build_model(ModelConfig(name="tinny"))


def test_byte_tokenizer():
    ids = encode_texts(["reach-v3", "", "ünïcode and a long tail"], length=10)
    assert ids.shape == (3, 10) and ids.dtype == torch.long
    assert ids[0, :8].tolist() == [b + 1 for b in b"reach-v3"] and ids[0, 8:].tolist() == [PAD_ID] * 2
    assert ids[1].tolist() == [PAD_ID] * 10
    assert decode_ids(ids[:2]) == ["reach-v3", ""]
    assert decode_ids(ids[2:])[0].startswith("ünïcode")  # cut at 10 bytes
    with pytest.raises(ValueError, match="task text 0: expected a string"):
        encode_texts([3], length=4)


def test_save_load_round_trip_is_exact(tmp_path):
    torch.manual_seed(0)
    adapter = build_model(ModelConfig(name="tiny", options=OPTIONS), IO)
    out = save_pretrained(adapter, tmp_path / "m")
    meta = json.loads((out / "model.json").read_text())
    assert meta["name"] == "tiny" and meta["io"]["cameras"] == ["corner", "wrist"]
    assert meta["options"]["width"] == 64 and meta["options"]["num_steps"] == 5  # fully resolved

    loaded = load_pretrained(out)
    for (k, v), (k2, v2) in zip(adapter.module.state_dict().items(), loaded.module.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    assert set(load_file(str(out / "model.safetensors"))) == set(adapter.module.state_dict())
    batch = random_batch(IO, 2)
    adapter.module.eval()
    np.testing.assert_array_equal(
        adapter.predict(batch, seed=3)["actions"], loaded.predict(batch, seed=3)["actions"]
    )

    # through the registry, as the server builds it; sampling options may change, inputs may not
    via_cfg = build_model(ModelConfig(name="tiny", pretrained=str(out), options={"num_steps": 2}), IO)
    assert via_cfg.cfg.num_steps == 2 and via_cfg.cfg.width == 64
    with pytest.raises(ValueError, match=r"the model expects inputs .*state_dim=9"):
        load_pretrained(out, io=ModelIO())
    with pytest.raises(ValueError, match="weights do not fit"):
        load_pretrained(out, options={"width": 128, "heads": 2})


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.json does not exist"):
        load_pretrained(tmp_path)
    (tmp_path / "model.json").write_text('{"format": "something else"}')
    with pytest.raises(
        ValueError, match=r"model\.json: expected a JSON object with \"format\": \"wamkit-model\""
    ):
        load_pretrained(tmp_path)
