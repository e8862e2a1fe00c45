"""Persistent warp-specialized FP4-weight grouped GEMM for sm_90a (CuTe DSL): the MoE GEMM1
(W13 + DSV4 clamped SwiGLU * routing weight (+ FP8 1x128 UE8M0 requant)) and GEMM2 (W2, fp32
rows) of :mod:`kernels_dsl.moe`, for MXFP4 / NVFP4 weights and FP8 (W4A8) / BF16 (W4A16)
activations, contiguous and masked grouped layouts.

``out[r, n] = sum_k A[r, k] * W_e[n, k]`` for every grouped row ``r`` of expert ``e``
(``[row_start[e], row_start[e] + row_count[e])``), then the stage's epilogue.

Structure (one CTA per SM, persistent over work units = (token M-tile, 256-row weight tile);
:mod:`kernels_dsl.sm90.scheduler`):

* warpgroup 0 (``setmaxnreg.dec``), warp 0 = TMA producer: per K block one TMA of the token
  tile ``[tile_m, BK]`` (E4M3 / BF16, 128B swizzle; rows past the tensor end are zero-filled by
  the hardware, rows of the next expert are loaded but never stored) and one of the packed
  weight tile ``[256 rows, BK/2 bytes]`` into a ``stages``-deep ring guarded by
  ``PipelineTmaAsync`` mbarriers (``stages`` from the shared-memory capacity,
  :mod:`kernels_dsl.sm90.config`);
* warpgroup 0, warps 1-3 = operand transform (:mod:`kernels_dsl.sm90.transform`): per unit a
  row prologue (reference exponent of every weight row over its whole K, column multipliers),
  per K block the decode of the packed E2M1 tile + UE8M0 / E4M3 scales into a double-buffered
  128B-swizzled E4M3 / BF16 tile, handed to the consumers through named barriers (full: transform
  ``bar.arrive`` after ``fence.proxy.async``, consumers ``bar.sync``; empty: the reverse);
* 1-2 consumer warpgroups (``setmaxnreg.inc``), 64 token rows each: WGMMA ``m64n128`` per half of
  the weight tile (two halves of 128 rows). W4A8: each 128-K block goes into a fresh fp32
  accumulator which is then promoted, ``acc += partial * a_scale[row, kb]`` (DeepGEMM style; the
  weight scales are folded per row into the decoded E4M3 bytes relative to the row's reference
  exponent and applied once per column in the epilogue). NVFP4 under W4A8 adds a second WGMMA
  per K step on the lo part of the hi + lo split. W4A16: BF16 WGMMA into the accumulator (exact
  BF16 weights), no promotion.
* epilogue per tile: GEMM1 ``gate = bf16(acc * col_scale)``, ``up`` likewise (the prepared W13
  tile pairs gate / up columns inside one thread), ``h = bf16(silu(min(gate, 10)) *
  clamp(up, -10, 10) * route_w)``; FP8: per (row, 128 h columns) amax over the lane quad,
  UE8M0 scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, E4M3 ``h``, fp32 ``h_s``; GEMM2 ``y =
  acc * col_scale`` (fp32). Rows past an expert's count are never stored.

Registers: the launch gives 168 per thread (384 threads); ``setmaxnreg.inc`` only hands out what
``.dec`` released, so warpgroup 0 runs at 72 and the consumers at 216 (72 + 2 x 216 = 504 <= 3 x
168; a larger consumer target deadlocks at launch, seen on the H200 in job moegemm-02).

Precision contract (tests/test_moe.py, tests/test_moe_decode.py): W4A8 GEMM2 relative
(Frobenius) error vs the exact-dequant fp32 reference on the same FP8 ``h`` <= 5e-3, NVFP4
included; W4A16 <= 1e-5. Measured on the H200 (job moegemm-03, 9 experts x D 512 x I 256,
contiguous + masked, both token tiles): W4A8 1.1e-4 (MXFP4) / 1.9e-4 (NVFP4), W4A16 1.9e-7 /
2.3e-7; ``h_s`` equal to the reference's on every row. Weight-scale folding bounds:
:mod:`kernels_dsl.sm90.transform`.

Performance (job moegemm-03, DSV4-Flash MXFP4 W4A8, GEMM1 + GEMM2, CUDA-graph replay): T=4
349 us (20% of copy BW on the active experts' weights), T=64 5.1 ms (12%), T=4096 8.7 ms (142
TFLOP/s): about 3-6 us per K block per CTA whatever the work, i.e. bound by the 3-warp transform
(11 serialized (row, chunk) items per thread per K block, each a dependent chain of shared /
global loads and ~40 instructions) and by the per-unit row prologue (its scale-byte loads are
latency-serialized per row). Not the registry default (the cuda kernels are faster); next:
the decode on more warps with interleaved items, per-row reference exponents precomputed once
per weight tensor.

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
    from .ptx import ld_global_nc_f32, ld_global_nc_u8, ld_global_nc_u16, ld_shared_b32, st_shared_b32
    from .scheduler import build_schedule, sched_words, unit_lookup
    from .transform import HALF_TILE_BYTES, decode_row_chunk, decoded_offset, row_prologue
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["Fp4GroupedGemmKernel"]

#: named barriers: decoded slot d full (transform -> consumers) / empty (consumers -> transform)
BAR_FULL = 1
BAR_EMPTY = 3
#: transform threads (warps 1-3 of warpgroup 0) and the (row, chunk) items each decodes per K block
TRANSFORM_THREADS = 96
ITEMS = -(-TILE_N * 4 // TRANSFORM_THREADS)


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
            self.nj = self.rows_wg // 32                      # rows per thread
            self.threads = cfg.threads
            # scale bytes of one thread's chunk per K block: MXFP4 1/32, NVFP4 1/16 values
            self.sf = cfg.sf
            #: diagnostics only (wrong results): bit 1 no epilogue stores, 2 no transform global loads,
            #: 4 no activation-scale loads, 8 no decode smem traffic, 16 no WGMMA
            self.debug = debug

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

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sched: cute.struct.MemRange[Int32, sched_words(self.cfg.e_cap)]
                colscale: cute.struct.MemRange[Float32, 4 * TILE_N]
                rowbase: cute.struct.MemRange[Int32, 4 * TILE_N]
                sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sA_l)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[Uint8, cute.cosize(sP_l)], 1024]
                sD: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sD_l)], 1024]

            self.shared_storage = SharedStorage
            self.kernel(tma_a, tA, tma_b, tB, mAs, mWs, mG, mRS, mRC, mRW, mOut, mOutS, n_w, tiled_mma,
                        sA_l, sD_l, sP_l).launch(grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                                 min_blocks_per_mp=self.cfg.ctas_per_sm)

        @cute.kernel
        def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mW: cute.Tensor,
                   mAs: cute.Tensor, mWs: cute.Tensor, mG: cute.Tensor, mRS: cute.Tensor, mRC: cute.Tensor,
                   mRW: cute.Tensor, mOut: cute.Tensor, mOutS: cute.Tensor, n_w: Int32, tiled_mma: cute.TiledMma,
                   sA_l: cute.ComposedLayout, sD_l: cute.ComposedLayout, sP_l: cute.Layout):
            cfg = self.cfg
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            if warp == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)
            storage = SmemAllocator().allocate(self.shared_storage)
            tx_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(sA_l, (None, None, 0)))
                        + TILE_N * self.pb)
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
                        for k in cutlass.range(KB, unroll=1):
                            pipe.producer_acquire(ps)
                            bar = pipe.producer_get_barrier(ps)
                            cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, ps.index)], tma_bar_ptr=bar)
                            cute.copy(tma_b, tBgB[(None, k)], tBsB[(None, ps.index)], tma_bar_ptr=bar)
                            pipe.producer_commit(ps)
                            ps.advance()
                    pipe.producer_tail(ps)
                else:
                    # ------------------------------ transform (warps 1-3) ------------------------------
                    self._transform(pipe, sSched, n_my, bidx, gdim, NT, E, KB, K, n_w, mWs, mG,
                                    storage.sP.data_ptr().toint(), storage.sD.data_ptr().toint(),
                                    storage.colscale.data_ptr().toint(), storage.rowbase.data_ptr().toint(), tidx - 32)
            else:
                # ------------------------------ consumers: WGMMA + promotion + epilogue ------------------
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
                as_base = mAs.iterator.toint()
                KB128 = K // 128
                r_first = cw * 64 + wq * 16 + lane // 4        # accumulator rows r_first, r_first + 8
                nbar = TRANSFORM_THREADS + 128 * self.nc
                cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                g = Int32(0)
                for ui in cutlass.range(n_my, unroll=1):
                    u = bidx + ui * gdim
                    e, nt, row0, nrows = unit_lookup(u, NT, sSched, E, self.tile_m, cfg.e_cap)
                    acc0.fill(0.0)
                    acc1.fill(0.0)
                    ra0 = Int64(cutlass.min(row0 + r_first, R - 1)) * KB128
                    ra1 = Int64(cutlass.min(row0 + r_first + 8, R - 1)) * KB128
                    for k in cutlass.range(KB, unroll=1):
                        ds = g % 2
                        sa0 = Float32(1.0)
                        sa1 = Float32(1.0)
                        if cutlass.const_expr(self.fp8 and not (self.debug & 4)):
                            sa0 = ld_global_nc_f32(as_base + (ra0 + k) * 4)
                            sa1 = ld_global_nc_f32(as_base + (ra1 + k) * 4)
                        pipe.consumer_wait(cs)
                        cute.arch.barrier(barrier_id=BAR_FULL + ds, number_of_threads=nbar)
                        for h in cutlass.range_constexpr(2):
                            sub = (ds * 2 + h) * self.parts
                            warpgroup.fence()
                            if cutlass.const_expr(self.debug & 16):
                                pass
                            elif cutlass.const_expr(self.fp8):
                                for kk in cutlass.range_constexpr(n_kk):
                                    for p in cutlass.range_constexpr(self.parts):
                                        tiled_mma.set(warpgroup.Field.ACCUMULATE, kk + p > 0)
                                        cute.gemm(tiled_mma, part, tCrA[(None, None, kk, cs.index)],
                                                  tCrB[(None, None, kk, sub + p)], part)
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                                if cutlass.const_expr(h == 0):
                                    promote(acc0, part, sa0, sa1)
                                else:
                                    promote(acc1, part, sa0, sa1)
                            else:
                                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                                for kk in cutlass.range_constexpr(n_kk):
                                    if cutlass.const_expr(h == 0):
                                        cute.gemm(tiled_mma, acc0, tCrA[(None, None, kk, cs.index)],
                                                  tCrB[(None, None, kk, sub)], acc0)
                                    else:
                                        cute.gemm(tiled_mma, acc1, tCrA[(None, None, kk, cs.index)],
                                                  tCrB[(None, None, kk, sub)], acc1)
                                warpgroup.commit_group()
                        if cutlass.const_expr(not self.fp8 and not (self.debug & 16)):
                            warpgroup.wait_group(0)
                        # the decoded slot and the TMA slot are free again
                        cute.arch.barrier_arrive(barrier_id=BAR_EMPTY + ds, number_of_threads=nbar)
                        pipe.consumer_release(cs)
                        cs.advance()
                        g = g + 1
                    # ---- epilogue of unit ui ----
                    csu = cs_addr + (ui % 4) * (TILE_N * 4)
                    if cutlass.const_expr(self.debug & 1):
                        pass
                    elif cutlass.const_expr(cfg.stage == 1):
                        epilogue_gemm1(acc0, acc1, csu, mOut, mOutS, mRW, row0, nrows, r_first, nt, c,
                                       n_w // 2, self.fp8)
                    else:
                        epilogue_gemm2(acc0, acc1, csu, mOut, row0, nrows, r_first, nt, c, n_w)

        # ---------------------------------------------------------------- transform warps
        @cute.jit
        def _transform(self, pipe, sSched: cute.Tensor, n_my: Int32, bidx: Int32, gdim: Int32, NT: Int32, E: Int32,
                       KB: Int32, K: Int32, n_w: Int32, mWs: cute.Tensor, mG: cute.Tensor, sP_addr: Int32,
                       sD_addr: Int32, cs_addr: Int32, rb_addr: Int32, tt: Int32):
            """Warps 1-3 (``tt`` = 0..95): per work unit the row prologue (reference exponents,
            column multipliers into the unit's colscale buffer), then per K block: wait for the TMA
            slot, wait until the consumers released decoded slot ``g % 2``, decode the 256 x BK
            packed tile (items ``i = tt + 96 j``: row ``i // 4``, chunk ``i % 4``), publish it."""
            cfg = self.cfg
            c = tt % 4
            nbar = TRANSFORM_THREADS + 128 * self.nc
            ws_base = mWs.iterator.toint()
            g_base = mG.iterator.toint()
            ng = mG.shape[1]
            KSF = K // self.sf
            scv = cute.make_rmem_tensor((ITEMS,), Uint32)
            rs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            g = Int32(0)
            for ui in cutlass.range(n_my, unroll=1):
                u = bidx + ui * gdim
                e, nt, _row0, _nrows = unit_lookup(u, NT, sSched, E, self.tile_m, cfg.e_cap)
                wrow0 = e * n_w + nt * TILE_N
                csu = cs_addr + (ui % 4) * (TILE_N * 4)
                rbu = rb_addr + (ui % 4) * (TILE_N * 4)
                # -- row prologue: reference exponent per row (quad max over the row's scale bytes)
                for j in cutlass.range_constexpr(ITEMS):
                    i = tt + TRANSFORM_THREADS * j
                    if i < TILE_N * 4:
                        rl = i // 4
                        gi = Int32(0)
                        if cutlass.const_expr(cfg.stage == 1):
                            gi = cutlass.select_((rl % HALF_N) >= 64, Int32(1), Int32(0))   # gate / up rows
                        rbv = Int32(127)
                        if cutlass.const_expr(not (self.debug & 2)):
                            gv = ld_global_nc_f32(g_base + (Int64(e) * ng + gi) * 4)
                            rbv = row_prologue(ws_base + Int64(wrow0 + rl) * KSF, KSF, c, gv, self.fp8,
                                               self.nvfp4, csu + rl * 4)
                        if c == 0:
                            st_shared_b32(rbu + rl * 4, Uint32(rbv))
                cute.arch.sync_warp()
                for j in cutlass.range_constexpr(ITEMS):
                    i = tt + TRANSFORM_THREADS * j
                    scv[j] = Uint32(127)
                    if cutlass.const_expr(not (self.debug & 2)):
                        if i < TILE_N * 4:
                            scv[j] = self._scale_load(ws_base + Int64(wrow0 + i // 4) * KSF, Int32(0), c)
                for k in cutlass.range(KB, unroll=1):
                    ds = g % 2
                    pipe.consumer_wait(rs)
                    if g >= 2:
                        cute.arch.barrier(barrier_id=BAR_EMPTY + ds, number_of_threads=nbar)
                    slot = rs.index
                    for j in cutlass.range_constexpr(ITEMS):
                        i = tt + TRANSFORM_THREADS * j
                        if i < TILE_N * 4:
                            rl = i // 4
                            sc = scv[j]
                            if cutlass.const_expr(not (self.debug & 2)):
                                if k + 1 < KB:   # prefetch the next K block's scale bytes
                                    scv[j] = self._scale_load(ws_base + Int64(wrow0 + rl) * KSF, k + 1, c)
                            src = sP_addr + slot * (TILE_N * self.pb) + rl * self.pb + c * (self.pb // 4)
                            hf = rl // HALF_N
                            n = rl % HALF_N
                            base = sD_addr + ((ds * 2 + hf) * self.parts) * HALF_TILE_BYTES
                            if cutlass.const_expr(not (self.debug & 8)):
                                rbv = Int32(ld_shared_b32(rbu + rl * 4))
                                decode_row_chunk(src, base + decoded_offset(n, 2 * c), base + decoded_offset(n, 2 * c + 1),
                                                 HALF_TILE_BYTES, sc, rbv, self.fp8, self.nvfp4)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier_arrive(barrier_id=BAR_FULL + ds, number_of_threads=nbar)
                    rs.advance()
                    g = g + 1
            # balance the consumers' last two EMPTY arrivals (no named barrier is left half-arrived)
            for d in cutlass.range_constexpr(2):
                if g >= 2 - d:
                    cute.arch.barrier(barrier_id=BAR_EMPTY + (g - 2 + d) % 2, number_of_threads=nbar)

        @cute.jit
        def _scale_load(self, ws_row: Int64, k: Int32, c: Int32):
            """The scale byte(s) of chunk ``c`` of K block ``k`` of one weight row (Uint32)."""
            v = Uint32(0)
            if cutlass.const_expr(self.fp8):
                if cutlass.const_expr(self.nvfp4):
                    v = ld_global_nc_u16(ws_row + k * 8 + 2 * c)
                else:
                    v = ld_global_nc_u8(ws_row + k * 4 + c)
            else:
                if cutlass.const_expr(self.nvfp4):
                    v = ld_global_nc_u8(ws_row + k * 4 + c)
                else:
                    v = ld_global_nc_u8(ws_row + k * 2 + c // 2)
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
    ws = t2(Uint8, 0, 0, 4, 4)
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
