"""Torch reference: DSV4 sparse attention with a per-head attention sink.

Source: dsv4_spec.md 2.2 (FLASH-REF kernel.py ``sparse_attn_kernel`` L276-368)::

    s_j = (q_h . kv_j) * softmax_scale                      # softmax_scale = 512^-0.5
    o_h = sum_j exp(s_j - m) kv_j / (sum_j exp(s_j - m) + exp(sink_h - m))

K = V = the full 512-d latent (rope dims included). Invalid entries (index -1 / ``valid``
False) contribute nothing. ``m`` is the max over valid scores and the sink.
"""
from __future__ import annotations

import torch

__all__ = ["sparse_attention_ref", "gather_rows"]


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


def sparse_attention_ref(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                         scale: float, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sparse attention over gathered entries with a per-head sink.

    Args:
        q: ``[T, H, D]`` queries (any float dtype).
        kv: ``[T, N, D]`` gathered keys = values for each query (K == V, MQA).
        valid: bool ``[T, N]``; False entries are ignored.
        sink: ``[H]`` per-head sink logits (natural-log units).
        scale: softmax scale (DSV4: ``head_dim ** -0.5`` = 512^-0.5).
        dtype: compute dtype (float32 or float64).

    Returns:
        ``[T, H, D]`` output in ``dtype``. A row with no valid entry returns zeros (the sink
        takes all the mass).

    Raises:
        ValueError: on mismatched shapes.
    """
    if q.dim() != 3 or kv.dim() != 3 or valid.shape != kv.shape[:2] or q.shape[0] != kv.shape[0] \
            or q.shape[-1] != kv.shape[-1] or sink.shape != (q.shape[1],):
        raise ValueError(f"sparse_attention_ref: expected q [T,H,D], kv [T,N,D], valid [T,N], sink [H]; got "
                         f"q {list(q.shape)}, kv {list(kv.shape)}, valid {list(valid.shape)}, sink {list(sink.shape)}")
    qf, kf = q.to(dtype), kv.to(dtype)
    s = torch.einsum("thd,tnd->thn", qf, kf) * scale                       # [T, H, N]
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sk = sink.to(dtype).view(1, -1, 1).expand(s.shape[0], -1, 1)           # [T, H, 1]
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sk)
    p = torch.exp(s - m)                                                    # exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True) + torch.exp(sk - m)
    return torch.einsum("thn,tnd->thd", p / denom, kf)
