"""Optimizer state and EMA in host memory, streamed through the device at each optimizer step.

Both are touched once per optimizer step, which with the recipe's global batch comes every 8–256
micro-batches: keeping them on the host frees their device memory (AdamW's moments are 8 bytes per
trained parameter, the EMA 4) for the cost of one pass over the PCIe bus per step.

The update itself runs on the device, with the very kernels the device-resident state would use
(torch's fused AdamW, ``torch._foreach_lerp_``), on chunks of about ``chunk_bytes``: chunk k+1 is
copied in on a side stream while chunk k is updated, and its result copied back behind it. So the
numbers are the same as without offload; only where the state rests between steps differs (and the
CPU, where the "device" is the host, still copies each chunk, so that the path is the one a GPU runs).

Host tensors keep the parameters' layout: a DTensor shard of FSDP2 gets a DTensor whose local tensor
is pinned host memory, as FSDP2's own CPU offload keeps its parameters, so DCP saves and loads the
state sharded exactly as it would on the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch.distributed.tensor import DTensor

from wamkit.device import PinnedArena

CHUNK_BYTES = 1 << 30


def local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


def host_like(
    p: torch.Tensor, dtype: torch.dtype = torch.float32, arena: PinnedArena | None = None
) -> torch.Tensor:
    """Zeros shaped as ``p``'s local part in host memory (pinned from ``arena`` when a GPU is there),
    wrapped as a DTensor of ``p``'s mesh and placements when ``p`` is one."""
    part = local(p)
    if torch.cuda.is_available():
        host = (arena or PinnedArena()).zeros(part.shape, dtype)
    else:
        host = torch.zeros(part.shape, dtype=dtype)
    if isinstance(p, DTensor):
        # DTensor's own constructor with p's spec, as FSDP2 builds its CPU-offloaded shards:
        # DTensor.from_local would move the local tensor to the mesh's device
        return DTensor(host, p._spec, requires_grad=False)
    return host


def _chunks(items: Sequence, size_of: Callable[[object], int], chunk_bytes: int) -> list[list]:
    out, cur, n = [], [], 0
    for it in items:
        cur.append(it)
        n += size_of(it)
        if n >= chunk_bytes:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def stream_update(
    host_sets: list[list[torch.Tensor]],
    device: torch.device,
    update: Callable[[list[int], list[list[torch.Tensor]]], None],
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Bring ``host_sets`` (per item, its host tensors) to ``device`` chunk by chunk, call
    ``update(item_indices, device_copies)`` to change the copies in place, and copy them back.

    On CUDA the copies in and out run on a side stream, overlapping the update of the chunk before;
    the call returns once every host tensor holds its result (a checkpoint may read it at once)."""
    if not host_sets:
        return
    order = list(range(len(host_sets)))
    chunks = _chunks(order, lambda i: sum(local(t).nbytes for t in host_sets[i]), chunk_bytes)
    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    main = torch.cuda.current_stream(device) if cuda else None

    def fetch(idx: list[int]):
        with torch.cuda.stream(side) if cuda else nullcontext():
            copies = [[local(t).to(device, non_blocking=True, copy=True) for t in host_sets[i]] for i in idx]
        ready = side.record_event() if cuda else None
        return copies, ready

    nxt = fetch(chunks[0])
    for k, idx in enumerate(chunks):
        copies, ready = nxt
        if k + 1 < len(chunks):
            nxt = fetch(chunks[k + 1])  # in flight while this chunk is updated
        if cuda:
            main.wait_event(ready)
            for ts in copies:
                for t in ts:
                    t.record_stream(main)  # allocated on the side stream, used on this one
        update(idx, copies)
        done = main.record_event() if cuda else None
        with torch.cuda.stream(side) if cuda else nullcontext():
            if cuda:
                side.wait_event(done)
            for i, ts in zip(idx, copies):
                for h, d in zip(host_sets[i], ts):
                    local(h).copy_(d, non_blocking=True)
    if cuda:
        torch.cuda.synchronize(device)


class HostAdamW(torch.optim.AdamW):
    """AdamW whose two moments live in host memory between steps (``train.offload=optimizer``).

    The same update as :class:`torch.optim.AdamW` with the same ``fused``/``foreach`` choice, run on the
    device chunk by chunk (:func:`stream_update`); ``step`` counters stay where torch keeps them. Its
    ``state_dict`` is torch's, so DCP checkpoints it like any optimizer.
    """

    def __init__(self, params, *, device: torch.device, chunk_bytes: int = CHUNK_BYTES, **kwargs):
        super().__init__(params, **kwargs)
        self.device, self.chunk_bytes = torch.device(device), chunk_bytes
        self.arena = PinnedArena()

    def _new_state(self, p: torch.Tensor, group: dict) -> dict:
        on_device = group["fused"] or group["capturable"]
        step = (
            torch.zeros((), dtype=torch.float32, device=local(p).device)
            if on_device
            else torch.tensor(0.0, dtype=torch.float32)
        )
        return {
            "step": step,
            "exp_avg": host_like(p, arena=self.arena),
            "exp_avg_sq": host_like(p, arena=self.arena),
        }

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostAdamW.step takes no closure")
        from torch.optim.adam import adam

        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if not self.state[p]:
                    self.state[p] = self._new_state(p, group)
            beta1, beta2 = group["betas"]

            def update(idx, copies, params=params, group=group, beta1=beta1, beta2=beta2):
                chosen = [params[i] for i in idx]
                adam(
                    [local(p) for p in chosen],
                    [local(p.grad) for p in chosen],
                    [c[0] for c in copies],
                    [c[1] for c in copies],
                    [],
                    [local(self.state[p]["step"]) for p in chosen],
                    amsgrad=False,
                    has_complex=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                    foreach=group["foreach"],
                    capturable=group["capturable"],
                    differentiable=False,
                    fused=group["fused"],
                    decoupled_weight_decay=True,
                )

            host_sets = [[self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]] for p in params]
            stream_update(host_sets, self.device, update, self.chunk_bytes)
        return None

    def offloaded(self) -> bool:
        """Every moment is in host memory (a load may have put them on the device: :meth:`rehost`)."""
        return all(local(s["exp_avg"]).device.type == "cpu" for s in self.state.values() if s)

    @torch.no_grad()
    def rehost(self) -> None:
        """Move moments that a ``load_state_dict`` placed beside their parameters back to the host."""
        for p, s in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in s and local(s[key]).device.type != "cpu":
                    h = host_like(p, s[key].dtype, self.arena)
                    local(h).copy_(local(s[key]))
                    s[key] = h
