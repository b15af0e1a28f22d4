"""Cosmos3 inference: policy, forward dynamics and inverse dynamics for a batch of requests.

All B requests share one transformer call per denoising step (see ``packing``). The clip of a request
has ``chunk + 1`` frames = 1 + chunk/4 latent frames; what is held fixed (conditioned) depends on the
mode, as in diffusers' ``Cosmos3OmniPipeline``:

==================  ===================================  =================================
mode                vision (latent frames)               actions
==================  ===================================  =================================
policy              frame 0 (the observation)            generated
forward_dynamics    frame 0                              all ``chunk`` given
inverse_dynamics    all (the whole observed clip)        generated
==================  ===================================  =================================

Sampling is UniPC on the adapter's scheduler (the native flow schedule), guidance 1 (no CFG): diffusers'
update, applied to the vision latents and actions together with no host wait per step (``sampler``). Each
step's velocities come from one of two interchangeable functions, with the very same sampler around them:

- *stock*: ``Cosmos3OmniTransformer.forward`` over the packed sequence of all requests (``packing``);
- *fast* (policy mode, ``options.fast_inference``, the default): the text keys/values of each prompt
  come from a cache and only the generation tokens run, on a batch axis (``fast``, ``fast_policy``).
  The tests pin it to the stock path (same actions and latents, fp32, <= 1e-5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wamkit.constants import TASK, image_key
from wamkit.device import host_buffer, to_device
from wamkit.models.base import Mode, row_seeds
from wamkit.models.cosmos3.fast_policy import Velocity
from wamkit.models.cosmos3.packing import PackedLayout, pack
from wamkit.models.cosmos3.recipe import native_sigmas
from wamkit.models.cosmos3.sampler import flow_sampler
from wamkit.models.rtc import committed, guide_input, guided_velocity

MODES = ("policy", "forward_dynamics", "inverse_dynamics")


@dataclass
class Prepared:
    """One batch ready for sampling: x0 the encoded frames [B, C, T0, h, w] (T0 = 1, or all frames in
    inverse dynamics), the held latent frames and action tokens, the initial actions [B, chunk, D]
    (given ones in forward dynamics) and the step function ``velocity(lat_v, lat_a, t)``."""

    x0: torch.Tensor
    vision_cond: tuple[int, ...]
    act_init: torch.Tensor
    action_cond: tuple[int, ...]
    velocity: Velocity


def _split_flat(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` with these shapes."""
    return [p.view(s) for p, s in zip(flat.split([math.prod(s) for s in shapes]), shapes)]


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


