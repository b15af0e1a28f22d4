"""Cosmos3 weights through the upstream layouts and back: cosmos-framework's full_weights.pt (RLinf's
SFT output), cosmos' net.* DCP directory, a diffusers folder. Synthetic checkpoints of the tiny preset,
in exactly those key layouts; every hop verified bit for bit, the end loaded by stock diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from diffusers import Cosmos3OmniTransformer  # noqa: E402

from wamkit.cli import main as wamkit  # noqa: E402
from wamkit.config import ModelConfig  # noqa: E402
from wamkit.constants import TASK  # noqa: E402
from wamkit.export import cosmos_formats as cf  # noqa: E402
from wamkit.models import build_model  # noqa: E402

from .test_cosmos3_model import IO, STEPS, make_batch  # noqa: E402

# The script's attention renames (diffusers scripts/convert_cosmos3_to_diffusers.py, removed in
# diffusers db44fe66; last at 278ed5ef, lines 518-531), applied here independently of wamkit's table.
SCRIPT_ATTN = [
    (".q_proj_moe_gen.", ".add_q_proj."), (".k_proj_moe_gen.", ".add_k_proj."),
    (".v_proj_moe_gen.", ".add_v_proj."), (".o_proj_moe_gen.", ".to_add_out."),
    (".q_norm_moe_gen.", ".norm_added_q."), (".k_norm_moe_gen.", ".norm_added_k."),
    (".q_proj.", ".to_q."), (".k_proj.", ".to_k."), (".v_proj.", ".to_v."), (".o_proj.", ".to_out."),
    (".q_norm.", ".norm_q."), (".k_norm.", ".norm_k."),
]  # fmt: skip
SCRIPT_MODULES = {"vae2llm": "proj_in", "llm2vae": "proj_out", "action2llm": "action_proj_in",
                  "llm2action": "action_proj_out"}  # fmt: skip
SCRIPT_TIME = {"mlp.0": "linear_1", "mlp.2": "linear_2"}


def script_key(net_key: str) -> str:
    """How the conversion script names a cosmos ``net`` key in diffusers (its steps, re-done here)."""
    if net_key.startswith("language_model."):
        k = net_key[len("language_model.") :].removeprefix("model.")
        for old, new in SCRIPT_ATTN:
            if old in k:
                return k.replace(old, new)
        return k
    head, _, rest = net_key.partition(".")
    if head == "time_embedder":
        sub, _, leaf = rest.rpartition(".")
        return f"time_embedder.{SCRIPT_TIME[sub]}.{leaf}"
    return f"{SCRIPT_MODULES[head]}.{rest}" if head in SCRIPT_MODULES else net_key


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(2)
    ad = build_model(ModelConfig(name="cosmos3", preset="tiny", options=STEPS), IO)
    with torch.no_grad():  # non-trivial heads and towers: a dropped or misplaced tensor would show
        for p in ad.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return ad


def one_forward(module, ad, width: int):
    """One transformer call on a fixed request; returns (vision velocity, first 10 action channels)."""
    batch = make_batch(1, seed=4)
    views = ad._views(batch)
    x0 = ad._encode([[v] for v in views])
    hw = ad._canvas_hw(views[0])
    c, _, h, w = x0.shape[1:]
    t_lat = ad._latent_frames()
    layout = ad._layout([ad.prompt(batch[TASK][0], hw, 0)], hw, (c, t_lat, h, w), (0,), ())
    ad.processor.layout = layout
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, c, t_lat, h, w, generator=g)
    acts = torch.zeros(16, width)
    acts[:, :10] = torch.randn(16, 10, generator=g)
    t = torch.tensor(500.0)
    kw = layout.forward_kwargs(
        [lat],
        t.expand(sum(layout.num_noisy_vision_tokens)),
        [acts],
        t.expand(sum(layout.num_noisy_action_tokens)),
        [torch.tensor([ad.domain_id])],
    )
    with torch.no_grad():
        pv, _, pa = module(**kw)
    return pv[0], pa[0][:, :10]


def test_key_mapping_is_the_conversion_scripts(adapter):
    sd = adapter.module.state_dict()
    for k in sd:
        net_key = cf.diffusers_to_cosmos_key(k)
        assert cf.cosmos_to_diffusers_key(net_key) == k
        if not k.startswith("action_modality_embed"):
            assert script_key(net_key) == k, (k, net_key)
    assert cf.diffusers_to_cosmos_key("layers.0.self_attn.to_add_out.weight") == (
        "language_model.model.layers.0.self_attn.o_proj_moe_gen.weight"
    )
    with pytest.raises(cf.FormatError, match="no diffusers"):
        cf.cosmos_to_diffusers_key("mystery.weight")


def test_chain_both_ways_and_stock_diffusers_gives_the_same_actions(adapter, tmp_path):
    ours = tmp_path / "ours"
    adapter.export_extra(ours)  # a 10-wide diffusers pipeline folder
    pt = cf.write_cosmos_pt(cf.read_any(ours), tmp_path / "full_weights.pt")
    raw = torch.load(pt, weights_only=True)
    assert "omni.net.language_model.model.layers.0.self_attn.q_proj_moe_gen.weight" in raw
    assert raw["omni.net.llm2action.bias.weight"].shape[1] == 64  # padded to max_action_dim
    dcp_dir = cf.write_cosmos_dcp(cf.read_any(pt), tmp_path / "model_dcp")
    assert (dcp_dir / "model" / ".metadata").is_file()
    back = cf.write_diffusers(cf.read_any(dcp_dir), tmp_path / "diffusers", base=ours)

    stock = Cosmos3OmniTransformer.from_pretrained(str(back), subfolder="transformer")
    assert stock.config.action_dim == 64
    v64, a64 = one_forward(stock, adapter, 64)
    v10, a10 = one_forward(adapter.module, adapter, 10)
    # a 64-wide matmul over zero-padded inputs sums in another order, and the action tokens reach the
    # vision tokens through attention: equal to the rounding of width x depth reordered sums
    depth = adapter.module.config.num_hidden_layers
    assert_rounding_close(v64, v10, length=64 * depth)
    assert_rounding_close(a64, a10, length=64 * depth)

    warm = build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained=str(back), options=STEPS), IO)
    batch = make_batch(2, seed=6)
    np.testing.assert_array_equal(
        warm.predict(batch, seed=2)["actions"], adapter.predict(batch, seed=2)["actions"]
    )

    # and back: diffusers -> DCP -> full_weights.pt, each the same 64-wide weights
    wide = cf.read_any(back)
    again = cf.write_cosmos_pt(cf.read_any(cf.write_cosmos_dcp(wide, tmp_path / "dcp2")), tmp_path / "w2.pt")
    cf.verify_same(wide, cf.read_any(again), again)


def test_full_weights_ema_and_the_cli(adapter, tmp_path):
    sd = adapter.module.state_dict()
    net = cf.to_cosmos(sd)
    blob = {f"omni.net.{k}": v for k, v in net.items()}
    blob |= {f"omni.net_ema.{k}": v + 1 for k, v in net.items()}
    blob["omni.net.language_model.model.visual.patch_embed.weight"] = torch.ones(2)  # no diffusers home
    torch.save(blob, tmp_path / "full_weights.pt")
    plain = cf.read_any(tmp_path / "full_weights.pt")
    ema = cf.read_any(tmp_path / "full_weights.pt", ema=True)
    cf.verify_same(sd, plain, tmp_path)
    torch.testing.assert_close(ema["proj_in.weight"], sd["proj_in.weight"] + 1, rtol=0, atol=0)

    out = tmp_path / "dcp"
    argv = ["convert", str(tmp_path / "full_weights.pt"), "--out", str(out), "--to", "cosmos-dcp", "--ema"]
    assert wamkit(argv) == 0
    got = cf.read_any(out)
    torch.testing.assert_close(got["proj_in.weight"], ema["proj_in.weight"], rtol=0, atol=0)
    assert wamkit(argv) == 1  # exists: refused without --overwrite
    # a cosmos layout has no architecture config: a diffusers output needs --base
    assert wamkit(["convert", str(out), "--out", str(tmp_path / "d"), "--to", "diffusers"]) == 1
