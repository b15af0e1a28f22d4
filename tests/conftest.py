"""Shared test set-up: headless rendering and paths to the upstream fixtures."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest

# A server a module's fixture runs in this process logs each closed connection at INFO from its own
# thread, into whatever handler an in-process CLI call left installed: lines in the suite's output
logging.getLogger("websockets.server").setLevel(logging.WARNING)

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

REPO = Path(__file__).resolve().parents[1]
# Datasets written by the real upstream libraries. The team's shared copy sits beside the checkout;
# tests/fixtures holds the same files so that a clone elsewhere tests against them too.
FIXTURES = REPO.parent / "shared" / "fixtures"
if not (FIXTURES / "libero_tiny").is_dir():
    FIXTURES = REPO / "tests" / "fixtures"


# The numerically sensitive tests: float results compared across code paths, widths, batch sizes or
# process layouts, or claimed bit-exact because the same kernels run in the same order. `make test`
# runs these a second time with ATEN_CPU_CAPABILITY=default (no AVX2/AVX-512 kernels) and
# OMP_NUM_THREADS=1 (other reduction splits), so a claim of exactness that holds on one CPU only, or a
# tolerance tuned to one machine, fails in CI rather than on a user's machine (tests/exactness.py).
NUMERICS = {
    "test_cosmos3_fast.py",
    "test_cosmos3_loss_reference.py",
    "test_cosmos3_scratch.py",
    "test_cosmos3_formats.py",
    "test_cosmos3_model.py",
    "test_cosmos3_prep.py",
    "test_cosmos3_sampler.py",
    "test_models_tiny.py",
    "test_rotations.py",
    "test_serve_text_tower.py",
    "test_train_base.py",
    "test_train_placement.py",
    "test_train_rendezvous.py",
}


if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
    # inductor's C++ code vectorises by its own probe of the CPU, and its vectorised kernels include
    # headers that this capability leaves out (they fail to compile: 'at::vec' has not been declared):
    # compiled code is scalar here, as the kernels it is compared with are
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1


# Tests of those files that compare no floats: a memory plan's byte arithmetic and its refusals
ARITHMETIC_ONLY = {
    "test_serve_text_tower.py::test_plan_nano",
    "test_serve_text_tower.py::test_a_size_where_nothing_fits_is_refused_naming_it",
    "test_serve_text_tower.py::test_a_serving_directory_is_planned_in_the_dtype_it_loads_in",
}


# LeRobot's policies run in .venv-lerobot (Python 3.12, torch < 2.12: `make setup-lerobot`), where `make
# test` runs these files; a Python without LeRobot leaves them out rather than reporting them skipped
if importlib.util.find_spec("lerobot") is None:
    collect_ignore_glob = ["test_lerobot_*.py"]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in NUMERICS and f"{item.path.name}::{item.originalname}" not in ARITHMETIC_ONLY:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(scope="session")
def libero_tiny() -> Path:
    """The LeRobot v3 dataset written by lerobot 0.6.1 (see ../shared/fixtures)."""
    root = FIXTURES / "libero_tiny"
    if not root.is_dir():
        pytest.fail(f"fixture {root} is missing (expected ../shared/fixtures or tests/fixtures)")
    return root


def spec_of(stats, io, **data):
    """The preprocessing spec training would build for ``io`` from ``stats`` and ``data.*`` settings."""
    from wamkit.config import DataConfig, RunConfig
    from wamkit.train.data_setup import build_spec

    return build_spec(RunConfig(data=DataConfig(chunk=io.chunk, **data)), io, stats)


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory) -> Path:
    """wamkit as a user gets it: the wheel built from this checkout, installed into a fresh venv whose
    only other packages are this interpreter's dependencies (a .pth line; this checkout's editable
    install is not seen). Returns that venv's python, to run from outside the checkout."""
    import shutil
    import subprocess
    import sys
    import sysconfig
    import venv

    root = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the sdist holds: setuptools writes build/ and egg-info beside its source
    source = root / "source"
    junk = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(REPO / "src", source / "src", ignore=junk)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = root.glob("wamkit-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", purelib, str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-3000:]
    return python
