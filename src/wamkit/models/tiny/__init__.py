"""``tiny``: the built-in two-tower world action model (plain torch, CPU-trainable).

``build(cfg, io)`` is registered as ``wamkit.models.tiny:build``; presets and options are in
:mod:`wamkit.models.tiny.config`, the network in :mod:`~wamkit.models.tiny.network`, losses and
sampling in :mod:`~wamkit.models.tiny.adapter`.
"""

from __future__ import annotations

from wamkit.config import ModelConfig
from wamkit.models.base import ModelIO
from wamkit.models.tiny.adapter import TinyAdapter
from wamkit.models.tiny.config import PRESETS, TinyConfig, resolve_config

__all__ = ["PRESETS", "TinyAdapter", "TinyConfig", "build", "check_config"]


def check_config(cfg: ModelConfig) -> None:
    """Refuse an unknown preset or option (:class:`ConfigError`), building nothing."""
    if not cfg.pretrained:  # a pretrained model's options are checked against its own model.json
        resolve_config(cfg.preset, cfg.options)


def build(cfg: ModelConfig, io: ModelIO | None = None, device: str | None = None) -> TinyAdapter:
    """Build ``tiny`` from ``cfg.preset`` + ``cfg.options`` for inputs ``io`` (default: MetaWorld's).

    With ``cfg.pretrained`` set, the architecture and inputs come from that directory's ``model.json``
    (``cfg.options`` may still change sampling options such as ``num_steps``) and its weights are loaded.
    ``device`` None leaves the parameters where torch's default device puts them (e.g. ``meta``).
    """
    if cfg.pretrained:
        from wamkit.models.pretrained import load_pretrained

        return load_pretrained(cfg.pretrained, device=device or "cpu", options=cfg.options, io=io)
    adapter = TinyAdapter(resolve_config(cfg.preset, cfg.options), io or ModelIO(), cfg.preset)
    if device is not None:
        adapter.module.to(device)
    return adapter
