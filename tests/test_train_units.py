"""The trainer's parts: schedule, optimizer groups, power EMA, checkpoint discovery, loss log, frozen
parameters, non-finite detection, and ``wamkit runs`` (in one process; the FSDP group is of size one)."""

from __future__ import annotations

import argparse
import json
import math
import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.test_train_support import ToyAdapter, ToyLoader, toy_adapter, toy_data
from wamkit.config import ConfigError, load_config
from wamkit.models.base import ParamGroup
from wamkit.train import NonFiniteLoss, train
from wamkit.train import checkpoint as ckpt
from wamkit.train.cli_runs import main as runs_main
from wamkit.train.cli_runs import read_scalars
from wamkit.train.memory import accumulation_steps
from wamkit.train.metrics import read_losses, truncate_losses
from wamkit.train.optim import PowerEMA, build_optimizer, lr_factor


def _cfg(tmp_path, *more):
    base = [f"train.run_dir={tmp_path / 'run'}", "train.micro_batch=4", "train.global_batch=4"]
    return load_config(None, [*base, "train.warmup_steps=2", "train.log_interval=2", *more])


def test_schedule_warmup_then_decay_to_min_ratio():
    f = [lr_factor(s, "cosine", 4, 20, 0.1) for s in range(25)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and f[12] == pytest.approx(0.55) and f[20] == pytest.approx(0.1)
    assert f[24] == pytest.approx(0.1)  # past max_steps it stays at the floor
    lin = [lr_factor(s, "lambda_linear", 0, 10, 0.0) for s in (0, 5, 10)]
    assert lin == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor(100, "constant", 10, 20, 0.0) == 1.0
    with pytest.raises(ValueError, match="train.schedule"):
        lr_factor(5, "step", 0, 10, 0.0)


def test_optimizer_groups_lr_mult_no_decay_and_frozen_refused():
    a = ToyAdapter()
    opt = build_optimizer(a.param_groups(), lr=1e-3, weight_decay=0.1, betas=[0.9, 0.95])
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["head"]["lr"] == pytest.approx(5e-3)
    assert by_name["body"]["weight_decay"] == 0.1 and by_name["body_no_decay"]["weight_decay"] == 0.0
    a.module.frozen.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="frozen"):
        build_optimizer([ParamGroup("x", [a.module.frozen.weight])], 1e-3, 0.0, [0.9, 0.95])


def test_power_ema_matches_the_formula():
    p = torch.nn.Parameter(torch.tensor([0.0]))
    ema = PowerEMA({"p": p}, power=0.5)
    ref = 0.0
    for step, value in enumerate([1.0, 2.0, 4.0, -3.0]):
        p.data.fill_(value)
        ema.update(step)
        decay = 1 - (step + 1) ** -0.5
        ref = decay * ref + (1 - decay) * value
        assert ema.shadow["p"].item() == pytest.approx(ref, rel=1e-5)


def test_accumulation_must_divide(tmp_path):
    assert accumulation_steps(_cfg(tmp_path, "train.global_batch=16"), 2) == 2
    with pytest.raises(ConfigError, match="train.global_batch=12"):
        accumulation_steps(_cfg(tmp_path, "train.global_batch=12"), 2)


def test_resume_auto_picks_newest_complete_and_ignores_partial_saves(tmp_path):
    root = tmp_path / "checkpoints"
    for step, complete in ((100, True), (200, True), (300, False)):
        d = root / ckpt.step_dir_name(step)
        d.mkdir(parents=True)
        if complete:
            (d / ckpt.MARKER).write_text(json.dumps({"step": step, "world_size": 1}))
    (root / ".tmp_step_000400").mkdir()
    assert ckpt.resolve_resume("auto", root).name == "step_000200"
    assert ckpt.resolve_resume("", root) is None
    assert ckpt.resolve_resume("auto", tmp_path / "nothing") is None
    with pytest.raises(ConfigError, match="train.resume .*step_000300: not a complete checkpoint"):
        ckpt.resolve_resume(str(root / "step_000300"), root)
    with pytest.raises(ConfigError, match="nowhere: no such checkpoint or run directory"):
        ckpt.resolve_resume(str(tmp_path / "nowhere"), root)
    # a run folder, or its checkpoints folder, stands for its newest complete checkpoint
    assert ckpt.resolve_resume(str(tmp_path), root).name == "step_000200"
    assert ckpt.resolve_resume(str(root), root).name == "step_000200"
    ckpt.clean_stale(root)
    assert not (root / ".tmp_step_000400").exists()


def test_truncate_losses_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / "losses.jsonl"
    path.write_text(
        '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n{"step": 3, "loss": 0.4}\n{"step": 4, "lo'
    )
    truncate_losses(tmp_path, 2)
    assert read_losses(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]


def test_frozen_parameters_stay_bit_identical_and_trained_ones_move(tmp_path):
    cfg = _cfg(tmp_path, "train.max_steps=3", "train.save_interval=3", "train.seed=7")
    run = train(cfg, toy_adapter, toy_data)
    dcp_to_torch_save(run / "checkpoints" / "step_000003", tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=False)["model"]
    torch.manual_seed(7)  # the trainer builds the model right after seeding with train.seed
    initial = ToyAdapter().module.state_dict()
    assert torch.equal(saved["frozen.weight"], initial["frozen.weight"])
    assert not torch.equal(saved["head.weight"], initial["head.weight"])
    assert "optim" in torch.load(tmp_path / "full.pt", weights_only=False)


