#!/usr/bin/env bash
# The inference engines' own request/response code, for the evaluator's backend tests
# (tests/engine_servers.py): SGLang's and vLLM-Omni's wheels from the package registry, unpacked
# without installing them (they need a GPU stack; the tests load the few modules that do not).
# Idempotent: a folder already unpacked for the pinned version is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.engines
PINS=("sglang==0.5.23:sglang/multimodal_gen/" "vllm-omni==0.30.0:vllm_omni/")
mkdir -p "$DEST/wheels"
for entry in "${PINS[@]}"; do
  pin=${entry%%:*}; keep=${entry#*:}
  name=${pin%%==*}; version=${pin#*==}
  out="$DEST/${name}-${version}"
  if [ -f "$out/.unpacked" ]; then continue; fi
  echo "setup_engines: $pin (request/response code only)"
  # only their Python files are used: one fixed wheel, whatever the host's Python and platform
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform any --dest "$DEST/wheels" "$pin"
  wheel=$(ls "$DEST/wheels/${name//-/_}-${version}-"*.whl | head -1)
  rm -rf "$out"
  "$PY" - "$wheel" "$out" "$keep" <<'PYEOF'
import sys, zipfile
wheel, out, keep = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(keep) and n.endswith(".py")]
    z.extractall(out, names)
print(f"  {len(names)} files from {wheel}")
PYEOF
  rm -f "$wheel"
  touch "$out/.unpacked"
done
