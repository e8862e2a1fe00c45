"""DSV4 Lightning Indexer (CSA layers): FP4 paged key cache, query quantization, logits, top-k.

Math (dsv4_spec.md 2.4; FLASH-REF model.py L380-433; DeepGEMM ``fp8_fp4_mqa_logits``)::

    I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . K[s])       64 heads, 128 dims, fp32
    allowed entries: ks[t] <= s < ke[t]; causal C4 rule ke = (pos_t + 1) // 4 ; else -inf
    selection: top-k (k = 512 Flash / 1024 Pro) of each row, -1 padded

``w`` is the weights_proj output with ``softmax_scale * n_heads^-0.5`` folded in (and, for
``fmt="fp8"``, the per-(t, h) power-of-two query scale, as vLLM does).

Formats (one 128-dim row; ``dsv4.reference.indexer.FORMATS``):

====== ============================ ================================= =========
fmt    values (VB bytes)            scales (SB bytes)                 bytes/row
====== ============================ ================================= =========
mxfp4  64: E2M1, elem 2i low nibble 4: UE8M0, one per 32 dims          68
nvfp4  64: E2M1                     8: E4M3, one per 16 dims (+ fp32   72
                                    global decode scale per cache)
fp8    128: E4M3                    4: fp32 power of two (little end.) 132
====== ============================ ================================= =========

Paged key cache ``uint8 [num_blocks, block_size, BPT]``; per block all values first, then all
scales (vLLM / DeepGEMM): value bytes of token j in block b at ``b*block_size*BPT + j*VB``,
scale bytes at ``b*block_size*BPT + block_size*VB + j*SB``. E.g. MXFP4, block_size 64:
values of token j at ``b*4352 + j*64``, its 4 UE8M0 at ``b*4352 + 4096 + j*4``.

Optional Hadamard (``hadamard=True``): ``x -> bf16((H_128 x) * 128^-0.5)`` (Sylvester order; the
official ``rotate_activation`` takes and returns bf16, so the rotated vector is rounded to bf16, then
quantized), for q and K alike (q.K is invariant under a shared orthogonal rotation). Precision
contract of the rotation (``dsv4.reference.hadamard``, every provider bit for bit): fp32 butterflies
in a fixed stage order (index bit 0 first, the official ``fast_hadamard_transform`` arithmetic), one
fp32 multiply by fp32(128^-0.5), one RNE to bf16; vs the exact rotation y*:
``|y - y*| <= 2^-8 |y*| + 2^-20 ||x||_1 128^-0.5`` (tested).

Precision contract of the logits ops (every provider; doctrine 5), against fp64 on the SAME
quantized values (the torch reference on the dequantized bytes):

(a') ``max |logit - reference| <= 2e-3 x the row's max |logit|``, and ``-inf`` exactly where the
     reference has it (range / length / invalid-page masks are exact);
(a'') top-k recall >= 99.5% against the exact top-k of the reference row (k = 512, rows with at
     least k allowed entries);
(b)  recall of the quantized selection against the unquantized FP32 path and (c) the CSA
     attention cosine of the two selections (mean >= 0.999) are measured at 32k tokens by
     tests/test_indexer.py (table in docs/benchmarks.md).

What the providers do: ``dsl`` (decode: MXFP4 / FP8 keys; prefill: every format; sm_90a). Decode runs one
FP8 WGMMA (K = 128) per (head, key): MXFP4 block scales are folded into the E4M3 operand bytes
relative to the row's largest block (exact for blocks within 14 binades of it; E2M1 x E2M1 products
are exact in the FP8 tensor core), the remaining power-of-two scales and FP8 key scales are applied
in FP32 after the head sum (DeepGEMM-style promotion). Prefill: MXFP4 on the same E4M3 operands; FP8
keys widened exactly to BF16 with full FP32 accumulation, because the FP8 WGMMA (as DeepGEMM's
``fp8_mqa_logits`` on the same bytes) exceeds the 2e-3 bound on short prefill rows; NVFP4 prefill
runs on the same BF16 operands after an exact ``dequant_fp4``; ``cuda`` (NVFP4 decode) decodes
exactly to BF16. The bound is what the quantization itself already costs (FP8 keys: 1.3e-2 from the
bf16 inputs), not bit-exactness. Measured errors and recalls per format: docs/benchmarks.md
("Lightning Indexer").
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..reference.indexer import normalize_context_lens
from ..registry import Op, Problem, Support, custom_op, register
from ..target import Target
from ._plan import planned
from .topk import K_MAX

__all__ = ["indexer_cache_write", "indexer_q_quant", "indexer_logits", "indexer_logits_paged",
           "indexer_topk", "indexer_topk_paged", "indexer_prefill_ranges", "indexer_bytes_per_token", "FORMATS"]

FORMATS = {"mxfp4": (64, 4), "nvfp4": (64, 8), "fp8": (128, 4)}
HEADS, DIM = 64, 128
_FMT_PARAM = Param("fmt", "str", "{'mxfp4', 'nvfp4', 'fp8'}", "row format (values VB + scales SB bytes)")
_LAYOUT_NOTE = ("Paged cache byte offsets (per block all values, then all scales): value bytes of token j of "
                "block b at b*block_size*BPT + j*VB; scale bytes at b*block_size*BPT + block_size*VB + j*SB. "
                "mxfp4: VB=64, SB=4 (UE8M0 per 32), BPT=68; nvfp4: VB=64, SB=8 (E4M3 per 16), BPT=72, plus "
                "an fp32 global decode scale per cache; fp8: VB=128 (E4M3), SB=4 (fp32 power of two), BPT=132.")


def indexer_bytes_per_token(fmt: str) -> int:
    """68 (mxfp4), 72 (nvfp4) or 132 (fp8)."""
    _check_fmt(fmt, "indexer_bytes_per_token")
    return sum(FORMATS[fmt])


def _check_fmt(fmt: str, op: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"{op}: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")


def _check_global(op: str, fmt: str, name: str, g: Optional[torch.Tensor]) -> None:
    if fmt == "nvfp4":
        if g is None:
            raise LayoutError(f"{op}: argument '{name}' (float32 [1], NVFP4 global decode scale) is required for fmt='nvfp4'")
        if g.dtype != torch.float32 or g.numel() != 1:
            raise LayoutError(f"{op}: argument '{name}' must be float32 [1], got {g.dtype} {list(g.shape)}")
    elif g is not None:
        raise LayoutError(f"{op}: argument '{name}' must be None for fmt={fmt!r} (only nvfp4 has a global scale)")


# =========================================================================================
# 1. cache writer
CACHE_WRITE_SPEC = OpSpec(
    name="indexer_cache_write",
    summary="Quantize indexer keys (optional Hadamard) into the paged MXFP4 / NVFP4 / FP8 key cache at slot_mapping.",
    inputs=(
        TensorSpec("cache", torch.uint8, ("num_blocks", "block_size", "BPT"),
                   packing="per block: block_size x VB value bytes, then block_size x SB scale bytes",
                   scale="mxfp4: UE8M0 per 32; nvfp4: E4M3 per 16 (+ global); fp8: fp32 per token",
                   doc="paged indexer key cache, written in place"),
        TensorSpec("k", torch.bfloat16, ("N", 128), doc="new compressed keys (indexer compressor output)"),
        TensorSpec("slot_mapping", (torch.int64, torch.int32), ("N",), align=4,
                   doc="slot = block * block_size + j; -1 (any slot outside [0, num_blocks*block_size)) = skip the token"),
        TensorSpec("global_scale", torch.float32, (1,), align=4, optional=True,
                   doc="nvfp4 only: fp32 decode multiplier of the cache (e.g. amax/2688)"),
    ),
    params=(_FMT_PARAM, Param("hadamard", "bool", "{True, False}", "rotate K by H_128 * 128^-0.5 first")),
    constraints=(("block_size % 64 == 0", "block_size must be a multiple of 64 (one 64-key tile per page slice)"),),
    formula="vals, sf = quantize(Hadamard?(k)); cache[values of slot] = vals; cache[scales of slot] = sf",
    source="dsv4_spec.md 2.7 (indexer K cache rows), 4.3; vLLM DeepseekV4Indexer / DeepGEMM kv_cache_sf layout",
    notes=_LAYOUT_NOTE,
)


def row_class(rows: int) -> int:
    """The row-count class of a quantizer problem: ``rows`` rounded up to a power of two (0 for 0), so that
    the registry's selection cache holds few entries while the providers can choose by size."""
    return 0 if rows <= 0 else 1 << (int(rows) - 1).bit_length()


