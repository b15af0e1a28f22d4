"""Dataset statistics against an independent in-memory computation, and the ``wamkit stats`` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from wamkit.actions.stats import StatsFile
from wamkit.constants import ACTION, OBS_STATE
from wamkit.data import DatasetError, compute_stats
from wamkit.data.synthetic import write_pattern_dataset


@pytest.fixture(scope="module")
def truth(libero_tiny):
    rows = [
        json.loads(line) for line in libero_tiny.with_name("libero_tiny.truth.jsonl").read_text().splitlines()
    ]
    eps: dict[int, list] = {}
    for r in rows:
        eps.setdefault(r["episode"], []).append(r)
    return eps


def reference_chunks(eps, chunk: int) -> np.ndarray:
    """Every non-padded chunk step, by explicit loops, with rot6d from scipy (first two columns)."""
    out = []
    for rows in eps.values():
        acts = np.asarray([r["action"] for r in rows], np.float64)
        for s in range(len(acts)):
            for k in range(chunk):
                if s + k < len(acts):
                    a = acts[s + k]
                    m = Rotation.from_rotvec(a[3:6]).as_matrix()
                    out.append(np.concatenate([a[:3], m[:, 0], m[:, 1], a[6:]]))
    return np.asarray(out)


def test_libero_rot6d_stats_match_reference(libero_tiny, truth):
    stats = compute_stats(libero_tiny, "libero_rot6d", chunk=4, seed=0)
    ref = reference_chunks(truth, 4)
    act = stats[ACTION]
    assert act.count == len(ref) and act.dim == 10
    assert np.allclose(act.mean, ref.mean(0), atol=1e-6) and np.allclose(act.std, ref.std(0), atol=1e-6)
    assert np.allclose(act.min, ref.min(0), atol=1e-6) and np.allclose(act.max, ref.max(0), atol=1e-6)
    # the reservoir holds every sample here, so quantiles are exact
    assert np.allclose(act.q01, np.quantile(ref, 0.01, axis=0), atol=1e-6)
    states = np.asarray([r["state"] for rows in truth.values() for r in rows], np.float32)
    assert np.allclose(stats[OBS_STATE].mean, states.astype(np.float64).mean(0), atol=1e-6)
    assert stats[OBS_STATE].tiny_dims() == [6, 7]  # the fixture's gripper qpos is constant
    meta = stats.metadata
    assert (meta["representation"], meta["fps"], meta["chunk"], meta["action_dim"]) == (
        "libero_rot6d",
        20,
        4,
        10,
    )


def test_raw_stats_deterministic_and_bounded_reservoir(tmp_path):
    root = write_pattern_dataset(tmp_path / "ds", [30, 25], size=(16, 16), cameras=("c",),
                                 extra_info={"render_quality": "fast"})  # fmt: skip
    a = compute_stats(root, "raw", chunk=16, seed=3)
    b = compute_stats(root, "raw", chunk=16, seed=3)
    assert a.to_json() == b.to_json()
    assert a.metadata["render_quality"] == "fast" and a.metadata["action_dim"] == 7
    # 30 + 25 frames -> chunk steps: sum over starts of min(16, L - s)
    want = sum(sum(min(16, n - s) for s in range(n)) for n in (30, 25))
    assert a[ACTION].count == want


def test_fps_mismatch_is_refused(tmp_path, libero_tiny):
    stats = compute_stats(libero_tiny, "raw", chunk=16)
    path = stats.save(tmp_path / "s.json")
    with pytest.raises(Exception, match="fps=20 but this run has fps=10"):
        StatsFile.load(path, fps=10)


def test_stats_command_writes_file_and_reports_tiny_dims(tmp_path, libero_tiny):
    out = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "wamkit", "stats", str(libero_tiny), "--representation", "libero_rot6d",
           "--chunk", "16", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "observation.state dims with q99 - q01" in proc.stdout and "6 (0), 7 (0)" in proc.stdout
    loaded = StatsFile.load(out, fps=20, representation="libero_rot6d", chunk=16)
    assert loaded[ACTION].dim == 10
    bad = subprocess.run(
        [sys.executable, "-m", "wamkit", "stats", str(tmp_path)], capture_output=True, text=True
    )
    assert bad.returncode == 1 and "meta/info.json: file is missing" in bad.stderr


def test_unknown_representation_is_refused(libero_tiny):
    with pytest.raises(DatasetError, match="representation 'quat'"):
        compute_stats(libero_tiny, "quat")


def _gripper_dataset(root, open_value: float, close_value: float):
    """LIBERO-shaped frames whose gripper alternates open/close; the fingers follow one step later."""
    from wamkit.data.writer import LeRobotDatasetWriter

    features = {
        "observation.images.image": {"dtype": "image", "shape": [8, 8, 3], "names": None},
        OBS_STATE: {"dtype": "float32", "shape": [8], "names": None},
        ACTION: {"dtype": "float32", "shape": [7], "names": None},
    }
    writer = LeRobotDatasetWriter.create(root, 20, features, robot_type="test")
    width = 0.04
    for t in range(60):
        closing = (t // 10) % 2 == 1
        action = np.zeros(7, np.float32)
        action[6] = close_value if closing else open_value
        state = np.zeros(8, np.float32)
        state[6], state[7] = width, -width
        writer.add_frame({"observation.images.image": np.zeros((8, 8, 3), np.uint8), OBS_STATE: state,
                          ACTION: action, "task": "grip"})  # fmt: skip
        width = float(np.clip(width + (-0.004 if closing else 0.004), 0.0, 0.04))
    writer.save_episode()
    writer.finalize()
    return root


@pytest.mark.parametrize(
    "open_value,close_value,want", [(1.0, 0.0, "open_1"), (0.0, 1.0, "close_1"), (-1.0, 1.0, "env")]
)
def test_gripper_convention_is_detected_and_recorded(tmp_path, open_value, close_value, want):
    root = _gripper_dataset(tmp_path / "d", open_value, close_value)
    stats = compute_stats(root, "libero_rot6d", chunk=4, finger_dims=(6, 7))
    assert stats.metadata["gripper"] == want, stats.metadata["gripper_evidence"]
    forced = compute_stats(root, "libero_rot6d", chunk=4, gripper="close_1")
    assert (forced.metadata["gripper"], forced.metadata["gripper_evidence"]) == (
        "close_1",
        "given explicitly",
    )


def test_stats_command_reports_the_gripper_convention(tmp_path, libero_tiny):
    out = tmp_path / "stats.json"
    cmd = [sys.executable, "-m", "wamkit", "stats", str(libero_tiny), "--representation", "libero_rot6d",
           "--finger-dims", "6,7", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gripper convention: env (gripper actions range over [-1, 1]: negative values" in proc.stdout
    assert StatsFile.load(out).metadata["gripper"] == "env"
    bad = subprocess.run([*cmd[:-2], "--finger-dims", "6"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--finger-dims: expected two state dims" in bad.stderr


def test_stats_never_decode_video_unless_asked(tmp_path, libero_tiny):
    root = tmp_path / "no_videos"
    shutil.copytree(libero_tiny, root)
    shutil.rmtree(root / "videos")  # any decode would now fail
    stats = compute_stats(root, "raw", chunk=4)
    assert set(stats.features) == {ACTION, OBS_STATE}
    with pytest.raises(DatasetError, match="video file is missing"):
        compute_stats(root, "raw", chunk=4, image_stats=True)
    full = compute_stats(libero_tiny, "raw", chunk=4, image_stats=True, image_stride=1)
    cam = full["observation.images.wrist_image"]
    assert cam.count == 100 * 64 * 64 and abs(cam.mean[1] - 60 / 255) < 0.02  # green = 60 * camera 1
    assert full[ACTION].mean == stats[ACTION].mean
