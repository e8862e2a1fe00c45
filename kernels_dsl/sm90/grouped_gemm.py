"""Persistent warp-specialized FP4-weight grouped GEMM for sm_90a (CuTe DSL): the MoE GEMM1
(W13 + DSV4 clamped SwiGLU * routing weight (+ FP8 1x128 UE8M0 requant)) and GEMM2 (W2, fp32
rows) of :mod:`kernels_dsl.moe`, for MXFP4 / NVFP4 weights and FP8 (W4A8) / BF16 (W4A16)
activations, contiguous and masked grouped layouts.

``out[r, n] = sum_k A[r, k] * W_e[n, k]`` for every grouped row ``r`` of expert ``e``
(``[row_start[e], row_start[e] + row_count[e])``), then the stage's epilogue.

Structure (one CTA per SM, persistent over work units = (token M-tile, 256-row weight tile);
:mod:`kernels_dsl.sm90.scheduler`):

* warpgroup 0 (``setmaxnreg.dec``), warp 0 = TMA producer: a ``stages``-deep ring guarded by
  ``PipelineTmaAsync`` mbarriers (``stages`` from the shared-memory capacity,
  :mod:`kernels_dsl.sm90.config`) whose stage ``j`` of a unit holds the packed weight tile
  ``[256 rows, BK/2 bytes]`` (+ its scale box) of K block ``j`` and the token tile ``[tile_m, BK]``
  (E4M3 / BF16, 128B swizzle; rows past the tensor end are zero-filled by the hardware, rows of the
  next expert are loaded but never stored) of K block ``j - 1``: exactly what the consumers use
  together (decode of ``j`` while the WGMMAs of ``j - 1`` run), so they hold one stage at a time
  and ``stages - 1`` loads stay in flight (``KB + 1`` stages per unit; stage 0 carries a spare copy
  of token block 0 and stage ``KB`` one of weight block ``KB - 1``, for a fixed transaction count);
* warpgroup 0, warps 1-3 = row prologue, running up to two work units ahead of the consumers:
  per unit the reference exponent of each of the 256 weight rows over its whole K and its column
  multiplier (:func:`kernels_dsl.sm90.transform.row_prologue`) into a 2-deep shared ring, handed
  over through named barriers (full: ``bar.arrive`` by the prologue warps, ``bar.sync`` by the
  consumers; empty: the reverse, after the unit's epilogue);
* 1-2 consumer warpgroups (``setmaxnreg.inc``), 64 token rows each, which also do the operand
  transform: consumer warpgroup ``w`` decodes its ``256 / consumers`` weight rows of each K block
  (packed E2M1 + UE8M0 / E4M3 scales; 4 or 8 (row, 16-byte chunk) items per thread; the scale
  bytes come with the TMA stage, or from global memory one K block ahead) into a double-buffered
  128B-swizzled E4M3 / BF16 tile: W4A8 with :meth:`Fp4GroupedGemmKernel._decode_fp8` (9 integer
  instructions per 8 codes, ``fp4.e2m1x8_to_e4m3x8_sm`` semantics: prmt magnitude LUT + sign masks
  from the sign-replicate prmt, shared by the NVFP4 hi / lo parts), W4A16 with
  :func:`kernels_dsl.sm90.transform.decode_row_chunk`. The decode of block ``k + 1`` runs while
  the tensor core executes the asynchronous WGMMAs of block ``k`` (issue, decode, ``wgmma.wait``);
  one ``fence.proxy.async`` + named barrier over the consumer warpgroups per K block publishes the
  decoded tile (and frees the other slot). MMA: WGMMA ``m64n128`` per half of the weight tile
  (two halves of 128 rows). W4A8: each 128-K block goes into a fresh fp32 accumulator which is
  then promoted, ``acc += partial * a_scale[row, kb]`` (DeepGEMM style; the weight scales are
  folded per row into the decoded E4M3 bytes relative to the row's reference exponent and applied
  once per column in the epilogue). NVFP4 under W4A8 adds a second WGMMA per K step on the lo
  part of the hi + lo split. W4A16: BF16 WGMMA into the accumulator (exact BF16 weights), no
  promotion.
* epilogue per tile: GEMM1 ``gate = bf16(acc * col_scale)``, ``up`` likewise (the prepared W13
  tile pairs gate / up columns inside one thread), ``h = bf16(silu(min(gate, 10)) *
  clamp(up, -10, 10) * route_w)``; FP8: per (row, 128 h columns) amax over the lane quad,
  UE8M0 scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, E4M3 ``h``, fp32 ``h_s``; GEMM2 ``y =
  acc * col_scale`` (fp32). Rows past an expert's count are never stored.

Registers: the launch gives 168 per thread (384 threads); ``setmaxnreg.inc`` only hands out what
``.dec`` released (a larger total deadlocks at launch), so warpgroup 0 + 2 consumer warpgroups
share 3 x 168: W4A8 24 / 240 (the consumer K loop then has no spill: 192 accumulator registers +
the decode; the producer / row-prologue warps spill a few words instead, off the critical path),
W4A16 40 / 232 (no spills either way). Timings of both splits: docs/benchmarks.md.

Precision contract (tests/test_moe.py, tests/test_moe_decode.py): W4A8 GEMM2 relative
(Frobenius) error vs the exact-dequant fp32 reference on the same FP8 ``h`` <= 5e-3, NVFP4
included; W4A16 <= 1e-5 (measured errors: docs/benchmarks.md). Weight-scale folding bounds:
:mod:`kernels_dsl.sm90.transform`.

Performance, profile (latency-bound consumer K loop, ~475 instructions per thread per 128-K block)
and the variants that lost: docs/benchmarks.md ("MoE grouped GEMMs in CuTe DSL").

Constraints (checked by the host wrapper, :mod:`kernels_dsl.moe`): ``K % BK == 0`` (128 FP8 /
64 BF16), ``N % 256 == 0``, ``K / SF % 4 == 0``, contiguous row-major tensors, 16-byte aligned
bases, ``E <= e_cap``.
"""
from __future__ import annotations

