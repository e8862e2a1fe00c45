"""``indexer_topk_paged`` (dsv4/ops/indexer.py): decode indexer logits + the topk op's selection.

CPU: the torch reference against an independent brute-force selection (python sort of
(-score, position) over the selectable entries, slots mapped by hand), ties by lower position,
-1 padding, invalid pages never selected, [B] vs [B, next_n] lengths, argument checks, registry
reasons. GPU: the DSL provider (logits kernel + topk op) is bitwise the two ops in sequence, recall
>= 99.5% against the exact selection on the same quantized values, ties and short rows,
graph-capturable. (The fused variant -- selection-histogram epilogue + histogram-fed select kernel
-- was measured on par with this path and deleted, issue 15.)
"""
from __future__ import annotations

import pytest
import torch

from dsv4.data import indexer_inputs
from dsv4.layout import LayoutError
from dsv4.ops.indexer import indexer_bytes_per_token, indexer_logits_paged, indexer_topk_paged
from dsv4.ops.topk import topk
from dsv4.reference.indexer import (cache_split, cache_write_ref, dequantize_cache, dequantize_q, paged_logits_ref,
                                    q_quant_ref)
from dsv4.registry import use


def _case(fmt="mxfp4", nn=2, ctx=(300, 5, 130), bs=64, seed=0, dev="cpu", bad_page=False):
    B = len(ctx)
    mb = max(-(-c // bs) for c in ctx)
    d = indexer_inputs(B * nn, sum(ctx), seed=seed)
    nb = B * mb + 2
    g = torch.Generator().manual_seed(seed)
    bt = torch.randperm(nb, generator=g)[: B * mb].reshape(B, mb).to(torch.int32)
    cache = torch.zeros(nb, bs, indexer_bytes_per_token(fmt), dtype=torch.uint8)
    slots = torch.cat([bt[b, torch.arange(c) // bs].long() * bs + torch.arange(c) % bs for b, c in enumerate(ctx)])
    cache_write_ref(cache, d.k, slots, fmt, None, True)
    qd, qs, wo = q_quant_ref(d.q, d.w, fmt, True, None)
    if bad_page:
        bt[0, 1] = -1
    to = (lambda x: x.to(dev))
    return (to(qd.reshape(B, nn, 64, -1)), to(qs.reshape(B, nn, 64, -1)), to(wo), to(cache), to(bt), mb * bs)


def _brute(logits: torch.Tensor, lens: torch.Tensor, bt: torch.Tensor, k: int, bs: int, mapped: bool):
    """Independent selection: python sort by (-score, position) over finite entries s < len."""
    rows, n = logits.shape
    nn = rows // bt.shape[0]
    out = torch.full((rows, k), -1, dtype=torch.int32)
    for r in range(rows):
        L = min(int(lens[r]), n)
        cand = [(-float(logits[r, s]), s) for s in range(L) if torch.isfinite(logits[r, s]) or logits[r, s] > 0]
        cand.sort()
        for j, (_, s) in enumerate(cand[:k]):
            out[r, j] = int(bt[r // nn, s // bs]) * bs + s % bs if mapped else s
    return out


def _ref_logits(qd, qs, wo, cache, lens, bt, max_ctx, fmt):
    B, nn = qd.shape[:2]
    qr = dequantize_q(qd.reshape(B * nn, 64, -1), qs.reshape(B * nn, 64, -1), fmt).reshape(B, nn, 64, 128)
    return paged_logits_ref(qr, wo, dequantize_cache(cache, fmt), lens, bt, max_ctx)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("mapped", [False, True])
def test_reference_matches_brute_force_selection_cpu(fmt, mapped):
    qd, qs, wo, cache, bt, max_ctx = _case(fmt, bad_page=True)
    lens = torch.tensor([300, 5, 130], dtype=torch.int32)            # [B]: both next_n rows see them
    k = 64
    idx, sc = indexer_topk_paged(qd, qs, wo, cache, lens, bt, k, fmt=fmt, map_to_slots=mapped, return_scores=True)
    lens2 = lens[:, None].repeat(1, 2)
    L = _ref_logits(qd, qs, wo, cache, lens2, bt, max_ctx, fmt)
    want = _brute(L, lens2.reshape(-1), bt, k, cache.shape[1], mapped)
    assert torch.equal(idx, want)
    # scores are the selected logits, -inf exactly on padding
    pos = _brute(L, lens2.reshape(-1), bt, k, cache.shape[1], False)
    exp = torch.where(pos >= 0, L.gather(1, pos.clamp(min=0).long()), torch.full(pos.shape, float("-inf")))
    assert torch.equal(sc, exp)
    # row 2-3 (len 5): 5 entries then -1 padding; the bad page (entries 64..127 of sequence 0) never selected
    assert (idx[2:4, 5:] == -1).all() and (idx[2:4, :5] >= 0).all()
    if not mapped:
        assert not ((idx[0:2] >= 64) & (idx[0:2] < 128)).any()


def test_ties_go_to_the_lower_position_and_lengths_per_row_cpu():
    """Identical key bytes at positions 3, 70 and 200 of one sequence: equal logits, selected in
    position order; [B, next_n] lengths cut row 1 before position 200."""
    fmt = "mxfp4"
    qd, qs, wo, cache, bt, max_ctx = _case(fmt, nn=2, ctx=(256,), seed=4)
    bs = cache.shape[1]
    cv, cs = cache_split(cache, fmt)
    slot = lambda s: (int(bt[0, s // bs]), s % bs)            # noqa: E731
    src = slot(3)
    for s in (70, 200):
        b, j = slot(s)
        cv[b, j] = cv[src[0], src[1]]
        cs[b, j] = cs[src[0], src[1]]
    lens = torch.tensor([[256, 150]], dtype=torch.int32)
    idx, sc = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 256, fmt=fmt, return_scores=True)
    for r, present in ((0, [3, 70, 200]), (1, [3, 70])):
        where = [int((idx[r] == p).nonzero()[0, 0]) for p in present]
        assert where == sorted(where)                          # lower position first
        assert len(set(sc[r, where].tolist())) == 1            # a real tie
        assert where == list(range(where[0], where[0] + len(where)))   # adjacent in the order
    assert not (idx[1] >= 150).any() and (idx[1, 150:] == -1).all()


def test_deterministic_and_equal_to_the_two_ops_cpu():
    qd, qs, wo, cache, bt, max_ctx = _case("fp8", nn=1, ctx=(500, 77))
    lens = torch.tensor([500, 77], dtype=torch.int32)
    a = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 100, fmt="fp8", max_ctx=450, map_to_slots=True)
    b = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 100, fmt="fp8", max_ctx=450, map_to_slots=True)
    assert torch.equal(a, b)
    L = indexer_logits_paged(qd, qs, wo, cache, lens, bt, fmt="fp8", max_ctx=450)
    c = topk(L, lens, 100, block_table=bt, block_size=cache.shape[1], rows_per_seq=1, sorted=True)
    assert torch.equal(a, c)


def test_argument_checks_name_the_argument_cpu():
    qd, qs, wo, cache, bt, _ = _case("mxfp4", nn=1, ctx=(64,))
    lens = torch.tensor([64], dtype=torch.int32)
    for bad in (0, 2049, True, 3.0, "8"):
        with pytest.raises(ValueError, match="'k'"):
            indexer_topk_paged(qd, qs, wo, cache, lens, bt, bad)
    with pytest.raises(ValueError, match="map_to_slots"):
        indexer_topk_paged(qd, qs, wo, cache, lens, bt, 8, map_to_slots=1)
    with pytest.raises(LayoutError, match="q_data"):
        indexer_topk_paged(qd[:, 0], qs, wo, cache, lens, bt, 8)
    with pytest.raises(LayoutError, match="context_lens"):
        indexer_topk_paged(qd, qs, wo, cache, lens.long(), bt, 8)
    with pytest.raises(LayoutError, match="max_ctx"):
        indexer_topk_paged(qd, qs, wo, cache, lens, bt, 8, max_ctx=65)
    with pytest.raises(LayoutError):
        indexer_topk_paged(qd, qs, wo[:, :32], cache, lens, bt, 8)


def test_registry_reasons_cpu():
    from dsv4.ops.indexer import TOPK_PAGED_OP
    from dsv4.target import Target
    t = Target("cuda", "sm_90a", "H200", 132, 0)
    p = TOPK_PAGED_OP.provider("dsl")
    if hasattr(p, "ok"):
        pytest.skip(p.reason)
    assert "PagedLogitsKernel" in p.describe and "topk op" in p.describe
    prob = {"fmt": "mxfp4", "next_n": 1, "block_size": 64, "max_ctx": 64, "k": 512, "mapped": False, "device": "cuda"}
    assert p.supports(prob, t) and p.supports({**prob, "fmt": "fp8", "next_n": 4, "mapped": True}, t)
    no = p.supports({**prob, "fmt": "nvfp4"}, t)
    assert not no and "NVFP4" in no.reason
    assert not p.supports({**prob, "block_size": 96}, t)


# =========================================================================================
# GPU
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
def test_gpu_dsl_topk_paged_is_the_two_ops_and_meets_recall(cuda_device, fmt):
    dev = cuda_device
    ctx = (5000, 1, 700, 3333)
    qd, qs, wo, cache, bt, max_ctx = _case(fmt, nn=2, ctx=ctx, seed=3, dev=dev, bad_page=True)
    lens = torch.tensor(ctx, dtype=torch.int32, device=dev)
    with use(indexer_topk_paged="dsl", indexer_logits_paged="dsl"):
        idx, sc = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 512, fmt=fmt, map_to_slots=True, return_scores=True)
        L = indexer_logits_paged(qd, qs, wo, cache, lens, bt, fmt=fmt)
    i2, s2 = topk(L, lens[:, None].repeat(1, 2).reshape(-1), 512, block_table=bt, block_size=64, rows_per_seq=2,
                  return_scores=True, sorted=True)
    assert torch.equal(idx, i2) and torch.equal(sc, s2)
    lens2 = lens[:, None].repeat(1, 2)
    ref = _ref_logits(qd, qs, wo, cache, lens2, bt, max_ctx, fmt)
    with use(topk="torch"):
        want = topk(ref, lens2.reshape(-1), 512, block_table=bt, block_size=64, rows_per_seq=2)
    for r in range(want.shape[0]):
        w_ = want[r][want[r] >= 0]
        g_ = idx[r][idx[r] >= 0]
        assert g_.numel() == w_.numel()
        if w_.numel() >= 16:
            rec = torch.isin(g_, w_).float().mean().item()
            assert rec >= 0.995, (r, rec)
    g = torch.cuda.CUDAGraph()
    with use(indexer_topk_paged="dsl"):
        with torch.cuda.graph(g):
            out = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 512, fmt=fmt, map_to_slots=True)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, idx)


@pytest.mark.gpu
def test_gpu_ties_and_short_rows(cuda_device):
    """All-equal logits (an all-zero cache): the lowest positions win, in order; a row shorter than
    k is padded with -1; bitwise the two ops in sequence."""
    dev = cuda_device
    qd, qs, wo, cache, bt, _ = _case("mxfp4", nn=1, ctx=(3000, 300), seed=5, dev=dev)
    cache.zero_()
    lens = torch.tensor([3000, 300], dtype=torch.int32, device=dev)
    with use(indexer_topk_paged="dsl", indexer_logits_paged="dsl"):
        idx, sc = indexer_topk_paged(qd, qs, wo, cache, lens, bt, 512, fmt="mxfp4", return_scores=True)
        L = indexer_logits_paged(qd, qs, wo, cache, lens, bt, fmt="mxfp4")
    i2, s2 = topk(L, lens, 512, return_scores=True, sorted=True)
    assert torch.equal(idx, i2) and torch.equal(sc, s2)
    assert torch.equal(idx[0].cpu(), torch.arange(512, dtype=torch.int32))
    assert torch.equal(idx[1, :300].cpu(), torch.arange(300, dtype=torch.int32)) and (idx[1, 300:] == -1).all()


@pytest.mark.gpu
def test_gpu_public_op_long_rows_graph(cuda_device):
    """The public op on B=8 x 32768 entries, next_n 1, random lengths: bitwise the two ops in sequence,
    graph capture, the dsl provider chosen."""
    from dsv4.ops.indexer import TOPK_PAGED_OP
    from dsv4.target import Target
    dev = cuda_device
    B, n, bs = 8, 32768, 64
    g = torch.Generator(device=dev).manual_seed(9)
    nb = B * n // bs
    cache = torch.randint(0, 256, (nb, bs, 68), dtype=torch.uint8, device=dev, generator=g)
    cache.view(nb, -1)[:, bs * 64:] = torch.randint(118, 123, (nb, bs * 4), dtype=torch.uint8, device=dev,
                                                    generator=g)
    bt = torch.randperm(nb, device=dev, generator=g).view(B, -1).to(torch.int32)
    qd = torch.randint(0, 256, (B, 1, 64, 64), dtype=torch.uint8, device=dev, generator=g)
    qs = torch.randint(118, 123, (B, 1, 64, 4), dtype=torch.uint8, device=dev, generator=g)
    w = torch.randn(B, 64, device=dev, generator=g)
    lens = torch.randint(1, n + 1, (B,), dtype=torch.int32, device=dev, generator=g)
    with use(indexer_topk_paged="dsl", indexer_logits_paged="dsl"):
        idx, sc = indexer_topk_paged(qd, qs, w, cache, lens, bt, 512, map_to_slots=True, return_scores=True)
        L = indexer_logits_paged(qd, qs, w, cache, lens, bt)
        i2, s2 = topk(L, lens, 512, block_table=bt, block_size=bs, rows_per_seq=1, return_scores=True, sorted=True)
        assert torch.equal(idx, i2) and torch.equal(sc, s2)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = indexer_topk_paged(qd, qs, w, cache, lens, bt, 512, map_to_slots=True)
        gr.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, idx)
    assert TOPK_PAGED_OP.select({"fmt": "mxfp4", "next_n": 1, "block_size": bs, "max_ctx": n, "k": 512,
                                 "mapped": True, "device": "cuda"}, Target.of(dev))[1].kind == "dsl"
