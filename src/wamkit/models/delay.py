"""BENCHMARK MODEL, NOT A POLICY: inference is a fixed, configurable delay plus a deterministic function.

``delay`` exists to measure the server and the evaluator on their own: its ``predict`` sleeps
``delay_ms + per_obs_ms * B`` milliseconds (a stand-in for a GPU forward pass whose cost is mostly
launch overhead plus a per-observation part) and returns actions that depend only on the inputs, so a
run with it is reproducible and a reply can be checked against an in-process call.

Options (``model.options``):

- ``delay_ms`` (float, default 0): fixed cost of one ``predict`` call, in milliseconds;
- ``per_obs_ms`` (float, default 0): extra cost per observation in the batch, in milliseconds;
- ``host_calls`` (whole number, default 0): then this many small torch calls on the host, each releasing and
  retaking the interpreter lock as a launch-bound GPU model's host thread does around every kernel
  launch: the stand-in for a model whose host, not its GPU, sets the pace. It is a fixed amount of
  work, so other busy threads of its process stretch it, as they stretch such a model (a call takes a
  few microseconds on an idle core). The sleeps above release the lock for their whole length.

Outputs, model space (normalised), for a batch of B observations with normalised state ``s`` [B, S]:

    actions[b, t, d] = tanh(s[b, d % S] + 0.1 t + 0.5 m[b]) + offset[d]

where ``m[b]`` is the mean of the first camera's image scaled to [0, 1] (so a test can tell the
cameras apart) and ``offset`` [action_dim] is the one trainable parameter (zeros at init). The seed is
ignored: the function has no randomness. ``forward_dynamics`` returns the first camera's image shifted
by the mean of the given actions; ``inverse_dynamics`` is ``policy`` plus the goal image's mean (``goal_images`` uint8 [B, H, W, 3]).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from wamkit.config import ConfigError, ModelConfig, from_dict
from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, image_key
from wamkit.models.base import Mode, ModelIO, ParamGroup


def preset_io(name: str) -> ModelIO:
    """The inputs of preset ``name``: ``small`` (MetaWorld's shapes), or an embodiment's (its profile:
    default cameras at 128 px, its state, its actions in its representation), so every registered
    embodiment has a delay server (``--preset <embodiment>``, e.g. ``--preset metaworld``)."""
    if name == "small":
        return ModelIO()
    from wamkit import embodiments

    if name not in embodiments.names():
        have = ", ".join(["small", *embodiments.names()])
        raise ConfigError(f"model.preset: '{name}' is not a delay preset (have: {have})")
    return ModelIO.of_embodiment(name)


@dataclass
class DelayOptions:
    """``model.options`` of the delay model (checked by :func:`wamkit.config.from_dict`, as every
    model's options are)."""

    delay_ms: float = 0.0  # a predict call's fixed cost
    per_obs_ms: float = 0.0  # and its cost per observation of the batch
    host_calls: int = 0  # small torch calls per predict (a launch-bound stand-in)

    def __post_init__(self) -> None:
        for key in ("delay_ms", "per_obs_ms"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"model.options.{key}: expected a non-negative number of ms, got {getattr(self, key)}"
                )
        if self.host_calls < 0:
            raise ConfigError(
                f"model.options.host_calls: expected a non-negative whole number of calls, got {self.host_calls}"
            )


def _np(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class _Offset(torch.nn.Module):
    def __init__(self, action_dim: int):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.zeros(action_dim))


class DelayModel:
    """The ``delay`` benchmark adapter (see the module docstring). Not a robot policy."""

    name = "delay"
    supports_rtc = False  # no flow sampler to guide
    future_frame_offsets: tuple[int, ...] = ()

    def __init__(self, io: ModelIO, preset: str, delay_ms: float, per_obs_ms: float, host_calls: int = 0):
        self.io = io
        self.preset = preset
        self.delay_ms = delay_ms
        self.per_obs_ms = per_obs_ms
        self.host_calls = host_calls
        self.module = _Offset(io.action_dim)
        self._scratch = torch.zeros(8)

    # -- training (trivial: only the offset learns) ----------------------------------------------
    def param_groups(self) -> list[ParamGroup]:
        return [ParamGroup("offset", list(self.module.parameters()), weight_decay=False)]

    def blocks(self) -> list[torch.nn.Module]:
        return []

    def _base(self, batch: dict[str, Any]) -> np.ndarray:
        """The parameter-free part of the actions, float32 [B, chunk, action_dim]."""
        state = _np(batch[OBS_STATE]).astype(np.float64)
        b, s = state.shape
        img = _np(batch[image_key(self.io.cameras[0])])
        m = img.reshape(b, -1).astype(np.float64).mean(1) / 255.0
        d = np.arange(self.io.action_dim) % s
        t = np.arange(self.io.chunk)[:, None]
        x = state[:, None, d] + 0.1 * t[None] + 0.5 * m[:, None, None]
        return np.tanh(x).astype(np.float32)

    def sft_loss(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        self.io.check_batch(batch, training=True)
        pred = torch.as_tensor(self._base(batch)) + self.module.offset
        target = torch.as_tensor(batch[ACTION], dtype=torch.float32)
        err = (pred - target) ** 2
        pad = batch.get(ACTION_IS_PAD)
        if pad is not None:
            keep = (~torch.as_tensor(pad, dtype=torch.bool))[..., None].float()
            loss = (err * keep).sum() / keep.sum().clamp(min=1) / self.io.action_dim
        else:
            loss = err.mean()
        return {"loss": loss, "mse": loss.detach()}

    # -- inference ---------------------------------------------------------------------------------
    @torch.no_grad()
    def predict(
        self,
        batch: dict[str, Any],
        mode: Mode = "policy",
        seed: int | Sequence[int] | None = None,
        **inputs: Any,
    ) -> dict[str, np.ndarray]:
        b = self.io.check_batch(batch)
        time.sleep((self.delay_ms + self.per_obs_ms * b) / 1000.0)
        for _ in range(self.host_calls):
            torch.add(self._scratch, 1.0, out=self._scratch)
        offset = self.module.offset.detach().cpu().numpy()
        if mode == "policy":
            return {"actions": self._base(batch) + offset}
        if mode == "inverse_dynamics":
            goal = _np(inputs["goal_images"])
            g = goal.reshape(b, -1).astype(np.float32).mean(1) / 255.0
            return {"actions": self._base(batch) + offset + g[:, None, None]}
        if mode == "forward_dynamics":
            acts = _np(inputs["actions"]).reshape(b, -1).astype(np.float32).mean(1)
            img = _np(batch[image_key(self.io.cameras[0])]).astype(np.float32)
            frames = np.clip(img + 10.0 * acts[:, None, None, None], 0, 255).astype(np.uint8)
            return {"frames": frames}
        raise ValueError(f"mode {mode!r} is unknown; expected policy, forward_dynamics or inverse_dynamics")

    # -- description -------------------------------------------------------------------------------
    def config_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "preset": self.preset,
            "options": {
                "delay_ms": self.delay_ms,
                "per_obs_ms": self.per_obs_ms,
                "host_calls": self.host_calls,
            },
            "io": self.io.to_dict(),
        }

    def flops_per_sample(self) -> float:
        return float(6 * self.io.chunk * self.io.action_dim)


def build(cfg: ModelConfig, io: ModelIO | None = None, **_: Any) -> DelayModel:
    """Build the benchmark model; ``io`` (from a dataset or an export) overrides the preset's."""
    preset = preset_io(cfg.preset)
    opts = from_dict(DelayOptions, dict(cfg.options), prefix="model.options")
    return DelayModel(io or preset, cfg.preset, opts.delay_ms, opts.per_obs_ms, opts.host_calls)


__all__ = ["DelayModel", "build", "preset_io"]
