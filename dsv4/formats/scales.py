"""Scale-factor formats: E4M3 (NVFP4 block scales, FP8 data) and UE8M0 (MX / DSV4 scales).

Byte conventions (seed 003): a scale tensor is *always* a float8 tensor
(``torch.float8_e4m3fn`` or ``torch.float8_e8m0fnu``).  To go between those and raw bytes
use ``.view(dtype)`` (reinterpret the bits) -- never ``.to(dtype)``, which converts the
*value*: ``torch.tensor([0x3F], dtype=torch.uint8).to(torch.float8_e4m3fn)`` is 64.0 (the
E4M3 value nearest to 63) while ``.view(torch.float8_e4m3fn)`` is the E4M3 whose bit
pattern is 0x3F = 2^0 * 1.875.  The helpers here (:func:`e4m3_bytes`,
:func:`e4m3_from_bytes`, :func:`ue8m0_bytes`, :func:`ue8m0_from_bytes`) do exactly that.

E4M3 ("fn", OCP 8-bit FP v1.0 / OCP MX v1.0 5.3.1): 1 sign, 4 exponent (bias 7), 3 mantissa
bits; max finite 448; no Inf; S.1111.111 is NaN; subnormals 2^-6 * m/8.

UE8M0 (OCP MX v1.0 5.4.1 "E8M0"): unsigned 8-bit exponent, byte ``b`` means ``2^(b-127)``
for ``b`` in 0..254 (so b=0 is 2^-127, an fp32 *subnormal*), and 0xFF is NaN.  There is no
zero.  Because fp32 also has bias 127, byte ``b`` in 1..254 is exactly the fp32 exponent
field of ``2^(b-127)``; that is what every function here works on (bit manipulation, as in
DSV4 ``kernel.py`` ``fast_log2_ceil`` / ``fast_pow2``).
"""
from __future__ import annotations

import torch

from ._checks import require_dtype, require_float_input

__all__ = [
    "E4M3_MAX",
    "UE8M0_NAN_BYTE",
    "e4m3_bytes",
    "e4m3_from_bytes",
    "e4m3_encode",
    "ue8m0_bytes",
    "ue8m0_from_bytes",
    "ue8m0_decode",
    "ue8m0_encode_pow2",
    "ue8m0_ceil",
    "ue8m0_floor",
]

#: Largest finite float8_e4m3fn magnitude.
E4M3_MAX = 448.0
#: The UE8M0 NaN encoding.
UE8M0_NAN_BYTE = 0xFF

_FP32_MANT_MASK = 0x7FFFFF
_FP32_2POW_M127_BITS = 0x00400000  # 2^-127 as an fp32 (subnormal) bit pattern
_FP32_QNAN_BITS = 0x7FC00000


def _view_as(name: str, t: torch.Tensor, want: torch.dtype, to: torch.dtype, layout: str) -> torch.Tensor:
    """``t.view(to)`` (bit reinterpretation) after checking that ``t`` is ``want``."""
    require_dtype(name, t, (want,), layout)
    return t.view(to)


# --------------------------------------------------------------------------- E4M3