from .config import HALF_N, TILE_N, GroupedGemmConfig

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
    from .epilogue import epilogue_gemm1, epilogue_gemm2, promote
    from . import fp4
    from .ptx import ld_global_nc_f32, ld_shared_b32, ld_shared_v4, st_shared_b32, st_shared_v4
    from .scheduler import build_schedule, cta_ids, sched_words, unit_lookup
    from .transform import (HALF_TILE_BYTES, decode_row_chunk, decoded_offset, ld_nc_u8, ld_nc_u16, row_prologue,
                            row_prologue_v4)
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["Fp4GroupedGemmKernel"]

#: named barriers: decoded K block complete (all consumer warpgroups); row-prologue buffer b full
#: (prologue warps -> consumers) / empty (consumers -> prologue warps)
BAR_K = 1
BAR_PFULL = 2
BAR_PEMPTY = 4
#: row-prologue threads (warps 1-3 of warpgroup 0) and the (row, lane) items each handles per unit
PROLOGUE_THREADS = 96
ITEMS = -(-TILE_N * 4 // PROLOGUE_THREADS)


if _HAVE_DSL:

    class Fp4GroupedGemmKernel:
        """See the module docstring. ``__call__(mA, mAs, mW, mWs, mG, mRS, mRC, mRW, mOut, mOutS,
        n_w, num_ctas, stream)``:

        * ``mA``: activations ``[R, K]`` Float8E4M3FN (W4A8) or BFloat16 (W4A16), row-major.
        * ``mAs``: fp32 ``[R, K / 128]`` activation scales (W4A8; any fp32 tensor for W4A16).
        * ``mW``: Uint8 ``[E * n_w, K / 2]`` packed E2M1 (expert-major rows; GEMM1: the prepared
          W13 tile order of ``moe_prepare_weights``).
        * ``mWs``: Uint8 ``[E * n_w, K / SF]`` scale bytes (UE8M0 / E4M3).
        * ``mG``: fp32 ``[E, 2]`` (GEMM1: gate, up) or ``[E, 1]`` (GEMM2) global multipliers.
        * ``mRS``, ``mRC``: Int32 ``[E]`` row_start / row_count.
        * ``mRW``: fp32 ``[R]`` routing weights (GEMM1; any fp32 tensor for GEMM2).
        * ``mOut``: GEMM1 FP8: Uint8 ``[R, n_w / 2]`` (E4M3 bytes); GEMM1 BF16: BFloat16 ``[R, n_w / 2]``;
          GEMM2: fp32 ``[R, n_w]``.
        * ``mOutS``: GEMM1 FP8: fp32 ``[R, n_w / 256]`` h scales (any fp32 tensor otherwise).
        * ``n_w``: Int32 weight rows per expert (``N``); ``num_ctas``: Int32 persistent grid.
        """

        def __init__(self, cfg: GroupedGemmConfig, debug: int = 0):
            self.cfg = cfg
            self.fp8 = cfg.act == "fp8"
            self.nvfp4 = cfg.fmt == "nvfp4"
            self.bk = cfg.block_k
            self.pb = cfg.block_k // 2                      # packed bytes per row per K block
            self.nc = cfg.consumers
            self.parts = cfg.parts
            self.stages = cfg.stages
            self.tile_m = cfg.tile_m
            self.dtype = Float8E4M3FN if self.fp8 else BFloat16
            self.rows_wg = TILE_N // self.nc                  # weight rows decoded per consumer wg
            self.ni = self.rows_wg // 32                      # (row, chunk) items per thread per K block
            self.threads = cfg.threads
            # scale bytes of one thread's chunk per K block: MXFP4 1/32, NVFP4 1/16 values
            self.sf = cfg.sf
            #: scale bytes per row per K block, and K blocks per 16-byte scale box (scale_tma)
            self.spk = self.bk // self.sf
            self.q = 16 // self.spk
            self.scale_tma = cfg.scale_tma
            #: diagnostics only (wrong results): bit 1 no epilogue stores, 2 no transform global loads,
            #: 4 no activation-scale loads, 8 no decode smem traffic, 16 no WGMMA
            self.debug = debug
            #: W4A8 decodes with :meth:`_decode_fp8` (9-instruction words, sign masks shared by the NVFP4
            #: hi / lo parts); W4A16 with :func:`~kernels_dsl.sm90.transform.decode_row_chunk`
            self.fast_dec = self.fp8

        @cute.jit
        def __call__(self, mA: cute.Tensor, mAs: cute.Tensor, mW: cute.Tensor, mWs: cute.Tensor,
                     mG: cute.Tensor, mRS: cute.Tensor, mRC: cute.Tensor, mRW: cute.Tensor,
                     mOut: cute.Tensor, mOutS: cute.Tensor, n_w: Int32, num_ctas: Int32,
                     stream: cuda.CUstream):
            lay = LayoutEnum.ROW_MAJOR
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, lay.sm90_mma_major_mode(), lay.sm90_mma_major_mode(), Float32,
                (self.nc, 1, 1), tiler_mn=(64, HALF_N))
            tile = (self.tile_m, HALF_N, self.bk)
            sA_l = sm90_utils.make_smem_layout_a(lay, tile, self.dtype, self.stages)
            n_sub = 2 * 2 * self.parts                       # decoded: 2 slots x 2 halves x parts
            sD_l = sm90_utils.make_smem_layout_b(lay, tile, self.dtype, n_sub)
            sP_l = cute.make_layout((TILE_N, self.pb, self.stages), stride=(self.pb, 1, TILE_N * self.pb))
            tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA,
                                                    cute.slice_(sA_l, (None, None, 0)), (self.tile_m, self.bk))
            tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mW,
                                                    cute.make_layout((TILE_N, self.pb), stride=(self.pb, 1)),
                                                    (TILE_N, self.pb))
            # scale bytes: one 16-byte box per weight row per K block (the block's bytes first)
            sS_l = cute.make_layout((TILE_N, 16, self.stages), stride=(16, 1, TILE_N * 16))
            tma_s, tS = tma_b, tB
            if cutlass.const_expr(self.scale_tma):
                tma_s, tS = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mWs,
                                                        cute.make_layout((TILE_N, 16), stride=(16, 1)), (TILE_N, 16))

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sched: cute.struct.MemRange[Int32, sched_words(self.cfg.e_cap)]
                colscale: cute.struct.MemRange[Float32, 2 * TILE_N]
                rowbase: cute.struct.MemRange[Int32, 2 * TILE_N]
                sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sA_l)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(sP_l)], 1024]
                sD: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sD_l)], 1024]
                sS: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(sS_l) if self.scale_tma else 16], 128]

            self.shared_storage = SharedStorage
            self.kernel(tma_a, tA, tma_b, tB, tma_s, tS, mAs, mWs, mG, mRS, mRC, mRW, mOut, mOutS, n_w, tiled_mma,
                        sA_l, sD_l, sP_l, sS_l).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                                 min_blocks_per_mp=self.cfg.ctas_per_sm)

        @cute.kernel
        def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mW: cute.Tensor,
                   tma_s: cute.CopyAtom, mSt: cute.Tensor, mAs: cute.Tensor, mWs: cute.Tensor, mG: cute.Tensor, mRS: cute.Tensor, mRC: cute.Tensor,
                   mRW: cute.Tensor, mOut: cute.Tensor, mOutS: cute.Tensor, n_w: Int32, tiled_mma: cute.TiledMma,
                   sA_l: cute.ComposedLayout, sD_l: cute.ComposedLayout, sP_l: cute.Layout, sS_l: cute.Layout):
            cfg = self.cfg
            tidx, bidx, gdim, warp, wg = cta_ids()
            if warp == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
                if cutlass.const_expr(self.scale_tma):
                    cpasync.prefetch_descriptor(tma_s)
            storage = SmemAllocator().allocate(self.shared_storage)
            tx_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(sA_l, (None, None, 0)))
                        + TILE_N * self.pb + (TILE_N * 16 if self.scale_tma else 0))
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * self.nc),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

            R = mA.shape[0]
            K = mA.shape[1]
            E = mRS.shape[0]
            KB = K // self.bk
            NT = n_w // TILE_N
            sSched = storage.sched.get_tensor(cute.make_layout(sched_words(cfg.e_cap)))
            build_schedule(mRS, mRC, sSched, R, E, self.tile_m, cfg.e_cap, tidx, self.threads)
            total_units = sSched[E] * NT
            n_my = Int32(0)
            if bidx < total_units:
                n_my = (total_units - bidx + gdim - 1) // gdim

            sA = storage.sA.get_tensor(sA_l.outer, swizzle=sA_l.inner)
            sP = storage.sP.get_tensor(sP_l)
            sD = storage.sD.get_tensor(sD_l.outer, swizzle=sD_l.inner)
            sS = storage.sS.get_tensor(sS_l) if self.scale_tma else None

            if wg == 0:
                cute.arch.setmaxregister_decrease(cfg.regs[0])
                if warp == 0:
                    # ------------------------------ TMA producer (warp 0) ------------------------------
                    ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    for ui in cutlass.range(n_my, unroll=1):
                        u = bidx + ui * gdim
                        e, nt, row0, nrows = unit_lookup(u, NT, sSched, E, self.tile_m, cfg.e_cap)
                        gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.bk), (0, None))
                        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                        gB = cute.local_tile(mW, (TILE_N, self.pb), (e * NT + nt, None))
                        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                                           cute.group_modes(sP, 0, 2), cute.group_modes(gB, 0, 2))
                        tSsS, tSgS = tBsB, tBgB
                        if cutlass.const_expr(self.scale_tma):
                            gS = cute.local_tile(mSt, (TILE_N, 16), (e * NT + nt, None))
                            tSsS, tSgS = cpasync.tma_partition(tma_s, 0, cute.make_layout(1),
                                                               cute.group_modes(sS, 0, 2), cute.group_modes(gS, 0, 2))
                        # stage j of a unit = packed weights (+ scales) of K block j and the token
                        # tile of K block j - 1: exactly what the consumers use together (decode of
                        # j while the WGMMAs of j - 1 run), so they hold one stage at a time. Stage
                        # 0 carries a spare copy of A block 0 and stage KB one of W block KB - 1
                        # (fixed transaction bytes per stage; the consumers ignore them).
                        for j in cutlass.range(KB + 1, unroll=1):
                            kw = cutlass.min(j, KB - 1)
                            pipe.producer_acquire(ps)
                            bar = pipe.producer_get_barrier(ps)
                            cute.copy(tma_b, tBgB[(None, kw)], tBsB[(None, ps.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.scale_tma):
                                cute.copy(tma_s, tSgS[(None, kw // self.q)], tSsS[(None, ps.index)], tma_bar_ptr=bar)
                            cute.copy(tma_a, tAgA[(None, cutlass.max(j - 1, 0))], tAsA[(None, ps.index)],
                                      tma_bar_ptr=bar)
                            pipe.producer_commit(ps)
                            ps.advance()
                    pipe.producer_tail(ps)
                else:
                    # ------------------------------ row prologue (warps 1-3) ---------------------------
                    self._prologue(sSched, n_my, bidx, gdim, NT, E, K, n_w, mWs, mG,
                                   storage.colscale.data_ptr().toint(), storage.rowbase.data_ptr().toint(), tidx - 32)
            else:
                # ------------------- consumers: operand decode + WGMMA + promotion + epilogue -------------
                cute.arch.setmaxregister_increase(cfg.regs[1])
                ct = tidx - 128
                cw = ct // 128
                t = ct % 128
                lane = t % 32
                wq = t // 32
                c = t % 4
                thr_mma = tiled_mma.get_slice(ct)
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sD))
                c_shape = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, HALF_N))).shape
                acc0 = cute.make_rmem_tensor(c_shape, Float32)
                acc1 = cute.make_rmem_tensor(c_shape, Float32)
                part = cute.make_rmem_tensor(c_shape, Float32)
                n_kk = cute.size(tCrA, mode=[2])
                cs_addr = storage.colscale.data_ptr().toint()
                rb_addr = storage.rowbase.data_ptr().toint()
                sP_addr = storage.sP.data_ptr().toint()
                sD_addr = storage.sD.data_ptr().toint()
                sS_addr = storage.sS.data_ptr().toint()
                as_base = mAs.iterator.toint()
                ws_base = mWs.iterator.toint()
                KB128 = K // 128
                KSF = K // self.sf
                r_first = cw * 64 + wq * 16 + lane // 4        # accumulator rows r_first, r_first + 8
                row_l0 = cw * self.rows_wg + t // 4            # first decoded weight row (items: + 32 j)
                src0 = sP_addr + row_l0 * self.pb + c * (self.pb // 4)
                ss0 = sS_addr + row_l0 * 16
                doff_a = decoded_offset(t // 4, 2 * c)
                doff_b = decoded_offset(t // 4, 2 * c + 1)
                nbar_p = PROLOGUE_THREADS + 128 * self.nc
                nbar_k = 128 * self.nc
                NI = self.ni
                rbr = cute.make_rmem_tensor((NI,), Int32)
                scv = cute.make_rmem_tensor((NI,), Uint32)
                cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                g = Int32(0)
                for ui in cutlass.range(n_my, unroll=1):
                    u = bidx + ui * gdim
                    e, nt, row0, nrows = unit_lookup(u, NT, sSched, E, self.tile_m, cfg.e_cap)
                    b = ui % 2
                    wrow0 = e * n_w + nt * TILE_N
                    ws_t = ws_base + Int64(wrow0 + row_l0) * KSF
                    # activation-scale element offsets of the thread's rows (32-bit: R * K / 128 < 2^31)
                    ra0 = cutlass.min(row0 + r_first, R - 1) * KB128
                    ra1 = cutlass.min(row0 + r_first + 8, R - 1) * KB128
                    rbp = rb_addr + b * (TILE_N * 4) + row_l0 * 4        # row references of item 0 (+128 B / item)
                    for j in cutlass.range_constexpr(NI):
                        scv[j] = Uint32(127)
                        if cutlass.const_expr(not (self.debug & 2) and not self.scale_tma):
                            scv[j] = self._scale_load(ws_t + Int64(j * 32) * KSF, Int32(0), c)
                    # the row prologue of this unit (reference exponents, column multipliers) is ready
                    cute.arch.barrier(barrier_id=BAR_PFULL + b, number_of_threads=nbar_p)
                    if cutlass.const_expr(not self.fast_dec):
                        for j in cutlass.range_constexpr(NI):
                            rbr[j] = Int32(ld_shared_b32(rbp + 128 * j))
                    acc0.fill(0.0)
                    acc1.fill(0.0)
                    # stage 0 of the unit: decode K block 0 into slot g % 2 (not overlapped), free it
                    pipe.consumer_wait(cs)
                    self._decode(0, NI, cs.index, g % 2, Int32(0), KB, src0, ss0, sD_addr, doff_a, doff_b, cw, ws_t, KSF,
                                 c, rbr, scv, rbp)
                    pipe.consumer_release(cs)
                    cs.advance()
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=BAR_K, number_of_threads=nbar_k)
                    for k in cutlass.range(KB, unroll=1):
                        ds = g % 2
                        sa0 = Float32(1.0)
                        sa1 = Float32(1.0)
                        if cutlass.const_expr(self.fp8 and not (self.debug & 4)):
                            sa0 = ld_global_nc_f32(as_base + Int64(ra0 + k) * 4)
                            sa1 = ld_global_nc_f32(as_base + Int64(ra1 + k) * 4)
                        # stage k + 1: token tile of block k, packed weights of block k + 1
                        pipe.consumer_wait(cs)
                        if cutlass.const_expr(self.fp8):
                            for h in cutlass.range_constexpr(2):
                                sub = (ds * 2 + h) * self.parts
                                warpgroup.fence()
                                if cutlass.const_expr(not (self.debug & 16)):
                                    for kk in cutlass.range_constexpr(n_kk):
                                        for p in cutlass.range_constexpr(self.parts):
                                            tiled_mma.set(warpgroup.Field.ACCUMULATE, kk + p > 0)
                                            cute.gemm(tiled_mma, part, tCrA[(None, None, kk, cs.index)],
                                                      tCrB[(None, None, kk, sub + p)], part)
                                warpgroup.commit_group()
                                # while the tensor core works: decode half of the next K block's items
                                # (after the last block: the stage's spare bytes into the free slot)
                                self._decode(h * (NI // 2), (h + 1) * (NI // 2), cs.index, 1 - ds, k + 1, KB,
                                             src0, ss0, sD_addr, doff_a, doff_b, cw, ws_t, KSF, c, rbr, scv, rbp)
                                warpgroup.wait_group(0)
                                if cutlass.const_expr(h == 0):
                                    promote(acc0, part, sa0, sa1)
                                else:
                                    promote(acc1, part, sa0, sa1)
                        else:
                            warpgroup.fence()
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                            if cutlass.const_expr(not (self.debug & 16)):
                                for h in cutlass.range_constexpr(2):
                                    for kk in cutlass.range_constexpr(n_kk):
                                        if cutlass.const_expr(h == 0):
                                            cute.gemm(tiled_mma, acc0, tCrA[(None, None, kk, cs.index)],
                                                      tCrB[(None, None, kk, ds * 2)], acc0)
                                        else:
                                            cute.gemm(tiled_mma, acc1, tCrA[(None, None, kk, cs.index)],
                                                      tCrB[(None, None, kk, ds * 2 + 1)], acc1)
                            warpgroup.commit_group()
                            self._decode(0, NI, cs.index, 1 - ds, k + 1, KB, src0, ss0, sD_addr, doff_a, doff_b, cw,
                                         ws_t, KSF, c, rbr, scv, rbp)
                            warpgroup.wait_group(0)
                        # the stage (token tile of block k, packed weights of block k + 1) is consumed
                        pipe.consumer_release(cs)
                        cs.advance()
                        cute.arch.fence_view_async_shared()
                        cute.arch.barrier(barrier_id=BAR_K, number_of_threads=nbar_k)
                        g = g + 1
                    # ---- epilogue of unit ui ----
                    csu = cs_addr + b * (TILE_N * 4)
                    if cutlass.const_expr(self.debug & 1):
                        pass
                    elif cutlass.const_expr(cfg.stage == 1):
                        epilogue_gemm1(acc0, acc1, csu, mOut, mOutS, mRW, row0, nrows, r_first, nt, c,
                                       n_w // 2, self.fp8)
                    else:
                        epilogue_gemm2(acc0, acc1, csu, mOut, row0, nrows, r_first, nt, c, n_w)
                    # prologue buffer b may be refilled (unit ui + 2)
                    cute.arch.barrier_arrive(barrier_id=BAR_PEMPTY + b, number_of_threads=nbar_p)

        # ---------------------------------------------------------------- consumer decode
        @cute.jit
        def _decode(self, j0: cutlass.Constexpr[int], j1: cutlass.Constexpr[int], slot: Int32, ds: Int32, k: Int32,
                    KB: Int32, src0: Int32, ss0: Int32, dst0: Int32, doff_a: Int32, doff_b: Int32, cw: Int32,
                    ws_t: Int64, KSF: Int32, c: Int32, rbr: cute.Tensor, scv: cute.Tensor, rbp: Int32):
            """Decode items ``j0 <= j < j1`` of this thread of K block ``k`` from TMA stage ``slot`` into
            decoded slot ``ds``, and prefetch their scale byte(s) of block ``k + 1``. Item ``j``: weight
            row ``cw * rows_wg + t // 4 + 32 j`` (half ``hf``, row ``t // 4 + 32 (j % 4)`` in the half),
            chunk ``c``; ``src0`` / ``dst0`` / ``doff_*`` / ``ws_t``: the thread's item-0 addresses."""
            if cutlass.const_expr(self.fast_dec):
                self._decode_fp8(j0, j1, slot, ds, k, KB, src0, ss0, dst0, doff_a, doff_b, cw, ws_t, KSF, c, rbr, scv, rbp)
            else:
                self._decode_items(j0, j1, slot, ds, k, KB, src0, ss0, dst0, doff_a, doff_b, cw, ws_t, KSF, c, rbr,
                                   scv, rbp)

        @cute.jit
        def _decode_items(self, j0: cutlass.Constexpr[int], j1: cutlass.Constexpr[int], slot: Int32, ds: Int32,
                          k: Int32, KB: Int32, src0: Int32, ss0: Int32, dst0: Int32, doff_a: Int32, doff_b: Int32,
                          cw: Int32, ws_t: Int64, KSF: Int32, c: Int32, rbr: cute.Tensor, scv: cute.Tensor, rbp: Int32):
            """W4A16 :meth:`_decode`: item by item with :func:`kernels_dsl.sm90.transform.decode_row_chunk`."""
            sbo = Int32(0)
            if cutlass.const_expr(self.scale_tma):
                sbo = (k % self.q) * self.spk + self._scale_sub(c)     # byte of the thread's chunk in the box
            for j in cutlass.range_constexpr(j0, j1):
                sc = scv[j]
                if cutlass.const_expr(self.scale_tma):
                    # the block's scale bytes came with its TMA stage
                    wv = ld_shared_b32(ss0 + slot * (TILE_N * 16) + (32 * j) * 16 + (sbo & ~3))
                    sc = (wv >> Uint32(8 * (sbo & 3))) & Uint32(0xFFFF if (self.fp8 and self.nvfp4) else 0xFF)
                elif cutlass.const_expr(not (self.debug & 2)):
                    # unpredicated (the last block re-reads itself): a predicated load into the
                    # loop-carried register made ptxas copy it back at the loop end, i.e. wait for it
                    scv[j] = self._scale_load(ws_t + Int64(j * 32) * KSF, cutlass.min(k + 1, KB - 1), c)
                src = src0 + slot * (TILE_N * self.pb) + (32 * j) * self.pb
                hf = cw
                if cutlass.const_expr(self.nc == 1):
                    hf = Int32(j // 4)
                base = dst0 + ((ds * 2 + hf) * self.parts) * HALF_TILE_BYTES + 4096 * (j % 4)
                if cutlass.const_expr(not (self.debug & 8)):
                    decode_row_chunk(src, base + doff_a, base + doff_b, sc, self.nvfp4)

        def _item_loads(self, j, slot, src0, ss0, sbo, rbp, pk, sw, rbs):
            """Shared loads of decode item ``j`` (trace-time helper): packed chunk, row reference and
            (scale TMA) the scale word, appended to ``pk`` / ``rbs`` / ``sw``."""
            pk.append(ld_shared_v4(src0 + slot * (TILE_N * self.pb) + (32 * j) * self.pb))
            rbs.append(Int32(ld_shared_b32(rbp + 128 * j)))
            if cutlass.const_expr(self.scale_tma):
                sw.append(ld_shared_b32(ss0 + slot * (TILE_N * 16) + (32 * j) * 16 + (sbo & ~3)))

        @cute.jit
        def _decode_fp8(self, j0: cutlass.Constexpr[int], j1: cutlass.Constexpr[int], slot: Int32, ds: Int32,
                        k: Int32, KB: Int32, src0: Int32, ss0: Int32, dst0: Int32, doff_a: Int32, doff_b: Int32,
                        cw: Int32, ws_t: Int64, KSF: Int32, c: Int32, rbr: cute.Tensor, scv: cute.Tensor, rbp: Int32):
            """W4A8 :meth:`_decode`: every shared load of items ``j0 <= j < j1`` (packed chunk + scale
            word) is issued before the first decode (the loads are ordered asm: one memory round trip
            per step instead of one per item), then each item decodes with
            :func:`kernels_dsl.sm90.fp4.e2m1x8_to_e4m3x8_sm` semantics (9 integer instructions per 8
            codes; NVFP4: the sign masks are shared by the hi and lo parts)."""
            sbo = Int32(0)
            if cutlass.const_expr(self.scale_tma):
                sbo = (k % self.q) * self.spk + self._scale_sub(c)
            pk = []
            sw = []
            rbs = []
            for j in cutlass.range_constexpr(j0, j1):
                if cutlass.const_expr(not self.scale_tma):
                    sw.append(scv[j])
                    if cutlass.const_expr(not (self.debug & 2)):
                        scv[j] = self._scale_load(ws_t + Int64(j * 32) * KSF, cutlass.min(k + 1, KB - 1), c)
            for i in cutlass.range_constexpr(j1 - j0):
                j = j0 + i
                self._item_loads(j, slot, src0, ss0, sbo, rbp, pk, sw, rbs)
                sc = sw[i]
                if cutlass.const_expr(self.scale_tma):
                    sc = (sc >> Uint32(8 * (sbo & 3))) & Uint32(0xFFFF if self.nvfp4 else 0xFF)
                hf = cw
                if cutlass.const_expr(self.nc == 1):
                    hf = Int32(j // 4)
                base = dst0 + ((ds * 2 + hf) * self.parts) * HALF_TILE_BYTES + 4096 * (j % 4)
                if cutlass.const_expr(not (self.debug & 8)):
                    w = pk[i]
                    if cutlass.const_expr(not self.nvfp4):
                        d = Int32(sc & Uint32(0xFF)) - rbs[i] + 6
                        lo = Uint32(0)
                        hi = Uint32(0)
                        if d >= fp4.SHIFT_RANGE[0]:
                            lo, hi = fp4.e4m3_lut_shift(d)
                        else:
                            lo, hi = fp4.e4m3_lut(d)
                        o = []
                        for q in cutlass.range_constexpr(4):
                            m0, m1, k0, k1 = fp4.e2m1x8_mag_sign(w[q], lo, hi)
                            o.append(m0 | k0)
                            o.append(m1 | k1)
                        st_shared_v4(base + doff_a, o[0], o[1], o[2], o[3])
                        st_shared_v4(base + doff_b, o[4], o[5], o[6], o[7])
                    else:
                        s0, s1 = fp4.e4m3x2_to_f32x2(sc)
                        inv = fp4.exp2i(-rbs[i])
                        h0l, h0h, l0l, l0h = fp4.e4m3_hilo_lut(s0 * inv)
                        h1l, h1h, l1l, l1h = fp4.e4m3_hilo_lut(s1 * inv)
                        oh = []
                        ol = []
                        for q in cutlass.range_constexpr(4):
                            hl, hh, ll, lh = (h0l, h0h, l0l, l0h) if q < 2 else (h1l, h1h, l1l, l1h)
                            m0, m1, k0, k1 = fp4.e2m1x8_mag_sign(w[q], hl, hh)
                            oh.append(m0 | k0)
                            oh.append(m1 | k1)
                            idx = w[q] & Uint32(0x77777777)
                            ol.append(fp4.prmt(ll, lh, idx) ^ k0)
                            ol.append(fp4.prmt(ll, lh, idx >> 16) ^ k1)
                        st_shared_v4(base + doff_a, oh[0], oh[1], oh[2], oh[3])
                        st_shared_v4(base + doff_b, oh[4], oh[5], oh[6], oh[7])
                        st_shared_v4(base + doff_a + HALF_TILE_BYTES, ol[0], ol[1], ol[2], ol[3])
                        st_shared_v4(base + doff_b + HALF_TILE_BYTES, ol[4], ol[5], ol[6], ol[7])

        # ---------------------------------------------------------------- row-prologue warps
        @cute.jit
        def _prologue(self, sSched: cute.Tensor, n_my: Int32, bidx: Int32, gdim: Int32, NT: Int32, E: Int32,
                      K: Int32, n_w: Int32, mWs: cute.Tensor, mG: cute.Tensor, cs_addr: Int32, rb_addr: Int32,
                      tt: Int32):
            """Warps 1-3 (``tt`` = 0..95), running up to two work units ahead of the consumers: per
            unit the reference exponent of each of the 256 weight rows over the whole K and its
            column multiplier (items ``i = tt + 96 j``: row ``i // 4``, lane ``i % 4`` of the row's
            quad) into buffer ``ui % 2``, published with a named barrier (full); buffer reuse waits
            for the consumers' release after the unit's epilogue (empty)."""
            cfg = self.cfg
            c = tt % 4
            nbar_p = PROLOGUE_THREADS + 128 * self.nc
            ws_base = mWs.iterator.toint()
            g_base = mG.iterator.toint()
            ng = mG.shape[1]
            KSF = K // self.sf
            # 16-byte scale loads when every row starts 16-byte aligned (the DSV4 shapes)
            v4 = ((KSF % 16) == 0) & ((Int32(ws_base % 16)) == 0)
            for ui in cutlass.range(n_my, unroll=1):
                u = bidx + ui * gdim
                e, nt, _row0, _nrows = unit_lookup(u, NT, sSched, E, self.tile_m, cfg.e_cap)
                b = ui % 2
                wrow0 = e * n_w + nt * TILE_N
                csu = cs_addr + b * (TILE_N * 4)
                rbu = rb_addr + b * (TILE_N * 4)
                if ui >= 2:
                    cute.arch.barrier(barrier_id=BAR_PEMPTY + b, number_of_threads=nbar_p)
                for j in cutlass.range_constexpr(ITEMS):
                    i = tt + PROLOGUE_THREADS * j
                    if i < TILE_N * 4:
                        rl = i // 4
                        gi = Int32(0)
                        if cutlass.const_expr(cfg.stage == 1):
                            gi = cutlass.select_((rl % HALF_N) >= 64, Int32(1), Int32(0))   # gate / up rows
                        rbv = Int32(127)
                        if cutlass.const_expr(not (self.debug & 2)):
                            gv = ld_global_nc_f32(g_base + (Int64(e) * ng + gi) * 4)
                            if v4:
                                rbv = row_prologue_v4(ws_base + Int64(wrow0 + rl) * KSF, KSF, c, gv, self.fp8,
                                                      self.nvfp4, csu + rl * 4)
                            else:
                                rbv = row_prologue(ws_base + Int64(wrow0 + rl) * KSF, KSF, c, gv, self.fp8,
                                                   self.nvfp4, csu + rl * 4)
                        if c == 0:
                            st_shared_b32(rbu + rl * 4, Uint32(rbv))
                cute.arch.barrier_arrive(barrier_id=BAR_PFULL + b, number_of_threads=nbar_p)
            # balance the consumers' last two empty arrivals (no named barrier is left half-arrived)
            for b in cutlass.range_constexpr(2):
                if n_my > b:
                    cute.arch.barrier(barrier_id=BAR_PEMPTY + b, number_of_threads=nbar_p)

        @cute.jit
        def _scale_sub(self, c: Int32):
            """Byte offset of chunk ``c``'s scale byte(s) inside one K block's scale bytes."""
            r = c
            if cutlass.const_expr(self.fp8 and self.nvfp4):
                r = 2 * c
            elif cutlass.const_expr(not self.fp8 and not self.nvfp4):
                r = c // 2
            return r

        @cute.jit
        def _scale_load(self, ws_row: Int64, k: Int32, c: Int32):
            """The scale byte(s) of chunk ``c`` of K block ``k`` of one weight row (Uint32)."""
            v = Uint32(0)
            if cutlass.const_expr(self.fp8):
                if cutlass.const_expr(self.nvfp4):
                    v = ld_nc_u16(ws_row + k * 8 + 2 * c)
                else:
                    v = ld_nc_u8(ws_row + k * 4 + c)
            else:
                if cutlass.const_expr(self.nvfp4):
                    v = ld_nc_u8(ws_row + k * 4 + c)
                else:
                    v = ld_nc_u8(ws_row + k * 2 + c // 2)
            return v


# ------------------------------------------------------------------------------------ host side
def fake_args(cfg: GroupedGemmConfig):
    """Fake tensors of one specialization (symbolic sizes: one compile serves every R, K, E, N).
    Every tensor has its own size symbols (unused operands may be 1-element placeholders)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    bk = cfg.block_k
    sym = cute.sym_int32

    def t2(dt, d0, d1, align, div1=1):
        return make_fake_compact_tensor(dt, (sym(), sym(divisibility=div1)), stride_order=(1, 0), assumed_align=align)

    adt = Float8E4M3FN if cfg.act == "fp8" else BFloat16
    a = make_fake_compact_tensor(adt, (sym(), sym(divisibility=bk)), stride_order=(1, 0), assumed_align=16)
    a_s = t2(Float32, 0, 0, 4)
    w = make_fake_compact_tensor(Uint8, (sym(divisibility=TILE_N), sym(divisibility=bk // 2)), stride_order=(1, 0),
                                 assumed_align=16)
    ws = (make_fake_compact_tensor(Uint8, (sym(), sym(divisibility=16)), stride_order=(1, 0), assumed_align=16)
          if cfg.scale_tma else t2(Uint8, 0, 0, 4, 4))
    g = make_fake_compact_tensor(Float32, (sym(), 2 if cfg.stage == 1 else 1), stride_order=(1, 0), assumed_align=4)
    rs = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    rc = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    rw = make_fake_compact_tensor(Float32, (sym(),), assumed_align=4)
    if cfg.stage == 1:
        odt = Uint8 if cfg.act == "fp8" else BFloat16
        out = t2(odt, 0, 0, 16, 64)
    else:
        out = t2(Float32, 0, 0, 16, 64)
    out_s = t2(Float32, 0, 0, 4)
    return a, a_s, w, ws, g, rs, rc, rw, out, out_s, Int32(256), Int32(132), make_fake_stream()


def compile_kernel(cfg: GroupedGemmConfig, arch: str = "sm_90a", extra: str = "", debug: int = 0):
    """``cute.compile`` of :class:`Fp4GroupedGemmKernel` for ``cfg`` (no GPU needed)."""
    from .._compile import compile_options
    return cute.compile(Fp4GroupedGemmKernel(cfg, debug), *fake_args(cfg), options=compile_options(arch, extra))
