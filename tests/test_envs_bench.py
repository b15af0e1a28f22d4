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
    assert "2 procs" in text and "renderer" in text
    rows = json.loads(out.read_text())
    assert [(r["size"], r["quality"], r["render_gpu"]) for r in rows] == [(32, "fast", -1)]
    assert all(r["one"] > 0 and r["all"] > 0 and r["processes"] == 2 for r in rows)
    assert set(rows[0]["rates"]) == {"1", "2"}
    # the GL renderer that drew the pixels is named (Mesa's software one on a machine without a GPU)
    assert rows[0]["gl_renderer"] not in ("", "?")


def _row(quality: str, one: float, many: float) -> dict:
    return {"suite": "metaworld", "size": 128, "quality": quality, "render_gpu": -1, "gl_renderer": "llvmpipe",
            "rates": {"1": one, "4": many}, "one": one, "all": many, "processes": 4}  # fmt: skip


def test_table_ratios():
    lines = format_table([_row("default", 10.0, 15.0), _row("fast", 80.0, 150.0)]).splitlines()
    assert lines[2].split()[-2] == "1.50x"  # default: N/1, no fast/default ratio
    assert lines[3].split()[-5:-1] == ["1.88x", "8.00x", "|", "10.00x"]


def test_render_gpu_reaches_the_worker_and_is_checked(monkeypatch):
    """env.render_gpu becomes MUJOCO_EGL_DEVICE_ID in the spawned worker (which MuJoCo's and robosuite's
    EGL contexts read) and nowhere else; a bad value or a non-EGL backend is refused by name."""
    import pytest

    from wamkit.config import ConfigError, EnvConfig
    from wamkit.envs.base import check_env_config, render_environ
    from wamkit.envs.workers import EnvWorker

    monkeypatch.delenv("MUJOCO_EGL_DEVICE_ID", raising=False)
    assert render_environ(3)["MUJOCO_EGL_DEVICE_ID"] == "3" and "MUJOCO_EGL_DEVICE_ID" not in render_environ(
        -1
    )
    w = EnvWorker(EnvConfig(render_gpu=0), 1, host_factory=EnvironHost)
    try:
        assert w.call("environ", "MUJOCO_EGL_DEVICE_ID", timeout=120) == "0"
    finally:
        w.close()
    import os

    assert "MUJOCO_EGL_DEVICE_ID" not in os.environ  # the parent's environment is left as it was
    with pytest.raises(ConfigError, match="env.render_gpu"):
        check_env_config(EnvConfig(render_gpu=-2))
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    with pytest.raises(ConfigError, match="env.render_gpu.*MUJOCO_GL"):
        check_env_config(EnvConfig(render_gpu=1))


class EnvironHost:
    """A host that only reports its process's environment (no simulator needed)."""

    def __init__(self, env_cfg, num_envs):
        pass

    def environ(self, key):
        import os

        return os.environ.get(key)

    def close(self):
        pass
