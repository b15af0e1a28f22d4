"""The built-in model ``tiny``: options, losses, modes, sampling, caching, FLOPs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.exactness import assert_rounding_close
from tests.test_models_support import one_thread, random_batch  # noqa: F401
from wamkit.config import ConfigError, ModelConfig
from wamkit.constants import ACTION_IS_PAD, OBS_STATE, future_image_key, image_key
from wamkit.models import ModelIO, build_model
from wamkit.models.tiny.adapter import shifted_times
from wamkit.models.tiny.network import JointBlock

pytestmark = pytest.mark.usefixtures("one_thread")
IO = ModelIO(image_size=64, chunk=8)
FAST = {"width": 64, "depth": 2, "heads": 2, "text_len": 16}
WORLD = {**FAST, "world_weight": 0.5, "forward_dynamics_prob": 0.25, "inverse_dynamics_prob": 0.25}


def make(options=None, io=IO, preset="small"):
    torch.manual_seed(0)
    return build_model(ModelConfig(name="tiny", preset=preset, options=options or {}), io)


def test_preset_sizes():
    assert make().num_parameters() < 5e6
    with torch.device("meta"):  # shapes only: no memory, no init time
        base = make(preset="base").num_parameters()
        big = make(preset="1b").num_parameters()
    assert 80e6 < base < 130e6, base
    assert big >= 1e9, big


def test_options_are_checked_by_name_and_type():
    with pytest.raises(ConfigError, match=r"model\.options\.widht.*did you mean 'model\.options\.width'"):
        make({"widht": 64})
    with pytest.raises(ConfigError, match=r"model\.options\.depth: expected an integer"):
        make({"depth": "two"})
    with pytest.raises(ConfigError, match=r"model\.options\.heads: width 64 must be divisible by heads 3"):
        make({"width": 64, "heads": 3})
    with pytest.raises(ConfigError, match=r"model\.preset: unknown preset 'smal'.*did you mean 'small'"):
        make(preset="smal")


def test_loss_parts_and_every_trainable_parameter_gets_a_gradient():
    a = make(WORLD)
    out = a.sft_loss(random_batch(IO, 6))
    assert set(out) == {"action_loss", "world_loss", "loss"}
    torch.testing.assert_close(out["loss"], out["action_loss"] + 0.5 * out["world_loss"])
    out["loss"].backward()
    no_grad = [n for n, p in a.module.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


def test_mode_mixing_masks_the_right_loss():
    batch = random_batch(IO, 4)
    fd = make({**FAST, "world_weight": 1.0, "forward_dynamics_prob": 1.0}).sft_loss(batch)
    assert fd["action_loss"].item() == 0.0 and fd["world_loss"].item() > 0.1
    inv = make({**FAST, "world_weight": 1.0, "inverse_dynamics_prob": 1.0}).sft_loss(batch)
    assert inv["world_loss"].item() == 0.0 and inv["action_loss"].item() > 0.1


def test_padded_actions_do_not_count():
    a = make(FAST)
    batch = random_batch(IO, 4)
    torch.manual_seed(1)
    unpadded = a.sft_loss(batch)["action_loss"]
    batch[ACTION_IS_PAD][:, 4:] = True
    torch.manual_seed(1)
    assert a.sft_loss(batch)["action_loss"] != unpadded
    batch[ACTION_IS_PAD][:] = True
    assert a.sft_loss(batch)["action_loss"].item() == 0.0


def test_without_world_weight_there_are_no_frame_tokens():
    a = make(FAST)
    assert a.module.n_frame == 0 and not any("frame" in n for n, _ in a.module.named_parameters())
    batch = random_batch(IO, 2, future=False)
    assert set(a.sft_loss(batch)) == {"action_loss", "loss"}
    with pytest.raises(ValueError, match="world_weight > 0"):
        a.predict(batch, mode="forward_dynamics", actions=batch["action"])


def test_world_model_needs_future_frames():
    with pytest.raises(ValueError, match=r"observation\.future_images\.corner.*world_weight=0"):
        make(WORLD).sft_loss(random_batch(IO, 2, future=False))


def test_predict_is_deterministic_for_a_seed_in_every_mode():
    a = make(WORLD)
    batch = random_batch(IO, 3)
    p1 = a.predict(batch, seed=7)["actions"]
    assert p1.shape == (3, IO.chunk, IO.action_dim) and p1.dtype == np.float32
    np.testing.assert_array_equal(p1, a.predict(batch, seed=7)["actions"])
    assert not np.allclose(p1, a.predict(batch, seed=8)["actions"])
    frames = a.predict(batch, mode="forward_dynamics", actions=batch["action"], seed=1)["frames"]
    assert frames.shape == (3, 64, 64, 3) and frames.dtype == np.uint8
    np.testing.assert_array_equal(
        frames, a.predict(batch, mode="forward_dynamics", actions=batch["action"], seed=1)["frames"]
    )
    goal = batch[future_image_key("corner")][:, 0]  # the one future frame
    inv = a.predict(batch, mode="inverse_dynamics", goal_images=goal, seed=1)["actions"]
    other = a.predict(batch, mode="inverse_dynamics", goal_images=goal.flip(1), seed=1)["actions"]
    assert inv.shape == p1.shape and not np.allclose(inv, other)  # the goal frame is used


def test_a_seeded_row_answers_the_same_alone_or_in_any_batch():
    """Noise is drawn per row from the row's seed (models/base.py): an int seed s gives row i seed s+i,
    a list gives each row its own. So a row's answer does not depend on what shares its call: exactly
    equal in one call's shapes, up to reordered float32 sums (tests/exactness.py: width x depth x
    steps) where another batch size lets the CPU kernels block the matmuls otherwise."""
    a = make(WORLD)
    batch = random_batch(IO, 3)
    together = a.predict(batch, seed=[7, 40, 9])["actions"]
    np.testing.assert_array_equal(a.predict(batch, seed=7)["actions"][0], together[0])
    length = FAST["width"] * FAST["depth"] * a.cfg.num_steps
    for i, s in enumerate([7, 40, 9]):
        alone = a.predict({k: v[i : i + 1] for k, v in batch.items()}, seed=s)["actions"][0]
        assert_rounding_close(alone, together[i], length=length)
    order = [2, 1, 0]
    reordered = {k: [v[i] for i in order] if isinstance(v, list) else v[order] for k, v in batch.items()}
    swapped = a.predict(reordered, seed=[9, 40, 7])["actions"]
    assert_rounding_close(swapped[::-1].copy(), together, length=length)
    with pytest.raises(ValueError, match=r"seed: expected one seed per row \(3\), got 2"):
        a.predict(batch, seed=[1, 2])


def test_residual_frame_head_starts_from_a_copy_of_the_current_frame():
    """world_residual: the frame head regresses the change from the current frame. It starts at zero,
    so an untrained model's forward dynamics returns the current frame itself, at the frame
    resolution, whatever the seed, and the world loss is the change's mean square."""
    a = make({**WORLD, "world_residual": True})
    assert not a.module.frame_out.weight.any() and not a.module.frame_out.bias.any()
    batch = random_batch(IO, 3)
    frames = a.predict(batch, mode="forward_dynamics", actions=batch["action"], seed=1)["frames"]
    copy = a._frames_to_images(a._current_frame(batch))
    np.testing.assert_array_equal(frames, copy)
    np.testing.assert_array_equal(
        frames, a.predict(batch, mode="forward_dynamics", actions=batch["action"], seed=2)["frames"]
    )
    key = future_image_key("corner")
    change = a._frame_latent(batch[key][:, 0], key) - a._current_frame(batch)
    torch.manual_seed(0)  # sft_loss draws its times first, then the modes: redo it to know them
    torch.distributions.Beta(1.5, 1.0).sample((3,))
    modes = torch.rand(3)
    keep = ~((modes >= WORLD["forward_dynamics_prob"]) & (modes < 0.5))  # not inverse dynamics
    torch.manual_seed(0)
    loss = a.sft_loss(batch)["world_loss"]
    want = change.pow(2).mean((1, 2))[keep].mean()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)


