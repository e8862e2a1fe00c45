# budget: 90
# Saved from the 2026-12-01 session (queued as moe-13, never ran: device budget spent): NVFP4 W4A8 and
# W4A16 prefill, dsl vs moe.cu v4 / v3 in one run, then the MoE GPU suites on the final routing.
# moe-13 (last): (1) timing first, alone: prefill dsl vs cuda moe.cu at the Flash shape for the classes
# moe-12 did not compare (NVFP4 W4A8 -> v4, W4A16 -> v3; cuda called directly: the registry no longer
# sends prefill to it), + MXFP4 W4A8 T=4096 / T=64 re-check of the paired-item decode; (2) the GPU tests
# of the final routing (dsl prefill, cuda moe_decode.cu decode), 3 files in parallel.
set +x
cat > /tmp/m13w.py <<'PYEOF'
import sys
from kernels_dsl import moe as dm
from kernels_dsl.sm90 import config as C
from kernels_dsl._compile import compile_cached
from kernels_dsl.sm90.grouped_gemm import compile_kernel
from dsv4.target import Target
import torch
arch = Target.of(torch.device("cuda")).arch
for spec in sys.argv[1:]:
    st, act, fmt, mm = spec.split(",")
    st = int(st); mm = int(mm)
    N, K = (4096, 4096) if st == 1 else (4096, 2048)
    cfg = C.choose(stage=st, act=act, fmt=fmt, R=256 * mm, E=256, N=N, K=K, max_m=mm)
    compile_cached(("moe_grouped_gemm", cfg.key(), arch, 0, dm._sm90_digest()), lambda: compile_kernel(cfg, arch))
