#!/usr/bin/env bash
# Run GPU tests under compute-sanitizer (memcheck, then racecheck) so every kernel is checked
# for out-of-bounds accesses and shared-memory races. CUDA API errors that are not kernel memory
# errors (e.g. torch probing optional driver entry points) are reported separately: the first run
# keeps them (--report-api-errors all) in its log so each can be read, the verdict counts only
# kernel errors.
# Usage (repo root):  bash scripts/gpu_sanitize.sh [pytest args, default: tests]
# Through the device tool: `bash scripts/gpu_sanitize.sh tests/test_dequant_fp4.py` (add
# `source .dsl/activate.sh &&` and carry .dsl for DSL kernels). Logs: $OUT/sanitize_<tool>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}; mkdir -p "$OUT"
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(tests)
PY=${PYTHON:-python3}
rc=0
for tool in memcheck racecheck; do
  log="$OUT/sanitize_$tool.log"
  extra=(); [ "$tool" = memcheck ] && extra=(--report-api-errors all)
  echo "=== compute-sanitizer --tool $tool ${args[*]}"
  compute-sanitizer --tool "$tool" "${extra[@]}" --target-processes all --log-file "$log.raw" \
    "$PY" -m pytest -q -x -m gpu -p no:cacheprovider "${args[@]}" > "$log" 2>&1
  trc=$?
  cat "$log.raw" >> "$log"; rm -f "$log.raw"
  kernel_errs=$(grep -cE "Invalid (__global__|__shared__|__local__)|Out-of-range|Misaligned|Race reported|Hazard" "$log")
  api_errs=$(grep -c "Program hit" "$log")
  echo "$tool: pytest rc=$trc, kernel memory/race errors=$kernel_errs, CUDA API errors=$api_errs"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Program hit" "$log" | sort | uniq -c | sort -rn | head -8
  [ "$kernel_errs" -ne 0 ] && rc=1
  tail -3 "$log" | sed 's/^/  /'
done
exit $rc
