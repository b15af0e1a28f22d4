"""The docs stay true: every shell command in README.md and docs/ is checked.

Each command in a ```bash block is one of:
- marked as needing a GPU or real weights (a ``<!-- needs: ... -->`` line before the block): it must
  still parse with the real CLI (a command or option that no longer exists fails);
- covered by a named test (``<!-- tested-by: tests/test_x.py::test_name -->`` before the block): the
  command must parse and the named test must exist;
- otherwise it is run here in a small form: ``<!-- small: ARGS -->`` before the block appends ARGS to
  each wamkit command of the block (e.g. dotted overrides that shrink the run); blocks run in order per
  page, in one scratch folder that holds a copy of configs/.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from wamkit.cli import build_parser

from .child_env import run_shell_block
from .conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "maintainers" / "README.md"]
MARK = re.compile(r"<!--\s*(needs|tested-by|small):\s*(.*?)\s*-->")


@dataclass
class Block:
    page: Path
    line: int
    commands: list[str]
    marks: dict[str, str]


def _blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, marks, i = [], {}, 0
    while i < len(lines):
        m = MARK.search(lines[i])
        if m:
            marks[m.group(1)] = m.group(2)
        elif lines[i].strip() in ("```bash", "```sh", "```console"):
            start, cmds, buf = i + 1, [], ""
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                text = lines[i].split(" #")[0].rstrip() if not lines[i].lstrip().startswith("#") else ""
                buf += text.rstrip("\\") + " " if text.endswith("\\") else text
                if not text.endswith("\\") and buf.strip():
                    cmds.append(buf.strip().removeprefix("$ "))
                    buf = ""
                i += 1
            blocks.append(Block(page, start, cmds, marks))
            marks = {}
        elif lines[i].strip():
            marks = {} if not lines[i].startswith("<!--") else marks
        i += 1
    return blocks


ALL = [b for p in PAGES for b in _blocks(p)]


def _wamkit_argv(cmd: str) -> list[str] | None:
    """The argv after ``wamkit`` (or ``python -m wamkit`` / ``torchrun ... -m wamkit``), else None."""
    argv = shlex.split(cmd)
    if argv and argv[0] == "wamkit":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1 : argv.index("-m") + 2] == ["wamkit"]:
        return argv[argv.index("-m") + 2 :]
    return None


ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _check_parses(cmd: str, where: str) -> None:
    cmd = cmd.removesuffix("&").strip()  # a trailing `&` only backgrounds the command
    words = cmd.split()
    while words and (ASSIGNMENT.match(words[0]) or words[0] == "time"):
        words = words[1:]  # `VAR=value cmd` and `time cmd` run cmd: it is checked as written after them
    if not words or words[0] in ("kill", "cd", "export", "ray", "tensorboard", "cat", "ls"):
        return  # shell glue around the commands under test
    cmd = " ".join(words)
    if words[0] in ("bash", "python", "python3") and not words[1].startswith("-"):
        assert (REPO / words[1]).is_file(), f"{where}: `{cmd}`: {words[1]} is not a file of the repository"
    argv = _wamkit_argv(cmd)
    if argv is not None:
        parser = build_parser(next((a for a in argv if not a.startswith("-")), None), argv)
        try:
            parser.parse_args(argv)
        except SystemExit as err:
            if err.code != 0:
                pytest.fail(f"{where}: `{cmd}` does not parse with the wamkit CLI")
        return
    first = shlex.split(cmd)[0]
    if first == "make":
        for target in shlex.split(cmd)[1:]:
            if "=" in target:
                continue
            ok = subprocess.run(["make", "-n", "-C", str(REPO), target], capture_output=True, text=True)
            assert ok.returncode == 0, f"{where}: `{cmd}`: the Makefile has no target {target!r}"


def test_docs_exist():
    names = {p.name for p in PAGES}
    for page in [
        "quickstart.md",
        "collect.md",
        "data.md",
        "train.md",
        "convert.md",
        "serve.md",
        "infer.md",
        "eval.md",
        "benchmarks.md",
    ]:
        assert page in names, f"docs/{page} is missing"


@pytest.mark.parametrize("block", ALL, ids=[f"{b.page.name}:{b.line}" for b in ALL])
def test_every_command_parses_or_names_its_test(block: Block):
    where = f"{block.page.relative_to(REPO)}:{block.line}"
    for cmd in block.commands:
        _check_parses(cmd, where)
    if "tested-by" in block.marks:
        path, _, name = block.marks["tested-by"].partition("::")
        text = (REPO / path).read_text() if (REPO / path).is_file() else ""
        assert f"def {name}(" in text, (
            f"{where}: tested-by names {block.marks['tested-by']}, which does not exist"
        )


RUNNABLE = {}
for b in ALL:
    if "needs" in b.marks or "tested-by" in b.marks or b.page.name == "README.md":
        continue
    RUNNABLE.setdefault(b.page, []).append(b)


@pytest.mark.slow
@pytest.mark.parametrize("page", list(RUNNABLE), ids=[p.name for p in RUNNABLE])
def test_page_commands_run_in_small_form(page: Path, tmp_path: Path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    shutil.copytree(REPO / "tests" / "fixtures", tmp_path / "tests" / "fixtures")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for block in RUNNABLE[page]:
        lines = []
        for cmd in block.commands:
            small = (
                block.marks.get("small", "")
                if _wamkit_argv(cmd.removesuffix("&").strip()) is not None
                else ""
            )
            if cmd.startswith("make "):  # make targets belong to the checkout, not the scratch folder
                cmd = f"make -C {shlex.quote(str(REPO))} {cmd[5:]}"
            lines.append(f"{cmd} {small}" if not cmd.endswith("&") else f"{cmd[:-1].strip()} {small} &")
        script = "\n".join(lines)
        out = run_shell_block(script, tmp_path, env, timeout=900)
        assert out.returncode == 0, f"{page.name}:{block.line}: block failed:\n{script}\n{out.stderr[-3000:]}"


def test_marks_are_known():
    for page in PAGES:
        for m in re.finditer(r"<!--\s*([a-z-]+):", page.read_text()):
            assert m.group(1) in ("needs", "tested-by", "small"), f"{page.name}: unknown mark {m.group(1)!r}"


def test_parser_rejects_a_removed_command():
    """The check above can fail: a command that does not exist does not parse."""
    with pytest.raises(SystemExit):
        build_parser("frobnicate", ["frobnicate"]).parse_args(["frobnicate"])
    assert isinstance(build_parser(), argparse.ArgumentParser)
    # behind an environment variable or `time`, a command is still checked
    for cmd in ("CUDA_VISIBLE_DEVICES=0 wamkit bench cosmos3 --no-such-flag", "time wamkit frobnicate"):
        with pytest.raises(pytest.fail.Exception, match="does not parse"):
            _check_parses(cmd, "here")
    with pytest.raises(AssertionError, match="not a file of the repository"):
        _check_parses("bash maintainers/no_such_script.sh", "here")
