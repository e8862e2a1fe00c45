"""Torch reference for the DSV4 Lightning Indexer (also the ``torch`` providers).

Math (dsv4_spec.md 2.4, FLASH-REF model.py L380-433)::

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . K[s])      h = 0..63, 128 dims, fp32 logits
    valid entries: ks[t] <= s < ke[t]  (causal C4 rule: ke = (pos_t + 1) // 4), else -inf

Formats of one 128-dim row (key or query head), ``FORMATS[fmt] = (value bytes VB, scale bytes SB)``:

* ``"mxfp4"`` (DSV4 default): 64 B packed E2M1 (element 2i low nibble) + 4 UE8M0 bytes (one per
  32 dims), DSV4 ``fp4_act_quant`` rule (:func:`dsv4.formats.quantize_mxfp4`, rule ``"dsv4"``).
* ``"nvfp4"``: 64 B packed E2M1 + 8 E4M3 bytes (one per 16 dims) + one fp32 global decode scale
  per tensor / per cache (:func:`dsv4.formats.quantize_nvfp4`, TransformerEngine order).
* ``"fp8"``: 128 E4M3 bytes + one fp32 power-of-two scale (4 B little endian) per row
  (:func:`dsv4.formats.quantize_fp8_block` block 128, ``"ue8m0"``; the DeepGEMM/V3.2 K cache).

Paged key cache ``uint8 [num_blocks, block_size, BPT]`` (BPT = VB + SB = 68 / 72 / 132): the
``[block_size, BPT]`` of a block is NOT row-major per token; per block, all value bytes come
first, then all scale bytes (vLLM ``DeepseekV4Indexer`` / DeepGEMM ``kv_cache_sf`` layout):

    values of token j in block b at byte  b*block_size*BPT + j*VB
    scales of token j in block b at byte  b*block_size*BPT + block_size*VB + j*SB

Hadamard (optional, the DSV4 reference rotates q and K): ``x -> bf16((H_128 x) * 128^-0.5)``
by :func:`dsv4.reference.hadamard.rotate_activation_ref` (the official ``rotate_activation``
asserts a bf16 input and returns bf16; fp32 butterflies in a fixed stage order, one fp32 scale multiply,
one RNE to bf16, then quantized: the contract and its bound vs the exact rotation are in
``dsv4.reference.hadamard``; every kernel is bit-exact with it).
"""
from __future__ import annotations

import torch

from ..formats import (dequantize_mxfp4, e2m1_decode, quantize_fp8_block,
                       quantize_mxfp4, quantize_nvfp4, unpack_e2m1)
from ..registry import TorchProvider
from .hadamard import rotate_activation_ref

__all__ = ["FORMATS", "HEADS", "DIM", "quantize_rows", "dequantize_rows", "cache_write_ref",
           "cache_split", "dequantize_cache", "q_quant_ref", "dequantize_q", "logits_ref",
           "paged_logits_ref", "causal_ranges", "normalize_context_lens", "topk_paged_ref"]

HEADS = 64
DIM = 128
#: fmt -> (value bytes, scale bytes) per 128-dim row
FORMATS = {"mxfp4": (64, 4), "nvfp4": (64, 8), "fp8": (128, 4)}


def _maybe_rotate(x: torch.Tensor, hadamard: bool) -> torch.Tensor:
    """fp32 values to quantize: ``bf16(Hadamard(x))`` (DSV4 ``rotate_activation``) or ``x``."""
    return rotate_activation_ref(x).float() if hadamard else x.float()


