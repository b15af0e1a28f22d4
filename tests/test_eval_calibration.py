"""The calibration keeps to ``eval.calibrate_s``: the envs it steps are built before it, once; every call
it makes (connections, warm-up, cold and warm calls, each slot's timed start) counts in the budget;
when one call costs more than the budget it runs its floor and nothing more; the seconds it reports are
the seconds it took.

Real executor threads over in-process workers whose calls sleep a set time, and a policy that does
likewise. The assertions count calls and the seconds of sleep they asked for, never the machine's
speed: a sleep only lasts longer on a loaded machine, which makes the calibration stop sooner, never
ask for more.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from wamkit.envs.base import EpisodeSpec
from wamkit.eval.calibrate import MAX_SIM_ROUNDS, WARM_CALLS, batch_sizes, calibrate, start_envs
from wamkit.eval.executors import EnvWorkerPool

CHUNK, ACTION_DIM = 4, 4


class Work:
    """Seconds of sleep asked for, summed over the workers and the policy (thread-safe)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()

    def sleep(self, s: float) -> None:
        with self._lock:
            self.seconds += s
        time.sleep(s)


class SleepyHost:
    """A worker's env slots: a start sleeps ``start_s`` (a slot's first start ``build_s`` more: it
    builds the simulator), each action of a chunk ``step_s``; episodes never end."""

    def __init__(self, work: Work, start_s: float, step_s: float, build_s: float) -> None:
        self.work, self.start_s, self.step_s, self.build_s = work, start_s, step_s, build_s
        self.built: Counter[int] = Counter()
        self.starts = self.advances = 0

    def max_steps(self, payload: Any) -> dict:
        return {}

    def start(self, slot_specs: dict[int, EpisodeSpec]) -> dict[int, dict]:
        out = {}
        for slot in slot_specs:
            if not self.built[slot]:
                self.built[slot] += 1
                self.work.sleep(self.build_s)
            self.work.sleep(self.start_s)
            self.starts += 1
            out[slot] = {"obs": {"state": np.zeros(3, np.float32)}}
        return out

    def advance(self, payload: dict) -> dict[int, dict]:
        self.advances += 1
        out = {}
        for slot, chunk in payload["actions"].items():
            self.work.sleep(self.step_s * len(chunk))
            k = len(chunk)
            out[slot] = {
                "obs": {"state": np.zeros(3)},
                "rewards": [0.0] * k,
                "terminated": False,
                "truncated": False,
            }
        return out


class InThread:
    """A worker handle that runs its host in the executor's dispatcher thread."""

    def __init__(self, host: SleepyHost) -> None:
        self.host, self._job = host, None

    def submit(self, method: str, payload: Any) -> None:
        self._job = (method, payload)

    def result(self, timeout: float | None = None) -> Any:
        method, payload = self._job
        return getattr(self.host, method)(payload)

    def kill(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return True


class SleepyPolicy:
    """A connection whose every call sleeps ``call_s`` and reports it as the server's time."""

    def __init__(self, work: Work, call_s: float) -> None:
        self.work, self.call_s = work, call_s
        self.sizes: list[int] = []

    def __call__(self, obs_list: list[dict], seeds: list[int] | None = None) -> tuple:
        self.sizes.append(len(obs_list))
        self.work.sleep(self.call_s)
        return np.zeros((len(obs_list), 2 * CHUNK, ACTION_DIM), np.float32), self.call_s, len(obs_list), 0


def _setup(workers: int, num_envs: int, start_s: float, step_s: float, call_s: float, build_s: float = 0.0):
    work = Work()
    hosts = [SleepyHost(work, start_s, step_s, build_s) for _ in range(workers)]
    ex = EnvWorkerPool(lambda w: InThread(hosts[w]), workers)
    policy = SleepyPolicy(work, call_s)
    episodes = [EpisodeSpec("toy", "t", trial, 0) for trial in range(num_envs)]
    return work, hosts, ex, policy, episodes


def test_the_envs_are_built_before_the_calibration_and_once():
    work, hosts, ex, policy, episodes = _setup(2, 4, start_s=0.0, step_s=0.0, call_s=0.0, build_s=0.05)
    envs = start_envs(ex, 4, episodes)
    assert [dict(h.built) for h in hosts] == [{0: 1, 1: 1}, {0: 1, 1: 1}]
    assert sum(h.starts for h in hosts) == 4
    work.seconds = 0.0
    cal = calibrate(envs, {"ws://a": lambda: policy}, batch_sizes(4, 2), 0.2, CHUNK)
    assert [dict(h.built) for h in hosts] == [{0: 1, 1: 1}, {0: 1, 1: 1}]  # nothing built again
    assert sum(h.starts for h in hosts) >= 8  # the calibration's timed start of every slot: a restart
    assert work.seconds == 0.0 and cal.t_reset >= 0.0


def test_a_budget_below_one_call_runs_the_floor_and_nothing_more():
    """Each call outlasts the whole budget: per batch size a cold call (the warm-up reply is size N's),
    WARM_CALLS warm and one timed; one timed start of every slot and one timed chunk."""
    work, hosts, ex, policy, episodes = _setup(1, 2, start_s=0.1, step_s=0.05, call_s=0.1)
    envs = start_envs(ex, 2, episodes)
    work.seconds, starts = 0.0, hosts[0].starts
    t0 = time.perf_counter()
    cal = calibrate(envs, {"ws://a": lambda: policy}, [1, 2], 0.05, CHUNK)
    wall = time.perf_counter() - t0
    assert Counter(policy.sizes) == {1: 1 + WARM_CALLS + 1, 2: 1 + WARM_CALLS + 1}
    assert policy.sizes[0] == 2  # the warm-up reply, at N
    assert (hosts[0].starts - starts, hosts[0].advances) == (2, 1)
    assert work.seconds <= cal.seconds <= wall  # the figure it reports is what it took
    assert cal.latency == {1: 0.1, 2: 0.1} and cal.t_step >= 0.05  # busy seconds per step


@pytest.mark.parametrize("budget_s", [0.6, 1.2])
def test_everything_the_calibration_does_fits_its_budget(budget_s):
    """The timed start of every slot (0.3 s for the three), the warm-up reply, the cold and warm calls
    count in the budget (a calibration that left them out asked for 1.4 s of a 0.6 s budget, 1.8 s
    of 1.2 s). The slack is what a loaded machine can add: every batch size's floor after the
    inference half's end, a call and a round under way when time is up."""
    call_s, start_s, step_s = 0.02, 0.1, 0.005
    work, hosts, ex, policy, episodes = _setup(1, 3, start_s=start_s, step_s=step_s, call_s=call_s)
    envs = start_envs(ex, 3, episodes)
    work.seconds, starts, sizes = 0.0, hosts[0].starts, [1, 3]
    t0 = time.perf_counter()
    cal = calibrate(envs, {"ws://a": lambda: policy}, sizes, budget_s, CHUNK)
    wall = time.perf_counter() - t0
    round_s = 3 * CHUNK * step_s
    slack = (len(sizes) * (2 + WARM_CALLS) + 1) * call_s + round_s
    assert work.seconds <= budget_s + slack
    assert work.seconds <= cal.seconds <= wall
    assert hosts[0].starts - starts == 3  # episodes never end: only the timed start of every slot
    assert 1 <= hosts[0].advances <= MAX_SIM_ROUNDS
    assert set(cal.latency) == {1, 3}
