"""Top-k selection of fp32 indexer logits per row (DSA / CSA indexer -> sparse attention).

Exact and deterministic: the selected set and its order are a function of the data only,
identical for every provider and launch configuration. Default (``sorted=False``): the k best
(score descending, ties by lower index) in ascending position order; ``sorted=True``: the same
entries by score descending, ties by lower index (the sort costs 2.2-2.8 us on the H200, 10-25%
of the op at the DSV4 shapes, and the sparse attention does not need it: issue 15).
Supports decode rows ``[0, lengths)``, prefill rows ``[starts, lengths)`` and a fused mapping of
the selected positions through a paged-KV ``block_table`` (entries outside ``[0, num_blocks)``
map to -1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._plan import planned

K_MAX = 2048

SPEC = OpSpec(
    name="topk",
    summary="Exact, deterministic per-row top-k of fp32 logits over [starts, lengths) (score desc, ties: lower "
            "index), in ascending position order (default) or sorted by score, optional block_table mapping.",
    inputs=(
        TensorSpec("logits", torch.float32, ("rows", "stride"), major="inner", align=4,
                   doc="scores; row r is valid on [starts[r], lengths[r]) (decode: [0, lengths[r])); "
                       "row stride in memory may exceed `stride` (views), last dim must be unit-stride"),
        TensorSpec("lengths", torch.int32, ("rows",), align=4,
                   doc="end of each row's valid range (exclusive). Clamped ON DEVICE to [0, stride] "
                       "(no host sync): lengths > stride behave as stride, lengths < 0 as 0"),
        TensorSpec("starts", torch.int32, ("rows",), align=4, optional=True,
                   doc="prefill: start of each row's valid range (inclusive); clamped on device to "
                       "[0, end]. None = 0"),
        TensorSpec("block_table", torch.int32, ("B", "max_blocks"), major="inner", align=4, optional=True,
                   doc="paged KV: logical block -> physical block, row r uses block_table[r // rows_per_seq]"),
    ),
    outputs=(
        TensorSpec("indices", torch.int32, ("rows", "k"), output=True,
                   doc="selected positions (absolute within the row, not relative to starts), or physical "
                       "slot ids block_table[r // rows_per_seq, p // block_size] * block_size + p % block_size "
                       "if block_table is given; -1 = padding (stays -1 after mapping), and -1 where the "
                       "block_table entry is outside [0, num_blocks) or the slot id would pass 2^31 - 1 "
                       "(the score is kept)"),
        TensorSpec("scores", torch.float32, ("rows", "k"), output=True,
                   doc="the selected logits (exact bits), -inf for padding (return_scores=True)"),
    ),
    params=(
        Param("k", "int", "1..2048", "entries kept per row (512 / 1024 tuned)"),
        Param("block_size", "int", ">= 1 with block_table", "tokens per KV block"),
        Param("rows_per_seq", "int", ">= 1", "logit rows per block_table row (decode: next_n; prefill: tokens)"),
        Param("return_scores", "bool", "{False, True}", "also return the selected scores"),
        Param("sorted", "bool", "{False, True}", "False (default): ascending position order (logical positions, "
              "before the block_table mapping; padding last); True: score desc, ties by lower index"),
        Param("num_blocks", "Optional[int]", ">= 0", "physical blocks of the paged cache: block_table entries outside "
              "[0, num_blocks) map to -1 (None: only negative entries do)"),
    ),
    constraints=(
        ("B * rows_per_seq == rows", "block_table must have rows / rows_per_seq rows (one per sequence)"),
        ("max_blocks * block_size >= stride", "block_table must cover every position < stride"),
    ),
    formula="selectable(r, p) = clamp(starts[r], 0, end) <= p < end = clamp(lengths[r], 0, stride) and "
            "logits[r, p] is not NaN and != -inf; output = the k selectable p with the largest "
            "(logits[r, p], -p) in lexicographic order (-0.0 == +0.0), in ascending p (sorted=True: by that key "
            "descending); padding (-1, -inf) last; mapped slot = -1 unless 0 <= block_table entry < num_blocks",
    source="DSV4 lightning-indexer top-k (dsv4_spec.md), DSA decode/prefill index selection (vLLM persistent_topk, "
           "FlashInfer top_k_page_table_transform semantics); exact ties by lower index (issue 5)",
    notes="Bitwise identical (set AND order) across runs, providers and launch configurations. The default order "
          "is ascending position (the sparse attention accumulates in index order, so a stable order keeps its "
          "rounding run-to-run stable; the score sort costs 10-25% of the op). +inf is selectable. Rows with fewer "
          "than k selectable entries are padded at the end. No host sync: lengths/starts are clamped on "
          "the device, never checked on the host.",
)


@dataclass(frozen=True)
class TopkProblem(Problem):
    """``topk`` provider selection: ``k`` entries per row, prefill rows (``starts`` given), a
    ``block_table`` mapping, the sorted order, the device type. The launch configuration
    (``kernels_cuda.topk.TopkConfig``) is chosen per call from the shape by the provider's heuristic
    and shown by ``registry.last_choice("topk").explain()``."""

    k: int
    prefill: bool
    mapped: bool
    sorted: bool
    device: str


def _example(target: Target) -> TopkProblem:
    return TopkProblem(512, False, False, False, target.device_type)


OP = register(Op("topk", SPEC, example_problem=_example))


@custom_op("dsv4::topk", mutates_args=())
def _topk_op(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts: Optional[torch.Tensor],
             block_table: Optional[torch.Tensor], block_size: int, rows_per_seq: int, sorted: bool,
             num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    problem = TopkProblem(k, starts is not None, block_table is not None, sorted, logits.device.type)
    return OP.dispatch(problem, Target.of(logits.device), logits=logits, lengths=lengths, k=k, starts=starts,
                       block_table=block_table, block_size=block_size, rows_per_seq=rows_per_seq, sorted=sorted,
                       num_blocks=None if num_blocks < 0 else num_blocks)


@_topk_op.register_fake
def _(logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted, num_blocks):
    rows = logits.shape[0]
    return (logits.new_empty((rows, k), dtype=torch.int32), logits.new_empty((rows, k), dtype=torch.float32))


def _check_int(name: str, v, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"topk: argument '{name}' must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"topk: argument '{name}' must be {rng}, got {v}")
    return v


@planned
def topk(logits: torch.Tensor, lengths: torch.Tensor, k: int, *, starts: Optional[torch.Tensor] = None,
         block_table: Optional[torch.Tensor] = None, block_size: int = 0, rows_per_seq: int = 1,
         return_scores: bool = False, sorted: bool = False, num_blocks: Optional[int] = None):
    """Exact per-row top-k of indexer logits.

    Args:
        logits: float32 ``[rows, stride]``, last dim unit-stride (row stride may be larger).
        lengths: int32 ``[rows]``: end (exclusive) of each row's valid range. Clamped on the
            device to ``[0, stride]`` (documented behaviour; there is no host check, which would
            need a sync).
        k: 1..2048 entries per row.
        starts: optional int32 ``[rows]`` (prefill rows): start (inclusive) of the valid range,
            clamped on the device to ``[0, end]``. Default: 0.
        block_table: optional int32 ``[B, max_blocks]`` with ``B * rows_per_seq == rows`` and
            ``max_blocks * block_size >= stride``: maps position ``p`` of row ``r`` to
            ``block_table[r // rows_per_seq, p // block_size] * block_size + p % block_size``
            in the same launch. An entry outside ``[0, num_blocks)`` (or a slot id past 2^31 - 1)
            gives index ``-1`` for the positions of that block (their scores are kept).
        block_size: tokens per block (required, >= 1, with ``block_table``).
        rows_per_seq: logit rows per ``block_table`` row (decode: ``next_n``).
        return_scores: also return the selected scores.
        sorted: False (default): the selected entries in ascending position order (logical
            positions, before any block_table mapping), padding last. True: sorted by score
            descending, ties by lower index (2.2-2.8 us more on the H200). Either way the same
            set of (index, score) pairs, bit for bit, and a deterministic order.
        num_blocks: physical blocks of the paged cache (``block_table`` entries must be in
            ``[0, num_blocks)``); None: only negative entries are invalid. Needs ``block_table``.

    Returns:
        ``indices`` int32 ``[rows, k]`` (and ``scores`` float32 ``[rows, k]``): the selectable
        positions (not NaN, not -inf, inside the range) with the largest scores (ties by lower
        index, -0.0 == +0.0), in ascending position order (``sorted=True``: by score descending,
        ties by lower index); indices are absolute positions in the
        row (or physical slots when mapped). Rows with fewer than ``k`` selectable entries are
        padded with ``-1`` / ``-inf`` (``-1`` is never mapped). Bitwise identical across runs
        and launch configurations.

    Raises:
        ValueError: ``k`` not an int in 1..2048, ``block_size`` / ``rows_per_seq`` out of range.
        LayoutError: an argument does not match ``docs/layouts/topk.md`` (dtype, shape, unit
            stride, device), or block_table's shape does not fit ``rows`` / ``stride``.

    Source: DSV4 lightning indexer top-k selection (dsv4_spec.md); semantics of issue 5.
    """
    _check_int("k", k, 1, K_MAX)
    _check_int("rows_per_seq", rows_per_seq, 1)
    _check_int("block_size", block_size, 0)
    if block_table is not None and block_size < 1:
        raise ValueError(f"topk: argument 'block_size' must be >= 1 when block_table is given, got {block_size}")
    if block_table is None and block_size != 0:
        raise ValueError("topk: argument 'block_size' is only meaningful with block_table (got "
                         f"block_size={block_size} and block_table=None)")
    for name, v in (("return_scores", return_scores), ("sorted", sorted)):
        if not isinstance(v, bool):
            raise ValueError(f"topk: argument '{name}' must be a bool, got {type(v).__name__}")
    if num_blocks is not None:
        _check_int("num_blocks", num_blocks, 0)
        if block_table is None:
            raise ValueError("topk: argument 'num_blocks' is only meaningful with block_table")
    SPEC.validate({"logits": logits, "lengths": lengths, "starts": starts, "block_table": block_table},
                  symbols={"block_size": block_size, "rows_per_seq": rows_per_seq})
    if logits.shape[0] == 0:
        idx = torch.empty((0, k), dtype=torch.int32, device=logits.device)
        sc = torch.empty((0, k), dtype=torch.float32, device=logits.device)
        return (idx, sc) if return_scores else idx
    idx, sc = _topk_op(logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted,
                                  -1 if num_blocks is None else min(num_blocks, 2 ** 31 - 1))
    return (idx, sc) if return_scores else idx


__all__ = ["topk", "TopkProblem"]


def graph_cases(device) -> list:
    """CUDA-graph cases: decode rows, and prefill rows with starts + block-table mapping."""
    from ._common import GraphCase, bytes_of
    dev = torch.device(device)
    rows, n = 64, 16384
    logits = torch.empty(rows, n, device=dev)
    lengths = torch.empty(rows, dtype=torch.int32, device=dev)
    starts = torch.empty(rows, dtype=torch.int32, device=dev)
    bt = torch.empty(rows // 2, n // 64, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(77)

    def refresh():
        logits.copy_(torch.randn(rows, n, generator=gen).round(decimals=2))     # ties on purpose
        lengths.copy_(torch.randint(0, n + 1, (rows,), generator=gen, dtype=torch.int32))
        starts.copy_((lengths.cpu() * torch.rand(rows, generator=gen) * 0.5).to(torch.int32))
        bt.copy_(torch.randperm(bt.numel(), generator=gen).view(bt.shape).to(torch.int32))
    refresh()
    return [
        GraphCase("topk-decode-k512", "topk", lambda: bytes_of(*topk(logits, lengths, 512, return_scores=True)),
                  refresh),                                          # default: ascending position, bitwise
        GraphCase("topk-decode-k512-sorted", "topk", lambda: bytes_of(*topk(
            logits, lengths, 512, return_scores=True, sorted=True)), refresh),
        GraphCase("topk-prefill-mapped-k1024", "topk",
                  lambda: topk(logits, lengths, 1024, starts=starts, block_table=bt, block_size=64, rows_per_seq=2),
                  refresh),
    ]
