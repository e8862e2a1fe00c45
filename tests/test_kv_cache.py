"""kv_cache ops: references vs independent oracles, layouts, hypothesis properties, validation,
NVRTC compile checks (CPU), and kernels vs references at realistic sizes (GPU).

Oracles independent of dsv4.reference.kv_cache:
* token format: ``dsv4.formats.quantize_fp8_block`` (block 64, ue8m0) + byte offsets decoded
  by hand from the raw cache bytes; ``quantize_mxfp4`` for the indexer cache, and the indexer
  colleague's ``cache_write_ref`` for byte compatibility;
* compressor: a literal FP64 transcription of FLASH-REF ``Compressor.forward`` (prefill branch,
  ``overlap_transform``) per sequence;
* Hadamard: the fp64 Sylvester matrix; RoPE: the complex64 multiply of ``apply_rotary_emb``.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4 import registry
from dsv4.formats.fp8 import dequantize_fp8_block, quantize_fp8_block
from dsv4.formats.mxfp4 import quantize_mxfp4
from dsv4.layout import LayoutError
from dsv4.ops.kv_cache import (kv_cache_append, kv_compress_decode, kv_compress_prefill, kv_gather,
                               new_compress_state)
from dsv4.reference import kv_cache as ref
from dsv4.reference.hadamard import hadamard_fwht, hadamard_matrix
from dsv4.reference.rope import apply_rope, precompute_freqs_cis, rope_cos_sin_table

CONFIGS = [(512, 4), (512, 128), (128, 4), (128, 128)]


# ------------------------------------------------------------------------------ helpers
def outlier_kv(n, gen, d=512, dtype=torch.bfloat16):
    """Gaussian rows with a few large outlier channels and one tiny block (amax floor path)."""
    x = torch.randn(n, d, generator=gen) * 2
    x[:, 7] *= 60
    x[:, 300] *= 25
    if d == 512:
        x[:, 128:192] *= 1e-6
    return x.to(dtype)


def make_cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def compress_inputs(lens, d, ratio, gen, device="cpu"):
    coff = 2 if ratio == 4 else 1
    T = sum(lens)
    kv = torch.randn(T, coff * d, generator=gen) * 1.5
    kv[:, 5] *= 30
    score = torch.randn(T, coff * d, generator=gen) * 2
    ape = torch.randn(ratio, coff * d, generator=gen) * 0.5
    w = torch.rand(d, generator=gen) + 0.5
    return [t.to(device) for t in (kv, score, ape, w)]


def new_cache(nb, bs, d, fmt, device="cpu"):
    if fmt == "bf16":
        return torch.zeros(nb, bs, d, dtype=torch.bfloat16, device=device)
    per = ref.TOKEN_BYTES if d == 512 else ref.IDX_TOKEN_BYTES
    return torch.zeros(nb, bs * per, dtype=torch.uint8, device=device)


def read_entries(cache, d, bt, seq, n):
    """Dequantized entries 0..n-1 of sequence ``seq`` (fp32)."""
    _, bs = ref.cache_format(cache, d)
    b = torch.arange(n)
    slots = bt[seq, b // bs].long() * bs + b % bs
    return ref.read_slots(cache, slots.to(cache.device), d).float()


# ------------------------------------------------------------------------------ oracles
def compressor_oracle(kv, score, ape, w, table, ratio, eps=1e-6):
    """FLASH-REF Compressor.forward (start_pos == 0) for one sequence, fp64 pooling; returns
    (pooled fp64 [n, d], final bf16 values [n, d])."""
    seqlen = kv.shape[0]
    d = w.shape[0]
    cutoff = seqlen - seqlen % ratio
    kvd = kv[:cutoff].double().unflatten(0, (-1, ratio))
    sc = score[:cutoff].double().unflatten(0, (-1, ratio)) + ape.double()
    if ratio == 4:  # overlap_transform
        def ot(t, value):
            s = t.shape[0]
            new = t.new_full((s, 2 * ratio, d), value)
            new[:, ratio:] = t[:, :, d:]
            new[1:, :ratio] = t[:-1, :, :d]
            return new
        kvd, sc = ot(kvd, 0.0), ot(sc, float("-inf"))
    pooled = (kvd * sc.softmax(dim=1)).sum(dim=1)
    x = pooled.float().to(torch.bfloat16).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    y = (w * x).to(torch.bfloat16)
    fc = torch.view_as_complex(table.view(-1, 32, 2).contiguous())[: cutoff: ratio]
    z = torch.view_as_complex(y[:, -64:].float().unflatten(-1, (-1, 2)).contiguous()) * fc
    y = torch.cat([y[:, :-64], torch.view_as_real(z).flatten(-2).to(torch.bfloat16)], 1)
    if d == 128:
        H = hadamard_matrix(128)
        y = (y.double() @ H.T * 128 ** -0.5).to(torch.bfloat16)
    return pooled, y


# ------------------------------------------------------------------------------ formats / layout
def test_token_quant_matches_formats_fp8_block():
    gen = torch.Generator().manual_seed(0)
    x = outlier_kv(256, gen)
    data, sf = ref.quant_fp8_ds_mla(x)
    q, s = quantize_fp8_block(x[:, :448], 64, "ue8m0")
    assert torch.equal(data[:, :448], q.view(torch.uint8))
    assert torch.equal(ref.ue8m0_decode(sf[:, :7].contiguous().view(torch.float8_e8m0fnu)), s)
    assert torch.equal(data[:, 448:].contiguous().view(torch.bfloat16), x[:, 448:])  # rope bytes bit-exact
    assert (sf[:, 7] == 0).all()
    fq = ref.fake_quant_fp8_ds_mla(x)
    assert torch.equal(fq[:, :448], dequantize_fp8_block(q, s, 64, torch.bfloat16))
    assert torch.equal(fq[:, 448:], x[:, 448:])


def test_append_byte_offsets_by_hand():
    """Decode one token straight from the raw bytes at the documented offsets."""
    gen = torch.Generator().manual_seed(1)
    nb, bs = 3, 6
    cache = new_cache(nb, bs, 512, "fp8_ds_mla")
    x = outlier_kv(1, gen)
    slot = 2 * bs + 5
    kv_cache_append(cache, x, torch.tensor([slot]))
    flat = cache.reshape(-1)
    base = 2 * bs * 584
    data = flat[base + 5 * 576: base + 6 * 576]
    scales = flat[base + bs * 576 + 5 * 8: base + bs * 576 + 6 * 8]
    q, s = quantize_fp8_block(x[:, :448], 64, "ue8m0")
    assert torch.equal(data[:448], q.view(torch.uint8)[0])
    assert torch.equal(data[448:].view(torch.bfloat16), x[0, 448:])
    assert torch.equal(scales[:7].view(torch.float8_e8m0fnu).float().log2(), s[0].log2())
    assert scales[7] == 0
    assert int(cache.count_nonzero()) == int(data.count_nonzero()) + int(scales.count_nonzero())


def test_indexer_layout_matches_colleague_cache_write_and_formats():
    gen = torch.Generator().manual_seed(2)
    lens = [67, 12]
    kv, score, ape, w = compress_inputs(lens, 128, 4, gen)
    table = rope_cos_sin_table(256)
    cu = make_cu(lens)
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    cache = new_cache(4, 16, 128, "mxfp4")
    kv_compress_prefill(kv, score, ape, w, table, cu, bt, cache)
    pooled, seq, b = ref.compress_pool_ref(kv, score, ape, cu, 4)
    y = ref.compress_finish_ref(pooled, b, 4, w, table)
    # formats oracle
    data, sf = ref.paged_views(cache, 128)
    slots = bt[seq, b // 16].long() * 16 + b % 16
    vq, sq = quantize_mxfp4(y, "dsv4")
    assert torch.equal(data.reshape(-1, 64)[slots], vq)
    assert torch.equal(sf.reshape(-1, 4)[slots], sq.view(torch.uint8))
    # byte compatibility with indexer_cache_write's reference (3-D [nb, bs, 68] view, no rotation)
    idx_ref = pytest.importorskip("dsv4.reference.indexer")
    other = torch.zeros(4, 16, 68, dtype=torch.uint8)
    idx_ref.cache_write_ref(other, y, slots, "mxfp4", None, False)
    assert torch.equal(other.reshape(4, -1), cache)


def test_hadamard_and_rope_references():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen).bfloat16()
    want = x.double() @ hadamard_matrix(128).T * 128 ** -0.5
    torch.testing.assert_close(hadamard_fwht(x).double(), want, rtol=1e-6, atol=1e-6)
    # table == precompute_freqs_cis (YaRN, theta 160000) and apply_rope == complex64 multiply
    tab = rope_cos_sin_table(4096)
    fc = precompute_freqs_cis(64, 4096, 65536, 160000.0, 16.0, 32, 1)
    assert torch.equal(torch.view_as_complex(tab.view(-1, 32, 2).contiguous()), fc)
    pos = torch.randint(0, 4096, (64,), generator=gen)
    y = torch.randn(64, 64, generator=gen).bfloat16()
    got = apply_rope(y, pos, tab)
    z = torch.view_as_real(torch.view_as_complex(y.float().unflatten(-1, (-1, 2)).contiguous()) * fc[pos]).flatten(-2)
    assert torch.equal(got.bfloat16(), z.bfloat16())
    # YaRN actually changes the low frequencies
    plain = rope_cos_sin_table(4096, compressed=False)
    assert not torch.equal(plain, tab)


# ------------------------------------------------------------------------------ append / gather
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bs=st.sampled_from([2, 4, 16, 64]), nb=st.integers(1, 5), n=st.integers(0, 60), seed=st.integers(0, 2 ** 16),
       idx64=st.booleans(), fmt=st.sampled_from(["fp8_ds_mla", "bf16"]))
def test_append_then_gather_roundtrip(bs, nb, n, seed, idx64, fmt):
    gen = torch.Generator().manual_seed(seed)
    n_slots = nb * bs
    n = min(n, n_slots)
    cache = new_cache(nb, bs, 512, fmt)
    x = outlier_kv(n, gen)
    slots = torch.randperm(n_slots, generator=gen)[:n]
    if n:
        slots[torch.rand(n, generator=gen) < 0.2] = -1
    slots = slots.to(torch.int64 if idx64 else torch.int32)
    kv_cache_append(cache, x, slots)
    # read back everything through gather (one request owning all pages, in a shuffled order)
    perm = torch.randperm(nb, generator=gen)
    bt = perm.view(1, -1).to(torch.int32)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(nb)
    logical = (inv[torch.arange(n_slots) // bs] * bs + torch.arange(n_slots) % bs).to(torch.int32)
    g = kv_gather(cache, bt, logical.view(1, -1), lens=torch.tensor([n_slots], dtype=torch.int32))[0]
    written = torch.zeros(n_slots, dtype=torch.bool)
    ok = slots >= 0
    written[slots[ok].long()] = True
    assert torch.equal(g[slots[ok].long()], ref.fake_quant_fp8_ds_mla(x[ok]))
    assert (g[~written] == 0).all()


def test_gather_swa_plus_compressed_invalid_rows_are_zero_and_formats_agree():
    gen = torch.Generator().manual_seed(4)
    nb, bs, B = 8, 16, 3
    caches = {f: (new_cache(nb, bs, 512, f), new_cache(4, 64, 512, f)) for f in ("fp8_ds_mla", "bf16")}
    x = outlier_kv(nb * bs, gen)
    y = outlier_kv(4 * 64, gen)
    for c, s in caches.values():
        kv_cache_append(c, x, torch.arange(nb * bs))
        kv_cache_append(s, y, torch.arange(4 * 64))
    bt = torch.tensor([[5, 2, -1, 9], [0, 1, 3, 4], [7, 6, 5, 4]], dtype=torch.int32)  # -1 and 9 (>= nb) bad
    swa_bt = torch.tensor([[0, 1], [2, -1], [3, 3]], dtype=torch.int32)
    T = 5
    req = torch.tensor([0, 1, 2, 0, 1], dtype=torch.int32)
    idx = torch.randint(-1, 4 * bs + 3, (T, 40), generator=gen, dtype=torch.int32)
    idx[0, :4] = torch.tensor([2 * bs, 3 * bs + 1, 4 * bs, 0])        # page -1, page 9, past table, ok
    swa_idx = torch.randint(-1, 128, (T, 128), generator=gen, dtype=torch.int32)
    swa_idx[2, 0] = 70
    lens = torch.full((B,), 4 * bs, dtype=torch.int32)
    swa_lens = torch.full((B,), 128, dtype=torch.int32)
    out = {f: kv_gather(c, bt, idx, lens=lens, req_idx=req, swa_cache=s, swa_block_table=swa_bt, swa_indices=swa_idx,
                        swa_lens=swa_lens) for f, (c, s) in caches.items()}
    assert out["fp8_ds_mla"].shape == (T, 168, 512)
    assert torch.equal(out["fp8_ds_mla"], out["bf16"])
    o = out["fp8_ds_mla"]
    assert (o[0, 128:131] == 0).all() and (o[0, 131] != 0).any()
    assert torch.equal(o[0, 131], ref.fake_quant_fp8_ds_mla(x[5 * bs: 5 * bs + 1])[0])
    assert (o[:, :128][swa_idx == -1] == 0).all() and (o[:, 128:][idx == -1] == 0).all()
    assert (o[1, :128][swa_idx[1] >= 64] == 0).all()                  # swa page -1
    r = swa_idx[2, 0].item()
    assert torch.equal(o[2, 0], ref.fake_quant_fp8_ds_mla(y[3 * 64 + r % 64: 3 * 64 + r % 64 + 1])[0])


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_gather_never_reads_past_a_requests_length(fmt):
    """Issue 19 item 1: request 0 has 3 compressed entries (page 0) and 5 SWA slots; its block_table
    row is padded with request 1's pages (a real page, as engines pad with 0 / stale ids). Every
    index at or past its length must give a zero row, never request 1's KV."""
    gen = torch.Generator().manual_seed(19)
    bs = 4
    cache, swa = new_cache(4, bs, 512, fmt), new_cache(8, 64, 512, fmt)
    x, y = outlier_kv(4 * bs, gen), outlier_kv(8 * 64, gen)
    kv_cache_append(cache, x, torch.arange(4 * bs))
    kv_cache_append(swa, y, torch.arange(8 * 64))
    bt = torch.tensor([[0, 1, 1], [1, 2, 0]], dtype=torch.int32)      # row 0 padded with request 1's page 1
    swa_bt = torch.tensor([[0, 2], [2, 3]], dtype=torch.int32)         # row 0 col 1 = request 1's page 2
    lens = torch.tensor([3, 8], dtype=torch.int32)
    swa_lens = torch.tensor([5, 128], dtype=torch.int32)
    idx = torch.arange(12, dtype=torch.int32).repeat(2, 1)
    swa_idx = torch.tensor([[0, 4, 5, 63, 64, 100], [0, 4, 5, 63, 64, 100]], dtype=torch.int32)
    o = kv_gather(cache, bt, idx, lens=lens, swa_cache=swa, swa_block_table=swa_bt, swa_indices=swa_idx,
                  swa_lens=swa_lens)
    want_c0 = ref.fake_quant_fp8_ds_mla(x[:3])
    assert torch.equal(o[0, 6:9], want_c0) and (o[0, 9:] == 0).all()
    assert (o[0, :6][torch.tensor([0, 1])] != 0).any(dim=-1).all() and (o[0, 2:6] == 0).all()
    # request 1 reads its own 8 entries (pages 1, 2) and nothing past them
    want_c1 = ref.fake_quant_fp8_ds_mla(torch.cat([x[bs:2 * bs], x[2 * bs:3 * bs]]))
    assert torch.equal(o[1, 6:14], want_c1) and (o[1, 14:] == 0).all()
    assert torch.equal(o[1, :6], ref.fake_quant_fp8_ds_mla(y[torch.tensor([128, 132, 133, 191, 192, 228])]))
    # negative lens = empty; the same on the public op with every provider that runs here
    o2 = kv_gather(cache, bt, idx, lens=torch.tensor([-1, 0], dtype=torch.int32))
    assert (o2 == 0).all()



