"""``wamkit serve`` refusing what it cannot serve, as typed: one line naming what to change."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["serve.max_message_mb=1", "--random-init"],
         "wamkit serve: config error: serve.max_message_mb=1: wamkit serve takes a serving directory here, "
         "and settings as --set serve.max_message_mb=1"),
        (["somewhere", "--random-init"], "wamkit serve: config error: give either EXPORT_DIR or --random-init, not both"),
    ],
)  # fmt: skip
def test_a_setting_given_where_the_directory_goes_is_named(tmp_path, args, line):
    run = subprocess.run(
        [str(Path(sys.executable).parent / "wamkit"), "serve", *args],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [line]
