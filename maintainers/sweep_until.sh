#!/usr/bin/env bash
# Run maintainers/demo_sweep.sh in the background, detached, and follow it for at most SECONDS_MAX
# seconds (default 520), so that a sweep longer than one device call goes on over several calls to a
# machine kept warm: a later call finds it still running and follows it again, or (if the call's end
# stopped it) starts it again, and every stage resumes. Same environment variables as demo_sweep.sh.
#   VARIANTS=... DATA_OVERRIDES=... JOBS=1 THREADS=8 bash maintainers/sweep_until.sh
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/sweep}
limit=${SECONDS_MAX:-520}
mkdir -p "$WORK/logs"
running() { pgrep -f "maintainers/demo_sweep.sh" >/dev/null; }
if running; then
  echo "[until] the sweep is still running"
else
  echo "[until] starting the sweep"
  setsid nohup bash maintainers/demo_sweep.sh >>"$WORK/sweep.out" 2>&1 </dev/null &
fi
t0=$(date +%s)
while running && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 10; done
if running; then echo "[until] still running after ${limit} s"; else echo "[until] the sweep ended"; fi
tail -n 5 "$WORK/sweep.out"
for f in "$WORK"/logs/*.log; do [ -f "$f" ] && { echo "== $f"; tail -c 2000 "$f" | tr '\r' '\n' | grep -v '^$' | tail -n 12; }; done
