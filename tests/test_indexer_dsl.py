"""Lightning Indexer DSL providers (kernels_dsl/indexer*.py): the precision contract of the FP8
WGMMA path, on the CPU (the fold algebra, against fp64) and on the H200 (the kernels).

Precision contract (dsv4/ops/indexer.py, module docstring), tested here for MXFP4 and FP8
keys, next_n 1..4, decode and prefill:
  (a') max |logit - fp64 reference on the same quantized values| <= 2e-3 x the row's max |logit|,
       -inf exactly where the reference has it;
  (a'') top-k recall >= 99.5% against the exact selection on the same values (rows with >= k
       entries; k = 512, 64 for short rows).
Gates (b) / (c) (recall vs the fp32 path, CSA attention cosine) live in tests/test_indexer.py
and run on whatever provider dispatch picks.

Status on the H200 (issue 13): every decode test below PASSED in GPU job idx-03 (the decode
provider is the registry default for MXFP4 / FP8). The prefill kernel passed the same checks in
jobs idx-11 / idx-12 (case scripts: smoke, 4 packed sequences, recall gate (b), graph capture;
the registry default for MXFP4 keys since then) except FP8 keys through E4M3 operands on short rows
(2.28e-3 x the row max; xfail below). FP8 keys run on the BF16-operand variant (job idx-14) and
NVFP4 keys on it after dequant_fp4 (job lead-38): the dsl provider serves every prefill format, the
CUDA prefill path is deleted. This file's GPU tests passed as such in job lead-39 (docs/status.md).
"""
from __future__ import annotations


import pytest
import torch

from dsv4.data import indexer_inputs
from dsv4.ops.indexer import (indexer_bytes_per_token, indexer_cache_write, indexer_logits_paged,
                              indexer_prefill_ranges, indexer_q_quant)
from dsv4.reference.indexer import (cache_split, dequantize_cache, dequantize_q, dequantize_rows, logits_ref,
                                    paged_logits_ref, q_quant_ref, quantize_rows)
from dsv4.registry import use

