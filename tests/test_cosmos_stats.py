"""Action statistics in cosmos-framework's layout (global / global_raw, as RLinf reuses them) load as a
stats file. The file is synthetic, built in the upstream layout."""

from __future__ import annotations

import json

import pytest

from wamkit.actions.stats import StatsError, StatsFile
from wamkit.actions.stats_cosmos import is_cosmos_stats, stats_from_cosmos


def cosmos_stats(gripper_lo: float = 0.0) -> dict:
    def block(rot_lo: float, rot_hi: float) -> dict:
        q01 = [-0.7, -0.8, -0.9] + [rot_lo] * 6 + [gripper_lo]
        q99 = [0.9, 0.8, 0.9] + [rot_hi] * 6 + [1.0]
        return {"mean": [0.0] * 10, "std": [0.5] * 10, "min": q01, "max": q99, "q01": q01, "q99": q99}

    return {
        "metadata": {
            "embodiment_type": "libero",
            "pose_convention": "frame_wise_relative",
            "rotation_format": "6d",
            "action_dim": 10,
            "skip_rotation_dims": [3, 4, 5, 6, 7, 8],
            "chunk_length": 16,
            "num_samples_stats": 10000,
        },
        "global": block(-1.0, 1.0),  # rotation dims left unnormalised
        "global_raw": block(-0.2, 0.3),
    }


def test_cosmos_stats_load_as_a_stats_file(tmp_path):
    path = tmp_path / "libero_native_frame_wise_relative_rot6d.json"
    path.write_text(json.dumps(cosmos_stats()))
    stats = StatsFile.load(path, representation="libero_rot6d", fps=20, chunk=16)
    act = stats["action"]
    assert act.dim == 10 and act.count == 10000
    assert act.q01[3] == -0.2 and act.q99[3] == 0.3  # global_raw: the block cosmos' quantile_rot uses
    meta = stats.metadata
    assert meta["gripper"] == "open_1" and meta["cosmos_block"] == "global_raw"
    assert meta["cosmos"]["skip_rotation_dims"] == [3, 4, 5, 6, 7, 8]


def test_only_global_and_env_gripper():
    data = cosmos_stats(gripper_lo=-1.0)
    del data["global_raw"]
    assert is_cosmos_stats(data) and not is_cosmos_stats({"format": "wamkit-stats/1", "global": {}})
    stats = stats_from_cosmos(data)
    assert stats["action"].q01[3] == -1.0 and "gripper" not in stats.metadata  # not NVIDIA's [0, 1] data


def test_bad_cosmos_stats_name_the_block():
    data = cosmos_stats()
    data["global_raw"]["q99"] = data["global_raw"]["q99"][:5]
    with pytest.raises(StatsError, match="global_raw: lists differ"):
        StatsFile.from_json(data, "x.json")
    data = cosmos_stats()
    data["metadata"]["action_dim"] = 7
    with pytest.raises(StatsError, match="action_dim=7"):
        StatsFile.from_json(data, "x.json")


def test_cosmos_stats_make_a_serving_spec_with_the_data_gripper(tmp_path):
    """Actions-only stats (Cosmos3 takes no state) give a spec whose state passes through, and whose
    decoded gripper is the env's command for NVIDIA's [0, 1] data."""
    import numpy as np

    from wamkit.models.base import ModelIO

    from .conftest import spec_of

    path = tmp_path / "stats.json"
    path.write_text(json.dumps(cosmos_stats()))
    io = ModelIO(("image", "wrist_image"), 64, 8, 10, 16, "libero_rot6d")
    spec = spec_of(StatsFile.load(path), io)
    assert spec.gripper == "open_1" and spec.stats.metadata["state_stats"] == "identity"
    state = np.linspace(-0.5, 0.5, 8)
    np.testing.assert_allclose(spec.encode_state(state), state, atol=1e-7)
    model_out = np.zeros((16, 10), np.float32)
    model_out[:, 9] = 1.0  # normalised 1 = q99 = 1.0 = "open" in the data
    assert (spec.decode_actions(model_out)[:, 6] == -1.0).all()
