"""Tests of the DSV4 FP4-weight MoE ops (dsv4/ops/moe.py).

CPU: the full pipeline through the torch providers (prepared layout, grouped layouts) against
the independent checkpoint-layout reference ``moe_layer_ref``; seed-003 regressions (scale
remap, per-expert global scales, gate/up concat order, float8 byte views); router semantics;
hypothesis over (tokens, experts, top-k); NVRTC compile + PTX checks of every kernel variant.
GPU (@pytest.mark.gpu): the WGMMA kernels against the references at realistic sizes.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4.formats import quantize_mxfp4, quantize_nvfp4, swizzle_sf_128x4
from dsv4.layout import LayoutError
from dsv4.ops import moe
from dsv4.reference.moe import dequant_fp4_weight, moe_layer_ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def make_weights(E, D, I, fmt="mxfp4", seed=0, gscale_spread=0.0, device="cpu", pow2_nvfp4=False):
    """Random FP4 expert weights (checkpoint layout) with per-row magnitude variation.

    gscale_spread: log10 range of per-expert global scales (nvfp4 global / mxfp4 extra multipliers).
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    kw = dict(generator=g, device=dev)
    w13f = torch.randn(E, 2 * I, D, **kw) * 0.02 * torch.exp(torch.randn(E, 2 * I, 1, **kw) * 0.5)
    w2f = torch.randn(E, D, I, **kw) * 0.02 * torch.exp(torch.randn(E, D, 1, **kw) * 0.5)
    if gscale_spread:
        g13 = (10.0 ** (torch.rand(E, 2, **kw) * 2 * gscale_spread - gscale_spread)).float()
        g2 = (10.0 ** (torch.rand(E, **kw) * 2 * gscale_spread - gscale_spread)).float()
    else:
        g13 = g2 = None
    if fmt == "mxfp4":
        w13, s13 = quantize_mxfp4(w13f)
        w2, s2 = quantize_mxfp4(w2f)
    else:
        if pow2_nvfp4:  # lossless MXFP4 -> NVFP4 re-encoding: E4M3 scales are powers of two
            w13, s13m = quantize_mxfp4(w13f)
            w2, s2m = quantize_mxfp4(w2f)
            s13 = (s13m.float() * 2.0 ** 10).to(torch.float8_e4m3fn).repeat_interleave(2, -1)
            s2 = (s2m.float() * 2.0 ** 10).to(torch.float8_e4m3fn).repeat_interleave(2, -1)
            base13 = torch.full((E, 2), 2.0 ** -10, device=dev)
            base2 = torch.full((E,), 2.0 ** -10, device=dev)
        else:
            t13 = quantize_nvfp4(w13f)  # per-expert global (decode) scale [E]
            t2 = quantize_nvfp4(w2f)
            w13, s13, w2, s2 = t13.data, t13.scale, t2.data, t2.scale
            base13 = t13.global_scale.float().view(E, 1).repeat(1, 2)
            base2 = t2.global_scale.float().view(E)
        g13 = base13 if g13 is None else base13 * g13
        g2 = base2 if g2 is None else base2 * g2
    to = lambda t: None if t is None else t.to(dev)
    return dict(w13=to(w13), w13_scale=to(s13), w2=to(w2), w2_scale=to(s2), w13_global=to(g13), w2_global=to(g2))


