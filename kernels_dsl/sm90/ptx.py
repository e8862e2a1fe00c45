"""Small inline-PTX device functions shared by the sm_90a DSL kernels: explicit shared-memory
vector loads / stores (the decoded-operand writes target computed 128B-swizzled addresses),
read-only global loads of scale bytes, global stores of epilogue pairs, 1-D bulk copies global ->
shared completed on an mbarrier and the mbarrier init / arrive / expect-tx / parity wait on an
address, proxy fences and named barriers, two converts, and the magic-multiply division by a runtime
divisor (:func:`slot_magic` on the host, :func:`mulhi_shift` on the device: the paged kernels'
``slot // block_size``).

Every memory function is emitted with side effects so that LLVM never merges or moves it across
the kernel's barriers (a pure inline asm would be CSE'd across pipeline iterations).
Addresses: shared memory as the 32-bit shared-window address (``ptr.toint()`` of an smem
pointer), global memory as the 64-bit generic address (``tensor.iterator.toint()`` + bytes).
"""
from __future__ import annotations

try:
    import cutlass  # noqa: F401
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["ld_shared_v4", "ld_shared_v2", "ld_shared_v2_f32", "ld_shared_b32", "ld_shared_f32", "st_shared_v4",
           "st_shared_b32", "st_shared_f32", "ld_global_nc_b32", "ld_global_nc_u8", "ld_global_nc_u16",
           "ld_global_nc_f32", "st_global_b16", "st_global_b32", "st_global_b64", "st_global_v4", "st_global_f32",
           "bulk_g2s", "mbar_init", "mbar_fence_init", "mbar_arrive", "mbar_arrive_expect_tx", "mbar_wait",
           "fence_proxy_async", "named_barrier", "max_u16x2", "pack_bf16x2", "e4m3_byte_to_f32", "mulhi_shift",
           "slot_magic"]


