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
#   3. each loss term's 100-step means for the three runs, from their losses.jsonl.
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

train() {  # train NAME TASK STEPS CACHE OVERRIDES...: one run into $WORK/NAME, reading the latents of
  # $WORK/latents_CACHE (encoded first by the run's own VAE; the fine-tuning runs share one)
  local name=$1 task=$2 steps=$3 cache=$WORK/latents_$4
  shift 4
  [ -f "$WORK/$name/done" ] && return
  local args=(demo_cosmos3 "env.tasks=[$task]" "data.root=$WORK/data_$task" "${COMMON[@]}" "$@"
    "train.max_steps=$steps" "train.save_interval=$steps" "train.run_dir=$WORK/$name")
  rm -rf "$WORK/$name"
  [ -f "$cache/done" ] || { rm -rf "$cache"; wamkit cache-latents "${args[@]}" --out "$cache" --no-progress; touch "$cache/done"; }
  wamkit train "${args[@]}" "model.options.latent_cache=$cache"
  touch "$WORK/$name/done"
}

collect drawer-open-v3
collect door-open-v3
train base drawer-open-v3 "$BASE_STEPS" base train.lr=3e-4 train.warmup_steps=50
[ -f "$WORK/base_serve/model.json" ] || wamkit convert "$WORK/base" --out "$WORK/base_serve"
[ -f "$WORK/base_diffusers/model_index.json" ] || wamkit convert "$WORK/base_serve" --to extra --out "$WORK/base_diffusers"
FT=(model.pretrained="$WORK/base_diffusers" train.warmup_steps=20)
train full door-open-v3 "$FT_STEPS" door "${FT[@]}" "train.lr=$FT_LR"
train lora door-open-v3 "$FT_STEPS" door "${FT[@]}" "train.lr=$FT_LR" train.lora.rank=16 train.lora.alpha=16
train lora_hi door-open-v3 "$FT_STEPS" door "${FT[@]}" "train.lr=$LORA_LR" train.lora.rank=16 train.lora.alpha=16

python - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
names = ("full", "lora", "lora_hi")
runs = {n: [json.loads(line) for line in (work / n / "losses.jsonl").read_text().splitlines()] for n in names}
keys = [k for k in runs["full"][0] if "loss" in k]
print("first logged loss: " + ", ".join(f"{n} {r[0]['loss']:.4f}" for n, r in runs.items()))
for key in keys:
    print(f"{key}, 100-step means")
    print("steps       " + "  ".join(f"{n:>8}" for n in runs))
    for lo in range(0, min(len(r) for r in runs.values()), 100):
        cols = [sum(x[key] for x in r[lo:lo + 100]) / len(r[lo:lo + 100]) for r in runs.values()]
        print(f"{lo + 1:>4}-{lo + 100:<5}  " + "  ".join(f"{c:8.4f}" for c in cols))
EOF
