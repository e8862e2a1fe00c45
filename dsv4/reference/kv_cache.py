"""Torch references for the DSV4 KV cache ops (also the ``torch`` providers).

Formulas (dsv4_spec.md 2.2, 2.3, 2.7, 4.2, 4.4; FLASH-REF model.py ``Compressor.forward``,
``Attention.forward``, kernel.py ``act_quant`` / ``fp4_act_quant``):

* token quantization, attention (d = 512): nope dims [0, 448) in 7 blocks of 64:
  ``amax = max(max|x_blk|, 1e-4)``, ``s = 2^ceil(log2(amax * fp32(1/448)))`` (UE8M0),
  ``q = e4m3(clamp(x / s, +-448))``; rope dims [448, 512) stay BF16.
* indexer key (d = 128): ``mxfp4(x)`` per 32 (``dsv4.formats.quantize_mxfp4``, DSV4 rule).
* compressor (ratio r, coff = 2 if r == 4 else 1): rows = r tokens of the block (+ for r = 4
  the previous block's r tokens on channels [0:d], current block on [d:2d]; block 0's
  previous rows kv = 0, score = -inf); ``score += ape[t mod r]``; per-channel softmax over
  the rows; ``c = sum softmax * kv`` (fp32); ``c = bf16(c)``; RMSNorm
  ``bf16(w * (c * (1 / sqrt(mean(c^2) + eps))))``; RoPE on the last 64 dims at position
  ``b * r`` (interleaved pairs, fp32 products, bf16 result); indexer: Hadamard (bf16 result);
  then the cache quantization above.

Deliberate, documented choices (kernels do the same): ``rsqrt`` is computed as
``1 / sqrt`` (two IEEE roundings; the reference's GPU ``rsqrtf`` is approximate, so no
bit-exact target exists); the complex RoPE multiply is written with real fp32 ops (what
ATen's vectorized complex64 multiply computes).

The ``bf16`` cache formats store what the reference model's BF16 cache holds: the
fake-quantized values (dequant(quant(x))), so gathers from either format are identical.
"""
from __future__ import annotations

import torch

from ..formats.e2m1 import e2m1_decode, unpack_e2m1
from ..formats.mxfp4 import finite_absmax, quantize_mxfp4
from ..formats.scales import ue8m0_ceil, ue8m0_decode
from ..registry import TorchProvider
from .hadamard import rotate_activation_ref
from .rope import apply_rope

__all__ = [
    "KV_DIM", "NOPE", "ROPE", "DATA_BYTES", "SF_BYTES", "TOKEN_BYTES", "IDX_DIM", "IDX_VAL_BYTES",
    "IDX_SF_BYTES", "IDX_TOKEN_BYTES",
    "quant_fp8_ds_mla", "dequant_fp8_ds_mla", "fake_quant_fp8_ds_mla", "quant_idx_mxfp4",
    "dequant_idx_mxfp4", "fake_quant_idx_mxfp4", "paged_views", "cache_format", "read_slots",
    "kv_cache_append_ref", "kv_gather_ref", "compress_entries", "compress_pool_ref", "compress_finish_ref",
    "kv_compress_prefill_ref", "kv_compress_decode_ref",
]

KV_DIM, NOPE, ROPE = 512, 448, 64
DATA_BYTES, SF_BYTES, TOKEN_BYTES = 576, 8, 584
IDX_DIM, IDX_VAL_BYTES, IDX_SF_BYTES, IDX_TOKEN_BYTES = 128, 64, 4, 68
_INV448 = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()


# ------------------------------------------------------------------------------ token formats
def quant_fp8_ds_mla(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, 512]`` -> (``data`` uint8 ``[N, 576]`` = 448 E4M3 | 128 B BF16 rope, ``sf`` uint8 ``[N, 8]`` = 7 UE8M0 | pad 0)."""
    n = x.shape[0]
    blk = x[:, :NOPE].float().reshape(n, NOPE // 64, 64)
    amax = finite_absmax(blk, dim=-1, keepdim=True).clamp(min=1e-4)
    e8 = ue8m0_ceil(amax * _INV448)
    s = ue8m0_decode(e8)
    q = (blk / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE)
    rope = x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8).reshape(n, 2 * ROPE)
    sf = torch.cat([e8.view(torch.uint8).reshape(n, 7), torch.zeros(n, 1, dtype=torch.uint8, device=x.device)], 1)
    return torch.cat([q, rope], 1), sf


def dequant_fp8_ds_mla(data: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quant_fp8_ds_mla`: bf16 ``[N, 512]`` (``e4m3 * 2^(sf-127)`` is exact in bf16)."""
    n = data.shape[0]
    q = data[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(n, 7, 64)
    s = ue8m0_decode(sf[:, :7].contiguous().view(torch.float8_e8m0fnu)).unsqueeze(-1)
    nope = (q * s).reshape(n, NOPE).to(torch.bfloat16)
    rope = data[:, NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], 1)