def slot_magic(bs: int) -> tuple[int, int]:
    """``(m, sh)`` with ``slot // bs == (slot * m) >> sh`` for every ``0 <= slot < 2^31`` (``sh = 31 + ceil(log2
    bs)``, ``m = ceil(2^sh / bs) < 2^32``): the kernels' page division, computed once on the host."""
    sh = 31 + (int(bs) - 1).bit_length()
    return -(-(1 << sh) // int(bs)), sh

if _HAVE_DSL:

    def _v(x, ty, loc, ip):
        return ty(x).ir_value(loc=loc, ip=ip)

    def _asm(ret, ptx, cons, args, side=True, loc=None, ip=None):
        return llvm.inline_asm(ret, args, ptx, cons, has_side_effects=side, is_align_stack=False,
                               asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    #: the inline-asm register class of each operand type
    _REG = {Int32: "r", Uint32: "r", Int64: "l", Float32: "f"}

    def _ld(ptx, addr_ty, addr, ty, n, loc, ip):
        """A load with side effects: ``$0 .. $n-1`` are ``n`` results of type ``ty`` (Uint32 or Float32),
        ``$n`` the address of type ``addr_ty`` (Int32 shared, Int64 global); one value or a tuple."""
        elem = T.f32() if ty is Float32 else T.i32()
        r = _asm(elem if n == 1 else llvm.StructType.get_literal([elem] * n), ptx,
                 ",".join(["=" + _REG[ty]] * n + [_REG[addr_ty]]), [_v(addr, addr_ty, loc, ip)], loc=loc, ip=ip)
        return ty(r) if n == 1 else tuple(ty(llvm.extractvalue(elem, r, [i], loc=loc, ip=ip)) for i in range(n))

    def _st(ptx, addr_ty, addr, ty, vals, loc, ip):
        """A store: ``$0`` the address of type ``addr_ty``, ``$1 ..`` the ``vals`` as type ``ty``."""
        _asm(None, ptx, ",".join([_REG[addr_ty]] + [_REG[ty]] * len(vals)),
             [_v(addr, addr_ty, loc, ip)] + [_v(x, ty, loc, ip) for x in vals], loc=loc, ip=ip)

    @dsl_user_op
    def ld_shared_v4(addr, *, loc=None, ip=None):
        """``ld.shared.v4.b32`` at a 16-byte aligned shared address -> 4 Uint32."""
        return _ld("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", Int32, addr, Uint32, 4, loc, ip)

    @dsl_user_op
    def ld_shared_v2(addr, *, loc=None, ip=None):
        """``ld.shared.v2.b32`` at an 8-byte aligned shared address -> 2 Uint32."""
        return _ld("ld.shared.v2.b32 {$0, $1}, [$2];", Int32, addr, Uint32, 2, loc, ip)

    @dsl_user_op
    def ld_shared_b32(addr, *, loc=None, ip=None):
        """``ld.shared.b32`` -> Uint32."""
        return _ld("ld.shared.b32 $0, [$1];", Int32, addr, Uint32, 1, loc, ip)

    @dsl_user_op
    def st_shared_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None):
        """``st.shared.v4.b32`` of 4 words at a 16-byte aligned shared address."""
        _st("st.shared.v4.b32 [$0], {$1, $2, $3, $4};", Int32, addr, Uint32, (w0, w1, w2, w3), loc, ip)

    @dsl_user_op
    def st_shared_b32(addr, w, *, loc=None, ip=None):
        _st("st.shared.b32 [$0], $1;", Int32, addr, Uint32, (w,), loc, ip)

    @dsl_user_op
    def ld_shared_v2_f32(addr, *, loc=None, ip=None):
        """8-byte shared load -> 2 x Float32 (addr 8 B aligned)."""
        return _ld("ld.shared.v2.f32 {$0, $1}, [$2];", Int32, addr, Float32, 2, loc, ip)

    @dsl_user_op
    def ld_shared_f32(addr, *, loc=None, ip=None):
        return _ld("ld.shared.f32 $0, [$1];", Int32, addr, Float32, 1, loc, ip)

    @dsl_user_op
    def st_shared_f32(addr, x, *, loc=None, ip=None):
        _st("st.shared.f32 [$0], $1;", Int32, addr, Float32, (x,), loc, ip)

    # ---------------------------------------------------------------- bulk copies, mbarriers, fences
    @dsl_user_op
    def bulk_g2s(dst, src, nbytes, mbar, *, loc=None, ip=None):
        """``cp.async.bulk`` of ``nbytes`` (multiple of 16) from global address ``src`` (Int64, 16 B
        aligned) to shared address ``dst`` (Int32, 16 B aligned); completes ``nbytes`` of
        transaction count on the mbarrier at shared address ``mbar``. One thread issues it."""
        _asm(None, "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
             "r,l,r,r", [_v(dst, Int32, loc, ip), _v(src, Int64, loc, ip), _v(nbytes, Int32, loc, ip),
                         _v(mbar, Int32, loc, ip)], loc=loc, ip=ip)

    @dsl_user_op
    def mbar_init(mbar, count, *, loc=None, ip=None):
        """``mbarrier.init.shared::cta.b64 [mbar], count`` (one thread)."""
        _asm(None, "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", [_v(mbar, Int32, loc, ip), _v(count, Int32, loc, ip)],
             loc=loc, ip=ip)

    @dsl_user_op
    def mbar_fence_init(*, loc=None, ip=None):
        """Make mbarrier initializations visible to the async proxy (bulk copies)."""
        _asm(None, "fence.mbarrier_init.release.cluster;", "", [], loc=loc, ip=ip)

    @dsl_user_op
    def mbar_arrive(mbar, *, loc=None, ip=None):
        """One arrival on the mbarrier (release semantics, CTA scope)."""
        _asm(None, "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [$0];\n}", "r", [_v(mbar, Int32, loc, ip)],
             loc=loc, ip=ip)

    @dsl_user_op
    def mbar_arrive_expect_tx(mbar, nbytes, *, loc=None, ip=None):
        """One arrival plus an expected transaction count of ``nbytes`` (the bulk copies that
        complete on this barrier)."""
        _asm(None, "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n}", "r,r",
             [_v(mbar, Int32, loc, ip), _v(nbytes, Int32, loc, ip)], loc=loc, ip=ip)

    @dsl_user_op
    def mbar_wait(mbar, parity, *, loc=None, ip=None):
        """Spin until the phase of parity ``parity`` (0/1) of the mbarrier has completed
        (``mbarrier.try_wait.parity``; acquire semantics)."""
        _asm(None, "{\n.reg .pred p;\nLAB_WAIT:\n"
                   "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
                   "@!p bra LAB_WAIT;\n}", "r,r", [_v(mbar, Int32, loc, ip), _v(parity, Int32, loc, ip)],
             loc=loc, ip=ip)

    @dsl_user_op
    def fence_proxy_async(*, loc=None, ip=None):
        """Order this thread's generic-proxy shared-memory accesses before later async-proxy ones
        (WGMMA operands, bulk copies) -- ``fence.proxy.async.shared::cta``."""
        _asm(None, "fence.proxy.async.shared::cta;", "", [], loc=loc, ip=ip)

    @dsl_user_op
    def named_barrier(bar_id: int, nthreads: int, *, loc=None, ip=None):
        """``bar.sync bar_id, nthreads`` (``nthreads`` a multiple of 32; id 0 is __syncthreads)."""
        _asm(None, f"bar.sync {int(bar_id)}, {int(nthreads)};", "", [], loc=loc, ip=ip)

    @dsl_user_op
    def pack_bf16x2(lo, hi, *, loc=None, ip=None):
        """Two fp32 -> one word of two bf16 (``cvt.rn.bf16x2.f32``, RNE), ``lo`` in the low half (pure)."""
        return Uint32(_asm(T.i32(), "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
                           [_v(lo, Float32, loc, ip), _v(hi, Float32, loc, ip)], side=False, loc=loc, ip=ip))

    @dsl_user_op
    def max_u16x2(a, b, *, loc=None, ip=None):
        """Per-16-bit-lane unsigned max (``max.u16x2``; pure)."""
        return Uint32(_asm(T.i32(), "max.u16x2 $0, $1, $2;", "=r,r,r", [_v(a, Uint32, loc, ip), _v(b, Uint32, loc, ip)],
                           side=False, loc=loc, ip=ip))

    @dsl_user_op
    def ld_global_nc_b32(addr, *, loc=None, ip=None):
        """``ld.global.nc.b32`` (read-only path) at a 4-byte aligned 64-bit address -> Uint32."""
        return _ld("ld.global.nc.b32 $0, [$1];", Int64, addr, Uint32, 1, loc, ip)

    @dsl_user_op
    def ld_global_nc_u8(addr, *, loc=None, ip=None):
        """``ld.global.nc.u8`` -> Uint32 (zero-extended byte)."""
        return _ld("{\n.reg .b16 t;\nld.global.nc.u8 t, [$1];\ncvt.u32.u16 $0, t;\n}", Int64, addr, Uint32, 1, loc, ip)

    @dsl_user_op
    def ld_global_nc_u16(addr, *, loc=None, ip=None):
        """``ld.global.nc.u16`` at a 2-byte aligned address -> Uint32 (zero-extended)."""
        return _ld("{\n.reg .b16 t;\nld.global.nc.u16 t, [$1];\ncvt.u32.u16 $0, t;\n}", Int64, addr, Uint32, 1, loc, ip)

    @dsl_user_op
    def ld_global_nc_f32(addr, *, loc=None, ip=None):
        """``ld.global.nc.f32`` -> Float32."""
        return _ld("ld.global.nc.f32 $0, [$1];", Int64, addr, Float32, 1, loc, ip)

    @dsl_user_op
    def st_global_b16(addr, w, *, loc=None, ip=None):
        """Store the low 16 bits of ``w`` (``st.global.b16``)."""
        _st("{\n.reg .b16 t;\ncvt.u16.u32 t, $1;\nst.global.b16 [$0], t;\n}", Int64, addr, Uint32, (w,), loc, ip)

    @dsl_user_op
    def st_global_v4(addr, w0, w1, w2, w3, *, loc=None, ip=None):
        """16-byte global store ``st.global.v4.b32`` (16 B aligned 64-bit address)."""
        _st("st.global.v4.b32 [$0], {$1, $2, $3, $4};", Int64, addr, Uint32, (w0, w1, w2, w3), loc, ip)

    @dsl_user_op
    def st_global_b32(addr, w, *, loc=None, ip=None):
        _st("st.global.b32 [$0], $1;", Int64, addr, Uint32, (w,), loc, ip)

    @dsl_user_op
    def st_global_f32(addr, x, *, loc=None, ip=None):
        _st("st.global.f32 [$0], $1;", Int64, addr, Float32, (x,), loc, ip)

    @dsl_user_op
    def st_global_b64(addr, x0, x1, *, loc=None, ip=None):
        """``st.global.v2.f32`` of two fp32 values at an 8-byte aligned address."""
        _st("st.global.v2.f32 [$0], {$1, $2};", Int64, addr, Float32, (x0, x1), loc, ip)

    @dsl_user_op
    def e4m3_byte_to_f32(b, *, loc=None, ip=None):
        """The E4M3 value of the low byte of ``b`` as fp32 (exact: ``cvt.rn.f16x2.e4m3x2``)."""
        return Float32(_asm(T.f32(), "{\n.reg .b16 t, lo, hi;\n.reg .b32 p;\ncvt.u16.u32 t, $1;\n"
                                     "cvt.rn.f16x2.e4m3x2 p, t;\nmov.b32 {lo, hi}, p;\ncvt.f32.f16 $0, lo;\n}",
                            "=f,r", [_v(b, Uint32, loc, ip)], side=False, loc=loc, ip=ip))

    @dsl_user_op
    def mulhi_shift(a, m, sh, *, loc=None, ip=None):
        """``(a * m) >> sh`` (u32 x u32 -> u64 product, ``32 <= sh < 64``): ``a // bs`` for ``a < 2^31`` with the
        host's magic pair ``(m, sh) = slot_magic(bs)``."""
        return Uint32(_asm(T.i32(), "{\n.reg .b64 p;\nmul.wide.u32 p, $1, $2;\nshr.b64 p, p, $3;\ncvt.u32.u64 $0, p;\n}",
                           "=r,r,r,r", [_v(a, Uint32, loc, ip), _v(m, Uint32, loc, ip), _v(sh, Int32, loc, ip)],
                           side=False, loc=loc, ip=ip))
