"""Quantization ops: bf16/fp16 ``[M, K]`` -> NVFP4 / MXFP4 / FP8 blocks, and FP8-block dequant.

Every op is bit-exact with the torch reference formats in :mod:`dsv4.formats` (the ``torch``
provider calls them). GPU provider: CuTe DSL ``kernels_dsl/quantize.py`` (kernels in
``kernels_dsl/quantize_fp4.py`` / ``quantize_fp8.py``; its launch geometry follows the problem's size
class, the problem carries ``M``; timings in docs/benchmarks.md). NVFP4 / MXFP4 dequantization is the
existing op :func:`dsv4.ops.dequant_fp4`.

The GPU providers never synchronize with the host (no ``.item()``): the NVFP4 global scale is
computed from the amax on the device, in one launch for small tensors (a single CTA, or one
grid-synchronized launch that keeps the tiles in registers across the grid-wide amax) and two
launches otherwise (amax partials, then quantize reading them), so every op is CUDA-graph
capturable. The ``torch`` provider is the oracle and is not (``dsv4.formats`` validates with
host syncs).

FP4 non-finite rule (OCP MX v1.0 6.3, issue 19 item 13): a block holding a NaN / Inf gets the NaN
scale and zero codes (it decodes to NaN); FP8 keeps NaN per element (E4M3 has a NaN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ..formats import NVFP4Tensor
from ..layout import LayoutError, OpSpec, Param, TensorSpec
from ..registry import Op, Problem, custom_op, register
from ..target import Target
from ._common import GraphCase, bytes_of, dtype_name
from ._plan import planned

IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SF_LAYOUTS = ("linear", "swizzled")
MXFP4_RULES = ("dsv4", "ocp")
FP8_BLOCKS = (32, 64, 128)
FP8_SCALE_FMTS = ("fp32", "ue8m0")
DQ_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_E2M1_PACKING = ("2 x E2M1 per byte, element 2i in the low nibble; nibble bit 3 = sign, bits 2:0 index "
                 "[0, 0.5, 1, 1.5, 2, 3, 4, 6]")
_SWZ = ("swizzled: [cdiv(M, 128), cdiv(K // 16, 4), 32, 4, 4], (m, k) at [m//128, k//4, m%32, (m//32)%4, k%4], "
        "padding rows/columns = 0x00 (cuBLAS/CUTLASS 128x4 layout, dsv4.formats.swizzle_sf_128x4)")

# ------------------------------------------------------------------------------ specs
SPEC_NVFP4 = OpSpec(
    name="quantize_nvfp4",
    summary="bf16/fp16/fp32 [M, K] -> NVFP4: packed E2M1 + E4M3 scale per 16 along K (linear or 128x4 "
            "swizzled) + FP32 global scale computed on the device (no host sync).",
    inputs=(
        TensorSpec("x", IN_DTYPES, ("M", "K"), doc="values to quantize (cuda provider: bf16/fp16)"),
        TensorSpec("global_scale", torch.float32, (1,), align=4, optional=True,
                   doc="optional caller-supplied DECODE multiplier g_dec (~amax/2688, e.g. a checkpoint's "
                       "weight_scale_2); must be finite and > 0 (not checked on the device). None = computed "
                       "from the amax of x (NaN if x holds a NaN / Inf)"),
    ),
    outputs=(
        TensorSpec("data", torch.uint8, ("M", "K // 2"), output=True, packing=_E2M1_PACKING,
                   doc="E2M1 codes"),
        TensorSpec("scale", torch.float8_e4m3fn, ("M", "K // 16"), output=True,
                   scale="E4M3 per 16 along K; linear: [M, K/16]; " + _SWZ, doc="block scales"),
        TensorSpec("global_scale", torch.float32, (2,), align=4, output=True,
                   doc="[g_dec, g_enc]: decode multiplier (NVFP4Tensor.global_scale) and encode multiplier"),
    ),
    params=(Param("sf_layout", "str", "{'linear', 'swizzled'}", "scale-factor layout"),),
    constraints=(("K % 16 == 0", "K must be a multiple of 16 (one E4M3 scale per 16)"),
                 ("M >= 1", "x must have at least one row")),
    formula="amax = max|x|; g_enc = min(2688 / amax, FLT_MAX) (1 if amax == 0, NaN if amax is NaN / Inf); "
            "g_dec = 1/g_enc; per 16: "
            "s = e4m3(min(vmax * (g_enc * fp32(1/6)), 448)); enc = min(1/(s * g_dec), FLT_MAX); "
            "code = e2m1_rne(clamp(x * enc, -6, 6)), sign-only where s == 0; a block holding a NaN / Inf (or any "
            "block when g_enc is NaN): s = 0x7F (NaN), codes 0 (OCP MX v1.0 6.3)",
    source="dsv4.formats.nvfp4 (TransformerEngine NVFP4 reference quantizer order; NVIDIA NVFP4 "
           "checkpoints: dsv4_spec.md 2.7)",
)

SPEC_MXFP4 = OpSpec(
    name="quantize_mxfp4",
    summary="bf16/fp16/fp32 [M, K] -> MXFP4: packed E2M1 + UE8M0 scale per 32 along K (DSV4 ceil rule or OCP floor rule).",
    inputs=(TensorSpec("x", IN_DTYPES, ("M", "K"), doc="values to quantize (cuda provider: bf16/fp16)"),),
    outputs=(
        TensorSpec("data", torch.uint8, ("M", "K // 2"), output=True, packing=_E2M1_PACKING, doc="E2M1 codes"),
        TensorSpec("scale", torch.float8_e8m0fnu, ("M", "K // 32"), output=True,
                   scale="UE8M0 per 32 along K, linear [M, K/32]", doc="block scales 2^(b-127)"),
    ),
    params=(Param("rule", "str", "{'dsv4', 'ocp'}", "scale rule: dsv4 s = 2^ceil(log2(max(amax, 6*2^-126) * "
                  "fp32(1/6))); ocp s = 2^clamp(floor(log2(amax)) - 2, -127, 127)"),),
    constraints=(("K % 32 == 0", "K must be a multiple of 32 (one UE8M0 scale per 32)"),),
    formula="code = e2m1_rne(clamp(x / s, -6, 6)); a block holding a NaN / Inf: s = 0xFF (NaN), codes 0 "
            "(OCP MX v1.0 6.3)",
    source="dsv4.formats.mxfp4; DSV4 kernel.py fp4_quant_kernel (dsv4_spec.md 2.1); OCP MX v1.0 6.3",
)

SPEC_FP8 = OpSpec(
    name="quantize_fp8_block",
    summary="bf16/fp16/fp32 [M, K] -> E4M3 with one scale per 1 x block along K (DSV4 act_quant), fp32 or UE8M0 scale.",
    inputs=(TensorSpec("x", IN_DTYPES, ("M", "K"), doc="values to quantize (cuda provider: bf16/fp16)"),),
    outputs=(
        TensorSpec("q", torch.float8_e4m3fn, ("M", "K"), output=True, doc="E4M3 values"),
        TensorSpec("scale", (torch.float32, torch.float8_e8m0fnu), ("M", "K // block"), output=True,
                   scale="one per block along K: fp32 dequant multiplier, or its UE8M0 byte "
                         "(scale_fmt='ue8m0', scale_dtype=float8_e8m0fnu)",
                   doc="x ~= q * scale"),
    ),
    params=(Param("block", "int", "{32, 64, 128}", "block length along K"),
            Param("scale_fmt", "str", "{'fp32', 'ue8m0'}", "fp32: s = amax * fp32(1/448); ue8m0: s rounded up to 2^k"),
            Param("scale_dtype", "torch.dtype", "{float32, float8_e8m0fnu (ue8m0 only)}", "scale output dtype")),
    constraints=(("K % block == 0", "K must be a multiple of block"),),
    formula="amax = max(finite max|x_blk|, 1e-4); s = amax * fp32(1/448) [ue8m0: 2^ceil(log2(.))]; "
            "q = e4m3_rne(clamp(x / s, -448, 448)), x / s correctly rounded; NaN -> 0x7F",
    source="dsv4.formats.fp8; DSV4 kernel.py act_quant_kernel (dsv4_spec.md 2.1)",
)

SPEC_DQ = OpSpec(
    name="dequantize_fp8_block",
    summary="E4M3 [M, K] with one scale per 1 x block along K -> bf16/fp16/fp32.",
    inputs=(
        TensorSpec("q", torch.float8_e4m3fn, ("M", "K"), doc="E4M3 values (reinterpret bytes with .view)"),
        TensorSpec("scale", (torch.float32, torch.float8_e8m0fnu), ("M", "K // block"), align=4,
                   scale="fp32 multiplier or UE8M0 byte 2^(b-127), one per block along K", doc="block scales"),
    ),
    outputs=(TensorSpec("out", DQ_OUT_DTYPES, ("M", "K"), output=True, doc="q * scale"),),
    params=(Param("block", "int", "{32, 64, 128}", "block length along K"),
            Param("out_dtype", "torch.dtype", "{bfloat16, float16, float32}", "output dtype")),
    constraints=(("K % block == 0", "K must be a multiple of block"),),
    formula="out = e4m3(q) * scale in fp32, rounded once to out_dtype",
    source="dsv4.formats.fp8.dequantize_fp8_block",
)


# ------------------------------------------------------------------------------ problems
# What selects a provider (frozen: the registry's cache key). ``M`` (rows) is part of every problem:
# the DSL provider's launch plan (kernels_dsl/quantize.py ``config``) follows the size class.
@dataclass(frozen=True)
class Nvfp4Problem(Problem):
    in_dtype: str       # "bfloat16" | "float16"
    K: int
    sf_layout: str      # "linear" | "swizzled"
    global_scale: bool  # given (True) or computed from the device amax (False)
    M: int
    device: str


@dataclass(frozen=True)
class Mxfp4Problem(Problem):
    in_dtype: str
    K: int
    rule: str           # "dsv4" | "ocp"
    M: int
    device: str


@dataclass(frozen=True)
class Fp8Problem(Problem):
    in_dtype: str
    K: int
    block: int          # 32 | 64 | 128
    scale_fmt: str      # "fp32" | "ue8m0"
    scale_dtype: str    # "float32" | "float8_e8m0fnu"
    M: int
    device: str


@dataclass(frozen=True)
class DequantFp8Problem(Problem):
    K: int
    block: int
    scale_dtype: str
    out_dtype: str
    M: int
    device: str


#: rows of the ``dsv4 ops`` example problems (a prefill-sized class)
_EXAMPLE_M = 8192


def _example_nvfp4(target: Target) -> Nvfp4Problem:
    return Nvfp4Problem("bfloat16", 7168, "swizzled", False, _EXAMPLE_M, target.device_type)


def _example_mxfp4(target: Target) -> Mxfp4Problem:
    return Mxfp4Problem("bfloat16", 7168, "dsv4", _EXAMPLE_M, target.device_type)


def _example_fp8(target: Target) -> Fp8Problem:
    return Fp8Problem("bfloat16", 7168, 128, "ue8m0", "float32", _EXAMPLE_M, target.device_type)


def _example_dq(target: Target) -> DequantFp8Problem:
    return DequantFp8Problem(7168, 128, "float32", "bfloat16", _EXAMPLE_M, target.device_type)


OP_NVFP4 = register(Op("quantize_nvfp4", SPEC_NVFP4, module="quantize", example_problem=_example_nvfp4))
OP_MXFP4 = register(Op("quantize_mxfp4", SPEC_MXFP4, module="quantize", example_problem=_example_mxfp4))
OP_FP8 = register(Op("quantize_fp8_block", SPEC_FP8, module="quantize", example_problem=_example_fp8))
OP_DQ = register(Op("dequantize_fp8_block", SPEC_DQ, module="quantize", example_problem=_example_dq))


def _swizzled_shape(M: int, K: int) -> tuple:
    ksf = K // 16
    return (-(-M // 128), -(-ksf // 4), 32, 4, 4)


# ------------------------------------------------------------------------------ custom ops
@custom_op("dsv4::quantize_nvfp4", mutates_args=())
def _quantize_nvfp4_op(x: torch.Tensor, global_scale: Optional[torch.Tensor],
                       sf_layout: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = Nvfp4Problem(dtype_name(x.dtype), x.shape[1], sf_layout, global_scale is not None, x.shape[0],
                           x.device.type)
    return OP_NVFP4.dispatch(problem, Target.of(x.device), x=x, global_scale=global_scale)


@_quantize_nvfp4_op.register_fake
def _(x, global_scale, sf_layout):
    M, K = x.shape
    sshape = (M, K // 16) if sf_layout == "linear" else _swizzled_shape(M, K)
    return (x.new_empty((M, K // 2), dtype=torch.uint8), x.new_empty(sshape, dtype=torch.float8_e4m3fn),
            x.new_empty((2,), dtype=torch.float32))


@custom_op("dsv4::quantize_mxfp4", mutates_args=())
def _quantize_mxfp4_op(x: torch.Tensor, rule: str) -> Tuple[torch.Tensor, torch.Tensor]:
    problem = Mxfp4Problem(dtype_name(x.dtype), x.shape[1], rule, x.shape[0], x.device.type)
    return OP_MXFP4.dispatch(problem, Target.of(x.device), x=x)


@_quantize_mxfp4_op.register_fake
def _(x, rule):
    M, K = x.shape
    return x.new_empty((M, K // 2), dtype=torch.uint8), x.new_empty((M, K // 32), dtype=torch.float8_e8m0fnu)


@custom_op("dsv4::quantize_fp8_block", mutates_args=())
def _quantize_fp8_block_op(x: torch.Tensor, block: int, scale_fmt: str,
                           scale_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    problem = Fp8Problem(dtype_name(x.dtype), x.shape[1], block, scale_fmt, dtype_name(scale_dtype), x.shape[0],
                         x.device.type)
    return OP_FP8.dispatch(problem, Target.of(x.device), x=x)


@_quantize_fp8_block_op.register_fake
def _(x, block, scale_fmt, scale_dtype):
    M, K = x.shape
    return x.new_empty((M, K), dtype=torch.float8_e4m3fn), x.new_empty((M, K // block), dtype=scale_dtype)


@custom_op("dsv4::dequantize_fp8_block", mutates_args=())
def _dequantize_fp8_block_op(q: torch.Tensor, scale: torch.Tensor, block: int,
                             out_dtype: torch.dtype) -> torch.Tensor:
    problem = DequantFp8Problem(q.shape[1], block, dtype_name(scale.dtype), dtype_name(out_dtype), q.shape[0],
                                q.device.type)
    return OP_DQ.dispatch(problem, Target.of(q.device), q=q, scale=scale)


@_dequantize_fp8_block_op.register_fake
def _(q, scale, block, out_dtype):
    return q.new_empty(q.shape, dtype=out_dtype)


# ------------------------------------------------------------------------------ public API
def _flatten_rows(name: str, x: torch.Tensor, opname: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise LayoutError(f"{opname}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise LayoutError(f"{opname}: argument '{name}' must be at least 1-D [..., K], got a 0-D tensor")
    if x.dim() == 2:
        return x
    if not x.is_contiguous():
        raise LayoutError(f"{opname}: argument '{name}' must be contiguous row-major, got strides {list(x.stride())} "
                          f"for shape {list(x.shape)} (call .contiguous())")
    return x.reshape(-1, x.shape[-1])


@planned
def quantize_nvfp4(x: torch.Tensor, *, global_scale: Optional[torch.Tensor] = None,
                   sf_layout: str = "linear") -> NVFP4Tensor:
    """Quantize ``x [M, K]`` to NVFP4 (E2M1 + E4M3 per 16 along K + FP32 global scale).

    Args:
        x: bfloat16 / float16 (cuda provider) or float32 (torch provider) ``[M, K]``,
            contiguous, ``K % 16 == 0``, ``M >= 1``.
        global_scale: ``None`` (default): the global scale is computed on the device from the
            amax of ``x`` (no host sync; ``g_enc = min(2688 / amax, FLT_MAX)``, 1.0 for an
            all-zero tensor, NaN when ``x`` holds a NaN / Inf). Or a float32 ``[1]`` / 0-dim tensor holding the DECODE
            multiplier ``g_dec`` (e.g. a checkpoint's ``weight_scale_2``); the caller
            guarantees it is finite and > 0 (the cuda provider does not check on the device).
        sf_layout: ``"linear"`` (scale ``[M, K/16]``) or ``"swizzled"`` (128x4 layout
            ``[cdiv(M,128), cdiv(K/16,4), 32, 4, 4]``, zero padding).

    Returns:
        :class:`dsv4.formats.NVFP4Tensor` with ``data`` uint8 ``[M, K/2]`` (element 2i in the
        low nibble), ``scale`` float8_e4m3fn, ``global_scale`` 0-dim fp32 decode multiplier and
        ``global_encode_scale`` 0-dim fp32 encode multiplier (both device tensors).
        ``x ~= e2m1 * scale * global_scale``.

    Raises:
        ValueError: unknown ``sf_layout``.
        LayoutError: ``x`` / ``global_scale`` do not match ``docs/layouts/quantize_nvfp4.md``.

    NaN / Inf (OCP MX v1.0 6.3, tested by value): a 16-block holding a NaN or +-Inf gets the
    NaN block scale (E4M3 0x7F) and zero codes, so it decodes to NaN; with a computed global
    scale such a tensor gets ``global_scale = NaN`` and every block the NaN scale.

    Formula: :mod:`dsv4.formats.nvfp4` (bit-exact). Source: TransformerEngine
    NVFP4 reference quantizer; NVIDIA NVFP4 checkpoints (dsv4_spec.md 2.7).
    """
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"quantize_nvfp4: sf_layout must be one of {SF_LAYOUTS}, got {sf_layout!r}")
    if isinstance(global_scale, torch.Tensor) and global_scale.dim() == 0:
        global_scale = global_scale.reshape(1)
    SPEC_NVFP4.validate({"x": x, "global_scale": global_scale})
    data, scale, gs = _quantize_nvfp4_op(x, global_scale, sf_layout)
    M, K = x.shape
    return NVFP4Tensor(data=data, scale=scale, global_scale=gs[0], shape=(int(M), int(K)), sf_layout=sf_layout,
                       global_encode_scale=gs[1])


@planned
def quantize_mxfp4(x: torch.Tensor, *, rule: str = "dsv4") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to MXFP4 (E2M1 + UE8M0 per 32 along K, no global scale).

    Args:
        x: bfloat16 / float16 (cuda provider) or float32 ``[..., K]``, contiguous, ``K % 32 == 0``.
        rule: ``"dsv4"`` (default, DSV4 kernel.py: ``s = 2^ceil(log2(max(amax, 6*2^-126) *
            fp32(1/6)))``) or ``"ocp"`` (OCP MX v1.0: ``s = 2^clamp(floor(log2(amax)) - 2)``).

    Returns:
        ``(data, scale)``: uint8 ``[..., K/2]`` (element 2i in the low nibble) and
        float8_e8m0fnu ``[..., K/32]``; ``x ~= e2m1 * 2^(scale_byte - 127)``. An empty input
        (``[0, K]``, any leading dim 0) gives empty outputs of these shapes (no launch work).

    Raises:
        ValueError: unknown ``rule``.
        LayoutError: ``x`` does not match ``docs/layouts/quantize_mxfp4.md``.

    NaN / Inf (OCP MX v1.0 6.3, tested by value): a 32-block holding a NaN or +-Inf gets the
    NaN scale (UE8M0 0xFF) and zero codes, so it decodes to NaN; other blocks are unaffected.

    Formula: :mod:`dsv4.formats.mxfp4` (bit-exact).
    """
    if rule not in MXFP4_RULES:
        raise ValueError(f"quantize_mxfp4: rule must be one of {MXFP4_RULES}, got {rule!r}")
    x2 = _flatten_rows("x", x, "quantize_mxfp4")
    SPEC_MXFP4.validate({"x": x2})
    data, scale = _quantize_mxfp4_op(x2, rule)
    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    # explicit sizes (never -1): an empty input [0, K] / [..., 0, K] has 0 elements and -1 is ambiguous
    return data.reshape(*lead, K // 2), scale.reshape(*lead, K // 32)


@planned
def quantize_fp8_block(x: torch.Tensor, *, block: int = 128, scale_fmt: str = "fp32",
                       scale_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to E4M3 with one scale per ``1 x block`` along K (DSV4 act_quant).

    Args:
        x: bfloat16 / float16 (cuda provider) or float32 ``[..., K]``, contiguous, ``K % block == 0``.
        block: 128 (DSV4 activations, default), 64 (KV nope part) or 32.
        scale_fmt: ``"fp32"`` (``s = max(amax, 1e-4) * fp32(1/448)``) or ``"ue8m0"`` (``s`` rounded
            up to a power of two, DSV4 ``fast_round_scale``).
        scale_dtype: ``torch.float32`` (default; the dequant multiplier) or, with
            ``scale_fmt="ue8m0"``, ``torch.float8_e8m0fnu`` (its UE8M0 byte, lossless).

    Returns:
        ``(q, scale)``: float8_e4m3fn ``[..., K]`` and ``scale_dtype`` ``[..., K/block]``;
        ``x ~= q * scale``. An empty input (``[0, K]``, any leading dim 0) gives empty outputs
        of these shapes.

    Raises:
        ValueError: bad ``block`` / ``scale_fmt`` / ``scale_dtype`` combination.
        LayoutError: ``x`` does not match ``docs/layouts/quantize_fp8_block.md``.

    Formula and NaN/Inf policy: :mod:`dsv4.formats.fp8` (bit-exact; the block amax counts finite
    elements only, NaN -> 0x7F, Inf -> +-448: E4M3 has a NaN, so NaN stays visible per element).
    """
    if block not in FP8_BLOCKS:
        raise ValueError(f"quantize_fp8_block: block must be one of {FP8_BLOCKS}, got {block!r}")
    if scale_fmt not in FP8_SCALE_FMTS:
        raise ValueError(f"quantize_fp8_block: scale_fmt must be one of {FP8_SCALE_FMTS}, got {scale_fmt!r}")
    if scale_dtype not in (torch.float32, torch.float8_e8m0fnu):
        raise ValueError(f"quantize_fp8_block: scale_dtype must be float32 or float8_e8m0fnu, got {scale_dtype}")
    if scale_dtype == torch.float8_e8m0fnu and scale_fmt != "ue8m0":
        raise ValueError("quantize_fp8_block: scale_dtype=float8_e8m0fnu needs scale_fmt='ue8m0' "
                         "(an fp32 scale amax/448 is not a power of two)")
    x2 = _flatten_rows("x", x, "quantize_fp8_block")
    SPEC_FP8.validate({"x": x2}, symbols={"block": block})
    q, scale = _quantize_fp8_block_op(x2, block, scale_fmt, scale_dtype)
    lead, K = tuple(x.shape[:-1]), x.shape[-1]
    # explicit sizes (never -1): an empty input [0, K] / [..., 0, K] has 0 elements and -1 is ambiguous
    return q.reshape(*lead, K), scale.reshape(*lead, K // block)


@planned
def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, *, block: int = 128,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """E4M3 block data back to real values: ``q * scale`` per block (fp32 math, one rounding).

    Args:
        q: float8_e4m3fn ``[..., K]``, contiguous, ``K % block == 0``.
        scale: float32 ``[..., K/block]`` multipliers, or float8_e8m0fnu (``2^(b-127)``).
        block: 128, 64 or 32.
        out_dtype: bfloat16 (default), float16 or float32.

    Returns:
        ``[..., K]`` tensor of ``out_dtype``.

    Raises:
        ValueError: bad ``block`` / ``out_dtype``.
        LayoutError: ``q`` / ``scale`` do not match ``docs/layouts/dequantize_fp8_block.md``.

    Source: :func:`dsv4.formats.dequantize_fp8_block` (bit-exact).
    """
    if block not in FP8_BLOCKS:
        raise ValueError(f"dequantize_fp8_block: block must be one of {FP8_BLOCKS}, got {block!r}")
    if out_dtype not in DQ_OUT_DTYPES:
        raise ValueError(f"dequantize_fp8_block: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    q2 = _flatten_rows("q", q, "dequantize_fp8_block")
    s2 = _flatten_rows("scale", scale, "dequantize_fp8_block")
    SPEC_DQ.validate({"q": q2, "scale": s2}, symbols={"block": block})
    out = _dequantize_fp8_block_op(q2, s2, block, out_dtype)
    return out.reshape(q.shape)


__all__ = ["quantize_nvfp4", "quantize_mxfp4", "quantize_fp8_block", "dequantize_fp8_block"]


# ------------------------------------------------------------------------------ graph cases
def graph_cases(device) -> list:
    """Graph-capture cases for the four ops (NVFP4: two-launch, single-CTA and given-scale paths)."""
    from .. import formats as F
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    M, K = (512, 7168) if cuda else (16, 256)
    x = torch.empty(M, K, dtype=torch.bfloat16, device=dev)
    xd = torch.empty(1, K, dtype=torch.bfloat16, device=dev)
    g = torch.empty(1, dtype=torch.float32, device=dev)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=dev)
    qs = torch.empty(M, K // 128, dtype=torch.float32, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(1234)

    def refresh():
        for t in (x, xd):
            v = torch.randn(t.shape, generator=gen) * (1 + 40 * (torch.rand(t.shape[1], generator=gen) < 0.02))
            t.copy_(v.to(torch.bfloat16))
        g.copy_(torch.rand(1, generator=gen) * 0.01 + 1e-3)
        a, b = F.quantize_fp8_block(torch.randn(M, K, generator=gen), 128, "fp32")
        q.copy_(a)
        qs.copy_(b)

    refresh()
    dt = dev.type

    def nv(layout, gs=False, src=x):
        return lambda: (lambda t: bytes_of(t.data, t.scale, t.global_scale.reshape(1)))(
            quantize_nvfp4(src, global_scale=g if gs else None, sf_layout=layout))

    nvp = lambda layout, gs, m=M: Nvfp4Problem("bfloat16", K, layout, gs, m, dt)  # noqa: E731
    return [
        GraphCase("quantize_nvfp4-swz-amax", "quantize_nvfp4", nv("swizzled"), refresh, nvp("swizzled", False)),
        GraphCase("quantize_nvfp4-lin-amax-1row", "quantize_nvfp4", nv("linear", src=xd), refresh,
                  nvp("linear", False, 1)),
        GraphCase("quantize_nvfp4-swz-given", "quantize_nvfp4", nv("swizzled", gs=True), refresh, nvp("swizzled", True)),
        GraphCase("quantize_mxfp4-dsv4", "quantize_mxfp4", lambda: bytes_of(*quantize_mxfp4(x)), refresh,
                  Mxfp4Problem("bfloat16", K, "dsv4", M, dt)),
        GraphCase("quantize_fp8_block-ue8m0", "quantize_fp8_block",
                  lambda: bytes_of(*quantize_fp8_block(x, scale_fmt="ue8m0", scale_dtype=torch.float8_e8m0fnu)), refresh,
                  Fp8Problem("bfloat16", K, 128, "ue8m0", "float8_e8m0fnu", M, dt)),
        GraphCase("dequantize_fp8_block-bf16", "dequantize_fp8_block",
                  lambda: dequantize_fp8_block(q, qs, block=128, out_dtype=torch.bfloat16), refresh,
                  DequantFp8Problem(K, 128, "float32", "bfloat16", M, dt)),
    ]
