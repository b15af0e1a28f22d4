"""The fast Cosmos3 denoising step: text keys/values computed once per prompt, requests on a batch axis.

Why this is exact (read in diffusers 0.42.1, ``models/transformers/transformer_cosmos3.py``):

- ``forward`` puts the text tokens, and only they, in the understanding prefix
  (``hidden_states[text_indexes]``, L741; ``und_seq = hidden_states[:und_len]``, L807), and adds the
  timestep embedding only to noisy vision and action tokens (``_apply_timestep_embeds_to_noisy_tokens``,
  L750 and L788). The text stream never sees the timestep.
- In every decoder layer the understanding stream attends causally to itself alone
  (``Cosmos3AttnProcessor``, the ``is_causal=True`` call at L94-L102) and its residual and MLP read only
  its own tokens (``Cosmos3VLTextMoTDecoderLayer.forward``, L365-L371). Its per-layer keys and values
  are therefore a function of the prompt's token ids (positions start at 0 in every request): the same
  at all denoising steps and for every request with that prompt.
- The generation tokens attend to ``[k_und_for_gen | k_gen]`` / ``[v_und | v_gen]`` (L106-L107): they
  read the text only through those keys (``k_norm_und_for_gen`` and rotary applied) and values. The
  generation tokens attend bidirectionally to each other, so they are recomputed at every step.
- The outputs read only generation positions (``vision_mse_loss_indexes``, ``action_mse_loss_indexes``,
  L830-L851); the text stream's last-layer output is read by nothing.

So :func:`encode_text` runs the understanding stream once per prompt and keeps each layer's text
keys/values ([KV heads, U, head_dim]); :func:`gen_step` runs only the generation stream of B requests
as a batch [B, G, hidden], one attention call per layer over ``[text K/V | generation K/V]`` of the
request itself (a key-padding bias masks the text padding of shorter prompts).

:func:`gen_step` is written for CUDA-graph capture and ``torch.compile``: every shape is fixed by the
:class:`StepContext`, there is no host synchronisation and no Python branch on tensor values, and it
returns fresh tensors (no buffer of one call is handed out by the next).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_cosmos3 import _rotate_half
from torch.nn.attention.flex_attention import flex_attention

from wamkit.device import to_device


@dataclass(frozen=True)
class TextKV:
    """One prompt's text keys and values of every decoder layer, each [layers, KV heads, U, head_dim]
    (one tensor: a batch's context copies a prompt in one call), as the generation tokens read them
    (``k_norm_und_for_gen`` and rotary applied to the keys)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def rotary(module: torch.nn.Module, position_ids: torch.Tensor, dtype: torch.dtype):
    """``(cos, sin)`` [N, head_dim] of mRoPE positions [3, N], as ``Cosmos3OmniTransformer.forward``
    computes them for the packed sequence (each position's values depend on that position alone)."""
    cos, sin = module.rotary_emb(
        position_ids=position_ids.float().unsqueeze(1), device=position_ids.device, dtype=dtype
    )
    return cos.squeeze(0), sin.squeeze(0)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


@torch.no_grad()
def encode_text(module: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor) -> TextKV:
    """The understanding stream of one prompt (ids [U], mRoPE positions [3, U]) through every layer,
    mirroring ``Cosmos3AttnProcessor`` and the decoder layer's text half; returns the keys/values."""
    return encode_layers(module, module.embed_tokens(input_ids), position_ids, module.layers)


@torch.no_grad()
def encode_layers(
    module: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layers: Iterable[torch.nn.Module]
) -> TextKV:
    """:func:`encode_text` from the token embeddings ``x`` [U, hidden] on, through ``layers``: the
    module's own decoder layers, or anything with their understanding half's attribute paths, one per
    layer in order (a streamed tower's device copies, :mod:`wamkit.models.cosmos3.host_tower`). The
    rotary tables come from ``module``."""
    cos, sin = (c.unsqueeze(1) for c in rotary(module, position_ids, x.dtype))  # [U, 1, d]
    keys, values, last = [], [], len(module.layers) - 1
    for i, layer in enumerate(layers):
        k, v, x = text_layer(layer, x, cos, sin, last=i == last)
        keys.append(k)
        values.append(v)
        if i == last:
            break
    return TextKV(torch.stack(keys), torch.stack(values))


def text_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, last: bool = False):
    """One decoder layer's text half: ``(keys, values, x)``, the keys/values [KV heads, U, d] as the
    generation tokens read them and ``x`` the layer's text output (the input itself at the ``last``
    layer, whose text output is read by nothing)."""
    attn = layer.self_attn
    hk, d = attn.num_key_value_heads, attn.head_dim
    h = layer.input_layernorm(x)
    k = attn.norm_k(attn.to_k(h).view(-1, hk, d))
    v = attn.to_v(h).view(-1, hk, d)
    k_for_gen = attn.k_norm_und_for_gen(k) if attn.k_norm_und_for_gen is not None else k
    keys = _rope(k_for_gen, cos, sin).transpose(0, 1).contiguous()
    values = v.transpose(0, 1).contiguous()
    if last:
        return keys, values, x
    q = _rope(attn.norm_q(attn.to_q(h).view(-1, attn.num_attention_heads, d)), cos, sin)
    out = dispatch_attention_fn(
        q.unsqueeze(0), _rope(k, cos, sin).unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True
    )
    x = x + attn.to_out(out.squeeze(0).flatten(-2, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return keys, values, x


@dataclass
class StepContext:
    """Everything of one batch that stays fixed across its denoising steps (B requests, G generation
    tokens each: ``n_vision`` vision tokens then the action tokens).

    text_k / text_v: per layer [B, heads, U_pad, d]; ``heads`` is the KV heads without ``key_bias``, all
    attention heads with it (the masked SDPA kernels lack grouped-query attention, so the text is
    expanded once here rather than at every step). key_bias: [B, 1, 1, U_pad + G], 0 for a key a
    request sees, -inf for its text padding; None when no request is padded. text_len: with
    ``attention="flex"`` the padding is masked inside a flex-attention kernel instead, from each
    request's prompt length, and the text keeps its KV heads (no expanded copies at every step).
    cos / sin: [B, G, 1, d] rotary of the generation positions (they start after each prompt).
    noisy_vision [1, n_vision, 1] / noisy_action [1, A, 1] / noisy_frames [1, 1, T, 1, 1]: bool, True
    where the token (frame) is generated, not a held condition. action_*: the domain's action heads.
    """

    text_k: list[torch.Tensor]
    text_v: list[torch.Tensor]
    key_bias: torch.Tensor | None
    text_len: torch.Tensor | None  # [B] int32 prompt lengths: the flex-attention path's padding mask
    cos: torch.Tensor
    sin: torch.Tensor
    noisy_vision: torch.Tensor
    noisy_action: torch.Tensor
    noisy_frames: torch.Tensor
    action_w_in: torch.Tensor  # [action_dim, hidden]
    action_b_in: torch.Tensor  # [hidden]
    action_w_out: torch.Tensor  # [hidden, action_dim]
    action_b_out: torch.Tensor  # [action_dim]

    def tensors(self) -> list[torch.Tensor]:
        """All tensors in a fixed order (for copying one context into another of the same shapes)."""
        out: list[torch.Tensor] = []
        for f in fields(self):
            v = getattr(self, f.name)
            out.extend(v if isinstance(v, list) else [] if v is None else [v])
        return out

    def signature(self) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in self.tensors())


def build_context(
    module: torch.nn.Module,
    texts: list[TextKV],
    gen_positions: list[torch.Tensor],
    latent_frames: int,
    frame_tokens: int,
    vision_cond: tuple[int, ...],
    action_cond: tuple[int, ...],
    domain_id: int,
    text_length: int | None = None,
    masked: bool = False,
    attention: str = "sdpa",
) -> StepContext:
    """The :class:`StepContext` of B requests. ``gen_positions``: per request the mRoPE positions
    [3, G] of its vision then action tokens; ``frame_tokens``: vision tokens per latent frame;
    ``text_length``: pad the text to this many tokens (default: the longest prompt); ``masked``: give a
    key bias even when nothing is padded (a fixed structure for captured graphs); ``attention``:
    ``"sdpa"`` or ``"flex"`` (padding masked from the prompt lengths inside a flex-attention kernel, for
    compiled steps: eager flex attention is a slow reference path)."""
    if attention not in ("sdpa", "flex"):
        raise ValueError(f"attention {attention!r}; expected 'sdpa' or 'flex'")
    flex = attention == "flex"
    dev, dt = module.proj_in.weight.device, module.proj_in.weight.dtype
    lengths = [t.length for t in texts]
    u_pad = max(lengths) if text_length is None else text_length
    if u_pad < max(lengths):
        raise ValueError(f"text_length={u_pad} is shorter than a prompt of {max(lengths)} tokens")
    g = int(gen_positions[0].shape[1])
    masked = (masked or any(n < u_pad for n in lengths)) and not flex
    attn = module.layers[0].self_attn
    groups = attn.num_attention_heads // attn.num_key_value_heads
    # every layer's text of every request in one zero-padded buffer [2, layers, B, KV, U_pad, d]: two
    # copies per request, not one pad per layer and request
    layers, kv_heads, _, d = texts[0].keys.shape
    kv = texts[0].keys.new_zeros((2, layers, len(texts), kv_heads, u_pad, d))
    for i, t in enumerate(texts):
        kv[0, :, i, :, : t.length] = t.keys
        kv[1, :, i, :, : t.length] = t.values
    if masked:
        kv = kv.repeat_interleave(groups, dim=3)
    text_k, text_v = list(kv[0].unbind(0)), list(kv[1].unbind(0))
    key_bias = None
    if masked:
        lens = to_device(torch.tensor(lengths), dev).view(-1, 1, 1, 1)
        pos = torch.arange(u_pad + g, device=dev)
        padding = (pos >= lens) & (pos < u_pad)
        key_bias = torch.zeros(padding.shape, device=dev, dtype=dt).masked_fill_(padding, float("-inf"))
    # rotary is per position: one call over every request's positions. Host data goes over by copies
    # that do not wait for the GPU (the batch's VAE encode is still queued there)
    cos, sin = rotary(module, to_device(torch.cat(gen_positions, 1), dev), dt)
    frames = to_device(torch.tensor([f not in vision_cond for f in range(latent_frames)]), dev)
    actions = to_device(
        torch.tensor([a not in action_cond for a in range(g - latent_frames * frame_tokens)]), dev
    )
    heads = module.action_proj_in, module.action_proj_out
    if not 0 <= domain_id < heads[0].num_domains:
        raise ValueError(f"action domain id {domain_id} outside [0, {heads[0].num_domains})")
    return StepContext(
        text_k=text_k,
        text_v=text_v,
        key_bias=key_bias,
        text_len=to_device(torch.tensor(lengths, dtype=torch.int32), dev) if flex else None,
        cos=cos.view(len(texts), g, 1, -1),
        sin=sin.view(len(texts), g, 1, -1),
        noisy_vision=frames.repeat_interleave(frame_tokens).view(1, -1, 1),
        noisy_action=actions.view(1, -1, 1),
        noisy_frames=frames.view(1, 1, -1, 1, 1),
        action_w_in=heads[0].fc.weight[domain_id].view(heads[0].input_size, heads[0].output_size),
        action_b_in=heads[0].bias.weight[domain_id],
        action_w_out=heads[1].fc.weight[domain_id].view(heads[1].input_size, heads[1].output_size),
        action_b_out=heads[1].bias.weight[domain_id],
    )


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[B, C, T, h, w] -> [B, T * ceil(h/p) * ceil(w/p), p * p * C], diffusers' token order
    (``_patchify_and_pack_latents``: zero-pad to a multiple of p, then ``cthpwq -> thwpqc``)."""
    b, c, t, h, w = latents.shape
    x = F.pad(latents, (0, -w % p, 0, -h % p))
    hp, wp = x.shape[3] // p, x.shape[4] // p
    return x.reshape(b, c, t, hp, p, wp, p).permute(0, 2, 3, 5, 4, 6, 1).reshape(b, t * hp * wp, p * p * c)


def unpatchify(tokens: torch.Tensor, t: int, h: int, w: int, p: int) -> torch.Tensor:
    """The inverse of :func:`patchify`: [B, T * hp * wp, p * p * C] -> [B, C, T, h, w] (padding cut)."""
    b, hp, wp = tokens.shape[0], -(-h // p), -(-w // p)
    x = tokens.reshape(b, t, hp, wp, p, p, -1).permute(0, 6, 1, 2, 4, 3, 5)
    return x.reshape(b, -1, t, hp * p, wp * p)[..., :h, :w]


def time_embedding(module: torch.nn.Module, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The timestep embeddings [N, hidden] of ``t`` [N] (0..1000), computed as ``forward`` does."""
    emb_dtype = next(module.time_embedder.parameters()).dtype
    scaled = t * module.config.timestep_scale
    return module.time_embedder(module.time_proj(scaled).to(emb_dtype)).to(dtype)


def _flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_len: torch.Tensor
) -> torch.Tensor:
    """Attention of the generation queries [B, H, G, d] over ``[text | generation]`` keys/values
    [B, KV, U_pad + G, d] (grouped-query: KV heads as they are), the text padding of request b (keys
    ``text_len[b]`` .. ``U_pad - 1``) masked out."""
    u_pad = k.shape[2] - q.shape[2]

    def keep_seen(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx < text_len[b]) | (kv_idx >= u_pad), score, -float("inf"))

    return flex_attention(q, k, v, score_mod=keep_seen, enable_gqa=q.shape[1] != k.shape[1])


