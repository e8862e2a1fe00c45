"""topk: reference vs an independent oracle (CPU), validation, NVRTC compile checks, and
cuda provider == reference bitwise on the H200 (``-m gpu``)."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4.layout import LayoutError
from dsv4.ops.topk import topk
from dsv4.reference.topk import topk_ref

NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------------
# independent oracle: plain Python, explicit (-score, index) key over the selectable entries
def oracle(logits, lengths, k, starts=None, block_table=None, block_size=0, rows_per_seq=1, num_blocks=None,
           sorted=True):
    x = logits.tolist()
    rows, n = logits.shape
    out_i, out_s = [], []
    for r in range(rows):
        hi = min(max(int(lengths[r]), 0), n)
        lo = 0 if starts is None else min(max(int(starts[r]), 0), hi)
        cand = [(p, x[r][p]) for p in range(lo, hi) if not math.isnan(x[r][p]) and x[r][p] != NEG_INF]
        cand.sort(key=lambda t: (-t[1], t[0]))
        sel = cand[:k]
        if not sorted:                                       # the op's default: ascending position
            sel.sort(key=lambda t: t[0])
        idx = [p for p, _ in sel] + [-1] * (k - len(sel))
        sc = [v for _, v in sel] + [NEG_INF] * (k - len(sel))
        if block_table is not None:
            bt = block_table.tolist()
            def slot(p):
                if p < 0:
                    return -1
                e = bt[r // rows_per_seq][p // block_size]
                v = e * block_size + p % block_size
                bad = e < 0 or (num_blocks is not None and e >= num_blocks) or v > 2 ** 31 - 1
                return -1 if bad else v
            idx = [slot(p) for p in idx]
        out_i.append(idx)
        out_s.append(sc)
    return torch.tensor(out_i, dtype=torch.int32).reshape(rows, k), torch.tensor(out_s, dtype=torch.float32).reshape(rows, k)


def assert_same(got, want):
    gi, gs = got
    wi, ws = want
    assert gi.dtype == torch.int32 and gs.dtype == torch.float32
    assert torch.equal(gi.cpu(), wi.cpu()), f"indices differ:\n{gi}\n{wi}"
    # bitwise (also -0.0 vs +0.0 and the -inf padding)
    assert torch.equal(gs.cpu().view(torch.int32), ws.cpu().view(torch.int32)), f"scores differ:\n{gs}\n{ws}"


def special_cases(gen: torch.Generator):
    """(name, logits, lengths, starts, k) covering ties, constants, -inf, NaN, empty and short rows."""
    cases = []
    n = 300
    r = torch.randn(6, n, generator=gen)
    L = torch.tensor([n, 250, 17, 0, 1, 299], dtype=torch.int32)
    cases.append(("random", r, L, None, 32))
    tied = torch.randint(-3, 4, (5, n), generator=gen).float() * 0.5
    cases.append(("tied", tied, torch.tensor([n, n, 100, 37, 3], dtype=torch.int32), None, 40))
    cases.append(("constant", torch.full((3, n), 1.25), torch.tensor([n, 64, 7], dtype=torch.int32), None, 16))
    neg = torch.full((3, n), NEG_INF)
    neg[1, 10] = -1e30
    neg[2, ::7] = 3.0
    cases.append(("-inf filled", neg, torch.full((3,), n, dtype=torch.int32), None, 64))
    nan = torch.randn(3, n, generator=gen)
    nan[0, ::2] = float("nan")
    nan[1] = float("nan")
    nan[2, :5] = float("inf")
    nan[2, 5:9] = float("nan")
    cases.append(("nan / +inf", nan, torch.full((3,), n, dtype=torch.int32), None, 200))
    zs = torch.tensor([[0.0, -0.0, 1e-45, -1e-45, 0.0, -0.0, 1e-40, -3.4e38, 3.4e38, 0.0]])
    cases.append(("signed zeros / denormals", zs, torch.tensor([10], dtype=torch.int32), None, 10))
    cases.append(("length 0", torch.randn(2, n, generator=gen), torch.zeros(2, dtype=torch.int32), None, 8))
    cases.append(("length < k", torch.randn(3, n, generator=gen), torch.tensor([5, 1, 31], dtype=torch.int32), None, 32))
    cases.append(("lengths clamp", torch.randn(2, 50, generator=gen), torch.tensor([1000, -4], dtype=torch.int32), None, 60))
    cases.append(("k > stride", torch.randn(2, 20, generator=gen), torch.tensor([20, 13], dtype=torch.int32), None, 33))
    pre = torch.randn(4, n, generator=gen)
    cases.append(("prefill starts", pre, torch.tensor([n, 200, 50, 10], dtype=torch.int32),
                  torch.tensor([0, 150, 60, -5], dtype=torch.int32), 24))
    return cases


@pytest.mark.parametrize("i", range(11))
def test_reference_matches_oracle_cases(i):
    name, x, L, S, k = special_cases(torch.Generator().manual_seed(0))[i]
    assert_same(topk_ref(x, L, k, S), oracle(x, L, k, S))
    assert_same(topk_ref(x, L, k, S, sorted=False), oracle(x, L, k, S, sorted=False))


def test_reference_block_table():
    g = torch.Generator().manual_seed(1)
    B, nn, bs, n = 3, 2, 16, 200
    x = torch.randn(B * nn, n, generator=g)
    x[:, ::5] = x[:, 1::5][:, : x[:, ::5].shape[1]]  # ties
    L = torch.tensor([200, 150, 33, 40, 0, 7], dtype=torch.int32)
    bt = torch.randperm(64, generator=g)[: B * 13].reshape(B, 13).int()
    assert_same(topk_ref(x, L, 50, None, bt, bs, nn), oracle(x, L, 50, None, bt, bs, nn))
    # unsorted: ascending LOGICAL position (the order before the mapping)
    assert_same(topk_ref(x, L, 50, None, bt, bs, nn, sorted=False),
                oracle(x, L, 50, None, bt, bs, nn, sorted=False))


def test_block_table_entries_outside_the_cache_map_to_minus_one():
    """Issue 19 item 2: entries outside [0, num_blocks) (and slot ids past 2^31 - 1) give -1, never a
    garbage slot id (before the fix: block 99999 -> 6399977, block -7 -> -401); scores are kept."""
    g = torch.Generator().manual_seed(3)
    bs, nb = 64, 40
    x = torch.randn(2, 256, generator=g)
    L = torch.tensor([256, 256], dtype=torch.int32)
    bt = torch.tensor([[0, 99999, 5, -7], [39, 40, 2 ** 30, 1]], dtype=torch.int32)
    for nbk in (None, nb):
        i, s = topk(x, L, 256, block_table=bt, block_size=bs, num_blocks=nbk, return_scores=True)
        assert_same((i, s), oracle(x, L, 256, None, bt, bs, 1, nbk, sorted=False))
        pos = topk(x, L, 256)                                   # unmapped positions, same order
        blk = pos.long() // bs
        e = bt.long().gather(1, blk)
        bad = (e < 0) | (e * bs + pos.long() % bs > 2 ** 31 - 1)
        if nbk is not None:
            bad |= e >= nbk
        assert torch.equal(i == -1, bad)
        assert not ((i > -1) & bad).any() and bool(bad.any())
        assert torch.equal(s, topk(x, L, 256, return_scores=True)[1])
    # with num_blocks, 99999 / -7 / 40 / 2^30 are out; without, only -7 and 2^30 (slot id > 2^31 - 1)
    i0 = topk(x, L, 256, block_table=bt, block_size=bs)
    i1 = topk(x, L, 256, block_table=bt, block_size=bs, num_blocks=nb)
    assert int((i0 == -1).sum()) == 2 * 64 and int((i1 == -1).sum()) == 4 * 64
    assert 6399977 not in i1.tolist()[0] and -401 not in i0.flatten().tolist()


def test_validation_sorted_and_num_blocks():
    x, L = _ok()
    with pytest.raises(ValueError, match="'sorted'"):
        topk(x, L, 8, sorted=1)
    with pytest.raises(ValueError, match="'num_blocks'"):
        topk(x, L, 8, num_blocks=4)                              # without block_table
    bt = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="'num_blocks'"):
        topk(x, L, 8, block_table=bt, block_size=16, num_blocks=-1)
    i, s = topk(x, L, 8, sorted=False, return_scores=True)       # the default: ascending position
    assert torch.equal(i, topk(x, L, 8)) and bool((i[:, 1:] > i[:, :-1]).all())
    assert_same(topk(x, L, 8, sorted=True, return_scores=True), oracle(x, L, 8))
    assert_same((i, s), oracle(x, L, 8, sorted=False))


def test_public_op_cpu_dispatches_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1000, generator=g)
    L = torch.tensor([1000, 999, 10, 0], dtype=torch.int32)
    i, s = topk(x, L, 64, return_scores=True)
    assert_same((i, s), oracle(x, L, 64, sorted=False))
    assert torch.equal(topk(x, L, 64), i)
    assert_same(topk(x, L, 64, return_scores=True, sorted=True), oracle(x, L, 64))


@st.composite
def problems(draw):
    rows = draw(st.integers(1, 5))
    stride = draw(st.integers(1, 160))
    k = draw(st.integers(1, 70))
    kind = draw(st.sampled_from(["randn", "ties", "specials"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(rows, stride, generator=g)
    elif kind == "ties":
        x = torch.randint(-2, 3, (rows, stride), generator=g).float()
    else:
        pool = torch.tensor([float("nan"), NEG_INF, float("inf"), 0.0, -0.0, 1.0, -1.0, 1e-42])
        x = pool[torch.randint(0, len(pool), (rows, stride), generator=g)]
    lengths = torch.tensor([draw(st.integers(-2, stride + 3)) for _ in range(rows)], dtype=torch.int32)
    starts = None
    if draw(st.booleans()):
        starts = torch.tensor([draw(st.integers(-2, stride + 1)) for _ in range(rows)], dtype=torch.int32)
    return x, lengths, starts, k


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_reference_hypothesis(p):
    x, L, S, k = p
    assert_same(topk_ref(x, L, k, S), oracle(x, L, k, S))
    assert_same(topk_ref(x, L, k, S, sorted=False), oracle(x, L, k, S, sorted=False))


# ---------------------------------------------------------------------------------------------
# validation
def _ok():
    return torch.randn(4, 64), torch.full((4,), 64, dtype=torch.int32)


@pytest.mark.parametrize("k", [0, 2049, -1, True, 3.0])
def test_validation_k(k):
    x, L = _ok()
    with pytest.raises(ValueError, match="'k'"):
        topk(x, L, k)


def test_validation_arguments():
    x, L = _ok()
    with pytest.raises(LayoutError, match="'logits'"):
        topk(x.double(), L, 8)
    with pytest.raises(LayoutError, match="'logits'"):
        topk(x[0], L, 8)
    with pytest.raises(LayoutError, match="'logits'"):
        topk(torch.randn(64, 4).t(), L, 8)            # last dim not unit-stride
    with pytest.raises(LayoutError, match="'lengths'"):
        topk(x, L.long(), 8)
    with pytest.raises(LayoutError, match="'lengths'"):
        topk(x, L[:3], 8)
    with pytest.raises(LayoutError, match="'starts'"):
        topk(x, L, 8, starts=L[:2])
    with pytest.raises(LayoutError, match="'starts'"):
        topk(x, L, 8, starts=L.float())
    bt = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="'block_size'"):
        topk(x, L, 8, block_table=bt)
    with pytest.raises(ValueError, match="'block_size'"):
        topk(x, L, 8, block_size=16)
    with pytest.raises(ValueError, match="'rows_per_seq'"):
        topk(x, L, 8, block_table=bt, block_size=16, rows_per_seq=0)
    with pytest.raises(LayoutError, match="rows_per_seq"):
        topk(x, L, 8, block_table=bt, block_size=16, rows_per_seq=1)   # 2 * 1 != 4 rows
    with pytest.raises(LayoutError, match="cover"):
        topk(x, L, 8, block_table=bt, block_size=8, rows_per_seq=2)    # 4 * 8 < 64
    with pytest.raises(LayoutError, match="'block_table'"):
        topk(x, L, 8, block_table=bt.long(), block_size=16, rows_per_seq=2)
    with pytest.raises(ValueError, match="'return_scores'"):
        topk(x, L, 8, return_scores=1)
    # valid strided view (row stride > stride) is accepted
    big = torch.randn(4, 100)
    assert_same(topk(big[:, :64], L, 8, return_scores=True), oracle(big[:, :64], L, 8, sorted=False))


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(8, 128)
        L = torch.empty(8, dtype=torch.int32)
        i, s = torch.ops.dsv4.topk(x, L, 16, None, None, 0, 1, True, -1)
        assert i.shape == (8, 16) and i.dtype == torch.int32 and s.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# NVRTC compile checks (no GPU needed)
def _ptxas_log(mod) -> str:
    return mod.ptxas_report()[1]


@pytest.mark.parametrize("cluster,threads,vec,res", [(1, 512, 1, 1), (2, 1024, 1, 0), (8, 1024, 0, 1), (4, 256, 1, 0),
                                                     (4, 512, 1, 1), (8, 1024, 1, 1), (16, 512, 1, 1), (2, 1024, 1, 1)])
def test_compile_sm90a(cluster, threads, vec, res):
    from kernels_cuda.nvrtc import load
    from kernels_cuda.topk import CAP
    mod = load("topk.cu", TOPK_CLUSTER=cluster, TOPK_THREADS=threads, TOPK_CAP=CAP, TOPK_VEC=vec, TOPK_RES=res)
    ptx = mod.ptx()
    assert ".entry topk_kernel" in ptx and ".target sm_90a" in ptx
    assert "__local_depot" not in ptx, "local memory array in PTX"
    assert ("ld.global.nc.v4.u32" in ptx) == bool(vec)
    assert "cvt.rn.f16.f32" in ptx and "vote.sync.ballot" in ptx and "shfl.sync" in ptx
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    if cluster > 1:
        assert "barrier.cluster.arrive" in ptx and "mapa.shared::cluster" in ptx
        assert "st.shared::cluster.u64" in ptx  # pass B: direct stores into the leader's buffers
        if res and cluster >= 4:
            # hierarchical merge: scalar gathers of the peers' coarse bins / buckets, slots from the merged
            # counts (no reservation atomic, no reduce-scatter stores)
            assert "ld.shared::cluster.u32" in ptx and "atom.shared::cluster.add" not in ptx
        else:
            # resident 2-CTA tiles: one 64-bit reservation per CTA; streamed slices: a 32-bit reservation per
            # buffer and a copy; the histogram merge: vector loads of every peer's bins (2 / 4 CTAs) or the
            # reduce-scatter's chunk loads and total stores (8 / 16)
            assert ("atom.shared::cluster.add.u64" if res else "atom.shared::cluster.add.u32") in ptx
            assert re.search(r"ld\.shared::cluster\.v[248]\.u32" if cluster < 8 else r"st\.shared::cluster\.u32", ptx)
    log = _ptxas_log(mod)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert m, log
    stack, st, ld = (int(v) for v in m.groups())
    # resident 1024-thread tiles keep 16 values per thread under the 64-register cap: a few spilled bytes;
    # the scalar-load fallback (misaligned rows only) a few more
    assert (stack, st, ld) == (0, 0, 0) or (res and threads == 1024 and st <= 16 and ld <= 16) or (
        not vec and st <= 128 and ld <= 128), log
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    assert regs <= 65536 // max(threads, 1024 if not res else threads), log


def test_default_config_is_shape_adaptive():
    from kernels_cuda.topk import TopkConfig, default_config, fits_resident
    assert default_config(128, 8192, 132) == TopkConfig(1, 512, True)       # short rows: 1 CTA, row in registers
    assert default_config(1, 129280, 132) == TopkConfig(16, 512, True)      # one row: 16-CTA cluster
    assert default_config(8, 129280, 132) == TopkConfig(8, 1024, True)      # 5+ rows: at most 8 CTAs each
    assert default_config(32, 32768, 132) == TopkConfig(2, 1024, True)      # smallest cluster that fits
    assert default_config(64, 65536, 132) == TopkConfig(2, 1024, False)     # long rows, full batch: 2 passes
    assert default_config(64, 131072, 132) == TopkConfig(2, 1024, False)
    assert default_config(4, 3000, 132) == TopkConfig(1, 512, True)
    assert default_config(4, 65536, 132) == TopkConfig(8, 512, True)       # 1-4 rows: 512-thread tiles
    assert default_config(1, 32768, 132) == TopkConfig(4, 512, True)
    assert default_config(8, 32768, 132) == TopkConfig(2, 1024, True)
    assert default_config(1000, 65536, 132) == TopkConfig(1, 512, False)   # many rows: 1 CTA each, 2 per SM
    assert fits_resident(16384, 1, 1024) and not fits_resident(16385, 1, 1024)
    assert "registers" in default_config(1, 129280, 132).explain()


def test_launch_config_clears_vec_for_unaligned_rows():
    from kernels_cuda.topk import TopkConfig, default_config, launch_config
    x = torch.empty(64, 65537)
    assert launch_config(x[:, :65536]) == replace(default_config(64, 65536, 132), vec=False)   # row stride 65537
    assert launch_config(torch.empty(64, 65536)) == default_config(64, 65536, 132)
    assert launch_config(torch.empty(64, 65536), TopkConfig(4, 1024, False), vec=False) == TopkConfig(4, 1024, False, False)
    assert str(TopkConfig(2, 1024, True)) == TopkConfig(2, 1024, True).explain()


def test_problem_is_a_frozen_dataclass():
    from dsv4.ops.topk import OP, TopkProblem
    from dsv4.target import Target
    p = OP.example_problem(Target.of(torch.device("cpu")))
    assert isinstance(p, TopkProblem) and p == TopkProblem(512, False, False, False, "cpu") and hash(p) == hash(
        TopkProblem(512, False, False, False, "cpu"))
    with pytest.raises(Exception):
        p.k = 3


# ---------------------------------------------------------------------------------------------
# GPU: cuda provider == reference, bitwise
#: (cluster, threads, resident): the defaults of the benchmark shapes and their alternatives
CONFIGS = [(1, 512, True), (2, 1024, False), (8, 1024, True), (4, 512, True), (4, 1024, False), (1, 1024, True),
           (2, 1024, True), (4, 256, False), (16, 512, True), (16, 1024, True)]


def _cuda(x, L, k, S=None, bt=None, bs=0, rps=1, cfg=None, **kw):
    """topk_cuda, sorted=True unless told (sorted=False: the op's default order, ascending position)."""
    from kernels_cuda.topk import TopkConfig, fits_resident, topk_cuda
    kw.setdefault("sorted", True)
    if cfg is not None:
        c, t, r = cfg
        kw["config"] = TopkConfig(c, t, r and fits_resident(x.shape[1], c, t))
    out = topk_cuda(x, L, k, S, bt, bs, rps, **kw)
    torch.cuda.synchronize()
    return out


def ref_u(*a, **kw):
    """The reference in the op's default order (sorted=False: ascending position, padding last)."""
    return topk_ref(*a, sorted=False, **kw)


def _gpu_cases():
    g = torch.Generator().manual_seed(0)
    out = [(n, x.cuda(), L.cuda(), None if S is None else S.cuda(), k) for n, x, L, S, k in special_cases(g)]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS)
