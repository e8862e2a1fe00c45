"""Tests of the MoE layer glue ops: ``moe_route``, ``moe_permute``, ``moe_combine``.

CPU: the torch references against independent loop oracles (stable counting-sort order, masked
drops, dropped out-of-range ids, FP8 bytes = ``dsv4.formats.quantize_fp8_block``, slot-order sum
vs fp64), the bad-input contract end to end (no error, dropped assignments, ``debug_check``
raises), registry wiring, the launch heuristic, and CPU compile checks of every CuTe DSL kernel
(PTX patterns).
GPU (@pytest.mark.gpu): the CuTe DSL kernels against the torch references bit for bit (sort
order, FP8 bytes, scales, weights, combine sums), at DSV4 shapes and edge sizes, bad ids on the
device (the context survives), CUDA-graph capture of the whole glue, and bad expert ids / positions /
grouping metadata through every provider of every MoE op in a child process (a device fault there
cannot take the test process with it).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4 import registry
from dsv4.formats import quantize_fp8_block
from dsv4.ops import moe
from dsv4.reference.moe import combine_ref, moe_layer_ref, route_ref


def _loop_permute(idx, E, layout, max_m):
    """Independent oracle: Python loops over the assignments in order."""
    flat = idx.reshape(-1).tolist()
    n = len(flat)
    counts = [0] * E
    rank = []
    for e in flat:
        if 0 <= e < E:
            rank.append(counts[e])
            counts[e] += 1
        else:
            rank.append(-1)
    if layout == "contiguous":
        start = [sum(counts[:e]) for e in range(E)]
        pos = [start[e] + r if r >= 0 else -1 for e, r in zip(flat, rank)]
        return start, counts, pos, n
    pos = [e * max_m + r if 0 <= r < max_m else -1 for e, r in zip(flat, rank)]
    return [e * max_m for e in range(E)], [min(c, max_m) for c in counts], pos, E * max_m


def _x(T, D, seed=0, dtype=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    x[:, torch.randperm(D, generator=g)[: max(1, D // 64)]] *= 30.0
    if T > 2:
        x[1, :128] = 0.0                        # amax floor block
        x[2, 5] = float("nan")                  # NaN -> canonical 0x7F, block amax over finite values
        x[2, 300 % D] = float("inf")
    return x.to(dtype).to(device)


def _check_grouped(g, x, idx, w, E, act, layout, max_m):
    start, counts, pos, R = _loop_permute(idx, E, layout, max_m)
    assert g.row_start.tolist() == start and g.row_count.tolist() == counts
    assert g.pos.tolist() == pos
    assert g.a.shape[0] == R and g.route_w.shape[0] == R
    k = idx.shape[1]
    if act == "fp8":
        q, s = quantize_fp8_block(x, 128, "ue8m0")
    wf = w.reshape(-1).float()
    for i, p in enumerate(pos):
        if p < 0:
            continue
        t = i // k
        if act == "fp8":
            assert torch.equal(g.a[p].view(torch.uint8), q[t].view(torch.uint8)), (i, p)
            assert torch.equal(g.a_s[p], s[t])
        else:
            assert torch.equal(g.a[p].view(torch.int16), x[t].to(torch.bfloat16).view(torch.int16))
        assert g.route_w[p].item() == wf[i].item()


# ------------------------------------------------------------------------------------- permute (CPU)
@pytest.mark.parametrize("act", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_permute_reference_matches_loop_oracle(act, layout):
    T, D, E, k = 23, 256, 7, 3
    x = _x(T, D)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    idx[:, 0] = 2                                # hot expert: masked drops past max_m
    w = torch.rand(T, k, generator=g)
    gr = moe.moe_permute(x, idx, w, E, act=act, layout=layout, max_m=5)
    _check_grouped(gr, x, idx, w, E, act, layout, 5)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 40), E=st.integers(1, 12), k=st.integers(1, 6), layout=st.sampled_from(["contiguous", "masked"]),
       max_m=st.integers(1, 8), bad=st.booleans(), seed=st.integers(0, 10 ** 6))
def test_permute_hypothesis_order_counts_drops(T, E, k, layout, max_m, bad, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-3, E + 3) if bad else (0, E)
    idx = torch.randint(lo, hi, (T, k), generator=g, dtype=torch.int64)
    x = _x(T, 128, seed)
    w = torch.rand(T, k, generator=g)
    gr = moe.moe_permute(x, idx, w, E, act="fp8", layout=layout, max_m=max_m)
    _check_grouped(gr, x, idx, w, E, "fp8", layout, max_m)


def test_permute_empty_tokens():
    x = torch.empty(0, 256, dtype=torch.bfloat16)
    idx = torch.empty(0, 6, dtype=torch.int32)
    g = moe.moe_permute(x, idx, torch.empty(0, 6), 5)
    assert g.a.shape == (0, 256) and g.row_count.tolist() == [0] * 5 and g.pos.numel() == 0
    gm = moe.moe_permute(x, idx, torch.empty(0, 6), 5, layout="masked", max_m=3)
    assert gm.row_start.tolist() == [0, 3, 6, 9, 12] and gm.a.shape == (15, 256)


# ------------------------------------------------------------------------------------- combine (CPU)
def test_combine_reference_slot_order_and_fp64_bound():
    g = torch.Generator().manual_seed(4)
    T, k, D, R = 17, 6, 64, 120
    y = torch.randn(R, D, generator=g) * torch.exp(torch.randn(R, 1, generator=g) * 3)
    pos = torch.randint(-1, R, (T * k,), generator=g)
    pos[5] = R + 7                               # out of range: adds nothing (never faults)
    pos[6] = -9
    out = moe.moe_combine(y, pos, T, k)
    want = torch.zeros(T, D)
    for t in range(T):
        acc = torch.zeros(D)
        for j in range(k):
            p = int(pos[t * k + j])
            acc = acc + (y[p] if 0 <= p < R else torch.zeros(D))
        want[t] = acc
    assert torch.equal(out, want)                # the slot-order fp32 sum, bit for bit
    ok = (pos >= 0) & (pos < R)
    f64 = torch.where(ok[:, None], y.double()[pos.clamp(0, R - 1)], 0).view(T, k, D).sum(1)
    bound = 4 * k * torch.finfo(torch.float32).eps * y.double().abs()[pos.clamp(0, R - 1)].view(T, k, D).sum(1) + 1e-30
    assert bool(((out.double() - f64).abs() <= bound).all())
    assert torch.equal(moe.moe_combine(y, pos, T, k, out_dtype=torch.bfloat16), want.to(torch.bfloat16))


def test_combine_out_dtype_checked():
    y, pos = torch.zeros(4, 8), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="out_dtype"):
        moe.moe_combine(y, pos, 2, 2, out_dtype=torch.int32)


# ------------------------------------------------------------------------------------- route (CPU)
def test_route_ties_lower_expert_id_first():
    """Equal selection scores (e.g. zero-padded tokens, no bias): lower expert id first, as the
    moe_route docstring promises (torch.topk does not)."""
    import torch
    from dsv4.ops.moe import moe_route
    with registry.use(moe_route="torch"):
        idx, w = moe_route(torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16),
                           topk=6)
        assert idx.tolist() == [[0, 1, 2, 3, 4, 5]] * 2
        gw = torch.zeros(8, 16)
        gw[5] = 1.0                         # expert 5 wins, then the tie among the rest: 0, 1
        idx, _ = moe_route(torch.ones(1, 16), gw, topk=3)
        assert idx.tolist() == [[5, 0, 1]]


def test_route_hash_bad_ids_are_dropped_slots():
    T, D, E, k, V = 6, 64, 10, 4, 9
    g = torch.Generator().manual_seed(7)
    x, gw = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]).to(torch.int32)
    tid2eid[1, 2] = E + 5                        # bad expert id
    tid2eid[2, 0] = -1
    ids = torch.tensor([0, 1, 2, V + 3, -2, 4])  # bad token ids (rows 3, 4)
    idx, w = moe.moe_route(x, gw, topk=k, input_ids=ids, tid2eid=tid2eid)
    assert idx[1, 2] == -1 and w[1, 2] == 0 and idx[2, 0] == -1 and w[2, 0] == 0
    assert bool((idx[3:5] == -1).all()) and bool((w[3:5] == 0).all())
    assert torch.equal(idx[0], tid2eid[0]) and torch.equal(idx[5], tid2eid[4])
    for t in (0, 1, 2, 5):
        assert abs(w[t].sum().item() - 1.5) < 1e-5  # normalized over the valid slots
    with pytest.raises(ValueError, match="tid2eid"):
        moe.moe_route(x, gw, topk=k, input_ids=ids.clamp(0, V - 1), tid2eid=tid2eid, debug_check=True)
    with pytest.raises(ValueError, match="input_ids"):
        moe.moe_route(x, gw, topk=k, input_ids=ids, tid2eid=tid2eid.clamp(0, E - 1), debug_check=True)


def test_route_weights_slot_order_sum():
    g = torch.Generator().manual_seed(8)
    x, gw, b = torch.randn(33, 128, generator=g), torch.randn(16, 128, generator=g) * 0.3, torch.randn(16, generator=g)
    idx, w = route_ref(x, gw, b, None, None, 6, 2.5)
    s = torch.sqrt(torch.nn.functional.softplus(x @ gw.t()))
    assert torch.equal(idx.long(), (s + b).topk(6, dim=-1).indices)
    ws = s.gather(1, idx.long())
    tot = ws[:, 0] + ws[:, 1] + ws[:, 2] + ws[:, 3] + ws[:, 4] + ws[:, 5]
    assert torch.equal(w, ws / tot[:, None] * 2.5)


# ------------------------------------------------------------------------------------- bad input end to end (CPU)
def _small_weights(E, D, I, seed=0):
    from dsv4.formats import quantize_mxfp4
    g = torch.Generator().manual_seed(seed)
    a13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * 0.02)
    a2, s2 = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.02)
    return dict(w13=a13, w13_scale=s13, w2=a2, w2_scale=s2)


def test_experts_out_of_range_ids_contribute_nothing():
    E, D, I, T, k = 5, 256, 128, 12, 3
    ck = _small_weights(E, D, I)
    W = moe.moe_prepare_weights(ck["w13"], ck["w13_scale"], ck["w2"], ck["w2_scale"], fmt="mxfp4")
    x = _x(T, D, 1).nan_to_num(0.0, 0.0, 0.0)
    g = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=g) + 0.1
    bad = idx.clone()
    bad[0, 1], bad[3, 0], bad[7, 2] = E, -1, 1 << 30
    for layout in ("contiguous", "masked"):
        out = moe.moe_experts(x, bad, w, W, layout=layout, max_m=T)
        keep = w.clone()
        keep[0, 1] = keep[3, 0] = keep[7, 2] = 0.0
        ref = moe_layer_ref(x, ck["w13"], ck["w13_scale"], ck["w2"], ck["w2_scale"], fmt="mxfp4",
                            topk_idx=idx, topk_w=keep)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, layout
        with pytest.raises(ValueError, match="topk_idx"):
            moe.moe_experts(x, bad, w, W, layout=layout, max_m=T, debug_check=True)


# ------------------------------------------------------------------------------------- registry / heuristic
@pytest.mark.parametrize("op", ["moe_route", "moe_permute", "moe_combine"])
def test_glue_ops_have_dsl_then_torch_providers(op):
    o = registry.get_op(op)
    assert o.module == "moe_glue" and o.kinds[0] == "dsl"
    from dsv4.target import Target
    cpu = [r for r in o.table(Target.of("cpu")) if r["provider"] == "torch"]
    assert cpu and cpu[0]["ok"]
    spec_md = o.spec.markdown()
    assert "## Outputs" in spec_md


def test_permute_tokens_per_block_bounds():
    from kernels_dsl.moe_glue import PERMUTE_CHUNK, permute_tokens_per_block
    assert permute_tokens_per_block(1, 6, 132) == 1
    assert permute_tokens_per_block(528, 6, 132) == 1
    assert permute_tokens_per_block(4096, 6, 132) == 8
    assert permute_tokens_per_block(10 ** 7, 6, 132) == PERMUTE_CHUNK // 6
    for T in (1, 7, 100, 5000, 16384):
        tpb = permute_tokens_per_block(T, 6, 132)
        assert 1 <= tpb and tpb * 6 <= PERMUTE_CHUNK


def test_dsl_configs_are_frozen_and_explained():
    """moe_route / moe_permute name their launch choices: a frozen config from one heuristic, the per-problem
    part from ``config(problem, target)``, the per-call part (gate GEMM fused or not, tokens per CTA) from
    :func:`route_config` / :func:`permute_config`, which ``run`` uses and records; ``explain()`` shows it."""
    import dataclasses

    from dsv4.target import Target
    pytest.importorskip("cutlass")
    from kernels_dsl import moe_glue as G
    t = Target.of("cpu")
    for op, want in (("moe_route", "8 scores per lane"), ("moe_permute", "expert capacity 256")):
        o = registry.get_op(op)
        p = o.provider("dsl")
        if isinstance(p, registry.Support):
            pytest.skip(f"dsl provider unavailable: {p.reason}")
        cfg = p.config(o.example_problem(t), t)
        assert dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen, (op, cfg)
        ch = registry.Choice("dsl", "sm_90a", config=cfg)
        assert want in ch.explain() and "config: " in ch.explain(), ch.explain()
    # the per-call gate decision: fp32 gate weights from GATE_MIN_T_FP32 tokens fused (64 staged token rows), bf16
    # ones up to GATE_MAX_T_BF16 tokens (16 rows), then cuBLAS
    x = torch.zeros(8, 4096, dtype=torch.bfloat16)
    c32 = G.route_config(256, False, x, torch.zeros(256, 4096, dtype=torch.float32))
    c16 = G.route_config(256, False, x, torch.zeros(256, 4096, dtype=torch.bfloat16))
    assert c32.gate_fused == G.gate_fused(x, torch.zeros(256, 4096)) and (c32.gate_fused, c32.n_part) == (True, 16)
    assert (c32.gate_kc, c32.gate_max_t) == (G.GATE_KC, G.GATE_MAX_T)
    assert (c16.gate_fused, c16.n_part, c16.gate_max_t) == (True, 16, G.GATE_SMALL_T) and "16 token rows" in str(c16)
    cb = G.route_config(256, False, torch.zeros(32, 4096, dtype=torch.bfloat16), torch.zeros(256, 4096,
                                                                                            dtype=torch.bfloat16))
    assert (cb.gate_fused, cb.n_part, cb.n_per_lane) == (False, 1, 8) and "cuBLAS" in cb.explain()
    assert G.route_config(256, True, x, torch.zeros(256, 4096)).n_per_lane == 1
    pc = G.permute_config(384, 6, 4096, 132)
    assert (pc.e_cap, pc.tokens_per_cta) == (512, G.permute_tokens_per_block(4096, 6, 132))
    with pytest.raises(dataclasses.FrozenInstanceError):
        pc.e_cap = 1


def test_dsl_supports_reasons():
    from dsv4.target import Target
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
    perm = registry.get_op("moe_permute")
    p = {"act": "fp8", "layout": "contiguous", "E": 4096, "k": 6, "D": 4096, "device": "cuda"}
    s = perm.check("dsl", p, h200)
    if "importable" in s.reason or "not importable" in s.reason:
        pytest.skip(s.reason)
    assert not s and "E=4096" in s.reason
    assert perm.check("dsl", dict(p, E=384), h200)
    assert not perm.check("dsl", dict(p, E=384), Target.of("cpu"))
    comb = registry.get_op("moe_combine")
    c = {"k": 6, "D": 4096, "y_dtype": "bfloat16", "out_dtype": "float32", "device": "cuda"}
    assert not comb.check("dsl", c, h200) and comb.check("dsl", dict(c, y_dtype="float32"), h200)
    route = registry.get_op("moe_route")
    assert not route.check("dsl", {"topk": 6, "hash": False, "E": 2048, "device": "cuda"}, h200)


# ------------------------------------------------------------------------------------- compile checks (CPU)
@pytest.fixture(scope="module")
def glue_ptx(tmp_path_factory):
    pytest.importorskip("cutlass.cute")
    from kernels_dsl import moe_glue
    return moe_glue.compile_check(str(tmp_path_factory.mktemp("moe_glue_ptx")))


def test_dsl_glue_ptx(glue_ptx):
    for name, ptx in glue_ptx.items():
        assert re.search(r"^\.target\s+sm_90a\b", ptx, re.M), name
        assert "ld.local" not in ptx and "st.local" not in ptx, name          # no spills / local arrays
        assert not re.search(r"\b(mul|add|div|sqrt|fma)\.[a-z.]*ftz", ptx), name
        if name.startswith("permute"):
            assert "match.any.sync.b32" in ptx and "atom.shared" in ptx and "bar.sync" in ptx, name
            assert re.search(r"ld\.global\.nc\.v(4\.b32|2\.b64)", ptx), name    # 16-byte id / activation loads
            if "-fp8-" in name:
                assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "st.global.v2.b32" in ptx, name
            else:
                assert "st.global.v4.b32" in ptx, name
        if name.startswith("route"):
            entries = {m.group(1): m.start() for m in re.finditer(r"^\.visible \.entry (\w+)", ptx, re.MULTILINE)}
            starts = sorted(entries.values()) + [len(ptx)]
            body = {n: ptx[p:starts[starts.index(p) + 1]] for n, p in entries.items()}
            topk = [b for n, b in body.items() if n.startswith("kernel_cutlass_kernel_")]
            gate = [b for n, b in body.items() if n.startswith("kernel_cutlass_gate_kernel_")]
            assert len(topk) == 1 and len(gate) == ("-gate-" in name), (name, list(body))
            topk = topk[0]
            assert "sqrt.rn.f32" in topk and "div.rn.f32" in topk, name              # IEEE sqrt / division
            assert ("shfl.sync.bfly" in topk) == ("hash" not in name), name         # arg-max by shuffles
            if "hash" not in name:   # the 64-bit arg-max key is unsigned (a signed max once ranked 0 = retired first)
                assert "max.u64" in topk and not re.search(r"max\.s64|setp\.[a-z]+\.s64", topk), name
            if gate and "hash" not in name:   # partial logits: 8 partials' loads issued before their adds
                lds = [m.start() for m in re.finditer(r"ld\.global\.b32", topk)]
                assert len(lds) > 8 * 8 and lds[8 * 8] < topk.index("add.f32"), name
            for g in gate:           # fused gate GEMM: 16-byte loads staged as fp32 in smem, SIMT register tiles
                assert "ld.global.nc.v4" in g and "st.shared.v4.b32" in g and "ld.shared.v4" in g, name
                assert "fma.rn.f32" in g and "ld.local" not in g, name
        if name.startswith("combine"):
            assert "ld.global.v4.b32" in ptx, name


# ------------------------------------------------------------------------------------- GPU
def _dsl_or_skip():
    from dsv4.target import Target
    s = registry.get_op("moe_permute").check(
        "dsl", {"act": "fp8", "layout": "contiguous", "E": 256, "k": 6, "D": 4096, "device": "cuda"},
        Target.of("cuda"))
    if not s:
        pytest.skip(s.reason)


def _routing(T, E, k, seed, skew=False, device="cuda", dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    if skew:   # expert 3 is in every token's top-k (the hottest a distinct top-k allows)
        rows = torch.nonzero(~(idx == 3).any(1)).flatten()
        idx[rows, 0] = 3
    return idx.to(dtype).to(device), (torch.rand(T, k, generator=g) + 0.05).to(device)


def _same_grouped(gd, gt):
    assert torch.equal(gd.row_start, gt.row_start) and torch.equal(gd.row_count, gt.row_count)
    assert torch.equal(gd.pos, gt.pos)
    keep = gd.pos[gd.pos >= 0]
    assert torch.equal(gd.a.view(torch.uint8)[keep], gt.a.view(torch.uint8)[keep])
    assert torch.equal(gd.route_w[keep], gt.route_w[keep])
    if gd.a_s is not None:
        assert torch.equal(gd.a_s[keep], gt.a_s[keep])


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,D", [(1, 256, 6, 4096), (4, 256, 6, 4096), (64, 384, 6, 7168), (1000, 256, 6, 4096),
                                     (4096, 256, 6, 4096), (37, 9, 3, 256), (300, 1, 1, 128)])
@pytest.mark.parametrize("act,layout", [("fp8", "contiguous"), ("fp8", "masked"), ("bf16", "contiguous")])
def test_gpu_permute_bit_exact(T, E, k, D, act, layout):
    _dsl_or_skip()
    x = _x(T, D, T, device="cuda")
    idx, w = _routing(T, E, k, T + E, skew=T > 8)
    mm = max(1, T // 3)
    with registry.use(moe_permute="dsl"):
        gd = moe.moe_permute(x, idx, w, E, act=act, layout=layout, max_m=mm)
    with registry.use(moe_permute="torch"):
        gt = moe.moe_permute(x, idx, w, E, act=act, layout=layout, max_m=mm)
    _same_grouped(gd, gt)


@pytest.mark.gpu
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_gpu_permute_dtypes_and_bad_ids(x_dtype, idx_dtype):
    _dsl_or_skip()
    T, E, k, D = 200, 20, 4, 512
    x = _x(T, D, 5, dtype=x_dtype, device="cuda")
    idx, w = _routing(T, E, k, 9, dtype=idx_dtype)
    idx[3, 1], idx[10, 0], idx[11, 3] = -1, E, -(1 << 20)
    for layout in ("contiguous", "masked"):
        with registry.use(moe_permute="dsl"):
            gd = moe.moe_permute(x, idx, w, E, layout=layout, max_m=40)
        with registry.use(moe_permute="torch"):
            gt = moe.moe_permute(x, idx, w, E, layout=layout, max_m=40)
        _same_grouped(gd, gt)
        assert gd.pos[3 * k + 1] == -1 and gd.pos[10 * k] == -1
    torch.cuda.synchronize()                     # the context is alive
    assert torch.ones(1, device="cuda").item() == 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("T,k,D,R", [(1, 6, 4096, 6), (64, 6, 7168, 384), (513, 3, 256, 2000)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_combine_bit_exact(T, k, D, R, out_dtype):
    _dsl_or_skip()
    g = torch.Generator().manual_seed(T)
    y = (torch.randn(R, D, generator=g) * torch.exp(torch.randn(R, 1, generator=g) * 2)).cuda()
    pos = torch.randint(-1, R, (T * k,), generator=g).cuda()
    pos[0] = R + 3
    with registry.use(moe_combine="dsl"):
        out = moe.moe_combine(y, pos, T, k, out_dtype=out_dtype)
    assert torch.equal(out, combine_ref(y, pos, T, k, out_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("E,hash_layer,bias_scale", [(256, False, 0.1), (384, False, 0.1), (256, True, 0.0),
                                                     (7, False, 0.1), (256, False, 3.0), (1000, False, 3.0)])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_gpu_route_matches_reference(E, hash_layer, bias_scale, gate_dtype):
    """fp32 gate weights: the same fp32 GEMM as the reference, then equal ids and (observed) equal
    weights. bf16 gate weights: a bf16 tensor-core GEMM with fp32 output (another fp32 summation
    order): ids equal up to near-ties of the score, weights within 1e-5. bias_scale 3: many
    negative selection scores (the unsigned arg-max key)."""
    _dsl_or_skip()
    T, D, k = 300, 512, 6 if E >= 6 else E
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16).cuda()
    gw = (torch.randn(E, D, generator=g) * 0.05).to(gate_dtype).cuda()
    bias = (torch.randn(E, generator=g) * bias_scale).cuda()
    if hash_layer:
        V = 1000
        tid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]).to(torch.int32)
        tid[5, 2] = E + 1
        ids = torch.randint(0, V, (T,), generator=g)
        ids[:8] = 5
        ids[8] = -4
        kw = dict(input_ids=ids.cuda(), tid2eid=tid.cuda())
    else:
        kw = dict(bias=bias)
    with registry.use(moe_route="dsl"):
        idx_d, w_d = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
    with registry.use(moe_route="torch"):
        idx_t, w_t = moe.moe_route(x, gw, topk=k, route_scale=2.5, **kw)
    assert int(idx_d.min()) >= (-1 if hash_layer else 0) and int(idx_d.max()) < E
    same_idx = (idx_d == idx_t).all(1)
    if not bool(same_idx.all()):   # only near-ties of the selection score may order differently
        s = torch.sqrt(torch.nn.functional.softplus(x.float() @ gw.float().t())) + (0 if hash_layer else bias)
        for t in torch.nonzero(~same_idx).flatten().tolist():
            a, b = s[t, idx_d[t].long()].sort().values, s[t, idx_t[t].long()].sort().values
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (t, idx_d[t], idx_t[t])
    ok = same_idx.unsqueeze(1).expand_as(w_d)
    err = ((w_d - w_t).abs() / w_t.abs().clamp_min(1e-30))[ok].max().item()
    print(f"\n[route dsl] E={E} hash={hash_layer} bias={bias_scale} gate={str(gate_dtype)[6:]}: idx equal "
          f"{int(same_idx.sum())}/{T}, w bit-equal {bool(torch.equal(w_d[ok], w_t[ok]))}, max rel {err:.2e}")
    assert int(same_idx.sum()) >= T - 3
    assert err <= (1e-6 if gate_dtype == torch.float32 else 1e-5)


@pytest.mark.gpu
def test_gpu_glue_graph_capture():
    """route -> permute -> combine (on a fake GEMM2 output) captured once, replayed on new data."""
    _dsl_or_skip()
    T, D, E, k = 64, 4096, 256, 6
    x = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    gw = torch.empty(E, D, device="cuda")

    def run():
        idx, w = moe.moe_route(x, gw, topk=k)
        g = moe.moe_permute(x, idx, w, E)
        y = g.a.float()[:, :D] * g.route_w[:, None]
        return moe.moe_combine(y, g.pos, T, k)

    def refresh(seed):
        gg = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(T, D, generator=gg).to(torch.bfloat16))
        gw.copy_(torch.randn(E, D, generator=gg) * 0.05)

    with registry.use(moe_route="dsl", moe_permute="dsl", moe_combine="dsl"):
        refresh(1)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for seed in (2, 3):
            refresh(seed)
            graph.replay()
            want = run()
            torch.cuda.synchronize()
            assert torch.equal(out, want)


# ------------------------------------------------------------------------------------- bad input on CUDA
def _bad_ids_cases(dev="cuda", glues=("dsl", "torch"), gemms=("cuda", "dsl", "torch"), acts=("fp8", "bf16"),
                   parts=("experts", "route", "combine", "gemm")) -> dict:
    """Every given provider of the MoE ops on ``dev`` with out-of-range expert ids (moe_experts /
    moe_permute), hash-layer ids (moe_route), positions (moe_combine) and grouping metadata (the
    grouped GEMMs), checked by value against the CPU references: ``{case: {"ok", "info"}}``.
    The child-process body of ``test_gpu_bad_expert_ids_every_provider_subprocess`` (and, torch
    only, of the CPU test); ``acts`` / ``parts`` select a subset (GPU jobs split it over processes)."""
    from dsv4.formats import quantize_mxfp4
    res = {}

    def case(name, fn):
        try:
            ok, info = fn()
            res[name] = {"ok": bool(ok), "info": info}
        except Exception as e:  # noqa: BLE001 - report every case
            res[name] = {"ok": False, "info": f"{type(e).__name__}: {str(e)[:300]}"}

    E, D, I, T, k = 6, 256, 128, 24, 3
    g = torch.Generator().manual_seed(3)
    a13, s13 = quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * 0.02)
    a2, s2 = quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.02)
    W = moe.moe_prepare_weights(a13.to(dev), s13.to(dev), a2.to(dev), s2.to(dev), fmt="mxfp4")
    x = _x(T, D, 4).nan_to_num(0.0, 0.0, 0.0)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    bad = idx.clone()
    bad[0, 1], bad[3, 0], bad[7, 2], bad[9, 1] = E, -1, 1 << 30, -(1 << 31)
    keep = w.clone()
    keep[0, 1] = keep[3, 0] = keep[7, 2] = keep[9, 1] = 0.0
    for act in (acts if "experts" in parts else ()):
        ref = moe_layer_ref(x, a13, s13, a2, s2, fmt="mxfp4", act=act, topk_idx=idx, topk_w=keep)
        tol = 1e-2 if act == "fp8" else 3e-3
        for glue in glues:
            for gemm in gemms:
                for layout, idt in (("contiguous", torch.int32), ("masked", torch.int64)):
                    def run(glue=glue, gemm=gemm, layout=layout, idt=idt, act=act, ref=ref, tol=tol):
                        b = bad.to(idt)
                        if idt == torch.int64:
                            b[11, 0] = 1 << 40
                        with registry.use(moe_permute=glue, moe_combine=glue, moe_gemm1_swiglu=gemm, moe_gemm2=gemm):
                            gr = moe.moe_permute(x.to(dev), b.to(dev), w.to(dev), E, act=act, layout=layout, max_m=T)
                            out = moe.moe_experts(x.to(dev), b.to(dev), w.to(dev), W, act=act, layout=layout, max_m=T)
                        kb = keep.clone()
                        if idt == torch.int64:
                            kb[11, 0] = 0.0
                        r = ref if idt == torch.int32 else moe_layer_ref(x, a13, s13, a2, s2, fmt="mxfp4", act=act,
                                                                         topk_idx=idx, topk_w=kb)
                        err = ((out.cpu() - r).norm() / r.norm()).item()
                        nd = int(gr.dropped())
                        want = 4 + (idt == torch.int64)
                        return err < tol and nd == want, f"rel {err:.2e} dropped {nd}/{want}"
                    case(f"experts-{act}-glue_{glue}-gemm_{gemm}-{layout}", run)

    V = 50
    gw = torch.randn(E, D, generator=g) * 0.05
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)])
    tid2eid[4, 1], tid2eid[5, 0] = E, -2
    ids = torch.randint(0, V, (T,), generator=g)
    ids[1], ids[2], ids[6], ids[8] = V, -1, 1 << 40, 4
    ri, rwt = route_ref(x.float(), gw, None, ids, tid2eid, k, 1.5)
    for glue in (glues if "route" in parts else ()):
        def run_route(glue=glue):
            with registry.use(moe_route=glue):
                i2, w2 = moe.moe_route(x.to(dev), gw.to(dev), topk=k, input_ids=ids.to(dev), tid2eid=tid2eid.to(dev))
            ok = torch.equal(i2.cpu(), ri) and torch.allclose(w2.cpu(), rwt, rtol=1e-5, atol=1e-6)
            return ok and bool((ri[[1, 2, 6]] < 0).all()) and int(ri[8, 1]) == -1, f"dropped slots {int((i2 < 0).sum())}"
        case(f"route-hash-{glue}", run_route)

    R = 50
    y = torch.randn(R, D, generator=g)
    pos = torch.randperm(T * k, generator=g) % R
    pos[:6] = torch.tensor([R, R + 7, -5, 1 << 40, -(1 << 40), -1])
    want = combine_ref(y, pos, T, k)
    for glue in (glues if "combine" in parts else ()):
        def run_combine(glue=glue):
            with registry.use(moe_combine=glue):
                out = moe.moe_combine(y.to(dev), pos.to(dev), T, k)
            return torch.equal(out.cpu(), want), f"max diff {(out.cpu() - want).abs().max().item():.2e}"
        case(f"combine-bad-pos-{glue}", run_combine)

    Rg, Eg = 70, 7              # 10 rows per expert on average: the decode kernel's 16-token chunks, as above
    starts = torch.tensor([0, 10, 30, -1, Rg + 7, 5, -5], dtype=torch.int32)
    counts = torch.tensor([10, 20, 10 ** 7, 4, 3, -4, Rg + 10], dtype=torch.int32)
    cst = torch.tensor([0, 10, 30, 0, 0, 0, 0], dtype=torch.int32)
    ccn = torch.tensor([10, 20, Rg - 30, 0, 0, 0, 0], dtype=torch.int32)
    g7 = torch.Generator().manual_seed(7)
    b13, t13 = quantize_mxfp4(torch.randn(Eg, 2 * I, D, generator=g7) * 0.02)
    b2, t2 = quantize_mxfp4(torch.randn(Eg, D, I, generator=g7) * 0.02)
    W7 = moe.moe_prepare_weights(b13.to(dev), t13.to(dev), b2.to(dev), t2.to(dev), fmt="mxfp4")
    xg = _x(Rg, D, 8).nan_to_num(0.0, 0.0, 0.0).to(dev)
    rw = (torch.rand(Rg, generator=g7) + 0.5).to(dev)
    for act in (acts if "gemm" in parts else ()):
        a, a_s = quantize_fp8_block(xg, 128, "ue8m0") if act == "fp8" else (xg, None)
        for prov in gemms:
            def run_gemm(prov=prov, a=a, a_s=a_s):
                outs = []
                for st_, cn_ in ((starts, counts), (cst, ccn)):
                    gg = moe.MoEGrouped(a, a_s, st_.to(dev), cn_.to(dev), rw, torch.arange(Rg, device=dev))
                    with registry.use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
                        h, h_s = moe.moe_gemm1_swiglu(gg, W7)
                        outs.append((h.view(torch.uint8) if h.dtype == torch.float8_e4m3fn else h, moe.moe_gemm2(h, h_s, gg, W7)))
                (hb, yb), (hc, yc) = outs
                return torch.equal(hb, hc) and torch.equal(yb, yc), f"|y| {yc.abs().sum().item():.3g}"
            case(f"gemm-bad-grouping-{act}-{prov}", run_gemm)

    if dev == "cuda":
        torch.cuda.synchronize()
    res["context-alive"] = {"ok": torch.ones(4, device=dev).sum().item() == 4.0, "info": ""}
    return res


def _bad_ids_child():
    print("BADIDS_JSON " + json.dumps(_bad_ids_cases()))


def _report(res, n_cases):
    print("\n".join(f"{'ok  ' if v['ok'] else 'FAIL'} {name}: {v['info']}" for name, v in res.items()))
    failed = {name: v["info"] for name, v in res.items() if not v["ok"]}
    assert len(res) == n_cases and not failed, failed


def test_bad_expert_ids_every_case_cpu():
    """The bad-input cases of the GPU test below through the torch providers on the CPU."""
    _report(_bad_ids_cases("cpu", ("torch",), ("torch",)), 4 + 1 + 1 + 2 + 1)


@pytest.mark.gpu
def test_gpu_bad_expert_ids_every_provider_subprocess():
    """Issue 19 item 3 on CUDA: out-of-range expert ids, hash ids, positions and grouping metadata
    through every provider (dsl / torch glue x cuda / dsl / torch GEMMs) are dropped or clamped as
    documented, by value, and the CUDA context survives; run in a child process so that a device-side
    assert or fault there is a failed test, not a dead test process."""
    _dsl_or_skip()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", "import test_moe_glue as t; t._bad_ids_child()"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"child process died (rc={r.returncode}; a device fault?): {r.stderr[-3000:]}"
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("BADIDS_JSON ")][-1]
    # experts: 2 acts x 2 glues x 3 GEMM providers x 2 layouts; route, combine: 2 glues; GEMMs: 2 acts x 3
    _report(json.loads(line[len("BADIDS_JSON "):]), 24 + 2 + 2 + 6 + 1)
