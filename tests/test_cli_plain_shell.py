"""The commands as a user types them: the venv's ``wamkit`` in a subprocess, from a shell with no
display and no ``MUJOCO_GL`` (the README's activated shell), in a working directory outside the checkout.
Each command sets up its own headless rendering, and each mistake ends in one line that names the file,
key or URL, with no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.child_env import start_logged, user_shell_env, wait_for_log

WAMKIT = Path(sys.executable).parent / "wamkit"


def wamkit(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = user_shell_env()
    return subprocess.run(
        [str(WAMKIT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_line_error(run: subprocess.CompletedProcess, command: str) -> str:
    """The refusal's single stderr line (``wamkit COMMAND: ...``); fails on a traceback."""
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith(f"wamkit {command}: ")]
    assert len(lines) == 1, run.stderr
    return lines[0]


@pytest.fixture(scope="module")
def metaworld_data(tmp_path_factory) -> Path:
    """Two tasks of two episodes each, collected from a plain shell (the journal lists a task's
    episodes together)."""
    root = tmp_path_factory.mktemp("plain")
    args = ["--suite", "metaworld", "--tasks", "reach-v3,button-press-topdown-v3", "--episodes", "2"]
    run = wamkit("collect", *args, "--workers", "1", "--image-size", "32", "--out", "data", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "data"


def _start_server(args: list[str], cwd: Path, env: dict[str, str]):
    """``wamkit serve ARGS`` started as a user starts it, its log in ``cwd/serve.log``; ``(process,
    port)`` once it says its port."""
    log = cwd / "serve.log"
    proc = start_logged([str(WAMKIT), *args], log, cwd=cwd, env=env)
    port = int(wait_for_log(proc, log, r"serving tiny on ws://127\.0\.0\.1:(\d+)", timeout=120).group(1))
    return proc, port


def test_check_renders_metaworld_from_a_shell_without_gl_settings(metaworld_data, tmp_path):
    # --trials 1: the journal's first two episodes are one task's; the checker takes one of each task
    run = wamkit("check", str(metaworld_data), "--suite", "metaworld", "--trials", "1", "--replay", "1",
                 cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "2 env resets over 2 task(s)" in run.stdout, run.stdout
    assert "image: corner: frames are oriented as the env's (2 same episode(s)" in run.stdout, run.stdout


@pytest.mark.slow
def test_check_pins_renders_from_a_shell_without_gl_settings(tmp_path):
    run = wamkit("check", "--pins", "metaworld", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "reproduces every drift pin" in run.stdout


def test_a_missing_dataset_is_one_line_in_every_command_and_train_leaves_no_run(tmp_path):
    missing = tmp_path / "nope"
    said = wamkit("train", "configs/demo.yaml", f"data.root={missing}", "train.run_dir=run", cwd=tmp_path)
    assert f"config error: data.root: {missing} holds no LeRobot dataset" in one_line_error(said, "train")
    assert not (tmp_path / "run").exists()  # no config.yaml and train.log of a run that never was
    said = wamkit("check", str(missing), "--suite", "metaworld", cwd=tmp_path)
    assert f"{missing}/meta/info.json: file is missing" in one_line_error(said, "check")


def test_debug_logging_shows_the_traceback(tmp_path):
    run = wamkit(
        "--log-level", "debug", "check", str(tmp_path / "nope"), "--suite", "metaworld", cwd=tmp_path
    )
    assert run.returncode == 2 and "Traceback" in run.stderr and "DatasetError" in run.stderr


def test_a_config_mistake_names_where_it_was_made(tmp_path, metaworld_data):
    said = one_line_error(wamkit("train", "configs/demo.yaml", "train.max_step=2", cwd=tmp_path), "train")
    assert "config error: command line: unknown key 'train.max_step'; did you mean 'train.max_steps'?" in said
    preset = tmp_path / "mine.yaml"
    preset.write_text("train:\n  max_step: 2\n")
    said = one_line_error(wamkit("train", str(preset), "train.lr=0.1", cwd=tmp_path), "train")
    assert f"config error: {preset}: unknown key 'train.max_step'" in said
    # a model option is refused before the stats are computed or a run folder is made
    args = [f"data.root={metaworld_data}", "train.run_dir=run", "model.options.hiden=3"]
    run = wamkit("train", "configs/demo.yaml", *args, cwd=tmp_path)
    assert "unknown key 'model.options.hiden'" in one_line_error(run, "train")
    assert "computing stats" not in run.stderr and not (tmp_path / "run").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _eval_without_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    url = f"ws://127.0.0.1:{_free_port()}"
    env = user_shell_env()
    args = [str(WAMKIT), "eval", "configs/demo.yaml", f"eval.server_url={url}", "eval.out_dir=ev"]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    return proc, url


def test_an_evaluation_says_it_waits_for_its_server(tmp_path):
    proc, url = _eval_without_server(tmp_path)
    try:
        deadline, lines = time.monotonic() + 25, []
        while time.monotonic() < deadline:  # long before the connect timeout (30 s) runs out
            lines.append(proc.stderr.readline())
            if f"waiting for a server at {url}" in lines[-1]:
                break
        assert f"waiting for a server at {url}" in lines[-1] and "giving up in" in lines[-1], lines
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.mark.slow
def test_an_evaluation_without_its_server_ends_in_one_line(tmp_path):
    proc, url = _eval_without_server(tmp_path)
    _, err = proc.communicate(timeout=120)
    said = one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, "", err), "eval")
    assert f"cannot connect to {url} after" in said and "wamkit serve" in said


def test_a_random_init_server_takes_the_shape_of_the_suite(tmp_path):
    """``serve --random-init --suite libero_10``: LIBERO's two cameras, 8-D state and 7-D env action, so
    its evaluation runs on a CPU with no training first (MetaWorld's shapes were served before)."""
    import numpy as np

    from wamkit.serve.client import PolicyClient

    env = user_shell_env()
    args = ["serve", "--model", "tiny", "--preset", "small", "--random-init", "--suite", "libero_10"]
    args += ["--set", "env.image_size=64", "--option", "num_steps=2", "--port", "0", "--device", "cpu"]
    proc, port = _start_server(args, tmp_path, env)
    try:
        with PolicyClient(f"127.0.0.1:{port}", connect_timeout_s=20) as client:
            inputs = client.metadata["inputs"]
            assert inputs["cameras"] == ["agentview", "wrist"] and inputs["state_dim"] == 8
            assert inputs["image_size"] == 64 and client.metadata["action_space"]["dim"] == 7
            obs = {k: np.zeros((64, 64, 3), np.uint8) for k in inputs["image_keys"]}
            obs |= {inputs["state_key"]: np.zeros(8, np.float32), inputs["prompt_key"]: "put the bowl away"}
            assert client.infer(obs)["actions"].shape == (client.metadata["chunk"], 7)
    finally:
        proc.kill()
        proc.wait()
    said = one_line_error(wamkit(*args[:6], "--suite", "libero_11", cwd=tmp_path), "serve")
    assert "--suite: unknown suite 'libero_11'" in said


def test_train_ends_with_a_summary_and_a_next_command_that_runs(metaworld_data, tmp_path):
    """The run's last words: steps, the final losses (the mean of the last log interval, as
    losses.jsonl holds them), the checkpoint and the convert command, which runs as printed. Its stderr
    is a pipe: the progress bar writes whole lines there, and the CPU plan counts in M and MiB."""
    import json
    import shlex

    args = [f"data.root={metaworld_data}", "train.run_dir=run", "env.image_size=32", "train.max_steps=4"]
    args += ["train.save_interval=4", "train.log_interval=2", "train.micro_batch=4", "train.global_batch=4"]
    run = wamkit("train", "configs/demo.yaml", *args, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "losses.jsonl").read_text().splitlines()]
    mean = sum(r["loss"] for r in records[2:]) / 2
    out = run.stdout.splitlines()
    assert out[0].startswith("trained tiny: 4 steps to step 4 in "), run.stdout
    assert out[1].startswith(f"  final losses (mean of steps 3-4): loss {mean:.4f}, "), run.stdout
    assert out[2] == "  checkpoint: run/checkpoints/step_000004", run.stdout
    assert out[3] == "  next: wamkit convert run/checkpoints/step_000004 --out run/serve", run.stdout
    converted = wamkit(*shlex.split(out[3].split("next: wamkit ", 1)[1]), cwd=tmp_path)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert (tmp_path / "run" / "serve" / "model.safetensors").is_file()

    assert "\r" not in run.stderr  # line-wise, not one line of carriage returns
    bar = [line for line in run.stderr.splitlines() if line.startswith("train: ")]
    assert bar and bar[-1].startswith("train: 100%") and "4/4" in bar[-1], run.stderr
    plan = run.stderr.split("memory plan: ", 1)[1]
    assert "M parameters (0.00M frozen, " in plan.splitlines()[0] and "0.000B" not in plan, plan
    assert "MiB/process" in plan and "  optimizer moments" in plan
    moments = float(plan.split("  optimizer moments")[1].split()[0])
    assert moments > 1  # MiB of a 1-2M parameter model's Adam moments, not a 0.00 GiB