def test_residual_frame_tokens_hold_the_current_frame_patch_by_patch():
    """world_residual: each future-frame token is given its patch of the current frame (frame_now_in),
    and the frame loss reaches those weights once the head is no longer zero."""
    a = make({**WORLD, "world_residual": True})
    torch.nn.init.normal_(a.module.frame_out.weight, std=0.02)  # past the copy-forecast start
    batch = random_batch(IO, 2)
    prefix = a._prefix(batch)
    now = a._current_frame(batch)
    gen = {
        "actions": torch.randn(2, IO.chunk, IO.action_dim),
        "t_actions": torch.zeros(2),
        "state": prefix["state"],
        "frames": torch.zeros_like(now),
        "t_frames": torch.ones(2),
    }
    with torch.no_grad():
        given = a.module(prefix=prefix, gen={**gen, "frames_now": now})[1]
        other = a.module(prefix=prefix, gen={**gen, "frames_now": now.flip(1)})[1]
    assert not torch.allclose(given, other)  # same prefix, other patches under the tokens
    a.sft_loss(batch)["world_loss"].backward()
    assert a.module.frame_now_in.weight.grad.abs().sum() > 0


def test_cached_prefix_matches_the_training_pass():
    a = make(WORLD)
    a.module.eval()
    batch = random_batch(IO, 3)
    prefix = a._prefix(batch)
    gen = {
        "actions": torch.randn(3, IO.chunk, IO.action_dim),
        "t_actions": torch.tensor([0.2, 0.5, 0.9]),
        "state": prefix["state"],
        "frames": torch.randn(3, a.module.n_frame, a.module.frame_dim),
        "t_frames": torch.tensor([0.0, 0.5, 1.0]),
    }
    with torch.no_grad():
        full = a.module(prefix=prefix, gen=gen)
        cached = a.module(gen=gen, cache=a.module(prefix=prefix))
    for x, y in zip(full, cached):  # the prefix's keys/values once, not recomputed: width x depth sums
        assert_rounding_close(x, y, length=a.cfg.width * a.cfg.depth * 4)


