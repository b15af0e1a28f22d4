"""The fast policy path's state: the text keys/values cache and, on CUDA, one captured step per bucket.

- :class:`TextKVMemoryCache`: a bounded LRU of :class:`~wamkit.models.cosmos3.kv_step.TextKV` keyed by prompt and
  canvas (the caption text and the (height, width) it was written for). It is emptied when the
  understanding weights change (a new storage or an in-place write: ``load_state_dict``), so a cached
  prompt never outlives the weights it was computed with. A write through ``p.data`` bypasses
  PyTorch's version counter: call :meth:`FastPolicy.clear` after one.
- :class:`FastPolicy.velocity` gives the velocity function of one batch for the sampler.
  ``step_graph="none"`` (and always on CPU): :func:`~wamkit.models.cosmos3.kv_step.gen_step` runs eagerly
  at the batch's own size. ``"cuda_graph"``: the batch is padded to a bucket (the next power of two,
  by repeating its last request; the text to a multiple of ``TEXT_BUCKET`` tokens) and the step of that
  bucket is captured once as a CUDA graph on static buffers; each call copies the latents in, replays,
  and returns clones of the outputs, so no buffer of one call is handed out by the next. ``"compile"``:
  the same static buffers run through ``torch.compile(mode="reduce-overhead")``, with the attention
  as a flex-attention kernel that masks each request's text padding from its prompt length (the SDPA
  kernels that take a mask lack grouped-query attention, so the captured SDPA step expands the text
  keys/values to every head and copies them at every step). ``"compile_layers"``: one decoder layer's
  generation half compiled (one graph serves every layer of a bucket) and the step around it captured
  as a CUDA graph. ``"auto"`` is ``"compile_layers"``. What compiling produced is kept between starts by the
  server (:mod:`wamkit.models.compile_cache`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch.distributed.tensor import DTensor

from wamkit.device import to_device
from wamkit.models.cosmos3 import STEP_GRAPHS
from wamkit.models.cosmos3.host_tower import StreamedTextTower
from wamkit.models.cosmos3.kv_step import (
    StepContext,
    TextKV,
    _gen_layer,
    build_context,
    encode_text,
    gen_step,
)
from wamkit.models.cosmos3.packing import RequestSegments
from wamkit.models.cosmos3.towers import param_role

TEXT_BUCKET = 32  # captured steps pad the text to a multiple of this: few buckets, little waste
RECOMPILE_LIMIT = 64  # compiled step shapes kept (batch buckets x text buckets)

Velocity = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def batch_bucket(n: int) -> int:
    """The captured batch size that serves ``n`` requests: the next power of two."""
    return 1 << max(n - 1, 0).bit_length()


class TextKVMemoryCache:
    """LRU of per-prompt text keys/values (at most ``capacity`` prompts)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Hashable, TextKV] = OrderedDict()
        self._stamp: Hashable = None
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable, stamp: Hashable, compute: Callable[[], TextKV]) -> TextKV:
        if stamp != self._stamp:  # other weights: every entry is stale
            self.clear()
            self._stamp = stamp
        if key in self._items:
            self.hits += 1
            self._items.move_to_end(key)
            return self._items[key]
        self.misses += 1
        kv = self._items[key] = compute()
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
        return kv

    def clear(self) -> None:
        self._items.clear()


def weights_stamp(module: torch.nn.Module) -> tuple:
    """Identity of the weights the text keys/values depend on (storage and in-place version)."""
    parts = [
        (p.data_ptr(), p._version, p.dtype)
        for name, p in module.named_parameters()
        if param_role(name) == "frozen" and name.startswith(("layers.", "embed_tokens."))
    ]
    return tuple(parts) + (module.rotary_emb.inv_freq.data_ptr(),)


