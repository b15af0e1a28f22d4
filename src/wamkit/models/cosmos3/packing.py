"""Pack N Cosmos3 requests into the one joint sequence ``Cosmos3OmniTransformer.forward`` takes.

The diffusers transformer has no batch axis: its input is one packed sequence, the causal
*understanding* prefix (text) first, then the *generation* tokens (vision latents, action tokens).
The pipeline runs one request per call. Here N requests share a call:

    und: [text_0 | text_1 | ... | text_{N-1}]        gen: [vis_0 act_0 | vis_1 act_1 | ...]

Each request's segments come from the pipeline's own builders (``_prepare_text_segment``,
``_prepare_vision_segment``, ``_prepare_action_segment``), called with request-local indices, and are
shifted to their global place here. Position ids stay request-local (every request starts at 0), so
one request's tokens see exactly what they would see alone, provided attention is kept inside a
request: :class:`SegmentMaskedAttnProcessor` does that with a block mask (causal within a request's
text, full within its generation tokens).

Attention modes (``model.options.attention``):

- ``"mask"``: one SDPA call per pathway with the boolean masks of :meth:`PackedLayout.attention_masks`
  ([U, U] and [G, U + G]); the masked kernel computes every masked-out score and lacks grouped-query
  attention (the KV heads are expanded).
- ``"loop"``: one unmasked (flash) call per request and pathway.
- ``"flex"``: one ``flex_attention`` call per pathway with the block masks of
  :meth:`PackedLayout.flex_block_masks`: blocks of 128 x 128 (query, key) pairs where no query may see
  its key are skipped, grouped-query attention is native. On CUDA it runs ``torch.compile``'d
  (:func:`_compiled_flex`). On the CPU flex attention has only a forward: a call that needs gradients
  (training) takes the ``"mask"`` computation instead (same masks, same results), logged once; no-grad
  calls (predictions, tests) run eager flex attention.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, _rotate_half
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from wamkit.device import to_device
from wamkit.models.cosmos3 import ATTENTION_MODES

log = logging.getLogger(__name__)

FLEX_BLOCK = 128  # flex_attention's sparse block (queries x keys), its default


@dataclass
class RequestSegments:
    """One request's static segments as the pipeline builds them (request-local indices)."""

    text: dict[str, Any]
    vision: dict[str, Any]
    action: dict[str, Any]

    @property
    def und_len(self) -> int:
        return int(self.text["und_len"])

    @property
    def gen_len(self) -> int:
        return int(self.vision["num_vision_tokens"]) + int(self.action["action_len"])


