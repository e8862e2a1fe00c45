#!/usr/bin/env bash
# Lightning Indexer (issue 4) on the H200, one device call (~150-250 s; give it timeout_s 300): gate (a) for every MMA
# variant, the GPU tests with the defaults, then the full benchmark table; JSON under $OUT.
#   $OUT/indexer_gate_a_<fmt>_<variant>.json  gate (a) numbers per MMA variant (prefill, decode)
#   $OUT/indexer_prefill_gate_*.json, indexer_recall.json   from the default-config GPU tests
#   $OUT/bench.json                           the benchmark rows;  $OUT/gpu.log  everything
# Usage (repo root): OUT=out bash scripts/gpu_indexer.sh     (no CuTe DSL needed)
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DSV4_RESULTS_DIR="$OUT"
S="$OUT/summary.txt"; L="$OUT/gpu.log"; PY=${PYTHON:-python3}; T0=$(date +%s)
step() { local name=$1 t=$2; shift 2; local s=$(date +%s); echo "=== $name" >> "$L"; timeout "$t" "$@" >> "$L" 2>&1
  local rc=$?; echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -aE 'passed|failed|error' "$L" | tail -1)" | tee -a "$S"; }
step "gate (a) per MMA variant" 75 $PY -m pytest -q -m gpu -p no:cacheprovider -s tests/test_indexer.py -k mma_variants
step "gpu tests (defaults)" 90 $PY -m pytest -q -x -m gpu -p no:cacheprovider --durations=6 tests/test_indexer.py -k "not mma_variants"
step "bench" 120 $PY bench/bench_indexer.py --budget 90 --json "$OUT/bench.json"
grep -aE "^FAILED|Error|assert" "$L" | head -8
$PY - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
print("\ngate (a) max rel err (prefill / decode nn1 / decode nn2; topk ok):")
for f in sorted(glob.glob(os.path.join(out, "indexer_gate_a_*.json"))):
    d = json.load(open(f))
    print(f"  {os.path.basename(f)[15:-5]:22s} " + " / ".join(f"{v['max_rel_err']:.2e}" for v in d.values())
          + "  " + str(all(v["topk_ok"] for v in d.values())))
p = os.path.join(out, "indexer_recall.json")
if os.path.exists(p):
    print("recall", json.load(open(p))["recall"])
p = os.path.join(out, "bench.json")
if not os.path.exists(p):
    sys.exit(0)
b = json.load(open(p))
print(f"\ncopy {b['copy_GBps']:.0f} GB/s, scaled_mm {b['fp8_scaled_mm_TFLOPs']:.0f} TFLOP/s, bench {b.get('elapsed_s', 0):.0f} s")
for kind, key, val in (("decode", ("fmt", "B", "entries", "next_n"), "us"), ("prefill", ("fmt", "S", "causal"), "TFLOPs")):
    rows = [r for r in b["rows"] if r["kind"] == kind]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"\n{kind} ({val}; %{'copy BW' if kind == 'decode' else 'of 1716'} of the first variant; torch eager / compile us)")
    print(" ".join(f"{k:>7s}" for k in key) + " " + " ".join(f"{v[:13]:>13s}" for v in variants) + "    %  eager compile")
    shapes = list(dict.fromkeys(tuple(r[k] for k in key) for r in rows))
    for sh in shapes:
        rs = {r["variant"]: r for r in rows if tuple(r[k] for k in key) == sh}
        first = next(iter(rs.values()))
        pct = first["pct_copy_bw"] if kind == "decode" else first["pct_fp8_peak_1716"]
        base = [r for r in rs.values() if "torch_eager_us" in r]
        e = f"{base[0]['torch_eager_us']:.0f}" if base else "-"
        c = f"{base[0]['torch_compile_us']:.0f}" if base and "torch_compile_us" in base[0] else "-"
        print(" ".join(f"{str(x):>7s}" for x in sh) + " " +
              " ".join(f"{rs[v][val]:13.1f}" if v in rs else f"{'':13s}" for v in variants) + f" {pct:5.1f} {e:>6s} {c:>6s}")
PY
cat "$S"; echo "total $(( $(date +%s) - T0 ))s"
