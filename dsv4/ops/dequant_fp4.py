"""FP4 (E2M1) block dequantization: packed E2M1 + block scales -> bf16 / fp32.

The first op of the library; it exercises every path (dsl, cuda, torch providers, layout
spec, torch.library custom op, CUDA graph capture).
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


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor) or t.device.type == "meta"

FORMATS = {"mxfp4": 32, "nvfp4": 16}
_SCALE_DTYPE = {"mxfp4": torch.float8_e8m0fnu, "nvfp4": torch.float8_e4m3fn}
OUT_DTYPES = (torch.bfloat16, torch.float32)

SPEC = OpSpec(
    name="dequant_fp4",
    summary="Block-scaled FP4 (E2M1) -> bf16/fp32 dequantization, MXFP4 (UE8M0 per 32) or NVFP4 (E4M3 per 16 + FP32 global).",
    inputs=(
        TensorSpec("data", torch.uint8, ("M", "Kp"), packing="2 x E2M1 per byte, element 2i in the low nibble; "
                   "nibble bit 3 = sign, bits 2:0 index [0, 0.5, 1, 1.5, 2, 3, 4, 6]",
                   doc="packed FP4 values, K = 2*Kp along the last dim"),
        TensorSpec("scale", (torch.float8_e8m0fnu, torch.float8_e4m3fn), ("M", "2 * Kp // SF"), align=2,
                   scale="mxfp4: UE8M0 (float8_e8m0fnu), one per 32 along K, linear [M, K/32]; "
                         "nvfp4: E4M3 (float8_e4m3fn), one per 16 along K, linear [M, K/16]",
                   doc="block scale factors"),
        TensorSpec("global_scale", torch.float32, (1,), align=4, optional=True,
                   doc="nvfp4 only: per-tensor FP32 decode multiplier (amax / (448*6) by the usual convention)"),
    ),
    outputs=(TensorSpec("out", OUT_DTYPES, ("M", "2 * Kp"), doc="dequantized values"),),
    params=(Param("fmt", "str", "{'mxfp4', 'nvfp4'}", "scale format; sets SF = 32 or 16"),
            Param("out_dtype", "torch.dtype", "{bfloat16, float32}", "output dtype")),
    constraints=(("(2 * Kp) % SF == 0", "K must be a multiple of the scale block SF"),),
    formula="mxfp4: out = e2m1(code) * 2^(sf-127); nvfp4: out = (e2m1(code) * e4m3(sf)) * global_scale; "
            "computed in fp32, rounded once to out_dtype",
    source="OCP MX v1.0 (MXFP4); NVIDIA NVFP4 (E4M3 per 16 + FP32 per-tensor); DSV4 FP4_TABLE "
           "(inference/convert.py), dsv4_spec.md 2.1/2.7",
)


@dataclass(frozen=True)
class DequantFp4Problem(Problem):
    """What selects the ``dequant_fp4`` provider (frozen: the registry's cache key)."""

    fmt: str            # "mxfp4" | "nvfp4"
    out_dtype: str      # "bfloat16" | "float32"
    K: int              # values per row (2 x packed bytes)
    device: str


def _example(target: Target) -> DequantFp4Problem:
    return DequantFp4Problem("mxfp4", "bfloat16", 7168, target.device_type)


OP = register(Op("dequant_fp4", SPEC, example_problem=_example))


@custom_op("dsv4::dequant_fp4", mutates_args=())
def _dequant_fp4_op(data: torch.Tensor, scale: torch.Tensor, global_scale: Optional[torch.Tensor],
                    fmt: str, out_dtype: torch.dtype) -> torch.Tensor:
    problem = DequantFp4Problem(fmt, dtype_name(out_dtype), 2 * data.shape[1], data.device.type)
    return OP.dispatch(problem, Target.of(data.device), data=data, scale=scale, global_scale=global_scale)


@_dequant_fp4_op.register_fake
def _(data, scale, global_scale, fmt, out_dtype):
    return data.new_empty((data.shape[0], 2 * data.shape[1]), dtype=out_dtype)


@planned
def dequant_fp4(data: torch.Tensor, scale: torch.Tensor, *, fmt: str = "mxfp4",
                global_scale: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize block-scaled FP4.

    Args:
        data: uint8 ``[M, K/2]``, 2 x E2M1 per byte, element 2i in the low nibble.
        scale: ``fmt="mxfp4"``: float8_e8m0fnu ``[M, K/32]``; ``fmt="nvfp4"``: float8_e4m3fn
            ``[M, K/16]`` (linear layout; swizzled scales must be unswizzled first with
            :func:`dsv4.formats.unswizzle_sf_128x4`).
        fmt: ``"mxfp4"`` or ``"nvfp4"``.
        global_scale: nvfp4 only, float32 ``[1]`` decode multiplier (required for nvfp4):
            finite and > 0, or NaN. NaN is the encoding of a tensor whose global amax was not
            finite (``quantize_nvfp4``, OCP MX rule): the whole tensor decodes to NaN. A CPU
            tensor is checked on the host (free): +-Inf, 0 or a negative value raise
            ``ValueError``. A CUDA tensor is not checked (that would cost a host sync), nor is any
            tensor inside ``torch.compile`` (a data-dependent branch); there the formula is applied
            as written (IEEE: NaN / Inf propagate, 0 gives +-0).
        out_dtype: ``torch.bfloat16`` or ``torch.float32``.

    Returns:
        ``[M, K]`` tensor of ``out_dtype``: mxfp4 ``e2m1 * 2^(sf-127)``; nvfp4
        ``(e2m1 * e4m3(sf)) * global_scale``; fp32 math, one rounding to ``out_dtype``. NaN
        scales decode their whole block to NaN (UE8M0 0xFF; E4M3 0x7F / 0xFF; a NaN
        ``global_scale``: every element), on every provider alike (NaN payloads may differ).

    Raises:
        TypeError: ``out_dtype`` is not a ``torch.dtype`` (e.g. the string ``"bfloat16"``).
        ValueError: unknown ``fmt`` / ``out_dtype``; a CPU ``global_scale`` that is +-Inf or <= 0.
        LayoutError: an argument does not match ``docs/layouts/dequant_fp4.md`` (dtype, shape,
            contiguity, alignment), or ``global_scale`` is missing/present for the format.

    Source: OCP MX spec v1.0; NVIDIA NVFP4; DSV4 ``convert.py`` FP4_TABLE (dsv4_spec.md 2.1).
    """
    if fmt not in FORMATS:
        raise ValueError(f"dequant_fp4: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"dequant_fp4: argument 'out_dtype' must be a torch.dtype (torch.bfloat16 or torch.float32), "
                        f"got {type(out_dtype).__name__} {out_dtype!r}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"dequant_fp4: argument 'out_dtype' must be torch.bfloat16 or torch.float32, got {out_dtype}")
    SPEC.validate({"data": data, "scale": scale, "global_scale": global_scale}, symbols={"SF": FORMATS[fmt]})
    if scale.dtype != _SCALE_DTYPE[fmt]:
        raise LayoutError(f"dequant_fp4: argument 'scale' has dtype {dtype_name(scale.dtype)}, expected "
                          f"{dtype_name(_SCALE_DTYPE[fmt])} for fmt={fmt!r}")
    if fmt == "nvfp4" and global_scale is None:
        raise LayoutError("dequant_fp4: argument 'global_scale' (float32 [1]) is required for fmt='nvfp4'")
    if fmt == "mxfp4" and global_scale is not None:
        raise LayoutError("dequant_fp4: argument 'global_scale' must be None for fmt='mxfp4' (MXFP4 has no global scale)")
    if (global_scale is not None and global_scale.device.type == "cpu" and not torch.compiler.is_compiling()
            and not _is_fake(global_scale)):
        g = float(global_scale[0])          # a host read of a host tensor: free
        if g == g and not (0.0 < g < float("inf")):
            raise ValueError(f"dequant_fp4: argument 'global_scale' must be finite and > 0 (or NaN, the encoding of a "
                             f"non-finite tensor), got {g}")
    return _dequant_fp4_op(data, scale, global_scale, fmt, out_dtype)


__all__ = ["dequant_fp4"]
