"""Learning is real: ``tiny`` trained on scripted MetaWorld demonstrations (real simulator) for a short
plain-AdamW run drives its flow-matching loss far below the start and samples expert-like actions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_models_support import chunk_samples, collect_metaworld, one_thread, take  # noqa: F401
from wamkit.config import ModelConfig
from wamkit.constants import ACTION
from wamkit.models import ModelIO, build_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reach_data():
    episodes = collect_metaworld("reach-v3", episodes=4, size=64, seed=0)
    assert len(episodes) >= 3, "the scripted expert should solve reach-v3"
    return chunk_samples(episodes, chunk=16, task="reach-v3")


def train(data: dict, steps: int, options: dict) -> tuple[object, list[float]]:
    torch.manual_seed(0)
    adapter = build_model(ModelConfig(preset="small", options=options), ModelIO(image_size=64, chunk=16))
    opt = torch.optim.AdamW(adapter.module.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    n = len(data["task"])
    losses = []
    for _ in range(steps):
        out = adapter.sft_loss(take(data, torch.randint(0, n, (32,), generator=g)))
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(adapter.module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out["action_loss"].item())
    return adapter, losses


def sampled_error(adapter, data: dict) -> float:
    """Mean squared error of sampled action chunks against the expert's, on every 5th sample."""
    batch = take(data, torch.arange(0, len(data["task"]), 5))
    pred = adapter.predict(batch, seed=0)["actions"]
    return float(((pred - batch[ACTION].numpy()) ** 2).mean())


def test_action_loss_falls_and_samples_approach_the_expert(reach_data):
    untrained = build_model(ModelConfig(preset="small"), ModelIO(image_size=64, chunk=16))
    adapter, losses = train(reach_data, steps=100, options={})
    start, end = np.mean(losses[:10]), np.mean(losses[-20:])
    assert end < 0.35 * start, (start, end)
    assert sampled_error(adapter, reach_data) < 0.5 * sampled_error(untrained, reach_data)


@pytest.mark.slow
def test_world_loss_falls_too(reach_data):
    options = {"world_weight": 0.5, "forward_dynamics_prob": 0.2, "inverse_dynamics_prob": 0.2}
    torch.manual_seed(0)
    adapter, losses = train(reach_data, steps=150, options=options)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:10])
    batch = take(reach_data, torch.arange(0, 8))
    torch.manual_seed(1)
    world = adapter.sft_loss(batch)["world_loss"].item()
    assert world < 0.8, world  # starts at ~1 + var(frame latent)