def _gen_layer(layer, gen: torch.Tensor, text_k, text_v, ctx: StepContext) -> torch.Tensor:
    """The generation half of one ``Cosmos3VLTextMoTDecoderLayer`` for [B, G, hidden]."""
    attn = layer.self_attn
    b, g, _ = gen.shape
    heads, kv, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    h = layer.input_layernorm_moe_gen(gen)
    q = _rope(attn.norm_added_q(attn.add_q_proj(h).view(b, g, heads, d)), ctx.cos, ctx.sin)
    k = _rope(attn.norm_added_k(attn.add_k_proj(h).view(b, g, kv, d)), ctx.cos, ctx.sin)
    v = attn.add_v_proj(h).view(b, g, kv, d)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, G, d]
    if ctx.text_len is not None:
        out = _flex_attention(q, torch.cat([text_k, k], dim=2), torch.cat([text_v, v], dim=2), ctx.text_len)
    else:
        if ctx.key_bias is not None:  # the text is expanded to all heads (see StepContext)
            k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            torch.cat([text_k, k], dim=2),
            torch.cat([text_v, v], dim=2),
            attn_mask=ctx.key_bias,
            enable_gqa=ctx.key_bias is None and heads != kv,
        )
    gen = gen + attn.to_add_out(out.transpose(1, 2).reshape(b, g, heads * d))
    return gen + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(gen))


