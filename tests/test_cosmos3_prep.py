"""The work of a Cosmos3 prediction before its denoising steps (models/cosmos3/encoding.py) against the
diffusers code it stands for, on the CPU in fp32: the one-frame encode against the Wan encoder of
diffusers, left unpatched (<= 1e-5, with fewer FLOPs); the batched frames bit for bit against the
pipeline's per-request ``_prepare_action_video_conditioning``, for the tiny preset's frames, LIBERO's
two 256x256 cameras and a size the pipeline resizes with PIL (the per-request path); multi-frame clips
(training, the latent cache) encoded bit for bit as before; the latent crop and the cached canvas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from diffusers import AutoencoderKLWan  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from wamkit.config import ModelConfig  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.models.cosmos3.encoding import encode_one_frame  # noqa: E402
from wamkit.models.cosmos3.presets import PRESETS  # noqa: E402

IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")
TIER = 256
# frame sizes (cameras side by side) -> whether the batched path takes them
SHAPES = {
    "tiny": ((64, 128), True),  # padded only (replicate)
    "libero": ((256, 512), True),  # two 256x256 cameras: resized to 160x320, padded (reflect)
    "square": ((128, 128), True),
    "pil_resized": ((60, 120), False),  # not a multiple of 16: the pipeline resizes with PIL first
}
VAES = {
    "tiny": PRESETS["tiny"][1],
    # Wan2.2 with residual blocks, channel changes (1x1 shortcut convs) and a time-downsampling block
    "wan22": dict(PRESETS["tiny"][1], base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
    # Wan2.1's flat encoder: residual blocks and resamples in one list, no patchify
    "wan21": dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
}


@pytest.fixture(scope="module")
def adapter():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield build_model(ModelConfig(name="cosmos3", preset="tiny", options={"num_inference_steps": 3}), IO)
    torch.set_num_threads(threads)


def _clips(hw: tuple[int, int], b: int, t: int, seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, 256, (t, *hw, 3), dtype=np.uint8)) for _ in range(b)]


def _pipeline_frames(adapter, clips, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's frames of each request, concatenated, and the last request's image size."""
    out = [
        adapter.pipe._prepare_action_video_conditioning(
            [Image.fromarray(f) for f in clip], TIER, len(clip), device=device, dtype=torch.float32
        )
        for clip in clips
    ]
    return torch.cat([o[0] for o in out]), out[-1][1]


def _pipeline_encode(adapter, clips) -> torch.Tensor:
    """``Cosmos3Adapter._encode`` as it was: per-request frames, diffusers' encode and crop."""
    frames, size = _pipeline_frames(adapter, clips)
    with torch.no_grad():
        z = adapter.pipe._encode_video(frames)
    return adapter.pipe._remove_action_video_padding_from_latent(z, size).float()


def _random_vae(cfg: dict) -> AutoencoderKLWan:
    torch.manual_seed(0)
    z = cfg.get("z_dim", 16)
    vae = AutoencoderKLWan(**cfg, latents_mean=[0.0] * z, latents_std=[1.0] * z).eval()
    with torch.no_grad():  # variance-preserving weights and non-zero biases: every term counts
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
    return vae


def _flops(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", VAES)
def test_one_frame_encode_equals_the_diffusers_encoder_with_fewer_flops(name):
    vae = _random_vae(VAES[name])
    x = torch.rand(3, 3, 1, 64, 96, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode()
        got = encode_one_frame(vae, x)
        ratio = _flops(lambda: encode_one_frame(vae, x)) / _flops(lambda: vae.encode(x))
    assert got.shape == want.shape and want.abs().max() > 0.1
    assert_rounding_close(got, want, length=1024)  # the convolutions' taps summed in another order
    assert ratio < 0.6, ratio  # the zero frames' taps are gone (Nano's VAE: 0.35)
    with pytest.raises(ValueError, match="expected one frame"):
        encode_one_frame(vae, torch.zeros(1, 3, 5, 64, 96))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 3])