# ------------------------------------------------------------------------------ compressor
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_compressor_reference_vs_fp64_model_transcription(d, ratio):
    gen = torch.Generator().manual_seed(10 + d + ratio)
    lens = [ratio * 9 + 3, ratio * 4, ratio - 1] if ratio == 4 else [ratio * 2 + 17, ratio + 5]
    kv, score, ape, w = compress_inputs(lens, d, ratio, gen)
    table = rope_cos_sin_table(2048)
    cu = make_cu(lens)
    pooled, seq, b = ref.compress_pool_ref(kv, score, ape, cu, ratio)
    pooled64, _, _ = ref.compress_pool_ref(kv, score, ape, cu, ratio, dtype=torch.float64)
    y = ref.compress_finish_ref(pooled, b, ratio, w, table)
    off = 0
    for i, L in enumerate(lens):
        n = L // ratio
        p_or, y_or = compressor_oracle(kv[cu[i]:cu[i + 1]], score[cu[i]:cu[i + 1]], ape, w, table, ratio)
        assert p_or.shape[0] == n
        torch.testing.assert_close(pooled64[off:off + n], p_or, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pooled[off:off + n].double(), p_or, rtol=2e-6, atol=2e-6)
        # final values: bf16; the oracle uses rsqrt / complex multiply / fp64 Hadamard
        diff = (y[off:off + n].float() - y_or.float()).abs()
        tol = 1.6e-2 * y_or.float().abs() + 1e-3
        assert (diff <= tol).all(), f"max excess {(diff - tol).max()}"
        if n:
            assert (y[off:off + n] == y_or).float().mean() > 0.97
        off += n
    assert off == seq.numel()