def test_shifted_time_grid():
    assert shifted_times(4, 1.0) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    t = shifted_times(4, 3.0)
    assert t[0] == 1.0 and t[-1] == 0.0 and t[2] == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda b: b.update({image_key("wrist"): b.pop(image_key("corner"))}),
            r"expects cameras \['corner'\]",
        ),
        (
            lambda b: b.update({image_key("corner"): torch.zeros(2, 32, 32, 3, dtype=torch.uint8)}),
            r"\[2, 64, 64, 3\]",
        ),
        (lambda b: b.update({OBS_STATE: torch.zeros(2, 7)}), r"expected shape \[B, 39\]"),
        (lambda b: b.update({"action": torch.zeros(2, 16, 4)}), r"expected shape \[2, 8, 4\]"),
    ],
)
def test_mismatched_inputs_say_what_the_model_expects(change, message):
    a = make(FAST)
    batch = random_batch(IO, 2)
    change(batch)
    with pytest.raises(ValueError, match=message):
        a.sft_loss(batch)


def test_param_groups_and_keys_to_select():
    a = make({**WORLD, "head_lr_mult": 5.0})
    groups = {g.name: g for g in a.param_groups()}
    ids = [id(p) for g in groups.values() for p in g.params]
    assert len(ids) == len(set(ids)) == len(list(a.module.parameters()))
    assert groups["heads"].lr_mult == 5.0 and groups["generation"].lr_mult == 1.0
    assert not groups["generation.no_decay"].weight_decay
    assert {"understanding", "generation", "heads"} <= set(groups)
    assert [type(b) for b in a.blocks()] == [JointBlock] * 2

    # the Cosmos3 recipe: train the generation tower and the heads, freeze understanding
    frozen = make({**WORLD, "keys_to_select": [".gen.", "action_", "frame_", "time_mlp", "gen_norm"]})
    names = {g.name for g in frozen.param_groups()}
    assert not any(n.startswith("understanding") for n in names)
    assert all(not p.requires_grad for n, p in frozen.module.named_parameters() if n.startswith("und_"))
    with pytest.raises(ConfigError, match=r"model\.options\.keys_to_select.*matches no parameter"):
        make({**FAST, "keys_to_select": ["nothing_like_this"]})


@pytest.mark.parametrize("residual", [False, True])
def test_flops_per_sample_matches_torch_flop_counter(residual):
    a = make({**WORLD, "stem_channels": [16], "world_residual": residual})
    batch = random_batch(IO, 2)
    # the math attention backend is made of matmuls the counter sees (the fused CPU kernel it does not)
    with sdpa_kernel(SDPBackend.MATH):
        fwd, total = FlopCounterMode(display=False), FlopCounterMode(display=False)
        with fwd:
            loss = a.sft_loss(batch)["loss"]
        with total:
            a.sft_loss(batch)["loss"].backward()
    assert fwd.get_total_flops() / 2 == pytest.approx(a.flops_per_sample() / 3, rel=0.02)
    # backward ~ 2 x forward; a little less, as the inputs (images, state) need no gradient
    assert total.get_total_flops() / 2 == pytest.approx(a.flops_per_sample(), rel=0.05)
    assert loss.isfinite()