@dataclass(frozen=True)
class CacheWriteProblem(Problem):
    """``indexer_cache_write`` provider selection (``block_size``: cache pages; ``rows``: the key count's
    :func:`row_class`)."""

    fmt: str            # "mxfp4" | "nvfp4" | "fp8"
    hadamard: bool
    block_size: int
    rows: int
    device: str


@dataclass(frozen=True)
class QQuantProblem(Problem):
    """``indexer_q_quant`` provider selection (``rows``: :func:`row_class` of the T x 64 (token, head) rows)."""

    fmt: str
    hadamard: bool
    rows: int
    device: str


@dataclass(frozen=True)
class LogitsProblem(Problem):
    fmt: str
    device: str


@dataclass(frozen=True)
class PagedProblem(Problem):
    """``indexer_logits_paged`` (and the logits half of ``indexer_topk_paged``)."""

    fmt: str
    next_n: int
    block_size: int
    max_ctx: int
    device: str


#: the decode kernels' tiles (both compiled providers of ``indexer_logits_paged`` / ``indexer_topk_paged``): pages
#: read in 64-key tiles, N = 64 * next_n <= 256 query rows per WGMMA
PAGED_TILE_KEYS = 64
PAGED_MAX_NEXT_N = 4


def paged_tile_limits(problem, kind: str) -> Support | None:
    """``Support.no`` (reason prefixed by the provider ``kind``) when a paged problem is outside the decode
    kernels' tiles -- ``block_size`` a multiple of :data:`PAGED_TILE_KEYS`, ``1 <= next_n <=``
    :data:`PAGED_MAX_NEXT_N` -- else ``None``."""
    if problem["block_size"] % PAGED_TILE_KEYS:
        return Support.no(f"{kind}: block_size {problem['block_size']} is not a multiple of {PAGED_TILE_KEYS}")
    if not 1 <= problem["next_n"] <= PAGED_MAX_NEXT_N:
        return Support.no(f"{kind}: next_n {problem['next_n']} outside 1..{PAGED_MAX_NEXT_N} "
                          f"(N = {PAGED_TILE_KEYS} * next_n <= {PAGED_TILE_KEYS * PAGED_MAX_NEXT_N})")
    return None


def paged_support(problem, kind: str, gate: Support | None, yes: str) -> Support:
    """A paged decode provider's answer: its own ``gate`` (arch / format; ``None`` = passes), then
    :func:`paged_tile_limits`, else ``Support.yes(yes)``."""
    no = gate if gate is not None else paged_tile_limits(problem, kind)
    return no if no is not None else Support.yes(yes)


@dataclass(frozen=True)
class TopkPagedProblem(Problem):
    fmt: str
    next_n: int
    block_size: int
    max_ctx: int
    k: int
    mapped: bool
    device: str


