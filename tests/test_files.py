"""The bottom layer's crash protocols: whole files, whole directories, JSONL journals."""

from __future__ import annotations

import json

import pytest

from wamkit.files import (
    JournalError,
    append_jsonl_path,
    atomic_write_json,
    atomic_write_with,
    commit_dir,
    fresh_tmp_dir,
    read_jsonl,
    rewrite_jsonl,
)


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = atomic_write_json(tmp_path / "a.json", {"v": 1})

    def broken(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_write_with(path, broken)
    assert json.loads(path.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_torn_last_line_is_dropped_and_repaired_but_a_bad_middle_line_is_an_error(tmp_path):
    path = tmp_path / "j.jsonl"
    for i in range(3):
        append_jsonl_path(path, {"i": i})
    with open(path, "a") as fh:
        fh.write('{"i": 3, "cut')  # a write cut short by a kill
    assert [r["i"] for r in read_jsonl(path)] == [0, 1, 2]
    assert path.read_text().endswith('"cut')  # reading alone changes nothing
    read_jsonl(path, repair=True)
    append_jsonl_path(path, {"i": 4})
    assert [r["i"] for r in read_jsonl(path)] == [0, 1, 2, 4]
    rewrite_jsonl(path, [{"i": 0}])
    assert read_jsonl(path) == [{"i": 0}]
    path.write_text('{"i": 0}\nnot json\n{"i": 2}\n')
    with pytest.raises(JournalError, match="line 2"):
        read_jsonl(path)


def test_a_directory_is_replaced_only_when_the_new_one_is_whole(tmp_path):
    out = tmp_path / "serve"
    tmp = fresh_tmp_dir(out)
    (tmp / "model.json").write_text("old")
    commit_dir(tmp, out)
    tmp = fresh_tmp_dir(out)
    (tmp / "model.json").write_text("new")
    with pytest.raises(FileExistsError, match="--overwrite"):
        commit_dir(tmp, out)
    assert (out / "model.json").read_text() == "old" and tmp.is_dir()
    commit_dir(tmp, out, overwrite=True)
    assert (out / "model.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serve"]
