"""Epilogues of the FP4-weight grouped GEMM (CuTe DSL device functions, registers -> global).

Accumulator fragment of a WGMMA ``m64n128`` fp32 tile (checked against
``partition_C`` of the tiled MMA: ``((2,2,16),1,1):((1@1,8@0,8@1),0,0)``): value
``v = e + 2 r + 4 j`` of thread ``(warp w, lane l)`` holds row ``16 w + l // 4 + 8 r`` and column
``8 j + 2 (l % 4) + e``. A lane quad owns whole rows: per row and 128 columns it holds 32 values.

* :func:`promote`: W4A8 per-128-K promotion ``acc += part * a_scale[row]`` (fp32 FMA).
* :func:`epilogue_gemm1`: DSV4 clamped SwiGLU on the prepared W13 tile (half ``h`` of the
  256-row tile = gate rows ``0..63`` / up rows ``64..127`` of h columns ``128 nt + 64 h + i``;
  gate column ``8 j + 2c + e`` (j < 8) pairs with up column ``8 (j + 8) + 2c + e`` in the same
  thread), times the routing weight, bf16 rounding at the reference's points; FP8: DSV4
  ``act_quant(128, ue8m0)`` over the 128 h columns of the tile (quad shuffle amax), E4M3 pairs
  stored as 16-bit words, the fp32 scale by lane 0 of the quad.
* :func:`epilogue_gemm2`: ``y = acc * col_scale`` as fp32 pairs.
Column multipliers (per-row weight reference exponent x per-expert global) come from shared memory.
"""
from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from . import fp4
    from .ptx import (ld_global_nc_f32, ld_shared_v2, pack_bf16x2, st_global_b16, st_global_b32, st_global_b64,
                      st_global_f32)
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["promote", "epilogue_gemm1", "epilogue_gemm2", "bf16_round", "pack_bf16x2"]

_INV448 = 1.0 / 448.0
_LOG2E = 1.4426950408889634