def _cw_example(target: Target) -> CacheWriteProblem:
    return CacheWriteProblem("mxfp4", True, 64, row_class(8 * 32768), target.device_type)


CACHE_WRITE_OP = register(Op("indexer_cache_write", CACHE_WRITE_SPEC, module="indexer", example_problem=_cw_example))


@custom_op("dsv4::indexer_cache_write", mutates_args=("cache",))
def _cache_write_op(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                    global_scale: Optional[torch.Tensor], fmt: str, hadamard: bool) -> None:
    problem = CacheWriteProblem(fmt, bool(hadamard), int(cache.shape[1]), row_class(k.shape[0]), cache.device.type)
    CACHE_WRITE_OP.dispatch(problem, Target.of(cache.device), cache=cache, k=k, slot_mapping=slot_mapping,
                            global_scale=global_scale)


@_cache_write_op.register_fake
def _(cache, k, slot_mapping, global_scale, fmt, hadamard):
    return None


@planned
def indexer_cache_write(cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor, *, fmt: str = "mxfp4",
                        global_scale: Optional[torch.Tensor] = None, hadamard: bool = True) -> None:
    """Write keys into the paged indexer key cache (in place).

    Args:
        cache: uint8 ``[num_blocks, block_size, BPT]`` (BPT = 68 mxfp4 / 72 nvfp4 / 132 fp8);
            per block all value bytes first, then all scale bytes (module docstring).
        k: bf16 ``[N, 128]`` keys.
        slot_mapping: int64/int32 ``[N]``: ``block * block_size + j``; -1 skips the token.
        fmt: ``"mxfp4"`` (DSV4 default), ``"nvfp4"`` or ``"fp8"``.
        global_scale: nvfp4 only: fp32 ``[1]`` decode multiplier shared by the whole cache.
        hadamard: rotate by ``H_128 * 128^-0.5`` before quantizing (the DSV4 reference does).

    Returns:
        None: ``cache`` is updated in place (only the slots named by ``slot_mapping``).

    Raises:
        ValueError: unknown fmt. LayoutError: argument mismatch (names the argument).

    Source: dsv4_spec.md 2.4 / 2.7 / 4.3.
    """
    _check_fmt(fmt, "indexer_cache_write")
    if not isinstance(hadamard, bool):
        raise ValueError(f"indexer_cache_write: argument 'hadamard' must be a bool, got {type(hadamard).__name__} {hadamard!r}")
    CACHE_WRITE_SPEC.validate({"cache": cache, "k": k, "slot_mapping": slot_mapping, "global_scale": global_scale},
                              symbols={"BPT": indexer_bytes_per_token(fmt)})
    _check_global("indexer_cache_write", fmt, "global_scale", global_scale)
    _cache_write_op(cache, k, slot_mapping, global_scale, fmt, bool(hadamard))


# =========================================================================================
# 2. query quantization
Q_QUANT_SPEC = OpSpec(
    name="indexer_q_quant",
    summary="Indexer queries [T,64,128] bf16 -> MXFP4 / NVFP4 (+ scales) or FP8 with its per-(t,h) scale folded into w.",
    inputs=(
        TensorSpec("q", torch.bfloat16, ("T", 64, 128), doc="indexer queries after RoPE (last 64 dims)"),
        TensorSpec("w", torch.float32, ("T", 64), doc="head weights (softmax_scale * 64^-0.5 folded)"),
        TensorSpec("global_scale", torch.float32, (1,), align=4, optional=True, doc="nvfp4 only: q decode multiplier"),
    ),
    outputs=(
        TensorSpec("q_data", torch.uint8, ("T", 64, "VB"), output=True, packing="mxfp4/nvfp4: 2 x E2M1 per byte, low nibble first; fp8: E4M3 bytes"),
        TensorSpec("q_sf", torch.uint8, ("T", 64, "SBQ"), output=True, align=1,
                   scale="mxfp4: 4 UE8M0 (per 32); nvfp4: 8 E4M3 (per 16); fp8: empty [T, 64, 0]"),
        TensorSpec("w_out", torch.float32, ("T", 64), output=True, doc="fp8: w * q_scale; fp4: copy of w"),
    ),
    params=(_FMT_PARAM, Param("hadamard", "bool", "{True, False}", "rotate q by H_128 * 128^-0.5 first")),
    formula="(q_data, q_sf) = quantize(Hadamard?(q)); fp8: per-(t,h) s = 2^ceil(log2(amax/448)), w_out = w * s",
    source="dsv4_spec.md 2.4, 2.7 (Indexer Q row), 4.3 item 6 (vLLM fused_indexer_q_rope_quant)",
)

Q_QUANT_OP = register(Op("indexer_q_quant", Q_QUANT_SPEC, module="indexer",
                         example_problem=lambda t: QQuantProblem("mxfp4", True, row_class(4096 * HEADS), t.device_type)))


