"""Env workers: real spawned processes, real pipes, real kills."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from wamkit.config import EnvConfig
from wamkit.constants import OBS_STATE, image_key
from wamkit.envs import EnvHost, EpisodeSpec
from wamkit.envs.workers import EnvWorker, WorkerDied, WorkerError

CFG = EnvConfig(image_size=32)
SPECS = {0: EpisodeSpec("metaworld", "reach-v3", 0, 5), 1: EpisodeSpec("metaworld", "push-v3", 1, 6)}


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, only not reaped
    except FileNotFoundError:
        return False


def test_worker_matches_in_process_host_and_reports_errors():
    host = EnvHost(CFG, 2)
    w = EnvWorker(CFG, 2, worker_id=3)
    try:
        host.reset(SPECS)
        w.submit("reset", SPECS)  # non-blocking: the call returns before the worker answers
        remote = w.result(timeout=60)
        assert sorted(remote) == [0, 1]
        actions = {0: np.array([0.3, 0.1, -0.2, 1.0]), 1: np.array([-0.5, 0.4, 0.0, -1.0])}
        for _ in range(3):
            local, remote = host.step(actions), w.call("step", actions, timeout=30)
        for slot in (0, 1):
            np.testing.assert_array_equal(local[slot][0][OBS_STATE], remote[slot][0][OBS_STATE])
            np.testing.assert_array_equal(
                local[slot][0][image_key("corner")], remote[slot][0][image_key("corner")]
            )
            assert local[slot][1:4] == remote[slot][1:4]
        with pytest.raises(WorkerError, match=r"worker 3: step\(\) failed: .*expected shape \[4\]") as err:
            w.call("step", {0: np.zeros(9)}, timeout=30)
        assert err.value.worker_id == 3 and "Traceback" in err.value.remote_traceback
        assert w.alive and w.call("max_steps", None, timeout=30) == {0: 500, 1: 500}
    finally:
        host.close()
        w.close()
    assert not w.alive and w.process.exitcode == 0


def test_killed_worker_raises_typed_error_naming_its_episodes():
    w = EnvWorker(CFG, 2, worker_id=5)
    try:
        w.call("reset", SPECS, timeout=60)
        pid = w.process.pid
        w.submit("step", {0: np.zeros(4)})
        w.result(timeout=30)
        os.kill(pid, 9)
        with pytest.raises(WorkerDied) as err:  # from submit (pipe closed) or from result
            w.submit("step", {0: np.zeros(4)})
            w.result(timeout=30)
        assert err.value.worker_id == 5
        assert set(err.value.episodes) == set(SPECS.values())
        assert "worker 5 died" in str(err.value) and "push-v3/trial 1/seed 6" in str(err.value)
        assert not _pid_alive(pid)
    finally:
        w.kill()
        w.close()


def test_bad_config_in_worker_is_reported():
    w = EnvWorker(EnvConfig(cameras=["nope"]), 1, worker_id=1)
    try:
        with pytest.raises(WorkerError, match="env.cameras"):
            w.call("reset", {0: SPECS[0]}, timeout=60)
    finally:
        w.close()


def test_worker_exits_when_its_parent_is_killed(tmp_path):
    """No orphan: SIGKILL the parent mid-episode; the child sees its pipe close and exits."""
    script = textwrap.dedent(
        """
        import sys, time
        from wamkit.config import EnvConfig
        from wamkit.envs import EpisodeSpec
        from wamkit.envs.workers import EnvWorker
        if __name__ == "__main__":
            w = EnvWorker(EnvConfig(image_size=32), 1)
            w.call("reset", {0: EpisodeSpec("metaworld", "reach-v3", 0, 0)}, timeout=60)
            print(w.process.pid, flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _pid_alive(child)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _pid_alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(child), f"worker {child} outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
