"""CuTe DSL FP8 (E4M3) dense GEMM for sm_90a: the tensor-core *ceiling* baseline of the MoE
benchmark (issue 7). Not a registered op (no ``PROVIDERS``): ``bench/bench_moe.py`` times it at
the grouped GEMM's per-expert shapes to show what a dense FP8 WGMMA kernel reaches there.

``C[M, N] = A[M, K] @ B[N, K]^T`` with A, B E4M3 (both K-major, i.e. row-major ``[M, K]`` and
``[N, K]``), FP32 accumulation in registers, C rounded once to bf16 or written as fp32. No
scales (a per-tensor scale would be one multiply in the epilogue; the ceiling does not need it).

Kernel structure (own code; the CuTe DSL API usage follows the CUTLASS Hopper ``dense_gemm``
example: TMA atoms, ``PipelineTmaAsync``, stmatrix + TMA-store epilogue):

* persistent CTAs (grid = min(#tiles, #SMs), passed at launch) walking output tiles in a
  grouped-M raster (``GROUP_M`` M-tiles share their B tiles in L2);
* 384 threads = 3 warpgroups: warpgroup 0 is the producer (``setmaxnreg.dec 40``; its warp 0
  issues the TMA loads ``cp.async.bulk.tensor`` of A and B k-tiles into a ``STAGES``-deep
  128B-swizzled smem ring guarded by ``PipelineTmaAsync`` mbarriers); warpgroups 1 and 2 are
  the WGMMA consumers (``setmaxnreg.inc 232``), each owns 64 rows of the 128 x TILE_N tile
  (``wgmma.mma_async m64nTILE_Nk32 .e4m3.e4m3``, one k-tile of MMAs kept in flight);
* epilogue (the producer is already loading the next tile's k-tiles meanwhile): ``direct``
  = accumulator registers -> global stores; ``tma`` (bf16) = ``stmatrix`` into a 4-deep ring
  of 128 x 32 swizzled smem tiles, each written out by an asynchronous TMA store;
* optional CTA pairs (``cluster_m=2``) that multicast the shared B tile.

Accuracy: WGMMA's FP8 path accumulates in the tensor core with less than fp32 precision
(DeepSeek-V3 technical report, sec. 3.3.2); measured on the H200 at 2048 x 4096 x 4096
(randn operands): relative Frobenius error 1.6e-3 vs an exact fp32 matmul of the same E4M3
values (integer-valued operands with |partial sums| < 2^12 are exact). No promotion to fp32
every k-tile is done (that would double the accumulator registers).

Tile 128 x 256 x 128 (default) or 128 x 128 x 128; M, N, K are runtime values (one compile per
``(out dtype, tile_n, cluster_m, epilogue, arch)``).

Throughput vs ``torch._scaled_mm`` (MoE prefill per-expert shapes, 8192^3): docs/benchmarks.md
("CuTe DSL: FP8 dense GEMM ceiling"); CTA pairs (``cluster_m=2``) were not faster on those shapes.
"""
from __future__ import annotations

from typing import Optional

from ._compile import compile_cached, compile_options, dl, dsl_available, i32, launch_on

try:  # the DSL is optional at import time
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum
    from cutlass import Float8E4M3FN, Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from .sm90.scheduler import cta_ids
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["fp8_gemm", "fp8_gemm_launcher", "Fp8GemmKernel", "compile_check", "PTX_PATTERNS", "TILE_M", "TILE_K", "TILE_NS"]

TILE_M = 128
TILE_K = 128          # 128 E4M3 = 128 B: one 128B-swizzle row per k-tile
TILE_NS = (128, 256)
#: stages of the A/B smem ring per tile_n (tile_n=256: 48 KiB/stage, 4 stages = 192 KiB)
STAGES = {128: 6, 256: 4}
GROUP_M = 8
#: thread-block cluster sizes along M (2: B tile multicast to a CTA pair)
CLUSTERS = (1, 2)
#: epilogues: "direct" (registers -> global stores) or "tma" (bf16 only: stmatrix into a 4-deep
#: ring of 128 x 32 swizzled smem tiles, TMA stores drained asynchronously)
EPILOGUES = ("direct", "tma")
EPI_TILE_N = 32
EPI_STAGES = 4
PRODUCER_REGS = 40
CONSUMER_REGS = 232
_OUT = ("bfloat16", "float32")

