"""The memory plan: bytes per category and where each lives, by arithmetic, before anything is built.

The trainer keeps, for a model with F frozen and T trained parameters over W processes (FSDP2 shards
every category by W; the frozen tower exists once, in the compute dtype: no fp32 copy, no gradient,
no optimizer state, no EMA):

| category | bytes (whole model) | where |
| --- | --- | --- |
| frozen weights | F x 2 (bf16) or F x 4 (fp32 training) | device |
| trained master weights | T x 4 (fp32) | device |
| gradients | T x 4 (fp32: FSDP2 reduces in fp32 into the fp32 shards) | device |
| optimizer moments | T x 8 (AdamW's two fp32 moments) | device, or pinned host (offload) |
| EMA | T x 4 (fp32, trained parameters only) | device, or pinned host (offload) |
| gathered weights | the compute copies FSDP2 all-gathers (see below) | device |
| activations | per sample x micro-batch (see :func:`activation_bytes`) | device |
| reserve | 3 GiB + 5% of the device (CUDA context, cuBLAS workspace, allocator fragmentation) | device |

Gathered weights: with ``reshard_after_forward`` never (one process, ``auto``), every block stays
gathered from its forward to its backward, so the whole model's compute copy is on the device at once
(all parameters x 2 bytes in bf16); otherwise at most two blocks (the one computing and the one
prefetched) plus the root's own parameters (embeddings, heads) are.

``train.offload``: ``none`` keeps everything on the device; ``ema`` moves the EMA to pinned host
memory; ``optimizer`` moves the moments and the EMA (both touched once per optimizer step, streamed
through the device in chunks then: :mod:`wamkit.train.offload`). ``auto`` on one process first keeps
the weights gathered (resharding would copy and cast every block again in each micro-batch's
backward, where offloading costs once per optimizer step), with the first of none, ema, optimizer that
fits, and reshards only when no offload makes that fit; on several processes it reshards, with the
first offload that fits. On a CPU device the host is the device: ``auto`` offloads nothing.

A plan that does not fit is refused with the settings that would (:mod:`wamkit.train.plan_search`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from wamkit.config import ConfigError, RunConfig
from wamkit.device import RESERVE_FIXED, RESERVE_FRACTION, GiB, MiB, device_budget, meminfo_bytes, parse_size  # noqa: F401
from wamkit.models.base import ActivationShape, ChecksActivations, PlansActivations

log = logging.getLogger(__name__)


def _counts(*ns: int) -> list[str]:
    """Parameter counts in one unit, the one that shows the largest: billions from 0.1B, else millions
    (a CPU model's 1.61M is not 0.002B)."""
    if max(ns) >= 1e8:
        return [f"{n / 1e9:.3f}B" for n in ns]
    return [f"{n / 1e6:.2f}M" for n in ns]


OFFLOAD_MODES = ("none", "ema", "optimizer")
# host memory a training process takes besides what the plan places there on purpose: the
# interpreter, torch and CUDA libraries, the VAE and tokenizer, loader buffers (a cosmos3 trainer's
# anonymous memory around its first step, measured: docs/results-log.md, "Full-size Cosmos3-Nano SFT on
# one H200"); a CPU process has no CUDA libraries or context
HOST_BASE = 6 * GiB
HOST_BASE_CPU = 1 * GiB


@dataclass(frozen=True)
class ModelSizes:
    """The parameter counts a plan needs (from a model built on the meta device)."""

    frozen: int
    trained: int
    largest_block: int  # parameters of the largest FSDP block
    root: int  # parameters outside the blocks (gathered by the root module)
    activations: ActivationShape | None = None
    checkpointing: bool | None = None  # the model's gradient checkpointing; None: it has no such option
    # frozen weights stored in int8 (a LoRA base, train.lora.base=int8): how many of ``frozen``, and
    # their bytes (one a weight, plus an fp32 scale and an int8 zero point per row); FSDP2 leaves them
    # alone: never sharded nor gathered
    int8_frozen: int = 0
    int8_bytes: int = 0
    lora: bool = False  # what trains is LoRA's adapters (and the model's full groups)

    @property
    def total(self) -> int:
        return self.frozen + self.trained


def model_sizes(
    adapter, groups: list | None = None, int8: list | tuple = (), lora: bool = False
) -> ModelSizes:
    """Count an adapter's parameters by role (trained = ``groups``, by default its ``param_groups()``;
    LoRA gives its own, with ``lora`` true), on any device (meta too); ``int8``: the frozen weights that
    will be stored in int8 (:meth:`wamkit.train.lora.Lora.int8_weights`)."""
    groups = adapter.param_groups() if groups is None else groups
    trained_ids = {id(p) for g in groups for p in g.params}
    frozen = trained = 0
    for p in adapter.module.parameters():
        if id(p) in trained_ids:
            trained += p.numel()
        else:
            frozen += p.numel()
    blocks = adapter.blocks()
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    root = sum(p.numel() for p in adapter.module.parameters() if id(p) not in in_blocks)
    ckpt = adapter.gradient_checkpointing if isinstance(adapter, ChecksActivations) else None
    int8_frozen = sum(p.numel() for p in int8)
    int8_bytes = sum(p.numel() + 5 * p.shape[0] for p in int8)
    activations = adapter.activation_shape() if isinstance(adapter, PlansActivations) else None
    return ModelSizes(frozen, trained, largest, root, activations, ckpt, int8_frozen, int8_bytes, lora)


# A LoRA step on a GPU needs more than activation_bytes counts. The plan's total is fitted to what the card
# had to hold in the two LoRA steps measured on a 24 GB card (the driver's peak, CUDA context included):
# the line through both, never below the formula. docs/train.md ("What fits where") has the figures;
# tests/test_train_plan_sizes.py pins them.
LORA_ACTIVATIONS_FIXED = int(-0.571 * GiB)
LORA_ACTIVATIONS_SCALE = 1.729


def activation_bytes(
    shape: ActivationShape | None, micro_batch: int, checkpointing: bool, element_bytes: int = 2
) -> int:
    """Activations kept for backward at ``micro_batch`` samples (an estimate, stated as such).

    Per token and block, autograd keeps (elements): for attention q, k, v and the output (2 h + 2 kv)
    for every token; for a token through trained weights also the two norm inputs, the projections'
    inputs and q/k before RoPE (6 h + kv) and the MLP's gate, up and product (3 i). Flash/flex
    attention keeps no L x L scores. With gradient checkpointing only each block's input (h per token)
    stays, and one block is recomputed at a time; either way the block being differentiated needs about
    its own activations again for their gradients (the factor 2 on one block). ``element_bytes``: 2
    under bf16 autocast, 4 in fp32.
    """
    if shape is None:
        return 0
    s = shape
    attn = s.tokens * (2 * s.hidden + 2 * s.kv_dim)
    rest = s.grad_tokens * (6 * s.hidden + s.kv_dim + 3 * s.intermediate)
    one_block = (attn + rest) * element_bytes
    kept = s.tokens * s.hidden * element_bytes * s.layers if checkpointing else one_block * s.layers
    return int(micro_batch * (kept + 2 * one_block))


def accumulation_steps(cfg: RunConfig, world_size: int) -> int:
    """Micro-batches per optimizer step; the one check that the global batch divides over the processes."""
    per_step = cfg.train.micro_batch * world_size
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} is not a multiple of train.micro_batch x processes "
            f"= {cfg.train.micro_batch} x {world_size}"
        )
    return cfg.train.global_batch // per_step


