"""CuTe DSL building blocks of the Hopper sparse-attention kernels (own code).

fp8_ds_mla row decode (:func:`e4m3x4_to_bf16x4`, :func:`ue8m0_bf16_multipliers`)
    The 584 B/token cache holds 448 E4M3 nope values with one UE8M0 scale per 64. A value is
    decoded to BF16 with integer ops only (no cvt): a byte ``s eeee mmm`` is placed at bf16
    bit 15 (sign) and bits 10..4 (``eeee mmm`` into the low exponent / high mantissa bits):
    that bf16 is exactly ``e4m3 * 2^-120`` (the E4M3 bias 7 vs the BF16 bias 127; E4M3
    subnormals land on BF16 subnormals, so they stay exact too). Per 32-bit word of 4 bytes:
    2 ``prmt`` + 2 shifts + 2 ``lop3``-able mask/or pairs give two bf16 pairs. The scale
    ``2^(sf - 127)`` is then applied as two exact ``mul.rn.bf16x2`` by powers of two,
    ``m1 = 2^(min(sf, 134) - 7)`` and ``m2 = 2^(max(sf, 134) - 134)`` (one factor would overflow
    bf16 for ``sf > 134``): the result is ``e4m3 * 2^(sf - 127)`` rounded once (RN) to bf16,
    i.e. exactly the reference ``bf16(float(e4m3) * 2^(sf-127))`` for every scale byte
    ``0 <= sf <= 254``. Not propagated: the E4M3 NaN codes ``0x7F`` / ``0xFF`` decode as
    ``+-480 * 2^(sf-127)`` and scale byte ``0xFF`` (NaN) as ``2^128`` (``kv_cache_append``
    writes neither: it saturates to +-448 and its scales stay below ``0xFF``).

WGMMA accumulator views (:func:`acc_mn_layout`, :func:`acc_frg_a_layout`)
    An sm90 ``m64nN`` fp32 accumulator fragment has the per-thread layout
    ``((2, 2, N/8), MMA_M, MMA_N)``: mode 0 = (column pair, row half (+8), 8-column group).
    :func:`acc_mn_layout` regroups it as ``((2, MMA_M), (2, N/8, MMA_N))`` = (rows of this
    thread, columns of this thread) for row-wise softmax; :func:`acc_frg_a_layout` regroups
    a 16-bit copy of it as the register A operand of a ``k16`` WGMMA: ``((2, 2, 2), MMA_M,
    (N/16, MMA_N))`` (the C layout of columns ``[16 k, 16 k + 16)`` is the A layout of k-block
    ``k``).

Bit-exact Python models (``model_*``) are checked on every byte and every scale by
tests/test_sparse_attention.py; the GPU test decodes through the kernel itself.
"""
from __future__ import annotations

import math
import struct

__all__ = ["model_e4m3x4_to_bf16x4", "model_dequant_e4m3", "model_ue8m0_multipliers", "SEL_LO", "SEL_HI",
           "SIGN_MASK", "BODY_MASK"]

#: prmt selectors: bytes (b0, b1) / (b2, b3) of a word -> 16-bit lanes ``b << 8``
SEL_LO = 0x1404
SEL_HI = 0x3424
SIGN_MASK = 0x80008000
BODY_MASK = 0x07F007F0
#: largest scale byte that one bf16 power-of-two multiplier 2^(sf - 7) can carry
SF_SPLIT = 134


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0x7
        out |= ((pool >> (8 * s)) & 0xFF) << (8 * i)
    return out


def model_e4m3x4_to_bf16x4(w: int) -> tuple[int, int]:
    """Model of :func:`e4m3x4_to_bf16x4`: word of 4 E4M3 bytes -> (bf16 pair of bytes 0,1; of 2,3),
    each bf16 = ``e4m3 * 2^-120`` (bit placement, no rounding)."""
    out = []
    for sel in (SEL_LO, SEL_HI):
        x = _prmt(w, 0, sel)
        out.append((x & SIGN_MASK) | ((x >> 4) & BODY_MASK))
    return out[0], out[1]


def model_ue8m0_multipliers(sf: int) -> tuple[int, int]:
    """Model of :func:`ue8m0_bf16_multipliers`: the two bf16 bit patterns ``2^(min(sf,134)-7)``,
    ``2^(max(sf,134)-134)``."""
    e1 = min(sf, SF_SPLIT) + 120
    e2 = max(sf, SF_SPLIT) - 7
    return e1 << 7, e2 << 7


def _bf16_to_float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (b & 0xFFFF) << 16))[0]


def _rne_bf16(x: float) -> int:
    """bf16 bits of the round-to-nearest-even of a Python float (one rounding; subnormals, inf)."""
    if x != x:
        return 0x7FC0
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if a == 0.0:
        return sign
    _, e = math.frexp(a)                       # a = m 2^e, 0.5 <= m < 1
    quantum = math.ldexp(1.0, max(e - 1, -126) - 7)
    n = a / quantum                            # exact (power-of-two quantum)
    r = math.floor(n)
    if n - r > 0.5 or (n - r == 0.5 and r % 2):
        r += 1
    v = r * quantum
    if v >= 2.0 ** 128:
        return sign | 0x7F80
    return sign | (struct.unpack("<I", struct.pack("<f", v))[0] >> 16)


