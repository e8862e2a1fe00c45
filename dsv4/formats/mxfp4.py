"""MXFP4: E2M1 elements, one UE8M0 (power-of-two) scale per 32 consecutive elements along K.

DSV4 uses this for routed-expert weights and the indexer (dsv4_spec.md 2.1 / 2.7:
"FP4 E2M1, 1x32 blocks along K, UE8M0, no global scale").

Two scale rules:

``rule="dsv4"`` (DSV4 ``kernel.py`` ``fp4_quant_kernel`` / ``fp4_act_quant``, dsv4_spec.md 2.1)::

    amax = max(max|x_blk|, 6 * 2^-126)
    s    = fast_round_scale(amax, 1/6) = 2^ceil(log2(amax * fp32(1/6)))   (= ue8m0_ceil)
    code = e2m1_rne(clamp(x / s, -6, 6))

  ``s >= amax/6`` so nothing is clipped; the floor keeps ``s >= 2^-126`` (UE8M0 byte >= 1).
  (``amax * fp32(1/6)`` is the reference's literal arithmetic; it gives the same exponent
  as ``amax / 6`` for every bf16/fp16 amax -- tested.)

``rule="ocp"`` (OCP MX v1.0 section 6.3, "Conversion from vector of scalar values")::

    shared_exp = floor(log2(amax)) - 2          (2 = emax of E2M1)
    shared_exp = clamp(shared_exp, -127, 127)   (UE8M0 range; amax == 0 -> -127)
    code       = e2m1_rne(clamp(x / 2^shared_exp, -6, 6))   (|x/s| in [4, 8): above 6 saturates)

Non-finite inputs (both rules; OCP MX v1.0 section 6.3, issue 19 item 13): a block whose amax
is NaN or Inf -- i.e. a block holding any NaN or +-Inf element -- gets the NaN scale (UE8M0
byte 0xFF) and all-zero codes, so the whole block decodes to NaN (:func:`dequantize_mxfp4`):
an overflow or NaN upstream stays visible instead of becoming silently finite.  Every other
block is unaffected (its amax, scale and codes are those of its own finite elements).

Outputs: ``data`` packed ``uint8 [..., K/2]`` (element 2i in the low nibble) and ``scale``
``float8_e8m0fnu [..., K/32]``.
"""
from __future__ import annotations

from typing import Tuple

import torch

from ._checks import require_dtype, require_float_input, require_min_ndim, require_out_dtype
from .e2m1 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from .scales import UE8M0_NAN_BYTE, ue8m0_ceil, ue8m0_decode

__all__ = ["MXFP4_BLOCK", "MXFP4_AMAX_FLOOR", "quantize_mxfp4", "dequantize_mxfp4", "finite_absmax"]

#: Elements per UE8M0 scale.
MXFP4_BLOCK = 32
#: DSV4 amax floor, 6 * 2^-126 (kernel.py ``fp4_quant_kernel``): keeps s >= 2^-126.
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
_INV6_F32 = torch.tensor(1.0 / 6.0, dtype=torch.float32).item()  # fp32(1/6) as the kernel uses


def finite_absmax(x: torch.Tensor, dim=-1, keepdim: bool = True) -> torch.Tensor:
    """``max |x|`` over ``dim`` counting only finite elements (NaN/Inf count as 0), in fp32.

    Used by every block quantizer in this package for its amax (see module docstrings).
    """
    xf = x.float()
    a = torch.where(torch.isfinite(xf), xf.abs(), torch.zeros_like(xf))
    return a.amax(dim=dim, keepdim=keepdim)


def _exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer tensor k in [-127, 127] (bit construction)."""
    k = k.to(torch.int32)
    bits = torch.where(k == -127, torch.full_like(k, 0x00400000), (k + 127) << 23)
    return bits.view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(a)) for finite fp32 a > 0 (subnormals included), as int32."""
    mant, ex = torch.frexp(a)           # a = mant * 2^ex, mant in [0.5, 1)
    return (ex - 1).to(torch.int32)


