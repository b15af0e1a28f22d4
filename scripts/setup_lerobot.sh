#!/usr/bin/env bash
# LeRobot's policies next to wamkit (`make setup-lerobot`): a second venv, .venv-lerobot, since LeRobot
# 0.6.1 needs Python >= 3.12 and torch < 2.12 while the project's venv is Python 3.11 with torch 2.13.
# It holds Python 3.12, PyPI's torch 2.11 and torchvision 0.26 (CUDA builds, which run on the CPU: the
# CPU builds live on an index this machine cannot reach), lerobot 0.6.1 and wamkit, editable, with its
# test tools and the aloha suite (gym-aloha, which LeRobot's --env.type=aloha also needs). Nothing is
# fetched from the Hub: the policies are built with pretrained_backbone_weights unset. Idempotent: a
# second run costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LEROBOT_VENV:-.venv-lerobot}
LEROBOT=0.6.1
STAMP="$VENV/.installed-lerobot-$LEROBOT-aloha"  # bumped when what is installed changes
if [ -f "$STAMP" ] && [ -f "$VENV/.wamkit-pyproject" ] && cmp -s pyproject.toml "$VENV/.wamkit-pyproject"; then
  echo "[setup-lerobot] ready ($VENV)"
  exit 0
fi

find_python312() {
  local c
  for c in "${LEROBOT_PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/3.12"*/bin/python3.12; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$c" 2>/dev/null || echo "$c"
      return 0
    fi
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY312=$(find_python312); then
    echo "[setup-lerobot] LeRobot $LEROBOT needs Python 3.12: none found (python3.12 on PATH, pyenv, or LEROBOT_PYTHON=/path/to/python3.12)" >&2
    exit 2
  fi
  echo "[setup-lerobot] creating $VENV with $PY312"
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
PIP="$VENV/bin/pip"
echo "[setup-lerobot] installing torch 2.11, lerobot $LEROBOT and wamkit into $VENV (a first run downloads about 3 GB)"
"$PIP" install -q "torch==2.11.*" "torchvision==0.26.*"
"$PIP" install -q "lerobot[diffusion,training]==$LEROBOT" -e ".[dev,lerobot,aloha]"
"$VENV/bin/python" - <<'PY'
import lerobot, torch, wamkit
from lerobot.policies.act.configuration_act import ACTConfig  # noqa: F401
from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig  # noqa: F401
print(f"[setup-lerobot] lerobot {lerobot.__version__}, torch {torch.__version__}, wamkit {wamkit.__version__}")
PY
cp pyproject.toml "$VENV/.wamkit-pyproject"
touch "$STAMP"
echo "[setup-lerobot] ready ($VENV)"
