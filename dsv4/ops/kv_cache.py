"""DSV4 paged KV caches: SWA ring / compressed-cache append, CSA/HCA compressors, KV gather.

Ops (one module, four registered ops, providers in ``kernels_cuda/kv_cache.py`` and
``dsv4/reference/kv_cache.py``):

* :func:`kv_cache_append` -- quantize ``kv [N, 512]`` into a paged cache at ``slot_mapping``
  (SWA ring: ``slot = ring_block * bs + pos % 128``; any paged cache).
* :func:`kv_compress_prefill` / :func:`kv_compress_decode` -- the DSV4 compressor
  (softmax-gated pooling, RMSNorm, RoPE, quantization) writing compressed entries into a paged
  cache, prefill (every complete block, sequences from position 0) and decode (incremental
  FP32 state, bit-identical entries).
* :func:`kv_gather` -- dequantize SWA + top-k compressed rows to dense BF16 ``[T, W + K, 512]``
  (indices past a request's ``lens`` / ``swa_lens`` read as -1: zero rows).

Cache formats (byte offsets exact; ``bs`` = tokens per paged block, inferred from the shape):

``fp8_ds_mla`` (FlashMLA "MODEL1" / vLLM DSV4, 584 B per token), uint8 ``[num_blocks, bs * 584]``
(or the same bytes viewed as ``[num_blocks, bs, 584]``)::

    block base  = page * bs * 584
    data(off)   = base + off * 576        bytes [0, 448)   E4M3 nope dims 0..447
                                          bytes [448, 576) 64 x BF16 rope dims 448..511 (little endian)
    scales(off) = base + bs * 576 + off * 8
                                          bytes [0, 7)     UE8M0 scale of nope dims [64g, 64g + 64), g = 0..6
                                          byte 7           pad, written as 0

``mxfp4`` (indexer key, 68 B per token), uint8 ``[num_blocks, bs * 68]`` or ``[num_blocks, bs, 68]``
(the ``indexer_cache_write`` cache, byte-compatible)::

    values(off) = page * bs * 68 + off * 64            128 x E2M1, element 2i in the low nibble
    scales(off) = page * bs * 68 + bs * 64 + off * 4   4 x UE8M0 (one per 32 dims)

``bf16``: ``[num_blocks, bs, d]`` bfloat16 holding the fake-quantized values (what the
reference model's BF16 cache holds), so gathers from ``bf16`` and quantized caches agree.

Quantization (DSV4 ``act_quant(x, 64, "ue8m0")``): per 64 nope dims ``amax = max(max|x|, 1e-4)``
(finite elements), ``s = 2^ceil(log2(amax * fp32(1/448)))``, ``q = e4m3_rn(clamp(x / s, +-448))``.
Indexer: Hadamard then MXFP4 (``dsv4.formats.quantize_mxfp4``, DSV4 rule).

Device-side value checks (no host sync): out-of-range slots / pages / indices are skipped
(append, compress) or produce zero rows (gather); ``debug_check=True`` validates the values on
the host first (syncs) and raises ``ValueError``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._common import dtype_name
from ._plan import planned

KV_DIM, IDX_DIM, ROPE_DIM = 512, 128, 64
#: compression ratios of the compressor ops: 4 (CSA, overlapping windows) and 128 (HCA)
COMPRESS_RATIOS = (4, 128)
TOKEN_BYTES, IDX_TOKEN_BYTES = 584, 68
#: byte size below which every flat extent of a kv tensor fits int32 32-bit words (the dsl providers' limit)
_I32_BYTES = 4 << 31
_IDX = (torch.int32, torch.int64)
_SOURCE = ("DSV4 FLASH-REF model.py Compressor / Attention / act_quant / fp4_act_quant (dsv4_spec.md 2.2, 2.3, "
           "2.7, 4.2, 4.4); vLLM DSV4 fp8_ds_mla block layout [bs x 576 B data][bs x 8 B scales]; FlashMLA MODEL1 "
           "584 B/token")
_CACHE_PACKING = ("fp8_ds_mla: uint8 [num_blocks, bs*584]; block base page*bs*584; token data at base+off*576 "
                  "= 448 E4M3 nope, then 64 BF16 rope (bytes 448..575); scales at base+bs*576+off*8 = 7 UE8M0 (per 64 "
                  "nope dims), then pad 0. bf16: [num_blocks, bs, 512] fake-quantized values")


#: (dtype, shape, d) -> (fmt, block_size) of a cache that passed :func:`_cache_info`'s shape checks
_CACHE_INFO: dict[tuple, tuple[str, int]] = {}


def _cache_info(cache: torch.Tensor, d: int, arg: str = "cache") -> tuple[str, int]:
    """(fmt, block_size) of a cache tensor, with shape checks (LayoutError naming ``arg``).

    The shape checks of a plain tensor are memoized per (dtype, shape, d) (a repeat call checks only
    contiguity and alignment); a miss, a tensor subclass (FakeTensor) and torch.compile tracing run
    every check."""
    plain = type(cache) is torch.Tensor and not torch.compiler.is_compiling()
    if plain:
        hit = _CACHE_INFO.get((cache.dtype, cache.shape, d))
        if hit is not None and cache.is_contiguous() and not (cache.is_cuda and cache.numel() and cache.data_ptr() % 16):
            return hit
    fmt, bs = _cache_info_full(cache, d, arg)
    if plain and len(_CACHE_INFO) < 1024:
        _CACHE_INFO[(cache.dtype, cache.shape, d)] = (fmt, bs)
    return fmt, bs


def _cache_info_full(cache: torch.Tensor, d: int, arg: str) -> tuple[str, int]:
    if not isinstance(cache, torch.Tensor):
        raise LayoutError(f"{arg}: must be a torch.Tensor cache, got {type(cache).__name__}")
    if cache.dim() >= 1 and cache.shape[0] < 1:
        raise LayoutError(f"{arg}: the cache has no blocks (num_blocks = 0), got shape {list(cache.shape)}")
    if cache.dtype == torch.uint8:
        per = TOKEN_BYTES if d == KV_DIM else IDX_TOKEN_BYTES
        fmt = "fp8_ds_mla" if d == KV_DIM else "mxfp4"
        ok2 = cache.dim() == 2 and cache.shape[1] % per == 0 and cache.shape[1] > 0
        ok3 = cache.dim() == 3 and cache.shape[2] == per and cache.shape[1] > 0
        if not (ok2 or ok3):
            raise LayoutError(f"{arg}: uint8 {fmt} cache must be [num_blocks, block_size * {per}] (or the same bytes "
                              f"viewed as [num_blocks, block_size, {per}]), got {list(cache.shape)}")
        bs = cache.shape[1] // per if ok2 else cache.shape[1]
        if fmt == "fp8_ds_mla" and bs % 2:
            raise LayoutError(f"{arg}: fp8_ds_mla block_size must be even (16-byte aligned token rows in a "
                              f"{per}-byte-per-token block), got block_size={bs}")
    elif cache.dtype == torch.bfloat16:
        if cache.dim() != 3 or cache.shape[2] != d:
            raise LayoutError(f"{arg}: bf16 cache must be [num_blocks, block_size, {d}], got {list(cache.shape)}")
        fmt, bs = "bf16", cache.shape[1]
    else:
        raise LayoutError(f"{arg}: cache dtype must be uint8 (quantized) or bfloat16, got {dtype_name(cache.dtype)}")
    if not cache.is_contiguous():
        raise LayoutError(f"{arg}: must be contiguous, got strides {list(cache.stride())}")
    if cache.device.type == "cuda" and cache.numel() and cache.data_ptr() % 16:
        raise LayoutError(f"{arg}: data pointer must be 16-byte aligned")
    return fmt, bs


def _cache_pair(op: str, main: torch.Tensor, main_arg: str, other: Optional[torch.Tensor], other_arg: str, d: int,
                device: torch.device, device_arg: str) -> tuple[str, int, Optional[int]]:
    """(fmt, block_size of ``main``, block_size of ``other`` or None) of a main cache and an optional
    second one (the SWA or the compressed cache of the same layer): same format, both on ``device``
    (the device of argument ``device_arg``); ``LayoutError`` naming the argument otherwise."""
    fmt, bs = _cache_info(main, d, main_arg)
    obs = None
    if other is not None:
        ofmt, obs = _cache_info(other, d, other_arg)
        if ofmt != fmt:
            raise LayoutError(f"{op}: '{other_arg}' format {ofmt} differs from '{main_arg}' format {fmt}")
    for arg, t in ((main_arg, main), (other_arg, other)):
        if t is not None and t.device != device:
            raise LayoutError(f"{op}: '{arg}' is on {t.device}, '{device_arg}' on {device}")
    return fmt, bs, obs


def _check_table(name: str, bt: torch.Tensor, rows_min: int | None = None) -> None:
    if bt.dtype != torch.int32 or bt.dim() != 2 or not bt.is_contiguous():
        raise LayoutError(f"{name}: expected contiguous int32 [rows, max_blocks], got {dtype_name(bt.dtype)} "
                          f"{list(bt.shape)} strides {list(bt.stride())}")
    if rows_min is not None and bt.shape[0] < rows_min:
        raise LayoutError(f"{name}: has {bt.shape[0]} rows, needs at least {rows_min} (one per sequence)")


def _check_ids(name: str, t: torch.Tensor, hi: int, what: str) -> None:
    """Host check (syncs; the ``debug_check`` paths only): every value of ``t`` in ``[-1, hi)``,
    else ValueError naming ``name``, the first bad position and ``what`` ``hi`` is."""
    bad = (t < -1) | (t >= hi)
    if bool(bad.any()):
        i = bad.nonzero()[0].tolist()
        raise ValueError(f"{name}[{', '.join(map(str, i))}] = {int(t[tuple(i)])} is outside [-1, {what}={hi})")


def _debug_table(name: str, bt: torch.Tensor, nb: int) -> None:
    _check_ids(name, bt, nb, "num_blocks")


# =============================================================================== append
APPEND_SPEC = OpSpec(
    name="kv_cache_append",
    summary="Quantize BF16 KV rows [N, 512] into a paged DSV4 cache (fp8_ds_mla 584 B/token or bf16) at slot_mapping; in place.",
    inputs=(
        TensorSpec("cache", (torch.uint8, torch.bfloat16), ("num_blocks", "W"), packing=_CACHE_PACKING,
                   scale="UE8M0 byte b = 2^(b-127), one per 64 nope dims, in the block's scale region",
                   doc="paged cache, modified in place (bf16 form is rank 3 [num_blocks, bs, 512])"),
        TensorSpec("kv", torch.bfloat16, ("N", 512), doc="rows after kv_norm + RoPE (front-end output)"),
        TensorSpec("slot_mapping", _IDX, ("N",), align=4,
                   doc="physical slot page*bs+off per row; -1 = skip; SWA ring: ring_page*bs + pos % 128"),
    ),
    params=(Param("debug_check", "bool", "{False, True}", "validate slot values on the host (syncs)"),),
    formula="nope: s_g = 2^ceil(log2(max(amax_g, 1e-4) * fp32(1/448))), q = e4m3_rn(clamp(x / s_g, +-448)); "
            "rope: bf16 copy; bf16 format stores q * s_g (exact)",
    source=_SOURCE,
    notes="Slots < 0 or >= num_blocks*bs are skipped on the device (never written out of bounds). One warp "
          "per token, one launch, no host sync, CUDA-graph capturable.",
)


@dataclass(frozen=True)
class AppendProblem(Problem):
    """What selects the ``kv_cache_append`` provider (frozen: the registry's cache key)."""

    fmt: str            # "fp8_ds_mla" | "bf16"
    slot: str           # slot_mapping dtype name
    device: str
    i32: bool           # every byte offset fits int32 (the DSL kernels' index width)


def _append_example(target: Target) -> AppendProblem:
    return AppendProblem("fp8_ds_mla", "int64", target.device_type, True)


APPEND_OP = register(Op("kv_cache_append", APPEND_SPEC, module="kv_cache", example_problem=_append_example))


@custom_op("dsv4::kv_cache_append", mutates_args=("cache",))
def _kv_cache_append_op(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    fmt, bs = _cache_info(cache, KV_DIM)
    problem = AppendProblem(fmt, dtype_name(slot_mapping.dtype), kv.device.type,
                            cache.numel() * cache.element_size() < _I32_BYTES)
    APPEND_OP.dispatch(problem, Target.of(kv.device), cache=cache, kv=kv, slot_mapping=slot_mapping)


@_kv_cache_append_op.register_fake
def _(cache, kv, slot_mapping):
    return None


@planned
def kv_cache_append(cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, *,
                    debug_check: bool = False) -> None:
    """Write ``kv`` rows into a paged KV cache (in place), quantizing to the cache's format.

    Args:
        cache: uint8 ``[num_blocks, block_size * 584]`` (``fp8_ds_mla``; block_size even) or
            bfloat16 ``[num_blocks, block_size, 512]``. Byte layout in the module docstring.
        kv: bfloat16 ``[N, 512]`` (kv_norm'ed, RoPE'd rows; dims 448..511 are the rope dims).
        slot_mapping: int32/int64 ``[N]`` physical slots ``page * block_size + offset``; ``-1``
            skips the row. For the SWA ring (window 128) use ``ring_slot(pos) = pos % 128``
            mapped through the request's ring pages.
        debug_check: validate ``-1 <= slot < num_blocks * block_size`` on the host (syncs).

    Returns:
        None (``cache`` is modified).

    Raises:
        LayoutError: dtype / shape / contiguity / alignment mismatch (names the argument).
        ValueError: ``debug_check`` and an out-of-range slot. Without ``debug_check``, slots
            outside ``[0, num_blocks * block_size)`` are skipped on the device.

    Source: DSV4 model.py Attention L502-506 (act_quant block 64, ue8m0), vLLM DSV4 fp8_ds_mla.
    """
    syms = APPEND_SPEC.validate({"kv": kv, "slot_mapping": slot_mapping},
                                specs=APPEND_SPEC.inputs[1:])
    fmt, bs = _cache_info(cache, KV_DIM)
    if cache.device != kv.device:
        raise LayoutError(f"kv_cache_append: 'cache' is on {cache.device}, 'kv' on {kv.device}")
    if debug_check and syms["N"]:
        n_slots = cache.shape[0] * bs
        bad = (slot_mapping < -1) | (slot_mapping >= n_slots)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"kv_cache_append: slot_mapping[{i}] = {int(slot_mapping[i])} is outside "
                             f"[-1, num_blocks * block_size = {n_slots})")
    if syms["N"] == 0:
        return
    _kv_cache_append_op(cache, kv, slot_mapping)


# =============================================================================== gather
GATHER_SPEC = OpSpec(
    name="kv_gather",
    summary="Dequantize SWA-window rows and top-k compressed rows of paged DSV4 caches into dense BF16 [T, W + K, 512]; -1 -> zero row.",
    inputs=(
        TensorSpec("cache", (torch.uint8, torch.bfloat16), ("num_blocks", "Wc"), packing=_CACHE_PACKING,
                   doc="compressed cache (fp8_ds_mla or bf16 [num_blocks, bs, 512])"),
        TensorSpec("block_table", torch.int32, ("R", "max_blocks"), align=4,
                   doc="compressed cache pages of each request"),
        TensorSpec("indices", torch.int32, ("T", "K"), align=4,
                   doc="top-k logical compressed entry ids per query (-1 = none)"),
        TensorSpec("lens", torch.int32, ("R",), align=4,
                   doc="valid compressed entries of each request: index l is read only if 0 <= l < lens[req]"),
        TensorSpec("req_idx", torch.int32, ("T",), align=4, optional=True,
                   doc="request (block_table row) of each query; default t"),
        TensorSpec("swa_cache", (torch.uint8, torch.bfloat16), ("swa_blocks", "Ws"), optional=True,
                   packing="same format as cache", doc="SWA ring cache"),
        TensorSpec("swa_block_table", torch.int32, ("Rs", "swa_max_blocks"), align=4, optional=True,
                   doc="SWA ring pages of each request"),
        TensorSpec("swa_indices", torch.int32, ("T", "W"), align=4, optional=True,
                   doc="logical SWA slots (ring slot = pos % 128) per query; -1 = none"),
        TensorSpec("swa_lens", torch.int32, ("Rs",), align=4, optional=True,
                   doc="valid ring slots of each request, min(tokens, 128): slot l is read only if l < swa_lens[req]"),
    ),
    outputs=(TensorSpec("out", torch.bfloat16, ("T", "W + K", 512),
                        doc="rows [0, W) from the SWA cache, rows [W, W+K) from the compressed cache"),),
    params=(Param("debug_check", "bool", "{False, True}", "validate block tables and indices on the host (syncs)"),),
    formula="l -> page = block_table[req, l // bs], off = l % bs; row = e4m3 * 2^(sf - 127) (exact in bf16), bf16 rope; "
            "l < 0, l >= lens[req], l // bs >= max_blocks, page outside [0, num_blocks) -> zeros",
    source=_SOURCE + "; FlashMLA dequantize_and_gather_k_cache",
    notes="One launch, no host sync, CUDA-graph capturable; never reads out of bounds, never reads another "
          "request's entries (indices at or past lens[req] give zero rows even when the block_table column holds "
          "a page). Providers: dsl (kernels_dsl/kv_cache.py), cuda (kernels_cuda/kv_cache.cu), torch.",
)


@dataclass(frozen=True)
class GatherProblem(Problem):
    """What selects the ``kv_gather`` provider."""

    fmt: str
    swa: bool           # a sliding-window cache is gathered too
    device: str
    i32: bool           # every byte offset (caches and output) fits int32


def _gather_example(target: Target) -> GatherProblem:
    return GatherProblem("fp8_ds_mla", True, target.device_type, True)


GATHER_OP = register(Op("kv_gather", GATHER_SPEC, module="kv_cache", example_problem=_gather_example))


@custom_op("dsv4::kv_gather", mutates_args=())
def _kv_gather_op(cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, lens: torch.Tensor,
                  req_idx: Optional[torch.Tensor], swa_cache: Optional[torch.Tensor],
                  swa_block_table: Optional[torch.Tensor], swa_indices: Optional[torch.Tensor],
                  swa_lens: Optional[torch.Tensor]) -> torch.Tensor:
    fmt, _ = _cache_info(cache, KV_DIM)
    W = swa_indices.shape[1] if swa_indices is not None else 0
    big = max(cache.numel() * cache.element_size(), indices.shape[0] * (W + indices.shape[1]) * KV_DIM * 2,
              swa_cache.numel() * swa_cache.element_size() if swa_cache is not None else 0)
    problem = GatherProblem(fmt, swa_indices is not None, cache.device.type, big < _I32_BYTES)
    return GATHER_OP.dispatch(problem, Target.of(cache.device), cache=cache, block_table=block_table,
                              indices=indices, lens=lens, req_idx=req_idx, swa_cache=swa_cache,
                              swa_block_table=swa_block_table, swa_indices=swa_indices, swa_lens=swa_lens)


@_kv_gather_op.register_fake
def _(cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table, swa_indices, swa_lens):
    W = swa_indices.shape[1] if swa_indices is not None else 0
    return indices.new_empty((indices.shape[0], W + indices.shape[1], KV_DIM), dtype=torch.bfloat16)


@planned
def kv_gather(cache: torch.Tensor, block_table: torch.Tensor, indices: torch.Tensor, *, lens: torch.Tensor,
              req_idx: Optional[torch.Tensor] = None, swa_cache: Optional[torch.Tensor] = None,
              swa_block_table: Optional[torch.Tensor] = None, swa_indices: Optional[torch.Tensor] = None,
              swa_lens: Optional[torch.Tensor] = None, debug_check: bool = False) -> torch.Tensor:
    """Gather and dequantize KV rows for sparse attention (SWA window + top-k compressed).

    Args:
        cache: compressed cache, uint8 ``[num_blocks, bs * 584]`` (fp8_ds_mla) or bf16
            ``[num_blocks, bs, 512]``.
        block_table: int32 ``[R, max_blocks]`` pages of each request's compressed cache.
        indices: int32 ``[T, K]`` logical compressed entry ids (the indexer's top-k, or all
            entries ``b < (t+1) // ratio`` for HCA); ``-1`` = no entry (zero row).
        lens: int32 ``[R]`` (required, keyword) valid compressed entries of each request
            (``L_r // ratio`` after the compressor ran): index ``l`` of a query of request
            ``r`` is read only when ``0 <= l < lens[r]``; any other index gives a zero row, so a
            query never reads another request's entries through a stale or padded block_table
            column (isolation; checked on the device, no host sync).
        req_idx: int32 ``[T]`` request of each query row (default ``t``; then ``R >= T``). A value
            outside ``[0, R)`` gives that row all-zero output rows (not checked: ``debug_check`` raises).
        swa_cache, swa_block_table, swa_indices, swa_lens: the SWA ring cache (same format as
            ``cache``), its pages, int32 ``[T, W]`` logical ring slots (``pos % 128``; -1 =
            none), and int32 ``[Rs]`` valid ring slots of each request (``min(L_r, 128)``; slot
            ``l`` is read only when ``l < swa_lens[r]``). All four or none.
        debug_check: validate block tables (entries in ``[-1, num_blocks)``), lens
            (``0 <= lens <= max_blocks * bs``) and indices (``-1 <= l < max_blocks * bs``) on the
            host (syncs).

    Returns:
        bfloat16 ``[T, W + K, 512]``: rows ``[0, W)`` from the SWA cache, then the compressed
        rows, in index order (the reference's ``cat([window_idx, compress_idx])`` order).
        Dequantization is exact (E4M3 x 2^k is representable in BF16).

    Raises:
        LayoutError: dtype / shape / format mismatch (names the argument), e.g. a bf16 SWA
            cache with an fp8 compressed cache.
        ValueError: partial SWA arguments, or ``debug_check`` finds a bad value. Without it,
            invalid indices / pages / indices at or past ``lens`` give zero rows on the device
            (never out of bounds, never another request's rows; negative ``lens`` = empty).

    Source: dsv4_spec.md 2.2 (window + compressed key set, -1 invalid), 4.4 (item 12).
    """
    swa = (swa_cache, swa_block_table, swa_indices, swa_lens)
    if any(x is not None for x in swa) and not all(x is not None for x in swa):
        raise ValueError("kv_gather: pass all of swa_cache, swa_block_table, swa_indices, swa_lens or none of them")
    tensors = {"block_table": block_table, "indices": indices, "lens": lens, "req_idx": req_idx,
               "swa_block_table": swa_block_table, "swa_indices": swa_indices, "swa_lens": swa_lens}
    GATHER_SPEC.validate(tensors, specs=[s for s in GATHER_SPEC.inputs if s.name in tensors])
    fmt, bs, sbs = _cache_pair("kv_gather", cache, "cache", swa_cache, "swa_cache", KV_DIM, indices.device, "indices")
    if req_idx is None and block_table.shape[0] < indices.shape[0]:
        raise LayoutError(f"kv_gather: block_table has {block_table.shape[0]} rows but req_idx is None and T = "
                          f"{indices.shape[0]} (row t uses request t)")
    if debug_check:
        _debug_table("block_table", block_table, cache.shape[0])
        lim = block_table.shape[1] * bs
        if bool(((indices < -1) | (indices >= lim)).any()):
            raise ValueError(f"kv_gather: indices outside [-1, max_blocks * block_size = {lim})")
        if swa_cache is not None:
            _debug_table("swa_block_table", swa_block_table, swa_cache.shape[0])
            lim = swa_block_table.shape[1] * sbs
            if bool(((swa_indices < -1) | (swa_indices >= lim)).any()):
                raise ValueError(f"kv_gather: swa_indices outside [-1, swa_max_blocks * block_size = {lim})")
        if req_idx is not None and bool(((req_idx < 0) | (req_idx >= block_table.shape[0])).any()):
            raise ValueError(f"kv_gather: req_idx outside [0, {block_table.shape[0]})")
        for name, ln, bt_, b_ in (("lens", lens, block_table, bs), ("swa_lens", swa_lens, swa_block_table,
                                                                     sbs if swa_cache is not None else 0)):
            if ln is not None and bool(((ln < 0) | (ln > bt_.shape[1] * b_)).any()):
                raise ValueError(f"kv_gather: {name} outside [0, max_blocks * block_size = {bt_.shape[1] * b_}]")
    return _kv_gather_op(cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table,
                                    swa_indices, swa_lens)


# =============================================================================== compressor
_COMPRESS_INPUTS = (
    TensorSpec("kv", torch.float32, ("T", "CH"), doc="wkv(x) per token, fp32, CH = coff * d (coff = 2 for ratio 4)"),
    TensorSpec("score", torch.float32, ("T", "CH"), doc="wgate(x) per token, fp32"),
    TensorSpec("ape", torch.float32, ("ratio", "CH"), doc="positional bias added to score by position in the block"),
    TensorSpec("norm_weight", torch.float32, ("d",), doc="RMSNorm weight (d = 512 attention, 128 indexer)"),
    TensorSpec("rope_cos_sin", torch.float32, ("P", 64),
               doc="row p = (cos_0, sin_0, ..., cos_31, sin_31) at position p (dsv4.reference.rope.rope_cos_sin_table: "
                   "compress_rope_theta 160000, YaRN); must cover every b * ratio"),
)
_COMPRESS_CACHE = TensorSpec(
    "cache", (torch.uint8, torch.bfloat16), ("num_blocks", "Wc"),
    packing="d=512: " + _CACHE_PACKING + ". d=128 (indexer): mxfp4 uint8 [num_blocks, bs*68]: values at "
            "page*bs*68 + off*64 (E2M1, low nibble first), scales at page*bs*68 + bs*64 + off*4 (4 UE8M0); "
            "or bf16 [num_blocks, bs, 128]",
    doc="compressed cache; entry b of sequence i -> page block_table[i, b // bs], offset b % bs")
_STATE = ("kv_state / score_state: float32 [>= B, coff*ratio, coff*d] (model.py kv_state / score_state); "
          "score_state rows hold score + ape; fresh state = (0, -inf), see new_compress_state")
_COMPRESS_FORMULA = ("rows (ratio 4: prev block ch [0:d] + current ch [d:2d]; ratio 128: block) ; c = sum_rows "
                     "softmax_rows(score + ape) * kv (per channel, fp32); c = bf16(c); y = bf16(w * (c / sqrt(mean(c^2) "
                     "+ eps))); RoPE(y[-64:], pos = b*ratio) -> bf16; d=512: fp8_ds_mla quant of y; d=128: "
                     "bf16(Hadamard(y) * 128^-0.5) -> MXFP4")


def _compress_check(kv, score, ape, norm_weight, rope_cos_sin, cache, spec, extra):
    tensors = {"kv": kv, "score": score, "ape": ape, "norm_weight": norm_weight, "rope_cos_sin": rope_cos_sin,
               **extra}
    syms = spec.validate(tensors, specs=[s for s in spec.inputs if s.name in tensors])
    ratio, d, ch = syms["ratio"], syms["d"], syms["CH"]
    if ratio not in COMPRESS_RATIOS:
        raise LayoutError(f"{spec.name}: ape must be [ratio, CH] with ratio 4 (CSA) or 128 (HCA), got {list(ape.shape)}")
    if d not in (KV_DIM, IDX_DIM):
        raise LayoutError(f"{spec.name}: norm_weight must be [512] (attention) or [128] (indexer), got {list(norm_weight.shape)}")
    coff = 2 if ratio == 4 else 1
    if ch != coff * d:
        raise LayoutError(f"{spec.name}: kv/score/ape last dim must be coff*d = {coff}*{d} = {coff * d} for ratio "
                          f"{ratio}, got {ch}")
    fmt, bs = _cache_info(cache, d)
    if cache.device != kv.device:
        raise LayoutError(f"{spec.name}: 'cache' is on {cache.device}, 'kv' on {kv.device}")
    return syms, fmt, bs, ratio, d, coff


def _check_state(name, kv_state, score_state, B, ratio, d, coff, device):
    want = (coff * ratio, coff * d)
    for nm, st in (("kv_state", kv_state), ("score_state", score_state)):
        if st is None or st.dtype != torch.float32 or st.dim() != 3 or tuple(st.shape[1:]) != want \
                or st.shape[0] < B or not st.is_contiguous():
            got = "None" if st is None else f"{dtype_name(st.dtype)} {list(st.shape)}"
            raise LayoutError(f"{name}: '{nm}' must be contiguous float32 [>= {B}, {want[0]}, {want[1]}], got {got}")
        if st.device != device:
            raise LayoutError(f"{name}: '{nm}' is on {st.device}, 'kv' on {device}")


PREFILL_SPEC = OpSpec(
    name="kv_compress_prefill",
    summary="DSV4 compressor, prefill: every complete block of every (ragged) sequence -> one compressed entry "
            "in a paged cache; the tail -> FP32 decode state.",
    inputs=_COMPRESS_INPUTS + (
        TensorSpec("cu_seqlens", torch.int32, ("B1",), align=4,
                   doc="token offsets of the sequences in kv/score; each sequence starts at position 0"),
        TensorSpec("block_table", torch.int32, ("Bt", "max_blocks"), align=4, doc="compressed cache pages per sequence"),
        _COMPRESS_CACHE,
        TensorSpec("kv_state", torch.float32, ("Bs", "NR", "CH"), optional=True, doc=_STATE),
        TensorSpec("score_state", torch.float32, ("Bs", "NR", "CH"), optional=True, doc=_STATE),
    ),
    params=(Param("eps", "float", "> 0", "RMSNorm eps (1e-6)"),
            Param("debug_check", "bool", "{False, True}", "validate cu_seqlens / block_table / rope table on the host")),
    formula=_COMPRESS_FORMULA,
    source=_SOURCE,
    notes="One launch: one thread group per entry (entry -> sequence by a warp prefix scan over cu_seqlens on "
          "the device) plus one CTA per (sequence, state row). Entries whose page is out of range are skipped; "
          "sequences whose cu_seqlens range is not inside [0, T] count as empty.",
)
DECODE_SPEC = OpSpec(
    name="kv_compress_decode",
    summary="DSV4 compressor, decode: append one token per sequence to the FP32 state; at a block boundary "
            "emit the compressed entry (bit-identical to prefill).",
    inputs=_COMPRESS_INPUTS + (
        TensorSpec("positions", _IDX, ("B",), align=4,
                   doc="position of this step's token per sequence; -1 = skip (on the device any negative value "
                       "skips; CPU tensors: values < -1 or past the block / rope table raise)"),
        TensorSpec("block_table", torch.int32, ("Bt", "max_blocks"), align=4, doc="compressed cache pages per sequence"),
        _COMPRESS_CACHE,
        TensorSpec("kv_state", torch.float32, ("Bs", "NR", "CH"), doc=_STATE),
        TensorSpec("score_state", torch.float32, ("Bs", "NR", "CH"), doc=_STATE),
    ),
    params=PREFILL_SPEC.params,
    formula=_COMPRESS_FORMULA + "; state row (coff-1)*ratio + pos % ratio <- (kv, score + ape[pos % ratio]); "
                                "ratio 4: after emitting, rows [0:4] <- rows [4:8]",
    source=_SOURCE,
    notes="One CTA per sequence; the pooling code and order are those of kv_compress_prefill. A position whose entry "
          "lies past the block table (or on a page outside [0, num_blocks)) updates the state and writes no entry.",
)


@dataclass(frozen=True)
class CompressProblem(Problem):
    """What selects the ``kv_compress_prefill`` / ``kv_compress_decode`` provider."""

    fmt: str
    d: int              # head dim (512 main KV, 128 indexer keys)
    ratio: int          # compression ratio (ape rows): 4 (CSA) or 128 (HCA)
    pos: str            # positions dtype name ("int32" for prefill's cu_seqlens)
    eps: float          # RMSNorm epsilon (a kernel argument)
    device: str


def _compress_example(target: Target) -> CompressProblem:
    return CompressProblem("fp8_ds_mla", 512, 4, "int64", 1e-6, target.device_type)


PREFILL_OP = register(Op("kv_compress_prefill", PREFILL_SPEC, module="kv_cache", example_problem=_compress_example))
DECODE_OP = register(Op("kv_compress_decode", DECODE_SPEC, module="kv_cache", example_problem=_compress_example))


@custom_op("dsv4::kv_compress_prefill", mutates_args=("cache", "kv_state", "score_state"))
def _kv_compress_prefill_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                            rope_cos_sin: torch.Tensor, cu_seqlens: torch.Tensor, block_table: torch.Tensor,
                            cache: torch.Tensor, kv_state: Optional[torch.Tensor],
                            score_state: Optional[torch.Tensor], eps: float) -> None:
    d = norm_weight.shape[0]
    fmt, _ = _cache_info(cache, d)
    problem = CompressProblem(fmt, d, ape.shape[0], "int32", float(eps), kv.device.type)
    PREFILL_OP.dispatch(problem, Target.of(kv.device), kv=kv, score=score, ape=ape, norm_weight=norm_weight,
                        rope_cos_sin=rope_cos_sin, cu_seqlens=cu_seqlens, block_table=block_table, cache=cache,
                        kv_state=kv_state, score_state=score_state)


