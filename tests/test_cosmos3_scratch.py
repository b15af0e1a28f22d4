"""Cosmos3 on an embodiment of its own, trained from scratch: the options its profile gives, the state
token, and the caption a served model is asked with (tiny preset, fp32, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit import embodiments  # noqa: E402
from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.constants import ACTION, OBS_STATE, TASK, future_image_key, image_key  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.models.cosmos3.presets import PRESETS, check_transformer_config  # noqa: E402

# MetaWorld's shape: one camera, the robot's own 4-D state, 4-D actions, no idle-frame counts
IO = ModelIO(("corner",), 64, 4, 4, 16, "raw", "metaworld")
LIBERO_IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d", "libero")
# stock (packed requests) against fast (cached text keys/values): each sampling step's reordered sums
# (192 wide, 4 deep) over the 4 steps (tests/exactness.py)
LENGTH = 192 * 4 * 4


def build(io: ModelIO = IO, **options):
    opts = {"num_inference_steps": 4, "dtype": "float32", "caption_dropout": 0.0, **options}
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options=opts), io)


def make_batch(b: int = 3, seed: int = 0, io: ModelIO = IO, training: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    batch = {
        image_key(c): torch.from_numpy(rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8))
        for c in io.cameras
    }
    batch[OBS_STATE] = torch.from_numpy(rng.uniform(-1, 1, (b, io.state_dim)).astype(np.float32))
    batch[TASK] = ["open the drawer", "slide the plate", "open the door"][:b]
    if training:
        for c in io.cameras:
            batch[future_image_key(c)] = torch.from_numpy(
                rng.integers(0, 256, (b, 16, 64, 64, 3), dtype=np.uint8)
            )
        batch[ACTION] = torch.from_numpy(rng.uniform(-1, 1, (b, 16, io.action_dim)).astype(np.float32))
    return batch


def test_scratch_presets_satisfy_the_shape_constraints():
    for name in ("small", "mini"):
        transformer, vae = PRESETS[name]
        check_transformer_config(transformer, f"preset {name}")
        assert transformer["latent_channel"] == vae["z_dim"]
        assert transformer["num_attention_heads"] % transformer["num_key_value_heads"] == 0


def test_the_embodiment_profile_gives_domain_framing_and_fps():
    metaworld = embodiments.get("metaworld")
    ad = build()
    assert ad.options.domain_name == metaworld.cosmos3_domain == "metaworld"
    assert ad.domain_id == metaworld.cosmos3_domain_id == 31
    # a row of the heads diffusers builds that its own domain table leaves to no embodiment
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID

    assert 31 not in _EMBODIMENT_TO_DOMAIN_ID.values()
    assert ad.module.action_proj_in.num_domains > 31
    assert ad.options.view_point == "third_person_view"
    assert ad.options.view_description == ""
    assert ad.options.fps == float(metaworld.fps) == 80.0
    assert '"fps": 80.0' in ad.prompt("open the drawer", (64, 64), None)
    # the recipe's data keeps the recipe's options; a config's own value wins over the profile's
    lib = build(LIBERO_IO)
    assert (lib.options.domain_name, lib.domain_id, lib.options.view_point, lib.options.fps) == (
        "libero",
        5,
        "concat_view",
        20.0,
    )
    assert build(domain_name="libero", fps=20.0).domain_id == 5
    with pytest.raises(ConfigError, match=r"model\.options\.domain_name: 'sawyer'"):
        build(domain_name="sawyer")


def test_served_captions_are_the_training_captions():
    """A model is asked with the caption it was trained on: data without idle-frame counts trains on
    captions without the field, so inference leaves it out too (with "0 out of 16." a model trained
    from scratch read text it had never seen and failed every episode); data with counts is asked
    with 0, as cosmos' policy server does."""
    for io, idle in ((IO, None), (LIBERO_IO, 0)):
        ad = build(io)
        hw = ad._canvas_hw(np.zeros((64, 64 * len(io.cameras), 3), np.uint8))
        trained = ad._train_texts({TASK: ["open the drawer"]}, hw)[0]
        assert ad.inference_idle_frames == idle
        asked = ad.prompt("open the drawer", hw, ad.inference_idle_frames)
        if idle is None:
            assert asked == trained and "idle_frame" not in asked
        else:
            assert '"idle_frame": "0 out of 16."' in asked


def test_the_state_token_reaches_the_actions_and_trains():
    ad = build(state_token=True)
    assert ad.action_len == 17
    batch = make_batch(training=True)
    torch.manual_seed(0)
    out = ad.sft_loss(batch)
    out["loss"].backward()
    heads = ad.module.action_proj_in.fc.weight.grad.view(32, 4, -1)
    assert torch.isfinite(out["loss"]) and heads[31].abs().sum() > 0  # metaworld's row of the input head
    ad.module.zero_grad(set_to_none=True)

    obs = make_batch()
    acts = ad.predict(obs, seed=7)["actions"]
    assert acts.shape == (3, 16, 4)
    other = dict(obs, **{OBS_STATE: -obs[OBS_STATE]})
    moved = np.abs(ad.predict(other, seed=7)["actions"] - acts).max()
    # the fast path (default) against diffusers' forward over packed requests, with the held token
    ad.options.fast_inference = False
    try:
        stock = ad.predict(obs, seed=7)["actions"]
    finally:
        ad.options.fast_inference = True
    assert_rounding_close(acts, torch.as_tensor(stock), LENGTH)
    assert moved > 1e3 * np.abs(acts - stock).max() + 1e-6  # the state changes the answer
    # without the token, the state is not an input: the same actions for any state
    plain = build()
    same = plain.predict(obs, seed=7)["actions"], plain.predict(other, seed=7)["actions"]
    assert np.array_equal(*same)


def test_a_state_wider_than_the_action_heads_is_refused():
    with pytest.raises(ConfigError, match=r"state_token: the state \(8-D\) must fit the action heads' 4"):
        build(ModelIO(("corner",), 64, 8, 4, 16, "raw", "metaworld"), state_token=True)


def _vae_tensors(vae: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in vae.state_dict().items()}


def test_a_random_presets_vae_is_one_function_of_the_preset():
    """Checkpoints and serving directories do not hold a random preset's frozen VAE: the server
    rebuilds it, so it must be the encoder training saw. It was drawn from the global generator, so
    `wamkit serve` (another seed state; on a GPU, CUDA's generator) encoded the camera with other
    random convolutions than training and its cache did: a `small` Cosmos3 trained on the GPU failed
    all 90 held-out episodes. Now it is the same under any global seed, built whole or on meta (the
    trainer's path), in any dtype."""
    from wamkit.models.cosmos3.components import build_random

    torch.manual_seed(0)
    _, whole, _ = build_random("mini", 4, torch.device("cpu"), torch.float32)
    torch.manual_seed(1234)
    torch.randn(1000)
    _, sharded, _ = build_random("mini", 4, torch.device("meta"), torch.float32)
    _, half, _ = build_random("mini", 4, torch.device("cpu"), torch.bfloat16)
    ref = _vae_tensors(whole)
    assert ref.keys() == _vae_tensors(sharded).keys()
    for name, value in _vae_tensors(sharded).items():
        assert torch.equal(value, ref[name]), name
    for name, value in half.state_dict().items():
        if value.dtype == torch.bfloat16:
            assert torch.equal(value, ref[name].to(torch.bfloat16)), name
    # random, not constant: the encoder separates images
    assert any(v.ndim > 1 and v.std() > 0 for v in ref.values())
