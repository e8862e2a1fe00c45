"""The MoE ops' eager host path (issue 17): what their providers' runs do on the host, which the plan
cache records and replays (dsv4/ops/_plan.py, _trace.py).

* ``moe_route`` (fp32 gate weights, 8..64 tokens; any decode size with ``set_gate_fused(True)``)
  runs the gate GEMM inside its own compiled call
  (``kernels_dsl.moe_glue.RouteKernel.gate_kernel``: fp32 partial logits per 256-wide K chunk, summed in
  order by the top-k kernel) instead of ``x.float()`` + cuBLAS + the top-k launch: same ids as the
  reference up to near-ties of the selection score, weights within 1e-5 relative, deterministic;
* ``moe_permute`` passes ``topk_idx`` / ``topk_w`` ``[T, k]`` and the fp8 rows to its kernel as they
  are (no host views);
* a provider's per-call scratch (the decode GEMMs' split-K workspace, the route's partial logits)
  stays a plain ``torch.empty``: the replay keeps kernel-only workspaces (dsv4/ops/_trace.py).

Every planned (replayed) MoE call must be bit-identical to the full path. No timing here
(bench/bench_eager.py measures the host time)."""
from __future__ import annotations

import pytest
import torch

from dsv4 import registry
from dsv4.ops import moe


# ------------------------------------------------------------------------------------------ CPU
def test_gate_fused_decision_cpu():
    from kernels_dsl import moe_glue as G
    bf, f32 = torch.bfloat16, torch.float32
    gw, gw32 = torch.zeros(256, 4096, dtype=bf), torch.zeros(256, 4096, dtype=f32)
    old = G.set_gate_fused(None)                        # the default: where measured not slower on the device
    try:
        assert G.gate_fused(torch.zeros(G.GATE_MIN_T_FP32, 4096, dtype=bf), gw32)
        assert G.gate_fused(torch.zeros(G.GATE_MAX_T, 4096, dtype=f32), gw32)
        assert not G.gate_fused(torch.zeros(G.GATE_MIN_T_FP32 - 1, 4096, dtype=bf), gw32)   # T = 1..7: cuBLAS
        assert G.gate_fused(torch.zeros(G.GATE_MAX_T_BF16, 4096, dtype=bf), gw)           # bf16 weights: small T
        assert not G.gate_fused(torch.zeros(G.GATE_MAX_T_BF16 + 1, 4096, dtype=bf), gw)   # then cuBLAS
        G.set_gate_fused(True)                          # every supported decode size
        assert G.gate_fused(torch.zeros(1, 4096, dtype=bf), gw)
        assert G.gate_fused(torch.zeros(G.GATE_MAX_T, 4096, dtype=f32), gw32)
        assert not G.gate_fused(torch.zeros(G.GATE_MAX_T + 1, 4096, dtype=bf), gw)        # prefill: cuBLAS
        assert not G.gate_fused(torch.zeros(1, 7168, dtype=bf), torch.zeros(384, 7168, dtype=bf))   # D > GATE_MAX_D
        assert not G.gate_fused(torch.zeros(0, 4096, dtype=bf), gw)
        assert not G.gate_fused(torch.zeros(4, 4100, dtype=bf), torch.zeros(8, 4100, dtype=bf))   # D % 8
        assert not G.gate_fused(torch.zeros(4, 4096, dtype=torch.float16), gw)          # dtype
        assert not G.gate_fused(torch.zeros(4096, 4, dtype=bf).t(), gw)                 # not row-major
        buf = torch.zeros(4 * 4096 + 8, dtype=bf)
        assert not G.gate_fused(buf[1:1 + 4 * 4096].view(4, 4096), gw)                 # not 16-byte aligned
        G.set_gate_fused(False)
        assert not G.gate_fused(torch.zeros(8, 4096, dtype=bf), gw32)
    finally:
        G.set_gate_fused(old)
    assert G.GATE_FUSED is old


# ------------------------------------------------------------------------------------------ GPU
def _dsl_or_skip():
    from dsv4.target import Target
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (sm_90a)")
    s = registry.get_op("moe_route").check("dsl", {"topk": 6, "hash": False, "E": 256, "device": "cuda"},
                                           Target.of("cuda"))
    if not s:
        pytest.skip(s.reason)


def _route_case(T, E, D, hash_layer, x_dtype, g_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    k = min(6, E)
    x = torch.randn(T, D, generator=g).to(x_dtype).cuda()
    gw = (torch.randn(E, D, generator=g) * 0.05).to(g_dtype).cuda()
    if hash_layer:
        V = 50
        tid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]).to(torch.int32)
        tid[3, 1] = E + 2                                   # a bad expert id: dropped slot
        ids = torch.randint(0, V, (T,), generator=g)
        ids[0] = 3
        kw = {"input_ids": ids.cuda(), "tid2eid": tid.cuda()}
    else:
        kw = {"bias": (torch.randn(E, generator=g) * 0.1).cuda()}
    return x, gw, k, kw


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,D,hash_layer", [(1, 256, 4096, False), (5, 384, 4096, False), (64, 256, 4096, False),
                                              (64, 8, 512, False), (17, 7, 520, False), (3, 1000, 1024, False),
                                              (9, 256, 4096, True), (64, 256, 2056, True)])
