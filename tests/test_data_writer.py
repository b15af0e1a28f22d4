"""The writer: round trip, crash safety, appending, and errors that name the broken file."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from wamkit.constants import ACTION, OBS_STATE
from wamkit.data import DatasetError, LeRobotDataset, LeRobotDatasetWriter
from wamkit.data.meta import INFO, PARTIAL
from wamkit.data.synthetic import (
    append_pattern_episodes,
    pattern_action,
    pattern_frame,
    pattern_state,
    write_pattern_dataset,
)

LENGTHS = [7, 12, 5]
TOL = 6  # uint8 levels; H.264 at crf 18 keeps flat colours within a few levels


def check_round_trip(ds: LeRobotDataset, lengths: list[int], cams=("image", "wrist_image")) -> None:
    i = 0
    for e, n in enumerate(lengths):
        for f in range(n):
            item = ds[i]
            assert (int(item["episode_index"]), int(item["frame_index"]), int(item["index"])) == (e, f, i)
            assert np.array_equal(item[OBS_STATE].numpy(), pattern_state(e, f, 8))
            assert np.array_equal(item[ACTION].numpy(), pattern_action(e, f, 7))
            for c, cam in enumerate(cams):
                got = item[f"observation.images.{cam}"].numpy().astype(int)
                want = pattern_frame(e, f, c, (64, 64)).astype(int)
                assert np.median(np.abs(got - want)) <= TOL, (e, f, cam)
            i += 1
    assert i == len(ds)


def test_round_trip_video_and_metadata(tmp_path):
    root = write_pattern_dataset(
        tmp_path / "ds", LENGTHS, extra_info={"render_quality": "fast", "suite": "x"}
    )
    ds = LeRobotDataset(root)
    assert (ds.num_episodes, len(ds), ds.fps) == (3, sum(LENGTHS), 20)
    assert ds.meta.info["wamkit"] == {"render_quality": "fast", "suite": "x"}
    assert ds.meta.info["total_frames"] == sum(LENGTHS) and ds.meta.info["total_tasks"] == 2
    assert ds[8]["task"] == "open the drawer" and ds[0]["task"] == "pick up the cube"
    check_round_trip(ds, LENGTHS)
    stats = json.loads((root / "meta/stats.json").read_text())
    all_states = np.concatenate([[pattern_state(e, f, 8) for f in range(n)] for e, n in enumerate(LENGTHS)])
    assert np.allclose(stats[OBS_STATE]["mean"], all_states.mean(0))
    assert np.allclose(stats[OBS_STATE]["std"], all_states.std(0))
    assert stats[OBS_STATE]["count"] == [sum(LENGTHS)]
    assert np.array(stats["observation.images.image"]["mean"]).shape == (3, 1, 1)


def test_round_trip_image_features(tmp_path):
    root = write_pattern_dataset(tmp_path / "ds", [4, 3], camera_dtype="image")
    ds = LeRobotDataset(root)
    assert ds.meta.image_keys == ["observation.images.image", "observation.images.wrist_image"]
    assert np.array_equal(ds[5]["observation.images.wrist_image"].numpy(), pattern_frame(1, 1, 1, (64, 64)))


CRASH = """
import os, sys
from wamkit.data.synthetic import write_pattern_dataset, pattern_frame, pattern_state, pattern_action
w = write_pattern_dataset(sys.argv[1], [6, 4], finalize=False)
from wamkit.data import LeRobotDatasetWriter
w = LeRobotDatasetWriter.open(sys.argv[1])
for f in range(3):  # half an episode, never saved
    w.add_frame({"observation.images.image": pattern_frame(2, f, 0, (64, 64)),
                 "observation.images.wrist_image": pattern_frame(2, f, 1, (64, 64)),
                 "observation.state": pattern_state(2, f, 8), "action": pattern_action(2, f, 7), "task": "t"})