def fake_quant_fp8_ds_mla(x: torch.Tensor) -> torch.Tensor:
    """``dequant(quant(x))`` as bf16: the reference model's BF16 KV cache content."""
    return dequant_fp8_ds_mla(*quant_fp8_ds_mla(x))


def quant_idx_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, 128]`` -> (uint8 ``[N, 64]`` packed E2M1, uint8 ``[N, 4]`` UE8M0), DSV4 rule."""
    d, s = quantize_mxfp4(x, "dsv4")
    return d, s.view(torch.uint8)


def dequant_idx_mxfp4(vals: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    v = e2m1_decode(unpack_e2m1(vals)).reshape(vals.shape[0], 4, 32)
    s = ue8m0_decode(sf.contiguous().view(torch.float8_e8m0fnu)).unsqueeze(-1)
    return (v * s).reshape(vals.shape[0], IDX_DIM).to(torch.bfloat16)


def fake_quant_idx_mxfp4(x: torch.Tensor) -> torch.Tensor:
    return dequant_idx_mxfp4(*quant_idx_mxfp4(x))


# ------------------------------------------------------------------------------ paged views
def cache_format(cache: torch.Tensor, d: int = KV_DIM) -> tuple[str, int]:
    """``(fmt, block_size)`` of a cache tensor: ``fp8_ds_mla`` / ``mxfp4`` (uint8 2-D) or ``bf16`` (3-D)."""
    if cache.dtype == torch.uint8:
        per = TOKEN_BYTES if d == KV_DIM else IDX_TOKEN_BYTES
        bs = cache.shape[1] if cache.dim() == 3 else cache.shape[1] // per
        return ("fp8_ds_mla" if d == KV_DIM else "mxfp4"), bs
    return "bf16", cache.shape[1]


def paged_views(cache: torch.Tensor, d: int = KV_DIM):
    """Writable views: quantized ``(data [nb, bs, 576|64], sf [nb, bs, 8|4])``; bf16 ``(cache, None)``."""
    fmt, bs = cache_format(cache, d)
    if fmt == "bf16":
        return cache, None
    vb, sb = (DATA_BYTES, SF_BYTES) if fmt == "fp8_ds_mla" else (IDX_VAL_BYTES, IDX_SF_BYTES)
    nb = cache.shape[0]
    cache = cache.reshape(nb, -1)   # a view (the cache is contiguous): [nb, bs * (vb + sb)]
    data = cache[:, : bs * vb].unflatten(1, (bs, vb))
    sf = cache[:, bs * vb: bs * (vb + sb)].unflatten(1, (bs, sb))
    assert data.shape == (nb, bs, vb) and sf.shape == (nb, bs, sb)
    return data, sf


def _write_rows(cache: torch.Tensor, d: int, page: torch.Tensor, off: torch.Tensor, y: torch.Tensor) -> None:
    """Store bf16 rows ``y [n, d]`` (pre-quantization values) at (page, off) in the cache's format."""
    fmt, _ = cache_format(cache, d)
    data, sf = paged_views(cache, d)
    if fmt == "bf16":
        data[page, off] = fake_quant_fp8_ds_mla(y) if d == KV_DIM else fake_quant_idx_mxfp4(y)
        return
    v, s = quant_fp8_ds_mla(y) if fmt == "fp8_ds_mla" else quant_idx_mxfp4(y)
    data[page, off] = v
    sf[page, off] = s


