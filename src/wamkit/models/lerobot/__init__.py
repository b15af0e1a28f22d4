"""``lerobot``: LeRobot's own policies (ACT, Diffusion Policy) behind the adapter protocol.

``model.preset`` is the LeRobot policy type and ``model.options`` its config's fields; the policy is
LeRobot's class, built and run by LeRobot's code (:mod:`wamkit.models.lerobot.adapter` only moves
tensors between the two batch layouts). It needs LeRobot 0.6.1, which needs Python 3.12 and torch <
2.12: ``make setup-lerobot`` builds ``.venv-lerobot`` with both (docs/lerobot.md).
"""

from __future__ import annotations

from typing import Any

from wamkit.config import ModelConfig
from wamkit.models.base import ModelIO

__all__ = ["build", "check_config"]


def check_config(cfg: ModelConfig) -> None:
    """Refuse a policy type or option the adapter would refuse (:class:`ConfigError`), building nothing."""
    from wamkit.models.lerobot.adapter import resolve_options

    if not cfg.pretrained:
        resolve_options(cfg.preset, dict(cfg.options))


def build(cfg: ModelConfig, io: ModelIO | None = None, device: Any = None) -> Any:
    """LeRobot's ``cfg.preset`` policy for inputs ``io`` (default: MetaWorld's), its config from
    ``cfg.options``; with ``cfg.pretrained``, a wamkit model directory of it (``model.json``) or a
    LeRobot pretrained folder as it is."""
    from wamkit.models.lerobot.adapter import LeRobotAdapter, is_lerobot_folder

    if cfg.pretrained and is_lerobot_folder(cfg.pretrained):  # written by lerobot-train or exported
        adapter = LeRobotAdapter.from_folder(cfg.pretrained, device=device or "cpu")
        if io is not None and io != adapter.io:  # as load_pretrained refuses for a wamkit folder
            raise ValueError(
                f"{cfg.pretrained}: the policy expects inputs {adapter.io}, but {io} was asked for"
            )
        return adapter
    if cfg.pretrained:
        from wamkit.models.pretrained import load_pretrained

        return load_pretrained(cfg.pretrained, device=device or "cpu", options=cfg.options, io=io)
    return LeRobotAdapter(cfg.preset, dict(cfg.options), io or ModelIO(), device=device or "cpu")
