#!/usr/bin/env bash
# The ALOHA table of docs/benchmarks.md ("ALOHA in simulation: the ACT paper's table"): LeRobot's ACT, Diffusion Policy and the
# built-in tiny, each trained on 50 scripted episodes per task and evaluated on 50 held-out seeds, on the
# GPU machine (one GPU). The datasets are collected here first (docs/aloha.md):
#
#   wamkit collect --suite aloha --tasks transfer_cube --episodes 50 --image-size 240 --out data/aloha_transfer_cube_240
#   wamkit collect --suite aloha --tasks insertion --episodes 50 --image-size 240 --out data/aloha_insertion_240
#
# and travel with the wheels in calls of at most 64 MiB (maintainers/gpu_carry.sh av15, lerobot, serve,
# aloha, and sim's mujoco, PyOpenGL, glfw, gymnasium and Farama wheels copied to .whl/simlite). A machine
# idle for 30 s goes back, so the calls follow each other at once:
#
#   1. carry .whl/av15 .whl/lerobot .whl/simlite:   bash maintainers/gpu_aloha.sh prep  (lerobot imports gymnasium)
#   2. carry data/aloha_transfer_cube_240 data/aloha_insertion_240:
#                                                    bash maintainers/gpu_aloha.sh train; sleep 520; bash maintainers/gpu_aloha.sh status
#   3. carry .whl/serve .whl/aloha .gl:             bash maintainers/gpu_aloha.sh prep; sleep S; ALOHA_STOP=1 timeout 480 bash maintainers/gpu_aloha.sh eval
#   4. carry .gl (if 3 ran out):                     bash maintainers/gpu_aloha.sh eval
#
# The subcommands, in the checkout's root:
#
#   bash maintainers/gpu_aloha.sh prep     # installs what was carried into /tmp/site, copies carried data
#                                          # to /tmp/aloha/data (call it with each carry)
#   bash maintainers/gpu_aloha.sh train    # prep, then every variant's training started in its own
#                                          # process session (it outlives the call), code read from a copy
#   bash maintainers/gpu_aloha.sh status   # each run's last log line and the GPU's use
#   bash maintainers/gpu_aloha.sh eval     # each run's newest checkpoint converted and evaluated (ALOHA_JOBS
#                                          # at a time, 2 by default); $OUT/aloha_table.json and the logs' tails
#   bash maintainers/gpu_aloha.sh bench    # one evaluated run (ALOHA_BENCH, act_tc by default) exported as a
#                                          # LeRobot folder, then `wamkit bench lerobot-eval` on its task
#                                          # (ALOHA_BENCH_TRIALS, 50), 10 envs, CUDA; $OUT/lerobot_eval.json
#
# Trainings stop at their max_steps or when `eval` stops them (ALOHA_STOP=1): each is evaluated at the
# newest checkpoint it wrote, whose step is reported beside its success.
set -uo pipefail
cd "$(dirname "$0")/.."
W=${ALOHA_WORK:-/tmp/aloha}
OUT=${OUT:-/tmp/aloha_out}
STEPS=${ALOHA_STEPS:-10000}
TAG=aloha
mkdir -p "$W/data" "$W/runs" "$W/logs" "$OUT"
# shellcheck source=maintainers/gpu_table_lib.sh
source maintainers/gpu_table_lib.sh

