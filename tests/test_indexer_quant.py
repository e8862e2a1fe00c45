"""CuTe DSL indexer quantizers (kernels_dsl/indexer_quant.py: ``indexer_cache_write`` /
``indexer_q_quant``): PTX of every specialization, the page-division magic and the packed-bf16 MXFP4
encoder's bit model on the CPU; on the GPU bit-exact against ``dsv4/reference/indexer.py`` (every format,
Hadamard or not, int32 / int64 slots with skipped and out-of-range entries, non-finite rows, extreme
magnitudes, both plans and the other geometries, CUDA-graph replay)."""
from __future__ import annotations

import re

import pytest
import torch

from dsv4.data import indexer_inputs
from dsv4.registry import get_op
from dsv4.reference.indexer import FORMATS, cache_write_ref, q_quant_ref

pytest.importorskip("cutlass")


def test_compile_every_specialization_ptx():
    import kernels_dsl.indexer_quant as M
    out = M.compile_check()
    assert set(out) == set(M.CHECK_VARIANTS)
    for name, ptx in out.items():
        for pat in M.PTX_FORBIDDEN:
            assert not re.search(pat, ptx), (name, pat)
        for pat in M.PTX_PATTERNS:
            assert re.search(pat, ptx), (name, pat)
        if "had" in name and "nohad" not in name:
            for pat in M.HADAMARD_PTX:
                assert re.search(pat, ptx), (name, pat)
        assert not re.search(r"\.f64\b", ptx), name     # the rotation contract is fp32 (dsv4.reference.hadamard)


def test_dsl_is_the_only_gpu_provider_at_every_row_class():
    """The dsl quantizers are the default at every row class (the CUDA ones are deleted: the DSL ones matched or beat
    them at every size, job kv9-02) and the plan picks 16 / 8 / 4 lanes by size."""
    import kernels_dsl.indexer_quant as M
    from dsv4 import registry
    from dsv4.ops.indexer import (
        CACHE_WRITE_OP,
        Q_QUANT_OP,
        CacheWriteProblem,
        QQuantProblem,
        row_class,
    )
    assert [row_class(n) for n in (0, 1, 2, 3, 128, 129, 262144)] == [0, 1, 2, 4, 128, 256, 262144]
    for op, mk in ((CACHE_WRITE_OP, lambda r: CacheWriteProblem("mxfp4", True, 64, r, "cuda")),
                   (Q_QUANT_OP, lambda r: QQuantProblem("mxfp4", True, r, "cuda"))):
        p = M.PROVIDERS[op.name](op)
        for r in (1, 64, 128, 4096, 1 << 18):
            assert p.supports_problem(mk(r))
        assert isinstance(registry.get_op(op.name).provider("cuda"), registry.Support)
    assert M.plan(128, 132) == M.PLAN_SMALL and M.plan(16384, 132) == M.PLAN_MID
    assert M.plan(262144, 132, "nvfp4") == M.PLAN_LARGE["nvfp4"]


def _gscale(x, fmt):
    return (x.float().abs().amax() / 2688.0).reshape(1).float() if fmt == "nvfp4" else None