def gen_step(
    module: torch.nn.Module,
    ctx: StepContext,
    lat_v: torch.Tensor,
    lat_a: torch.Tensor,
    t: torch.Tensor,
    layer_fn=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Velocities of one denoising step for B requests (``layer_fn``: what runs each layer's
    generation half, :func:`_gen_layer` or a compiled copy of it).

    lat_v: vision latents [B, C, T, h, w]; lat_a: actions [B, A, action_dim]; t: float, the timestep
    in the model's 0..1000 scale, [1] for all requests (a denoising step) or [B], one per request (a
    training batch). Returns fp32 ``(v_v [B, C, T, h, w], v_a [B, A, D])``, zero at held
    (conditioned) frames and tokens, as ``Cosmos3OmniTransformer.forward``'s outputs are.
    """
    dt = module.proj_in.weight.dtype
    p, (t_lat, h, w) = module.config.latent_patch_size, lat_v.shape[2:]
    temb = time_embedding(module, t, dt).unsqueeze(1)  # [1 or B, 1, hidden]
    x_v = module.proj_in(patchify(lat_v.to(dt), p))
    x_v = torch.where(ctx.noisy_vision, x_v + temb, x_v)
    x_a = lat_a.to(dt) @ ctx.action_w_in + ctx.action_b_in + module.action_modality_embed
    x_a = torch.where(ctx.noisy_action, x_a + temb, x_a)
    gen, n_v = torch.cat([x_v, x_a], dim=1), x_v.shape[1]
    run_layer = layer_fn or _gen_layer
    for layer, text_k, text_v in zip(module.layers, ctx.text_k, ctx.text_v):
        gen = run_layer(layer, gen, text_k, text_v, ctx)
    gen = module.norm_moe_gen(gen)
    v_v = unpatchify(module.proj_out(gen[:, :n_v]), t_lat, h, w, p)
    v_a = gen[:, n_v:] @ ctx.action_w_out + ctx.action_b_out
    return torch.where(ctx.noisy_frames, v_v, 0.0).float(), torch.where(ctx.noisy_action, v_a, 0.0).float()