@_kv_compress_prefill_op.register_fake
def _(kv, score, ape, norm_weight, rope_cos_sin, cu_seqlens, block_table, cache, kv_state, score_state, eps):
    return None


@custom_op("dsv4::kv_compress_decode", mutates_args=("cache", "kv_state", "score_state"))
def _kv_compress_decode_op(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                           rope_cos_sin: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                           cache: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor, eps: float) -> None:
    d = norm_weight.shape[0]
    fmt, _ = _cache_info(cache, d)
    problem = CompressProblem(fmt, d, ape.shape[0], dtype_name(positions.dtype), float(eps), kv.device.type)
    DECODE_OP.dispatch(problem, Target.of(kv.device), kv=kv, score=score, ape=ape, norm_weight=norm_weight,
                       rope_cos_sin=rope_cos_sin, positions=positions, block_table=block_table, cache=cache,
                       kv_state=kv_state, score_state=score_state)


@_kv_compress_decode_op.register_fake
def _(kv, score, ape, norm_weight, rope_cos_sin, positions, block_table, cache, kv_state, score_state, eps):
    return None


@planned
def kv_compress_prefill(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                        rope_cos_sin: torch.Tensor, cu_seqlens: torch.Tensor, block_table: torch.Tensor,
                        cache: torch.Tensor, *, kv_state: Optional[torch.Tensor] = None,
                        score_state: Optional[torch.Tensor] = None, eps: float = 1e-6,
                        debug_check: bool = False) -> None:
    """DSV4 compressor (CSA ratio 4 with overlap / HCA ratio 128), prefill mode, in place.

    Every sequence ``i`` (tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` of ``kv``/``score``, positions
    from 0) emits entries ``b = 0 .. L_i // ratio - 1`` into ``cache`` (page
    ``block_table[i, b // bs]``, offset ``b % bs``). With ``kv_state``/``score_state`` the
    incomplete tail (and, for ratio 4, the last complete block's rows) are stored so that
    :func:`kv_compress_decode` continues bit-identically.

    Args:
        kv, score: float32 ``[T, coff*d]`` = ``wkv(x)``, ``wgate(x)`` (coff = 2 for ratio 4, else 1).
        ape: float32 ``[ratio, coff*d]`` (ratio 4 or 128).
        norm_weight: float32 ``[d]``; d = 512 (attention) or 128 (indexer: Hadamard + MXFP4).
        rope_cos_sin: float32 ``[P, 64]`` interleaved cos/sin (``dsv4.reference.rope.rope_cos_sin_table``);
            ``P`` must exceed every ``b * ratio`` (clamped to row ``P - 1`` on the device).
        cu_seqlens: int32 ``[B + 1]``, non-decreasing within ``[0, T]``. Checked where it is free
            (CPU tensors) and with ``debug_check``; on a GPU, without ``debug_check`` (no host sync),
            a sequence whose range ``[cu_seqlens[i], cu_seqlens[i+1])`` is not inside ``[0, T]``
            (decreasing, negative or past ``T``) counts as empty: no entries, decode state rows
            reset to (0, -inf); nothing is read out of bounds.
        block_table: int32 ``[>= B, max_blocks]``; entries whose page is -1 or outside
            ``[0, num_blocks)``, or whose page column is past ``max_blocks``, are not written.
        cache: d=512: uint8 ``[nb, bs*584]`` or bf16 ``[nb, bs, 512]``; d=128: uint8
            ``[nb, bs*68]`` (MXFP4) or bf16 ``[nb, bs, 128]``.
        kv_state, score_state: optional float32 ``[>= B, coff*ratio, coff*d]`` (both or neither).
        eps: RMSNorm epsilon.
        debug_check: host-side value checks (syncs): cu_seqlens monotone within [0, T], pages in
            range, rope table long enough, every entry inside the block table. On CPU tensors the
            same checks always run (they cost no device sync), except the page values.

    Returns:
        None.

    Raises:
        LayoutError: shapes / dtypes / formats (names the argument).
        ValueError: value checks (CPU tensors, or ``debug_check``): ``cu_seqlens`` decreasing or
            outside ``[0, T]``, the rope table or the block table too short; ``debug_check``: a page
            outside ``[-1, num_blocks)``.

    Source: FLASH-REF model.py Compressor.forward (start_pos == 0 branch), dsv4_spec.md 2.3, 4.2.
    """
    if (kv_state is None) != (score_state is None):
        raise ValueError("kv_compress_prefill: pass both kv_state and score_state or neither")
    extra = {"cu_seqlens": cu_seqlens, "block_table": block_table}
    syms, fmt, bs, ratio, d, coff = _compress_check(kv, score, ape, norm_weight, rope_cos_sin, cache,
                                                    PREFILL_SPEC, extra)
    B = cu_seqlens.shape[0] - 1
    _check_table("block_table", block_table, B)
    if rope_cos_sin.shape[0] == 0:
        raise LayoutError("kv_compress_prefill: argument 'rope_cos_sin' has 0 rows; it needs one per position b * ratio")
    if kv_state is not None:
        _check_state("kv_compress_prefill", kv_state, score_state, B, ratio, d, coff, kv.device)
    if debug_check or kv.device.type == "cpu":   # host values: free on CPU tensors, a sync on a GPU
        cu = cu_seqlens.long()
        T = kv.shape[0]
        bad = torch.cat([cu[:1] < 0, cu[1:] < cu[:-1], cu[-1:] > T]).nonzero().flatten()
        if B and bad.numel():
            i = min(int(bad[0]), B)
            raise ValueError(f"kv_compress_prefill: argument 'cu_seqlens' must be non-decreasing within [0, T={T}] "
                             f"(T = kv.shape[0]); cu_seqlens[{i}] = {int(cu[i])}"
                             + (f" after cu_seqlens[{i - 1}] = {int(cu[i - 1])}" if i else ""))
        if debug_check:
            _debug_table("block_table", block_table, cache.shape[0])
        if B:
            n_max = int((cu[1:] - cu[:-1]).max()) // ratio
            if n_max and (n_max - 1) * ratio >= rope_cos_sin.shape[0]:
                raise ValueError(f"kv_compress_prefill: rope_cos_sin has {rope_cos_sin.shape[0]} rows, position "
                                 f"{(n_max - 1) * ratio} needed")
            if n_max > block_table.shape[1] * bs:
                raise ValueError(f"kv_compress_prefill: a sequence has {n_max} entries but block_table holds "
                                 f"{block_table.shape[1]} x {bs}")
    if B == 0:
        return
    _kv_compress_prefill_op(kv, score, ape, norm_weight, rope_cos_sin, cu_seqlens, block_table, cache,
                                       kv_state, score_state, float(eps))


