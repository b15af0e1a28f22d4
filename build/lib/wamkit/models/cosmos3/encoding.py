"""Clips of uint8 frames -> the Wan VAE's normalised latents, as diffusers' ``Cosmos3OmniPipeline``
makes them (``_prepare_action_video_conditioning``, ``_encode_video``,
``_remove_action_video_padding_from_latent``), with less work: the same numbers, except that the
one-frame encode sums its convolutions in another order (equal to float rounding: 1e-5 in fp32, one
bf16 step in bf16). Each shortcut is
pinned to the diffusers code it stands for by tests/test_cosmos3_prep.py:

- *Canvas geometry*, per frame shape and resolution tier: computed once, by the pipeline itself on a
  blank frame, and cached (:class:`Canvas`). The latents are cropped to the content on the host: no
  ``.item()`` waits for the VAE.
- *Batched frames*: all clips' uint8 frames go to the device in one copy (pinned memory, non-blocking,
  on CUDA); there the pipeline's per-pixel map (uint8 -> [-1, 1], read from the pipeline's own output
  for every uint8 value), one bicubic antialiased resize and one pad place them on the canvas. Taken
  when the pipeline would leave the frames' size as is before that resize (sizes that are multiples of
  the VAE's 16: otherwise it resizes them with PIL first, and each request takes the pipeline's path).
- *One-frame encode* (:func:`encode_one_frame`): the Wan encoder's causal 3D convs pad a frame with
  ``k - 1`` zero frames in front; with one frame and nothing cached, only the kernel's last temporal
  tap meets data, so a 2D conv with that slice gives the same output (Nano's VAE: 100 instead of 285
  GFLOP per frame). Clips of several frames (training, the latent cache) keep diffusers' encode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    WanAttentionBlock,
    WanCausalConv3d,
    WanEncoder3d,
    WanMidBlock,
    WanResample,
    WanResidualBlock,
    WanResidualDownBlock,
    patchify,
)
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from wamkit.device import host_buffer, to_device


@dataclass(frozen=True)
class Canvas:
    """Where frames of one shape land on the pipeline's action canvas, in pixels (height, width): the
    frame, resized to ``content``, fills the top-left corner of ``size``, the rest is padding.
    ``kept``: the pipeline's preprocessing leaves the frame's size as is (no PIL resize)."""

    size: tuple[int, int]
    content: tuple[int, int]
    kept: bool

    def latent_hw(self, scale: int) -> tuple[int, int]:
        """The content's size in latent pixels (``_remove_action_video_padding_from_latent``'s)."""
        return max(self.content[0] // scale, 1), max(self.content[1] // scale, 1)


class ClipEncoder:
    """The pipeline's encoding of clips, shortcut where it is exact (see the module doc)."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self._canvases: dict[tuple[int, int, int], Canvas] = {}
        self._values: dict[torch.device, torch.Tensor] = {}
        self._stats: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}

    def canvas(self, frame_hw: tuple[int, int], tier: int) -> Canvas:
        """The canvas of ``frame_hw`` frames on ``tier``, from the pipeline's own preprocessing."""
        key = (int(frame_hw[0]), int(frame_hw[1]), int(tier))
        if key not in self._canvases:
            blank = Image.fromarray(np.zeros((*key[:2], 3), np.uint8))
            _, size, h, w = self.pipe._prepare_action_video_conditioning(
                [blank], tier, 1, device="cpu", dtype=torch.float32
            )
            kept = tuple(self.pipe.video_processor.preprocess_video([blank]).shape) == (1, 3, 1, *key[:2])
            self._canvases[key] = Canvas((h, w), (int(size[2]), int(size[3])), kept)
        return self._canvases[key]

    def __call__(self, clips: list[list[np.ndarray]], tier: int, device: torch.device) -> torch.Tensor:
        """Clips (per sample, a list of uint8 [H, W, 3] frames) -> cropped normalised latents
        [B, C, T, h, w] fp32, computed on ``device`` (where the VAE must be)."""
        # a clip's first frame (the observation) sets its canvas, and one canvas crops the whole batch;
        # later frames of other sizes (goal_images) take the pipeline's path, which resizes them to it
        shapes = {clip[0].shape for clip in clips}
        if len(shapes) != 1:
            raise ValueError(f"observation images of one batch must share one shape; got {sorted(shapes)}")
        canvas = self.canvas(clips[0][0].shape[:2], tier)
        frames = self.frames(clips, canvas, tier, device)
        vae = self.pipe.vae
        if frames.shape[2] == 1 and not vae.use_tiling:
            z = self._normalise(encode_one_frame(vae, frames.to(vae.dtype)))
        else:
            z = self.pipe._encode_video(frames)
        h, w = canvas.latent_hw(self.pipe.vae_scale_factor_spatial)
        return z[:, :, :, :h, :w].float().contiguous()

    def frames(self, clips: list[list[np.ndarray]], canvas: Canvas, tier: int, device) -> torch.Tensor:
        """The clips on the canvas: fp32 [B, 3, T, height, width] in [-1, 1] on ``device``."""
        device = torch.device(device)
        values = self._unit_values(device) if canvas.kept else None
        u8 = _upload(clips, device) if values is not None else None
        if u8 is None:  # the pipeline's path, request by request
            per_request = [
                self.pipe._prepare_action_video_conditioning(
                    [Image.fromarray(f) for f in clip], tier, len(clip), device=device, dtype=torch.float32
                )[0]
                for clip in clips
            ]
            return torch.cat(per_request)
        b, t, h, w, c = u8.shape
        x = values.index_select(0, u8.permute(0, 1, 4, 2, 3).reshape(-1).int()).view(b * t, c, h, w)
        return place(x, canvas).view(b, t, c, *canvas.size).permute(0, 2, 1, 3, 4).contiguous()

    def _unit_values(self, device: torch.device) -> torch.Tensor | None:
        """Per uint8 value, the float the pipeline's preprocessing makes of it (/255, 2x - 1), read
        from its output for a 16x16 image holding all 256 values; None if it resized that image."""
        if device not in self._values:
            ramp = np.repeat(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), 3, axis=2)
            out = self.pipe.video_processor.preprocess_video([Image.fromarray(ramp)])
            if tuple(out.shape) != (1, 3, 1, 16, 16):
                return None
            self._values[device] = out[0, 0, 0].flatten().to(device, torch.float32)
        return self._values[device]

    def _normalise(self, raw_mu: torch.Tensor) -> torch.Tensor:
        """``_encode_video``'s latent normalisation of the posterior mode, in the VAE's dtype. The
        statistics stay on the device: copying them there per call would wait for the encoder."""
        key = (raw_mu.device, raw_mu.dtype)
        if key not in self._stats:
            self._stats[key] = tuple(
                s.to(device=raw_mu.device, dtype=raw_mu.dtype).view(1, -1, 1, 1, 1)
                for s in (self.pipe._vae_latents_mean, self.pipe._vae_latents_inv_std)
            )
        mean, inv_std = self._stats[key]
        return (raw_mu - mean) * inv_std


