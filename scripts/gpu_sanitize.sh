#!/usr/bin/env bash
# Run the GPU tests under compute-sanitizer (memcheck, then racecheck) so every kernel is checked
# for out-of-bounds accesses and shared-memory races. Works on the H200 machine (Firecracker).
# Usage (repo root):  bash scripts/gpu_sanitize.sh [pytest args, default: -m gpu tests]
# Through the device tool: run `bash scripts/gpu_sanitize.sh tests/test_dequant_fp4.py` (add
# `source .dsl/activate.sh &&` and carry .dsl for DSL kernels).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(tests)
PY=${PYTHON:-python3}
rc=0
for tool in memcheck racecheck; do
  echo "=== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
    "$PY" -m pytest -q -x -m gpu -p no:cacheprovider "${args[@]}" || rc=$?
done
exit $rc
