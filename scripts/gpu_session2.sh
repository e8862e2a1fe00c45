#!/usr/bin/env bash
# Follow-up GPU session: re-validate what changed after scripts/gpu_session.sh and time MoE v3.
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S="$OUT/summary.txt"; L="$OUT/gpu.log"; PY=${PYTHON:-python3}; T0=$(date +%s)
step() { local name=$1 t=$2; shift 2; local s=$(date +%s); echo "=== $name" >> "$L"; timeout "$t" "$@" >> "$L" 2>&1
  local rc=$?; echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -E 'passed|failed' "$L" | tail -1)" | tee -a "$S"; }
step "gpu tests: graph capture (dsl, cuda)" 80 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_capture.py
step "gpu tests: quantize launch geometry" 50 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_quantize.py -k geometry
step "dsv4 run --context 131072" 70 bash -c "$PY -m dsv4 run --context 131072 --no-progress --json $OUT/run.json --plot $OUT/run.png > $OUT/run.txt 2>&1; rc=\$?; cat $OUT/run.txt; exit \$rc"
step "bench moe --quick" 75 $PY bench/bench_moe.py --quick --json "$OUT/moe.json"
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$S"