@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_compressor_cache_contents_dequantize_to_reference(d, ratio):
    gen = torch.Generator().manual_seed(20 + d + ratio)
    lens = [ratio * 5 + 1, ratio * 3]
    kv, score, ape, w = compress_inputs(lens, d, ratio, gen)
    table = rope_cos_sin_table(1024)
    cu = make_cu(lens)
    bt = torch.tensor([[1, 0, 4], [2, 3, -1]], dtype=torch.int32)
    q, f = new_cache(5, 2, d, "fp8_ds_mla" if d == 512 else "mxfp4"), new_cache(5, 2, d, "bf16")
    kv_compress_prefill(kv, score, ape, w, table, cu, bt, q)
    kv_compress_prefill(kv, score, ape, w, table, cu, bt, f)
    pooled, seq, b = ref.compress_pool_ref(kv, score, ape, cu, ratio)
    y = ref.compress_finish_ref(pooled, b, ratio, w, table)
    fq = ref.fake_quant_fp8_ds_mla(y) if d == 512 else ref.fake_quant_idx_mxfp4(y)
    for i, L in enumerate(lens):
        n = L // ratio
        sel = seq == i
        assert torch.equal(read_entries(q, d, bt, i, n), fq[sel].float())
        assert torch.equal(read_entries(f, d, bt, i, n), fq[sel].float())
    if d == 512:  # rope dims stored bit-exact in BF16
        assert torch.equal(fq[:, 448:], y[:, 448:])


