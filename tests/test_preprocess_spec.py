"""The preprocessing spec: training and serving run the same transforms, and a model is served with
exactly the normalisation, clipping and gripper convention it was trained with (through a real
training run, ``convert`` and the server)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from wamkit.actions.spec import PreprocessSpec, SpecError
from wamkit.actions.stats import FeatureStats, StatsFile
from wamkit.config import DataConfig, load_config
from wamkit.constants import ACTION, OBS_STATE, image_key
from wamkit.data import LeRobotDataset, compute_stats, make_train_dataset
from wamkit.data.synthetic import write_pattern_dataset
from wamkit.export import checkpoint_to_serving
from wamkit.models.base import ModelIO
from wamkit.serve.loading import load_served
from wamkit.serve.policy import ServedPolicy

from .conftest import spec_of

FIXTURES = Path(__file__).parent / "fixtures" / "preprocess"

IO = ModelIO(cameras=("image", "wrist_image"), image_size=24, state_dim=8, action_dim=7, chunk=4)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec") / "data"
    write_pattern_dataset(root, [12, 9], size=(64, 48))  # not square, not the model's size: resized
    return root


def test_training_and_serving_give_identical_model_inputs(dataset):
    spec = spec_of(compute_stats(dataset, "raw", chunk=4), IO, normalization="mean_std")
    train_item = make_train_dataset(DataConfig(root=str(dataset), chunk=4), spec)[5]
    raw = LeRobotDataset(dataset)[5]  # the very frame and state, as decoded from the files

    class _NoModel:
        name, io, supports_rtc, module = "none", IO, False, torch.nn.Module()

    served = ServedPolicy(_NoModel(), spec).prepare(
        {
            image_key("image"): raw[image_key("image")].numpy(),
            image_key("wrist_image"): raw[image_key("wrist_image")].numpy(),
            OBS_STATE: raw[OBS_STATE].numpy(),
            "prompt": raw["task"],
        }
    )
    for cam in IO.cameras:
        got = served.batch[image_key(cam)][0]
        assert got.shape == (24, 24, 3)
        np.testing.assert_array_equal(got, train_item[image_key(cam)].numpy())
    np.testing.assert_array_equal(served.batch[OBS_STATE][0], train_item[OBS_STATE].numpy())


def _normalize(kind: str, x: np.ndarray, f: dict) -> np.ndarray:
    """Written out independently of wamkit.actions.normalize."""
    if kind == "quantile":
        return 2 * (x - f["q01"]) / np.maximum(f["q99"] - f["q01"], 1e-8) - 1
    if kind == "mean_std":
        return (x - f["mean"]) / np.maximum(f["std"], 1e-8)
    if kind == "min_max":
        return 2 * (x - f["min"]) / np.maximum(f["max"] - f["min"], 1e-8) - 1
    return x


def _unnormalize(kind: str, y: np.ndarray, f: dict) -> np.ndarray:
    if kind == "quantile":
        return (y + 1) / 2 * np.maximum(f["q99"] - f["q01"], 1e-8) + f["q01"]
    if kind == "mean_std":
        return y * np.maximum(f["std"], 1e-8) + f["mean"]
    if kind == "min_max":
        return (y + 1) / 2 * np.maximum(f["max"] - f["min"], 1e-8) + f["min"]
    return y


@pytest.mark.parametrize(
    "kind,clip", [("quantile", False), ("mean_std", True), ("min_max", True), ("none", False)]
)
def test_a_model_is_served_with_the_normalisation_it_was_trained_with(dataset, tmp_path, kind, clip):
    from wamkit.train import train

    cfg = load_config(
        None,
        [
            f"data.root={dataset}", "data.chunk=4", f"data.normalization={kind}", f"data.clip={clip}",
            "data.num_workers=0", f"data.stats={tmp_path / 'stats.json'}",
            f"train.run_dir={tmp_path / 'run'}", "train.max_steps=1", "train.save_interval=1",
            "train.micro_batch=2", "train.global_batch=2", "train.log_interval=1",
            "model.preset=small", "model.options.width=32", "model.options.depth=1", "model.options.heads=2",
            "model.options.num_steps=2",
        ],
    )  # fmt: skip
    compute_stats(dataset, "raw", chunk=4).save(tmp_path / "stats.json")
    run = train(cfg)
    serve_dir = checkpoint_to_serving(run / "checkpoints" / "step_000001", tmp_path / "serve")
    policy = load_served(serve_dir, "cpu")
    assert (policy.spec.normalization, policy.spec.clip) == (kind, clip)
    stats = json.loads((tmp_path / "stats.json").read_text())["features"]
    f_state = {k: np.asarray(v) for k, v in stats[OBS_STATE].items() if k != "count"}
    f_act = {k: np.asarray(v) for k, v in stats[ACTION].items() if k != "count"}

    raw = LeRobotDataset(dataset)[3]
    obs = {image_key(c): raw[image_key(c)].numpy() for c in ("image", "wrist_image")} | {
        OBS_STATE: raw[OBS_STATE].numpy(),
        "prompt": raw["task"],
        "seed": 3,
    }
    req = policy.prepare(obs)
    np.testing.assert_allclose(
        req.batch[OBS_STATE][0], _normalize(kind, raw[OBS_STATE].numpy(), f_state), rtol=1e-5
    )
    model_out = ServedPolicy(policy.adapter, policy.spec, raw_actions=True).infer(obs)["actions"]
    served = policy.infer(obs)["actions"]
    np.testing.assert_allclose(served, _unnormalize(kind, model_out, f_act), rtol=1e-5, atol=1e-4)
    # clipping applies to training targets: a stored action beyond the range is encoded to at most 1
    far = np.asarray(f_act["max"]) * 10 + 10
    assert (np.abs(policy.spec.encode_actions(far)).max() <= 1.0 + 1e-6) == clip or kind == "none"


def test_spec_file_round_trip_and_bad_fields_are_named(dataset, tmp_path):
    spec = spec_of(compute_stats(dataset, "raw", chunk=4), IO, normalization="min_max", clip=True)
    back = PreprocessSpec.load(spec.save(tmp_path / "preprocess.json"))
    assert back.to_json() == spec.to_json() and back.stats_hash() == spec.stats_hash()
    data = spec.to_json()
    del data["steps"], data["chunk"]
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"bad\.json: missing steps, chunk"):
        PreprocessSpec.load(tmp_path / "bad.json")
    data = spec.to_json()
    data["steps"][-1]["method"] = "bicubic"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"bad\.json: steps\[5\] \(resize\): method 'bicubic' is not one of"):
        PreprocessSpec.load(tmp_path / "bad.json")
    # a file of format 1 names its own fields
    old = json.loads((FIXTURES / "pattern_none.preprocess.json").read_text())
    del old["gripper"]
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(SpecError, match=r"bad\.json: missing gripper"):
        PreprocessSpec.load(tmp_path / "bad.json")
    with pytest.raises(SpecError, match="does not fit the model.*image_size: spec 24, model 32"):
        spec.check_model(
            ModelIO(cameras=("image", "wrist_image"), image_size=32, state_dim=8, action_dim=7, chunk=4)
        )


def _libero_open_1_spec() -> PreprocessSpec:
    """A LIBERO rot6d spec whose data stores the gripper as NVIDIA's does: g in [0, 1], 1 = open."""
    rng = np.random.default_rng(0)
    a10 = np.concatenate([rng.normal(0, 0.3, (500, 9)), rng.integers(0, 2, (500, 1))], axis=1)
    stats = StatsFile(
        features={
            ACTION: FeatureStats.from_array(a10),
            OBS_STATE: FeatureStats.from_array(rng.normal(size=(500, 8))),
        },
        metadata={"representation": "libero_rot6d", "fps": 20, "gripper": "open_1"},
    )
    io = ModelIO(("agentview", "wrist"), 64, 8, 10, 16, "libero_rot6d")
    return spec_of(stats, io)


