"""The model placed by its memory plan: built on the meta device where the model can be, planned,
refused before anything is allocated if it fits nowhere, sharded, then filled shard by shard.

For a model whose builder supports it (``register_model(..., meta=True)``: cosmos3), nothing of the
model exists in host memory: the transformer is built on the meta device, the frozen part cast to the
compute dtype there (bf16 in bf16 training: the frozen tower exists once, as the copy the forward
reads), FSDP2 shards it, ``to_empty`` gives each process only its shards on its device, and the
adapter's ``load_weights`` streams into them the rows each process holds (:mod:`wamkit.models.weights`).
Other models are built whole on the CPU as before (they are small) and moved to the device by
``fully_shard``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from wamkit.config import ConfigError, RunConfig
from wamkit.device import proc_status, status_bytes
from wamkit.models.base import ChecksActivations, LoadsWeights, ModelAdapter, ParamGroup
from wamkit.train import memory, plan_search
from wamkit.train.dist import DistInfo, shard_adapter
from wamkit.train.lora import Lora, quantize_base
from wamkit.train.lora import apply as apply_lora

log = logging.getLogger(__name__)


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (``/proc/self/status`` RssAnon; 0 where absent):
    memory-mapped weight files are not in it, the copies read out of them are."""
    try:
        return status_bytes(proc_status(), "RssAnon")
    except OSError:
        return 0


def on_meta(adapter: ModelAdapter) -> bool:
    return any(p.is_meta for p in adapter.module.parameters())


def plan_input(
    cfg: RunConfig,
    sizes: memory.ModelSizes,
    *,
    world_size: int,
    device_type: str,
    device_bytes: int,
    host_bytes: int,
    procs_per_host: int,
    micro_batch: int | None = None,
) -> memory.PlanInput:
    t = cfg.train
    return memory.PlanInput(
        world_size=world_size,
        device_bytes=device_bytes,
        host_bytes=host_bytes,
        procs_per_host=procs_per_host,
        device_type=device_type,
        precision=t.precision,
        micro_batch=micro_batch or t.micro_batch,
        checkpointing=bool(sizes.checkpointing),
        ema=t.ema,
        offload=t.offload,
        reshard=t.reshard_after_forward,
        global_batch=t.global_batch,
    )


def plan_here(
    cfg: RunConfig,
    info: DistInfo,
    adapter: ModelAdapter,
    micro_batch: int | None = None,
    groups: list[ParamGroup] | None = None,
    int8: list | tuple = (),
) -> memory.Plan:
    """The plan for this run's processes and devices; refused (ConfigError) if it fits nowhere.
    ``groups``: what trains (by default the adapter's ``param_groups()``; LoRA gives its own);
    ``int8``: the frozen weights a LoRA base stores in int8."""
    sizes = memory.model_sizes(adapter, groups, int8, lora=groups is not None)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    inp = plan_input(
        cfg,
        sizes,
        world_size=info.world_size,
        device_type=info.device.type,
        device_bytes=memory.device_memory_bytes(info.device),
        host_bytes=memory.host_memory_bytes(),
        procs_per_host=local,
        micro_batch=micro_batch,
    )
    plan = memory.make_plan(inp, sizes)
    if not plan.fits:
        raise plan_search.refusal(plan, search_modes(cfg, adapter, sizes))
    why = " (chosen by train.offload=auto)" if cfg.train.offload == "auto" and plan.offload != "none" else ""
    log.info("%s%s", plan.table(), why)
    return plan


def search_modes(cfg: RunConfig, adapter: ModelAdapter, sizes: memory.ModelSizes) -> plan_search.Modes:
    """What a refusal searches: ``sizes`` as the config trains, and LoRA's too when it trains in full."""
    rank = cfg.train.lora.rank
    return plan_search.Modes(sizes, rank, None if rank else plan_search.lora_sizes(adapter, sizes))


@dataclass
class Placed:
    root: torch.nn.Module
    groups: list[ParamGroup]
    trained: dict[str, torch.nn.Parameter]
    plan: memory.Plan
    load_s: float  # seconds filling the shards from the weights' source (0 for a model built whole)


