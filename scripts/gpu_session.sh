#!/usr/bin/env bash
# One batched GPU session (the device tool gives 30 device-minutes a session: batch everything).
# Steps run in priority order, each under its own time limit; everything goes to $OUT:
#   summary.txt (short), gpu.log (all output), run.json/run.png/run.txt (dsv4 run + dsv4 ops),
#   topk.json, dequant.json, indexer_tuned.json (benchmarks).
# Usage on the H200 (repo root, .dsl carried):
#   source .dsl/activate.sh && bash scripts/gpu_session.sh
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
S="$OUT/summary.txt"
L="$OUT/gpu.log"
PY=${PYTHON:-python3}
T0=$(date +%s)

step() {  # step NAME SECONDS CMD...
  local name=$1 t=$2; shift 2
  local s=$(date +%s)
  echo "=== $name" >> "$L"
  timeout "$t" "$@" >> "$L" 2>&1
  local rc=$?
  local last
  last=$(grep -E "passed|failed|error|Error" "$L" | tail -1)
  echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $last" | tee -a "$S"
}

nvidia-smi -L | tee -a "$S"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$S"

# 1. correctness of what changed since the last GPU validation
step "gpu tests: dequant_fp4 + topk (defaults)" 150 $PY -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_dequant_fp4.py tests/test_topk.py
step "gpu tests: graph capture of every op" 150 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_graph_capture.py
# 2. the main job on the H200
step "dsv4 run --context 131072" 180 bash -c \
  "$PY -m dsv4 run --context 131072 --batch 8 --no-progress --json $OUT/run.json --plot $OUT/run.png > $OUT/run.txt 2>&1; rc=\$?; cat $OUT/run.txt; exit \$rc"
$PY -m dsv4 ops --device cuda >> "$OUT/run.txt" 2>&1
step "gpu tests: quantize" 90 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_quantize.py
# 3. candidate speed-ups, each validated before it is timed
step "gpu tests: topk" 90 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_topk.py
step "bench topk (every config)" 90 $PY bench/bench_topk.py --json "$OUT/topk.json"
step "bench dequant_fp4" 60 $PY bench/bench_dequant_fp4.py --json "$OUT/dequant.json"
step "gpu tests: indexer" 120 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer.py tests/test_indexer_dsl.py
step "bench indexer (quick)" 90 $PY bench/bench_indexer.py --quick --json "$OUT/indexer_quick.json"
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$S"
