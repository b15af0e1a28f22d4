"""Step distillation as a training mode (``train.distill_from``): the run's model is the student of a
teacher's serving directory. The student starts from the teacher's weights (``model.pretrained`` is the
teacher's directory), and the model's own ``start_distillation`` makes its ``sft_loss`` the distillation
loss (``tiny``: :mod:`wamkit.models.tiny.distill`, which says which method and why).

Resolved once, where a run starts (:func:`resolve`); the teacher is built on the run's device beside the
student, frozen, outside the module the trainer shards and optimises (:func:`start`).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from wamkit.config import ConfigError, RunConfig

log = logging.getLogger(__name__)


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the student's model named by the teacher's directory (``model.pretrained`` and
    ``model.name`` from its model.json); refuses a missing directory, another ``model.pretrained``, or
    another model name, naming the key."""
    src = cfg.train.distill_from
    if not src:
        return cfg
    from wamkit.models.pretrained import read_model_json

    if not (Path(src) / "model.json").is_file():
        raise ConfigError(
            f"train.distill_from: {src} holds no model.json; expected the teacher's serving directory "
            "(`wamkit convert RUN --out DIR`)"
        )
    if cfg.model.pretrained and Path(cfg.model.pretrained).resolve() != Path(src).resolve():
        raise ConfigError(
            f"train.distill_from={src} with model.pretrained={cfg.model.pretrained}: the student starts from "
            "its teacher's weights; leave model.pretrained empty"
        )
    name = read_model_json(Path(src))["name"]
    if cfg.model.name != name and cfg.model.name != "tiny":  # tiny: the default, not a choice
        raise ConfigError(
            f"train.distill_from: the teacher is a '{name}' model, model.name is '{cfg.model.name}'"
        )
    model = dataclasses.replace(cfg.model, name=name, pretrained=str(src))
    return dataclasses.replace(cfg, model=model)


def start(adapter, cfg: RunConfig, device: torch.device) -> None:
    """Make ``adapter`` the student of ``train.distill_from``'s model (built here, on ``device``)."""
    t = cfg.train
    from wamkit.models.base import StepDistilled

    if not isinstance(adapter, StepDistilled):
        raise ConfigError(
            f"train.distill_from: model '{adapter.name}' has no step distillation (models with it: tiny)"
        )
    from wamkit.models.pretrained import load_pretrained

    teacher = load_pretrained(t.distill_from, device=device)
    adapter.start_distillation(teacher, t.distill_steps, t.distill_teacher_steps)
    d = adapter.distilled
    log.info(
        "step distillation: a %d-step student of %s (its %d-step sampler)", d["steps"], t.distill_from,
        d["teacher_steps"],
    )  # fmt: skip