def _decode_after_prefill(d, ratio, lens, split, gen, fmt, device="cpu"):
    """(cache from one prefill, cache from prefill of the first split[i] tokens + decode steps)."""
    kv, score, ape, w = compress_inputs(lens, d, ratio, gen, device)
    table = rope_cos_sin_table(max(lens) + ratio, device=device)
    cu = make_cu(lens).to(device)
    B = len(lens)
    nmax = max(lens) // ratio // 2 + 1
    bt = torch.randperm(B * nmax, generator=gen).view(B, nmax).to(torch.int32).to(device)
    c1, c2 = new_cache(B * nmax, 2, d, fmt, device), new_cache(B * nmax, 2, d, fmt, device)
    ks1, ss1 = new_compress_state(B, ratio, d, device)
    kv_compress_prefill(kv, score, ape, w, table, cu, bt, c1, kv_state=ks1, score_state=ss1)
    cu0 = make_cu(split).to(device)
    pre = torch.cat([torch.arange(int(cu[i]), int(cu[i]) + split[i]) for i in range(B)]).to(device)
    ks, ss = new_compress_state(B, ratio, d, device)
    kv_compress_prefill(kv[pre], score[pre], ape, w, table, cu0, bt, c2, kv_state=ks, score_state=ss)
    for step in range(max(L - s for L, s in zip(lens, split))):
        pos = torch.tensor([s + step if s + step < L else -1 for L, s in zip(lens, split)], device=device)
        rows = torch.tensor([int(cu[i]) + min(split[i] + step, lens[i] - 1) for i in range(B)], device=device)
        kv_compress_decode(kv[rows], score[rows], ape, w, table, pos, bt, c2, ks, ss)
    return c1, c2, (ks1, ss1), (ks, ss)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.sampled_from(CONFIGS), lens=st.lists(st.integers(1, 21), min_size=1, max_size=3),
       frac=st.floats(0, 1), seed=st.integers(0, 2 ** 16), fmt=st.sampled_from(["q", "bf16"]))
def test_reference_decode_equals_prefill(cfg, lens, frac, seed, fmt):
    d, ratio = cfg
    lens = [L * (1 if ratio == 4 else 13) for L in lens]
    split = [int(L * frac) for L in lens]
    gen = torch.Generator().manual_seed(seed)
    f = "bf16" if fmt == "bf16" else ("fp8_ds_mla" if d == 512 else "mxfp4")
    c1, c2, st1, st2 = _decode_after_prefill(d, ratio, lens, split, gen, f)
    assert torch.equal(c1, c2)
    # the states agree on every row that a later decode step reads
    ks1, ss1 = st1
    ks2, ss2 = st2
    for i, L in enumerate(lens):
        r = L % ratio
        off = ratio if ratio == 4 else 0
        assert torch.equal(ks1[i, off:off + r], ks2[i, off:off + r])
        assert torch.equal(ss1[i, off:off + r], ss2[i, off:off + r])
        if ratio == 4 and L >= 4:
            assert torch.equal(ks1[i, :4], ks2[i, :4]) and torch.equal(ss1[i, :4], ss2[i, :4])


