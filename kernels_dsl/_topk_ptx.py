"""PTX building blocks of the selection-histogram epilogue (kernels_dsl/indexer_paged.py, ``hist=True``).

The histogram feeds ``topk_select_kernel`` (kernels_cuda/topk.cu), so its bucket function is
EXACTLY topk.cu's ``decode()``: an entry is selectable when its fp32 value is not NaN and not
-inf; -0.0 is canonicalized to +0.0; bucket = top 11 bits of the order-preserving code of the
value rounded to fp16 (``cvt.rn.f16.f32``: 32 bins per octave, monotone in the value).
Shared addresses are 32-bit shared-window addresses, global ones 64-bit generic addresses.
Memory operations carry side effects (never merged or moved across barriers).
"""
from __future__ import annotations

try:
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass.cutlass_dsl import T, dsl_user_op
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["NBINS", "bucket_f32", "red_shared_add_u32", "red_global_add_u32"]

NBINS = 2048

#: fp32 -> bucket (or 0xFFFFFFFF when not selectable); mirrors topk.cu decode()
_BUCKET_PTX = (
    "{\n"
    ".reg .pred p, q;\n"
    ".reg .b32 u, a, r, m;\n"
    ".reg .f32 f;\n"
    ".reg .b16 h;\n"
    "mov.b32 u, $1;\n"
    "and.b32 a, u, 0x7FFFFFFF;\n"
    "setp.gt.u32 p, a, 0x7F800000;\n"          # NaN
    "setp.eq.or.b32 p, u, 0xFF800000, p;\n"    # -inf
    "setp.eq.b32 q, u, 0x80000000;\n"          # -0.0 -> +0.0
    "selp.b32 u, 0, u, q;\n"
    "mov.b32 f, u;\n"
    "cvt.rn.f16.f32 h, f;\n"
    "cvt.u32.u16 r, h;\n"
    "bfe.s32 m, r, 15, 1;\n"                   # -1 if the fp16 sign is set
    "and.b32 m, m, 0x7FFF;\n"
    "or.b32 m, m, 0x8000;\n"                   # 0xFFFF (negative) or 0x8000 (positive)
    "xor.b32 r, r, m;\n"
    "shr.u32 r, r, 5;\n"
    "selp.b32 $0, 0xFFFFFFFF, r, p;\n"
    "}")


if _HAVE_DSL:
    from ._indexer_ptx import _asm as _asm_ordered
    from ._indexer_ptx import _ir as _v

    def _asm(ret, ptx, cons, args, side, loc, ip):
        return _asm_ordered(ret, args, ptx, cons, side, loc, ip)

    @dsl_user_op
    def bucket_f32(v, *, loc=None, ip=None):
        """Bucket 0..2047 of fp32 ``v`` (topk.cu ``decode``), or 0xFFFFFFFF if ``v`` is NaN or -inf."""
        return Uint32(_asm(T.i32(), _BUCKET_PTX, "=r,f", [_v(v, Float32, loc, ip)], False, loc, ip))

    @dsl_user_op
    def red_shared_add_u32(addr, v, *, loc=None, ip=None):
        """``red.shared.add.u32 [addr], v`` (addr: 32-bit shared address)."""
        _asm(None, "red.shared.add.u32 [$0], $1;", "r,r", [_v(addr, Int32, loc, ip), _v(v, Uint32, loc, ip)],
             True, loc, ip)

    @dsl_user_op
    def red_global_add_u32(addr, v, *, loc=None, ip=None):
        """``red.global.add.u32 [addr], v`` (addr: 64-bit global address)."""
        _asm(None, "red.global.add.u32 [$0], $1;", "l,r", [_v(addr, Int64, loc, ip), _v(v, Uint32, loc, ip)],
             True, loc, ip)
