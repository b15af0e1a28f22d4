"""Shared helpers of the model tests (no tests here): synthetic batches, scripted MetaWorld demos."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wamkit.constants import ACTION, ACTION_IS_PAD, OBS_STATE, TASK, future_image_key, image_key
from wamkit.models.base import ModelIO
from wamkit.models.synthetic import synthetic_batch


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, 2 OpenMP threads competing with other processes
    made a training step of ``small`` ~20x slower (0.2 s -> 4 s) than one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_batch(io: ModelIO, b: int, seed: int = 0, future: bool = True) -> dict:
    """A training batch of the documented format with random content (one future frame per camera)."""
    batch = synthetic_batch(io, b, 1 if future else 0, seed=seed)
    batch[TASK] = [f"task {i % 3}" for i in range(b)]
    return batch


def collect_metaworld(task: str, episodes: int, size: int, max_steps: int = 150, seed: int = 0) -> list[dict]:
    """Run MetaWorld's scripted expert for ``task``; return successful episodes as dicts of arrays:
    ``images`` uint8 [T, size, size, 3] (corner camera, fast render), ``state`` [T, 39], ``action`` [T, 4]."""
    import gymnasium as gym
    import metaworld  # noqa: F401  (registers the Meta-World environments)
    import metaworld.policies as policies

    name = "Sawyer" + "".join(p.capitalize() for p in task.replace("-v3", "").split("-")) + "V3Policy"
    policy = getattr(policies, name)()
    env = gym.make(
        "Meta-World/MT1",
        env_name=task,
        render_mode="rgb_array",
        camera_name="corner",
        width=size,
        height=size,
    )
    model = env.unwrapped.model
    model.vis.quality.shadowsize = 0
    model.vis.quality.offsamples = 0
    model.mat_reflectance[:] = 0
    out = []
    try:
        for ep in range(episodes):
            obs, _ = env.reset(seed=seed + ep)
            images, states, actions = [], [], []
            for _ in range(max_steps):
                act = np.clip(policy.get_action(obs), -1.0, 1.0).astype(np.float32)
                images.append(env.render().copy())
                states.append(obs.astype(np.float32))
                actions.append(act)
                obs, _, _, _, info = env.step(act)
                if info["success"]:
                    break
            if info["success"]:
                out.append(
                    {"images": np.stack(images), "state": np.stack(states), "action": np.stack(actions)}
                )
    finally:
        env.close()
    return out


def chunk_samples(episodes: list[dict], chunk: int, task: str, camera: str = "corner") -> dict:
    """All (frame, chunk) samples of ``episodes`` as one big batch; state normalised to zero mean, unit
    std; actions (already in [-1, 1]) kept; chunks past the episode end are padded and flagged."""
    states = np.concatenate([e["state"] for e in episodes])
    mean, std = states.mean(0), states.std(0) + 1e-3
    imgs, sts, acts, pads, futs = [], [], [], [], []
    for e in episodes:
        t_len = len(e["action"])
        for t in range(t_len):
            idx = np.arange(t, t + chunk)
            pads.append(idx >= t_len)
            acts.append(e["action"][np.minimum(idx, t_len - 1)])
            imgs.append(e["images"][t])
            futs.append(e["images"][min(t + chunk, t_len - 1)])
            sts.append((e["state"][t] - mean) / std)
    return {
        image_key(camera): torch.from_numpy(np.stack(imgs)),
        future_image_key(camera): torch.from_numpy(np.stack(futs))[:, None],  # one frame: [B, 1, H, W, 3]
        OBS_STATE: torch.from_numpy(np.stack(sts).astype(np.float32)),
        ACTION: torch.from_numpy(np.stack(acts)),
        ACTION_IS_PAD: torch.from_numpy(np.stack(pads)),
        TASK: [task] * len(imgs),
        "_stats": (mean, std),
    }


def take(data: dict, idx: torch.Tensor) -> dict:
    """Rows ``idx`` of a batch made by :func:`chunk_samples`."""
    out = {}
    for k, v in data.items():
        if k.startswith("_"):
            continue
        out[k] = [v[i] for i in idx.tolist()] if isinstance(v, list) else v[idx]
    return out
