#!/usr/bin/env bash
# Issue 78's GPU figures (docs/maniskill.md): the GPU executor's benchmark and the table of tiny, ACT and
# Diffusion Policy trained on ManiSkill3's motion-planning demonstrations, on the GPU machine (one GPU).
# The demonstrations are collected here first, 100 a task at ManiSkill's 128 px (docs/maniskill.md):
#
#   for t in PickCube-v1 StackCube-v1 PushCube-v1 PegInsertionSide-v1; do
#     wamkit collect --suite maniskill --tasks $t --episodes 100 --image-size 128 --out data/maniskill_128/$t
#   done
#
# What travels (maintainers/gpu_carry.sh maniskill, sapien; .whl/simlite for gymnasium; .gl), in calls of
# at most 64 MiB that follow each other within 30 s (a machine idle longer goes back):
#
#   1. carry .whl/sapien .gl:                   bash maintainers/gpu_maniskill.sh prep
#   2. carry .whl/maniskill .whl/simlite .gl:   bash maintainers/gpu_maniskill.sh check && bash maintainers/gpu_maniskill.sh smoke
#      (check names each module the image still lacks: carry its wheel in the next call)
#   3. carry .gl .whl/serve:                    bash maintainers/gpu_maniskill.sh bench
#   4. carry data/maniskill_128 .whl/lerobot .whl/av15:  bash maintainers/gpu_maniskill.sh train; sleep 500; ... status
#   5. carry .gl:                               MS_STOP=1 timeout 480 bash maintainers/gpu_maniskill.sh eval
#
# Subcommands, in the checkout's root:
#   prep    install what was carried into /tmp/site (maintainers/gpu_env.sh), copy carried data to $W/data
#   check   import what the env workers import; name the first module missing
#   smoke   one GPU-executor evaluation: PickCube, 8 envs in 2 stages, a random-init tiny, 20 steps
#   bench   wamkit bench gpu-sim at N = 16, 64, 256 ($OUT/gpu_sim.json)
#   train   each variant's training in its own process session (outlives the call), code read from a copy
#   status  each run's last log line and the GPU's use
#   eval    each run's newest checkpoint converted and evaluated on 50 held-out seeds ($OUT/maniskill_table.json)
set -uo pipefail
cd "$(dirname "$0")/.."
W=${MS_WORK:-/tmp/ms}
OUT=${OUT:-/tmp/ms_out}
STEPS=${MS_STEPS:-10000}
TAG=ms
mkdir -p "$W/data" "$W/runs" "$W/logs" "$OUT"
# shellcheck source=maintainers/gpu_table_lib.sh
source maintainers/gpu_table_lib.sh
TASKS=(PickCube-v1 StackCube-v1 PushCube-v1 PegInsertionSide-v1)
# name prefix | training overrides | evaluation overrides. ACT and Diffusion Policy as LeRobot ships them
# (Diffusion's random crop 90% of the image, as LeRobot's 84 of 96), ACT's chunk cut to 30 of ManiSkill's
# 100-step episodes, with temporal ensembling; tiny as the demo's preset trains it.
MODELS=(
  "act|model.name=lerobot model.preset=act model.options={} data.chunk=30 train.micro_batch=32 train.global_batch=32 train.lr=1e-4 train.weight_decay=1e-4 train.schedule=constant train.warmup_steps=0 train.grad_clip=10|eval.chunk_blend=ensemble eval.replan_interval=1 eval.ensemble_coeff=0.01"
  "diff|model.name=lerobot model.preset=diffusion model.options={} model.options.crop_shape=[116,116] data.chunk=16 train.micro_batch=64 train.global_batch=64 train.lr=1e-4 train.weight_decay=1e-6 train.betas=[0.95,0.999] train.schedule=cosine train.warmup_steps=500|eval.replan_interval=8"
  "tiny|model.name=tiny model.preset=small data.chunk=16 train.micro_batch=32 train.global_batch=32 train.lr=5e-4 train.warmup_steps=100|eval.replan_interval=8"
)
ONLY=${MS_ONLY:-}  # a regex of run names (model_task), all by default

prep() {
  # shellcheck disable=SC1091
  source maintainers/gpu_env.sh >/dev/null
  if [ -d data/maniskill_128 ] && [ ! -d "$W/data/maniskill_128" ]; then cp -r data/maniskill_128 "$W/data/"; fi
  ls "$W/data" 2>/dev/null
}

runs() {  # runs FUNCTION: FUNCTION name task train_overrides eval_overrides, for each model and task
  local m t prefix tr ev
  for m in "${MODELS[@]}"; do
    IFS='|' read -r prefix tr ev <<<"$m"
    for t in "${TASKS[@]}"; do
      [ -n "$ONLY" ] && ! [[ ${prefix}_$t =~ $ONLY ]] && continue
      "$1" "${prefix}_$t" "$t" "$tr" "$ev"
    done
  done
}

start_one() {
  table_train "$1" "$W/data/maniskill_128/$2" "$3 env.suite=maniskill" 1 2048
}

eval_one() {
  table_eval "$1" "env.suite=maniskill env.tasks=[$2] env.image_size=128 eval.num_envs=50 eval.workers=2 \
eval.pipeline_stages=2 eval.executor=${MS_EXECUTOR:-local} $4"
}

case "${1:-}" in
  prep) prep ;;
  check)
    prep >/dev/null
    python3 -c "import mani_skill.envs, sapien, gymnasium; import wamkit.envs.maniskill_batch, wamkit.eval.gpu_host; print('maniskill imports: ok')" 2>&1 | tail -n 3
    python3 -c "import torch; print('cuda', torch.cuda.is_available())"
    ;;
  smoke)
    prep >/dev/null
    python3 -m wamkit serve --model tiny --preset small --random-init --suite maniskill --device cuda --port 8031 \
      >"$W/logs/smoke_serve.log" 2>&1 &
    srv=$!
    sleep 25
    WAMKIT_MANISKILL_PYTHON=$(command -v python3) python3 -m wamkit eval eval.server_url=ws://127.0.0.1:8031 \
      env.suite=maniskill env.tasks=[PickCube-v1] env.max_steps=20 eval.trials=8 eval.num_envs=8 eval.workers=2 \
      eval.pipeline_stages=2 eval.executor=gpu eval.videos=1 eval.out_dir="$W/smoke" --no-progress 2>&1 | tail -n 15
    kill $srv
    ;;
  bench)
    prep >/dev/null
    WAMKIT_MANISKILL_PYTHON=$(command -v python3) python3 -m wamkit bench gpu-sim --task PickCube-v1 \
      --num-envs "${MS_BENCH_N:-16,64,256}" --stages 2 --device cuda --json "$OUT/gpu_sim.json" 2>&1 | tail -n 20
    ;;
  train)
    prep
    table_code
    runs start_one
    ;;
  status) table_status ;;
  eval)
    prep >/dev/null
    if [ -n "${MS_STOP:-}" ]; then pkill -f "wamkit train" && sleep 5; fi
    export WAMKIT_MANISKILL_PYTHON; WAMKIT_MANISKILL_PYTHON=$(command -v python3)
    jobs=${MS_JOBS:-3}
    eval_all() { while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 2; done; eval_one "$@" & }
    runs eval_all
    wait
    table_report maniskill
    ;;
  *) echo "usage: gpu_maniskill.sh prep|check|smoke|bench|train|status|eval" >&2; exit 2 ;;
esac