@planned
def kv_compress_decode(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, norm_weight: torch.Tensor,
                       rope_cos_sin: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                       cache: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor, *,
                       eps: float = 1e-6, debug_check: bool = False) -> None:
    """DSV4 compressor, one decode step per sequence, in place (cache and state).

    Sequence ``i``'s token at ``positions[i]`` (-1 = skip) is stored in state row
    ``(coff-1)*ratio + pos % ratio`` (score + ape); when ``(pos + 1) % ratio == 0`` the state is
    pooled (same device code and order as :func:`kv_compress_prefill`, so entries are
    bit-identical), ratio 4 shifts rows [4:8] -> [0:4], and entry ``pos // ratio`` is written.

    Args:
        kv, score: float32 ``[B, coff*d]`` (this step's ``wkv(x)``, ``wgate(x)``).
        ape, norm_weight, rope_cos_sin, block_table, cache, eps: as :func:`kv_compress_prefill`.
        positions: int32/int64 ``[B]``: -1 = skip this sequence, else ``>= 0`` with the entry
            ``pos // ratio`` inside the block table (``< max_blocks * bs``) and the rope table
            (``pos // ratio * ratio < P``). Checked where it is free (CPU tensors) and with
            ``debug_check``; on a GPU without ``debug_check`` (no host sync): any negative position
            skips its sequence (state and cache untouched); a position whose entry falls outside
            the block table (or on a page -1 / outside ``[0, num_blocks)``) updates the state but
            writes no entry; the rope row is clamped to ``P - 1``; nothing is read out of bounds.
        kv_state, score_state: float32 ``[>= B, coff*ratio, coff*d]`` (from prefill or
            :func:`new_compress_state`).
        debug_check: host-side checks of positions / pages / rope table (syncs).

    Returns:
        None.

    Raises:
        LayoutError: shapes / dtypes / formats. ValueError: value checks (CPU tensors, or
            ``debug_check``): a position below -1 or past the block / rope table; ``debug_check``:
            a page outside ``[-1, num_blocks)``.

    Source: FLASH-REF model.py Compressor.forward (start_pos > 0 branch), dsv4_spec.md 2.3.
    """
    extra = {"positions": positions, "block_table": block_table}
    syms, fmt, bs, ratio, d, coff = _compress_check(kv, score, ape, norm_weight, rope_cos_sin, cache,
                                                    DECODE_SPEC, extra)
    B = syms["B"]
    if kv.shape[0] != B:
        raise LayoutError(f"kv_compress_decode: kv has {kv.shape[0]} rows, positions has {B}")
    _check_table("block_table", block_table, B)
    if rope_cos_sin.shape[0] == 0:
        raise LayoutError("kv_compress_decode: argument 'rope_cos_sin' has 0 rows; it needs one per position b * ratio")
    _check_state("kv_compress_decode", kv_state, score_state, B, ratio, d, coff, kv.device)
    if debug_check or kv.device.type == "cpu":   # host values: free on CPU tensors, a sync on a GPU
        if debug_check:
            _debug_table("block_table", block_table, cache.shape[0])
        p = positions.long()
        cap = block_table.shape[1] * bs
        bad = ((p < -1) | ((p >= 0) & ((p // ratio >= cap) | (p // ratio * ratio >= rope_cos_sin.shape[0])))).nonzero()
        if bad.numel():
            i = int(bad[0])
            why = ("-1 = skip, else >= 0" if int(p[i]) < -1 else
                   f"its entry {int(p[i]) // ratio} must lie inside block_table ({block_table.shape[1]} pages x {bs} "
                   f"= {cap} entries) and rope_cos_sin ({rope_cos_sin.shape[0]} rows)")
            raise ValueError(f"kv_compress_decode: argument 'positions' has positions[{i}] = {int(p[i])}: {why}")
    if B == 0:
        return
    _kv_compress_decode_op(kv, score, ape, norm_weight, rope_cos_sin, positions, block_table, cache,
                                      kv_state, score_state, float(eps))


def new_compress_state(batch: int, ratio: int, head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh compressor decode state for :func:`kv_compress_prefill` / :func:`kv_compress_decode`.

    Args:
        batch: number of sequences (state rows), a Python int >= 0.
        ratio: compression ratio, one of :data:`COMPRESS_RATIOS`: 4 (CSA, overlapping windows:
            ``coff = 2``) or 128 (HCA: ``coff = 1``).
        head_dim: ``d``, one of 512 (attention KV compressor) or 128 (indexer key compressor).
        device: torch device of the state (default CPU).

    Returns:
        ``(kv_state, score_state)``: float32 ``[batch, coff*ratio, coff*head_dim]`` each;
        ``kv_state`` zeros, ``score_state`` -inf (no token seen yet).

    Raises:
        ValueError: ``batch`` not an int >= 0, ``ratio`` not 4 / 128, ``head_dim`` not 512 / 128.

    Source: model.py Compressor.__init__ (kv_state zeros, score_state -inf), dsv4_spec.md 2.3.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"new_compress_state: argument 'batch' must be an int >= 0, got {type(batch).__name__} {batch!r}")
    if isinstance(ratio, bool) or ratio not in COMPRESS_RATIOS:
        raise ValueError(f"new_compress_state: argument 'ratio' must be one of {COMPRESS_RATIOS} (4 = CSA, 128 = HCA), "
                         f"got {ratio!r}")
    if isinstance(head_dim, bool) or head_dim not in (KV_DIM, IDX_DIM):
        raise ValueError(f"new_compress_state: argument 'head_dim' must be {KV_DIM} (attention) or {IDX_DIM} "
                         f"(indexer), got {head_dim!r}")
    coff = 2 if ratio == 4 else 1
    shape = (batch, coff * ratio, coff * head_dim)
    return (torch.zeros(shape, dtype=torch.float32, device=device),
            torch.full(shape, float("-inf"), dtype=torch.float32, device=device))


__all__ = ["kv_cache_append", "kv_gather", "kv_compress_prefill", "kv_compress_decode", "new_compress_state"]


def graph_cases(device) -> list:
    """CUDA-graph cases: append (fp8_ds_mla), gather (SWA + top-k), CSA compress prefill (d=512)
    and decode (state restored inside the case, so every call is the same step)."""
    from ..reference.kv_cache import TOKEN_BYTES
    from ..reference.rope import rope_cos_sin_table
    from ._common import GraphCase, bytes_of
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(606)
    nb, bs, N, T, K = 64, 64, 1024, 32, 512
    cache = torch.zeros(nb, bs * TOKEN_BYTES, dtype=torch.uint8, device=dev)
    swa = torch.zeros(T // 2 * 2, bs * TOKEN_BYTES, dtype=torch.uint8, device=dev)
    kv = torch.empty(N, 512, dtype=torch.bfloat16, device=dev)
    slots = torch.empty(N, dtype=torch.int64, device=dev)
    bt = torch.empty(T, 16, dtype=torch.int32, device=dev)
    idx = torch.empty(T, K, dtype=torch.int32, device=dev)
    swa_bt = torch.arange(T * 2, dtype=torch.int32, device=dev).view(T, 2) % swa.shape[0]
    swa_idx = torch.empty(T, 128, dtype=torch.int32, device=dev)
    lens = torch.empty(T, dtype=torch.int32, device=dev)
    swa_lens = torch.empty(T, dtype=torch.int32, device=dev)
    # compressor (ratio 4, d = 512: coff = 2)
    cu = torch.tensor([0, 64, 101], dtype=torch.int32, device=dev)       # two sequences: 64 and 37 tokens
    ckv = torch.empty(101, 1024, device=dev)
    csc = torch.empty(101, 1024, device=dev)
    ape = torch.empty(4, 1024, device=dev)
    nw = torch.empty(512, device=dev)
    table = rope_cos_sin_table(256, device=dev)
    cbt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    ccache = torch.zeros(4, 8 * TOKEN_BYTES, dtype=torch.uint8, device=dev)
    dkv, dsc = torch.empty(2, 1024, device=dev), torch.empty(2, 1024, device=dev)
    pos = torch.tensor([7, 3], device=dev)                  # (pos + 1) % 4 == 0: both emit an entry
    st0 = new_compress_state(2, 4, 512, dev)
    st = new_compress_state(2, 4, 512, dev)

    def refresh():
        x = torch.randn(N, 512, generator=gen) * 2
        x[:, 7] *= 60
        kv.copy_(x.to(torch.bfloat16))
        slots.copy_(torch.randperm(nb * bs, generator=gen)[:N])
        bt.copy_(torch.randint(-1, nb, (T, 16), generator=gen, dtype=torch.int32))
        idx.copy_(torch.randint(-1, 16 * bs, (T, K), generator=gen, dtype=torch.int32))
        swa_idx.copy_(torch.randint(-1, 128, (T, 128), generator=gen, dtype=torch.int32))
        lens.copy_(torch.randint(0, 16 * bs + 1, (T,), generator=gen, dtype=torch.int32))
        swa_lens.copy_(torch.randint(0, 129, (T,), generator=gen, dtype=torch.int32))
        for t, s in ((ckv, 1.5), (csc, 2.0), (ape, 0.5), (dkv, 1.5), (dsc, 2.0)):
            t.copy_(torch.randn(t.shape, generator=gen) * s)
        nw.copy_(torch.rand(512, generator=gen) + 0.5)
        for a in st0:
            a.copy_(torch.randn(a.shape, generator=gen))

    def append():
        kv_cache_append(cache, kv, slots)
        return cache.clone()

    def gather():
        return kv_gather(cache, bt, idx, lens=lens, swa_cache=swa, swa_block_table=swa_bt, swa_indices=swa_idx,
                         swa_lens=swa_lens)

    def prefill():
        kv_compress_prefill(ckv, csc, ape, nw, table, cu, cbt, ccache)
        return ccache.clone()

    def decode():
        st[0].copy_(st0[0])
        st[1].copy_(st0[1])
        kv_compress_decode(dkv, dsc, ape, nw, table, pos, cbt, ccache, st[0], st[1])
        return bytes_of(ccache, st[0], st[1])
    refresh()
    append()                                  # fill the cache once so gathers read real entries
    return [GraphCase("kv_cache_append-fp8_ds_mla", "kv_cache_append", append, refresh),
            GraphCase("kv_gather-swa+topk", "kv_gather", gather, refresh),
            GraphCase("kv_compress_prefill-c4-d512", "kv_compress_prefill", prefill, refresh),
            GraphCase("kv_compress_decode-c4-d512", "kv_compress_decode", decode, refresh)]
