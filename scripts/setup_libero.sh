#!/usr/bin/env bash
# Installs the LIBERO extra without hub access. Filled in by the LIBERO backend work.
set -euo pipefail
echo "[setup-libero] LIBERO backend not built yet; skipping"
