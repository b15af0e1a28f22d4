"""Real-time chunking (wamkit.models.rtc): the paper's soft mask and weight, the tiny model's guided
sampler, and the served fields (rows with and without it, different delays, in one model call)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close
from wamkit.constants import OBS_STATE, PROMPT, image_key
from wamkit.models.rtc import guidance_weight, request_rows, soft_mask
from wamkit.serve.loading import random_init
from wamkit.serve.policy import RequestError

# the served tiny model's sums (tests/test_serve_server.py: width 160 x depth 3 x 2), once more for the
# guidance's backward pass through them
LENGTH = 160 * 3 * 2 * 2


def test_soft_mask_is_the_papers_schedule():
    # H = 16, leftover K = 8, d = 3: 1 for i < d, c_i (e^c_i - 1) / (e - 1) with c_i = (K - i) / (K - d + 1)
    w = soft_mask(16, 8, 3)
    want = (
        [1.0] * 3 + [((8 - i) / 6) * math.expm1((8 - i) / 6) / (math.e - 1) for i in range(3, 8)] + [0.0] * 8
    )
    np.testing.assert_allclose(w, want, rtol=1e-6)
    assert list(soft_mask(16, 8, 3, "linear")[3:8]) == pytest.approx([(8 - i) / 6 for i in range(3, 8)])
    assert list(soft_mask(16, 8, 3, "ones")) == [1.0] * 8 + [0.0] * 8
    assert list(soft_mask(16, 8, 3, "zeros")) == [1.0] * 3 + [0.0] * 13
    with pytest.raises(ValueError, match="delay"):
        soft_mask(16, 4, 5)


def test_guidance_weight_is_clipped_at_beta():
    beta = torch.tensor([5.0, 100.0])
    assert guidance_weight(1.0, beta).tolist() == [5.0, 100.0]  # pure noise: the clip
    # t = 0.5 (tau = 0.5): (1 - tau) / (tau r2) with r2 = 0.5 -> 2
    assert guidance_weight(0.5, beta).tolist() == pytest.approx([2.0, 2.0])
    assert guidance_weight(0.0, beta).tolist() == [0.0, 0.0]


@pytest.fixture(scope="module")
def served():
    return random_init("tiny", "small", device="cpu")


def obs(served, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    io = served.io
    out = {image_key(c): rng.integers(0, 255, (n, 64, 64, 3), dtype=np.uint8) for c in io.cameras}
    return out | {OBS_STATE: rng.normal(size=(n, io.state_dim)).astype(np.float32), PROMPT: ["reach"] * n}


def reply(served, request: dict) -> np.ndarray:
    return served.run([served.prepare(request)])[0]["actions"]


def test_committed_prefix_kept_and_overlap_guided(served):
    base = reply(served, obs(served, 2) | {"seed": [7, 8]})
    prev = np.clip(base[:, 8:] * 0.5 + 0.2, -1, 1).astype(np.float32)  # another plan's leftover, K = 8
    guided = reply(served, obs(served, 2) | {"seed": [7, 8], "prev_actions": prev, "delay": np.array([3, 5])})
    for row, d in enumerate((3, 5)):
        # the committed actions, through the spec's encode and decode: fp32 rounding
        assert_rounding_close(guided[row, :d], prev[row, :d], length=4)
        # the rest of the overlap is pulled toward the leftover
        soft = slice(d, 8)
        assert (
            np.abs(guided[row, soft] - prev[row, soft]).mean()
            < np.abs(base[row, soft] - prev[row, soft]).mean()
        )


def test_rows_mixed_in_one_call_get_their_own_answers(served):
    """Requests with and without RTC, with different delays and leftovers, merged into one model call:
    each row answers as it does alone."""
    rng = np.random.default_rng(3)
    reqs = [
        obs(served, 1, 1) | {"seed": 11},
        obs(served, 1, 2)
        | {"seed": 12, "prev_actions": rng.uniform(-1, 1, (1, 8, 4)).astype(np.float32), "delay": 2},
        obs(served, 2, 3)
        | {
            "seed": [13, 14],
            "prev_actions": rng.uniform(-1, 1, (2, 12, 4)).astype(np.float32),
            "prev_actions_len": np.array([12, 0]),
            "delay": np.array([4, 0]),
        },
    ]
    together = served.run([served.prepare(r) for r in reqs])
    for r, got in zip(reqs, together):
        alone = served.run([served.prepare(r)])[0]
        assert_rounding_close(got["actions"], alone["actions"], length=LENGTH)
    # the unguided rows equal a request without the fields at all
    plain = reply(served, obs(served, 2, 3) | {"seed": [13, 14]})
    assert_rounding_close(together[2]["actions"][1], plain[1], length=LENGTH)
    assert_rounding_close(
        together[0]["actions"], reply(served, obs(served, 1, 1) | {"seed": 11}), length=LENGTH
    )


def test_rtc_fields_are_checked_by_name(served):
    base = obs(served, 1) | {"seed": 1}  # batched, B = 1
    prev = np.zeros((1, 8, 4), np.float32)
    with pytest.raises(RequestError, match="delay"):
        served.prepare(base | {"prev_actions": prev})
    with pytest.raises(RequestError, match="delay: expected"):
        served.prepare(base | {"prev_actions": prev, "delay": 9})
    with pytest.raises(RequestError, match="prev_actions: expected"):
        served.prepare(base | {"prev_actions": np.zeros((1, 8, 3), np.float32), "delay": 1})
    with pytest.raises(RequestError, match="rtc_schedule"):
        served.prepare(base | {"prev_actions": prev, "delay": 1, "rtc_schedule": "cubic"})
    with pytest.raises(RequestError, match="K <= the chunk"):
        served.prepare(base | {"prev_actions": np.zeros((1, 17, 4), np.float32), "delay": 1})


def test_a_model_without_a_flow_sampler_refuses_the_fields():
    delay = random_init("delay", "small", device="cpu")
    assert delay.metadata()["real_time_chunking"] is False
    with pytest.raises(
        RequestError, match="prev_actions, delay: real-time chunking needs a flow-matching sampler"
    ):
        delay.prepare(obs(delay, 1) | {"prev_actions": np.zeros((1, 4, 4), np.float32), "delay": 1})


def test_request_rows_pad_and_mask():
    rows = request_rows([np.ones((3, 2), np.float32), None], [1, 0], horizon=5, dim=2, schedule="ones")
    assert rows["actions"].shape == (2, 5, 2) and rows["actions"][0, 3:].sum() == 0
    assert rows["weights"].tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert rows["delay"].tolist() == [1, 0]


def test_served_rtc_over_the_wire():
    """docs/serve.md "Real-time chunking", as its snippet runs it: a real server, a real socket."""
    from wamkit.eval.server_proc import start_server_process
    from wamkit.serve.client import PolicyClient

    with start_server_process(["--model", "tiny", "--random-init", "--device", "cpu"]) as srv:
        client = PolicyClient(srv.url)
        assert client.metadata["real_time_chunking"] is True
        o = {
            "observation.images.corner": np.zeros((128, 128, 3), np.uint8),
            "observation.state": np.zeros(39, np.float32),
            "prompt": "open the drawer",
        }
        chunk = client.infer(o | {"seed": 0})["actions"]
        nxt = client.infer(o | {"seed": 1, "prev_actions": chunk[8:], "delay": 2})["actions"]
        client.close()
    assert chunk.shape == nxt.shape == (16, 4)
    assert np.allclose(nxt[:2], chunk[8:10], atol=1e-5)


@pytest.fixture(scope="module")
def prefix_served():
    """tiny trained for training-time RTC (``prefix_max_delay``): an rtc request's committed actions
    enter as clean tokens instead of guiding the sampler."""
    return random_init("tiny", "small", options={"prefix_max_delay": 8}, device="cpu")


def test_a_prefix_trained_model_conditions_on_the_committed_actions(prefix_served):
    served = prefix_served
    rng = np.random.default_rng(5)
    prev = rng.uniform(-1, 1, (2, 8, 4)).astype(np.float32)
    req = obs(served, 2) | {"seed": [7, 8], "prev_actions": prev, "delay": np.array([3, 6])}
    got = reply(served, req)
    for row, d in enumerate((3, 6)):
        assert_rounding_close(got[row, :d], prev[row, :d], length=4)
    # the prefix is an input, not a guide: the guidance clip is not used, and another prefix gives
    # another continuation
    assert_rounding_close(reply(served, req | {"rtc_max_guidance": 0.5}), got, length=LENGTH)
    other = reply(served, req | {"prev_actions": -prev})
    # (an untrained model's continuation barely depends on it: 1e-4 here, against fp32 rounding's 1e-6)
    assert np.abs(other[:, 6:] - got[:, 6:]).max() > 2e-5
    # rows with and without a prefix, with different delays, in one call: each answers as alone
    reqs = [
        obs(served, 1, 1) | {"seed": 11},
        obs(served, 1, 2) | {"seed": 12, "prev_actions": prev[:1], "delay": 5},
    ]
    together = served.run([served.prepare(r) for r in reqs])
    for r, row in zip(reqs, together):
        assert_rounding_close(row["actions"], served.run([served.prepare(r)])[0]["actions"], length=LENGTH)


def test_prefix_training_leaves_the_committed_actions_out_of_the_loss(monkeypatch):
    """With every sample's d = 0 the loss is the plain model's (the same noise and times; the per-token
    times only change the rounding); with d = chunk no action is left to learn."""
    plain = random_init("tiny", "small", device="cpu").adapter
    prefixed = random_init("tiny", "small", options={"prefix_max_delay": 8}, device="cpu").adapter
    prefixed.module.load_state_dict(plain.module.state_dict())
    io = plain.io
    rng = np.random.default_rng(0)
    batch = {
        image_key(c): torch.from_numpy(
            rng.integers(0, 255, (4, io.image_size, io.image_size, 3), dtype=np.uint8)
        )
        for c in io.cameras
    }
    batch |= {
        OBS_STATE: torch.from_numpy(rng.normal(size=(4, io.state_dim)).astype(np.float32)),
        "action": torch.from_numpy(rng.uniform(-1, 1, (4, io.chunk, io.action_dim)).astype(np.float32)),
        "task": ["reach"] * 4,
    }
    torch.manual_seed(0)
    want = plain.sft_loss(batch)["action_loss"]
    for d, expect in ((0, want), (io.chunk, torch.tensor(0.0))):
        monkeypatch.setattr(torch, "randint", lambda lo, hi, size, device=None, d=d: torch.full(size, d))
        torch.manual_seed(0)
        got = prefixed.sft_loss(batch)["action_loss"]
        assert_rounding_close(got.detach().numpy(), expect.detach().numpy(), length=LENGTH)


def test_a_prefix_as_long_as_the_chunk_is_refused():
    from wamkit.config import ConfigError

    with pytest.raises(ConfigError, match="prefix_max_delay: 16 leaves no action of the 16-action chunk"):
        random_init("tiny", "small", options={"prefix_max_delay": 16}, device="cpu")


def test_prefix_training_conditions_on_the_executed_actions_and_learns_the_recorded_ones(monkeypatch):
    """A perturbed collection's ``executed_action`` chunk is the committed prefix the model sees (as at
    inference it sees what the robot executes); the loss stays on the recorded labels after it. Without
    the column the prefix is the recorded actions, the same loss bit for bit."""
    from wamkit.constants import EXECUTED_ACTION

    served = random_init("tiny", "small", options={"prefix_max_delay": 8}, device="cpu")
    adapter, io = served.adapter, served.adapter.io
    assert adapter.sample_extras == (EXECUTED_ACTION,)
    assert random_init("tiny", "small", device="cpu").adapter.sample_extras == ()
    rng = np.random.default_rng(1)
    batch = {
        image_key(c): torch.from_numpy(
            rng.integers(0, 255, (4, io.image_size, io.image_size, 3), dtype=np.uint8)
        )
        for c in io.cameras
    }
    action = torch.from_numpy(rng.uniform(-1, 1, (4, io.chunk, io.action_dim)).astype(np.float32))
    executed = torch.from_numpy(rng.uniform(-1, 1, (4, io.chunk, io.action_dim)).astype(np.float32))
    batch |= {
        OBS_STATE: torch.from_numpy(rng.normal(size=(4, io.state_dim)).astype(np.float32)),
        "action": action,
        "task": ["reach"] * 4,
    }
    monkeypatch.setattr(torch, "randint", lambda lo, hi, size, device=None: torch.full(size, 5))
    seen = []
    forward = adapter.module.forward
    monkeypatch.setattr(
        adapter.module, "forward", lambda **kw: seen.append(kw["gen"]["actions"]) or forward(**kw)
    )

    def loss(b):
        torch.manual_seed(0)
        return adapter.sft_loss(b)["action_loss"]

    plain = loss(batch)
    assert torch.equal(loss(batch | {EXECUTED_ACTION: action.clone()}), plain)
    perturbed = loss(batch | {EXECUTED_ACTION: executed})
    assert torch.equal(seen[-1][:, :5], executed[:, :5])  # the prefix enters clean, as executed
    assert torch.equal(seen[-1][:, 5:], seen[0][:, 5:])  # the same noise over the same labels
    assert not torch.equal(perturbed, plain)  # another prefix, another continuation's error