@dataclass(frozen=True)
class PlanInput:
    """What a plan is computed for (every field has a value: nothing here is ``auto``)."""

    world_size: int
    device_bytes: int
    host_bytes: int  # of one host
    procs_per_host: int
    device_type: str  # "cuda" | "cpu"
    precision: str  # "bf16" | "fp32"
    micro_batch: int
    checkpointing: bool
    ema: bool
    offload: str  # auto | none | ema | optimizer
    reshard: str  # auto | always | never
    global_batch: int = 0  # samples per optimizer step (0: one micro-batch per process)

    @property
    def accumulation(self) -> int:
        """Micro-batches per optimizer step and process."""
        return max(1, self.global_batch // (self.micro_batch * self.world_size))


@dataclass
class Plan:
    """Bytes per category for one process, where each lives, and the settings they follow from."""

    inp: PlanInput
    sizes: ModelSizes
    offload: str
    reshard: str  # resolved: always | never
    grad_sync: str  # "last": gradients reduced on the last micro-batch only; "every": on each
    rows: list[tuple[str, int, str]] = field(default_factory=list)  # (category, bytes, "device"|"host")

    @property
    def device_total(self) -> int:
        return sum(b for _, b, where in self.rows if where == "device")

    @property
    def host_base(self) -> int:
        return HOST_BASE if self.inp.device_type == "cuda" else HOST_BASE_CPU

    @property
    def host_total(self) -> int:
        """One host: each of its processes' offloaded bytes plus :data:`HOST_BASE` (CPU: less)."""
        per_proc = sum(b for _, b, where in self.rows if where == "host") + self.host_base
        return per_proc * self.inp.procs_per_host

    @property
    def fits_device(self) -> bool:
        return self.inp.device_type == "cpu" or self.device_total <= self.inp.device_bytes

    @property
    def fits_host(self) -> bool:
        extra = self.device_total * self.inp.procs_per_host if self.inp.device_type == "cpu" else 0
        return self.host_total + extra <= self.inp.host_bytes

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def table(self) -> str:
        """The plan as text: one line per category, per process, then the totals against the budget."""
        i, s = self.inp, self.sizes
        dev = "device" if i.device_type == "cuda" else "host (CPU training)"
        total, frozen, trained = _counts(s.total, s.frozen, s.trained)
        # a plan under a GiB is written in MiB: a CPU model's table is not a column of 0.00
        unit, size = ("GiB", GiB) if self.device_total >= GiB else ("MiB", MiB)
        lines = [
            f"memory plan: {i.world_size} process(es), {i.device_bytes / GiB:.1f} GiB per {dev}, "
            f"{i.host_bytes / GiB:.1f} GiB per host ({i.procs_per_host} process(es) on it); "
            f"{total} parameters ({frozen} frozen, {trained} trained), "
            f"{i.precision}, micro-batch {i.micro_batch}, checkpointing {'on' if i.checkpointing else 'off'}",
            f"  offload={self.offload}, reshard_after_forward={self.reshard}, gradients reduced on "
            f"{'every micro-batch' if self.grad_sync == 'every' else 'the last micro-batch'} of "
            f"{i.accumulation}",
            f"  {'category':<24} {unit + '/process':>11}  where",
        ]
        for cat, b, where in self.rows:
            lines.append(f"  {cat:<24} {b / size:>11.2f}  {where}")
        dev_line = f"  device total {self.device_total / GiB:.2f} GiB of {i.device_bytes / GiB:.1f}"
        if i.device_type == "cpu":
            dev_line = f"  process total {self.device_total / size:.2f} {unit} (on the host)"
        lines.append(dev_line + ("" if self.fits_device else "  -> does not fit"))
        lines.append(
            f"  host total {self.host_total / GiB:.2f} GiB of {i.host_bytes / GiB:.1f} (offloaded state and "
            f"{self.host_base / GiB:.0f} GiB per process)" + ("" if self.fits_host else "  -> does not fit")
        )
        return "\n".join(lines)


def _rows(
    inp: PlanInput, s: ModelSizes, offload: str, reshard: str, grad_sync: str
) -> list[tuple[str, int, str]]:
    w = inp.world_size
    compute = 2 if inp.precision == "bf16" else 4
    on_host = "host" if inp.device_type == "cuda" else "device"
    moments_at = on_host if offload == "optimizer" else "device"
    ema_at = on_host if offload in ("ema", "optimizer") else "device"
    if reshard == "never":
        gathered = (s.total - s.int8_frozen) * compute
    else:
        gathered = (2 * s.largest_block + s.root) * compute
    rows = [
        ("frozen weights", (s.frozen - s.int8_frozen) * compute // w + s.int8_bytes, "device"),
        ("trained master (fp32)", s.trained * 4 // w, "device"),
        # reduced only on the last micro-batch, FSDP2 accumulates the others unsharded (in fp32, its
        # reduce dtype): the whole trained part's gradients on every process
        (
            "gradients (fp32)",
            s.trained * 4 // (w if grad_sync == "every" or inp.accumulation == 1 else 1),
            "device",
        ),
        ("optimizer moments", s.trained * 8 // w, moments_at),
    ]
    if inp.ema:
        rows.append(("EMA (fp32)", s.trained * 4 // w, ema_at))
    rows += [
        ("gathered weights", gathered, "device"),
        ("activations (estimate)", _activations(inp, s, compute), "device"),
    ]
    if inp.device_type == "cuda":
        rows.append(("reserve", int(RESERVE_FIXED + RESERVE_FRACTION * inp.device_bytes), "device"))
    return rows


def _activations(inp: PlanInput, s: ModelSizes, element_bytes: int) -> int:
    """:func:`activation_bytes`, with the measured excess of a LoRA step on a GPU
    (:data:`LORA_ACTIVATIONS_FIXED`, :data:`LORA_ACTIVATIONS_SCALE`)."""
    est = activation_bytes(s.activations, inp.micro_batch, inp.checkpointing, element_bytes)
    if s.lora and inp.device_type == "cuda":
        return max(est, int(LORA_ACTIVATIONS_FIXED + LORA_ACTIVATIONS_SCALE * est))
    return est


def plan_for(inp: PlanInput, sizes: ModelSizes, offload: str, reshard: str, grad_sync: str = "last") -> Plan:
    """The plan of one fixed placement (``offload``, ``reshard`` and ``grad_sync`` resolved)."""
    return Plan(inp, sizes, offload, reshard, grad_sync, _rows(inp, sizes, offload, reshard, grad_sync))


def _reshard_options(inp: PlanInput) -> list[str]:
    """Resolved resharding modes to try, preferred first (auto: keep gathered on one process)."""
    if inp.reshard == "auto":
        return ["never", "always"] if inp.world_size == 1 else ["always"]
    return [inp.reshard]


def make_plan(inp: PlanInput, sizes: ModelSizes) -> Plan:
    """Resolve ``offload``, ``reshard`` and ``grad_sync``: the first placement that fits (or, if none
    does, the last one tried, whose ``fits`` is False; :func:`wamkit.train.plan_search.refusal` words
    the error). Reducing the gradients on every micro-batch (one reduce-scatter of the trained part per
    micro-batch, small beside a micro-batch's compute) is preferred to offloading when the unsharded
    accumulation is what does not fit."""
    if inp.offload not in ("auto", *OFFLOAD_MODES):
        raise ConfigError(f"train.offload: {inp.offload!r}; expected auto, {', '.join(OFFLOAD_MODES)}")
    if inp.offload == "auto" and inp.device_type != "cuda":
        offloads = ["none"]  # the host is the device (an explicit mode still runs its streamed path)
    elif inp.offload == "auto":
        offloads = list(OFFLOAD_MODES) if inp.ema else ["none", "optimizer"]
    else:
        offloads = [inp.offload]
    syncs = ["last", "every"] if inp.world_size > 1 and inp.accumulation > 1 else ["last"]
    plan = None
    for reshard in _reshard_options(inp):
        for offload in offloads:
            for sync in syncs:
                plan = plan_for(inp, sizes, offload, reshard, sync)
                if plan.fits:
                    return plan
    assert plan is not None
    return plan


def host_memory_bytes() -> int:
    """This host's memory (``/proc/meminfo`` MemTotal)."""
    return meminfo_bytes("MemTotal")


def device_memory_bytes(device: torch.device) -> int:
    """A CUDA device's memory as this process may use it (:func:`wamkit.device.device_budget`: a cap
    set by ``set_per_process_memory_fraction`` is planned for), or the host's for a CPU."""
    if device.type == "cuda":
        return device_budget(device)
    return host_memory_bytes()
