"""The ``tiny`` network: two towers (understanding, generation) with joint attention per block.

Token layout (W = width):

- understanding tower, computed once per observation: ``text_len`` byte tokens, ``(image_res/patch)^2``
  patch tokens per camera, one state token;
- generation tower, once per denoising step: ``chunk`` noisy action tokens, then (if the model uses
  frames) ``(world_res/world_patch)^2`` noisy future-frame tokens.

Each block holds separate weights per tower (Mixture-of-Transformers): every tower projects its own
tokens to q, k, v, and attention is joint. The mask is block-causal: understanding tokens see only
understanding tokens, generation tokens see everything. The understanding keys and values therefore do
not depend on the noisy tokens, so sampling computes them once and caches them across Euler steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from wamkit.models.base import ModelIO
from wamkit.models.text import VOCAB_SIZE
from wamkit.models.tiny.config import TinyConfig

KV = tuple[torch.Tensor, torch.Tensor]


def to_unit_range(images: torch.Tensor, res: int) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, res, res] in [-1, 1] (area resampling)."""
    x = images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    if x.shape[-1] != res or x.shape[-2] != res:
        x = F.interpolate(x, size=(res, res), mode="area")
    return x


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """[B, 3, R, R] -> [B, (R/p)^2, p*p*3], row-major over the patch grid."""
    b, c, r, _ = x.shape
    n = r // p
    return x.reshape(b, c, n, p, n, p).permute(0, 2, 4, 3, 5, 1).reshape(b, n * n, p * p * c)


def unpatchify(tokens: torch.Tensor, p: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: [B, n*n, p*p*3] -> [B, 3, n*p, n*p]."""
    b, nn_, _ = tokens.shape
    n = math.isqrt(nn_)
    return tokens.reshape(b, n, n, p, p, 3).permute(0, 5, 1, 3, 2, 4).reshape(b, 3, n * p, n * p)


def time_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of flow times t in [0, 1]: [...] -> [..., dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    angles = (t.float() * 1000.0)[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ImageStem(nn.Module):
    """Stride-2 3x3 convs (``stem_channels``), then a patchify conv: [B,3,R,R] -> [B, (R/patch)^2, W]."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c in cfg.stem_channels:
            layers += [nn.Conv2d(c_in, c, 3, stride=2, padding=1), nn.GELU()]
            c_in = c
        rest = cfg.patch // 2 ** len(cfg.stem_channels)
        layers.append(nn.Conv2d(c_in, cfg.width, rest, stride=rest))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).flatten(2).transpose(1, 2)


class TowerLayer(nn.Module):
    """One tower's weights in one block. ``with_output=False`` (the last block's understanding tower)
    keeps only the k, v projection: nothing reads that tower's outputs after the last block."""

    def __init__(self, width: int, mlp_ratio: float, with_output: bool = True):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.with_output = with_output
        if with_output:
            hidden = int(width * mlp_ratio)
            self.proj = nn.Linear(width, width)
            self.norm2 = nn.LayerNorm(width)
            self.mlp = nn.Sequential(
                nn.Linear(width, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, width)
            )

    def qkv_heads(self, x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, N, W] -> q, k, v each [B, heads, N, W/heads]."""
        b, n, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, heads, w // heads).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual attention output and MLP; ``attn`` is [B, heads, N, W/heads]."""
        b, h, n, d = attn.shape
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, h * d))
        return x + self.mlp(self.norm2(x))


class JointBlock(nn.Module):
    """One Mixture-of-Transformers block. ``forward(xu, xg, kv)`` returns ``(xu', xg', (k_u, v_u))``:

    - ``xu`` and ``xg`` given (training): both towers, in one pass;
    - ``xg`` None (prefix): the understanding tower only, plus its keys/values to cache;
    - ``xu`` None and ``kv`` given (a denoising step): the generation tower over the cached prefix.
    """

    def __init__(self, cfg: TinyConfig, last: bool):
        super().__init__()
        self.heads = cfg.heads
        self.und = TowerLayer(cfg.width, cfg.mlp_ratio, with_output=not last)
        self.gen = TowerLayer(cfg.width, cfg.mlp_ratio)

    def forward(
        self, xu: torch.Tensor | None, xg: torch.Tensor | None, kv: KV | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, KV]:
        if xu is not None:
            qu, ku, vu = self.und.qkv_heads(xu, self.heads)
            if self.und.with_output:
                xu = self.und.finish(xu, F.scaled_dot_product_attention(qu, ku, vu))
            else:
                xu = None
        elif kv is not None:
            ku, vu = kv
        else:
            raise ValueError("JointBlock needs understanding tokens or their cached keys/values")
        if xg is not None:
            qg, kg, vg = self.gen.qkv_heads(xg, self.heads)
            k = torch.cat([ku, kg], dim=2)
            v = torch.cat([vu, vg], dim=2)
            xg = self.gen.finish(xg, F.scaled_dot_product_attention(qg, k, v))
        # k/v are views of the fused qkv projection; FSDP2 cannot hook a block output that is a view
        # (an in-place op on it would skip its all-gather), so the cache leaves the block as a copy.
        return xu, xg, (ku.contiguous(), vu.contiguous())


