"""Process group set-up and FSDP2 sharding.

One code path for every launch: without torchrun the trainer starts a process group of size one, so a
one-process run shards, checkpoints and resumes exactly like an N-process one (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from wamkit.config import RESHARD_CHOICES, ConfigError
from wamkit.device import resolve_device
from wamkit.models.base import ParamGroup
from wamkit.models.base import compile_blocks as compile_regions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    started_group: bool  # True if this process created the group (and must destroy it)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(name: str, local_rank: int) -> torch.device:
    """``train.device`` for this process (see :mod:`wamkit.device`); a GPU becomes the current one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(name, "train.device", local_rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_distributed(device_name: str = "auto") -> DistInfo:
    """Join the torchrun group (RANK/WORLD_SIZE set) or start a group of one on a free local port."""
    if not dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = pick_device(device_name, local_rank)
        kwargs: dict = {"backend": "nccl" if device.type == "cuda" else "gloo"}
        if device.type == "cuda":
            kwargs["device_id"] = device
        if "RANK" not in os.environ:  # not under torchrun: a group of one, leaving os.environ alone
            kwargs.update(init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        dist.init_process_group(**kwargs)
        started = True
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = pick_device(device_name, local_rank)
        started = False
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, started)


def shutdown(info: DistInfo) -> None:
    if info.started_group and dist.is_initialized():
        dist.destroy_process_group()


class LossModule(torch.nn.Module):
    """The FSDP root: its ``forward(batch)`` is the adapter's ``sft_loss``.

    FSDP2 gathers the root's own parameters in the root's forward hook; adapters compute their loss
    through their own methods, not ``module.forward``, so the trainer calls this wrapper instead. The
    adapter's module is a child (``inner``); state dicts are taken from it, so names carry no prefix.
    """

    def __init__(self, adapter, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.adapter = [adapter]  # a list keeps the adapter out of the module tree
        self.inner = adapter.module
        self.autocast_dtype = autocast_dtype

    def forward(self, batch):
        if self.autocast_dtype is None:
            return self.adapter[0].sft_loss(batch)
        # With bf16 parameters (MixedPrecisionPolicy) every float32 tensor an adapter makes inside its
        # loss (pixels, noise, time embeddings) would meet bf16 weights; autocast reconciles them the
        # same way for every model, so adapters need no dtype plumbing of their own.
        device_type = next(self.inner.parameters()).device.type
        with torch.autocast(device_type, dtype=self.autocast_dtype):
            return self.adapter[0].sft_loss(batch)


def apply_fsdp(
    module: torch.nn.Module,
    blocks: list[torch.nn.Module],
    device: torch.device,
    precision: str,
    reshard: str = "auto",
    ignored: set[torch.nn.Parameter] | None = None,
) -> torch.nn.Module:
    """``fully_shard`` each block, then the root, over all ranks.

    The module may come in on the CPU: ``fully_shard`` moves each block's parameters to ``device`` as it
    shards them, so a model larger than one device is never whole on it. bf16 keeps fp32 master weights
    and optimizer state, computes in bf16 and reduces gradients in fp32 (GPU only). Blocks compiled
    before (:func:`wamkit.models.base.compile_blocks`) keep FSDP's hooks outside their graph.
    ``reshard``: ``train.reshard_after_forward``. ``ignored``: parameters FSDP2 leaves as they are (a
    quantized frozen base, :func:`wamkit.train.lora.quantize_base`): neither sharded, cast nor moved.
    """
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if precision == "bf16":
        if device.type != "cuda":
            raise ConfigError("train.precision=bf16 needs a CUDA device; use train.precision=fp32 on the CPU")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    if reshard not in RESHARD_CHOICES:
        raise ConfigError(
            f"train.reshard_after_forward={reshard!r}; expected one of {', '.join(RESHARD_CHOICES)}"
        )
    several = dist.get_world_size() > 1 if reshard == "auto" else reshard == "always"
    for i, block in enumerate(blocks):
        # auto: the last block is not resharded after forward: backward needs it at once, and FSDP
        # would all-gather it again immediately. With one rank nothing is resharded: the "all-gather"
        # is a copy and a bf16 cast of every weight, which backward would otherwise pay a second time.
        last = reshard == "auto" and i == len(blocks) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=mp, reshard_after_forward=several and not last, ignored_params=ignored
        )
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=several, ignored_params=ignored)
    return module


def shard_adapter(
    adapter,
    device: torch.device,
    precision: str,
    compile_blocks: bool = False,
    reshard: str = "auto",
    groups: list[ParamGroup] | None = None,
    ignored: set[torch.nn.Parameter] | None = None,
) -> tuple[LossModule, list[ParamGroup], dict[str, torch.nn.Parameter]]:
    """Freeze what ``groups`` (by default ``param_groups()``; LoRA gives its own) leaves out, shard, and
    return ``(root, groups, trained)``. ``ignored``: frozen parameters FSDP2 leaves alone (:func:`apply_fsdp`).

    ``fully_shard`` replaces parameters with DTensor ones, so groups are rebuilt by parameter name
    afterwards; ``trained`` maps name -> sharded parameter (what the optimizer and the EMA see).
    """
    module = adapter.module
    name_of = {id(p): n for n, p in module.named_parameters()}
    named = []
    for g in adapter.param_groups() if groups is None else groups:
        missing = [i for i, p in enumerate(g.params) if id(p) not in name_of]
        if missing:
            raise ValueError(
                f"param group '{g.name}' holds parameters that are not in the model ({missing[:3]})"
            )
        named.append((g, [name_of[id(p)] for p in g.params]))
    trained_names = {n for _, names in named for n in names}
    for n, p in module.named_parameters():
        if n not in trained_names:
            p.requires_grad_(False)  # frozen: never in the optimizer, no gradient computed
    if compile_blocks:
        compile_regions(adapter)
    root = apply_fsdp(
        LossModule(adapter, torch.bfloat16 if precision == "bf16" else None),
        adapter.blocks(),
        device,
        precision,
        reshard,
        ignored,
    )
    params = dict(module.named_parameters())
    groups = [ParamGroup(g.name, [params[n] for n in names], g.lr_mult, g.weight_decay) for g, names in named]
    trained = {n: params[n] for _, names in named for n in names}
    return root, groups, trained
