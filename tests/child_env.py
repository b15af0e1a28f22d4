"""The environment the tests give the ``wamkit`` processes they start."""

from __future__ import annotations

import os

from tests.conftest import REPO


def child_env(*, user_shell: bool = False) -> dict[str, str]:
    """This process's environment with one thread per process (2 cores are shared, and no result may
    depend on the thread count) and the checkout on ``PYTHONPATH``. ``user_shell`` also drops the
    Makefile's rendering variables, as the README's activated shell has none: wamkit and LeRobot's
    plug-in env must choose offscreen rendering themselves."""
    env = dict(os.environ)
    if user_shell:
        for key in ("MUJOCO_GL", "PYOPENGL_PLATFORM"):
            env.pop(key, None)
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
