"""A lazy model registry: ``register_model("tiny", "wamkit.models.tiny:build")``.

The builder's module is imported only when that model is built, so the heavy libraries of one model
(diffusers for cosmos3) are never imported by a user of another.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from wamkit.config import ConfigError, ModelConfig, _suggest
from wamkit.models.base import ModelAdapter, ModelIO

Builder = Callable[..., ModelAdapter]
Check = Callable[[ModelConfig], None]
_REGISTRY: dict[str, str | Builder] = {}
_CHECKS: dict[str, str | Check] = {}
_META: set[str] = set()


def _imported(ref: str | Callable) -> Callable:
    if isinstance(ref, str):
        module, func = ref.split(":")
        return getattr(importlib.import_module(module), func)
    return ref


def register_model(
    name: str, builder: str | Builder, meta: bool = False, check: str | Check | None = None
) -> None:
    """Register ``builder(cfg: ModelConfig, io: ModelIO | None, device=None) -> ModelAdapter`` under
    ``name``.

    ``builder`` may be a ``"module:function"`` string, imported on first use. ``meta``: the builder
    takes ``device="meta"`` and gives an adapter whose module is unfilled, with ``load_weights(device)``
    to fill it once sharded (the trainer then never holds the whole model in host memory).
    ``check(cfg)``: raises :class:`ConfigError` for the preset and options the builder would refuse,
    building nothing, so that the trainer refuses a typo before it reads any data.
    """
    _REGISTRY[name] = builder
    _CHECKS.pop(name, None)
    if check is not None:
        _CHECKS[name] = check
    if meta:
        _META.add(name)
    else:
        _META.discard(name)


def builds_on_meta(name: str) -> bool:
    return name in _META


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(name: str) -> Builder:
    if name not in _REGISTRY:
        raise ConfigError(
            f"model.name: unknown model '{name}'{_suggest(name, _REGISTRY)} (registered: {', '.join(registered_models())})"
        )
    builder = _REGISTRY[name] = _imported(_REGISTRY[name])
    return builder


def check_model_config(cfg: ModelConfig) -> None:
    """Refuse an unknown model, and the preset or options its registered check refuses (models with
    none are checked when built)."""
    if cfg.name not in _REGISTRY:
        _resolve(cfg.name)  # raises, naming the registered models
    if cfg.name in _CHECKS:
        check = _CHECKS[cfg.name] = _imported(_CHECKS[cfg.name])
        check(cfg)


def build_model(cfg: ModelConfig, io: ModelIO | None = None, **kwargs: Any) -> ModelAdapter:
    """Build the adapter ``cfg.name``; ``io`` (from the dataset) overrides the preset's inputs."""
    return _resolve(cfg.name)(cfg, io, **kwargs)


# The built-in models. A new model adds one line here and one folder next to this file.
register_model("tiny", "wamkit.models.tiny:build", check="wamkit.models.tiny:check_config")
register_model(
    "cosmos3", "wamkit.models.cosmos3:build", meta=True, check="wamkit.models.cosmos3:check_config"
)
# LeRobot's own policies (ACT, Diffusion Policy) through its code: needs `make setup-lerobot`
register_model("lerobot", "wamkit.models.lerobot:build", check="wamkit.models.lerobot:check_config")
# A model whose inference is a fixed, configurable delay and a deterministic function of its input:
# for measuring the server and the evaluator alone, clearly labelled as such in benchmark output.
register_model("delay", "wamkit.models.delay:build")
