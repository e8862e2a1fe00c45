"""CuTe DSL providers for ``kv_cache_append`` and ``kv_gather`` (DSV4 paged KV caches).

Contracts: docs/layouts/kv_cache_append.md, kv_gather.md (``dsv4.ops.kv_cache``); byte layout of
the ``fp8_ds_mla`` token (584 B: 448 E4M3 nope + 64 BF16 rope at ``page*bs*584 + off*576``, 7
UE8M0 scales + 1 pad byte at ``page*bs*584 + bs*576 + off*8``) and of the ``bf16`` cache
(``[nb, bs, 512]`` fake-quantized values) in the module docstring of ``dsv4/ops/kv_cache.py``.
Both kernels are bit-exact against ``dsv4/reference/kv_cache.py``.

:class:`KvAppendKernel` (one warp per token; ``Int64`` addresses, no 8 GiB limit)
    Every lane loads the token's slot and its 32 bytes of the 1 KB row (dims ``16 l .. 16 l + 15``,
    two ``ld.global.nc.v4``) up front, and the row math runs before the slot test, so that the slot and
    the row come in one memory round trip. Block-64 amax on the packed bf16 bits (``|bits|`` order =
    ``|value|`` order: three ``max.xorsign.abs.bf16x2`` per 8 values, 4 lanes by ``shfl.bfly``; a row
    with Inf / NaN takes a warp-uniform branch to the finite-only max), UE8M0 scale
    ``2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))`` (exponent-field arithmetic), ``x * 2^-k`` (exact:
    equal to the reference's ``x / s``), ``cvt.rn.satfinite.e4m3x2.f32`` (= clamp to +-448 then RNE);
    the page division is the host's magic multiply (:func:`kernels_dsl.sm90.ptx.slot_magic`,
    ``slot < 2^31``); lanes 0..27 store 16 E4M3 bytes each (448 contiguous bytes per warp instruction),
    lanes 28..31 the rope dims (2 x 16 B); the 7 scale bytes + pad are gathered by shuffles and lane 0
    stores them as one 8-byte word. ``bf16`` caches get ``e4m3 * s`` (exact) in 2 x 16 B per lane.
    Slots outside ``[0, num_blocks * bs)`` are skipped (never written). About 150 SASS instructions per
    lane and token (the former kernel: ~300, issue-bound at 68% of copy BW; job kv9-01).

:class:`KvGatherKernel` (one warp per ``rows`` consecutive output rows)
    Lane ``j`` resolves row ``j`` of the warp (``row -> (t, c)``, index load, request,
    ``lens[req]``, block_table load, page checks) into a byte offset, so the dependent
    index -> page -> data loads of ``rows`` rows overlap. Then, ``group`` rows at a time, the
    offsets are broadcast by ``shfl.idx`` and every row is loaded in 16-byte chunks (576 B
    data: 36 chunks, lanes 0..31 + 0..3; ``bf16``: 1 KB, 2 chunks per lane) plus its 8-byte
    scale word; ``fp8_ds_mla`` rows are parked in shared memory (per warp) so that lane ``l``
    then decodes the 16-byte output units ``l`` and ``l + 32`` (8 E4M3 bytes x 2^(sf-127),
    exact in bf16; units 56..63 = the rope bytes) and every store instruction of the warp writes
    512 contiguous bytes. Invalid rows (``l < 0``, ``l >= lens[req]``, a request outside the
    block_table, a page index past ``max_blocks``, a page outside ``[0, num_blocks)``) are
    zeros and read nothing.

Walls: none. Sizes are runtime values; one compile per (op, format, index dtype / optional
arguments present, config, arch). One launch per call, no host sync, CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, compile_variants, i32, i64, launch_on
from .sm90.ptx import slot_magic

try:  # the DSL is optional at import time: the provider then reports "unavailable"
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass.memory import SmemAllocator

    from ._quantize_ptx import chunk_absmax, finite_chunk_absmax, shfl_bfly_max, vote_any
    from .dequant_fp4 import l2_prefetch_kw
    from .sm90 import fp4
    from .sm90.ptx import ld_global_nc_b32, mulhi_shift, st_global_v4
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["KvAppendConfig", "KvGatherConfig", "KvAppendKernel", "KvGatherKernel", "DslKvCacheAppend",
           "DslKvGather", "PROVIDERS", "compile_check", "PTX_PATTERNS"]

#: what every compiled variant's PTX must contain (tests/test_compile_dsl.py)
PTX_PATTERNS = (r"\.target\s+sm_90a", r"ld\.global\.nc\.v4\.(b|u)32", r"st\.global\.v4\.(b|u)32")
#: flush-to-zero would change subnormal values
PTX_FORBIDDEN = (r"\.ftz\b",)

TOKEN_B, DATA_B, SF_B, NOPE = 584, 576, 8, 448


@dataclass(frozen=True)
class KvAppendConfig:
    """``threads`` per CTA (one warp per token)."""
    threads: int = 256


@dataclass(frozen=True)
class KvGatherConfig:
    """``rows`` output rows per warp (resolved by lanes 0..rows-1), loaded ``group`` at a time;
    ``l2_prefetch`` (0, 64, 128, 256): ``.L2::<n>B`` prefetch size of the cache row loads."""
    rows: int = 2
    group: int = 2
    threads: int = 128
    l2_prefetch: int = 0


#: defaults = the measured winners (H200, CUDA-graph replay, bit-exact; the sweeps of both kernels' geometries are in
#: docs/benchmarks.md: "kv_cache_append and the indexer quantizers" (ninth session) and "indexer quantizers on an
#: fp32 Hadamard contract, kv_cache_append, kv_gather" (eighth session)).
DEFAULT_APPEND = KvAppendConfig()
DEFAULT_GATHER = KvGatherConfig()
#: benchmark hook ({"append": KvAppendConfig(..), "gather": KvGatherConfig(..)}); empty in production
VARIANT: dict = {}


if _HAVE_DSL:

    def _pow2_bits(b):
        """fp32 bits of 2^(b - 127) for an exponent byte 1 <= b <= 254."""
        return Uint32(b) << 23

    def _e4m3_to_bf16_words(words, s):
        """The E4M3 bytes of ``words`` (4 per word, byte 0 first) times the fp32 power of two ``s`` (exact in bf16)
        -> bf16 pairs, 2 words per input word."""
        n = len(words)
        rf = cute.make_rmem_tensor((4 * n,), Float32)
        for k in range(n):
            x0, x1 = fp4.e4m3x2_to_f32x2(words[k])
            x2, x3 = fp4.e4m3x2_to_f32x2(words[k] >> 16)
            rf[4 * k] = x0 * s
            rf[4 * k + 1] = x1 * s
            rf[4 * k + 2] = x2 * s
            rf[4 * k + 3] = x3 * s
        rh = cute.make_rmem_tensor((4 * n,), BFloat16)
        rh.store(rf.load().to(BFloat16))
        rw = cute.recast_tensor(rh, Uint32)
        return [rw[i] for i in range(2 * n)]

    def _dequant_unit(sWords, sf_lo, sf_hi, un, res):
        """Output unit ``un`` (< 56) of an fp8_ds_mla row staged in ``sWords``: E4M3 bytes
        ``8 un .. 8 un + 7`` times ``2^(sf - 127)`` (scale byte ``un / 8`` of the 8-byte word
        ``{sf_lo, sf_hi}``; 0 -> 2^-127, 0xFF -> NaN), exact, as 4 words of bf16 pairs in ``res``."""
        g = un // 8
        sh = Uint32(8) * Uint32(g % 4)
        sbyte = (cutlass.select_(g < 4, Uint32(sf_lo), Uint32(sf_hi)) >> sh) & Uint32(0xFF)
        out = _e4m3_to_bf16_words([sWords[2 * un], sWords[2 * un + 1]], fp4.ue8m0_to_f32(sbyte))
        for k in range(4):
            res[k] = out[k]

    @dsl_user_op
    def _ld_v4(addr, *, loc=None, ip=None):
        """``ld.global.nc.v4.u32`` (read-only path) -> 4 words."""
        r = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4), [Int64(addr).ir_value(loc=loc, ip=ip)],
                            "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", has_side_effects=True,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return [Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]

    @dsl_user_op
    def _st_v2(addr, lo, hi, *, loc=None, ip=None):
        llvm.inline_asm(None, [Int64(addr).ir_value(loc=loc, ip=ip), Uint32(lo).ir_value(loc=loc, ip=ip),
                               Uint32(hi).ir_value(loc=loc, ip=ip)],
                        "st.global.v2.b32 [$0], {$1, $2};", "l,r,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)

    class KvAppendKernel:
        """``__call__(kv, slots, cache, n, n_slots, bs, dm, dsh, n_ctas, stream)`` (``Int64`` addresses): one warp
        per token, the 16 values of a lane as two 16-byte words; block-64 amax on the packed bf16 bits
        (``|bits|`` order = ``|value|`` order; a warp-uniform branch to the finite-only max when a row holds
        Inf / NaN), the page division by the host's magic multiply (``slot < 2^31``)."""

        def __init__(self, fmt: str, slot64: bool, config: KvAppendConfig):
            self.fmt = fmt
            self.slot64 = slot64
            self.cfg = config

        @cute.jit
        def __call__(self, kv: Int64, slots: Int64, cache: Int64, n: Int64, n_slots: Int64, bs: Int32, dm: Int64,
                     dsh: Int32, n_ctas: Int32, stream: cuda.CUstream):
            self.kernel(kv, slots, cache, n, n_slots, bs, dm, dsh).launch(
                grid=[n_ctas, 1, 1], block=[self.cfg.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, kv: Int64, slots: Int64, cache: Int64, n: Int64, n_slots: Int64, bs: Int32, dm: Int64,
                   dsh: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            t = Int64(bidx) * (self.cfg.threads // 32) + Int64(warp)
            tt = cutlass.select_(t < n, t, Int64(0))
            slot = Int64(0)
            if cutlass.const_expr(self.slot64):
                lo = ld_global_nc_b32(slots + tt * 8)
                hi = ld_global_nc_b32(slots + tt * 8 + 4)
                slot = (Int64(hi) << 32) | Int64(lo)
            else:
                slot = Int64(Int32(ld_global_nc_b32(slots + tt * 4)))
            src = kv + tt * 1024 + Int64(lane) * 32
            wa = _ld_v4(src)
            wb = _ld_v4(src + 16)
            # the row's math before the slot test: the row loads then issue with the slot load (one round trip)
            h = cutlass.max(chunk_absmax(wa, False), chunk_absmax(wb, False))
            if vote_any(Int32(h >= Uint32(0x7F80))) != Uint32(0):  # Inf / NaN count as 0
                h = cutlass.max(finite_chunk_absmax(wa, 0x7F80), finite_chunk_absmax(wb, 0x7F80))
            h = shfl_bfly_max(h, 1)
            h = shfl_bfly_max(h, 2)
            amax = fp4.bits_to_f32(h << 16)
            # UE8M0 byte of 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) (a normal fp32)
            xb = fp4.f32_to_bits(cutlass.max(amax, Float32(1e-4)) * Float32(1.0 / 448.0))
            sb = ((xb >> 23) & Uint32(0xFF)) + cutlass.select_((xb & Uint32(0x7FFFFF)) != Uint32(0),
                                                               Uint32(1), Uint32(0))
            inv = fp4.bits_to_f32((Uint32(254) - sb) << 23)       # 2^-k exactly (105 <= sb <= 247)
            f = []
            for w in wa + wb:
                f += [fp4.bits_to_f32(w << 16), fp4.bits_to_f32(w & Uint32(0xFFFF0000))]
            q = [fp4.cvt_e4m3x2_f32(f[4 * i] * inv, f[4 * i + 1] * inv)
                 | (fp4.cvt_e4m3x2_f32(f[4 * i + 2] * inv, f[4 * i + 3] * inv) << 16) for i in range(4)]
            if (t < n) & (slot >= Int64(0)) & (slot < n_slots):          # warp-uniform
                s32 = Uint32(slot)
                page = mulhi_shift(s32, Uint32(dm), dsh)
                off = s32 - page * Uint32(bs)
                if cutlass.const_expr(self.fmt == "fp8_ds_mla"):
                    base = cache + Int64(page) * (Int64(bs) * TOKEN_B)
                    data = base + Int64(off) * DATA_B
                    if lane < 28:                                      # 448 contiguous E4M3 bytes
                        st_global_v4(data + Int64(lane) * 16, *q)
                    else:                                              # rope dims: bf16 copy
                        r0 = data + NOPE + Int64(lane - 28) * 32
                        st_global_v4(r0, *wa)
                        st_global_v4(r0 + 16, *wb)
                    # the 7 scale bytes (lanes 0, 4, .., 24) + pad 0 -> one 8-byte word from lane 0
                    lo_w = Uint32(0)
                    hi_w = Uint32(0)
                    for g in cutlass.range_constexpr(7):
                        v = cute.arch.shuffle_sync(sb, offset=4 * g)
                        if cutlass.const_expr(g < 4):
                            lo_w = lo_w | (v << (8 * g))
                        else:
                            hi_w = hi_w | (v << (8 * (g - 4)))
                    if lane == 0:
                        _st_v2(base + Int64(bs) * DATA_B + Int64(off) * SF_B, lo_w, hi_w)
                else:
                    dst = cache + Int64(s32) * 1024 + Int64(lane) * 32
                    if lane < 28:                                      # fake-quant: e4m3(x / s) * s, exact in bf16
                        rw = _e4m3_to_bf16_words(q, fp4.bits_to_f32(sb << 23))
                        st_global_v4(dst, *rw[:4])
                        st_global_v4(dst + 16, *rw[4:])
                    else:
                        st_global_v4(dst, *wa)
                        st_global_v4(dst + 16, *wb)

    class KvGatherKernel:
        """``__call__(cache, bt, lens, idx, req, swa_cache, swa_bt, swa_lens, swa_idx, out, bs, nb,
        swa_bs, swa_nb, stream)``: caches as Uint32 words (``fp8_ds_mla`` / ``bf16``, as
        :class:`KvAppendKernel`), ``bt`` / ``swa_bt`` Int32 ``[R, cols]`` (at least 1 x 1),
        ``lens`` / ``swa_lens`` Int32 ``[R]``, ``idx`` Int32 ``[T, K]``, ``swa_idx`` Int32
        ``[T, W]``, ``req`` Int32 ``[T]`` or None (request = t), ``out`` Uint32 words of bf16
        ``[T, W + K, 512]``. The SWA arguments are None when there is no window part."""

        def __init__(self, fmt: str, has_req: bool, has_swa: bool, config: KvGatherConfig = DEFAULT_GATHER):
            if fmt not in ("fp8_ds_mla", "bf16"):
                raise ValueError(f"fmt must be 'fp8_ds_mla' or 'bf16', got {fmt!r}")
            if config.rows > 32 or config.rows % config.group:
                raise ValueError(f"rows must be <= 32 and a multiple of group, got {config}")
            self.fmt = fmt
            self.has_req = has_req
            self.has_swa = has_swa
            self.cfg = config

        @cute.jit
        def __call__(self, mCache: cute.Tensor, mBt: cute.Tensor, mLens: cute.Tensor, mIdx: cute.Tensor,
                     mReq: Optional[cute.Tensor], mSwaCache: Optional[cute.Tensor], mSwaBt: Optional[cute.Tensor],
                     mSwaLens: Optional[cute.Tensor], mSwaIdx: Optional[cute.Tensor], mOut: cute.Tensor,
                     bs: Int32, nb: Int32, swa_bs: Int32, swa_nb: Int32, stream: cuda.CUstream):
            T, K = mIdx.shape
            W = Int32(0)
            if cutlass.const_expr(self.has_swa):
                W = mSwaIdx.shape[1]
            total = Int64(T) * Int64(W + K)
            per_cta = (self.cfg.threads // 32) * self.cfg.rows
            o_words = cute.size(mOut.shape)
            gOut = cute.zipped_divide(cute.make_tensor(mOut.iterator, cute.make_layout(o_words)), (4,))
            g16 = cute.zipped_divide(cute.make_tensor(mCache.iterator, cute.make_layout(cute.size(mCache.shape))), (4,))
            g8 = cute.zipped_divide(cute.make_tensor(mCache.iterator, cute.make_layout(cute.size(mCache.shape))), (2,))
            s16 = g16
            s8 = g8
            if cutlass.const_expr(self.has_swa):
                s16 = cute.zipped_divide(
                    cute.make_tensor(mSwaCache.iterator, cute.make_layout(cute.size(mSwaCache.shape))), (4,))
                s8 = cute.zipped_divide(
                    cute.make_tensor(mSwaCache.iterator, cute.make_layout(cute.size(mSwaCache.shape))), (2,))
            self.kernel(g16, g8, mBt, mLens, mIdx, mReq, s16, s8, mSwaBt, mSwaLens, mSwaIdx, gOut, bs, nb,
                        swa_bs, swa_nb, W, total).launch(
                grid=[cute.ceil_div(total, per_cta), 1, 1], block=[self.cfg.threads, 1, 1], stream=stream)

        @cute.jit
        def entry_page(self, mIdx: cute.Tensor, mLens: cute.Tensor, mBt: cute.Tensor, t: Int64, c: Int32, c0,
                       req: Int32, b_s: Int32):
            """Entry ``c - c0`` of list row ``t`` of request ``req`` in one cache: ``(l, page)``, its
            position ``l = mIdx[t, c - c0]`` and the page holding it, ``page = -1`` (a zero row) where
            ``req`` is outside the block table's rows, ``l`` outside ``[0, mLens[req])`` or ``l // b_s``
            past the table's columns."""
            l = Int32(-1)
            page = Int32(-1)
            if (req >= 0) & (req < mBt.shape[0]):
                l = mIdx[t, c - c0]
                ln = mLens[req]
                if (l >= 0) & (l < ln):
                    pi = l // b_s
                    if pi < mBt.shape[1]:
                        page = mBt[req, pi]
            return l, page

        @cute.kernel
        def kernel(self, g16: cute.Tensor, g8: cute.Tensor, mBt: cute.Tensor, mLens: cute.Tensor, mIdx: cute.Tensor,
                   mReq: Optional[cute.Tensor], s16: cute.Tensor, s8: cute.Tensor, mSwaBt: Optional[cute.Tensor],
                   mSwaLens: Optional[cute.Tensor], mSwaIdx: Optional[cute.Tensor], gOut: cute.Tensor,
                   bs: Int32, nb: Int32, swa_bs: Int32, swa_nb: Int32, W: Int32, total: Int64):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            RPW = self.cfg.rows
            G = self.cfg.group
            fp8 = self.fmt == "fp8_ds_mla"
            K = mIdx.shape[1]
            NS = Int64(W + K)
            r0 = (Int64(bidx) * (self.cfg.threads // 32) + Int64(warp)) * RPW
            # ---- lane j < RPW resolves row r0 + j: src = byte offset of the token row, -1 = zero
            # row, -2 = past the output (no store); sw = 1 when the row comes from the SWA cache
            src = Int64(-2)
            sfo = Int64(0)
            sw = Int32(0)
            r = r0 + Int64(lane)
            if (lane < RPW) & (r < total):
                src = Int64(-1)
                t = r // NS
                c = Int32(r - t * NS)
                req = Int32(t)
                if cutlass.const_expr(self.has_req):
                    req = mReq[t]
                l = Int32(-1)
                b_s = bs
                n_b = nb
                page = Int32(-1)
                if cutlass.const_expr(self.has_swa):
                    if c < W:
                        sw = Int32(1)
                        b_s = swa_bs
                        n_b = swa_nb
                        l, page = self.entry_page(mSwaIdx, mSwaLens, mSwaBt, t, c, 0, req, b_s)
                    else:
                        l, page = self.entry_page(mIdx, mLens, mBt, t, c, W, req, b_s)
                else:
                    l, page = self.entry_page(mIdx, mLens, mBt, t, c, 0, req, b_s)
                if (page >= 0) & (page < n_b):
                    off = Int64(l - (l // b_s) * b_s)
                    if cutlass.const_expr(fp8):
                        base = Int64(page) * Int64(b_s) * TOKEN_B
                        src = base + off * DATA_B
                        sfo = base + Int64(b_s) * DATA_B + off * SF_B
                    else:
                        src = (Int64(page) * Int64(b_s) + off) * 1024
            ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128,
                                       **l2_prefetch_kw(self.cfg.l2_prefetch))
            ld8 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=64, invariant=True)
            st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
            st16s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
            zero = cute.make_rmem_tensor((4,), Uint32)
            zero.fill(0)
            # per warp: G staged fp8 rows of 36 chunks (4 words each, a row's 144 words contiguous)
            nw = self.cfg.threads // 32
            sRow = SmemAllocator().allocate_tensor(Uint32, cute.make_layout((4, 36 * G * nw)), byte_alignment=16)
            for grp in cutlass.range(RPW // G, unroll=1):
                rsrc = cute.make_rmem_tensor((G,), Int64)
                rsfo = cute.make_rmem_tensor((G,), Int64)
                rsw = cute.make_rmem_tensor((G,), Int32)
                rA = cute.make_rmem_tensor((4, G), Uint32)
                rB = cute.make_rmem_tensor((4, G), Uint32)
                rS = cute.make_rmem_tensor((2, G), Uint32)
                rA.fill(0)
                rB.fill(0)
                rS.fill(0)
                for i in cutlass.range_constexpr(G):
                    j = grp * G + i
                    rsrc[i] = cute.arch.shuffle_sync(src, offset=j)
                    rsfo[i] = cute.arch.shuffle_sync(sfo, offset=j)
                    rsw[i] = cute.arch.shuffle_sync(sw, offset=j)
                cute.arch.sync_warp()                         # the previous group's smem reads are done
                for i in cutlass.range_constexpr(G):          # every load of the group first
                    if rsrc[i] >= 0:
                        u0 = rsrc[i] // 16 + Int64(lane)
                        if cutlass.const_expr(fp8):
                            if rsw[i] != 0:
                                cute.copy(ld16, s16[(None, u0)], rA[(None, i)])
                                cute.copy(ld8, s8[(None, rsfo[i] // 8)], rS[(None, i)])
                                if lane < 4:
                                    cute.copy(ld16, s16[(None, u0 + 32)], rB[(None, i)])
                            else:
                                cute.copy(ld16, g16[(None, u0)], rA[(None, i)])
                                cute.copy(ld8, g8[(None, rsfo[i] // 8)], rS[(None, i)])
                                if lane < 4:
                                    cute.copy(ld16, g16[(None, u0 + 32)], rB[(None, i)])
                        else:
                            if rsw[i] != 0:
                                cute.copy(ld16, s16[(None, u0)], rA[(None, i)])
                                cute.copy(ld16, s16[(None, u0 + 32)], rB[(None, i)])
                            else:
                                cute.copy(ld16, g16[(None, u0)], rA[(None, i)])
                                cute.copy(ld16, g16[(None, u0 + 32)], rB[(None, i)])
                if cutlass.const_expr(fp8):
                    for i in cutlass.range_constexpr(G):
                        col = (warp * G + i) * 36
                        cute.copy(st16s, rA[(None, i)], sRow[(None, col + lane)])
                        if lane < 4:
                            cute.copy(st16s, rB[(None, i)], sRow[(None, col + 32 + lane)])
                    cute.arch.sync_warp()
                for i in cutlass.range_constexpr(G):
                    j = grp * G + i
                    if rsrc[i] >= -1:
                        ou = (r0 + j) * 64 + Int64(lane)     # 16-byte output units lane and lane + 32
                        if rsrc[i] == -1:
                            cute.copy(st16, zero, gOut[(None, ou)])
                            cute.copy(st16, zero, gOut[(None, ou + 32)])
                        else:
                            if cutlass.const_expr(fp8):
                                sWords = cute.make_tensor(sRow[(None, (warp * G + i) * 36)].iterator,
                                                          cute.make_layout(144))
                                # unit lane: nope values 8 lane .. 8 lane + 7 (scale group lane / 8)
                                res = cute.make_rmem_tensor((4,), Uint32)
                                _dequant_unit(sWords, rS[0, i], rS[1, i], Int32(lane), res)
                                cute.copy(st16, res, gOut[(None, ou)])
                                # unit lane + 32: nope for lane < 24, the rope bf16 bytes for lanes 24..31
                                if lane < 24:
                                    _dequant_unit(sWords, rS[0, i], rS[1, i], Int32(lane) + 32, res)
                                else:
                                    for k in cutlass.range_constexpr(4):
                                        res[k] = sWords[112 + 4 * (lane - 24) + k]
                                cute.copy(st16, res, gOut[(None, ou + 32)])
                            else:
                                cute.copy(st16, rA[(None, i)], gOut[(None, ou)])
                                cute.copy(st16, rB[(None, i)], gOut[(None, ou + 32)])



def _fake_flat(sym: str):
    from cutlass.cute.runtime import make_fake_compact_tensor
    return make_fake_compact_tensor(Uint32, (cute.sym_int32(symbol=sym),), assumed_align=16)


def _fake_2d(dt, a: str, b: str):
    from cutlass.cute.runtime import make_fake_compact_tensor
    return make_fake_compact_tensor(dt, (cute.sym_int32(symbol=a), cute.sym_int32(symbol=b)), stride_order=(1, 0),
                                    assumed_align=4)


def _fake_1d(dt, a: str, align: int = 4):
    from cutlass.cute.runtime import make_fake_compact_tensor
    return make_fake_compact_tensor(dt, (cute.sym_int32(symbol=a),), assumed_align=align)


def _compile_append(fmt: str, slot64: bool, arch: str, extra: str = "", config: KvAppendConfig | None = None):
    from cutlass.cute.runtime import make_fake_stream
    kern = KvAppendKernel(fmt, slot64, config or VARIANT.get("append", DEFAULT_APPEND))
    z, i = Int64(0), Int32(0)
    return cute.compile(kern, z, z, z, z, z, i, z, i, i, make_fake_stream(), options=compile_options(arch, extra))


def _fake_words(sym: str, rank: int):
    """Uint32 words of a contiguous tensor of ``rank`` dims (1: flat); ``__call__`` reads only its size and base."""
    if rank == 1:
        return _fake_flat(sym)
    from cutlass.cute.runtime import make_fake_compact_tensor
    return make_fake_compact_tensor(Uint32, tuple(cute.sym_int32(symbol=f"{sym}{i}") for i in range(rank)),
                                    stride_order=tuple(range(rank - 1, -1, -1)), assumed_align=16)


def _compile_gather(fmt: str, has_req: bool, has_swa: bool, arch: str, extra: str = "",
                    config: KvGatherConfig | None = None, ranks: tuple = (1, 1, 1)):
    """``ranks``: of the word views of the cache, the SWA cache and the output (their own shapes: one view
    op each on the host instead of a flat re-shape, the kernel sees the same flat words)."""
    from cutlass.cute.runtime import make_fake_stream
    kern = KvGatherKernel(fmt, has_req, has_swa, config or VARIANT.get("gather", DEFAULT_GATHER))
    swa = (_fake_words("Ws", ranks[1]), _fake_2d(Int32, "Rs", "Cs"), _fake_1d(Int32, "Rs2"),
           _fake_2d(Int32, "T2", "W")) if has_swa else (None, None, None, None)
    return cute.compile(kern, _fake_words("Wc", ranks[0]), _fake_2d(Int32, "R", "C"), _fake_1d(Int32, "R1"),
                        _fake_2d(Int32, "T", "K"), _fake_1d(Int32, "T1") if has_req else None, *swa,
                        _fake_words("O", ranks[2]), Int32(2), Int32(1), Int32(2), Int32(1), make_fake_stream(),
                        options=compile_options(arch, extra))


#: variants compiled by tests/test_compile_dsl.py (every specialization the providers launch)
CHECK_VARIANTS = {
    **{f"append-{f}-{'i64' if s64 else 'i32'}": (lambda a, e, f=f, s64=s64: _compile_append(f, s64, a, e))
       for f in ("fp8_ds_mla", "bf16") for s64 in (False, True)},
    **{f"gather-{f}-{'req' if r else 'noreq'}-{'swa' if w else 'noswa'}":
       (lambda a, e, f=f, r=r, w=w: _compile_gather(f, r, w, a, e))
       for f in ("fp8_ds_mla", "bf16") for r in (False, True) for w in (False, True)},
    # the word views in the tensors' own shapes (what the TVM-FFI path launches: DslKvGather.run, _words)
    "gather-fp8_ds_mla-noreq-swa-nd": lambda a, e: _compile_gather("fp8_ds_mla", False, True, a, e, ranks=(3, 3, 3)),
}


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a", only=None) -> dict[str, str]:
    """Compile every specialization for ``arch`` without a GPU; ``{variant: PTX text}``."""
    return compile_variants("kv_cache", CHECK_VARIANTS, dump_dir, arch, only)


def _u32(t, align: int = 16):
    """torch tensor (any dtype, contiguous) -> flat CuTe Uint32 tensor over its bytes."""
    import torch
    from ._compile import dl
    return dl(t.reshape(-1).view(torch.uint8).view(torch.int32), align, Uint32)


def _words(t):
    """``(kernel argument, rank)``: a contiguous tensor as Uint32 words in its own shape (TVM-FFI path, last dim
    a whole number of words: one dtype view), else flat (:func:`_u32`)."""
    import torch

    from ._compile import fast_call
    if fast_call() and t.dim() >= 1 and t.is_contiguous() and t.shape[-1] * t.element_size() % 4 == 0:
        return (t if t.dtype == torch.uint32 else t.view(torch.uint32)), t.dim()
    return _u32(t), 1


#: why these providers come before cuda (the registry takes the first that supports a problem; timings:
#: docs/benchmarks.md, "kv_cache_append and the indexer quantizers" and the kv_gather sections)
WHY_FIRST = {
    "kv_cache_append": "faster than the deleted cuda kernel at every measured size (docs/benchmarks.md)",
    "kv_gather": "at or below the cuda provider at the measured decode / prefill sizes (docs/benchmarks.md)",
}


def _fmt_ok(problem, op: str) -> Support:
    if problem.get("fmt") not in ("fp8_ds_mla", "bf16"):
        return Support.no(f"dsl: format {problem.get('fmt')!r} not supported (fp8_ds_mla, bf16)")
    if op == "kv_gather" and not problem.get("i32", True):
        return Support.no("dsl: a cache or output over 2^31 32-bit words (8 GiB): the flat extents are int32 "
                          "(the cuda provider runs it)")
    return Support.yes("sm_90a; " + WHY_FIRST[op])


class _KvDsl(DslProvider):
    #: ``(VARIANT key, default config)``: the one frozen config ``run`` launches at every size
    cfg: tuple = ()

    def supports_problem(self, problem):
        return _fmt_ok(problem, self.op.name)

    def config(self, problem, target=None):
        """The frozen config ``run`` launches (:data:`VARIANT` override, else the default)."""
        return VARIANT.get(*self.cfg)


class DslKvCacheAppend(_KvDsl):
    cfg = ("append", DEFAULT_APPEND)
    describe = ("CuTe DSL KvAppendKernel: warp per token, slot + row in one round trip, packed-bf16 amax, "
                "cvt e4m3x2, host page magic, 16 B stores")

    def run(self, problem, *, cache, kv, slot_mapping):
        import torch

        from dsv4.target import Target

        n = kv.shape[0]
        if n == 0:
            return
        fmt = problem["fmt"]
        bs = cache.shape[1] // TOKEN_B if (fmt == "fp8_ds_mla" and cache.dim() == 2) else cache.shape[1]
        arch = Target.of(kv.device).arch
        s64 = slot_mapping.dtype == torch.int64
        cfg = self.config(problem)
        fn = compile_cached(("kv_cache_append", fmt, s64, cfg, arch), lambda: _compile_append(fmt, s64, arch, config=cfg))
        dm, dsh = slot_magic(bs)
        launch_on(kv.device, fn, i64(kv.data_ptr()), i64(slot_mapping.data_ptr()), i64(cache.data_ptr()), i64(n),
                  i64(cache.shape[0] * bs), i32(bs), i64(dm), i32(dsh), i32(-(-n // (cfg.threads // 32))))


def _table(bt, lens, dev):
    """An empty block table (0 rows or 0 columns) -> a 1 x 1 table of -1 and lens 0: every row is zero."""
    import torch
    if bt.numel() == 0:
        return (torch.full((1, 1), -1, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev))
    return bt, lens


class DslKvGather(_KvDsl):
    cfg = ("gather", DEFAULT_GATHER)
    describe = ("CuTe DSL KvGatherKernel: lanes resolve rows (index, lens, block_table) in parallel, 16 B row loads, "
                "smem-staged exact E4M3 -> BF16, 512 B-contiguous warp stores")

    def run(self, problem, *, cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table, swa_indices,
            swa_lens):
        import torch

        from dsv4.target import Target

        from ._compile import dl
        T, K = indices.shape
        W = swa_indices.shape[1] if swa_indices is not None else 0
        out = torch.empty((T, W + K, 512), dtype=torch.bfloat16, device=indices.device)
        if out.numel() == 0:
            return out
        fmt = problem["fmt"]
        arch = Target.of(indices.device).arch
        has_req, has_swa = req_idx is not None, swa_indices is not None
        cfg = self.config(problem)
        cw, rc = _words(cache)
        sw, rs = _words(swa_cache) if has_swa else (None, 1)
        ow, ro = _words(out)
        ranks = (rc, rs, ro)
        fn = compile_cached(("kv_gather", fmt, has_req, has_swa, cfg, arch) + ((ranks,) if ranks != (1, 1, 1) else ()),
                            lambda: _compile_gather(fmt, has_req, has_swa, arch, config=cfg, ranks=ranks))

        def bsz(c):
            return c.shape[1] // TOKEN_B if (fmt == "fp8_ds_mla" and c.dim() == 2) else c.shape[1]
        dev = indices.device
        bt, ln = _table(block_table, lens, dev)
        if has_swa:
            sbt, sln = _table(swa_block_table, swa_lens, dev)
            swa = (sw, dl(sbt, 4), dl(sln, 4), dl(swa_indices, 4))
            sbs, snb = bsz(swa_cache), swa_cache.shape[0]
        else:
            swa, sbs, snb = (None, None, None, None), 1, 0
        launch_on(dev, fn, cw, dl(bt, 4), dl(ln, 4), dl(indices, 4), dl(req_idx, 4) if has_req else None,
                  *swa, ow, i32(bsz(cache)), i32(cache.shape[0]), i32(sbs), i32(snb))
        return out


PROVIDERS = {"kv_cache_append": DslKvCacheAppend, "kv_gather": DslKvGather}
