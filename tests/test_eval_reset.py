"""An episode's result must not depend on what its env slot ran before (so not on the schedule).

MetaWorld's reset moves the goal marker after its last ``mj_forward``; the first frame then showed the
marker where the slot's previous episode left it, the (image-reading) delay policy answered
differently, and ``wamkit bench eval`` found different results for (a), (b) and (c). Real MetaWorld,
in process: the same episode in a fresh slot and in a slot that ran another episode first.
"""

from __future__ import annotations

import numpy as np

from wamkit.config import load_config
from wamkit.envs.base import EpisodeSpec
from wamkit.eval.chunk_host import ChunkHost


def test_first_frame_and_chunk_do_not_depend_on_the_previous_episode():
    env_cfg = load_config(
        None, ["env.tasks=push-v3", "env.image_size=64", "env.render_quality=fast", "env.max_steps=40"]
    ).env
    host = ChunkHost(env_cfg, 2)
    try:
        target = EpisodeSpec(suite="metaworld", task="push-v3", trial=1, seed=1)
        before = EpisodeSpec(suite="metaworld", task="push-v3", trial=0, seed=0)
        obs = host.reset({1: before})[1]
        for _ in range(100):  # the slot's previous episode: the expert, to success
            step = host.advance({"actions": {1: host.expert_actions({1: obs})[1][None]}})[1]
            obs = step["obs"]
            if step["terminated"]:
                break
        assert step["terminated"], "the expert should solve push-v3 seed 0 within 100 steps"
        first = host.reset({0: target, 1: target})
        assert first[0].keys() == first[1].keys()
        for key in first[0]:
            np.testing.assert_array_equal(first[0][key], first[1][key], err_msg=f"first obs {key}")
        chunk = np.random.default_rng(0).uniform(-1, 1, (8, 4)).astype(np.float32)
        out = host.advance({"actions": {0: chunk, 1: chunk}})
        np.testing.assert_array_equal(out[0]["rewards"], out[1]["rewards"])
        for key in out[0]["obs"]:
            np.testing.assert_array_equal(out[0]["obs"][key], out[1]["obs"][key], err_msg=f"obs {key}")
    finally:
        host.close()