os._exit(9)  # a crash: no finalize, no clean-up
"""


def test_crash_leaves_no_complete_dataset_and_open_appends(tmp_path):
    root = tmp_path / "ds"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CRASH), str(root)], capture_output=True, text=True
    )
    assert proc.returncode == 9, proc.stderr
    assert not (root / INFO).exists() and (root / PARTIAL).exists()
    with pytest.raises(DatasetError, match="not finalized"):
        LeRobotDataset(root)
    # a kill inside an episode-metadata write leaves its staging file, truncated: not an episode file
    stale = root / "meta" / "episodes" / "chunk-000" / "file-007.tmp.parquet"
    stale.write_bytes(b"PAR1 cut short")
    w = LeRobotDatasetWriter.open(root)
    assert (w.num_episodes, w.num_frames) == (2, 10) and not stale.exists()
    append_pattern_episodes(
        w, [5], 2, ("image", "wrist_image"), (64, 64), 8, 7, ("pick up the cube", "open the drawer")
    )
    w.finalize()
    check_round_trip(LeRobotDataset(root), [6, 4, 5])
    stale.write_bytes(b"PAR1 cut short")  # readers pass such a file by, too
    check_round_trip(LeRobotDataset(root), [6, 4, 5])
    stale.unlink()
    # re-opening a finished dataset makes it incomplete again until finalize
    w = LeRobotDatasetWriter.open(root)
    assert not (root / INFO).exists()
    append_pattern_episodes(
        w, [3], 3, ("image", "wrist_image"), (64, 64), 8, 7, ("pick up the cube", "open the drawer")
    )
    w.finalize()
    ds = LeRobotDataset(root)
    assert ds.num_episodes == 4 and ds.meta.info["total_tasks"] == 2
    check_round_trip(ds, [6, 4, 5, 3])


def test_writer_rejects_bad_input(tmp_path):
    feats = {"observation.images.c": {"dtype": "video", "shape": [63, 64, 3]}}
    with pytest.raises(DatasetError, match=r"features\['observation.images.c'\].*even"):
        LeRobotDatasetWriter.create(tmp_path / "a", 20, feats)
    feats = {OBS_STATE: {"dtype": "float32", "shape": [3]}, ACTION: {"dtype": "float32", "shape": [2]}}
    w = LeRobotDatasetWriter.create(tmp_path / "b", 20, feats)
    with pytest.raises(DatasetError, match=r"'observation.state' must have shape \[3\]"):
        w.add_frame({OBS_STATE: np.zeros(4, np.float32), ACTION: np.zeros(2, np.float32), "task": "t"})
    with pytest.raises(DatasetError, match="missing \\['action'\\]"):
        w.add_frame({OBS_STATE: np.zeros(3, np.float32), "task": "t"})
    with pytest.raises(DatasetError, match="not empty"):
        LeRobotDatasetWriter.create(tmp_path / "b", 20, feats)


@pytest.fixture
def small(tmp_path):
    return write_pattern_dataset(tmp_path / "ds", [5, 4])


def test_missing_and_truncated_files_are_named(small):
    data = small / "data/chunk-000/file-001.parquet"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(DatasetError, match="file-001.parquet: cannot read parquet"):
        LeRobotDataset(small)
    data.unlink()
    with pytest.raises(DatasetError, match="file-001.parquet: file is missing"):
        LeRobotDataset(small)


def test_truncated_and_missing_video_are_named(small):
    video = small / "videos/observation.images.wrist_image/chunk-000/file-000.mp4"
    video.write_bytes(video.read_bytes()[:600])
    ds = LeRobotDataset(small)
    assert int(ds[6]["frame_index"]) == 1  # episode 1 uses another file
    with pytest.raises(DatasetError, match="observation.images.wrist_image/chunk-000/file-000.mp4"):
        ds[2]
    video.unlink()
    with pytest.raises(DatasetError, match="file-000.mp4: video file is missing"):
        LeRobotDataset(small)


def test_wrong_feature_shape_is_named(small):
    info = json.loads((small / INFO).read_text())
    info["features"][OBS_STATE]["shape"] = [9]
    (small / INFO).write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=r"column 'observation.state' has 8 values per row.*shape \[9\]"):
        LeRobotDataset(small)
