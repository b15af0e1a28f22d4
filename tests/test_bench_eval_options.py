"""``wamkit bench eval --schedules/--serial-trials``: the schedules of a long benchmark (LIBERO-10's 500
episodes) can be chosen, and the serial one run on the first trials only, its episodes checked against
the same episodes of the others."""

from __future__ import annotations

import json

import pytest

from wamkit.cli import main as wamkit


@pytest.mark.slow
def test_serial_on_a_subset_beside_the_pipelined_schedule(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "eval", "--trials", "2", "--serial-trials", "1", "--max-steps", "6", "--num-envs", "2"]
    argv += ["--stages", "2", "--schedules", "serial,pipelined", "--delay-ms", "5", "--per-obs-ms", "1"]
    argv += ["--calibrate-s", "0.5", "--workers", "2", "--image-size", "32", "--json", str(out)]
    assert wamkit(argv) == 0  # 0: the episodes the serial run shares with the pipelined one agree
    text = capsys.readouterr().out
    assert "--serial-trials" in text and "(b) lock-step" not in text
    assert "episode results identical across schedules and repeats: yes" in text
    rows = {r["mode"][:3]: r for r in json.loads(out.read_text())["runs"]}
    assert set(rows) == {"(a)", "(c)"}
    # (a) ran 1 trial of each of the 2 tasks, (c) 2: half the episodes, each at most 6 steps
    assert rows["(a)"]["resets"] == 2 and rows["(c)"]["resets"] == 4
    assert 0 < rows["(a)"]["env_steps"] < rows["(c)"]["env_steps"] <= 4 * 6


def test_one_run_per_schedule_says_so(tmp_path, capsys):
    # --repeats 1: a run too long to repeat (LIBERO-10's 500 episodes) is printed as one run, not a median
    out = tmp_path / "bench.json"
    argv = ["bench", "eval", "--trials", "2", "--max-steps", "4", "--num-envs", "2", "--stages", "2"]
    argv += ["--schedules", "pipelined", "--repeats", "1", "--delay-ms", "5", "--per-obs-ms", "1"]
    argv += ["--calibrate-s", "0.5", "--workers", "2", "--image-size", "32", "--json", str(out)]
    assert wamkit(argv) == 0
    text = capsys.readouterr().out
    assert "run 1 of 1: (c) pipelined, P=2" in text
    assert "ONE run per schedule (--repeats 1): no medians, no spread" in text
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["repeats"] == 1 and len(doc["runs"]) == 1
    assert wamkit(["bench", "eval", "--repeats", "0"]) != 0
    assert "--repeats: expected >= 1 run per schedule, got 0" in capsys.readouterr().err


def test_schedule_options_are_checked(capsys):
    assert wamkit(["bench", "eval", "--schedules", "serial,warp"]) != 0
    assert "--schedules: 'serial,warp'; expected a comma list from serial" in capsys.readouterr().err
    assert wamkit(["bench", "eval", "--trials", "2", "--serial-trials", "3"]) != 0
    assert "--serial-trials: expected 0..--trials=2, got 3" in capsys.readouterr().err


def test_server_comparisons_are_checked_before_any_server_starts(monkeypatch):
    from types import SimpleNamespace

    import pytest

    from wamkit.bench.eval import _device_env, _modes
    from wamkit.config import ConfigError

    args = SimpleNamespace(num_envs=6, stages="6", schedules="serial,lockstep,pipelined")
    for bad, match in (
        (dict(), "multiple of the 4 servers"),
        (dict(num_envs=8, schedules="serial"), "alone"),
    ):
        with pytest.raises(ConfigError, match=match):
            _modes(SimpleNamespace(**{**vars(args), **bad}), servers=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert _device_env("cuda:1") == ("cuda", {"CUDA_VISIBLE_DEVICES": "3"})
    with pytest.raises(ConfigError, match="--devices: 'cuda:2'"):
        _device_env("cuda:2")
