"""The fast Cosmos3 policy path against the stock diffusers path (tiny preset, fp32, CPU).

Same seed, same sampler: the fast path (cached text keys/values, requests on a batch axis) must give
the actions and the future latents of ``Cosmos3OmniTransformer.forward`` over packed requests.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.config import ConfigError, ModelConfig  # noqa: E402
from wamkit.constants import OBS_STATE, TASK, image_key  # noqa: E402
from wamkit.models import ModelIO, build_model  # noqa: E402
from wamkit.models.cosmos3.fast_policy import TextKVMemoryCache, batch_bucket  # noqa: E402
from wamkit.models.cosmos3.kv_step import build_context, gen_step  # noqa: E402

IO = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")
# stock (packed requests, text recomputed) against fast (cached text keys/values, a batch axis): each
# sampling step's reordered sums (192 wide, 4 deep) over the tiny model's steps (tests/exactness.py)
LENGTH = 192 * 4 * 4
# three prompts of different token counts: the mixed batch pads and masks the shorter ones
TASKS = [
    "put the black bowl on the plate",
    "open the top drawer of the cabinet and put the bowl inside it",
    "stack",
]


def make_batch(tasks: list[str], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    b = len(tasks)
    batch = {
        image_key(c): torch.from_numpy(rng.integers(0, 256, (b, 64, 64, 3), dtype=np.uint8))
        for c in IO.cameras
    }
    batch[OBS_STATE] = torch.zeros(b, 8)
    batch[TASK] = list(tasks)
    return batch


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(2)
    opts = {"num_inference_steps": 4, "dtype": "float32"}
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options=opts), IO)


def both_paths(ad, batch: dict, seed: int) -> tuple[dict, dict]:
    """(stock, fast) outputs with actions and latents, fast path asserted not to call forward."""
    calls = []
    handle = ad.module.register_forward_hook(lambda *a: calls.append(1))
    try:
        ad.options.fast_inference = False
        stock = ad.predict(batch, seed=seed, return_latents=True)
        n_stock = len(calls)
        ad.options.fast_inference = True
        fast = ad.predict(batch, seed=seed, return_latents=True)
    finally:
        ad.options.fast_inference = True
        handle.remove()
    assert n_stock == ad.options.num_inference_steps and len(calls) == n_stock  # fast: no forward
    return stock, fast


def assert_same(stock: dict, fast: dict) -> None:
    for key in ("actions", "latents"):
        assert fast[key].shape == stock[key].shape and fast[key].dtype == np.float32
        assert_rounding_close(fast[key], stock[key], length=LENGTH)
    # the futures are generated, not copies of the input: a check that could fail on a broken sampler
    assert np.abs(stock["latents"][:, :, 1:]).max() > 0.1


def test_fast_path_is_the_default_and_equals_stock_for_one_request(adapter):
    assert adapter.options.fast_inference is True
    stock, fast = both_paths(adapter, make_batch(TASKS[:1]), seed=5)
    assert_same(stock, fast)


def test_fast_path_equals_stock_for_a_mixed_batch_of_prompts(adapter):
    batch = make_batch(TASKS, seed=1)
    stock, fast = both_paths(adapter, batch, seed=9)
    lengths = {kv.length for kv in adapter.fast.cache._items.values()}
    assert len(lengths) == 3  # three prompt lengths: padded and masked in one attention call
    assert_same(stock, fast)
    # request i draws from seed + i, whatever else is in the batch: request 1 alone with seed 9 + 1
    one = {k: v[1:2] for k, v in batch.items()}
    assert_rounding_close(adapter.predict(one, seed=10)["actions"], fast["actions"][1:2], length=LENGTH)


def test_text_keys_values_are_computed_once_per_prompt(adapter):
    adapter.fast.clear()
    cache = adapter.fast.cache
    hits, misses = cache.hits, cache.misses
    adapter.predict(make_batch([TASKS[0], TASKS[1], TASKS[0]]), seed=0)
    assert cache.misses - misses == 2 and cache.hits - hits == 1  # one encoding per prompt, not per step
    adapter.predict(make_batch([TASKS[1], TASKS[0]], seed=3), seed=0)
    assert cache.misses - misses == 2 and cache.hits - hits == 3  # and across requests
    small = TextKVMemoryCache(2)
    for key in "abc":
        small.get(key, None, lambda key=key: key)
    assert len(small) == 2 and list(small._items) == ["b", "c"]  # bounded, least recently used out
    small.get("b", None, lambda: "b")
    small.get("d", None, lambda: "d")
    assert list(small._items) == ["b", "d"]
    small.get("b", "other weights", lambda: "b2")
    assert list(small._items) == ["b"] and small._items["b"] == "b2"


def test_cached_text_follows_changed_weights(adapter):
    batch = make_batch(TASKS[:2], seed=2)
    before = adapter.predict(batch, seed=4)["actions"]
    w = adapter.module.layers[0].self_attn.to_v.weight  # understanding tower: the cached values
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.mul_(1.5)
        stock, fast = both_paths(adapter, batch, seed=4)
        assert_same(stock, fast)
        assert not np.allclose(fast["actions"], before, atol=1e-4)
    finally:
        with torch.no_grad():
            w.copy_(saved)


def test_bucketed_static_step_equals_stock(adapter):
    """What a captured CUDA graph runs, checked eagerly on the CPU: the batch padded to a power of two,
    the text to a multiple of 32 tokens with a key bias, the context copied into static buffers."""
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    adapter.fast.bucketed = True
    try:
        batch = make_batch(TASKS, seed=6)
        stock, fast = both_paths(adapter, batch, seed=3)
        assert_same(stock, fast)
        steps = list(adapter.fast._steps.values())
        assert len(steps) == 1 and steps[0].lat_v.shape[0] == 4 and steps[0].ctx.key_bias is not None
        swapped = make_batch(TASKS[::-1], seed=7)  # another mix of the same shapes: the same bucket
        stock, fast = both_paths(adapter, swapped, seed=8)
        assert_same(stock, fast)
        assert list(adapter.fast._steps.values()) == steps
    finally:
        adapter.fast.bucketed = False
        adapter.fast.clear()


def test_flex_attention_step_equals_stock(adapter):
    """What a compiled step runs (the text padding masked by prompt length in a flex-attention kernel,
    the text keys/values at their KV heads, not expanded), checked eagerly on the CPU for a mixed batch
    of prompts of different lengths."""
    adapter.fast.bucketed, adapter.fast.attention = True, "flex"
    try:
        batch = make_batch(TASKS, seed=9)
        stock, fast = both_paths(adapter, batch, seed=5)
        assert_same(stock, fast)
        (step,) = adapter.fast._steps.values()
        ctx, attn = step.ctx, adapter.module.layers[0].self_attn
        assert ctx.key_bias is None and len(set(ctx.text_len.tolist())) > 1  # prompts of several lengths
        assert ctx.text_k[0].shape[1] == attn.num_key_value_heads < attn.num_attention_heads
    finally:
        adapter.fast.bucketed, adapter.fast.attention = False, "auto"
        adapter.fast.clear()


def test_graph_capture_is_a_no_op_on_cpu(adapter):
    batch = make_batch(TASKS[:2], seed=4)
    eager = adapter.predict(batch, seed=1, return_latents=True)
    adapter.fast.step_graph = "cuda_graph"
    try:
        graphed = adapter.predict(batch, seed=1, return_latents=True)
    finally:
        adapter.fast.step_graph = "none"
    assert not adapter.fast._steps
    for key in ("actions", "latents"):
        np.testing.assert_array_equal(graphed[key], eager[key])


def test_the_step_traces_as_one_graph(adapter):
    """No graph break in the step (no host sync, no branch on tensor values): what CUDA-graph capture
    and torch.compile(mode="reduce-overhead") need. Traced by dynamo on the CPU, run eagerly."""
    ad, hw = adapter, (64, 128)
    texts = [ad.prompt(t, hw, 0) for t in TASKS[:2]]
    segs = ad._requests(texts, hw, (8, 5, 4, 8), (0,), ())  # latents [8, 5, 4, 8]: 5 frames x 2 x 4 patches
    kvs = [ad.fast.text_kv((text, hw), s) for text, s in zip(texts, segs)]
    pos = [torch.cat([s.vision["vision_mrope_ids"], s.action["action_mrope_ids"]], 1) for s in segs]
    lat_v, lat_a, t = torch.randn(2, 8, 5, 4, 8), torch.randn(2, 16, 10), torch.tensor([700.0])
    for attention in ("sdpa", "flex"):
        ctx = build_context(
            ad.module, kvs, pos, 5, 2 * 4, (0,), (), ad.domain_id, masked=True, attention=attention
        )
        torch._dynamo.reset()
        traced = torch.compile(gen_step, fullgraph=True, backend="eager")
        with torch.no_grad():  # as predictions run (flex attention has no CPU backward)
            want = gen_step(ad.module, ctx, lat_v, lat_a, t)
            got = traced(ad.module, ctx, lat_v, lat_a, t)
        for a, b in zip(got, want):  # compiled against eager: one step's reordered sums (192 wide, 4 deep)
            assert_rounding_close(a, b, length=192 * 4)
        assert want[0][:, :, 0].abs().max() == 0 and want[0][:, :, 1:].abs().max() > 0  # frame 0 is held


def test_fast_options_are_checked():
    for opts, key in (
        ({"fast_inference": "yes"}, "fast_inference"),
        ({"step_graph": "graphs"}, "step_graph"),
        ({"text_cache_size": 0}, "text_cache_size"),
    ):
        with pytest.raises(ConfigError, match=f"model.options.{key}"):
            build_model(ModelConfig(name="cosmos3", preset="tiny", options=opts), IO)


def _compiled_attention() -> str:
    """The attention a compiled CPU step can use here: flex (the GPU default), where inductor's CPU
    flex template builds (AVX2, not under ATEN_CPU_CAPABILITY=default: torch's own check), else SDPA."""
    try:
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported
    except ImportError:
        return "sdpa"
    return "flex" if check_cpu_supported() else "sdpa"


@contextlib.contextmanager
def compiled_on_cpu(adapter, mode: str):
    """The adapter's fast step in ``mode`` (compile | compile_layers), compiled by inductor on the CPU,
    from a fresh dynamo cache; put back as it was afterwards."""
    from wamkit.models.cosmos3 import fast_policy

    before = adapter.fast.step_graph
    adapter.fast.step_graph, adapter.fast.compile_on_cpu = mode, True
    adapter.fast.attention = _compiled_attention()
    torch._dynamo.reset()
    fast_policy._COMPILED_LAYER = None
    try:
        yield
    finally:
        adapter.fast.step_graph, adapter.fast.compile_on_cpu, adapter.fast.attention = before, False, "auto"
        adapter.fast.clear()


@pytest.mark.slow
def test_the_compiled_step_gives_the_eager_fast_paths_actions(adapter):
    """step_graph="compile" (the whole step compiled), compiled by inductor on the CPU here: the
    batch padded to its bucket, the text masked in flex attention, the step one compiled graph. Its
    actions and latents are the eager fast path's within fp32 rounding (inductor reorders the sums)."""
    batch = make_batch(TASKS, seed=11)
    eager = adapter.predict(batch, seed=2, return_latents=True)
    with compiled_on_cpu(adapter, "compile"):
        compiled = adapter.predict(batch, seed=2, return_latents=True)
        (step,) = adapter.fast._steps.values()
        assert step.mode == "compile" and step.lat_v.shape[0] == 4  # 3 requests in the bucket of 4
        again = adapter.predict(batch, seed=2, return_latents=True)  # the same compiled graph, again
    for key in ("actions", "latents"):
        assert_rounding_close(compiled[key], eager[key], length=LENGTH)
        np.testing.assert_array_equal(again[key], compiled[key])


def test_compiled_layers_give_the_eager_actions_with_one_graph_for_every_layer(adapter):
    """step_graph="compile_layers" (auto's mode on CUDA): the generation half of one decoder layer compiled (on the CPU here;
    on a GPU the step around it is captured as a CUDA graph). The layers share the compiled code, so a
    bucket traces one layer, not the whole step: one graph however many layers the model has."""
    from wamkit.models.cosmos3 import fast_policy

    batch = make_batch(TASKS, seed=12)
    eager = adapter.predict(batch, seed=4, return_latents=True)
    with compiled_on_cpu(adapter, "compile_layers"):
        got = adapter.predict(batch, seed=4, return_latents=True)
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(fast_policy._gen_layer.__code__)
        assert len(adapter.module.layers) > 1 and len(entries) == 1
    for key in ("actions", "latents"):
        assert_rounding_close(got[key], eager[key], length=LENGTH)
