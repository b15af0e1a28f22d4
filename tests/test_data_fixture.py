"""The reader against files written by lerobot 0.6.1 (the shared fixture) and its truth file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from wamkit.constants import ACTION, OBS_STATE
from wamkit.data import DatasetError, LeRobotDataset

from .conftest import FIXTURES

FIXTURE = FIXTURES / "libero_tiny"
TRUTH = FIXTURE.with_name("libero_tiny.truth.jsonl")
CAMS = ["observation.images.image", "observation.images.wrist_image"]
TOL = 8  # uint8 levels: AV1 at crf 30 on 64 px moves flat colours by a few levels


@pytest.fixture(scope="module")
def truth(libero_tiny) -> list[dict]:
    assert libero_tiny == FIXTURE
    return [json.loads(line) for line in TRUTH.read_text().splitlines()]


def check_pattern(img: np.ndarray, episode: int, frame: int, cam: int) -> None:
    """Red, green and the blue band of the fixture pattern, away from the band's edge."""
    img = img.astype(np.int32)
    h = img.shape[0]
    band = (frame * 3) % h
    body = img[band + 2 :] if band + 4 < h else img[:, :0]  # all band: only the band to check
    red = (episode * 40 + frame * 6) % 256
    if body.size == 0:
        assert np.median(img[:, :, 2]) >= 150
        return
    assert abs(np.median(body[..., 0]) - red) <= TOL, (episode, frame, cam)
    assert abs(np.median(body[..., 1]) - 60 * cam) <= TOL, (episode, frame, cam)
    assert np.median(body[..., 2]) <= TOL
    if band >= 4:
        assert np.median(img[: band - 2, :, 2]) >= 150  # chroma subsampling dims the band


def check_against_truth(ds: LeRobotDataset, truth: list[dict]) -> None:
    """Every frame: indices, time, state, action and task exact, both cameras' colour pattern."""
    assert len(ds) == len(truth)
    for i, t in enumerate(truth):
        item = ds[i]
        assert (int(item["episode_index"]), int(item["frame_index"])) == (t["episode"], t["frame"])
        assert np.array_equal(item[OBS_STATE].numpy(), np.asarray(t["state"], np.float32))
        assert np.array_equal(item[ACTION].numpy(), np.asarray(t["action"], np.float32))
        assert item["task"] == t["task"]
        assert abs(float(item["timestamp"]) - t["frame"] / 20) < 1e-6
        for c, key in enumerate(CAMS):
            img = item[key].numpy()
            assert img.dtype == np.uint8 and img.shape == (64, 64, 3)
            check_pattern(img, t["episode"], t["frame"], c)


def test_reads_every_frame_exactly(truth):
    ds = LeRobotDataset(FIXTURE)
    assert (len(ds), ds.num_episodes, ds.fps) == (100, 4, 20)
    assert ds.camera_keys == CAMS
    assert ds.meta.info["robot_type"] == "panda"
    check_against_truth(ds, truth)


def test_random_order_gives_the_same_frames(truth):
    ds = LeRobotDataset(FIXTURE, cameras=["image"])
    seq = [ds[i]["observation.images.image"].numpy().copy() for i in range(len(ds))]
    fresh = LeRobotDataset(FIXTURE, cameras=["image"])
    for i in np.random.default_rng(0).permutation(len(ds)):
        assert np.array_equal(fresh[int(i)]["observation.images.image"].numpy(), seq[i])


def test_action_chunk_pads_past_the_episode_end(truth):
    ds = LeRobotDataset(FIXTURE, delta_timestamps={ACTION: [k / 20 for k in range(16)]}, cameras=[])
    first_len = sum(1 for t in truth if t["episode"] == 0)
    i = first_len - 3  # three frames before the end of episode 0
    item = ds[i]
    assert item[ACTION].shape == (16, 7)
    assert item["action_is_pad"].tolist() == [False] * 3 + [True] * 13
    assert np.array_equal(
        item[ACTION][:3].numpy(), np.asarray([t["action"] for t in truth[i : i + 3]], np.float32)
    )
    assert np.array_equal(item[ACTION][5].numpy(), np.asarray(truth[first_len - 1]["action"], np.float32))


def test_episode_subset_and_camera_subset(truth):
    ds = LeRobotDataset(FIXTURE, episodes=[2], cameras=["wrist_image"])
    rows = [t for t in truth if t["episode"] == 2]
    assert len(ds) == len(rows) and ds.camera_keys == ["observation.images.wrist_image"]
    item = ds[5]
    assert "observation.images.image" not in item
    assert np.array_equal(item[OBS_STATE].numpy(), np.asarray(rows[5]["state"], np.float32))
    check_pattern(item["observation.images.wrist_image"].numpy(), 2, 5, 1)


def test_bad_requests_name_what_was_expected():
    with pytest.raises(DatasetError, match="unknown camera 'front'.*observation.images.image"):
        LeRobotDataset(FIXTURE, cameras=["front"])
    with pytest.raises(DatasetError, match=r"episodes \[9\]"):
        LeRobotDataset(FIXTURE, episodes=[9])
    with pytest.raises(DatasetError, match="not multiples of 1/fps"):
        LeRobotDataset(FIXTURE, delta_timestamps={ACTION: [0.0, 0.033]})
    with pytest.raises(IndexError):
        LeRobotDataset(FIXTURE, cameras=[])[100]


def test_frames_kept_in_memory_are_the_frames_decoded_per_sample(truth):
    """data.frame_memory_mb: whole files decoded into memory give the very frames the per-sample
    decoder gives (the same decoder and colour conversion), in any order; a budget that a file would
    pass keeps none of it and reads it per sample; a time with no frame is named with the file."""
    plain = LeRobotDataset(FIXTURE)
    kept = LeRobotDataset(FIXTURE, frame_memory_mb=64)
    small = LeRobotDataset(FIXTURE, frame_memory_mb=0.5)  # a camera's file holds 1.2 MB of RGB
    for i in np.random.default_rng(0).permutation(len(plain)).tolist():
        want = plain[i]
        for ds in (kept, small):
            got = ds[i]
            for key in CAMS:
                assert np.array_equal(got[key].numpy(), want[key].numpy()), (i, key)
    check_against_truth(kept, truth)
    assert kept._videos._whole_bytes == len(CAMS) * 100 * 64 * 64 * 3
    assert small._videos._whole_bytes == 0 and all(v is None for v in small._videos._whole.values())
    video = next((FIXTURE / "videos" / CAMS[0]).rglob("*.mp4"))
    with pytest.raises(DatasetError, match=r"file-000\.mp4: video ends before t=9\.0000s"):
        kept._videos.frame(video, 9.0, 1e-4)
    with pytest.raises(DatasetError, match=r"no frame at t=0\.0250s \(the next frame is at t=0\.0500s"):
        kept._videos.frame(video, 0.025, 1e-4)