def e4m3_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of an E4M3 tensor: ``t.view(torch.uint8)`` (bit reinterpretation, seed 003).

    Args:
        t: ``torch.float8_e4m3fn`` tensor, any shape.

    Returns:
        ``torch.uint8`` tensor of the same shape sharing storage with ``t``.

    Raises:
        TypeError: ``t`` is not ``float8_e4m3fn``.
    """
    return _view_as("t", t, torch.float8_e4m3fn, torch.uint8, "E4M3 scales/values")


def e4m3_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Reinterpret raw bytes as E4M3: ``b.view(torch.float8_e4m3fn)`` (never ``.to``; seed 003).

    Args:
        b: ``torch.uint8`` tensor, any shape.

    Returns:
        ``torch.float8_e4m3fn`` view of the same storage (0x3F -> 1.875, not 63).

    Raises:
        TypeError: ``b`` is not ``uint8``.
    """
    return _view_as("b", b, torch.uint8, torch.float8_e4m3fn, "raw E4M3 bytes")


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """Round real values to E4M3 with saturation (the CUDA ``__nv_cvt_float_to_fp8(...,
    __NV_SATFINITE, __NV_E4M3)`` / PTX ``cvt.rn.satfinite.e4m3x2`` behaviour).

    ``x`` is clamped to ``[-448, 448]`` and then rounded to nearest-even E4M3 (subnormals
    included).  +-Inf -> +-448.  NaN stays NaN.  Identical to
    ``ml_dtypes.float8_e4m3fn(clip(x, -448, 448))`` (tested on every bf16/fp16 value).

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.

    Returns:
        ``torch.float8_e4m3fn`` tensor of ``x.shape``.

    Raises:
        TypeError: wrong dtype.
    """
    require_float_input("x", x, "real values to round to E4M3")
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


# --------------------------------------------------------------------------- UE8M0

def ue8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a UE8M0 tensor: ``t.view(torch.uint8)``.

    Raises:
        TypeError: ``t`` is not ``float8_e8m0fnu``.
    """
    return _view_as("t", t, torch.float8_e8m0fnu, torch.uint8, "UE8M0 scales")


def ue8m0_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Reinterpret raw bytes as UE8M0: ``b.view(torch.float8_e8m0fnu)`` (byte b = 2^(b-127)).

    Raises:
        TypeError: ``b`` is not ``uint8``.
    """
    return _view_as("b", b, torch.uint8, torch.float8_e8m0fnu, "raw UE8M0 bytes (byte b means 2^(b-127))")


def ue8m0_decode(t: torch.Tensor) -> torch.Tensor:
    """Exact UE8M0 -> float32 by bit manipulation.

    byte ``b`` in 1..254 -> fp32 with exponent field ``b`` and zero mantissa (= 2^(b-127));
    ``b == 0`` -> 2^-127 (fp32 subnormal 0x00400000, exact); ``b == 0xFF`` -> NaN.
    Source: OCP MX v1.0 5.4.1; DSV4 ``kernel.py`` ``fast_pow2`` (``(k + 127) << 23``).

    Args:
        t: ``torch.float8_e8m0fnu`` tensor, any shape.

    Returns:
        float32 tensor of the same shape.

    Raises:
        TypeError: ``t`` is not ``float8_e8m0fnu`` (a ``uint8`` tensor must be reinterpreted
            with :func:`ue8m0_from_bytes` first, so the byte meaning is explicit).
    """
    require_dtype("t", t, (torch.float8_e8m0fnu,), "UE8M0 scales; reinterpret raw bytes with "
                  ".view(torch.float8_e8m0fnu)")
    b = t.view(torch.uint8).to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, _FP32_2POW_M127_BITS), bits)
    bits = torch.where(b == 0xFF, torch.full_like(bits, _FP32_QNAN_BITS), bits)
    return bits.view(torch.float32)


def _fp32_fields(x: torch.Tensor):
    xf = x.float().contiguous()
    bits = xf.view(torch.int32)
    neg = bits < 0
    e = (bits >> 23) & 0xFF
    m = bits & _FP32_MANT_MASK
    return xf, neg, e, m


def _to_e8m0(byte_i32: torch.Tensor) -> torch.Tensor:
    return byte_i32.to(torch.uint8).view(torch.float8_e8m0fnu)


