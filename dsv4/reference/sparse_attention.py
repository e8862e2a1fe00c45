"""Torch reference: DSV4 sparse attention with a per-head attention sink (also the ``torch`` provider).

Source: dsv4_spec.md 2.2 / 4.4 (FLASH-REF kernel.py ``sparse_attn_kernel`` L276-368)::

    s_j = (q_h . kv_j) * softmax_scale                      # softmax_scale = 512^-0.5
    o_h = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink_h - m))
    lse = ln(sum_j exp(s_j) + exp(sink_h))                  # natural log, the sink included

K = V = the full 512-d latent (rope dims included). Invalid entries (index -1 / ``valid``
False) contribute nothing. ``m`` is the max over valid scores and the sink.

:func:`sparse_attention_paged_ref` is the op's reference: it resolves each row's slot lists
(``dsv4.ops.sparse_attention``: physical slots, entries past the length / ``-1`` / out of range
= none), dequantizes the rows exactly as ``kv_gather`` does (``read_slots``) and runs
:func:`sparse_attention_ref` in fp32 (or fp64).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..registry import TorchProvider
from .kv_cache import KV_DIM, cache_format, read_slots

__all__ = ["sparse_attention_ref", "sparse_attention_lse_ref", "gather_rows", "gather_slots",
           "sparse_attention_paged_ref", "PROVIDERS"]


def gather_rows(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather ``kv[indices]`` with -1 -> zero row.

    Args:
        kv: ``[N, D]`` rows.
        indices: int ``[T, n]`` with -1 for "no entry".
    Returns:
        (``[T, n, D]`` gathered rows, ``[T, n]`` bool valid mask).
    """
    valid = indices >= 0
    g = kv[indices.clamp_min(0).long()]
    return g * valid.unsqueeze(-1).to(g.dtype), valid


def _check(q, kv, valid, sink):
    if q.dim() != 3 or kv.dim() != 3 or valid.shape != kv.shape[:2] or q.shape[0] != kv.shape[0] \
            or q.shape[-1] != kv.shape[-1] or (sink is not None and sink.shape != (q.shape[1],)):
        raise ValueError(f"sparse_attention_ref: expected q [T,H,D], kv [T,N,D], valid [T,N], sink [H]; got "
                         f"q {list(q.shape)}, kv {list(kv.shape)}, valid {list(valid.shape)}, "
                         f"sink {None if sink is None else list(sink.shape)}")


def sparse_attention_lse_ref(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: Optional[torch.Tensor],
                             scale: float, *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over gathered entries with a per-head sink, and its log-sum-exp.

    Args:
        q: ``[T, H, D]`` queries (any float dtype).
        kv: ``[T, N, D]`` gathered keys = values for each query (K == V, MQA).
        valid: bool ``[T, N]``; False entries are ignored.
        sink: ``[H]`` per-head sink logits (natural-log units), or None (no sink).
        scale: softmax scale (DSV4: ``head_dim ** -0.5`` = 512^-0.5).
        dtype: compute dtype (float32 or float64).

    Returns:
        (``out [T, H, D]``, ``lse [T, H]``) in ``dtype``: ``lse = ln(exp(sink) + sum_valid exp(s))``.
        A row with no valid entry returns zeros and ``lse = sink`` (``-inf`` without a sink).

    Raises:
        ValueError: on mismatched shapes.
    """
    _check(q, kv, valid, sink)
    qf, kf = q.to(dtype), kv.to(dtype)
    s = torch.einsum("thd,tnd->thn", qf, kf) * scale                       # [T, H, N]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    if sink is None:
        sk = torch.full((s.shape[0], s.shape[1], 1), float("-inf"), dtype=dtype, device=s.device)
    else:
        sk = sink.to(dtype).view(1, -1, 1).expand(s.shape[0], -1, 1)       # [T, H, 1]
    m = torch.maximum(s.amax(dim=-1, keepdim=True) if s.shape[-1] else sk, sk)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)                                               # exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sk - m_safe)
    out = torch.einsum("thn,tnd->thd", p / torch.where(denom > 0, denom, torch.ones_like(denom)), kf)
    lse = (m_safe + torch.log(denom)).squeeze(-1)
    return out, lse


def sparse_attention_ref(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                         scale: float, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The output of :func:`sparse_attention_lse_ref` (same arguments): ``[T, H, D]`` in ``dtype``."""
    return sparse_attention_lse_ref(q, kv, valid, sink, scale, dtype=dtype)[0]


def gather_slots(cache: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized rows of physical ``slots [T, n]`` (entries ``>= lens[t]``, ``-1`` and slots outside
    ``[0, num_blocks * bs)`` invalid -> zero rows): (bf16 ``[T, n, 512]``, bool valid ``[T, n]``)."""
    _, bs = cache_format(cache, KV_DIM)
    n_slots = cache.shape[0] * bs
    T, n = slots.shape
    col = torch.arange(n, device=slots.device).view(1, -1)
    valid = (slots >= 0) & (slots < n_slots) & (col < lens.view(-1, 1).long())
    safe = torch.where(valid, slots, torch.zeros_like(slots)).reshape(-1)
    rows = read_slots(cache, safe).reshape(T, n, KV_DIM) if T * n else \
        torch.zeros((T, n, KV_DIM), dtype=torch.bfloat16, device=slots.device)
    return torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device)), valid


def sparse_attention_paged_ref(q, swa_cache, swa_indices, swa_lens, sink=None, cache=None, indices=None, lens=None,
                               scale: float = KV_DIM ** -0.5, *, dtype: torch.dtype = torch.float32
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's math on the caches: ``(out [T, H, 512], lse [T, H])`` in ``dtype`` (not rounded)."""
    kv, valid = gather_slots(swa_cache, swa_indices, swa_lens)
    if cache is not None:
        kc, vc = gather_slots(cache, indices, lens)
        kv, valid = torch.cat([kv, kc], 1), torch.cat([valid, vc], 1)
    return sparse_attention_lse_ref(q, kv, valid, sink, scale, dtype=dtype)


class TorchSparseAttention(TorchProvider):
    describe = "torch reference: gather + dequantize the listed rows, fp32 softmax with the sink"

    def run(self, problem, *, q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale, num_splits):
        out, lse = sparse_attention_paged_ref(q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale)
        return out.to(torch.bfloat16), lse.float()


PROVIDERS = {"sparse_attention": TorchSparseAttention}
