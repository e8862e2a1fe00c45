"""DSV4 sparse attention with a per-head sink over the paged KV caches (decode and prefill).

Op :func:`sparse_attention` (one registered op, ``torch.ops.dsv4.sparse_attention``; providers
``kernels_dsl/sparse_attention.py`` and ``dsv4/reference/sparse_attention.py``) and the wrapper
:func:`sparse_attention_decode` (``[B, next_n, ...]`` shapes). Every query row ``t`` (decode:
``t = b * next_n + i``; prefill: every token of a ragged batch) attends with its ``H`` heads to
its own key set: the first ``swa_lens[t]`` slots of ``swa_indices[t]`` in the SWA cache and the
first ``lens[t]`` slots of ``indices[t]`` in the compressed cache (CSA: the indexer's top-k; HCA:
every causally available entry), one softmax over the union with the sink
(dsv4_spec.md 2.2, 4.4; FLASH-REF kernel.py ``sparse_attn_kernel``)::

    s_j   = (q[t, h] . kv_j) * scale                   scale = 512^-0.5 (head_dim^-0.5)
    out   = sum_j exp(s_j - lse) kv_j                  K = V = the full 512-d latent (rope dims too)
    lse   = ln(exp(sink[h]) + sum_j exp(s_j))          natural log, the sink included

``kv_j`` = the dequantized cache row (fp8_ds_mla: ``e4m3 * 2^(sf - 127)`` exact in bf16, rope
dims bf16). Index values are **physical slot ids** ``page * block_size + offset`` of the cache
they index: the op :func:`dsv4.ops.attn_lists.attn_lists` builds the window and CSA / HCA lists in
one launch (CuTe DSL on sm_90a); the torch helpers :func:`window_slots`, :func:`compressed_slots`,
:func:`hca_slots` define them (its reference) from positions, logical entry ids and block tables. Entries past a row's
length, ``-1`` and any value outside ``[0, num_blocks * block_size)`` contribute nothing and are
never dereferenced (device-side, no check, no sync); duplicates count once per occurrence (as in
the reference's gather). A row with no valid entry returns ``out = 0`` and ``lse = sink[h]``
(``-inf`` without a sink): the sink takes all the mass.

Merging with another partial result ``(o2, lse2)`` computed *without* a sink over a disjoint key
set: ``lse' = logaddexp(lse, lse2)``, ``out' = exp(lse - lse') out + exp(lse2 - lse') o2`` (this
op's ``lse`` already holds the sink exactly once).

Precision contract (the dsl provider; tests/test_sparse_attention.py): same dequantized KV as the
reference, BF16 tensor-core products with FP32 accumulation, probabilities rounded to bf16 for
the PV product (as FlashMLA): ``|out - out_ref| <= 2e-3 * max|out_ref| + ulp_bf16(out_ref) / 2``
(the second term is the bf16 output rounding) and ``|lse - lse_ref| <= 1e-3 + 2e-6 * |lse_ref|``
(the relative term is the FP32 accumulation of 512-dim scores: with the heavy-scale-spread test
caches ``|lse|`` reaches ~930, where 1e-3 is 16 fp32 ulps; measured: docs/benchmarks.md),
against the fp32 reference on the same dequantized rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._common import dtype_name
from ._plan import planned
from .kv_cache import _CACHE_PACKING, _cache_info, _cache_pair, _check_ids

__all__ = ["sparse_attention", "sparse_attention_decode", "window_slots", "compressed_slots", "hca_slots",
           "HEAD_DIM", "WINDOW", "DEFAULT_SCALE"]

HEAD_DIM = 512
WINDOW = 128
DEFAULT_SCALE = HEAD_DIM ** -0.5
_SOURCE = ("dsv4_spec.md 2.2 / 4.4 (FLASH-REF model.py Attention L436-543, kernel.py sparse_attn_kernel L276-368); "
           "FlashMLA flash_mla_with_kvcache (indices / extra_indices, topk_length, attn_sink, lse); "
           "vLLM DSV4 fp8_ds_mla cache")

SPEC = OpSpec(
    name="sparse_attention",
    summary="Sparse attention with a per-head sink over the SWA + compressed fp8_ds_mla caches: one softmax over "
            "each query row's own slot lists; out bf16 [T, H, 512] + natural-log LSE.",
    inputs=(
        TensorSpec("q", torch.bfloat16, ("T", "H", 512), doc="queries (after q_norm + RoPE), 64-head blocks per CTA"),
        TensorSpec("swa_cache", (torch.uint8, torch.bfloat16), ("swa_blocks", "Ws_bytes"), packing=_CACHE_PACKING,
                   doc="SWA window cache (ring or linear pages); bf16 form [num_blocks, bs, 512] (torch provider only)"),
        TensorSpec("swa_indices", torch.int32, ("T", "Ws"), align=4,
                   doc="physical SWA slots page*bs+off per row; entries >= swa_lens[t], -1, out of range = none"),
        TensorSpec("swa_lens", torch.int32, ("T",), align=4, doc="valid prefix length of each row's SWA list"),
        TensorSpec("sink", torch.float32, ("H",), align=4, optional=True,
                   doc="per-head attention sink (natural-log units); None = no sink"),
        TensorSpec("cache", (torch.uint8, torch.bfloat16), ("num_blocks", "Wc_bytes"), optional=True,
                   packing="same format as swa_cache", doc="compressed cache (CSA top-k / HCA entries)"),
        TensorSpec("indices", torch.int32, ("T", "K"), align=4, optional=True,
                   doc="physical compressed slots per row (CSA: top-k, HCA: all causal entries); -1 = none"),
        TensorSpec("lens", torch.int32, ("T",), align=4, optional=True, doc="valid prefix length of each row's list"),
    ),
    outputs=(TensorSpec("out", torch.bfloat16, ("T", "H", 512), doc="sum_j exp(s_j - lse) kv_j"),
             TensorSpec("lse", torch.float32, ("T", "H"), align=4,
                        doc="ln(exp(sink_h) + sum_j exp(s_j)), natural log, sink included; empty row: sink_h")),
    params=(Param("scale", "float", "> 0", "softmax scale, default 512^-0.5"),
            Param("num_splits", "int or None", ">= 1", "KV splits per row (None: heuristic; >1 adds a combine pass)"),
            Param("debug_check", "bool", "{False, True}", "validate index values on the host (syncs)")),
    formula="s_j = scale * q[t,h].kv_j over j in swa[t, :swa_lens[t]] ++ comp[t, :lens[t]] (valid slots); "
            "lse = ln(exp(sink_h) + sum_j exp(s_j)); out = sum_j exp(s_j - lse) kv_j; kv_j = dequant(cache row), "
            "rope dims included in K and V",
    source=_SOURCE,
    notes="Index values outside [0, num_blocks * block_size) and -1 are treated as empty entries on the device "
          "(never dereferenced). One launch (plus one combine launch with KV splits; T > 65535 rows: one per 65535-row "
          "chunk, gridDim.y), no host sync, CUDA-graph capturable.",
)


@dataclass(frozen=True)
class SparseAttentionProblem(Problem):
    """What selects the ``sparse_attention`` provider: cache format, heads, rows, entries per row,
    the forced KV split (None = heuristic)."""

    fmt: str            # "fp8_ds_mla" | "bf16"
    H: int
    T: int
    entries: int        # window + compressed entries per row
    split: Optional[int]
    device: str


def _example(target: Target) -> SparseAttentionProblem:
    return SparseAttentionProblem("fp8_ds_mla", 64, 64, 640, None, target.device_type)


#: dsl (kernels_dsl/sparse_attention.py, validated on the H200) first; torch = the reference, any device.
OP = register(Op("sparse_attention", SPEC, kinds=("dsl", "torch"), example_problem=_example))


@custom_op("dsv4::sparse_attention", mutates_args=())
def _sparse_attention_op(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                         swa_lens: torch.Tensor, sink: Optional[torch.Tensor], cache: Optional[torch.Tensor],
                         indices: Optional[torch.Tensor], lens: Optional[torch.Tensor], scale: float,
                         num_splits: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    fmt, _ = _cache_info(swa_cache, HEAD_DIM, "swa_cache")
    entries = swa_indices.shape[1] + (indices.shape[1] if indices is not None else 0)
    problem = SparseAttentionProblem(fmt, q.shape[1], q.shape[0], entries, num_splits, q.device.type)
    return OP.dispatch(problem, Target.of(q.device), q=q, swa_cache=swa_cache, swa_indices=swa_indices,
                       swa_lens=swa_lens, sink=sink, cache=cache, indices=indices, lens=lens, scale=scale,
                       num_splits=num_splits)


@_sparse_attention_op.register_fake
def _(q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale, num_splits):
    T, H = q.shape[0], q.shape[1]
    return q.new_empty((T, H, HEAD_DIM)), q.new_empty((T, H), dtype=torch.float32)


def _check_lists(name: str, idx: torch.Tensor, lens_name: str, lens: torch.Tensor, n_slots: int) -> None:
    _check_ids(f"sparse_attention: {name}", idx, n_slots, "num_blocks * block_size")
    if bool((lens < 0).any()) or bool((lens > idx.shape[1]).any()):
        raise ValueError(f"sparse_attention: {lens_name} must lie in [0, {idx.shape[1]}]")


@planned
def sparse_attention(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor, swa_lens: torch.Tensor,
                     sink: Optional[torch.Tensor] = None, *, cache: Optional[torch.Tensor] = None,
                     indices: Optional[torch.Tensor] = None, lens: Optional[torch.Tensor] = None,
                     scale: float = DEFAULT_SCALE, num_splits: Optional[int] = None,
                     debug_check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention with sink over per-row slot lists of two paged DSV4 KV caches.

    Args:
        q: bfloat16 ``[T, H, 512]`` contiguous (any ``H >= 1``; the kernel processes heads in
            blocks of 64 and never reads or writes past ``H``).
        swa_cache: the SWA cache, uint8 fp8_ds_mla ``[num_blocks, bs * 584]`` (or
            ``[num_blocks, bs, 584]``, bs even) or bfloat16 ``[num_blocks, bs, 512]`` (torch
            provider). Byte layout: ``kv_cache_append``.
        swa_indices: int32 ``[T, Ws]`` physical slots (``page * bs + off``) of the row's window.
        swa_lens: int32 ``[T]`` entries of ``swa_indices[t]`` to use (clamped to ``[0, Ws]`` on the device).
        sink: float32 ``[H]`` per-head sink logits (natural-log units), or None (no sink).
        cache, indices, lens: the compressed cache (same format as ``swa_cache``, its own page
            size), int32 ``[T, K]`` physical slots and int32 ``[T]`` lengths: all three or none
            (SWA-only layers).
        scale: softmax scale (DSV4: ``512 ** -0.5``; no YaRN mscale).
        num_splits: KV splits per row (None: chosen by the provider from T, H, the list width
            and the SM count; >1 writes fp32 partials and merges them in a second launch).
        debug_check: validate on the host (syncs) that every index is in ``[-1, num_slots)`` and
            every length in ``[0, width]``; without it bad values are treated as empty entries.

    Returns:
        ``(out, lse)``: bfloat16 ``[T, H, 512]`` and float32 ``[T, H]``, ``lse`` the natural-log
        normalizer including the sink (module docstring: formula, merge rule, empty rows).

    Raises:
        LayoutError: dtype / shape / contiguity / alignment / device / cache-format mismatch
            (names the argument).
        ValueError: partial compressed arguments, ``scale`` not a finite number > 0, ``num_splits``
            not None or an int >= 1, ``debug_check`` not a bool, or a ``debug_check`` failure.

    Source: dsv4_spec.md 2.2, 4.4 (FLASH-REF kernel.py ``sparse_attn_kernel``); FlashMLA
    ``flash_mla_with_kvcache`` (sparse FP8, ``extra_indices``, ``attn_sink``).
    """
    args = validate_args(q, swa_cache, swa_indices, swa_lens, sink, cache=cache, indices=indices, lens=lens,
                         scale=scale, num_splits=num_splits, debug_check=debug_check)
    return _sparse_attention_op(*args)


