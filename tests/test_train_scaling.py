"""``wamkit bench train --processes``: the trainer step under torchrun with 1 and 2 processes (gloo on
the CPU), side by side with the scaling ratio and the comparison with the best 1-process micro-batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _ratio_tolerance(a: float, b: float) -> float:
    """How far a ratio printed to 2 decimals may lie from a / b of samples/s printed to 1 decimal (each
    within 0.05 of its value): d(a/b) <= 0.05 / b * (1 + a / b), plus the ratio's own 0.005. On a
    loaded CPU the rates are small (1.8, 3.2), so the rounding of the printed rates dominates."""
    return 0.05 / b * (1 + a / b) + 0.005 + 1e-9


@pytest.mark.slow
def test_bench_train_processes_prints_rows_and_ratios_that_add_up():
    cmd = [
        sys.executable, "-m", "wamkit", "bench", "train", "--model", "tiny", "--preset", "small",
        "--option", "width=32", "--option", "depth=2", "--option", "heads=2",
        "--processes", "2", "--micro-batch", "2,4", "--steps", "2", "--warmup", "1",
        "--reshard-after-forward", "auto,never",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    # processes, micro-batch, s/step, samples/s, per process, MFU (n/a on a CPU), GiB, host RSS GB, scaling,
    # vs best 1, reshard after forward
    row = re.compile(
        r"^\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+n/a\s+n/a\s+[\d.]+\s+([\d.]+)x\s+([\d.]+)x\s+(\w+)$"
    )
    rows = {(int(m[1]), int(m[2]), m[8]): m for m in map(row.match, out.stdout.splitlines()) if m}
    # 1 process added as the reference (first mode); micro-batch 4 (not the first) on 1 process only;
    # the 2-process row once per mode
    assert sorted(rows) == [(1, 2, "auto"), (1, 4, "auto"), (2, 2, "auto"), (2, 2, "never")], out.stdout
    sps = {k: float(m[4]) for k, m in rows.items()}
    best1 = max(sps[1, 2, "auto"], sps[1, 4, "auto"])
    for (n, mb, mode), m in rows.items():
        s_step, scaling, vs_best = float(m[3]), float(m[6]), float(m[7])
        got = sps[n, mb, mode]
        assert abs(got - n * mb / s_step) <= 0.01 * got + 0.1  # every process's samples count
        assert abs(float(m[5]) - got / n) <= 0.1
        assert abs(scaling - got / sps[1, mb, "auto"]) <= _ratio_tolerance(got, sps[1, mb, "auto"])
        assert abs(vs_best - got / best1) <= _ratio_tolerance(got, best1)
    assert float(rows[1, 2, "auto"][6]) == float(rows[1, 4, "auto"][6]) == 1.0
    assert f"micro-batch {2 if sps[1, 2, 'auto'] > sps[1, 4, 'auto'] else 4}," in out.stdout.splitlines()[-1]


def test_bench_train_refuses_a_micro_batch_list_without_processes():
    from wamkit.bench.train import main
    from wamkit.cli import build_parser

    argv = ["bench", "train", "--micro-batch", "2,4"]
    args = build_parser("bench", argv).parse_args(argv)
    with pytest.raises(SystemExit, match="--processes"):
        main(args)


def test_bench_train_refuses_reshard_mode_lists_it_cannot_compare():
    from wamkit.bench.train import main
    from wamkit.cli import build_parser

    for argv, match in [
        (["bench", "train", "--reshard-after-forward", "auto,never"], "needs --processes"),
        (["bench", "train", "--processes", "1", "--reshard-after-forward", "auto,never"], "count above 1"),
    ]:
        args = build_parser("bench", argv).parse_args(argv)
        with pytest.raises(SystemExit, match=match):
            main(args)
    argv = ["bench", "train", "--reshard-after-forward", "auto,,sometimes"]
    with pytest.raises(SystemExit):  # argparse names the flag and the bad entries on stderr
        build_parser("bench", argv).parse_args(argv)


def test_bench_train_warms_up_on_short_steps_and_times_whole_ones(caplog):
    """`--warmup-accumulation N`: the untimed steps run N micro-batches (enough to compile, fill the
    allocator and make the optimizer's state), the timed ones `--accumulation`, whose micro-batches the
    row's s/step divides by."""
    import logging

    from wamkit.cli import main

    argv = ["bench", "train", "--model", "tiny", "--preset", "small", "--option", "width=32", "--option",
            "depth=2", "--option", "heads=2", "--micro-batch", "2", "--device", "cpu", "--steps", "1",
            "--warmup", "2", "--accumulation", "3", "--warmup-accumulation", "1"]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="wamkit"):
        assert main(argv) == 0
    done = [r.getMessage() for r in caplog.records if re.match(r"trainer step \d+ done", r.getMessage())]
    assert [re.match(r"trainer step (\d+) done: (\d+) micro", m).groups() for m in done] == [
        ("0", "1"),
        ("1", "1"),
        ("2", "3"),
    ], done
