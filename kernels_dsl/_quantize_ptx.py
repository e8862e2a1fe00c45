"""Inline-PTX building blocks of the quantization kernels (kernels_dsl/quantize_*.py).

The quantizers must be bit-exact with :mod:`dsv4.formats`, so every rounding step is written as
the PTX instruction it has to be (``mul.rn.f32``, ``add.rn.f32``, ``rcp.rn.f32``, ``div.rn.f32``,
``fma.rn.f32``, ``cvt.rn.satfinite.e4m3x2.f32``; never ``.ftz``, never a contracted multiply-add
that the reference does not do). Float -> int conversion never happens: roundings are done by
magic-number fp32 adds and exponent-field integer arithmetic (see ``kernels_dsl/sm90/fp4.py``
:func:`e2m1x8_encode`).

Memory: global addresses are 64-bit generic addresses passed to the kernels as ``Int64``
scalars (the ops validate every tensor before the launch); 16-byte loads go through the
read-only path without L1 allocation and with an L2 eviction-priority policy
(``createpolicy``); stores are ``st.global.v4`` / narrower. Shared memory is addressed by the
32-bit shared-window address. Memory ops and ``shfl.sync`` carry ``has_side_effects`` (never
merged, hoisted or sunk into a branch); pure arithmetic does not. The generic loads / stores /
converts come from ``kernels_dsl/sm90/ptx.py`` (imported under the short names used here). Shared by
the quantizers: the one staged-tile store loop (``store_staged``) and the E2M1 encoder
(``e2m1x8_encode_rn``, an alias of ``kernels_dsl/sm90/fp4.py`` ``e2m1x8_encode``); the per-warp bulk-copy tile ring (``ring_*``: mbarrier + ``cp.async.bulk``) of the
NVFP4 quantizer.
"""
from __future__ import annotations

try:
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

#: fp32 constants as bit patterns (the references' fp32 literals, dsv4.formats)
F32_INV6 = 0x3E2AAAAB       # fp32(1/6)
F32_INV448 = 0x3B124925     # fp32(1/448)
F32_1EM4 = 0x38D1B717       # fp32(1e-4), FP8 amax floor
F32_MX_FLOOR = 0x01C00000   # 6 * 2^-126, MXFP4 dsv4 amax floor
F32_FLT_MAX = 0x7F7FFFFF
F32_QNAN = 0x7FFFFFFF
ABS_INF = {"bfloat16": 0x7F80, "float16": 0x7C00}   # |half bits| >= this: Inf or NaN

