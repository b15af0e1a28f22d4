"""The cosmos3 adapter on the tiny config: build, recipe structure, batched predictions against single
requests and against diffusers' own Cosmos3OmniPipeline, export and warm start."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from diffusers import Cosmos3OmniTransformer  # noqa: E402
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (  # noqa: E402
    _EMBODIMENT_TO_DOMAIN_ID,
    CosmosActionCondition,
)
from PIL import Image  # noqa: E402

from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, image_key  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.models.base import compile_blocks  # noqa: E402
from wamkit.models.cosmos3 import export_diffusers  # noqa: E402
from wamkit.models.cosmos3.towers import param_role  # noqa: E402

IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")
STEPS = {"num_inference_steps": 3}


def make_batch(b: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    batch = {
        image_key(c): torch.from_numpy(rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8))
        for c in IO.cameras
    }
    batch[OBS_STATE] = torch.zeros(b, 8)
    batch[TASK] = [
        ["put the black bowl on the plate", "open the top drawer of the cabinet"][i % 2] for i in range(b)
    ]
    batch[ACTION] = torch.from_numpy(rng.uniform(-1, 1, (b, 16, 10)).astype(np.float32))
    batch[ACTION_IS_PAD] = torch.zeros(b, 16, dtype=torch.bool)
    return batch


# prompts of three lengths: packed requests whose text segments differ
UNEVEN_TASKS = [
    "stop",
    "put the black bowl on the plate",
    "open the top drawer of the cabinet and put the bowl in it",
]


def rows(batch: dict, sl: slice) -> dict:
    return {k: v[sl] for k, v in batch.items()}


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(2)
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options=STEPS), IO)


def test_build_freezes_the_understanding_tower_and_groups_the_rest(adapter):
    m = adapter.module
    assert isinstance(m, Cosmos3OmniTransformer) and m.config.action_dim == 10 and m.action_gen
    non_embedding = sum(
        p.numel() for n, p in m.named_parameters() if not n.startswith(("embed_tokens", "lm_head"))
    )
    assert 200_000 < non_embedding < 1_000_000
    groups = {g.name: g for g in adapter.param_groups()}
    assert groups["action_heads"].lr_mult == 5.0
    trained = {id(p) for g in groups.values() for p in g.params}
    for name, p in m.named_parameters():
        assert p.requires_grad == (id(p) in trained), name
        assert p.requires_grad == (param_role(name) != "frozen"), name
    names = {n for n, p in m.named_parameters() if p.requires_grad}
    assert "layers.0.mlp_moe_gen.up_proj.weight" in names and "layers.0.mlp.up_proj.weight" not in names
    assert {"proj_in.weight", "proj_out.weight", "time_embedder.linear_1.weight"} <= names
    assert "embed_tokens.weight" not in names and "action_proj_in.fc.weight" in names
    assert [type(b).__name__ for b in adapter.blocks()] == ["Cosmos3VLTextMoTDecoderLayer"] * 4
    assert adapter.flops_per_sample() > 0


def test_bad_options_name_the_key():
    with pytest.raises(ConfigError, match="model.options.resolution_tir"):
        build_model(ModelConfig(name="cosmos3", preset="tiny", options={"resolution_tir": 256}), IO)
    with pytest.raises(ConfigError, match="model.options.view_point"):
        build_model(ModelConfig(name="cosmos3", preset="tiny", options={"view_point": "top"}), IO)
    with pytest.raises(ConfigError, match="model.preset: 'huge'"):
        build_model(ModelConfig(name="cosmos3", preset="huge"), IO)
    with pytest.raises(ConfigError, match="not a diffusers Cosmos3 folder"):
        build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained="/nonexistent"), IO)


def test_batched_predictions_equal_single_requests_in_one_call_per_step(adapter):
    """The stock path: all requests packed into one diffusers forward per step (the fast path's
    equality to it is tests/test_cosmos3_fast.py's), in each attention mode, for requests whose prompts
    (so text segments) differ in length."""
    batch = {**make_batch(3), TASK: UNEVEN_TASKS}
    adapter.options.fast_inference = False
    calls = []
    handle = adapter.module.register_forward_hook(lambda *a: calls.append(1))
    try:
        alone = [adapter.predict(rows(batch, slice(i, i + 1)), seed=7 + i)["actions"][0] for i in range(3)]
        calls.clear()
        packed = {}
        for attention in ("mask", "loop", "flex"):
            adapter.processor.mode = attention
            packed[attention] = adapter.predict(batch, seed=7)["actions"]
        n_calls = len(calls)
        adapter.processor.mode = "mask"
        again = adapter.predict(batch, seed=7)["actions"]
        other_seed = adapter.predict(rows(batch, slice(0, 1)), seed=8)["actions"][0]
    finally:
        adapter.processor.mode = "mask"
        adapter.options.fast_inference = True
        handle.remove()
    assert n_calls == 3 * STEPS["num_inference_steps"]  # all 3 requests in each step's one call
    for both in packed.values():
        assert both.shape == (3, 16, 10) and both.dtype == np.float32
        for i in range(3):  # request i draws from seed + i, whatever else is in the call
            # 3 packed requests against 1: each of the 3 steps' reordered sums (192 wide, 4 deep)
            assert_rounding_close(both[i], alone[i], length=3 * 192 * 4)
    assert_rounding_close(packed["flex"], packed["mask"], length=3 * 192 * 4)
    np.testing.assert_array_equal(again, packed["mask"])
    assert not np.allclose(other_seed, alone[0])


def test_flex_block_masks_of_a_packed_layout_are_its_attention_masks(adapter):
    """Element by element (``mask_mod`` over the whole grid) and block by block (the tables of
    ``create_block_mask``), for the layout of requests with prompts of different lengths."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    adapter.options.fast_inference = False
    try:
        adapter.predict({**make_batch(3), TASK: UNEVEN_TASKS}, seed=0)
    finally:
        adapter.options.fast_inference = True
    lay = adapter.processor.layout
    assert len({e - s for s, e in lay.und_bounds}) == 3
    assert lay.flex_block_masks() is lay.flex_block_masks()  # built once per layout
    for bm, dense in zip(lay.flex_block_masks(), lay.attention_masks()):
        q_len, kv_len = bm.seq_lengths
        assert (q_len, kv_len) == tuple(dense.shape)
        torch.testing.assert_close(create_mask(bm.mask_mod, None, None, q_len, kv_len, "cpu")[0, 0], dense)
        ref = create_block_mask(bm.mask_mod, None, None, q_len, kv_len, device="cpu")
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            torch.testing.assert_close(getattr(bm, name), getattr(ref, name), rtol=0, atol=0, msg=name)


def test_flex_training_on_the_cpu_takes_the_masked_call_and_says_so(adapter, caplog):
    """flex_attention has no CPU backward: calls that need gradients (the generation pathway; the frozen
    understanding tower's need none) use "mask", with the same gradients as "mask" itself."""
    batch = make_batch(2, seed=1)
    weight = adapter.module.layers[1].mlp_moe_gen.up_proj.weight
    grads = {}
    try:
        for attention in ("mask", "flex"):
            adapter.processor.mode = attention
            torch.manual_seed(0)
            adapter.module.zero_grad()
            with caplog.at_level("INFO", logger="wamkit.models.cosmos3.packing"):
                adapter.sft_loss(batch)["loss"].backward()
            grads[attention] = weight.grad.clone()
    finally:
        adapter.processor.mode = "mask"
        adapter.module.zero_grad()
    assert caplog.text.count("no CPU backward in flex_attention") == 1
    # the frozen tower's calls take flex in one and masked sdpa in the other: one pass's reordered sums
    # (192 wide, 4 deep) forward and back
    assert_rounding_close(grads["flex"], grads["mask"], length=2 * 192 * 4)


def test_gradient_checkpointing_recomputes_within_the_packed_requests(adapter):
    batch = make_batch(2, seed=1)
    layer = adapter.module.layers[1].mlp_moe_gen.up_proj.weight
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            adapter.module.enable_gradient_checkpointing()
        torch.manual_seed(0)
        adapter.module.zero_grad()
        adapter.sft_loss(batch)["loss"].backward()
        grads.append(layer.grad.clone())
    adapter.module.disable_gradient_checkpointing()
    adapter.module.zero_grad()
    # the recompute runs the same kernels on the same shapes, but in another order of the backward's
    # accumulations: one pass's reordered sums (192 wide, 4 deep) forward and back
    assert_rounding_close(grads[1], grads[0], length=2 * 192 * 4)


@pytest.mark.parametrize("attention", [pytest.param("mask", marks=pytest.mark.slow), "flex"])
def test_compiled_blocks_under_checkpointing_give_the_eager_gradients(attention):
    """``train.compile`` compiles each block. Everything a layer reads besides its inputs (the masks,
    the one-time notice of the masked fallback) is settled before the layers run, so every layer and its
    recomputation under checkpointing trace one graph: settled by the first layer, that layer traced a
    graph of its own and its recomputation, picking the others', saved other tensors (refused). The
    packed length changes with the captions, so the blocks compile for dynamic shapes."""
    out, graphs = {}, []
    for compiled in (True, False):  # compiled first: a fresh processor, as a run's first step has
        torch.manual_seed(0)
        options = STEPS | {"attention": attention}
        ad = build_model(ModelConfig(name="cosmos3", preset="tiny", options=options), IO)
        ad.module.enable_gradient_checkpointing()
        if compiled:
            torch._dynamo.reset()
            compile_blocks(ad)
        torch.manual_seed(0)
        # two batches whose prompts differ in length: the packed sequences do (one graph serves both)
        for seed, tasks in ((1, UNEVEN_TASKS[1:]), (2, UNEVEN_TASKS[:2])):
            batch = make_batch(2, seed=seed)
            batch[TASK] = list(tasks)
            ad.module.zero_grad()
            loss = ad.sft_loss(batch)["loss"]
            loss.backward()
            out[compiled, seed] = (loss.detach(), ad.module.layers[1].mlp_moe_gen.up_proj.weight.grad.clone())
            graphs.append(layer_graphs(ad))
    torch._dynamo.reset()
    # compiled for dynamic shapes: the second batch's lengths compile nothing new (for one shape, each
    # new length was a new graph, up to dynamo's recompile limit)
    assert graphs[0] == graphs[1] > 0, graphs[:2]
    # inductor fuses and reorders the fp32 sums: one pass's reordered sums (192 wide, 4 deep) forward
    # and back, as for the recompute above
    for seed in (1, 2):
        for got, want in zip(out[True, seed], out[False, seed]):
            assert_rounding_close(got, want, length=2 * 192 * 4)


def layer_graphs(ad) -> int:
    """How many compiled entries the decoder layers' forward holds (all layers share its code)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(type(ad.module.layers[0]).forward.__code__))


@pytest.mark.slow
def test_compiled_blocks_call_flex_attention_apart_and_keep_one_graph_over_lengths():
    """Flex attention runs outside a compiled block (a graph break): traced into it, the block mask's
    lengths were guards, a new graph per packed length; the CPU's inductor flex template does not build
    for dynamic shapes at all. Forward only: the CPU has flex attention without gradients."""
    torch.manual_seed(0)
    ad = build_model(ModelConfig(name="cosmos3", preset="tiny", options=STEPS | {"attention": "flex"}), IO)
    with torch.no_grad():
        batches = []
        for seed, tasks in ((1, UNEVEN_TASKS[1:]), (2, UNEVEN_TASKS[:2]), (3, UNEVEN_TASKS[::2])):
            batches.append(make_batch(2, seed=seed))
            batches[-1][TASK] = list(tasks)
        torch.manual_seed(0)
        eager = [ad.sft_loss(b)["loss"] for b in batches]
        torch._dynamo.reset()
        compile_blocks(ad)
        torch.manual_seed(0)
        compiled, graphs = [], []
        for b in batches:
            compiled.append(ad.sft_loss(b)["loss"])
            graphs.append(layer_graphs(ad))
    torch._dynamo.reset()
    assert graphs[1] == graphs[2] > 0, graphs  # the third length compiles nothing new
    for got, want in zip(compiled, eager):
        assert_rounding_close(got, want, length=192 * 4)  # one forward's reordered sums


def test_policy_matches_diffusers_pipeline(adapter):
    """Our sampler for one request reproduces Cosmos3OmniPipeline. diffusers refuses domain "libero"
    (no canonical width), so both run domain "bridge_orig_lerobot", which is 10-D like ours; and the
    pipeline's caption has neither cosmos' LIBERO view description nor idle_frame, so both are off."""
    ad = adapter
    batch = make_batch(1, seed=3)
    libero_id, ad.domain_id = ad.domain_id, _EMBODIMENT_TO_DOMAIN_ID["bridge_orig_lerobot"]
    desc, ad.options.view_description = ad.options.view_description, ""
    ad.inference_idle_frames = None
    try:
        ours = ad.predict(batch, seed=11)["actions"][0]
    finally:
        ad.domain_id, ad.options.view_description, ad.inference_idle_frames = libero_id, desc, 0
    frame = np.concatenate([batch[image_key(c)][0].numpy() for c in IO.cameras], axis=1)
    cond = CosmosActionCondition(
        mode="policy",
        chunk_size=16,
        domain_name="bridge_orig_lerobot",
        resolution_tier=256,
        image=Image.fromarray(frame),
        view_point="concat_view",
    )
    # the processor keeps the layout of the adapter's last packed call (gradient checkpointing needs
    # it); the pipeline's own forward is one unpacked request
    ad.processor.layout = None
    ref = ad.pipe(
        batch[TASK][0],
        action=cond,
        fps=20.0,
        num_inference_steps=3,
        guidance_scale=1.0,
        use_system_prompt=False,
        generator=torch.Generator("cpu").manual_seed(11),
        output_type="latent",
        enable_safety_check=False,
    ).action[0]
    assert_rounding_close(ours, ref.numpy(), length=3 * 192 * 4)  # 3 steps of another call layout


def test_forward_and_inverse_dynamics(adapter):
    batch = make_batch(1)
    out = adapter.predict(batch, "forward_dynamics", seed=0, actions=np.zeros((1, 16, 10), np.float32))
    video, frames = out["video"], out["frames"]
    assert video.dtype == np.uint8 and video.shape == (1, 17, 64, 128, 3)  # all 16 future frames rolled out
    np.testing.assert_array_equal(frames, video[:, -1])  # the two views' canvas content, last frame
    clip = {image_key(c): np.stack([255 - batch[image_key(c)].numpy()] * 16, axis=1) for c in IO.cameras}
    acts = adapter.predict(batch, "inverse_dynamics", seed=0, goal_images=clip)["actions"]
    assert acts.shape == (1, 16, 10) and np.isfinite(acts).all()
    goal = {image_key(c): 255 - batch[image_key(c)] for c in IO.cameras}  # one goal frame, held
    held = adapter.predict(batch, "inverse_dynamics", seed=0, goal_images=goal)["actions"]
    np.testing.assert_array_equal(held, acts)
    policy = adapter.predict(batch, seed=0, return_frames=True)
    assert policy["video"].shape == (1, 17, 64, 128, 3) and policy["actions"].shape == (1, 16, 10)
    with pytest.raises(ValueError, match="forward_dynamics needs actions of shape"):
        adapter.predict(batch, "forward_dynamics", actions=np.zeros((2, 8, 10)))


def test_export_loads_in_diffusers_with_identical_outputs_and_warm_starts(adapter, tmp_path):
    with torch.no_grad():  # make the heads and towers non-trivial so a skipped weight would show
        for p in adapter.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    out = tmp_path / "export"
    adapter.export_extra(out)  # export_diffusers, then reloaded and compared bit for bit
    saved = json.loads((out / "wamkit.json").read_text())
    assert saved["preset"] == "tiny" and saved["options"]["base"] == ""
    loaded = Cosmos3OmniTransformer.from_pretrained(str(out), subfolder="transformer")
    sd, sd2 = adapter.module.state_dict(), loaded.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        torch.testing.assert_close(sd[k], sd2[k], rtol=0, atol=0, msg=k)

    assert export_diffusers(adapter, tmp_path / "again") == tmp_path / "again"
    batch = make_batch(2, seed=5)
    warm = build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained=str(out), options=STEPS), IO)
    assert warm.config_dict()["options"]["base"] == str(out.resolve())  # a saved copy rebuilds from here
    np.testing.assert_array_equal(
        warm.predict(batch, seed=1)["actions"], adapter.predict(batch, seed=1)["actions"]
    )


def test_a_folder_without_action_heads_gets_fresh_ones_and_says_so(adapter, tmp_path, caplog):
    base = tmp_path / "base"
    adapter.pipe.save_pretrained(str(base))
    cfg = json.loads((base / "transformer" / "config.json").read_text())
    cfg.update(action_gen=False, action_dim=None)  # a base model without action heads
    (base / "transformer" / "config.json").write_text(json.dumps(cfg))
    bare = Cosmos3OmniTransformer.from_config(cfg)
    bare.load_state_dict(
        {k: v for k, v in adapter.module.state_dict().items() if not k.startswith("action_")}, strict=True
    )
    bare.save_pretrained(str(base / "transformer"))
    with caplog.at_level("INFO", logger="wamkit.models.cosmos3.components"):
        ad = build_model(ModelConfig(name="cosmos3", preset="tiny", pretrained=str(base), options=STEPS), IO)
    assert "initialised afresh" in caplog.text and "holds none" in caplog.text
    assert ad.module.config.action_dim == 10 and ad.module.action_modality_embed.abs().sum() == 0
    sd = adapter.module.state_dict()
    for k, v in ad.module.state_dict().items():
        if not k.startswith("action_"):
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0, msg=k)
    with pytest.raises(ConfigError, match="reinit_action_heads"):
        build_model(
            ModelConfig(
                name="cosmos3", preset="tiny", pretrained=str(base), options={"reinit_action_heads": False}
            ),
            IO,
        )


def test_shape_constraints_of_a_config_are_checked():
    from wamkit.models.cosmos3.presets import PRESETS, check_transformer_config

    for name, (tcfg, vcfg) in PRESETS.items():
        check_transformer_config(tcfg, name)
        assert tcfg["latent_channel"] == vcfg["z_dim"], name
    tiny = PRESETS["tiny"][0]
    with pytest.raises(ConfigError, match=r"sum\(rope_axes_dim\)=12 must equal head_dim/2=8"):
        check_transformer_config({**tiny, "rope_axes_dim": [4, 4, 4]}, "cfg.json")
    with pytest.raises(ConfigError, match="patch_latent_dim=30 must equal latent_channel"):
        check_transformer_config({**tiny, "patch_latent_dim": 30}, "cfg.json")
