"""The training pipeline: per-sample format, suites, fps refusal, and exactly resumable loading."""

from __future__ import annotations

import logging
from itertools import groupby

import numpy as np
import pytest
import torch

from wamkit.actions.spec import SpecError
from wamkit.config import ConfigError, DataConfig
from wamkit.constants import ACTION, OBS_STATE
from wamkit.data import compute_stats, make_train_dataset, make_train_loader
from wamkit.data.loader import SampleStream
from wamkit.data.synthetic import pattern_action, pattern_frame, pattern_state, write_pattern_dataset
from wamkit.models.base import ModelIO

from .conftest import spec_of

CHUNK = 4
IO = ModelIO(cameras=("front", "wrist"), image_size=32, state_dim=8, action_dim=7, chunk=CHUNK)


@pytest.fixture(scope="module")
def suites(tmp_path_factory):
    root = tmp_path_factory.mktemp("suites")
    write_pattern_dataset(root / "suite_a", [9, 6], size=(64, 64))
    write_pattern_dataset(root / "suite_b", [5], size=(64, 64), first_pattern=50)
    write_pattern_dataset(root / "slow", [5], fps=10, size=(64, 64))
    return root


@pytest.fixture(scope="module")
def codec(suites):
    return spec_of(compute_stats(suites / "suite_a", "raw", chunk=CHUNK), IO)


def cfg(root, **kw) -> DataConfig:
    base = dict(root=str(root), suites=["suite_a", "suite_b"], cameras=["image", "wrist_image"], chunk=CHUNK)
    return DataConfig(**{**base, **kw})


def test_sample_format_values_and_future_frames(suites, codec):
    ds = make_train_dataset(cfg(suites), codec, future_offsets=(CHUNK,))
    assert len(ds) == 20
    item = ds[7]  # suite_a episode 0, frame 7 of 9: chunk runs 2 past the end
    want = np.stack([pattern_action(0, min(f, 8), 7) for f in range(7, 7 + CHUNK)])
    assert np.allclose(item[ACTION].numpy(), codec.encode_actions(want))
    assert item["action_is_pad"].tolist() == [False, False, True, True]
    assert np.allclose(item[OBS_STATE].numpy(), codec.encode_state(pattern_state(0, 7, 8)))
    assert item["observation.images.front"].shape == (32, 32, 3)
    assert item["observation.images.front"].dtype == torch.uint8
    future = item["observation.future_images.wrist"].numpy().astype(int)  # [K=1, ...] clamped to frame 8
    assert future.shape == (1, 32, 32, 3)
    assert abs(np.median(future[..., 0]) - pattern_frame(0, 8, 1, (64, 64))[40, 0, 0]) <= 6
    assert abs(np.median(future[..., 1]) - 60) <= 6
    other = ds[15]  # suite_b episode 0 frame 0 (pattern 50)
    assert other["task"] == "pick up the cube"
    assert np.allclose(other[OBS_STATE].numpy(), codec.encode_state(pattern_state(50, 0, 8)))
    batch = next(make_train_loader(ds, 4, seed=0, num_workers=0))
    assert IO.check_batch(batch, training=True) == 4 and len(batch["task"]) == 4


def test_fps_mismatch_and_bad_cameras_are_refused(suites, codec):
    with pytest.raises(SpecError, match="slow: recorded at 10 fps but the preprocessing spec .* 20 fps"):
        make_train_dataset(cfg(suites, suites=["slow"]), codec)
    with pytest.raises(Exception, match="has no camera 'side'"):
        make_train_dataset(cfg(suites, cameras=["image", "side"]), codec)


def test_auto_detected_suites_warn(suites, codec, caplog):
    # root holds suite_a, suite_b (20 fps) and slow (10 fps): found, warned about, and refused
    with caplog.at_level(logging.WARNING), pytest.raises(SpecError, match="slow"):
        make_train_dataset(cfg(suites, suites=[]), codec)
    assert "auto-detected suites ['slow', 'suite_a', 'suite_b']" in caplog.text
    # none of them belongs to a registered embodiment's training mix: no mix is named as incomplete
    assert "full training mix" not in caplog.text


def test_suite_weights_set_the_mix():
    stream = SampleStream([100, 50], [3.0, 1.0], seed=0)
    idx = np.asarray(stream.indices(0, 4000))
    share = np.mean(idx < 100)
    assert abs(share - 0.75) < 0.03
    # within an epoch each suite walks its own permutation: no repeats before it is exhausted
    a = idx[idx < 100][:100]
    assert len(np.unique(a)) == 100


def key(batch) -> list[tuple]:
    return [tuple(np.round(s, 4)) for s in batch[OBS_STATE].numpy()]