class Cosmos3Inference:
    """``predict`` of :class:`~wamkit.models.cosmos3.adapter.Cosmos3Adapter` (a mixin over its helpers)."""

    @torch.no_grad()
    def predict(
        self,
        batch: dict[str, Any],
        mode: Mode = "policy",
        seed: int | Sequence[int] | None = None,
        **inputs: Any,
    ) -> dict[str, np.ndarray]:
        """Run B requests. Returns, by mode:

        - ``policy``: ``actions`` float32 [B, chunk, action_dim] (model space); with
          ``inputs["return_frames"]=True`` also ``video`` (below).
        - any mode, with ``inputs["return_latents"]=True``: ``latents`` float32 [B, C, T, h, w], the
          denoised vision latents (T = 1 + chunk/4; frame 0 is the observation's).
        - ``forward_dynamics`` (``inputs["actions"]`` [B, chunk, action_dim], model space): ``video``
          uint8 [B, chunk + 1, h, W', 3] -- the observation then the chunk predicted future frames,
          cameras side by side at the canvas content size -- and ``frames`` = its last frame.
        - ``inverse_dynamics``: ``actions``; ``inputs["goal_images"]`` = {image key: the frames after
          the observation, uint8 [B, chunk, H, W, 3] (the whole clip), or [B, H, W, 3] (one goal
          frame, held for the whole chunk)}.

        Request i draws its noise from ``seed + i`` (or ``seed[i]``, one seed per request; no seed: 0):
        a request's answer does not depend on the batch.
        """
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is unknown; expected {', '.join(MODES)}")
        io = self.io
        guide = guide_input(
            inputs.pop("rtc", None), mode, io.check_batch(batch), io.chunk, io.action_dim, self.device
        )
        prep = self._prepare(batch, mode, inputs, eager=guide is not None)
        lat_v, lat_a = self._sample(prep, row_seeds(0 if seed is None else seed, len(prep.act_init)), guide)
        out: dict[str, np.ndarray] = {}
        if mode != "forward_dynamics":  # the chunk, without the held state token
            out["actions"] = lat_a[:, self.held_actions :].cpu().numpy().astype(np.float32)
        if inputs.get("return_latents"):
            out["latents"] = lat_v.float().cpu().numpy()
        if mode == "forward_dynamics" or inputs.get("return_frames"):
            out["video"] = self._decode(lat_v)
        if mode == "forward_dynamics":
            out["frames"] = out["video"][:, -1]
        return out

    supports_rtc = True  # predict(policy) takes rtc=: wamkit.models.rtc
    returns_frames = True  # predict(policy) takes return_frames=True: the clip it predicts with the actions

    def _prepare(
        self, batch: dict[str, Any], mode: Mode, inputs: dict[str, Any], eager: bool = False
    ) -> Prepared:
        """Encode the observations and choose the step function of B requests (see the module doc);
        ``eager``: a step that can be differentiated (the fast path without captured graphs)."""
        b = self.io.check_batch(batch)
        views = self._views(batch)
        held = self._state_tokens(batch, torch.device("cpu"))  # [B, 0 or 1, D]: the state token
        act_init = torch.cat([held, torch.zeros(b, self.io.chunk, self.io.action_dim)], dim=1)
        vision_cond, action_cond = (0,), tuple(range(held.shape[1]))
        if mode == "inverse_dynamics":
            x0 = self._encode(self._goal_clips(views, inputs.get("goal_images")))
            vision_cond = tuple(range(self._latent_frames()))
        else:
            x0 = self._encode([[v] for v in views])
        if mode == "forward_dynamics":
            act_init = torch.cat([held, self._given_actions(inputs.get("actions"), b)], dim=1)
            action_cond = tuple(range(self.action_len))
        c, _, h, w = x0.shape[1:]
        hw = self._canvas_hw(views[0])
        texts = [self.prompt(t, hw, self.inference_idle_frames) for t in batch[TASK]]
        shape = (c, self._latent_frames(), h, w)
        reqs = self._requests(texts, hw, shape, vision_cond, action_cond)
        if mode == "policy" and self.options.fast_inference and self.fast.usable():
            keys = [(text, hw) for text in texts]
            velocity = self._fast_velocity(keys, reqs, shape, vision_cond, action_cond, eager)
        elif self.fast.text_tower is not None:
            raise ValueError(
                f"mode {mode!r}: the understanding tower is served from host memory (serve.text_tower=host), "
                "which reads the text through cached keys/values, in policy mode only; serve with "
                "serve.text_tower=device for the other modes"
            )
        else:
            velocity = self._stock_velocity(pack(reqs, self.device))
        return Prepared(x0, vision_cond, act_init, action_cond, velocity)

    def _goal_clips(self, views: list[np.ndarray], goal: Any) -> list[list[np.ndarray]]:
        if not isinstance(goal, dict) and len(self.io.cameras) == 1 and goal is not None:
            goal = {image_key(self.io.cameras[0]): goal}  # one camera: the array is its goal
        if not isinstance(goal, dict):
            raise ValueError(
                "inverse_dynamics needs every camera's goal: goal_images={image key: uint8 "
                "[B, chunk, H, W, 3] or [B, H, W, 3]}"
            )
        cams = [_np(goal[k]) for k in self._image_keys(goal)]
        if cams[0].ndim == 4:  # one goal frame per camera: held for the whole chunk
            side = np.concatenate(cams, axis=2)
            return [[v] + [side[i]] * self.io.chunk for i, v in enumerate(views)]
        if cams[0].ndim != 5 or cams[0].shape[1] != self.io.chunk:
            raise ValueError(
                f"goal_images: expected [B, {self.io.chunk}, H, W, 3] per camera, got {list(cams[0].shape)}"
            )
        side = np.concatenate(cams, axis=3)
        return [[v, *side[i]] for i, v in enumerate(views)]

    def _image_keys(self, goal: dict) -> list[str]:
        keys = [image_key(c) for c in self.io.cameras]
        missing = [k for k in keys if k not in goal]
        if missing:
            raise ValueError(f"goal_images lacks {', '.join(missing)} (cameras {list(self.io.cameras)})")
        return keys

    def _given_actions(self, acts: Any, b: int) -> torch.Tensor:
        want = (b, self.io.chunk, self.io.action_dim)
        if acts is None or tuple(np.shape(acts)) != want:
            raise ValueError(f"forward_dynamics needs actions of shape {list(want)}, got {np.shape(acts)}")
        return torch.as_tensor(_np(acts), dtype=torch.float32)

    def _stock_velocity(self, layout: PackedLayout) -> Velocity:
        """Velocities by ``Cosmos3OmniTransformer.forward`` over the packed requests."""

        def velocity(lat_v: torch.Tensor, lat_a: torch.Tensor, t: torch.Tensor):
            t_v = t.float().expand(sum(layout.num_noisy_vision_tokens))
            t_a = t.float().expand(sum(layout.num_noisy_action_tokens))
            return self._run(layout, lat_v, t_v, lat_a, t_a)

        return velocity

    def _fast_velocity(self, keys, reqs, shape, vision_cond, action_cond, eager=False) -> Velocity:
        """Velocities by the fast path's generation-only step (text keys/values from the cache)."""
        step = self.fast.velocity(
            keys,
            reqs,
            shape,
            (self.action_len, self.io.action_dim),
            vision_cond,
            action_cond,
            self.domain_id,
            eager=eager,
        )
        return lambda lat_v, lat_a, t: step(lat_v, lat_a, t.float().reshape(1))

    def _sample(
        self, prep: Prepared, seeds: list[int], guide: dict[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """UniPC denoising of all requests at once; conditioned frames/tokens are held fixed, as in the
        pipeline (their velocity is zeroed). Returns the latents [B, C, T, h, w] and actions. ``guide``:
        real-time chunking of the actions (:meth:`_guided`).

        One sampler steps the vision latents and the noisy actions together (``sampler``: diffusers'
        update, bit for bit, without a host wait per step)."""
        x0, act_init = prep.x0, prep.act_init
        dev, t_lat = self.device, self._latent_frames()
        shape_v = (x0.shape[0], x0.shape[1], t_lat, *x0.shape[3:])
        lat_v, noise_a, act, cond_v, cond_a = self._draw(seeds, shape_v, prep)  # lat_v: the noise
        t0 = x0.shape[2]  # encoded frames: 1 (policy, forward dynamics) or all (inverse dynamics)
        lat_v[:, :, :t0] = cond_v[:t0] * x0 + (1 - cond_v[:t0]) * lat_v[:, :, :t0]
        lat_a = cond_a * act + (1 - cond_a) * noise_a

        steps = int(self.options.num_inference_steps)
        noisy_actions = len(prep.action_cond) < act_init.shape[1]
        samples = [lat_v, lat_a] if noisy_actions else [lat_v]
        sigmas = native_sigmas(self.scheduler, steps)
        sampler = flow_sampler(self.options.sampler, self.scheduler, sigmas, dev, samples)
        for t in sampler.timesteps:
            with torch.profiler.record_function("cosmos3.denoise_step"):  # a named range in profiles
                if guide is not None:
                    v_v, v_a = self._guided(prep.velocity, lat_v, lat_a, t, guide)
                else:
                    v_v, v_a = prep.velocity(lat_v, lat_a, t)
            if noisy_actions:
                lat_v, lat_a = sampler.step(t, [v_v * (1 - cond_v), v_a * (1 - cond_a)])
            else:
                (lat_v,) = sampler.step(t, [v_v * (1 - cond_v)])
        if guide is not None:  # the committed actions, as they are executed
            lat_a = torch.cat(
                [
                    lat_a[:, : self.held_actions],
                    committed(lat_a[:, self.held_actions :], guide["actions"], guide["delay"]),
                ],
                dim=1,
            )
        return lat_v, lat_a

    def _guided(self, velocity: Velocity, lat_v, lat_a, t, guide) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's velocities with the chunk's guided as in real-time chunking
        (:func:`wamkit.models.rtc.guided_velocity`; the noise level is the flow sigma ``t / 1000``, the
        scheduler's ``num_train_timesteps``). The held state token stays as it is."""
        held = self.held_actions
        sigma = float(t) / float(self.scheduler.config.num_train_timesteps)
        vision: list[torch.Tensor] = []

        def chunk_velocity(chunk: torch.Tensor) -> torch.Tensor:
            v_v, v_a = velocity(lat_v, torch.cat([lat_a[:, :held], chunk], dim=1), t)
            vision.append(v_v.detach())
            return v_a[:, held:]

        v_chunk = guided_velocity(
            chunk_velocity, lat_a[:, held:], sigma, guide["actions"], guide["weights"], guide["max_guidance"]
        )
        return vision[0], torch.cat([torch.zeros_like(lat_a[:, :held]), v_chunk], dim=1)

    def _draw(self, seeds: list[int], shape_v: tuple[int, ...], prep: Prepared) -> list[torch.Tensor]:
        """The initial noise of the latents [B, C, T, h, w] and actions [B, chunk, D] (request i from
        ``seeds[i]``, in the pipeline's draw order: the vision latents, then the actions), the initial
        actions and the held-frame masks [T, 1, 1] and [chunk, 1]: built in one host buffer and copied
        to the device at once, without waiting for the device."""
        act_init = prep.act_init
        shapes = [shape_v, act_init.shape, act_init.shape, (shape_v[2], 1, 1), (act_init.shape[1], 1)]
        host = host_buffer(sum(math.prod(s) for s in shapes), self.device)
        noise_v, noise_a, act, cond_v, cond_a = _split_flat(host, shapes)
        for i in range(shape_v[0]):
            g = torch.Generator("cpu").manual_seed(seeds[i])
            torch.randn(noise_v[i].shape, generator=g, out=noise_v[i])
            torch.randn(noise_a[i].shape, generator=g, out=noise_a[i])
        act.copy_(act_init)
        cond_v.zero_()
        cond_a.zero_()
        cond_v[list(prep.vision_cond)] = 1.0
        cond_a[list(prep.action_cond)] = 1.0
        return _split_flat(to_device(host, self.device), shapes)

    def _decode(self, lat_v: torch.Tensor) -> np.ndarray:
        """Latents [B, C, T, h, w] -> uint8 video [B, F, H, W, 3] (F = chunk + 1 frames)."""
        vae = self.vae
        mean = self.pipe._vae_latents_mean.to(lat_v.device, vae.dtype).view(1, -1, 1, 1, 1)
        inv_std = self.pipe._vae_latents_inv_std.to(lat_v.device, vae.dtype).view(1, -1, 1, 1, 1)
        video = vae.decode(lat_v.to(vae.dtype) / inv_std + mean).sample  # [B, 3, F, H, W] in [-1, 1]
        video = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return video.permute(0, 2, 3, 4, 1).cpu().numpy()