def model_dequant_e4m3(byte: int, sf: int) -> int:
    """bf16 bits of the kernel's decode of one E4M3 ``byte`` with UE8M0 scale byte ``sf``:
    bit placement, then two RN bf16 multiplies (Python float products of bf16 values are exact)."""
    lo, _ = model_e4m3x4_to_bf16x4(byte)
    m1, m2 = model_ue8m0_multipliers(sf)
    v = _rne_bf16(_bf16_to_float(lo & 0xFFFF) * _bf16_to_float(m1))
    return _rne_bf16(_bf16_to_float(v) * _bf16_to_float(m2))


try:  # the DSL is optional at import time
    import cutlass
    import cutlass.cute as cute
    from cutlass import Uint32
    from cutlass.cutlass_dsl import dsl_user_op

    from .fp4 import mul_bf16x2, prmt
    from .ptx import st_shared_v4
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False


if _HAVE_DSL:
    __all__ += ["e4m3x4_to_bf16x4", "ue8m0_bf16_multipliers", "dequant_e4m3x4", "acc_mn_layout",
                "acc_frg_a_layout", "make_acc_mn_view", "st_shared_v4", "sw128_offset"]

    def sw128_offset(row, col16):
        """Byte offset of 16-byte chunk ``col16`` (0..7) of row ``row`` inside a 128B-swizzled
        8-row x 128 B atom (``Swizzle<3,4,3>`` on byte addresses: chunk ^= row % 8)."""
        return (row % 8) * 128 + ((col16 ^ (row % 8)) << 4)

    @dsl_user_op
    def e4m3x4_to_bf16x4(w, *, loc=None, ip=None):
        """Word of 4 E4M3 bytes -> two bf16 pairs ``(bytes 0,1)``, ``(bytes 2,3)``, each value
        ``e4m3 * 2^-120`` (exact bit placement)."""
        w = Uint32(w)
        x0 = prmt(w, Uint32(0), Uint32(SEL_LO), loc=loc, ip=ip)
        x1 = prmt(w, Uint32(0), Uint32(SEL_HI), loc=loc, ip=ip)
        y0 = (x0 & Uint32(SIGN_MASK)) | ((x0 >> Uint32(4)) & Uint32(BODY_MASK))
        y1 = (x1 & Uint32(SIGN_MASK)) | ((x1 >> Uint32(4)) & Uint32(BODY_MASK))
        return y0, y1

    @dsl_user_op
    def ue8m0_bf16_multipliers(sf, *, loc=None, ip=None):
        """UE8M0 scale byte -> the two bf16-pair multipliers ``{2^(min(sf,134)-7)} x 2``,
        ``{2^(max(sf,134)-134)} x 2`` whose product with ``e4m3 * 2^-120`` is ``e4m3 * 2^(sf-127)``."""
        s = Uint32(sf) & Uint32(0xFF)
        e1 = cutlass.min(s, Uint32(SF_SPLIT)) + Uint32(120)
        e2 = cutlass.max(s, Uint32(SF_SPLIT)) - Uint32(7)
        return (e1 << Uint32(7)) | (e1 << Uint32(23)), (e2 << Uint32(7)) | (e2 << Uint32(23))

    @dsl_user_op
    def dequant_e4m3x4(w, m1, m2, *, loc=None, ip=None):
        """Word of 4 E4M3 bytes + multipliers -> two bf16 pairs ``e4m3 * 2^(sf-127)`` (RN, exact)."""
        y0, y1 = e4m3x4_to_bf16x4(w, loc=loc, ip=ip)
        y0 = mul_bf16x2(mul_bf16x2(y0, m1, loc=loc, ip=ip), m2, loc=loc, ip=ip)
        y1 = mul_bf16x2(mul_bf16x2(y1, m1, loc=loc, ip=ip), m2, loc=loc, ip=ip)
        return y0, y1

    def acc_mn_layout(acc_layout):
        """``((2, 2, V), M, N)`` accumulator layout -> ``((2, M), (2, V, N))`` (rows, columns)."""
        col = cute.make_layout(acc_layout.shape)
        shape = ((col.shape[0][1], col.shape[1]), (col.shape[0][0], col.shape[0][2], col.shape[2]))
        stride = ((col.stride[0][1], col.stride[1]), (col.stride[0][0], col.stride[0][2], col.stride[2]))
        return cute.composition(acc_layout, cute.make_layout(shape, stride=stride))

    def make_acc_mn_view(acc):
        """The (rows, columns) view of an accumulator (or of a tensor partitioned like one)."""
        return cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))

    def acc_frg_a_layout(acc_layout):
        """``((2, 2, V), M, N)`` (V even) -> ``((2, 2, 2), M, (V / 2, N))``: the accumulator of an
        ``m64nK`` MMA seen as the register A operand of ``m64nXk16`` MMAs over K."""
        l = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
        return cute.make_layout(
            ((l.shape[0][0], l.shape[0][1], l.shape[0][2][0]), l.shape[1], (l.shape[0][2][1], l.shape[2])),
            stride=((l.stride[0][0], l.stride[0][1], l.stride[0][2][0]), l.stride[1],
                    (l.stride[0][2][1], l.stride[2])))
