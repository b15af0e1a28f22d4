"""What fits: the placements searched when a run's memory plan does not fit, and the pick per device size.

A placement is the config's own plan (:func:`wamkit.train.memory.make_plan`: offload and resharding
resolved as the config says) with a few settings changed, each written as the user would type it. The
search is a small fixed set, every candidate a plan by arithmetic (microseconds each):

| move | options, preferred first | offered when |
| --- | --- | --- |
| ``train.offload=auto`` | one | the config fixes another mode |
| ``train.reshard_after_forward=auto`` | one | the config fixes another mode |
| ``model.options.gradient_checkpointing=true`` | one | the model has the option and it is off |
| ``train.micro_batch=M`` | the divisors of the global batch per process below the config's, largest first (the trainer's accumulation grows to keep the global batch) | always |
| N processes | 2, 4, 8, ..., 64 that divide the global batch, fewest first | a refusal only: the table of device sizes is for the world size asked |
| ``train.lora.rank=16`` | one (:data:`LORA_RANK`, the model's own targets) | the config trains in full and the model names LoRA targets |

Candidates are every move alone and every pair of moves of two kinds: two changes at most. A run that
needs three is said to fit nowhere in the search (with the moves searched named), rather than searched
over a product that grows with every option. Order of preference: full SFT before LoRA (LoRA departs
from the recipe: a plan recommends it, never applies it; a run trains with LoRA only when its config
sets ``train.lora.rank``), then fewer changes, then the table's order (offload, resharding,
checkpointing, micro-batch, processes). Within one set of kinds the first option that fits wins: the
largest micro-batch, the fewest processes.

A refusal (:func:`refusal`) names, for full SFT and for LoRA apart, the fitting placements with the
fewest changes; the table of device sizes (:func:`pick`) names the first placement that fits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any

import torch

from wamkit.config import ConfigError, LoraConfig
from wamkit.train import lora
from wamkit.train.memory import GiB, ModelSizes, Plan, PlanInput, make_plan

LORA_RANK = 16  # the rank a plan suggests (train.lora.rank): the memory barely depends on it
PROCESSES = (2, 4, 8, 16, 32, 64)
KINDS = ("offload", "reshard", "checkpointing", "micro_batch", "processes", "lora")


@dataclass(frozen=True)
class Modes:
    """A model's sizes as the config trains it, and under LoRA at :data:`LORA_RANK` when the config
    trains in full (None: the config already uses LoRA, or the model names no LoRA targets)."""

    sizes: ModelSizes
    lora_rank: int = 0  # the config's train.lora.rank (0: full SFT)
    lora_sizes: ModelSizes | None = None


def lora_sizes(adapter, full: ModelSizes, rank: int = LORA_RANK) -> ModelSizes | None:
    """``adapter``'s counts under LoRA at ``rank`` on the model's own targets (``train.lora``'s other
    defaults), by arithmetic on the model as built for full SFT (nothing is changed, peft is not
    imported): each target linear layer [out, in] gains r x (in + out) trained parameters (peft's
    ``lora_A`` and ``lora_B``, no bias) and its weight joins the frozen ones; the model's full groups
    train in full. None when the model names no LoRA targets."""
    try:
        spec = lora.resolve(LoraConfig(rank=rank), adapter)
    except ConfigError:
        return None
    assert spec is not None
    names = {id(m): n for n, m in adapter.module.named_modules()}
    targets = set(spec.targets)

    def added(module: torch.nn.Module) -> int:
        return sum(
            rank * (m.in_features + m.out_features)
            for m in module.modules()
            if isinstance(m, torch.nn.Linear) and names.get(id(m)) in targets
        )

    groups = {g.name: g for g in adapter.param_groups()}
    heads = sum(p.numel() for n in spec.full_groups for p in groups[n].params)
    blocks = adapter.blocks()
    new = added(adapter.module)
    largest = max((sum(p.numel() for p in b.parameters()) + added(b) for b in blocks), default=0)
    root = full.root + new - sum(added(b) for b in blocks)
    return replace(
        full, frozen=full.total - heads, trained=heads + new, largest_block=largest, root=root, lora=True
    )


@dataclass(frozen=True)
class Move:
    """One setting changed: ``setting`` as the user types it, ``change`` the plan input it gives."""

    kind: str  # one of KINDS
    setting: str
    change: tuple[tuple[str, Any], ...] = ()


def _divisors_below(n: int, below: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({x for d in small for x in (d, n // d) if x < below}, reverse=True)


def _moves(inp: PlanInput, modes: Modes, processes: bool) -> dict[str, list[Move]]:
    """Each kind's options, preferred first (the module docstring's table)."""
    out: dict[str, list[Move]] = {}
    if inp.offload != "auto":
        out["offload"] = [Move("offload", "train.offload=auto", (("offload", "auto"),))]
    if inp.reshard != "auto":
        out["reshard"] = [Move("reshard", "train.reshard_after_forward=auto", (("reshard", "auto"),))]
    if modes.sizes.checkpointing is False and not inp.checkpointing:
        out["checkpointing"] = [
            Move("checkpointing", "model.options.gradient_checkpointing=true", (("checkpointing", True),))
        ]
    per_process = inp.global_batch // inp.world_size if inp.global_batch else inp.micro_batch
    mbs = _divisors_below(per_process, inp.micro_batch)
    if mbs:
        out["micro_batch"] = [
            Move("micro_batch", f"train.micro_batch={m}", (("micro_batch", m),)) for m in mbs
        ]
    if processes:
        ppn = max(inp.procs_per_host, 8)  # hosts of up to 8 devices, each with this host's memory
        out["processes"] = [
            Move("processes", f"{n} processes", (("world_size", n), ("procs_per_host", min(n, ppn))))
            for n in PROCESSES
            if n > inp.world_size
        ]
    if modes.lora_sizes is not None:
        out["lora"] = [Move("lora", f"train.lora.rank={LORA_RANK}")]
    return out


@dataclass(frozen=True)
class Placement:
    """A plan that fits and the moves (none: the config as it is) that give it."""

    moves: tuple[Move, ...]
    plan: Plan
    lora_rank: int  # 0: full SFT

    @property
    def changed(self) -> bool:
        return bool(self.moves)

    @property
    def training(self) -> str:
        return f"LoRA rank {self.lora_rank}" if self.lora_rank else "full SFT"

    @property
    def settings(self) -> str:
        """The overrides to type, then the process count (``torchrun``'s), e.g. ``train.lora.rank=16
        train.micro_batch=16``."""
        lora_first = sorted(self.moves, key=lambda m: m.kind != "lora")  # the change that matters most
        words = [m.setting for m in lora_first if m.kind != "processes"]
        procs = [f"{m.setting} (torchrun: --nproc_per_node x --nnodes)" for m in self.moves
                 if m.kind == "processes"]  # fmt: skip
        return " with ".join(w for w in (" ".join(words), *procs) if w)

    def why(self) -> str:
        """The notes a reader needs beside the settings: how many changes, LoRA's departure, the
        accumulation that keeps the global batch."""
        i = self.plan.inp
        notes = ["two changes together"] if len(self.moves) == 2 else []
        if any(m.kind == "lora" for m in self.moves):
            notes.append("LoRA: a departure from full SFT")
        if any(m.kind in ("micro_batch", "processes") for m in self.moves) and i.global_batch:
            notes.append(
                f"{i.accumulation} micro-batches of {i.micro_batch} per process and step keep the "
                f"global batch of {i.global_batch}"
            )
        return f" ({'; '.join(notes)})" if notes else ""

    def summary(self) -> str:
        """One line: training, micro-batch x accumulation, checkpointing, offload, device and host use."""
        p, i = self.plan, self.plan.inp
        return (
            f"{self.training}, micro-batch {i.micro_batch} x {i.accumulation}, checkpointing "
            f"{'on' if i.checkpointing else 'off'}, offload={p.offload}, reshard_after_forward={p.reshard}; "
            f"device {p.device_total / GiB:.2f} of {i.device_bytes / GiB:.1f} GiB, "
            f"host {p.host_total / GiB:.2f} of {i.host_bytes / GiB:.1f} GiB"
        )


def _combos(kinds: list[str]) -> list[tuple[str, ...]]:
    """The config as it is, each kind alone, each pair: full SFT first, then fewer changes."""
    combos = [(), *((k,) for k in kinds), *itertools.combinations(kinds, 2)]
    return sorted(combos, key=lambda c: ("lora" in c, len(c)))  # stable: KINDS order within


def _first_fit(inp: PlanInput, modes: Modes, options: list[list[Move]]) -> Placement | None:
    """The first product of ``options`` (one move per kind, preferred first) whose plan fits."""
    for moves in itertools.product(*options):
        changed = replace(inp, **dict(c for m in moves for c in m.change))
        if moves and changed.global_batch % (changed.micro_batch * changed.world_size):
            continue  # the trainer refuses a global batch that processes x micro-batch do not divide
        uses_lora = any(m.kind == "lora" for m in moves)
        sizes = modes.lora_sizes if uses_lora else modes.sizes
        assert sizes is not None
        plan = make_plan(changed, sizes)
        if plan.fits:
            return Placement(tuple(moves), plan, LORA_RANK if uses_lora else modes.lora_rank)
    return None


def _fitting(inp: PlanInput, modes: Modes, processes: bool):
    """Each set of kinds (in :func:`_combos`' order) with its first fitting placement, lazily."""
    moves = _moves(inp, modes, processes)
    for combo in _combos([k for k in KINDS if k in moves]):
        found = _first_fit(inp, modes, [moves[k] for k in combo])
        if found is not None:
            yield found


def pick(inp: PlanInput, modes: Modes) -> Placement | None:
    """The placement the table of device sizes picks for ``inp`` (its world size kept): the config as it
    is where it fits, else the first change in the module docstring's order; None: nothing searched fits."""
    return next(_fitting(inp, modes, processes=False), None)


def suggestions(inp: PlanInput, modes: Modes) -> list[Placement]:
    """The placements a refusal names: of full SFT, and of LoRA apart, those with the fewest changes."""
    found = [p for p in _fitting(inp, modes, processes=True) if p.changed]
    out = []
    for is_lora in (False, True):
        mine = [p for p in found if any(m.kind == "lora" for m in p.moves) == is_lora]
        fewest = min((len(p.moves) for p in mine), default=0)
        out += [p for p in mine if len(p.moves) == fewest]
    return out


def searched(inp: PlanInput, modes: Modes) -> str:
    """The moves the search tried, in words (for 'nothing fits')."""
    words = {"offload": "offload", "reshard": "resharding", "checkpointing": "checkpointing",
             "micro_batch": "micro-batch", "processes": "process count",
             "lora": f"LoRA (train.lora.rank={LORA_RANK})"}  # fmt: skip
    moves = _moves(inp, modes, processes=True)
    return ", ".join(words[k] for k in KINDS if k in moves)


def what_fits(inp: PlanInput, modes: Modes) -> str:
    """The refusal's tail: the settings that would fit, one per line, or what was searched in vain."""
    found = suggestions(inp, modes)
    if not found:
        return f"no change of one or two of these settings fits: {searched(inp, modes)}"
    lines = [f"  {p.settings}{p.why()}" for p in found]
    if all(p.lora_rank for p in found) and not modes.lora_rank:
        lines.append("  (full SFT: no change of one or two settings fits)")
    single = any(len(p.moves) == 1 for p in found)
    return ("settings that would fit:" if single else "settings that would fit (no single change does):") + (
        "\n" + "\n".join(lines)
    )


def refusal(plan: Plan, modes: Modes) -> ConfigError:
    """The error of a plan that does not fit: its numbers and what would fit."""
    return ConfigError(
        "the training state does not fit (nothing was built):\n"
        + plan.table()
        + "\n"
        + what_fits(plan.inp, modes)
    )
