"""Serving with the understanding tower in host memory (``serve.text_tower``, issue 52 item 5) and the
serving memory plan that picks it (item 6).

The host path is a separate code path (the tower's layers copied one at a time into two device-resident
slots, :mod:`wamkit.models.cosmos3.host_tower`) that runs on the CPU too, where the "device" is the
host. Its kernels, shapes, dtypes and order are the device path's, so the actions must be bit-equal,
not merely close: an inexact copy or a slot holding the wrong layer's weights breaks that.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.cli import main as wamkit  # noqa: E402
from wamkit.config import ConfigError, ModelConfig, ServeConfig, load_config  # noqa: E402
from wamkit.serve import plan  # noqa: E402
from wamkit.serve.loading import random_init  # noqa: E402
from wamkit.train.memory import GiB  # noqa: E402

from .test_cosmos3_fast import IO, TASKS, make_batch  # noqa: E402

OPTS = {"num_inference_steps": 4, "dtype": "float32"}
# the command of docs/serve.md ("Serving in 24 GB") and docs/cosmos3.md, as written there
PLAN = ["serve", "--random-init", "--model", "cosmos3", "--preset", "nano", "--plan",
        "--device-memory", "24GB,48GB,80GB,141GB"]  # fmt: skip
PLAN_24 = ["serve", "--random-init", "--model", "cosmos3", "--preset", "nano", "--plan", "--device-memory", "24GB",
           "--max-batch", "8", "--option", "text_cache_size=32"]  # fmt: skip
# Cosmos3-Nano's parameters (docs/cosmos3.md, REFERENCE): the understanding tower with the embeddings
# and LM head 8.191B, the generation tower with projections, time embedder and heads 6.968B
NANO_FROZEN, NANO_GEN = 8.191e9, 6.968e9


def _policies():
    torch.set_num_threads(2)
    device = random_init("cosmos3", "tiny", OPTS, device="cpu", io=IO, text_tower="device")
    host = random_init("cosmos3", "tiny", OPTS, device="cpu", io=IO, text_tower="host")
    return device, host


def _count_calls(modules) -> list[int]:
    calls = []
    for m in modules:
        m.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_the_host_tower_gives_the_default_servers_actions_bit_for_bit():
    """Same weights (hash), same seeds: the same actions, for a first prompt, for a second prompt
    computed while the first is cached, and for a mixed batch of cached and new prompts; the host
    server's text comes from the streamed slots, never from the module's own layers."""
    dev, host = _policies()
    assert dev.identity()["weights_sha256"] == host.identity()["weights_sha256"]
    tower = host.adapter.fast.text_tower
    assert tower is not None and dev.adapter.fast.text_tower is None
    own = _count_calls(layer.self_attn.to_k for layer in host.adapter.module.layers)
    streamed = _count_calls(slot.self_attn.to_k for slot in tower.slots)
    cache = host.adapter.fast.cache
    n_layers = len(host.adapter.module.layers)
    for tasks, misses in ((TASKS[:1], 1), (TASKS[1:2], 2), (TASKS, 3), (TASKS[::-1], 3)):
        want = dev.adapter.predict(make_batch(tasks), seed=7)["actions"]
        got = host.adapter.predict(make_batch(tasks), seed=7)["actions"]
        assert np.array_equal(want, got), f"{tasks}: max difference {np.abs(want - got).max()}"
        assert cache.misses == misses and len(streamed) == misses * n_layers
    assert cache.hits == 2 + 3 and not own  # the third batch: two cached prompts and a new one


def test_the_host_tower_serves_policy_mode_only():
    _, host = _policies()
    batch = make_batch(TASKS[:1])
    with pytest.raises(ValueError, match=r"serve.text_tower=host.*policy mode only"):
        host.adapter.predict(batch, mode="forward_dynamics", actions=np.zeros((1, 16, 10), np.float32))


def test_the_setting_is_checked_by_name():
    with pytest.raises(ConfigError, match=r"serve\.text_tower: 'gpu' is not allowed; expected one of"):
        load_config(None, ["serve.text_tower=gpu"])
    with pytest.raises(ConfigError, match=r"serve\.text_tower: expected one of auto, device, host"):
        ServeConfig(text_tower="gpu")
    with pytest.raises(ConfigError, match=r"serve\.text_tower=host: model 'tiny' has no separate text tower"):
        random_init("tiny", "small", device="cpu", text_tower="host")
    with pytest.raises(ConfigError, match=r"serve\.text_tower=host: model 'tiny' has no separate text tower"):
        plan.resolve_text_tower(
            "host", ModelConfig(name="tiny", preset="small"), None, None, torch.device("cpu"), 8
        )


def _sections(out: str) -> dict[str, str]:
    return dict(re.findall(r"== (\S+) device ==\n(.*?)\n\n", out, re.S))


def _rows(section: str) -> dict[str, tuple[float, str]]:
    return {
        m[0].strip(): (float(m[1]), m[2])
        for m in re.findall(r"^  (\D.*?)\s+([\d.]+)  (device|host)$", section, re.M)
    }


@pytest.mark.slow
def test_plan_nano(capsys):
    """The plan of full Nano, from shapes (the model built on the meta device): on 24 GB the tower goes
    to the host and the plan names the batch and text cache that fit; from 48 GB on everything stays
    on the device. The weights' rows are Nano's parameter counts times bf16's two bytes."""
    assert wamkit(PLAN) == 0
    out = capsys.readouterr().out
    picks = dict(re.findall(r"^  (\S+): (.*)$", out.split("what fits:\n")[1], re.M))
    assert picks["24GB"].startswith("does not fit as asked; serve.text_tower=host serve.max_batch=")
    for size in ("48GB", "80GB", "141GB"):
        assert picks[size].startswith("serve.text_tower=device"), picks[size]
    s24, s80 = _sections(out)["24GB"], _sections(out)["80GB"]
    host_rows = _rows(s24.split("serving plan:")[2])  # the plan that fits
    assert host_rows["understanding tower"][1] == "host" and _rows(s80)["understanding tower"][1] == "device"
    assert host_rows["understanding tower"][0] == pytest.approx(NANO_FROZEN * 2 / GiB, abs=0.01)
    assert host_rows["generation tower and heads"][0] == pytest.approx(NANO_GEN * 2 / GiB, abs=0.01)
    # the fitting settings do fit when planned with them
    batch = int(re.search(r"serve.max_batch=(\d+)", picks["24GB"]).group(1))
    cache = re.search(r"text_cache_size=(\d+)", picks["24GB"])
    model = ModelConfig(
        name="cosmos3", preset="nano", options={"text_cache_size": int(cache.group(1))} if cache else {}
    )
    again = plan.pick(plan.planning_adapter(model, None), "host", batch, 24 * 10**9, "cuda")
    assert again.fits and again.plan.text_tower == "host"
    # the settings of the GPU commands of docs/serve.md: auto picks host on 24 GB
    assert wamkit(PLAN_24) == 0
    assert "  24GB: serve.text_tower=host (" in capsys.readouterr().out