class _NanLoader(ToyLoader):
    def __next__(self):
        batch = super().__next__()
        if self.pos == 3:  # the third batch: step 3
            batch["observation.state"][0, 0] = float("nan")
        return batch


def test_non_finite_loss_stops_the_run_before_it_is_saved(tmp_path):
    cfg = _cfg(tmp_path, "train.max_steps=8", "train.save_interval=4", "train.log_interval=4")

    def nan_data(cfg, rank, world, run_dir):
        io, stats, _ = toy_data(cfg, rank, world, run_dir)
        return io, stats, lambda *_: _NanLoader(cfg.train.micro_batch, 0, rank, world)

    with pytest.raises(NonFiniteLoss, match="step 3"):
        train(cfg, toy_adapter, nan_data)
    assert ckpt.list_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_runs_prints_each_scalar_from_the_event_files(tmp_path, capsys):
    run = train(_cfg(tmp_path, "train.max_steps=4", "train.save_interval=4"), toy_adapter, toy_data)
    scalars = read_scalars(run)
    assert sorted(scalars["train/loss"]) == [1, 2, 3, 4]
    losses = read_losses(run)
    assert [scalars["train/loss"][r["step"]] for r in losses] == pytest.approx([r["loss"] for r in losses])
    for tag in ("train/mse", "train/l1", "train/grad_norm", "train/lr", "time/step", "time/data",
                "train/samples_per_s", "memory/peak_gib"):  # fmt: skip
        assert tag in scalars, tag
    assert runs_main(argparse.Namespace(run_dir=str(run))) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("train/loss "))
    count, last_step, last = line.split()[1:]
    assert (int(count), int(last_step)) == (4, 4) and math.isclose(
        float(last), losses[-1]["loss"], rel_tol=1e-5
    )
    for name in ("config.yaml", "train.log", "preprocess.json"):
        assert (run / name).is_file(), name
    assert os.listdir(run / "tb")


def _tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_fresh_run_in_a_used_run_dir_is_refused_and_loses_nothing(tmp_path):
    cfg = _cfg(tmp_path, "train.max_steps=4", "train.save_interval=2", "train.keep_last=5")
    train(cfg, toy_adapter, toy_data)
    before = _tree(tmp_path / "run" / "checkpoints")
    losses = (tmp_path / "run" / "losses.jsonl").read_bytes()
    with pytest.raises(
        ConfigError, match=r"already holds step_000002, step_000004, losses.jsonl.*--resume auto"
    ):
        train(cfg, toy_adapter, toy_data)
    assert _tree(tmp_path / "run" / "checkpoints") == before
    assert (tmp_path / "run" / "losses.jsonl").read_bytes() == losses


def test_pruning_removes_only_this_runs_checkpoints(tmp_path):
    train(
        _cfg(tmp_path, "train.max_steps=4", "train.save_interval=2", "train.keep_last=5"),
        toy_adapter,
        toy_data,
    )
    root = tmp_path / "run" / "checkpoints"
    meta = json.loads((root / "step_000002" / "meta.json").read_text())
    lineage = meta["lineage"]
    assert (
        len(lineage) == 16
        and json.loads((root / "step_000004" / "meta.json").read_text())["lineage"] == lineage
    )
    (root / "step_000002" / "meta.json").write_text(json.dumps({**meta, "lineage": "another-run"}))
    more = _cfg(
        tmp_path, "train.max_steps=8", "train.save_interval=2", "train.keep_last=1", "train.resume=auto"
    )
    train(more, toy_adapter, toy_data)
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000008"]
    assert json.loads((root / "step_000008" / "meta.json").read_text())["lineage"] == lineage


def test_an_old_copy_moved_aside_by_a_killed_resave_comes_back(tmp_path):
    root = tmp_path / "checkpoints"
    aside = root / ".old_step_000004"
    aside.mkdir(parents=True)
    (aside / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1, "lineage": "x"}))
    (root / ".tmp_step_000004").mkdir()  # the new copy, never finished
    ckpt.clean_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]
    assert ckpt.is_complete(root / "step_000004")
    # with the new copy in place, the old one just goes
    aside.mkdir()
    (aside / "meta.json").write_text("{}")
    ckpt.clean_stale(root)
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]


def test_edm2_ema_matches_its_definition():
    from wamkit.train.optim import edm2_gamma, ema_decay

    g = edm2_gamma(0.1)
    assert g == pytest.approx(6.94, abs=0.01)  # cosmos' rate 0.1
    assert math.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))) == pytest.approx(0.1, rel=1e-9)
    assert ema_decay(0, "edm2", 0.75, 0.1) == 0.0  # the first update copies the weights
    assert ema_decay(99, "edm2", 0.75, 0.1) == pytest.approx((1 - 1 / 100) ** (g + 1))
    assert ema_decay(99, "inverse_power", 0.75, 0.1) == pytest.approx(1 - 100**-0.75)
    with pytest.raises(ValueError, match="train.ema_rate"):
        edm2_gamma(0.7)
