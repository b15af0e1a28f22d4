"""The Ray executor across several runs in one process: Ray is joined once per process, so what a run
configures must travel with its actors (the render GPU), and a run naming another cluster is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from wamkit.config import ConfigError, EnvConfig
from wamkit.eval.executors import ray_executor


def _environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _render_device(env_cfg: EnvConfig, address: str = "") -> str | None:
    """MUJOCO_EGL_DEVICE_ID of a fresh env actor of a run with ``env_cfg``."""
    with ray_executor(env_cfg, [1], watchdog_s=120, address=address) as ex:
        ex.call(0, 0, "max_steps", []).result(timeout=300)
        return _environ(ex.pid(0)).get("MUJOCO_EGL_DEVICE_ID")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc/<pid>/environ")
def test_a_later_ray_run_renders_on_its_own_gpu_and_cannot_switch_clusters(monkeypatch):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'wamkit[ray]')")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MUJOCO_EGL_DEVICE_ID", raising=False)
    env_cfg = EnvConfig(tasks=["reach-v3"], image_size=32)
    try:
        assert _render_device(env_cfg) is None  # the first run joins a local cluster; EGL's choice
        second = EnvConfig(tasks=["reach-v3"], image_size=32, render_gpu=0)
        assert _render_device(second) == "0"  # the second run's render GPU, not the first's
        assert _render_device(env_cfg) is None
        cluster = ray.get_runtime_context().gcs_address
        with pytest.raises(ConfigError, match=r"eval.ray_address: 127.0.0.1:1 is not the Ray cluster"):
            ray_executor(env_cfg, [1], watchdog_s=120, address="127.0.0.1:1")
        assert _render_device(env_cfg, address=cluster) is None  # the same cluster, named: fine
    finally:
        ray.shutdown()
