"""The cosmos3 training loss against a per-sample reference through diffusers' stock path.

For one batch, caption dropout off, the terms ``Cosmos3Adapter.sft_loss`` returns (what the trainer
logs: ``loss``, ``flow_matching_loss_action``, ``flow_matching_loss_vision``) equal a computation that
shares none of the adapter's packing: each sample is one request built the way diffusers'
``Cosmos3OmniPipeline`` builds one (its clip conditioning and VAE encode, ``tokenize_prompt``,
``_prepare_text_segment`` / ``_prepare_vision_segment`` / ``_prepare_action_segment``, the keyword
arguments of its conditional pass; the caption is the recipe's ``action_prompt``, pinned by
tests/test_cosmos3_recipe.py), run through a fresh ``Cosmos3OmniTransformer`` with the same weights
and diffusers' default attention processor, one request per call. The loss is then written
out from its definition (adapter module docstring): ``action_loss_weight`` x the mean over the
non-padded action tokens of their mean square error + ``vision_loss_weight`` x the mean square error
over every future latent frame of every sample (frame 0 is the clean condition, not a target).

The batch makes each part count: distinct weights (10 and 3), padded action rows in one sample, and
idle-frame counts that differ between samples (two samples share a task, so only the idle count sets
their captions apart). Each of those is also shown to move the loss by more than the rounding bound,
so the comparison cannot pass with a mask or a weight ignored. The adapter's transformer call is
recorded (torch's forward hooks): its inputs show that the replayed draws are its noise levels, noise
and captions, and its outputs are compared request by request, which the loss's means alone would
blur (measured: generation tokens attending across packed requests moved the loss by less than its
bound, and their velocities by 300 times theirs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close, rounding_atol

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer  # noqa: E402
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor  # noqa: E402
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID  # noqa: E402
from PIL import Image  # noqa: E402

from wamkit.actions.cosmos3 import action_prompt  # noqa: E402
from wamkit.config import ModelConfig  # noqa: E402
from wamkit.constants import (  # noqa: E402
    ACTION,
    ACTION_IS_PAD,
    IDLE_FRAMES,
    OBS_STATE,
    TASK,
    future_image_key,
    image_key,
)
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.models.cosmos3.recipe import train_sigmas  # noqa: E402

pytestmark = pytest.mark.numerics

IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")
OPTIONS = {"action_loss_weight": 10.0, "vision_loss_weight": 3.0, "caption_dropout": 0.0, "attention": "mask"}
# samples 0 and 1 share a task and differ in their idle count only; sample 1's last 5 rows are padding
TASKS = ["put the black bowl on the plate", "put the black bowl on the plate", "open the top drawer"]
IDLE = [3, 11, 0]
PAD_FROM = {1: 11}
SEED = 17
# The adapter runs all samples in one packed call (attention kept inside each request by a mask, a
# loop or flex attention), the reference one request per call with the stock kernels: the
# transformer's sums are reordered, at most one forward's worth of them (192 wide, 4 deep, as
# tests/test_cosmos3_model.py), on latents that the batched VAE encode and the per-request one sum in
# another order (1024 taps, tests/test_cosmos3_prep.py). A squared error doubles the relative error of
# what it squares, and the loss's final mean sums its terms in another order again (at most
# VISION_TERMS of them; the action mean has fewer). So:
VISION_TERMS = len(TASKS) * 8 * 4 * 4 * 8  # samples x latent channels x future frames x latent h x w
LENGTH = 2 * (192 * 4 + 1024) + VISION_TERMS


def make_batch() -> dict:
    rng = np.random.default_rng(5)
    b, chunk = len(TASKS), IO.chunk
    batch = {}
    for cam in IO.cameras:
        batch[image_key(cam)] = torch.from_numpy(rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8))
        fut = rng.integers(0, 256, (b, chunk, 64, 64, 3), dtype=np.uint8)
        batch[future_image_key(cam)] = torch.from_numpy(fut)
    batch[OBS_STATE] = torch.zeros(b, 8)
    batch[TASK] = list(TASKS)
    batch[ACTION] = torch.from_numpy(rng.uniform(-1, 1, (b, chunk, IO.action_dim)).astype(np.float32))
    pad = torch.zeros(b, chunk, dtype=torch.bool)
    for i, start in PAD_FROM.items():
        pad[i, start:] = True
    batch[ACTION_IS_PAD] = pad
    batch[IDLE_FRAMES] = torch.tensor(IDLE)
    return batch


@pytest.fixture(scope="module")
def adapter():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield build_model(ModelConfig(name="cosmos3", preset="tiny", options=OPTIONS), IO)
    torch.set_num_threads(threads)


class StockReference:
    """One request at a time, as ``Cosmos3OmniPipeline`` builds and runs one (policy mode: latent frame 0
    and no action token are conditions), through a fresh transformer with the stock processor."""

    def __init__(self, adapter) -> None:
        self.options = adapter.options
        self.transformer = Cosmos3OmniTransformer.from_config(adapter.module.config)
        self.transformer.load_state_dict(adapter.module.state_dict())
        self.transformer.eval()
        procs = {type(layer.self_attn.processor) for layer in self.transformer.layers}
        assert procs == {Cosmos3AttnProcessor}, procs
        self.pipe = Cosmos3OmniPipeline(
            transformer=self.transformer,
            text_tokenizer=adapter.tokenizer,
            vae=adapter.vae,
            scheduler=adapter.scheduler,
            enable_safety_checker=False,
        )
        self.domain_id = torch.tensor([_EMBODIMENT_TO_DOMAIN_ID[self.options.domain_name]])

    def encode(self, frames: list[np.ndarray]) -> tuple[torch.Tensor, tuple[int, int]]:
        """A clip of uint8 frames -> (latents [1, C, T, h, w], canvas (height, width)), as the
        pipeline's ``prepare_latents`` encodes an action request's clip."""
        pil = [Image.fromarray(f) for f in frames]
        tier = self.options.resolution_tier
        video, size, h, w = self.pipe._prepare_action_video_conditioning(
            pil, tier, len(pil), "cpu", torch.float32
        )
        with torch.no_grad():
            z = self.pipe._encode_video(video).contiguous().float()
        return self.pipe._remove_action_video_padding_from_latent(z, size), (h, w)

    def caption(self, task: str, hw: tuple[int, int], idle: int | None) -> str:
        o = self.options
        return action_prompt(task, view_point=o.view_point, view_description=o.view_description,
                             num_frames=IO.chunk + 1, fps=float(o.fps), height=hw[0], width=hw[1],
                             idle_frames=idle, chunk=IO.chunk)  # fmt: skip

    def token_ids(self, caption: str, hw: tuple[int, int]) -> list[int]:
        # no system prompt and no flat templates: cosmos tokenises the JSON caption as it is
        ids, _ = self.pipe.tokenize_prompt(
            caption, num_frames=IO.chunk + 1, height=hw[0], width=hw[1], fps=float(self.options.fps),
            use_system_prompt=False, add_resolution_template=False, add_duration_template=False,
        )  # fmt: skip
        return ids

    def velocities(self, ids: list[int], x_v: torch.Tensor, x_a: torch.Tensor, timestep: float):
        """The conditional pass of the pipeline's denoising loop for one request: predicted velocities
        (vision [1, C, T, h, w], zero at the condition frame; actions [chunk, D])."""
        fps = float(self.options.fps)
        text = self.pipe._prepare_text_segment(ids, device="cpu")
        offset, und = text["vision_start_temporal_offset"], text["und_len"]
        vis = self.pipe._prepare_vision_segment(
            input_vision_tokens=x_v, has_image_condition=True, mrope_offset=offset, vision_fps=fps,
            curr=und, device="cpu", condition_frame_indexes=[0],
        )  # fmt: skip
        act = self.pipe._prepare_action_segment(
            input_action_tokens=x_a, condition_frame_indexes=[], mrope_offset=offset, action_fps=fps,
            curr=und + vis["num_vision_tokens"], device="cpu",
        )  # fmt: skip
        with torch.no_grad():
            preds_v, _, preds_a = self.transformer(
                input_ids=text["input_ids"],
                text_indexes=text["text_indexes"],
                position_ids=torch.cat(
                    [text["text_mrope_ids"], vis["vision_mrope_ids"], act["action_mrope_ids"]], 1
                ),
                und_len=und,
                sequence_length=und + vis["num_vision_tokens"] + act["action_len"],
                vision_tokens=[x_v],
                vision_token_shapes=vis["vision_token_shapes"],
                vision_sequence_indexes=vis["vision_sequence_indexes"],
                vision_mse_loss_indexes=vis["vision_mse_loss_indexes"],
                vision_timesteps=torch.full((vis["num_noisy_vision_tokens"],), timestep),
                vision_noisy_frame_indexes=vis["vision_noisy_frame_indexes"],
                action_tokens=[x_a],
                action_token_shapes=act["action_token_shapes"],
                action_sequence_indexes=act["action_sequence_indexes"],
                action_mse_loss_indexes=act["action_mse_loss_indexes"],
                action_timesteps=torch.full((act["num_noisy_action_tokens"],), timestep),
                action_noisy_frame_indexes=act["action_noisy_frame_indexes"],
                action_domain_ids=[self.domain_id],
                return_dict=False,
            )
        return preds_v[0], preds_a[0]


def reference_terms(ref, batch, x0_v, hw, sigma, eps_v, eps_a, idle=IDLE) -> dict:
    """Per-sample squared errors through the stock path, combined as the loss defines them; also the
    combinations that ignore a mask (all action rows, frame 0 as a target), for the vacuity checks, and
    each request's noisy inputs and predicted velocities."""
    x0_a = batch[ACTION].float()
    keep = ~batch[ACTION_IS_PAD]
    sq_v, sq_v0, sq_a, inputs, velocities = [], [], [], [], []
    for i, task in enumerate(batch[TASK]):
        s = sigma[i]
        x0, eps = x0_v[i : i + 1], eps_v[i : i + 1]  # one request: [1, C, T, h, w]
        x_v = (1 - s) * x0 + s * eps
        x_v[:, :, 0] = x0[:, :, 0]  # the current frame: the clean condition
        x_a = (1 - s) * x0_a[i] + s * eps_a[i]
        ids = ref.token_ids(ref.caption(task, hw, idle[i]), hw)
        v_v, v_a = ref.velocities(ids, x_v, x_a, float(s * 1000))  # the model's timestep: sigma x 1000
        inputs.append((x_v, x_a))
        velocities.append((v_v, v_a))
        err_v = (v_v - (eps - x0)).square()
        sq_v.append(err_v[:, :, 1:].flatten())
        sq_v0.append(err_v.flatten())
        sq_a.append((v_a - (eps_a[i] - x0_a[i])).square().mean(-1))  # per token [chunk]
    vision = sum(e.sum() for e in sq_v) / sum(e.numel() for e in sq_v)
    action = sum(e[keep[i]].sum() for i, e in enumerate(sq_a)) / keep.sum()
    w_a, w_v = OPTIONS["action_loss_weight"], OPTIONS["vision_loss_weight"]
    return {
        "loss": w_a * action + w_v * vision,
        "flow_matching_loss_action": action,
        "flow_matching_loss_vision": vision,
        "action_with_padding": sum(e.sum() for e in sq_a) / sum(e.numel() for e in sq_a),
        "vision_with_frame0": sum(e.sum() for e in sq_v0) / sum(e.numel() for e in sq_v0),
        "inputs": inputs,
        "velocities": velocities,
    }


