"""``wamkit bench cosmos3`` in its small CPU form: one run prints stock and fast rows per batch size,
the fast rows' actions equal stock's (fp32), and the profile of one step of each path."""

from __future__ import annotations

import collections
import json
import re

import pytest
import torch

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from wamkit.cli import main  # noqa: E402

ROW = re.compile(r"^(stock|fast\S*)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+")


@pytest.mark.numerics  # float results across code paths (tests/conftest.py)
def test_bench_cosmos3_prints_stock_and_fast_side_by_side(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    argv = ["bench", "cosmos3", "--preset", "tiny", "--device", "cpu", "--dtype", "float32"]
    argv += ["--steps", "2", "--batches", "1,3", "--image-size", "64", "--threads", "1"]
    argv += ["--profile", "--profile-rows", "3", "--json", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert [(r[0], r[1]) for r in rows] == [("stock", "1"), ("fast", "1"), ("stock", "3"), ("fast", "3")]
    assert all(float(v) > 0 for r in rows for v in r[2:])
    assert "profile: stock, batch 3" in out and "profile: fast, batch 3" in out
    assert out.count("Self CPU time total") == 2
    saved = json.loads(out_json.read_text())["rows"]
    fast = [r for r in saved if r["path"] == "fast"]
    assert len(fast) == 2 and all(r["vs_stock"] > 0 for r in fast)
    for r in fast:  # each of the 2 steps' reordered sums, 192 wide and 4 deep (tests/exactness.py)
        bound = 2 * 192 * 4 * torch.finfo(torch.float32).eps * r["stock_action_max"]
        assert 0 <= r["max_action_diff"] <= bound, (r["max_action_diff"], bound)


SFT_ROW = re.compile(r"^(transformer|encode|cached|cached_inline)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s")


def test_bench_cosmos3_sft_prints_transformer_encode_and_cached_rows(capsys, tmp_path, monkeypatch):
    from wamkit.bench import cosmos3_sft

    encodes = collections.Counter()  # the VAE's encode calls inside each row's steps
    step = cosmos3_sft.SftBench.step

    def counted(bench, path, b):
        vae = bench.ad._encode

        def spy(*args, **kwargs):
            encodes[path] += 1
            return vae(*args, **kwargs)

        bench.ad._encode = spy
        try:
            return step(bench, path, b)
        finally:
            del bench.ad._encode  # the adapter's own method again

    monkeypatch.setattr(cosmos3_sft.SftBench, "step", counted)
    out_json = tmp_path / "sft.json"
    argv = ["bench", "cosmos3-sft", "--preset", "tiny", "--device", "cpu", "--batches", "1,2"]
    argv += ["--steps", "1", "--warmup", "1", "--image-size", "32", "--threads", "1"]
    argv += ["--paths", "transformer,encode,cached,cached_inline", "--loader-workers", "2"]
    argv += [
        "--profile",
        "1",
        "--profile-path",
        "transformer,cached",
        "--profile-rows",
        "3",
        "--json",
        str(out_json),
    ]
    argv += ["--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = [m.groups() for m in map(SFT_ROW.match, out.splitlines()) if m]
    assert [(r[0], r[1]) for r in rows] == [
        (p, b) for b in ("1", "2") for p in ("transformer", "encode", "cached", "cached_inline")
    ]
    assert all(float(v) > 0 for r in rows for v in r[2:])
    assert out.count("VAE encode of") == 2 and "profile: cached, batch 2, 1 steps" in out
    assert "profile: transformer, batch 2, 1 steps" in out  # every row --profile-path names
    assert "Self CPU time total" in out
    assert (tmp_path / "latents" / "manifest.json").is_file()  # the cached row read a real cache folder
    saved = json.loads(out_json.read_text())
    assert len(saved["rows"]) == 8 and saved["flops_per_sample"] > 0
    # the rows that read latents (the cache's or the batch's) never ran the VAE; the encode row did
    assert encodes["encode"] > 0 and encodes.keys() == {"encode"}, encodes


def test_bench_cosmos3_sft_repeats_interleave_rows_and_print_medians(capsys, tmp_path, monkeypatch):
    from wamkit.bench import cosmos3_sft

    order = []
    measure = cosmos3_sft.measure

    def spy(bench, path, b, steps, attention):
        order.append(path)
        return measure(bench, path, b, steps, attention)

    monkeypatch.setattr(cosmos3_sft, "measure", spy)
    out_json = tmp_path / "sft.json"
    argv = ["bench", "cosmos3-sft", "--preset", "tiny", "--device", "cpu", "--batches", "1"]
    argv += ["--steps", "1", "--warmup", "1", "--image-size", "32", "--threads", "1", "--repeats", "3"]
    argv += ["--paths", "cached,transformer", "--json", str(out_json), "--cache-dir", str(tmp_path)]
    assert main(argv) == 0
    assert order == ["cached", "transformer"] * 3  # interleaved, in the order given
    out = capsys.readouterr().out
    assert [m[1] for m in map(SFT_ROW.match, out.splitlines()) if m] == ["cached", "transformer"]
    rows = {r["path"]: r for r in json.loads(out_json.read_text())["rows"]}
    # a row printed after the transformer's still gets its ratio, from the two medians
    assert rows["cached"]["vs_transformer"] == pytest.approx(
        rows["cached"]["samples_per_s"] / rows["transformer"]["samples_per_s"]
    )
    with pytest.raises(SystemExit, match="--repeats 0"):
        main(["bench", "cosmos3-sft", "--preset", "tiny", "--device", "cpu", "--repeats", "0"])


def test_bench_cosmos3_rtc_row_beside_the_plain_fast_row(capsys):
    """RTC's cost per prediction (issue: the Cosmos3-Nano-shaped server at batch 1 and 8 on the GPU):
    the guided row runs the same batch; its actions differ from stock by the guidance's pull."""
    argv = ["bench", "cosmos3", "--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--steps", "2"]
    argv += ["--batches", "2", "--image-size", "64", "--threads", "1", "--paths", "stock,fast,fast+rtc"]
    assert main(argv) == 0
    rows = [m.groups() for m in map(ROW.match, capsys.readouterr().out.splitlines()) if m]
    assert [r[0] for r in rows] == ["stock", "fast", "fast+rtc"] and all(float(r[4]) > 0 for r in rows)
