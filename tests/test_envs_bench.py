"""``wamkit bench env`` runs real workers and prints both figures and their ratios."""

from __future__ import annotations

import json

from wamkit.bench.env import format_table
from wamkit.cli import main as cli_main


def test_bench_env_prints_one_and_all_process_figures(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "env", "--suites", "metaworld", "--sizes", "32", "--seconds", "0.5", "--processes", "2"]
    argv += ["--qualities", "fast"]  # the default look renders ~10x slower; the ratio code is tested below
    assert cli_main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "N procs" in text and "2 procs" in text
    rows = json.loads(out.read_text())
    assert [(r["size"], r["quality"]) for r in rows] == [(32, "fast")]
    assert all(r["one"] > 0 and r["all"] > 0 and r["processes"] == 2 for r in rows)


def test_table_ratios():
    rows = [
        {"suite": "metaworld", "size": 128, "quality": "default", "one": 10.0, "all": 15.0},
        {"suite": "metaworld", "size": 128, "quality": "fast", "one": 80.0, "all": 150.0},
    ]
    lines = format_table(rows).splitlines()
    assert lines[2].split()[-1] == "1.50x"  # default: N/1, no fast/default ratio
    assert lines[3].split()[-4:] == ["1.88x", "8.00x", "|", "10.00x"]
