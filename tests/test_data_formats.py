"""LeRobot v2.1 read natively (the fixture lerobot 0.3.3 wrote), and v3 tasks tables as each writer
stores them (lerobot 0.4's unnamed pandas index, lerobot 0.6's index named ``task``)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wamkit.constants import ACTION, OBS_STATE
from wamkit.data import DatasetError, LeRobotDataset, compute_stats
from wamkit.data.meta import tasks_from_table

from .conftest import FIXTURES, REPO
from .test_data_fixture import CAMS, check_against_truth

V21 = FIXTURES / "libero_tiny_v21"
TASK_TABLES = REPO / "tests" / "fixtures" / "tasks_parquet"  # written by pandas 3.1.1 (see README there)


def truth_of(root) -> list[dict]:
    return [json.loads(line) for line in root.with_name(root.name + ".truth.jsonl").read_text().splitlines()]


def test_v21_fixture_reads_every_frame_exactly():
    ds = LeRobotDataset(V21)
    assert ds.meta.version == "v2.1"
    assert (len(ds), ds.num_episodes, ds.fps, ds.camera_keys) == (100, 4, 20, CAMS)
    check_against_truth(ds, truth_of(V21))
    ep = ds.meta.episodes[1]
    assert ep.data_file.name == "episode_000001.parquet" and ep.from_index == 24
    assert ep.videos[CAMS[0]][1:] == (0.0, ep.length / 20)


def test_v21_chunks_subsets_and_stats_match_v3_path():
    ds = LeRobotDataset(V21, delta_timestamps={ACTION: [k / 20 for k in range(16)]}, episodes=[2])
    truth = [t for t in truth_of(V21) if t["episode"] == 2]
    item = ds[len(truth) - 2]
    assert item["action_is_pad"].tolist() == [False] * 2 + [True] * 14
    assert np.array_equal(item[ACTION][1].numpy(), np.asarray(truth[-1]["action"], np.float32))
    stats = compute_stats(V21, "raw", chunk=4)
    states = np.asarray([t["state"] for t in truth_of(V21)], np.float64)
    assert stats[OBS_STATE].count == 100 and np.allclose(stats[OBS_STATE].mean, states.mean(0), atol=1e-6)


def test_v21_torn_or_missing_metadata_is_named(tmp_path):
    root = tmp_path / "v21"
    shutil.copytree(V21, root)
    path = root / "meta" / "episodes.jsonl"
    path.chmod(0o644)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    with pytest.raises(DatasetError, match=r"episodes.jsonl: line 4 is not valid JSON"):
        LeRobotDataset(root)
    path.write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(DatasetError, match="lists 3 episodes; meta/info.json total_episodes is 4"):
        LeRobotDataset(root)


@pytest.mark.parametrize(
    "table", ["lerobot04_unnamed_index.parquet", "lerobot06_named_index.parquet", "plain_columns"]
)
def test_v3_tasks_table_of_every_writer(tmp_path, libero_tiny, table):
    root = tmp_path / "ds"
    shutil.copytree(libero_tiny, root)
    target = root / "meta" / "tasks.parquet"
    target.chmod(0o644)
    if table == "plain_columns":  # no pandas metadata at all, as pyarrow alone writes it
        plain = pa.table({"task": ["open the top drawer of the cabinet", "put the black bowl on the plate"],
                          "task_index": [1, 0]})  # fmt: skip
        pq.write_table(plain, target)
    else:
        shutil.copyfile(TASK_TABLES / table, target)
    if table.startswith("lerobot04"):
        assert "__index_level_0__" in pq.read_schema(target).names  # the layout under test
    ds = LeRobotDataset(root)
    truth = truth_of(libero_tiny)
    assert ds.meta.tasks == {0: "put the black bowl on the plate", 1: "open the top drawer of the cabinet"}
    assert [ds[i]["task"] for i in range(0, 100, 9)] == [truth[i]["task"] for i in range(0, 100, 9)]


def test_tasks_table_without_text_is_refused(tmp_path):
    bad = pa.table({"task_index": [0], "name": ["x"]})
    with pytest.raises(
        DatasetError, match=r"tasks.parquet: no task text.*columns are \['task_index', 'name'\]"
    ):
        tasks_from_table(bad, tmp_path / "meta" / "tasks.parquet")
    unnamed = pa.table({"task_index": [0], "__index_level_0__": ["reach"]}).replace_schema_metadata(
        {"pandas": json.dumps({"index_columns": ["__index_level_0__"]})}
    )
    assert tasks_from_table(unnamed, tmp_path) == {0: "reach"}
