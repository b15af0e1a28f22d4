"""FP8 inference for linear layers: e4m3 weights with one scale per output row, activations quantized
per row on the fly, one ``torch._scaled_mm`` per layer (``serve.precision=fp8``).

The weights are quantized once (``w ~ w8 * s_w``, ``s_w = amax(|w row|) / 448``); each call quantizes
its input the same way per row (``s_x = amax(|x row|) / 448``) and multiplies in FP8 with the two
scale vectors applied to the float32 accumulator, output bf16. Eagerly the activation's amax and cast
are kernels of their own; inside a compiled step (Cosmos3's ``step_graph="compile"``) inductor fuses
them into one reduction kernel beside the neighbouring norm, which is where FP8 pays.

torchao's float8 inference recipe does the same (``Float8DynamicActivationFloat8WeightConfig`` with
``PerRow`` granularity) through tensor subclasses; :func:`quantize_linears_torchao` applies it to the
same layers, for ``wamkit bench cosmos3 --paths fast+compile+fp8_torchao`` to weigh the two. Serving
uses ``torch._scaled_mm`` because it ships with torch itself, where each torchao release supports a
narrow range of torch versions (0.18: torch 2.11 and newer).

Needs a GPU with FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell);
:func:`unsupported` says why not, for the error a user gets elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_CAPABILITY = (8, 9)


def unsupported(device: torch.device) -> str:
    """Why FP8 matmuls cannot run on ``device`` ("" when they can)."""
    if device.type != "cuda":
        return (
            f"FP8 needs a CUDA GPU with FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, "
            f"Blackwell); the model is on {device.type}"
        )
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 tensor cores need 8.9 or newer"
    return ""


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] as e4m3 and its per-row float32 scales [M, 1]."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` (no grad) in FP8 (module docstring). ``weight_fp8`` [out, in] e4m3 and
    ``weight_scale`` [1, out] float32; the bias kept in its dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = _rowwise(linear.weight.detach())
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        xq, xs = _rowwise(x.reshape(-1, shape[-1]))
        y = torch._scaled_mm(
            xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale, out_dtype=torch.bfloat16
        )
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3 rowwise"


def quantize_linears(root: nn.Module, keep=lambda name, m: True) -> int:
    """Replace every ``nn.Linear`` under ``root`` for which ``keep(name, module)`` holds (and whose
    sizes the FP8 kernels take: multiples of 16) by an :class:`Fp8Linear`; returns how many."""
    swaps = [
        (name, m)
        for name, m in root.named_modules()
        if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0 and keep(name, m)
    ]
    for name, m in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = root.get_submodule(parent_name) if parent_name else root
        setattr(parent, child, Fp8Linear(m))
    return len(swaps)


def quantize_linears_torchao(root: nn.Module, keep=lambda name, m: True) -> int:
    """The same layers as :func:`quantize_linears` (``keep``, multiples of 16) through torchao's float8
    inference recipe (dynamic per-row activations, per-row weights); returns how many. Raises
    ``RuntimeError`` when torchao is not installed."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as err:
        raise RuntimeError(f"FP8 through torchao needs the torchao package ({err})") from err
    names = {
        name
        for name, m in root.named_modules()
        if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0 and keep(name, m)
    }
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    quantize_(root, config, filter_fn=lambda m, fqn: fqn in names)
    return len(names)