def test_gpu_special_cases(cfg):
    for name, x, L, S, k in _gpu_cases():
        want = topk_ref(x, L, k, S)
        assert_same(_cuda(x, L, k, S, cfg=cfg), want)
        assert_same(_cuda(x, L, k, S, cfg=cfg, sorted=False), ref_u(x, L, k, S))


def _realistic(rows, n, seed, kind="randn"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "randn":
        x = torch.randn(rows, n, device="cuda", generator=g)
        x[:, torch.randint(0, n, (64,), device="cuda", generator=g)] *= 30.0     # outlier columns
    elif kind == "indexer":   # relu-sum style logits: >= 0, many exact zeros, narrow range
        x = torch.relu(torch.randn(rows, n, 4, device="cuda", generator=g)).sum(-1) * 0.25
    elif kind == "narrow":    # all in one fp16 bucket -> candidate-buffer overflow path
        x = 1.0 + torch.rand(rows, n, device="cuda", generator=g) * 2.0 ** -12
    elif kind == "ties":
        x = torch.randint(0, 7, (rows, n), device="cuda", generator=g).float()
    elif kind == "fewbins":   # a few hundred candidates in the threshold bin: rank path at its limit / radix
        x = torch.randint(0, 40, (rows, n), device="cuda", generator=g).float() * 2.0 ** -6 + 1.0
        x += torch.rand(rows, n, device="cuda", generator=g) * 2.0 ** -14
    else:
        x = torch.full((rows, n), 0.5, device="cuda")
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("rows,n,k", [(64, 65536, 512), (64, 131072, 1024), (1, 129280, 1024), (128, 8192, 512),
                                      (32, 32768, 512), (16, 32768, 2048), (8, 8192, 1), (4, 5000, 777),
                                      (3, 100000, 2048)])
@pytest.mark.parametrize("kind", ["randn", "indexer", "narrow", "ties", "constant", "fewbins"])
def test_gpu_benchmark_sizes(rows, n, k, kind):
    x = _realistic(rows, n, rows * 7 + n, kind)
    g = torch.Generator().manual_seed(n)
    L = torch.randint(n // 2, n + 1, (rows,), generator=g).int().cuda()
    L[0] = n
    want = topk_ref(x, L, k)
    got = _cuda(x, L, k)
    assert_same(got, want)
    assert_same(_cuda(x, L, k, sorted=False), ref_u(x, L, k))
    if kind in ("randn", "ties"):
        ref_vals = torch.topk(torch.where(torch.arange(n, device="cuda")[None] < L[:, None].long(), x,
                                          torch.tensor(float("-inf"), device="cuda")), k, dim=1).values
        assert torch.equal(got[1], ref_vals)


@pytest.mark.gpu
def test_gpu_determinism_runs_and_configs():
    x = _realistic(64, 65536, 3, "ties")
    L = torch.full((64,), 65536, dtype=torch.int32, device="cuda")
    L[::3] = 40000
    base = _cuda(x, L, 512)
    assert_same(base, topk_ref(x, L, 512))
    un = _cuda(x, L, 512, sorted=False)
    assert_same(un, ref_u(x, L, 512))
    for _ in range(10):                                  # set AND order stable run to run, both modes
        assert_same(_cuda(x, L, 512), base)
        assert_same(_cuda(x, L, 512, sorted=False), un)
    for cfg in CONFIGS:                                  # ... and across launch configurations
        assert_same(_cuda(x, L, 512, cfg=cfg), base)
        assert_same(_cuda(x, L, 512, cfg=cfg, sorted=False), un)
    # scalar-load path on a misaligned view (row stride 65537, offset 1 element)
    buf = torch.empty(64, 65537 + 3, device="cuda")
    v = buf[:, 1:65537]
    v.copy_(x)
    assert_same(_cuda(v, L, 512), base)
    assert_same(_cuda(v, L, 512, cfg=(4, 1024, True)), base)
    # candidate-overflow path (bin b0 > TOPK_CAP: leader re-reads the row)
    xc = _realistic(8, 65536, 4, "narrow")
    Lc = torch.full((8,), 65536, dtype=torch.int32, device="cuda")
    want = topk_ref(xc, Lc, 1024)
    for cfg in CONFIGS:
        assert_same(_cuda(xc, Lc, 1024, cfg=cfg), want)
        assert_same(_cuda(xc, Lc, 1024, cfg=cfg, sorted=False), ref_u(xc, Lc, 1024))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(1, 512, True), (4, 512, False), (2, 1024, True)])
