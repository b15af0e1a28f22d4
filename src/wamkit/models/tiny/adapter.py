"""``TinyAdapter``: the built-in world action model behind the adapter protocol.

Flow matching convention: ``x_t = (1 - t) x + t eps`` with t = 1 pure noise; the network predicts the
velocity ``eps - x``; sampling integrates from t = 1 to 0 with Euler steps on a shifted grid.
Modes differ only in which generation tokens are noisy: ``policy`` denoises actions (and the future
frame, when the model uses frames) from the observation; ``forward_dynamics`` gives clean actions
(t = 0) and denoises the future frame; ``inverse_dynamics`` gives a clean goal frame and denoises
actions. Training mixes the modes per sample (``forward_dynamics_prob``, ``inverse_dynamics_prob``).
With ``world_residual`` the frame is not diffused: its tokens enter as zeros at t = 1, each with its patch
of the current frame added, and the head regresses the change from the current frame (``world_loss``:
MSE, its mean, or L1, its median), one pass; an untrained (zero) head forecasts a copy of the current frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wamkit.config import ConfigError
from wamkit.constants import (
    ACTION,
    ACTION_IS_PAD,
    EXECUTED_ACTION,
    OBS_STATE,
    TASK,
    future_image_key,
    image_key,
)
from wamkit.models.base import ActivationShape, Mode, ModelIO, ParamGroup, row_seeds, seeded_noise
from wamkit.models.rtc import committed, guide_input, guided_velocity
from wamkit.models.rtc import held as rtc_held
from wamkit.models.text import encode_texts
from wamkit.models.tiny.config import TinyConfig
from wamkit.models.tiny.network import TinyWAM, patchify, to_unit_range, unpatchify

GROUPS = ("understanding", "generation", "heads")


def shifted_times(num_steps: int, shift: float) -> list[float]:
    """Euler grid from 1 to 0 (num_steps + 1 points), warped by ``t' = s t / (1 + (s - 1) t)``."""
    u = np.linspace(1.0, 0.0, num_steps + 1)
    return [float(v) for v in shift * u / (1.0 + (shift - 1.0) * u)]


def _group_of(name: str) -> str:
    if name.startswith("und_") or ".und." in name:
        return "understanding"
    if ".gen." in name:
        return "generation"
    return "heads"


