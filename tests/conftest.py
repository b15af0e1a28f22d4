"""Shared test set-up: headless rendering and paths to the upstream fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

REPO = Path(__file__).resolve().parents[1]
# Datasets written by the real upstream libraries. The team's shared copy sits beside the checkout;
# tests/fixtures holds the same files so that a clone elsewhere tests against them too.
FIXTURES = REPO.parent / "shared" / "fixtures"
if not (FIXTURES / "libero_tiny").is_dir():
    FIXTURES = REPO / "tests" / "fixtures"


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
