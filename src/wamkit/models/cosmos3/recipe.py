"""The Cosmos3 robot training example and sampling schedule, as cosmos-framework trains them.

Each piece names the upstream fact it reproduces (file and line in docs/cosmos3.md):

- **Prompt**: the structured JSON action caption of diffusers'
  ``Cosmos3OmniPipeline._build_action_json_prompt`` (framing, action time and description, duration,
  fps, canvas resolution, aspect ratio), plus the two fields cosmos training adds for robot data: the
  dataset's view description appended to the framing sentence, and ``idle_frame`` = ``"k out of N."``
  inside the action entry. No system prompt. In training the whole caption is replaced by ``""`` with
  probability ``caption_dropout``; at inference ``k`` is 0.
- **Idle frames**: frames of a raw (un-normalised) ``[dpos(3), rot6d(6), g(1)]`` chunk in a run of at
  least 3 consecutive frames where the translation, the rotation angle and the gripper change are all
  below per-frame thresholds (5 mm/s and 1.5 deg/s divided by fps, gripper change 0.01).
- **Training noise level**: one sigma per sample, shared by vision and action tokens, drawn from the
  "waver" distribution and warped by the resolution's shift (3 for the 256 tier):
  ``sigma = shift t / (1 + (shift - 1) t)``.
- **Sampling**: UniPC on the native flow schedule (:func:`native_sigmas`, then ``flow_shift``: 5 unless
  the checkpoint's own scheduler config is a native flow schedule with its own shift), no guidance.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import UniPCMultistepScheduler

from wamkit.actions.cosmos3 import action_prompt  # noqa: F401  (the recipe's caption)
from wamkit.device import to_device

WAVER_MODE_S = 1.29  # the "waver" training-time distribution's mode parameter
# Keys of a diffusers scheduler config that select a non-native (approximating) sigma schedule.
_NON_NATIVE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def shift_sigmas(t: torch.Tensor, shift: float) -> torch.Tensor:
    """The flow-matching time shift ``shift t / (1 + (shift - 1) t)`` (t, sigma in [0, 1])."""
    return shift * t / (1 + (shift - 1) * t)


def train_sigmas(n: int, shift: float, device: Any = "cpu", generator: torch.Generator | None = None):
    """``n`` training noise levels: waver-distributed ``t`` (from uniform ``u``), then shifted."""
    u = torch.rand((n,), generator=generator)
    t = 1.0 - u - WAVER_MODE_S * (torch.cos(torch.pi / 2.0 * u) ** 2 - 1 + u)
    return to_device(shift_sigmas(t, shift), torch.device(device))  # no wait for the GPU


def native_sigmas(scheduler: UniPCMultistepScheduler, steps: int) -> np.ndarray:
    """The native flow grid before the shift: ``steps`` sigmas linear from ``1 - 1/N`` towards 0 (N the
    train timesteps), as cosmos' FlowUniPC and diffusers' ``use_native_flow_schedule`` pipeline set
    them; ``set_timesteps(sigmas=...)`` then applies ``flow_shift``."""
    n = int(scheduler.config.num_train_timesteps)
    return np.linspace(1.0 - 1.0 / n, 0.0, steps + 1)[:-1]


def _scheduler_config(root: Path | None) -> dict[str, Any]:
    path = None if root is None else root / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def is_native_flow(config: dict[str, Any]) -> bool:
    """True when a scheduler config is the native shifted flow schedule (not an approximation)."""
    return bool(config.get("use_flow_sigmas")) and not any(config.get(k) for k in _NON_NATIVE_KEYS)


def sampling_scheduler(root: Path | None, default_shift: float) -> UniPCMultistepScheduler:
    """UniPC on the native flow schedule. ``<root>/scheduler`` supplies its settings (solver order,
    train timesteps, ...) where it exists; its ``flow_shift`` is used only if it already is a native
    flow schedule, else ``default_shift``. A Karras approximation of the flow schedule (what
    NVIDIA's converter writes) is replaced by the schedule it approximates."""
    cfg = _scheduler_config(root)
    shift = float(cfg["flow_shift"]) if is_native_flow(cfg) and "flow_shift" in cfg else default_shift
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("sigma_max", "sigma_min")}
    cfg.update({k: False for k in _NON_NATIVE_KEYS})
    cfg.update(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift)
    return UniPCMultistepScheduler.from_config(cfg)