def test_gpu_prefill_and_block_table(cfg):
    g = torch.Generator().manual_seed(5)
    B, nn, n, bs = 8, 4, 20000, 64
    x = _realistic(B * nn, n, 11, "randn")
    x[:, 1000:1100] = 7.0  # ties inside ranges
    L = torch.randint(0, n + 1, (B * nn,), generator=g).int()
    S = (L.float() * torch.rand(B * nn, generator=g)).int() - 3
    L, S = L.cuda(), S.cuda()
    mb = -(-n // bs)
    bt = torch.stack([torch.randperm(4 * mb, generator=g)[:mb] for _ in range(B)]).int()
    bt[0, 3], bt[1, 5], bt[2, 17], bt[3, 0] = -1, 4 * mb, 2 ** 30, -5      # entries outside the cache
    bt = bt.cuda()
    for k in (512, 2048, 100):
        for nbk in (None, 4 * mb):
            want = topk_ref(x, L, k, S, bt, bs, nn, num_blocks=nbk)
            assert_same(_cuda(x, L, k, S, bt, bs, nn, cfg=cfg, num_blocks=nbk), want)
            assert_same(_cuda(x, L, k, S, bt, bs, nn, cfg=cfg, num_blocks=nbk, sorted=False),
                        ref_u(x, L, k, S, bt, bs, nn, num_blocks=nbk))
        assert_same(_cuda(x, L, k, None, bt, bs, nn, cfg=cfg), topk_ref(x, L, k, None, bt, bs, nn))
    # public op dispatches the cuda provider
    from dsv4 import registry
    with registry.use(topk="cuda"):
        i, s = topk(x, L, 512, starts=S, block_table=bt, block_size=bs, rows_per_seq=nn, return_scores=True,
                    num_blocks=4 * mb, sorted=True)
        iu, su = topk(x, L, 512, starts=S, block_table=bt, block_size=bs, rows_per_seq=nn, return_scores=True,
                      num_blocks=4 * mb)
    from kernels_cuda.topk import launch_config
    ch = registry.last_choice("topk")                       # the launch configuration of the last call
    assert ch.kind == "cuda" and ch.config == launch_config(x) and f"config: {ch.config.explain()}" in ch.explain()
    want = topk_ref(x, L, 512, S, bt, bs, nn, num_blocks=4 * mb)
    assert_same((i, s), want)
    assert_same((iu, su), ref_u(x, L, 512, S, bt, bs, nn, num_blocks=4 * mb))
    assert bool((i == -1).any())


@pytest.mark.gpu
def test_gpu_cuda_graph():
    from dsv4 import registry
    x = _realistic(64, 65536, 9, "randn")
    L = torch.full((64,), 65536, dtype=torch.int32, device="cuda")
    with registry.use(topk="cuda"):
        topk(x, L, 512)  # compile + smem attribute outside capture
        topk(x, L, 512, sorted=True)
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            i, s = topk(x, L, 512, return_scores=True, sorted=True)
            iu, su = topk(x, L, 512, return_scores=True)
    for seed in range(3):
        x.copy_(_realistic(64, 65536, 100 + seed, "indexer"))
        L.copy_(torch.randint(0, 65537, (64,), device="cuda").int())
        gr.replay()
        torch.cuda.synchronize()
        assert_same((i, s), topk_ref(x, L, 512))
        assert_same((iu, su), ref_u(x, L, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [(1, 512, True), (2, 1024, False), (16, 512, True)])
def test_gpu_pdl_launch(cfg):
    """Programmatic dependent launch (``pdl=True``): the kernel waits for the preceding grid before its first
    global access, so in a CUDA graph where a plain kernel rewrites the logits before every top-k and PDL top-k
    launches follow each other, every result is the reference's, bitwise (and on an eager stream)."""
    from kernels_cuda.topk import TopkConfig, fits_resident, topk_cuda
    rows, n, k = {1: (128, 8192, 512), 2: (64, 65536, 512), 16: (1, 129280, 1024)}[cfg[0]]
    c = TopkConfig(cfg[0], cfg[1], cfg[2] and fits_resident(n, cfg[0], cfg[1]))
    L = torch.full((rows,), n, dtype=torch.int32, device="cuda")
    L[::2] = n - 1001
    srcs = [_realistic(rows, n, 30 + i, kind) for i, kind in enumerate(("randn", "indexer", "ties"))]
    x = srcs[0].clone()
    for pdl in (True, False):                                                # eager stream (and compiled)
        assert_same(topk_cuda(x, L, k, config=c, pdl=pdl), ref_u(x, L, k))
        assert_same(topk_cuda(x, L, k, config=c, pdl=pdl, sorted=True), topk_ref(x, L, k))
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    outs = []
    with torch.cuda.graph(gr):
        for s in srcs:
            x.copy_(s)                                   # the producer of the logits: a plain kernel
            outs.append(topk_cuda(x, L, k, config=c, pdl=True))
            outs.append(topk_cuda(x, L, k, config=c, pdl=True, sorted=True))
    x.zero_()
    for _ in range(2):
        gr.replay()
        torch.cuda.synchronize()
        for i, s in enumerate(srcs):
            assert_same(outs[2 * i], ref_u(s, L, k))
            assert_same(outs[2 * i + 1], topk_ref(s, L, k))
        for o in outs:
            o[0].fill_(-7)