print("warm", sys.argv[1:], flush=True)
PYEOF
cat > /tmp/m13t.py <<'PYEOF'
import traceback, torch
dev = "cuda"
from dsv4.ops import moe
from dsv4.registry import use, last_choice, get_op
from bench._util import time_cuda, copy_bandwidth
from kernels_cuda import moe as km
def P(*a): print(*a, flush=True)
bw = copy_bandwidth(1 << 30)
E, D, I, k = 256, 4096, 2048, 6
def weights(fmt):
    sf = 32 if fmt == "mxfp4" else 16
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device=dev)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device=dev)
    if fmt == "mxfp4":
        s13 = torch.randint(118, 124, (E, 2 * I, D // sf), dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
        s2 = torch.randint(118, 124, (E, D, I // sf), dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
        return moe.moe_prepare_weights(w13, s13, w2, s2, fmt=fmt)
    s13 = (torch.rand(E, 2 * I, D // sf, device=dev) * 4 + 0.5).to(torch.float8_e4m3fn)
    s2 = (torch.rand(E, D, I // sf, device=dev) * 4 + 0.5).to(torch.float8_e4m3fn)
    return moe.moe_prepare_weights(w13, s13, w2, s2, fmt=fmt, w13_global=torch.full((E, 2), 1e-3, device=dev),
                                   w2_global=torch.full((E,), 1e-3, device=dev))
c1 = km.CudaMoEGemm1(get_op("moe_gemm1_swiglu")); c2 = km.CudaMoEGemm2(get_op("moe_gemm2"))
cases = [("nvfp4", "fp8", 4096, "contiguous", 1), ("mxfp4", "bf16", 4096, "contiguous", 1),
         ("mxfp4", "fp8", 4096, "contiguous", 0), ("mxfp4", "fp8", 64, "masked", 0), ("nvfp4", "fp8", 16384, "contiguous", 1)]
Ws = {}
for fmt, act, T, layout, with_cuda in cases:
    try:
        if fmt not in Ws:
            Ws.clear(); torch.cuda.empty_cache(); Ws[fmt] = weights(fmt)
        W = Ws[fmt]
        x = (torch.randn(T, D, device=dev) * 0.5).to(torch.bfloat16)
        idx = torch.rand(T, E, device=dev).argsort(1)[:, :k].to(torch.int32)
        wt = torch.rand(T, k, device=dev)
        mm = {64: 16}.get(T)
        g = moe.moe_permute(x, idx, wt, E, act=act, layout=layout, max_m=mm if layout == "masked" else T)
        hint = mm if layout == "masked" else int(g.row_count.max())
        rows = int(g.row_count.sum()); act_e = int((g.row_count > 0).sum())
        sfb = 32 if fmt == "mxfp4" else 16
        wbytes = act_e * 2 * I * (D // 2 + D // sfb) + act_e * D * (I // 2 + I // sfb)
        fl = 2 * rows * 3 * I * D
        res = {}
        with use(moe_gemm1_swiglu="dsl", moe_gemm2="dsl"):
            h, hs = moe.moe_gemm1_swiglu(g, W, max_m=hint); y = moe.moe_gemm2(h, hs, g, W, max_m=hint)
            torch.cuda.synchronize()
            t1 = time_cuda(lambda: moe.moe_gemm1_swiglu(g, W, max_m=hint), warmup=2, iters=8, graph=True)
            t2 = time_cuda(lambda: moe.moe_gemm2(h, hs, g, W, max_m=hint), warmup=2, iters=8, graph=True)
        res["dsl"] = (t1, t2)
        if with_cuda:  # the moe.cu prefill kernels, called directly (bypassing the registry's routing)
            p1 = moe._gemm_problem(g.a, W.w13, fmt, hint); p2 = moe._gemm_problem(h, W.w2, fmt, hint)
            a1 = dict(a=g.a, a_s=g.a_s, w13=W.w13, w13_scale=W.w13_scale, g13=W.g13, row_start=g.row_start,
                      row_count=g.row_count, route_w=g.route_w)
            hc, hsc = c1.run(p1, **a1)
            a2 = dict(h=hc, h_s=hsc if act == "fp8" else None, w2=W.w2, w2_scale=W.w2_scale, g2=W.g2,
                      row_start=g.row_start, row_count=g.row_count)
            yc = c2.run(p2, **a2); torch.cuda.synchronize()
            t1c = time_cuda(lambda: c1.run(p1, **a1), warmup=2, iters=8, graph=True)
            t2c = time_cuda(lambda: c2.run(p2, **a2), warmup=2, iters=8, graph=True)
            res["cuda " + km.effective_version(act, fmt)] = (t1c, t2c)
            valid = torch.zeros(g.a.shape[0], dtype=torch.bool, device=dev)
            for e in range(E):
                s0, cnt = int(g.row_start[e]), int(g.row_count[e]); valid[s0:s0 + cnt] = True
            rel = ((y[valid] - yc[valid]).norm() / yc[valid].norm()).item()
        line = f"TIME {fmt} {act} T={T:5d} {layout:10s} act.exp {act_e:3d} rows {rows:6d} |"
        for prov, (a_, b_) in res.items():
            line += f" {prov}: g1 {a_:8.1f} g2 {b_:8.1f} sum {a_ + b_:8.1f} us {fl / (a_ + b_) / 1e6:5.0f} TF/s {100 * wbytes / ((a_ + b_) * 1e3) / bw:5.1f}%bw |"
        if with_cuda:
            kc = [kk for kk in res if kk != "dsl"][0]
            line += f" dsl/cuda speedup {sum(res[kc]) / sum(res['dsl']):.2f}x (y dsl vs cuda rel {rel:.1e})"
        P(line)
    except Exception:
        P(f"TIME {fmt} {act} {T}: EXCEPTION"); traceback.print_exc()
PYEOF
echo "=== warm dsl compiles (4 procs)  $(date +%T)"
timeout 16 python3 /tmp/m13w.py 1,fp8,nvfp4,1000 2,fp8,nvfp4,1000 > /tmp/w1.log 2>&1 &
timeout 16 python3 /tmp/m13w.py 1,bf16,mxfp4,1000 2,bf16,mxfp4,1000 > /tmp/w2.log 2>&1 &
timeout 16 python3 /tmp/m13w.py 1,fp8,mxfp4,1000 2,fp8,mxfp4,1000 > /tmp/w3.log 2>&1 &
timeout 16 python3 /tmp/m13w.py 1,fp8,mxfp4,16 2,fp8,mxfp4,16 > /tmp/w4.log 2>&1 &
timeout 16 python3 -c "
import torch
from kernels_cuda import moe as km
for act, fmt in (('fp8', 'nvfp4'), ('bf16', 'mxfp4')):
    for st in (1, 2):
        km._kernel(act, fmt, st, 256)
print('warm cuda moe.cu v4 nvfp4 / v3 bf16', flush=True)
" > /tmp/w5.log 2>&1 &
wait; cat /tmp/w?.log | grep -E "warm|Error" | head -8
echo "=== timing  $(date +%T)"
timeout 20 python3 /tmp/m13t.py 2>&1 | grep -E "TIME|Error|EXCEPTION" | head -12
echo "=== GPU tests, final routing (4 procs)  $(date +%T)"
PT="python3 -m pytest -v -m gpu -p no:cacheprovider"
timeout 46 $PT tests/test_moe.py > /tmp/p1.log 2>&1 &
timeout 46 $PT tests/test_moe_decode.py -k "not dsl" > /tmp/p2.log 2>&1 &
timeout 46 $PT tests/test_moe_decode.py -k dsl > /tmp/p3.log 2>&1 &
timeout 46 $PT tests/test_moe_glue.py > /tmp/p4.log 2>&1 &
wait
for f in /tmp/p1.log /tmp/p2.log /tmp/p3.log /tmp/p4.log; do
  echo "--- $f: $(grep -c ' PASSED' $f) PASSED, $(grep -c ' FAILED' $f) FAILED, $(grep -c ' ERROR' $f) ERROR, $(grep -c ' SKIPPED' $f) SKIPPED"
  grep -E " FAILED| ERROR|^E  .*(Error|assert)" $f | head -6; grep -E "^=+ .*(passed|failed|error)" $f | tail -1
done
echo "=== end $(date +%T)"