@pytest.fixture(scope="module")
def reference(adapter) -> dict:
    """The batch, its per-request latents and captions, ``sft_loss``'s draws replayed, and the stock
    reference's terms (for the batch's idle counts and for two wrong ones)."""
    batch = make_batch()
    b = len(TASKS)
    ref = StockReference(adapter)
    clips = []  # the current frame, then the future ones; cameras side by side in io.cameras order
    for i in range(b):
        now = np.concatenate([batch[image_key(c)][i].numpy() for c in IO.cameras], axis=1)
        fut = np.concatenate([batch[future_image_key(c)][i].numpy() for c in IO.cameras], axis=2)
        clips.append([now, *fut])
    encoded = [ref.encode(clip) for clip in clips]
    x0_v, hw = torch.cat([z for z, _ in encoded]), encoded[0][1]
    assert x0_v.shape == (b, 8, 5, 4, 8)  # 17 frames -> 5 latent frames of 4 x 8 (VISION_TERMS)
    captions = [ref.caption(t, hw, k) for t, k in zip(TASKS, IDLE)]
    assert all(f'"idle_frame": "{k} out of 16."' in c for c, k in zip(captions, IDLE))
    ids = [ref.token_ids(c, hw) for c in captions]
    assert len({len(x) for x in ids}) == b  # three caption lengths (samples 0 and 1: by the idle count)

    # sft_loss's draws, in its order: the noise levels (recipe.train_sigmas), the vision noise, the
    # action noise (then the caption-dropout draw, which cannot drop a caption at probability 0)
    torch.manual_seed(SEED)
    sigma = train_sigmas(b, float(adapter.options.train_shift))
    eps_v, eps_a = torch.randn(x0_v.shape), torch.randn(b, IO.chunk, IO.action_dim)
    noise = (sigma, eps_v, eps_a)
    return {
        "batch": batch,
        "noise": noise,
        "ids": ids,
        "want": reference_terms(ref, batch, x0_v, hw, *noise),
        # the idle_frame field left out (the captions of a batch without idle counts), and the counts
        # given to the wrong samples
        "wrong_idle": [
            reference_terms(ref, batch, x0_v, hw, *noise, idle=idle)
            for idle in ([None] * b, [IDLE[1], IDLE[0], IDLE[2]])
        ],
    }


