#!/usr/bin/env bash
# The test suite N times in a row while a CPU-heavy job runs beside it (a busy loop per core
# but one), to show that no test depends on timing: every run must pass.
#   bash scripts/suite_under_load.sh [N] [PYTHON] [pytest args…]
# Prints each run's exit status, wall time and pytest's last line; exits 1 if any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
py=${2:-python3}
shift $(( $# >= 2 ? 2 : $# ))
burners=$(( $(nproc) > 1 ? $(nproc) - 1 : 1 ))
pids=()
for _ in $(seq "$burners"); do
  "$py" -c "while True: pass" & pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
status=0
for run in $(seq "$runs"); do
  start=$(date +%s)
  # Kept out of the temporary directory, where pytest's own folders are pruned.
  logs=${SUITE_LOGS:-$HOME/.cache/suite-under-load}
  mkdir -p "$logs"
  log=$(mktemp "$logs/run$run.XXXXXX")
  "$py" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1
  code=$?
  [ "$code" -eq 0 ] || status=1
  echo "run $run: exit $code in $(( $(date +%s) - start )) s, load $(cut -d' ' -f1-3 /proc/loadavg): $(tail -n 1 "$log")"
  [ "$code" -eq 0 ] || grep -E -A1 "^(FAILED|ERROR)|left behind by the suite" "$log"
  [ "$code" -eq 0 ] && rm -f "$log"  # a failed run's whole output stays in $logs
done
exit $status
