"""Which Cosmos3 parameters belong to which tower, and the FLOPs that follow from it.

Each ``Cosmos3VLTextMoTDecoderLayer`` holds two weight sets sharing one attention: the
*understanding* tower (text stream, frozen in the SFT recipe) and the *generation* tower (vision and
action tokens, trained). Names are diffusers' parameter names of ``Cosmos3OmniTransformer``.
"""

from __future__ import annotations

import torch

# Parameter-name prefixes inside a decoder layer that belong to the generation tower.
_GEN_LAYER_PARTS = (
    "self_attn.add_q_proj.",
    "self_attn.add_k_proj.",
    "self_attn.add_v_proj.",
    "self_attn.to_add_out.",
    "self_attn.norm_added_q.",
    "self_attn.norm_added_k.",
    "mlp_moe_gen.",
    "input_layernorm_moe_gen.",
    "post_attention_layernorm_moe_gen.",
)
_UND_LAYER_PARTS = (
    "self_attn.to_q.",
    "self_attn.to_k.",
    "self_attn.to_v.",
    "self_attn.to_out.",
    "self_attn.norm_q.",
    "self_attn.norm_k.",
    # normalises the understanding keys the generation tokens read: cosmos' trainable set selects by
    # "moe_gen" in the name, which this (k_norm_und_for_gen) lacks, so it stays frozen
    "self_attn.k_norm_und_for_gen.",
    "mlp.",
    "input_layernorm.",
    "post_attention_layernorm.",
)
# The generation tower's linear layers inside a decoder layer (what train.lora adapts by default).
GEN_LINEARS = (
    "self_attn.add_q_proj",
    "self_attn.add_k_proj",
    "self_attn.add_v_proj",
    "self_attn.to_add_out",
    "mlp_moe_gen.gate_proj",
    "mlp_moe_gen.up_proj",
    "mlp_moe_gen.down_proj",
)
_GEN_TOP = ("norm_moe_gen.", "time_embedder.", "proj_in.", "proj_out.")
_FROZEN_TOP = ("embed_tokens.", "lm_head.", "norm.", "audio_")
_ACTION_TOP = ("action_proj_in.", "action_proj_out.", "action_modality_embed")


def param_role(name: str) -> str:
    """``"action_heads"``, ``"generation"`` or ``"frozen"`` for a transformer parameter name.

    An unknown name raises: a new diffusers parameter must be placed on purpose, not trained by accident.
    """
    if name.startswith(_ACTION_TOP):
        return "action_heads"
    if name.startswith(_GEN_TOP):
        return "generation"
    if name.startswith(_FROZEN_TOP):
        return "frozen"
    if name.startswith("layers."):
        rest = name.split(".", 2)[2]
        if rest.startswith(_GEN_LAYER_PARTS):
            return "generation"
        if rest.startswith(_UND_LAYER_PARTS):
            return "frozen"
    raise RuntimeError(
        f"cosmos3: parameter '{name}' is in neither tower; update wamkit.models.cosmos3.towers"
    )


def layer_params(transformer: torch.nn.Module) -> tuple[int, int]:
    """Parameters of all decoder layers: ``(understanding, generation)``."""
    und = gen = 0
    for name, p in transformer.layers.named_parameters():
        if param_role("layers." + name) == "frozen":
            und += p.numel()
        else:
            gen += p.numel()
    return und, gen


def forward_flops(transformer: torch.nn.Module, n_und: int, n_gen: int) -> tuple[float, float]:
    """Forward FLOPs of one request with ``n_und`` text and ``n_gen`` generation tokens:
    ``(understanding, generation)`` -- linear layers (2 per weight per token) plus attention (causal
    text: half of 4·L²·d; generation tokens attend to text and generation: 4·L_g·(L_u + L_g)·d)."""
    und_p, gen_p = layer_params(transformer)
    c = transformer.config
    d = c.num_attention_heads * c.head_dim * c.num_hidden_layers
    und = 2 * und_p * n_und + 2 * d * n_und * n_und
    gen = 2 * gen_p * n_gen + 4 * d * n_gen * (n_und + n_gen) + 4 * c.hidden_size * c.patch_latent_dim * n_gen
    return float(und), float(gen)


def train_flops(transformer: torch.nn.Module, n_und: int, n_gen: int) -> float:
    """Training FLOPs of one request: the frozen understanding tower runs forward only (no trainable
    parameter is upstream of it), the generation tower forward and backward (3x)."""
    und, gen = forward_flops(transformer, n_und, n_gen)
    return und + 3 * gen