def test_resume_is_exact_with_workers_across_epochs(suites, codec):
    ds = make_train_dataset(cfg(suites), codec)
    run = make_train_loader(ds, 6, seed=1, num_workers=2)
    seen = [key(next(run)) for _ in range(8)]  # 48 samples: more than two epochs of 20
    flat = [s for b in seen for s in b]
    assert len(set(flat[:18])) == 18  # batches 0-2 lie in epoch 1: no sample twice
    assert flat[:20] != flat[20:40]  # and epoch 2 is reshuffled
    again = make_train_loader(ds, 6, seed=1, num_workers=2)
    again_first = [key(next(again)) for _ in range(3)]
    assert again_first == seen[:3]
    state = again.state_dict()
    assert state["samples_seen"] == 18
    resumed = make_train_loader(ds, 6, seed=1, num_workers=0)
    resumed.load_state_dict(state)
    assert [key(next(resumed)) for _ in range(5)] == seen[3:]
    with pytest.raises(ConfigError, match="loader had seed=1, this run's has 2; data.seed changed"):
        make_train_loader(ds, 6, seed=2, num_workers=0).load_state_dict(state)
    smaller = make_train_dataset(cfg(suites, suites=["suite_a"]), codec)
    with pytest.raises(ConfigError, match=r"epoch_len=20, this run's has 15; the dataset's size \(data.root"):
        make_train_loader(smaller, 6, seed=1, num_workers=0).load_state_dict(state)


def test_ranks_split_the_global_batch(suites, codec):
    ds = make_train_dataset(cfg(suites), codec)
    whole = make_train_loader(ds, 8, seed=5, num_workers=0)
    r0 = make_train_loader(ds, 4, seed=5, num_workers=0, rank=0, world_size=2)
    r1 = make_train_loader(ds, 4, seed=5, num_workers=0, rank=1, world_size=2)
    for _ in range(3):  # each reads its slice in index order: the same samples, sorted per rank
        assert sorted(key(next(whole))) == sorted(key(next(r0)) + key(next(r1)))


def test_training_order_visits_file_local_windows():
    window = 4
    stream = SampleStream([22], [1.0], seed=3, window=window)
    order = np.asarray(stream.indices(0, 22))
    assert sorted(order.tolist()) == list(range(22))  # an epoch still covers each sample once
    runs = [(w, [int(i) for i in idx]) for w, idx in groupby(order, key=lambda i: int(i) // window)]
    assert sorted(w for w, _ in runs) == list(range(6))  # each window visited in one run
    assert [w for w, _ in runs] != list(range(6))  # in a shuffled order of windows
    assert any(idx != sorted(idx) for _, idx in runs)  # and shuffled within
    assert order.tolist() == SampleStream([22], [1.0], seed=3, window=window).indices(0, 22)
    plain = SampleStream([22], [1.0], seed=3, window=1).indices(0, 22)  # the pre-window order
    assert plain == np.random.default_rng([3, 0]).permutation(22).tolist()


def test_loader_state_names_a_window_mismatch(suites, codec):
    ds = make_train_dataset(cfg(suites), codec)
    state = make_train_loader(ds, 4, seed=0, num_workers=0, window=1).state_dict()
    with pytest.raises(ConfigError, match="loader had window=1, this run's has 8"):
        make_train_loader(ds, 4, seed=0, num_workers=0).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "window"}  # saved before windows: the plain order
    make_train_loader(ds, 4, seed=0, num_workers=0, window=1).load_state_dict(old)


def test_a_run_on_several_suites_needs_its_one_stats_file(suites, tmp_path):
    """Several datasets are normalised with one stats file: without data.stats (or one at
    data.root/meta/wamkit_stats.json) the run is refused naming data.stats, not computed over the
    parent folder, which is no dataset. A parent holding one dataset gets that one's stats."""
    from wamkit.config import load_config
    from wamkit.train.data_setup import dataset_roots, resolve_stats

    both = [f"data.root={suites}", "data.suites=[suite_a,suite_b]"]
    assert [p.name for p in dataset_roots(load_config(None, both))] == ["suite_a", "suite_b"]
    with pytest.raises(ConfigError, match=r"data.stats: the run trains on 2 datasets \(suite_a, suite_b\)"):
        resolve_stats(load_config(None, both), tmp_path, 20.0, True)
    given = compute_stats(suites / "suite_a", "raw", chunk=CHUNK).save(tmp_path / "given.json")
    assert resolve_stats(load_config(None, [*both, f"data.stats={given}"]), tmp_path, 20.0, True).is_file()
    one = tmp_path / "one"
    write_pattern_dataset(one / "only", [4], size=(64, 64))
    single = load_config(None, [f"data.root={one}"])
    assert dataset_roots(single) == [one / "only"]
    (tmp_path / "run").mkdir()
    assert resolve_stats(single, tmp_path / "run", 20.0, True).is_file()
