#!/usr/bin/env bash
# One-shot environment set-up for `make setup` / `make test` / `make demo`.
# Idempotent: each step checks before it acts, so a second run costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

# 1. System libraries for headless MuJoCo rendering (EGL through Mesa). Only installed when missing.
need=()
for pkg in libegl1 libgl1 libglvnd0 libgl1-mesa-dri libegl-mesa0; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] installing system packages: ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PIP="$VENV/bin/pip"

# 3. torch: on a machine without an NVIDIA driver take the CPU build (on this project's CI machines
#    torch==2.13.0 lies on local disk); elsewhere let pip resolve the range from pyproject.toml.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] NVIDIA driver found: torch comes from the package's range"
  else
    echo "[setup] installing CPU torch"
    "$PIP" install -q "torch==${WAMKIT_CPU_TORCH:-2.13.0}" \
      || "$PIP" install -q "torch==${WAMKIT_CPU_TORCH:-2.13.0}" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

# 4. The package, editable, with the test tools and the extras the test suite exercises (Cosmos3
#    through diffusers, Ray, torchao for LoRA's int8 base, gym-aloha for the aloha suite). LIBERO has its own step:
#    scripts/setup_libero.sh. `make demo` asks for the package alone (WAMKIT_EXTRAS= ): the demo
#    needs none of the extras, and skipping them is a minute of a fresh clone's set-up.
EXTRAS=${WAMKIT_EXTRAS-dev,cosmos3,ray,lora-int8,aloha}
if [ -n "$EXTRAS" ]; then
  "$PIP" install -q -e ".[$EXTRAS]"
else
  "$PIP" install -q -e .
  echo "[setup] ready for the demo: $("$VENV/bin/python" -c 'import torch, wamkit; print("wamkit", wamkit.__version__, "torch", torch.__version__)')"
  exit 0
fi

# 5. openpi-client (the reference OpenPI client used by the interoperability tests). Its metadata
#    pins numpy<2, which conflicts with everything else here; its code runs on numpy 2, so it is
#    installed unchanged but without its pins.
"$VENV/bin/python" -c "import openpi_client" >/dev/null 2>&1 \
  || "$PIP" install -q --no-deps "openpi-client==0.1.2"
echo "[setup] ready: $("$VENV/bin/python" -c 'import torch, wamkit; print("wamkit", wamkit.__version__, "torch", torch.__version__)')"