class TinyWAM(nn.Module):
    """The whole network. ``forward`` is the only entry point, so FSDP2's hooks see every call.

    ``forward(prefix=..., gen=...)`` -> ``(v_actions [B, chunk, A], v_frames [B, F, P] or None)``;
    ``forward(prefix=...)`` -> cache (list of per-block keys/values);
    ``forward(gen=..., cache=...)`` -> velocities, as in training.

    ``prefix``: ``text`` int64 [B, text_len], ``images`` list of uint8 [B, H, W, 3] (one per camera),
    ``state`` float [B, state_dim]. ``gen``: ``actions`` [B, chunk, A], ``t_actions`` [B] (or [B, chunk]: a time per action token), ``state``, plus
    ``frames`` [B, F, P] and ``t_frames`` [B] when the model uses frames (P = world_patch^2 * 3).
    """

    def __init__(self, cfg: TinyConfig, io: ModelIO):
        super().__init__()
        self.cfg, self.io = cfg, io
        w = cfg.width
        n_img = (cfg.image_res // cfg.patch) ** 2
        self.n_frame = (cfg.world_res // cfg.world_patch) ** 2 if cfg.uses_frames else 0
        self.frame_dim = cfg.world_patch**2 * 3
        # understanding embedders
        self.und_text = nn.Embedding(VOCAB_SIZE, w)
        self.und_text_pos = nn.Parameter(torch.randn(cfg.text_len, w) * 0.02)
        self.und_stem = ImageStem(cfg)
        self.und_image_pos = nn.Parameter(torch.randn(len(io.cameras), n_img, w) * 0.02)
        self.und_state = nn.Sequential(
            nn.Linear(io.state_dim, w), nn.GELU(approximate="tanh"), nn.Linear(w, w)
        )
        # generation embedders and heads
        self.time_mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.action_in = nn.Linear(io.action_dim, w)
        self.action_mix = nn.Sequential(nn.Linear(2 * w, w), nn.SiLU(), nn.Linear(w, w))
        self.action_pos = nn.Parameter(torch.randn(io.chunk, w) * 0.02)
        # The state also enters every action token directly (as pi0 feeds it to its action expert): in
        # MetaWorld the goal and object positions are in the state, and the actions must hit them to cm.
        self.action_state = nn.Linear(io.state_dim, w)
        if self.n_frame:
            self.frame_in = nn.Linear(self.frame_dim, w)
            self.frame_pos = nn.Parameter(torch.randn(self.n_frame, w) * 0.02)
            self.frame_out = nn.Linear(w, self.frame_dim)
            if cfg.world_residual:
                # the current frame's patches, each under its own future-frame token: the change is
                # then a local edit of pixels the token holds, not a frame redrawn from image features
                self.frame_now_in = nn.Linear(self.frame_dim, w)
        self.blocks = nn.ModuleList(JointBlock(cfg, last=i == cfg.depth - 1) for i in range(cfg.depth))
        self.gen_norm = nn.LayerNorm(w)
        self.action_out = nn.Linear(w, io.action_dim)
        self.apply(self._init)
        if self.n_frame and cfg.world_residual:
            # a residual frame head starts as the copy-the-current-frame forecast exactly: a random head
            # would add a change of ~0.02 * sqrt(width) (tens of grey levels) that training must unlearn
            nn.init.zeros_(self.frame_out.weight)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def embed_prefix(
        self, text: torch.Tensor, images: list[torch.Tensor], state: torch.Tensor
    ) -> torch.Tensor:
        parts = [self.und_text(text) + self.und_text_pos]
        for i, img in enumerate(images):
            parts.append(self.und_stem(to_unit_range(img, self.cfg.image_res)) + self.und_image_pos[i])
        parts.append(self.und_state(state.to(self.und_text_pos.dtype))[:, None])
        return torch.cat(parts, dim=1)

    def embed_gen(self, gen: dict[str, torch.Tensor]) -> torch.Tensor:
        w = self.cfg.width
        dtype = self.action_pos.dtype
        t_act = self.time_mlp(time_features(gen["t_actions"], w).to(dtype))
        if t_act.dim() == 2:  # one flow time per sample; [B, chunk] gives each action token its own
            t_act = t_act[:, None]
        a = self.action_in(gen["actions"].to(dtype))
        a = self.action_mix(torch.cat([a, t_act.expand_as(a)], dim=-1)) + self.action_pos
        a = a + self.action_state(gen["state"].to(dtype))[:, None]
        if not self.n_frame:
            return a
        t_frm = self.time_mlp(time_features(gen["t_frames"], w).to(dtype))
        f = self.frame_in(gen["frames"].to(dtype)) + t_frm[:, None] + self.frame_pos
        if "frames_now" in gen:
            f = f + self.frame_now_in(gen["frames_now"].to(dtype))
        return torch.cat([a, f], dim=1)

    def heads(self, xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        xg = self.gen_norm(xg)
        chunk = self.io.chunk
        v_act = self.action_out(xg[:, :chunk])
        v_frm = self.frame_out(xg[:, chunk:]) if self.n_frame else None
        return v_act, v_frm

    def forward(
        self,
        prefix: dict[str, Any] | None = None,
        gen: dict[str, torch.Tensor] | None = None,
        cache: list[KV] | None = None,
    ):
        xu = self.embed_prefix(**prefix) if prefix is not None else None
        xg = self.embed_gen(gen) if gen is not None else None
        if xu is None and cache is None:
            raise ValueError("TinyWAM.forward needs prefix inputs or a prefix cache")
        new_cache: list[KV] = []
        for i, block in enumerate(self.blocks):
            xu, xg, kv = block(xu, xg, None if cache is None else cache[i])
            new_cache.append(kv)
        if gen is None:
            return new_cache
        return self.heads(xg)