def _specials(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Rows with NaN / +-Inf, tiny and huge magnitudes, zeros, a wide exponent spread (in place)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = x.shape[0]
    x[0, 5] = float("nan")
    x[1, 77] = float("inf")
    x[2, 3] = -float("inf")
    x[3] = 0.0
    x[4] = -0.0
    x[5] *= 1e-38
    x[6] *= 3e37
    sp = torch.exp2(torch.randint(-60, 60, (128,), generator=g).float()).to(x.device)
    x[7] = (x[7].float() * sp).to(x.dtype)
    x[8, :64] = 0.0
    x[n - 1, 127] = float("nan")
    return x


@pytest.fixture
def dsl_quant(monkeypatch):
    import kernels_dsl.indexer_quant as M
    monkeypatch.setitem(M.VALIDATED, "indexer_cache_write", True)
    monkeypatch.setitem(M.VALIDATED, "indexer_q_quant", True)
    return M


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_gpu_cache_write_bit_exact(cuda_device, dsl_quant, fmt, hadamard, slot_dtype):
    d = indexer_inputs(8, 3000 + 7, seed=31, device=cuda_device)
    k = _specials(d.k.clone(), 3)
    g = _gscale(d.k, fmt)
    bs, nb = 64, 60
    N = k.shape[0]
    slots = torch.randperm(nb * bs, device=cuda_device)[:N]
    slots[::13] = -1
    slots[5::97] = nb * bs + 3            # out of range: skipped
    ref = torch.randint(0, 256, (nb, bs, sum(FORMATS[fmt])), dtype=torch.uint8,
                        device=cuda_device)
    got = ref.clone()
    cache_write_ref(ref, k, slots, fmt, g, hadamard)
    dsl_quant.DslCacheWrite(get_op("indexer_cache_write")).run({"fmt": fmt, "hadamard": hadamard}, cache=got, k=k,
                                      slot_mapping=slots.to(slot_dtype), global_scale=g)
    torch.cuda.synchronize()
    assert torch.equal(got, ref), (got != ref).nonzero()[:8].tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("hadamard", [False, True])
def test_gpu_q_quant_bit_exact(cuda_device, dsl_quant, fmt, hadamard):
    d = indexer_inputs(67, 64, seed=32, device=cuda_device)
    q = d.q.clone()
    _specials(q.view(-1, 128), 4)
    gq = _gscale(d.q, fmt)
    qd, qs, wo = dsl_quant.DslQQuant(get_op("indexer_q_quant")).run({"fmt": fmt, "hadamard": hadamard}, q=q, w=d.w, global_scale=gq)
    rq, rs, rw = q_quant_ref(q, d.w, fmt, hadamard, gq)
    assert torch.equal(qd, rq), (qd != rq).nonzero()[:8].tolist()
    assert torch.equal(qs, rs), (qs != rs).nonzero()[:8].tolist()
    assert torch.equal(wo.isnan(), rw.isnan()) and torch.equal(torch.nan_to_num(wo), torch.nan_to_num(rw))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_prefill_sizes_bit_exact(cuda_device, dsl_quant, fmt):
    """Row counts that take the 4-lanes plan (plan) and the 8-lanes one (the 4288 q rows), through the public ops."""
    from dsv4 import registry
    from dsv4.ops.indexer import indexer_cache_write, indexer_q_quant
    assert dsl_quant.plan(40000, 132, fmt) == dsl_quant.PLAN_LARGE[fmt] and dsl_quant.plan(128, 132) == dsl_quant.PLAN_SMALL
    d = indexer_inputs(700, 40000 + 5, seed=34, device=cuda_device)
    k = _specials(d.k.clone(), 5)
    g, gq = _gscale(d.k, fmt), _gscale(d.q, fmt)
    bs, nb = 64, 1000
    slots = torch.randperm(nb * bs, device=cuda_device)[:k.shape[0]]
    slots[::29] = -1
    ref = torch.zeros(nb, bs, sum(FORMATS[fmt]), dtype=torch.uint8, device=cuda_device)
    got = ref.clone()
    cache_write_ref(ref, k, slots, fmt, g, True)
    with registry.use(indexer_cache_write="dsl", indexer_q_quant="dsl"):
        indexer_cache_write(got, k, slots, fmt=fmt, global_scale=g, hadamard=True)
        assert registry.last_choice("indexer_cache_write").kind == "dsl"
        qd, qs, wo = indexer_q_quant(d.q, d.w, fmt=fmt, hadamard=True, global_scale=gq)
    assert torch.equal(got, ref), (got != ref).nonzero()[:8].tolist()
    rq, rs, rw = q_quant_ref(d.q, d.w, fmt, True, gq)
    assert torch.equal(qd, rq) and torch.equal(qs, rs) and torch.equal(wo, rw)


@pytest.mark.gpu
@pytest.mark.parametrize("geom", [{"lanes": 4, "groups": 2}, {"lanes": 8}, {"lanes": 16, "groups": 2},
                                  {"lanes": 4, "bf16_mx": False}, {"lanes": 16, "bf16_mx": False}])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_every_geometry_bit_exact(cuda_device, dsl_quant, monkeypatch, fmt, geom):
    """Geometries the plan does not pick by default (lanes per row, steps per iteration, the fp32 MXFP4 encoder),
    forced through :data:`VARIANT`: bit-exact too (cache write with skipped slots, q quant with non-finite rows)."""
    for k_, v_ in geom.items():
        monkeypatch.setitem(dsl_quant.VARIANT, k_, v_)
    d = indexer_inputs(9, 2001, seed=35, device=cuda_device)
    k = _specials(d.k.clone(), 6)
    g = _gscale(d.k, fmt)
    bs, nb = 64, 40
    slots = torch.randperm(nb * bs, device=cuda_device)[:k.shape[0]]
    slots[::11] = -1
    ref = torch.randint(0, 256, (nb, bs, sum(FORMATS[fmt])), dtype=torch.uint8, device=cuda_device)
    got = ref.clone()
    cache_write_ref(ref, k, slots, fmt, g, True)
    dsl_quant.DslCacheWrite(get_op("indexer_cache_write")).run({"fmt": fmt, "hadamard": True}, cache=got, k=k, slot_mapping=slots, global_scale=g)
    q = d.q.clone()
    _specials(q.view(-1, 128), 7)
    gq = _gscale(d.q, fmt)
    qd, qs, wo = dsl_quant.DslQQuant(get_op("indexer_q_quant")).run({"fmt": fmt, "hadamard": True}, q=q, w=d.w, global_scale=gq)
    torch.cuda.synchronize()
    assert torch.equal(got, ref), (got != ref).nonzero()[:8].tolist()
    rq, rs, rw = q_quant_ref(q, d.w, fmt, True, gq)
    assert torch.equal(qd, rq) and torch.equal(qs, rs)
    assert torch.equal(wo.isnan(), rw.isnan()) and torch.equal(torch.nan_to_num(wo), torch.nan_to_num(rw))


@pytest.mark.gpu
def test_gpu_graph_replay(cuda_device, dsl_quant):
    d = indexer_inputs(16, 4096, seed=33, device=cuda_device)
    bs, nb = 64, 80
    k = d.k.clone()
    slots = torch.randperm(nb * bs, device=cuda_device)[:k.shape[0]]
    cache = torch.zeros(nb, bs, 68, dtype=torch.uint8, device=cuda_device)
    p = dsl_quant.DslCacheWrite(get_op("indexer_cache_write"))
    pq = dsl_quant.DslQQuant(get_op("indexer_q_quant"))
    q = d.q.clone()
    prob = {"fmt": "mxfp4", "hadamard": True}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        p.run(prob, cache=cache, k=k, slot_mapping=slots, global_scale=None)
        pq.run(prob, q=q, w=d.w, global_scale=None)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p.run(prob, cache=cache, k=k, slot_mapping=slots, global_scale=None)
        out = pq.run(prob, q=q, w=d.w, global_scale=None)
    for seed in (1, 2):
        d2 = indexer_inputs(16, 4096, seed=40 + seed, device=cuda_device)
        k.copy_(d2.k)
        q.copy_(d2.q)
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.zeros_like(cache)
        cache_write_ref(ref, k, slots, "mxfp4", None, True)
        assert torch.equal(cache, ref)
        rq, rs, rw = q_quant_ref(q, d.w, "mxfp4", True)
        assert torch.equal(out[0], rq) and torch.equal(out[1], rs) and torch.equal(out[2], rw)


def test_slot_magic_page_division_cpu():
    """The host's magic pair divides every slot < 2^31 exactly (block sizes 1 .. 2^20)."""
    import random

    from kernels_dsl.indexer_quant import slot_magic
    rnd = random.Random(5)
    for bs in [1, 2, 3, 7, 63, 64, 65, 100, 128, 192, 256, 1000, 4096, 65535, 65536, 1 << 20]:
        m, sh = slot_magic(bs)
        assert m < 1 << 32
        for n in [0, 1, bs - 1, bs, bs + 1, (1 << 31) - 1, (1 << 31) - 2] + [rnd.randrange(1 << 31) for _ in range(500)]:
            assert (n * m) >> sh == n // bs, (bs, n)


def test_packed_bf16_mxfp4_encoder_model_cpu():
    """The packed-bf16 MXFP4 E2M1 encoder's bit model equals the fp32 encoder's model (sm90.fp4) on every finite bf16
    value, for the block scale it sets as the block max and for 1..6 binades more (every level, every tie)."""
    import numpy as np

    from kernels_dsl.indexer_quant import model_e2m1x8_pow2_bf16
    from kernels_dsl.sm90.fp4 import model_e2m1x8_encode
    h = np.arange(0x8000, dtype=np.uint32)
    h = h[(h & 0x7F80) != 0x7F80]                                   # finite magnitudes (signs: the shared helper)
    f = (h << 16).view(np.float32).astype(np.float64)
    base = np.where(f > 0, np.ceil(np.log2(np.maximum(f, 2.0 ** -126) / 6.0)), -126).astype(int)
    rnd = np.random.default_rng(3)
    for extra in range(7):
        k = np.clip(base + extra, -126, 126)
        idx = rnd.permutation(len(h))
        for j in range(0, len(idx) - 7, 8):
            sel = idx[j:j + 8]
            kk = int(k[sel].max())                                   # one scale per 8 values: the largest
            words = [int(h[sel[2 * i]]) | (int(h[sel[2 * i + 1]]) << 16) for i in range(4)]
            got = model_e2m1x8_pow2_bf16(words, 127 - kk)
            want = model_e2m1x8_encode(words, 2.0 ** -kk) & 0x77777777
            assert got == want, (hex(got), hex(want), [hex(x) for x in words], kk)
