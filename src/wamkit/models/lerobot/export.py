"""A wamkit-trained LeRobot policy as a LeRobot pretrained folder.

The folder is what ``policy.save_pretrained`` and the processors' ``save_pretrained`` write
(``config.json``, ``model.safetensors``, ``policy_preprocessor.json`` and
``policy_postprocessor.json`` with their statistics): LeRobot's ``from_pretrained`` and
``PolicyProcessorPipeline.from_pretrained`` load it, and its preprocessor, policy and postprocessor turn
raw observations into the actions wamkit's server would send for the same observation.

Normalisation is done once on each side. In wamkit the preprocessing spec normalises; in the folder,
LeRobot's normaliser does, with the spec's statistics and its kind mapped to LeRobot's mode (quantile
-> QUANTILES on q01/q99, mean_std -> MEAN_STD, min_max -> MIN_MAX, none -> IDENTITY); the cameras
MEAN_STD on ImageNet's statistics, as lerobot-train normalises them and wamkit's adapter does. For
state and actions LeRobot's normaliser is the same affine map as wamkit's
(``lerobot/processor/normalize_processor.py``, ``_apply_transform``) but for MEAN_STD's divisor,
``std + 1e-8`` where wamkit's is ``max(std, 1e-8)``: a relative difference of 1e-8 / std.

A spec whose other steps LeRobot's processors cannot express is refused, naming the step: an action
representation other than ``raw``, a gripper convention other than the env's, clipping. Images must
reach the folder's policy at the size it was trained at (the spec's resize is not a LeRobot step).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from wamkit.constants import ACTION, OBS_STATE, image_key

MODES = {"quantile": "QUANTILES", "mean_std": "MEAN_STD", "min_max": "MIN_MAX", "none": "IDENTITY"}


class ExportError(ValueError):
    """The model or its spec cannot be written as a LeRobot folder that reproduces it."""


def _norm_kind(spec: Any, feature: str) -> str:
    from wamkit.actions.steps import NormalizeStep

    found = [s for s in spec.steps if isinstance(s, NormalizeStep) and s.feature == feature]
    return found[0].kind if found else "none"


def processor_stats(spec: Any) -> tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]:
    """LeRobot's normalisation modes by feature type and its ``dataset_stats`` from ``spec``."""
    where = "preprocessing spec"
    if spec is None:
        raise ExportError(
            "a LeRobot folder needs the model's preprocessing spec (its normalisation statistics)"
        )
    if spec.representation != "raw":
        raise ExportError(
            f"{where}: action representation '{spec.representation}' has no LeRobot processor step; "
            "a LeRobot folder needs representation raw"
        )
    if spec.gripper != "env":
        raise ExportError(
            f"{where}: gripper convention '{spec.gripper}' has no LeRobot processor step; a LeRobot folder "
            "needs the data's gripper in the env's convention (env)"
        )
    if spec.clip:
        raise ExportError(
            f"{where}: clipped normalisation has no LeRobot processor step; train with clip off"
        )
    from lerobot.utils.constants import IMAGENET_STATS

    modes = {
        "VISUAL": "MEAN_STD",
        "STATE": MODES[_norm_kind(spec, OBS_STATE)],
        "ACTION": MODES[_norm_kind(spec, ACTION)],
    }
    # the cameras as lerobot-train normalises them (and wamkit's adapter does): ImageNet's statistics
    stats = {
        image_key(c): {k: torch.tensor(v, dtype=torch.float32) for k, v in IMAGENET_STATS.items()}
        for c in spec.cameras
    }
    for feature in (OBS_STATE, ACTION):
        s = spec.stats[feature]
        stats[feature] = {
            k: torch.tensor(getattr(s, k), dtype=torch.float32)
            for k in ("mean", "std", "min", "max", "q01", "q99")
        }
    return modes, stats


def write_pretrained(adapter: Any, spec: Any, out_dir: str | Path) -> Path:
    """Write ``adapter``'s policy and ``spec``'s normalisation as a LeRobot pretrained folder in
    ``out_dir``, then load it back with LeRobot's loaders and check the weights bit for bit."""
    from lerobot.configs.types import NormalizationMode
    from lerobot.policies.factory import make_pre_post_processors

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes, stats = processor_stats(spec)
    config = copy.deepcopy(adapter.config)
    config.normalization_mapping = {k: NormalizationMode(v) for k, v in modes.items()}
    adapter.module.save_pretrained(out)
    config.device = None  # LeRobot's loader picks the machine's best device, as for its own folders
    config._save_pretrained(out)  # over the policy's own config.json: the processors' modes, no device
    config.device = "cpu"
    pre, post = make_pre_post_processors(config, dataset_stats=stats)
    pre.save_pretrained(out)
    post.save_pretrained(out)
    verify_pretrained(adapter, out, stats)
    return out


def verify_pretrained(adapter: Any, folder: Path, stats: dict[str, dict[str, torch.Tensor]]) -> None:
    """LeRobot's ``from_pretrained`` reads ``folder`` to the adapter's weights, bit for bit, and its
    processors load holding ``stats`` (the spec's and the cameras'), bit for bit."""
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot.processor import NormalizerProcessorStep, UnnormalizerProcessorStep

    loaded = get_policy_class(adapter.policy_type).from_pretrained(str(folder))
    mine = adapter.module.state_dict()
    theirs = loaded.state_dict()
    if sorted(mine) != sorted(theirs):
        raise ExportError(
            f"{folder}: LeRobot's loader read other parameters ({sorted(set(mine) ^ set(theirs))[:5]})"
        )
    for name, t in mine.items():
        if not torch.equal(t.detach().cpu(), theirs[name].detach().cpu()):
            raise ExportError(f"{folder}: parameter {name} differs after LeRobot's loader read it back")
    # loaded as lerobot-eval loads them
    pre, post = make_pre_post_processors(loaded.config, pretrained_path=str(folder))
    for pipeline in (pre, post):
        for step in pipeline.steps:
            if not isinstance(step, NormalizerProcessorStep | UnnormalizerProcessorStep):
                continue
            for feature, have in step.stats.items():
                for kind, value in have.items():
                    want = stats.get(feature, {}).get(kind)
                    if want is None or not torch.equal(torch.as_tensor(value).float().cpu(), want):
                        raise ExportError(
                            f"{folder}: the processors' {feature} {kind} differ from the spec's"
                        )
