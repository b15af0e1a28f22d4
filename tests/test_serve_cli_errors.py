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


def test_an_evaluation_whose_server_refuses_its_requests_ends_in_one_line(tmp_path):
    """A server whose message limit is below one request's size: ``wamkit eval`` as typed ends with the
    server's refusal in one line naming the server, no traceback."""
    from .child_env import served_tiny, user_shell_env

    wamkit = str(Path(sys.executable).parent / "wamkit")
    with served_tiny(tmp_path, "--max-message-mb", "0.01") as url:
        run = subprocess.run(
            [wamkit, "eval", f"eval.server_url={url}", "eval.trials=1", "eval.num_envs=1", "--pipeline", "1",
             "env.max_steps=5", "eval.videos=0", f"eval.out_dir={tmp_path / 'e'}", "--no-progress"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=user_shell_env(),
        )  # fmt: skip
    assert run.returncode != 0
    errors = [ln for ln in run.stderr.splitlines() if ln.startswith("wamkit eval:") or "Traceback" in ln]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert errors[0].startswith(f"wamkit eval: the server at {url} answered: decode error: message of ")
    assert "exceeds serve.max_message_mb" in errors[0]