def place(x: torch.Tensor, canvas: Canvas) -> torch.Tensor:
    """Frames [N, 3, H, W] (fp32, [-1, 1]) resized to the canvas content and padded to its size, as
    ``_prepare_action_video_conditioning`` does to each request's frames."""
    (ch, cw), (th, tw) = canvas.content, canvas.size
    if (ch, cw) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=(ch, cw), mode="bicubic", align_corners=False, antialias=True)
    pad_right, pad_bottom = tw - cw, th - ch
    if pad_right or pad_bottom:
        mode = "replicate" if pad_right >= cw or pad_bottom >= ch else "reflect"
        x = F.pad(x, (0, pad_right, 0, pad_bottom), mode=mode)
    return x


def _upload(clips: list[list[np.ndarray]], device: torch.device) -> torch.Tensor | None:
    """All frames as one uint8 [B, T, H, W, 3] tensor on ``device``, copied there at once (from
    pinned memory, without waiting, on CUDA); None unless the clips are equally long and their frames
    uint8 RGB of one shape."""
    frames = [f for clip in clips for f in clip]
    shape = frames[0].shape
    if len(shape) != 3 or shape[2] != 3 or any(len(c) != len(clips[0]) for c in clips):
        return None
    if any(f.shape != shape or f.dtype != np.uint8 for f in frames):
        return None
    host = host_buffer((len(frames), *shape), device, torch.uint8)
    np.stack(frames, out=host.numpy())
    return to_device(host.view(len(clips), len(clips[0]), *shape), device)