DSL_FORMATS = ("mxfp4", "fp8")
ERR_BOUND = 2e-3
RECALL_BOUND = 0.995
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# =========================================================================================
# CPU: the fold of the FP8 path (what the kernels compute, in exact arithmetic)
def fold_mxfp4_rows(vals: torch.Tensor, sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Model of kernels_dsl.indexer_fp8_rows / the decode transform: MXFP4 rows -> (E4M3 values as
    fp64 [rows, 128], fp64 row scale 2^(E - 133)), E4M3 rounding by torch (RNE)."""
    v = vals.to(torch.int32)
    nib = torch.stack((v & 15, v >> 4), -1).reshape(v.shape[0], 128)
    lut = torch.tensor(E2M1 + [-x for x in E2M1], dtype=torch.float64)
    lev = lut[nib.long()]
    e = sf.to(torch.int64)
    E = e.amax(1, keepdim=True)
    f = torch.exp2((e - E + 6).double()).repeat_interleave(32, 1)
    q = (lev * f).float().to(torch.float8_e4m3fn).double()
    return q, torch.exp2((E[:, 0] - 133).double())


def test_fold_model_meets_contract_cpu():
    """The FP8 operands of the MXFP4 path (block scales folded relative to the row maximum) give
    logits within the contract of the exact dequantized reference; exactly equal when every
    block is within 14 binades of its row's largest (the realistic case)."""
    T, S = 24, 700
    d = indexer_inputs(T, S, seed=12)
    qd, qs, wo = q_quant_ref(d.q, d.w, "mxfp4", True)
    kv, ksf = quantize_rows(d.k, "mxfp4", None, True)
    ks = torch.zeros(T, dtype=torch.int32)
    ke = torch.full((T,), S, dtype=torch.int32)
    ref = logits_ref(dequantize_q(qd, qs, "mxfp4"), wo, dequantize_rows(kv, ksf, "mxfp4"), ks, ke)
    q8, qsc = fold_mxfp4_rows(qd.reshape(T * 64, 64), qs.reshape(T * 64, 4))
    k8, ksc = fold_mxfp4_rows(kv, ksf)
    dots = torch.einsum("thd,sd->ths", q8.reshape(T, 64, 128), k8).clamp_min(0)
    got = torch.einsum("ths,th->ts", dots, wo.double() * qsc.reshape(T, 64)) * ksc[None]
    rel = ((got - ref.double()).abs().amax(1) / ref.double().abs().amax(1)).max().item()
    assert rel < 1e-6, rel
    # a row with one block 20 binades below its largest: rounded, still far inside the contract
    kv2, ksf2 = kv.clone(), ksf.clone()
    ksf2[:, 1] = ksf2[:, 0] - 20
    k8b, kscb = fold_mxfp4_rows(kv2, ksf2)
    refb = logits_ref(dequantize_q(qd, qs, "mxfp4"), wo, dequantize_rows(kv2, ksf2, "mxfp4"), ks, ke)
    dots = torch.einsum("thd,sd->ths", q8.reshape(T, 64, 128), k8b).clamp_min(0)
    gotb = torch.einsum("ths,th->ts", dots, wo.double() * qsc.reshape(T, 64)) * kscb[None]
    relb = ((gotb - refb.double()).abs().amax(1) / refb.double().abs().amax(1)).max().item()
    assert relb < 1e-4, relb


def test_dsl_providers_registered_and_nvfp4_reason_cpu():
    from dsv4.ops.indexer import LOGITS_OP, PAGED_OP
    from dsv4.target import Target
    t = Target("cuda", "sm_90a", "H200", 132, 0)
    for op, extra in ((PAGED_OP, {"next_n": 1, "block_size": 64, "max_ctx": 64}), (LOGITS_OP, {})):
        p = op.provider("dsl")
        if hasattr(p, "ok"):
            pytest.skip(p.reason)
        for fmt in DSL_FORMATS + ("nvfp4",):
            s = p.supports({"fmt": fmt, **extra, "device": "cuda"}, t)
            if op is PAGED_OP and fmt == "nvfp4":
                assert not s and "NVFP4" in s.reason, s    # decode: no exact FP8 operand, cuda decodes
            else:
                assert s, (op.name, fmt)
    assert not LOGITS_OP.provider("dsl").supports({"fmt": "mxfp4", "device": "cuda"},
                                                  Target("cuda", "sm_80", "A100", 108, 0))
    p = PAGED_OP.provider("dsl")
    assert not p.supports({"fmt": "mxfp4", "next_n": 5, "block_size": 64, "max_ctx": 64, "device": "cuda"}, t)
    assert not p.supports({"fmt": "mxfp4", "next_n": 1, "block_size": 96, "max_ctx": 64, "device": "cuda"}, t)


def test_prefill_operand_choices_cpu():
    """MXFP4 runs on E4M3 operands only; FP8 keys on BF16 (default, exact) or E4M3; others refused
    by name before anything is launched."""
    pytest.importorskip("cutlass")
    from kernels_dsl.indexer import prefill_logits_dsl
    x = torch.zeros(1, dtype=torch.uint8)
    for fmt, operand in (("mxfp4", "bf16"), ("fp8", "fp16"), ("nvfp4", "e4m3"), ("e2m1", None)):
        with pytest.raises(ValueError, match="fmt" if operand is None else "operand"):
            prefill_logits_dsl(x, x, x, x, x, x, x, fmt=fmt, operand=operand)
    with pytest.raises(ValueError, match="q_global"):
        prefill_logits_dsl(x, x, x, x, x, x, x, fmt="nvfp4")


# =========================================================================================
# GPU
def _contract(got: torch.Tensor, ref: torch.Tensor, lens: torch.Tensor, k: int = 512) -> dict:
    fin = torch.isfinite(ref)
    mask_ok = bool(torch.equal(torch.isfinite(got), fin))
    diff = torch.where(fin, (got.double() - ref.double()).abs(), torch.zeros_like(ref, dtype=torch.float64))
    diff = torch.nan_to_num(diff, nan=float("inf"))
    scale = torch.where(fin, ref.double().abs(), torch.zeros_like(diff)).amax(1).clamp_min(1e-30)
    rel = float((diff.amax(1) / scale).max())
    recalls = []
    for r in range(ref.shape[0]):
        n = int(fin[r].sum())
        kk = min(k, n)
        if kk < 16:
            continue
        a = torch.topk(ref[r], kk).indices
        b = torch.topk(got[r], kk).indices
        m = torch.zeros(ref.shape[1], dtype=torch.bool, device=ref.device)
        m[a] = True
        recalls.append(float(m[b].float().mean()))
    return {"mask_ok": mask_ok, "max_rel_err": rel, "min_recall": min(recalls) if recalls else 1.0}


def _assert_contract(st: dict) -> None:
    assert st["mask_ok"], st
    assert st["max_rel_err"] <= ERR_BOUND, st
    assert st["min_recall"] >= RECALL_BOUND, st


def _paged_case(dev, fmt, nn, ctx, bs=64, seed=0, bad_pages=False):
    B = len(ctx)
    mb = max(-(-c // bs) for c in ctx)
    d = indexer_inputs(B * nn, sum(ctx), seed=seed, device=dev)
    nb = B * mb + 3
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(nb, generator=g)[: B * mb].reshape(B, mb).to(torch.int32).to(dev)
    cache = torch.zeros(nb, bs, indexer_bytes_per_token(fmt), dtype=torch.uint8, device=dev)
    slots = torch.cat([bt[b, torch.arange(c, device=dev) // bs].long() * bs + torch.arange(c, device=dev) % bs
                       for b, c in enumerate(ctx)])
    indexer_cache_write(cache, d.k, slots, fmt=fmt, hadamard=True)
    qd, qs, wo = indexer_q_quant(d.q, d.w, fmt=fmt, hadamard=True)
    lens = torch.tensor([[max(0, c - i) for i in range(nn)] for c in ctx], dtype=torch.int32, device=dev)
    if bad_pages:
        bt[0, min(1, mb - 1)] = -1
        bt[min(1, B - 1), 0] = nb + 7
    return qd.reshape(B, nn, 64, -1), qs.reshape(B, nn, 64, -1), wo, cache, lens, bt, mb * bs


def _paged_ref(qd, qs, wo, cache, lens, bt, max_ctx, fmt):
    B, nn = qd.shape[:2]
    qr = dequantize_q(qd.reshape(B * nn, 64, -1), qs.reshape(B * nn, 64, -1), fmt).reshape(B, nn, 64, 128)
    return paged_logits_ref(qr, wo, dequantize_cache(cache, fmt), lens, bt, max_ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", DSL_FORMATS)
@pytest.mark.parametrize("nn", [1, 2, 3, 4])
def test_gpu_dsl_paged_contract(cuda_device, fmt, nn):
    """Decode: 7 sequences of uneven lengths (1 .. 5000 entries), shuffled pages, one
    irregular row and invalid pages; the DSL kernel vs fp64 on the same quantized values."""
    ctx = [5000, 1, 64, 65, 2049, 700, 3333]
    qd, qs, wo, cache, lens, bt, max_ctx = _paged_case(cuda_device, fmt, nn, ctx, seed=nn, bad_pages=True)
    lens[2, nn - 1] = 17
    with use(indexer_logits_paged="dsl"):
        got = indexer_logits_paged(qd, qs, wo, cache, lens, bt, fmt=fmt)
    st = _contract(got, _paged_ref(qd, qs, wo, cache, lens, bt, max_ctx, fmt), lens)
    print(f"\ndsl paged {fmt} next_n={nn}: {st}")
    _assert_contract(st)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", DSL_FORMATS)
def test_gpu_dsl_paged_block_size_128_and_short_max_ctx(cuda_device, fmt):
    """Pages of 128 entries (two 64-key tiles per page), max_ctx not a multiple of 64, [B]
    context_lens (every next_n row sees the committed entries)."""
    ctx = [3000, 130, 1000]
    qd, qs, wo, cache, lens, bt, _ = _paged_case(cuda_device, fmt, 2, ctx, bs=128, seed=9)
    lens1 = torch.tensor(ctx, dtype=torch.int32, device=cuda_device)
    with use(indexer_logits_paged="dsl"):
        got = indexer_logits_paged(qd, qs, wo, cache, lens1, bt, fmt=fmt, max_ctx=2950)
    ref = _paged_ref(qd, qs, wo, cache, lens1[:, None].repeat(1, 2), bt, 2950, fmt)
    st = _contract(got, ref, lens1)
    _assert_contract(st)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", DSL_FORMATS)
def test_gpu_dsl_paged_onehot_decode_exact(cuda_device, fmt):
    """Seed 000 on the FP8 path: logits[d, s] = K_s[d] exactly for one-hot queries (every E2M1
    byte through the in-kernel fold, or random E4M3 keys with power-of-two scales)."""
    dev = cuda_device
    if fmt == "mxfp4":
        kv = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(4, 64)
        sfb = torch.tensor([127, 100, 150, 127], dtype=torch.uint8)[:, None].repeat(1, 4)
        expect = dequantize_rows(kv, sfb, "mxfp4").double().t()
    else:
        g = torch.Generator().manual_seed(3)
        vals = (torch.randn(4, 128, generator=g) * 8).to(torch.float8_e4m3fn)
        kv = vals.view(torch.uint8)
        sfb = torch.tensor([1.0, 2.0 ** -10, 2.0 ** 10, 0.5])[:, None].contiguous().view(torch.uint8).reshape(4, 4)
        expect = dequantize_rows(kv, sfb, "fp8").double().t()
    q = torch.zeros(128, 64, 128)
    w = torch.zeros(128, 64)
    for dd in range(128):
        q[dd, 0, dd], q[dd, 1, dd], w[dd, 0], w[dd, 1] = 1.0, -1.0, 1.0, -1.0
    qd, qs, wo = q_quant_ref(q.to(torch.bfloat16), w, fmt, False, None)
    ar = torch.arange(128)
    qv = dequantize_q(qd, qs, fmt)[ar, 0, ar].double() * (wo[:, 0].double() if fmt == "fp8" else 1.0)
    expect = expect * qv[:, None]
    vb, sb = (64, 4) if fmt == "mxfp4" else (128, 4)
    cache = torch.zeros(3, 64, vb + sb, dtype=torch.uint8)
    cv, cs = cache_split(cache, fmt)
    cv[1, :4] = kv
    cs[1, :4] = sfb
    bt = torch.ones(128, 1, dtype=torch.int32)
    with use(indexer_logits_paged="dsl"):
        P = indexer_logits_paged(qd.reshape(128, 1, 64, -1).to(dev), qs.reshape(128, 1, 64, -1).to(dev), wo.to(dev),
                                 cache.to(dev), torch.full((128,), 4, dtype=torch.int32, device=dev), bt.to(dev),
                                 fmt=fmt)
    assert torch.equal(P[:, :4].double().cpu(), expect)
    assert torch.isneginf(P[:, 4:]).all()


@pytest.mark.gpu
def test_gpu_dsl_paged_graph_capture(cuda_device):
    qd, qs, wo, cache, lens, bt, _ = _paged_case(cuda_device, "mxfp4", 2, [100, 2000, 2560, 7], seed=5)
    with use(indexer_logits_paged="dsl"):
        eager = indexer_logits_paged(qd, qs, wo, cache, lens, bt)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = indexer_logits_paged(qd, qs, wo, cache, lens, bt)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


#: (fmt, WGMMA operand) of the prefill kernel: MXFP4 folded to E4M3 (validated, jobs idx-11/12), FP8
#: widened to BF16 (the exact FP8-key variant; passes in the GPU regressions, e.g. lead9-02), FP8 as E4M3 (runs,
#: but the FP8 WGMMA's ~14-bit accumulation reached 2.28e-3 x the row max on short rows, job idx-11)
PREFILL_VARIANTS = [("mxfp4", "e4m3"), ("fp8", "bf16"), pytest.param("fp8", "e4m3", marks=pytest.mark.xfail(
    reason="FP8 WGMMA accumulation (K = 128, ~14 bits): 2.28e-3 x the row max on short rows (job idx-11)",
    strict=False))]


def _prefill_case(dev, lens_, seed: int, fmt: str, operand=None, q_global=None, k_global=None):
    """One DSL prefill run: the packed sequences ``lens_`` (causal ranges, ratio 4), quantized
    queries / keys, the logits; ``(L, ks, ke, qd, qs, wo, kv, ksf)``."""
    ks, ke, pos = indexer_prefill_ranges(lens_, device=dev)
    T, S = int(ks.numel()), sum(L // 4 for L in lens_)
    d = indexer_inputs(T, S, seed=seed, q_positions=pos.cpu(), device=dev)
    qd, qs, wo = indexer_q_quant(d.q, d.w, fmt=fmt, hadamard=True, global_scale=q_global)
    kv, ksf = quantize_rows(d.k, fmt, k_global, True)
    from kernels_dsl.indexer import prefill_logits_dsl
    L = prefill_logits_dsl(qd, qs, wo, kv, ksf, ks, ke, fmt=fmt, operand=operand, q_global=q_global,
                           k_global=k_global)
    return L, ks, ke, qd, qs, wo, kv, ksf


def _assert_inf_mask(L: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor) -> None:
    """Every row's logits are finite exactly on its range ``[ks, ke)``."""
    cols = torch.arange(L.shape[1], device=L.device)
    assert torch.equal(torch.isfinite(L), (cols[None] >= ks[:, None]) & (cols[None] < ke[:, None]))


def _sampled_rows(T: int, n: int, tail: int, dev) -> torch.Tensor:
    """``n`` random rows (seed 0) and the last ``tail`` rows of ``T``."""
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.randperm(T, generator=g)[:n].to(dev), torch.arange(max(0, T - tail), T, device=dev)])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,operand", PREFILL_VARIANTS)
def test_gpu_dsl_prefill_contract(cuda_device, fmt, operand):
    """Prefill: 5 packed sequences (24187 queries, 6045 entries), causal ranges; sampled rows vs
    fp64 on the same quantized values; every row's -inf mask."""
    dev = cuda_device
    L, ks, ke, qd, qs, wo, kv, ksf = _prefill_case(dev, [12288, 8192, 2500, 1200, 7], 7, fmt, operand)
    _assert_inf_mask(L, ks, ke)
    rows = _sampled_rows(L.shape[0], 500, 68, dev)
    ref = logits_ref(dequantize_q(qd[rows], qs[rows], fmt), wo[rows], dequantize_rows(kv, ksf, fmt), ks[rows], ke[rows],
                     dtype=torch.float64, chunk=16)
    st = _contract(L[rows], ref, ke[rows] - ks[rows])
    print(f"\ndsl prefill {fmt}/{operand}: {st}")
    _assert_contract(st)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,operand", PREFILL_VARIANTS)
@pytest.mark.parametrize("lens_", [[21], [300, 5, 130]])
def test_gpu_dsl_prefill_short_rows(cuda_device, fmt, operand, lens_):
    """Rows with 0..80 allowed entries (the first queries of each sequence see none), T and S not
    multiples of the tiles; every row vs fp64 on the same quantized values."""
    L, ks, ke, qd, qs, wo, kv, ksf = _prefill_case(cuda_device, lens_, 1, fmt, operand)
    ref = logits_ref(dequantize_q(qd, qs, fmt), wo, dequantize_rows(kv, ksf, fmt), ks, ke, dtype=torch.float64, chunk=16)
    st = _contract(L, ref, ke - ks, k=64)
    print(f"\ndsl prefill short rows {fmt}/{operand} {lens_}: {st}")
    _assert_contract(st)


@pytest.mark.gpu
@pytest.mark.parametrize("lens_", [[300, 5, 130], [12288, 2500, 7]])
def test_gpu_dsl_prefill_nvfp4_bf16(cuda_device, lens_):
    """NVFP4 keys on the BF16-operand prefill kernel (dequant_fp4 to BF16, exact; global scales after
    the head sum): vs fp64 on the same quantized values times q_global * k_global; every row's mask."""
    dev = cuda_device
    gq = torch.tensor([0.37], device=dev)
    gk = torch.tensor([1.9], device=dev)
    L, ks, ke, qd, qs, wo, kv, ksf = _prefill_case(dev, lens_, 5, "nvfp4", q_global=gq, k_global=gk)
    _assert_inf_mask(L, ks, ke)
    rows = _sampled_rows(L.shape[0], 400, 40, dev)
    ref = logits_ref(dequantize_q(qd[rows], qs[rows], "nvfp4", gq), wo[rows], dequantize_rows(kv, ksf, "nvfp4") * gk,
                     ks[rows], ke[rows], dtype=torch.float64, chunk=16)
    st = _contract(L[rows], ref, ke[rows] - ks[rows], k=64)
    print(f"\ndsl prefill nvfp4/bf16 {lens_}: {st}")
    _assert_contract(st)


@pytest.mark.gpu
def test_gpu_fp8_rows_conversion_matches_model(cuda_device):
    from kernels_dsl.indexer_fp8_rows import mxfp4_rows_to_fp8
    d = indexer_inputs(1, 3000, seed=3)
    kv, ksf = quantize_rows(d.k, "mxfp4", None, True)
    ksf[::7, 2] = (ksf[::7, 0].to(torch.int32) - 17).clamp_min(0).to(torch.uint8)   # far-below blocks: rounded
    v8, sc = mxfp4_rows_to_fp8(kv.to(cuda_device), ksf.to(cuda_device))
    want_v, want_s = fold_mxfp4_rows(kv, ksf)
    assert torch.equal(v8.cpu().view(torch.float8_e4m3fn).double(), want_v)
    assert torch.equal(sc.cpu().double(), want_s)


@pytest.mark.gpu
def test_gpu_fp8_rows_pair_one_launch_matches_model(cuda_device):
    """Two row sets of different sizes in one launch (the prefill's q and K), and one row (an empty second set)."""
    from kernels_dsl.indexer_fp8_rows import mxfp4_rows_to_fp8, mxfp4_rows_to_fp8_pair
    sets = []
    for seed, n in ((4, 192), (5, 1001)):
        kv, ksf = quantize_rows(indexer_inputs(1, n, seed=seed).k, "mxfp4", None, True)
        sets.append((kv, ksf))
    got = mxfp4_rows_to_fp8_pair(*(x.to(cuda_device) for x in (*sets[0], *sets[1])))
    for (kv, ksf), (v8, sc) in zip(sets, (got[:2], got[2:])):
        want_v, want_s = fold_mxfp4_rows(kv, ksf)
        assert torch.equal(v8.cpu().view(torch.float8_e4m3fn).double(), want_v)
        assert torch.equal(sc.cpu().double(), want_s)
    kv, ksf = sets[1][0][:1], sets[1][1][:1]
    v8, sc = mxfp4_rows_to_fp8(kv.to(cuda_device), ksf.to(cuda_device))
    want_v, want_s = fold_mxfp4_rows(kv, ksf)
    assert torch.equal(v8.cpu().view(torch.float8_e4m3fn).double(), want_v)
    assert torch.equal(sc.cpu().double(), want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8", "nvfp4"])
def test_gpu_dsl_prefill_graph_capture(cuda_device, fmt):
    """Every prefill format under CUDA-graph capture (FP8: the BF16 widening; NVFP4: dequant_fp4 + the
    global-scale product) replays to the eager result."""
    dev = cuda_device
    ks, ke, pos = indexer_prefill_ranges([4096], device=dev)
    d = indexer_inputs(4096, 1024, seed=2, q_positions=pos.cpu(), device=dev)
    gq = torch.tensor([0.5], device=dev) if fmt == "nvfp4" else None
    gk = torch.tensor([2.0], device=dev) if fmt == "nvfp4" else None
    qd, qs, wo = indexer_q_quant(d.q, d.w, fmt=fmt, global_scale=gq)
    kv, ksf = quantize_rows(d.k, fmt, gk, True)
    from kernels_dsl.indexer import prefill_logits_dsl
    kw = dict(fmt=fmt, q_global=gq, k_global=gk)
    eager = prefill_logits_dsl(qd, qs, wo, kv, ksf, ks, ke, **kw)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = prefill_logits_dsl(qd, qs, wo, kv, ksf, ks, ke, **kw)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