@dataclass
class PackedLayout:
    """Static fields of the joint sequence of N requests (everything but tokens and timesteps).

    ``und_segment`` [U] / ``gen_segment`` [G]: the request index of each understanding / generation
    token, used to build the attention masks.
    """

    n: int
    input_ids: torch.Tensor
    text_indexes: torch.Tensor
    position_ids: torch.Tensor  # [3, U + G]
    und_len: int
    sequence_length: int
    vision_token_shapes: list[tuple[int, int, int]]
    vision_sequence_indexes: torch.Tensor
    vision_mse_loss_indexes: torch.Tensor
    vision_noisy_frame_indexes: list[torch.Tensor]
    action_token_shapes: list[tuple[int, int, int]]
    action_sequence_indexes: torch.Tensor
    action_mse_loss_indexes: torch.Tensor
    action_noisy_frame_indexes: list[torch.Tensor]
    num_noisy_vision_tokens: list[int]
    num_noisy_action_tokens: list[int]
    und_segment: torch.Tensor
    gen_segment: torch.Tensor
    und_bounds: list[tuple[int, int]] = field(default_factory=list)  # per request [start, end) in und
    gen_bounds: list[tuple[int, int]] = field(default_factory=list)  # per request [start, end) in gen
    masks: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    flex_masks: tuple[BlockMask, BlockMask] | None = field(default=None, repr=False)

    def attention_masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks (True = may attend): und [U, U] causal within a request, gen [G, U + G] within a
        request. Built once per layout (they are the same for every layer and step)."""
        if self.masks is None:
            u, g = self.und_segment, self.gen_segment
            causal = torch.ones(len(u), len(u), dtype=torch.bool, device=u.device).tril()
            und_mask = (u[:, None] == u[None, :]) & causal
            gen_mask = g[:, None] == torch.cat([u, g])[None, :]
            self.masks = (und_mask, gen_mask)
        return self.masks

    def flex_block_masks(self) -> tuple[BlockMask, BlockMask]:
        """The masks of :meth:`attention_masks` as flex-attention block masks (und over [U] keys, gen
        over the ``[text | generation]`` keys [U + G]). Built once per layout, shared by all layers."""
        if self.flex_masks is None:
            u, g = self.und_segment, self.gen_segment
            kv = torch.cat([u, g])

            def und_mod(b, h, q_idx, kv_idx):
                return (u[q_idx] == u[kv_idx]) & (kv_idx <= q_idx)

            def gen_mod(b, h, q_idx, kv_idx):
                return g[q_idx] == kv[kv_idx]

            self.flex_masks = (
                segment_block_mask(u, u, und_mod, causal=True, n=self.n),
                segment_block_mask(g, kv, gen_mod, n=self.n),
            )
        return self.flex_masks

    def forward_kwargs(
        self,
        vision_tokens: list[torch.Tensor],
        vision_timesteps: torch.Tensor,
        action_tokens: list[torch.Tensor],
        action_timesteps: torch.Tensor,
        domain_ids: list[torch.Tensor],
    ) -> dict[str, Any]:
        """Keyword arguments of ``Cosmos3OmniTransformer.forward`` for one step.

        vision_tokens: N latents [1, C, T, h, w]; action_tokens: N chunks [chunk, action_dim];
        timesteps: one value per noisy token (request order), in the model's 0..1000 scale.
        """
        return dict(
            input_ids=self.input_ids,
            text_indexes=self.text_indexes,
            position_ids=self.position_ids,
            und_len=self.und_len,
            sequence_length=self.sequence_length,
            vision_tokens=vision_tokens,
            vision_token_shapes=self.vision_token_shapes,
            vision_sequence_indexes=self.vision_sequence_indexes,
            vision_mse_loss_indexes=self.vision_mse_loss_indexes,
            vision_timesteps=vision_timesteps,
            vision_noisy_frame_indexes=self.vision_noisy_frame_indexes,
            action_tokens=action_tokens,
            action_token_shapes=self.action_token_shapes,
            action_sequence_indexes=self.action_sequence_indexes,
            action_mse_loss_indexes=self.action_mse_loss_indexes,
            action_timesteps=action_timesteps,
            action_noisy_frame_indexes=self.action_noisy_frame_indexes,
            action_domain_ids=domain_ids,
            return_dict=False,
        )


def pack(requests: list[RequestSegments], device: torch.device) -> PackedLayout:
    """Concatenate request-local segments into one joint sequence (see the module docstring)."""
    if not requests:
        raise ValueError("pack: no requests")
    und_total = sum(r.und_len for r in requests)
    ids, text_idx, und_pos, gen_pos = [], [], [], []
    vis_seq, vis_mse, act_seq, act_mse, und_seg, gen_seg = [], [], [], [], [], []
    u_off, g_off = 0, und_total
    und_bounds, gen_bounds = [], []
    for i, r in enumerate(requests):
        und_bounds.append((u_off, u_off + r.und_len))
        gen_bounds.append((g_off - und_total, g_off - und_total + r.gen_len))
        local_und = r.und_len

        def to_global(idx: torch.Tensor, u_off=u_off, g_off=g_off, local_und=local_und) -> torch.Tensor:
            return torch.where(idx < local_und, idx + u_off, idx - local_und + g_off)

        ids.append(r.text["input_ids"])
        text_idx.append(to_global(r.text["text_indexes"]))
        und_pos.append(r.text["text_mrope_ids"].float())
        gen_pos.append(r.vision["vision_mrope_ids"].float())
        gen_pos.append(r.action["action_mrope_ids"].float())
        vis_seq.append(to_global(r.vision["vision_sequence_indexes"]))
        vis_mse.append(to_global(r.vision["vision_mse_loss_indexes"]))
        act_seq.append(to_global(r.action["action_sequence_indexes"]))
        act_mse.append(to_global(r.action["action_mse_loss_indexes"]))
        und_seg.append(torch.full((local_und,), i, dtype=torch.long))
        gen_seg.append(torch.full((r.gen_len,), i, dtype=torch.long))
        u_off += local_und
        g_off += r.gen_len

    # everything is joined on the host and each field crosses to the device once, from pinned memory
    # without waiting (a pageable copy per request field waited for the GPU: 13-15 waits per request per
    # training step, which kept the host from running ahead of the GPU)
    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return to_device(torch.cat([x.cpu() for x in xs]), device)

    def split(parts: list[torch.Tensor]) -> list[torch.Tensor]:  # one crossing, then views per part
        return list(torch.split(cat(parts), [len(x) for x in parts])) if parts else []

    return PackedLayout(
        n=len(requests),
        input_ids=cat(ids),
        text_indexes=cat(text_idx),
        position_ids=to_device(torch.cat([x.cpu() for x in und_pos + gen_pos], dim=1), device),
        und_len=und_total,
        sequence_length=g_off,
        vision_token_shapes=[s for r in requests for s in r.vision["vision_token_shapes"]],
        vision_sequence_indexes=cat(vis_seq),
        vision_mse_loss_indexes=cat(vis_mse).long(),
        vision_noisy_frame_indexes=split(
            [x for r in requests for x in r.vision["vision_noisy_frame_indexes"]]
        ),
        action_token_shapes=[s for r in requests for s in r.action["action_token_shapes"]],
        action_sequence_indexes=cat(act_seq),
        action_mse_loss_indexes=cat(act_mse).long(),
        action_noisy_frame_indexes=split(
            [x for r in requests for x in r.action["action_noisy_frame_indexes"]]
        ),
        num_noisy_vision_tokens=[int(r.vision["num_noisy_vision_tokens"]) for r in requests],
        num_noisy_action_tokens=[int(r.action["num_noisy_action_tokens"]) for r in requests],
        und_segment=cat(und_seg),
        gen_segment=cat(gen_seg),
        und_bounds=und_bounds,
        gen_bounds=gen_bounds,
    )


def segment_block_mask(
    q_seg: torch.Tensor,
    kv_seg: torch.Tensor,
    mask_mod: Callable,
    block: int = FLEX_BLOCK,
    causal: bool = False,
    n: int | None = None,
) -> BlockMask:
    """The flex-attention block mask of "query i sees key j iff ``q_seg[i] == kv_seg[j]``" (and j <= i if
    ``causal``; then queries and keys are one sequence); ``mask_mod`` must say the same per element.

    Its tables are those ``create_block_mask(mask_mod, ...)`` gives (tests/test_cosmos3_flex.py), but
    built from how many tokens of each request every block holds ([blocks, N]): eager
    ``create_block_mask`` materialises the [Q, KV] boolean mask first, quadratic in the packed length.
    Segment ids are 0..N-1 (``n``: N, when the caller knows it; reading it off device tensors waits for
    the GPU); the last block's padding belongs to no request, so it is never full.
    """
    if n is None:
        n = int(torch.cat([q_seg, kv_seg]).max()) + 1

    def counts(seg: torch.Tensor) -> torch.Tensor:  # [blocks, n] tokens of each request per block
        pad = torch.full((-len(seg) % block,), n, dtype=seg.dtype, device=seg.device)
        hot = torch.nn.functional.one_hot(torch.cat([seg, pad]), n + 1)[:, :n]
        return hot.view(-1, block, n).sum(1).double()

    cq = counts(q_seg)
    pairs = cq @ counts(kv_seg).T  # [Q blocks, KV blocks]: (query, key) pairs of one request
    if causal:  # blocks below the diagonal keep all pairs, above none, on it c (c + 1) / 2 per request
        pairs = pairs.tril(-1) + torch.diag((cq * (cq + 1) / 2).sum(1))
    full = pairs == block * block
    partial = (pairs > 0) & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as flex's own tables
        dense = dense.to(torch.int32)[None, None]
        idx = torch.argsort(dense, dim=-1, descending=True, stable=True)
        return dense.sum(-1).to(torch.int32), idx.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(len(q_seg), len(kv_seg)),
    )


@functools.cache
def _compiled_flex() -> Callable:
    """``flex_attention`` compiled (eager it materialises every score; the documented pattern is one
    compiled function called from the eager model). ``dynamic=True``: the packed lengths change with
    every batch's prompts, and the und and gen calls differ anyway; on the CPU two compilations served
    every later length."""
    return torch.compile(flex_attention, dynamic=True)


@torch.compiler.disable
def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """Packed attention under ``block_mask``: q [L, H, d], k / v [S, KV, d] (H a multiple of KV) ->
    [L, H * d]. Compiled on CUDA, eager elsewhere (forward only there).

    Never traced into a compiled caller (``train.compile``'s blocks): there the block mask's sequence
    lengths, plain ints, became guards, so every new packed length recompiled the block until dynamo's
    recompile limit left it eager; and inductor's CPU flex template fails to build for dynamic shapes.
    Called apart, this function's own compilation serves every length, as it does from eager code."""
    dev = q.device.type
    # flex_attention is no autocast op (SDPA is): give it the dtype autocast would
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
    q, k, v = (x.to(dt).transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    if dev == "cuda":
        # never inductor's decoding kernel, which it picks for a short query (a small packed batch) and
        # which has no backward: under dynamic shapes it failed with NoValidChoicesError (LoRA at
        # micro-batch 2, torch 2.11; docs/cosmos3.md, "An int8 base")
        out = _compiled_flex()(
            q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options={"FORCE_USE_FLEX_ATTENTION": True}
        )
    else:
        with warnings.catch_warnings():  # eager is the intended reference off CUDA, not an oversight
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1).flatten(-2, -1)


def resolve_attention(mode: str, device: torch.device) -> str:
    """The attention mode ``mode`` means for tensors on ``device``: ``auto`` is flex on CUDA, mask
    elsewhere (flex attention is compiled on CUDA; on the CPU it is an eager reference path)."""
    if mode != "auto":
        return mode
    return "flex" if torch.device(device).type == "cuda" else "mask"


class SegmentMaskedAttnProcessor(Cosmos3AttnProcessor):
    """Cosmos3's dual-pathway attention kept inside each packed request.

    With no ``layout`` (one request) it *is* the stock processor (``super().__call__``). Otherwise it
    runs the same projections, norms and rotary embedding through the attention module's own layers,
    for all requests at once, and then attends per request: ``mode="mask"`` with one masked call per
    pathway (the block masks of :meth:`PackedLayout.attention_masks`), ``mode="loop"`` with one
    unmasked call per request and pathway (flash kernels; more launches), ``mode="flex"`` with one
    flex-attention call per pathway (:meth:`PackedLayout.flex_block_masks`; on the CPU a call that needs
    gradients takes the ``"mask"`` computation, see the module docstring); ``mode="auto"`` (the
    options' default) is flex on CUDA and mask elsewhere, chosen per call from where the tensors are.
    The tests pin mask, loop and flex to the stock processor: N packed requests give the outputs of N
    separate stock calls.
    """

    def __init__(self, mode: str) -> None:
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode {mode!r}; expected one of {ATTENTION_MODES}")
        self.mode = mode
        self.layout: PackedLayout | None = None
        self._warned_cpu_grad = False

    def prepare(self, layout: PackedLayout, device: torch.device) -> None:
        """Set the layout of the next transformer call and build the masks its attention mode reads.

        Built here, before the layers run, so that no layer builds them: a compiled block would
        otherwise trace one graph for the first layer (masks absent) and another for the rest, and
        under gradient checkpointing the first layer's recomputation would pick the second graph and
        save different tensors than its forward did."""
        self.layout = layout
        if layout.n == 1:
            return
        mode = resolve_attention(self.mode, device)
        if mode == "flex":
            layout.flex_block_masks()
            if device.type == "cpu" and torch.is_grad_enabled():  # the masked fallback of _flex_or_mask
                if not self._warned_cpu_grad:
                    log.info(
                        "attention 'flex': no CPU backward in flex_attention; calls with gradients use 'mask'"
                    )
                    self._warned_cpu_grad = True
                layout.attention_masks()
        elif mode == "mask":
            layout.attention_masks()

    def __call__(self, attn, und_seq, gen_seq, rotary_emb):
        if self.layout is None or self.layout.n == 1:
            return super().__call__(attn, und_seq, gen_seq, rotary_emb)
        lay = self.layout
        h, kv, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
        q_und = attn.norm_q(attn.to_q(und_seq).view(-1, h, d))
        k_und = attn.norm_k(attn.to_k(und_seq).view(-1, kv, d))
        v_und = attn.to_v(und_seq).view(-1, kv, d)
        k_und_for_gen = attn.k_norm_und_for_gen(k_und) if attn.k_norm_und_for_gen is not None else k_und
        q_gen = attn.norm_added_q(attn.add_q_proj(gen_seq).view(-1, h, d))
        k_gen = attn.norm_added_k(attn.add_k_proj(gen_seq).view(-1, kv, d))
        v_gen = attn.add_v_proj(gen_seq).view(-1, kv, d)

        cos_und, sin_und, cos_gen, sin_gen = (x.unsqueeze(1) for x in rotary_emb)

        def rope(x, cos, sin):
            return x * cos + _rotate_half(x) * sin

        q_und, k_und = rope(q_und, cos_und, sin_und), rope(k_und, cos_und, sin_und)
        k_und_for_gen = rope(k_und_for_gen, cos_und, sin_und)
        q_gen, k_gen = rope(q_gen, cos_gen, sin_gen), rope(k_gen, cos_gen, sin_gen)

        def attend(q, k, v, mask=None, causal=False):
            if mask is not None:  # PyTorch's masked (memory-efficient) kernel lacks GQA: expand the KV heads
                k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
            out = dispatch_attention_fn(
                q.unsqueeze(0),
                k.unsqueeze(0),
                v.unsqueeze(0),
                attn_mask=None if mask is None else mask[None, None],
                is_causal=causal,
                enable_gqa=mask is None,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            return out.squeeze(0).flatten(-2, -1)

        mode = resolve_attention(self.mode, und_seq.device)
        if mode == "loop":
            und_parts, gen_parts = [], []
            for (us, ue), (gs, ge) in zip(lay.und_bounds, lay.gen_bounds):
                und_parts.append(attend(q_und[us:ue], k_und[us:ue], v_und[us:ue], causal=True))
                k = torch.cat([k_und_for_gen[us:ue], k_gen[gs:ge]])
                v = torch.cat([v_und[us:ue], v_gen[gs:ge]])
                gen_parts.append(attend(q_gen[gs:ge], k, v))
            und_out, gen_out = torch.cat(und_parts), torch.cat(gen_parts)
        elif mode == "flex":
            k_all, v_all = torch.cat([k_und_for_gen, k_gen]), torch.cat([v_und, v_gen])
            und_bm, gen_bm = lay.flex_block_masks()
            und_out = self._flex_or_mask(attend, q_und, k_und, v_und, und_bm, 0)
            gen_out = self._flex_or_mask(attend, q_gen, k_all, v_all, gen_bm, 1)
        else:
            und_mask, gen_mask = lay.attention_masks()
            und_out = attend(q_und, k_und, v_und, und_mask)
            gen_out = attend(q_gen, torch.cat([k_und_for_gen, k_gen]), torch.cat([v_und, v_gen]), gen_mask)
        return attn.to_out(und_out), attn.to_add_out(gen_out)

    def _flex_or_mask(self, attend, q, k, v, block_mask: BlockMask, pathway: int) -> torch.Tensor:
        """Flex attention, or on the CPU, where it has no backward, the masked call when gradients are
        needed (the library would refuse: it checks the same ``requires_grad``)."""
        if q.device.type != "cpu" or not (q.requires_grad or k.requires_grad or v.requires_grad):
            return flex_attend(q, k, v, block_mask)
        return attend(q, k, v, self.layout.attention_masks()[pathway])


def install_processor(transformer: torch.nn.Module, mode: str) -> SegmentMaskedAttnProcessor:
    """Give every decoder layer's attention one shared :class:`SegmentMaskedAttnProcessor`."""
    proc = SegmentMaskedAttnProcessor(mode)
    for layer in transformer.layers:
        layer.self_attn.set_processor(proc)
    return proc
