#!/usr/bin/env bash
# MoE decode kernel (kernels_cuda/moe_decode.cu): GPU tests (-x, time-boxed), then the decode benchmark
# (decode kernel vs the DSL grouped GEMM forced through registry.use, CUDA-graph replay, weight-byte floor
# from the copy bandwidth measured in the same process). Table last; details under $OUT.
# Usage (device tool, repo root): bash scripts/gpu_moe_decode.sh     [QUICK=1 for MXFP4 only]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}; T0=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
# WGMMA consumer (DecodeConfig.mma=0) first, then the default mma.sync consumer (mma=1), each -x
for SEL in "not mmasync" "mmasync"; do
  timeout ${TEST_TIMEOUT:-70} $PY -m pytest -v -x -m gpu -p no:cacheprovider -s tests/test_moe_decode.py -k "$SEL" > "$OUT/tests.log" 2>&1
  echo "gpu tests [$SEL] rc=$? at $(( $(date +%s) - T0 ))s: $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
  grep -E '^\[moe decode|FAILED|Error|error:|assert' "$OUT/tests.log" | cut -c1-160 | head -14
  cp "$OUT/tests.log" "$OUT/tests_${SEL// /_}.log"
done
T1=$(date +%s)
timeout ${BENCH_TIMEOUT:-140} $PY bench/bench_moe_decode.py ${QUICK:+--quick} --json "$OUT/moe_decode.json" > "$OUT/bench.log" 2>&1
RC=$?; echo "bench rc=$RC in $(( $(date +%s) - T1 ))s"
if [ $RC -eq 0 ]; then grep -v "^{" "$OUT/bench.log" | tail -80; else tail -60 "$OUT/bench.log"; fi
echo "total $(( $(date +%s) - T0 ))s"
