"""Random batches of the documented training format (see :mod:`wamkit.models.base`), for benchmarks
and tests: the right shapes and dtypes, no data needed."""

from __future__ import annotations

from typing import Any

import torch

from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, future_image_key, image_key


def synthetic_batch(
    io: Any,
    b: int,
    future: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    task: str = "pick up the block",
) -> dict[str, Any]:
    """A batch of ``b`` samples for a ModelIO: images, state, actions in [-1, 1], pads, tasks, and
    ``future`` future frames per camera (uint8 [b, future, H, W, 3]) when ``future > 0``."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, io.image_size, io.image_size, 3)
    batch: dict[str, Any] = {
        OBS_STATE: torch.randn(b, io.state_dim, generator=g),
        ACTION: torch.randn(b, io.chunk, io.action_dim, generator=g).clamp(-1, 1),
        ACTION_IS_PAD: torch.zeros(b, io.chunk, dtype=torch.bool),
        TASK: [task] * b,
    }
    for cam in io.cameras:
        batch[image_key(cam)] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        if future:
            fshape = (b, future, *shape[1:])
            batch[future_image_key(cam)] = torch.randint(0, 256, fshape, dtype=torch.uint8, generator=g)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
