"""DSV4 attention index lists: every query row's SWA window slots and its CSA / HCA compressed
slots, with their lengths, in one op (``torch.ops.dsv4.attn_lists``; providers
``kernels_dsl/attn_lists.py`` and ``dsv4/reference/attn_lists.py``).

The lists are what :func:`dsv4.ops.sparse_attention.sparse_attention` reads: physical slot ids
``page * block_size + offset`` of the SWA cache and of the compressed cache. The semantics are
those of :func:`~dsv4.ops.sparse_attention.window_slots`, :func:`~dsv4.ops.sparse_attention.compressed_slots`
and :func:`~dsv4.ops.sparse_attention.hca_slots` (the torch provider calls them), per row ``t``
with position ``p = positions[t]`` and request ``r = req_idx[t]``:

* SWA (every kind): ``n = min(clamp(p + 1, 0, window), max(p - first + 1, 0))``; entry ``j < n``
  is position ``p - n + 1 + j`` (oldest first) at logical slot ``pos % ring`` (decode ring) or
  ``pos`` (``ring=None``: linear cache); ``swa_lens[t] = n``; entries ``j >= n`` are -1.
* CSA (``kind="csa"``): entry ``j`` is the logical compressed entry ``entries[t, j]`` (the
  indexer's top-k, -1 = none); ``lens`` = the given ``lens`` (int32) or ``K``.
* HCA (``kind="hca"``): entries ``j < n_c = min(max(p + 1, 0) // ratio, max_entries)`` (every
  causally available compressed entry), -1 after; ``lens[t] = n_c``.

A logical slot ``l`` of request ``r`` maps to ``block_table[r, l // bs] * bs + l % bs``; it is
-1 when ``l < 0``, ``r`` is outside ``[0, R)``, ``l // bs >= max_pages``, the page value is
``< 0`` or ``>= num_blocks`` (when given) or the slot exceeds ``2^31 - 1``. Nothing is checked
on the host that needs a sync: bad positions, request ids and block-table values give -1
entries on the device and are never dereferenced outside the tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._common import dtype_name
from ._plan import planned

__all__ = ["attn_lists", "AttnLists"]

_INT = (torch.int32, torch.int64)
_I64_MIN, _I64_MAX = -2 ** 63, 2 ** 63 - 1
KINDS = ("swa", "csa", "hca")
_SOURCE = ("dsv4_spec.md 2.2 / 4.4 (FLASH-REF model.py Attention: window_topk_idxs, compress_topk_idxs); "
           "FlashMLA flash_mla_with_kvcache indices / extra_indices; vLLM DSV4 block tables")

SPEC = OpSpec(
    name="attn_lists",
    summary="Attention index lists of one step: each query row's SWA window slots and its CSA top-k / HCA "
            "causal compressed slots (physical page*bs+off ids, -1 = none) with their lengths, one launch.",
    inputs=(
        TensorSpec("positions", _INT, ("T",), major="any", align=4,
                   doc="position of each query row in its sequence (-1 = padding row: empty lists)"),
        TensorSpec("req_idx", _INT, ("T",), major="any", align=4,
                   doc="request (block_table row) of each query row; outside [0, R) = empty lists"),
        TensorSpec("swa_block_table", torch.int32, ("Rs", "Ps"), major="any", align=4,
                   doc="SWA cache pages of each request (ring: ring_page = (p % ring) // bs)"),
        TensorSpec("first", _INT, ("T",), major="any", align=4, optional=True,
                   doc="oldest position the SWA cache still holds per row (or an int for all rows)"),
        TensorSpec("block_table", torch.int32, ("R", "P"), major="any", align=4, optional=True,
                   doc="compressed cache pages of each request (CSA / HCA)"),
        TensorSpec("entries", torch.int32, ("T", "K"), major="any", align=4, optional=True,
                   doc="CSA: logical compressed entry ids per row (top-k output), -1 = none"),
        TensorSpec("lens", _INT, ("T",), major="any", align=4, optional=True,
                   doc="CSA: list lengths to pass through (default K)"),
    ),
    outputs=(
        TensorSpec("swa_slots", torch.int32, ("T", "window"), doc="physical SWA slots, oldest first, -1 after swa_lens"),
        TensorSpec("swa_lens", torch.int32, ("T",), doc="min(clamp(p + 1, 0, window), max(p - first + 1, 0))"),
        TensorSpec("slots", torch.int32, ("T", "K"), optional=True,
                   doc="CSA: slots of entries[t]; HCA (K = max_entries): slots of entries 0..lens[t]-1, -1 after"),
        TensorSpec("lens_out", torch.int32, ("T",), optional=True,
                   doc="CSA: lens (int32) or K; HCA: min(max(p + 1, 0) // ratio, max_entries)"),
    ),
    params=(Param("kind", "str", "swa, csa, hca", "which compressed list is built besides the window"),
            Param("swa_block_size", "int", "[1, 2^31)", "tokens per SWA page"),
            Param("window", "int", ">= 1", "window length (DSV4: 128, the query token included)"),
            Param("ring", "int or None", ">= window or None", "ring slots of the SWA cache (128), None = linear"),
            Param("first", "int or int [T] tensor", "int64 values", "oldest cached position (default 0)"),
            Param("swa_num_blocks", "int or None", ">= 0", "SWA cache pages (range check), optional"),
            Param("block_size", "int", "[1, 2^31)", "entries per compressed page (CSA / HCA)"),
            Param("max_entries", "int", ">= 0", "HCA: list width K"),
            Param("ratio", "int", ">= 1", "HCA compression ratio (128)"),
            Param("num_blocks", "int or None", ">= 0", "compressed cache pages (range check), optional")),
    formula="slot(r, l) = (l >= 0 && 0 <= r < R && l/bs < P && 0 <= bt[r, l/bs] < num_blocks && slot <= 2^31-1) ? "
            "bt[r, l/bs]*bs + l%bs : -1; SWA l = (p-n+1+j) % ring, n = min(clamp(p+1, 0, window), max(p-first+1, 0)); "
            "CSA l = entries[t, j]; HCA l = j < min(max(p+1, 0)//ratio, max_entries) ? j : -1",
    source=_SOURCE,
    notes="One launch (dsl), no host sync, CUDA-graph capturable. The dsl and torch providers agree bit for bit. "
          "Inputs that are not contiguous (or a CSA entries pointer not 16-byte aligned) are copied first.",
)


@dataclass(frozen=True)
class AttnListsProblem(Problem):
    """What selects the ``attn_lists`` provider: list kind, query rows, window and list widths."""

    kind: str           # "csa" | "hca" | "swa"
    T: int              # query rows
    window: int         # SWA window entries per row
    width: int          # compressed entries per row (0 for swa)
    device: str


def _example(target: Target) -> AttnListsProblem:
    return AttnListsProblem("csa", 16, 128, 512, target.device_type)


#: dsl (kernels_dsl/attn_lists.py) first; torch = the reference (the sparse_attention helpers), any device.
OP = register(Op("attn_lists", SPEC, kinds=("dsl", "torch"), example_problem=_example))


class AttnLists(NamedTuple):
    """Result of :func:`attn_lists` (``slots`` / ``lens`` are None for ``kind="swa"``)."""

    swa_slots: torch.Tensor
    swa_lens: torch.Tensor
    slots: Optional[torch.Tensor]
    lens: Optional[torch.Tensor]


@custom_op("dsv4::attn_lists", mutates_args=())
def _attn_lists_op(positions: torch.Tensor, req_idx: torch.Tensor, swa_block_table: torch.Tensor,
                   swa_block_size: int, window: int, ring: int, first: Optional[torch.Tensor], first_scalar: int,
                   swa_num_blocks: int, kind: str, block_table: Optional[torch.Tensor], block_size: int,
                   entries: Optional[torch.Tensor], lens: Optional[torch.Tensor], max_entries: int, ratio: int,
                   num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T = positions.shape[0]
    width = 0 if kind == "swa" else (entries.shape[1] if kind == "csa" else max_entries)
    problem = AttnListsProblem(kind, T, window, width, positions.device.type)
    return OP.dispatch(problem, Target.of(positions.device), positions=positions, req_idx=req_idx,
                       swa_block_table=swa_block_table, swa_block_size=swa_block_size, window=window, ring=ring,
                       first=first, first_scalar=first_scalar, swa_num_blocks=swa_num_blocks, kind=kind,
                       block_table=block_table, block_size=block_size, entries=entries, lens=lens,
                       max_entries=max_entries, ratio=ratio, num_blocks=num_blocks)


@_attn_lists_op.register_fake
def _(positions, req_idx, swa_block_table, swa_block_size, window, ring, first, first_scalar, swa_num_blocks, kind,
      block_table, block_size, entries, lens, max_entries, ratio, num_blocks):
    T = positions.shape[0]
    width = 0 if kind == "swa" else (entries.shape[1] if kind == "csa" else max_entries)
    i32 = dict(dtype=torch.int32)
    return (positions.new_empty((T, window), **i32), positions.new_empty((T,), **i32),
            positions.new_empty((T, width), **i32), positions.new_empty((T if kind != "swa" else 0,), **i32))


def _int(name: str, v, lo: int, hi: int = _I64_MAX, *, none_ok: bool = False):
    if v is None and none_ok:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        want = f"an int in [{lo}, {hi}]" if hi < _I64_MAX else f"an int >= {lo}"
        raise ValueError(f"attn_lists: argument '{name}' must be {'None or ' if none_ok else ''}{want}, got {v!r}")
    return v


@planned
def attn_lists(positions: torch.Tensor, req_idx: torch.Tensor, swa_block_table: torch.Tensor, swa_block_size: int,
               *, kind: str = "swa", window: int = 128, ring: Optional[int] = 128, first=0,
               swa_num_blocks: Optional[int] = None, block_table: Optional[torch.Tensor] = None,
               block_size: Optional[int] = None, entries: Optional[torch.Tensor] = None,
               lens: Optional[torch.Tensor] = None, max_entries: Optional[int] = None, ratio: int = 128,
               num_blocks: Optional[int] = None) -> AttnLists:
    """The attention index lists of one step (module docstring: the formulas), in one launch.

    Args:
        positions: int32 / int64 ``[T]`` position of each query row (-1 = padding row).
        req_idx: int32 / int64 ``[T]`` request (block-table row) of each query row.
        swa_block_table: int32 ``[Rs, Ps >= 1]`` SWA cache pages of each request.
        swa_block_size: tokens per SWA page.
        kind: ``"swa"`` (window only), ``"csa"`` (+ top-k entries -> slots) or ``"hca"``
            (+ every causally available compressed entry).
        window: window length (DSV4: 128). ring: ring slots of the SWA cache (>= window; 128 =
            decode ring), None = linear cache (a prefill chunk's own KV).
        first: int or int32 / int64 ``[T]``: oldest position the SWA cache still holds. Pass it
            with a ring: after a step has appended its ``next_n`` tokens, a ring of 128 holds
            positions ``c - 128 .. c - 1`` only, and without ``first = c - 128`` the earlier rows'
            oldest window slots would name ring slots already overwritten by the newest tokens.
            With ``first`` those rows see ``128 - i`` entries; a ring of ``>= window + next_n - 1``
            slots gives every row its full window (dsv4_spec.md 2.2: the last 128 raw tokens).
        swa_num_blocks: pages of the SWA cache (slots on other pages become -1), optional.
        block_table: int32 ``[R, P]`` compressed cache pages (csa / hca); block_size: entries
            per compressed page; num_blocks: compressed cache pages, optional.
        entries: csa: int32 ``[T, K]`` logical entry ids (-1 = none); lens: csa: int32 / int64
            ``[T]`` lengths to pass through (default K; int64 values keep their low 32 bits, as
            ``.to(torch.int32)``; ``sparse_attention`` clamps lengths to ``[0, K]``).
        max_entries: hca: list width ``K`` (size it ``>= (max position + 1) // ratio``: a row with more
            causal entries keeps entries ``0 .. K-1`` only, silently dropping the newest); ratio: hca
            compression ratio (128).

    Returns:
        :class:`AttnLists` ``(swa_slots int32 [T, window], swa_lens int32 [T], slots int32 [T, K],
        lens int32 [T])``; ``slots`` / ``lens`` are None for ``kind="swa"``. Fresh tensors, on
        the device, no sync.

    Raises:
        LayoutError: a tensor with the wrong dtype / rank / shape / device (names the argument).
        ValueError: a bad ``kind``, an integer parameter out of range, a missing or extraneous
            argument for the kind, or ``T * max(window, K) >= 2^31``.

    Source: dsv4_spec.md 2.2 / 4.4; the semantics of ``window_slots`` / ``compressed_slots`` /
    ``hca_slots`` in :mod:`dsv4.ops.sparse_attention` (the torch provider).
    """
    if kind not in KINDS:
        raise ValueError(f"attn_lists: argument 'kind' must be one of {KINDS}, got {kind!r}")
    _int("swa_block_size", swa_block_size, 1, 2 ** 31 - 1)      # page * bs + off stays exact in int64
    _int("window", window, 1, 2 ** 31 - 1)
    if ring is not None and (isinstance(ring, bool) or not isinstance(ring, int) or not window <= ring <= _I64_MAX):
        raise ValueError(f"attn_lists: argument 'ring' must be None or an int >= window={window} (a smaller ring "
                         f"no longer holds the whole window: its slots would alias), got {ring!r}")
    _int("swa_num_blocks", swa_num_blocks, 0, none_ok=True)
    first_t = first if isinstance(first, torch.Tensor) else None
    if first_t is None:
        _int("first", first, _I64_MIN)
    need = {"csa": ("block_table", "block_size", "entries"), "hca": ("block_table", "block_size", "max_entries"),
            "swa": ()}[kind]
    given = {"block_table": block_table, "block_size": block_size, "entries": entries, "lens": lens,
             "max_entries": max_entries, "num_blocks": num_blocks}
    allowed = set(need) | ({"lens", "num_blocks"} if kind == "csa" else {"num_blocks"} if kind == "hca" else set())
    for k, v in given.items():
        if k in need and v is None:
            raise ValueError(f"attn_lists: kind={kind!r} needs argument '{k}'")
        if k not in allowed and v is not None:
            raise ValueError(f"attn_lists: argument '{k}' does not apply to kind={kind!r}")
    if kind != "swa":
        _int("block_size", block_size, 1, 2 ** 31 - 1)
        _int("num_blocks", num_blocks, 0, none_ok=True)
    if kind == "hca":
        _int("max_entries", max_entries, 0, 2 ** 31 - 1)
        _int("ratio", ratio, 1)
    for name, t in (("positions", positions), ("req_idx", req_idx), ("swa_block_table", swa_block_table)):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"attn_lists: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if first_t is not None and first_t.dtype not in _INT:
        raise LayoutError(f"attn_lists: argument 'first' must be an int or an int32 / int64 [T] tensor, got "
                          f"{dtype_name(first_t.dtype)} {list(first_t.shape)}")
    tensors = {"positions": positions, "req_idx": req_idx, "swa_block_table": swa_block_table, "first": first_t,
               "block_table": block_table, "entries": entries, "lens": lens}
    syms = SPEC.validate(tensors)
    if syms["Ps"] < 1:
        raise LayoutError(f"attn_lists: argument 'swa_block_table' must be [Rs, max_pages >= 1], got "
                          f"{list(swa_block_table.shape)}")
    T = syms["T"]
    width = 0 if kind == "swa" else (syms["K"] if kind == "csa" else max_entries)
    if T * max(window, width) >= 2 ** 31:
        raise ValueError(f"attn_lists: T * max(window, K) = {T} * {max(window, width)} must be < 2^31 (int32 offsets)")
    ws, wl, cs, cl = _attn_lists_op(
        positions, req_idx, swa_block_table, swa_block_size, window, 0 if ring is None else ring, first_t,
        0 if first_t is not None else int(first), -1 if swa_num_blocks is None else swa_num_blocks, kind,
        block_table, 1 if block_size is None else block_size, entries, lens,
        0 if max_entries is None else max_entries, ratio, -1 if num_blocks is None else num_blocks)
    if kind == "swa":
        return AttnLists(ws, wl, None, None)
    return AttnLists(ws, wl, cs, cl)


# ------------------------------------------------------------------------------------------ graph cases
def graph_cases(device) -> list:
    """CUDA-graph cases: a CSA decode step (int64 positions, per-row ``first``, bad ids and pages
    in the inputs) and an HCA step (linear window, page range check)."""
    from ._common import GraphCase, bytes_of
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1415)
    cases = []
    T, R, K, bs = 12, 3, 96, 16
    pos = torch.empty(T, dtype=torch.int64, device=dev)
    req = torch.empty(T, dtype=torch.int32, device=dev)
    first = torch.empty(T, dtype=torch.int64, device=dev)
    swa_bt = torch.empty(R, 2, dtype=torch.int32, device=dev)
    bt = torch.empty(R, 8, dtype=torch.int32, device=dev)
    ent = torch.empty(T, K, dtype=torch.int32, device=dev)

    def refresh():
        p = torch.randint(-1, 600, (T,), generator=gen)
        pos.copy_(p)
        req.copy_(torch.randint(-1, R + 1, (T,), generator=gen, dtype=torch.int32))
        first.copy_(p - torch.randint(0, 200, (T,), generator=gen))
        swa_bt.copy_(torch.randint(-1, 2 * R + 1, swa_bt.shape, generator=gen, dtype=torch.int32))
        bt.copy_(torch.randint(-1, 8 * R + 2, bt.shape, generator=gen, dtype=torch.int32))
        ent.copy_(torch.randint(-1, 8 * bs + 4, ent.shape, generator=gen, dtype=torch.int32))

    def run_csa():
        r = attn_lists(pos, req, swa_bt, 64, kind="csa", first=first, swa_num_blocks=2 * R, block_table=bt,
                       block_size=bs, entries=ent, num_blocks=8 * R)
        return bytes_of(*r)

    def run_hca():
        r = attn_lists(pos, req, bt, bs, kind="hca", ring=None, block_table=bt, block_size=bs, max_entries=K,
                       ratio=4, num_blocks=8 * R)
        return bytes_of(*r)

    refresh()
    cases.append(GraphCase("attn_lists-csa", "attn_lists", run_csa, refresh,
                           {"kind": "csa", "T": T, "window": 128, "width": K, "device": dev.type}))
    cases.append(GraphCase("attn_lists-hca", "attn_lists", run_hca, refresh,
                           {"kind": "hca", "T": T, "window": 128, "width": K, "device": dev.type}))
    return cases