def test_a_size_where_nothing_fits_is_refused_naming_it(capsys):
    """A server would be refused on 24 GB at the defaults (max_batch 32, 128 cached prompts), naming the
    host placement's batch and cache that fit; on 16 GB nothing fits; both before anything is built."""
    assert wamkit(PLAN[:-1] + ["24GB"]) == 2
    err = capsys.readouterr().err
    assert (
        "config error: serving plan: 25.40 GiB needed on a 22.4 GiB device with serve.text_tower=host" in err
    )
    assert "serve.text_tower=host serve.max_batch=16 model.options.text_cache_size=64 fits" in err
    ad = plan.planning_adapter(ModelConfig(name="cosmos3", preset="nano"), None)
    p = plan.pick(ad, "auto", 32, 16 * 10**9, "cuda")
    assert not p.fits and p.instead is None
    assert "nothing fits this device" in str(plan.refusal(p))
    p = plan.pick(ad, "device", 8, 24 * 10**9, "cuda")
    assert not p.fits and p.instead is not None
    assert str(plan.refusal(p)).startswith("serving plan: ") and "serve.text_tower=host" in str(
        plan.refusal(p)
    )


@pytest.mark.slow
def test_a_serving_directory_is_planned_in_the_dtype_it_loads_in(tmp_path, capsys):
    """A serving directory is built on the CPU then moved: under dtype auto its weights are fp32, four
    bytes a parameter, and Nano's then fits 24 GB nowhere; with dtype bfloat16 it plans as the random
    preset does. Only model.json is read (no weights here)."""
    from wamkit.files import MODEL_FILE, model_json

    ad = plan.planning_adapter(ModelConfig(name="cosmos3", preset="nano"), None)
    for dtype, gen_bytes in (("auto", 4), ("bfloat16", 2)):
        folder = tmp_path / dtype
        folder.mkdir()
        config = ad.config_dict()
        config["options"] = {**config["options"], "dtype": dtype}
        (folder / MODEL_FILE).write_text(json.dumps(model_json(config)))
        assert wamkit(["serve", str(folder), "--plan", "--device-memory", "24GB,141GB"]) == 0
        out = capsys.readouterr().out
        weights = "float32" if gen_bytes == 4 else "bfloat16"
        assert f"{weights} weights" in out
        gen = _rows(_sections(out)["141GB"])["generation tower and heads"][0]
        assert gen == pytest.approx(NANO_GEN * gen_bytes / GiB, abs=0.01)
        fits_24 = "  24GB: nothing fits" not in out
        assert fits_24 == (gen_bytes == 2), out.split("what fits:")[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_streamed_tower_gives_the_default_servers_actions():
    """The CUDA path: the tower pinned, its layers copied on a side stream behind events, the
    compiled-and-captured step (the default on CUDA) reading the text from the cache. Same kernels on
    the same shapes: bit-equal actions expected; the tower's weights off the GPU."""
    dev = random_init(
        "cosmos3", "tiny", {"num_inference_steps": 4}, device="cuda", io=IO, text_tower="device"
    )
    host = random_init("cosmos3", "tiny", {"num_inference_steps": 4}, device="cuda", io=IO, text_tower="host")
    tower = host.adapter.fast.text_tower
    assert all(p.is_pinned() for half in tower.layers for p in half.parameters())
    assert host.adapter.module.embed_tokens.weight.device.type == "cpu"
    assert host.adapter.module.proj_in.weight.device.type == "cuda"
    for tasks in (TASKS[:1], TASKS, TASKS[::-1]):
        want = dev.adapter.predict(make_batch(tasks), seed=7)["actions"]
        got = host.adapter.predict(make_batch(tasks), seed=7)["actions"]
        assert np.array_equal(want, got), f"{tasks}: max difference {np.abs(want - got).max()}"