# name | task | training overrides | evaluation overrides
# ACT as the paper trains it for simulation (arXiv 2304.13705 Table III; its repository's README command:
# chunk 100, KL weight 10, 512 wide, feed-forward 3200, 4 encoder layers, batch 8, lr 1e-5, AdamW with
# weight decay 1e-4), LeRobot's one decoder layer (the layer the paper's code used), temporal ensembling
# with m = 0.01 at evaluation; the backbone from random weights (no ImageNet download), so a second ACT
# at lr 1e-4 beside it. Diffusion Policy as LeRobot ships it (horizon 16, 8 executed, lr 1e-4, batch 64;
# its random crop 90% of the image, as LeRobot's 84 of 96);
# tiny as the demo's preset trains it.
ACT="model.name=lerobot model.preset=act model.options={} model.options.dim_model=512 model.options.dim_feedforward=3200 model.options.n_encoder_layers=4 model.options.n_decoder_layers=1 model.options.kl_weight=10 data.chunk=100 train.micro_batch=8 train.global_batch=8 train.weight_decay=1e-4 train.betas=[0.9,0.999] train.schedule=constant train.warmup_steps=0 train.grad_clip=10"
ENS="eval.chunk_blend=ensemble eval.replan_interval=1 eval.ensemble_coeff=0.01"
DIFF="model.name=lerobot model.preset=diffusion model.options={} model.options.crop_shape=[216,216] data.chunk=16 train.micro_batch=64 train.global_batch=64 train.lr=1e-4 train.weight_decay=1e-6 train.betas=[0.95,0.999] train.schedule=cosine train.warmup_steps=500"
TINY="model.name=tiny model.preset=small data.chunk=16 train.micro_batch=32 train.global_batch=32 train.lr=5e-4 train.warmup_steps=100"
VARIANTS=(
  "act_tc|transfer_cube|$ACT train.lr=1e-5|$ENS"
  "act_ins|insertion|$ACT train.lr=1e-5|$ENS"
  "act4_tc|transfer_cube|$ACT train.lr=1e-4|$ENS"
  "act4_ins|insertion|$ACT train.lr=1e-4|$ENS"
  "diff_tc|transfer_cube|$DIFF|eval.replan_interval=8"
  "diff_ins|insertion|$DIFF|eval.replan_interval=8"
  "tiny_tc|transfer_cube|$TINY|eval.replan_interval=8"
  "tiny_ins|insertion|$TINY|eval.replan_interval=8"
)
ONLY=${ALOHA_ONLY:-}  # a regex of variant names (all by default)

prep() {
  # shellcheck disable=SC1091
  source maintainers/gpu_env.sh >/dev/null
  for d in data/aloha_*; do
    [ -d "$d" ] && [ ! -d "$W/data/$(basename "$d")" ] && cp -r "$d" "$W/data/" && echo "[aloha] data: $(basename "$d")"
  done
  ls "$W/data"
}

each() {  # each FUNCTION: FUNCTION name task train_overrides eval_overrides, for the variants chosen
  local v name task tr ev
  for v in "${VARIANTS[@]}"; do
    IFS='|' read -r name task tr ev <<<"$v"
    [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && continue
    "$1" "$name" "$task" "$tr" "$ev"
  done
}

each_task() {  # each_task NAME: the task of variant NAME
  local v name task tr ev
  for v in "${VARIANTS[@]}"; do
    IFS='|' read -r name task tr ev <<<"$v"
    [ "$name" = "$1" ] && echo "$task"
  done
}

start_one() {
  table_train "$1" "$W/data/aloha_${2}_240" "$3 env.suite=aloha" 2 4096
}

eval_one() {
  table_eval "$1" "env.suite=aloha env.tasks=[$2] env.image_size=240 eval.num_envs=50 eval.workers=7 $4"
}

case "${1:-}" in
  prep) prep ;;
  train)
    prep
    table_code
    each start_one
    ;;
  status) table_status ;;
  eval)
    prep
    if [ -n "${ALOHA_STOP:-}" ]; then pkill -f "wamkit train" && sleep 5; fi
    jobs=${ALOHA_JOBS:-2}
    for v in "${VARIANTS[@]}"; do
      IFS='|' read -r name task tr ev <<<"$v"
      [ -n "$ONLY" ] && ! [[ $name =~ $ONLY ]] && continue
      while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 2; done
      eval_one "$name" "$task" "$tr" "$ev" &
    done
    wait
    table_report aloha
    ;;
  bench)
    prep
    name=${ALOHA_BENCH:-act_tc}
    task=$(each_task "$name")
    b=$W/bench_$name && rm -rf "$b" && mkdir -p "$b"
    python3 -m wamkit convert "$W/runs/$name/serve" --to extra --out "$b/folder" >"$b/export.log" 2>&1 ||
      { tail -n 5 "$b/export.log"; exit 1; }
    python3 -m wamkit bench lerobot-eval --policy "$b/folder" --trials "${ALOHA_BENCH_TRIALS:-50}" --envs 10 \
      --device cuda --out "$b/bench" env.suite=aloha env.tasks="[$task]" env.cameras=[top] env.image_size=240 \
      2>&1 | tail -n 30
    cp "$b/bench/lerobot_eval.json" "$OUT/" 2>/dev/null
    tail -n 20 "$b/bench/wamkit.log" "$b/bench/lerobot.log" >"$OUT/lerobot_eval_tails.log" 2>/dev/null
    ;;
  *) echo "usage: gpu_aloha.sh prep|train|status|eval|bench" >&2; exit 2 ;;
esac