@pytest.mark.parametrize("x_dtype,g_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["bf16-fp32", "bf16-bf16", "fp32-fp32", "fp32-bf16"])
def test_gpu_route_fused_gate_matches_reference(T, E, D, hash_layer, x_dtype, g_dtype):
    """The fused gate GEMM (decode sizes): ids equal to the torch reference's up to near-ties of the
    selection score, weights within 1e-5 relative, bit-identical on a repeat call; the cuBLAS path of
    the same provider agrees the same way."""
    _check_fused_route(T, E, D, hash_layer, x_dtype, g_dtype, {})


@pytest.mark.gpu
@pytest.mark.parametrize("kc,max_t", [(128, 64), (256, 16), (128, 16)])
@pytest.mark.parametrize("T,E,D,hash_layer", [(1, 256, 4096, False), (16, 7, 520, False)])
def test_gpu_route_fused_gate_geometries(kc, max_t, T, E, D, hash_layer):
    """The fused gate GEMM at other K chunks / staged token rows (``moe_glue.ROUTE_VARIANT``): the same
    contract as the default geometry (bf16 x and gate weights)."""
    _check_fused_route(T, E, D, hash_layer, torch.bfloat16, torch.bfloat16, {"gate_kc": kc, "gate_max_t": max_t})


def _check_fused_route(T, E, D, hash_layer, x_dtype, g_dtype, variant):
    _dsl_or_skip()
    from kernels_dsl import moe_glue as G
    x, gw, k, kw = _route_case(T, E, D, hash_layer, x_dtype, g_dtype, seed=T * 1000 + E)
    old = G.set_gate_fused(True)                         # the fused path at every supported size
    G.ROUTE_VARIANT.update(variant)
    try:
        assert G.gate_fused(x, gw)
        if variant:
            cfg = G.route_config(E, hash_layer, x, gw)
            assert (cfg.gate_kc, cfg.gate_max_t, cfg.n_part) == (variant["gate_kc"], variant["gate_max_t"],
                                                                 -(-D // variant["gate_kc"]))
        with registry.use(moe_route="dsl"):
            idx_f, w_f = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
            idx_f2, w_f2 = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
            G.set_gate_fused(False)
            idx_c, w_c = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
    finally:
        G.set_gate_fused(old)
        G.ROUTE_VARIANT.clear()
    with registry.use(moe_route="torch"):
        idx_t, w_t = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
    assert torch.equal(idx_f, idx_f2) and torch.equal(w_f, w_f2)          # deterministic
    s = torch.sqrt(torch.nn.functional.softplus(x.float() @ gw.float().t()))
    if not hash_layer:
        s = s + kw["bias"]
    for name, (i_d, w_d) in (("fused", (idx_f, w_f)), ("cublas", (idx_c, w_c))):
        same = (i_d == idx_t).all(1)
        for t in torch.nonzero(~same).flatten().tolist():    # only near-ties may order differently
            a = s[t, i_d[t].clamp_min(0).long()].sort().values
            b = s[t, idx_t[t].clamp_min(0).long()].sort().values
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (name, t, i_d[t], idx_t[t])
        assert int(same.sum()) >= T - max(1, T // 16), name
        ok = same.unsqueeze(1).expand_as(w_d)
        rel = ((w_d - w_t).abs() / w_t.abs().clamp_min(1e-30))[ok & (w_t != 0)]
        err = rel.max().item() if rel.numel() else 0.0
        # the cuBLAS path with bf16 weights: a tensor-core GEMM (its own fp32 summation order), 1.07e-5 seen at D=2056
        assert err <= (1e-5 if name == "fused" or g_dtype == torch.float32 else 3e-5), (name, err)
        assert torch.equal(w_d[ok & (w_t == 0)], w_t[ok & (w_t == 0)]), name   # dropped slots: exactly 0
    print(f"\n[route fused] T={T} E={E} D={D} hash={hash_layer} {str(x_dtype)[6:]}/{str(g_dtype)[6:]}: "
          f"ids equal {int((idx_f == idx_t).all(1).sum())}/{T}")


@pytest.mark.gpu
def test_gpu_route_unaligned_x_is_refused_before_any_launch():
    """A CUDA ``x`` must be 16-byte aligned (docs/layouts/moe_route.md): a clear LayoutError naming it
    before any launch (the spec check; the message seen on the H200 in job eagerB10-04)."""
    _dsl_or_skip()
    from dsv4.layout import LayoutError
    T, E, D = 4, 256, 1024
    buf = torch.randn(T * D + 8).to(torch.bfloat16).cuda()
    x = buf[1:1 + T * D].view(T, D)                      # 2-byte offset
    with pytest.raises(LayoutError, match="argument 'x' data pointer is not 16-byte aligned"):
        moe.moe_route(x, torch.randn(E, D, device="cuda"), topk=6)


@pytest.mark.gpu
def test_gpu_moe_planned_calls_bit_identical():
    """Every MoE graph case's call, replayed from its plan (the provider's recorded host trace), is
    bit-identical to the full path (tests/test_plan_cache.py's check, on the MoE cases only)."""
    _dsl_or_skip()
    from bench.bench_eager import collect_cases, record
    from tests.test_plan_cache import check_hit_equals_full
    kinds = {}
    for case in collect_cases(torch.device("cuda")):
        if not case.op.startswith("moe_"):
            continue
        case.run()
        for c in record(case):
            kinds[(c.name, c.label)] = check_hit_equals_full(c)
    assert kinds and all(v == "replayed" for v in kinds.values()), kinds