def test_batched_frames_are_the_pipelines_bit_for_bit(adapter, shape, t, monkeypatch):
    hw, batched = SHAPES[shape]
    clips = _clips(hw, 4, t)
    want, size = _pipeline_frames(adapter, clips)
    canvas = adapter.clip_encoder.canvas(hw, TIER)
    assert canvas.kept == batched
    assert (canvas.size, canvas.content) == ((int(size[0]), int(size[1])), (int(size[2]), int(size[3])))
    per_request = []
    stock = adapter.pipe._prepare_action_video_conditioning
    monkeypatch.setattr(
        adapter.pipe,
        "_prepare_action_video_conditioning",
        lambda *a, **k: per_request.append(1) or stock(*a, **k),
    )
    got = adapter.clip_encoder.frames(clips, canvas, TIER, "cpu")
    assert len(per_request) == (0 if batched else len(clips))
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", ["tiny", "libero", "pil_resized"])
def test_multi_frame_clips_are_encoded_as_before_bit_for_bit(adapter, shape):
    """Training and the latent cache encode clips of chunk + 1 frames: diffusers' encode, unchanged."""
    clips = _clips(SHAPES[shape][0], 2, 5, seed=2)
    assert torch.equal(adapter._encode(clips), _pipeline_encode(adapter, clips))


@pytest.mark.parametrize("shape", ["tiny", "libero", "pil_resized"])
def test_one_frame_clips_are_encoded_as_the_pipeline_does(adapter, shape):
    clips = _clips(SHAPES[shape][0], 3, 1, seed=3)
    want = _pipeline_encode(adapter, clips)
    got = adapter._encode(clips)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert_rounding_close(got, want, length=1024)  # batched against the pipeline's: the VAE's sums


@pytest.mark.parametrize(
    "hw, tier", [((64, 128), 256), ((256, 512), 256), ((16, 400), 256), ((60, 120), 480), ((720, 960), 720)]
)
def test_latent_crop_on_the_host_is_the_pipelines(adapter, hw, tier):
    """``Canvas.latent_hw`` (no ``.item()``) crops as ``_remove_action_video_padding_from_latent``."""
    _, size, th, tw = adapter.pipe._prepare_action_video_conditioning(
        [Image.fromarray(_clips(hw, 1, 1)[0][0])], tier, 1, device="cpu", dtype=torch.float32
    )
    s = adapter.pipe.vae_scale_factor_spatial
    z = torch.randn(2, 8, 1, th // s, tw // s)
    want = adapter.pipe._remove_action_video_padding_from_latent(z, size)
    h, w = adapter.clip_encoder.canvas(hw, tier).latent_hw(s)
    assert torch.equal(z[:, :, :, :h, :w], want)


def test_the_canvas_is_computed_once_per_frame_shape_and_tier(adapter, monkeypatch):
    calls = []
    stock = adapter.pipe._prepare_action_video_conditioning
    monkeypatch.setattr(
        adapter.pipe,
        "_prepare_action_video_conditioning",
        lambda *a, **k: calls.append(a[1]) or stock(*a, **k),
    )
    frame = np.zeros((48, 96, 3), np.uint8)
    want = stock([Image.fromarray(frame)], TIER, 1, device="cpu", dtype=torch.float32)[2:]
    assert [adapter._canvas_hw(frame) for _ in range(3)] == [want] * 3
    assert calls == [TIER]
    monkeypatch.setattr(adapter.options, "resolution_tier", 480)
    other = stock([Image.fromarray(frame)], 480, 1, device="cpu", dtype=torch.float32)[2:]
    assert adapter._canvas_hw(frame) == other != want
    assert calls == [TIER, 480]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batched_frames_on_cuda_are_the_pipelines_bit_for_bit(adapter):
    """The pinned, non-blocking copy and the batched resize on the GPU, against the pipeline there."""
    for shape in ("tiny", "libero"):
        hw, _ = SHAPES[shape]
        clips = _clips(hw, 8, 1)
        want, _ = _pipeline_frames(adapter, clips, device="cuda")
        got = adapter.clip_encoder.frames(clips, adapter.clip_encoder.canvas(hw, TIER), TIER, "cuda")
        assert torch.equal(got, want), shape


def test_frames_of_different_shapes_in_one_batch_are_refused(adapter):
    clips = _clips(SHAPES["tiny"][0], 1, 1) + _clips(SHAPES["libero"][0], 1, 1)
    with pytest.raises(ValueError, match="share one shape"):
        adapter._encode(clips)
