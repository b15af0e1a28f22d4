"""The understanding tower served from host memory, streamed to the device one layer at a time.

``serve.text_tower=host`` (docs/serve.md, "Where the text tower lives"; docs/cosmos3.md, "Serving in
24 GB"): the generation tower, the action heads
and the text key/value cache stay on the device; the understanding tower's decoder-layer weights rest
in pinned host memory (:class:`~wamkit.device.PinnedArena`: no power-of-two rounding), and the token
embeddings, final norm and LM head in ordinary host memory. They stay parameters of the module, so the
weights' hash, ``load_state_dict`` and the text cache's stamp (:func:`fast_policy.weights_stamp`) see
the very tensors the device-resident model has. A new prompt's keys/values are computed by
:func:`kv_step.encode_layers` over two device-resident copies of one layer's understanding half
("slots"): layer i runs in slot i % 2 while layer i + 1 is copied into the other on a side stream.

**Why streamed, not computed on the CPU** (Cosmos3-Nano, bf16, a caption of 141 tokens: a task
instruction with its view and timing fields):

- the tower's decoder layers hold 36 x 193.0M = 6.95B parameters = 13.9 GB (the other 1.24B of its
  8.19B are the embedding table, gathered row by row on the host, and the LM head, never run);
- streamed over PCIe at ~25 GB/s (Gen4 x16 from pinned memory; Gen5 about twice that) they take
  13.9 / 25 = 0.56 s, while the GPU computes each layer (2 x 193M x 141 = 54 GFLOP, 386 MB of weights
  read: ~0.1 ms) behind its copy: a new prompt costs ~0.6 s (~0.3 s on Gen5), whatever its length and
  whatever the host's CPU;
- on the CPU the same prompt is 2 x 6.95B x 141 = 1.96 TFLOP. On a host of 16 cores fp32 GEMM peaks
  near 16 x 2.5 GHz x 64 FLOP/cycle = 2.6 TFLOP/s (AVX-512, two FMA units),
  ~1.5 sustained, so 1.3 s and more, growing with the prompt; bf16 is faster only on CPUs with AMX,
  and slower without. Those cores are also the server's: its preprocessing, its batching, and the
  thread that launches the GPU's kernels (the served step is launch-bound at batch 1), which a
  concurrent CPU encode would slow for every request in flight;
- and the CPU's kernels round differently from the GPU's, where the streamed layers run the very
  kernels of the default server (bit-equal keys/values, below);
- so with the denoising of the first batch (docs/benchmarks.md, "Cosmos3") the streamed path should
  answer a new prompt in about 0.9 s, inside the 2 s target with room (the measured figure:
  docs/cosmos3.md, "Serving in 24 GB"); the CPU path would be at or past the target, and host-dependent.

Exactness: the slots run the same kernels on tensors of the same shapes, dtypes and layout, in the
same order, as the device-resident tower (the embedding gather on the host is a copy of rows), so the
keys/values, and hence the actions, are bit-equal to the default server's: tests/test_serve_text_tower.py
checks it on the CPU, where the "device" is the host and the copies are plain copies; on a GPU it is
expected for the same reason (docs/cosmos3.md, "Serving in 24 GB", compares the two servers' actions).

Only policy mode's fast path reads the text through keys/values; the stock path (the other modes, or
``fast_inference=false``) runs the whole module on one device and is refused by the adapter.
"""

from __future__ import annotations

import copy

import torch

from wamkit.device import PinnedArena, to_device
from wamkit.models.cosmos3.kv_step import TextKV, encode_layers

# a decoder layer's understanding half (towers.param_role: "frozen" inside a layer)
ATTN_PARTS = ("to_q", "to_k", "to_v", "to_out", "norm_q", "norm_k", "k_norm_und_for_gen")
LAYER_PARTS = ("input_layernorm", "mlp", "post_attention_layernorm")
ATTN_SIZES = ("num_attention_heads", "num_key_value_heads", "head_dim")


