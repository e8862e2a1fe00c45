"""Torch reference for ``topk`` (also the ``torch`` provider).

Exact by construction: every selectable position gets a unique int64 composite key
``(key32(score) - 2^31) << 32 | (n - 1 - pos)`` where ``key32`` is the order-preserving uint32
image of the fp32 bits (-0.0 canonicalized to +0.0). Sorting that key descending gives score
descending, ties by lower index, with no reliance on sort stability or float comparisons; it is
the same total order the CUDA kernel selects with (kernels_cuda/topk.cu).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..registry import TorchProvider

_NEG_INF = float("-inf")


def composite_keys(logits: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[rows, n]`` composite keys (INT64_MIN where not selectable) and the valid mask.

    ``lo``/``hi``: int64 ``[rows]`` clamped range bounds. Selectable = ``lo <= pos < hi``, not
    NaN, not -inf.
    """
    rows, n = logits.shape
    x = logits.float()
    pos = torch.arange(n, device=x.device, dtype=torch.int64)
    valid = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None]) & ~torch.isnan(x) & (x != _NEG_INF)
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    u = torch.where(u == 0x80000000, torch.zeros_like(u), u)                 # -0.0 -> +0.0
    key = torch.where(u >= 0x80000000, 0xFFFFFFFF - u, u | 0x80000000)       # order-preserving
    comp = ((key - 0x80000000) << 32) + (n - 1 - pos)[None, :]
    comp = torch.where(valid, comp, torch.full_like(comp, torch.iinfo(torch.int64).min))
    return comp, valid


def topk_ref(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts: Optional[torch.Tensor] = None,
             block_table: Optional[torch.Tensor] = None, block_size: int = 0,
             rows_per_seq: int = 1, sorted: bool = True,
             num_blocks: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference top-k: ``(indices int32 [rows, k], scores fp32 [rows, k])``.

    Semantics as :func:`dsv4.ops.topk.topk`: range ``[clamp(starts, 0, hi), hi)`` with
    ``hi = clamp(lengths, 0, n)``; NaN / -inf never selected; sorted by score descending, ties
    by lower index; padding ``-1`` / ``-inf``; optional block_table mapping (-1 stays -1; an entry
    outside ``[0, num_blocks)`` -- only negative ones without ``num_blocks`` -- or a slot id past
    2^31 - 1 gives -1, the score is kept). ``sorted=False``: the same entries in ascending position
    order (padding last), the op's unsorted contract.
    """
    rows, n = logits.shape
    dev = logits.device
    hi = lengths.to(torch.int64).clamp(0, n)
    lo = torch.zeros_like(hi) if starts is None else torch.minimum(starts.to(torch.int64).clamp(min=0), hi)
    comp, valid = composite_keys(logits, lo, hi)
    if n < k:  # pad so that k columns exist
        pad = torch.full((rows, k - n), torch.iinfo(torch.int64).min, dtype=torch.int64, device=dev)
        comp = torch.cat([comp, pad], 1)
        valid = torch.cat([valid, torch.zeros((rows, k - n), dtype=torch.bool, device=dev)], 1)
    order = torch.sort(comp, dim=1, descending=True).indices[:, :k]          # keys unique where valid
    ok = valid.gather(1, order)
    idx = torch.where(ok, order, torch.full_like(order, -1))
    src = logits.float()
    if n < k:
        src = torch.cat([src, torch.zeros((rows, k - n), dtype=src.dtype, device=dev)], 1)
    scores = torch.where(ok, src.gather(1, order), torch.full(order.shape, _NEG_INF, device=dev))
    if not sorted:   # ascending position, padding (-1) last
        o = torch.sort(torch.where(ok, order, torch.full_like(order, torch.iinfo(torch.int64).max)), dim=1).indices
        idx, scores, ok = idx.gather(1, o), scores.gather(1, o), ok.gather(1, o)
    if block_table is not None:
        seq = torch.arange(rows, device=dev) // rows_per_seq
        b = idx.clamp(min=0) // block_size
        e = block_table.to(torch.int64)[seq[:, None], b]
        phys = e * block_size + idx.clamp(min=0) % block_size
        ok = (idx >= 0) & (e >= 0) & (phys <= 2 ** 31 - 1)
        if num_blocks is not None:
            ok &= e < num_blocks
        idx = torch.where(ok, phys, torch.full_like(idx, -1))
    return idx.to(torch.int32), scores.to(torch.float32)


class TorchTopk(TorchProvider):
    describe = "torch reference (int64 composite key sort, exact ties)"

    def run(self, problem, *, logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted=False,
            num_blocks=None):
        return topk_ref(logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted, num_blocks)


PROVIDERS = {"topk": TorchTopk}
