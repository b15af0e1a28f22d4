"""Which episodes an evaluation plans, by the suite's protocol: trials per task, the seed rule, and what
plan.json records (resolved settings and the simulator stack)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from wamkit.config import ConfigError, EnvConfig, EvalConfig
from wamkit.envs.base import episode_seed
from wamkit.envs.suites import resolve_env_config as resolve
from wamkit.eval.episodes import plan_episodes, plan_record
from wamkit.eval.journal import Journal

needs_libero = pytest.mark.skipif(
    importlib.util.find_spec("libero") is None, reason="LIBERO extra not installed: run `make setup-libero`"
)


def test_seed_rules():
    assert [episode_seed("openpi", 1000, t) for t in range(3)] == [7, 7, 7]
    assert [episode_seed("openvla", 1000, t) for t in range(3)] == [0, 0, 0]
    assert [episode_seed("per_trial", 1000, t) for t in range(3)] == [1000, 1001, 1002]
    with pytest.raises(ConfigError, match="env.seed_rule"):
        episode_seed("auto", 0, 0)


def test_metaworld_plan_seeds_each_trial_and_records_the_stack():
    env, ev = resolve(EnvConfig(tasks=["reach-v3", "push-v3"])), EvalConfig()
    eps = plan_episodes(env, ev)
    assert len(eps) == 2 * 10  # MetaWorld's protocol: 10 trials per task
    assert [(e.task, e.trial, e.seed) for e in eps[:3]] == [
        ("reach-v3", 0, 1000),
        ("push-v3", 0, 1000),
        ("reach-v3", 1, 1001),
    ]
    plan = plan_record(env, EvalConfig(trials=3), {"url": "ws://x"})
    assert (plan["trials"], plan["seed_rule"], plan["render_quality"], plan["seed"]) == (
        3,
        "per_trial",
        "fast",
        1000,
    )
    assert set(plan["stack"]) >= {"mujoco", "robosuite", "libero", "metaworld"}
    assert plan["stack"]["metaworld"] == "3.1.1"
    # where the env workers render (env.render_gpu) is recorded, so a resume elsewhere is refused
    assert plan["render_gpu"] == -1
    assert (
        plan_record(resolve(EnvConfig(tasks=["reach-v3"], render_gpu=1)), EvalConfig(), {})["render_gpu"] == 1
    )
    with pytest.raises(ConfigError, match="env.seed_rule"):
        resolve(EnvConfig(seed_rule="openpi"))
    # resolved once where a run starts: the plan takes the resolved config, and refuses a plain one
    assert resolve(env) is env
    with pytest.raises(TypeError, match="plan_episodes takes an env config resolved"):
        plan_episodes(EnvConfig(tasks=["reach-v3"]), ev)


@needs_libero
def test_libero_plan_is_openpis_protocol():
    env = resolve(EnvConfig(suite="libero_spatial", tasks=["0", "1"], cameras=["agentview"]))
    eps = plan_episodes(env, EvalConfig())
    assert len(eps) == 2 * 50 and {e.seed for e in eps} == {7}
    assert [e.trial for e in eps[:4]] == [0, 0, 1, 1]
    plan = plan_record(env, EvalConfig(), {"url": "ws://x"})
    assert (plan["seed_rule"], plan["seed"], plan["render_quality"], plan["trials"]) == (
        "openpi",
        7,
        "default",
        50,
    )
    vla = plan_episodes(
        resolve(EnvConfig(suite="libero_spatial", tasks=["0"], seed_rule="openvla")), EvalConfig(trials=2)
    )
    assert [(e.trial, e.seed) for e in vla] == [(0, 0), (1, 0)]
    old = plan_episodes(
        resolve(EnvConfig(suite="libero_spatial", tasks=["0"], seed_rule="per_trial")), EvalConfig(trials=2)
    )
    assert [(e.trial, e.seed) for e in old] == [(0, 1000), (1, 1001)]


def test_a_run_from_before_render_gpu_resumes_and_a_real_change_is_refused(tmp_path):
    """plan.json gained render_gpu later: a plan written before it lacks the key and is read as the
    -1 (EGL's choice) every such run rendered with; another render GPU is still another plan."""
    env = resolve(EnvConfig(tasks=["reach-v3"]))
    plan = plan_record(env, EvalConfig(trials=2), {"url": "ws://x"})
    old = {k: v for k, v in plan.items() if k != "render_gpu"}  # as the evaluator wrote it before
    Journal(tmp_path, old).close()
    with Journal(tmp_path, plan, resume=True) as j:
        assert j.plan["render_gpu"] == -1
    assert json.loads((tmp_path / "plan.json").read_text())["render_gpu"] == -1
    (tmp_path / "plan.json").write_text(json.dumps(old))
    moved = plan_record(
        resolve(EnvConfig(tasks=["reach-v3"], render_gpu=1)), EvalConfig(trials=2), {"url": "ws://x"}
    )
    with pytest.raises(ConfigError, match="render_gpu: -1 -> 1"):
        Journal(tmp_path, moved, resume=True)
    with pytest.raises(ConfigError, match="trials: 2 -> 3"):  # any other difference as before
        Journal(tmp_path, plan_record(env, EvalConfig(trials=3), {"url": "ws://x"}), resume=True)