def quantize_rows(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None,
                  hadamard: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows ``x [..., 128]`` -> (values uint8 ``[..., VB]``, scale bytes uint8 ``[..., SB]``).

    ``global_scale`` (fp32 ``[1]``, the NVFP4 decode multiplier) is required for ``"nvfp4"``.
    """
    lead = x.shape[:-1]
    xf = _maybe_rotate(x, hadamard).reshape(-1, DIM)
    if fmt == "mxfp4":
        d, s = quantize_mxfp4(xf, rule="dsv4")
        vals, sf = d, s.view(torch.uint8)
    elif fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("quantize_rows: nvfp4 needs global_scale (fp32 [1] decode multiplier)")
        t = quantize_nvfp4(xf, global_scale=global_scale.float().reshape(1))
        vals, sf = t.data, t.scale.view(torch.uint8)
    elif fmt == "fp8":
        q, s = quantize_fp8_block(xf, 128, "ue8m0")
        vals, sf = q.view(torch.uint8), s.reshape(-1, 1).contiguous().view(torch.uint8)
    else:
        raise ValueError(f"unknown indexer format {fmt!r}; expected one of {sorted(FORMATS)}")
    vb, sb = FORMATS[fmt]
    return vals.reshape(*lead, vb).contiguous(), sf.reshape(*lead, sb).contiguous()


def dequantize_rows(vals: torch.Tensor, sf: torch.Tensor, fmt: str,
                    global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_rows` (no inverse Hadamard): fp32 ``[..., 128]``.

    nvfp4 returns ``e2m1 * e4m3`` (the global scale is NOT applied; callers multiply).
    """
    lead = vals.shape[:-1]
    v2, s2 = vals.reshape(-1, vals.shape[-1]), sf.reshape(-1, sf.shape[-1])
    if fmt == "mxfp4":
        out = dequantize_mxfp4(v2, s2.contiguous().view(torch.float8_e8m0fnu), torch.float32)
    elif fmt == "nvfp4":
        e = e2m1_decode(unpack_e2m1(v2))
        s = s2.contiguous().view(torch.float8_e4m3fn).float()
        out = e * s.repeat_interleave(16, dim=-1)
    elif fmt == "fp8":
        q = v2.contiguous().view(torch.float8_e4m3fn)
        s = s2.contiguous().view(torch.float32)
        out = q.float() * s  # one block of 128: e4m3 * power-of-two scale, exact in fp32
    else:
        raise ValueError(f"unknown indexer format {fmt!r}")
    return out.reshape(*lead, DIM)


def cache_split(cache: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the paged cache: values ``[num_blocks, block_size, VB]``, scales ``[num_blocks, block_size, SB]``."""
    vb, sb = FORMATS[fmt]
    nb, bs, bpt = cache.shape
    flat = cache.view(nb, bs * bpt)
    return flat[:, : bs * vb].view(nb, bs, vb), flat[:, bs * vb:].view(nb, bs, sb)


def cache_write_ref(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, fmt: str,
                    global_scale: torch.Tensor | None, hadamard: bool) -> None:
    """Quantize ``k [N, 128]`` and write token n at ``slot_mapping[n]`` in place. Slots outside
    ``[0, num_blocks * block_size)`` (-1 by convention) are skipped, as the CUDA kernel does.

    Reference only: the boolean selection of valid slots synchronizes with the host (the CUDA
    provider does not).
    """
    vals, sf = quantize_rows(k, fmt, global_scale, hadamard)
    cv, cs = cache_split(cache, fmt)
    bs = cache.shape[1]
    slot = slot_mapping.long()
    ok = (slot >= 0) & (slot < cache.shape[0] * bs)
    sl = slot[ok]
    cv[sl // bs, sl % bs] = vals[ok]
    cs[sl // bs, sl % bs] = sf[ok]


def dequantize_cache(cache: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[num_blocks, block_size, 128]`` real key values (nvfp4: times the global scale)."""
    cv, cs = cache_split(cache, fmt)
    out = dequantize_rows(cv, cs, fmt)
    if fmt == "nvfp4":
        out = out * global_scale.float().reshape(1, 1, 1)
    return out


def q_quant_ref(q: torch.Tensor, w: torch.Tensor, fmt: str, hadamard: bool,
                global_scale: torch.Tensor | None = None):
    """q ``[T, 64, 128]`` bf16, w ``[T, 64]`` fp32 -> (q values uint8 ``[T, 64, VB]``,
    q scales uint8 ``[T, 64, SB]`` (fp8: ``[T, 64, 0]``, empty), w' fp32 ``[T, 64]``).

    fp8: the per-(t, h) power-of-two scale is folded into the weights, ``w' = w * s`` (vLLM
    ``fused_indexer_q``); fp4 formats: ``w' = w`` (copy).
    """
    vals, sf = quantize_rows(q, fmt, global_scale, hadamard)
    if fmt == "fp8":
        s = sf.contiguous().view(torch.float32).reshape(w.shape)
        return vals, sf[..., :0].contiguous(), (w.float() * s).contiguous()
    return vals, sf, w.float().clone()


def dequantize_q(q_data: torch.Tensor, q_sf: torch.Tensor, fmt: str,
                 global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[T, 64, 128]`` of the quantized queries (fp8: the raw E4M3 values, scale in w';
    nvfp4: times the q global scale)."""
    if fmt == "fp8":
        return q_data.contiguous().view(torch.float8_e4m3fn).float()
    out = dequantize_rows(q_data, q_sf, fmt)
    if fmt == "nvfp4":
        out = out * global_scale.float().reshape(1, 1, 1)
    return out


def logits_ref(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor,
               *, dtype: torch.dtype = torch.float64, chunk: int = 64) -> torch.Tensor:
    """Dense reference ``I [T, S]`` fp32 from real values ``q [T, 64, 128]``, ``w [T, 64]``,
    ``k [S, 128]``; -inf outside ``[ks[t], ke[t])``. Math in ``dtype`` (fp64 default), chunked
    over T to bound memory."""
    T, S = q.shape[0], k.shape[0]
    out = torch.empty((T, S), dtype=torch.float32, device=q.device)
    kd = k.to(dtype)
    cols = torch.arange(S, device=q.device)
    for t0 in range(0, T, chunk):
        qd = q[t0:t0 + chunk].to(dtype)
        s = torch.einsum("thd,sd->ths", qd, kd).clamp_min_(0)
        logit = torch.einsum("ths,th->ts", s, w[t0:t0 + chunk].to(dtype))
        ok = (cols[None] >= ks[t0:t0 + chunk, None].long()) & (cols[None] < ke[t0:t0 + chunk, None].long())
        out[t0:t0 + chunk] = torch.where(ok, logit, torch.full_like(logit, float("-inf"))).float()
    return out


def normalize_context_lens(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per-row lengths ``[B, next_n]``: returned as is when given ``[B, next_n]`` (explicit
    per-row lengths, e.g. DeepGEMM's MTP token rule ``len - next_n + 1 + i``); a ``[B]`` tensor
    means that every one of the ``next_n`` rows of batch ``b`` sees ``context_lens[b]``
    committed entries (DSV4 decode over compressed C4 entries: the MTP tokens of a step share
    the entries committed before the step), i.e. it is broadcast along ``next_n``."""
    if context_lens.dim() == 2:
        return context_lens.to(torch.int32)
    return context_lens.to(torch.int32)[:, None].expand(-1, next_n)


def paged_logits_ref(q: torch.Tensor, w: torch.Tensor, kcache_real: torch.Tensor, lens: torch.Tensor,
                     block_table: torch.Tensor, max_ctx: int, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Decode reference: ``q [B, next_n, 64, 128]`` real, ``w [B*next_n, 64]``, ``kcache_real``
    ``[num_blocks, block_size, 128]`` real keys, ``lens [B, next_n]``, ``block_table [B, max_blocks]``
    -> fp32 ``[B*next_n, max_ctx]`` (-inf at columns >= the row's length, and at keys whose
    block_table entry is outside ``[0, num_blocks)``: such pages are never read, as in the kernel)."""
    B, nn = q.shape[:2]
    nb, bs = kcache_real.shape[:2]
    out = torch.full((B * nn, max_ctx), float("-inf"), dtype=torch.float32, device=q.device)
    s = torch.arange(max_ctx, device=q.device)
    for b in range(B):  # reference only (host loop over the batch)
        raw = block_table[b, (s // bs)].long()
        valid = (raw >= 0) & (raw < nb)
        kb = kcache_real[torch.where(valid, raw, 0), s % bs]               # [max_ctx, 128]
        zeros = torch.zeros(nn, dtype=torch.int32, device=q.device)
        o = logits_ref(q[b], w[b * nn:(b + 1) * nn], kb, zeros, lens[b], dtype=dtype)
        out[b * nn:(b + 1) * nn] = o.masked_fill(~valid[None, :], float("-inf"))
    return out


def causal_ranges(seq_lens: list[int], ratio: int = 4, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batched prefill of several sequences packed along T (each starting at position 0), keys
    = each sequence's compressed entries packed along S. Returns (ks, ke, pos) int32 ``[T]``:
    query t of a sequence at position p with key offset o sees ``[o, o + (p + 1) // ratio)``."""
    ks, ke, pos = [], [], []
    off = 0
    for L in seq_lens:
        p = torch.arange(L, dtype=torch.int32)
        ks.append(torch.full((L,), off, dtype=torch.int32))
        ke.append(off + (p + 1) // ratio)
        pos.append(p)
        off += L // ratio
    return (torch.cat(ks).to(device), torch.cat(ke).to(device), torch.cat(pos).to(device))


# ------------------------------------------------------------------------------------------
# providers
class TorchCacheWrite(TorchProvider):
    describe = "torch reference (formats quantizers, boolean slot select: not graph capturable)"

    def run(self, problem, *, cache, k, slot_mapping, global_scale):
        cache_write_ref(cache, k, slot_mapping, problem["fmt"], global_scale, problem["hadamard"])


class TorchQQuant(TorchProvider):
    describe = "torch reference"

    def run(self, problem, *, q, w, global_scale):
        return q_quant_ref(q, w, problem["fmt"], problem["hadamard"], global_scale)


class TorchLogits(TorchProvider):
    describe = "torch reference (dequantize, fp64 einsum, ReLU, weighted head sum)"

    def run(self, problem, *, q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global):
        fmt = problem["fmt"]
        qr = dequantize_q(q_data, q_sf, fmt, q_global)
        kr = dequantize_rows(k_data, k_sf, fmt)
        if fmt == "nvfp4":
            kr = kr * k_global.float()
        return logits_ref(qr, w, kr, ks, ke)


class TorchPagedLogits(TorchProvider):
    describe = "torch reference (gather pages, dequantize, fp64 einsum; host loop over the batch)"

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        fmt = problem["fmt"]
        B, nn = q_data.shape[:2]
        if B == 0:
            return torch.empty((0, problem["max_ctx"]), dtype=torch.float32, device=q_data.device)
        qr = dequantize_q(q_data.reshape(B * nn, HEADS, -1), q_sf.reshape(B * nn, HEADS, -1), fmt, q_global)
        kr = dequantize_cache(cache, fmt, k_global)
        return paged_logits_ref(qr.reshape(B, nn, HEADS, DIM), w, kr, lens, block_table, problem["max_ctx"])


def topk_paged_ref(logits: torch.Tensor, lens: torch.Tensor, block_table: torch.Tensor, k: int, block_size: int,
                   mapped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection of ``indexer_topk_paged`` on given logits ``[B*next_n, max_ctx]``: the topk
    op's reference (score desc, ties by lower position, -1 / -inf padding), lengths = the rows'
    ``lens [B, next_n]``, optional block_table mapping (rows_per_seq = next_n)."""
    from .topk import topk_ref
    nn = lens.shape[1]
    return topk_ref(logits, lens.reshape(-1), k, None, block_table if mapped else None,
                    block_size if mapped else 0, nn)


class TorchTopkPaged(TorchProvider):
    describe = "torch reference (paged logits reference, then the topk reference)"

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        logits = TorchPagedLogits.run(self, problem, q_data=q_data, q_sf=q_sf, w=w, cache=cache, lens=lens,
                                      block_table=block_table, q_global=q_global, k_global=k_global)
        return topk_paged_ref(logits, lens, block_table, problem["k"], problem["block_size"], problem["mapped"])


PROVIDERS = {
    "indexer_topk_paged": TorchTopkPaged,
    "indexer_cache_write": TorchCacheWrite,
    "indexer_q_quant": TorchQQuant,
    "indexer_logits": TorchLogits,
    "indexer_logits_paged": TorchPagedLogits,
}
