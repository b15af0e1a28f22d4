"""The cosmos3 adapter: NVIDIA Cosmos3 (diffusers ``Cosmos3OmniTransformer``) behind wamkit's protocol.

The LIBERO SFT recipe (see docs/cosmos3_libero.md):

- inputs: the two camera views side by side (``io.cameras`` order, left to right) as one frame, put on
  the pipeline's action canvas (``resolution_tier``) and encoded by the Wan VAE; the task string as
  the pipeline's structured action caption (``view_point`` framing, ``fps``), Qwen3 chat template.
  The proprio state is not a model input (Cosmos3 has none).
- outputs: ``io.chunk`` action tokens of ``io.action_dim`` (10-D ``[dpos, rot6d, g]`` for LIBERO, already
  quantile-normalised) through the ``domain_name`` row of the action heads, and ``chunk / 4`` future
  latent frames (the world-model part).
- trained: the generation tower, time embedder, vae<->llm projections (``proj_in``/``proj_out``) and
  the action heads (``lr_mult = action_lr_mult``); the understanding tower and the embeddings are frozen.
- loss: flow matching with ``x_t = (1 - s) x0 + s noise`` and velocity ``noise - x0`` on the action
  tokens (padding excluded) and the future vision latents, ``s`` logit-normal per sample.

Gripper: the model learns the dataset's own gripper value (LIBERO stores the env convention, -1 open /
+1 close) and ``predict`` returns model space; the codec's ``decode_actions`` gives env values back.
``wamkit.actions.libero.model_gripper_to_env`` (g in [0, 1], 1 = open) is therefore *not* applied here:
it is for models trained in the Cosmos/OpenVLA convention, and belongs in the codec if such a model is
served.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import _EMBODIMENT_TO_DOMAIN_ID
from PIL import Image

from wamkit.config import ConfigError
from wamkit.constants import ACTION, ACTION_IS_PAD, TASK, image_key
from wamkit.models.base import Mode, ModelIO, ParamGroup
from wamkit.models.cosmos3.packing import PackedLayout, RequestSegments, install_processor, pack
from wamkit.models.cosmos3.towers import param_role, train_flops

FUTURE_IMAGES = "observation.future_images"
NUM_TRAIN_TIMESTEPS = 1000  # the model's timestep = sigma * 1000 (then x timestep_scale inside)


def _np_images(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


class Cosmos3Adapter:
    """Cosmos3 through diffusers. ``module`` is the ``Cosmos3OmniTransformer``; the VAE, scheduler and
    tokenizer are frozen helpers, and ``pipe`` is a ``Cosmos3OmniPipeline`` over them whose segment
    builders, tokenizer template and VAE encoding are reused as they are."""

    name = "cosmos3"
    needs_future_frames = True  # the trainer's loader adds observation.future_images.<cam>

    def __init__(self, io, preset, pretrained, options, transformer, vae, scheduler, tokenizer):
        self.io: ModelIO = io
        self.preset, self.pretrained, self.options = preset, pretrained, options
        self.module = transformer
        self.vae, self.scheduler, self.tokenizer = vae, scheduler, tokenizer
        self.pipe = Cosmos3OmniPipeline(
            transformer=transformer,
            text_tokenizer=tokenizer,
            vae=vae,
            scheduler=scheduler,
            enable_safety_checker=False,
        )
        self.pipe.set_progress_bar_config(disable=True)
        self.domain_id = _EMBODIMENT_TO_DOMAIN_ID[options["domain_name"]]
        self.processor = install_processor(transformer, options["attention"])
        self._text: dict[str, dict[str, Any]] = {}
        self._segments: dict[tuple, RequestSegments] = {}
        self._nominal: PackedLayout | None = None
        for name, p in transformer.named_parameters():
            p.requires_grad_(param_role(name) != "frozen")
        if options["gradient_checkpointing"]:
            transformer.enable_gradient_checkpointing()

    # -- protocol: structure --------------------------------------------------------------------
    def param_groups(self) -> list[ParamGroup]:
        groups = {
            "generation": ParamGroup("generation"),
            "generation_no_decay": ParamGroup("generation_no_decay", weight_decay=False),
            "action_heads": ParamGroup("action_heads", lr_mult=float(self.options["action_lr_mult"])),
        }
        for name, p in self.module.named_parameters():
            role = param_role(name)
            if role == "action_heads":
                groups["action_heads"].params.append(p)
            elif role == "generation":
                groups["generation" if p.ndim >= 2 else "generation_no_decay"].params.append(p)
        return list(groups.values())

    def blocks(self) -> list[torch.nn.Module]:
        """The ``Cosmos3VLTextMoTDecoderLayer``s: FSDP2 shards each one (diffusers' ``_no_split_modules``)."""
        return list(self.module.layers)

    def config_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "preset": self.preset,
            "pretrained": self.pretrained,
            "options": dict(self.options),
            "io": self.io.to_dict(),
        }

    def export_extra(self, out_dir) -> None:
        """``wamkit convert --to extra``: a diffusers pipeline folder, verified by reloading it."""
        from wamkit.models.cosmos3.components import export_diffusers, verify_export

        export_diffusers(self, out_dir)
        verify_export(self, out_dir)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the input projections: under FSDP2 mixed precision, read inside the
        root's forward, it is the unsharded ``param_dtype`` (bf16), not the fp32 master weights'."""
        return self.module.proj_in.weight.dtype

    # -- inputs -> latents and segments -----------------------------------------------------------
    def _views(self, batch: dict[str, Any], prefix: str | None = None) -> list[np.ndarray]:
        """Per sample, the cameras side by side: uint8 [H, n_cams * W, 3]."""
        keys = [f"{prefix}.{c}" if prefix else image_key(c) for c in self.io.cameras]
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"batch lacks {', '.join(missing)} (cameras {list(self.io.cameras)})")
        cams = [_np_images(batch[k]) for k in keys]
        return list(np.concatenate(cams, axis=2))

    def _encode(self, clips: list[list[np.ndarray]]) -> torch.Tensor:
        """Clips (per sample, a list of uint8 frames) -> cropped normalised latents [B, C, T, h, w] fp32."""
        dev, frames, size = self.device, [], None
        for clip in clips:
            pil = [Image.fromarray(f) for f in clip]
            f, size, _, _ = self.pipe._prepare_action_video_conditioning(
                pil, self.options["resolution_tier"], len(pil), device=dev, dtype=torch.float32
            )
            frames.append(f)
        vae_dev = next(self.vae.parameters()).device
        if vae_dev != dev:
            self.vae.to(dev)
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            z = self.pipe._encode_video(torch.cat(frames))
        return self.pipe._remove_action_video_padding_from_latent(z, size).float()

    def _canvas_hw(self, frame: np.ndarray) -> tuple[int, int]:
        _, _, h, w = self.pipe._prepare_action_video_conditioning(
            [Image.fromarray(frame)], self.options["resolution_tier"], 1, device="cpu", dtype=torch.float32
        )
        return h, w

    def _text_segment(self, task: str, hw: tuple[int, int]) -> dict[str, Any]:
        key = (task, hw)
        if key not in self._text:
            ids, _ = self.pipe.tokenize_prompt(
                task,
                num_frames=self.io.chunk + 1,
                height=hw[0],
                width=hw[1],
                fps=float(self.options["fps"]),
                action_mode="policy",
                action_view_point=self.options["view_point"],
            )
            self._text[key] = self.pipe._prepare_text_segment(ids, device="cpu")
        return self._text[key]

    def _layout(self, tasks: list[str], hw, latent_shape, vision_cond, action_cond) -> PackedLayout:
        """The packed layout of len(tasks) requests; ``latent_shape`` = (C, T, h, w)."""
        reqs = []
        for task in tasks:
            text = self._text_segment(task, hw)
            key = (
                text["und_len"],
                float(text["vision_start_temporal_offset"]),
                latent_shape,
                vision_cond,
                action_cond,
            )
            if key not in self._segments:
                vis = self.pipe._prepare_vision_segment(
                    input_vision_tokens=torch.empty((1, *latent_shape), device="meta"),
                    has_image_condition=True,
                    mrope_offset=text["vision_start_temporal_offset"],
                    vision_fps=float(self.options["fps"]),
                    curr=text["und_len"],
                    device="cpu",
                    condition_frame_indexes=list(vision_cond),
                )
                act = self.pipe._prepare_action_segment(
                    input_action_tokens=torch.empty((self.io.chunk, self.io.action_dim), device="meta"),
                    condition_frame_indexes=list(action_cond),
                    mrope_offset=text["vision_start_temporal_offset"],
                    action_fps=float(self.options["fps"]),
                    curr=text["und_len"] + vis["num_vision_tokens"],
                    device="cpu",
                )
                self._segments[key] = RequestSegments(text, vis, act)
            reqs.append(RequestSegments(text, self._segments[key].vision, self._segments[key].action))
        return pack(reqs, self.device)

    def _latent_frames(self) -> int:
        return self.io.chunk // int(self.vae.config.scale_factor_temporal) + 1

    def _run(self, layout: PackedLayout, lat_v: torch.Tensor, t_v: torch.Tensor, lat_a: torch.Tensor, t_a):
        """One transformer call over all requests; returns predicted velocities [N, C, T, h, w], [N, chunk, D]."""
        dt, n = self.dtype, layout.n
        # Left set after the call on purpose: gradient checkpointing re-runs the layers' forward during
        # backward, and the recomputation must attend within the same requests.
        self.processor.layout = layout
        preds_v, _, preds_a = self.module(
            **layout.forward_kwargs(
                [lat_v[i : i + 1].to(dt) for i in range(n)],
                t_v,
                [lat_a[i].to(dt) for i in range(n)],
                t_a,
                [torch.tensor([self.domain_id], device=lat_a.device)] * n,
            )
        )
        return torch.cat(preds_v).float(), torch.stack(preds_a).float()

    # -- protocol: training -----------------------------------------------------------------------
    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        b = self.io.check_batch(batch, training=True)
        dev = self.device
        views = self._views(batch)
        has_future = f"{FUTURE_IMAGES}.{self.io.cameras[0]}" in batch
        future = self._views(batch, FUTURE_IMAGES) if has_future else views  # no future: a still scene
        x0_v = self._encode([[cur] + [fut] * self.io.chunk for cur, fut in zip(views, future)])
        x0_a = torch.as_tensor(batch[ACTION], device=dev, dtype=torch.float32)
        pad = batch.get(ACTION_IS_PAD)
        keep = (
            torch.ones(x0_a.shape[:2], device=dev)
            if pad is None
            else (~torch.as_tensor(pad, device=dev)).float()
        )

        sigma = torch.sigmoid(torch.randn(b, device=dev))  # logit-normal(0, 1)
        eps_v, eps_a = torch.randn_like(x0_v), torch.randn_like(x0_a)
        s_v = sigma.view(b, 1, 1, 1, 1)
        x_v = (1 - s_v) * x0_v + s_v * eps_v
        x_v[:, :, 0] = x0_v[:, :, 0]  # the current frame is the clean condition
        x_a = (1 - sigma.view(b, 1, 1)) * x0_a + sigma.view(b, 1, 1) * eps_a

        hw = self._canvas_hw(views[0])
        layout = self._layout(list(batch[TASK]), hw, tuple(x0_v.shape[1:]), (0,), ())
        t = sigma * NUM_TRAIN_TIMESTEPS
        t_v = t.repeat_interleave(torch.tensor(layout.num_noisy_vision_tokens, device=dev))
        t_a = t.repeat_interleave(torch.tensor(layout.num_noisy_action_tokens, device=dev))
        v_v, v_a = self._run(layout, x_v, t_v, x_a, t_a)

        loss_v = (v_v[:, :, 1:] - (eps_v - x0_v)[:, :, 1:]).square().mean()
        err_a = (v_a - (eps_a - x0_a)).square().mean(-1)
        loss_a = (err_a * keep).sum() / keep.sum().clamp(min=1.0)
        loss = loss_a + float(self.options["vision_loss_weight"]) * loss_v
        return {
            "loss": loss,
            "flow_matching_loss_action": loss_a.detach(),
            "flow_matching_loss_vision": loss_v.detach(),
        }

    # -- protocol: inference ----------------------------------------------------------------------
    @torch.no_grad()
    def predict(
        self, batch: dict[str, Any], mode: Mode = "policy", seed: int | None = None, **inputs: Any
    ) -> dict[str, np.ndarray]:
        """Model-space action chunks [B, chunk, action_dim] (``policy``, ``inverse_dynamics`` with
        ``inputs["goal_images"]`` = {image key: uint8 [B, H, W, 3]}), or the predicted frame ``chunk``
        steps ahead, uint8 [B, H, n_cams * W, 3] (``forward_dynamics`` with ``inputs["actions"]``
        [B, chunk, action_dim], model space). Request i draws its noise from ``seed + i``: the same
        request gives the same answer whatever else is in the batch. All B requests share one
        transformer call per denoising step."""
        b = self.io.check_batch(batch)
        seed = 0 if seed is None else int(seed)
        views = self._views(batch)
        t_lat = self._latent_frames()
        act_init = torch.zeros(b, self.io.chunk, self.io.action_dim)
        if mode == "policy":
            x0 = self._encode([[v] for v in views])
            vision_cond, action_cond = (0,), ()
        elif mode == "inverse_dynamics":
            goal = inputs.get("goal_images")
            if not isinstance(goal, dict):
                raise ValueError("inverse_dynamics needs goal_images={image key: uint8 [B, H, W, 3]}")
            goals = self._views(goal)
            x0 = self._encode([[v] + [g] * self.io.chunk for v, g in zip(views, goals)])
            vision_cond, action_cond = tuple(range(t_lat)), ()
        elif mode == "forward_dynamics":
            acts = inputs.get("actions")
            want = (b, self.io.chunk, self.io.action_dim)
            if acts is None or tuple(np.shape(acts)) != want:
                raise ValueError(
                    f"forward_dynamics needs actions of shape {list(want)}, got {np.shape(acts)}"
                )
            act_init = torch.as_tensor(np.asarray(acts), dtype=torch.float32)
            x0 = self._encode([[v] for v in views])
            vision_cond, action_cond = (0,), tuple(range(self.io.chunk))
        else:
            raise ValueError(
                f"mode {mode!r} is unknown; expected policy, forward_dynamics or inverse_dynamics"
            )
        c, _, h, w = x0.shape[1:]
        layout = self._layout(
            list(batch[TASK]), self._canvas_hw(views[0]), (c, t_lat, h, w), vision_cond, action_cond
        )
        lat_v, lat_a = self._sample(layout, x0, vision_cond, act_init, action_cond, seed)
        if mode == "forward_dynamics":
            return {"frames": self._decode_last_frame(lat_v)}
        return {"actions": lat_a.cpu().numpy().astype(np.float32)}

    def _sample(self, layout, x0, vision_cond, act_init, action_cond, seed):
        """UniPC denoising of all requests at once; conditioned frames/tokens are held fixed, as in the
        pipeline (their velocity is zeroed)."""
        dev, n, t_lat = self.device, layout.n, self._latent_frames()
        shape_v = (1, x0.shape[1], t_lat, *x0.shape[3:])
        noise_v, noise_a = [], []
        for i in range(n):  # the pipeline's draw order: the vision latents, then the actions
            g = torch.Generator("cpu").manual_seed(seed + i)
            noise_v.append(torch.randn(shape_v, generator=g))
            noise_a.append(torch.randn(act_init.shape[1:], generator=g))
        cond_v = torch.zeros(t_lat, 1, 1, device=dev)
        cond_v[list(vision_cond)] = 1.0
        cond_a = torch.zeros(self.io.chunk, 1, device=dev)
        cond_a[list(action_cond)] = 1.0
        lat_v = torch.cat(noise_v).to(dev)
        t0 = x0.shape[2]  # encoded frames: 1 (policy, forward dynamics) or all (inverse dynamics)
        lat_v[:, :, :t0] = cond_v[:t0] * x0 + (1 - cond_v[:t0]) * lat_v[:, :, :t0]
        lat_a = cond_a * act_init.to(dev) + (1 - cond_a) * torch.stack(noise_a).to(dev)

        sch_v = copy.deepcopy(self.scheduler)
        sch_v.set_timesteps(int(self.options["num_inference_steps"]), device=dev)
        sch_a = copy.deepcopy(sch_v)
        noisy_actions = len(action_cond) < self.io.chunk
        for t in sch_v.timesteps:
            t_v = t.float().expand(sum(layout.num_noisy_vision_tokens))
            t_a = t.float().expand(sum(layout.num_noisy_action_tokens))
            v_v, v_a = self._run(layout, lat_v, t_v, lat_a, t_a)
            lat_v = sch_v.step(v_v * (1 - cond_v), t, lat_v, return_dict=False)[0]
            if noisy_actions:
                lat_a = sch_a.step(v_a * (1 - cond_a), t, lat_a, return_dict=False)[0]
        return lat_v, lat_a

    def _decode_last_frame(self, lat_v: torch.Tensor) -> np.ndarray:
        vae = self.vae
        mean = self.pipe._vae_latents_mean.to(lat_v.device, vae.dtype).view(1, -1, 1, 1, 1)
        inv_std = self.pipe._vae_latents_inv_std.to(lat_v.device, vae.dtype).view(1, -1, 1, 1, 1)
        video = vae.decode(lat_v.to(vae.dtype) / inv_std + mean).sample  # [B, 3, F, H, W] in [-1, 1]
        last = video[:, :, -1].float().clamp(-1, 1)
        return ((last + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()

    # -- protocol: accounting ---------------------------------------------------------------------
    def nominal_layout(self) -> PackedLayout:
        """The layout of one request of ``io``'s size with a typical LIBERO task (for FLOP counts)."""
        if self._nominal is None:
            frame = np.zeros((self.io.image_size, self.io.image_size * len(self.io.cameras), 3), np.uint8)
            hw = self._canvas_hw(frame)
            s = int(self.vae.config.scale_factor_spatial)
            content = self.pipe._prepare_action_video_conditioning(
                [Image.fromarray(frame)],
                self.options["resolution_tier"],
                1,
                device="cpu",
                dtype=torch.float32,
            )[1]
            h, w = max(int(content[2]) // s, 1), max(int(content[3]) // s, 1)
            shape = (self.module.config.latent_channel, self._latent_frames(), h, w)
            task = "put both the alphabet soup and the tomato sauce in the basket"
            self._nominal = self._layout([task], hw, shape, (0,), ())
        return self._nominal

    def flops_per_sample(self) -> float:
        """Training FLOPs of one nominal LIBERO sample (see :func:`towers.train_flops`)."""
        lay = self.nominal_layout()
        return train_flops(self.module, lay.und_len, lay.sequence_length - lay.und_len)


def resolve_dtype(option: str, device: torch.device) -> torch.dtype:
    if option == "bfloat16":
        return torch.bfloat16
    if option not in ("auto", "float32"):
        raise ConfigError(f"model.options.dtype: {option!r}; expected auto, float32 or bfloat16")
    return torch.float32
