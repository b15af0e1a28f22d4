#!/usr/bin/env bash
# Variants of the demo preset (src/wamkit/configs/demo.yaml) side by side on one dataset, on a machine
# with more cores than a laptop (the GPU machine: `source maintainers/gpu_env.sh` first, with the `sim`
# carry and PyAV; see maintainers/README.md). The dataset is collected once; every variant trains and is
# evaluated from its own folder, JOBS at a time, each on THREADS CPU threads (training on CUDA when
# TRAIN_DEVICE=cuda; serving stays on the CPU in fp32, as on a laptop). One line per variant in
# VARIANTS: a name, then `wamkit demo` overrides; CONFIG names the preset they start from (default: the
# demo's; its env and collect sections must match the dataset's, which DATA_OVERRIDES set). Results: $OUT/sweep.tsv (held-out success per task,
# the blind control, forward-dynamics error) and the tails of the variants' logs in $OUT/logs.tar.gz.
# Variants already finished in WORK are skipped (each stage resumes), so a second call to a machine kept
# warm goes on where a first one stopped; SUMMARY_ONLY=1 only writes the table.
#
#   VARIANTS=my_variants.txt JOBS=8 timeout 540 bash maintainers/demo_sweep.sh; SUMMARY_ONLY=1 VARIANTS=... bash maintainers/demo_sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sweep_out}
WORK=${WORK:-/tmp/sweep}
JOBS=${JOBS:-6}
THREADS=${THREADS:-2}
TRAIN_DEVICE=${TRAIN_DEVICE:-cuda}
VARIANTS=${VARIANTS:?a file of lines: NAME override ...}
CONFIG=${CONFIG:-}
DATA_OVERRIDES=${DATA_OVERRIDES:-}
mkdir -p "$OUT" "$WORK/logs"
WAMKIT=(python3 -m wamkit)

base=$WORK/base
if [ -z "${SUMMARY_ONLY:-}" ] && [ ! -f "$base/stages/stats.done" ]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  cat >"$WORK/collect.py" <<'EOF'
import json, os, sys, time
from pathlib import Path


def main() -> None:
    from wamkit.data import compute_stats
    from wamkit.demo import demo_config
    from wamkit.envs.collect import collect
    out = Path(sys.argv[1])
    cfg = demo_config(None, [f"collect.workers={min(os.cpu_count() or 8, 14)}", *sys.argv[2:]], out)
    t = time.perf_counter()
    summary = collect(cfg)
    compute_stats(cfg.data.root, cfg.data.representation, cfg.data.chunk, cfg.data.seed).save(cfg.data.stats)
    (out / "stages").mkdir(exist_ok=True)
    (out / "stages" / "collect.done").write_text(json.dumps({"tasks": summary["tasks"], "seconds": time.perf_counter() - t}))
    (out / "stages" / "stats.done").write_text(json.dumps({"path": cfg.data.stats, "seconds": 0}))


if __name__ == "__main__":
    main()
EOF
  # shellcheck disable=SC2086
  python3 "$WORK/collect.py" "$base" $DATA_OVERRIDES || { echo "[sweep] collect failed"; exit 1; }
  echo "[sweep] dataset in $(( $(date +%s) - t0 )) s"
fi

run_variant() {
  local name=$1; shift
  local dir=$WORK/$name
  [ -f "$dir/stages/report.done" ] && return
  mkdir -p "$dir/stages"
  cp -rn "$base/data" "$base/stats.json" "$dir/" 2>/dev/null
  cp "$base/stages/collect.done" "$base/stages/stats.done" "$dir/stages/"
  local t0; t0=$(date +%s)
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=$THREADS "${WAMKIT[@]}" demo --out "$dir" $CONFIG $DATA_OVERRIDES train.device="$TRAIN_DEVICE" \
    serve.device=cpu "$@" >>"$WORK/logs/$name.log" 2>&1
  echo "[sweep] $name: rc $? in $(( $(date +%s) - t0 )) s"
}

[ -z "${SUMMARY_ONLY:-}" ] && while read -r name rest; do
  [ -z "$name" ] || [ "${name:0:1}" = "#" ] && continue
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 2; done
  # shellcheck disable=SC2086
  run_variant "$name" $rest &
done <"$VARIANTS"
wait

python3 - "$WORK" "$VARIANTS" >"$OUT/sweep.tsv" <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
print("variant\tall\ttasks\tblind\tfd_rmse\tcopy_rmse\tfd_mae\tcopy_mae\ttrain_s")
for line in open(sys.argv[2]):
    if not line.strip() or line.startswith("#"):
        continue
    name = line.split()[0]
    st = work / name / "stages"
    try:
        ev = json.loads((st / "eval.done").read_text())
        s = next(iter(ev["suites"].values()))
        tasks = " ".join(f"{t.split('-')[0]}={r['successes'] if 'successes' in r else round(r['rate'] * r['episodes'])}" for t, r in s["tasks"].items())
        bl = json.loads((st / "eval_blind.done").read_text())["all"]["rate"]
        fd = json.loads((st / "report.done").read_text()).get("forward_dynamics") or {}
        tr = json.loads((st / "train.done").read_text())["seconds"]
        print(f"{name}\t{s['all']['rate']:.3f}\t{tasks}\t{bl:.3f}\t{fd.get('model_rmse', 0):.1f}\t{fd.get('copy_rmse', 0):.1f}\t{fd.get('model_error', 0):.1f}\t{fd.get('copy_error', 0):.1f}\t{tr:.0f}")
    except (OSError, KeyError, StopIteration, ValueError) as e:
        print(f"{name}\tunfinished ({type(e).__name__}: {e})")
EOF
cat "$OUT/sweep.tsv"
(cd "$WORK/logs" && for f in *.log; do tail -c 3000 "$f" | tr '\r' '\n' | tail -n 40 >"$f.tail"; done
 tar czf "$OUT/logs.tar.gz" ./*.tail)
