"""Operand-transform stage of the FP4-weight grouped GEMM: packed E2M1 weight tiles (TMA'd into
shared memory, row-major ``[256 rows, BK/2 bytes]``) decoded into the WGMMA operand layout
(K-major, 128-byte swizzle) of E4M3 (FP8 activations) or BF16 (bf16 activations), with the
block scales folded in (CuTe DSL device functions; decode math from :mod:`kernels_dsl.sm90.fp4`).

Thread mapping (per consumer warpgroup, 128 threads): lane quad ``c = t % 4`` owns the 16-byte
(E4M3: 32 values = one MXFP4 scale group / two NVFP4 groups) or 8-byte (BF16: 16 values) chunk
``c`` of a row; rows ``t // 4 + 32 j``. A warp reads 8 consecutive packed rows (conflict-free) and
writes 16-byte chunks at ``chunk ^ (row % 8)`` (the hardware 128B swizzle: conflict-free too).

Decoded layout (checked against ``sm90_utils.make_smem_layout_b`` for a 128-row half tile:
``S<3,4,3> o ((8,16),(BK,1)):((BK,1024),(1,0))``, byte offsets): half tile ``sub`` starts at
``sub * 16384``; byte ``(n, kbyte)`` is at ``(n // 8) * 1024 + (n % 8) * 128 + (((kbyte // 16) ^ (n %
8)) * 16) + kbyte % 16``.

Scale folding (per row, reference exponent fixed over the whole K of a work unit, computed by
:func:`row_prologue` from the row's scale bytes):

* W4A8 MXFP4: ``e_ref = max_k e - 6``; the decoded byte is ``e4m3(level * 2^(e - e_ref))`` (exact
  while the row's exponents span <= 14 binades, else round-to-nearest-even into the E4M3
  subnormals: absolute error <= ``2^(e_ref - 10)``); ``2^(e_ref - 127) * global`` multiplies the
  column in the epilogue.
* W4A8 NVFP4: ``base = floor(log2 max_k sf) - 5``; ``v = level * sf * 2^-base`` split into
  ``hi = e4m3(v)``, ``lo = e4m3(v - hi)`` (two tiles, two WGMMAs); exact when
  ``v >= 2^-4`` for the row's smallest nonzero ``level * sf``, i.e. when its block scales lie
  within 8 binades of the row maximum (beyond that ``lo`` rounds: relative error of that value
  <= 2^-4, absolute <= ``2^(base - 9)``); ``2^base * global`` in the epilogue.
* W4A16: ``bf16(level) * bf16(scale)`` (exact: UE8M0 powers of two, E4M3 x E2M1 <= 6 significant
  bits), ``global`` in the epilogue.
"""
from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from . import fp4
    from .ptx import ld_global_nc_b32, ld_shared_v2, max_u16x2, st_shared_b32, st_shared_v4
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["decoded_offset", "row_prologue", "row_prologue_v4", "decode_row_chunk", "ld_nc_u8", "ld_nc_u16",
           "HALF_TILE_BYTES"]

#: bytes of one decoded 128-row half tile (128 x 128 E4M3 or 128 x 64 BF16)
HALF_TILE_BYTES = 16384

