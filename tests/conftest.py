"""Shared test set-up: headless rendering and paths to the upstream fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("PYOPENGL_PLATFORM", "egl")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"


@pytest.fixture(scope="session")
def libero_tiny() -> Path:
    """The LeRobot v3 dataset written by lerobot 0.6.1 (see ../shared/fixtures)."""
    root = FIXTURES / "libero_tiny"
    if not root.is_dir():
        pytest.fail(f"fixture {root} is missing: the tests need ../shared/fixtures beside the checkout")
    return root
