"""``wamkit serve``: serve a model over the OpenPI websocket protocol with dynamic batching.

    wamkit serve EXPORT_DIR --port 8000                       # a serving directory from `wamkit convert`
    wamkit serve --model tiny --preset small --random-init    # untrained weights, identity stats

Flags override the ``serve`` section of ``--config`` (a YAML preset) and ``--set`` overrides; the
defaults live in :class:`wamkit.config.ServeConfig`. ``--port 0`` picks a free port and logs it.

The metadata sent on connect names what is served (``identity``: model, weights sha256, stats sha256,
action transform, autocast; :meth:`ServedPolicy.identity`), and the start-up log repeats it, so an evaluation
can refuse to mix results of two models (``wamkit eval --resume``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from pathlib import Path

from wamkit import embodiments
from wamkit.config import (
    SERVE_PRECISIONS,
    SERVE_TEXT_TOWERS,
    SERVE_WARM,
    ConfigError,
    EnvConfig,
    RunConfig,
    load_config,
    parse_override,
)
from wamkit.models import ModelIO
from wamkit.serve.lifetime import exit_with_parent
from wamkit.serve.loading import as_device, check_serving_dir, load_served, random_init
from wamkit.serve.plan import print_plan, resolve_text_tower, served_model
from wamkit.serve.policy import ServedPolicy
from wamkit.serve.server import run_server, warm_buckets

log = logging.getLogger(__name__)

# flag -> ServeConfig field; a flag left unset keeps the config's value
FLAGS = {
    "host": "host",
    "port": "port",
    "max_batch": "max_batch",
    "max_wait_ms": "max_wait_ms",
    "device": "device",
    "max_message_mb": "max_message_mb",
    "precision": "precision",
    "warm": "warm",
    "compile_cache": "compile_cache",
    "text_tower": "text_tower",
    "sampling_steps": "sampling_steps",
}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What to run: a serving directory, or ``--model/--preset --random-init`` (shared with ``infer``)."""
    parser.add_argument(
        "export_dir", nargs="?", help="serving directory (model.safetensors, model.json, preprocess.json)"
    )
    parser.add_argument("--model", help="registered model name, with --random-init (default: model.name)")
    parser.add_argument(
        "--preset", help="the model's size preset, with --random-init (default: model.preset)"
    )
    parser.add_argument("--random-init", action="store_true", help="untrained weights and identity stats")
    parser.add_argument(
        "--suite",
        help="with --random-init: the inputs and actions of this suite's embodiment profile (its default "
        "cameras, its state as env.state keeps it, images at env.image_size), for a smoke run of its "
        "evaluation (default: the preset's inputs)",
    )
    parser.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE", help="a model option (repeatable)"
    )
    parser.add_argument("--config", help="YAML preset: a file or a packaged preset's name")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="dotted config override"
    )
    parser.add_argument("--device", help="auto | cpu | cuda (default: serve.device)")
    parser.add_argument(
        "--raw-actions", action="store_true", default=None, help="reply with the model's normalised output"
    )
    parser.add_argument(
        "--precision",
        choices=SERVE_PRECISIONS,
        help="model-call compute: auto = bf16 autocast for fp32 weights on CUDA, else as the weights "
        "(default: serve.precision)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warm",
        choices=SERVE_WARM,
        help="run every batch bucket once before answering: auto = when the model compiles or captures "
        "its steps (default: serve.warm)",
    )
    parser.add_argument(
        "--compile-cache", help="where compiled steps are kept ('' = nowhere; serve.compile_cache)"
    )
    parser.add_argument(
        "--warm-only",
        action="store_true",
        help="run every batch bucket once (filling the compile cache, serve.compile_cache) and exit",
    )
    add_model_arguments(parser)
    parser.add_argument("--host", help="interface to bind (default: serve.host)")
    parser.add_argument("--port", type=int, help="TCP port; 0 picks a free one (default: serve.port)")
    parser.add_argument(
        "--max-batch", type=int, help="observations per model call (default: serve.max_batch)"
    )
    parser.add_argument(
        "--max-wait-ms", type=float, help="wait for a fuller batch (default: serve.max_wait_ms)"
    )
    parser.add_argument(
        "--max-message-mb", type=float, help="largest request (default: serve.max_message_mb)"
    )
    parser.add_argument(
        "--sampling-steps",
        type=int,
        help="sampler steps of each request (a flow model's Euler or UniPC steps), set without retraining; "
        "0 = the model's own (default: serve.sampling_steps)",
    )
    parser.add_argument(
        "--text-tower",
        choices=SERVE_TEXT_TOWERS,
        help="where the text (understanding) tower's weights rest: device, host (streamed to the device "
        "per new prompt), auto = the serving plan's pick for this device (default: serve.text_tower)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the serving memory plan for each --device-memory size and exit (nothing is built)",
    )
    parser.add_argument(
        "--device-memory",
        default="",
        metavar="SIZE[,SIZE...]",
        help="with --plan: device sizes to plan for, e.g. 24GB,48GB,80GB,141GB",
    )
    parser.add_argument(
        "--empty-metadata",
        action="store_true",
        help="send {} on connect, as openpi's own servers do (to check a client that must do without)",
    )


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """The run config with the command-line flags applied (checked like every other override)."""
    overrides = list(args.set)
    for flag, field in FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"serve.{field}={value}")
    if args.raw_actions:
        overrides.append("serve.raw_actions=true")
    cfg = load_config(args.config, overrides)
    options = dict(cfg.model.options)
    for text in args.option:
        key, value = parse_override(text)
        options[key] = value
    model = dataclasses.replace(
        cfg.model, name=args.model or cfg.model.name, preset=args.preset or cfg.model.preset, options=options
    )
    return dataclasses.replace(cfg, model=model)