if _HAVE_DSL:

    @dsl_user_op
    def _ld_global_nc_v4(addr, *, loc=None, ip=None):
        """``ld.global.nc.v4.b32`` at a 16-byte aligned 64-bit address -> 4 Uint32."""
        r = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
                            "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", has_side_effects=True,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return tuple(Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4))

    @dsl_user_op
    def ld_nc_u8(addr, *, loc=None, ip=None):
        """``ld.global.nc.u8`` straight into a 32-bit register (zero-extended by the load itself: no
        dependent ``cvt`` right behind the load, which would wait for it and defeat a prefetch)."""
        return Uint32(llvm.inline_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.u8 $0, [$1];",
                                      "=r,l", has_side_effects=True, is_align_stack=False,
                                      asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def ld_nc_u16(addr, *, loc=None, ip=None):
        """``ld.global.nc.u16`` (2-byte aligned) straight into a 32-bit register (see :func:`ld_nc_u8`)."""
        return Uint32(llvm.inline_asm(T.i32(), [Int64(addr).ir_value(loc=loc, ip=ip)], "ld.global.nc.u16 $0, [$1];",
                                      "=r,l", has_side_effects=True, is_align_stack=False,
                                      asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @cute.jit
    def _bytemax_words(m2: Uint32, w: Uint32):
        """Running per-16-bit-lane max of the bytes of ``w`` (two ``max.u16x2``)."""
        return max_u16x2(m2, max_u16x2(w & Uint32(0x00FF00FF), (w >> 8) & Uint32(0x00FF00FF)))

    @cute.jit
    def decoded_offset(n: Int32, q: Int32):
        """Byte offset of 16-byte chunk ``q`` of row ``n`` inside a 128-row half tile."""
        r8 = n & 7
        return (n >> 3) * 1024 + r8 * 128 + ((q ^ r8) << 4)

    @cute.jit
    def _row_reference(m2: Uint32, g: Float32, fp8: cutlass.Constexpr[bool], nvfp4: cutlass.Constexpr[bool],
                       c: Int32, colscale_addr: Int32):
        """Quad-reduce the running byte max ``m2`` of a row's scale bytes into its reference
        (MXFP4: the max UE8M0 byte; NVFP4: ``base``; W4A16: 0) and write the column multiplier."""
        cs = g
        rb = Int32(0)
        if cutlass.const_expr(fp8):
            m = cutlass.max(m2 & Uint32(0xFFFF), m2 >> 16)
            m = cutlass.max(m, Uint32(cute.arch.shuffle_sync_bfly(Int32(m), 1)))
            m = cutlass.max(m, Uint32(cute.arch.shuffle_sync_bfly(Int32(m), 2)))
            if cutlass.const_expr(not nvfp4):
                rb = Int32(m)
                e = cutlass.max(cutlass.min(rb - 133, Int32(127)), Int32(-126))
                cs = g * fp4.exp2i(e)
            else:
                # base = floor(log2 e4m3(m)) - 5 (normal: E - 7; subnormal m * 2^-9: floor(log2 m) - 9)
                ex = Int32(m >> 3)
                mm = Int32(m & Uint32(7))
                sub_l = cutlass.select_(mm >= 4, Int32(-7), cutlass.select_(mm >= 2, Int32(-8), Int32(-9)))
                fl = cutlass.select_(ex > 0, ex - 7, sub_l)
                rb = cutlass.select_(m == Uint32(0), Int32(0), fl - 5)
                cs = g * fp4.exp2i(rb)
        if c == 0:
            st_shared_b32(colscale_addr, fp4.f32_to_bits(cs))
        return rb

    @cute.jit
    def row_prologue(ws_row: Int64, nsb: Int32, c: Int32, g: Float32, fp8: cutlass.Constexpr[bool],
                     nvfp4: cutlass.Constexpr[bool], colscale_addr: Int32):
        """Reference exponent of one weight row over its whole K (all 4 lanes of the row's quad
        call this; lane ``c`` reads scale words ``c, c + 4, ...`` of the ``nsb`` scale bytes at
        ``ws_row``); returns it (Int32: MXFP4 the max UE8M0 byte, NVFP4 ``base``; W4A16: 0) to every
        lane of the quad and lane 0 writes the column multiplier (fp32) to ``colscale_addr``."""
        m2 = Uint32(0)
        if cutlass.const_expr(fp8):
            nw = nsb // 4
            for i in cutlass.range(c, nw, 4, unroll=4):
                m2 = _bytemax_words(m2, ld_global_nc_b32(ws_row + Int64(i) * 4))
        return _row_reference(m2, g, fp8, nvfp4, c, colscale_addr)

    @cute.jit
    def row_prologue_v4(ws_row: Int64, nsb: Int32, c: Int32, g: Float32, fp8: cutlass.Constexpr[bool],
                        nvfp4: cutlass.Constexpr[bool], colscale_addr: Int32):
        """:func:`row_prologue` with 16-byte loads: lane ``c`` reads chunks ``c, c + 4, c + 8, c + 12``
        of the row per round (all issued before any is used: one memory round trip per 256 bytes of
        scales; the DSV4 rows need one; chunks past the row end re-read its last one). Needs
        ``nsb % 16 == 0`` and a 16-byte aligned ``ws_row``."""
        m2 = Uint32(0)
        if cutlass.const_expr(fp8):
            nch = nsb // 16
            for r in cutlass.range(0, nch, 16, unroll=1):
                ws = []
                for q in cutlass.range_constexpr(4):   # past the row end: re-read its last chunk (max is idempotent)
                    ch = cutlass.min(r + c + 4 * q, nch - 1)
                    ws.append(_ld_global_nc_v4(ws_row + Int64(ch) * 16))
                for q in cutlass.range_constexpr(4):
                    for i in cutlass.range_constexpr(4):
                        m2 = _bytemax_words(m2, ws[q][i])
        return _row_reference(m2, g, fp8, nvfp4, c, colscale_addr)

    @cute.jit
    def decode_row_chunk(src: Int32, dst_a: Int32, dst_b: Int32, sc: Uint32, nvfp4: cutlass.Constexpr[bool]):
        """W4A16: decode one thread's 8-byte chunk (16 values) of one weight row for one K block
        into BF16 ``level * scale`` (exact).

        ``src``: shared address of the packed chunk; ``dst_a`` / ``dst_b``: shared addresses of
        its two 16-byte decoded chunks (``2c`` and ``2c + 1`` of the row, swizzled); ``sc``: the
        chunk's scale byte, zero-extended (UE8M0 for MXFP4, E4M3 for NVFP4). (W4A8 decodes inside
        the grouped GEMM: ``Fp4GroupedGemmKernel._decode_fp8``.)
        """
        w0, w1 = ld_shared_v2(src)
        sb = sc & Uint32(0xFF)
        bits = Uint32(0)
        if cutlass.const_expr(not nvfp4):
            bits = cutlass.select_(sb == Uint32(0), Uint32(0x0040),
                                   cutlass.select_(sb == Uint32(0xFF), Uint32(0x7FC0), sb << 7))
        else:
            sv, _ = fp4.e4m3x2_to_f32x2(sb)
            bits = fp4.f32_to_bits(sv) >> 16
        s2 = bits | (bits << 16)
        p0, p1, p2, p3 = fp4.e2m1x8_to_bf16x8(w0)
        q0, q1, q2, q3 = fp4.e2m1x8_to_bf16x8(w1)
        st_shared_v4(dst_a, fp4.mul_bf16x2(p0, s2), fp4.mul_bf16x2(p1, s2), fp4.mul_bf16x2(p2, s2),
                     fp4.mul_bf16x2(p3, s2))
        st_shared_v4(dst_b, fp4.mul_bf16x2(q0, s2), fp4.mul_bf16x2(q1, s2), fp4.mul_bf16x2(q2, s2),
                     fp4.mul_bf16x2(q3, s2))
