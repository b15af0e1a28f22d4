"""cosmos' LIBERO training example and sampling schedule, checked against diffusers' own Cosmos3
helpers (the pipeline's caption builder and tokenizer template, its flow-matching schedulers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from diffusers import Cosmos3OmniPipeline, FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _ACTION_VIEWPOINT_TEMPLATES  # noqa: E402

from wamkit.actions.idle import count_idle_frames  # noqa: E402
from wamkit.config import ModelConfig  # noqa: E402
from wamkit.constants import TASK, future_image_key  # noqa: E402
from wamkit.embodiments.libero import PROFILE as _LIBERO  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.cosmos3 import recipe  # noqa: E402

from .test_cosmos3_model import IO, STEPS, make_batch  # noqa: E402

LIBERO_VIEWS = _LIBERO.cosmos3_view_description  # cosmos' LIBERO dataset's view layout
CANVAS = dict(num_frames=17, fps=20.0, height=192, width=320)


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(2)
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options=STEPS), IO)


def test_caption_is_the_pipelines_plus_cosmos_libero_fields():
    task = "put the black bowl on the plate"
    theirs = Cosmos3OmniPipeline._build_action_json_prompt(task, view_point="concat_view", **CANVAS)
    plain = recipe.action_prompt(
        task, view_point="concat_view", view_description="", idle_frames=None, chunk=16, **CANVAS
    )
    assert plain == theirs
    full = json.loads(
        recipe.action_prompt(
            task,
            view_point="concat_view",
            view_description=LIBERO_VIEWS,
            idle_frames=0,
            chunk=16,
            **CANVAS,
        )
    )
    framing = full["cinematography"]["framing"]
    assert framing == _ACTION_VIEWPOINT_TEMPLATES["concat_view"] + " " + LIBERO_VIEWS
    assert list(full["actions"][0]) == ["time", "description", "idle_frame"]
    assert full["actions"][0]["idle_frame"] == "0 out of 16."
    assert (full["resolution"], full["aspect_ratio"], full["duration"]) == (
        {"H": 192, "W": 320},
        "16,9",
        "0s",
    )


def test_tokens_have_no_system_prompt_and_match_the_pipeline(adapter):
    ad = adapter
    hw = (192, 320)
    desc, ad.options.view_description = ad.options.view_description, ""
    try:
        text = ad.prompt("open the drawer", hw, None)
        ours = ad._text_segment(text, hw)["input_ids"].tolist()
    finally:
        ad.options.view_description = desc
    theirs, _ = ad.pipe.tokenize_prompt(
        "open the drawer",
        num_frames=17,
        height=hw[0],
        width=hw[1],
        fps=20.0,
        use_system_prompt=False,
        action_mode="policy",
        action_view_point="concat_view",
    )
    assert ours == list(theirs)
    with_system, _ = ad.pipe.tokenize_prompt(
        "open the drawer",
        num_frames=17,
        height=192,
        width=320,
        fps=20.0,
        action_mode="policy",
        use_system_prompt=True,
    )
    # diffusers' pipeline default adds a system prompt (ours is set off); cosmos trains without
    assert not ad.pipe.config.default_use_system_prompt
    assert "helpful assistant" in ad.tokenizer.decode(with_system)
    assert "helpful assistant" not in ad.tokenizer.decode(ours)


def test_idle_frames_count_runs_of_three_still_frames():
    still = np.tile([0, 0, 0, 1, 0, 0, 0, 1, 0, 1.0], (16, 1))
    assert count_idle_frames(still, fps=20) == 16
    moving = still.copy()
    moving[:, 0] = 0.01  # 1 cm per frame: far above 5 mm/s / 20 fps
    assert count_idle_frames(moving, fps=20) == 0
    mixed = moving.copy()
    mixed[3:5, 0] = 0.0  # a run of two still frames does not count
    mixed[8:12, 0] = 0.0  # a run of four does
    assert count_idle_frames(mixed, fps=20) == 4
    turning = still.copy()
    turning[:, 3:9] = [np.cos(0.1), np.sin(0.1), 0, -np.sin(0.1), np.cos(0.1), 0]  # 0.1 rad per frame
    assert count_idle_frames(turning, fps=20) == 0
    gripping = still.copy()
    gripping[8:, 9] = 0.0  # the gripper closes at frame 8: that frame moves
    assert count_idle_frames(gripping, fps=20) == 15


def test_training_noise_is_waver_shifted_like_diffusers_flow_shift():
    t = torch.linspace(0.001, 1.0, 1000)
    sch = FlowMatchEulerDiscreteScheduler(shift=3.0)  # diffusers applies the same shift to its sigmas
    unshifted = FlowMatchEulerDiscreteScheduler(shift=1.0).sigmas[:-1]
    torch.testing.assert_close(recipe.shift_sigmas(unshifted, 3.0), sch.sigmas[:-1], rtol=1e-6, atol=1e-6)
    s = recipe.train_sigmas(20000, 3.0, generator=torch.Generator().manual_seed(0))
    assert s.min() >= 0 and s.max() <= 1
    raw = recipe.train_sigmas(20000, 1.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(s, recipe.shift_sigmas(raw, 3.0))  # same draws, warped
    assert s.median() > raw.median()  # the shift moves training towards noisier levels
    assert t.numel() == 1000


def test_sampling_is_the_native_flow_schedule_at_shift_5(adapter, tmp_path):
    sch = recipe.sampling_scheduler(None, 5.0)
    sch.set_timesteps(30, sigmas=recipe.native_sigmas(sch, 30))
    grid = np.linspace(1 - 1 / 1000, 0, 31)[:-1]  # cosmos' FlowUniPC: linear sigmas, then the shift
    np.testing.assert_allclose(sch.sigmas[:-1].numpy(), 5 * grid / (1 + 4 * grid), rtol=1e-6)
    # diffusers' pipeline samples on this very grid when use_native_flow_schedule is set (ours is)
    assert adapter.pipe.config.use_native_flow_schedule and adapter.scheduler.config.flow_shift == 5.0
    karras = tmp_path / "karras" / "scheduler"
    karras.mkdir(parents=True)
    # the approximation NVIDIA's converter writes into a diffusers folder
    cfg = {"use_karras_sigmas": True, "use_flow_sigmas": True, "sigma_max": 200.0, "sigma_min": 0.147}
    (karras / "scheduler_config.json").write_text(json.dumps(cfg))
    replaced = recipe.sampling_scheduler(karras.parent, 5.0)
    assert replaced.config.flow_shift == 5.0 and not replaced.config.use_karras_sigmas
    native = tmp_path / "native" / "scheduler"
    native.mkdir(parents=True)
    (native / "scheduler_config.json").write_text(json.dumps({"use_flow_sigmas": True, "flow_shift": 3.0}))
    assert recipe.sampling_scheduler(native.parent, 5.0).config.flow_shift == 3.0


def test_training_example_is_seventeen_real_frames_with_dropout(adapter):
    ad = adapter
    assert ad.future_frame_offsets == tuple(range(1, 17)) and ad.sample_extras == ("idle_frames",)
    batch = make_batch(2)
    rng = np.random.default_rng(1)
    for c in IO.cameras:
        batch[future_image_key(c)] = torch.from_numpy(
            rng.integers(0, 256, (2, 16, 64, 64, 3), dtype=np.uint8)
        )
    clips = ad._clips(batch, ad._views(batch))
    assert len(clips) == 2 and len(clips[0]) == 17
    np.testing.assert_array_equal(clips[1][5][:, :64], batch[future_image_key("image")][1, 4].numpy())
    np.testing.assert_array_equal(clips[1][5][:, 64:], batch[future_image_key("wrist_image")][1, 4].numpy())
    batch["idle_frames"] = torch.tensor([3, 0])
    texts = ad._train_texts(batch, (192, 320))
    assert '"idle_frame": "3 out of 16."' in texts[0] and "left half" in texts[0]
    ad.options.caption_dropout = 1.0
    try:
        assert ad._train_texts(batch, (192, 320)) == ["", ""]
    finally:
        ad.options.caption_dropout = 0.1
    torch.manual_seed(0)
    loss = ad.sft_loss(batch)
    assert torch.isfinite(loss["loss"]) and set(loss) >= {
        "flow_matching_loss_vision",
        "flow_matching_loss_action",
    }
    with pytest.raises(ValueError, match=r"B, K = \(2, 16\)"):
        ad._clips(
            {**batch, future_image_key("image"): batch[future_image_key("image")][:, :4]}, ad._views(batch)
        )
    assert batch[TASK]
