"""Every error the package raises for bad input reaches the user as one line naming what to change:
the ``wamkit`` command prints a :class:`~wamkit.config.UserError` as ``wamkit CMD: message`` with no
traceback. Each class is walked through the command's handler, and the common ones are triggered as a
user types them (the server's refusal and the execution's are in tests/test_serve_cli_errors.py and
tests/test_eval_execution.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit import cli
from wamkit.config import UserError

# the modules that define the package's UserError classes: the walk below fails on a class outside them
MODULES = (
    "wamkit.config", "wamkit.actions.stats", "wamkit.actions.spec", "wamkit.serve.client",
    "wamkit.serve.server", "wamkit.models.pretrained", "wamkit.models.cosmos3.latents",
    "wamkit.models.cosmos3.text_kv", "wamkit.data.meta", "wamkit.eval.execution", "wamkit.eval.backends.base",
)  # fmt: skip


def _classes() -> list[type[UserError]]:
    for name in MODULES:
        importlib.import_module(name)
    seen, todo = [], [UserError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("wamkit.") and sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def test_the_walk_finds_every_user_error_class():
    names = {c.__name__ for c in _classes()}
    assert {"ConfigError", "DatasetError", "ServerError", "ExecutionError", "ModelFileError"} <= names
    assert all(c.__module__ in MODULES for c in _classes()), [
        c for c in _classes() if c.__module__ not in MODULES
    ]


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_each_user_error_is_printed_in_one_line(cls, monkeypatch, capsys):
    message = f"{cls.__name__}: what was given, and what was expected instead"
    try:
        err = cls(message)
    except TypeError:  # a class that builds its message from parts
        err = cls.__new__(cls)
        Exception.__init__(err, message)

    def main(args):
        raise err

    monkeypatch.setattr(cli._load("stats"), "main", main)
    code = cli.main(["stats", "somewhere"])
    out = capsys.readouterr()
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wamkit stats: ") and message in lines[0], out.err
    assert "Traceback" not in out.err


def _wamkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "wamkit"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["train", "train.max_stepz=5"],
         "wamkit train: config error: command line: unknown key 'train.max_stepz'; did you mean 'train.max_steps'?"),
        (["train", "data.root=ds", "model.name=tiny"], "wamkit train: ds/meta/info.json: missing key 'fps'"),
        (["serve", "srv"], "wamkit serve: config error: serving directory srv lacks model.safetensors"),
        (["convert", "srv", "--out", "o"], "wamkit convert: srv: not a DCP checkpoint (no .metadata)"),
    ],
)  # fmt: skip
def test_bad_input_as_typed_ends_in_one_line(tmp_path, args, line):
    (tmp_path / "ds" / "meta").mkdir(parents=True)
    (tmp_path / "ds" / "meta" / "info.json").write_text("{}")
    (tmp_path / "srv").mkdir()
    run = _wamkit(*args, cwd=tmp_path)
    assert run.returncode != 0
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), run.stderr[-2000:]