#: What the compiled PTX must contain (tests/test_compile_dsl.py, tests/test_dsl_fp8_gemm.py).
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3",
                r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global",
                r"setmaxnreg\.dec\.sync\.aligned\.u32\s+40",
                r"setmaxnreg\.inc\.sync\.aligned\.u32\s+232",
                r"mbarrier\.try_wait")


if _HAVE_DSL:

    class Fp8GemmKernel:
        """Warp-specialized persistent TMA + WGMMA E4M3 GEMM, ``C = A @ B^T`` (fp32 accumulate).

        ``__call__(mA, mB, mC, num_ctas, stream)``:

        * ``mA``: Float8E4M3FN ``[M, K]`` row-major (K contiguous), 16 B aligned base.
        * ``mB``: Float8E4M3FN ``[N, K]`` row-major (K contiguous), 16 B aligned base.
        * ``mC``: BFloat16 / Float32 ``[M, N]`` row-major.
        * ``num_ctas``: Int32, persistent grid size (the SM count; at most the tile count).

        ``cluster_m = 2``: CTA pairs (thread-block clusters of 2 along M) compute vertically
        adjacent tiles that share their B tile; each CTA loads half of B and multicasts it to
        both (``CopyBulkTensorTileG2SMulticastOp``), so the L2 -> SM traffic per CTA drops from
        ``(128 + tile_n) * 128`` to ``(128 + tile_n / 2) * 128`` bytes per k-tile. The empty
        barriers then count the consumer warps of both CTAs (a stage is refilled only when both
        released it); ``num_ctas`` must be even.

        Constraints (checked by :func:`fp8_gemm` before launch): ``M % (128 * cluster_m) == 0``,
        ``N % tile_n == 0``, ``K % 128 == 0``; no bounds predication inside the kernel.
        """

        def __init__(self, out_dtype, tile_n: int = 256, stages: Optional[int] = None, cluster_m: int = 1,
                     epilogue: str = "direct"):
            if tile_n not in TILE_NS:
                raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n}")
            if cluster_m not in CLUSTERS:
                raise ValueError(f"cluster_m must be one of {CLUSTERS}, got {cluster_m}")
            if epilogue not in EPILOGUES or (epilogue == "tma" and out_dtype.width != 16):
                raise ValueError(f"epilogue must be one of {EPILOGUES} ('tma' needs a 16-bit output), got {epilogue!r}")
            self.epi_tma = epilogue == "tma"
            self.cluster_m = cluster_m
            self.out_dtype = out_dtype
            self.tile_n = tile_n
            self.stages = stages or STAGES[tile_n]
            self.tile_mnk = (TILE_M, tile_n, TILE_K)
            self.atom_layout = (2, 1, 1)          # two consumer warpgroups stacked along M
            self.threads = 128 * 3

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, num_ctas: Int32,
                     stream: cuda.CUstream):
            a_layout = LayoutEnum.from_tensor(mA)
            b_layout = LayoutEnum.from_tensor(mB)
            self.c_layout = LayoutEnum.from_tensor(mC)
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                Float8E4M3FN, Float8E4M3FN, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
                Float32, self.atom_layout, tiler_mn=(64, self.tile_n))
            sA_l = sm90_utils.make_smem_layout_a(a_layout, self.tile_mnk, Float8E4M3FN, self.stages)
            sB_l = sm90_utils.make_smem_layout_b(b_layout, self.tile_mnk, Float8E4M3FN, self.stages)
            tma_a, tA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA,
                                                    cute.slice_(sA_l, (None, None, 0)), (TILE_M, TILE_K))
            if cutlass.const_expr(self.cluster_m == 1):
                tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB,
                                                        cute.slice_(sB_l, (None, None, 0)), (self.tile_n, TILE_K))
            else:
                tma_b, tB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), mB,
                                                        cute.slice_(sB_l, (None, None, 0)), (self.tile_n, TILE_K),
                                                        num_multicast=self.cluster_m)

            # epilogue smem ring + TMA store atom (built in both modes; smem only for "tma")
            sC_l = sm90_utils.make_smem_layout_epi(self.out_dtype, self.c_layout, (TILE_M, EPI_TILE_N), EPI_STAGES)
            tma_c, tC = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mC,
                                                    cute.slice_(sC_l, (None, None, 0)), (TILE_M, EPI_TILE_N))
            sC_elems = cute.cosize(sC_l) if self.epi_tma else 8

            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sA_l)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sB_l)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, sC_elems], 1024]

            self.shared_storage = SharedStorage
            if cutlass.const_expr(self.cluster_m == 1):
                self.kernel(tma_a, tA, tma_b, tB, mC, tma_c, tC, tiled_mma, sA_l, sB_l, sC_l).launch(
                    grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)
            else:
                self.kernel(tma_a, tA, tma_b, tB, mC, tma_c, tC, tiled_mma, sA_l, sB_l, sC_l).launch(
                    grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], cluster=[self.cluster_m, 1, 1],
                    stream=stream, min_blocks_per_mp=1)

        @cute.kernel
        def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                   mC: cute.Tensor, tma_c: cute.CopyAtom, tC: cute.Tensor, tiled_mma: cute.TiledMma,
                   sA_l: cute.ComposedLayout, sB_l: cute.ComposedLayout, sC_l: cute.ComposedLayout):
            tidx, bidx, gdim, warp_idx, wg_idx = cta_ids()
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_a)
                cpasync.prefetch_descriptor(tma_b)

            # cluster rank along M (0 without clusters); persistent work unit = cluster tile
            rank = 0
            if cutlass.const_expr(self.cluster_m > 1):
                rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            unit0 = bidx // self.cluster_m
            n_units = gdim // self.cluster_m

            storage = SmemAllocator().allocate(self.shared_storage)
            # bytes landing in this CTA per stage: its A tile + the whole B tile (own half + partner's)
            tx_bytes = (cute.size_in_bytes(Float8E4M3FN, cute.slice_(sA_l, (None, None, 0)))
                        + cute.size_in_bytes(Float8E4M3FN, cute.slice_(sB_l, (None, None, 0))))
            # empty barrier: one arrive per consumer warp (8) of every CTA reading the stage
            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8 * self.cluster_m),
                tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)))
            sA = storage.sA.get_tensor(sA_l.outer, swizzle=sA_l.inner)
            sB = storage.sB.get_tensor(sB_l.outer, swizzle=sB_l.inner)

            # (bM, bK, tiles_m, k_tiles) / (bN, bK, tiles_n, k_tiles) / (bM, bN, tiles_m, tiles_n)
            gA = cute.local_tile(mA, (TILE_M, TILE_K), (None, None))
            gB = cute.local_tile(mB, (self.tile_n, TILE_K), (None, None))
            gC = cute.local_tile(mC, (TILE_M, self.tile_n), (None, None))
            units_m = cute.size(gA, mode=[2]) // self.cluster_m
            tiles_n = cute.size(gB, mode=[2])
            k_tiles = cute.size(gA, mode=[3])
            num_units = units_m * tiles_n
            group_span = GROUP_M * tiles_n

            if wg_idx == 0:
                # ---------------- producer warpgroup: one warp issues TMA ----------------
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
                    # with a cluster: this CTA loads B rows [rank * tile_n / 2, ...) and multicasts them
                    tBsB, tBgB = cpasync.tma_partition(tma_b, rank, cute.make_layout(self.cluster_m),
                                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
                    ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                    for unit in cutlass.range(unit0, num_units, n_units, unroll=1):
                        um, tn = self._tile_coord(unit, units_m, group_span)
                        tm = um * self.cluster_m + rank
                        for k in cutlass.range(k_tiles, unroll=1):
                            pipe.producer_acquire(ps)
                            bar = pipe.producer_get_barrier(ps)
                            cute.copy(tma_a, tAgA[(None, tm, k)], tAsA[(None, ps.index)], tma_bar_ptr=bar)
                            if cutlass.const_expr(self.cluster_m == 1):
                                cute.copy(tma_b, tBgB[(None, tn, k)], tBsB[(None, ps.index)], tma_bar_ptr=bar)
                            else:
                                cute.copy(tma_b, tBgB[(None, tn, k)], tBsB[(None, ps.index)], tma_bar_ptr=bar,
                                          mcast_mask=cutlass.Int16((1 << self.cluster_m) - 1))
                            pipe.producer_commit(ps)
                            ps.advance()
                    pipe.producer_tail(ps)
            else:
                # ---------------- 2 consumer warpgroups: WGMMA + epilogue ----------------
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                thr_mma = tiled_mma.get_slice(tidx - 128)
                tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))   # smem descriptors
                tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
                acc = cute.make_rmem_tensor(thr_mma.partition_C(gC[(None, None, 0, 0)]).shape, Float32)
                n_kb = cute.size(tCrA, mode=[2])
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                if cutlass.const_expr(self.epi_tma):
                    # stmatrix (r2s) copy of the accumulator fragment into 128 x 32 swizzled smem tiles
                    sC = storage.sC.get_tensor(sC_l.outer, swizzle=sC_l.inner)
                    r2s = cute.make_tiled_copy_S(
                        sm90_utils.get_smem_store_op(self.c_layout, elem_ty_d=self.out_dtype, elem_ty_acc=Float32),
                        cute.make_tiled_copy_C_atom(
                            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                                                self.out_dtype), tiled_mma))
                    thr_r2s = r2s.get_slice(tidx - 128)
                    tRS_sC = thr_r2s.partition_D(sC)                          # (R2S, R2S_M, R2S_N, EPI_STAGES)
                    tRS_acc = r2s.retile(acc)                                 # chunks of size_rd = one 128 x 32 sub-tile
                    rd_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
                    rD = cute.make_rmem_tensor_like(rd_layout, Float32)
                    size_rd = cute.size(rD)
                    gCt = cute.local_tile(tC, (TILE_M, self.tile_n), (None, None))   # TMA coordinate tiles
                    store_pipe = pipeline.PipelineTmaStore.create(
                        num_stages=EPI_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256))
                rs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
                for unit in cutlass.range(unit0, num_units, n_units, unroll=1):
                    um, tn = self._tile_coord(unit, units_m, group_span)
                    tm = um * self.cluster_m + rank
                    acc.fill(0.0)
                    # k-tile 0
                    pipe.consumer_wait(rs)
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(n_kb):
                        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, rs.index)], tCrB[(None, None, kb, rs.index)], acc)
                    warpgroup.commit_group()
                    rs.advance()
                    # k-tiles 1..: keep one k-tile of WGMMAs in flight, release the one before
                    for k in cutlass.range(1, k_tiles, 1, unroll=1):
                        pipe.consumer_wait(rs)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(n_kb):
                            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, rs.index)],
                                      tCrB[(None, None, kb, rs.index)], acc)
                        warpgroup.commit_group()
                        warpgroup.wait_group(1)
                        pipe.consumer_release(cs)
                        cs.advance()
                        rs.advance()
                    warpgroup.wait_group(0)
                    pipe.consumer_release(cs)
                    cs.advance()
                    if cutlass.const_expr(self.epi_tma):
                        # epilogue: 128 x 32 sub-tiles -> smem ring -> TMA store (issued by thread 128, drained
                        # asynchronously; a ring slot is rewritten only after its store has read it)
                        gEpi = cute.zipped_divide(gCt[(None, None, tm, tn)], (TILE_M, EPI_TILE_N))
                        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                                               cute.group_modes(sC, 0, 2), gEpi)
                        for e in cutlass.range_constexpr(self.tile_n // EPI_TILE_N):
                            for v in cutlass.range_constexpr(size_rd):
                                rD[v] = tRS_acc[e * size_rd + v]
                            rOut = cute.make_rmem_tensor_like(rd_layout, self.out_dtype)
                            rOut.store(rD.load().to(self.out_dtype))
                            buf = e % EPI_STAGES
                            cute.copy(r2s, rOut, tRS_sC[(None, None, None, buf)])
                            cute.arch.fence_view_async_shared()
                            cute.arch.barrier(barrier_id=1, number_of_threads=256)
                            if tidx == 128:   # one thread issues, commits and waits on the bulk groups
                                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (0, e))])
                                store_pipe.producer_commit()
                                store_pipe.producer_acquire()
                            cute.arch.barrier(barrier_id=1, number_of_threads=256)
                    else:
                        # epilogue: registers -> global (one rounding to the output dtype)
                        tCgC = thr_mma.partition_C(gC[(None, None, tm, tn)])
                        if cutlass.const_expr(self.out_dtype == Float32):
                            cute.autovec_copy(acc, tCgC)
                        else:
                            rC = cute.make_rmem_tensor_like(acc, self.out_dtype)
                            rC.store(acc.load().to(self.out_dtype))
                            cute.autovec_copy(rC, tCgC)
                if cutlass.const_expr(self.epi_tma):
                    if tidx == 128:
                        store_pipe.producer_tail()

        def _tile_coord(self, tile, tiles_m, group_span):
            """Grouped-M raster of work units: GROUP_M consecutive M-units sweep N together
            (their B tiles are reused from L2); the last group may be shorter."""
            group = tile // group_span
            first_m = group * GROUP_M
            gsize = cutlass.min(tiles_m - first_m, GROUP_M)
            r = tile - group * group_span
            return first_m + r % gsize, r // gsize