class TinyAdapter:
    """The ``tiny`` model: ``module`` is a :class:`TinyWAM`; see the module docstring for the maths."""

    name = "tiny"

    def __init__(self, cfg: TinyConfig, io: ModelIO, preset: str):
        self.cfg, self.io, self.preset = cfg, io, preset
        if cfg.prefix_max_delay >= io.chunk:
            raise ConfigError(
                f"model.options.prefix_max_delay: {cfg.prefix_max_delay} leaves no action of the "
                f"{io.chunk}-action chunk to learn; expected at most {io.chunk - 1}"
            )
        self.module = TinyWAM(cfg, io)
        # step distillation (start_distillation): [teacher] (a list keeps it out of the module tree), the
        # student's steps, the teacher's
        self._distill: tuple[list[TinyAdapter], int, int] | None = None
        # a prefix-trained model is conditioned on what the env executed (the data stage's chunk of it)
        self.sample_extras: tuple[str, ...] = (EXECUTED_ACTION,) if cfg.prefix_max_delay else ()
        if cfg.keys_to_select:
            names = [n for n, _ in self.module.named_parameters()]
            chosen = {n for n in names if any(k in n for k in cfg.keys_to_select)}
            if not chosen:
                examples = ", ".join(sorted({n.split(".")[0] for n in names}))
                raise ConfigError(
                    f"model.options.keys_to_select: {cfg.keys_to_select} matches no parameter name "
                    f"(names start with: {examples}; blocks hold '.und.' and '.gen.' towers)"
                )
            for n, p in self.module.named_parameters():
                p.requires_grad_(n in chosen)

    # ---------------------------------------------------------------------------------------------
    # protocol
    # ---------------------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.module.action_pos.device

    @property
    def future_frame_offsets(self) -> tuple[int, ...]:
        """The one future frame this model predicts, ``chunk`` steps ahead, when it has frame tokens."""
        return (self.io.chunk,) if self.cfg.uses_frames else ()

    @property
    def frame_res(self) -> int:
        """The future frame's resolution (``world_res``; models.base.PredictsFramesAt)."""
        return self.cfg.world_res

    def blocks(self) -> list[torch.nn.Module]:
        return list(self.module.blocks)

    def param_groups(self) -> list[ParamGroup]:
        """Trainable parameters by tower (``understanding``, ``generation``, ``heads``); norms, biases
        and embeddings go to ``<group>.no_decay``. Heads get ``head_lr_mult``. Empty groups are left out."""
        groups: dict[str, ParamGroup] = {}
        for n, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            base = _group_of(n)
            decay = p.ndim >= 2 and "pos" not in n and "und_text" not in n
            key = base if decay else f"{base}.no_decay"
            if key not in groups:
                mult = self.cfg.head_lr_mult if base == "heads" else 1.0
                groups[key] = ParamGroup(key, [], lr_mult=mult, weight_decay=decay)
            groups[key].params.append(p)
        return list(groups.values())

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad or not trainable_only)

    def config_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "preset": self.preset,
            "options": self.cfg.to_dict(),
            "io": self.io.to_dict(),
        }

    def activation_shape(self) -> ActivationShape:
        """Token counts and widths for the trainer's memory plan (both towers train: every token)."""
        cfg, w = self.cfg, self.cfg.width
        n_u = cfg.text_len + (cfg.image_res // cfg.patch) ** 2 * len(self.io.cameras) + 1
        n = n_u + self.io.chunk + self.module.n_frame
        return ActivationShape(n, n, w, w, int(w * cfg.mlp_ratio), cfg.depth)

    def flops_per_sample(self) -> float:
        """Training FLOPs of one sample: 3 x forward (backward = 2 x forward); matmuls, attention, convs."""
        cfg, io, w = self.cfg, self.io, self.cfg.width
        n_img = (cfg.image_res // cfg.patch) ** 2 * len(io.cameras)
        n_u = cfg.text_len + n_img + 1
        n_g = io.chunk + self.module.n_frame
        hidden = int(w * cfg.mlp_ratio)
        full = 3 * w * w + w * w + 2 * w * hidden  # qkv, proj, mlp weights of one tower layer
        fwd = 0.0
        for i in range(cfg.depth):
            und = full if i < cfg.depth - 1 else 3 * w * w
            fwd += 2 * (n_u * und + n_g * full)
            # scores + weighted sum: 2 matmuls of 2 flops per multiply-add
            q_u = n_u if i < cfg.depth - 1 else 0
            fwd += 4 * w * (q_u * n_u + n_g * (n_u + n_g))
        # stem convs, per camera
        res, c_in = cfg.image_res, 3
        for c in cfg.stem_channels:
            res //= 2
            fwd += 2 * res * res * c * c_in * 9 * len(io.cameras)
            c_in = c
        fwd += 2 * n_img * w * c_in * (cfg.patch // 2 ** len(cfg.stem_channels)) ** 2
        fwd += 2 * (io.state_dim * w + w * w)  # state MLP
        fwd += 2 * io.chunk * (io.action_dim * w + 3 * w * w + w * io.action_dim)  # action in/mix/out
        # frame in and out, and with a residual head the current frame in
        frame_layers = 3 if self.module.n_frame and cfg.world_residual else 2
        fwd += 2 * self.module.n_frame * frame_layers * w * self.module.frame_dim
        return 3.0 * fwd

    # ---------------------------------------------------------------------------------------------
    # batches -> tensors
    # ---------------------------------------------------------------------------------------------

    def _tensor(self, x: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
        return t.to(self.device, dtype=dtype, non_blocking=True)

    def _prefix(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {
            "text": encode_texts(list(batch[TASK]), self.cfg.text_len, self.device),
            "images": [self._tensor(batch[image_key(c)]) for c in self.io.cameras],
            "state": self._tensor(batch[OBS_STATE], torch.float32),
        }

    def _frame_latent(self, images: Any, what: str) -> torch.Tensor:
        """uint8 [B, H, W, 3] of the first camera -> frame tokens [B, F, world_patch^2 * 3] in [-1, 1]."""
        img = self._tensor(images)
        size = self.io.image_size
        if img.ndim != 4 or tuple(img.shape[1:]) != (size, size, 3) or img.dtype != torch.uint8:
            raise ValueError(
                f"{what}: expected uint8 images of shape [B, {size}, {size}, 3], got {img.dtype} {list(img.shape)}"
            )
        return patchify(to_unit_range(img, self.cfg.world_res), self.cfg.world_patch)

    def _current_frame(self, batch: dict[str, Any]) -> torch.Tensor:
        """The first camera's current frame as frame tokens: what a residual frame head adds to."""
        key = image_key(self.io.cameras[0])
        return self._frame_latent(batch[key], key)

    def _noise(self, seeds: list[int] | None, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Noise of each of ``shapes`` ([B, ...]): per row from its seed, or from the global generator."""
        if seeds is None:
            return [torch.randn(shape, device=self.device) for shape in shapes]
        return seeded_noise(seeds, [shape[1:] for shape in shapes], self.device)

    def _frames_to_images(self, tokens: torch.Tensor) -> np.ndarray:
        x = unpatchify(tokens.float(), self.cfg.world_patch)
        size = self.io.image_size
        if x.shape[-1] != size and size % x.shape[-1] == 0:
            # blown up pixel for pixel: averaging the image back down to world_res gives the forecast
            # itself (bilinear smoothing would blur it, and a comparison there with it)
            x = F.interpolate(x, size=(size, size), mode="nearest")
        elif x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
        x = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return x.permute(0, 2, 3, 1).cpu().numpy()

    def _needs_frames(self, what: str) -> None:
        if not self.module.n_frame:
            raise ValueError(
                f"{what} needs future-frame tokens, but this tiny model was built without them; "
                "build it with model.options.world_weight > 0"
            )

    # ---------------------------------------------------------------------------------------------
    # training
    # ---------------------------------------------------------------------------------------------

    @property
    def sampling_steps(self) -> int:
        """The Euler steps a policy request is sampled with (``num_steps``; ``serve.sampling_steps``)."""
        return self.cfg.num_steps

    @sampling_steps.setter
    def sampling_steps(self, steps: int) -> None:
        self.cfg = dataclasses.replace(self.cfg, num_steps=int(steps))  # checked as an option is

    @property
    def distilled(self) -> dict[str, int] | None:
        """``{"steps", "teacher_steps"}`` of a step-distilled model, None for one that is not."""
        c = self.cfg
        return (
            {"steps": c.distilled_steps, "teacher_steps": c.distilled_teacher_steps}
            if c.distilled_steps
            else None
        )

    def start_distillation(self, teacher: TinyAdapter, steps: int, teacher_steps: int = 0) -> None:
        """Train from now on as the ``steps``-step student of ``teacher`` (:mod:`wamkit.models.tiny.distill`):
        ``sft_loss`` becomes the distillation loss, and the model records ``steps`` as its sampler's and
        what it was distilled for. ``teacher_steps`` 0: the teacher's own ``num_steps``."""
        mine, theirs = self.config_dict(), teacher.config_dict()
        sampling = ("num_steps", "distilled_steps", "distilled_teacher_steps")
        differ = sorted(
            k for k in {*mine["options"], *theirs["options"]}
            if k not in sampling and mine["options"].get(k) != theirs["options"].get(k)
        )  # fmt: skip
        if differ or mine["io"] != theirs["io"]:
            raise ConfigError(
                "train.distill_from: the student must be the teacher's model (it starts from its weights); "
                f"they differ in {', '.join(differ) or 'their inputs (io)'}"
            )
        teacher_steps = teacher_steps or teacher.cfg.num_steps
        teacher.module.eval().requires_grad_(False)
        self._distill = ([teacher], steps, teacher_steps)
        self.cfg = dataclasses.replace(
            self.cfg, num_steps=steps, distilled_steps=steps, distilled_teacher_steps=teacher_steps
        )

    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``{"action_loss", "world_loss" (if frames), "loss"}``: flow-matching MSE on the velocity,
        averaged over noisy, non-padded elements; ``loss = action_loss + world_weight * world_loss``.
        Noise, times and modes come from torch's global RNG (the trainer seeds and checkpoints it).
        A student (:meth:`start_distillation`) returns the distillation loss instead."""
        if self._distill is not None:
            from wamkit.models.tiny.distill import distill_loss

            (teacher,), steps, teacher_steps = self._distill
            self.io.check_batch(batch, training=True)
            return distill_loss(self, teacher, batch, steps, teacher_steps)
        b = self.io.check_batch(batch, training=True)
        dev = self.device
        x_act = self._tensor(batch[ACTION], torch.float32)
        t = torch.distributions.Beta(1.5, 1.0).sample((b,)).to(dev) * 0.999 + 0.001
        u = torch.rand(b, device=dev)
        is_fd = u < self.cfg.forward_dynamics_prob
        is_id = (~is_fd) & (u < self.cfg.forward_dynamics_prob + self.cfg.inverse_dynamics_prob)
        t_act = torch.where(is_fd, torch.zeros_like(t), t)
        eps_act = torch.randn_like(x_act)
        prefix = self._prefix(batch)
        weight = (~is_fd).float()[:, None].expand(b, self.io.chunk)
        if self.cfg.prefix_max_delay:  # training-time RTC: a clean prefix of d actions, out of the loss
            held = rtc_held(
                torch.randint(0, self.cfg.prefix_max_delay + 1, (b,), device=dev), self.io.chunk, dev
            )
            t_act = torch.where(held, 0.0, t_act[:, None])  # [B, chunk]
            weight = weight * (~held).float()
        tt = t_act[..., None] if t_act.dim() == 2 else t_act[:, None, None]
        x_in = x_act
        if self.cfg.prefix_max_delay and EXECUTED_ACTION in batch:
            # the committed prefix is what the env executed (a perturbed collection's executed_action
            # column), as at inference it is what the robot executes; the loss stays on the labels
            x_in = torch.where(held[..., None], self._tensor(batch[EXECUTED_ACTION], torch.float32), x_act)
        gen = {
            "actions": (1 - tt) * x_in + tt * eps_act,
            "t_actions": t_act,
            "state": prefix["state"],
        }
        if self.module.n_frame:
            key = future_image_key(self.io.cameras[0])
            if key not in batch:
                raise ValueError(
                    f"batch lacks {key} (the frame {self.io.chunk} steps ahead), which this model predicts; "
                    "provide it or build the model with model.options.world_weight=0"
                )
            x_frm = self._frame_latent(batch[key][:, 0], key)  # [B, K=1, H, W, 3] -> [B, H, W, 3]
            now = self._current_frame(batch) if self.cfg.world_residual else None
            if now is not None:
                x_frm = x_frm - now
            t_frm = torch.where(is_id, torch.zeros_like(t), t)
            eps_frm = torch.randn_like(x_frm)
            if self.cfg.world_residual:  # zeros at t = 1 to forecast; the clean change as a goal
                t_frm = torch.where(is_id, torch.zeros_like(t), torch.ones_like(t))
                eps_frm = torch.zeros_like(x_frm)
            gen["frames"] = (1 - t_frm)[:, None, None] * x_frm + t_frm[:, None, None] * eps_frm
            gen["t_frames"] = t_frm
            if now is not None:
                gen["frames_now"] = now
        v_act, v_frm = self.module(prefix=prefix, gen=gen)

        if ACTION_IS_PAD in batch:
            weight = weight * (~self._tensor(batch[ACTION_IS_PAD], torch.bool)).float()
        err = (v_act.float() - (eps_act - x_act)).pow(2).mean(-1)
        out = {"action_loss": (err * weight).sum() / weight.sum().clamp_min(1.0)}
        loss = out["action_loss"]
        if v_frm is not None:
            fw = (~is_id).float()
            target = x_frm if self.cfg.world_residual else eps_frm - x_frm
            diff = v_frm.float() - target
            ferr = (diff.abs() if self.cfg.world_loss == "l1" else diff.pow(2)).mean((1, 2))
            out["world_loss"] = (ferr * fw).sum() / fw.sum().clamp_min(1.0)
            loss = loss + self.cfg.world_weight * out["world_loss"]
        out["loss"] = loss
        return out

    # ---------------------------------------------------------------------------------------------
    # sampling
    # ---------------------------------------------------------------------------------------------

    supports_rtc = True  # predict(policy) takes rtc=: wamkit.models.rtc

    def _guided_step(
        self, gen: dict[str, Any], cache: Any, guide: dict[str, torch.Tensor], t_now: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One guided velocity: the action velocity through :func:`wamkit.models.rtc.guided_velocity`,
        the frame velocity of the same forward pass."""
        frames: list[torch.Tensor | None] = []

        def velocity(x_act: torch.Tensor) -> torch.Tensor:
            v_act, v_frm = self.module(gen={**gen, "actions": x_act}, cache=cache)
            frames.append(None if v_frm is None else v_frm.detach())
            return v_act

        v_act = guided_velocity(
            velocity, gen["actions"], t_now, guide["actions"], guide["weights"], guide["max_guidance"]
        )
        return v_act, frames[0]

    @torch.no_grad()
    def predict(
        self,
        batch: dict[str, Any],
        mode: Mode = "policy",
        seed: int | Sequence[int] | None = None,
        **inputs: Any,
    ) -> dict[str, np.ndarray]:
        """See :meth:`wamkit.models.base.ModelAdapter.predict`. ``num_steps`` (int) overrides the
        preset's number of Euler steps."""
        if mode not in ("policy", "forward_dynamics", "inverse_dynamics"):
            raise ValueError(
                f"mode {mode!r} is unknown; expected policy, forward_dynamics or inverse_dynamics"
            )
        b = self.io.check_batch(batch)
        dev = self.device
        num_steps = int(inputs.pop("num_steps", self.cfg.num_steps))
        guide = guide_input(inputs.pop("rtc", None), mode, b, self.io.chunk, self.io.action_dim, dev)
        seeds = row_seeds(seed, b)
        # the current frame, which a residual frame head is given and adds its forecast change to
        now = self._current_frame(batch) if self.module.n_frame and self.cfg.world_residual else None
        chunk_shape = (b, self.io.chunk, self.io.action_dim)
        frame_shape = (b, self.module.n_frame, self.module.frame_dim)
        denoise_act = denoise_frm = False
        # the frame tokens sampling starts from: noise, or zeros for a regressed (residual) head
        noisy_frames = self.module.n_frame and not self.cfg.world_residual
        if mode == "policy":
            x_act, *rest = self._noise(seeds, [chunk_shape, frame_shape] if noisy_frames else [chunk_shape])
            x_frm = rest[0] if rest else torch.zeros(frame_shape, device=dev) if self.module.n_frame else None
            denoise_act, denoise_frm = True, x_frm is not None
        elif mode == "forward_dynamics":
            self._needs_frames(mode)
            if "actions" not in inputs:
                raise ValueError("forward_dynamics needs actions=[B, chunk, action_dim] (model space)")
            x_act = self._tensor(inputs.pop("actions"), torch.float32)
            if tuple(x_act.shape) != chunk_shape:
                raise ValueError(f"actions: expected shape {list(chunk_shape)}, got {list(x_act.shape)}")
            x_frm = (
                self._noise(seeds, [frame_shape])[0] if noisy_frames else torch.zeros(frame_shape, device=dev)
            )
            denoise_frm = True
            if now is not None:  # nothing the network is given changes between Euler steps: one pass
                num_steps = 1
        else:
            self._needs_frames(mode)
            if "goal_images" not in inputs:
                raise ValueError(f"inverse_dynamics needs goal_images=[B, {self.io.image_size}, ...] uint8")
            x_frm = self._frame_latent(inputs.pop("goal_images"), "goal_images")
            if x_frm.shape[0] != b:
                raise ValueError(f"goal_images: expected {b} images, got {x_frm.shape[0]}")
            if now is not None:
                x_frm = x_frm - now
            (x_act,) = self._noise(seeds, [chunk_shape])
            denoise_act = True
        if inputs:
            raise ValueError(f"unexpected inputs for mode {mode}: {sorted(inputs)}")

        prefix = self._prefix(batch)
        cache = self.module(prefix=prefix)
        times = shifted_times(num_steps, self.cfg.time_shift)
        zero, one = torch.zeros(b, device=dev), torch.ones(b, device=dev)
        held = None
        if guide is not None and self.cfg.prefix_max_delay:
            # trained with clean prefixes: the committed actions enter as they are (flow time 0)
            held = rtc_held(guide["delay"].long(), self.io.chunk, dev)
        for t_now, t_next in zip(times[:-1], times[1:]):
            t = torch.full((b,), t_now, device=dev)
            gen = {"actions": x_act, "t_actions": t if denoise_act else zero, "state": prefix["state"]}
            if held is not None:
                x_act = committed(x_act, guide["actions"], guide["delay"])
                gen["actions"], gen["t_actions"] = x_act, torch.where(held, 0.0, t[:, None])
            if x_frm is not None:
                t_frm = (one if self.cfg.world_residual else t) if denoise_frm else zero
                gen["frames"], gen["t_frames"] = x_frm, t_frm
                if now is not None:
                    gen["frames_now"] = now
            if guide is not None and held is None:  # real-time chunking: see wamkit.models.rtc
                v_act, v_frm = self._guided_step(gen, cache, guide, t_now)
            else:
                v_act, v_frm = self.module(gen=gen, cache=cache)
            if denoise_act:
                x_act = x_act + (t_next - t_now) * v_act.float()
            if denoise_frm and self.cfg.world_residual:
                forecast = v_frm.float()  # the expected change: its input stays zeros at t = 1
            elif denoise_frm:
                x_frm = x_frm + (t_next - t_now) * v_frm.float()
        if guide is not None:
            x_act = committed(x_act, guide["actions"], guide["delay"])
        if mode == "forward_dynamics":
            if now is not None:
                x_frm = forecast + now
            return {"frames": self._frames_to_images(x_frm)}
        return {"actions": x_act.float().cpu().numpy().astype(np.float32)}