def test_open_1_data_decodes_to_env_commands_both_ways():
    spec = _libero_open_1_spec()
    stored = np.zeros((2, 7))
    stored[:, 3:6] = 0.1
    stored[:, 6] = [1.0, 0.0]  # open, close in the data's convention
    env = spec.decode_actions(spec.encode_actions(stored))
    assert env[:, 6].tolist() == [-1.0, 1.0]  # the env's: -1 open, +1 close
    np.testing.assert_allclose(env[:, :6], stored[:, :6], atol=1e-5)
    assert spec.env_to_stored(env)[:, 6].tolist() == [1.0, 0.0]


@pytest.mark.libero
@pytest.mark.skipif(importlib.util.find_spec("libero") is None, reason="LIBERO extra not installed")
def test_predicting_open_on_open_1_data_opens_the_gripper_in_libero():
    """The model's output says "open" (g = 1 in NVIDIA's data convention); the decoded command opens
    the real LIBERO gripper after it was closed."""
    from wamkit.config import EnvConfig
    from wamkit.envs import EpisodeSpec, expand_tasks, make_env

    spec = _libero_open_1_spec()
    stored = np.zeros((16, 7))
    stored[:, 6] = 1.0  # "open", as the model learned it from the data
    open_cmd = spec.decode_actions(spec.encode_actions(stored))[0]
    env = make_env(EnvConfig(suite="libero_10", tasks=["0"], cameras=["agentview"], image_size=32))
    try:
        env.reset(EpisodeSpec("libero_10", expand_tasks("libero_10", ["0"])[0], 0, 7))
        close = np.array([0, 0, 0, 0, 0, 0, 1.0])
        for _ in range(15):
            obs = env.step(close)[0]
        closed = float(obs[OBS_STATE][6] - obs[OBS_STATE][7])
        for _ in range(15):
            obs = env.step(open_cmd.astype(np.float64))[0]
        opened = float(obs[OBS_STATE][6] - obs[OBS_STATE][7])
    finally:
        env.close()
    assert opened > closed + 0.01, (closed, opened)
