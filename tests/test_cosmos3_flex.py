"""The flex-attention block masks of packed Cosmos3 requests (models/cosmos3/packing.py): their tables are
``create_block_mask``'s, and a kernel that skips blocks by them (compiled flex attention) attends as
SDPA does with the dense masks; ``bench cosmos3-sft`` compares the modes side by side. The model-level
equalities (flex = mask = stock) are in tests/test_cosmos3_model.py."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

from wamkit.cli import main  # noqa: E402
from wamkit.models.cosmos3.packing import flex_attend, segment_block_mask  # noqa: E402

# per request: (text tokens, generation tokens); lengths straddle blocks of 16 and 32 both ways
REQUESTS = [(37, 70), (5, 70), (64, 33), (130, 70), (1, 16)]


def segments(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])


def packed_mods(requests=REQUESTS, device="cpu"):
    """(q segments, kv segments, mask_mod, causal) of the und and gen pathways, as flex_block_masks."""
    u, g = segments([r[0] for r in requests]).to(device), segments([r[1] for r in requests]).to(device)
    kv = torch.cat([u, g])

    def und_mod(b, h, q, k):
        return (u[q] == u[k]) & (k <= q)

    def gen_mod(b, h, q, k):
        return g[q] == kv[k]

    return [(u, u, und_mod, True), (g, kv, gen_mod, False)]


TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
TABLES += ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("block", [1, 16, 32, 128])
def test_segment_block_mask_has_the_tables_of_create_block_mask(block):
    for q_seg, kv_seg, mod, causal in packed_mods():
        ours = segment_block_mask(q_seg, kv_seg, mod, block, causal=causal)
        ref = create_block_mask(mod, None, None, len(q_seg), len(kv_seg), device="cpu", BLOCK_SIZE=block)
        assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
        for name in TABLES:
            torch.testing.assert_close(getattr(ours, name), getattr(ref, name), rtol=0, atol=0, msg=name)
        if block == 16:  # the case is not trivial: blocks are skipped, others are full, the rest partial
            dense, full = ours.to_dense(), ours.full_kv_num_blocks.sum()
            assert 0 < full < dense.sum() < dense.numel()


def dense_reference(q, k, v, mask):
    """SDPA with a boolean [L, S] mask, the KV heads expanded: q [L, H, d], k / v [S, KV, d] -> [L, H*d]."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = (
        q.transpose(0, 1),
        k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1),
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(0, 1).flatten(-2, -1)


@pytest.mark.numerics  # float results across code paths (tests/conftest.py)
def test_eager_flex_attend_equals_sdpa_with_the_dense_masks():
    torch.manual_seed(0)
    for q_seg, kv_seg, mod, causal in packed_mods():
        q, k, v = (
            torch.randn(len(q_seg), 4, 16),
            torch.randn(len(kv_seg), 2, 16),
            torch.randn(len(kv_seg), 2, 16),
        )
        mask = q_seg[:, None] == kv_seg[None, :]
        if causal:
            mask &= torch.ones_like(mask).tril()
        out = flex_attend(q, k, v, segment_block_mask(q_seg, kv_seg, mod, 128, causal=causal))
        # another kernel over the same scores: each output sums len(kv) weighted values of a 16-wide dot
        assert_rounding_close(out, dense_reference(q, k, v, mask), length=len(kv_seg) + 16)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="compiled flex attention on the CPU needs g++")
def test_compiled_flex_skips_blocks_by_the_tables_and_attends_as_sdpa():
    """Eager flex attention evaluates ``mask_mod`` everywhere; a compiled kernel trusts the tables (full
    blocks skip ``mask_mod``, empty ones are never read), so this is where a wrong table would show."""
    torch.manual_seed(0)
    fn = torch.compile(flex_attention, dynamic=True)
    # the requests 4 times longer: some of them cover whole blocks of 128
    for q_seg, kv_seg, mod, causal in packed_mods([(4 * u, 4 * g) for u, g in REQUESTS]):
        q = torch.randn(len(q_seg), 4, 16)
        k, v = torch.randn(len(kv_seg), 2, 16), torch.randn(len(kv_seg), 2, 16)
        bm = segment_block_mask(q_seg, kv_seg, mod, causal=causal)
        assert bm.full_kv_num_blocks.sum() > 0
        with torch.no_grad():
            out = fn(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=bm, enable_gqa=True)
        mask = q_seg[:, None] == kv_seg[None, :]
        if causal:
            mask &= torch.ones_like(mask).tril()
        ref = dense_reference(q, k, v, mask)
        assert_rounding_close(out[0].transpose(0, 1).flatten(-2, -1), ref, length=len(kv_seg) + 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_attend_on_cuda_with_gradients_equals_sdpa_with_the_dense_masks():
    """The training path of attention "auto" on a GPU: compiled flex attention, forward and backward."""
    torch.manual_seed(0)
    for q_seg, kv_seg, mod, causal in packed_mods([(4 * u, 4 * g) for u, g in REQUESTS], "cuda"):
        q = torch.randn(len(q_seg), 4, 16, device="cuda", requires_grad=True)
        k = torch.randn(len(kv_seg), 2, 16, device="cuda", requires_grad=True)
        v = torch.randn(len(kv_seg), 2, 16, device="cuda", requires_grad=True)
        w = torch.randn(len(q_seg), 64, device="cuda")
        out = flex_attend(q, k, v, segment_block_mask(q_seg, kv_seg, mod, causal=causal))
        got = [out, *torch.autograd.grad((out * w).sum(), (q, k, v))]
        mask = q_seg[:, None] == kv_seg[None, :]
        if causal:
            mask &= torch.ones_like(mask).tril()
        ref = dense_reference(q, k, v, mask)
        want = [ref, *torch.autograd.grad((ref * w).sum(), (q, k, v))]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bench_cosmos3_sft_compares_attention_modes_side_by_side(capsys, tmp_path):
    out_json = tmp_path / "sft.json"
    argv = ["bench", "cosmos3-sft", "--preset", "tiny", "--device", "cpu", "--batches", "2", "--steps", "1"]
    argv += ["--warmup", "1", "--image-size", "32", "--threads", "1", "--paths", "transformer"]
    argv += ["--attention", "mask,loop,flex", "--cache-dir", str(tmp_path), "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^(\w+)\s+2\s+[\d.]+\s+[\d.]+\s.*\s(mask|loop|flex)$", out, re.MULTILINE)
    assert rows == [("transformer", "mask"), ("transformer", "loop"), ("transformer", "flex")]
    assert re.search(r"transformer: samples/s over mask's: loop [\d.]+x, flex [\d.]+x", out)
    saved = json.loads(out_json.read_text())
    assert saved["attention"] == ["mask", "loop", "flex"]
    assert [r["attention"] for r in saved["rows"]] == ["mask", "loop", "flex"]
    with pytest.raises(SystemExit, match="--attention 'mask,sparse'"):
        main(argv[:-6] + ["--attention", "mask,sparse"])


def test_auto_attention_is_flex_on_cuda_and_mask_elsewhere():
    from wamkit.models.cosmos3.packing import resolve_attention
    from wamkit.models.cosmos3.presets import resolve_options

    assert resolve_options({}).attention == "auto"
    assert resolve_attention("auto", torch.device("cuda")) == "flex"
    assert resolve_attention("auto", torch.device("cpu")) == "mask"
    assert [resolve_attention(m, torch.device("cuda")) for m in ("mask", "loop", "flex")] == [
        "mask",
        "loop",
        "flex",
    ]
