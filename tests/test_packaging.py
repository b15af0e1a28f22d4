"""wamkit outside a source checkout: the wheel carries its presets, so `wamkit demo` and `wamkit train
libero_10_cosmos3` work after `pip install wamkit` (tests/test_demo.py runs the demo from this same
installed wheel)."""

from __future__ import annotations

import subprocess

import pytest

from wamkit.config import ConfigError, packaged_presets, preset_path

from .conftest import REPO


def test_the_installed_wheel_holds_the_presets_and_trains_from_a_name(installed_wheel, tmp_path):
    where = subprocess.run(
        [str(installed_wheel), "-c", "import wamkit, wamkit.config as c; print(wamkit.__file__); print(c.packaged_presets())"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr[-2000:]
    file, presets = where.stdout.splitlines()
    assert not file.startswith(str(REPO)) and str(installed_wheel.parents[1]) in file
    assert presets == str(packaged_presets()) and "'demo'" in presets and "'libero_10_cosmos3'" in presets
    plan = subprocess.run(
        [str(installed_wheel), "-m", "wamkit", "train", "libero_10_cosmos3", "--plan", "--world-size", "8",
         "--device-memory", "80GB", "--host-memory", "1000GB"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "cosmos3/nano" in plan.stdout and "device total" in plan.stdout  # the recipe's plan


def test_a_preset_is_a_file_or_a_packaged_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    for name in ("demo", "demo.yaml", "configs/demo.yaml"):
        assert preset_path(name).read_text() == (REPO / "configs" / "demo.yaml").read_text()
    (tmp_path / "demo.yaml").write_text("train: {max_steps: 3}\n")
    assert preset_path("demo.yaml").resolve() == tmp_path / "demo.yaml"  # a file here wins
    with pytest.raises(ConfigError, match=r"config file elsewhere/demo.yaml does not exist"):
        preset_path("elsewhere/demo.yaml")  # a path with a folder is never replaced by a packaged one
    with pytest.raises(
        ConfigError, match=r"'dmeo' is not a packaged preset \(have: demo, demo_cosmos3, libero_10_cosmos3"
    ):
        preset_path("dmeo")
