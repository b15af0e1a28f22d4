"""One device resolver for every stage (train, serve, infer, bench): the same names mean the same thing.

Names: ``auto`` (a GPU when one is visible, else the CPU), ``cpu``, ``cuda`` (the process's GPU: under
torchrun the local rank's), ``cuda:N`` (GPU N; with several processes on one host each would need its
own, so a multi-process run refuses it).
"""

from __future__ import annotations

import re

import torch

from wamkit.config import ConfigError

GiB = 2**30
MiB = 2**20
# what a CUDA device keeps beyond what a plan places on it: the context and the allocator's slack
# (train/memory.py and serve/plan.py budget with it)
RESERVE_FIXED = 3 * GiB
RESERVE_FRACTION = 0.05


def resolve_device(name: str, key: str = "device", local_rank: int = 0, processes: int = 1) -> torch.device:
    """The torch device ``name`` means here; ``key`` names the setting in errors."""
    kind, _, index = name.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"{key}: {name!r} is not one of auto, cpu, cuda, cuda:N")
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{key}: {name!r} asked for, but no CUDA device is visible")
    if index:
        if processes > 1:
            raise ConfigError(f"{key}: {name!r} names one GPU, but {processes} processes run; use cuda")
        if int(index) >= torch.cuda.device_count():
            raise ConfigError(f"{key}: {name!r} but {torch.cuda.device_count()} CUDA device(s) are visible")
        return torch.device("cuda", int(index))
    return torch.device("cuda", local_rank)


def host_buffer(shape: int | tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32):
    """An uninitialised host tensor for :func:`to_device`, pinned where ``device`` is a GPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.device(device).type == "cuda")


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` by a copy that does not wait for the work already queued there: on a GPU
    from pinned memory, asynchronously (:func:`host_buffer` is pinned already; anything else is pinned
    first). A plain ``.to(cuda)`` from pageable memory, ``torch.tensor(..., device=cuda)`` included,
    waits until the GPU has finished everything queued before it; on the CPU ``host`` itself."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def proc_status(pid: int | str = "self") -> dict[str, str]:
    """A process's ``/proc/<pid>/status`` fields (Linux), values as written ("123 kB"); FileNotFoundError
    for a process that has gone."""
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


def status_bytes(status: dict[str, str], key: str) -> int:
    """A ``kB`` field of :func:`proc_status` in bytes (0 where absent)."""
    return int(status.get(key, "0 kB").split()[0]) * 1024


def meminfo_bytes(key: str) -> int:
    """A field of this host's ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {key}")


SLAB_BYTES = 1 << 30
_ALIGN = 64


class PinnedArena:
    """Pinned host memory handed out from 1 GiB slabs.

    torch's pinned allocator rounds every block up to a power of two (``CachingHostAllocator``), so
    tensors pinned one by one take up to twice their size: 78 GB of Nano moments and EMA held 108 GB
    of host memory that way. A slab is itself a power of two, and tensors are cut from it back to back
    (larger ones get a block of their own)."""

    def __init__(self, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        self.slab_bytes, self.pin = slab_bytes, pin
        self._slab: torch.Tensor | None = None
        self._used = 0
        self.reserved = 0  # bytes of pinned memory taken

    def zeros(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        n = max(1, int(torch.Size(shape).numel())) * torch.empty((), dtype=dtype).element_size()
        if n > self.slab_bytes // 4:
            self.reserved += n
            return torch.zeros(shape, dtype=dtype, pin_memory=self.pin)
        if self._slab is None or self._used + n > self.slab_bytes:
            self._slab = torch.empty(self.slab_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._used = 0
            self.reserved += self.slab_bytes
        part = self._slab[self._used : self._used + n]
        self._used += -(-n // _ALIGN) * _ALIGN
        out = part.view(dtype)[: torch.Size(shape).numel()].view(shape)
        return out.zero_()


# CUDA device index -> the card size this process stands in for (emulate_card)
_CARD_BYTES: dict[int, int] = {}
# memory the driver gives a process after its allocator is capped (kernels loaded lazily, cuBLAS and
# NCCL state); a margin, not a measurement: `wamkit bench train` prints the driver's peak and how much
# of it lay outside the allocator, which is the check
KERNEL_ALLOWANCE = 1 << 30


def emulate_card(device: torch.device, size: int, allowance: int = KERNEL_ALLOWANCE) -> int:
    """Make this process stand in for a card of ``size`` bytes, as the driver counts them (the CUDA
    context included): memory plans read ``size`` (:func:`device_budget`), and the caching allocator is
    capped at what a process on such a card would have: ``size`` less what the driver reports in use now
    (this process's context, and any other process's memory) and ``allowance`` for what the driver gives
    the process later outside the allocator. Returns the allocator's cap."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)  # makes the context: it is in the figure
    cap = size - (total - free) - allowance
    if size > total or cap <= 0:
        raise ConfigError(
            f"device memory {size / 2**30:.2f} GiB: this device has {total / 2**30:.2f} GiB, "
            f"{(total - free) / 2**30:.2f} GiB in use now; a card that size cannot be stood in for"
        )
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    _CARD_BYTES[device.index or 0] = size
    return cap


def device_budget(device: torch.device) -> int:
    """A CUDA device's memory as this process may use it: the card :func:`emulate_card` stands in for
    (``wamkit bench train --device-memory``), else its total times the fraction
    ``torch.cuda.set_per_process_memory_fraction`` set (a user's own cap)."""
    device = torch.device(device)
    if (device.index or 0) in _CARD_BYTES:
        return _CARD_BYTES[device.index or 0]
    props = torch.cuda.get_device_properties(device)
    # torch >= 2.8 says the fraction; before, the cap is not readable and the total is planned for
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _d: 1.0)(device)
    return int(props.total_memory * fraction)


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|tib|tb)?\s*$", re.IGNORECASE)
_UNITS = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40, "tb": 10**12, None: GiB}


def parse_size(text: str, what: str) -> int:
    """``"141GB"``, ``"80GiB"``, ``"139.8"`` (GiB) -> bytes; a ConfigError naming ``what`` otherwise."""
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}: {text!r} is not a size; expected e.g. 141GB, 80GiB or 139.8 (GiB)")
    unit = m.group(2).lower() if m.group(2) else None
    return int(float(m.group(1)) * _UNITS[unit])
