"""The SFT loop: one function, ``train(cfg)``, the same for one process and for N under torchrun.

Exact resume rests on three things: the schedule is a function of the step, every source of randomness
(python, numpy, torch per rank, the loader position) is in the checkpoint, and nothing in the loop
depends on wall time. Per-step losses stay on the device until a log interval, where one collective
averages them over ranks and one host copy brings them back (no sync per step; a non-finite loss is
caught there, before any checkpoint could save it).
"""

from __future__ import annotations

import json
import logging
import random
import resource
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from wamkit.config import ConfigError, RunConfig, UserError, save_config, to_dict
from wamkit.files import CONFIG_FILE, MODEL_FILE, SPEC_FILE, model_json
from wamkit.log import close_file_logs, setup_logging
from wamkit.models.base import HasPretrainedBase, ModelAdapter, ModelIO, NeedsSampleExtras
from wamkit.train import base_weights, distill, memory
from wamkit.train import checkpoint as ckpt
from wamkit.train import lora as lora_
from wamkit.train.dist import DistInfo, init_distributed, shutdown
from wamkit.train.metrics import RunLogger, truncate_losses
from wamkit.train.optim import PowerEMA, build_optimizer, lr_factor, set_lr
from wamkit.train.placement import place_run, rss_anon_bytes

log = logging.getLogger(__name__)

AdapterFn = Callable[[RunConfig, ModelIO], ModelAdapter]
# (cfg, rank, world, run_dir) -> (io, spec_path, make_loader(future_frame_offsets, sample_extras, adapter)
# -> loader); the adapter reads a latent cache for the loader (wamkit.models.base.CachesLatents)
DataFn = Callable[
    [RunConfig, int, int, Path],
    tuple[ModelIO, Path, Callable[[tuple[int, ...], tuple[str, ...], ModelAdapter], Any]],
]


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm became NaN/inf; the run stops before saving it."""


def _default_adapter(cfg: RunConfig, io: ModelIO) -> ModelAdapter:
    """The registry's model, on the meta device where it can be (filled once sharded: placement)."""
    from wamkit.models import build_model
    from wamkit.models.registry import builds_on_meta

    if builds_on_meta(cfg.model.name):
        return build_model(cfg.model, io, device="meta")
    return build_model(cfg.model, io)


