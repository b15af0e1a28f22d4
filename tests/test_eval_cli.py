"""``wamkit eval`` as a user runs it: a serving directory on disk, a local server the evaluator starts
in its own process, the exit codes and messages of bad input, ``--resume``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit.config import ConfigError, EvalConfig, ModelConfig, ServeConfig
from wamkit.eval.runner import reach_servers
from wamkit.models import build_model
from wamkit.models.pretrained import save_pretrained
from wamkit.serve.client import PolicyClient
from wamkit.serve.loading import identity_spec

from .child_env import user_shell_env


@pytest.fixture(scope="module")
def serve_dir(tmp_path_factory):
    """A serving directory of the delay benchmark model (weights, model.json, identity spec)."""
    out = tmp_path_factory.mktemp("serve")
    adapter = build_model(ModelConfig(name="delay", preset="metaworld", options={"delay_ms": 2.0}))
    save_pretrained(adapter, out)
    identity_spec(adapter.io).save(out / "preprocess.json")
    return out


def wamkit(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``wamkit eval ARGS`` as typed in the README's activated shell: the venv's ``wamkit``, no rendering
    variables (the evaluator sets up headless rendering itself), run from ``cwd``, not the checkout."""
    env = user_shell_env()
    cmd = [str(Path(sys.executable).parent / "wamkit"), "eval", *args, "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_eval_cli_with_a_local_server_and_resume(serve_dir, tmp_path):
    out = tmp_path / "eval"
    args = [
        f"eval.serve_dir={serve_dir}",
        f"eval.out_dir={out}",
        "env.tasks=reach-v3",
        "env.image_size=64",
        "env.max_steps=8",
        "eval.trials=2",
        "eval.num_envs=2",
        "eval.workers=1",
        "eval.videos=0",
    ]
    run = wamkit(*args, "--pipeline", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "| metaworld | reach-v3 | 2 |" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["throughput"]["stages"] == 2 and summary["all"]["episodes"] == 2
    server = json.loads((out / "plan.json").read_text())["server"]
    assert server["serve_dir"] == str(serve_dir.resolve()) and server["identity"]["model"] == "delay"
    server_log = (out / "server.log").read_text()  # the server's start: what, its hashes, its batching
    assert "serving delay (built in" in server_log and "weights sha256" in server_log
    assert "serving delay on ws://127.0.0.1:" in server_log and "max_batch=" in server_log

    again = wamkit(*args, cwd=tmp_path)  # results exist: refuse rather than overwrite or count twice
    assert again.returncode == 2 and "--resume" in again.stderr
    journal = (out / "episodes.jsonl").read_text()
    resumed = wamkit(*args, "--resume", cwd=tmp_path)  # nothing missing: no episode runs
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "episodes.jsonl").read_text() == journal
    assert json.loads((out / "summary.json").read_text())["all"] == summary["all"]


def test_eval_cli_errors_name_the_keys(serve_dir, tmp_path):
    bad = wamkit(
        f"eval.serve_dir={serve_dir}",
        f"eval.out_dir={tmp_path}",
        "eval.num_envs=3",
        "--pipeline",
        "2",
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert "eval.num_envs=3 is not divisible by eval.pipeline_stages=2" in bad.stderr
    nodir = wamkit(f"eval.serve_dir={tmp_path / 'missing'}", f"eval.out_dir={tmp_path}", cwd=tmp_path)
    assert nodir.returncode == 2 and "eval.serve_dir" in nodir.stderr
    pipe = wamkit(f"eval.serve_dir={serve_dir}", "--pipeline", "fast", cwd=tmp_path)
    assert pipe.returncode == 2 and "--pipeline" in pipe.stderr
    # the run's serve settings reach the server it starts: bf16 autocast on this CPU-only machine is
    # refused by that server, naming the key
    bf16 = wamkit(
        f"eval.serve_dir={serve_dir}",
        f"eval.out_dir={tmp_path / 'bf16'}",
        "serve.precision=bf16",
        cwd=tmp_path,
    )
    assert bf16.returncode != 0
    assert "serve.precision=bf16 needs the model on a CUDA device" in bf16.stderr


def test_a_model_from_other_data_is_refused_before_any_episode():
    from wamkit.config import ConfigError
    from wamkit.envs import suite_info
    from wamkit.eval.backends.wamkit import check_spec_fits

    mw = suite_info("metaworld")
    spec = {
        "fps": mw.fps,
        "state_dim": mw.state_dim,
        "env_action_dim": mw.action_dim,
        "render_quality": "fast",
    }
    check_spec_fits(spec, mw, "ws://x", "fast")  # fits
    with pytest.raises(ConfigError, match=r"fps: model 20, env 80"):
        check_spec_fits({**spec, "fps": 20}, mw, "ws://x", "fast")
    with pytest.raises(ConfigError, match=r"render_quality: model 'fast', env 'default'"):
        check_spec_fits(spec, mw, "ws://x", "default")
    check_spec_fits({**spec, "render_quality": None}, mw, "ws://x", "default")  # unrecorded: not checked
    # trained on the full 39-D state, evaluated with env.state=proprio: the suite is right, env.state is not
    proprio = suite_info("metaworld", "proprio")
    with pytest.raises(ConfigError, match=r"state_dim: model 39, env 4\); the suite is right, its state is not: "
                       r"set env.state=full"):  # fmt: skip
        check_spec_fits(spec, proprio, "ws://x", "fast")
    with pytest.raises(ConfigError, match=r"set env.state=proprio"):
        check_spec_fits({**spec, "state_dim": 4}, mw, "ws://x", "fast")
    with pytest.raises(
        ConfigError, match=r"state_dim: model 14, env 39\); evaluate it on the suite its data came"
    ):
        check_spec_fits({**spec, "state_dim": 14}, mw, "ws://x", "fast")


def test_the_server_an_evaluation_starts_gets_the_runs_whole_serve_section(serve_dir, tmp_path):
    """Settings beyond device, precision and batching reach the child `wamkit serve`: its metadata
    reports the run's max_batch and message limit (the limit was dropped before)."""
    serve = ServeConfig(device="cpu", max_batch=3, max_wait_ms=7.0, max_message_mb=1.5, warm="none")
    ecfg = EvalConfig(serve_dir=str(serve_dir), out_dir=str(tmp_path))
    with reach_servers(ecfg, serve) as urls, PolicyClient(urls[0]) as client:
        assert client.metadata["max_batch"] == 3
        assert client.metadata["max_message_bytes"] == int(1.5 * 2**20)
    log = (tmp_path / "server.log").read_text()
    assert "serve.max_message_mb" not in log  # accepted as an override, not refused

    raw = ServeConfig(device="cpu", raw_actions=True)
    with pytest.raises(ConfigError, match="serve.raw_actions"), reach_servers(ecfg, raw):
        pass
