#!/usr/bin/env bash
# Lightning Indexer (issue 13) on the H200, one device call (~120-200 s): the GPU tests (CUDA quantizers,
# the NVFP4 CUDA path, the DSL decode / prefill kernels against the precision contract, gates (b) / (c)),
# then the benchmark table (add PEERS=1 inside a peer job to time DeepGEMM beside ours); JSON under $OUT.
#   $OUT/indexer_prefill_gate_*.json, indexer_recall.json   from the GPU tests
#   $OUT/bench.json                                         the benchmark rows;  $OUT/gpu.log  everything
# Usage (repo root, the CuTe DSL bundle active): OUT=out bash scripts/gpu_indexer.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DSV4_RESULTS_DIR="$OUT"
S="$OUT/summary.txt"; L="$OUT/gpu.log"; PY=${PYTHON:-python3}; T0=$(date +%s)
step() { local name=$1 t=$2; shift 2; local s=$(date +%s); echo "=== $name" >> "$L"; timeout "$t" "$@" >> "$L" 2>&1
  local rc=$?; echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -aE 'passed|failed|error' "$L" | tail -1)" | tee -a "$S"; }
step "gpu tests: DSL kernels" 90 $PY -m pytest -q -m gpu -p no:cacheprovider -s tests/test_indexer_dsl.py
step "gpu tests: indexer" 90 $PY -m pytest -q -m gpu -p no:cacheprovider --durations=6 tests/test_indexer.py
step "bench" 150 $PY bench/bench_indexer.py --budget 120 ${PEERS:+--peers} --json "$OUT/bench.json"
grep -aE "^FAILED|Error|assert" "$L" | head -8
grep -aE "dsl (paged|prefill)|recall|cosine" "$L" | head -20
cat "$S"; echo "total $(( $(date +%s) - T0 ))s"
