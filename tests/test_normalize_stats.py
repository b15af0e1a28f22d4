"""Normalizers (exact inverses, numpy and torch), the stats file format and its checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wamkit.actions import normalize
from wamkit.actions.spec import SpecError
from wamkit.actions.stats import FeatureStats, StatsAccumulator, StatsError, StatsFile
from wamkit.models.base import ModelIO

from .conftest import spec_of


@pytest.fixture
def data() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5000, 4)) * [1.0, 10.0, 0.1, 1.0] + [0.0, 5.0, -1.0, 0.0]
    x[:, 3] = 0.5  # a constant dimension: q99 - q01 = 0
    return x


@pytest.mark.parametrize("kind", ["quantile", "mean_std", "min_max", "none"])
def test_round_trips_numpy_and_torch(data, kind):
    stats = FeatureStats.from_array(data)
    norm = normalize.make_normalizer(kind, stats)
    y = norm.normalize(data)
    assert np.max(np.abs(norm.unnormalize(y) - data)) < 1e-9
    t = torch.tensor(data, dtype=torch.float64)
    yt = norm.normalize(t)
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float64
    assert torch.allclose(yt, torch.tensor(y))
    assert torch.max(torch.abs(norm.unnormalize(yt) - t)) < 1e-9


def test_quantile_formula_and_clip(data):
    stats = FeatureStats.from_array(data)
    q01, q99 = np.quantile(data, [0.01, 0.99], axis=0)
    y = normalize.quantile(stats).normalize(data)
    expected = 2 * (data - q01) / np.maximum(q99 - q01, 1e-8) - 1
    assert np.allclose(y, expected)
    assert y[:, :3].min() < -1 and y[:, :3].max() > 1  # the recipe does not clip...
    yc = normalize.quantile(stats, clip=True).normalize(data)
    assert yc.min() >= -1 and yc.max() <= 1  # ...unless asked to
    assert stats.tiny_dims() == [3]


def test_unknown_normalizer_is_named(data):
    with pytest.raises(ValueError, match="quantile"):
        normalize.make_normalizer("zscore", FeatureStats.from_array(data))


def test_accumulator_matches_exact_stats(data):
    acc = StatsAccumulator(dim=4, reservoir=10_000, seed=0)
    for part in np.array_split(data, 7):
        acc.update(part)
    exact, streamed = FeatureStats.from_array(data), acc.result()
    for key in ("mean", "std", "min", "max", "q01", "q99"):
        assert np.allclose(getattr(exact, key), getattr(streamed, key)), key
    assert streamed.count == 5000


def test_accumulator_reservoir_is_bounded_and_seeded():
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(50_000, 2))
    a, b = StatsAccumulator(2, reservoir=2_000, seed=7), StatsAccumulator(2, reservoir=2_000, seed=7)
    for part in np.array_split(x, 13):
        a.update(part)
        b.update(part)
    assert a.sample.shape == (2_000, 2)
    assert a.result() == b.result()  # deterministic for a seed
    assert abs(a.result().q99[0] - 0.99) < 0.01  # an unbiased sample of the stream


def _stats_file(data) -> StatsFile:
    return StatsFile(
        features={"action": FeatureStats.from_array(data)},
        metadata={"representation": "raw", "fps": 20, "chunk": 16, "action_dim": 4},
    )


def test_stats_file_round_trip_and_checks(tmp_path, data):
    path = _stats_file(data).save(tmp_path / "stats.json")
    loaded = StatsFile.load(path, fps=20, representation="raw")
    assert loaded == _stats_file(data)
    with pytest.raises(StatsError, match="fps=20 but this run has fps=10"):
        StatsFile.load(path, fps=10)
    with pytest.raises(StatsError, match="representation='raw'"):
        StatsFile.load(path, representation="libero_rot6d")
    with pytest.raises(StatsError, match="no feature 'observation.state'"):
        loaded["observation.state"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("format"), "'format'"),
        (lambda d: d["features"]["action"].pop("q99"), "features.action: missing q99"),
        (lambda d: d["features"]["action"].update(std=[1.0]), "lists differ in length"),
        (lambda d: d["features"]["action"].update(mean=["a", 1, 2, 3]), "features.action.mean"),
        (lambda d: d["features"]["action"].update(count=0), "count"),
        (lambda d: d.update(features={}), "non-empty"),
        (lambda d: d["features"]["action"].update(q01=[9.0, 9.0, 9.0, 9.0]), "q01 exceeds q99"),
    ],
)
def test_malformed_stats_files_are_named(tmp_path, data, mutate, message):
    d = _stats_file(data).to_json()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(StatsError, match=message) as err:
        StatsFile.load(path)
    assert str(path) in str(err.value)


def test_truncated_and_missing_stats_files(tmp_path, data):
    path = _stats_file(data).save(tmp_path / "stats.json")
    path.write_text(path.read_text()[:50])
    with pytest.raises(StatsError, match="not valid JSON"):
        StatsFile.load(path)
    with pytest.raises(StatsError, match="does not exist"):
        StatsFile.load(tmp_path / "nope.json")


def test_codec_libero_round_trip():
    rng = np.random.default_rng(2)
    from scipy.spatial.transform import Rotation

    a7 = np.concatenate(
        [
            rng.normal(size=(400, 3)),
            Rotation.random(400, random_state=1).as_rotvec() * 0.3,
            rng.choice([-1.0, 1.0], (400, 1)),
        ],
        axis=1,
    )
    from wamkit.actions.pose import to_rot6d_action

    stats = StatsFile(
        features={
            "action": FeatureStats.from_array(to_rot6d_action(a7)),
            "observation.state": FeatureStats.from_array(a7),
        },
        metadata={"representation": "libero_rot6d", "fps": 20, "gripper": "env"},
    )
    io = ModelIO(
        cameras=("image",), image_size=8, state_dim=7, action_dim=10, chunk=16, representation="libero_rot6d"
    )
    codec = spec_of(stats, io)
    encoded = codec.encode_actions(a7.reshape(25, 16, 7))
    assert encoded.shape == (25, 16, 10) and encoded.dtype == np.float32
    decoded = codec.decode_actions(encoded)
    assert decoded.shape == (25, 16, 7)
    assert np.max(np.abs(decoded.reshape(400, 7) - a7)) < 1e-4  # float32 model space
    with pytest.raises(SpecError, match="metadata has no 'representation'"):
        spec_of(StatsFile(features=stats.features, metadata={"fps": 20, "gripper": "env"}), io)