def check_source(args: argparse.Namespace) -> None:
    """Exactly one thing to serve: a serving directory or ``--random-init``."""
    if args.export_dir and "=" in args.export_dir and not Path(args.export_dir).exists():
        raise ConfigError(
            f"{args.export_dir}: wamkit serve takes a serving directory here, and settings as "
            f"--set {args.export_dir}"
        )
    if args.export_dir and args.random_init:
        raise ConfigError("give either EXPORT_DIR or --random-init, not both")
    if args.export_dir and (args.model or args.preset or args.option):
        raise ConfigError(
            "--model, --preset and --option apply to --random-init; a serving directory has its own"
        )
    if not args.export_dir and not args.random_init:
        raise ConfigError("nothing to serve: give a serving directory (EXPORT_DIR) or --random-init")


def build_policy(args: argparse.Namespace, cfg: RunConfig) -> ServedPolicy:
    """The served policy, its text tower placed as ``serve.text_tower`` resolves on this device (the
    serving plan, before anything is built: :func:`wamkit.serve.plan.resolve_text_tower`)."""
    check_source(args)
    if args.export_dir:  # its files, before its model.json is read for the plan
        check_serving_dir(args.export_dir)
    s = cfg.serve
    io = suite_io(args.suite, cfg.env) if args.suite else None
    dev = as_device(s.device)  # serve.device resolved once: everything below takes the device
    tower = resolve_text_tower(s.text_tower, *served_model(args.export_dir, cfg.model, io), dev, s.max_batch)
    if args.export_dir:
        return load_served(args.export_dir, dev, s.raw_actions, s.precision, tower, s.sampling_steps)
    m = cfg.model
    return random_init(
        m.name, m.preset, m.options, dev, s.raw_actions, s.precision, io=io, text_tower=tower,
        sampling_steps=s.sampling_steps,
    )  # fmt: skip


def suite_io(suite: str, env: EnvConfig) -> ModelIO:
    """``--suite``: the ModelIO of the suite's embodiment profile (``env.state``, ``env.image_size``)."""
    profile = embodiments.for_suite(suite)
    if profile is None:
        raise ConfigError(f"--suite: unknown suite '{suite}' (valid: {', '.join(embodiments.suites())})")
    return ModelIO.of_embodiment(profile.name, env.state, env.image_size)


def main(args: argparse.Namespace) -> int:
    exit_with_parent()  # a server an evaluation started ends with it, however it ends
    cfg = resolve_config(args)
    if getattr(args, "plan", False):  # nothing is built: the model's shapes on the meta device
        check_source(args)
        io = suite_io(args.suite, cfg.env) if args.suite else None
        print_plan(*served_model(args.export_dir, cfg.model, io), cfg.serve.text_tower, cfg.serve.max_batch,
                   args.device_memory)  # fmt: skip
        return 0
    t0 = time.perf_counter()
    policy = build_policy(args, cfg)
    t1 = time.perf_counter()
    ident = policy.identity()
    log.info(
        "serving %s (built in %.1f s, weights hashed in %.1f s): weights sha256 %s, stats sha256 %s, "
        "actions %s, autocast %s",
        ident["model"],
        t1 - t0,
        time.perf_counter() - t1,
        ident["weights_sha256"][:16],
        ident["stats_sha256"][:16],
        ident["action_transform"],
        ident["autocast"],
    )
    s = cfg.serve
    sizes = policy.warm_sizes(s.max_batch, "all" if args.warm_only and s.warm == "auto" else s.warm)
    if args.warm_only:  # fill the compile cache for a later start (a job script's step before eval)
        out = warm_buckets(policy, sizes, s.compile_cache) or {"cache": "off", "cache_dir": ""}
        log.info(
            "warm-only: %d buckets %s; compile cache %s %s", len(sizes), sizes, out["cache"], out["cache_dir"]
        )
        return 0
    run_server(
        policy,
        s.host,
        s.port,
        warm=sizes,
        compile_cache=s.compile_cache,
        max_batch=s.max_batch,
        max_wait_ms=s.max_wait_ms,
        max_message_mb=s.max_message_mb,
        empty_metadata=bool(getattr(args, "empty_metadata", False)),
    )
    return 0
