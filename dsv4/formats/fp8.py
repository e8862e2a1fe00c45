"""FP8 (E4M3) block quantization along K, the DSV4 ``act_quant`` recipe.

Source: DSV4 ``kernel.py`` ``act_quant_kernel`` (dsv4_spec.md 2.1), per row and per block of
``block`` consecutive elements along the last dim::

    amax = max(max|x_blk|, 1e-4)
    s    = amax * fp32(1/448)                          scale_fmt="fp32"
    s    = fast_round_scale(amax, 1/448)               scale_fmt="ue8m0"
         = 2^ceil(log2(amax * fp32(1/448)))            (ue8m0_ceil; power of two)
    q    = e4m3(clamp(x / s, -448, 448))               (round to nearest even)

The reference multiplies by the fp32 constant ``1/448`` (``fp8_max_inv``) and divides ``x``
by ``s``; this module does the same so that codes match bit for bit.  The scale is
returned as float32 in both modes (for ``"ue8m0"`` it is an exact power of two; encode it
losslessly with :func:`dsv4.formats.ue8m0_encode_pow2` if a UE8M0 tensor is needed).

Non-finite inputs (library choice, documented and tested): the block amax counts finite
elements only; then ``clamp`` maps +-Inf to +-448 and NaN stays NaN, always the canonical E4M3 NaN byte 0x7F.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._checks import require_dtype, require_float_input, require_min_ndim, require_out_dtype, \
    require_positive_int
from .mxfp4 import finite_absmax
from .scales import E4M3_MAX, ue8m0_ceil, ue8m0_decode

__all__ = ["FP8_AMAX_FLOOR", "quantize_fp8_block", "dequantize_fp8_block"]

#: DSV4 act_quant amax floor.
FP8_AMAX_FLOOR = 1e-4
_INV448_F32 = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()


def quantize_fp8_block(x: torch.Tensor, block: int = 128,
                       scale_fmt: str = "fp32") -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``x [..., K]`` to E4M3 with one fp32 scale per ``block`` elements along K.

    Args:
        x: float32 / bfloat16 / float16 tensor ``[..., K]``, at least 1-D, ``K % block == 0``.
        block: block length along K (128 for DSV4 activations; 64 for the KV cache nope part;
            32 also supported; any positive int dividing K is accepted).
        scale_fmt: ``"fp32"`` (``s = amax/448``) or ``"ue8m0"`` (``s`` rounded up to a power
            of two).  Formulas in the module docstring.

    Returns:
        ``(q, scale)``: ``q`` ``torch.float8_e4m3fn [..., K]``; ``scale`` ``torch.float32
        [..., K/block]`` (the dequant multiplier: ``x ~= q * scale``).

    Raises:
        TypeError: bad dtype / ``block`` type.
        ValueError: 0-D ``x``, ``K % block != 0``, bad ``block``, unknown ``scale_fmt``.
    """
    require_float_input("x", x, "[..., K] values to quantize")
    require_min_ndim("x", x, 1, "[..., K]")
    require_positive_int("block", block)
    if scale_fmt not in ("fp32", "ue8m0"):
        raise ValueError(f"scale_fmt: expected 'fp32' or 'ue8m0', got {scale_fmt!r}")
    K = x.shape[-1]
    if K % block:
        raise ValueError(f"x: expected [..., K] with K % block == 0 (block={block}), got {tuple(x.shape)}")
    blk = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = finite_absmax(blk, dim=-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    if scale_fmt == "ue8m0":
        s = ue8m0_decode(ue8m0_ceil(amax * _INV448_F32))
    else:
        s = amax * _INV448_F32
    q = (blk / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    # canonical NaN 0x7F whatever the input NaN's sign (the sign of a NaN produced by a
    # division differs between CPU and GPU; the kernels always write 0x7F)
    qb = q.view(torch.uint8)
    q = torch.where(torch.isnan(blk), torch.full_like(qb, 0x7F), qb).view(torch.float8_e4m3fn)
    return q.reshape(x.shape), s.squeeze(-1)


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int = 128,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 block data back to real values: ``q * scale`` per block, fp32 math, one rounding.

    Args:
        q: ``torch.float8_e4m3fn [..., K]`` (reinterpret raw bytes with
            ``.view(torch.float8_e4m3fn)``, never ``.to``).
        scale: ``torch.float32 [..., K/block]``.
        block: block length along K used at quantization.
        out_dtype: float32 (default), bfloat16 or float16.

    Returns:
        ``[..., K]`` tensor of ``out_dtype``.

    Raises:
        TypeError: wrong dtypes.
        ValueError: shapes inconsistent with ``block``.
    """
    require_dtype("q", q, (torch.float8_e4m3fn,), "[..., K] E4M3 values")
    require_dtype("scale", scale, (torch.float32,), "[..., K/block] fp32 dequant multipliers")
    require_positive_int("block", block)
    require_out_dtype("out_dtype", out_dtype)
    require_min_ndim("q", q, 1, "[..., K]")
    K = q.shape[-1]
    if K % block or tuple(scale.shape) != (*q.shape[:-1], K // block):
        raise ValueError(f"scale: expected shape [..., K/block] = {(*q.shape[:-1], K // block) if K % block == 0 else '?'}"
                         f" for q {tuple(q.shape)} and block={block} (K must be a multiple of block), "
                         f"got {tuple(scale.shape)}")
    vals = q.float().reshape(*q.shape[:-1], K // block, block)
    return (vals * scale.unsqueeze(-1)).reshape(q.shape).to(out_dtype)