@custom_op("dsv4::indexer_q_quant", mutates_args=())
def _q_quant_op(q: torch.Tensor, w: torch.Tensor, global_scale: Optional[torch.Tensor], fmt: str,
                hadamard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = QQuantProblem(fmt, bool(hadamard), row_class(q.shape[0] * HEADS), q.device.type)
    return Q_QUANT_OP.dispatch(problem, Target.of(q.device), q=q, w=w, global_scale=global_scale)


def q_quant_outputs(q: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The uninitialized outputs of ``indexer_q_quant`` for ``q`` ``[T, 64, 128]``: q_data uint8
    ``[T, 64, VB]``, q_sf uint8 ``[T, 64, SBQ]`` (fp8: size-0 last dim), w_out fp32 ``[T, 64]``, on
    ``q``'s device (shared by the fake implementation and every kernel provider)."""
    T = q.shape[0]
    return (q.new_empty((T, HEADS, FORMATS[fmt][0]), dtype=torch.uint8),
            q.new_empty((T, HEADS, _sbq(fmt)), dtype=torch.uint8),
            q.new_empty((T, HEADS), dtype=torch.float32))


@_q_quant_op.register_fake
def _(q, w, global_scale, fmt, hadamard):
    return q_quant_outputs(q, fmt)


@planned
def indexer_q_quant(q: torch.Tensor, w: torch.Tensor, *, fmt: str = "mxfp4", hadamard: bool = True,
                    global_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize indexer queries.

    Args:
        q: bf16 ``[T, 64, 128]``. w: fp32 ``[T, 64]``.
        fmt: ``"mxfp4"`` / ``"nvfp4"`` / ``"fp8"``. hadamard: rotate first.
        global_scale: nvfp4 only, fp32 ``[1]`` q decode multiplier.

    Returns:
        ``(q_data uint8 [T,64,VB], q_sf uint8 [T,64,SB] (fp8: [T,64,0]), w_out fp32 [T,64])``;
        fp8 folds the per-(t,h) power-of-two scale into ``w_out`` (vLLM convention).

    Raises:
        ValueError / LayoutError as :func:`indexer_cache_write`.
    """
    _check_fmt(fmt, "indexer_q_quant")
    if not isinstance(hadamard, bool):
        raise ValueError(f"indexer_q_quant: argument 'hadamard' must be a bool, got {type(hadamard).__name__} {hadamard!r}")
    Q_QUANT_SPEC.validate({"q": q, "w": w, "global_scale": global_scale})
    _check_global("indexer_q_quant", fmt, "global_scale", global_scale)
    return _q_quant_op(q, w, global_scale, fmt, bool(hadamard))


# =========================================================================================
# 3. prefill logits
LOGITS_SPEC = OpSpec(
    name="indexer_logits",
    summary="Prefill indexer logits on tensor cores: quantized q [T,64,.] x contiguous quantized keys [S,.], per-query [ks, ke).",
    inputs=(
        TensorSpec("q_data", torch.uint8, ("T", 64, "VB"), doc="from indexer_q_quant"),
        TensorSpec("q_sf", torch.uint8, ("T", 64, "SBQ"), align=1, doc="from indexer_q_quant (fp8: [T,64,0])"),
        TensorSpec("w", torch.float32, ("T", 64), doc="head weights (fp8: q scale folded)"),
        TensorSpec("k_data", torch.uint8, ("S", "VB"), doc="contiguous key values (same format as q)"),
        TensorSpec("k_sf", torch.uint8, ("S", "SB"), align=16, doc="key scale bytes (fp8: fp32 as 4 bytes)"),
        TensorSpec("ks", torch.int32, ("T",), align=4, doc="first allowed key of each query"),
        TensorSpec("ke", torch.int32, ("T",), align=4, doc="end (exclusive) of allowed keys; causal: offset + (pos+1)//4"),
        TensorSpec("q_global", torch.float32, (1,), align=4, optional=True, doc="nvfp4 only"),
        TensorSpec("k_global", torch.float32, (1,), align=4, optional=True, doc="nvfp4 only"),
    ),
    outputs=(TensorSpec("logits", torch.float32, ("T", "S"), output=True, doc="fp32; -inf outside [ks, ke)"),),
    params=(_FMT_PARAM,),
    formula="logits[t,s] = sum_h w[t,h] * relu(q[t,h] . K[s]) if ks[t] <= s < ke[t] else -inf",
    source="dsv4_spec.md 2.4, 4.3 item 7 (DeepGEMM fp8_fp4_mqa_logits semantics)",
    notes="Many sequences of different lengths go in one launch: pack queries along T and keys along S "
          "and give each query its own [ks, ke) (indexer_prefill_ranges builds them).",
)

LOGITS_OP = register(Op("indexer_logits", LOGITS_SPEC, module="indexer",
                        example_problem=lambda t: LogitsProblem("mxfp4", t.device_type)))


@custom_op("dsv4::indexer_logits", mutates_args=())
def _logits_op(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, k_data: torch.Tensor, k_sf: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, q_global: Optional[torch.Tensor], k_global: Optional[torch.Tensor],
               fmt: str) -> torch.Tensor:
    problem = LogitsProblem(fmt, q_data.device.type)
    return LOGITS_OP.dispatch(problem, Target.of(q_data.device), q_data=q_data, q_sf=q_sf, w=w, k_data=k_data,
                              k_sf=k_sf, ks=ks, ke=ke, q_global=q_global, k_global=k_global)


@_logits_op.register_fake
def _(q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global, fmt):
    return w.new_empty((q_data.shape[0], k_data.shape[0]))


def _sbq(fmt: str) -> int:
    return 0 if fmt == "fp8" else FORMATS[fmt][1]


@planned
def indexer_logits(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, k_data: torch.Tensor,
                   k_sf: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, *, fmt: str = "mxfp4",
                   q_global: Optional[torch.Tensor] = None, k_global: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Prefill indexer logits (non-paged keys), one launch for all sequences.

    Args:
        q_data, q_sf, w: from :func:`indexer_q_quant` (``[T,64,VB]``, ``[T,64,SB|0]``, ``[T,64]``).
        k_data: uint8 ``[S, VB]``; k_sf: uint8 ``[S, SB]`` (fp8: each row an fp32 scale).
        ks, ke: int32 ``[T]``: query t may see keys ``ks[t] <= s < ke[t]`` (the causal C4 rule
            goes into ``ke``; see :func:`indexer_prefill_ranges`).
        fmt: ``"mxfp4"`` / ``"nvfp4"`` / ``"fp8"``; q_global / k_global: nvfp4 global scales.

    Returns:
        fp32 ``[T, S]``: ``sum_h w[t,h] * relu(q[t,h] . K[s])`` inside the range, -inf outside.
        Precision: within 2e-3 x the row's max |logit| of fp64 on the same quantized values,
        top-k recall >= 99.5% (module docstring; measured errors: docs/benchmarks.md).

    Raises:
        ValueError / LayoutError (argument named, expected vs got).
    """
    _check_fmt(fmt, "indexer_logits")
    vb, sb = FORMATS[fmt]
    LOGITS_SPEC.validate({"q_data": q_data, "q_sf": q_sf, "w": w, "k_data": k_data, "k_sf": k_sf, "ks": ks,
                          "ke": ke, "q_global": q_global, "k_global": k_global},
                         symbols={"VB": vb, "SB": sb, "SBQ": _sbq(fmt)})
    _check_global("indexer_logits", fmt, "q_global", q_global)
    _check_global("indexer_logits", fmt, "k_global", k_global)
    return _logits_op(q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global, fmt)


def indexer_prefill_ranges(seq_lens, ratio: int = 4, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal key ranges for a batched prefill, the ``ks`` / ``ke`` inputs of :func:`indexer_logits`.

    Sequences are packed along T (queries, each sequence starting at position 0) and their
    compressed entries along S: the query at position p of a sequence whose entries start at
    offset o sees entries ``[o, o + (p + 1) // ratio)`` (DSV4 C4 causal rule); sequence i
    contributes ``seq_lens[i] // ratio`` entries. Host-side helper (takes Python ints, builds
    the tensors on the host and copies them to ``device``; call it outside CUDA-graph capture).

    Args:
        seq_lens: iterable of Python ints >= 0, tokens per sequence; ``T = sum(seq_lens)``.
        ratio: compression ratio, a Python int >= 1 (4 for the CSA indexer, the default).
        device: torch device of the results (default CPU).

    Returns:
        ``(ks, ke, pos)``: int32 ``[T]`` each: first entry (inclusive), end entry (exclusive,
        ``ke >= ks``) and the token position within its sequence.

    Raises:
        ValueError: ``seq_lens`` not an iterable of ints >= 0, or ``ratio`` not an int >= 1.

    Source: dsv4_spec.md 2.3 / 2.4 (compressed entry b covers tokens [b*ratio, (b+1)*ratio)).
    """
    from ..reference.indexer import causal_ranges
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"indexer_prefill_ranges: argument 'ratio' must be an int >= 1 (4 for CSA), got "
                         f"{type(ratio).__name__} {ratio!r}")
    try:
        lens = list(seq_lens)
    except TypeError:
        raise ValueError(f"indexer_prefill_ranges: argument 'seq_lens' must be an iterable of ints >= 0, got "
                         f"{type(seq_lens).__name__}") from None
    bad = [(i, v) for i, v in enumerate(lens) if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        i, v = bad[0]
        raise ValueError(f"indexer_prefill_ranges: argument 'seq_lens' must hold ints >= 0 (tokens per sequence), "
                         f"got seq_lens[{i}] = {v!r} ({type(v).__name__})")
    if not lens:   # no sequence: three empty [0] tensors (torch.cat of nothing would raise)
        return tuple(torch.empty((0,), dtype=torch.int32, device=device) for _ in range(3))
    return causal_ranges(lens, ratio, device)


# =========================================================================================
# 4. decode (paged) logits
PAGED_SPEC = OpSpec(
    name="indexer_logits_paged",
    summary="Decode indexer logits on tensor cores from the paged FP4/FP8 key cache (block_table, per-row lengths, next_n 1..4).",
    inputs=(
        TensorSpec("q_data", torch.uint8, ("B", "next_n", 64, "VB"), doc="quantized queries (indexer_q_quant, reshaped)"),
        TensorSpec("q_sf", torch.uint8, ("B", "next_n", 64, "SBQ"), align=1, doc="query scales (fp8: size-0 last dim)"),
        TensorSpec("w", torch.float32, ("B * next_n", 64), doc="head weights, row b*next_n + i"),
        TensorSpec("cache", torch.uint8, ("num_blocks", "block_size", "BPT"), doc="paged key cache (indexer_cache_write)"),
        TensorSpec("context_lens", torch.int32, ("B", "next_n"), align=4,
                   doc="entries visible to each query row; the public function also takes [B]: all next_n rows of "
                       "batch b see context_lens[b] entries (DSV4 C4 decode)"),
        TensorSpec("block_table", torch.int32, ("B", "max_blocks"), align=4, doc="page of entry s = block_table[b, s // block_size]; an entry outside [0, num_blocks) is never read, its keys get -inf"),
        TensorSpec("q_global", torch.float32, (1,), align=4, optional=True, doc="nvfp4 only"),
        TensorSpec("k_global", torch.float32, (1,), align=4, optional=True, doc="nvfp4 only (the cache's global scale)"),
    ),
    outputs=(TensorSpec("logits", torch.float32, ("B * next_n", "max_ctx"), output=True, doc="-inf at s >= context_lens"),),
    params=(_FMT_PARAM, Param("max_ctx", "int", "<= max_blocks * block_size", "columns of the output (default max_blocks*block_size)")),
    constraints=(("block_size % 64 == 0", "block_size must be a multiple of 64"),
                 ("next_n >= 1 and next_n <= 4", "next_n must be 1..4 (N = 64*next_n <= 256 in one WGMMA)")),
    formula="logits[b*next_n+i, s] = sum_h w * relu(q[b,i,h] . K[page(b,s), s % block_size]) if s < len[b,i] else -inf",
    source="dsv4_spec.md 4.3 item 8 (DeepGEMM fp8_fp4_paged_mqa_logits semantics)",
    notes=_LAYOUT_NOTE + " One launch for the whole batch; every row has its own length (seed 002).",
)

PAGED_OP = register(Op("indexer_logits_paged", PAGED_SPEC, module="indexer",
                       example_problem=lambda t: PagedProblem("mxfp4", 1, 64, 32768, t.device_type)))


@custom_op("dsv4::indexer_logits_paged", mutates_args=())
def _paged_op(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, lens: torch.Tensor,
              block_table: torch.Tensor, q_global: Optional[torch.Tensor], k_global: Optional[torch.Tensor],
              fmt: str, max_ctx: int) -> torch.Tensor:
    problem = PagedProblem(fmt, int(q_data.shape[1]), int(cache.shape[1]), int(max_ctx), q_data.device.type)
    return PAGED_OP.dispatch(problem, Target.of(q_data.device), q_data=q_data, q_sf=q_sf, w=w, cache=cache, lens=lens,
                             block_table=block_table, q_global=q_global, k_global=k_global)


@_paged_op.register_fake
def _(q_data, q_sf, w, cache, lens, block_table, q_global, k_global, fmt, max_ctx):
    return w.new_empty((q_data.shape[0] * q_data.shape[1], max_ctx))


def _check_paged(op: str, spec: OpSpec, q_data, q_sf, w, cache, context_lens, block_table, fmt, max_ctx,
                 q_global, k_global) -> tuple[torch.Tensor, int]:
    """Argument checks shared by the paged decode ops (:func:`indexer_logits_paged`,
    :func:`indexer_topk_paged`): format, ``q_data`` rank, ``context_lens`` dtype / rank (normalized
    to ``[B, next_n]``), the layout spec, ``max_ctx`` (int in ``[1, max_blocks * block_size]``,
    default the whole table) and the NVFP4 global scales. Returns ``(lens, max_ctx)``.
    Raises ``ValueError`` / ``LayoutError`` naming ``op`` and the argument."""
    _check_fmt(fmt, op)
    if q_data.dim() != 4:
        raise LayoutError(f"{op}: argument 'q_data' must be [B, next_n, 64, VB], got {list(q_data.shape)}")
    if context_lens.dtype != torch.int32 or context_lens.dim() not in (1, 2):
        raise LayoutError(f"{op}: argument 'context_lens' must be int32 [B] or [B, next_n], got "
                          f"{context_lens.dtype} {list(context_lens.shape)}")
    lens = normalize_context_lens(context_lens, q_data.shape[1]).contiguous()
    vb, sb = FORMATS[fmt]
    env = spec.validate({"q_data": q_data, "q_sf": q_sf, "w": w, "cache": cache, "context_lens": lens,
                         "block_table": block_table, "q_global": q_global, "k_global": k_global},
                        symbols={"VB": vb, "SBQ": _sbq(fmt), "BPT": vb + sb})
    full = env["max_blocks"] * env["block_size"]
    if max_ctx is None:
        max_ctx = full
    if isinstance(max_ctx, bool) or not isinstance(max_ctx, numbers.Integral):   # never truncate a float
        raise LayoutError(f"{op}: max_ctx must be an int (logit columns), got {type(max_ctx).__name__} {max_ctx!r}")
    if not (0 < int(max_ctx) <= full):
        raise LayoutError(f"{op}: max_ctx={max_ctx} must be in [1, max_blocks*block_size={full}]")
    _check_global(op, fmt, "q_global", q_global)
    _check_global(op, fmt, "k_global", k_global)
    return lens, int(max_ctx)


@planned
def indexer_logits_paged(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, *, fmt: str = "mxfp4",
                         max_ctx: Optional[int] = None, q_global: Optional[torch.Tensor] = None,
                         k_global: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode indexer logits over the paged key cache, one launch for the batch.

    Args:
        q_data: uint8 ``[B, next_n, 64, VB]``; q_sf: uint8 ``[B, next_n, 64, SB|0]``.
        w: fp32 ``[B*next_n, 64]``.
        cache: uint8 ``[num_blocks, block_size, BPT]`` (:func:`indexer_cache_write`).
        context_lens: int32 ``[B, next_n]``: entries visible to each row (explicit per-row
            lengths; DeepGEMM's MTP token rule ``len - next_n + 1 + i`` is written this way), or
            ``[B]``: all ``next_n`` rows of batch ``b`` see ``context_lens[b]`` committed entries
            (the DSV4 decode semantics of compressed C4 entries: the draft tokens of one step
            share the entries committed before it; NOT DeepGEMM's token rule).
        block_table: int32 ``[B, max_blocks]``.
        max_ctx: output columns (default ``max_blocks * block_size``).
        fmt, q_global, k_global: as :func:`indexer_logits`.

    Returns:
        fp32 ``[B*next_n, max_ctx]``, -inf at columns ``>=`` the row's length (and at keys whose
        ``block_table`` entry is outside ``[0, num_blocks)``: such pages are never read).
        Precision: within 2e-3 x the row's max |logit| of fp64 on the same quantized values,
        top-k recall >= 99.5% (module docstring). One persistent launch, device-side schedule
        (no host sync, graph-capturable).

    Raises:
        ValueError / LayoutError (argument named, expected vs got), e.g. next_n > 4.
    """
    lens, max_ctx = _check_paged("indexer_logits_paged", PAGED_SPEC, q_data, q_sf, w, cache, context_lens,
                                 block_table, fmt, max_ctx, q_global, k_global)
    return _paged_op(q_data, q_sf, w, cache, lens, block_table, q_global, k_global,
                                               fmt, int(max_ctx))


# =========================================================================================
# 5. top-k
@planned
def indexer_topk(logits: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices of each row of indexer logits: the :func:`dsv4.ops.topk.topk` op (its
    own registry entry, spec and kernel), named here for the indexer pipeline.

    Args:
        logits: fp32 ``[rows, stride]``. lengths: int32 ``[rows]`` valid columns.
        k: number of entries to select, a Python int in 1..2048 (512 Flash / 1024 Pro).

    Returns:
        int32 ``[rows, k]``: sorted by score desc, ties -> lower index, -1 where a row has
        fewer than k finite allowed entries.

    Raises:
        ValueError: ``k`` not a Python int (a float, str or bool is refused, never truncated) or
            outside ``1..2048``.
        LayoutError: ``logits`` / ``lengths`` do not match ``docs/layouts/topk.md``.
    """
    import numbers

    from .topk import topk
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):   # Python / numpy int; never truncate
        raise ValueError(f"indexer_topk: argument 'k' must be an int (entries per row, 1..2048), got "
                         f"{type(k).__name__} {k!r}")
    return topk(logits, lengths, int(k), sorted=True)   # this op's contract: sorted (topk's default: by position)


# =========================================================================================
# 6. decode logits + top-k in one op
TOPK_PAGED_SPEC = OpSpec(
    name="indexer_topk_paged",
    summary="Decode indexer top-k: the indexer_logits_paged logits of every row, then the topk op's exact selection "
            "(ties by lower index, -1 padding), optionally mapped to physical cache slots through block_table.",
    inputs=PAGED_SPEC.inputs,
    outputs=(
        TensorSpec("indices", torch.int32, ("B * next_n", "k"), output=True,
                   doc="logical entry positions s (0 <= s < context_lens of the row), sorted by logit desc, ties by "
                       "lower s; or, with map_to_slots, block_table[b, s // block_size] * block_size + s % block_size; "
                       "-1 = padding (rows with fewer than k finite logits; never mapped)"),
        TensorSpec("scores", torch.float32, ("B * next_n", "k"), output=True,
                   doc="the selected logits (return_scores=True), -inf for padding"),
    ),
    params=(_FMT_PARAM, Param("k", "int", "1..2048", "entries kept per row (512 Flash / 1024 Pro)"),
            Param("max_ctx", "int", "<= max_blocks * block_size", "logit columns considered (default max_blocks*block_size)"),
            Param("map_to_slots", "bool", "{False, True}", "return physical slots instead of logical positions"),
            Param("return_scores", "bool", "{False, True}", "also return the selected logits")),
    constraints=PAGED_SPEC.constraints,
    formula="indices = topk(indexer_logits_paged(q, w, cache, context_lens, block_table), lengths=context_lens "
            "(per row, clamped to max_ctx), k, block_table if map_to_slots, rows_per_seq=next_n)",
    source="dsv4_spec.md 2.4 (lightning indexer selection); DeepGEMM fp8_paged_mqa_logits + vLLM / FlashInfer "
           "top_k_page_table_transform semantics; the topk op's contract (docs/layouts/topk.md)",
    notes=_LAYOUT_NOTE + " Same logits as indexer_logits_paged (same precision contract) and the same selection as "
          "the topk op on them: bitwise identical to calling the two ops in sequence with the same providers.",
)

TOPK_PAGED_OP = register(Op("indexer_topk_paged", TOPK_PAGED_SPEC, module="indexer",
                            example_problem=lambda t: TopkPagedProblem("mxfp4", 1, 64, 32768, 512, False,
                                                                       t.device_type)))


@custom_op("dsv4::indexer_topk_paged", mutates_args=())
def _topk_paged_op(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor, lens: torch.Tensor,
                   block_table: torch.Tensor, q_global: Optional[torch.Tensor], k_global: Optional[torch.Tensor],
                   fmt: str, max_ctx: int, k: int, map_to_slots: bool) -> tuple[torch.Tensor, torch.Tensor]:
    problem = TopkPagedProblem(fmt, int(q_data.shape[1]), int(cache.shape[1]), int(max_ctx), int(k),
                               bool(map_to_slots), q_data.device.type)
    return TOPK_PAGED_OP.dispatch(problem, Target.of(q_data.device), q_data=q_data, q_sf=q_sf, w=w, cache=cache,
                                  lens=lens, block_table=block_table, q_global=q_global, k_global=k_global)


@_topk_paged_op.register_fake
def _(q_data, q_sf, w, cache, lens, block_table, q_global, k_global, fmt, max_ctx, k, map_to_slots):
    rows = q_data.shape[0] * q_data.shape[1]
    return w.new_empty((rows, k), dtype=torch.int32), w.new_empty((rows, k))


@planned
def indexer_topk_paged(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                       context_lens: torch.Tensor, block_table: torch.Tensor, k: int, *, fmt: str = "mxfp4",
                       max_ctx: Optional[int] = None, q_global: Optional[torch.Tensor] = None,
                       k_global: Optional[torch.Tensor] = None, map_to_slots: bool = False,
                       return_scores: bool = False):
    """Decode indexer selection: top-``k`` entries of every query row over the paged key cache.

    Equivalent to ``topk(indexer_logits_paged(...), lengths, k, block_table=..., rows_per_seq=next_n)``
    (:func:`indexer_logits_paged`, :func:`dsv4.ops.topk.topk`), as one op.

    Providers: ``dsl`` for MXFP4 / FP8 keys (the DSL logits kernel, then the top-k kernel of
    :func:`dsv4.ops.topk.topk`; bitwise the two ops called in sequence); NVFP4 keys have no kernel
    provider for this op yet and run the torch reference (call :func:`indexer_logits_paged`, which
    has a CUDA NVFP4 kernel, then :func:`dsv4.ops.topk.topk` for the kernel path).

    Args:
        q_data, q_sf, w, cache, context_lens, block_table, fmt, max_ctx, q_global, k_global: as
            :func:`indexer_logits_paged` (``context_lens`` ``[B]`` = committed entries shared by the
            ``next_n`` rows, or ``[B, next_n]`` per row).
        k: entries per row, a Python int in 1..2048.
        map_to_slots: return physical cache slots ``block_table[b, s // block_size] * block_size +
            s % block_size`` instead of logical positions ``s``.
        return_scores: also return the selected logits.

    Returns:
        int32 ``[B*next_n, k]`` (and fp32 ``[B*next_n, k]`` scores): per row the entries with the
        largest logits, sorted descending, ties by lower position; ``-1`` (score ``-inf``) pads
        rows with fewer than ``k`` selectable entries (an entry is selectable when
        ``s < min(len, max_ctx)`` and its page is inside the cache). Deterministic.
        Precision: the logits obey :func:`indexer_logits_paged`'s contract (2e-3 x the row's max
        |logit| against fp64 on the same quantized values), so the selection has top-k recall >=
        99.5% against the exact selection on those values; given the logits it is exact.

    Raises:
        ValueError: ``k`` not an int in 1..2048; ``map_to_slots`` / ``return_scores`` not bools.
        LayoutError: as :func:`indexer_logits_paged`.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= int(k) <= K_MAX:
        raise ValueError(f"indexer_topk_paged: argument 'k' must be an int in 1..{K_MAX}, got {type(k).__name__} {k!r}")
    for name, v in (("map_to_slots", map_to_slots), ("return_scores", return_scores)):
        if not isinstance(v, bool):
            raise ValueError(f"indexer_topk_paged: argument '{name}' must be a bool, got {type(v).__name__}")
    lens, max_ctx = _check_paged("indexer_topk_paged", TOPK_PAGED_SPEC, q_data, q_sf, w, cache, context_lens,
                                 block_table, fmt, max_ctx, q_global, k_global)
    idx, sc = _topk_paged_op(q_data, q_sf, w, cache, lens, block_table, q_global, k_global, fmt,
                                                int(max_ctx), int(k), map_to_slots)
    return (idx, sc) if return_scores else idx


def graph_cases(device) -> list:
    """CUDA-graph cases (MXFP4): cache write, q quant, prefill logits, paged decode logits, decode top-k."""
    from ..data import indexer_inputs
    from ..reference.indexer import quantize_rows
    from ._common import GraphCase, bytes_of
    dev = torch.device(device)
    T, bs, nb, B, nn = 64, 64, 32, 2, 2
    S = nb * bs
    q = torch.empty(T, 64, 128, dtype=torch.bfloat16, device=dev)
    k = torch.empty(S, 128, dtype=torch.bfloat16, device=dev)
    w = torch.empty(T, 64, dtype=torch.float32, device=dev)
    cache = torch.zeros(nb, bs, 68, dtype=torch.uint8, device=dev)
    slots = torch.empty(S, dtype=torch.int64, device=dev)
    k_data = torch.empty(S, 64, dtype=torch.uint8, device=dev)
    k_sf = torch.empty(S, 4, dtype=torch.uint8, device=dev)
    qd = torch.empty(T, 64, 64, dtype=torch.uint8, device=dev)
    qs = torch.empty(T, 64, 4, dtype=torch.uint8, device=dev)
    ks, ke, _ = indexer_prefill_ranges([4 * S // 2] * 2, device=dev)          # 2 packed sequences
    ks, ke = ks[-T:].contiguous(), ke[-T:].contiguous()
    lens = torch.empty(B, nn, dtype=torch.int32, device=dev)
    bt = torch.empty(B, nb // B, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(41)

    def refresh():
        seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
        d = indexer_inputs(T, S, seed=seed, device=dev)
        q.copy_(d.q)
        k.copy_(d.k)
        w.copy_(d.w)
        slots.copy_(torch.randperm(S, generator=gen))
        a, b = quantize_rows(d.k, "mxfp4", hadamard=True)
        k_data.copy_(a)
        k_sf.copy_(b)
        a, b = quantize_rows(d.q, "mxfp4", hadamard=True)
        qd.copy_(a)
        qs.copy_(b)
        lens.copy_(torch.randint(1, S // B + 1, (B, nn), generator=gen, dtype=torch.int32))
        bt.copy_(torch.randperm(nb, generator=gen)[:bt.numel()].view(bt.shape).to(torch.int32))
    refresh()

    def cw():
        indexer_cache_write(cache, k, slots, fmt="mxfp4", hadamard=True)
        return cache.clone()
    return [
        GraphCase("indexer_cache_write-mxfp4", "indexer_cache_write", cw, refresh),
        GraphCase("indexer_q_quant-mxfp4", "indexer_q_quant", lambda: bytes_of(*indexer_q_quant(q, w, fmt="mxfp4")),
                  refresh),
        GraphCase("indexer_logits-mxfp4", "indexer_logits",
                  lambda: indexer_logits(qd, qs, w, k_data, k_sf, ks, ke, fmt="mxfp4"), refresh),
        GraphCase("indexer_logits_paged-mxfp4", "indexer_logits_paged",
                  lambda: indexer_logits_paged(qd[:B * nn].view(B, nn, 64, 64), qs[:B * nn].view(B, nn, 64, 4),
                                               w[:B * nn], cache, lens, bt, fmt="mxfp4"), refresh),
        GraphCase("indexer_topk_paged-mxfp4-k64-mapped", "indexer_topk_paged",
                  lambda: bytes_of(*indexer_topk_paged(qd[:B * nn].view(B, nn, 64, 64), qs[:B * nn].view(B, nn, 64, 4),
                                                       w[:B * nn], cache, lens, bt, 64, fmt="mxfp4", map_to_slots=True,
                                                       return_scores=True)), refresh),
    ]
