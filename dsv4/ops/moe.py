"""DSV4 routed-expert MoE with FP4 (E2M1) expert weights on Hopper.

Ops (all registered; providers: ``kernels_cuda/moe.py`` (cuda), ``kernels_dsl/moe_glue.py`` (dsl, the
glue ops), ``kernels_dsl/moe.py`` (dsl, the grouped GEMMs on the ``kernels_dsl/sm90/`` mainloop) and
``dsv4/reference/moe.py`` (torch)):

* :func:`moe_prepare_weights` (``moe_prepare_weights``): checkpoint tensors -> kernel layout
  (:class:`MoEWeights`); the layout is printed by ``MoEWeights.describe()`` /
  ``docs/layouts/moe_prepare_weights.md``.
* :func:`moe_route` (``dsv4::moe_route``): DSV4 gate (sqrt(softplus) scores, bias only for
  selection, top-k, normalized weights * route_scale; hash layers: ``tid2eid[input_ids]``).
* :func:`moe_permute` (``dsv4::moe_permute``) / :func:`moe_combine` (``dsv4::moe_combine``):
  token permutation to the grouped layout (``"contiguous"``: rows sorted by expert, per-expert
  offsets; ``"masked"``: ``[E, max_m]`` slots with per-expert counts) fused with act_quant, and
  the un-permute + sum over the top-k rows of each token. Device-side, no host sync, no loop over
  experts (CUDA-graph capturable). Route / permute / combine ("the glue") have CuTe DSL providers
  in ``kernels_dsl/moe_glue.py`` (one compiled call each) and torch references in
  ``dsv4/reference/moe.py``; out-of-range expert ids are dropped assignments, never a fault.
* :func:`moe_gemm1_swiglu` (``dsv4::moe_gemm1_swiglu``): grouped GEMM1 (W13) + DSV4 clamped
  SwiGLU + routing weight (+ FP8 1x128 UE8M0 requant for W4A8).
* :func:`moe_gemm2` (``dsv4::moe_gemm2``): grouped GEMM2 (W2), fp32 rows.
  The two GEMM ops run on the CuTe DSL grouped GEMM except where the CUDA decode kernel is measured
  faster (few rows per expert; ``GEMM_KINDS``, docs/benchmarks.md).
* :func:`moe_forward`: the routed-expert layer (route -> permute -> GEMM1 -> GEMM2 -> combine).

Formulas: dsv4_spec.md 2.5 (FLASH-REF model.py L546-645) and 2.1 (act_quant, fp4_gemm).

Seed 003 bugs made impossible here:
(1) scale-factor remap: the kernel reads linear ``[N, K/SF]`` scales; swizzled 128x4 inputs
    are un-swizzled by :func:`dsv4.formats.unswizzle_sf_128x4` in prepare (round trip tested);
(2) one expert's global scale for all: global scales must be ``[E, 2]`` (W13: gate, up) and
    ``[E]`` (W2), validated; the kernel indexes them by the tile's expert;
(3) gate/up interleaving: W13 input rows are the plain concat ``[gate (I rows); up (I rows)]``;
    prepare does the (documented) tile reordering itself from that convention;
(4) float8 byte views: scales are reinterpreted with ``.view(torch.uint8)`` only; raw ``uint8``
    scale inputs are rejected (pass ``.view(torch.float8_e8m0fnu)`` / ``.view(torch.float8_e4m3fn)``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._common import dtype_name
from ._plan import planned

FORMATS = {"mxfp4": 32, "nvfp4": 16}
_SCALE_DTYPE = {"mxfp4": torch.float8_e8m0fnu, "nvfp4": torch.float8_e4m3fn}
ACTS = ("fp8", "bf16")
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: ``moe_forward(out_dtype=...)`` choices (floating only: an integer dtype would truncate)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYOUTS = ("contiguous", "masked")


# ------------------------------------------------------------------------------------------
# problems: what selects a provider and its config (frozen, hashable: the registry's cache key)
@dataclass(frozen=True)
class PrepareProblem(Problem):
    fmt: str            # "mxfp4" | "nvfp4"
    device: str


@dataclass(frozen=True)
class RouteProblem(Problem):
    topk: int
    hash: bool          # hash layer (tid2eid[input_ids]) instead of the score top-k
    E: int
    device: str


@dataclass(frozen=True)
class PermuteProblem(Problem):
    act: str            # "fp8" | "bf16"
    layout: str         # "contiguous" | "masked"
    E: int
    k: int              # top-k
    D: int
    device: str


@dataclass(frozen=True)
class CombineProblem(Problem):
    k: int
    D: int
    y_dtype: str        # dtype name of the GEMM2 rows
    out_dtype: str
    device: str


@dataclass(frozen=True)
class GemmProblem(Problem):
    """``moe_gemm1_swiglu`` / ``moe_gemm2``: formats, sizes (``N`` weight rows: 2I / D, ``K``
    reduction), grouped rows ``R``, ``rows``: an upper bound of the rows that hold an assignment
    (``min(R, T * topk)``: the masked layout's ``E * max_m`` slots are mostly empty at decode) and
    the scheduling hint ``max_m`` (largest rows per expert; None = unknown, the kernels assume
    ``R / E``). ``R`` / ``rows`` / ``max_m`` only select kernel configurations."""

    fmt: str
    act: str
    E: int
    N: int
    K: int
    R: int
    rows: int
    max_m: Optional[int]
    device: str

# ------------------------------------------------------------------------------------------
# prepare
PREPARE_SPEC = OpSpec(
    name="moe_prepare_weights",
    summary="Checkpoint FP4 expert weights -> kernel layout (W13 rows reordered per 256-row tile, "
            "scale bytes linear, per-expert global scales).",
    inputs=(
        TensorSpec("w13", torch.uint8, ("E", "2 * I", "D // 2"),
                   packing="2 x E2M1 per byte, element 2i in the low nibble",
                   doc="rows = plain concat [gate_proj (w1) rows 0..I-1; up_proj (w3) rows I..2I-1] (never interleaved)"),
        TensorSpec("w13_scale", (torch.float8_e8m0fnu, torch.float8_e4m3fn), ("E", "2 * I", "D // SF"), align=1,
                   scale="linear [E, 2I, D/SF] (or swizzled 128x4 with sf_layout='swizzled'); mxfp4: UE8M0 / 32, nvfp4: E4M3 / 16"),
        TensorSpec("w2", torch.uint8, ("E", "D", "I // 2"), packing="2 x E2M1 per byte, low nibble first",
                   doc="down_proj (w2)"),
        TensorSpec("w2_scale", (torch.float8_e8m0fnu, torch.float8_e4m3fn), ("E", "D", "I // SF"), align=1,
                   scale="linear [E, D, I/SF]"),
        TensorSpec("w13_global", torch.float32, ("E", 2), align=4, optional=True,
                   doc="per-expert FP32 decode multipliers (gate, up); required for nvfp4, default 1 for mxfp4"),
        TensorSpec("w2_global", torch.float32, ("E",), align=4, optional=True,
                   doc="per-expert FP32 decode multiplier of W2; required for nvfp4, default 1 for mxfp4"),
    ),
    outputs=(
        TensorSpec("w13p", torch.uint8, ("E", "2 * I", "D // 2"), output=True,
                   doc="row r of 256-row tile t = W13 row: tile t covers I columns [128t, 128t+128): "
                       "[gate 128t..+63 | up 128t..+63 | gate 128t+64..+127 | up 128t+64..+127]"),
        TensorSpec("w13p_scale", torch.uint8, ("E", "2 * I", "D // SF"), align=4, output=True,
                   doc="scale bytes (raw E8M0 / E4M3 bits via .view(uint8)), same row order as w13p"),
        TensorSpec("w2p", torch.uint8, ("E", "D", "I // 2"), output=True, doc="unchanged W2 data"),
        TensorSpec("w2p_scale", torch.uint8, ("E", "D", "I // SF"), align=4, output=True, doc="W2 scale bytes"),
        TensorSpec("g13", torch.float32, ("E", 2), align=4, output=True, doc="(gate, up) global scales"),
        TensorSpec("g2", torch.float32, ("E",), align=4, output=True, doc="W2 global scales"),
    ),
    params=(Param("fmt", "str", "{'mxfp4', 'nvfp4'}", "scale format; SF = 32 or 16"),
            Param("sf_layout", "str", "{'linear', 'swizzled'}", "layout of the input scale tensors")),
    constraints=(("I % 128 == 0", "intermediate size I must be a multiple of 128 (GEMM1 tile = 128 I columns)"),
                 ("D % 256 == 0", "hidden size D must be a multiple of 256 (GEMM2 N tile)"),
                 ("D % 128 == 0", "hidden size D must be a multiple of 128 (K block)")),
    formula="w13p[e, 256t + 128h + 64u + j] = w13[e, u*I + 128t + 64h + j] (u = 0 gate, 1 up); scales likewise",
    source="dsv4_spec.md 2.5 / 2.7 (w1 = gate_proj, w3 = up_proj, w2 = down_proj; MXFP4 or NVIDIA NVFP4)",
    notes="W4A8 exactness (prefill: the CuTe DSL grouped GEMM, kernels_dsl/sm90/transform.py): the UE8M0 "
          "scales of a weight row are folded into E4M3 values relative to the row's largest exponent over "
          "its whole K; exact while the row's exponents span <= 14 binades (beyond: round-to-nearest into "
          "the E4M3 subnormals, absolute error <= 2^(e_ref - 10)); NVFP4 under W4A8 splits each decoded "
          "weight into hi + lo E4M3 parts (two FP8 WGMMAs), exact while the row's block scales lie within 8 "
          "binades of its largest. Decode-sized groups (cuda moe_decode.cu) use exact BF16 weights.",
)


@dataclass
class MoEWeights:
    """Prepared expert weights (kernel layout, see ``PREPARE_SPEC`` / ``describe()``).

    Attributes: ``w13`` uint8 [E, 2I, D/2] (tile-reordered), ``w13_scale`` uint8 [E, 2I, D/SF],
    ``w2`` uint8 [E, D, I/2], ``w2_scale`` uint8 [E, D, I/SF], ``g13`` fp32 [E, 2], ``g2`` fp32 [E],
    ``fmt`` ('mxfp4' | 'nvfp4'), sizes ``E``, ``I``, ``D``.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    g13: torch.Tensor
    g2: torch.Tensor
    fmt: str
    E: int
    I: int
    D: int

    def describe(self) -> str:
        """The prepared layout spec next to the actual tensors."""
        lines = [PREPARE_SPEC.text(), "  actual:"]
        for k in ("w13", "w13_scale", "w2", "w2_scale", "g13", "g2"):
            t = getattr(self, k)
            lines.append(f"    {k}: {str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}")
        lines.append(f"    fmt={self.fmt} E={self.E} I={self.I} D={self.D}")
        return "\n".join(lines)


def _ex_prepare(target):
    return PrepareProblem("mxfp4", target.device_type)


PREPARE_OP = register(Op("moe_prepare_weights", PREPARE_SPEC, module="moe", kinds=("torch",),
                         example_problem=_ex_prepare))


def w13_tile_permutation(I: int, device=None) -> torch.Tensor:
    """Row permutation of W13 used by :func:`moe_prepare_weights`: ``w13p = w13[:, p]``.

    Per 128 I-columns tile t the 256 prepared rows are
    ``[gate 128t..+63, up 128t..+63, gate 128t+64..+127, up 128t+64..+127]``, built from the
    plain-concat convention ``w13 = [gate (rows 0..I-1); up (rows I..2I-1)]``; never assumes
    interleaving.

    Args:
        I: intermediate size (moe_intermediate_size), a Python int, multiple of 128.
        device: torch device of the result (default CPU).

    Returns:
        int64 ``[2I]``: ``p[256t + 128h + 64u + j] = u*I + 128t + 64h + j`` (u = 0 gate, 1 up).

    Raises:
        LayoutError: ``I`` is not a positive int multiple of 128.

    Source: the grouped GEMM1 weight tile (BLOCK_N = 256 rows = 128 gate + 128 up columns:
    kernels_dsl/sm90/epilogue.py, kernels_cuda/moe_decode.cu).
    """
    if isinstance(I, bool) or not isinstance(I, int) or I <= 0 or I % 128:
        raise LayoutError(f"w13_tile_permutation: argument I={I!r} must be a positive int multiple of 128 "
                          "(intermediate size; GEMM1 tile = 128 I columns)")
    t = torch.arange(I // 128, device=device).view(-1, 1, 1, 1)
    h = torch.arange(2, device=device).view(1, -1, 1, 1)
    u = torch.arange(2, device=device).view(1, 1, -1, 1)
    j = torch.arange(64, device=device).view(1, 1, 1, -1)
    return (u * I + 128 * t + 64 * h + j).reshape(-1)


def _check_scale_dtype(name: str, t: torch.Tensor, fmt: str) -> None:
    want = _SCALE_DTYPE[fmt]
    if t.dtype == torch.uint8:
        raise LayoutError(f"moe_prepare_weights: argument '{name}' is raw uint8; reinterpret the bytes with "
                          f".view({want}) (never .to(): seed 003, 0x3F would become 63.0)")
    if t.dtype != want:
        raise LayoutError(f"moe_prepare_weights: argument '{name}' has dtype {t.dtype}, expected {want} for fmt={fmt!r}")


def moe_prepare_weights(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                        *, fmt: str = "mxfp4", w13_global: Optional[torch.Tensor] = None,
                        w2_global: Optional[torch.Tensor] = None, sf_layout: str = "linear") -> MoEWeights:
    """Convert checkpoint expert tensors into the kernel layout.

    Args:
        w13: uint8 ``[E, 2I, D/2]`` packed E2M1, rows = ``concat[gate_proj; up_proj]`` (w1; w3).
        w13_scale: ``fmt='mxfp4'``: float8_e8m0fnu ``[E, 2I, D/32]``; ``'nvfp4'``: float8_e4m3fn
            ``[E, 2I, D/16]``. With ``sf_layout='swizzled'``: the 128x4 swizzled form
            ``[E, cdiv(2I,128), cdiv(D/SF,4), 32, 4, 4]`` (un-swizzled here).
        w2: uint8 ``[E, D, I/2]``; w2_scale: ``[E, D, I/SF]`` (or swizzled).
        fmt: ``'mxfp4'`` or ``'nvfp4'``.
        w13_global: float32 ``[E, 2]`` per-expert (gate, up) decode multipliers (NVFP4
            ``weight_scale_2`` of w1 and w3); required for nvfp4; ones for mxfp4 when None.
        w2_global: float32 ``[E]``; required for nvfp4.
        sf_layout: ``'linear'`` or ``'swizzled'``.

    Returns:
        :class:`MoEWeights` (layout: ``PREPARE_SPEC``, ``docs/layouts/moe_prepare_weights.md``).

    Raises:
        LayoutError: wrong dtype (including raw uint8 scales), shape, missing/ill-shaped global
            scales (e.g. a single scale for all experts), I % 128 or D % 256 != 0.
        ValueError: unknown ``fmt`` / ``sf_layout``; a NaN / Inf global scale (it would turn the
            whole expert into NaN; checked on the host: a load-time op, the one sync is fine).
    """
    if fmt not in FORMATS:
        raise ValueError(f"moe_prepare_weights: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if sf_layout not in ("linear", "swizzled"):
        raise ValueError(f"moe_prepare_weights: sf_layout must be 'linear' or 'swizzled', got {sf_layout!r}")
    SF = FORMATS[fmt]
    _check_scale_dtype("w13_scale", w13_scale, fmt)
    _check_scale_dtype("w2_scale", w2_scale, fmt)
    if sf_layout == "swizzled":
        from ..formats import unswizzle_sf_128x4
        E, N13, Kp = w13.shape
        w13_scale = unswizzle_sf_128x4(w13_scale, N13, 2 * Kp // SF)
        E2, D2, Ip = w2.shape
        w2_scale = unswizzle_sf_128x4(w2_scale, D2, 2 * Ip // SF)
    if fmt == "nvfp4" and (w13_global is None or w2_global is None):
        raise LayoutError("moe_prepare_weights: fmt='nvfp4' needs per-expert global scales w13_global "
                          "float32 [E, 2] (gate, up) and w2_global float32 [E]")
    for name, g in (("w13_global", w13_global), ("w2_global", w2_global)):
        if isinstance(g, torch.Tensor) and g.is_floating_point() and g.numel() and not bool(torch.isfinite(g).all()):
            bad = (~torch.isfinite(g)).nonzero()[0].tolist()
            raise ValueError(f"moe_prepare_weights: argument '{name}' has a non-finite value at {bad} "
                             f"({float(g[tuple(bad)])}); per-expert global scales must be finite")
    env = PREPARE_SPEC.validate({"w13": w13, "w13_scale": w13_scale, "w2": w2, "w2_scale": w2_scale,
                                 "w13_global": w13_global, "w2_global": w2_global},
                                symbols={"SF": SF, "I": w13.shape[1] // 2 if w13.dim() == 3 else -1,
                                         "D": 2 * w13.shape[2] if w13.dim() == 3 else -1})
    problem = PrepareProblem(fmt, w13.device.type)
    return PREPARE_OP.dispatch(problem, Target.of(w13.device), w13=w13, w13_scale=w13_scale, w2=w2,
                               w2_scale=w2_scale, w13_global=w13_global, w2_global=w2_global,
                               E=env["E"], I=env["I"], D=env["D"])


def prepare_impl(problem, *, w13, w13_scale, w2, w2_scale, w13_global, w2_global, E, I, D) -> MoEWeights:
    """Torch body of ``moe_prepare_weights`` (device-side gathers; ``.view(uint8)`` byte views)."""
    fmt = problem["fmt"]
    perm = w13_tile_permutation(I, w13.device)
    dev = w13.device
    g13 = (w13_global if w13_global is not None else torch.ones(E, 2, device=dev)).float().contiguous()
    g2 = (w2_global if w2_global is not None else torch.ones(E, device=dev)).float().contiguous()
    return MoEWeights(
        w13=w13.index_select(1, perm).contiguous(),
        w13_scale=w13_scale.view(torch.uint8).index_select(1, perm).contiguous(),
        w2=w2.contiguous(), w2_scale=w2_scale.view(torch.uint8).contiguous(),
        g13=g13, g2=g2, fmt=fmt, E=E, I=I, D=D)


def _is_int(v) -> bool:
    """A Python / numpy integer, not a bool (a float, str or tensor is refused, never truncated)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_int(op: str, name: str, v, lo: int, hi: Optional[int] = None, what: str = "") -> int:
    """``v`` must be a Python int (not bool) in ``[lo, hi]``; ValueError naming the argument."""
    if not _is_int(v):
        raise ValueError(f"{op}: argument '{name}' must be an int, got {type(v).__name__} {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{op}: argument '{name}' must be {rng}" + (f" ({what})" if what else "") + f", got {v}")
    return int(v)


# ------------------------------------------------------------------------------------------
# router
ROUTE_SPEC = OpSpec(
    name="moe_route",
    summary="DSV4 MoE gate: sqrt(softplus(x W^T)) scores, bias for selection only, top-k, "
            "normalized * route_scale; hash layers: tid2eid[input_ids].",
    inputs=(
        TensorSpec("x", (torch.bfloat16, torch.float32), ("T", "D"), doc="hidden states"),
        TensorSpec("gate_weight", (torch.bfloat16, torch.float32), ("E", "D"), doc="router weight Wg"),
        TensorSpec("bias", torch.float32, ("E",), align=4, optional=True, doc="selection bias (non-hash layers)"),
        TensorSpec("input_ids", (torch.int32, torch.int64), ("T",), align=4, optional=True, doc="hash layers"),
        TensorSpec("tid2eid", (torch.int32, torch.int64), ("V", "K_TOP"), align=4, optional=True,
                   doc="hash layers: token id -> expert ids"),
    ),
    outputs=(TensorSpec("topk_idx", torch.int32, ("T", "K_TOP"), output=True),
             TensorSpec("topk_w", torch.float32, ("T", "K_TOP"), output=True)),
    params=(Param("topk", "int", ">= 1", "experts per token (6 in DSV4)"),
            Param("route_scale", "float", "> 0", "routed_scaling_factor (1.5 Flash, 2.5 Pro)")),
    formula="s = sqrt(softplus(x_fp32 @ Wg_fp32^T)); idx = topk(s + bias, k) (or tid2eid[input_ids]); "
            "w = s[idx] / sum(s[idx]) * route_scale",
    source="dsv4_spec.md 2.5 / 4.5 item 14 (FLASH-REF model.py Gate)",
)


def _ex_route(target):
    return RouteProblem(6, False, 256, target.device_type)


#: the layer glue ops (route, permute, combine) share the provider module ``moe_glue``
#: (kernels_dsl/moe_glue.py, dsv4/reference/moe_glue.py)
ROUTE_OP = register(Op("moe_route", ROUTE_SPEC, module="moe_glue", example_problem=_ex_route))


@custom_op("dsv4::moe_route", mutates_args=())
def _moe_route_op(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor],
                  input_ids: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor], topk: int,
                  route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    problem = RouteProblem(topk, tid2eid is not None, gate_weight.shape[0], x.device.type)
    return ROUTE_OP.dispatch(problem, Target.of(x.device), x=x, gate_weight=gate_weight, bias=bias,
                             input_ids=input_ids, tid2eid=tid2eid, topk=topk, route_scale=route_scale)


@_moe_route_op.register_fake
def _(x, gate_weight, bias, input_ids, tid2eid, topk, route_scale):
    T = x.shape[0]
    return (x.new_empty((T, topk), dtype=torch.int32), x.new_empty((T, topk), dtype=torch.float32))


@planned
def moe_route(x: torch.Tensor, gate_weight: torch.Tensor, *, topk: int = 6, route_scale: float = 1.5,
              bias: Optional[torch.Tensor] = None, input_ids: Optional[torch.Tensor] = None,
              tid2eid: Optional[torch.Tensor] = None,
              debug_check: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DSV4 router.

    Args:
        x: bf16/fp32 ``[T, D]``; gate_weight: bf16/fp32 ``[E, D]``; bias: fp32 ``[E]`` (selection only).
        topk: experts per token, a Python int in ``[1, E]`` (6 in DSV4).
        route_scale: multiplier of the normalized weights (unitless, > 0; 1.5 Flash, 2.5 Pro).
        input_ids, tid2eid: hash layers: ``idx = tid2eid[input_ids]``; ``input_ids`` int32/int64
            ``[T]`` with values in ``[0, V)``; ``tid2eid`` int32/int64 ``[V, topk]`` with values
            (expert ids) in ``[0, E)``. The value ranges are NOT checked by default (that needs a
            host sync); bad values never fault: a slot whose ``input_ids`` value is outside
            ``[0, V)`` or whose ``tid2eid`` value is outside ``[0, E)`` is a dropped assignment
            (``topk_idx = -1``, ``topk_w = 0``; the token's other weights are normalized over its
            valid slots), on every provider. ``debug_check=True`` raises instead (syncs).
        debug_check: host-side value checks of ``input_ids`` / ``tid2eid`` (syncs; off by default).

    Returns:
        ``(topk_idx int32 [T, topk], topk_w float32 [T, topk])``; ``topk_idx`` values in ``[0, E)``
        (or -1: a dropped hash-layer slot, see above); ``topk_w`` uses the unbiased scores, rows
        sum to ``route_scale``. Slots are ordered by decreasing selection score (``s + bias``;
        ties: lower expert id first); hash layers: in ``tid2eid`` order. The weight sum is taken
        in slot order. Non-finite input is not checked (it would need a host sync): a row whose
        selected scores do not sum to a positive number (e.g. NaN in ``x``) gets weights 0 (it
        contributes nothing), an infinite score gives NaN weights; ``debug_check`` does not look
        at ``x``.

    Precision (dsl provider): the gate GEMM ``x_fp32 @ Wg_fp32^T`` is an fp32 sum in another order
    than the reference's (fp32 gate weights at 8..64 tokens inside the route's own launch, else on cuBLAS; about 1e-7
    relative), so slots whose selection scores are near-ties may order differently; weights within
    1e-5 relative of the reference's (tests/test_moe_eager.py, tests/test_moe_glue.py).
    Deterministic: the same inputs give the same bits.

    Raises:
        ValueError: ``topk`` not an int in ``[1, E]``, ``route_scale`` not a finite positive number, or
            (``debug_check``) ``input_ids`` / ``tid2eid`` values out of range.
        LayoutError: shapes/dtypes (``docs/layouts/moe_route.md``); only one of ``input_ids`` /
            ``tid2eid`` given, or a ``tid2eid`` width != topk.

    Source: dsv4_spec.md 2.5 (FLASH-REF model.py Gate).
    """
    if (input_ids is None) != (tid2eid is None):
        raise LayoutError("moe_route: hash layers need both 'input_ids' and 'tid2eid'")
    topk = _check_int("moe_route", "topk", topk, 1)
    ROUTE_SPEC.validate({"x": x, "gate_weight": gate_weight, "bias": bias, "input_ids": input_ids,
                         "tid2eid": tid2eid}, symbols={"K_TOP": topk})
    E = gate_weight.shape[0]
    _check_int("moe_route", "topk", topk, 1, E, f"experts per token, at most E = gate_weight.shape[0] = {E}")
    if isinstance(route_scale, bool) or not isinstance(route_scale, numbers.Real) or not 0 < route_scale < float("inf"):
        raise ValueError(f"moe_route: argument 'route_scale' must be a finite number > 0, got {route_scale!r}")
    if debug_check and tid2eid is not None:
        V = tid2eid.shape[0]
        if input_ids.numel() and bool(((input_ids < 0) | (input_ids >= V)).any()):
            raise ValueError(f"moe_route: argument 'input_ids' has values outside [0, V={V}) "
                             f"(V = tid2eid.shape[0]); got min {int(input_ids.min())}, max {int(input_ids.max())}")
        if tid2eid.numel() and bool(((tid2eid < 0) | (tid2eid >= E)).any()):
            raise ValueError(f"moe_route: argument 'tid2eid' has expert ids outside [0, E={E}) "
                             f"(E = gate_weight.shape[0]); got min {int(tid2eid.min())}, max {int(tid2eid.max())}")
    return _moe_route_op(x, gate_weight, bias, input_ids, tid2eid, int(topk), float(route_scale))


# ------------------------------------------------------------------------------------------
# permutation / combine (registered ops; providers: kernels_dsl/moe_glue.py, dsv4/reference/moe.py)
class MoEGrouped(NamedTuple):
    """Grouped activations: rows of expert e are ``[row_start[e], row_start[e] + row_count[e])``.

    ``a``: fp8 e4m3 ``[R, D]`` or bf16; ``a_s``: fp32 ``[R, D/128]`` (fp8) or None; ``row_start``,
    ``row_count``: int32 ``[E]``; ``route_w``: fp32 ``[R]`` routing weight of each row; ``pos``:
    int64 ``[T*topk]`` row of each (token, slot) or -1 (dropped: masked layout count > max_m, or
    an expert id outside ``[0, E)``). Rows that hold no assignment are unspecified. The grouped GEMMs
    read ``pos.numel()`` (= T*topk) as the upper bound of the assignments that sizes the cuda decode
    config (never the result): a hand-built grouping should give ``pos`` its real ``[T*topk]`` length.
    :meth:`dropped` counts the dropped assignments on the device.
    """

    a: torch.Tensor
    a_s: Optional[torch.Tensor]
    row_start: torch.Tensor
    row_count: torch.Tensor
    route_w: torch.Tensor
    pos: torch.Tensor

    def dropped(self) -> torch.Tensor:
        """The dropped assignments (``pos == -1``: an expert id outside ``[0, E)``, or past ``max_m``
        in the masked layout): an int64 0-d tensor on ``pos``'s device (no host sync; ``int()`` syncs)."""
        return (self.pos < 0).sum()


PERMUTE_SPEC = OpSpec(
    name="moe_permute",
    summary="Stable counting sort of the (token, slot) assignments by expert, fused with DSV4 act_quant "
            "(FP8 E4M3 1x128, UE8M0 scales) and the gather into the grouped layout (contiguous / masked).",
    inputs=(
        TensorSpec("x", _X_DTYPES, ("T", "D"), doc="hidden states (D % 128 == 0 for act='fp8')"),
        TensorSpec("topk_idx", (torch.int32, torch.int64), ("T", "K_TOP"), align=4,
                   doc="expert id of each (token, slot); ids outside [0, E) are dropped assignments"),
        TensorSpec("topk_w", torch.float32, ("T", "K_TOP"), align=4,
                   doc="routing weights (other float dtypes are converted to fp32 first)"),
    ),
    outputs=(
        TensorSpec("a", (torch.float8_e4m3fn, torch.bfloat16), ("R", "D"), output=True,
                   doc="grouped rows; R = T * K_TOP (contiguous) or E * max_m (masked); row of assignment i "
                       "= pos[i]; rows holding no assignment are unspecified"),
        TensorSpec("a_s", torch.float32, ("R", "D // 128"), align=4, output=True,
                   scale="fp32 per (row, 128 along D): UE8M0 powers of two (act_quant); empty [0] for bf16"),
        TensorSpec("row_start", torch.int32, ("E",), align=4, output=True,
                   doc="contiguous: exclusive prefix sum of row_count; masked: e * max_m"),
        TensorSpec("row_count", torch.int32, ("E",), align=4, output=True,
                   doc="valid assignments of expert e (masked: at most max_m)"),
        TensorSpec("route_w", torch.float32, ("R",), align=4, output=True, doc="topk_w of each grouped row"),
        TensorSpec("pos", torch.int64, ("T * K_TOP",), align=8, output=True,
                   doc="grouped row of assignment i = t * K_TOP + j, or -1 (dropped)"),
    ),
    params=(Param("num_experts", "int", ">= 1", "E, the experts of the weights"),
            Param("act", "str", "{'fp8', 'bf16'}", "W4A8 (act_quant to E4M3) or W4A16 (bf16 copy)"),
            Param("layout", "str", "{'contiguous', 'masked'}", "grouped layout (DeepGEMM's two)"),
            Param("max_m", "int", ">= 1", "masked: rows per expert; assignments past it are dropped")),
    constraints=(),
    formula="rows of expert e in assignment order (stable): contiguous row = row_start[e] + rank, masked row = "
            "e * max_m + rank (dropped if rank >= max_m); a[row] = act_quant(x[t], 128, ue8m0) (fp8) or "
            "bf16(x[t]); a_s[row] = its scales; route_w[row] = topk_w[t, j]; pos[t * K_TOP + j] = row",
    source="DSV4 act_quant (dsv4_spec.md 2.1, bit-exact with dsv4.formats.quantize_fp8_block); grouped layouts as "
           "DeepGEMM (contiguous / masked)",
    notes="Bad expert ids (negative or >= E) never fault: they are dropped assignments (pos = -1, no row, not "
          "counted), on every provider; moe_permute(debug_check=True) raises ValueError instead (host sync). "
          "Contiguous layout with dropped ids: rows [sum(row_count), R) hold nothing.",
)

COMBINE_SPEC = OpSpec(
    name="moe_combine",
    summary="Un-permute + sum: out[t] = sum over the k slots of y[pos[t * k + j]] (fp32, slot order).",
    inputs=(
        TensorSpec("y", (torch.float32, torch.bfloat16, torch.float16), ("R", "D"),
                   doc="grouped GEMM2 rows (moe_gemm2: fp32, routing weight already applied)"),
        TensorSpec("pos", torch.int64, ("T * K_TOP",), align=8,
                   doc="MoEGrouped.pos; values outside [0, R) (e.g. -1) add nothing"),
    ),
    outputs=(TensorSpec("out", OUT_DTYPES, ("T", "D"), output=True, doc="fp32 sum rounded once to out_dtype"),),
    params=(Param("num_tokens", "int", ">= 0", "T"), Param("topk", "int", ">= 1", "K_TOP = topk_idx.shape[1]"),
            Param("out_dtype", "torch.dtype", "float32, bfloat16, float16", "output dtype (default float32)")),
    formula="acc = 0.0; for j in 0..K_TOP-1: acc += (0 <= pos[t*K_TOP+j] < R) ? y[pos[t*K_TOP+j]] : 0; out[t] = acc",
    source="dsv4_spec.md 2.5 (MoE.forward: y[idx] += expert(x[idx]) * weights)",
    notes="Deterministic: the fixed slot order, no atomics; the dsl and torch providers agree bit for bit.",
)


def _ex_permute(target):
    return PermuteProblem("fp8", "contiguous", 256, 6, 4096, target.device_type)


def _ex_combine(target):
    return CombineProblem(6, 4096, "float32", "float32", target.device_type)


PERMUTE_OP = register(Op("moe_permute", PERMUTE_SPEC, module="moe_glue", example_problem=_ex_permute))
COMBINE_OP = register(Op("moe_combine", COMBINE_SPEC, module="moe_glue", example_problem=_ex_combine))


@custom_op("dsv4::moe_permute", mutates_args=())
def _moe_permute_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int, act: str,
                    layout: str, max_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
    problem = PermuteProblem(act, layout, num_experts, topk_idx.shape[1], x.shape[1], x.device.type)
    return PERMUTE_OP.dispatch(problem, Target.of(x.device), x=x, topk_idx=topk_idx, topk_w=topk_w,
                               num_experts=num_experts, act=act, layout=layout, max_m=max_m)


@_moe_permute_op.register_fake
def _(x, topk_idx, topk_w, num_experts, act, layout, max_m):
    T, D = x.shape
    n = T * topk_idx.shape[1]
    R = n if layout == "contiguous" else num_experts * max_m
    fp8 = act == "fp8"
    return (x.new_empty((R, D), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16),
            x.new_empty((R, D // 128) if fp8 else (0,), dtype=torch.float32),
            x.new_empty((num_experts,), dtype=torch.int32), x.new_empty((num_experts,), dtype=torch.int32),
            x.new_empty((R,), dtype=torch.float32), x.new_empty((n,), dtype=torch.int64))


@custom_op("dsv4::moe_combine", mutates_args=())
def _moe_combine_op(y: torch.Tensor, pos: torch.Tensor, num_tokens: int, topk: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    problem = CombineProblem(topk, y.shape[1], dtype_name(y.dtype), dtype_name(out_dtype), y.device.type)
    return COMBINE_OP.dispatch(problem, Target.of(y.device), y=y, pos=pos, num_tokens=num_tokens, topk=topk,
                               out_dtype=out_dtype)


@_moe_combine_op.register_fake
def _(y, pos, num_tokens, topk, out_dtype):
    return y.new_empty((num_tokens, y.shape[1]), dtype=out_dtype)


def _check_routing(op: str, x, topk_idx, topk_w) -> None:
    """Shapes / dtypes / devices of ``x [T, D]``, ``topk_idx [T, k]``, ``topk_w [T, k]`` (no value checks)."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_w", topk_w)):
        if not isinstance(t, torch.Tensor):
            raise LayoutError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise LayoutError(f"{op}: argument 'x' must be bfloat16/float16/float32 [T, D], got "
                          f"{str(x.dtype).replace('torch.', '')} {list(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int32, torch.int64) or topk_idx.shape[0] != x.shape[0]:
        raise LayoutError(f"{op}: argument 'topk_idx' must be int32/int64 [T, k] with T = x.shape[0] = "
                          f"{x.shape[0]}, got {str(topk_idx.dtype).replace('torch.', '')} {list(topk_idx.shape)}")
    if topk_w.shape != topk_idx.shape or not topk_w.dtype.is_floating_point:
        raise LayoutError(f"{op}: argument 'topk_w' must be a float tensor of topk_idx's shape "
                          f"{list(topk_idx.shape)}, got {str(topk_w.dtype).replace('torch.', '')} {list(topk_w.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_w", topk_w)):
        if t.device != x.device:
            raise LayoutError(f"{op}: argument '{name}' is on {t.device}, 'x' on {x.device}")


@planned
def moe_permute(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, num_experts: int, *,
                act: str = "fp8", layout: str = "contiguous", max_m: Optional[int] = None,
                debug_check: bool = False) -> MoEGrouped:
    """Quantize (act='fp8': E4M3 1x128 UE8M0, DSV4 act_quant) and group tokens by expert.

    Args:
        x: bf16/fp16/fp32 ``[T, D]`` (``D % 128 == 0`` for ``act='fp8'``).
        topk_idx: int32/int64 ``[T, k]`` expert ids, meant to be in ``[0, num_experts)``. The
            range is NOT checked by default (that needs a host sync); out-of-range ids never
            fault: an id that is negative or ``>= num_experts`` is a dropped assignment
            (``pos = -1``, no grouped row, not counted in ``row_count``; it contributes nothing to
            :func:`moe_combine`), on every provider. ``debug_check=True`` raises instead.
        topk_w: float ``[T, k]`` routing weights (applied later, in GEMM1; converted to fp32).
        num_experts: E, a Python int >= 1 (the experts of the weights, ``MoEWeights.E``).
        act: ``'fp8'`` (W4A8) or ``'bf16'`` (W4A16).
        layout: ``'contiguous'`` (R = T*k rows sorted by expert, stable: rows of an expert keep
            assignment order ``t*k + j``) or ``'masked'`` (R = E*max_m, expert e's rows start at
            e*max_m; assignments past max_m are dropped, ``pos = -1``; choose ``max_m >= max
            count``, e.g. T for no drops).
        max_m: rows per expert for ``layout='masked'`` (an int >= 1); ignored for contiguous.
        debug_check: host-side check that ``topk_idx`` values are in ``[0, num_experts)`` (syncs).

    Returns:
        :class:`MoEGrouped`: ``a`` float8_e4m3fn (fp8) or bf16 ``[R, D]``; ``a_s`` fp32
        ``[R, D/128]`` (UE8M0 powers of two, fp8) or None; ``row_start`` / ``row_count`` int32
        ``[E]``; ``route_w`` fp32 ``[R]``; ``pos`` int64 ``[T*k]`` (grouped row of each
        (token, slot), -1 if dropped). Rows holding no assignment (masked padding; contiguous
        rows past ``sum(row_count)`` when ids were dropped) are unspecified. No host sync
        (unless ``debug_check``); no loop over experts. Layout: ``docs/layouts/moe_permute.md``.

    Raises:
        ValueError: unknown ``act`` / ``layout``; ``num_experts`` / ``max_m`` not an int >= 1; a
            grouped layout of 2^31 rows or more (``T*k`` contiguous, ``num_experts*max_m`` masked);
            ``debug_check`` and a ``topk_idx`` value outside ``[0, num_experts)``.
        LayoutError: ``x`` / ``topk_idx`` / ``topk_w`` dtype, shape or device (argument named),
            ``D % 128 != 0`` with ``act='fp8'``.

    Source: DSV4 act_quant (dsv4_spec.md 2.1); grouped layouts as DeepGEMM (contiguous / masked).
    """
    if act not in ACTS or layout not in LAYOUTS:
        raise ValueError(f"moe_permute: act in {ACTS}, layout in {LAYOUTS}; got {act!r}, {layout!r}")
    _check_routing("moe_permute", x, topk_idx, topk_w)
    E = _check_int("moe_permute", "num_experts", num_experts, 1)
    if layout == "masked":
        max_m = _check_int("moe_permute", "max_m", max_m, 1, what="rows per expert, needed with layout='masked'")
    else:
        max_m = 0
    T, D = x.shape
    if act == "fp8" and D % 128:
        raise LayoutError(f"moe_permute: argument 'x' [T, D] needs D % 128 == 0 for act='fp8' (1x128 blocks), got D={D}")
    R = T * topk_idx.shape[1] if layout == "contiguous" else E * max_m
    if R >= 2 ** 31:
        raise ValueError(f"moe_permute: the grouped layout would have R={R} rows "
                         f"({'T*k' if layout == 'contiguous' else 'num_experts*max_m'}); at most 2^31 - 1 are supported")
    if debug_check and topk_idx.numel() and bool(((topk_idx < 0) | (topk_idx >= E)).any()):
        raise ValueError(f"moe_permute: argument 'topk_idx' has expert ids outside [0, num_experts={E}): "
                         f"min {int(topk_idx.min())}, max {int(topk_idx.max())}")
    if topk_w.dtype != torch.float32:
        topk_w = topk_w.float()
    a, a_s, row_start, row_count, rw, pos = _moe_permute_op(x, topk_idx, topk_w, E, act, layout, max_m)
    return MoEGrouped(a, a_s if act == "fp8" else None, row_start, row_count, rw, pos)


@planned
def moe_combine(y: torch.Tensor, pos: torch.Tensor, num_tokens: int, topk: int, *,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Un-permute and sum: ``out[t] = sum_j y[pos[t*k + j]]`` (rows with ``pos = -1`` add 0).

    The routing weight is already inside ``y`` (applied to h before GEMM2, as DSV4 does).
    Deterministic gather + sum in slot order from 0.0, fp32 (no atomics, no host sync); the
    providers agree bit for bit.

    Args:
        y: float ``[R, D]`` grouped GEMM2 rows (:func:`moe_gemm2`, fp32).
        pos: int64 ``[num_tokens * topk]`` grouped row of each (token, slot), ``-1`` = dropped
            (``MoEGrouped.pos`` from :func:`moe_permute`). Values outside ``[0, R)`` are not
            checked (that needs a sync) and never fault: they add nothing, like ``-1``.
        num_tokens: T, a Python int >= 0. topk: k, a Python int >= 1 (``topk_idx.shape[1]``).
        out_dtype: float32 (default), bfloat16 or float16: the fp32 sum rounded once.

    Returns:
        ``[T, D]`` of ``out_dtype``: sum over the k slots of each token, in slot order.

    Raises:
        ValueError: ``num_tokens`` / ``topk`` not ints in range; ``out_dtype`` not a float dtype.
        LayoutError: ``y`` not a 2-D float tensor; ``pos`` not int64 ``[num_tokens * topk]`` or on
            another device.

    Source: dsv4_spec.md 2.5 (MoE.forward: y[idx] += expert(x[idx]) * weights).
    """
    T = _check_int("moe_combine", "num_tokens", num_tokens, 0)
    k = _check_int("moe_combine", "topk", topk, 1)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"moe_combine: argument 'out_dtype' must be float32, bfloat16 or float16, got {out_dtype!r}")
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or not y.dtype.is_floating_point:
        got = f"{str(y.dtype).replace('torch.', '')} {list(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise LayoutError(f"moe_combine: argument 'y' must be a float [R, D] tensor (moe_gemm2 output), got {got}")
    if not isinstance(pos, torch.Tensor) or pos.dtype != torch.int64 or pos.dim() != 1 or pos.numel() != T * k:
        got = f"{str(pos.dtype).replace('torch.', '')} {list(pos.shape)}" if isinstance(pos, torch.Tensor) \
            else type(pos).__name__
        raise LayoutError(f"moe_combine: argument 'pos' must be int64 [num_tokens * topk] = [{T} * {k}] = [{T * k}] "
                          f"(MoEGrouped.pos), got {got}; check num_tokens / topk")
    if pos.device != y.device:
        raise LayoutError(f"moe_combine: argument 'pos' is on {pos.device}, 'y' on {y.device}")
    if y.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        y = y.float()
    return _moe_combine_op(y, pos, T, k, out_dtype)


# ------------------------------------------------------------------------------------------
# grouped GEMMs
_GROUP_INPUTS = (
    TensorSpec("row_start", torch.int32, ("E",), align=4,
               doc="first grouped row of each expert; a value outside [0, R) gives the expert no rows"),
    TensorSpec("row_count", torch.int32, ("E",), align=4,
               doc="rows of each expert (<= 0 = no work; clamped to R - row_start on every provider, never faults)"),
)

GEMM1_SPEC = OpSpec(
    name="moe_gemm1_swiglu",
    summary="Grouped FP4-weight GEMM1 (W13) + DSV4 clamped SwiGLU * routing weight (+ FP8 1x128 requant).",
    inputs=(
        TensorSpec("a", (torch.float8_e4m3fn, torch.bfloat16), ("R", "D"), doc="grouped activations"),
        TensorSpec("a_s", torch.float32, ("R", "D // 128"), align=4, optional=True,
                   scale="fp32 per (row, 128 along D), UE8M0 powers of two from act_quant (fp8 only)"),
        TensorSpec("w13", torch.uint8, ("E", "2 * I", "D // 2"), packing="prepared (moe_prepare_weights)"),
        TensorSpec("w13_scale", torch.uint8, ("E", "2 * I", "D // SF"), align=4, scale="raw scale bytes, linear"),
        TensorSpec("g13", torch.float32, ("E", 2), align=4, doc="per-expert (gate, up) global scales"),
        *_GROUP_INPUTS,
        TensorSpec("route_w", torch.float32, ("R",), align=4, doc="routing weight of each grouped row"),
    ),
    outputs=(TensorSpec("h", (torch.float8_e4m3fn, torch.bfloat16), ("R", "I"), output=True),
             TensorSpec("h_s", torch.float32, ("R", "I // 128"), align=4, output=True,
                        doc="fp8: UE8M0 power-of-two scales; bf16: empty [0]")),
    params=(Param("fmt", "str", "{'mxfp4','nvfp4'}", "weight scale format"),
            Param("act", "str", "{'fp8','bf16'}", "W4A8 (FP8 WGMMA) or W4A16 (BF16 WGMMA)")),
    constraints=(("I % 128 == 0", "I must be a multiple of 128"), ("D % 128 == 0", "D must be a multiple of 128")),
    formula="gate = bf16(A W_gate^T g13[e,0]); up = bf16(A W_up^T g13[e,1]); "
            "h = bf16(silu(min(gate,10)) * clamp(up,-10,10) * route_w); fp8: act_quant(h, 128, ue8m0)",
    source="dsv4_spec.md 2.5 Expert (FLASH-REF model.py L596-606), 2.1 act_quant/fp4_gemm",
)

GEMM2_SPEC = OpSpec(
    name="moe_gemm2",
    summary="Grouped FP4-weight GEMM2 (W2 down-proj), fp32 rows.",
    inputs=(
        TensorSpec("h", (torch.float8_e4m3fn, torch.bfloat16), ("R", "I")),
        TensorSpec("h_s", torch.float32, ("R", "I // 128"), align=4, optional=True, scale="fp32 per (row, 128)"),
        TensorSpec("w2", torch.uint8, ("E", "D", "I // 2"), packing="2 x E2M1 per byte, low nibble first"),
        TensorSpec("w2_scale", torch.uint8, ("E", "D", "I // SF"), align=4, scale="raw scale bytes, linear"),
        TensorSpec("g2", torch.float32, ("E",), align=4, doc="per-expert global scale"),
        *_GROUP_INPUTS,
    ),
    outputs=(TensorSpec("y", torch.float32, ("R", "D"), output=True),),
    params=GEMM1_SPEC.params,
    constraints=(("I % 128 == 0", "I must be a multiple of 128"), ("D % 256 == 0", "D must be a multiple of 256")),
    formula="y[r] = g2[e] * (h[r] * h_s) @ W2[e]^T (fp32)",
    source="dsv4_spec.md 2.5 Expert (y = w2(h))",
)


def _ex_gemm(target):
    return GemmProblem("mxfp4", "fp8", 256, 4096, 4096, 24576, 24576, None, target.device_type)


#: provider preference of the grouped GEMMs: ``cuda`` is asked first but accepts only the problems
#: where a CUDA kernel is measured faster, with that reason (kernels_cuda/moe.py: the moe_decode.cu
#: decode kernel at <= 16 rows per expert); everything else -- prefill, both formats, W4A8 and W4A16
#: -- runs on the CuTe DSL grouped GEMM (kernels_dsl/moe.py; timings in docs/benchmarks.md).
#: ``registry.last_choice(op).explain()`` shows the decision, the skipped provider's reason and the
#: chosen kernel's config (DecodeConfig / GroupedGemmConfig).
GEMM_KINDS = ("cuda", "dsl", "torch")
GEMM1_OP = register(Op("moe_gemm1_swiglu", GEMM1_SPEC, module="moe", kinds=GEMM_KINDS, example_problem=_ex_gemm))
GEMM2_OP = register(Op("moe_gemm2", GEMM2_SPEC, module="moe", kinds=GEMM_KINDS, example_problem=_ex_gemm))


def _act_of(a: torch.Tensor) -> str:
    return "fp8" if a.dtype == torch.float8_e4m3fn else "bf16"


def _gemm_problem(a: torch.Tensor, w: torch.Tensor, fmt: str, max_m: Optional[int], assignments: int = -1) -> GemmProblem:
    """The :class:`GemmProblem` of a grouped GEMM call (``assignments`` < 0: unknown, ``rows = R``)."""
    R = a.shape[0]
    return GemmProblem(fmt, _act_of(a), w.shape[0], w.shape[1], a.shape[1], R,
                       R if assignments is None or assignments < 0 else min(R, int(assignments)),
                       None if max_m is None or max_m < 0 else int(max_m), a.device.type)


@custom_op("dsv4::moe_gemm1_swiglu", mutates_args=())
def _gemm1_op(a: torch.Tensor, a_s: Optional[torch.Tensor], w13: torch.Tensor, w13_scale: torch.Tensor,
              g13: torch.Tensor, row_start: torch.Tensor, row_count: torch.Tensor, route_w: torch.Tensor,
              fmt: str, max_m: int = -1, assignments: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    problem = _gemm_problem(a, w13, fmt, max_m, assignments)
    return GEMM1_OP.dispatch(problem, Target.of(a.device), a=a, a_s=a_s, w13=w13, w13_scale=w13_scale, g13=g13,
                             row_start=row_start, row_count=row_count, route_w=route_w)


@_gemm1_op.register_fake
def _(a, a_s, w13, w13_scale, g13, row_start, row_count, route_w, fmt, max_m=-1, assignments=-1):
    R, I = a.shape[0], w13.shape[1] // 2
    if a.dtype == torch.float8_e4m3fn:
        return a.new_empty((R, I)), a.new_empty((R, I // 128), dtype=torch.float32)
    return a.new_empty((R, I)), a.new_empty((0,), dtype=torch.float32)


@custom_op("dsv4::moe_gemm2", mutates_args=())
def _gemm2_op(h: torch.Tensor, h_s: Optional[torch.Tensor], w2: torch.Tensor, w2_scale: torch.Tensor,
              g2: torch.Tensor, row_start: torch.Tensor, row_count: torch.Tensor, fmt: str,
              max_m: int = -1, assignments: int = -1) -> torch.Tensor:
    problem = _gemm_problem(h, w2, fmt, max_m, assignments)
    return GEMM2_OP.dispatch(problem, Target.of(h.device), h=h, h_s=h_s, w2=w2, w2_scale=w2_scale, g2=g2,
                             row_start=row_start, row_count=row_count)


@_gemm2_op.register_fake
def _(h, h_s, w2, w2_scale, g2, row_start, row_count, fmt, max_m=-1, assignments=-1):
    return h.new_empty((h.shape[0], w2.shape[1]), dtype=torch.float32)


def _check_act_scale(op: str, a, a_s, name: str) -> None:
    if a.dtype == torch.float8_e4m3fn and a_s is None:
        raise LayoutError(f"{op}: argument '{name}_s' (fp32 1x128 scales) is required for FP8 '{name}'")
    if a.dtype == torch.bfloat16 and a_s is not None:
        raise LayoutError(f"{op}: argument '{name}_s' must be None for bf16 '{name}' (W4A16)")


def _check_hint(op: str, max_m) -> int:
    if max_m is None:
        return -1
    return _check_int(op, "max_m", max_m, 0, what="scheduling hint: the largest rows of one expert")


@planned
def moe_gemm1_swiglu(g: MoEGrouped, w: MoEWeights, *, max_m: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped GEMM1 + clamped SwiGLU + routing weight (+ FP8 requant).

    Args:
        g: :class:`MoEGrouped` from :func:`moe_permute` (fp8 or bf16 activations).
        w: :class:`MoEWeights` from :func:`moe_prepare_weights`.
        max_m: optional scheduling hint, the largest ``row_count`` of any expert (the masked
            layout's ``max_m``; DeepGEMM's ``expected_m_per_group``). Only the kernel
            configuration (token tile) depends on it, never the result; None = ``R / E``. The
            dsl provider reads it; the cuda (decode) provider configures from the assignments per expert
            (``min(R, T * topk) / E``, ``g.pos`` holds one entry per assignment), so a masked layout
            with one hot expert still runs the decode kernel (it cuts that expert into token chunks).

    Precision (dsl provider, W4A8): FP8 WGMMA per 128-K block promoted into fp32 (DeepGEMM
    style), weights decoded exactly (MXFP4 while a row's scales span <= 14 binades, NVFP4 through
    the hi + lo E4M3 split); ``h`` is rounded through bf16 and DSV4 act_quant like the reference.

    Returns:
        ``(h, h_s)``: fp8 path: ``h`` float8_e4m3fn ``[R, I]``, ``h_s`` fp32 ``[R, I/128]``
        (UE8M0 powers of two); bf16 path: ``h`` bf16 ``[R, I]``, ``h_s`` empty. Rows outside every
        expert's range are unspecified.

    Bad grouping metadata (a hand-built :class:`MoEGrouped`) never faults, on every provider: expert
    ``e`` owns rows ``[s, s + min(c, R - s))`` when ``0 <= s = row_start[e] < R`` and
    ``c = row_count[e] > 0``, else none (values are not checked: that needs a sync).

    Raises:
        LayoutError: operands not matching ``docs/layouts/moe_gemm1_swiglu.md``.
    """
    _check_act_scale("moe_gemm1_swiglu", g.a, g.a_s, "a")
    GEMM1_SPEC.validate({"a": g.a, "a_s": g.a_s, "w13": w.w13, "w13_scale": w.w13_scale, "g13": w.g13,
                         "row_start": g.row_start, "row_count": g.row_count, "route_w": g.route_w},
                        symbols={"SF": FORMATS[w.fmt], "I": w.I})
    return _gemm1_op(g.a, g.a_s, w.w13, w.w13_scale, w.g13, g.row_start, g.row_count,
                                           g.route_w, w.fmt, _check_hint("moe_gemm1_swiglu", max_m), g.pos.numel())


@planned
def moe_gemm2(h: torch.Tensor, h_s: Optional[torch.Tensor], g: MoEGrouped, w: MoEWeights, *,
              max_m: Optional[int] = None) -> torch.Tensor:
    """Grouped GEMM2 (down-proj): ``y[r] = g2[e] * (h[r] * h_s) @ W2[e]^T`` in fp32.

    Args:
        h: float8_e4m3fn (W4A8) or bf16 (W4A16) ``[R, I]`` from :func:`moe_gemm1_swiglu`.
        h_s: fp32 ``[R, I/128]`` UE8M0 power-of-two scales (fp8), or None / empty (bf16).
        g: :class:`MoEGrouped` (row_start / row_count int32 ``[E]``) from :func:`moe_permute`.
        w: :class:`MoEWeights` from :func:`moe_prepare_weights`.
        max_m: optional scheduling hint (largest ``row_count``), as :func:`moe_gemm1_swiglu`.

    Precision contract (dsl provider): relative (Frobenius) error vs the exact-dequant fp32
    reference on the same ``h`` <= 5e-3 under W4A8 (NVFP4 included), <= 1e-5 under W4A16
    (tests/test_moe.py).

    Returns:
        fp32 ``[R, D]``: row r of expert e is its down-projection (routing weight already in
        ``h``); rows outside every expert's ``[row_start, row_start + row_count)`` are
        unspecified. Feed it to :func:`moe_combine`.
        Bad ``row_start`` / ``row_count`` are clamped as in :func:`moe_gemm1_swiglu`.

    Raises:
        LayoutError: layout mismatch (``docs/layouts/moe_gemm2.md``), missing / extra ``h_s``.

    Source: dsv4_spec.md 2.5 Expert (y = w2(h)).
    """
    if h_s is not None and h_s.numel() == 0 and h.dtype == torch.bfloat16:
        h_s = None
    _check_act_scale("moe_gemm2", h, h_s, "h")
    GEMM2_SPEC.validate({"h": h, "h_s": h_s, "w2": w.w2, "w2_scale": w.w2_scale, "g2": w.g2,
                         "row_start": g.row_start, "row_count": g.row_count}, symbols={"SF": FORMATS[w.fmt]})
    return _gemm2_op(h, h_s, w.w2, w.w2_scale, w.g2, g.row_start, g.row_count, w.fmt,
                                    _check_hint("moe_gemm2", max_m), g.pos.numel())


def _check_weights(op: str, w, x: Optional[torch.Tensor] = None) -> None:
    """``w`` is a :class:`MoEWeights` whose sizes agree with its tensors (and with ``x [T, D]``)."""
    if not isinstance(w, MoEWeights):
        raise LayoutError(f"{op}: argument 'w' must be MoEWeights (from moe_prepare_weights), got {type(w).__name__}")
    for name, t in (("w13", w.w13), ("w13_scale", w.w13_scale), ("w2", w.w2), ("w2_scale", w.w2_scale),
                    ("g13", w.g13), ("g2", w.g2)):
        if t.shape[0] != w.E:
            raise LayoutError(f"{op}: argument 'w' is inconsistent: w.E = {w.E} experts but w.{name} has shape "
                              f"{list(t.shape)} (expected {w.E} along dim 0); rebuild it with moe_prepare_weights")
    if x is not None and x.dim() == 2 and x.shape[1] != w.D:
        raise LayoutError(f"{op}: argument 'x' has shape {list(x.shape)}, expected [T, D] with D = w.D = {w.D} "
                          f"(hidden size of the expert weights)")


def moe_experts(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w: MoEWeights, *,
                act: str = "fp8", layout: str = "contiguous", max_m: Optional[int] = None,
                debug_check: bool = False) -> torch.Tensor:
    """Routed experts given a routing: permute -> GEMM1+SwiGLU -> GEMM2 -> combine.

    Args:
        x: bf16/fp16/fp32 ``[T, D]`` hidden states, ``D = w.D``.
        topk_idx: int32/int64 ``[T, k]`` expert ids (e.g. from :func:`moe_route`) in ``[0, w.E)``;
            an id outside it is a dropped assignment that contributes nothing (not checked, never
            faults; ``debug_check`` raises instead: see :func:`moe_permute`).
        topk_w: float ``[T, k]`` routing weights (already normalized and scaled by route_scale).
        w: :class:`MoEWeights` from :func:`moe_prepare_weights` (``E`` experts, sizes ``I``, ``D``).
        act: ``'fp8'`` (W4A8: act_quant 1x128 UE8M0, FP8 WGMMA) or ``'bf16'`` (W4A16).
        layout, max_m: grouped layout, as :func:`moe_permute`.
        debug_check: host-side check of the ``topk_idx`` value range (syncs).

    Returns:
        fp32 ``[T, D]``: ``sum_j topk_w[t, j] * expert_{topk_idx[t, j]}(x[t])`` (the routing
        weight is applied to h before GEMM2, as DSV4 does).

    Raises:
        ValueError: unknown ``act`` / ``layout``, bad ``max_m``, ``debug_check`` range failure.
        LayoutError: ``w`` not MoEWeights or inconsistent with its own ``E``; ``x`` not
            ``[T, w.D]``; ``topk_idx`` / ``topk_w`` dtype/shape/device (argument named); the
            grouped GEMM layouts (``docs/layouts/moe_gemm1_swiglu.md``, ``moe_gemm2.md``).

    Source: dsv4_spec.md 2.5 (FLASH-REF model.py MoE / Expert).
    """
    _check_weights("moe_experts", w, x if isinstance(x, torch.Tensor) else None)
    return _experts(x, topk_idx, topk_w, w, act, layout, max_m, debug_check, torch.float32)


def _experts(x, topk_idx, topk_w, w, act, layout, max_m, debug_check, out_dtype):
    """permute -> GEMM1 + SwiGLU -> GEMM2 -> combine (rounded once to ``out_dtype``)."""
    g = moe_permute(x, topk_idx, topk_w, w.E, act=act, layout=layout, max_m=max_m, debug_check=debug_check)
    hint = max_m if layout == "masked" else None     # GEMM scheduling hint: largest rows per expert
    h, h_s = moe_gemm1_swiglu(g, w, max_m=hint)
    y = moe_gemm2(h, h_s, g, w, max_m=hint)
    return moe_combine(y, g.pos, x.shape[0], topk_idx.shape[1], out_dtype=out_dtype)


def moe_forward(x: torch.Tensor, w: MoEWeights, gate_weight: torch.Tensor, *, topk: int = 6,
                route_scale: float = 1.5, bias: Optional[torch.Tensor] = None,
                input_ids: Optional[torch.Tensor] = None, tid2eid: Optional[torch.Tensor] = None,
                act: str = "fp8", layout: str = "contiguous", max_m: Optional[int] = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """DSV4 routed-expert layer (no shared expert): route -> experts -> combine.

    Args:
        x: bf16/fp32 ``[T, D]`` hidden states, ``D = w.D``.
        w: :class:`MoEWeights` (``E`` experts).
        gate_weight: bf16/fp32 ``[E, D]`` router weight; ``E`` must equal ``w.E``.
        topk, route_scale, bias, input_ids, tid2eid: router arguments, as :func:`moe_route`
            (hash layers: a bad ``input_ids`` / ``tid2eid`` value drops that slot, never faults).
        act, layout, max_m: as :func:`moe_permute`.
        out_dtype: floating output dtype: float32 (default), bfloat16 or float16.

    Returns:
        ``[T, D]`` of ``out_dtype`` (computed in fp32, rounded once, inside :func:`moe_combine`).

    Raises:
        TypeError: ``out_dtype`` is not a torch.dtype.
        ValueError: ``out_dtype`` not one of float32 / bfloat16 / float16 (an integer dtype
            would silently truncate); bad ``topk`` / ``route_scale`` / ``act`` / ``layout`` / ``max_m``.
        LayoutError: ``gate_weight`` rows != ``w.E``; any shape/dtype mismatch of the router or
            expert operands (argument named, see :func:`moe_route`, :func:`moe_experts`).

    Source: dsv4_spec.md 2.5 (FLASH-REF model.py MoE.forward, routed experts only).
    """
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"moe_forward: argument 'out_dtype' must be a torch.dtype (one of float32, bfloat16, "
                        f"float16), got {type(out_dtype).__name__} {out_dtype!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"moe_forward: argument 'out_dtype' must be a floating dtype (float32, bfloat16 or "
                         f"float16), got {str(out_dtype).replace('torch.', '')}")
    _check_weights("moe_forward", w, x if isinstance(x, torch.Tensor) else None)
    if isinstance(gate_weight, torch.Tensor) and gate_weight.dim() == 2 and gate_weight.shape[0] != w.E:
        raise LayoutError(f"moe_forward: argument 'gate_weight' has shape {list(gate_weight.shape)}, expected "
                          f"[E, D] with E = w.E = {w.E} (the experts of the weights)")
    idx, wt = moe_route(x, gate_weight, topk=topk, route_scale=route_scale, bias=bias, input_ids=input_ids,
                        tid2eid=tid2eid)
    return _experts(x, idx, wt, w, act, layout, max_m, False, out_dtype)


__all__ = ["moe_prepare_weights", "moe_route", "moe_permute", "moe_combine", "moe_gemm1_swiglu", "moe_gemm2",
           "moe_experts", "moe_forward", "MoEWeights", "MoEGrouped", "w13_tile_permutation"]


def graph_cases(device) -> list:
    """CUDA-graph cases: router, permutation (fp8 contiguous, bf16 masked), combine, and GEMM1 +
    SwiGLU / GEMM2 on a fixed grouping (MXFP4, FP8 activations, contiguous layout).
    ``moe_prepare_weights`` is an offline, load-time weight conversion and is not meant for graphs
    (see NOT_GRAPH_OPS)."""
    from ..formats import quantize_mxfp4
    from ._common import GraphCase, bytes_of
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(909)
    E, D, I, T, k = 8, 512, 256, 64, 2
    w13f = torch.randn(E, 2 * I, D, generator=gen) * 0.02
    w2f = torch.randn(E, D, I, generator=gen) * 0.02
    a13, s13 = quantize_mxfp4(w13f)
    a2, s2 = quantize_mxfp4(w2f)
    W = moe_prepare_weights(a13.to(dev), s13.to(dev), a2.to(dev), s2.to(dev), fmt="mxfp4")
    x = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
    gw = torch.empty(E, D, dtype=torch.float32, device=dev)
    bias = torch.empty(E, dtype=torch.float32, device=dev)
    idx = torch.empty(T, k, dtype=torch.int32, device=dev)
    tw = torch.empty(T, k, dtype=torch.float32, device=dev)

    def refresh():
        v = torch.randn(T, D, generator=gen)
        v[:, :4] *= 30
        x.copy_(v.to(torch.bfloat16))
        gw.copy_(torch.randn(E, D, generator=gen) * 0.05)
        bias.copy_(torch.randn(E, generator=gen) * 0.1)
        idx.copy_(torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32))
        tw.copy_(torch.rand(T, k, generator=gen) + 0.1)
    refresh()

    def gemm1():
        g = moe_permute(x, idx, tw, E, act="fp8", layout="contiguous")
        h, hs = moe_gemm1_swiglu(g, W)
        keep = g.pos.clamp_min(0)                # only rows that hold a (token, expert) pair:
        rows = [h.view(torch.uint8)[keep]]       # padding rows of a group are unspecified
        if hs is not None and hs.numel():
            rows.append(hs.contiguous().view(torch.uint8)[keep])
        return bytes_of(*(r * (g.pos >= 0).view(-1, 1).to(r.dtype) for r in rows))

    def gemm2():
        g = moe_permute(x, idx, tw, E, act="fp8", layout="contiguous")
        h, hs = moe_gemm1_swiglu(g, W)
        return moe_combine(moe_gemm2(h, hs, g, W), g.pos, T, k)
    def permute(act, layout):
        g = moe_permute(x, idx, tw, E, act=act, layout=layout, max_m=T)
        keep = g.pos.clamp_min(0)                # rows holding no assignment are unspecified
        rows = [g.a.view(torch.uint8)[keep], g.route_w[keep]] + ([g.a_s[keep]] if g.a_s is not None else [])
        return bytes_of(g.row_start, g.row_count, g.pos, *rows)

    y = torch.empty(T * k, D, dtype=torch.float32, device=dev)
    pos = torch.empty(T * k, dtype=torch.int64, device=dev)

    def refresh_all():
        refresh()
        y.copy_(torch.randn(T * k, D, generator=gen))
        p = torch.randperm(T * k, generator=gen)
        p[::7] = -1                              # dropped assignments
        pos.copy_(p)
    refresh_all()
    return [GraphCase("moe_route", "moe_route", lambda: bytes_of(*moe_route(x, gw, topk=k, bias=bias)), refresh),
            GraphCase("moe_permute-fp8-contiguous", "moe_permute", lambda: permute("fp8", "contiguous"), refresh),
            GraphCase("moe_permute-bf16-masked", "moe_permute", lambda: permute("bf16", "masked"), refresh),
            GraphCase("moe_combine-bf16", "moe_combine",
                      lambda: moe_combine(y, pos, T, k, out_dtype=torch.bfloat16), refresh_all),
            GraphCase("moe_gemm1_swiglu-mxfp4-fp8", "moe_gemm1_swiglu", gemm1, refresh),
            GraphCase("moe_gemm2-mxfp4-fp8", "moe_gemm2", gemm2, refresh)]


#: ops that are not graph-captured by design, with the reason (tests/test_graph_capture.py)
NOT_GRAPH_OPS = {"moe_prepare_weights": "offline weight conversion at load time (runs once per checkpoint)"}
