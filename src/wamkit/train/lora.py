"""LoRA SFT (``train.lora``): peft's low-rank adapters in place of training a model's linear layers in full.

A training placement, like offload: the model is built as for full SFT, then, before anything is cast,
sharded or filled, peft (its ``LoraModel`` tuner) replaces each target linear layer ``L`` by a LoRA
layer that keeps ``L`` as its ``base_layer`` and adds ``lora_A`` [r, in] and ``lora_B`` [out, r]: the
layer computes ``L(x) + (alpha / r) * B(A(dropout(x)))``.

- **Targets.** ``train.lora.target_modules``, else the model's own list (its ``lora_targets()``,
  :class:`~wamkit.models.base.LoraTargets`); an entry is a linear layer's name or its last dotted parts,
  as peft matches them. Each entry must name linear layers that full SFT trains: LoRA never trains what
  the recipe freezes (a frozen tower's weights are the base's, its text keys/values may be cached).
- **What trains.** The adapters, and the model's ``full_groups`` in full (cosmos3: the action heads,
  which the recipe initialises afresh). Every other parameter is frozen, and frozen parameters are
  kept in the compute dtype (a bf16 run's base is bf16: :func:`wamkit.train.placement.cast_frozen`).
- **Initial values.** ``A`` uniform in ``+-1/sqrt(in)`` (peft's own law: kaiming-uniform with
  ``a = sqrt(5)``), drawn per tensor from ``train.seed`` + crc32 of its name; ``B`` zeros, so the model
  at step 0 is the base exactly. The values are the same whether the model is built whole or on the meta
  device and filled shard by shard (:class:`LoraWeights`), on any number of processes.
- **Checkpoints.** A model that names its base saves no frozen weights (:mod:`wamkit.train.base_weights`),
  so a LoRA checkpoint holds the adapters, the fully trained groups, their optimizer state and EMA.
  ``meta.json`` records ``lora`` (:meth:`LoraSpec.to_meta`), and the base's hash covers the adapted
  layers' weights too (``base_reference(whole=True)``). A resume under other LoRA settings is refused,
  naming the key; a model without a named base (a random preset but ``tiny``) keeps its frozen weights
  in its checkpoints, as in full SFT.
- **A quantized base** (``train.lora.base=int8``): the adapted layers' frozen weights in torchao's
  weight-only int8 (:func:`quantize_base`), for a base that must fit a small card. The weights exist
  only once the model is filled (a meta-built one is filled after peft put its layers in), so each
  adapted layer's ``base_layer`` is quantized under peft's layer, which calls it as any module (peft's
  own torchao layer differs only in merge/unmerge, which a run never calls). One process only: FSDP2
  leaves the quantized weights alone (its ``ignored_params``). ``meta.json``'s ``lora.base`` records the
  format; a resume in another is refused.
- **Export.** :meth:`Lora.merge` folds each adapter into its layer's weight (peft's ``merge_and_unload``,
  ``W + (alpha / r) B A``): ``wamkit convert`` writes a plain model, served with no peft code. Over an
  int8 base, ``W`` is the int8 weight dequantized (:func:`round_base`): the served model is the one the
  run trained, in the base's dtype; the adapters learnt to correct the int8 base, not the original one.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from wamkit.config import ConfigError, LoraConfig, UserError
from wamkit.models.base import LoraTargets, NamesLoraTargets, ParamGroup

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name: part of every adapter parameter's name
LORA_GROUP = "lora"


def _peft():
    try:
        import peft
    except ImportError:
        raise UserError(
            "train.lora needs peft: pip install 'wamkit[cosmos3]' (or pip install peft)"
        ) from None
    return peft


def _torchao_int8():
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise UserError(
            "train.lora.base=int8 needs torchao: pip install 'wamkit[lora-int8]' (or pip install torchao)"
        ) from None
    return Int8WeightOnlyConfig, quantize_


@dataclass(frozen=True)
class LoraSpec:
    """``train.lora`` resolved against a model: ``targets`` are whole module names, ``alpha`` a number."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    full_groups: tuple[str, ...] = ()
    base: str = "bf16"  # train.lora.base: the adapted layers' frozen weights' format

    def to_meta(self) -> dict[str, Any]:
        """What a checkpoint records (``meta.json``'s ``lora``): export rebuilds the layers from it."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "full_groups": list(self.full_groups),
            "base": self.base,
        }

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> LoraSpec:
        return cls(
            int(d["rank"]),
            float(d["alpha"]),
            float(d["dropout"]),
            tuple(d["targets"]),
            tuple(d["full_groups"]),
            d.get("base", "bf16"),  # checkpoints from before train.lora.base: a base in the compute dtype
        )


def _trained_linears(adapter, full_groups: tuple[str, ...]) -> list[str]:
    """Names of the linear layers whose weight full SFT trains, but those that train in full under LoRA."""
    groups = [g for g in adapter.param_groups() if g.name not in full_groups]
    trained = {id(p) for g in groups for p in g.params}
    return [
        n for n, m in adapter.module.named_modules()
        if isinstance(m, torch.nn.Linear) and id(m.weight) in trained
    ]  # fmt: skip


def _matches(name: str, entry: str) -> bool:
    return name == entry or name.endswith("." + entry)  # peft's rule for a list of target names


def _short(names: list[str]) -> str:
    """Names as their last two dotted parts, once each (``self_attn.add_q_proj``, not every layer's)."""
    return ", ".join(sorted({".".join(n.split(".")[-2:]) for n in names}))


def resolve(cfg: LoraConfig, adapter) -> LoraSpec | None:
    """``train.lora`` against ``adapter``'s layers (None when off). An entry of ``target_modules`` adapts
    the layers it names that full SFT trains (``gate_proj`` in Cosmos3: the generation tower's, not the
    understanding tower's); one that names none is refused, naming the key and the layers it may name."""
    if cfg.rank == 0:
        return None
    named: LoraTargets | None = adapter.lora_targets() if isinstance(adapter, NamesLoraTargets) else None
    entries = tuple(cfg.target_modules) or (named.modules if named is not None else ())
    if not entries:
        raise ConfigError(
            f"train.lora.target_modules: model '{adapter.name}' names no layers for LoRA; list the linear "
            "layers to adapt"
        )
    full = named.full_groups if named is not None else ()
    allowed = _trained_linears(adapter, full)
    frozen = [
        n for n, m in adapter.module.named_modules() if isinstance(m, torch.nn.Linear) and n not in allowed
    ]  # fmt: skip
    targets: set[str] = set()
    for entry in entries:
        hits = [n for n in allowed if _matches(n, entry)]
        if not hits:
            if any(_matches(n, entry) for n in frozen):
                why = "names frozen layers (LoRA adapts only layers that full SFT trains)"
            else:
                why = f"matches no linear layer of {adapter.name}"
            raise ConfigError(
                f"train.lora.target_modules: {entry!r} {why}; the layers it may name end in: {_short(allowed)}"
            )
        targets.update(hits)
    alpha = cfg.alpha or float(cfg.rank)
    return LoraSpec(cfg.rank, alpha, cfg.dropout, tuple(sorted(targets)), tuple(full), cfg.base)


def initial_value(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """An adapter tensor's value at step 0 (see the module docstring), fp32 on the CPU."""
    if f".lora_B.{ADAPTER}." in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


class LoraWeights:
    """A model's weight source (:mod:`wamkit.models.weights`) as the adapted model names its tensors:
    an adapted layer's ``weight``/``bias`` under ``<layer>.base_layer.``, and each adapter tensor with its
    :func:`initial_value`."""

    def __init__(self, base, spec: LoraSpec, adapters: dict[str, tuple[int, ...]], seed: int):
        self.base, self.adapters, self.seed = base, adapters, seed
        have = base.shapes()
        self._renamed = {
            f"{t}.base_layer.{leaf}": f"{t}.{leaf}"
            for t in spec.targets
            for leaf in ("weight", "bias")
            if f"{t}.{leaf}" in have
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        have = self.base.shapes()
        old = set(self._renamed.values())
        out = {k: v for k, v in have.items() if k not in old}
        out.update({new: have[o] for new, o in self._renamed.items()})
        out.update(self.adapters)
        return out

    def where(self, name: str) -> str:
        if name in self.adapters:
            return f"LoRA's initial values (seed {self.seed})"
        return self.base.where(self._renamed.get(name, name))

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.adapters:
            return initial_value(name, self.adapters[name], self.seed)[start:stop]
        return self.base.read(self._renamed.get(name, name), start, stop)


def _is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


@dataclass
class Lora:
    """The adapters put into a model: ``groups`` is what trains (the fully trained groups, then the
    adapters as one group), ``wrap`` the view of the model's weight source a meta-built model is filled
    from."""

    spec: LoraSpec
    tuner: Any  # peft's LoraModel over adapter.module (the module itself was changed in place)
    groups: list[ParamGroup]
    seed: int
    adapters: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def wrap(self, source) -> LoraWeights:
        return LoraWeights(source, self.spec, self.adapters, self.seed)

    def merge(self) -> None:
        """Fold the adapters into their layers' weights and put the plain layers back (in place)."""
        self.tuner.merge_and_unload()

    def int8_weights(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The frozen weights :func:`quantize_base` will store in int8 (none for a bf16 base), for the
        memory plan; on any device (meta too)."""
        if self.spec.base != "int8":
            return []
        return [layer.weight for layer in _base_layers(module, self.spec).values()]


def inject(adapter, spec: LoraSpec, seed: int = 0) -> Lora:
    """peft's LoRA layers into ``adapter.module`` in place (before it is sharded); the fully trained
    groups train again (peft freezes every other parameter), the adapters of a model built whole take
    their initial values now, those of a meta-built one when it is filled (:meth:`Lora.wrap`)."""
    peft = _peft()
    module = adapter.module
    have = {g.name: g for g in adapter.param_groups()}
    unknown = [n for n in spec.full_groups if n not in have]
    if unknown:
        raise RuntimeError(f"{adapter.name}: lora_targets() names param groups it does not have: {unknown}")
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.targets),
        init_lora_weights=False,  # the values are ours (initial_value): the same on meta and off it
        bias="none",
    )
    # low_cpu_mem_usage: the adapters are made on the meta device, drawing nothing from the global RNG
    tuner = peft.LoraModel(module, config, ADAPTER, low_cpu_mem_usage=True)
    full = [have[n] for n in spec.full_groups]
    for g in full:
        for p in g.params:
            p.requires_grad_(True)
    _materialise(module, seed)  # before the groups are taken: to_empty makes new parameters
    named = [(n, p) for n, p in module.named_parameters() if _is_adapter(n)]
    lora = Lora(spec, tuner, [*full, ParamGroup(LORA_GROUP, [p for _, p in named])], seed)
    lora.adapters = {n: tuple(p.shape) for n, p in named}
    n_adapter = sum(math.prod(s) for s in lora.adapters.values())
    n_full = sum(p.numel() for g in full for p in g.params)
    log.info(
        "LoRA rank %d (alpha %g, dropout %g) in %d layers: %.2fM adapter parameters; in full: %s (%.2fM)",
        spec.rank, spec.alpha, spec.dropout, len(spec.targets), n_adapter / 1e6,
        ", ".join(spec.full_groups) or "nothing", n_full / 1e6,
    )  # fmt: skip
    return lora


@torch.no_grad()
def _materialise(module: torch.nn.Module, seed: int) -> None:
    """The adapters of a model whose weights exist: on their layer's device, with their initial values."""
    peft = _peft()
    for layer in module.modules():
        if not isinstance(layer, peft.tuners.lora.LoraLayer):
            continue
        dev = layer.get_base_layer().weight.device
        if dev.type == "meta":
            continue  # filled with the rest of the model, from LoraWeights
        for part in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            part.to_empty(device=dev)
    for name, p in module.named_parameters():
        if _is_adapter(name) and not p.is_meta:
            p.copy_(initial_value(name, tuple(p.shape), seed))


def apply(adapter, cfg: LoraConfig, seed: int = 0) -> Lora | None:
    """``train.lora`` on ``adapter``: resolved (:func:`resolve`) and injected (:func:`inject`); None when off."""
    spec = resolve(cfg, adapter)
    return None if spec is None else inject(adapter, spec, seed)


def check_same(saved: dict[str, Any] | None, current: LoraSpec | None, what: str) -> None:
    """Refuse ``what`` (a resume) under other LoRA settings than the checkpoint's, naming the key."""
    if saved is None and current is None:
        return
    if saved is None:
        raise ConfigError(
            f"{what}: train.lora.rank={current.rank}, but the checkpoint was trained without LoRA (full SFT); "
            "resume it with train.lora.rank=0"
        )
    if current is None:
        raise ConfigError(
            f"{what}: the checkpoint holds LoRA adapters (train.lora.rank={saved['rank']}, "
            f"train.lora.alpha={saved['alpha']:g}); resume it with the same train.lora"
        )
    now = current.to_meta()
    saved = {"base": "bf16", **saved}
    for key, cfg_key in (
        ("rank", "rank"),
        ("alpha", "alpha"),
        ("targets", "target_modules"),
        ("base", "base"),
    ):
        if saved[key] != now[key]:
            mine, theirs = now[key], saved[key]
            if key == "targets":
                mine = f"{len(mine)} layers" if len(mine) > 3 else mine
                theirs = f"{len(theirs)} layers ({_short(theirs)})" if len(theirs) > 3 else theirs
            raise ConfigError(
                f"{what}: train.lora.{cfg_key} is {mine} in this run but {theirs} in the checkpoint; "
                "resume it with the same train.lora"
            )


def _base_layers(module: torch.nn.Module, spec: LoraSpec) -> dict[str, torch.nn.Module]:
    return {t: module.get_submodule(t).get_base_layer() for t in spec.targets}


@torch.no_grad()
def quantize_base(module: torch.nn.Module, spec: LoraSpec) -> list[torch.nn.Parameter]:
    """The adapted layers' frozen weights (filled, on their device) in ``spec.base``'s format, in place;
    returns the quantized weights (none for ``bf16``). ``int8``: torchao's weight-only int8, per output
    row ``q = round(W / s)``, clamped to [-128, 127], with ``s = max|W_row| / 127.5`` (symmetric: its
    zero point is 0), ``s`` in fp32 (in a bf16 run too); the forward computes ``(x q^T) s``: each weight moves
    by at most ``s / 2``, 1/255 of its row's largest."""
    if spec.base == "bf16":
        return []
    config, quantize = _torchao_int8()
    layers = _base_layers(module, spec)
    mine = {id(m) for m in layers.values()}
    quantize(module, config(), filter_fn=lambda m, _fqn: id(m) in mine)
    weights = [m.weight for m in layers.values()]
    log.info(
        "the adapted layers' base in int8 (torchao, weight-only): %.2f GB in %d layers",
        sum(stored_bytes(w) for w in weights) / 1e9, len(weights),
    )  # fmt: skip
    return weights


@torch.no_grad()
def round_base(module: torch.nn.Module, spec: LoraSpec) -> None:
    """The adapted layers' weights as a run over ``spec.base`` saw them, in their own dtype (int8:
    quantized, then dequantized), so that a merge gives the model the run trained; in place."""
    if not quantize_base(module, spec):
        return
    for layer in _base_layers(module, spec).values():
        layer.weight = torch.nn.Parameter(layer.weight.dequantize(), requires_grad=False)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds, a torchao quantized one's parts (its int8 values, scales, zero points) too."""
    flatten = getattr(t, "__tensor_flatten__", None)  # a tensor subclass's inner tensors
    if flatten is None:
        return t.numel() * t.element_size()
    return sum(stored_bytes(getattr(t, name)) for name in flatten()[0])
