"""``wamkit train CONFIG --plan``: the memory plan of a run, for this machine or any other, built on meta.

Nothing is trained, loaded or read: the model is built on the meta device (or whole on the CPU if it is
small), from the preset's shape when ``model.pretrained`` is not here, with the model's default inputs
when ``data.root`` is not here, and as a run reading its text cache when ``model.options.text_kv_cache``
is not here yet.

One device size (``--device-memory 80GB``): the plan's table, or the refusal a run would meet, naming
the settings that would fit (:mod:`wamkit.train.plan_search`). Several (``--device-memory
24GB,48GB,80GB,141GB``, ``--host-memory`` one size or one per device): per size, the table of the
placement picked (the config's where it fits, else the first change that fits: full SFT before LoRA)
and a line saying what it is; then one summary line per size. LoRA picked there is a recommendation: a
run trains with LoRA only when its config sets ``train.lora.rank``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from wamkit.config import ConfigError, RunConfig
from wamkit.train import memory, plan_search
from wamkit.train.placement import plan_input, search_modes


@dataclasses.dataclass(frozen=True)
class Budget:
    """One machine a plan is asked for: its device type and sizes, and the sizes as the user typed them."""

    device_type: str  # "cuda" | "cpu"
    device_bytes: int
    host_bytes: int
    label: str  # e.g. "24GB device, 48GB host"


def _plan_io(cfg: RunConfig):
    """The dataset's inputs if its folder is here, else None (the model's defaults), and a note."""
    from wamkit.train.data_setup import first_dataset_root, io_from_dataset

    root = first_dataset_root(cfg)
    info = Path(root) / "meta" / "info.json"
    if not info.is_file():
        return None, f"data.root {root} is not here: the model's default inputs are planned for"
    meta = json.loads(info.read_text())
    return io_from_dataset(cfg, meta["features"], str(info), meta.get("robot_type")), f"inputs of {root}"


def _plan_model(cfg: RunConfig):
    """The run's model built for planning, the config's LoRA put in, and a note on what is not here."""
    from wamkit.models import build_model
    from wamkit.models.registry import builds_on_meta
    from wamkit.train.lora import apply as apply_lora

    io, note = _plan_io(cfg)
    model = cfg.model
    if model.pretrained and not Path(model.pretrained).exists():  # the plan needs its shape only
        note += (
            f"; model.pretrained {model.pretrained} is not here: the preset '{model.preset}' gives the shape"
        )
        model = dataclasses.replace(model, pretrained="")
    text_kv = str(model.options.get("text_kv_cache", "") or "")
    if text_kv and not (Path(text_kv) / "manifest.json").is_file():  # planned as read from it
        note += f"; model.options.text_kv_cache {text_kv} is not here: planned as a run reading it"
        model = dataclasses.replace(
            model, options={k: v for k, v in model.options.items() if k != "text_kv_cache"}
        )
    else:
        text_kv = ""
    meta = builds_on_meta(model.name)
    adapter = build_model(model, io, device="meta") if meta else build_model(model, io)
    if text_kv:
        adapter.drop_understanding_tower(force=True)
    lora = apply_lora(adapter, cfg.train.lora)
    return adapter, lora, note


def _sizes(text: str, what: str) -> list[tuple[int, str]]:
    """``"24GB,48GB"`` -> [(bytes, "24GB"), ...] (empty text: none)."""
    if not text:
        return []
    parts = [p.strip() for p in text.split(",")]
    return [(memory.parse_size(p, what), p) for p in parts]


def budgets(cfg: RunConfig, device_memory: str, host_memory: str) -> list[Budget]:
    """The machines asked for: one per ``--device-memory`` size (default: this device), with one
    ``--host-memory`` for all or one per device (default: this host's)."""
    from wamkit.device import resolve_device

    devices = _sizes(device_memory, "--device-memory")
    hosts = _sizes(host_memory, "--host-memory")
    if len(hosts) > 1 and len(hosts) != len(devices):
        raise ConfigError(
            f"--host-memory: {len(hosts)} sizes for {len(devices) or 1} device size(s); give one host size "
            "for all, or one per --device-memory size"
        )
    if devices:
        device_type = "cuda"
    else:
        here = resolve_device(cfg.train.device, "train.device", 0, 1)
        devices = [(memory.device_memory_bytes(here), f"this {here.type} device")]
        device_type = here.type
    hosts = hosts or [(memory.host_memory_bytes(), "this host")]
    hosts = hosts * len(devices) if len(hosts) == 1 else hosts
    return [Budget(device_type, d, h, f"{dl} device, {hl} host") for (d, dl), (h, hl) in zip(devices, hosts)]


def _size_report(budget: Budget, placement: plan_search.Placement | None, plan: memory.Plan,
                 modes: plan_search.Modes) -> str:  # fmt: skip
    """One device size: its picked plan's table (the config's where nothing fits) and what it picks."""
    head = f"== {budget.label} =="
    if placement is None:
        n = plan.inp.world_size
        why = plan_search.what_fits(plan.inp, modes)
        return f"{head}\n{plan.table()}\n  nothing searched fits {n} process(es) of this size; {why}"
    pick = f"  picks: {placement.summary()}"
    if placement.changed:
        pick += f"\n  with: {placement.settings}{placement.why()}"
    if placement.lora_rank and not modes.lora_rank:
        pick += "\n  LoRA is a recommendation: this config trains in full; a run uses LoRA only when set"
    return f"{head}\n{placement.plan.table()}\n{pick}"


def _summary_line(budget: Budget, placement: plan_search.Placement | None) -> str:
    if placement is None:
        return f"  {budget.label}: nothing fits (its section says what would)"
    with_ = f" [{placement.settings}]" if placement.changed else " [the config as it is]"
    return f"  {budget.label}: {placement.summary()}{with_}"


def print_plan(
    cfg: RunConfig, world_size: int, device_memory: str, host_memory: str, procs_per_host: int
) -> None:
    """The plan for ``world_size`` processes on each machine asked for (module docstring); one machine
    whose plan does not fit is refused (ConfigError), as the run would be."""
    if world_size < 1:
        raise ConfigError(f"--world-size: expected a positive number of processes, got {world_size}")
    memory.accumulation_steps(cfg, world_size)  # the global batch divides over the processes
    asked = budgets(cfg, device_memory, host_memory)
    adapter, lora, note = _plan_model(cfg)
    if lora is None:
        sizes = memory.model_sizes(adapter)
    else:
        sizes = memory.model_sizes(adapter, lora.groups, lora.int8_weights(adapter.module), lora=True)
    modes = search_modes(cfg, adapter, sizes)

    def inp_for(b: Budget) -> memory.PlanInput:
        return plan_input(
            cfg, sizes, world_size=world_size, device_type=b.device_type, device_bytes=b.device_bytes,
            host_bytes=b.host_bytes, procs_per_host=procs_per_host or min(world_size, 8),
        )  # fmt: skip

    print(f"{cfg.model.name}/{cfg.model.preset} ({note}), global batch {cfg.train.global_batch}")
    if len(asked) == 1:
        plan = memory.make_plan(inp_for(asked[0]), sizes)
        if not plan.fits:
            raise plan_search.refusal(plan, modes)
        print(plan.table())
        return
    lines = []
    for b in asked:
        inp = inp_for(b)
        placement = plan_search.pick(inp, modes)
        print(_size_report(b, placement, memory.make_plan(inp, sizes), modes) + "\n")
        lines.append(_summary_line(b, placement))
    print(f"what fits, {world_size} process(es), global batch {cfg.train.global_batch}:")
    print("\n".join(lines))