def make_x(T, D, seed=1, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    x[:, torch.randperm(D, generator=g)[: max(1, D // 64)]] *= 30.0  # outlier channels
    return x.to(torch.bfloat16).to(device)


def ref_out(x, ck, fmt, act, idx, w, kernel_fold=False):
    return moe_layer_ref(x, ck["w13"], ck["w13_scale"], ck["w2"], ck["w2_scale"], fmt=fmt, act=act,
                         w13_global=ck["w13_global"], w2_global=ck["w2_global"], topk_idx=idx, topk_w=w,
                         kernel_fold=kernel_fold)


def prep(ck, fmt, **kw):
    return moe.moe_prepare_weights(ck["w13"], ck["w13_scale"], ck["w2"], ck["w2_scale"], fmt=fmt,
                                   w13_global=ck["w13_global"], w2_global=ck["w2_global"], **kw)


def random_routing(T, E, k, seed=2, device="cpu", only=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.arange(E) if only is None else torch.as_tensor(only)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g) + 0.1
    return idx.to(device), w.to(device)


# ------------------------------------------------------------------------------------- prepare
def test_w13_tile_permutation_is_plain_concat():
    I = 256
    p = moe.w13_tile_permutation(I)
    assert sorted(p.tolist()) == list(range(2 * I))
    tile = p[:256].view(2, 2, 64)  # [h, u, j]
    assert torch.equal(tile[0, 0], torch.arange(64))                 # gate rows 0..63
    assert torch.equal(tile[0, 1], I + torch.arange(64))             # up rows I..I+63 (plain concat)
    assert torch.equal(tile[1, 0], 64 + torch.arange(64))
    assert torch.equal(tile[1, 1], I + 64 + torch.arange(64))


def test_reference_undoes_the_prepared_layout_with_its_own_code():
    """The oracle's prepared-W13 row order (dsv4/reference/moe.py, written from the documented layout)
    equals the op's permutation, and the reference does not import it (issue 17 item 5)."""
    import inspect

    import dsv4.reference.moe as R
    for I in (128, 256, 1024):
        assert R.prepared_w13_rows(I) == moe.w13_tile_permutation(I).tolist()
        w = torch.randn(2, 2 * I, 3)
        assert torch.equal(R._unpermute_w13(w[:, moe.w13_tile_permutation(I)], I), w)
    src = inspect.getsource(R)
    assert "import w13_tile_permutation" not in src and "w13_tile_permutation(" not in src


def _bad_grouping(R, E):
    """A grouping whose experts 0..2 own disjoint valid ranges (expert 2's count runs past R) and
    whose experts 3..6 carry bad metadata (negative start, start past R, negative count, start -5
    with a count reaching into the valid rows)."""
    starts = torch.tensor([0, 10, 30, -1, R + 7, 5, -5][:E], dtype=torch.int32)
    counts = torch.tensor([10, 20, 10 ** 7, 4, 3, -4, R + 10][:E], dtype=torch.int32)
    return starts, counts


@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_grouped_gemm_refs_bad_grouping_rule(act):
    """Bad row_start / row_count in the torch oracles follow the kernels' rule (clamped to [0, R),
    an expert with a start outside [0, R) or a count <= 0 has no rows): by value vs the same GEMMs on
    the clean grouping (expert 2 = rows [30, R))."""
    E, D, I, R = 7, 256, 128, 45
    ck = make_weights(E, D, I)
    W = prep(ck, "mxfp4")
    x = make_x(R, D)
    from dsv4.formats import quantize_fp8_block
    a, a_s = quantize_fp8_block(x, 128, "ue8m0") if act == "fp8" else (x, None)
    rw = torch.rand(R) + 0.5
    bs, bc = _bad_grouping(R, E)
    cs = torch.tensor([0, 10, 30, 0, 0, 0, 0], dtype=torch.int32)
    cc = torch.tensor([10, 20, R - 30, 0, 0, 0, 0], dtype=torch.int32)
    pos = torch.arange(R, dtype=torch.int64)
    out = {}
    for name, (st_, cn_) in {"bad": (bs, bc), "clean": (cs, cc)}.items():
        g = moe.MoEGrouped(a, a_s, st_, cn_, rw, pos)
        h, h_s = moe.moe_gemm1_swiglu(g, W)
        y = moe.moe_gemm2(h, h_s, g, W)
        out[name] = (h, h_s, y)
    hb, hsb, yb = out["bad"]
    hc, hsc, yc = out["clean"]
    assert torch.equal(hb.view(torch.uint8) if act == "fp8" else hb, hc.view(torch.uint8) if act == "fp8" else hc)
    assert torch.equal(yb, yc) and bool(yc.abs().sum(1).gt(0).all())


def test_grouped_dropped_counts_bad_ids_on_the_device():
    E, D, T, k = 5, 256, 12, 3
    x = make_x(T, D)
    idx, w = random_routing(T, E, k)
    idx[0, 1], idx[3, 0], idx[7, 2], idx[8, 0] = E, -1, 1 << 30, -(1 << 31)
    for layout in ("contiguous", "masked"):
        g = moe.moe_permute(x, idx, w, E, layout=layout, max_m=T)
        n = g.dropped()
        assert n.dtype == torch.int64 and n.dim() == 0 and int(n) == 4
        assert int(g.row_count.sum()) == T * k - 4
    g = moe.moe_permute(x, idx, w, E, layout="masked", max_m=1)      # masked overflow drops count too
    assert int(g.dropped()) == T * k - int(g.row_count.sum())


def test_prepare_layout_and_describe():
    ck = make_weights(3, 256, 128)
    W = prep(ck, "mxfp4")
    assert W.w13.dtype == torch.uint8 and W.w13_scale.dtype == torch.uint8
    assert tuple(W.g13.shape) == (3, 2) and tuple(W.g2.shape) == (3,)
    assert torch.equal(W.w13[:, 64:128], ck["w13"][:, 128:192])  # tile 0: up rows follow gate 0..63
    assert "moe_prepare_weights" in W.describe() and "w13_scale: uint8" in W.describe()


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_swizzled_sf_round_trip_matches_linear(fmt):
    ck = make_weights(2, 256, 128, fmt=fmt)
    lin = prep(ck, fmt)
    sw = dict(ck, w13_scale=swizzle_sf_128x4(ck["w13_scale"]), w2_scale=swizzle_sf_128x4(ck["w2_scale"]))
    W = prep(sw, fmt, sf_layout="swizzled")
    assert torch.equal(W.w13_scale, lin.w13_scale) and torch.equal(W.w2_scale, lin.w2_scale)
    # every K group of the scales matters (seed 003: only k_group 0 was read)
    ck2 = dict(ck, w13_scale=ck["w13_scale"].clone())
    b = ck2["w13_scale"].view(torch.uint8)
    b[0, 0, 3] = b[0, 0, 3] + 1  # bump scale group 3 of row 0
    W2 = prep(ck2, fmt)
    assert not torch.equal(W2.w13_scale, lin.w13_scale)


def test_global_scale_shapes_enforced():
    ck = make_weights(3, 256, 128, fmt="nvfp4")
    with pytest.raises(LayoutError, match="w13_global"):
        prep(dict(ck, w13_global=ck["w13_global"][:1]), "nvfp4")   # one scale for all experts
    with pytest.raises(LayoutError, match="w13_global"):
        prep(dict(ck, w13_global=ck["w13_global"][:, 0]), "nvfp4")  # no separate gate / up
    with pytest.raises(LayoutError, match="global"):
        prep(dict(ck, w2_global=None), "nvfp4")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_global_scales_rejected(bad):
    """Same class as issue 19 item 4 (dequant_fp4's NaN global_scale): a non-finite per-expert global
    scale is refused at prepare time, naming the argument (before: accepted, the expert became NaN)."""
    ck = make_weights(3, 256, 128, fmt="nvfp4")
    for name in ("w13_global", "w2_global"):
        kw = dict(ck)
        g = kw[name].clone()
        g.view(-1)[1] = bad
        kw[name] = g
        with pytest.raises(ValueError, match=name):
            prep(kw, "nvfp4")


def test_raw_uint8_scales_rejected_and_byte_views_exact():
    ck = make_weights(2, 256, 128, fmt="nvfp4")
    with pytest.raises(LayoutError, match="view"):
        prep(dict(ck, w13_scale=ck["w13_scale"].view(torch.uint8)), "nvfp4")
    # byte 0x3F is E4M3 1.875 (seed 003: .to() made it 63.0)
    s = ck["w13_scale"].clone()
    s.view(torch.uint8)[:] = 0x3F
    W = prep(dict(ck, w13_scale=s), "nvfp4")
    assert int(W.w13_scale.unique().item()) == 0x3F
    d = dequant_fp4_weight(W.w13[:1], W.w13_scale[:1], "nvfp4")
    codes_ref = dequant_fp4_weight(W.w13[:1], torch.ones_like(W.w13_scale[:1], dtype=torch.float32).to(torch.float8_e4m3fn), "nvfp4")
    assert torch.allclose(d, codes_ref * 1.875)


# ------------------------------------------------------------------------------------- router
def test_router_bias_only_for_selection_and_normalization():
    torch.manual_seed(0)
    T, D, E, k = 64, 128, 16, 6
    x = torch.randn(T, D)
    gw = torch.randn(E, D) * 0.2
    bias = torch.zeros(E)
    bias[3] = 100.0  # forces expert 3 into every selection
    idx, w = moe.moe_route(x, gw, topk=k, route_scale=2.5, bias=bias)
    assert idx.dtype == torch.int32 and w.dtype == torch.float32
    assert bool((idx == 3).any(1).all())
    s = torch.sqrt(torch.nn.functional.softplus(x @ gw.t()))
    ws = s.gather(1, idx.long())
    assert torch.allclose(w, ws / ws.sum(1, keepdim=True) * 2.5, rtol=1e-5)   # unbiased scores
    assert torch.allclose(w.sum(1), torch.full((T,), 2.5), rtol=1e-5)


def test_router_hash_layer():
    T, D, E, k, V = 10, 64, 12, 6, 50
    tid2eid = torch.stack([torch.randperm(E)[:k] for _ in range(V)]).to(torch.int32)
    ids = torch.randint(0, V, (T,))
    x, gw = torch.randn(T, D), torch.randn(E, D)
    idx, w = moe.moe_route(x, gw, topk=k, route_scale=1.5, input_ids=ids, tid2eid=tid2eid)
    assert torch.equal(idx, tid2eid[ids])
    assert torch.allclose(w.sum(1), torch.full((T,), 1.5), rtol=1e-5)


# ------------------------------------------------------------------------------------- layer (torch providers)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("act", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_pipeline_matches_reference_cpu(fmt, act, layout):
    E, D, I, T, k = 7, 256, 256, 41, 3   # odd expert count
    ck = make_weights(E, D, I, fmt=fmt, gscale_spread=2.0)
    W = prep(ck, fmt)
    x = make_x(T, D)
    idx, w = random_routing(T, E, k, only=[0, 2, 3, 5, 6])  # experts 1 and 4 get zero tokens
    out = moe.moe_experts(x, idx, w, W, act=act, layout=layout, max_m=T)
    ref = ref_out(x, ck, fmt, act, idx, w)
    assert _rel(out, ref) < 1e-5


def test_per_expert_global_scales_matter():
    """Scales differing by orders of magnitude; applying one expert's scale to all is caught."""
    E, D, I, T, k = 5, 256, 128, 30, 2
    ck = make_weights(E, D, I, fmt="nvfp4", gscale_spread=3.0)
    x = make_x(T, D)
    idx, w = random_routing(T, E, k)
    ref = ref_out(x, ck, "nvfp4", "bf16", idx, w)
    out = moe.moe_experts(x, idx, w, prep(ck, "nvfp4"), act="bf16")
    assert _rel(out, ref) < 1e-5
    bad = dict(ck, w13_global=ck["w13_global"][:1].expand(E, 2).contiguous(),
               w2_global=ck["w2_global"][:1].expand(E).contiguous())
    assert _rel(moe.moe_experts(x, idx, w, prep(bad, "nvfp4"), act="bf16"), ref) > 0.1


def test_gate_up_order_matters():
    E, D, I, T, k = 3, 256, 128, 20, 2
    ck = make_weights(E, D, I)
    x = make_x(T, D)
    idx, w = random_routing(T, E, k)
    ref = ref_out(x, ck, "mxfp4", "fp8", idx, w)
    swapped = dict(ck, w13=torch.cat([ck["w13"][:, I:], ck["w13"][:, :I]], 1),
                   w13_scale=torch.cat([ck["w13_scale"][:, I:], ck["w13_scale"][:, :I]], 1))
    assert _rel(ref_out(x, swapped, "mxfp4", "fp8", idx, w), ref) > 0.1
    assert _rel(moe.moe_experts(x, idx, w, prep(ck, "mxfp4")), ref) < 1e-5
    assert _rel(moe.moe_experts(x, idx, w, prep(swapped, "mxfp4")), ref) > 0.1


def test_masked_drop_and_combine():
    E, D, I, T, k = 4, 256, 128, 16, 2
    ck = make_weights(E, D, I)
    W = prep(ck, "mxfp4")
    x = make_x(T, D)
    idx = torch.zeros(T, k, dtype=torch.int32)
    idx[:, 1] = 1  # experts 0 and 1 get T rows each, max_m = 5 keeps 5
    w = torch.rand(T, k)
    g = moe.moe_permute(x, idx, w, E, layout="masked", max_m=5)
    assert g.row_count.tolist() == [5, 5, 0, 0]
    assert int((g.pos >= 0).sum()) == 10
    out = moe.moe_experts(x, idx, w, W, layout="masked", max_m=5)
    assert torch.all(out[5:] == 0)


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 24), E=st.integers(1, 9), k=st.integers(1, 4), layout=st.sampled_from(["contiguous", "masked"]),
       seed=st.integers(0, 1000))
def test_hypothesis_tokens_experts_topk(T, E, k, layout, seed):
    k = min(k, E)
    D, I = 256, 128
    ck = _HYP_WEIGHTS[E]
    x = make_x(T, D, seed=seed)
    gw = torch.randn(E, D, generator=torch.Generator().manual_seed(seed)) * 0.1
    idx, w = moe.moe_route(x, gw, topk=k, route_scale=1.5, bias=torch.randn(E) * 0.05)
    assert idx.min() >= 0 and idx.max() < E and all(len(set(r)) == k for r in idx.tolist())
    out = moe.moe_experts(x, idx, w, prep(ck, "mxfp4"), layout=layout, max_m=T)
    ref = ref_out(x, ck, "mxfp4", "fp8", idx, w)
    assert _rel(out, ref) < 1e-5


_HYP_WEIGHTS = {E: make_weights(E, 256, 128, seed=E) for E in range(1, 10)}


def _nvfp4_w4a8_split(data, scale):
    """Torch model of the NVFP4 W4A8 hi + lo split (the split the CuTe DSL grouped GEMM decodes with
    kernels_dsl/sm90/fp4.py ``e4m3_hilo_lut``; first built for the deleted moe.cu): per (row, 128-K block)
    base = floor(log2(max sf)) - 5, f = sf * 2^-base, hi = e4m3_rn(level * f), lo = e4m3_rn(v - hi);
    returns (2^base * hi, 2^base * lo) fp32 [..., N, K]."""
    from dsv4.formats import e2m1_decode, unpack_e2m1
    vals = e2m1_decode(unpack_e2m1(data))
    nb = vals.shape[-1] // 128
    sf = scale.float().view(*scale.shape[:-1], nb, 8)
    sm = sf.amax(-1, keepdim=True)
    base = torch.where(sm > 0, torch.floor(torch.log2(sm.clamp_min(1e-30))) - 5, torch.zeros_like(sm))
    v = vals.view(*vals.shape[:-1], nb, 8, 16) * (sf * torch.exp2(-base)).unsqueeze(-1)
    hi = v.to(torch.float8_e4m3fn).float()
    lo = (v - hi).to(torch.float8_e4m3fn).float()
    b = torch.exp2(base).unsqueeze(-1)
    return (hi * b).reshape(vals.shape), (lo * b).reshape(vals.shape)


def test_nvfp4_w4a8_hi_lo_split_exact():
    """NVFP4 under W4A8 (task: exact): hi + lo reproduces level * sf exactly for general E4M3 block
    scales (quantize_nvfp4, per-expert global scales 3 decades apart) and for block scales spanning
    exactly 10 binades inside one 128-K block (the documented bound); the single-E4M3 fold is not."""
    from dsv4.reference.moe import fold_fp4_weight_w4a8
    ck = make_weights(3, 256, 128, fmt="nvfp4", gscale_spread=3.0)
    for w, sc in ((ck["w13"], ck["w13_scale"]), (ck["w2"], ck["w2_scale"])):
        exact = dequant_fp4_weight(w, sc, "nvfp4")
        hi, lo = _nvfp4_w4a8_split(w, sc)
        assert torch.equal(hi + lo, exact)
        assert (lo != 0).any()  # the lo term is really needed
        assert not torch.equal(fold_fp4_weight_w4a8(w, sc, "nvfp4"), exact)  # the old one-rounding fold
    # bound: scales of one 128-K block 2^10 apart (max = 448 = 1.75 * 2^8, min = 1.875 * 2^-2)
    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=g)
    sb = torch.randint(0x30, 0x7F, (64, 8), dtype=torch.uint8, generator=g)
    sb[:, 0] = 0x7E                                   # 448
    sb[:, 1] = 0x2F                                   # 1.875 * 2^-2: 10 binades below
    sb[:, 2] = 0x00                                   # zero scale
    sc = sb.view(torch.float8_e4m3fn)
    hi, lo = _nvfp4_w4a8_split(w, sc)
    assert torch.equal(hi + lo, dequant_fp4_weight(w, sc, "nvfp4"))


def test_device_lo_lut_emulation():
    """Bit-level emulation of the NVFP4 W4A8 hi / lo LUT bytes with the sign applied by XOR
    (kernels_dsl/sm90/fp4.py ``e4m3_hilo_lut`` + ``model_e2m1x8_to_e4m3x8(sign_xor=True)``) and the
    power-of-two predicate: for every positive E4M3 block scale and every block maximum up to
    10 binades above it, hi byte + lo byte == +-level * f exactly; lo == 0 exactly for power-of-two sf."""
    ml = pytest.importorskip("ml_dtypes")
    import math
    import numpy as np
    E4 = ml.float8_e4m3fn

    def e4(x):
        return np.array(x, dtype=np.float32).astype(E4)

    levels = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    for b in range(1, 0x7F):
        sf = float(np.array([b], dtype=np.uint8).view(E4).astype(np.float32)[0])
        ex, m = b >> 3, b & 7
        pow2 = (m == 0) if ex else (m & (m - 1)) == 0
        e_sf = max(math.floor(math.log2(sf)), -6)
        for emax in range(max(e_sf, math.floor(math.log2(sf))), min(e_sf + 10, 8) + 1):
            f = np.float32(sf * 2.0 ** (5 - emax))
            v = levels * f                                   # exact in fp32
            hi = e4(v)
            lo = e4(v - hi.astype(np.float32))
            assert np.array_equal(hi.astype(np.float32) + lo.astype(np.float32), v), (b, emax)
            if pow2:
                assert not lo.view(np.uint8).any(), (b, emax)
            # sign by XOR on the byte (lo may already be negative)
            hn = (hi.view(np.uint8) ^ 0x80).view(E4).astype(np.float32)
            ln = (lo.view(np.uint8) ^ 0x80).view(E4).astype(np.float32)
            assert np.array_equal(hn + ln, -v), (b, emax)


# ------------------------------------------------------------------------------------- GPU
#: grouped-GEMM providers the GPU tests of prefill-sized groups run: the registry sends those to
#: ``dsl`` (the cuda provider, kernels_cuda/moe.py, is decode-only and declines them); decode-sized
#: groups are tested on both providers below and in tests/test_moe_decode.py.
_GPU_VERSIONS = ["dsl"]


@pytest.fixture(params=_GPU_VERSIONS)
def kver(request):
    """The provider kind under test ("dsl", or "cuda" where it serves the problem)."""
    return request.param


def _gemm2_tol(kver: str, act: str) -> float:
    """GEMM2 gate vs the exact-dequant oracle on the same h: the cuda kernels are exact (fp32
    summation order only, 1e-4); the dsl provider's contract is 5e-3 (W4A8: FP8 WGMMA per 128-K
    block with fp32 promotion) / 1e-5 (W4A16)."""
    if kver == "cuda":
        return 1e-4
    return 5e-3 if act == "fp8" else 1e-5


def _gpu_case(fmt, act, layout, E=33, D=2048, I=1024, T=2048, k=6, pow2_nvfp4=False, only=None, spread=2.0,
              prov="dsl"):
    dev = "cuda"
    ck = make_weights(E, D, I, fmt=fmt, gscale_spread=spread, device=dev, pow2_nvfp4=pow2_nvfp4)
    W = prep(ck, fmt)
    x = make_x(T, D, device=dev)
    idx, w = random_routing(T, E, k, device=dev, only=only)
    from dsv4.registry import use
    with use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
        out = moe.moe_experts(x, idx, w, W, act=act, layout=layout, max_m=T)
    ref = ref_out(x, ck, fmt, act, idx, w)
    return out, ref, W, x, idx, w


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("act", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_layer_matches_reference(fmt, act, layout, kver):
    pow2 = fmt == "nvfp4" and act == "fp8"  # W4A8 NVFP4 is exact for power-of-two block scales
    out, ref, *_ = _gpu_case(fmt, act, layout, pow2_nvfp4=pow2, only=[e for e in range(33) if e % 5], prov=kver)
    err = _rel(out, ref)
    print(f"\n[moe gpu {kver}] {fmt} {act} {layout}: rel err {err:.3e}")
    assert err < (1e-2 if act == "fp8" else 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act,layout", [("mxfp4", "fp8", "contiguous"), ("nvfp4", "fp8", "masked"),
                                            ("mxfp4", "bf16", "masked"), ("nvfp4", "bf16", "contiguous")])
def test_gpu_small_layer_every_variant(fmt, act, layout, kver):
    """Small shapes (the compute-sanitizer subset, tests/conftest.py SANITIZE): both weight formats x
    both activations of the grouped GEMM kernels, both layouts, prefill-sized groups, vs the
    checkpoint-layout reference."""
    pow2 = fmt == "nvfp4" and act == "fp8"
    out, ref, *_ = _gpu_case(fmt, act, layout, E=5, D=512, I=256, T=96, k=4, pow2_nvfp4=pow2, prov=kver)
    assert _rel(out, ref) < (1e-2 if act == "fp8" else 3e-3)


def gemms_and_oracles(g, W, prov, max_m=None):
    """GEMM1 + GEMM2 of grouping ``g`` on provider ``prov``, and the torch oracles on the same inputs
    (the GEMM2 oracle on the provider's own ``h``): ``(h, h_s, y, h_ref, h_s_ref, y_ref)``."""
    from dsv4.registry import use
    with use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
        h, h_s = moe.moe_gemm1_swiglu(g, W, max_m=max_m)
        y = moe.moe_gemm2(h, h_s, g, W, max_m=max_m)
    with use(moe_gemm1_swiglu="torch", moe_gemm2="torch"):
        h_ref, h_s_ref = moe.moe_gemm1_swiglu(g, W)
        y_ref = moe.moe_gemm2(h, h_s, g, W)
    return h, h_s, y, h_ref, h_s_ref, y_ref


def capture_replay(fn):
    """``(fn(), the same call captured in a CUDA graph and replayed)``: both outputs, synchronized."""
    out = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out, out_g


def _maxrel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


@pytest.mark.gpu
def test_gpu_nvfp4_general_scales_w4a8(kver):
    """General (non power-of-two) E4M3 block scales, per-expert global scales 3 decades apart, under
    W4A8: the hi + lo split is exact, so the layer matches the exact reference as tightly as MXFP4
    (same data path and tolerance); the old single-E4M3 fold is reported for comparison."""
    out, ref, W, x, idx, w = _gpu_case("nvfp4", "fp8", "contiguous", E=9, T=512, spread=3.0, prov=kver)
    ck = make_weights(9, 2048, 1024, fmt="nvfp4", gscale_spread=3.0, device="cuda")
    fold = ref_out(x, ck, "nvfp4", "fp8", idx, w, kernel_fold=True)
    mx_out, mx_ref, *_ = _gpu_case("mxfp4", "fp8", "contiguous", E=9, T=512, spread=3.0, prov=kver)
    print(f"\n[moe gpu {kver}] nvfp4 general scales W4A8: vs exact {_rel(out, ref):.3e} (max {_maxrel(out, ref):.3e}); "
          f"old one-rounding fold vs exact {_rel(fold, ref):.3e} (max {_maxrel(fold, ref):.3e}); "
          f"mxfp4 same path vs exact {_rel(mx_out, mx_ref):.3e} (max {_maxrel(mx_out, mx_ref):.3e})")
    assert _rel(out, ref) < 1e-2 and _rel(out, ref) < 3 * _rel(mx_out, mx_ref) + 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_w4a8_gemms_within_contract_given_inputs(fmt, kver):
    """W4A8 GEMM1 / GEMM2 on identical FP8 inputs vs the exact-dequant torch oracle, general NVFP4
    block scales (not powers of two) and per-expert global scales 3 decades apart. Contract
    (DeepGEMM style: FP8 WGMMA per 128-K block promoted into fp32; the weight decode, NVFP4's hi +
    lo split included, is exact): GEMM2 relative error <= 5e-3; GEMM1's h within the bf16 / FP8
    rounding of the reference."""
    dev = "cuda"
    E, D, I, T, k = 9, 2048, 1024, 1024, 6
    ck = make_weights(E, D, I, fmt=fmt, device=dev, gscale_spread=3.0)
    W = prep(ck, fmt)
    x = make_x(T, D, device=dev)
    idx, w = random_routing(T, E, k, device=dev)
    g = moe.moe_permute(x, idx, w, E, act="fp8")
    h, h_s, y, h_ref, h_s_ref, y_ref = gemms_and_oracles(g, W, kver)
    hd = h.float() * h_s.repeat_interleave(128, 1)
    hd_ref = h_ref.float() * h_s_ref.repeat_interleave(128, 1)
    print(f"\n[moe gpu {kver}] {fmt} W4A8 gemm2 given h: rel {_rel(y, y_ref):.3e} max {_maxrel(y, y_ref):.3e}; "
          f"gemm1 h: rel {_rel(hd, hd_ref):.3e}")
    assert _rel(y, y_ref) < _gemm2_tol(kver, "fp8") and _maxrel(y, y_ref) < (1e-3 if kver == "cuda" else 2e-2)
    assert _rel(hd, hd_ref) < 1e-2 and (h_s == h_s_ref).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_gpu_gemm2_within_contract_given_h(act, kver):
    """GEMM2 on the kernel's own h vs the exact-dequant oracle: W4A8 relative error <= 5e-3 (FP8
    WGMMA per 128-K block, fp32 promotion), W4A16 <= 1e-5 (exact products, fp32 summation order)."""
    dev = "cuda"
    E, D, I, T, k = 17, 2048, 1024, 1024, 6
    ck = make_weights(E, D, I, device=dev, gscale_spread=3.0)
    W = prep(ck, "mxfp4")
    x = make_x(T, D, device=dev)
    idx, w = random_routing(T, E, k, device=dev)
    g = moe.moe_permute(x, idx, w, E, act=act)
    h, h_s, y, h_ref, h_s_ref, y_ref = gemms_and_oracles(g, W, kver)
    print(f"\n[moe gpu {kver}] {act} gemm2 given h: rel {_rel(y, y_ref):.3e}")
    assert _rel(y, y_ref) < _gemm2_tol(kver, act)
    if act == "fp8":
        hd = h.float() * h_s.repeat_interleave(128, 1)
        hd_ref = h_ref.float() * h_s_ref.repeat_interleave(128, 1)
        assert _rel(hd, hd_ref) < 1e-2
        assert (h_s == h_s_ref).float().mean() > 0.99
    else:
        assert _rel(h, h_ref) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kver", ["dsl", "cuda"])
def test_gpu_decode_masked_flash_shape_and_graph(kver):
    """Decode: 1-16 tokens per active expert at D=4096, I=2048, E=256; CUDA-graph capture."""
    dev = "cuda"
    E, D, I, k = 256, 4096, 2048, 6
    ck = make_weights(8, D, I, device=dev)
    # 256 experts sharing 8 distinct weight sets (keeps the test small); global scales differ
    rep = lambda t: t.repeat(32, *([1] * (t.dim() - 1))) if t is not None else None
    ck = {kk: rep(v) for kk, v in ck.items()}
    ck["w13_global"] = (10.0 ** torch.linspace(-2, 2, E, device=dev)).view(E, 1).repeat(1, 2).contiguous()
    ck["w2_global"] = (10.0 ** torch.linspace(2, -2, E, device=dev)).contiguous()
    W = prep(ck, "mxfp4")
    T = 16
    x = make_x(T, D, device=dev)
    idx, w = random_routing(T, E, k, device=dev, only=list(range(0, E, 7)))
    from dsv4.registry import use
    with use(moe_gemm1_swiglu=kver, moe_gemm2=kver):
        out, out_g = capture_replay(lambda: moe.moe_experts(x, idx, w, W, layout="masked", max_m=16))
    ref = ref_out(x, ck, "mxfp4", "fp8", idx, w)
    assert _rel(out, ref) < 1e-2
    assert torch.equal(out_g, out)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_w4a8_fold_exact_for_mxfp4_and_pow2_nvfp4(fmt):
    from dsv4.reference.moe import fold_fp4_weight_w4a8
    ck = make_weights(2, 256, 128, fmt=fmt, pow2_nvfp4=True)
    exact = dequant_fp4_weight(ck["w13"], ck["w13_scale"], fmt)
    assert torch.equal(fold_fp4_weight_w4a8(ck["w13"], ck["w13_scale"], fmt), exact)
    # a 128-block spanning > 14 binades flushes its smallest group (documented)
    if fmt == "mxfp4":
        s = ck["w13_scale"].clone()
        s.view(torch.uint8)[0, 0, 0] = 100
        s.view(torch.uint8)[0, 0, 1] = 120
        f = fold_fp4_weight_w4a8(ck["w13"], s, fmt)
        assert torch.all(f[0, 0, :32] == 0) and torch.equal(f[0, 0, 32:], dequant_fp4_weight(ck["w13"], s, fmt)[0, 0, 32:])


# ------------------------------------------------------------------------------------- dsl grouped GEMM (CPU)
def _dsl_fold_model(data, scale, fmt):
    """Torch model of kernels_dsl/sm90/transform.py under W4A8: per row a reference over the whole
    K (MXFP4: max UE8M0 byte; NVFP4: floor(log2 max sf) - 5), decoded E4M3 part(s), and the column
    multiplier; returns (sum of parts * multiplier, parts count)."""
    vals = dequant_fp4_weight(data, torch.ones_like(scale, dtype=torch.float32).to(scale.dtype)
                              if False else scale, fmt)  # exact reference values
    lev = __import__("dsv4.formats", fromlist=["e2m1_decode"]).e2m1_decode(
        __import__("dsv4.formats", fromlist=["unpack_e2m1"]).unpack_e2m1(data))
    sf = 32 if fmt == "mxfp4" else 16
    if fmt == "mxfp4":
        b = scale.view(torch.uint8).to(torch.int32)
        rb = b.amax(-1, keepdim=True)
        d = (b - rb + 6).repeat_interleave(sf, -1).float()
        q = (lev * torch.exp2(d)).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        return q * torch.exp2((rb - 133).float()), vals
    s = scale.float()
    m = s.amax(-1, keepdim=True)
    base = torch.where(m > 0, torch.floor(torch.log2(m.clamp_min(1e-30))) - 5, torch.zeros_like(m))
    v = lev * (s * torch.exp2(-base)).repeat_interleave(sf, -1)
    hi = v.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    lo = (v - hi).to(torch.float8_e4m3fn).float()
    return (hi + lo) * torch.exp2(base), vals


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_dsl_w4a8_row_fold_is_exact_on_checkpoint_like_weights(fmt):
    """The DSL W4A8 weight decode (per-row reference exponent over the whole K, E4M3 fold / NVFP4
    hi + lo split) reproduces level * scale exactly on realistic weights (per-row magnitudes
    spread as in a checkpoint, general NVFP4 block scales), so the FP8 kernel's only error is the
    tensor core's per-128-K accumulation; a row spanning more binades than the bound loses only
    bits below 2^-9 relative to its largest value."""
    ck = make_weights(3, 256, 256, fmt=fmt, gscale_spread=3.0)
    for w, sc in ((ck["w13"], ck["w13_scale"]), (ck["w2"], ck["w2_scale"])):
        got, exact = _dsl_fold_model(w, sc, fmt)
        assert torch.equal(got, exact)
    if fmt == "mxfp4":  # one group 20 binades below its row maximum: rounds, bounded
        s = ck["w2_scale"].clone()
        s.view(torch.uint8)[0, 0, 0] = int(s.view(torch.uint8)[0, 0].max()) - 20
        got, exact = _dsl_fold_model(ck["w2"], s, fmt)
        rowmax = exact[0, 0].abs().max()
        assert not torch.equal(got, exact) and (got - exact).abs().max() <= rowmax * 2.0 ** -9


def _mag_sign_model(w, lo, hi, xor=False):
    """Bit model of the W4A8 word decode of kernels_dsl/sm90/grouped_gemm.py (``fp4.e2m1x8_mag_sign``): the
    magnitudes by a prmt LUT lookup, the signs as byte-msb masks from the sign-replicate prmt over
    {w << 4, w} (kernels_dsl/sm90/fp4.py selectors); E4M3 = mag | sign (NVFP4 lo parts: mag ^ sign)."""
    from kernels_dsl.sm90 import fp4
    idx = w & 0x77777777
    m0, m1 = fp4.model_prmt(lo, hi, idx & 0xFFFF), fp4.model_prmt(lo, hi, idx >> 16)
    a = (w << 4) & 0xFFFFFFFF
    k0 = fp4.model_prmt(a, w, fp4._SIGN_SEL0) & 0x80808080
    k1 = fp4.model_prmt(a, w, fp4._SIGN_SEL1) & 0x80808080
    return (m0 ^ k0, m1 ^ k1) if xor else (m0 | k0, m1 | k1)


def test_dsl_w4a8_sign_mask_decode_is_the_reference_decode():
    """The 9-instruction decode the W4A8 kernel runs equals the reference decode models bit for bit,
    for every LUT it builds: MXFP4 exponent-shift and exact LUTs (sign by OR) and the NVFP4 hi + lo
    LUTs (lo parts carry their own sign: sign by XOR)."""
    import random
    from kernels_dsl.sm90 import fp4
    rnd = random.Random(5)
    words = [rnd.getrandbits(32) for _ in range(1500)] + [0, 0xFFFFFFFF, 0x88888888, 0x77777777, 0x80000008]
    words += [c << (4 * i) for c in range(16) for i in range(8)]
    luts = [fp4.model_e4m3_lut_shift(d) for d in range(fp4.SHIFT_RANGE[0], fp4.SHIFT_RANGE[1] + 1)]
    luts += [fp4.model_e4m3_lut(d) for d in range(-14, 7)]
    for lo, hi in luts:
        for w in words[::7]:
            assert _mag_sign_model(w, lo, hi) == fp4.model_e2m1x8_to_e4m3x8(w, lo, hi), (hex(w), hex(lo), hex(hi))
    for f in (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 3.0, 0.3125, 0.0390625, 13.0):
        hl, hh, ll, lh = fp4.model_e4m3_hilo_lut(f)
        for w in words[::5]:
            assert _mag_sign_model(w, hl, hh) == fp4.model_e2m1x8_to_e4m3x8(w, hl, hh)
            assert _mag_sign_model(w, ll, lh, xor=True) == fp4.model_e2m1x8_to_e4m3x8(w, ll, lh, sign_xor=True)


def test_dsl_config_heuristic_and_smem_fit():
    from kernels_dsl.sm90 import config as C
    for stage in (1, 2):
        for act in ("fp8", "bf16"):
            for fmt in ("mxfp4", "nvfp4"):
                for m in (1, 16, 64, 65, 4096):
                    for E in (8, 256, 384, 1024):
                        cfg = C.choose(stage=stage, act=act, fmt=fmt, R=E * m, E=E, N=4096, K=4096, max_m=m)
                        assert C.smem_bytes(cfg) <= C.SMEM_OPTIN, cfg
                        assert cfg.stages >= 2 and cfg.tile_m == (64 if m <= 64 else 128)
                        p, c = cfg.regs
                        assert p % 8 == 0 and c % 8 == 0 and 128 * (p + cfg.consumers * c) <= 65536 // cfg.ctas_per_sm * 1
                        assert (p, c) == ((24, 240) if act == "fp8" else (40, 232)), cfg
                        assert act in cfg.explain() and fmt in cfg.explain()
    # the hint decides the tile, not the average: one hot expert among many empty ones
    assert C.choose(stage=1, act="fp8", fmt="mxfp4", R=300, E=256, N=4096, K=4096).tile_m == 64
    assert C.choose(stage=1, act="fp8", fmt="mxfp4", R=300, E=256, N=4096, K=4096, max_m=290).tile_m == 128


def test_gemm_routing_decode_cuda_prefill_dsl():
    """The registry order (dsv4.ops.moe.GEMM_KINDS) asks cuda first; the cuda provider accepts only
    decode-sized groups (moe_decode.cu, measured faster there) and declines prefill with the reason
    that the DSL grouped GEMM is faster; every problem is one the dsl provider supports."""
    from dsv4.registry import get_op
    from dsv4.target import Target
    from kernels_cuda import moe as km
    t = Target("cuda", "sm_90a", "H200", 132, 0)
    assert moe.GEMM_KINDS[:2] == ("cuda", "dsl")
    for name, cls, N, K in (("moe_gemm1_swiglu", km.CudaMoEGemm1, 4096, 4096), ("moe_gemm2", km.CudaMoEGemm2, 4096, 2048)):
        op = get_op(name)
        for act in ("fp8", "bf16"):
            for fmt in ("mxfp4", "nvfp4"):
                for R, decode in ((256 * 4, True), (6 * 64, True), (256 * 16, True), (6 * 4096, False), (256 * 17, False)):
                    p = {"fmt": fmt, "act": act, "E": 256, "N": N, "K": K, "R": R, "max_m": None, "device": "cuda"}
                    s = cls(op).supports_problem(p)
                    assert s.ok == decode, (name, act, fmt, R, s.reason)
                    assert ("moe_decode.cu" in s.reason) if decode else ("DSL grouped GEMM is faster" in s.reason)
                    d = op.check("dsl", p, t)
                    assert d.ok or "not importable" in d.reason, d.reason


def test_dsl_provider_reason_shows_config():
    from dsv4.registry import get_op
    from dsv4.target import Target
    t = Target("cuda", "sm_90a", "H200", 132, 0)
    for name in ("moe_gemm1_swiglu", "moe_gemm2"):
        op = get_op(name)
        s = op.check("dsl", dict(moe._ex_gemm(t), max_m=4), t)
        if "not importable" in s.reason:
            pytest.skip(s.reason)
        assert s.ok and "tile 64x256" in s.reason, s.reason
        assert op.check("dsl", dict(moe._ex_gemm(t), K=4096 + 64), t).ok is False
        cpu = Target("cpu", None, "cpu", 0)
        assert not op.check("dsl", moe._ex_gemm(t), cpu).ok


def test_dsl_compile_check_ptx():
    pytest.importorskip("cutlass.cute")
    import os
    import re
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from kernels_dsl import moe as dm
    v = dm.compile_check(variants=((1, "fp8", "nvfp4", 128), (2, "bf16", "mxfp4", 64)))
    for name, ptx in v.items():
        for pat in dm.PTX_PATTERNS:
            assert re.search(pat, ptx), (name, pat)
        assert not re.search(r"\b(ld|st)\.local\b", ptx) or name.startswith("s1-fp8-nvfp4"), name
    assert len(re.findall(r"wgmma\.mma_async\S*e4m3\.e4m3", v["s1-fp8-nvfp4-m128"])) == 16   # 2 halves x 4 k32 x (hi, lo)
    assert "bf16.bf16" in v["s2-bf16-mxfp4-m64"]
