#!/usr/bin/env bash
# ManiSkill3 next to wamkit (`make setup-maniskill`; docs/maniskill.md): a venv of its own,
# .venv-maniskill, whose Python the env workers of the maniskill suite are started with. ManiSkill3's
# motion planner (mplib 0.1.1, which mani-skill 3.0.1 pins) crashes under numpy 2 (a segfault in
# mplib.Planner), and SAPIEN pulls opencv-python, which clashes with LIBERO's opencv-python-headless,
# so ManiSkill3 cannot share the project's venv. This one holds numpy < 2, the CPU torch where there is
# no NVIDIA driver, mani-skill, sapien, mplib, and wamkit itself (editable, without its dependencies:
# a worker runs only wamkit's env layer).
# SAPIEN renders through Vulkan. On a machine without a GPU that is Mesa's lavapipe, which must offer
# descriptorBindingPartiallyBound: Mesa 23 or newer (Debian 12's own 22.3 lacks it; bookworm-backports
# has 25). Idempotent: a second run costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${MANISKILL_VENV:-.venv-maniskill}
PINS=("mani-skill==3.0.1" "sapien==3.0.3" "mplib==0.1.1" "numpy>=1.24,<2")
STAMP="$VENV/.installed-maniskill-3.0.1"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

# 1. Vulkan: the loader, and on a machine without an NVIDIA driver Mesa's lavapipe, new enough
mesa_major() { dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null | sed 's/^[0-9]*://' | cut -d. -f1; }
if command -v dpkg >/dev/null 2>&1; then
  need=()
  dpkg -s libvulkan1 >/dev/null 2>&1 || need+=(libvulkan1)
  mesa=$(mesa_major)  # empty where mesa-vulkan-drivers is not installed
  if ! command -v nvidia-smi >/dev/null 2>&1 && { [ -z "$mesa" ] || [ "$mesa" -lt 23 ]; }; then
    codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    if [ "$codename" = bookworm ]; then
      if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/; then
        echo "[setup-maniskill] adding Debian's bookworm-backports (Mesa 25's lavapipe)"
        echo "deb http://deb.debian.org/debian bookworm-backports main" | $SUDO tee /etc/apt/sources.list.d/wamkit-backports.list >/dev/null
      fi
      $SUDO apt-get update -qq
      echo "[setup-maniskill] installing mesa-vulkan-drivers from bookworm-backports"
      DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends -t bookworm-backports \
        mesa-vulkan-drivers libvulkan1 >/dev/null
      need=()
    else
      need+=(mesa-vulkan-drivers)
    fi
  fi
  if [ ${#need[@]} -gt 0 ]; then
    echo "[setup-maniskill] installing system packages: ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

if [ -f "$STAMP" ]; then
  echo "[setup-maniskill] ready ($VENV)"
  exit 0
fi

# 2. The venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup-maniskill] creating $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PIP="$VENV/bin/pip"
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1 && ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "[setup-maniskill] installing CPU torch"
  "$PIP" install -q "torch==${WAMKIT_CPU_TORCH:-2.13.0}" "numpy<2" \
    || "$PIP" install -q "torch==${WAMKIT_CPU_TORCH:-2.13.0}" "numpy<2" --index-url https://download.pytorch.org/whl/cpu
fi
echo "[setup-maniskill] installing ${PINS[*]} into $VENV (a first run downloads about 400 MB)"
"$PIP" install -q "${PINS[@]}" pyyaml
"$PIP" install -q --no-deps -e .
"$VENV/bin/python" - <<'PY'
import mani_skill, numpy, sapien, wamkit
import mani_skill.envs  # noqa: F401  (registers the tasks)
print(f"[setup-maniskill] mani-skill {mani_skill.__version__}, sapien {sapien.__version__}, numpy {numpy.__version__}, wamkit {wamkit.__version__}")
PY
touch "$STAMP"
echo "[setup-maniskill] ready ($VENV)"
