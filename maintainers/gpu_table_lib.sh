# Sourced by gpu_aloha.sh and gpu_maniskill.sh: the runs of a benchmark table on the GPU machine, each
# trained in its own process session (it outlives the device call) from a copy of the code, then
# converted at its newest checkpoint and evaluated. The caller sets W (work folder), STEPS (training
# steps), TAG (the log lines' prefix) and OUT (where the table's files go).

table_code() {  # the code the trainings read, copied: a later call replaces the checkout
  rm -rf "$W/code" && mkdir -p "$W/code" && cp -r src "$W/code/"
}

table_train() {  # table_train NAME DATA_ROOT "OVERRIDES" THREADS FRAME_MEMORY_MB
  local name=$1 data=$2 tr=$3 threads=$4 mb=$5
  [ -f "$W/runs/$name/started" ] && { echo "[$TAG] $name: already started"; return; }
  mkdir -p "$W/runs/$name" "$W/logs" && touch "$W/runs/$name/started"
  # shellcheck disable=SC2086
  setsid nohup env PYTHONPATH="$W/code/src:/tmp/site" OMP_NUM_THREADS="$threads" \
    python3 -m wamkit train $tr data.root="$data" data.num_workers=1 data.frame_memory_mb="$mb" \
    train.max_steps="$STEPS" train.save_interval=1000 train.keep_last=1 train.log_interval=100 \
    train.device=cuda train.run_dir="$W/runs/$name" >"$W/logs/$name.train.log" 2>&1 </dev/null &
  echo "[$TAG] $name: training started (pid $!)"
}

table_eval() {  # table_eval NAME "OVERRIDES": 50 held-out episodes of its newest checkpoint
  local name=$1 ev=$2 ckpt
  ckpt=$(ls -d "$W/runs/$name"/checkpoints/step_* 2>/dev/null | sort | tail -n 1)
  [ -n "$ckpt" ] || { echo "[$TAG] $name: no checkpoint"; return; }
  [ -f "$W/runs/$name/eval/summary.json" ] && { echo "[$TAG] $name: evaluated"; return; }
  {
    python3 -m wamkit convert "$ckpt" --out "$W/runs/$name/serve" &&
    # shellcheck disable=SC2086
    python3 -m wamkit eval eval.trials=50 eval.serve_dir="$W/runs/$name/serve" serve.device=cuda \
      eval.videos=1 eval.out_dir="$W/runs/$name/eval" $ev --resume --no-progress
  } >"$W/logs/$name.eval.log" 2>&1
  echo "[$TAG] $name: eval rc $? ($(basename "$ckpt"))"
}

table_status() {  # each run's last logged step and the GPU's use
  for f in "$W"/logs/*.log; do echo "== $(basename "$f"): $(grep -a -o 'step [0-9]*[^|]*' "$f" | tail -n 1)"; tail -n 2 "$f" | cut -c1-200; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
}

table_report() {  # table_report NAME: $OUT/NAME_table.json (each run's checkpoint and summary), the logs' tails
  python3 - "$W" >"$OUT/${1}_table.json" <<'PY'
import json, sys
from pathlib import Path
w = Path(sys.argv[1])
rows = {}
for run in sorted((w / "runs").iterdir()):
    summary = run / "eval" / "summary.json"
    ckpts = sorted((run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
    rows[run.name] = {"checkpoint": ckpts[-1].name if ckpts else None,
                      "summary": json.loads(summary.read_text()) if summary.is_file() else None}
print(json.dumps(rows, indent=1))
PY
  for f in "$W"/logs/*.log; do echo "== $f"; tail -n 15 "$f"; done >"$OUT/${1}_logs.txt"
}