def quantize_mxfp4(x: torch.Tensor, rule: str = "dsv4") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` to MXFP4 (E2M1 + UE8M0 per 32 along the last dim).

    Args:
        x: float32 / bfloat16 / float16 tensor ``[..., K]``, ``K % 32 == 0``, at least 1-D.
        rule: ``"dsv4"`` (default; DSV4 kernel.py ceil rule with amax floor 6*2^-126) or
            ``"ocp"`` (OCP MX v1.0 floor rule).  Formulas in the module docstring.

    Returns:
        ``(data, scale)``: ``data`` ``torch.uint8 [..., K/2]`` packed E2M1 (element 2i in
        the low nibble); ``scale`` ``torch.float8_e8m0fnu [..., K/32]``.  A block holding a
        NaN or +-Inf gets scale 0xFF (NaN) and zero codes (module docstring).

    Raises:
        TypeError: ``x`` not a supported float tensor.
        ValueError: 0-D ``x``, ``K % 32 != 0``, unknown ``rule``.
    """
    require_float_input("x", x, "[..., K] values to quantize, K % 32 == 0")
    require_min_ndim("x", x, 1, "[..., K]")
    K = x.shape[-1]
    if K % MXFP4_BLOCK:
        raise ValueError(f"x: expected [..., K] with K % 32 == 0 (one UE8M0 scale per 32), got {tuple(x.shape)}")
    if rule not in ("dsv4", "ocp"):
        raise ValueError(f"rule: expected 'dsv4' or 'ocp', got {rule!r}")
    blk = x.float().reshape(*x.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    bad = (~torch.isfinite(blk)).any(dim=-1, keepdim=True)      # NaN / Inf block -> NaN scale (OCP MX 6.3)
    amax = finite_absmax(blk, dim=-1, keepdim=True)              # (bad blocks: overwritten below)
    if rule == "dsv4":
        amax = amax.clamp(min=MXFP4_AMAX_FLOOR)
        scale_e8 = ue8m0_ceil(amax * _INV6_F32)          # fast_round_scale(amax, 1/6)
        s = ue8m0_decode(scale_e8)
    else:
        pos = amax > 0
        e = _floor_log2(torch.where(pos, amax, torch.ones_like(amax))) - 2
        e = torch.where(pos, e, torch.full_like(e, -127)).clamp(-127, 127)
        s = _exp2_int(e)
        scale_e8 = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    codes = e2m1_encode((blk / s).clamp(-E2M1_MAX, E2M1_MAX))
    codes = torch.where(bad, torch.zeros_like(codes), codes)
    scale_b = torch.where(bad, torch.full_like(scale_e8.view(torch.uint8), UE8M0_NAN_BYTE), scale_e8.view(torch.uint8))
    data = pack_e2m1(codes.reshape(x.shape))
    return data, scale_b.view(torch.float8_e8m0fnu).squeeze(-1)


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 -> real values: ``e2m1(code) * 2^(scale_byte - 127)``.

    Computed in fp32 (the product of an E2M1 level and a power of two is exact unless it
    overflows fp32: level 6 with byte 254+ gives Inf), then rounded once to ``out_dtype``.
    A NaN scale (0xFF) makes its whole block NaN.

    Args:
        data: ``torch.uint8 [..., K/2]`` packed E2M1 (low nibble first).
        scale: ``torch.float8_e8m0fnu [..., K/32]`` (same leading dims as ``data``).
        out_dtype: float32 (default), bfloat16 or float16.

    Returns:
        ``[..., K]`` tensor of ``out_dtype``.

    Raises:
        TypeError: wrong dtypes (e.g. a ``uint8`` scale: reinterpret it with
            ``.view(torch.float8_e8m0fnu)``).
        ValueError: shapes do not match ``data [..., K/2]`` / ``scale [..., K/32]``.
    """
    require_dtype("data", data, (torch.uint8,), "[..., K/2] packed E2M1, low nibble first")
    require_dtype("scale", scale, (torch.float8_e8m0fnu,), "[..., K/32] UE8M0; reinterpret raw bytes "
                  "with .view(torch.float8_e8m0fnu)")
    require_out_dtype("out_dtype", out_dtype)
    require_min_ndim("data", data, 1, "[..., K/2]")
    K = data.shape[-1] * 2
    if K % MXFP4_BLOCK or tuple(scale.shape) != (*data.shape[:-1], K // MXFP4_BLOCK):
        raise ValueError(f"scale: expected shape [..., K/32] = {(*data.shape[:-1], K // MXFP4_BLOCK)} for data "
                         f"[..., K/2] = {tuple(data.shape)} (K={K}, must be a multiple of 32), "
                         f"got {tuple(scale.shape)}")
    vals = e2m1_decode(unpack_e2m1(data)).reshape(*data.shape[:-1], K // MXFP4_BLOCK, MXFP4_BLOCK)
    out = vals * ue8m0_decode(scale).unsqueeze(-1)
    return out.reshape(*data.shape[:-1], K).to(out_dtype)