class _StaticStep:
    """The step of one bucket on static buffers: a private copy of the context and the latent inputs.
    ``mode``: "cuda_graph" (captured), "compile", "compile_layers" (a compiled layer inside a captured
    step), or "none" (run eagerly: the CPU check of the rest). On the CPU nothing is captured."""

    def __init__(self, module, ctx: StepContext, lat_v_shape, lat_a_shape, mode: str, pool) -> None:
        self.module, self.mode = module, mode
        dev = ctx.cos.device
        self.ctx = StepContext(**{k: _clone(v) for k, v in vars(ctx).items()})
        self.lat_v = torch.zeros(lat_v_shape, device=dev)
        self.lat_a = torch.zeros(lat_a_shape, device=dev)
        self.t = torch.full((1,), 500.0, device=dev)
        self.layer_fn, self.graph, self.out = None, None, None
        if mode in ("compile", "compile_layers"):
            # each bucket (batch, text length) is another shape of the one compiled function: one graph
            # each, past dynamo's default limit of 8 per function (beyond which it would run eagerly)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        if mode == "compile":
            for t in (*self.ctx.tensors(), self.lat_v, self.lat_a, self.t):
                torch._dynamo.mark_static_address(t)  # the same buffers every call: no input copies
            self.fn = torch.compile(
                functools.partial(gen_step, module), mode="reduce-overhead", dynamic=False, fullgraph=True
            )
        elif mode == "compile_layers":
            # one decoder layer's generation half compiled (the layers share its code and shapes: one
            # graph per bucket, 1/36 of the whole step's tracing), the step around it captured
            self.layer_fn = compiled_layer()
        if mode in ("cuda_graph", "compile_layers") and dev.type == "cuda":
            self.graph, self.out = self._capture(pool)

    def _capture(self, pool):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (cuBLAS handles, kernel choice,
            for _ in range(2):  # and the compiled layer's compile)
                gen_step(self.module, self.ctx, self.lat_v, self.lat_a, self.t, self.layer_fn)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a server's other threads may use CUDA while this one captures
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = gen_step(self.module, self.ctx, self.lat_v, self.lat_a, self.t, self.layer_fn)
        return graph, out

    def load(self, ctx: StepContext) -> None:
        for dst, src in zip(self.ctx.tensors(), ctx.tensors(), strict=True):
            dst.copy_(src)

    def __call__(self, lat_v: torch.Tensor, lat_a: torch.Tensor, t: torch.Tensor):
        n = lat_v.shape[0]
        self.lat_v[:n].copy_(lat_v)
        self.lat_a[:n].copy_(lat_a)
        self.t.copy_(t)
        if self.mode == "compile":
            torch.compiler.cudagraph_mark_step_begin()
            out = self.fn(self.ctx, self.lat_v, self.lat_a, self.t)
        elif self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            out = gen_step(self.module, self.ctx, self.lat_v, self.lat_a, self.t, self.layer_fn)
        return out[0][:n].clone(), out[1][:n].clone()


_COMPILED_LAYER = None


def compiled_layer():
    """The compiled generation half of a decoder layer, one function for every layer and bucket
    (dynamo inlines the layer module, so its weights are inputs and the code is shared)."""
    global _COMPILED_LAYER
    if _COMPILED_LAYER is None:
        _COMPILED_LAYER = torch.compile(_gen_layer, dynamic=False, fullgraph=True)
    return _COMPILED_LAYER


def _clone(v):
    if isinstance(v, list):
        return [x.clone() for x in v]
    return None if v is None else v.clone()


class FastPolicy:
    """Text K/V cache plus batched (optionally captured) generation steps for one transformer."""

    def __init__(self, module: torch.nn.Module, cache_size: int, step_graph: str = "none") -> None:
        if step_graph not in STEP_GRAPHS:
            raise ValueError(f"step_graph {step_graph!r}; expected one of {STEP_GRAPHS}")
        self.module, self.step_graph = module, step_graph
        self.cache = TextKVMemoryCache(cache_size)
        self._steps: dict[tuple, _StaticStep] = {}
        self._pool = None
        # pad to buckets on static buffers even without a graph (the tests check the captured path's
        # padding and masking this way on the CPU)
        self.bucketed = False
        # run step_graph="compile" on the CPU too (without CUDA graphs): the CPU check of the compiled step
        self.compile_on_cpu = False
        # auto: compiled steps mask the text padding inside a flex-attention kernel (grouped-query, no
        # expanded text copies), the others use SDPA; "sdpa" / "flex" force one (benchmarks, CPU checks)
        self.attention = "auto"
        # serve.text_tower=host: the understanding tower rests in host memory and a new prompt's
        # keys/values are computed by streaming its layers (models/cosmos3/host_tower.py)
        self.text_tower: StreamedTextTower | None = None

    def mode(self) -> str:
        """The step this policy runs on its module's device: ``auto`` is ``compile_layers`` on CUDA (as
        fast as ``compile`` and compiled in a fraction of its time: docs/benchmarks.md); on the CPU every
        mode runs eagerly (unless :attr:`compile_on_cpu`)."""
        mode = "compile_layers" if self.step_graph == "auto" else self.step_graph
        if self.module.proj_in.weight.device.type == "cuda":
            return mode
        return mode if mode in ("compile", "compile_layers") and self.compile_on_cpu else "none"

    def usable(self) -> bool:
        """False for an FSDP2-sharded module: the fast step calls the layers' submodules directly,
        past the per-block hooks that gather the shards (the stock path then serves)."""
        return not isinstance(self.module.proj_in.weight, DTensor)

    def clear(self) -> None:
        """Forget cached prompts and captured steps (after changing weights behind PyTorch's back)."""
        self.cache.clear()
        self._steps.clear()

    def stamp(self) -> tuple:
        """The identity of the weights, device and dtype the cached text keys/values belong to."""
        weight = self.module.proj_in.weight
        return weights_stamp(self.module), weight.device, weight.dtype

    def text_kv(self, key: Hashable, segment: RequestSegments, stamp: tuple | None = None) -> TextKV:
        """The text keys/values of one prompt; ``stamp``: :meth:`stamp`, taken once per batch."""
        dev = self.module.proj_in.weight.device
        text = segment.text

        def compute() -> TextKV:
            ids, pos = text["input_ids"], text["text_mrope_ids"]
            if self.text_tower is not None:  # the tower in host memory, streamed layer by layer
                return self.text_tower.encode(ids, pos)
            return encode_text(self.module, to_device(ids, dev), to_device(pos, dev))

        return self.cache.get(key, self.stamp() if stamp is None else stamp, compute)

    def velocity(
        self,
        keys: list[Hashable],
        segments: list[RequestSegments],
        latent_shape: tuple[int, int, int, int],
        action_shape: tuple[int, int],
        vision_cond: tuple[int, ...],
        action_cond: tuple[int, ...],
        domain_id: int,
        eager: bool = False,
    ) -> Velocity:
        """``f(lat_v [B, C, T, h, w], lat_a [B, A, D], t [1]) -> (v_v, v_a)`` for these B requests.

        ``keys``: per request its prompt's cache key; ``latent_shape`` = (C, T, h, w); ``action_shape``
        = (A, D). ``eager``: the step runs eagerly at the batch's size whatever ``step_graph`` says (a
        function to differentiate: real-time chunking's guidance, ``wamkit.models.rtc``)."""
        stamp = self.stamp()  # one walk over the weights per batch, not one per request
        texts = [self.text_kv(k, s, stamp) for k, s in zip(keys, segments)]
        gen_pos = [
            torch.cat([s.vision["vision_mrope_ids"], s.action["action_mrope_ids"]], 1) for s in segments
        ]
        _, t_lat, h, w = latent_shape
        p = self.module.config.latent_patch_size
        frame_tokens = -(-h // p) * -(-w // p)
        args = (t_lat, frame_tokens, vision_cond, action_cond, domain_id)
        mode = self.mode()
        if eager or (mode == "none" and not self.bucketed):
            ctx = build_context(self.module, texts, gen_pos, *args)
            return functools.partial(gen_step, self.module, ctx)
        n, nb = len(texts), batch_bucket(len(texts))
        texts, gen_pos = texts + [texts[-1]] * (nb - n), gen_pos + [gen_pos[-1]] * (nb - n)
        u = -(-max(t.length for t in texts) // TEXT_BUCKET) * TEXT_BUCKET
        compiled = mode in ("compile", "compile_layers")
        attention = self.attention if self.attention != "auto" else "flex" if compiled else "sdpa"
        ctx = build_context(
            self.module, texts, gen_pos, *args, text_length=u, masked=True, attention=attention
        )
        key = (mode, ctx.signature(), latent_shape, action_shape, vision_cond, action_cond)
        if key not in self._steps:
            if self._pool is None and mode == "cuda_graph":
                self._pool = torch.cuda.graph_pool_handle()  # buckets replay one at a time: one pool
            self._steps[key] = _StaticStep(
                self.module, ctx, (nb, *latent_shape), (nb, *action_shape), mode, self._pool
            )
        step = self._steps[key]
        step.load(ctx)
        return step
