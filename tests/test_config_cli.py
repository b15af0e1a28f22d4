"""Configs (presets, dotted overrides, errors that name the key) and the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from wamkit.cli import COMMANDS, main
from wamkit.config import ConfigError, RunConfig, load_config, save_config

from .conftest import REPO


def test_preset_plus_overrides(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("train:\n  max_steps: 50\n  lr: 1.0e-3\ndata:\n  root: /data/a\n")
    cfg = load_config(
        preset, ["train.max_steps=10", "data.root=/data/x", "env.tasks=reach-v3,push-v3", "train.lr=2"]
    )
    assert cfg.train.max_steps == 10 and cfg.data.root == "/data/x"
    assert cfg.env.tasks == ["reach-v3", "push-v3"]
    assert cfg.train.lr == 2.0 and isinstance(cfg.train.lr, float)  # ints widen to float
    assert cfg.serve.port == RunConfig().serve.port  # untouched defaults come from one place


def test_numbers_without_a_decimal_point_are_numbers(tmp_path):
    # YAML 1.1 reads 1e-3 (no dot) as the string "1e-3", in a file and on the command line alike
    preset = tmp_path / "p.yaml"
    preset.write_text("train:\n  lr: 3e-4\n")
    assert load_config(preset).train.lr == 3e-4
    assert load_config(preset, ["train.lr=1e-3"]).train.lr == 1e-3
    assert load_config(preset, ["train.lr=-2E+1"]).train.lr == -20.0
    with pytest.raises(ConfigError, match="train.lr: expected a number, got '1e-3x'"):
        load_config(preset, ["train.lr=1e-3x"])


def test_one_task_index_is_a_list_of_one(tmp_path):
    # env.tasks=4 (one LIBERO task by index) reads as the number 4 in YAML; it means the list ["4"]
    preset = tmp_path / "p.yaml"
    preset.write_text("env:\n  suite: libero_10\n")
    assert load_config(preset, ["env.tasks=4"]).env.tasks == ["4"]
    assert load_config(preset, ["env.tasks=4,5"]).env.tasks == ["4", "5"]
    with pytest.raises(ConfigError, match="env.tasks: expected a list of"):
        load_config(preset, ["env.tasks=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_step=10", "unknown key 'train.max_step'; did you mean 'train.max_steps'?"),
        ("trian.max_steps=10", "unknown key 'trian'; did you mean 'train'?"),
        ("train.max_steps=ten", "train.max_steps: expected an integer, got 'ten'"),
        ("train.max_steps=1.5", "train.max_steps: expected an integer"),
        ("train.ema=maybe", "train.ema: expected true or false"),
        (
            "train.schedule=linear",
            "train.schedule: 'linear' is not allowed; expected one of 'constant', 'lambda_linear', 'cosine'",
        ),
        ("train", "must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_bad_preset_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  nmae: tiny\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: unknown key 'model\.nmae'; did you mean 'model\.name'"
    ):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["eval.num_envs=8", "model.options={depth: 2}"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert yaml.safe_load(path.read_text())["eval"]["num_envs"] == 8
    assert load_config(path) == cfg


def test_every_preset_in_configs_is_valid():
    presets = sorted((REPO / "configs").glob("*.yaml"))
    assert presets, "configs/ holds no presets"
    for preset in presets:
        load_config(preset)


def test_cli_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_cli_entry_point_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "wamkit", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("wamkit ")


def test_log_records_go_to_the_stderr_of_the_moment(monkeypatch, capsys):
    # a command run in a process whose stderr changed after logging was set up (a test's capture, a
    # redirect) wrote to the old, closed stream: "--- Logging error ---" and a traceback
    import io
    import logging

    from wamkit.log import setup_logging

    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    setup_logging("info")
    monkeypatch.undo()
    old.close()
    logging.getLogger("wamkit.test").warning("after the stream changed")
    err = capsys.readouterr().err
    assert "after the stream changed" in err and "Logging error" not in err


def test_a_cosmos3_command_prints_no_import_chatter_of_optional_libraries():
    """With torchao installed (the LoRA int8 base), importing diffusers logs what torchao cannot load on
    this torch and diffusers' note on torchao tensors; a command shows them only at --log-level debug."""
    pytest.importorskip("torchao")
    cmd = [sys.executable, "-m", "wamkit", "train", "libero_10_cosmos3", "--plan", "--world-size", "1",
           "--device-memory", "141GB", "--host-memory", "128GB"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torchao" not in run.stderr and "_pytree" not in run.stderr, run.stderr[:2000]


@pytest.mark.parametrize(
    "argv",
    [
        ["collect", "env.max_steps=5", "--out", "X", "env.image_size=32"],
        ["train", "demo", "--resume", "auto", "train.seed=7"],
        ["bench", "lerobot-eval", "--policy", "P", "--trials", "2", "env.max_steps=5"],
    ],
)
def test_overrides_are_taken_before_or_after_a_commands_options(argv):
    """The dotted overrides of a command may follow its options: they join those before, in order."""
    from wamkit.cli import _command_in, build_parser, parse

    args = parse(build_parser(_command_in(argv), argv), argv)
    assert args.overrides == [t for t in argv if "=" in t]


def test_a_stray_word_after_the_options_is_refused_with_the_commands_usage(capsys):
    with pytest.raises(SystemExit):
        main(["collect", "env.max_steps=5", "--out", "X", "stray"])
    err = capsys.readouterr().err
    assert "usage: wamkit collect" in err and "unrecognized arguments: stray" in err


def test_train_without_a_dataset_names_data_root(tmp_path, capsys):
    """``wamkit train`` pointed at no dataset says which key to set, in one line."""
    assert main(["train", f"data.root={tmp_path / 'nothing'}", f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1].startswith("wamkit train: config error: data.root: ")
        and "holds no LeRobot dataset" in err[-1]
    )