def read_slots(cache: torch.Tensor, slots: torch.Tensor, d: int = KV_DIM) -> torch.Tensor:
    """Dequantized bf16 rows ``[n, d]`` at physical slot ids (``page * bs + off``, all valid)."""
    fmt, bs = cache_format(cache, d)
    data, sf = paged_views(cache, d)
    page, off = slots.long() // bs, slots.long() % bs
    if fmt == "bf16":
        return data[page, off]
    if fmt == "fp8_ds_mla":
        return dequant_fp8_ds_mla(data[page, off], sf[page, off])
    return dequant_idx_mxfp4(data[page, off], sf[page, off])


# ------------------------------------------------------------------------------ append / gather
def kv_cache_append_ref(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize ``kv [N, 512]`` into ``cache`` at ``slot_mapping`` (-1 or >= nb*bs: skipped)."""
    fmt, bs = cache_format(cache)
    n_slots = cache.shape[0] * bs
    ok = (slot_mapping >= 0) & (slot_mapping < n_slots)
    slots = slot_mapping[ok].long()
    _write_rows(cache, KV_DIM, slots // bs, slots % bs, kv[ok])


def _resolve(cache, block_table, idx, req, lens):
    """logical index [T, n] -> (valid mask, page, off); invalid -> page 0. Valid: ``0 <= l <
    lens[req]``, ``req`` a block_table row, ``l // bs`` a block_table column, page in ``[0, nb)``."""
    _, bs = cache_format(cache)
    nb = cache.shape[0]
    rows, cols = block_table.shape
    l = idx.long()
    r = req.long().view(-1, 1).expand_as(l)
    pi = torch.div(l, bs, rounding_mode="floor")
    valid = (l >= 0) & (pi < cols) & (r >= 0) & (r < rows)
    if block_table.numel() == 0:                    # no pages at all: every row is zero
        z = torch.zeros_like(l)
        return valid & False, z, z
    rc = r.clamp(0, rows - 1)
    valid &= l < lens.long()[rc]
    page = block_table[rc, pi.clamp(0, cols - 1)].long()
    valid &= (page >= 0) & (page < nb)
    return valid, torch.where(valid, page, 0), torch.where(valid, l % bs, 0)


def _gather_part(cache, block_table, idx, req, lens):
    valid, page, off = _resolve(cache, block_table, idx, req, lens)
    fmt, bs = cache_format(cache)
    rows = read_slots(cache, (page * bs + off).reshape(-1)).reshape(*idx.shape, KV_DIM)
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def kv_gather_ref(cache, block_table, indices, lens, req_idx=None, swa_cache=None, swa_block_table=None,
                  swa_indices=None, swa_lens=None) -> torch.Tensor:
    """bf16 ``[T, W + K, 512]``: SWA rows (``swa_indices``) then compressed rows (``indices``).
    An index ``l`` of query ``t`` (request ``r = req_idx[t]``) is read only when ``0 <= l <
    lens[r]`` (``swa_lens[r]`` for the SWA part) and its page is valid; otherwise the row is 0."""
    T = indices.shape[0]
    req = req_idx if req_idx is not None else torch.arange(T, device=indices.device)
    parts = []
    if swa_indices is not None:
        parts.append(_gather_part(swa_cache, swa_block_table, swa_indices, req, swa_lens))
    parts.append(_gather_part(cache, block_table, indices, req, lens))
    return torch.cat(parts, 1)


# ------------------------------------------------------------------------------ compressor
def compress_lengths(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """int64 ``[B]`` token count of each sequence under the kernels' bad-input rule
    (kernels_cuda/kv_cache.cu ``kvc_find_entry``): a sequence whose range ``[cu[i], cu[i+1])`` is
    not inside ``[0, T]`` (decreasing, negative, past ``T``) counts as empty (device-side, no sync)."""
    cu = cu_seqlens.long()
    s0, s1 = cu[:-1], cu[1:]
    ok = (s0 >= 0) & (s1 >= s0) & (s1 <= T)
    return torch.where(ok, s1 - s0, torch.zeros_like(s0))


def compress_entries(cu_seqlens: torch.Tensor, ratio: int, T: int | None = None):
    """(seq [E], b [E]) of every complete block of every sequence, in entry order (``T``: the
    tokens of kv; sequences outside ``[0, T]`` are empty, :func:`compress_lengths`)."""
    cu = cu_seqlens.long()
    cnt = (compress_lengths(cu, T) if T is not None else (cu[1:] - cu[:-1]).clamp(min=0)) // ratio
    seq = torch.repeat_interleave(torch.arange(cnt.numel(), device=cu.device), cnt)
    first = torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
    b = torch.arange(seq.numel(), device=cu.device) - first
    return seq, b


def compress_pool_ref(kv, score, ape, cu_seqlens, ratio, dtype=torch.float32):
    """Softmax-gated pooling of every complete block (model.py L322-341), ``[E, d]`` in ``dtype``."""
    d = ape.shape[1] // (2 if ratio == 4 else 1)
    seq, b = compress_entries(cu_seqlens, ratio, kv.shape[0])
    tok0 = cu_seqlens.long()[seq] + b * ratio                           # [E]
    ar = torch.arange(ratio, device=kv.device)
    idx = tok0.unsqueeze(1) + ar                                        # [E, r]
    kvf, scf, apef = kv.to(dtype), score.to(dtype), ape.to(dtype)
    k_cur, s_cur = kvf[idx], scf[idx] + apef
    if ratio == 4:
        has_prev = (b > 0).view(-1, 1, 1)
        pidx = (idx - ratio).clamp(min=0)
        k_prev = torch.where(has_prev, kvf[pidx][..., :d], torch.zeros((), dtype=dtype, device=kv.device))
        s_prev = torch.where(has_prev, (scf[pidx] + apef)[..., :d],
                             torch.full((), float("-inf"), dtype=dtype, device=kv.device))
        rows_k = torch.cat([k_prev, k_cur[..., d:]], 1)
        rows_s = torch.cat([s_prev, s_cur[..., d:]], 1)
    else:
        rows_k, rows_s = k_cur, s_cur
    return (rows_k * rows_s.softmax(dim=1)).sum(dim=1), seq, b


def compress_finish_ref(pooled, b, ratio, norm_weight, rope_cos_sin, eps=1e-6):
    """pooled fp32 ``[E, d]`` -> bf16 pre-quantization values ``[E, d]`` (RMSNorm, RoPE, Hadamard for d=128)."""
    d = pooled.shape[1]
    x = pooled.float().to(torch.bfloat16).float()
    var = x.square().mean(-1, keepdim=True)
    r = torch.reciprocal(torch.sqrt(var + eps))
    y = (norm_weight.float() * (x * r)).to(torch.bfloat16)
    pos = (b.long() * ratio).clamp(max=rope_cos_sin.shape[0] - 1)
    rope = apply_rope(y[:, d - ROPE:], pos, rope_cos_sin).to(torch.bfloat16)
    y = torch.cat([y[:, : d - ROPE], rope], 1)
    if d == IDX_DIM:
        y = rotate_activation_ref(y)   # rotate_activation: bf16 in, bf16 out (fp32 butterflies, dsv4.reference.hadamard)
    return y


def _entry_slots(cache, d, block_table, seq, b):
    fmt, bs = cache_format(cache, d)
    nb = cache.shape[0]
    cols = block_table.shape[1]
    pi = b.long() // bs
    ok = pi < cols
    page = block_table[seq.long(), pi.clamp(max=cols - 1)].long()
    ok &= (page >= 0) & (page < nb)
    return ok, page, b.long() % bs


def kv_compress_prefill_ref(kv, score, ape, norm_weight, rope_cos_sin, cu_seqlens, block_table, cache,
                            kv_state=None, score_state=None, eps=1e-6) -> None:
    """Prefill compressor: every complete block of every sequence (positions from 0) -> cache;
    the tail (and the overlap block) -> decode state (model.py L323-341)."""
    ratio = ape.shape[0]
    d = norm_weight.shape[0]
    pooled, seq, b = compress_pool_ref(kv, score, ape, cu_seqlens, ratio)
    y = compress_finish_ref(pooled, b, ratio, norm_weight, rope_cos_sin, eps)
    ok, page, off = _entry_slots(cache, d, block_table, seq, b)
    _write_rows(cache, d, page[ok], off[ok], y[ok])
    if kv_state is not None:
        _prefill_state_ref(kv, score, ape, cu_seqlens, ratio, kv_state, score_state)


def _prefill_state_ref(kv, score, ape, cu_seqlens, ratio, kv_state, score_state):
    B = cu_seqlens.numel() - 1
    nr = kv_state.shape[1]
    cu = cu_seqlens.long()
    L = compress_lengths(cu, kv.shape[0])       # sequences outside [0, T]: empty, state (0, -inf)
    cutoff = L - L % ratio
    rem = L % ratio
    row = torch.arange(nr, device=kv.device)
    if ratio == 4:
        prev = row < ratio
        tok = torch.where(prev, cutoff.view(-1, 1) - ratio + row, cutoff.view(-1, 1) + row - ratio)
        valid = torch.where(prev, (cutoff >= ratio).view(-1, 1), (row - ratio).view(1, -1) < rem.view(-1, 1))
    else:
        tok = cutoff.view(-1, 1) + row
        valid = row.view(1, -1) < rem.view(-1, 1)
    g = (cu[:-1].view(-1, 1) + tok).clamp(0, max(kv.shape[0] - 1, 0))
    if kv.shape[0] == 0:  # nothing to copy: every row is (0, -inf)
        kf = sf_ = torch.zeros(B, nr, kv.shape[1], device=kv.device)
    else:
        kf, sf_ = kv.float()[g], score.float()[g] + ape.float()[row % ratio]
    kst = torch.where(valid.unsqueeze(-1), kf, torch.zeros((), device=kv.device))
    sst = torch.where(valid.unsqueeze(-1), sf_, torch.full((), float("-inf"), device=kv.device))
    kv_state[:B] = kst
    score_state[:B] = sst


def kv_compress_decode_ref(kv, score, ape, norm_weight, rope_cos_sin, positions, block_table, cache,
                           kv_state, score_state, eps=1e-6) -> None:
    """One decode step per sequence (model.py L342-358): append the token to the FP32 state,
    at a block boundary pool the state, shift the overlap rows, write the entry."""
    ratio = ape.shape[0]
    d = norm_weight.shape[0]
    B = positions.shape[0]
    p = positions.long()
    act = (p >= 0).nonzero().flatten()
    pa = p[act]
    j = pa % ratio
    row = j + (ratio if ratio == 4 else 0)
    kv_state[act, row] = kv[act].float()
    score_state[act, row] = score[act].float() + ape.float()[j]
    comp = act[((pa + 1) % ratio) == 0]
    if comp.numel() == 0:
        return
    ks, ss = kv_state[comp], score_state[comp]
    if ratio == 4:
        rows_k = torch.cat([ks[:, :ratio, :d], ks[:, ratio:, d:]], 1)
        rows_s = torch.cat([ss[:, :ratio, :d], ss[:, ratio:, d:]], 1)
        kv_state[comp, :ratio] = ks[:, ratio:]
        score_state[comp, :ratio] = ss[:, ratio:]
    else:
        rows_k, rows_s = ks, ss
    pooled = (rows_k * rows_s.softmax(dim=1)).sum(dim=1)
    b = p[comp] // ratio
    y = compress_finish_ref(pooled, b, ratio, norm_weight, rope_cos_sin, eps)
    ok, page, off = _entry_slots(cache, d, block_table, comp, b)
    _write_rows(cache, d, page[ok], off[ok], y[ok])


# ------------------------------------------------------------------------------ providers
class TorchKvCacheAppend(TorchProvider):
    describe = "torch reference: act_quant(block 64, ue8m0) + scatter"

    def run(self, problem, *, cache, kv, slot_mapping):
        kv_cache_append_ref(cache, kv, slot_mapping)


class TorchKvGather(TorchProvider):
    describe = "torch reference: block_table lookup + dequant, -1 / past lens -> zeros"

    def run(self, problem, *, cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table, swa_indices,
            swa_lens):
        return kv_gather_ref(cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table, swa_indices,
                             swa_lens)


class TorchKvCompressPrefill(TorchProvider):
    describe = "torch reference: model.py Compressor (softmax pooling, RMSNorm, RoPE, quant)"

    def run(self, problem, **tensors):  # the op's operands, named as the reference's arguments
        kv_compress_prefill_ref(**tensors, eps=problem["eps"])


class TorchKvCompressDecode(TorchProvider):
    describe = "torch reference: model.py Compressor decode step"

    def run(self, problem, **tensors):
        kv_compress_decode_ref(**tensors, eps=problem["eps"])


PROVIDERS = {
    "kv_cache_append": TorchKvCacheAppend,
    "kv_gather": TorchKvGather,
    "kv_compress_prefill": TorchKvCompressPrefill,
    "kv_compress_decode": TorchKvCompressDecode,
}
