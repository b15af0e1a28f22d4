"""The two Cosmos3 LIBERO presets carry the published recipe (docs/cosmos3.md cites each number)."""

from __future__ import annotations

import pytest

from wamkit.config import load_config
from wamkit.train.optim import lr_factor

from .conftest import REPO

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")


@pytest.mark.parametrize(("name", "steps"), [("libero_10_cosmos3", 2000), ("libero_all_cosmos3", 5000)])
def test_recipe_numbers(name: str, steps: int):
    from wamkit.models.cosmos3.presets import resolve_options

    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    t = cfg.train
    assert (t.lr, t.warmup_steps, t.micro_batch, t.global_batch) == (5e-5, 500, 32, 2048)
    assert (t.betas, t.weight_decay, t.grad_clip, t.schedule) == ([0.9, 0.99], 0.05, 1.0, "lambda_linear")
    assert (t.max_steps, t.save_interval, t.ema) == (steps, 500, True)
    # cosmos' line: linear from 1 at step 500 to 0 at step 16,000, stopped at max_steps
    for step in (500, 1234, steps - 1):
        cosmos = 1 - (step - 500) / (16000 - 500)
        assert lr_factor(step, t.schedule, t.warmup_steps, t.max_steps, t.min_lr_ratio) == pytest.approx(
            cosmos, abs=1e-5
        )
    opts = resolve_options(cfg.model.options)
    assert (opts.action_lr_mult, opts.caption_dropout, opts.train_shift, opts.sampling_shift) == (
        5.0,
        0.1,
        3.0,
        5.0,
    )
    assert (opts.num_inference_steps, opts.action_loss_weight, opts.vision_loss_weight) == (
        30,
        10.0,
        10.0,
    )
    assert cfg.eval.replan_interval == cfg.data.chunk == 16  # the whole chunk runs before the next request
    if name == "libero_all_cosmos3":
        assert cfg.data.suites == ["libero_spatial", "libero_object", "libero_goal", "libero_10"]


def test_an_option_typo_is_refused_before_a_run_reads_data():
    """The registry's check hook refuses a cosmos3 option or preset typo without building anything."""
    from wamkit.config import ConfigError, ModelConfig
    from wamkit.models.registry import check_model_config

    check_model_config(ModelConfig(name="cosmos3", preset="tiny", options={"caption_dropout": 0.1}))
    with pytest.raises(ConfigError, match="did you mean 'model.options.gradient_checkpointing'"):
        check_model_config(
            ModelConfig(name="cosmos3", preset="tiny", options={"gradient_checkpointng": True})
        )
    with pytest.raises(ConfigError, match="unknown cosmos3 preset 'tinyy'"):
        check_model_config(ModelConfig(name="cosmos3", preset="tinyy"))