def _default_data(cfg: RunConfig, rank: int, world: int, run_dir: Path):
    from wamkit.train.data_setup import build_data

    return build_data(cfg, rank, world, run_dir)


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _loaded_in_place(osd: dict[str, Any], optimizer: torch.optim.Optimizer) -> bool:
    """Whether an optimizer state dict's tensors are the optimizer's own (so DCP's in-place load has
    already restored them); only asked of the host-offloaded optimizer."""
    if not getattr(optimizer, "offloaded", None):
        return False
    own = {id(v) for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)}
    given = [v for st in osd.get("state", {}).values() for v in st.values() if torch.is_tensor(v)]
    return bool(given) and all(id(v) in own for v in given)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class _Loop:
    """State of one run; ``run()`` trains to ``train.max_steps``."""

    def __init__(self, cfg: RunConfig, info: DistInfo, adapter_fn: AdapterFn, data_fn: DataFn):
        self.t_start = time.perf_counter()
        self.cfg, self.info, t = cfg, info, cfg.train
        self.run_dir = Path(t.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.accum = memory.accumulation_steps(cfg, info.world_size)
        # train.resume decided here, once, before anything is built (a large model takes minutes), on
        # every rank, so all of them stop on a bad one (none waits at a barrier): a fresh run refuses a
        # used folder; "auto" takes the newest complete checkpoint (or none); a path, its checkpoint
        if t.resume == "":
            ckpt.refuse_used_run_dir(self.run_dir, self.ckpt_root)
        resume_path = ckpt.resolve_resume(t.resume, self.ckpt_root)
        if info.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            setup_logging("info", str(self.run_dir / "train.log"))
            save_config(cfg, self.run_dir / CONFIG_FILE)
            ckpt.clean_stale(self.ckpt_root)
        else:
            logging.getLogger().setLevel(logging.WARNING)  # one voice: rank 0's
        dist.barrier()

        io, self.spec_path, make_loader = data_fn(cfg, info.rank, info.world_size, self.run_dir)
        _seed_all(t.seed)  # the same initial weights on every rank: each keeps its shard of them
        self.adapter = adapter_fn(cfg, io)
        module = self.adapter.module
        module.train()  # a model loaded from a folder comes in eval mode (dropout, a VAE's sampling off)
        # the base is named (and hashed) before LoRA renames the layers it adapts: their weights are the base's
        self.base = self._base()
        if t.lora.base != "bf16" and self.base is None:
            raise ConfigError(
                f"train.lora.base={t.lora.base}: {self.adapter.name} preset '{cfg.model.preset}' names no base "
                "that checkpoints could leave out (a random preset other than tiny), so they would hold the "
                "quantized weights; use model.pretrained, the tiny preset, or train.lora.base=bf16"
            )
        self.lora, placed = place_run(self.adapter, info, cfg)  # lora None: full SFT
        if t.distill_from:  # the student of a teacher's serving directory (wamkit.train.distill)
            distill.start(self.adapter, cfg, info.device)
        self.plan, self.root, groups, trained = placed.plan, placed.root, placed.groups, placed.trained
        self.trainable = list(trained.values())
        offload = self.plan.offload
        self.optimizer = build_optimizer(
            groups, t.lr, t.weight_decay, t.betas, fused=info.device.type == "cuda",
            host_device=info.device if offload == "optimizer" else None,
        )  # fmt: skip
        ema_host = info.device if offload in ("ema", "optimizer") else None
        self.ema = PowerEMA(trained, t.ema_power, t.ema_type, t.ema_rate, ema_host) if t.ema else None
        extras = tuple(self.adapter.sample_extras) if isinstance(self.adapter, NeedsSampleExtras) else ()
        self.loader = make_loader(tuple(self.adapter.future_frame_offsets), extras, self.adapter)
        _seed_all(t.seed + 1_000_003 * (info.rank + 1))  # per-rank noise in the loss
        self.step = 0
        self.saved: Path | None = None  # the newest checkpoint this run wrote
        self.pending: ckpt.PendingSave | None = None
        # DCP's background writer runs its collectives on a gloo group of its own, so that they never
        # interleave with the training's on the default group (NCCL or gloo) from another thread; made
        # at the first save (collective, as every save is)
        self.writer_group: dist.ProcessGroup | None = None
        self.n_params = sum(p.numel() for p in module.parameters())
        self.n_trainable = sum(p.numel() for p in self.trainable)

        self.lineage = self._fresh_lineage()
        if resume_path is not None:
            self._load(resume_path)
        elif t.resume == "auto":
            log.info("--resume auto: no complete checkpoint in %s, starting fresh", self.ckpt_root)
        if info.is_main:
            truncate_losses(self.run_dir, self.step)  # a fresh run also drops a killed run's tail
        self.logger = RunLogger(self.run_dir, self.step, t.max_steps, info.is_main)

    # ---------------------------------------------------------------------------------------------
    def _fresh_lineage(self) -> str:
        """Rank 0 draws it; every rank records the same one."""
        box = [ckpt.new_lineage() if self.info.is_main else ""]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _base(self) -> dict[str, Any] | None:
        """The adapter's base with its content hash (rank 0 hashes, every rank records the same)."""
        whole = self.cfg.train.lora.rank > 0  # under LoRA the adapted layers' weights are the base's too
        has_base = isinstance(self.adapter, HasPretrainedBase)
        box = [
            base_weights.resolve(self.adapter.base_reference(whole=whole), self.run_dir)
            if has_base and self.info.is_main
            else None
        ]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            log.info(
                "checkpoints leave the frozen weights out: their base is %s", base_weights.describe(box[0])
            )
        return box[0]

    def _state_options(self, load: bool = False) -> StateDictOptions:
        # with a base, frozen weights are never saved (nor loaded: they came from the base; torch then
        # loads non-strictly, and _load checks that only frozen names were left out)
        frozen_out = self.base is not None
        return StateDictOptions(ignore_frozen_params=frozen_out, strict=not (load and frozen_out))

    def _sharded(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.adapter.module, self.optimizer, options=self._state_options())
        state = {"model": msd, "optim": osd}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def _load(self, path: Path) -> None:
        meta = ckpt.read_meta(path)
        lora_.check_same(meta.get("lora"), self.lora.spec if self.lora else None, f"--resume {path}")
        base_weights.check_same(meta.get("base"), self.base, f"--resume {path}")
        state = self._sharded()
        rank_state = ckpt.load_checkpoint(path, state)
        if _loaded_in_place(state["optim"], self.optimizer):
            # DCP loaded the moments into the optimizer's own (host) tensors; torch's load_state_dict
            # would first move every one of them beside its parameter, on a GPU that has no room
            result = set_model_state_dict(
                self.adapter.module, state["model"], options=self._state_options(True)
            )
            log.info("optimizer state loaded in place, in host memory")
        else:
            result = set_state_dict(
                self.adapter.module,
                self.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=self._state_options(load=True),
            )
        frozen = {n for n, p in self.adapter.module.named_parameters() if not p.requires_grad}
        wrong = [k for k in result.missing_keys if k not in frozen] + list(result.unexpected_keys)
        if wrong:
            raise RuntimeError(f"{path}: the checkpoint's model state does not fit this model: {wrong[:5]}")
        rehost = getattr(self.optimizer, "rehost", None)
        if rehost is not None:  # torch's load_state_dict puts moments beside their parameters
            rehost()
        self.step = meta["step"]
        self.lineage = meta.get("lineage") or self.lineage  # a resumed run continues its lineage
        if rank_state:
            ckpt.set_rng_state(rank_state["rng"], self.info.device)
            self.loader.load_state_dict(rank_state["loader"])
        else:
            log.warning(
                "%s was written by another number of processes: weights, optimizer and step resume, but the "
                "data order and RNG streams start afresh (the run is not an exact continuation)",
                path,
            )
        log.info("resumed from %s at step %d", path, self.step)

    def _meta(self) -> dict[str, Any] | None:
        """What ``meta.json`` records besides the step: the base the frozen weights come from, LoRA's settings."""
        meta = {"base": self.base} if self.base is not None else {}
        if self.lora is not None:
            meta["lora"] = self.lora.spec.to_meta()
        return meta or None

    def _finish_save(self) -> None:
        """Complete the checkpoint being written, if any (before anything it holds changes)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        path = pending.finish()
        self.saved = Path(path)
        waited = time.perf_counter() - t0
        log.info(
            "saved %s: shards written in %.2f s beside training, %.2f s waited to finish", path,
            pending.write_s, waited,
        )  # fmt: skip
        self.logger.scalars(pending.step, {"time/save_write_s": pending.write_s, "time/save_wait_s": waited})

    def _save(self) -> None:
        self._finish_save()
        t0 = time.perf_counter()
        files = {
            # the format of wamkit.models.pretrained, so export rebuilds the model the same way
            MODEL_FILE: json.dumps(model_json(self.adapter.config_dict())),
            SPEC_FILE: self.spec_path.read_text(),
            CONFIG_FILE: yaml.safe_dump(to_dict(self.cfg), sort_keys=False),
        }
        rank_state = {"rng": ckpt.rng_state(self.info.device), "loader": self.loader.state_dict()}
        if self.cfg.train.async_save and self.writer_group is None:
            self.writer_group = dist.new_group(backend="gloo")
        self.pending = ckpt.begin_save(
            self.ckpt_root,
            self.step,
            self._sharded(),
            rank_state,
            files,
            self.cfg.train.keep_last,
            self.lineage,
            self._meta(),
            self.writer_group,
        )
        dt = time.perf_counter() - t0
        self.logger.scalars(self.step, {"time/save_s": dt})  # the time training stood still for it
        if self.writer_group is None:
            self._finish_save()
        else:
            log.info("checkpoint of step %d: written beside training; training stood still %.2f s to start it",
                     self.step, dt)  # fmt: skip

    # ---------------------------------------------------------------------------------------------
    def _next_batch(self) -> dict[str, Any]:
        # The loader's randomness is its own: a torch DataLoader draws its workers' base seed from the
        # global generator whenever it (re)starts, which a resumed run does at another step. Forking
        # the CPU generator keeps the training noise stream independent of when the loader restarts.
        with torch.random.fork_rng(devices=[]):
            try:
                return next(self._it)
            except StopIteration:  # a finite loader: start its next pass
                self._it = iter(self.loader)
                return next(self._it)

    def _one_step(self) -> tuple[dict[str, torch.Tensor], float, float]:
        """One optimizer step over ``accum`` micro-batches: (device scalars, lr, seconds waiting for data)."""
        t = self.cfg.train
        parts: dict[str, torch.Tensor] = {}
        t_data = 0.0
        for micro in range(self.accum):
            t0 = time.perf_counter()
            batch = _to_device(self._next_batch(), self.info.device)
            t_data += time.perf_counter() - t0
            # reduce-scatter gradients only on the last micro-batch of the step, unless the plan has no
            # room for the unsharded accumulation (train.memory: grad_sync)
            self.root.set_requires_gradient_sync(self.plan.grad_sync == "every" or micro == self.accum - 1)
            out = self.root(batch)
            if "loss" not in out:
                raise KeyError(f"{self.adapter.name}.sft_loss returned {sorted(out)}; it must include 'loss'")
            (out["loss"] / self.accum).backward()
            for k, v in out.items():
                parts[k] = parts.get(k, 0.0) + v.detach().float() / self.accum
        self._finish_save()  # the optimizer step changes what a save in flight is writing
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        lr = set_lr(
            self.optimizer, lr_factor(self.step, t.schedule, t.warmup_steps, t.max_steps, t.min_lr_ratio)
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if self.ema is not None:
            self.ema.update(self.step - 1)
        parts["grad_norm"] = norm.detach().float()
        return parts, lr, t_data

    def _flush(
        self, pending: list[tuple[int, dict[str, torch.Tensor], float]], t_data: float, t_wall: float
    ) -> None:
        """Average pending per-step values over ranks (one collective, one host copy) and log them."""
        if not pending:
            return
        keys = list(pending[0][1])
        table = torch.stack([torch.stack([p[k] for k in keys]) for _, p, _ in pending])  # [steps, keys]
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        rows = (table / self.info.world_size).tolist()
        records = [{"step": s, **dict(zip(keys, row)), "lr": lr} for (s, _, lr), row in zip(pending, rows)]
        bad = [r["step"] for r in records if not all(np.isfinite(v) for v in r.values())]
        if bad:
            raise NonFiniteLoss(
                f"non-finite loss or gradient norm at step {bad[0]} (run dir {self.run_dir}); "
                "lower train.lr or check the data; the last checkpoint is from before it"
            )
        self.logger.steps(records)
        n = len(pending)
        step_s = t_wall / n
        mem = (
            torch.cuda.max_memory_allocated(self.info.device) / 2**30
            if self.info.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        )
        self.logger.scalars(
            pending[-1][0],
            {
                "time/step": step_s,
                "time/data": t_data / n,
                "train/samples_per_s": self.cfg.train.global_batch / step_s,
                "memory/peak_gib": mem,
            },
        )
        pending.clear()

    def run(self) -> None:
        t = self.cfg.train
        log.info(
            "training %s: %.2fM parameters (%.2fM trained), %d process(es) on %s, global batch %d = %d x %d x %d",
            self.adapter.name, self.n_params / 1e6, self.n_trainable / 1e6, self.info.world_size,
            self.info.device, t.global_batch, t.micro_batch, self.info.world_size, self.accum,
        )  # fmt: skip
        self._it = iter(self.loader)
        start = self.step
        try:
            self._train()
        except BaseException:
            if self.pending is not None:  # the writer thread ends before the process groups do
                self.pending.wait()
            raise
        self.logger.close()
        if self.info.is_main:
            print(self.summary(start, time.perf_counter() - self.t_start), flush=True)

    def summary(self, start: int, seconds: float) -> str:
        """What the run did, where its checkpoint is and the command that serves it."""
        steps = f"{self.step - start} steps" + (f" (from step {start})" if start else "")
        lines = [f"trained {self.adapter.name}: {steps} to step {self.step} in {seconds:.0f} s"]
        last = self.logger.last
        if last:
            names = sorted(
                (k for k in last[-1] if k not in ("step", "lr", "grad_norm")), key=lambda k: k != "loss"
            )
            means = ", ".join(f"{k} {sum(r[k] for r in last) / len(last):.4f}" for k in names)
            span = (
                f"step {last[0]['step']}" if len(last) == 1 else f"steps {last[0]['step']}-{last[-1]['step']}"
            )
            lines.append(f"  final losses (mean of {span}): {means}")
        if self.saved is not None:
            lines.append(f"  checkpoint: {self.saved}")
            ema = " --ema" if self.cfg.train.ema else ""
            out = shlex.quote(str(self.run_dir / "serve"))
            lines.append(f"  next: wamkit convert {shlex.quote(str(self.saved))} --out {out}{ema}")
            lines.append(f"  then: wamkit serve {out}")
        return "\n".join(lines)

    def _train(self) -> None:
        t = self.cfg.train
        pending: list[tuple[int, dict[str, torch.Tensor], float]] = []
        t_data, t_last = 0.0, time.perf_counter()
        first = True
        while self.step < t.max_steps:
            parts, lr, dt_data = self._one_step()
            if first:
                first = False
                log.info(
                    "first optimizer step done %.1f s after start; host RssAnon %.2f GB (rank %d)",
                    time.perf_counter() - self.t_start, rss_anon_bytes() / 1e9, self.info.rank,
                )  # fmt: skip
            pending.append((self.step, parts, lr))
            t_data += dt_data
            saving = self.step % t.save_interval == 0 or self.step == t.max_steps
            if saving or self.step % t.log_interval == 0:
                self._flush(pending, t_data, time.perf_counter() - t_last)
                t_data, t_last = 0.0, time.perf_counter()
            if saving:
                self._save()
                t_last = time.perf_counter()
        self._finish_save()


def train(cfg: RunConfig, adapter_fn: AdapterFn | None = None, data_fn: DataFn | None = None) -> Path:
    """Train ``cfg`` to ``train.max_steps``; return the run directory.

    ``adapter_fn(cfg, io)`` and ``data_fn(cfg, rank, world, run_dir)`` default to the registry model and
    ``wamkit.data``; tests and users with their own data pass their own.
    """
    cfg = distill.resolve(cfg)  # the student's model named by its teacher's directory
    if adapter_fn is None:  # a typo in model.options is refused before any data is read
        from wamkit.models.registry import check_model_config

        check_model_config(cfg.model)
    info = init_distributed(cfg.train.device)  # ranges were checked by TrainConfig.__post_init__
    run_dir = Path(cfg.train.run_dir)
    fresh = not run_dir.exists()
    try:
        if cfg.train.precision == "bf16" and info.device.type != "cuda":  # train.device resolved: cpu or auto
            raise ConfigError("train.precision=bf16 needs a CUDA device; use train.precision=fp32 on the CPU")
        try:
            loop = _Loop(cfg, info, adapter_fn or _default_adapter, data_fn or _default_data)
        except UserError:
            if fresh and info.is_main:  # a refused run leaves no folder behind to mistake for a run
                close_file_logs(run_dir)
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        loop.run()
    finally:
        shutdown(info)
    return run_dir