#: the operands :func:`validate_args` checks with the spec (the caches have their own checks)
_TENSOR_SPECS = tuple(s for s in SPEC.inputs if s.name in ("q", "swa_indices", "swa_lens", "sink", "indices", "lens"))


def validate_args(q, swa_cache, swa_indices, swa_lens, sink=None, *, cache=None, indices=None, lens=None,
                  scale: float = DEFAULT_SCALE, num_splits: Optional[int] = None, debug_check: bool = False) -> tuple:
    """The checks of :func:`sparse_attention` (same arguments, same errors), without the launch;
    returns the positional operands of the kernels / custom op ``(q, swa_cache, swa_indices,
    swa_lens, sink, cache, indices, lens, scale, num_splits)``."""
    comp = (cache, indices, lens)
    if any(x is not None for x in comp) and not all(x is not None for x in comp):
        raise ValueError("sparse_attention: pass all of cache, indices, lens or none of them")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"sparse_attention: argument 'scale' must be a finite float > 0, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"sparse_attention: argument 'num_splits' must be None or an int >= 1, got {num_splits!r}")
    if not isinstance(debug_check, bool):
        raise ValueError(f"sparse_attention: argument 'debug_check' must be a bool, got {debug_check!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        got = f"{dtype_name(q.dtype)} {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise LayoutError(f"sparse_attention: argument 'q' must be bfloat16 [T, H, 512], got {got}")
    tensors = {"q": q, "swa_indices": swa_indices, "swa_lens": swa_lens, "sink": sink, "indices": indices,
               "lens": lens}
    syms = SPEC.validate(tensors, specs=_TENSOR_SPECS)
    if syms["H"] < 1:
        raise LayoutError("sparse_attention: argument 'q' must have H >= 1 heads")
    fmt, sbs, cbs = _cache_pair("sparse_attention", swa_cache, "swa_cache", cache, "cache", HEAD_DIM, q.device, "q")
    if debug_check:
        _check_lists("swa_indices", swa_indices, "swa_lens", swa_lens, swa_cache.shape[0] * sbs)
        if cache is not None:
            _check_lists("indices", indices, "lens", lens, cache.shape[0] * cbs)
    return q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, float(scale), num_splits


@planned
def sparse_attention_decode(q: torch.Tensor, swa_cache: torch.Tensor, swa_indices: torch.Tensor,
                            swa_lens: torch.Tensor, sink: Optional[torch.Tensor] = None, *,
                            cache: Optional[torch.Tensor] = None, indices: Optional[torch.Tensor] = None,
                            lens: Optional[torch.Tensor] = None, scale: float = DEFAULT_SCALE,
                            num_splits: Optional[int] = None,
                            debug_check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-shaped :func:`sparse_attention` (FlashMLA ``flash_mla_with_kvcache`` shapes).

    Args:
        q: bfloat16 ``[B, next_n, H, 512]`` (next_n = 1..4 MTP query tokens per request).
        swa_indices: int32 ``[B, next_n, Ws]``; swa_lens: int32 ``[B, next_n]`` (per query token)
            or ``[B]`` (per request, FlashMLA's ``topk_length``).
        indices, lens: int32 ``[B, next_n, K]`` and ``[B, next_n]`` / ``[B]``, or None.
        Other arguments: as :func:`sparse_attention`.

    Returns:
        ``(out [B, next_n, H, 512] bf16, lse [B, next_n, H] fp32)``.

    Raises:
        LayoutError / ValueError: as :func:`sparse_attention`, plus a ``q`` that is not rank 4
            with next_n in 1..4, or list shapes that do not match ``[B, next_n, *]``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not 1 <= q.shape[1] <= 4:
        got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise LayoutError(f"sparse_attention_decode: argument 'q' must be [B, next_n (1..4), H, 512], got {got}")
    B, n = q.shape[:2]

    def rows(name, x, width):
        if x is None:
            return None
        if width:
            if x.dim() != 3 or tuple(x.shape[:2]) != (B, n):
                raise LayoutError(f"sparse_attention_decode: argument '{name}' must be [B={B}, next_n={n}, *], got "
                                  f"{list(x.shape)}")
            return x.reshape(B * n, x.shape[2])
        if x.dim() == 1 and x.shape[0] == B:
            return x.repeat_interleave(n)
        if x.dim() != 2 or tuple(x.shape) != (B, n):
            raise LayoutError(f"sparse_attention_decode: argument '{name}' must be [B={B}] or [B, next_n={n}], got "
                              f"{list(x.shape)}")
        return x.reshape(B * n)
    out, lse = sparse_attention(q.reshape(B * n, q.shape[2], q.shape[3]), swa_cache, rows("swa_indices", swa_indices, True),
                                rows("swa_lens", swa_lens, False), sink, cache=cache,
                                indices=rows("indices", indices, True), lens=rows("lens", lens, False), scale=scale,
                                num_splits=num_splits, debug_check=debug_check)
    return out.view(B, n, q.shape[2], HEAD_DIM), lse.view(B, n, q.shape[2])


# ------------------------------------------------------------------------------------------ index builders
def _page_slots(block_table: torch.Tensor, req: torch.Tensor, logical: torch.Tensor, block_size: int,
                num_blocks: Optional[int]) -> torch.Tensor:
    """logical entry ids ``[T, n]`` (-1 = none) -> physical slots through ``block_table[req]``; entries past
    the table, of a request outside ``[0, R)``, on pages outside ``[0, num_blocks)`` (or ``< 0``) or whose
    slot ``page * block_size + off`` exceeds ``2^31 - 1`` become -1 (int64 math; an empty table gives -1).
    The reference of the ``attn_lists`` op (``dsv4.ops.attn_lists``)."""
    rows, cols = block_table.shape
    l = logical.long()
    if rows == 0 or cols == 0:
        return torch.full_like(l, -1).to(torch.int32)
    pi = torch.div(l, block_size, rounding_mode="floor")
    r = req.long().view(-1, 1).expand_as(l)
    ok = (l >= 0) & (pi < cols) & (r >= 0) & (r < rows)
    page = block_table[r.clamp(0, rows - 1), pi.clamp(0, cols - 1)].long()
    ok &= page >= 0
    if num_blocks is not None:
        ok &= page < num_blocks
    slot = page * block_size + l % block_size
    ok &= slot <= 2 ** 31 - 1
    return torch.where(ok, slot, torch.full_like(l, -1)).to(torch.int32)


def window_slots(positions: torch.Tensor, req_idx: torch.Tensor, block_table: torch.Tensor, block_size: int, *,
                 window: int = WINDOW, ring: Optional[int] = WINDOW, first=0,
                 num_blocks: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SWA lists: the raw positions ``max(first, p - window + 1) .. p`` of each query row.

    The torch reference of :func:`dsv4.ops.attn_lists.attn_lists` (which builds these and the
    compressed lists in one launch on the GPU).

    Args:
        positions: int ``[T]`` position of each query token in its sequence (-1 = padding row).
        req_idx: int ``[T]`` request (``block_table`` row) of each query row.
        block_table: int32 ``[R, max_pages]`` pages of each request's SWA cache.
        block_size: tokens per page of that cache.
        window: window length (DSV4: 128, the query token included).
        ring: ``128`` = decode ring buffer (position ``p`` lives at ring slot ``p % ring``); None =
            linear cache (position ``p`` at logical slot ``p``, e.g. a prefill chunk's own KV).
        first: int or int ``[T]``: oldest position the cache still holds (a ring of 128 that has
            taken a step's ``next_n`` new tokens no longer holds the oldest window positions of
            the earlier rows; default 0).
        num_blocks: pages of the cache (slots on pages outside it become -1), optional.

    Returns:
        ``(slots int32 [T, window], lens int32 [T])``: oldest first, valid prefix
        ``lens = clamp(min(p + 1, window, p - first + 1), 0)``; on the device, no sync.
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window_slots: argument 'window' must be an int >= 1, got {window!r}")
    if ring is not None and (isinstance(ring, bool) or not isinstance(ring, int) or ring < window):
        raise ValueError(f"window_slots: argument 'ring' must be None or an int >= window={window} (a smaller ring "
                         f"no longer holds the whole window: its slots would alias), got {ring!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"window_slots: argument 'block_size' must be an int >= 1, got {block_size!r}")
    if block_table.dim() != 2 or block_table.shape[1] < 1:
        raise LayoutError(f"window_slots: argument 'block_table' must be [R, max_pages >= 1], got "
                          f"{list(block_table.shape)}")
    p = positions.long().view(-1, 1)
    f = first.long().view(-1, 1) if isinstance(first, torch.Tensor) else int(first)
    ar = torch.arange(window, device=positions.device).view(1, -1)
    n = torch.minimum((p + 1).clamp(0, window), (p - f + 1).clamp(min=0))
    pos = p - n + 1 + ar                                            # valid entries first
    pos = torch.where(ar < n, pos, torch.full_like(pos, -1))
    logical = pos % ring if ring is not None else pos
    logical = torch.where(pos >= 0, logical, torch.full_like(pos, -1))
    return _page_slots(block_table, req_idx, logical, block_size, num_blocks), n.view(-1).to(torch.int32)


def compressed_slots(entries: torch.Tensor, req_idx: torch.Tensor, block_table: torch.Tensor, block_size: int, *,
                     lens: Optional[torch.Tensor] = None, num_blocks: Optional[int] = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """CSA lists: logical compressed entry ids (the indexer's top-k, -1 = none) -> physical slots
    (the torch reference of ``attn_lists(kind="csa")``).

    Args:
        entries: int32 ``[T, K]`` logical entry ids of each row's request.
        req_idx: int ``[T]`` request of each row; block_table: int32 ``[R, max_pages]`` compressed pages.
        block_size: entries per page; num_blocks: pages of the cache (optional range check).
        lens: int32 ``[T]`` list lengths (default K: the -1 entries are skipped by the kernel).

    Returns:
        ``(slots int32 [T, K], lens int32 [T])``.
    """
    slots = _page_slots(block_table, req_idx, entries, block_size, num_blocks)
    if lens is None:
        lens = torch.full((entries.shape[0],), entries.shape[1], dtype=torch.int32, device=entries.device)
    return slots, lens.to(torch.int32)


def hca_slots(positions: torch.Tensor, req_idx: torch.Tensor, block_table: torch.Tensor, block_size: int,
              max_entries: int, *, ratio: int = 128, num_blocks: Optional[int] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """HCA lists: every causally available compressed entry ``b < (p + 1) // ratio`` (dense; the
    torch reference of ``attn_lists(kind="hca")``).

    Returns ``(slots int32 [T, max_entries], lens int32 [T] = min((p + 1) // ratio, max_entries))``.
    """
    n = ((positions.long() + 1).clamp(min=0) // ratio).clamp(max=max_entries)
    ar = torch.arange(max_entries, device=positions.device).view(1, -1)
    logical = torch.where(ar < n.view(-1, 1), ar.expand(positions.shape[0], -1), torch.full_like(ar, -1))
    return _page_slots(block_table, req_idx, logical, block_size, num_blocks), n.to(torch.int32)


# ------------------------------------------------------------------------------------------ graph cases
def graph_cases(device) -> list:
    """CUDA-graph cases: decode H=64 (SWA + CSA top-k, KV split forced) and H=16 (no split)."""
    from ..reference.kv_cache import TOKEN_BYTES
    from ._common import GraphCase, bytes_of
    from .kv_cache import kv_cache_append
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1414)
    cases = []
    for H, T, K, splits in ((64, 4, 256, 2), (16, 6, 96, 1)):
        nb, bs = 12, 64
        swa = torch.zeros(4, bs * TOKEN_BYTES, dtype=torch.uint8, device=dev)
        comp = torch.zeros(nb, bs * TOKEN_BYTES, dtype=torch.uint8, device=dev)
        q = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        sink = torch.empty(H, device=dev)
        sidx = torch.empty(T, WINDOW, dtype=torch.int32, device=dev)
        slen = torch.empty(T, dtype=torch.int32, device=dev)
        cidx = torch.empty(T, K, dtype=torch.int32, device=dev)
        clen = torch.empty(T, dtype=torch.int32, device=dev)

        def refresh(swa=swa, comp=comp, q=q, sink=sink, sidx=sidx, slen=slen, cidx=cidx, clen=clen, T=T, K=K, nb=nb,
                    bs=bs):
            for c in (swa, comp):
                n = c.shape[0] * bs
                kv_cache_append(c, (torch.randn(n, HEAD_DIM, generator=gen) * 2).to(torch.bfloat16).to(dev),
                                torch.arange(n, device=dev))
            q.copy_(torch.randn(q.shape, generator=gen).to(torch.bfloat16))
            sink.copy_(torch.randn(sink.shape, generator=gen))
            sidx.copy_(torch.randint(-1, 4 * bs, sidx.shape, generator=gen, dtype=torch.int32))
            slen.copy_(torch.randint(0, WINDOW + 1, slen.shape, generator=gen, dtype=torch.int32))
            cidx.copy_(torch.randint(-1, nb * bs, cidx.shape, generator=gen, dtype=torch.int32))
            clen.copy_(torch.randint(0, K + 1, clen.shape, generator=gen, dtype=torch.int32))

        def run(swa=swa, comp=comp, q=q, sink=sink, sidx=sidx, slen=slen, cidx=cidx, clen=clen, splits=splits):
            o, l = sparse_attention(q, swa, sidx, slen, sink, cache=comp, indices=cidx, lens=clen, num_splits=splits)
            return bytes_of(o, l)

        refresh()
        cases.append(GraphCase(f"sparse_attention-h{H}-s{splits}", "sparse_attention", run, refresh,
                               {"fmt": "fp8_ds_mla", "H": H, "T": T, "entries": WINDOW + K, "split": splits,
                                "device": dev.type}))
    return cases
