#!/usr/bin/env bash
# LoRA's loss curve beside full SFT's (docs/cosmos3.md "Does LoRA learn?"; maintainers, not a test).
#
#   bash maintainers/cosmos3_lora_curve.sh [WORK]      # WORK defaults to runs/cosmos3_lora_curve
#
# On a CPU, with the CPU-sized Cosmos3 (`mini`, camera only: state_token=false, as the slow learning
# test trains it):
#   1. a base: `mini` trained from scratch on drawer-open demonstrations (BASE_STEPS), written as a
#      diffusers folder (`wamkit convert --to extra`);
#   2. from that base, fine-tuning on door-open demonstrations, a task the base never saw, over the same
#      FT_STEPS and the same batches: full SFT, then LoRA rank 16 (alpha 16) at the same rate and at a
#      higher one (LoRA_LR);
#   3. a table of each run's 25-step mean losses (action and vision terms), from its losses.jsonl.
# Finished stages are skipped: run it again after a stop to go on.
set -euo pipefail
WORK=${1:-runs/cosmos3_lora_curve}
BASE_STEPS=${BASE_STEPS:-1200}
FT_STEPS=${FT_STEPS:-600}
FT_LR=${FT_LR:-3e-4}
LORA_LR=${LORA_LR:-1e-3}
EPISODES=${EPISODES:-40}
mkdir -p "$WORK"
COMMON=(model.preset=mini model.options.attention=loop model.options.state_token=false data.num_workers=0
  data.frame_memory_mb=256 train.precision=fp32 train.device=cpu train.micro_batch=16 train.global_batch=16
  train.log_interval=25)

collect() {  # collect TASK: EPISODES demonstrations of TASK into $WORK/data_TASK
  [ -f "$WORK/data_$1/meta/info.json" ] || wamkit collect --config demo_cosmos3 --out "$WORK/data_$1" \
    --episodes "$EPISODES" --workers 2 "env.tasks=[$1]"
}

train() {  # train NAME TASK STEPS OVERRIDES...: one run into $WORK/NAME, its latents cached first
  local name=$1 task=$2 steps=$3
  shift 3
  [ -f "$WORK/$name/done" ] && return
  local args=(demo_cosmos3 "env.tasks=[$task]" "data.root=$WORK/data_$task" "${COMMON[@]}" "$@"
    "train.max_steps=$steps" "train.save_interval=$steps" "train.run_dir=$WORK/$name")
  rm -rf "$WORK/$name" "$WORK/latents_$name"
  wamkit cache-latents "${args[@]}" --out "$WORK/latents_$name" --no-progress
  wamkit train "${args[@]}" "model.options.latent_cache=$WORK/latents_$name"
  touch "$WORK/$name/done"
}

collect drawer-open-v3
collect door-open-v3
train base drawer-open-v3 "$BASE_STEPS" train.lr=3e-4 train.warmup_steps=50
[ -f "$WORK/base_serve/model.json" ] || wamkit convert "$WORK/base" --out "$WORK/base_serve"
[ -f "$WORK/base_diffusers/model_index.json" ] || wamkit convert "$WORK/base_serve" --to extra --out "$WORK/base_diffusers"
FT=(model.pretrained="$WORK/base_diffusers" train.warmup_steps=20)
train full door-open-v3 "$FT_STEPS" "${FT[@]}" "train.lr=$FT_LR"
train lora door-open-v3 "$FT_STEPS" "${FT[@]}" "train.lr=$FT_LR" train.lora.rank=16 train.lora.alpha=16
train lora_hi door-open-v3 "$FT_STEPS" "${FT[@]}" "train.lr=$LORA_LR" train.lora.rank=16 train.lora.alpha=16

python - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
runs = {n: [json.loads(l) for l in (work / n / "losses.jsonl").read_text().splitlines()] for n in ("full", "lora", "lora_hi")}
keys = [k for k in runs["full"][0] if k.endswith("loss")]
print("steps      " + "  ".join(f"{n}:{k}" for n in runs for k in keys))
n = min(len(r) for r in runs.values())
for lo in range(0, n, 25):
    cols = []
    for r in runs.values():
        rows = r[lo:lo + 25]
        cols += [sum(x[k] for x in rows) / len(rows) for k in keys]
    print(f"{lo:>4}-{lo + len(rows) - 1:<4}  " + "  ".join(f"{c:.4f}" for c in cols))
EOF
