"""Torch provider of ``attn_lists``: the index builders of :mod:`dsv4.ops.sparse_attention`
(:func:`~dsv4.ops.sparse_attention.window_slots`, :func:`~dsv4.ops.sparse_attention.compressed_slots`,
:func:`~dsv4.ops.sparse_attention.hca_slots`) are the reference; this provider calls them (about
10 small torch launches per list) and returns fresh tensors (the custom op's outputs may not
alias its inputs)."""
from __future__ import annotations

import torch

from ..registry import TorchProvider

__all__ = ["attn_lists_ref", "PROVIDERS"]


def attn_lists_ref(positions, req_idx, swa_block_table, swa_block_size, window, ring, first, first_scalar,
                   swa_num_blocks, kind, block_table, block_size, entries, lens, max_entries, ratio, num_blocks):
    """The op's custom-op arguments (``ring`` 0 = linear, ``*num_blocks`` -1 = none) -> ``(swa_slots,
    swa_lens, slots, lens)``; ``slots`` is ``[T, 0]`` and ``lens`` ``[0]`` for ``kind="swa"``."""
    from ..ops.sparse_attention import compressed_slots, hca_slots, window_slots
    T = positions.shape[0]
    ws, wl = window_slots(positions, req_idx, swa_block_table, swa_block_size, window=window,
                          ring=ring if ring > 0 else None, first=first if first is not None else first_scalar,
                          num_blocks=swa_num_blocks if swa_num_blocks >= 0 else None)
    nb = num_blocks if num_blocks >= 0 else None
    if kind == "swa":
        cs = torch.empty((T, 0), dtype=torch.int32, device=positions.device)
        cl = torch.empty((0,), dtype=torch.int32, device=positions.device)
    elif kind == "csa":
        cs, cl = compressed_slots(entries, req_idx, block_table, block_size, lens=lens, num_blocks=nb)
        if lens is not None and cl.data_ptr() == lens.data_ptr():
            cl = cl.clone()
    else:
        cs, cl = hca_slots(positions, req_idx, block_table, block_size, max_entries, ratio=ratio, num_blocks=nb)
    return ws, wl, cs, cl


class TorchAttnLists(TorchProvider):
    describe = "torch reference: window_slots + compressed_slots / hca_slots (dsv4.ops.sparse_attention)"

    def run(self, problem, **args):
        return attn_lists_ref(**args)


PROVIDERS = {"attn_lists": TorchAttnLists}