if _HAVE_DSL:

    @dsl_user_op
    def bf16_round(x, *, loc=None, ip=None):
        """fp32 -> nearest bf16 (RNE) -> fp32."""
        return Float32(llvm.inline_asm(
            T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
            "{\n.reg .b16 t;\ncvt.rn.bf16.f32 t, $1;\nmov.b32 $0, {0, t};\n}", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @cute.jit
    def promote(acc: cute.Tensor, part: cute.Tensor, s0: Float32, s1: Float32):
        """``acc += part * s_row`` (rows r and r + 8 of the thread: scales s0, s1)."""
        for j in cutlass.range_constexpr(16):
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    v = 4 * j + 2 * r + e
                    acc[v] = part[v] * (s0 if r == 0 else s1) + acc[v]

    @cute.jit
    def _swiglu_half(acc: cute.Tensor, csu: Int32, h: cutlass.Constexpr[int], c: Int32, rw0: Float32, rw1: Float32,
                     am: cute.Tensor):
        """In place: the gate slots of ``acc`` (j < 8) become h values; running amax per row in ``am``."""
        for j in cutlass.range_constexpr(8):
            col = 128 * h + 8 * j + 2 * c
            g0, g1 = ld_shared_v2(csu + col * 4)
            u0, u1 = ld_shared_v2(csu + (col + 64) * 4)
            gs = (fp4.bits_to_f32(g0), fp4.bits_to_f32(g1))
            us = (fp4.bits_to_f32(u0), fp4.bits_to_f32(u1))
            for r in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(2):
                    v = 4 * j + 2 * r + e
                    gt = bf16_round(acc[v] * gs[e])
                    up = bf16_round(acc[v + 32] * us[e])
                    gt = cutlass.min(gt, Float32(10.0))
                    up = cutlass.min(cutlass.max(up, Float32(-10.0)), Float32(10.0))
                    sig = Float32(1.0) + cute.math.exp2(gt * Float32(-_LOG2E), fastmath=True)
                    x = bf16_round(gt / sig * up * (rw0 if r == 0 else rw1))
                    acc[v] = x
                    am[r] = cutlass.max(am[r], cutlass.max(x, -x))

    @cute.jit
    def epilogue_gemm1(acc0: cute.Tensor, acc1: cute.Tensor, csu: Int32, mOut: cute.Tensor, mOutS: cute.Tensor,
                       mRW: cute.Tensor, row0: Int32, nrows: Int32, r_first: Int32, nt: Int32, c: Int32,
                       I: Int32, fp8: cutlass.Constexpr[bool]):
        R = mRW.shape[0]
        rw0 = ld_global_nc_f32(mRW.iterator.toint() + Int64(cutlass.min(row0 + r_first, R - 1)) * 4)
        rw1 = ld_global_nc_f32(mRW.iterator.toint() + Int64(cutlass.min(row0 + r_first + 8, R - 1)) * 4)
        am = cute.make_rmem_tensor((2,), Float32)
        am[0] = Float32(0.0)
        am[1] = Float32(0.0)
        _swiglu_half(acc0, csu, 0, c, rw0, rw1, am)
        _swiglu_half(acc1, csu, 1, c, rw0, rw1, am)
        out = mOut.iterator.toint()
        if cutlass.const_expr(fp8):
            sc = cute.make_rmem_tensor((2,), Float32)
            inv = cute.make_rmem_tensor((2,), Float32)
            for r in cutlass.range_constexpr(2):
                a = am[r]
                a = cutlass.max(a, Float32(cute.arch.shuffle_sync_bfly(a, 1)))
                a = cutlass.max(a, Float32(cute.arch.shuffle_sync_bfly(a, 2)))
                a = cutlass.max(a, Float32(1e-4)) * Float32(_INV448)
                bits = fp4.f32_to_bits(a)
                ex = ((bits >> 23) & Uint32(0xFF)) + cutlass.select_((bits & Uint32(0x7FFFFF)) != Uint32(0),
                                                                     Uint32(1), Uint32(0))
                sc[r] = fp4.bits_to_f32(ex << 23)
                inv[r] = fp4.bits_to_f32((Uint32(254) - ex) << 23)
            for r in cutlass.range_constexpr(2):
                row = r_first + 8 * r
                if row < nrows:
                    rbase = out + Int64(row0 + row) * I
                    for h in cutlass.range_constexpr(2):
                        for j in cutlass.range_constexpr(8):
                            v = 4 * j + 2 * r
                            col = nt * 128 + 64 * h + 8 * j + 2 * c
                            x0 = (acc0[v] if h == 0 else acc1[v]) * inv[r]
                            x1 = (acc0[v + 1] if h == 0 else acc1[v + 1]) * inv[r]
                            st_global_b16(rbase + col, fp4.cvt_e4m3x2_f32(x0, x1))
                    if c == 0:
                        st_global_f32(mOutS.iterator.toint() + (Int64(row0 + row) * (I // 128) + nt) * 4, sc[r])
        else:
            for r in cutlass.range_constexpr(2):
                row = r_first + 8 * r
                if row < nrows:
                    rbase = out + Int64(row0 + row) * I * 2
                    for h in cutlass.range_constexpr(2):
                        for j in cutlass.range_constexpr(8):
                            v = 4 * j + 2 * r
                            col = nt * 128 + 64 * h + 8 * j + 2 * c
                            x0 = acc0[v] if h == 0 else acc1[v]
                            x1 = acc0[v + 1] if h == 0 else acc1[v + 1]
                            st_global_b32(rbase + col * 2, pack_bf16x2(x0, x1))

    @cute.jit
    def epilogue_gemm2(acc0: cute.Tensor, acc1: cute.Tensor, csu: Int32, mOut: cute.Tensor, row0: Int32,
                       nrows: Int32, r_first: Int32, nt: Int32, c: Int32, N: Int32):
        out = mOut.iterator.toint()
        for r in cutlass.range_constexpr(2):
            row = r_first + 8 * r
            if row < nrows:
                rbase = out + (Int64(row0 + row) * N + nt * 256) * 4
                for h in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(16):
                        col = 128 * h + 8 * j + 2 * c
                        s0, s1 = ld_shared_v2(csu + col * 4)
                        v = 4 * j + 2 * r
                        a0 = acc0[v] if h == 0 else acc1[v]
                        a1 = acc0[v + 1] if h == 0 else acc1[v + 1]
                        st_global_b64(rbase + col * 4, a0 * fp4.bits_to_f32(s0), a1 * fp4.bits_to_f32(s1))