def cast_frozen(adapter: ModelAdapter, dtype: torch.dtype, groups: list[ParamGroup] | None = None) -> None:
    """Frozen parameters in the compute dtype: no fp32 copy of weights that never change (a bf16
    forward reads the same values either way: a bf16 cast of the fp32 copy of a bf16 weight is exact).
    ``groups``: what trains (by default the adapter's ``param_groups()``)."""
    groups = adapter.param_groups() if groups is None else groups
    trained = {id(p) for g in groups for p in g.params}
    for p in adapter.module.parameters():
        if id(p) not in trained and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def place_run(adapter: ModelAdapter, info: DistInfo, cfg: RunConfig) -> tuple[Lora | None, Placed]:
    """A run's model made ready to train: ``train.lora`` put in (None: full SFT), the memory plan made
    for what then trains (refused, :func:`plan_here`, before anything is allocated), the model placed by
    it (:func:`place`; the plan is ``Placed.plan``). ``wamkit train`` and ``wamkit bench train`` both."""
    lora = apply_lora(adapter, cfg.train.lora, cfg.train.seed)
    groups = lora.groups if lora is not None else None
    int8 = lora.int8_weights(adapter.module) if lora is not None else []
    plan = plan_here(cfg, info, adapter, groups=groups, int8=int8)
    return lora, place(adapter, info, cfg, plan, lora)


def place(
    adapter: ModelAdapter, info: DistInfo, cfg: RunConfig, plan: memory.Plan, lora: Lora | None = None
) -> Placed:
    """Shard ``adapter`` as ``plan`` says and, if it was built on meta, fill its shards on the device.
    With ``lora`` (:mod:`wamkit.train.lora`, put in before) its groups train, the adapted layers' base
    weights are frozen like the rest, and the shards are filled through its view of the weights."""
    t = cfg.train
    groups = lora.groups if lora is not None else None
    if t.precision == "bf16":
        cast_frozen(adapter, torch.bfloat16, groups)
    meta = on_meta(adapter)
    quantized: set[torch.nn.Parameter] = set()
    load_s = 0.0
    if lora is not None and lora.spec.base != "bf16":
        if info.world_size > 1:
            raise ConfigError(
                f"train.lora.base={lora.spec.base} runs on one process (FSDP2 does not shard a quantized "
                f"base), got {info.world_size}: use train.lora.base=bf16 to shard the base over them"
            )
        checkpointing = isinstance(adapter, ChecksActivations) and adapter.gradient_checkpointing
        if t.compile and info.device.type == "cuda" and checkpointing:
            # with torch 2.11 and torchao 0.18 each compiled layer's recompute under activation
            # checkpointing saved other tensors than its forward (torch.utils.checkpoint.CheckpointError
            # at the first backward), once the model was built and compiled: refuse before building
            # (docs/cosmos3.md, "An int8 base")
            raise ConfigError(
                f"train.lora.base={lora.spec.base} with train.compile=true and gradient checkpointing fails "
                "on CUDA (the compiled layers' recompute differs from their forward); set train.compile=false, "
                "or train.lora.base=bf16"
            )
        if meta:  # the weights first: the quantization reads them
            module = adapter.module
            name_of = {id(p): n for n, p in module.named_parameters()}
            load_s = _fill(adapter, module, info.device, lora)
            params = dict(module.named_parameters())  # to_empty made new parameters: the groups by name
            groups = [
                ParamGroup(g.name, [params[name_of[id(p)]] for p in g.params], g.lr_mult, g.weight_decay)
                for g in groups
            ]
            # nothing here may hold the base's weights once they are quantized: the quantization frees
            # each layer's bf16 weight as it makes its int8 one (held, every bf16 weight stayed beside
            # the int8 ones: Nano's LoRA ran out of a 24 GB card's memory before its first step)
            del params
            meta = False
        for name in lora.spec.targets:  # FSDP2 moves what it shards, not what it leaves alone
            adapter.module.get_submodule(name).get_base_layer().to(info.device)
        quantized = set(quantize_base(adapter.module, lora.spec))
    # several processes with auto: FSDP2's own auto (reshard every block but the last, whose weights the
    # backward needs at once), which the plan counted as resharding
    reshard = "auto" if t.reshard_after_forward == "auto" and info.world_size > 1 else plan.reshard
    root, groups, trained = shard_adapter(
        adapter, info.device, t.precision, t.compile, reshard, groups, quantized or None
    )
    if meta:
        load_s = _fill(adapter, root, info.device, lora)
    return Placed(root, groups, trained, plan, load_s)


def _fill(adapter: ModelAdapter, root: torch.nn.Module, device: torch.device, lora: Lora | None) -> float:
    """Fill a meta-built model (its shards, once sharded) from its weights' source; returns the seconds."""
    if not isinstance(adapter, LoadsWeights):
        raise RuntimeError(f"{adapter.name}: built on the meta device but has no load_weights(device)")
    t0 = time.perf_counter()
    root.to_empty(device=device)
    n = adapter.load_weights(device) if lora is None else adapter.load_weights(device, wrap=lora.wrap)
    load_s = time.perf_counter() - t0
    log.info(
        "weights streamed into this process's shards: %.2f GB read in %.1f s; host RssAnon %.2f GB",
        n / 1e9, load_s, rss_anon_bytes() / 1e9,
    )  # fmt: skip
    return load_s