def ue8m0_encode_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Encode float scales that are exact powers of two as UE8M0 (lossless).

    Args:
        scale: float32 / bfloat16 / float16 tensor whose every element is either NaN or an
            exact power of two in ``[2^-127, 2^127]``.

    Returns:
        ``torch.float8_e8m0fnu`` tensor of the same shape; ``2^k -> byte k+127``,
        NaN -> 0xFF.

    Raises:
        TypeError: wrong dtype.
        ValueError: some element is not NaN and not an exact power of two in range
            (zero, negative, Inf, 3.0, 2^-128 ...).  Use :func:`ue8m0_ceil` /
            :func:`ue8m0_floor` to round arbitrary values.
    """
    require_float_input("scale", scale, "power-of-two scales 2^k, k in [-127, 127]")
    xf, neg, e, m = _fp32_fields(scale)
    normal_pow2 = (~neg) & (e >= 1) & (e <= 254) & (m == 0)
    tiny = xf.view(torch.int32) == _FP32_2POW_M127_BITS
    nan = torch.isnan(xf)
    ok = normal_pow2 | tiny | nan
    if not bool(ok.all()):
        bad = xf[~ok]
        raise ValueError(f"scale: expected exact powers of two in [2^-127, 2^127] (or NaN); "
                         f"{bad.numel()} element(s) are not, e.g. {float(bad[0])!r}")
    byte = torch.where(nan, torch.full_like(e, 0xFF), torch.where(tiny, torch.zeros_like(e), e))
    return _to_e8m0(byte)


def ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """Smallest UE8M0 power of two ``>= x``.

    For normal fp32 ``x > 0`` this is exactly DSV4 ``kernel.py`` ``fast_round_scale``:
    ``fast_pow2(fast_log2_ceil(x))`` where ``fast_log2_ceil = exp_field - 127 +
    (mantissa != 0)``, i.e. UE8M0 byte ``= exp_field + (mantissa != 0)``.
    Outside that range (never reached by the DSV4 quantizers, whose amax floors keep the
    argument normal) the result is the true ceiling clamped to the format:

    * ``x <= 2^-127`` (including 0, subnormals, negatives, -Inf) -> 2^-127 (byte 0);
      ``2^-127 < x < 2^-126`` -> 2^-126 (the bit trick would give 2^-126 for every
      subnormal);
    * ``x > 2^127`` (not representable), +Inf and NaN -> NaN (0xFF), as ml_dtypes does for
      overflow.

    Args:
        x: float32 / bfloat16 / float16 tensor (widened to fp32 exactly), any shape.

    Returns:
        ``torch.float8_e8m0fnu`` tensor of ``x.shape``.

    Raises:
        TypeError: wrong dtype.
    """
    require_float_input("x", x, "values to round up to a power of two")
    xf, neg, e, m = _fp32_fields(x)
    byte = e + (m != 0).to(e.dtype)                       # normal: exponent field, +1 if not pow2
    sub = (e == 0).to(e.dtype) * (m > _FP32_2POW_M127_BITS).to(e.dtype)  # zero / subnormal
    byte = torch.where(e == 0, sub, byte)
    byte = torch.where(e == 255, torch.full_like(byte, 0xFF), byte)    # +-Inf / NaN
    byte = torch.where(neg & ~torch.isnan(xf), torch.zeros_like(byte), byte)
    return _to_e8m0(byte)


def ue8m0_floor(x: torch.Tensor) -> torch.Tensor:
    """Largest UE8M0 power of two ``<= x`` (byte = fp32 exponent field for normal ``x``).

    * ``x < 2^-127`` (including 0, negatives, -Inf) clamps to 2^-127 (byte 0);
    * ``2^-127 <= x < 2^-126`` -> 2^-127;
    * +Inf and NaN -> NaN (0xFF).  Every finite ``x >= 2^-127`` is exact.

    Args:
        x: float32 / bfloat16 / float16 tensor, any shape.

    Returns:
        ``torch.float8_e8m0fnu`` tensor of ``x.shape``.

    Raises:
        TypeError: wrong dtype.
    """
    require_float_input("x", x, "values to round down to a power of two")
    xf, neg, e, m = _fp32_fields(x)
    byte = torch.where(e == 0, torch.zeros_like(e), e)
    byte = torch.where(neg & ~torch.isnan(xf), torch.zeros_like(byte), byte)
    return _to_e8m0(byte)
