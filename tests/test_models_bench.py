"""``wamkit bench model`` runs end to end and prints both figures for every batch size, plus ratios."""

from __future__ import annotations

import re

from wamkit.cli import main


def test_bench_model_prints_throughput_table(capsys):
    argv = ["bench", "model", "--model", "tiny", "--preset", "small", "--batches", "1,4", "--steps", "2"]
    argv += [
        "--warmup",
        "1",
        "--threads",
        "1",
        "--image-size",
        "64",
        "--option",
        "width=64",
        "--option",
        "depth=2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny/small" in out and "GFLOP per training sample" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert [r[0] for r in rows] == ["1", "4"]
    assert all(float(v) > 0 for r in rows for v in r[1:5])
    assert re.search(r"ratio batch 4 / batch 1: fwd\+bwd samples/s x[\d.]+, policy obs/s x[\d.]+", out)
