# budget: 150
# carry: peers
# Saved from the 2026-12-01 sessions (jobs idx-13, idx-15): the same-run DeepGEMM indexer table. Queue it as a
# peers job (copy into .gpuq/jobs/, second device call with .peers carried); the DeepGEMM build takes ~80 s.
# idx-13: same-run DeepGEMM table for the indexer: prefill 8192 x 16384 causal first (MXFP4 default =
# DSL 4-warpgroup kernel, FP8 default = cuda, --dsl-prefill times the DSL kernel for FP8 too), then
# decode rows (B=32 nn1/nn2, B=128, uneven 1k..128k) until the budget; JSON in $JOB_OUT. Last, if time
# is left: FP8 precision of DeepGEMM vs ours vs fp64 on the same bytes.
set -u
export PYTHONUNBUFFERED=1
T0=$SECONDS
source .peers/deepgemm/build_deepgemm.sh
dg_build "$(ls .peers/deepgemm/deepgemm-*.tar.xz | head -n 1)" driver || { echo "DeepGEMM build failed"; exit 1; }
export LD_PRELOAD="$(ls /usr/lib/x86_64-linux-gnu/libstdc++.so.6 | head -1)"
echo "== DeepGEMM ready at +$((SECONDS - T0)) s"
BUDGET=${PEERS_BUDGET:-84}   # seconds for the whole job (the DeepGEMM build takes ~80 s of it)
left=$(( BUDGET - (SECONDS - T0) ))
bb=$(( left - 14 )); (( bb < 4 )) && bb=4
echo "== bench (budget ${bb}s): prefill rows, then decode rows"
timeout -k 2 $(( bb + 10 )) python3 bench/bench_indexer.py --quick --peers --dsl-prefill --prefill-first --budget $bb \
  --json "$JOB_OUT/bench_indexer_peers.json" 2>&1
left=$(( BUDGET + 2 - (SECONDS - T0) ))
if (( left >= 12 )); then
echo "== FP8 precision: DeepGEMM vs ours vs fp64 on the same bytes (at +$((SECONDS - T0)) s)"
cat > /tmp/idx13_prec.py <<'PYEOF'
"""DeepGEMM fp8_mqa_logits vs this project's FP8 prefill kernel (BF16 operands) vs fp64 on the same FP8 bytes."""
import json, torch
import deep_gemm as dg
from dsv4.data import indexer_inputs
from dsv4.ops.indexer import indexer_logits, indexer_prefill_ranges, indexer_q_quant
from dsv4.reference.indexer import dequantize_q, dequantize_rows, logits_ref, quantize_rows
from kernels_dsl.indexer import prefill_logits_dsl
dev = torch.device("cuda")
for lens_ in ([300, 5, 130], [2500, 1200, 7]):
    ks, ke, pos = indexer_prefill_ranges(lens_, device=dev)
    T, S = int(ks.numel()), sum(L // 4 for L in lens_)
    d = indexer_inputs(T, S, seed=1, q_positions=pos.cpu(), device=dev)
    qd, qs, wo = indexer_q_quant(d.q, d.w, fmt="fp8", hadamard=True)
    kv, ksf = quantize_rows(d.k, "fp8", None, True)
    ref = logits_ref(dequantize_q(qd, qs, "fp8"), wo, dequantize_rows(kv, ksf, "fp8"), ks, ke, dtype=torch.float64, chunk=16)
    q8 = qd.view(torch.float8_e4m3fn)
    k8 = kv.view(torch.float8_e4m3fn)
    k8s = ksf.contiguous().view(torch.float32).view(S)
    out = {"case": lens_, "T": T, "S": S}
    fin = torch.isfinite(ref)
    scale = torch.where(fin, ref.double().abs(), torch.zeros_like(ref, dtype=torch.float64)).amax(1).clamp_min(1e-30)
    def rel(L):
        L = L[:, :S]
        diff = torch.where(fin, (L.double() - ref.double()).abs(), torch.zeros_like(ref, dtype=torch.float64))
        r = diff.amax(1) / scale
        return float(r.max()), int((r > 2e-3).sum())
    try:
        Ldg = dg.fp8_mqa_logits(q8, (k8, k8s), wo, ks, ke, clean_logits=True)
        out["deepgemm_max_rel, rows>2e-3"] = rel(Ldg)
    except Exception as e:  # noqa: BLE001
        out["deepgemm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    out["dsl_max_rel, rows>2e-3"] = rel(prefill_logits_dsl(qd, qs, wo, kv, ksf, ks, ke, fmt="fp8"))
    print("PRECISION fp8 prefill", json.dumps(out), flush=True)
PYEOF
timeout -k 2 $(( left - 2 )) python3 /tmp/idx13_prec.py 2>&1 | grep -aE "PRECISION|Error"
fi
echo "done at +$((SECONDS - T0)) s"
