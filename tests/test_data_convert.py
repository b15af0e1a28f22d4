"""LeRobot v2.1 <-> v3.0 conversion on the fixtures upstream wrote: both ways, every frame against the
truth file, streams copied (frames identical) or re-encoded (PSNR reported), crash and resume."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from wamkit.cli import main as cli
from wamkit.data import DatasetError, LeRobotDataset
from wamkit.data import convert_dataset as conv
from wamkit.data.convert_dataset import JOURNAL, convert_dataset
from wamkit.data.remux import decode_all
from wamkit.data.video import VideoEncoder

from .test_data_formats import V21, check_against_truth, truth_of

CAM = "observation.images.image"


def test_v21_to_v3_and_back_every_frame(tmp_path):
    v3 = tmp_path / "v3"
    report = convert_dataset(V21, v3)
    assert (report["from"], report["to"], report["copied_videos"], report["reencoded_videos"]) == (
        "v2.1", "v3.0", 2, 0)  # fmt: skip
    assert report["verify"]["identical_camera_frames"] == 200
    ds = LeRobotDataset(v3)
    assert ds.meta.version == "v3.0" and not (tmp_path / "v3.tmp").exists()
    assert len({e.videos[CAM][0] for e in ds.meta.episodes.values()}) == 1  # joined into one file
    assert ds.meta.episodes[2].videos[CAM][1] == pytest.approx((24 + 31) / 20)
    check_against_truth(ds, truth_of(V21))
    back = tmp_path / "v21"
    report = convert_dataset(v3, back)
    assert (report["to"], report["copied_videos"], report["verify"]["identical_camera_frames"]) == (
        "v2.1",
        8,
        200,
    )
    again = LeRobotDataset(back)
    assert again.meta.version == "v2.1"
    check_against_truth(again, truth_of(V21))
    for e in range(4):  # the round trip gives the very packets back: the files decode identically
        a = decode_all(LeRobotDataset(V21).meta.episodes[e].videos[CAM][0], again.meta.episodes[e].length)
        b = decode_all(again.meta.episodes[e].videos[CAM][0], again.meta.episodes[e].length)
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    info = json.loads((back / "meta/info.json").read_text())
    assert info["data_path"] == "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    assert info["total_videos"] == 8 and "data_files_size_in_mb" not in info


def test_v3_fixture_to_v21(tmp_path, libero_tiny):
    out = tmp_path / "v21"
    assert cli(["convert-dataset", str(libero_tiny), str(out)]) == 0
    ds = LeRobotDataset(out)
    check_against_truth(ds, truth_of(libero_tiny))
    stats = [json.loads(line) for line in (out / "meta/episodes_stats.jsonl").read_text().splitlines()]
    assert stats[0]["stats"]["action"]["count"] == [ds.meta.episodes[0].length]
    assert np.asarray(stats[0]["stats"][CAM]["mean"]).shape == (3, 1, 1)


def test_streams_that_differ_are_reencoded_and_psnr_reported(tmp_path):
    src = tmp_path / "mixed"
    shutil.copytree(V21, src)
    ep1 = LeRobotDataset(src).meta.episodes[1]
    path = ep1.videos[CAM][0]
    frames = decode_all(path, ep1.length)
    path.chmod(0o644)
    enc = VideoEncoder(path, 20, 64, 64)  # episode 1 of one camera now H.264, the others AV1
    for f in frames:
        enc.add(f)
    enc.close()
    report = convert_dataset(src, tmp_path / "v3", data_mb=0.001)  # one data file per episode too
    assert (report["copied_videos"], report["reencoded_videos"]) == (1, 1)
    check = report["verify"]
    assert check["reencoded_camera_frames"] == 100 and check["identical_camera_frames"] == 100
    assert check["psnr_min_db"] > 30
    ds = LeRobotDataset(tmp_path / "v3")
    assert len({e.data_file for e in ds.meta.episodes.values()}) == 4
    check_against_truth(ds, truth_of(V21))


def test_crash_then_resume_redoes_only_the_unfinished_unit(tmp_path, monkeypatch):
    dst = tmp_path / "v3"
    calls = []
    real = conv.join_videos

    def crash_on_second(parts, out, fps):
        calls.append(out)
        if len(calls) == 2:
            raise KeyboardInterrupt("power cut")
        return real(parts, out, fps)

    monkeypatch.setattr(conv, "join_videos", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        convert_dataset(V21, dst)
    work = tmp_path / "v3.tmp"
    assert not dst.exists() and (work / JOURNAL).is_file()
    assert not list(work.rglob("*.tmp.mp4"))  # the cut-short file was never renamed into place
    calls.clear()
    with pytest.raises(DatasetError, match="unfinished conversion with plan"):
        convert_dataset(V21, dst, video_mb=1)  # another plan does not mix with this one
    report = convert_dataset(V21, dst)
    assert len(calls) == 1  # only the camera whose file was cut short
    assert report["verify"]["identical_camera_frames"] == 200 and not work.exists()
    with pytest.raises(DatasetError, match="already exists"):
        convert_dataset(V21, dst)
