"""CuTe DSL indexer quantizers (kernels_dsl/indexer_quant.py: ``indexer_cache_write`` /
``indexer_q_quant``): PTX of every specialization on the CPU; on the GPU bit-exact against
``dsv4/reference/indexer.py`` (every format, Hadamard or not, int32 / int64 slots with skipped and
out-of-range entries, non-finite rows, extreme magnitudes, CUDA-graph replay)."""
from __future__ import annotations

import re

import pytest
import torch

from dsv4.data import indexer_inputs
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


def test_default_provider_by_row_class():
    """The dsl provider is the default from MIN_ROWS rows of the problem's row class up (below it the cuda
    provider, measured faster there), and runs at every size when forced."""
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
        lo = M.MIN_ROWS[op.name]
        assert p.supports_problem(mk(max(lo, 1)))
        if lo > 1:
            assert not p.supports_problem(mk(lo // 2))
        with registry.use(**{op.name: "dsl"}):
            assert p.supports_problem(mk(1))


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
    dsl_quant.DslCacheWrite(None).run({"fmt": fmt, "hadamard": hadamard}, cache=got, k=k,
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
    qd, qs, wo = dsl_quant.DslQQuant(None).run({"fmt": fmt, "hadamard": hadamard}, q=q, w=d.w, global_scale=gq)
    rq, rs, rw = q_quant_ref(q, d.w, fmt, hadamard, gq)
    assert torch.equal(qd, rq), (qd != rq).nonzero()[:8].tolist()
    assert torch.equal(qs, rs), (qs != rs).nonzero()[:8].tolist()
    assert torch.equal(wo.isnan(), rw.isnan()) and torch.equal(torch.nan_to_num(wo), torch.nan_to_num(rw))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gpu_prefill_sizes_bit_exact(cuda_device, dsl_quant, fmt):
    """Row counts that take the 16-rows-per-warp plan (plan_groups), through the public ops with the dsl
    provider forced (the cuda one is the default: faster at decode sizes)."""
    from dsv4 import registry
    from dsv4.ops.indexer import indexer_cache_write, indexer_q_quant
    assert dsl_quant.plan_groups(40000, 132) == 4 and dsl_quant.plan_groups(128, 132) == 1
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
def test_gpu_graph_replay(cuda_device, dsl_quant):
    d = indexer_inputs(16, 4096, seed=33, device=cuda_device)
    bs, nb = 64, 80
    k = d.k.clone()
    slots = torch.randperm(nb * bs, device=cuda_device)[:k.shape[0]]
    cache = torch.zeros(nb, bs, 68, dtype=torch.uint8, device=cuda_device)
    p = dsl_quant.DslCacheWrite(None)
    pq = dsl_quant.DslQQuant(None)
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