@pytest.mark.parametrize("attention", ["mask", "loop", "flex"])
def test_logged_loss_equals_a_per_sample_stock_diffusers_computation(adapter, reference, attention):
    batch, ids, want = reference["batch"], reference["ids"], reference["want"]
    sigma = reference["noise"][0]
    # The adapter's inputs to its one transformer call and its outputs, recorded through torch's own
    # hook API: the reference replays the same noise levels, noise and captions, and each packed
    # request's velocities are its own request's.
    seen = {}
    hooks = [
        adapter.module.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
        adapter.module.register_forward_hook(lambda m, a, kw, out: seen.update(out=out), with_kwargs=True),
    ]
    adapter.processor.mode = attention  # what options.attention sets (packing.install_processor)
    try:
        torch.manual_seed(SEED)
        out = adapter.sft_loss(batch)  # with gradients, as the trainer calls it
    finally:
        for hook in hooks:
            hook.remove()
        adapter.processor.mode = OPTIONS["attention"]

    t = sigma * 1000
    n_v = 4 * (4 // 2) * (8 // 2)  # per sample: noisy latent frames x patches (latent_patch_size 2)
    assert torch.equal(seen["vision_timesteps"], t.repeat_interleave(n_v))
    assert torch.equal(seen["action_timesteps"], t.repeat_interleave(IO.chunk))
    for i, (x_v, x_a) in enumerate(want["inputs"]):
        assert_rounding_close(seen["vision_tokens"][i], x_v, length=1024)  # the batched VAE encode
        assert torch.equal(seen["action_tokens"][i], x_a)
    assert seen["input_ids"].tolist() == [x for request in ids for x in request]
    preds_v, _, preds_a = seen["out"]
    for i, (v_v, v_a) in enumerate(want["velocities"]):
        # one forward's reordered sums on latents of another encode order (see LENGTH)
        assert_rounding_close(preds_v[i].detach(), v_v, length=192 * 4 + 1024)
        assert_rounding_close(preds_a[i].detach(), v_a, length=192 * 4 + 1024)

    for key in ("flow_matching_loss_action", "flow_matching_loss_vision", "loss"):
        assert_rounding_close(out[key].detach(), want[key], length=LENGTH)

    # Not vacuous: each mask, the weights and the idle counts move the loss by more than the bound.
    def moved(got: torch.Tensor, other: torch.Tensor) -> bool:
        return float((got.detach() - other).abs()) > rounding_atol(other, LENGTH)

    action, vision = want["flow_matching_loss_action"], want["flow_matching_loss_vision"]
    assert moved(out["flow_matching_loss_action"], want["action_with_padding"])
    assert moved(out["flow_matching_loss_vision"], want["vision_with_frame0"])
    assert moved(out["loss"], action + vision) and moved(out["loss"], 3 * action + 10 * vision)
    # The tiny random model reads a caption's one digit weakly (all counts 0, the inference caption,
    # moves the loss by less than the bound); the caption ids above pin the counts exactly, and a
    # wrong caption moves the action term and the loss beyond the bound.
    for other in reference["wrong_idle"]:
        assert moved(out["flow_matching_loss_action"], other["flow_matching_loss_action"])
        assert moved(out["loss"], other["loss"])
