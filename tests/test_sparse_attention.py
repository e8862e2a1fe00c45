"""sparse_attention: reference vs an independent fp64 oracle, semantics (invalid / duplicate / empty
entries, the merge rule), index builders, validation errors, the DSL decode model (CPU), and the
CuTe DSL kernel vs the reference on the same dequantized KV (GPU).

Oracle (independent of dsv4.reference.sparse_attention and of read_slots): each valid entry's
584 bytes are decoded by hand from the raw cache (E4M3 via torch.float8_e4m3fn, UE8M0 via
2^(b-127), the BF16 rope bytes), then an fp64 softmax over the row's logits with the sink as one
more logit (``lse = logsumexp``, the sink's probability dropped from the output).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4 import registry
from dsv4.layout import LayoutError
from dsv4.ops.kv_cache import kv_cache_append
from dsv4.ops.sparse_attention import (DEFAULT_SCALE, compressed_slots, hca_slots, sparse_attention,
                                       sparse_attention_decode, validate_args, window_slots)
from dsv4.reference.kv_cache import TOKEN_BYTES
from dsv4.reference.sparse_attention import sparse_attention_paged_ref

D = 512


# ------------------------------------------------------------------------------ helpers
def make_cache(nb, bs, gen, device="cpu", spread=True):
    """A filled fp8_ds_mla cache (every slot written); ``spread`` varies the per-block scales over
    ~2^-20 .. 2^6 and plants tiny values so E4M3 subnormals occur."""
    n = nb * bs
    x = torch.randn(n, D, generator=gen)
    if spread:
        x = x * torch.exp2(torch.randint(-20, 7, (n, 8), generator=gen).float()).repeat_interleave(64, 1)
        x[:, 5] *= 1e-3
        x[:, 200] *= 40
    cache = torch.zeros(nb, bs * TOKEN_BYTES, dtype=torch.uint8, device=device)
    kv_cache_append(cache, x.to(torch.bfloat16).to(device), torch.arange(n, device=device))
    return cache


def oracle_row(cache, slot):
    """fp64 dequantized row of a physical slot, decoded from the raw bytes."""
    bs = cache.shape[1] // TOKEN_BYTES
    page, off = divmod(int(slot), bs)
    blk = cache[page].cpu()
    data = blk[off * 576:(off + 1) * 576]
    sf = blk[bs * 576 + off * 8: bs * 576 + off * 8 + 7]
    e4 = data[:448].clone().view(torch.float8_e4m3fn).double()
    scale = torch.tensor([2.0 ** (int(b) - 127) for b in sf], dtype=torch.float64).repeat_interleave(64)
    nope = (e4 * scale).to(torch.bfloat16).double()        # the cache row is bf16-exact
    rope = data[448:].clone().view(torch.bfloat16).double()
    return torch.cat([nope, rope])


def oracle(q, swa, sidx, slen, sink, comp=None, cidx=None, clen=None, scale=DEFAULT_SCALE):
    T, H, _ = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        rows = []
        for cache, idx, n in ((swa, sidx, slen), (comp, cidx, clen)):
            if cache is None:
                continue
            nslots = cache.shape[0] * (cache.shape[1] // TOKEN_BYTES)
            for j in range(min(max(int(n[t]), 0), idx.shape[1])):
                s = int(idx[t, j])
                if 0 <= s < nslots:
                    rows.append(oracle_row(cache, s))
        kv = torch.stack(rows) if rows else torch.zeros(0, D, dtype=torch.float64)
        for h in range(H):
            logits = kv @ q[t, h].double().cpu() * scale
            sk = torch.tensor([float(sink[h]) if sink is not None else -math.inf], dtype=torch.float64)
            allv = torch.cat([logits, sk])
            lse[t, h] = torch.logsumexp(allv, 0)
            if len(rows) and math.isfinite(float(lse[t, h])):
                out[t, h] = torch.exp(logits - lse[t, h]) @ kv
    return out, lse


def random_problem(T, H, gen, *, K=96, Ws=128, device="cpu", nb=6, bs=64, sbs=32, hca=False, sink=True,
                   spread=True):
    """Caches + lists for T rows; ``spread`` = heavy per-block scale spread (peaked softmax), else
    unit-variance KV (diffuse softmax, scores ~ N(0, 1/4))."""
    swa = make_cache(4, sbs, gen, device, spread)
    comp = make_cache(nb, bs, gen, device, spread)
    q = (torch.randn(T, H, D, generator=gen) * 0.5).to(torch.bfloat16).to(device)
    sk = (torch.randn(H, generator=gen) * 2).to(device) if sink else None
    sidx = torch.randint(0, 4 * sbs, (T, Ws), generator=gen, dtype=torch.int32).to(device)
    slen = torch.randint(0, Ws + 1, (T,), generator=gen, dtype=torch.int32).to(device)
    if hca:
        cidx = torch.arange(K, dtype=torch.int32).repeat(T, 1).to(device) % (nb * bs)
        clen = torch.randint(0, K + 1, (T,), generator=gen, dtype=torch.int32).to(device)
    else:
        cidx = torch.randint(-1, nb * bs, (T, K), generator=gen, dtype=torch.int32).to(device)
        clen = torch.full((T,), K, dtype=torch.int32).to(device)
    return q, swa, sidx, slen, sk, comp, cidx, clen


# ------------------------------------------------------------------------------ reference vs oracle (CPU)
@pytest.mark.parametrize("seed,sink", [(0, True), (1, False), (2, True)])
def test_reference_matches_fp64_oracle(seed, sink):
    gen = torch.Generator().manual_seed(seed)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(3, 4, gen, K=40, Ws=24, sink=sink)
    sidx[0, 3] = -1
    sidx[1, 0] = 10 ** 6                       # out of range -> ignored
    cidx[2, :5] = cidx[2, 5]                   # duplicates count once per occurrence
    o, l = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen, DEFAULT_SCALE)
    wo, wl = oracle(q, swa, sidx, slen, sk, comp, cidx, clen)
    torch.testing.assert_close(o.double(), wo, rtol=2e-5, atol=2e-5 * float(wo.abs().max()))
    torch.testing.assert_close(l.double(), wl, rtol=1e-6, atol=2e-5)


_HYP_CACHES = {}


def _hyp_caches():
    """Two small filled caches (SWA: 3 pages x 4, compressed: 5 pages x 2 slots), built once."""
    if not _HYP_CACHES:
        gen = torch.Generator().manual_seed(99)
        _HYP_CACHES.update(swa=make_cache(3, 4, gen), comp=make_cache(5, 2, gen))
    return _HYP_CACHES["swa"], _HYP_CACHES["comp"]


@settings(max_examples=40, deadline=None)
@given(T=st.integers(0, 3), H=st.integers(1, 3), Ws=st.integers(0, 7), K=st.integers(0, 7),
       with_comp=st.booleans(), with_sink=st.booleans(), data=st.data())
def test_reference_matches_fp64_oracle_adversarial_lists(T, H, Ws, K, with_comp, with_sink, data):
    """Hypothesis: lists mixing valid slots, duplicates, -1, other negatives, values just past / far past
    the cache, lengths < 0, 0 and > width, SWA-only rows and layers; reference (fp64) == oracle."""
    swa, comp = _hyp_caches()
    ids = lambda n_slots: st.one_of(st.integers(0, n_slots - 1), st.sampled_from(
        [-1, -2, -(2 ** 31), n_slots, n_slots + 1, 2 ** 31 - 1]))
    lst = lambda n, w, n_slots: torch.tensor(data.draw(st.lists(st.lists(ids(n_slots), min_size=w, max_size=w),
                                                                min_size=n, max_size=n)),
                                             dtype=torch.int32).view(n, w)
    lens = lambda n, w: torch.tensor(data.draw(st.lists(st.integers(-2, w + 2), min_size=n, max_size=n)),
                                     dtype=torch.int32)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    q = (torch.randn(T, H, D, generator=gen) * 0.5).to(torch.bfloat16)
    sk = (torch.randn(H, generator=gen) * 3) if with_sink else None
    sidx, slen = lst(T, Ws, 12), lens(T, Ws)
    comp_args = (comp, lst(T, K, 10), lens(T, K)) if with_comp else ()
    o, l = sparse_attention_paged_ref(q, swa, sidx, slen, sk, *comp_args, DEFAULT_SCALE, dtype=torch.float64) \
        if comp_args else sparse_attention_paged_ref(q, swa, sidx, slen, sk, scale=DEFAULT_SCALE, dtype=torch.float64)
    wo, wl = oracle(q, swa, sidx, slen, sk, *comp_args)
    assert o.shape == (T, H, D) and l.shape == (T, H)
    torch.testing.assert_close(o, wo, rtol=1e-9, atol=1e-9 * max(1.0, float(wo.abs().max()) if wo.numel() else 1.0))
    fin = torch.isfinite(wl)
    assert torch.equal(fin, torch.isfinite(l)) and torch.equal(l[~fin], wl[~fin])
    torch.testing.assert_close(l[fin], wl[fin], rtol=1e-12, atol=1e-9)
    # the public op (torch provider) is the same math rounded, with the same shapes
    with registry.use(sparse_attention="torch"):
        po, pl = sparse_attention(q, swa, sidx, slen, sk, **(dict(zip(("cache", "indices", "lens"), comp_args))))
    assert po.dtype == torch.bfloat16 and pl.dtype == torch.float32 and po.shape == (T, H, D)
    torch.testing.assert_close(po.double(), wo, rtol=8e-3, atol=1e-5 * max(1.0, float(wo.abs().max()) if wo.numel()
                                                                               else 1.0))


def test_op_torch_provider_is_the_reference_rounded():
    gen = torch.Generator().manual_seed(4)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(4, 8, gen)
    with registry.use(sparse_attention="torch"):
        o, l = sparse_attention(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32 and o.shape == (4, 8, D) and l.shape == (4, 8)
    assert torch.equal(o, ro.to(torch.bfloat16)) and torch.equal(l, rl)


def test_invalid_entries_contribute_nothing():
    gen = torch.Generator().manual_seed(5)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(2, 4, gen, K=32, Ws=16)
    slen[:] = 16
    clean = sparse_attention_paged_ref(q, swa, sidx[:, :10], torch.full_like(slen, 10), sk, comp, cidx[:, :20],
                                       torch.full_like(clen, 20))
    junk_s = sidx.clone()
    junk_s[:, 10:] = torch.tensor([-1, -7, 4 * 32, 2 ** 31 - 1, 5, 6])   # past the length: ignored whatever they are
    got = sparse_attention_paged_ref(q, swa, junk_s, torch.full_like(slen, 10), sk, comp, cidx,
                                     torch.full_like(clen, 20))
    torch.testing.assert_close(got[0], clean[0], rtol=1e-6, atol=1e-6)
    # -1 / out-of-range inside the length == removing them
    mixed = cidx[:, :20].clone()
    extra = torch.tensor([[-1, 6 * 64, -5, 10 ** 8]]).repeat(2, 1).to(torch.int32)
    got = sparse_attention_paged_ref(q, swa, sidx[:, :10], torch.full_like(slen, 10), sk, comp,
                                     torch.cat([extra, mixed], 1), torch.full_like(clen, 24))
    torch.testing.assert_close(got[0], clean[0], rtol=1e-6, atol=1e-6)


def test_empty_rows_sink_takes_all_mass():
    gen = torch.Generator().manual_seed(6)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(3, 4, gen)
    slen[:] = 0
    clen[:] = 0
    o, l = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(l, sk.view(1, -1).expand(3, -1))
    o, l = sparse_attention_paged_ref(q, swa, sidx, slen, None, comp, cidx, clen)
    assert torch.equal(o, torch.zeros_like(o)) and bool(torch.isneginf(l).all())


def test_lse_merge_rule():
    """(out, lse) with the sink over part A merged with a sink-free result over part B == the whole."""
    gen = torch.Generator().manual_seed(7)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(3, 4, gen, K=64, Ws=32)
    slen[:] = 32
    full = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen, dtype=torch.float64)
    a = sparse_attention_paged_ref(q, swa, sidx, slen, sk, dtype=torch.float64)
    b = sparse_attention_paged_ref(q, comp, cidx, clen, None, dtype=torch.float64)
    lse = torch.logaddexp(a[1], b[1])
    out = torch.exp(a[1] - lse).unsqueeze(-1) * a[0] + torch.exp(b[1] - lse).unsqueeze(-1) * b[0]
    torch.testing.assert_close(out, full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, full[1], rtol=1e-12, atol=1e-12)


def test_decode_wrapper_shapes_and_per_request_lens():
    gen = torch.Generator().manual_seed(8)
    B, n, H = 2, 3, 4
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(B * n, H, gen, K=16, Ws=8)
    per_req = torch.tensor([5, 7], dtype=torch.int32)
    o, l = sparse_attention_decode(q.view(B, n, H, D), swa, sidx.view(B, n, -1), per_req, sk, cache=comp,
                                   indices=cidx.view(B, n, -1), lens=clen.view(B, n))
    ro, rl = sparse_attention(q, swa, sidx, per_req.repeat_interleave(n), sk, cache=comp, indices=cidx, lens=clen)
    assert o.shape == (B, n, H, D) and l.shape == (B, n, H)
    assert torch.equal(o.reshape(B * n, H, D), ro) and torch.equal(l.reshape(B * n, H), rl)
    with pytest.raises(LayoutError, match="'q'"):
        sparse_attention_decode(q.view(B, n, H, D)[:, :, :, :256], swa, sidx.view(B, n, -1), per_req, sk)
    with pytest.raises(LayoutError, match="'swa_indices'"):
        sparse_attention_decode(q.view(B, n, H, D), swa, sidx, per_req, sk)


# ------------------------------------------------------------------------------ index builders
def test_window_slots_ring_and_linear():
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    pos = torch.tensor([0, 5, 127, 128, 300, -1])
    req = torch.tensor([0, 0, 1, 1, 0, 1])
    slots, lens = window_slots(pos, req, bt, 64)
    assert lens.tolist() == [1, 6, 128, 128, 128, 0]
    for t in range(len(pos)):
        p, r = int(pos[t]), int(req[t])
        want = [((x % 128) // 64, (x % 128) % 64) for x in range(max(0, p - 127), p + 1)]
        want = [int(bt[r, pg]) * 64 + o for pg, o in want]
        assert slots[t, :len(want)].tolist() == want and bool((slots[t, len(want):] == -1).all())
    lin, _ = window_slots(torch.tensor([130]), torch.tensor([0]), torch.tensor([[4, 5, 6]], dtype=torch.int32), 64,
                          ring=None)
    assert lin[0].tolist() == [4 * 64 + 3 + i if i < 61 else 5 * 64 + (i - 61) if i < 125 else 6 * 64 + (i - 125)
                               for i in range(128)]


def test_hca_and_compressed_slots():
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    slots, lens = hca_slots(torch.tensor([127, 128 * 5 - 1, 10_000]), torch.tensor([0, 0, 0]), bt, 4, 8)
    assert lens.tolist() == [1, 5, 8]
    assert slots[1].tolist() == [8, 9, 10, 11, 0, -1, -1, -1]
    top = torch.tensor([[3, -1, 11, 12]], dtype=torch.int32)
    s, l = compressed_slots(top, torch.tensor([0]), bt, 4, num_blocks=3)
    assert s.tolist() == [[11, -1, 7, -1]] and l.tolist() == [4]     # entry 12 is past the table


# ------------------------------------------------------------------------------ validation (CPU)
def _valid_args(gen):
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(2, 4, gen, K=8, Ws=8)
    return dict(q=q, swa_cache=swa, swa_indices=sidx, swa_lens=slen, sink=sk), dict(cache=comp, indices=cidx,
                                                                                   lens=clen)


@pytest.mark.parametrize("change,needle", [
    (lambda a, k: a.update(q=a["q"].float()), "'q'"),
    (lambda a, k: a.update(q=a["q"][:, :, :256]), "'q'"),
    (lambda a, k: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)), "'q'"),
    (lambda a, k: a.update(swa_indices=a["swa_indices"].long()), "'swa_indices'"),
    (lambda a, k: a.update(swa_indices=a["swa_indices"][:1]), "'swa_indices'"),
    (lambda a, k: a.update(swa_lens=a["swa_lens"].view(-1, 1)), "'swa_lens'"),
    (lambda a, k: a.update(sink=a["sink"][:3]), "'sink'"),
    (lambda a, k: a.update(sink=a["sink"].double()), "'sink'"),
    (lambda a, k: a.update(swa_cache=a["swa_cache"][:, :-1]), "swa_cache"),
    (lambda a, k: k.update(cache=k["cache"].view(torch.int8)), "^cache: "),
    (lambda a, k: k.update(indices=k["indices"][:, ::2]), "'indices'"),
    (lambda a, k: k.update(lens=k["lens"][:1]), "'lens'"),
])
def test_layout_errors_name_the_argument(change, needle):
    a, k = _valid_args(torch.Generator().manual_seed(9))
    change(a, k)
    with pytest.raises(LayoutError, match=needle):
        sparse_attention(**a, **k)


def test_value_errors():
    a, k = _valid_args(torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="cache, indices, lens"):
        sparse_attention(**a, cache=k["cache"], indices=k["indices"])
    with pytest.raises(ValueError, match="'scale'"):
        sparse_attention(**a, **k, scale=0.0)
    with pytest.raises(ValueError, match="'num_splits'"):
        sparse_attention(**a, **k, num_splits=0)
    bf = torch.zeros(4, 32, D, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="format"):
        sparse_attention(**a, cache=bf, indices=k["indices"], lens=k["lens"])
    with pytest.raises(ValueError, match="'debug_check'"):
        sparse_attention(**a, **k, debug_check="yes")
    with pytest.raises(ValueError, match="'scale'"):
        sparse_attention(**a, **k, scale=float("nan"))
    with pytest.raises(ValueError, match="'num_splits'"):
        sparse_attention(**a, **k, num_splits=2.0)
    with pytest.raises(ValueError, match="swa_lens must lie in"):
        sparse_attention(**dict(a, swa_lens=a["swa_lens"] + 9), **k, debug_check=True)
    k["indices"][0, 0] = 6 * 64
    with pytest.raises(ValueError, match=r"indices\[0, 0\]"):
        sparse_attention(**a, **k, debug_check=True)
    got = sparse_attention(**a, **k)         # without debug_check: treated as an empty entry
    k["indices"][0, 0] = -1
    want = sparse_attention(**a, **k)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bf16_cache_reference_path():
    gen = torch.Generator().manual_seed(11)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(2, 4, gen)
    from dsv4.reference.kv_cache import read_slots
    def as_bf16(c):
        bs = c.shape[1] // TOKEN_BYTES
        return read_slots(c, torch.arange(c.shape[0] * bs)).view(c.shape[0], bs, D)
    o1, l1 = sparse_attention(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    o2, l2 = sparse_attention(q, as_bf16(swa), sidx, slen, sk, cache=as_bf16(comp), indices=cidx, lens=clen)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_torch_compile_custom_op_cpu():
    gen = torch.Generator().manual_seed(12)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(2, 4, gen, K=8, Ws=8)
    torch._dynamo.reset()
    f = torch.compile(lambda q: torch.ops.dsv4.sparse_attention(q, swa, sidx, slen, sk, comp, cidx, clen,
                                                                 DEFAULT_SCALE, None)[0].float() * 2,
                      backend="aot_eager", fullgraph=True)
    want = torch.ops.dsv4.sparse_attention(q, swa, sidx, slen, sk, comp, cidx, clen, DEFAULT_SCALE, None)[0]
    assert torch.equal(f(q), want.float() * 2)


# ------------------------------------------------------------------------------ DSL decode model, heuristics (CPU)
def test_fp8_ds_mla_bit_decode_model_is_exact():
    pytest.importorskip("ml_dtypes")
    from kernels_dsl.sm90.attention import model_dequant_e4m3, model_e4m3x4_to_bf16x4
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
    for b in range(256):
        if b in (0x7F, 0xFF):                          # E4M3 NaN codes (never written by kv_cache_append)
            continue
        lo, _ = model_e4m3x4_to_bf16x4(b)              # placement = e4m3 * 2^-120 exactly
        v = torch.tensor([lo << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).double().item()
        assert v == float(e4[b]) * 2.0 ** -120, hex(b)
        for sf in range(255):
            want = (torch.tensor([float(e4[b]) * 2.0 ** (sf - 127)], dtype=torch.float64).float()
                    .to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
            assert model_dequant_e4m3(b, sf) == want, (hex(b), sf)


def test_split_heuristic():
    from kernels_dsl.sparse_attention import choose_config
    for args in ((128, 128, 1152, 132), (64, 64, 640, 132), (2, 16, 64 * 40, 132), (4, 64, 100, 132),
                 (8192, 64, 640, 132)):
        c = choose_config(*args)
        tiles = -(-args[2] // 64)
        # every tile is covered exactly by the splits
        assert (c.num_splits - 1) * c.tiles_per_split < tiles <= c.num_splits * c.tiles_per_split
    assert choose_config(4, 64, 100, 132).num_splits == 1              # 2 tiles: never split
    assert choose_config(64, 64, 640, 132).num_splits == 2             # 64 CTAs x 2 = one wave of 132 SMs
    assert choose_config(8, 64, 640, 132).num_splits == 5              # at least 2 tiles per split
    c = choose_config(4, 64, 640, 132, num_splits=50)                   # more splits than tiles: one tile each
    assert (c.num_splits, c.tiles_per_split) == (10, 1)
    c = choose_config(1, 64, 64 * 70_000, 132, num_splits=10 ** 6)     # gridDim.z <= 65535
    assert c.num_splits <= 65535 and (c.num_splits - 1) * c.tiles_per_split < 70_000 <= c.num_splits * c.tiles_per_split


def test_dsl_launcher_chunks_rows_past_the_grid_limit(monkeypatch):
    """The fwd grid is [ceil(H/64), T, splits] and gridDim.y <= 65535: the launcher cuts a larger T into row
    chunks (views of every per-row operand and of out / lse). CPU check of that glue: each chunk is run by the
    reference into its out / lse slice, and the whole equals the reference over all rows."""
    import kernels_dsl.sparse_attention as prov
    assert prov.MAX_ROWS_PER_LAUNCH == 65535
    calls = []

    def fake_launch(q, swa, sidx, slen, sk, comp, cidx, clen, scale, num_splits, out, lse):
        assert 1 <= q.shape[0] <= 4 and out.shape[0] == lse.shape[0] == sidx.shape[0] == slen.shape[0] == q.shape[0]
        assert q.is_contiguous() and out.is_contiguous() and sidx.is_contiguous() and cidx.is_contiguous()
        calls.append((q.data_ptr(), q.shape[0], out.data_ptr(), num_splits))
        o, l = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen, scale)
        out.copy_(o.to(torch.bfloat16))
        lse.copy_(l)

    monkeypatch.setattr(prov, "MAX_ROWS_PER_LAUNCH", 4)
    monkeypatch.setattr(prov, "_launch", fake_launch)
    gen = torch.Generator().manual_seed(31)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(10, 4, gen, K=16, Ws=8)
    o, l = prov.sparse_attention_dsl(q, swa, sidx, slen, sk, comp, cidx, clen, DEFAULT_SCALE, 2)
    row_q, row_o = q[0].numel() * q.element_size(), o[0].numel() * o.element_size()
    assert [(c[0] - q.data_ptr()) // row_q for c in calls] == [0, 4, 8] and [c[1] for c in calls] == [4, 4, 2]
    assert [(c[2] - o.data_ptr()) // row_o for c in calls] == [0, 4, 8] and {c[3] for c in calls} == {2}
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    assert torch.equal(o, ro.to(torch.bfloat16)) and torch.equal(l, rl)


# ------------------------------------------------------------------------------ GPU: DSL kernel vs reference
def _check_close(o, l, ro, rl, label):
    """The precision contract of dsv4.ops.sparse_attention."""
    of, rof = o.float(), ro.float()
    assert bool(torch.isfinite(of).all()), f"{label}: non-finite output"
    half_ulp = torch.where(rof == 0, torch.zeros_like(rof), torch.exp2(torch.floor(torch.log2(rof.abs())) - 8))
    tol = 2e-3 * float(rof.abs().max())
    err = ((of - rof).abs() - half_ulp).clamp(min=0)
    assert float(err.max()) <= tol, f"{label}: out error {float(err.max()):.3g} > {tol:.3g}"
    fin = torch.isfinite(rl)
    assert torch.equal(fin, torch.isfinite(l)) and torch.equal(rl[~fin], l[~fin]), f"{label}: lse infinities differ"
    d = (l[fin] - rl[fin]).abs() - 2e-6 * rl[fin].abs()
    assert d.numel() == 0 or float(d.max()) <= 1e-3, f"{label}: lse error beyond 2e-6 |lse| {float(d.max()):.3g}"


CASES = {
    "csa": dict(K=512, Ws=128),
    "hca": dict(K=200, Ws=128, hca=True),
    "swa_only": dict(K=0, Ws=128),
    "nosink": dict(K=256, Ws=128, sink=False),
    "short": dict(K=8, Ws=8),
    "diffuse": dict(K=1024, Ws=128, spread=False),
}


def _dsl(q, swa, sidx, slen, sk, *, cache=None, indices=None, lens=None, num_splits=None):
    """The dsl kernels through their launcher with an explicit split count (same checks and defaults as
    the public op, which the op tests below go through)."""
    from kernels_dsl.sparse_attention import sparse_attention_dsl
    return sparse_attention_dsl(*validate_args(q, swa, sidx, slen, sk, cache=cache, indices=indices, lens=lens,
                                               num_splits=num_splits))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_dsl_matches_reference(H, case, splits):
    gen = torch.Generator().manual_seed(hash((H, case)) % 2 ** 31)
    kw = dict(CASES[case])
    K = kw.pop("K")
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(5, H, gen, K=max(K, 1), device="cuda", **kw)
    comp_args = dict(cache=comp, indices=cidx, lens=clen) if K else {}
    o, l = _dsl(q, swa, sidx, slen, sk, num_splits=splits, **comp_args)
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, *(comp_args.values() if K else ()))
    _check_close(o, l, ro, rl, f"H={H} {case} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128])
def test_dsl_adversarial_lists(H):
    gen = torch.Generator().manual_seed(77 + H)
    T = 6
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(T, H, gen, K=160, Ws=128, device="cuda")
    sidx[0] = -1                                   # row 0: nothing valid at all
    cidx[0] = -1
    slen[1] = 0                                    # row 1: lengths 0
    clen[1] = 0
    cidx[2] = cidx[2, 0]                           # row 2: one entry 160 times
    clen[3] = 0                                    # row 3: SWA only
    cidx[4, ::3] = 2 ** 31 - 1                     # row 4: out-of-range values (never dereferenced)
    cidx[4, 1::3] = -(2 ** 31)
    sidx[5, ::2] = 4 * 32                          # row 5: first slot past the SWA cache
    for splits in (1, 4):
        o, l = _dsl(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen, num_splits=splits)
        ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
        _check_close(o, l, ro, rl, f"H={H} adversarial splits={splits}")
        assert torch.equal(o[:2], torch.zeros_like(o[:2])) and torch.equal(l[:2], sk.view(1, -1).expand(2, -1))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 24, 100])
def test_dsl_odd_heads_and_lengths_outside_the_list(H):
    """H outside {16, 32, 64, 128} (a partial 64-head block: TMA zero-fill, masked stores) and lengths that
    are negative or past the list width (clamped to [0, width] on the device, as the reference does)."""
    gen = torch.Generator().manual_seed(500 + H)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(6, H, gen, K=72, Ws=40, device="cuda")
    slen.copy_(torch.tensor([-5, 47, 2 ** 31 - 1, -(2 ** 31), 3, 40], dtype=torch.int32))
    clen.copy_(torch.tensor([80, -1, 0, 2 ** 31 - 1, -(2 ** 31), 71], dtype=torch.int32))
    for splits in (1, 3):
        out = torch.full((6, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")     # unwritten -> NaN
        lse = torch.full((6, H), float("nan"), device="cuda")
        from kernels_dsl.sparse_attention import sparse_attention_dsl
        o, l = sparse_attention_dsl(*validate_args(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen,
                                                   num_splits=splits), out=out, lse=lse)
        ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
        _check_close(o, l, ro, rl, f"H={H} odd lengths splits={splits}")
    assert int(torch.ones(4, device="cuda").sum()) == 4                  # the context is alive


@pytest.mark.gpu
def test_dsl_rows_past_the_grid_limit():
    """T > 65535 rows (gridDim.y): the launcher runs row chunks; every row matches the reference."""
    from kernels_dsl.sparse_attention import MAX_ROWS_PER_LAUNCH
    gen = torch.Generator().manual_seed(65536)
    T = MAX_ROWS_PER_LAUNCH + 3
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(T, 2, gen, K=8, Ws=8, device="cuda")   # H=2: cheap
    o, l = sparse_attention(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    assert registry.last_choice("sparse_attention").kind == "dsl"
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    _check_close(o, l, ro, rl, f"T={T}")


@pytest.mark.gpu
def test_dsl_single_entry_is_the_exact_dequantized_row():
    """One valid entry and no sink: softmax weight exactly 1, so out == the decoded cache row bit
    for bit (checks the in-kernel gather + E4M3 decode + K/V smem layouts on every dim)."""
    gen = torch.Generator().manual_seed(13)
    T, H = 8, 64
    q, swa, sidx, slen, _, comp, cidx, clen = random_problem(T, H, gen, K=64, Ws=64, device="cuda")
    sidx[:] = -1
    slen[:] = 64
    cidx[:] = -1
    pick = torch.randint(0, comp.shape[0] * 64, (T,), generator=gen, dtype=torch.int32).cuda()
    cidx[torch.arange(T), torch.arange(T) * 7 % 64] = pick
    o, _ = _dsl(q, swa, sidx, slen, None, cache=comp, indices=cidx, lens=clen)
    from dsv4.reference.kv_cache import read_slots
    rows = read_slots(comp, pick)
    assert torch.equal(o, rows.view(T, 1, D).expand(T, H, D))


@pytest.mark.gpu
def test_dsl_decode_next_n_and_prefill_rows():
    gen = torch.Generator().manual_seed(14)
    B, n, H = 8, 2, 128
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(B * n, H, gen, K=1024, Ws=128, device="cuda", nb=40)
    o, l = _dsl(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)     # decode rows = B * next_n
    o, l = o.view(B, n, H, D), l.view(B, n, H)
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    _check_close(o.view(B * n, H, D), l.view(B * n, H), ro, rl, "decode next_n=2 H=128")
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(300, 64, gen, K=512, Ws=128, device="cuda", nb=20)
    o, l = _dsl(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    _check_close(o, l, ro, rl, "prefill T=300 H=64")


def test_window_slots_first_position():
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    s, n = window_slots(torch.tensor([300, 298]), torch.tensor([0, 0]), bt, 64, first=300 - 127)
    assert n.tolist() == [128, 126]
    assert s[1, :126].tolist() == [p % 128 for p in range(173, 299)] and bool((s[1, 126:] == -1).all())


def test_dsl_provider_offered_for_fp8_ds_mla_on_sm90a_only():
    """The registry picks dsl for fp8_ds_mla caches on sm_90a; a bf16 cache or another arch falls back."""
    from dsv4.target import Target
    op = registry.get_op("sparse_attention")
    problem = {"fmt": "fp8_ds_mla", "H": 64, "T": 8, "entries": 640, "split": None, "device": "cuda"}
    assert op.check("dsl", problem, Target("cuda", "sm_90a", "H200", 132, 0))
    sup = op.check("dsl", dict(problem, fmt="bf16"), Target("cuda", "sm_90a", "H200", 132, 0))
    assert not sup and "fp8_ds_mla" in sup.reason
    assert not op.check("dsl", problem, Target("cuda", "sm_100a", "B200", 148, 0))


def test_validate_args_matches_the_public_checks():
    gen = torch.Generator().manual_seed(3)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(2, 16, gen, K=8, Ws=8)
    a = validate_args(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    assert a[0] is q and a[5] is comp and a[8] == DEFAULT_SCALE and a[9] is None
    with pytest.raises(ValueError, match="cache, indices, lens"):
        validate_args(q, swa, sidx, slen, sk, cache=comp)


@pytest.mark.gpu
def test_gpu_op_picks_dsl_and_is_graph_capturable():
    """The public op on the H200 runs the dsl provider (the registry default) and replays under a CUDA
    graph with the lists changed in place (no host sync, no shape-dependent host work per call)."""
    gen = torch.Generator().manual_seed(21)
    q, swa, sidx, slen, sk, comp, cidx, clen = random_problem(16, 64, gen, K=512, Ws=128, device="cuda", nb=20)
    o, l = sparse_attention(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    assert registry.last_choice("sparse_attention").kind == "dsl"
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    _check_close(o, l, ro, rl, "op (dsl)")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        og, lg = sparse_attention(q, swa, sidx, slen, sk, cache=comp, indices=cidx, lens=clen)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o) and torch.equal(lg, l)
    cidx.copy_(torch.flip(cidx, dims=[1]))          # same entries, other order: new lists in place
    clen.fill_(300)
    g.replay()
    torch.cuda.synchronize()
    ro, rl = sparse_attention_paged_ref(q, swa, sidx, slen, sk, comp, cidx, clen)
    _check_close(og, lg, ro, rl, "graph replay, new lists")


def test_dsl_provider_config_is_the_split_heuristic_cpu():
    """Issue 17 item 3: the dsl provider names the frozen :class:`SplitConfig` ``run`` launches (the one
    heuristic, :func:`choose_config`), explained in words."""
    import dataclasses

    from dsv4.ops.sparse_attention import SparseAttentionProblem
    from dsv4.target import Target
    pytest.importorskip("cutlass")
    from kernels_dsl.sparse_attention import choose_config
    p = registry.get_op("sparse_attention").provider("dsl")
    if isinstance(p, registry.Support):
        pytest.skip(p.reason)
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
    for T, H, entries, split in ((4, 64, 384, 2), (6, 16, 224, 1), (64, 64, 640, None), (2, 128, 2048, None)):
        cfg = p.config(SparseAttentionProblem("fp8_ds_mla", H, T, entries, split, "cuda"), h200)
        assert cfg == choose_config(T, H, entries, 132, split) and type(cfg).__dataclass_params__.frozen
        assert dataclasses.is_dataclass(cfg) and ("split" in str(cfg))
        if split is not None:
            assert cfg.num_splits == split