if _HAVE_DSL:

    # the generic loads / stores / converts shared with the other sm_90a kernels (kernels_dsl/sm90/ptx.py)
    from .sm90.fp4 import (bits_to_f32 as bits_f32, cvt_e4m3x2_f32 as e4m3x2, e2m1x8_encode,  # noqa: F401
                           e4m3x2_to_f32x2, f32_to_bits as f32_bits, prmt)
    from .sm90.ptx import (e4m3_byte_to_f32 as e4m3_to_f32, fence_proxy_async, ld_global_nc_b32 as ld_nc_b32,  # noqa: F401
                           ld_global_nc_f32 as ld_nc_f32, ld_shared_b32 as lds_b32, ld_shared_v4 as lds_v4, max_u16x2,
                           mbar_fence_init as fence_mbar_init, mbar_init, mbar_wait, pack_bf16x2 as f32_to_bf16x2,
                           st_global_b32 as st_b32, st_global_f32 as st_f32, st_global_v4 as st_v4,
                           st_shared_b32 as sts_b32, st_shared_f32 as sts_f32)

    def _v(x, ty, loc, ip):
        return ty(x).ir_value(loc=loc, ip=ip)

    def _asm(ret, ptx, cons, args, side=False, loc=None, ip=None):
        return llvm.inline_asm(ret, args, ptx, cons, has_side_effects=side, is_align_stack=False,
                               asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    def _u32(ptx, cons, args, side=False, loc=None, ip=None):
        return Uint32(_asm(T.i32(), ptx, cons, args, side, loc, ip))

    def _f32(ptx, cons, args, loc=None, ip=None):
        return Float32(_asm(T.f32(), ptx, cons, args, False, loc, ip))

    def _struct(n, ptx, cons, args, side, loc, ip):
        r = _asm(llvm.StructType.get_literal([T.i32()] * n), ptx, cons, args, side, loc, ip)
        return tuple(Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(n))

    # ---------------------------------------------------------------- global memory
    @dsl_user_op
    def l2_evict_first(*, loc=None, ip=None):
        """An L2 ``evict_first`` cache policy (``createpolicy.fractional``), as a 64-bit handle."""
        return Int64(_asm(T.i64(), "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l", [], False, loc, ip))

    @dsl_user_op
    def l2_evict_last(*, loc=None, ip=None):
        """An L2 ``evict_last`` cache policy (keep the line for a second pass)."""
        return Int64(_asm(T.i64(), "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;", "=l", [], False, loc, ip))

    @dsl_user_op
    def st_u8(addr, w, *, loc=None, ip=None):
        """Store the low byte of ``w``."""
        _asm(None, "{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.global.u8 [$0], t;\n}", "l,r",
             [_v(addr, Int64, loc, ip), _v(w, Uint32, loc, ip)], True, loc, ip)

    # ---------------------------------------------------------------- shared memory
    @dsl_user_op
    def sts_v2(addr, w0, w1, *, loc=None, ip=None):
        _asm(None, "st.shared.v2.b32 [$0], {$1, $2};", "r,r,r",
             [_v(addr, Int32, loc, ip), _v(w0, Uint32, loc, ip), _v(w1, Uint32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def sts_u8(addr, w, *, loc=None, ip=None):
        _asm(None, "{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.shared.u8 [$0], t;\n}", "r,r",
             [_v(addr, Int32, loc, ip), _v(w, Uint32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def lds_u8(addr, *, loc=None, ip=None):
        return _u32("{\n.reg .b16 t;\nld.shared.u8 t, [$1];\ncvt.u32.u16 $0, t;\n}", "=r,r",
                    [_v(addr, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def bar_sync(*, loc=None, ip=None):
        """``bar.sync 0`` (whole CTA)."""
        _asm(None, "bar.sync 0;", "", [], True, loc, ip)

    @dsl_user_op
    def warp_sync(*, loc=None, ip=None):
        _asm(None, "bar.warp.sync 0xffffffff;", "", [], True, loc, ip)

    # ---------------------------------------------------------------- warp reductions
    @dsl_user_op
    def shfl_bfly_max(v, lanemask: int, *, loc=None, ip=None):
        """``max(v, shfl.sync.bfly(v, lanemask))`` (unsigned)."""
        return _u32("{\n.reg .b32 t;\nshfl.sync.bfly.b32 t, $1, " + str(int(lanemask)) + ", 0x1f, 0xffffffff;\n"
                    "max.u32 $0, $1, t;\n}", "=r,r", [_v(v, Uint32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def redux_max(v, *, loc=None, ip=None):
        """Warp-wide unsigned max (``redux.sync.max.u32``, sm_80+)."""
        return _u32("redux.sync.max.u32 $0, $1, 0xffffffff;", "=r,r", [_v(v, Uint32, loc, ip)], True, loc, ip)

    # ---------------------------------------------------------------- integer helpers
    @dsl_user_op
    def umax(a, b, *, loc=None, ip=None):
        return _u32("max.u32 $0, $1, $2;", "=r,r,r", [_v(a, Uint32, loc, ip), _v(b, Uint32, loc, ip)], loc=loc, ip=ip)

    @dsl_user_op
    def clz(a, *, loc=None, ip=None):
        return _u32("clz.b32 $0, $1;", "=r,r", [_v(a, Uint32, loc, ip)], loc=loc, ip=ip)

    def chunk_absmax(w, fp16=None):
        """max |half| of the 8 halves of a 16-byte chunk, as |bits| (Uint32 in [0, 0x7FFF]).
        |bits| order = |value| order for bf16 / fp16; NaN > Inf > every finite value. With the input
        dtype given (``fp16`` True / False): three packed ``max.NaN.xorsign.abs.{f16x2,bf16x2}`` (a NaN
        half gives the canonical NaN 0x7FFF, still >= Inf; job quant8-01: 1-3% faster than the integer
        masks); ``None``: integer masks + ``max.u16x2`` (dtype-free)."""
        if fp16 is not None:
            a = absmax_h2x4(w[0], w[1], w[2], w[3], fp16) & Uint32(0x7FFF7FFF)
            return umax(a & Uint32(0xFFFF), a >> 16)
        m = Uint32(0x7FFF7FFF)
        a = max_u16x2(max_u16x2(w[0] & m, w[1] & m), max_u16x2(w[2] & m, w[3] & m))
        return umax(a & Uint32(0xFFFF), a >> 16)

    @dsl_user_op
    def absmax_h2x4(w0, w1, w2, w3, fp16: bool, *, loc=None, ip=None):
        """Lane-wise ``max(|w0|, |w1|, |w2|, |w3|)`` of four half pairs (magnitudes; the sign bits are junk),
        NaN-propagating."""
        ty = "f16x2" if fp16 else "bf16x2"
        return _u32("{\n.reg .b32 a, b;\nmax.NaN.xorsign.abs.%s a, $1, $2;\nmax.NaN.xorsign.abs.%s b, $3, $4;\n"
                    "max.NaN.xorsign.abs.%s $0, a, b;\n}" % (ty, ty, ty), "=r,r,r,r,r",
                    [_v(w, Uint32, loc, ip) for w in (w0, w1, w2, w3)], loc=loc, ip=ip)

    # ---------------------------------------------------------------- float helpers (exact PTX)
    @dsl_user_op
    def fmul(a, b, *, loc=None, ip=None):
        return _f32("mul.rn.f32 $0, $1, $2;", "=f,f,f", [_v(a, Float32, loc, ip), _v(b, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def fmin(a, b, *, loc=None, ip=None):
        return _f32("min.f32 $0, $1, $2;", "=f,f,f", [_v(a, Float32, loc, ip), _v(b, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def fmax(a, b, *, loc=None, ip=None):
        return _f32("max.f32 $0, $1, $2;", "=f,f,f", [_v(a, Float32, loc, ip), _v(b, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def frcp(a, *, loc=None, ip=None):
        """``rcp.rn.f32`` (correctly rounded 1/a, subnormals kept)."""
        return _f32("rcp.rn.f32 $0, $1;", "=f,f", [_v(a, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def fdiv(a, b, *, loc=None, ip=None):
        """``div.rn.f32`` (correctly rounded a/b)."""
        return _f32("div.rn.f32 $0, $1, $2;", "=f,f,f", [_v(a, Float32, loc, ip), _v(b, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def half_to_f32(h, fp16: bool, *, loc=None, ip=None):
        """One input half (bits in the low 16 bits of ``h``) -> fp32 (exact)."""
        if not fp16:
            return bits_f32(Uint32(h) << 16, loc=loc, ip=ip)
        return _f32("{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\ncvt.f32.f16 $0, t;\n}", "=f,r", [_v(h, Uint32, loc, ip)],
                    loc, ip)

    def word_to_f32x2(w, fp16: bool):
        """A 32-bit word of two halves -> (element 2j = low half, element 2j+1 = high half) in fp32."""
        w = Uint32(w)
        if not fp16:
            return bits_f32(w << 16), bits_f32(w & Uint32(0xFFFF0000))
        return half_to_f32(w & Uint32(0xFFFF), True), half_to_f32(w >> 16, True)

    @dsl_user_op
    def f32_to_f16x2(lo, hi, *, loc=None, ip=None):
        """``cvt.rn.f16x2.f32``: {lo in bits 0..15, hi in bits 16..31}."""
        return _u32("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [_v(lo, Float32, loc, ip), _v(hi, Float32, loc, ip)],
                    loc=loc, ip=ip)

    # ---------------------------------------------------------------- scale helpers
    def ue8m0_ceil_byte(t):
        """UE8M0 byte of the smallest power of two >= t (normal fp32 t > 0): exponent field +
        (mantissa != 0), DSV4 ``fast_round_scale``."""
        b = f32_bits(t)
        return (b >> 23) + (((b & Uint32(0x7FFFFF)) + Uint32(0x7FFFFF)) >> 23)

    def floor_log2(a):
        """exact floor(log2(a)) for finite fp32 a > 0, subnormals included (Int32)."""
        b = f32_bits(a)
        e_norm = Int32(b >> 23) - 127
        e_sub = Int32(31) - Int32(clz(b)) - 149
        return cutlass_select(b >= Uint32(0x00800000), e_norm, e_sub)

    def exp2_int(k):
        """exact fp32 2^k for integer k in [-127, 127] (2^-127 is the subnormal 0x00400000)."""
        k = Int32(k)
        bits = Uint32(k + 127) << 23
        return bits_f32(cutlass_select(k <= Int32(-127), Uint32(0x00400000), bits))

    def cutlass_select(c, a, b):
        import cutlass
        return cutlass.select_(c, a, b)

    @dsl_user_op
    def ld_nc_v4_if(addr, pol, pred, *, loc=None, ip=None):
        """:func:`ld_nc_v4` predicated on ``pred != 0`` (zeros otherwise; no branch)."""
        return _struct(4, "{\n.reg .pred p;\nsetp.ne.b32 p, $6, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
                          "mov.b32 $3, 0;\n@p ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {$0, $1, $2, $3}, "
                          "[$4], $5;\n}",
                       "=r,=r,=r,=r,l,l,r", [_v(addr, Int64, loc, ip), _v(pol, Int64, loc, ip), _v(pred, Int32, loc, ip)],
                       True, loc, ip)

    @dsl_user_op
    def sts_b32_if(addr, w, pred, *, loc=None, ip=None):
        """``st.shared.b32`` predicated on ``pred != 0``."""
        _asm(None, "{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\n@p st.shared.b32 [$0], $1;\n}", "r,r,r",
             [_v(addr, Int32, loc, ip), _v(w, Uint32, loc, ip), _v(pred, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def st_v4_if(addr, w0, w1, w2, w3, pred, *, loc=None, ip=None):
        """:func:`st_v4` predicated on ``pred != 0``."""
        _asm(None, "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n@p st.global.v4.b32 [$0], {$1, $2, $3, $4};\n}",
             "l,r,r,r,r,r", [_v(addr, Int64, loc, ip)] + [_v(w, Uint32, loc, ip) for w in (w0, w1, w2, w3)]
             + [_v(pred, Int32, loc, ip)], True, loc, ip)

    # ---------------------------------------------------------------- bulk async copy (TMA, no tensor map)
    @dsl_user_op
    def bulk_load(dst, src, nbytes, mbar, pol, *, loc=None, ip=None):
        """Arm ``mbar`` with ``nbytes`` (``mbarrier.arrive.expect_tx``) and start one bulk copy of ``nbytes``
        (multiple of 16, 16-byte aligned) from global ``src`` to shared ``dst`` that completes on ``mbar``
        (``cp.async.bulk...mbarrier::complete_tx::bytes``, L2 policy ``pol``). One thread issues it."""
        _asm(None, "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$3], $2;\n"
                   "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [$0], [$1], $2, [$3], $4;",
             "r,l,r,r,l", [_v(dst, Int32, loc, ip), _v(src, Int64, loc, ip), _v(nbytes, Int32, loc, ip),
                           _v(mbar, Int32, loc, ip), _v(pol, Int64, loc, ip)], True, loc, ip)


    def store_staged(dst, sd, lane, tile_bytes: int, full, valid_words):
        """Copy a warp's staged output tile (``tile_bytes`` at shared ``sd``) to global ``dst``: 16-byte
        stores (512 contiguous bytes per warp instruction) when the tile is full and a multiple of 512
        bytes, else 4-byte stores of its first ``valid_words`` words (128 contiguous bytes per warp
        instruction). The one store loop of the quantizers (codes of quantize_fp4.py, E4M3 bytes of
        quantize_fp8.py)."""
        return _store_staged(dst, sd, lane, tile_bytes, full, valid_words)

    # A warp's ring of ``P`` warp tiles (``tb`` bytes each) in shared memory, filled by bulk copies that
    # lane 0 issues (one mbarrier per slot): the warp's ``i``-th tile lives in slot ``i % P``;
    # :func:`ring_read` waits for it and loads lane ``l``'s ``qj`` 16-byte chunks ``32 j + l``, then the
    # caller refills the slot with tile ``i + P`` (:func:`ring_issue`), so ``P`` tiles stay in flight
    # while the warp computes, whatever its register budget. The control flow (``if lane == 0``) stays in
    # the kernel body; these functions are straight-line. A ring is the pair (buf, bar) of shared addresses.
    def ring_alloc(alloc, warps: int, warp, P: int, tb: int):
        import cutlass.cute as cute
        ring = alloc.allocate_tensor(Uint32, cute.make_layout(warps * P * tb // 4), byte_alignment=128)
        bars = alloc.allocate_tensor(Int64, cute.make_layout(warps * P), byte_alignment=8)
        return ring.iterator.toint() + warp * (P * tb), bars.iterator.toint() + warp * (P * 8)

    def ring_init(bar, P: int):
        """(lane 0) initialize the slot barriers."""
        for s in range(P):
            mbar_init(bar + 8 * s, 1)
        fence_mbar_init()

    def ring_issue(buf, bar, tb: int, slot, src, nbytes, pol):
        """(lane 0, after a ``bar.warp.sync`` that follows the warp's reads of the slot) bulk-copy ``nbytes``
        from global ``src`` into ring slot ``slot``; the proxy fence orders those generic-proxy reads
        before the async-proxy writes (write-after-read)."""
        fence_proxy_async()
        bulk_load(buf + slot * tb, src, nbytes, bar + 8 * slot, pol)

    def ring_read(buf, bar, P: int, tb: int, i, lane, qj: int):
        """Wait for the warp's tile ``i``; (its slot, lane's ``qj`` chunks)."""
        slot = Int32(i % P)
        mbar_wait(bar + 8 * slot, Int32((i // P) % 2))
        base = buf + slot * tb
        return slot, [lds_v4(base + ((32 * j) + lane) * 16) for j in range(qj)]

    @dsl_user_op
    def vote_any(pred, *, loc=None, ip=None):
        """1 if ``pred != 0`` in any lane of the (converged) warp, else 0 (``vote.sync.any.pred``)."""
        return _u32("{\n.reg .pred p, q;\nsetp.ne.b32 p, $1, 0;\nvote.sync.any.pred q, p, 0xffffffff;\n"
                    "selp.u32 $0, 1, 0, q;\n}", "=r,r", [_v(pred, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def div_rn_by3(x, s, r, *, loc=None, ip=None):
        """Correctly rounded ``x / s`` for finite ``s > 0`` given ``r = RN(1/s)`` (Markstein), 3
        instructions: ``q0 = RN(x r)``, ``t = RN(q0 s - x)`` (the exact residual, negated: RN is
        odd-symmetric), ``q = RN(q0 - t r)``. The sign of a zero result comes out right without a
        sign fix: ``x = -0`` gives ``t = +0``, ``q = -0 - 0 = -0`` (``q0 != 0`` for ``x != 0`` at the
        quantizer's ``s >= 1e-4/448``). Finite ``x`` only: the caller patches non-finite elements."""
        return _f32("{\n.reg .f32 q0, t;\nmul.rn.f32 q0, $1, $3;\nneg.f32 t, $1;\nfma.rn.f32 t, q0, $2, t;\n"
                    "neg.f32 t, t;\nfma.rn.f32 $0, t, $3, q0;\n}",
                    "=f,f,f,f", [_v(x, Float32, loc, ip), _v(s, Float32, loc, ip), _v(r, Float32, loc, ip)], loc, ip)

    @dsl_user_op
    def ld_nc_v2_if(addr, pred, *, loc=None, ip=None):
        """8-byte read-only load predicated on ``pred != 0`` (zeros otherwise)."""
        return _struct(2, "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\n"
                          "@p ld.global.nc.L1::no_allocate.v2.u32 {$0, $1}, [$2];\n}", "=r,=r,l,r",
                       [_v(addr, Int64, loc, ip), _v(pred, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def ld_nc_b32_if(addr, pred, *, loc=None, ip=None):
        """4-byte read-only load predicated on ``pred != 0`` (0 otherwise)."""
        return _u32("{\n.reg .pred p;\nsetp.ne.b32 p, $2, 0;\nmov.b32 $0, 0;\n@p ld.global.nc.b32 $0, [$1];\n}",
                    "=r,l,r", [_v(addr, Int64, loc, ip), _v(pred, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def ld_nc_u8_if(addr, pred, *, loc=None, ip=None):
        """1-byte read-only load predicated on ``pred != 0`` (0 otherwise)."""
        return _u32("{\n.reg .pred p;\n.reg .b16 t;\nsetp.ne.b32 p, $2, 0;\nmov.b16 t, 0;\n@p ld.global.nc.u8 t, [$1];\n"
                    "cvt.u32.u16 $0, t;\n}", "=r,l,r", [_v(addr, Int64, loc, ip), _v(pred, Int32, loc, ip)], True, loc, ip)

    def finite_chunk_absmax(w, abs_inf: int):
        """max |half| over the FINITE halves of a chunk (NaN / Inf count as 0), as |bits|.
        Straight-line: per word, halves >= abs_inf are masked off (no carry crosses a half:
        ``h + (0x8000 - abs_inf) <= 0xFFFF``)."""
        add = Uint32(((0x8000 - abs_inf) << 16) | (0x8000 - abs_inf))
        acc = Uint32(0)
        for k in range(4):
            m = Uint32(w[k]) & Uint32(0x7FFF7FFF)
            flag = (m + add) & Uint32(0x80008000)
            kill = flag | (flag - (flag >> 15))
            acc = max_u16x2(acc, m & (kill ^ Uint32(0xFFFFFFFF)))
        return umax(acc & Uint32(0xFFFF), acc >> 16)

    # ---------------------------------------------------------------- E2M1 encode
    #: the project's one E2M1 encoder (kernels_dsl/sm90/fp4.py: one magic add per element, 6 instructions), under
    #: the name the quantizers and kernels_dsl/indexer_quant.py import
    e2m1x8_encode_rn = e2m1x8_encode

    @dsl_user_op
    def ld_relaxed_b32(addr, *, loc=None, ip=None):
        """``ld.relaxed.gpu.global.b32``: a value written by another CTA during this launch."""
        return _u32("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [_v(addr, Int64, loc, ip)], True, loc, ip)

    @dsl_user_op
    def grid_arrive_wait(partial_addr, value, ws, last, pred, *, loc=None, ip=None):
        """Grid-wide barrier of one thread per CTA (``pred != 0``), self-resetting, no host state:
        store ``value`` at ``partial_addr``; read the generation ``ws[1]``; ``atom.add.acq_rel`` the
        arrival counter ``ws[0]``; the arrival that sees ``last`` (= gridDim - 1) resets the counter
        and bumps the generation (release); every other one spins (``ld.acquire.gpu``) until the
        generation moves. Needs every CTA of the grid co-resident, and launches that use the same
        ``ws`` serialized (one stream)."""
        _asm(None,
             "{\n.reg .pred p, q;\n.reg .b32 g0, old, g;\n.reg .b64 gen;\nsetp.ne.b32 q, $4, 0;\n@!q bra QDONE;\n"
             "st.global.b32 [$0], $1;\nadd.s64 gen, $2, 4;\nld.acquire.gpu.global.b32 g0, [gen];\n"
             "atom.add.acq_rel.gpu.global.u32 old, [$2], 1;\nsetp.eq.u32 p, old, $3;\n@!p bra QWAIT;\n"
             "st.relaxed.gpu.global.b32 [$2], 0;\nred.release.gpu.global.add.u32 [gen], 1;\nbra QDONE;\n"
             "QWAIT:\nld.acquire.gpu.global.b32 g, [gen];\nsetp.eq.u32 p, g, g0;\n@p bra QWAIT;\nQDONE:\n}",
             "l,r,l,r,r", [_v(partial_addr, Int64, loc, ip), _v(value, Uint32, loc, ip), _v(ws, Int64, loc, ip),
                           _v(last, Uint32, loc, ip), _v(pred, Int32, loc, ip)], True, loc, ip)

    @dsl_user_op
    def ld_nc_v4(addr, pol, hint: bool = True, *, loc=None, ip=None):
        """16-byte read-only load without L1 allocation (L2 policy ``pol`` with ``hint``), unpredicated."""
        if hint:
            return _struct(4, "ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {$0, $1, $2, $3}, [$4], $5;",
                           "=r,=r,=r,=r,l,l", [_v(addr, Int64, loc, ip), _v(pol, Int64, loc, ip)], True, loc, ip)
        return _struct(4, "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l",
                       [_v(addr, Int64, loc, ip)], True, loc, ip)

    def ld_tile_into(buf, x, cb, lane, pol, rem, qj: int, hint: bool = True):
        """Register double buffer fill: the ``qj`` 16-byte chunks ``cb + 32 j + lane`` of a warp tile with ``rem``
        valid chunks into ``buf[4 j + k]`` (an rmem tensor of 4 qj Uint32): unpredicated loads for a full tile
        (fresh registers, so the compiler can issue them before the previous tile is consumed), zero-filled
        predicated ones for a partial tile."""
        return _ld_tile_into(buf, x, cb, lane, pol, rem, qj, hint)

    @dsl_user_op
    def ld_nc_v4_if_any(addr, pol, pred, hint: bool = True, *, loc=None, ip=None):
        """:func:`ld_nc_v4_if` WITHOUT zeroing: for ``pred == 0`` the result is undefined. For
        loads whose out-of-range lanes feed only values that are never stored (whole scale blocks
        are either in or out of range): saves the four register moves per load."""
        if hint:
            return _struct(4, "{\n.reg .pred p;\nsetp.ne.b32 p, $6, 0;\n"
                              "@p ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {$0, $1, $2, $3}, [$4], $5;\n}",
                           "=r,=r,=r,=r,l,l,r", [_v(addr, Int64, loc, ip), _v(pol, Int64, loc, ip),
                                                 _v(pred, Int32, loc, ip)], True, loc, ip)
        return _struct(4, "{\n.reg .pred p;\nsetp.ne.b32 p, $5, 0;\n@p ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, "
                          "[$4];\n}", "=r,=r,=r,=r,l,r", [_v(addr, Int64, loc, ip), _v(pred, Int32, loc, ip)],
                       True, loc, ip)

    import cutlass
    import cutlass.cute as cute

    # Programmatic dependent launch (PDL): every launch of the quantize / dequant kernels carries the
    # programmatic-stream-serialization attribute, so on a stream (and in a CUDA graph) its CTAs may be scheduled
    # while the preceding kernel drains; the first statement of the kernel body (pdl_prologue) is
    # ``griddepcontrol.wait`` -- nothing reads or writes global memory before the preceding grid has completed and
    # flushed its memory -- and ``griddepcontrol.launch_dependents`` lets the next PDL launch start: at the start
    # of the body for decode sizes (``early``: the next kernel's launch hides behind this whole kernel), at its end
    # for the large class (the next kernel's CTAs do not take SM slots while this one streams). After a kernel
    # without the attribute, or eager, it behaves as a plain launch. Job quant9-02 (CUDA graphs of 24 calls):
    # [16, 7168] 0.4-0.6 us faster per call with the early trigger (the late one 0.2 us less), 8192^2 MXFP4 /
    # FP8 0.7-1.7 us faster with the late trigger (the early one +-0.5 us).
    def pdl_launch_kw() -> dict:
        """Launch keywords of every quantize / dequant kernel: programmatic dependent launch."""
        return {"use_pdl": True}

    def pdl_prologue(early: bool):
        """First statement of every kernel body: wait for the preceding grid (complete and flushed) before any
        global access; ``early``: then let the next PDL launch start its CTAs."""
        cute.arch.griddepcontrol_wait()
        if early:
            cute.arch.griddepcontrol_launch_dependents()

    def kernel_prologue(early: bool):
        """First statements of the quantize / dequant kernel bodies: :func:`pdl_prologue`, then this thread's
        ``(tidx, lane, warp, bidx, gdim)``: thread, lane and warp in the CTA, CTA index, grid size (for the
        grid-stride loops over warp tiles)."""
        pdl_prologue(early)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        return tidx, tidx % 32, tidx // 32, bidx, gdim

    def pdl_epilogue(early: bool):
        """Last statement of every kernel body: (not ``early``) let the next PDL launch start as this grid drains."""
        if not early:
            cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def _store_staged(dst, sd, lane, tile_bytes: cutlass.Constexpr, full, valid_words):
        if cutlass.const_expr(tile_bytes % 512 == 0):
            if full:
                for iv in cutlass.range_constexpr(tile_bytes // 512):
                    qv = lds_v4(sd + (32 * iv + lane) * 16)
                    st_v4(dst + Int64(32 * iv + lane) * 16, qv[0], qv[1], qv[2], qv[3])
            else:
                for iw in cutlass.range_constexpr(tile_bytes // 128):
                    if Int64(32 * iw + lane) < valid_words:
                        st_b32(dst + Int64(32 * iw + lane) * 4, lds_b32(sd + (32 * iw + lane) * 4))
        else:
            for iw in cutlass.range_constexpr(tile_bytes // 128):
                if Int64(32 * iw + lane) < valid_words:
                    st_b32(dst + Int64(32 * iw + lane) * 4, lds_b32(sd + (32 * iw + lane) * 4))

    @cute.jit
    def _ld_tile_into(buf, x, cb, lane, pol, rem, qj: cutlass.Constexpr, hint: cutlass.Constexpr):
        if rem >= 32 * qj:
            for j in cutlass.range_constexpr(qj):
                w = ld_nc_v4(x + (cb + (32 * j) + Int64(lane)) * 16, pol, hint)
                for k in cutlass.range_constexpr(4):
                    buf[4 * j + k] = w[k]
        else:
            for j in cutlass.range_constexpr(qj):
                w = ld_nc_v4_if(x + (cb + (32 * j) + Int64(lane)) * 16, pol, Int32((32 * j) + lane < rem))
                for k in cutlass.range_constexpr(4):
                    buf[4 * j + k] = w[k]