def test_an_evaluation_at_another_image_size_than_its_model_warns_once(tmp_path):
    """A model taking 32 px images evaluated on 64 px renders runs (the server resizes) and says so,
    once, not per pipeline stage or per connection."""
    env = user_shell_env()
    args = ["serve", "--model", "tiny", "--preset", "small", "--random-init", "--suite", "metaworld"]
    args += ["--set", "env.state=proprio", "--set", "env.image_size=32", "--option", "num_steps=2"]
    args += ["--port", "0", "--device", "cpu"]
    proc, port = _start_server(args, tmp_path, env)
    try:
        overrides = ["env.tasks=[reach-v3]", "env.image_size=64", "env.max_steps=8", "eval.trials=2"]
        overrides += ["eval.num_envs=2", "eval.workers=1", "eval.pipeline_stages=2", "eval.videos=0"]
        overrides += ["eval.calibrate_s=1", f"eval.server_url=ws://127.0.0.1:{port}", "eval.out_dir=ev"]
        run = wamkit("eval", "configs/demo.yaml", *overrides, cwd=tmp_path)
    finally:
        proc.kill()
        proc.wait()
    assert run.returncode == 0, run.stderr[-3000:]
    said = [line for line in run.stderr.splitlines() if "env.image_size=64: the model served at" in line]
    assert len(said) == 1, run.stderr
    assert "takes 32 px images" in said[0] and "set env.image_size=32" in said[0]


