"""PTX building blocks of the Lightning Indexer DSL kernels (kernels_dsl/indexer_*.py).

Raw shared-memory addresses (32-bit, ``Pointer.toint()`` of an smem pointer) and global
addresses (64-bit) go straight into a handful of PTX instructions that the CuTe DSL does not
expose in this form: 1-D bulk copies global -> shared completed on an mbarrier (the page loads
of the paged cache), mbarrier init / arrive / expect-tx / parity wait on an address, 16-byte
shared loads / stores (the operand transforms), and a bounded-range warp scan. Every function
is a ``dsl_user_op``; memory operations carry ``has_side_effects`` (never hoisted or merged
across the barriers that order them), pure ones do not.
"""
from __future__ import annotations

try:
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["bulk_g2s", "mbar_init", "mbar_fence_init", "mbar_arrive", "mbar_arrive_expect_tx", "mbar_wait",
           "ld_shared_v4", "ld_shared_v2_f32", "ld_shared_u32", "ld_shared_f32", "st_shared_v4", "st_shared_u32", "st_shared_f32",
           "fence_proxy_async", "named_barrier"]


if _HAVE_DSL:

    def _ir(x, ty, loc, ip):
        return ty(x).ir_value(loc=loc, ip=ip)

    def _asm(ret, args, ptx, cons, side_effects, loc, ip):
        return llvm.inline_asm(ret, args, ptx, cons, has_side_effects=side_effects, is_align_stack=False,
                               asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    @dsl_user_op
    def bulk_g2s(dst, src, nbytes, mbar, *, loc=None, ip=None):
        """``cp.async.bulk`` of ``nbytes`` (multiple of 16) from global address ``src`` (Int64, 16 B
        aligned) to shared address ``dst`` (Int32, 16 B aligned); completes ``nbytes`` of
        transaction count on the mbarrier at shared address ``mbar``. One thread issues it."""
        _asm(None, [_ir(dst, Int32, loc, ip), _ir(src, Int64, loc, ip), _ir(nbytes, Int32, loc, ip),
                    _ir(mbar, Int32, loc, ip)],
             "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
             "r,l,r,r", True, loc, ip)

    @dsl_user_op
    def mbar_init(mbar, count, *, loc=None, ip=None):
        """``mbarrier.init.shared::cta.b64 [mbar], count`` (one thread)."""
        _asm(None, [_ir(mbar, Int32, loc, ip), _ir(count, Int32, loc, ip)],
             "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", True, loc, ip)

    @dsl_user_op
    def mbar_fence_init(*, loc=None, ip=None):
        """Make mbarrier initializations visible to the async proxy (bulk copies)."""
        _asm(None, [], "fence.mbarrier_init.release.cluster;", "", True, loc, ip)

    @dsl_user_op
    def mbar_arrive(mbar, *, loc=None, ip=None):
        """One arrival on the mbarrier (release semantics, CTA scope)."""
        _asm(None, [_ir(mbar, Int32, loc, ip)],
             "{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [$0];\n}", "r", True, loc, ip)

    @dsl_user_op
    def mbar_arrive_expect_tx(mbar, nbytes, *, loc=None, ip=None):
        """One arrival plus an expected transaction count of ``nbytes`` (the bulk copies that
        complete on this barrier)."""
        _asm(None, [_ir(mbar, Int32, loc, ip), _ir(nbytes, Int32, loc, ip)],
             "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n}", "r,r", True, loc, ip)

    @dsl_user_op
    def mbar_wait(mbar, parity, *, loc=None, ip=None):
        """Spin until the phase of parity ``parity`` (0/1) of the mbarrier has completed
        (``mbarrier.try_wait.parity``; acquire semantics)."""
        _asm(None, [_ir(mbar, Int32, loc, ip), _ir(parity, Int32, loc, ip)],
             "{\n.reg .pred p;\nLAB_WAIT:\n"
             "mbarrier.try_wait.parity.shared::cta.b64 p, [$0], $1;\n"
             "@!p bra LAB_WAIT;\n}", "r,r", True, loc, ip)

    @dsl_user_op
    def ld_shared_v4(addr, *, loc=None, ip=None):
        """16-byte shared load -> 4 x Uint32."""
        st = llvm.StructType.get_literal([T.i32()] * 4)
        r = _asm(st, [_ir(addr, Int32, loc, ip)], "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];",
                 "=r,=r,=r,=r,r", True, loc, ip)
        return tuple(Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4))

    @dsl_user_op
    def ld_shared_v2_f32(addr, *, loc=None, ip=None):
        """8-byte shared load -> 2 x Float32 (addr 8 B aligned)."""
        st = llvm.StructType.get_literal([T.f32()] * 2)
        r = _asm(st, [_ir(addr, Int32, loc, ip)], "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", True, loc, ip)
        return tuple(Float32(llvm.extractvalue(T.f32(), r, [i], loc=loc, ip=ip)) for i in range(2))

    @dsl_user_op
    def ld_shared_u32(addr, *, loc=None, ip=None):
        return Uint32(_asm(T.i32(), [_ir(addr, Int32, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", True, loc, ip))

    @dsl_user_op
    def ld_shared_f32(addr, *, loc=None, ip=None):
        return Float32(_asm(T.f32(), [_ir(addr, Int32, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", True, loc, ip))

    @dsl_user_op
    def st_shared_v4(addr, a, b, c, d, *, loc=None, ip=None):
        """16-byte shared store of 4 x 32-bit words (addr 16 B aligned)."""
        _asm(None, [_ir(addr, Int32, loc, ip)] + [_ir(v, Uint32, loc, ip) for v in (a, b, c, d)],
             "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", True, loc, ip)

    @dsl_user_op
    def st_shared_u32(addr, v, *, loc=None, ip=None):
        _asm(None, [_ir(addr, Int32, loc, ip), _ir(v, Uint32, loc, ip)], "st.shared.b32 [$0], $1;", "r,r",
             True, loc, ip)

    @dsl_user_op
    def st_shared_f32(addr, v, *, loc=None, ip=None):
        _asm(None, [_ir(addr, Int32, loc, ip), _ir(v, Float32, loc, ip)], "st.shared.f32 [$0], $1;", "r,f",
             True, loc, ip)

    @dsl_user_op
    def fence_proxy_async(*, loc=None, ip=None):
        """Order this thread's generic-proxy shared-memory writes before later async-proxy reads
        (WGMMA operands) -- ``fence.proxy.async.shared::cta``."""
        _asm(None, [], "fence.proxy.async.shared::cta;", "", True, loc, ip)

    @dsl_user_op
    def named_barrier(bar_id: int, nthreads: int, *, loc=None, ip=None):
        """``bar.sync bar_id, nthreads`` (``nthreads`` a multiple of 32; id 0 is __syncthreads)."""
        _asm(None, [], f"bar.sync {int(bar_id)}, {int(nthreads)};", "", True, loc, ip)
