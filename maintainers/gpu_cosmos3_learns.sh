#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md "Cosmos3 trained from scratch" and docs/cosmos3.md "Does the
# recipe's loss fall?" (maintainers; maintainers/README.md). `run`: the demo's MetaWorld data at 128 px,
# then each variant of maintainers/cosmos3_demo_variants.txt through `wamkit demo demo_cosmos3` (train and
# serve on the GPU); once the first variant's training is done (so its training time is its own), the
# recipe's loss curve (`maintainers/gpu_runs.sh cosmos3-loss`) runs beside its evaluation.
#
# Whole, it takes longer than one device call (10 minutes), so `start` runs it in a process session of
# its own, which outlives the call on a machine kept warm, and `wait S` follows it for up to S seconds
# and copies what is finished to $OUT. Four calls to one warm machine, each straight after the last:
#   carry .whl/av .whl/serve:  source maintainers/gpu_env.sh
#   carry .whl/sim .gl:        source maintainers/gpu_env.sh >/dev/null && bash maintainers/gpu_cosmos3_learns.sh start && bash maintainers/gpu_cosmos3_learns.sh wait 560
#   then, until it prints "finished":  export PYTHONPATH=$PWD/src:/tmp/site MUJOCO_GL=egl PYOPENGL_PLATFORM=egl; bash maintainers/gpu_cosmos3_learns.sh wait 580
# Nothing survives a machine given back: on 2026-12-06 one was given back between the second and third
# calls (the third found a fresh machine and printed "no run on this machine") and the ten minutes of
# the second were lost. Make each next call at once; one variant alone (JOBS=1 THREADS=12, a
# one-line VARIANTS file) takes about 15 minutes of device time in all.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-/tmp/c3_out}
export WORK=${WORK:-/tmp/c3_sweep}
mkdir -p "$RESULTS"

collect_results() {  # a device call returns at most 8 files: one archive, and the figures on stdout
  [ -n "${OUT:-}" ] || return 0
  local pack=/tmp/c3_pack
  rm -rf "$pack" && mkdir -p "$pack"
  cp "$RESULTS"/*.log "$RESULTS"/*.tsv "$RESULTS"/*.txt "$RESULTS"/*.jsonl "$pack/" 2>/dev/null
  # the loss curve so far, while it runs
  [ -f /tmp/l8_loss/run/losses.jsonl ] && cp /tmp/l8_loss/run/losses.jsonl "$pack/cosmos3_loss_partial.jsonl"
  local d f v
  for d in "$WORK"/*/eval "$WORK"/*/eval_blind; do
    v=$(basename "$(dirname "$d")")_$(basename "$d")
    [ -f "$d/summary.json" ] || continue
    cp "$d/summary.json" "$pack/${v}_summary.json"
    python3 -c "
import json, sys
s = json.load(open(sys.argv[1]))['all']
print(f'[learns] {sys.argv[2]}: {s[\"success_once\"]}/{s[\"episodes\"]} ({100 * s[\"rate\"]:.1f}%, 95% CI '
      f'{100 * s[\"ci95\"][0]:.1f}-{100 * s[\"ci95\"][1]:.1f})')" "$d/summary.json" "$v"
  done
  for f in "$WORK"/*/stages/*.done; do  # named *.json: files named *.done do not come back
    [ -f "$f" ] && cp "$f" "$pack/$(basename "$(dirname "$(dirname "$f")")")_$(basename "$f" .done).json"
  done
  tar -czf "$OUT/learns.tar.gz" -C "$pack" . 2>/dev/null
  [ -f "$RESULTS/sweep.tsv" ] && cp "$RESULTS/sweep.tsv" "$OUT/"
  return 0
}

case "${1:-run}" in
  run)
    OUT=$RESULTS VARIANTS=${VARIANTS:-maintainers/cosmos3_demo_variants.txt} CONFIG=demo_cosmos3 \
      DATA_OVERRIDES="env.image_size=128" JOBS=${JOBS:-2} THREADS=${THREADS:-6} TRAIN_DEVICE=cuda \
      bash maintainers/demo_sweep.sh &
    sweep=$!
    first=$(grep -v '^#' "${VARIANTS:-maintainers/cosmos3_demo_variants.txt}" | awk 'NF {print $1; exit}')
    while kill -0 "$sweep" 2>/dev/null && [ ! -f "$WORK/$first/stages/train.done" ]; do sleep 5; done
    if [ "${LOSS_LIMIT:-1200}" -gt 0 ]; then  # LOSS_LIMIT=0: the closed-loop table alone
      echo "[learns] $first trained; the recipe's loss curve starts"
      OUT=$RESULTS/loss LOSS_LIMIT=${LOSS_LIMIT:-1200} bash maintainers/gpu_runs.sh cosmos3-loss
      cp "$RESULTS/loss/index.txt" "$RESULTS/loss_index.txt" 2>/dev/null
      cp "$RESULTS/loss/cosmos3_loss.jsonl" "$RESULTS/" 2>/dev/null
      tail -c 20000 "$RESULTS/loss/train_loss.log" >"$RESULTS/loss_train.log" 2>/dev/null
    fi
    wait "$sweep"
    # what training taught, open loop, beside a blind and a state-lookup baseline
    python3 maintainers/cosmos3_action_error.py "$WORK/$first/train" "$WORK/$first/serve" \
      >"$RESULTS/action_error.txt" 2>&1
    echo "[learns] finished"
    ;;
  start)
    setsid nohup env LOSS_LIMIT="${LOSS_LIMIT:-1200}" bash "$0" run >"$RESULTS/learns.log" 2>&1 </dev/null &
    echo "[learns] started (log $RESULTS/learns.log)"
    ;;
  wait)
    if [ ! -f "$RESULTS/learns.log" ]; then  # a machine given back between calls keeps nothing
      echo "[learns] no run on this machine (was it given back between calls?): start again" >&2
      exit 3
    fi
    end=$((SECONDS + ${2:-560}))
    while [ $SECONDS -lt $end ] && ! grep -q '^\[learns\] finished' "$RESULTS/learns.log" 2>/dev/null; do sleep 10; done
    tail -n 20 "$RESULTS/learns.log"
    for f in "$WORK"/logs/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 1500 "$f" | tr '\r' '\n' | tail -n 6; }; done
    collect_results
    ;;
  *)
    echo "usage: gpu_cosmos3_learns.sh run | start | wait SECONDS" >&2
    exit 2
    ;;
esac