# ------------------------------------------------------------------------------ validation
def test_validation_errors():
    cache = new_cache(2, 4, 512, "fp8_ds_mla")
    x = torch.zeros(3, 512, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="kv"):
        kv_cache_append(cache, x.float(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(LayoutError, match="slot_mapping"):
        kv_cache_append(cache, x, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(LayoutError, match="block_size must be even"):
        kv_cache_append(torch.zeros(2, 3 * 584, dtype=torch.uint8), x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(LayoutError, match="cache"):
        kv_cache_append(torch.zeros(2, 100, dtype=torch.uint8), x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8"):
        kv_cache_append(cache, x, torch.tensor([0, 8, -1]), debug_check=True)
    kv_cache_append(cache, x, torch.tensor([0, 8, -5]))           # device path: skipped, no error
    bt = torch.tensor([[0, 7]], dtype=torch.int32)
    idx = torch.zeros(1, 3, dtype=torch.int32)
    ln = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table"):
        kv_gather(cache, bt, idx, lens=ln, debug_check=True)
    assert (kv_gather(cache, bt, torch.tensor([[5, -1, 100]], dtype=torch.int32), lens=ln) == 0).all()
    with pytest.raises(ValueError, match="all of swa"):
        kv_gather(cache, bt, idx, lens=ln, swa_cache=cache)
    with pytest.raises(ValueError, match="all of swa"):
        kv_gather(cache, bt, idx, lens=ln, swa_cache=cache, swa_block_table=bt, swa_indices=idx)
    with pytest.raises(LayoutError, match="block_table"):
        kv_gather(cache, bt.long(), idx, lens=ln)
    with pytest.raises(TypeError, match="lens"):
        kv_gather(cache, bt, idx)                                  # lens is required
    with pytest.raises(LayoutError, match="lens"):
        kv_gather(cache, bt, idx, lens=torch.tensor([8, 8], dtype=torch.int32))
    with pytest.raises(LayoutError, match="lens"):
        kv_gather(cache, bt, idx, lens=ln.long())
    with pytest.raises(ValueError, match="lens outside"):
        kv_gather(cache, torch.tensor([[0, 1]], dtype=torch.int32), idx, lens=torch.tensor([9], dtype=torch.int32),
                  debug_check=True)
    with pytest.raises(LayoutError, match="format"):
        kv_gather(cache, bt, idx, lens=ln, swa_cache=new_cache(2, 4, 512, "bf16"), swa_block_table=bt,
                  swa_indices=idx, swa_lens=ln)
    gen = torch.Generator().manual_seed(0)
    kv, score, ape, w = compress_inputs([8], 512, 4, gen)
    table = rope_cos_sin_table(64)
    cu = make_cu([8])
    with pytest.raises(LayoutError, match="coff"):
        kv_compress_prefill(kv[:, :512].contiguous(), score[:, :512].contiguous(), ape[:, :512].contiguous(), w, table, cu, bt,
                            cache)
    with pytest.raises(LayoutError, match="ratio"):
        kv_compress_prefill(kv, score, ape[:3], w, table, cu, bt, cache)
    with pytest.raises(LayoutError, match="mxfp4"):
        kv_compress_prefill(kv[:, :256].contiguous(), score[:, :256].contiguous(), ape[:, :256].contiguous(), w[:128],
                            table, cu, bt, cache)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kv_compress_prefill(kv, score, ape, w, table, torch.tensor([0, 9], dtype=torch.int32), bt, cache,
                            debug_check=True)
    with pytest.raises(LayoutError, match="kv_state"):
        ks, ss = new_compress_state(1, 128, 512)
        kv_compress_decode(kv[:1], score[:1], ape, w, table, torch.tensor([3]), bt, cache, ks, ss)


def test_registry_and_fake_tensor_shapes():
    for name in ("kv_cache_append", "kv_gather", "kv_compress_prefill", "kv_compress_decode"):
        op = registry.get_op(name)
        assert op.module == "kv_cache"
        assert op.spec.markdown().startswith(f"# `{name}`")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        cache = torch.empty(4, 64 * 584, dtype=torch.uint8)
        out = torch.ops.dsv4.kv_gather(cache, torch.empty(2, 3, dtype=torch.int32), torch.empty(2, 5, dtype=torch.int32),
                                       torch.empty(2, dtype=torch.int32), None, cache,
                                       torch.empty(2, 2, dtype=torch.int32), torch.empty(2, 128, dtype=torch.int32),
                                       torch.empty(2, dtype=torch.int32))
        assert out.shape == (2, 133, 512) and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ NVRTC compile checks
@pytest.mark.parametrize("fmt", [0, 1])
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_nvrtc_compiles_sm90a_and_uses_vector_ops(fmt, d, ratio):
    pytest.importorskip("cuda.bindings")
    from kernels_cuda.nvrtc import CudaModule
    m = CudaModule("kv_cache.cu", tuple(sorted({"KVC_FMT": str(fmt), "KVC_D": str(d), "KVC_RATIO": str(ratio),
                                                "KVC_IDX64": "1"}.items())))
    ptx = m.ptx()
    for k in ("kv_gather_kernel", "kv_compress_prefill_kernel", "kv_compress_decode_kernel"):
        assert f".entry {k}" in ptx
    assert "ld.global.nc.v4.u32" in ptx and "st.global.v4" in ptx
    assert "shfl.sync.bfly" in ptx and "vote.sync.ballot" in ptx
    if d == 512:                                    # fp8_ds_mla entries (quantized or fake-quant)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if fmt == 0 or d == 512:                        # the gather's exact E4M3 -> BF16 / the fake-quant round trip
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    assert ".local" not in ptx                      # no spills / local arrays
    assert "ex2.approx.ftz.f32" in ptx              # default KVC_ONLINE=2 (base-2 MUFU exp)


def test_provider_defaults_match_cu_defaults():
    pytest.importorskip("cuda.bindings")
    import re

    from kernels_cuda import kv_cache as kc
    from kernels_cuda.nvrtc import KERNEL_DIR
    src = (KERNEL_DIR / "kv_cache.cu").read_text()
    for k, v in kc.DEFAULTS.items():
        assert re.search(rf"#define {k} {v}\b", src), k
    def tc(*a):
        c = kc.compress_config(*a)
        return c.threads, c.entries_per_cta
    assert tc(512, 4, True) == (128, 1) and tc(128, 4, True) == (128, 4)
    assert tc(512, 128, True) == (512, 1) and tc(128, 128, False) == (128, 1)
    assert kc.gather_config().rows_per_cta == 8 * kc.DEFAULTS["KVC_GATHER_RPW"]


# ------------------------------------------------------------------------------ GPU
def _cuda_vs_ref(fn_cuda, fn_ref, kind="cuda"):
    """``fn_cuda`` with ``kv_gather`` forced to ``kind`` (cuda / dsl), ``kv_cache_append`` to its one
    kernel provider (dsl) and the compressors to cuda; ``fn_ref`` with the torch references."""
    with registry.use({"kv_cache_append": "dsl", "kv_gather": kind, "kv_compress_prefill": "cuda",
                       "kv_compress_decode": "cuda"}):
        a = fn_cuda()
    with registry.use({"*": "torch"}):
        b = fn_ref()
    return a, b


GPU_KINDS = ["cuda", "dsl"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dsl"])
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("idx64", [False, True])
def test_gpu_append_matches_reference_bytes(fmt, idx64, kind, cuda_device):
    gen = torch.Generator().manual_seed(30)
    nb, bs, N = 300, 64, 16384
    x = outlier_kv(N, gen).to(cuda_device)
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    slots[::97] = -1
    slots[5] = nb * bs + 3                                             # out of range: skipped
    slots = slots.to(torch.int64 if idx64 else torch.int32).to(cuda_device)

    def run():
        c = new_cache(nb, bs, 512, fmt, cuda_device)
        kv_cache_append(c, x, slots)
        return c
    a, b = _cuda_vs_ref(run, run, kind)
    if fmt == "bf16":
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    else:
        assert torch.equal(a, b)
    assert registry.last_choice("kv_cache_append").kind == "torch"


@pytest.mark.gpu
def test_gpu_dsl_append_past_8gib(cuda_device):
    """The dsl append kernel addresses bytes with 64-bit offsets: a fp8_ds_mla cache over 2^33 bytes (the former
    kernel's int32 word-extent limit) gets its last page right and nothing else touched."""
    bs = 64
    nb = (1 << 33) // (bs * 584) + 8
    try:
        cache = torch.zeros(nb, bs * 584, dtype=torch.uint8, device=cuda_device)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("no 8.6 GB of device memory free")
    gen = torch.Generator().manual_seed(31)
    x = outlier_kv(2 * bs, gen).to(cuda_device)
    slots = torch.cat([torch.arange(bs), (nb - 1) * bs + torch.arange(bs)]).to(cuda_device)
    slots[5] = nb * bs                                                   # one past the end: skipped
    with registry.use(kv_cache_append="dsl"):
        kv_cache_append(cache, x, slots)
    assert registry.last_choice("kv_cache_append").kind == "dsl"
    small = torch.zeros(2, bs * 584, dtype=torch.uint8, device=cuda_device)
    ref.kv_cache_append_ref(small, x, torch.where(slots >= bs, slots - (nb - 2) * bs, slots).clamp(max=2 * bs))
    torch.cuda.synchronize()
    assert torch.equal(cache[0], small[0]) and torch.equal(cache[nb - 1], small[1])
    assert not cache[1:nb - 1].any()
    del cache


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_gpu_gather_matches_reference(fmt, kind, cuda_device):
    gen = torch.Generator().manual_seed(31)
    B, nbc, bs = 128, 40 * 128, 64                     # 40 pages (2560 entries) per request
    cache = new_cache(nbc, bs, 512, fmt, cuda_device)
    swa = new_cache(B * 2, 64, 512, fmt, cuda_device)
    kv_cache_append(cache, outlier_kv(nbc * bs, gen).to(cuda_device), torch.arange(nbc * bs, device=cuda_device))
    kv_cache_append(swa, outlier_kv(B * 128, gen).to(cuda_device), torch.arange(B * 128, device=cuda_device))
    bt = torch.randperm(nbc, generator=gen).view(B, 40).to(torch.int32)
    bt[3, 5] = -1
    bt[4, 6] = nbc + 10
    swa_bt = torch.arange(B * 2, dtype=torch.int32).view(B, 2)
    idx = torch.randint(-1, 40 * bs + 5, (B, 512), generator=gen, dtype=torch.int32)
    swa_idx = torch.randint(-1, 128, (B, 128), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, 40 * bs + 1, (B,), generator=gen, dtype=torch.int32)     # per-request lengths
    lens[:8] = 40 * bs
    swa_lens = torch.randint(0, 129, (B,), generator=gen, dtype=torch.int32)
    swa_lens[:8] = 128
    args = [t.to(cuda_device) for t in (bt, idx, swa_bt, swa_idx, lens, swa_lens)]
    run = lambda: kv_gather(cache, args[0], args[1], lens=args[4], swa_cache=swa, swa_block_table=args[2],
                            swa_indices=args[3], swa_lens=args[5])
    a, b = _cuda_vs_ref(run, run, kind)
    assert a.shape == (B, 640, 512)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    past = (idx.to(cuda_device) >= args[4].view(-1, 1))
    assert (a[:, 128:][past] == 0).all() and past.any()
    # prefill shape: one request, all 2560 entries + a req_idx mapping
    req = torch.full((1,), 7, dtype=torch.int32, device=cuda_device)
    allidx = torch.arange(40 * bs, dtype=torch.int32, device=cuda_device).view(1, -1)
    run = lambda: kv_gather(cache, args[0], allidx, lens=args[4], req_idx=req)
    a, b = _cuda_vs_ref(run, run, kind)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert registry.last_choice("kv_gather").kind == "torch"
    # odd sizes: 1 query, K not a multiple of the rows per warp, an empty block table
    one = torch.tensor([[5, 3000, -1, 7, 1]], dtype=torch.int32, device=cuda_device)
    run = lambda: kv_gather(cache, args[0][:1], one, lens=args[4][:1])
    a, b = _cuda_vs_ref(run, run, kind)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    empty = torch.empty(1, 0, dtype=torch.int32, device=cuda_device)
    run = lambda: kv_gather(cache, empty, one, lens=args[4][:1])
    a, _ = _cuda_vs_ref(run, run, kind)
    assert (a == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_gather_isolation_past_lens(kind, cuda_device):
    """Issue 19 item 1 on the device: indices at or past lens[req] whose block_table column holds
    another request's page give zero rows (the reference's answer, bit for bit)."""
    gen = torch.Generator().manual_seed(33)
    bs, R = 16, 6
    cache = new_cache(R * 4, bs, 512, "fp8_ds_mla", cuda_device)
    swa = new_cache(R * 2, 64, 512, "fp8_ds_mla", cuda_device)
    kv_cache_append(cache, outlier_kv(R * 4 * bs, gen).to(cuda_device), torch.arange(R * 4 * bs, device=cuda_device))
    kv_cache_append(swa, outlier_kv(R * 128, gen).to(cuda_device), torch.arange(R * 128, device=cuda_device))
    bt = torch.arange(R * 4, dtype=torch.int32).view(R, 4).roll(1, 0)  # every row ends in real pages
    swa_bt = torch.arange(R * 2, dtype=torch.int32).view(R, 2)
    lens = torch.tensor([0, 1, 15, 16, 33, 64], dtype=torch.int32)
    swa_lens = torch.tensor([0, 1, 64, 65, 127, 128], dtype=torch.int32)
    idx = torch.arange(64, dtype=torch.int32).repeat(R, 1)
    swa_idx = torch.arange(128, dtype=torch.int32).repeat(R, 1)
    args = [t.to(cuda_device) for t in (bt, swa_bt, lens, swa_lens, idx, swa_idx)]
    run = lambda: kv_gather(cache, args[0], args[4], lens=args[2], swa_cache=swa, swa_block_table=args[1],
                            swa_indices=args[5], swa_lens=args[3])
    a, b = _cuda_vs_ref(run, run, kind)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for r in range(R):
        assert (a[r, :128][int(swa_lens[r]):] == 0).all() and (a[r, 128:][int(lens[r]):] == 0).all()
        assert (a[r, 128:][:int(lens[r])] != 0).any(dim=-1).all()


def _gpu_prefill(d, ratio, lens, fmt, dev, gen, exact_inputs=False):
    kv, score, ape, w = compress_inputs(lens, d, ratio, gen)
    if exact_inputs:  # integer kv + one finite score per channel -> order-independent fp32 math
        kv = torch.randint(-8, 9, kv.shape, generator=gen).float()
        score = torch.full_like(score, float("-inf"))
        coff = 2 if ratio == 4 else 1
        score[ratio - 1::ratio, (coff - 1) * d:] = torch.randn(score[ratio - 1::ratio, (coff - 1) * d:].shape,
                                                               generator=gen)
        w = torch.randint(1, 5, (d,), generator=gen).float() * 0.25
    kv, score, ape, w = (t.to(dev) for t in (kv, score, ape, w))
    table = rope_cos_sin_table(max(lens) + 1, device=dev)
    cu = make_cu(lens).to(dev)
    B, nmax = len(lens), max(lens) // ratio // 16 + 1
    bt = torch.randperm(B * nmax, generator=gen).view(B, nmax).to(torch.int32).to(dev)
    f = "bf16" if fmt == "bf16" else ("fp8_ds_mla" if d == 512 else "mxfp4")

    def run():
        c = new_cache(B * nmax, 16, d, f, dev)
        ks, ss = new_compress_state(B, ratio, d, dev)
        kv_compress_prefill(kv, score, ape, w, table, cu, bt, c, kv_state=ks, score_state=ss)
        return c, ks, ss
    (a, ka, sa), (b, kb, sb) = _cuda_vs_ref(run, run)
    return a, b, (ka, sa, kb, sb), bt, f


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q", "bf16"])
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_gpu_compress_prefill_matches_reference(d, ratio, fmt, cuda_device):
    gen = torch.Generator().manual_seed(40 + d + ratio)
    lens = [5003, 3001, 517] if ratio == 4 else [40000, 9000, 300]    # >= 2k entries, >= 8k tokens
    a, b, (ka, sa, kb, sb), bt, f = _gpu_prefill(d, ratio, lens, fmt, cuda_device, gen)
    assert torch.equal(ka, kb) and torch.equal(sa, sb)                # state tail: pure copies + one add
    n_total = 0
    for i, L in enumerate(lens):
        n = L // ratio
        n_total += n
        ea, eb = read_entries(a, d, bt.cpu(), i, n), read_entries(b, d, bt.cpu(), i, n)
        if d == 512:  # one bf16 ulp before quantization moves an E4M3 code by at most one step
            diff = (ea - eb).abs()
            step = eb.abs() * 0.13 + 1e-3 * eb.abs().amax(-1, keepdim=True)
            assert (diff <= step).all(), f"seq {i}: max excess {(diff - step).max()}"
        assert (ea == eb).float().mean() > 0.97
        cos = torch.nn.functional.cosine_similarity(ea, eb, dim=-1)
        assert cos.min() > (0.999 if d == 512 else 0.98) and cos.mean() > 0.9999
    assert n_total >= 2000 or ratio == 128


@pytest.mark.gpu
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_gpu_compress_prefill_bit_exact_on_order_independent_inputs(d, ratio, cuda_device):
    gen = torch.Generator().manual_seed(50 + d + ratio)
    lens = [4099, 2050] if ratio == 4 else [9000, 700]
    a, b, *_ = _gpu_prefill(d, ratio, lens, "q", cuda_device, gen, exact_inputs=True)
    assert torch.equal(a, b)                         # FP8 / MXFP4 bytes and BF16 rope bits identical


def test_reference_indexer_compressor_nan_entry_gets_nan_scales():
    """Issue 19 item 13 for the indexer key cache (MXFP4, OCP MX rule): an entry whose pooled
    value is NaN gets the NaN scale 0xFF and zero codes in every block (decodes to NaN)."""
    gen = torch.Generator().manual_seed(71)
    kv, score, ape, w = compress_inputs([16], 128, 4, gen)
    kv[3 + 4, 128 + 5] = float("nan")          # token 3 of block 1, current-block half: only entry 1
    table = rope_cos_sin_table(32)
    bt = torch.tensor([[0]], dtype=torch.int32)
    cache = new_cache(1, 16, 128, "mxfp4")
    with registry.use({"*": "torch"}):
        kv_compress_prefill(kv, score, ape, w, table, make_cu([16]), bt, cache)
    vals, sf = ref.paged_views(cache, 128)
    assert (sf[0, 1] == 0xFF).all() and (vals[0, 1] == 0).all()
    assert (sf[0, [0, 2, 3]] != 0xFF).all()


@pytest.mark.gpu
def test_gpu_indexer_compressor_nan_entry_matches_reference(cuda_device):
    gen = torch.Generator().manual_seed(72)
    lens = [4099, 2050]
    kv, score, ape, w = compress_inputs(lens, 128, 4, gen)
    kv = torch.randint(-8, 9, kv.shape, generator=gen).float()        # order-independent fp32 math (as the
    score[:] = float("-inf")                                           # bit-exact test): one-hot pooling
    score[3::4, 128:] = torch.randn(score[3::4, 128:].shape, generator=gen)   # one finite row per channel
    kv[3 + 4 * 17, 128 + 9] = float("nan")                                   # entry 17 of sequence 0
    # entry 5 of sequence 1 (it starts at token 4099 = 3 mod 4, so its one-hot rows are its local
    # position 0 of each block: the Inf must sit on that row; a -inf-score row carries no weight)
    kv[4099 + 4 * 5, 128 + 1] = float("inf")
    dev = cuda_device
    kv, score, ape, w = (t.to(dev) for t in (kv, score, ape, w))
    table = rope_cos_sin_table(max(lens) + 1, device=dev)
    cu = make_cu(lens).to(dev)
    bt = torch.arange(2 * 80, dtype=torch.int32).view(2, 80).to(dev)

    def run():
        c = new_cache(160, 16, 128, "mxfp4", dev)
        kv_compress_prefill(kv, score, ape, w, table, cu, bt, c)
        return c
    a, b = _cuda_vs_ref(run, run)
    assert torch.equal(a, b)
    _, sf = ref.paged_views(a, 128)
    assert (sf[1, 1] == 0xFF).all() and (sf[80, 5] == 0xFF).all()          # entry 17 = page 1 off 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["q", "bf16"])
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_gpu_decode_equals_prefill_bit_exact(d, ratio, fmt, cuda_device):
    gen = torch.Generator().manual_seed(60 + d + ratio)
    lens = [300, 45, 133, 8] if ratio == 4 else [700, 260, 129]
    split = [L // 2 + 1 for L in lens]
    f = "bf16" if fmt == "bf16" else ("fp8_ds_mla" if d == 512 else "mxfp4")
    with registry.use({"*": "cuda"}):
        c1, c2, _, _ = _decode_after_prefill(d, ratio, lens, split, gen, f, cuda_device)
    assert torch.equal(c1, c2)
    assert c1.count_nonzero() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("d,ratio", CONFIGS)
def test_gpu_decode_matches_reference_decode(d, ratio, cuda_device):
    gen = torch.Generator().manual_seed(70 + d + ratio)
    B = 128
    coff = 2 if ratio == 4 else 1
    f = "fp8_ds_mla" if d == 512 else "mxfp4"
    ks0 = torch.randn(B, coff * ratio, coff * d, generator=gen).to(cuda_device)
    ss0 = torch.randn(B, coff * ratio, coff * d, generator=gen).to(cuda_device)
    kv = torch.randn(B, coff * d, generator=gen).to(cuda_device)
    score = torch.randn(B, coff * d, generator=gen).to(cuda_device)
    ape = torch.randn(ratio, coff * d, generator=gen).to(cuda_device)
    w = (torch.rand(d, generator=gen) + 0.5).to(cuda_device)
    pos = torch.randint(0, 4000, (B,), generator=gen)
    pos[::2] = (pos[::2] // ratio) * ratio + ratio - 1                 # half of them emit an entry
    pos[7] = -1
    pos = pos.to(cuda_device)
    table = rope_cos_sin_table(4096, device=cuda_device)
    bt = torch.arange(B * 64, dtype=torch.int32, device=cuda_device).view(B, 64)

    def run():
        c = new_cache(B * 64, 64 if ratio == 4 else 2, d, f, cuda_device)
        ks, ss = ks0.clone(), ss0.clone()
        kv_compress_decode(kv, score, ape, w, table, pos, bt, c, ks, ss)
        return c, ks, ss
    (a, ka, sa), (b, kb, sb) = _cuda_vs_ref(run, run)
    assert torch.equal(ka, kb) and torch.equal(sa, sb)
    pc = pos.cpu()
    emit = ((pc >= 0) & ((pc + 1) % ratio == 0)).nonzero().flatten()
    bs = 64 if ratio == 4 else 2
    eb_ = pc[emit] // ratio
    slots = (bt.cpu()[emit, eb_ // bs].long() * bs + eb_ % bs).to(cuda_device)
    ra, rb = ref.read_slots(a, slots, d).float(), ref.read_slots(b, slots, d).float()
    assert emit.numel() >= B // 2 - 1 and rb.abs().sum(-1).min() > 0
    assert (ra == rb).float().mean() > 0.97
    cos = torch.nn.functional.cosine_similarity(ra, rb, dim=-1)
    assert cos.min() > (0.999 if d == 512 else 0.98)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_cuda_graph_capture(kind, cuda_device):
    gen = torch.Generator().manual_seed(80)
    cache = new_cache(64, 64, 512, "fp8_ds_mla", cuda_device)
    x = outlier_kv(128, gen).to(cuda_device)
    slots = torch.arange(128, device=cuda_device) * 3
    bt = torch.arange(64, dtype=torch.int32, device=cuda_device).view(1, -1)
    idx = (torch.arange(256, dtype=torch.int32, device=cuda_device) * 3 % 384).view(2, 128)
    req = torch.zeros(2, dtype=torch.int32, device=cuda_device)
    lens = torch.full((1,), 384, dtype=torch.int32, device=cuda_device)
    ks, ss = new_compress_state(4, 4, 512, cuda_device)
    kvd = torch.randn(4, 1024, device=cuda_device)
    sc = torch.randn(4, 1024, device=cuda_device)
    ape = torch.randn(4, 1024, device=cuda_device)
    w = torch.ones(512, device=cuda_device)
    table = rope_cos_sin_table(128, device=cuda_device)
    pos = torch.tensor([3, 7, 11, 2], device=cuda_device)
    bt4 = bt.expand(4, -1).contiguous()
    with registry.use({"*": "cuda", "kv_cache_append": "dsl", "kv_gather": kind}):
        kv_cache_append(cache, x, slots)
        kv_gather(cache, bt, idx, lens=lens, req_idx=req)
        k2, s2 = new_compress_state(4, 4, 512, cuda_device)
        kv_compress_decode(kvd, sc, ape, w, table, pos, bt4, cache, k2, s2)    # load modules before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            kv_cache_append(cache, x, slots)
            out = kv_gather(cache, bt, idx, lens=lens, req_idx=req)
            kv_compress_decode(kvd, sc, ape, w, table, pos, bt4, cache, ks, ss)
        g.replay()
        torch.cuda.synchronize()
    want = ref.fake_quant_fp8_ds_mla(x)[idx.long().cpu() // 3].to(cuda_device)
    assert torch.equal(out, want)


def test_dsl_providers_explain_their_config():
    """The DSL kv_cache_append / kv_gather and dequant_fp4 providers name the frozen config ``run``
    launches (``registry.last_choice(op).explain()``, ``dsv4 ops --verbose``)."""
    import dataclasses

    from dsv4.target import Target
    pytest.importorskip("cutlass")
    import dsv4.ops  # noqa: F401  (registers every op)
    from kernels_dsl import dequant_fp4, kv_cache
    t = Target.of("cpu")
    for op, want in (("kv_cache_append", kv_cache.DEFAULT_APPEND), ("kv_gather", kv_cache.DEFAULT_GATHER),
                     ("dequant_fp4", dequant_fp4.DEFAULT_CONFIG)):
        o = registry.get_op(op)
        p = o.provider("dsl")
        if isinstance(p, registry.Support):
            pytest.skip(f"dsl provider unavailable: {p.reason}")
        cfg = p.config(o.example_problem(t), t)
        assert cfg == want and dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen, (op, cfg)



def test_cuda_providers_explain_their_config_cpu():
    """The CUDA kv_gather / compressor providers name the frozen config ``run`` launches (host heuristics)."""
    import dataclasses

    from dsv4.ops.kv_cache import CompressProblem, GatherProblem
    from dsv4.target import Target
    pytest.importorskip("cuda.bindings")
    import dsv4.ops  # noqa: F401  (registers every op)
    from kernels_cuda import kv_cache as kc
    t = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
    for op, problem, want in (
            ("kv_gather", GatherProblem("fp8_ds_mla", True, "cuda", True), kc.gather_config()),
            ("kv_compress_prefill", CompressProblem("mxfp4", 128, 4, "int32", 1e-6, "cuda"),
             kc.compress_config(128, 4, True)),
            ("kv_compress_decode", CompressProblem("fp8_ds_mla", 512, 128, "int64", 1e-6, "cuda"),
             kc.compress_config(512, 128, False))):
        p = registry.get_op(op).provider("cuda")
        if isinstance(p, registry.Support):
            pytest.skip(f"cuda provider unavailable: {p.reason}")
        cfg = p.config(problem, t)
        assert cfg == want and dataclasses.is_dataclass(cfg) and cfg.__dataclass_params__.frozen and str(cfg), (op, cfg)