class TextHalf(torch.nn.Module):
    """One decoder layer's understanding half under the layer's own attribute paths
    (``self_attn.to_k``, ``mlp``, ...), so that :func:`kv_step.text_layer` runs it. ``own``: deep
    copies (a slot), else the layer's modules themselves (a view of the tower's host weights)."""

    def __init__(self, layer: torch.nn.Module, own: bool) -> None:
        super().__init__()
        take = copy.deepcopy if own else (lambda m: m)
        attn = torch.nn.Module()
        for name in ATTN_PARTS:
            part = getattr(layer.self_attn, name)
            setattr(attn, name, None if part is None else take(part))
        for name in ATTN_SIZES:
            setattr(attn, name, getattr(layer.self_attn, name))
        self.self_attn = attn
        for name in LAYER_PARTS:
            setattr(self, name, take(getattr(layer, name)))


def tower_parameter_names(module: torch.nn.Module) -> set[str]:
    """The names of the parameters that rest in host memory (every layer's understanding half, the
    embeddings, final norm and LM head: :func:`towers.param_role` "frozen")."""
    from wamkit.models.cosmos3.towers import param_role

    return {n for n, _ in module.named_parameters() if param_role(n) == "frozen"}


class StreamedTextTower:
    """The understanding tower of ``module`` in host memory, run on ``device`` layer by layer.

    Built by :meth:`Cosmos3Adapter.place_text_tower`, which has put everything else on ``device``.
    :meth:`encode` gives one prompt's :class:`TextKV` on ``device``."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.arena = PinnedArena() if self.cuda else None
        self.layers = [TextHalf(layer, own=False) for layer in module.layers]
        with torch.no_grad():
            if self.arena is not None:  # pinned: the copies to the device run asynchronously
                for half in self.layers:
                    for p in half.parameters():
                        p.data = self.arena.zeros(p.shape, p.dtype).copy_(p.data)
            self.slots = [TextHalf(module.layers[0], own=True).to(self.device) for _ in range(2)]
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in self.slots] if self.cuda else None

    @property
    def pinned_bytes(self) -> int:
        return self.arena.reserved if self.arena is not None else 0

    def slot_bytes(self) -> int:
        """Device bytes of the two slots."""
        return sum(p.numel() * p.element_size() for s in self.slots for p in s.parameters())

    def _load(self, i: int) -> None:
        """Copy layer ``i``'s weights into slot ``i % 2`` (on the side stream, behind the compute that
        last read that slot; its readiness is recorded in ``_ready``)."""
        slot = self.slots[i % 2]
        with torch.no_grad():
            if self._copy_stream is None:
                for dst, src in zip(slot.parameters(), self.layers[i].parameters(), strict=True):
                    dst.copy_(src)
                return
            with torch.cuda.stream(self._copy_stream):
                for dst, src in zip(slot.parameters(), self.layers[i].parameters(), strict=True):
                    dst.copy_(src, non_blocking=True)
                self._ready[i % 2].record(self._copy_stream)

    def _stream(self):
        """The slots in layer order, each holding its layer's weights when handed out: before layer i
        is handed out, layer i + 1 is queued into the other slot, behind layer i - 1's kernels (that
        slot's last reader), so that its copy runs while layer i computes."""
        n, copying = len(self.layers), self._copy_stream is not None
        compute = torch.cuda.current_stream(self.device) if copying else None
        if copying:  # the slots' last readers (a previous prompt's layers) go first
            self._copy_stream.wait_stream(compute)
        self._load(0)
        for i in range(n):
            if i + 1 < n:
                if copying:
                    self._copy_stream.wait_stream(compute)  # queued so far: layers up to i - 1
                self._load(i + 1)
            if copying:
                compute.wait_event(self._ready[i % 2])
            yield self.slots[i % 2]

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> TextKV:
        """One prompt's keys/values (ids [U] and mRoPE positions [3, U], on the host) on the device."""
        x = to_device(self.module.embed_tokens(input_ids.cpu()), self.device)  # rows gathered on the host
        return encode_layers(self.module, x, to_device(position_ids, self.device), self._stream())
