"""The GPU executor's env host: N sub-scenes simulated together in one process (``eval.executor=gpu``).

It answers the calls :class:`~wamkit.eval.chunk_host.ChunkHost` answers (``start``, ``advance``,
``max_steps``), over a suite's batched env (a backend's ``make_batch``: ManiSkill3's
:class:`~wamkit.envs.maniskill_batch.ManiSkillBatchEnv`). The scheduler gives each stage a worker of its
own (:func:`wamkit.eval.scheduler.layout` with ``by_stage``), so every running episode of a worker is in
each of its ``advance`` calls and all of them step together: the k actions of a chunk are k steps of the
whole batch. An episode that ends mid-chunk (success, or its horizon) keeps the observation of its last
step and takes no further action; its sub-scene holds still until a new episode starts there.

An exception of the simulator fails every slot of the call (``{"error": ...}``; one simulation holds
them all), and the batched env is rebuilt, as ChunkHost rebuilds one env.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from wamkit.config import EnvConfig
from wamkit.constants import OBS_IMAGES
from wamkit.envs.base import EpisodeSpec
from wamkit.eval.chunk_host import ERROR, describe

log = logging.getLogger(__name__)


class BatchChunkHost:
    """``num_envs`` slots of one batched env; ``sim_backend`` as the backend's ``make_batch`` takes it."""

    def __init__(self, env_cfg: EnvConfig, num_envs: int, sim_backend: str = "physx_cuda") -> None:
        if num_envs < 1:
            raise ValueError(f"BatchChunkHost: num_envs must be >= 1, got {num_envs}")
        self.env_cfg, self.num_envs, self.sim_backend = env_cfg, num_envs, sim_backend
        self.env = self._build()
        self.specs: dict[int, EpisodeSpec] = {}
        self.steps = np.zeros(num_envs, np.int64)

    def _build(self) -> Any:
        from wamkit.envs.suites import batch_backend

        return batch_backend(self.env_cfg.suite).make_batch(self.env_cfg, self.num_envs, self.sim_backend)

    def _failed(self, slots: list[int], err: Exception) -> dict[int, dict[str, str]]:
        log.warning("batched env raised %s; rebuilding it (slots %s)", describe(err), slots)
        try:
            self.env.close()
        except Exception as close_err:  # noqa: BLE001 - a broken simulation may fail to close; it is replaced
            log.warning("batched env: close failed (%s)", describe(close_err))
        self.specs.clear()  # every sub-scene went with it: the scheduler restarts what ran there
        self.env = self._build()
        return {s: {ERROR: describe(err)} for s in slots}

    def max_steps(self, slots: list[int] | None = None) -> dict[int, int]:
        names = self.specs if not slots else {s: self.specs[s] for s in slots}
        return {s: self.env.max_steps(spec) for s, spec in names.items()}

    def start(self, slot_specs: dict[int, Any]) -> dict[int, dict[str, Any]]:
        """Reset the given slots in one call of the batched env: ``{"obs": first observation}`` each."""
        specs = {
            int(s): EpisodeSpec.from_dict(spec) if isinstance(spec, dict) else spec
            for s, spec in slot_specs.items()
        }
        try:
            obs = self.env.reset(specs)
        except Exception as err:  # noqa: BLE001 - the simulator's own error: recorded, not fatal
            return self._failed(sorted(specs), err)
        self.specs.update(specs)
        self.steps[list(specs)] = 0
        return {s: {"obs": obs[s]} for s in specs}

    def advance(self, payload: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """ChunkHost's ``advance`` (the same payload and answer), every slot's chunk applied in lock-step.

        The chunks must be equally long: the scheduler sends each slot ``replan_interval`` actions."""
        chunks = {int(s): np.asarray(c) for s, c in payload["actions"].items()}
        film = set(payload.get("film", ()))
        lengths = {c.shape[0] for c in chunks.values()}
        for s, c in chunks.items():
            if c.ndim != 2:
                raise ValueError(f"advance: slot {s} actions must be [k, action_dim], got {list(c.shape)}")
            if s not in self.specs:
                raise RuntimeError(f"BatchChunkHost: slot {s} stepped before start")
        if len(lengths) > 1:
            raise ValueError(
                f"advance: the batched env steps every slot together, so the chunks must be equally "
                f"long; got lengths {sorted(lengths)}"
            )
        live = sorted(chunks)
        out: dict[int, dict[str, Any]] = {
            s: {"rewards": [], "successes": [], "terminated": False, "truncated": False, "frames": []}
            for s in live
        }
        try:
            for t in range(lengths.pop() if lengths else 0):
                if not live:
                    break
                rewards, successes = self.env.step({s: chunks[s][t] for s in live})
                ended, filmed = [], [s for s in live if s in film]
                for s in live:
                    self.steps[s] += 1
                    out[s]["rewards"].append(float(rewards[s]))
                    out[s]["successes"].append(bool(successes[s]))
                    out[s]["terminated"] = bool(successes[s])
                    out[s]["truncated"] = bool(
                        not successes[s] and self.steps[s] >= self.env.max_steps(self.specs[s])
                    )
                    if out[s]["terminated"] or out[s]["truncated"]:
                        ended.append(s)
                if filmed or ended:
                    seen = self.env.observe(sorted(set(filmed) | set(ended)))
                    for s in filmed:
                        out[s]["frames"].append(
                            {k: v for k, v in seen[s].items() if k.startswith(OBS_IMAGES)}
                        )
                    for s in ended:
                        out[s]["obs"] = seen[s]
                        self.specs.pop(s)
                live = [s for s in live if s not in ended]
            for s, obs in self.env.observe(live).items():
                out[s]["obs"] = obs
        except Exception as err:  # noqa: BLE001 - the simulator's own error: recorded, not fatal
            return self._failed(sorted(chunks), err)
        return out

    def gl_info(self, payload: Any = None) -> dict[str, str]:
        return {}

    def close(self) -> None:
        self.env.close()