# -- the one-frame encode ------------------------------------------------------------------------


def encode_one_frame(vae: AutoencoderKLWan, x: torch.Tensor) -> torch.Tensor:
    """``vae.encode(x).latent_dist.mode()`` of one-frame clips ``x`` [B, C, 1, H, W] (the VAE's dtype):
    the raw posterior mean [B, z_dim, 1, h, w].

    diffusers encodes the first frame of a clip with an empty feature cache: every causal conv pads it
    with zero frames, the ``downsample3d`` resamples skip their ``time_conv`` (it starts with the second
    chunk), and the shortcuts of the residual down blocks average the frame with a zero frame (kept here,
    they are not convs). This walks the encoder's modules in the order of its ``forward`` with each
    causal conv of a temporal kernel replaced by the 2D conv of its last tap."""
    if x.shape[2] != 1:
        raise ValueError(f"encode_one_frame: expected one frame, got {x.shape[2]} ({list(x.shape)})")
    if vae.use_slicing and x.shape[0] > 1:
        return torch.cat([encode_one_frame(vae, part) for part in x.split(1)])
    if vae.config.patch_size is not None:
        x = patchify(x, patch_size=vae.config.patch_size)
    h = vae.quant_conv(_encoder(vae.encoder, x))
    return DiagonalGaussianDistribution(h).mode()


def _encoder(enc: WanEncoder3d, x: torch.Tensor) -> torch.Tensor:
    x = _conv(enc.conv_in, x)
    for layer in enc.down_blocks:
        x = _down_layer(layer, x)
    x = _mid(enc.mid_block, x)
    return _conv(enc.conv_out, enc.nonlinearity(enc.norm_out(x)))


def _conv(conv: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for one frame with no cached frames: a causal conv whose ``k - 1`` leading zero
    frames meet all taps but the last is the 2D conv of that tap; other modules run as they are."""
    if not isinstance(conv, WanCausalConv3d) or conv.kernel_size[0] == 1:
        return conv(x)
    pad_w, _, pad_h, _, pad_t, _ = conv._padding
    if pad_t != conv.kernel_size[0] - 1 or conv.stride[0] != 1 or conv.dilation[0] != 1:
        raise ValueError(f"encode_one_frame: a causal conv of another padding ({conv})")
    y = F.conv2d(
        x[:, :, 0],
        conv.weight[:, :, -1],
        conv.bias,
        conv.stride[1:],
        (pad_h, pad_w),
        conv.dilation[1:],
        conv.groups,
    )
    return y.unsqueeze(2)


def _residual(block: WanResidualBlock, x: torch.Tensor) -> torch.Tensor:
    h = _conv(block.conv_shortcut, x)
    x = _conv(block.conv1, block.nonlinearity(block.norm1(x)))
    x = _conv(block.conv2, block.dropout(block.nonlinearity(block.norm2(x))))
    return x + h


def _down_layer(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(layer, WanResidualBlock):
        return _residual(layer, x)
    if isinstance(layer, WanResidualDownBlock):  # Wan2.2
        y = x
        for block in layer.resnets:
            y = _residual(block, y)
        if layer.downsampler is not None:
            y = layer.downsampler(y)  # without a cache: the 2D resample only, as the first chunk
        return y + layer.avg_shortcut(x)
    if isinstance(layer, WanResample | WanAttentionBlock):  # Wan2.1's flat list
        return layer(x)
    raise TypeError(f"encode_one_frame: unknown encoder layer {type(layer).__name__}")


def _mid(mid: WanMidBlock, x: torch.Tensor) -> torch.Tensor:
    x = _residual(mid.resnets[0], x)
    for attn, block in zip(mid.attentions, mid.resnets[1:]):
        if attn is not None:
            x = attn(x)
        x = _residual(block, x)
    return x
