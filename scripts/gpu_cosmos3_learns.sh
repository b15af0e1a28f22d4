#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md "Cosmos3 trained from scratch" (maintainers; docs/gpu_machine.md):
# the demo's MetaWorld data at 128 px, then each variant of scripts/cosmos3_demo_variants.txt through
# `wamkit demo demo_cosmos3` (train and serve on the GPU), two at a time. Carry: serve, av, sim (and
# .gl), in two calls to a machine kept warm (scripts/gpu_carry.sh). A call stopped by its time limit
# leaves every stage resumable: the next call goes on (WORK stays on a warm machine).
#   source scripts/gpu_env.sh && timeout 560 bash scripts/gpu_cosmos3_learns.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/c3_out} WORK=${WORK:-/tmp/c3_sweep}
export CONFIG=demo_cosmos3 DATA_OVERRIDES="env.image_size=128" VARIANTS=${VARIANTS:-scripts/cosmos3_demo_variants.txt}
export JOBS=${JOBS:-2} THREADS=${THREADS:-6} TRAIN_DEVICE=cuda
bash scripts/demo_sweep.sh
