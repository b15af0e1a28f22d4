"""Size presets and options of the built-in world action model ``tiny``.

A preset is a set of :class:`TinyConfig` field values; ``model.options`` override single fields
(``model.options.depth=2``) and are checked by name and type, so a typo gets the nearest valid key.
The three presets share all code: ``small`` trains on 2 CPU cores in minutes, ``base`` is ~100M and
``1b`` >= 1B parameters (for GPU benchmarks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from wamkit.config import ConfigError, _suggest, from_dict


@dataclass
class TinyConfig:
    """Architecture, loss and sampler of ``tiny``. Resolution and patch sizes are in pixels."""

    width: int = 160  # residual stream width of both towers
    depth: int = 3  # number of joint-attention blocks
    heads: int = 4
    mlp_ratio: float = 4.0
    image_res: int = 64  # camera images are resized (area) to image_res x image_res inside the model
    patch: int = 16  # total downsampling of the image stem: (image_res / patch)^2 tokens per camera
    stem_channels: list[int] = field(default_factory=lambda: [32, 64])  # stride-2 convs before patchify
    text_len: int = 32  # task text bytes kept (padded / cut)
    world_res: int = 32  # the future-frame "latent": the first camera's future frame at world_res px
    world_patch: int = 8  # pixels per side of one future-frame token
    world_weight: float = 0.0  # weight of the future-frame flow-matching loss; 0 drops the frame tokens
    # the frame head regresses the future frame's change from the current frame (its expected value;
    # not diffused: the frame tokens enter as zeros at t = 1, each holding its patch of the current
    # frame). It starts at zero, so an untrained model forecasts a copy of the current frame.
    # False: the frame is flow-matched as the actions are.
    world_residual: bool = False
    # the regressed change's loss (world_residual only): "l1" forecasts its median, which keeps the
    # still background exactly still; "mse" its mean, which spreads a moving arm's blur over every pixel
    world_loss: str = "mse"
    forward_dynamics_prob: float = 0.0  # share of training samples in forward-dynamics mode
    inverse_dynamics_prob: float = 0.0  # share of training samples in inverse-dynamics mode
    num_steps: int = 5  # Euler steps at inference
    # the Euler steps this model was step-distilled for (wamkit.models.tiny.distill; 0: not distilled) and
    # its teacher's steps: recorded with the model, so a server asked for more steps says so
    distilled_steps: int = 0
    distilled_teacher_steps: int = 0
    time_shift: float = 2.0  # t' = s t / (1 + (s - 1) t); s > 1 spends more steps near noise (t = 1)
    keys_to_select: list[str] = field(default_factory=list)  # trainable-name substrings; empty: all
    head_lr_mult: float = 1.0  # learning-rate multiplier of the action / frame heads and time embedder
    # training-time real-time chunking (Black, Ren, Equi and Levine 2025, arXiv 2512.05964): each
    # training sample's first d actions, d uniform in [0, prefix_max_delay], enter clean (flow time 0)
    # and are left out of the loss, so the model learns to continue a committed prefix. Such a model
    # answers an rtc request (wamkit.models.rtc) by taking the committed actions as clean tokens instead
    # of guiding its sampler. 0: off (the plain flow policy)
    prefix_max_delay: int = 0

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"model.options.{key}: {why}")

        for key in ("width", "depth", "heads", "image_res", "patch", "text_len", "world_res", "world_patch"):
            if getattr(self, key) < 1:
                raise bad(key, f"must be >= 1, got {getattr(self, key)}")
        if self.width % self.heads:
            raise bad("heads", f"width {self.width} must be divisible by heads {self.heads}")
        if (self.width // self.heads) % 2:
            raise bad("heads", f"head dim width/heads = {self.width // self.heads} must be even")
        stride = 2 ** len(self.stem_channels)
        if self.patch % stride:
            raise bad("patch", f"{self.patch} must be divisible by 2^len(stem_channels) = {stride}")
        if self.image_res % self.patch:
            raise bad("image_res", f"{self.image_res} must be divisible by patch {self.patch}")
        if self.world_res % self.world_patch:
            raise bad("world_res", f"{self.world_res} must be divisible by world_patch {self.world_patch}")
        if self.num_steps < 1:
            raise bad("num_steps", f"must be >= 1, got {self.num_steps}")
        for key in ("distilled_steps", "distilled_teacher_steps"):
            if getattr(self, key) < 0:
                raise bad(key, f"must be >= 0 (0: not distilled), got {getattr(self, key)}")
        if self.time_shift <= 0:
            raise bad("time_shift", f"must be > 0, got {self.time_shift}")
        if self.world_loss not in ("mse", "l1"):
            raise bad("world_loss", f"must be mse or l1, got {self.world_loss!r}")
        if self.world_loss == "l1" and not self.world_residual:
            raise bad(
                "world_loss",
                "l1 needs world_residual=true (a diffused frame is trained by its velocity's MSE)",
            )
        if self.world_weight < 0:
            raise bad("world_weight", f"must be >= 0, got {self.world_weight}")
        for key in ("forward_dynamics_prob", "inverse_dynamics_prob"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise bad(key, f"must be in [0, 1], got {getattr(self, key)}")
        if self.forward_dynamics_prob + self.inverse_dynamics_prob > 1.0:
            raise bad("inverse_dynamics_prob", "forward_dynamics_prob + inverse_dynamics_prob must be <= 1")
        if self.prefix_max_delay < 0:
            raise bad("prefix_max_delay", f"must be >= 0, got {self.prefix_max_delay}")

    @property
    def uses_frames(self) -> bool:
        """Whether future-frame tokens are part of the model (they cost compute when unused)."""
        return self.world_weight > 0 or self.forward_dynamics_prob > 0 or self.inverse_dynamics_prob > 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS: dict[str, dict[str, Any]] = {
    # ~1.5M parameters; 16 image tokens from a small conv stem on 64 px, few Euler steps.
    "small": {},
    # ~100M parameters: a ViT-style patch stem on 128 px (64 tokens), frames on a 64 px grid.
    "base": {
        "width": 768,
        "depth": 7,
        "heads": 12,
        "image_res": 128,
        "patch": 16,
        "stem_channels": [],
        "text_len": 64,
        "world_res": 64,
        "world_patch": 8,
        "world_weight": 0.1,
        "forward_dynamics_prob": 0.1,
        "inverse_dynamics_prob": 0.1,
        "num_steps": 10,
    },
}
# >= 1B parameters: the same shapes as base, wider and deeper (head dim 128).
PRESETS["1b"] = {**PRESETS["base"], "width": 2048, "depth": 12, "heads": 16}


def resolve_config(preset: str, options: dict[str, Any]) -> TinyConfig:
    """The preset's values with ``options`` on top; unknown presets / keys raise :class:`ConfigError`."""
    if preset not in PRESETS:
        raise ConfigError(
            f"model.preset: unknown preset '{preset}' for model 'tiny'{_suggest(preset, PRESETS)} "
            f"(valid: {', '.join(PRESETS)})"
        )
    return from_dict(TinyConfig, {**PRESETS[preset], **options}, prefix="model.options")
