#!/usr/bin/env bash
# MoE prefill (issue 7) on the H200: GPU tests per kernel version (time-boxed), then prefill timing of
# v3 vs v4 (moe.cu) at DSV4 Flash / Pro shapes, MXFP4 and NVFP4 (general E4M3 block scales: exact
# hi + lo path; power-of-two scales: cheap path), W4A8 plus one W4A16 row, as TFLOP/s and % of the FP8
# peak measured in the same run (torch._scaled_mm 8192^3). Short table last; details under $OUT.
# Usage (repo root): OUT=out bash scripts/gpu_moe_prefill.sh   [STEPS="compile tests4 bench tests3"]
set -u
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export DSV4_MOE_DECODE=0  # the prefill kernels only (few-rows-per-expert shapes would go to moe_decode.cu)
S="$OUT/summary.txt"; L="$OUT/gpu_moe_prefill.log"; PY=${PYTHON:-python3}; T0=$(date +%s)
STEPS=${STEPS:-"compile tests4 bench tests3"}
step() { local name=$1 t=$2; shift 2; local s=$(date +%s); echo "=== $name" >> "$L"; timeout -k 5 "$t" "$@" >> "$L" 2>&1
  local rc=$?; echo "[$(( s - T0 ))s] $name: rc=$rc in $(( $(date +%s) - s ))s :: $(grep -E ' passed| failed|error' "$L" | tail -1)" | tee -a "$S"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
PYTEST="$PY -m pytest -q -x -m gpu -p no:cacheprovider -s tests/test_moe.py"

# 1. NVRTC: every moe.cu variant (+ v4 with one producer warpgroup) into the disk cache, in parallel (keeps compile time out of the test boxes)
has compile && step "nvrtc compile (moe.cu variants)" 60 $PY - <<'EOF'
from concurrent.futures import ProcessPoolExecutor
import itertools
def build(v):
    from kernels_cuda.nvrtc import load
    a, f, s, w = v[:4]
    extra = dict(v[4]) if len(v) > 4 else {}
    load("moe.cu", MOE_ACT=a, MOE_WFMT=f, MOE_STAGE=s, MOE_SW128=w, **extra).cubin()
    return v
jobs = list(itertools.product((0, 1), (0, 1), (1, 2), (0, 1)))
jobs += [(0, f, s, 1, (("V4_PWG", p),)) for f in (0, 1) for s in (1, 2) for p in (1, 2)]
jobs += [(0, 0, s, 1, (("V4_PWG", 2), ("V4_STAGES", st))) for s in (1, 2) for st in (3, 5)]
jobs += [(0, 0, s, 1, (("MOE_DIAG", d), ("V4_PWG", 2))) for s in (1, 2) for d in (1, 2, 3)]
jobs += [(0, f, s, 1, (("V4_PWG", 2), ("V4_WCOAL", 1))) for f in (0, 1) for s in (1, 2)]
with ProcessPoolExecutor(16) as ex:
    print(list(ex.map(build, jobs)))
EOF
# 2. GPU tests: v4 first, then v3 (v1 / v2 were deleted 2026-12-01)
has tests4 && step "gpu tests v4 (2 producer warpgroups)" 80 env DSV4_MOE_TEST_VERSIONS=v4 DSV4_MOE_V4_PWG=2 $PYTEST
has tests4 && step "gpu tests v4 (1 producer warpgroup)" 60 env DSV4_MOE_TEST_VERSIONS=v4 DSV4_MOE_V4_PWG=1 $PYTEST
has tests4 && step "gpu tests v4 (coalesced weight copies, V4_WCOAL=1)" 60 env DSV4_MOE_TEST_VERSIONS=v4 DSV4_MOE_V4_WCOAL=1 $PYTEST
# 3. prefill timing (before the remaining tests so that a slow test cannot eat it)
has bench && step "prefill timing v3 vs v4" 150 $PY - "$OUT" <<'EOF'
import json, sys, time
import torch
from bench._util import copy_bandwidth, json_safe, time_cuda, print_table
from dsv4.ops import moe
from dsv4.ops.moe import MoEGrouped
from dsv4.formats import quantize_fp8_block
from dsv4.registry import use
import os
out_dir = sys.argv[1]
dev = "cuda"

def fp8_peak():
    M = 8192
    a = torch.randn(M, M, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(M, M, device=dev).to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(M, 1, device=dev), torch.ones(1, M, device=dev)
    us = time_cuda(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), warmup=5, iters=30)
    return 2 * M ** 3 / (us * 1e-6) / 1e12

def weights(E, D, I, fmt, scales):
    g = torch.Generator(device=dev).manual_seed(0)
    SF = 32 if fmt == "mxfp4" else 16
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev, generator=g)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev, generator=g)
    def sc(shape):
        if fmt == "mxfp4":
            return torch.randint(118, 123, shape, dtype=torch.uint8, device=dev, generator=g).view(torch.float8_e8m0fnu)
        if scales == "pow2":  # lossless MXFP4 -> NVFP4 re-encoding: E4M3 scales 0.5, 1, 2
            return (0x30 + 8 * torch.randint(0, 3, shape, dtype=torch.uint8, device=dev, generator=g)).view(torch.float8_e4m3fn)
        return torch.randint(0x30, 0x40, shape, dtype=torch.uint8, device=dev, generator=g).view(torch.float8_e4m3fn)
    s13, s2 = sc((E, 2 * I, D // SF)), sc((E, D, I // SF))
    g13 = torch.full((E, 2), 0.01, device=dev) if fmt == "nvfp4" else None
    g2 = torch.full((E,), 0.01, device=dev) if fmt == "nvfp4" else None
    return moe.moe_prepare_weights(w13, s13, w2, s2, fmt=fmt, w13_global=g13, w2_global=g2)

def grouped(E, D, act, n_active, m):
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    counts[torch.arange(n_active, device=dev) * (E // n_active)] = m   # spread out; the others empty
    R = n_active * m
    row_start = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    x = torch.randn(R, D, device=dev)
    x[:, ::97] *= 20.0
    a, a_s = quantize_fp8_block(x, 128, "ue8m0") if act == "fp8" else (x.to(torch.bfloat16), None)
    return MoEGrouped(a, a_s, row_start, counts, torch.rand(R, device=dev) + 0.1, torch.zeros(1, dtype=torch.int64, device=dev))

def run(g, W):
    h, h_s = moe.moe_gemm1_swiglu(g, W)
    return moe.moe_gemm2(h, h_s, g, W)

bw = copy_bandwidth()
peak = fp8_peak()
print(f"copy bandwidth {bw:.0f} GB/s; fp8 torch._scaled_mm 8192^3: {peak:.0f} TFLOP/s", flush=True)
cases = [("flash", 4096, 2048, 16, 2048, f, "fp8", sc) for f, sc in (("mxfp4", "-"), ("nvfp4", "general"), ("nvfp4", "pow2"))]
cases += [("flash", 4096, 2048, 8, 4096, f, "fp8", sc) for f, sc in (("mxfp4", "-"), ("nvfp4", "general"))]
cases += [("pro", 7168, 3072, 16, 2048, f, "fp8", sc) for f, sc in (("mxfp4", "-"), ("nvfp4", "general"))]
cases += [("flash", 4096, 2048, 16, 2048, "mxfp4", "bf16", "-")]
rows, cache = [], {}
for name, D, I, n, m, fmt, act, scales in cases:
    key = (name, fmt, scales)
    if key not in cache:
        cache.clear(); torch.cuda.empty_cache()
        # flash: 2n experts (every other one empty); pro: 384 experts as in bench_moe.py
        cache[key] = weights(384 if name == "pro" else (2 * n if n == 16 else 16), D, I, fmt, scales)
    W = cache[key]
    g = grouped(W.E, D, act, n, m)
    fl = 2 * n * m * 3 * I * D
    r = dict(shape=name, fmt=fmt if scales == "-" else f"{fmt}({scales})", act=act, rows=f"{n}x{m}")
    ys = {}
    # v4p1: one producer warpgroup; v4w: coalesced weight copies (V4_WCOAL=1, tuning)
    for ver, kv, pwg, wc in (("v3", "v3", "2", "0"), ("v4", "v4", "2", "0"), ("v4p1", "v4", "1", "0"), ("v4w", "v4", "2", "1")):
        os.environ["DSV4_MOE_KERNEL"], os.environ["DSV4_MOE_V4_PWG"], os.environ["DSV4_MOE_V4_WCOAL"] = kv, pwg, wc
        try:
            with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                ys[ver] = run(g, W)
                us = time_cuda(lambda: run(g, W), warmup=2, iters=10)
            r[f"{ver}_us"] = us
            r[f"{ver}_TFLOPs"] = fl / (us * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            print(f"{ver} {r}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            r[f"{ver}_us"] = float("nan")
    os.environ.pop("DSV4_MOE_KERNEL", None)
    os.environ.pop("DSV4_MOE_V4_PWG", None)
    os.environ.pop("DSV4_MOE_V4_WCOAL", None)
    if "v4" in ys and "v3" in ys:
        valid = torch.zeros(ys["v3"].shape[0], dtype=torch.bool, device=dev)
        for e in torch.nonzero(g.row_count).flatten().tolist():
            s0, c = int(g.row_start[e]), int(g.row_count[e]); valid[s0:s0 + c] = True
        b = ys["v3"][valid]
        r["v4_vs_v3_rel"] = ((ys["v4"][valid] - b).norm() / b.norm()).item()
        for v in ("v4p1", "v4w"):
            if v in ys:
                r[f"{v}_vs_v3_rel"] = ((ys[v][valid] - b).norm() / b.norm()).item()
    r["v4_pct_peak"] = 100 * r.get("v4_TFLOPs", float("nan")) / peak
    r["v4/v3"] = r.get("v3_us", float("nan")) / r.get("v4_us", float("nan"))
    rows.append(r)
    print(r, flush=True)
# v4 ring depth sweep (MXFP4, flash 16x2048, two producer warpgroups)
W = weights(32, 4096, 2048, "mxfp4", "-")
g = grouped(32, 4096, "fp8", 16, 2048)
os.environ["DSV4_MOE_KERNEL"], os.environ["DSV4_MOE_V4_PWG"] = "v4", "2"
for st in ("3", "4", "5"):
    os.environ["DSV4_MOE_V4_STAGES"] = st
    try:
        with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
            us = time_cuda(lambda: run(g, W), warmup=2, iters=10)
        print(f"v4 stages={st}: flash mxfp4 16x2048 {us:.0f} us {2 * 32768 * 3 * 2048 * 4096 / (us * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"v4 stages={st}: {type(e).__name__}: {str(e)[:200]}", flush=True)
os.environ.pop("DSV4_MOE_V4_STAGES", None)
# v4 diagnostics (wrong results by design): where does the time go? (DSV4_MOE_DIAG is refused
# without DSV4_BENCH_DIAGNOSTICS=1, dsv4/config.py)
os.environ["DSV4_BENCH_DIAGNOSTICS"] = "1"
for dg, what in (("1", "no WGMMA"), ("2", "no FP4 decode"), ("3", "neither: loads + barriers only")):
    os.environ["DSV4_MOE_DIAG"] = dg
    try:
        with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
            us = time_cuda(lambda: run(g, W), warmup=2, iters=10)
        print(f"v4 diag{dg} ({what}): flash mxfp4 16x2048 {us:.0f} us", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"v4 diag{dg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
os.environ.pop("DSV4_MOE_DIAG", None)
os.environ.pop("DSV4_BENCH_DIAGNOSTICS", None)
os.environ.pop("DSV4_MOE_KERNEL", None)
os.environ.pop("DSV4_MOE_V4_PWG", None)
json.dump(json_safe(dict(copy_bw_GBps=bw, fp8_peak_tflops=peak, rows=rows, gpu=torch.cuda.get_device_name(),
                         date=time.strftime("%Y-%m-%d"))), open(os.path.join(out_dir, "moe_prefill.json"), "w"), indent=1)
print()
print_table(rows, ["shape", "fmt", "act", "rows", "v3_us", "v4_us", "v4p1_us", "v4w_us", "v3_TFLOPs", "v4_TFLOPs",
                   "v4p1_TFLOPs", "v4w_TFLOPs", "v4_pct_peak", "v4/v3", "v4_vs_v3_rel", "v4p1_vs_v3_rel", "v4w_vs_v3_rel"], title=f"MoE prefill (GEMM1+SwiGLU+GEMM2), FP8 peak {peak:.0f} TFLOP/s, copy {bw:.0f} GB/s")
EOF
has tests3 && step "gpu tests v3" 60 env DSV4_MOE_TEST_VERSIONS=v3 $PYTEST
echo "total $(( $(date +%s) - T0 ))s" | tee -a "$S"
# short table last
grep -E "^\[moe gpu" "$L" | sort | uniq | tail -n 40
grep -E "^v4 stages=|^v4 diag" "$L"
sed -n '/^MoE prefill (GEMM1/,/^$/p' "$L" | sed -n '1,20p'
cat "$S"
