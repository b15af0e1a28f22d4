"""The serving memory plan: what a served model keeps, where, and whether it fits a device.

For a model with a text tower of its own (:class:`~wamkit.models.base.PlacesTextTower`: Cosmos3's
understanding tower, which computes a prompt's keys/values once), per device size:

| category | bytes | where |
| --- | --- | --- |
| generation tower and heads | the weights the denoising step reads, in the serving dtype | device |
| understanding tower | its weights (embeddings and LM head included) | device, or host (``serve.text_tower=host``) |
| streamed layer slots | two copies of its largest layer (host placement only) | device |
| VAE | the image encoder | device |
| text K/V cache | ``model.options.text_cache_size`` prompts at the nominal caption's length | device |
| batch at max_batch | text keys/values of a call and of every captured bucket, and one layer's working set (an estimate) | device |
| reserve | 3 GiB + 5% of the device (CUDA context, cuBLAS workspace, compiled code, fragmentation) | device |

``serve.text_tower=auto`` picks ``device`` where the whole model fits, else ``host``. A size where
neither fits is refused before anything is built, naming what would with the tower in host memory:
the largest ``serve.max_batch`` (the asked one, then the powers of two below it), with the largest
``model.options.text_cache_size`` (the model's, then 64, 32, 16 prompts), or saying that nothing
does. The sizes come from the model built on the meta device: nothing is read or allocated.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from wamkit.config import ConfigError, ModelConfig
from wamkit.device import RESERVE_FIXED, RESERVE_FRACTION, GiB, MiB, device_budget, parse_size
from wamkit.models.base import ModelIO, PlacesTextTower, ServingFootprint

log = logging.getLogger(__name__)

PLACEMENTS = ("device", "host")


@dataclasses.dataclass(frozen=True)
class ServePlan:
    """Bytes per category of one placement (``text_tower``: device | host) at ``max_batch``."""

    text_tower: str
    max_batch: int
    cache_size: int  # prompts the text K/V cache holds
    dtype: str  # the weights'
    device_bytes: int
    device_type: str
    rows: list[tuple[str, int, str]]  # (category, bytes, "device" | "host")

    @property
    def device_total(self) -> int:
        return sum(b for _, b, where in self.rows if where == "device")

    @property
    def host_total(self) -> int:
        return sum(b for _, b, where in self.rows if where == "host")

    @property
    def fits(self) -> bool:
        return self.device_type != "cuda" or self.device_total <= self.device_bytes

    def table(self) -> str:
        unit, size = ("GiB", GiB) if self.device_total >= GiB else ("MiB", MiB)
        lines = [
            f"serving plan: serve.text_tower={self.text_tower}, serve.max_batch={self.max_batch}, "
            f"text cache of {self.cache_size} prompts, {self.dtype} weights, {self.device_bytes / GiB:.1f} GiB device",
            f"  {'category':<32} {unit:>8}  where",
        ]
        lines += [f"  {cat:<32} {b / size:>8.2f}  {where}" for cat, b, where in self.rows]
        line = f"  device total {self.device_total / GiB:.2f} GiB of {self.device_bytes / GiB:.1f}"
        lines.append(line + ("" if self.fits else "  -> does not fit"))
        if self.host_total:
            lines.append(
                f"  host {self.host_total / GiB:.2f} GiB (the understanding tower; its layers pinned)"
            )
        return "\n".join(lines)


def plan_for(
    fp: ServingFootprint,
    text_tower: str,
    max_batch: int,
    device_bytes: int,
    device_type: str = "cuda",
    cache_size: int = 0,
) -> ServePlan:
    """The plan of one placement from the model's footprint at ``max_batch``, its text cache holding
    ``cache_size`` prompts (0: the model's own size)."""
    if text_tower not in PLACEMENTS:
        raise ValueError(f"text_tower {text_tower!r}; expected one of {PLACEMENTS}")
    host = text_tower == "host"
    cache_size = cache_size or fp.text_cache_size
    rows = [
        ("generation tower and heads", fp.weights, "device"),
        ("understanding tower", fp.text_tower, "host" if host else "device"),
    ]
    if host:
        rows.append(("streamed layer slots (2)", 2 * fp.text_layer, "device"))
    rows += [
        ("VAE", fp.vae, "device"),
        (f"text K/V cache ({cache_size} prompts)", cache_size * fp.text_prompt, "device"),
        (f"batch at max_batch {max_batch} (estimate)", fp.batch, "device"),
    ]
    if device_type == "cuda":
        rows.append(("reserve", int(RESERVE_FIXED + RESERVE_FRACTION * device_bytes), "device"))
    return ServePlan(text_tower, max_batch, cache_size, fp.dtype, device_bytes, device_type, rows)


@dataclasses.dataclass(frozen=True)
class Pick:
    """What a device size gets: the plan picked, or, where nothing asked for fits, the plan asked for
    and ``instead``, the host placement with the settings that fit (None: none does)."""

    plan: ServePlan
    fits: bool
    instead: ServePlan | None = None

    def settings(self) -> str:
        """The settings of ``instead`` that differ from the plan asked for."""
        p, q = self.plan, self.instead
        out = ["serve.text_tower=host"]
        if q.max_batch != p.max_batch:
            out.append(f"serve.max_batch={q.max_batch}")
        if q.cache_size != p.cache_size:
            out.append(f"model.options.text_cache_size={q.cache_size}")
        return " ".join(out)

    def summary(self) -> str:
        p = self.plan
        if self.fits:
            return f"serve.text_tower={p.text_tower} ({p.device_total / GiB:.1f} GiB of {p.device_bytes / GiB:.1f})"
        if self.instead is not None:
            q = self.instead
            return (
                f"does not fit as asked; {self.settings()} fits ({q.device_total / GiB:.1f} GiB of "
                f"{q.device_bytes / GiB:.1f})"
            )
        return "nothing fits: not even serve.text_tower=host at serve.max_batch=1"


def _smaller(n: int, steps: tuple[int, ...] = ()) -> list[int]:
    """``n``, then the powers of two below it (``steps``: the given sizes below ``n`` instead)."""
    below = (
        [s for s in steps if s < n] if steps else [1 << i for i in range(n.bit_length()) if 1 << i < n][::-1]
    )
    return [n, *below]


def pick(
    adapter: PlacesTextTower,
    setting: str,
    max_batch: int,
    device_bytes: int,
    device_type: str,
    built_on: str | None = None,
) -> Pick:
    """The placement for ``serve.text_tower=setting`` (auto: device where it fits, else host); where
    none fits, the host placement with the largest batch, then the largest text cache, that does.
    ``built_on``: the device type the weights are built on (default ``device_type``; a serving
    directory: the CPU, :func:`served_model`)."""
    built_on = built_on or device_type
    fp = adapter.serving_footprint(max_batch, built_on)
    tries = PLACEMENTS if setting == "auto" else (setting,)
    plans = [plan_for(fp, t, max_batch, device_bytes, device_type) for t in tries]
    for plan in plans:
        if plan.fits:
            return Pick(plan, True)
    for batch in _smaller(max_batch):
        fp_b = adapter.serving_footprint(batch, built_on)
        for cache in _smaller(fp.text_cache_size, (64, 32, 16)):
            q = plan_for(fp_b, "host", batch, device_bytes, device_type, cache)
            if q.fits:
                return Pick(plans[-1], False, q)
    return Pick(plans[-1], False)


def refusal(p: Pick) -> ConfigError:
    """The error a server meets where its plan does not fit, naming what would."""
    q = p.plan
    return ConfigError(
        f"serving plan: {q.device_total / GiB:.2f} GiB needed on a {q.device_bytes / GiB:.1f} GiB device with "
        f"serve.text_tower={q.text_tower} at serve.max_batch={q.max_batch}; "
        + (
            f"{p.settings()} fits"
            if p.instead is not None
            else "nothing fits this device (not even host at batch 1)"
        )
        + "\n"
        + q.table()
    )


def planning_adapter(model: ModelConfig, io: ModelIO | None) -> Any:
    """The model built on the meta device for planning (nothing read or allocated), or None for a model
    whose builder does not build there: a model that keeps its text tower on the host is planned from
    shapes, so it builds on meta; any other is served whole on the device."""
    from wamkit.models import build_model
    from wamkit.models.registry import builds_on_meta

    return build_model(model, io, device="meta") if builds_on_meta(model.name) else None


def served_model(
    export_dir: str | None, model: ModelConfig, io: ModelIO | None
) -> tuple[ModelConfig, ModelIO | None, str | None]:
    """The model a server would serve and the device type its weights are built on: a serving
    directory's (its ``model.json``; loaded on the CPU, then moved: ``"cpu"``), else ``model`` (built
    on the serving device: None)."""
    if not export_dir:
        return model, io, None
    from wamkit.models.pretrained import read_model_json

    meta = read_model_json(Path(export_dir))  # only model.json is read: a plan needs no weights
    cfg = ModelConfig(name=meta["name"], preset=meta["preset"], options=meta["options"])
    return cfg, ModelIO.from_dict(meta["io"]), "cpu"


def resolve_text_tower(
    setting: str,
    model: ModelConfig,
    io: ModelIO | None,
    built_on: str | None,
    device: torch.device,
    max_batch: int,
) -> str:
    """``serve.text_tower`` resolved for this device, before the model is built: ``device`` or
    ``host``; a placement that does not fit is refused (:func:`refusal`). On a CPU the host is the
    device: ``auto`` is ``device``."""
    if setting == "device" or (setting == "auto" and device.type != "cuda"):
        return "device"
    adapter = planning_adapter(model, io)
    if not isinstance(adapter, PlacesTextTower):
        if setting == "host":
            raise ConfigError(
                f"serve.text_tower=host: model {model.name!r} has no separate text tower to keep in host "
                "memory; use serve.text_tower=device (or auto)"
            )
        return "device"
    if device.type != "cuda":
        return setting
    p = pick(adapter, setting, max_batch, device_budget(device), "cuda", built_on)
    if not p.fits:
        raise refusal(p)
    log.info("serving plan: %s\n%s", p.summary(), p.plan.table())
    return p.plan.text_tower


def print_plan(
    model: ModelConfig,
    io: ModelIO | None,
    built_on: str | None,
    setting: str,
    max_batch: int,
    device_memory: str,
) -> None:
    """``wamkit serve ... --plan``: per ``--device-memory`` size (comma-separated), the table of the
    placement picked and a line saying what it is; then one summary line per size. One size whose plan
    does not fit is refused (ConfigError), as a server would be there."""
    sizes = [
        (parse_size(s.strip(), "--device-memory"), s.strip()) for s in device_memory.split(",") if s.strip()
    ]
    if not sizes:
        raise ConfigError("--plan needs --device-memory SIZE[,SIZE...] (e.g. 24GB,48GB,80GB,141GB)")
    adapter = planning_adapter(model, io)
    if not isinstance(adapter, PlacesTextTower):
        raise ConfigError(
            f"--plan: model {model.name!r} has no serving memory plan (it has no separate text tower)"
        )
    print(f"{model.name}/{model.preset}: serve.text_tower={setting}, serve.max_batch={max_batch}")
    if len(sizes) == 1:  # one device: its plan, or the refusal a server would meet there
        p = pick(adapter, setting, max_batch, sizes[0][0], "cuda", built_on)
        if not p.fits:
            raise refusal(p)
    lines = []
    for nbytes, label in sizes:
        p = pick(adapter, setting, max_batch, nbytes, "cuda", built_on)
        shown = p.plan.table() + (f"\n{p.instead.table()}" if p.instead is not None else "")
        print(f"== {label} device ==\n{shown}\n  picks: {p.summary()}\n")
        lines.append(f"  {label}: {p.summary()}")
    print("what fits:")
    print("\n".join(lines))
