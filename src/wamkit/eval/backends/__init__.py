"""Which server the evaluator talks to: one module per inference engine, chosen by ``eval.backend``.

Every backend turns a stage's observations (env frames, raw state, the task) into its engine's
request and the reply back into env-ready action chunks, behind the connection interface the
evaluator already uses (:mod:`wamkit.eval.backends.base`): the scheduler, the journal, calibration, several
servers, ``--resume`` and the reports do not know which one runs. docs/eval.md, "Evaluating against
another inference engine", says what each one sends and what it leaves to the engine.

A backend is registered by name with the module that implements it, imported when first used
(:func:`register`): a new engine is a new module and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from wamkit.config import ConfigError

_MODULES: dict[str, str] = {
    "wamkit": "wamkit.eval.backends.wamkit",  # wamkit's own server (OpenPI websocket + wamkit metadata)
    "openpi": "wamkit.eval.backends.openpi",  # any OpenPI websocket server (openpi's serve_policy, ...)
    "sglang": "wamkit.eval.backends.sglang",  # SGLang's diffusion server, /v1/actions/generations
    "vllm_omni": "wamkit.eval.backends.vllm_omni",  # vLLM-Omni, /v1/videos in action mode
    "cosmos_http": "wamkit.eval.backends.cosmos_http",  # cosmos-framework's policy server, /predict_batch
}


def register(name: str, module: str) -> None:
    """Make ``eval.backend=<name>`` use ``module`` (its ``connect(target, patience)``)."""
    _MODULES[name] = module


def names() -> list[str]:
    return sorted(_MODULES)


def backend_module(name: str) -> Any:
    if name not in _MODULES:
        raise ConfigError(f"eval.backend={name!r}; expected one of {', '.join(names())}")
    return importlib.import_module(_MODULES[name])


def connect(name: str, target: Any, patience: Any) -> Any:
    """One connection of backend ``name`` to ``target.url`` (the interface of :mod:`.base`)."""
    return backend_module(name).connect(target, patience)
