"""Real-time chunking on Cosmos3 (tiny preset, fp32, CPU): the guided UniPC sampler keeps the committed
actions, pulls the overlap toward the leftover, answers each row of a mixed batch as it does alone, and
gives the same chunk on the stock path (packed ``Cosmos3OmniTransformer.forward``) and the fast path
(cached text keys/values; a guided step runs eagerly, since a captured graph cannot be differentiated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.exactness import assert_rounding_close

pytest.importorskip("diffusers", reason="cosmos3 needs the wamkit[cosmos3] extra")

from tests.test_cosmos3_fast import IO, LENGTH, TASKS, make_batch  # noqa: E402
from wamkit.config import ModelConfig  # noqa: E402
from wamkit.models import build_model  # noqa: E402
from wamkit.models.rtc import request_rows  # noqa: E402

# the guided step adds a backward pass through the same sums (tests/test_cosmos3_fast.py's LENGTH)
GUIDED = 2 * LENGTH


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(2)
    opts = {"num_inference_steps": 4, "dtype": "float32"}
    return build_model(ModelConfig(name="cosmos3", preset="tiny", options=opts), IO)


def leftovers(base: np.ndarray) -> list[np.ndarray]:
    return [np.clip(base[i, 8:] * 0.5 + 0.3, -1, 1).astype(np.float32) for i in range(len(base))]


def test_guided_chunk_keeps_the_committed_actions_on_both_paths(adapter):
    batch = make_batch(TASKS)
    base = adapter.predict(batch, seed=[1, 2, 3])["actions"]
    left = leftovers(base)
    rtc = request_rows([left[0], None, left[2]], [3, 0, 5], IO.chunk, IO.action_dim)
    out = {}
    for fast in (False, True):
        adapter.options.fast_inference = fast
        try:
            out[fast] = adapter.predict(batch, seed=[1, 2, 3], rtc=rtc)["actions"]
        finally:
            adapter.options.fast_inference = True
    assert_rounding_close(out[True], out[False], length=GUIDED)
    got = out[True]
    for row, d in ((0, 3), (2, 5)):
        np.testing.assert_array_equal(got[row, :d], left[row][:d])  # stated as executed
        soft = slice(d, 8)
        assert (
            np.abs(got[row, soft] - left[row][soft]).mean() < np.abs(base[row, soft] - left[row][soft]).mean()
        )
    assert_rounding_close(got[1], base[1], length=GUIDED)  # the unguided row


def test_each_row_of_a_mixed_batch_answers_as_alone(adapter):
    batch = make_batch(TASKS)
    base = adapter.predict(batch, seed=[4, 5, 6])["actions"]
    left = leftovers(base)
    rtc = request_rows([left[0], left[1], None], [2, 6, 0], IO.chunk, IO.action_dim, "linear", 3.0)
    together = adapter.predict(batch, seed=[4, 5, 6], rtc=rtc)["actions"]
    for i in range(3):
        one = {k: (v[i : i + 1] if k != "task" else v[i : i + 1]) for k, v in batch.items()}
        alone = adapter.predict(one, seed=[4 + i], rtc={k: v[i : i + 1] for k, v in rtc.items()})["actions"]
        assert_rounding_close(together[i], alone[0], length=GUIDED)