_OUT_DSL = {"bfloat16": "BFloat16", "float32": "Float32"}


def _fake_args(out: str):
    """Fake tensors for one specialization: symbolic M, N, K (one compile serves every size)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    m = cute.sym_int32(divisibility=TILE_M, symbol="M")
    n = cute.sym_int32(divisibility=128, symbol="N")
    k = cute.sym_int32(divisibility=TILE_K, symbol="K")
    a = make_fake_compact_tensor(Float8E4M3FN, (m, k), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(Float8E4M3FN, (n, k), stride_order=(1, 0), assumed_align=16)
    c = make_fake_compact_tensor(getattr(cutlass, _OUT_DSL[out]), (m, n), stride_order=(1, 0), assumed_align=16)
    return a, b, c, Int32(132), make_fake_stream()


def _compile(out: str, tile_n: int, arch: str, extra: str = "", cluster_m: int = 1, epilogue: str = "direct"):
    kern = Fp8GemmKernel(getattr(cutlass, _OUT_DSL[out]), tile_n, cluster_m=cluster_m, epilogue=epilogue)
    return cute.compile(kern, *_fake_args(out), options=compile_options(arch, extra))


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a",
                  variants: Optional[tuple] = None) -> dict[str, str]:
    """Compile the GEMM for ``arch`` without a GPU; return
    ``{"<out>-n<tile_n>-c<cluster_m>[-tma]": PTX}``.

    ``variants`` defaults to every ``(out dtype, tile_n, cluster_m, epilogue)`` (the TMA-store
    epilogue for bf16 only). Used by tests/test_compile_dsl.py and tests/test_dsl_fp8_gemm.py
    (which assert ``PTX_PATTERNS``).
    """
    variants = variants or tuple((o, n, c, e) for o in _OUT for n in TILE_NS for c in CLUSTERS for e in EPILOGUES
                                 if e == "direct" or o == "bfloat16")
    from ._compile import compile_variants
    return compile_variants("fp8_gemm", {
        f"{o}-n{n}-c{c}" + ("-tma" if e == "tma" else ""):
            (lambda arch, extra, o=o, n=n, c=c, e=e: _compile(o, n, arch, extra, cluster_m=c, epilogue=e))
        for o, n, c, e in variants}, dump_dir, arch)


def _check_operand(name: str, t, rows_name: str, rows_mult: int) -> None:
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected dtype torch.float8_e4m3fn (E4M3), got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [{rows_name}, K] tensor, got shape {tuple(t.shape)}")
    if t.stride(1) != 1 or t.stride(0) != t.shape[1]:
        raise ValueError(f"{name}: expected a contiguous K-major [{rows_name}, K] tensor (strides "
                         f"({t.shape[1]}, 1)), got strides {tuple(t.stride())}")
    if t.shape[0] == 0 or t.shape[0] % rows_mult:
        raise ValueError(f"{name}: {rows_name}={t.shape[0]} must be a positive multiple of {rows_mult}")
    if t.shape[1] == 0 or t.shape[1] % TILE_K:
        raise ValueError(f"{name}: K={t.shape[1]} must be a positive multiple of {TILE_K}")


def _prepare(a, b, out_dtype, out, tile_n, num_ctas, cluster_m, epilogue):
    """Validate (naming the argument), allocate ``out``, compile/load; return (launch, out)."""
    import torch
    if tile_n not in TILE_NS:
        raise ValueError(f"tile_n: expected one of {TILE_NS}, got {tile_n!r}")
    if cluster_m not in CLUSTERS:
        raise ValueError(f"cluster_m: expected one of {CLUSTERS}, got {cluster_m!r}")
    _check_operand("a", a, "M", TILE_M * cluster_m)
    _check_operand("b", b, "N", tile_n)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: K={b.shape[1]} must equal a's K={a.shape[1]}")
    if a.device != b.device:
        raise ValueError(f"b: on {b.device}, expected a's device {a.device}")
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.bfloat16
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    if epilogue is None:
        epilogue = "tma" if out_dtype == torch.bfloat16 else "direct"
    if epilogue not in EPILOGUES or (epilogue == "tma" and out_dtype != torch.bfloat16):
        raise ValueError(f"epilogue: expected one of {EPILOGUES} ('tma' with bf16 output only), got {epilogue!r} "
                         f"with out_dtype {out_dtype}")
    M, N = a.shape[0], b.shape[0]
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != out_dtype or tuple(out.shape) != (M, N) \
                or not out.is_contiguous() or out.device != a.device:
            got = (f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))} "
                   f"contiguous={getattr(out, 'is_contiguous', lambda: None)()} on {getattr(out, 'device', None)}")
            raise ValueError(f"out: expected a contiguous {out_dtype} [{M}, {N}] tensor on {a.device}, got {got}")
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t is not None and t.data_ptr() % 16:
            raise ValueError(f"{name}: data pointer must be 16-byte aligned (TMA), got address % 16 = {t.data_ptr() % 16}")
    if num_ctas is not None and (not isinstance(num_ctas, int) or isinstance(num_ctas, bool) or num_ctas <= 0
                                 or num_ctas % cluster_m):
        raise ValueError(f"num_ctas: expected a positive int multiple of cluster_m={cluster_m}, got {num_ctas!r}")
    if a.device.type != "cuda":
        raise RuntimeError(f"a: fp8_gemm runs on a CUDA sm_90a device, got a tensor on {a.device}")
    ok = dsl_available()
    if not ok:
        raise RuntimeError(f"fp8_gemm needs the CuTe DSL: {ok.reason}")

    from dsv4.target import Target
    arch = Target.of(a.device).arch
    if arch != "sm_90a":
        raise RuntimeError(f"a: fp8_gemm is compiled for sm_90a only, device is {arch}")
    out_name = "bfloat16" if out_dtype == torch.bfloat16 else "float32"
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    tiles = (M // TILE_M) * (N // tile_n)
    if num_ctas is None:
        sms = Target.of(a.device).sm_count
        num_ctas = sms - sms % cluster_m
    num_ctas = min(num_ctas, tiles)
    fn = compile_cached(("fp8_gemm", out_name, tile_n, cluster_m, epilogue, arch),
                        lambda: _compile(out_name, tile_n, arch, cluster_m=cluster_m, epilogue=epilogue))

    args = (dl(a, 16, Float8E4M3FN), dl(b, 16, Float8E4M3FN), dl(out, 16), i32(num_ctas))
    dev = a.device

    def launch():
        launch_on(dev, fn, *args)
        return out
    return launch, out


def fp8_gemm(a, b, *, out_dtype=None, out=None, tile_n: int = 256, num_ctas: Optional[int] = None,
             cluster_m: int = 1, epilogue: Optional[str] = None):
    """Dense FP8 GEMM ``C = A @ B^T`` on sm_90a (CuTe DSL, TMA + WGMMA, warp-specialized).

    Benchmark ceiling for the MoE grouped GEMMs (issue 7); **not a registered op** (there is no
    ``PROVIDERS`` entry and no torch reference provider; tests compare it with a torch fp32
    matmul of the dequantized operands).

    Args:
        a: ``[M, K]`` ``torch.float8_e4m3fn`` (E4M3), contiguous (K-major), CUDA, 16 B aligned.
        b: ``[N, K]`` ``torch.float8_e4m3fn``, contiguous (K-major: the weight layout of
            ``nn.Linear``), same device.
        out_dtype: ``torch.bfloat16`` (default, or ``out.dtype``) or ``torch.float32``.
        out: optional preallocated ``[M, N]`` contiguous output of ``out_dtype``.
        tile_n: CTA tile N, 256 (default) or 128. The CTA tile is ``128 x tile_n x 128``.
        num_ctas: persistent grid size; default = the device's SM count (rounded down to a
            multiple of ``cluster_m``, capped at #tiles).
        cluster_m: 1 (default) or 2: CTA pairs along M share the B tile through TMA multicast.
        epilogue: ``"tma"`` (default for bf16: stmatrix -> swizzled smem ring -> asynchronous
            TMA stores) or ``"direct"`` (default and only choice for fp32: accumulator
            registers -> global stores). ``"tma"`` is the faster one (docs/benchmarks.md).

    Returns:
        ``C`` ``[M, N]`` = ``sum_k float(a[m, k]) * float(b[n, k])`` accumulated in fp32 by the
        tensor cores (WGMMA ``.f32.e4m3.e4m3``), rounded once (RN) to ``out_dtype``.

    Constraints: ``M % (128 * cluster_m) == 0``, ``N % tile_n == 0``, ``K % 128 == 0`` (no tail
    handling), all > 0; data pointers 16 B aligned (TMA). One launch, no host sync
    (graph-capturable).

    Raises:
        TypeError / ValueError naming the argument (``a``, ``b``, ``out``, ``out_dtype``,
        ``tile_n``, ``cluster_m``, ``epilogue``, ``num_ctas``) with expected vs got, before anything is compiled or launched.
        RuntimeError (naming ``a``) if the tensors are not on a CUDA sm_90a device, or if the
        CuTe DSL is not importable.
    """
    launch, _ = _prepare(a, b, out_dtype, out, tile_n, num_ctas, cluster_m, epilogue)
    return launch()


def fp8_gemm_launcher(a, b, *, out_dtype=None, out=None, tile_n: int = 256, num_ctas: Optional[int] = None,
                      cluster_m: int = 1, epilogue: Optional[str] = None):
    """Like :func:`fp8_gemm` but validate, allocate and build the launch arguments once and
    return ``(launch, out)``: ``launch()`` re-runs the kernel on the same tensors with no
    per-call Python checks (for benchmarks and CUDA-graph capture). Same arguments and errors."""
    return _prepare(a, b, out_dtype, out, tile_n, num_ctas, cluster_m, epilogue)
