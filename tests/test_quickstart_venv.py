"""After `make demo`, the next command the quickstart shows works as written: `make` installs into
`.venv` without activating it, so the README, the quickstart and the demo's closing lines say
`source .venv/bin/activate`, and that puts `wamkit` on the PATH of a shell that had none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.demo import _print_next_steps, demo_config

from .conftest import REPO

BARE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a new user's shell: no venv on it


def test_activating_the_venv_puts_wamkit_on_path():
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the checkout (make setup creates it)")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": BARE_PATH}
    bare = subprocess.run(["bash", "-c", "command -v wamkit"], env=env, cwd=REPO, capture_output=True)
    assert bare.returncode != 0  # the situation the issue describes: "command not found"
    script = "source .venv/bin/activate && command -v wamkit && wamkit runs --help"
    run = subprocess.run(["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[0] == str(REPO / ".venv" / "bin" / "wamkit")


def test_demo_closing_lines_say_how_to_reach_wamkit(monkeypatch, capsys):
    cfg = demo_config(None, [], Path("runs/demo"))
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PATH", BARE_PATH)
    _print_next_steps(cfg)
    out = capsys.readouterr().out
    if (REPO / ".venv").resolve() == Path(sys.prefix).resolve():
        assert "source .venv/bin/activate" in out
    assert "wamkit runs runs/demo/train" in out and "wamkit serve runs/demo/serve --port 8000" in out
    monkeypatch.setenv("PATH", str(REPO / ".venv" / "bin") + os.pathsep + BARE_PATH)
    _print_next_steps(cfg)
    assert "source" not in capsys.readouterr().out  # already on the PATH: nothing to activate
