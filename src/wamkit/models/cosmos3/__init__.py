"""The ``cosmos3`` model: NVIDIA Cosmos3 through diffusers (``pip install 'wamkit[cosmos3]'``).

``build(cfg, io)`` is registered as ``wamkit.models.cosmos3:build``. Presets: ``tiny`` (CPU tests),
``nano`` (Cosmos3-Nano's shape, random weights), ``nano_l8`` (Nano width, 8 layers: SFT on one GPU),
``small`` and ``mini`` (trained from scratch: on one GPU in minutes, on a CPU);
``model.pretrained`` = a diffusers folder on disk (never downloaded). See docs/cosmos3.md.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

from wamkit import embodiments
from wamkit.actions.representations import get_representation
from wamkit.config import ConfigError, ModelConfig
from wamkit.models.base import ModelIO

# model.options.attention (models/cosmos3/packing.py): auto = flex on CUDA, mask elsewhere
AttentionMode = Literal["auto", "mask", "loop", "flex"]
ATTENTION_MODES: tuple[str, ...] = get_args(AttentionMode)
# how the served sampler runs a denoising step (models/cosmos3/fast_policy.py, FastPolicy)
StepGraph = Literal["auto", "none", "cuda_graph", "compile", "compile_layers"]
STEP_GRAPHS: tuple[str, ...] = get_args(StepGraph)

# The embodiment of cosmos-framework's published SFT recipe (docs/cosmos3.md): its profile gives the
# presets' domain name and view description, and the default IO below.
RECIPE_EMBODIMENT = "libero"


def _recipe_io() -> ModelIO:
    """The recipe's IO: its published datasets' cameras at 256 px, its state, 16-step chunks of its
    actions in its representation (two views, 8-D state, 10-D rot6d actions)."""
    e = embodiments.get(RECIPE_EMBODIMENT)
    return ModelIO(
        cameras=e.dataset_cameras or e.default_cameras,
        image_size=256,
        state_dim=e.state_dim,
        action_dim=get_representation(e.representation).model_dim(e.action_dim),
        chunk=16,
        representation=e.representation,
        embodiment=e.name,
    )


DEFAULT_IO = _recipe_io()


def check_config(cfg: ModelConfig) -> None:
    """Refuse an unknown preset or option (:class:`ConfigError`) before a run reads any data, building
    nothing (the registry's check hook)."""
    from wamkit.models.cosmos3.presets import PRESETS, resolve_options

    resolve_options(dict(cfg.options))
    if not cfg.pretrained and cfg.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown cosmos3 preset {cfg.preset!r} (have: {', '.join(PRESETS)})")


def build(
    cfg: ModelConfig, io: ModelIO | None = None, device: Any = None, weights_device: Any = None, **_: Any
):
    """Build the adapter from a preset (random weights) or ``cfg.pretrained`` (a diffusers folder).

    ``device``: where the model is created (default: CPU); a Nano-sized preset is materialised there
    directly, in ``options.dtype``. ``meta``: the transformer is left on the meta device, unfilled, with
    the VAE and tokenizer on the CPU; ``adapter.weight_source(device)`` then gives what the trainer
    streams into each process's shard (:mod:`wamkit.models.weights`), read from disk only then.
    ``weights_device``: build on ``device`` the model a build on ``weights_device`` gives (its dtype,
    its random weights drawn there: CUDA's generator draws other numbers than the CPU's), so that a
    model built in host memory to be served with its text tower there (``serve.text_tower=host``) is
    the very model the default server builds on the GPU.
    """
    from wamkit.models.cosmos3.adapter import Cosmos3Adapter, resolve_dtype
    from wamkit.models.cosmos3.components import (
        RandomWeights,
        build_from_base,
        build_random,
        fresh_heads,
        load_pretrained,
        load_tokenizer,
        make_scheduler,
        open_pretrained,
        pipeline_root,
    )
    from wamkit.models.cosmos3.presets import resolve_options
    from wamkit.models.weights import Overlay, StateDictWeights

    io = io or DEFAULT_IO
    opts = resolve_options(dict(cfg.options), io.embodiment)
    if io.chunk % 4:
        raise ValueError(f"cosmos3: io.chunk={io.chunk} must be a multiple of 4 (the VAE's temporal stride)")
    if opts.state_token and io.state_dim > io.action_dim:
        raise ConfigError(
            f"model.options.state_token: the state ({io.state_dim}-D) must fit the action heads' "
            f"{io.action_dim} inputs (env.state=proprio keeps the robot's own state)"
        )
    dev = torch.device(device if device is not None else "cpu")
    draw_on = torch.device(weights_device) if weights_device is not None else None
    dtype = resolve_dtype(opts.dtype, draw_on or dev)
    root, source = None, None
    if cfg.pretrained:
        root, _ = pipeline_root(cfg.pretrained)
        if dev.type == "meta":
            transformer, vae, folder, fresh = open_pretrained(root, io.action_dim, opts.reinit_action_heads)
            heads = StateDictWeights(fresh_heads(transformer), "fresh action heads") if fresh else None
            source = folder if heads is None else Overlay(folder, heads)
        else:
            transformer, vae, _ = load_pretrained(root, io.action_dim, opts.reinit_action_heads, dev, dtype)
        opts.base = str(root.resolve())  # a rebuilt (saved) model takes its architecture and VAE here
    elif opts.base:
        root, _ = pipeline_root(opts.base)
        transformer, vae, source = build_from_base(root, io.action_dim, dev, dtype, draw_on)
    else:
        transformer, vae, source = build_random(cfg.preset, io.action_dim, dev, dtype, draw_on)
    adapter = Cosmos3Adapter(
        io,
        cfg.preset,
        cfg.pretrained,
        opts,
        transformer,
        vae,
        make_scheduler(root, float(opts.sampling_shift)),
        load_tokenizer(root),
    )
    if dev.type == "meta":
        adapter.set_weight_source(source if callable(source) else (lambda _device, s=source: s))
    if not cfg.pretrained and (opts.base or cfg.preset != "tiny"):  # random weights, whole or streamed
        adapter.set_weight_law(RandomWeights(transformer, torch.device("cpu")))
    if opts.text_kv_cache:
        adapter.use_text_kv(opts.text_kv_cache)
    return adapter


def export_diffusers(adapter, out_dir):
    """See :func:`wamkit.models.cosmos3.components.export_diffusers`."""
    from wamkit.models.cosmos3.components import export_diffusers as _export

    return _export(adapter, out_dir)


__all__ = ["ATTENTION_MODES", "DEFAULT_IO", "STEP_GRAPHS", "build", "export_diffusers"]