def test_serve_refuses_a_bad_serving_directory_or_a_taken_port_in_one_line(tmp_path):
    """Each is one line naming the directory, the file or the address, before anything is built."""
    said = one_line_error(wamkit("serve", "typo/dir", "--port", "0", cwd=tmp_path), "serve")
    assert "serving directory typo/dir does not exist" in said
    half = tmp_path / "half"
    half.mkdir()
    (half / "model.json").write_text("{}")
    said = one_line_error(wamkit("serve", "half", "--port", "0", cwd=tmp_path), "serve")
    assert (
        "serving directory half lacks model.safetensors, preprocess.json" in said and "wamkit convert" in said
    )
    for name in ("model.safetensors", "preprocess.json"):
        (half / name).write_bytes(b"")
    for extra in ([], ["--plan"]):  # the serving plan reads model.json too
        said = one_line_error(wamkit("serve", "half", *extra, "--port", "0", cwd=tmp_path), "serve")
        assert 'half/model.json: expected a JSON object with "format": "wamkit-model"' in said
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = wamkit("serve", "--model", "delay", "--random-init", "--port", str(port), cwd=tmp_path)
    said = one_line_error(run, "serve")
    assert f"cannot listen on 127.0.0.1:{port}" in said and "--port 0 picks a free one" in said


def test_an_engine_backend_without_its_settings_is_one_line(tmp_path):
    """A backend's settings (eval.backend_options, the URL's scheme) are the user's to fix: one line
    naming the backend, the URL and the key, not a traceback."""
    args = ["eval", "configs/demo.yaml", "eval.backend=sglang", "eval.out_dir=ev"]
    said = one_line_error(
        wamkit(*args, "eval.server_url=http://127.0.0.1:9", "--no-progress", cwd=tmp_path), "eval"
    )
    assert "eval.backend=sglang at http://127.0.0.1:9: eval.backend_options.serving_dir: give" in said
    opts = [
        "eval.server_url=ws://127.0.0.1:9",
        "eval.backend=openpi",
        "eval.backend_options.connections=abc",
    ]
    said = one_line_error(wamkit(*args, *opts, "--no-progress", cwd=tmp_path), "eval")
    assert "eval.backend_options.connections='abc'; expected an integer >= 1" in said


def test_a_stats_file_that_does_not_fit_the_run_is_one_line_naming_it(tmp_path):
    """LeRobot's own stats file, or wamkit's of another action representation, given as data.stats:
    one line naming the file given (not the run's copy of it), and no run folder left."""
    fixture = Path(__file__).parent / "fixtures" / "libero_tiny"
    base = ["train", "configs/demo.yaml", f"data.root={fixture}", "train.run_dir=run"]
    said = one_line_error(wamkit(*base, f"data.stats={fixture}/meta/stats.json", cwd=tmp_path), "train")
    assert f"{fixture}/meta/stats.json: 'format' is None, expected 'wamkit-stats/1'" in said
    assert wamkit("stats", str(fixture), "--out", "raw.json", cwd=tmp_path).returncode == 0
    run = wamkit(*base, "data.stats=raw.json", "data.representation=libero_rot6d", cwd=tmp_path)
    said = one_line_error(run, "train")
    assert "raw.json: metadata representation='raw' but this run has representation='libero_rot6d'" in said
    assert not (tmp_path / "run").exists()
