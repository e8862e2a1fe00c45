#!/usr/bin/env bash
# Final validation batch of a session (one device call, ~8 min): the GPU tests of everything that
# changed run CONCURRENTLY (correctness only, NVRTC compiles spread over the CPUs), then the timed
# steps run one at a time on a quiet GPU. Each step is time-boxed; logs under $OUT.
# Usage (repo root; the defaults include CuTe DSL kernels: `source .dsl/activate.sh && export
# PYTHONPATH=.:$PYTHONPATH` first): OUT=out bash scripts/gpu_final.sh
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DSV4_RESULTS_DIR="$OUT"
PY=${PYTHON:-python3}; T0=$(date +%s); S="$OUT/summary.txt"
nvidia-smi -L | tee -a "$S"
PT="$PY -m pytest -q -m gpu -p no:cacheprovider -rf"
par() {  # par NAME SECONDS CMD... (background)
  local name=$1 t=$2; shift 2
  ( s=$(date +%s); timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; rc=$?
    echo "[par] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -aE ' passed| failed|error' "$OUT/$name.log" | tail -1)" >> "$S" ) &
}
seqstep() {  # seqstep NAME SECONDS CMD...
  local name=$1 t=$2; shift 2; local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -aE ' passed| failed|error' "$OUT/$name.log" | tail -1)" | tee -a "$S"
}
# ---- phase A: correctness, concurrently
par t_indexer 200 $PT -x tests/test_indexer.py tests/test_indexer_dsl.py tests/test_indexer_topk_paged.py
par t_moe_decode 200 $PT -x tests/test_moe_decode.py
par t_moe 200 $PT -x tests/test_moe.py tests/test_moe_glue.py tests/test_sparse_attention.py tests/test_attn_lists.py
par t_graph 200 bash -c "$PT -x tests/test_graph_capture.py tests/test_quantize.py tests/test_kv_cache.py tests/test_topk.py tests/test_dequant_fp4.py"
wait
echo "phase A done at $(( $(date +%s) - T0 ))s" | tee -a "$S"
# ---- phase B: timed, one at a time
seqstep run 70 bash -c "$PY -m dsv4 run --context 131072 --batch 8 --no-progress --json $OUT/run.json; $PY -m dsv4 ops --device cuda"
seqstep bench_moe_decode 110 $PY bench/bench_moe_decode.py --quick --json "$OUT/moe_decode.json"
seqstep bench_indexer 80 $PY bench/bench_indexer.py --only decode --budget 50 --no-compile --json "$OUT/indexer.json"
seqstep sanitize_dequant 60 bash scripts/gpu_sanitize.sh tests/test_dequant_fp4.py
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$S"
echo; cat "$S"
echo; for f in t_indexer t_moe_decode t_moe t_graph; do echo "== $f"; grep -aE "^FAILED|^ERROR|Error:|rel err|recall" "$OUT/$f.log" | head -8; done
echo "== run"; tail -30 "$OUT/run.log" | cut -c1-150
echo "== moe decode"; grep -v "^{" "$OUT/bench_moe_decode.log" | tail -40 | cut -c1-160
echo "== indexer"; tail -25 "$OUT/bench_indexer.log" | cut -c1-160
echo "== sanitize"; cat "$OUT/sanitize_dequant.log" | tail -12
