"""CuTe DSL prefill kernel of ``indexer_logits``: FP8 WGMMA over TMA-loaded keys, per-query
``[ks, ke)`` ranges, one persistent launch for all packed sequences.

Contract: docs/layouts/indexer_logits.md (``dsv4.ops.indexer.LOGITS_SPEC``)::

    logits[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s])    ks[t] <= s < ke[t];  -inf elsewhere

Operands: queries ``[T * 64, 128]`` (+ an optional fp32 scale per (t, h) folded into w), keys
``[S, 128]`` + one fp32 scale per key applied after the head sum, both E4M3 (``operand="e4m3"``,
FP8 WGMMA m64n128k32) or both BF16 (``operand="bf16"``, BF16 WGMMA m64n128k16, full FP32
accumulation). MXFP4 inputs reach the E4M3 variant through kernels_dsl/indexer_fp8_rows.py (block
scales folded relative to the row maximum: exact products); FP8 inputs reach the BF16 variant
widened exactly (every E4M3 value is a BF16 value), because the FP8 WGMMA keeps ~14 accumulator
bits, too few for the op's contract on short rows (see below). Stages: E4M3 6 key tiles + 2 query
units (178 KB smem), BF16 4 + 1 (194 KB).

Kernel structure (own code; DeepGEMM ``sm90_fp8_mqa_logits`` is the peer):

* 640 threads: warpgroup 0 = producer (``setmaxnreg.dec`` to 32; one warp issues every TMA
  load: the expect-tx by one elected lane, each TMA ``cute.copy`` by the whole warp, because
  the copy elects its issuing lane with a full-warp ``elect.sync``), warpgroups 1-4 = math
  (``setmaxnreg.inc`` to 112; 32 x 128 + 112 x 512 = 96 x 640 registers, the launch allocation).
  A work unit is 8 consecutive queries; math warpgroup w owns 2 of them (the WGMMA B operand:
  2 x 64 heads = N 128) and **all four math warpgroups consume the same 64-key tile**, so every
  key tile read from L2 serves 8 queries (DeepGEMM splits the keys over its warpgroups instead
  and re-reads every key per 2 queries).
* Persistent CTAs (one per SM) take units round-robin from the last query backwards (causal
  prefill: the longest ranges first, the short ones balance the tail).
* Per key tile and math warpgroup: WGMMA m64n128k32 E4M3 x 4 (K = 128) into one accumulator,
  wait, release the key stage (its two key scales already in registers), then the epilogue
  (ReLU x w head sum on the CUDA cores, x the key scale, range mask, store) while the other
  three warpgroups keep the tensor core busy. Columns of the unit's rows outside the tiles it
  computes are written -inf (the op's full [T, S] contract, no second pass).

Timings and precision (MXFP4 <= 4.5e-7 x the row max vs fp64; FP8 keys on the E4M3 variant up to
2.28e-3 on short rows, hence the BF16 variant for them): docs/benchmarks.md ("Lightning Indexer ...
prefill").

Constraints: 16-byte aligned q / k / key-scale base pointers (TMA); S, T any.
"""
from __future__ import annotations

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float8E4M3FN, Float32, Int32
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from .sm90 import ptx
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["PrefillLogitsKernel", "BQ", "WGS", "QUNIT", "compile_check", "PTX_PATTERNS"]

PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n128k(32\.f32\.e4m3\.e4m3|16\.f32\.bf16\.bf16)",
                r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global",
                r"setmaxnreg\.dec\.sync\.aligned\.u32\s+32", r"setmaxnreg\.inc\.sync\.aligned\.u32\s+112",
                r"mbarrier\.try_wait")
TILE = 64          # keys per tile (WGMMA M)
BQ = 2             # queries per math warpgroup (WGMMA N = 128)
WGS = 4            # math warpgroups
QUNIT = BQ * WGS   # queries per work unit
THREADS = 128 * (1 + WGS)
NEG_INF = float("-inf")
# 640 threads, 1 CTA / SM: 96 registers per thread at launch (65536 / 640, granule 8); the
# producer gives 96 - 32 back, the math warpgroups take 112: 32 * 128 + 112 * 512 = 96 * 640
PRODUCER_REGS = 32
MATH_REGS = 112


if _HAVE_DSL:

    class PrefillLogitsKernel:
        """``__call__(mQ, mK, mKs, mW, mQs, mKsIdx, mKeIdx, mOut, grid, stream)``:

        * ``mQ``: Float8E4M3FN ``[T * 64, 128]`` (row t*64 + h), 16 B aligned.
        * ``mK``: Float8E4M3FN ``[S, 128]``; ``mKs``: Float32 ``[S]`` key scales.
        * ``mW``: Float32 ``[T, 64]``; ``mQs``: Float32 ``[T, 64]`` query scales (``has_qscale``)
          or any fp32 tensor (unread).
        * ``mKsIdx`` / ``mKeIdx``: Int32 ``[T]`` allowed range per query.
        * ``mOut``: Float32 ``[T, S]`` row-major.
        * ``grid``: Int32, persistent CTAs (<= the SM count; 1 CTA per SM, 640 threads).
        """

        def __init__(self, has_qscale: bool, operand: str = "e4m3"):
            self.has_qscale = has_qscale
            self.operand = operand
            self.ab = Float8E4M3FN if operand == "e4m3" else BFloat16
            self.elt = 1 if operand == "e4m3" else 2
            # smem: K ring stages x (64 x 128 x elt + 256 B), Q stages x 4 x 128 x 128 x elt
            self.stages, self.q_stages = (6, 2) if operand == "e4m3" else (4, 1)

        def make_mma(self):
            return sm90_utils.make_trivial_tiled_mma(
                self.ab, self.ab, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                tiler_mn=(TILE, BQ * 64))

        @cute.jit
        def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mKs: cute.Tensor, mW: cute.Tensor, mQs: cute.Tensor,
                     mKsIdx: cute.Tensor, mKeIdx: cute.Tensor, mOut: cute.Tensor, grid: Int32,
                     stream: cuda.CUstream):
            tiled_mma = self.make_mma()
            sK_l = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE, BQ * 64, 128), self.ab, self.stages)
            sQ_l = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, BQ * 64, 128), self.ab,
                                                 self.q_stages * WGS)
            sKs_l = cute.make_layout((TILE, self.stages))
            tma_k, tK = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mK,
                                                    cute.slice_(sK_l, (None, None, 0)), (TILE, 128))
            tma_q, tQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ,
                                                    cute.slice_(sQ_l, (None, None, 0)), (BQ * 64, 128))
            tma_s, tS = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKs,
                                                    cute.slice_(sKs_l, (None, 0)), (TILE,))
            S, QS = self.stages, self.q_stages

            @cute.struct
            class Smem:
                kfull: cute.struct.MemRange[cutlass.Int64, S]
                kempty: cute.struct.MemRange[cutlass.Int64, S]
                qfull: cute.struct.MemRange[cutlass.Int64, QS]
                qempty: cute.struct.MemRange[cutlass.Int64, QS]
                ks: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sKs_l)], 128]
                sK: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sK_l)], 1024]
                sQ: cute.struct.Align[cute.struct.MemRange[self.ab, cute.cosize(sQ_l)], 1024]

            self.smem = Smem
            self.kernel(tma_k, tK, tma_q, tQ, tma_s, tS, mW, mQs, mKsIdx, mKeIdx, mOut, tiled_mma,
                        sK_l, sQ_l, sKs_l).launch(grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                  min_blocks_per_mp=1)

        # ------------------------------------------------------------------ helpers
        @cute.jit
        def unit_tiles(self, mKsIdx: cute.Tensor, mKeIdx: cute.Tensor, k: Int32, cta: Int32, G: Int32, U: Int32,
                       T: Int32, S: Int32):
            """This CTA's k-th query unit u (units dealt round-robin over the G CTAs, from the last
            of the U units) and the key tiles [tile0, tile1) covering the union of the ranges of
            u's queries: (u, tile0, tile1). The producer and the math warpgroups walk the same list."""
            u = U - 1 - cta - k * G
            lo = S
            hi = Int32(0)
            for i in cutlass.range_constexpr(QUNIT):
                t = u * QUNIT + i
                if t < T:
                    a = cutlass.max(cutlass.min(Int32(mKsIdx[t]), S), Int32(0))
                    b = cutlass.max(cutlass.min(Int32(mKeIdx[t]), S), Int32(0))
                    if b > a:
                        lo = cutlass.min(lo, a)
                        hi = cutlass.max(hi, b)
            tile0 = lo // TILE
            tile1 = (hi + (TILE - 1)) // TILE
            if hi <= lo:
                tile0 = Int32(0)
                tile1 = Int32(0)
            return u, tile0, tile1

        @cute.jit
        def head_sum(self, acc: cute.Tensor, rW: cute.Tensor, r: int):
            """ReLU x w over this thread's 16 heads of query row r (accumulator registers 32 r ..
            32 r + 31), then over the quad: (v0, v1) for keys m0 and m0 + 8."""
            s = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            for k in cutlass.range_constexpr(32):
                i = 32 * r + k
                half = (i >> 1) & 1
                par = i & 1
                wj = ((i >> 2) % 8) * 2 + par
                s[2 * half + par] = s[2 * half + par] + cute.arch.fmax(acc[i], Float32(0.0)) * rW[r * 16 + wj]
            v0 = s[0] + s[1]
            v1 = s[2] + s[3]
            for off in cutlass.range_constexpr(2):
                v0 = v0 + cute.arch.shuffle_sync_bfly(v0, offset=1 << off)
                v1 = v1 + cute.arch.shuffle_sync_bfly(v1, offset=1 << off)
            return v0, v1

        def mma_tile(self, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor, ks: Int32, qb: Int32, n_kb: int):
            """The 4 k32 WGMMAs of one key tile (A stage ``ks``) x this warpgroup's queries (B
            stage ``qb``) into a fresh accumulator. Traced inline (fresh atom per call site)."""
            tm = self.make_mma()
            warpgroup.fence()
            for kb in range(n_kb):
                tm.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(tm, acc, tCrA[(None, None, kb, ks)], tCrB[(None, None, kb, qb)], acc)
            warpgroup.commit_group()

        @cute.jit
        def epilogue(self, acc: cute.Tensor, rW: cute.Tensor, rLo: cute.Tensor, rHi: cute.Tensor, mOut: cute.Tensor,
                     t0: Int32, tile: Int32, ksc0: Float32, ksc1: Float32, m0: Int32, q4: Int32, T: Int32, S: Int32):
            for r in cutlass.range_constexpr(BQ):
                v0, v1 = self.head_sum(acc, rW, r)
                v = cutlass.select_(q4 == 1, v1 * ksc1, v0 * ksc0)
                s = tile * TILE + m0 + 8 * q4
                t = t0 + r
                if (q4 < 2) & (s < S) & (t < T):
                    ok = (s >= rLo[r]) & (s < rHi[r])
                    mOut[t, s] = cutlass.select_(ok, v, Float32(NEG_INF))

        @cute.jit
        def advance(self, stage: Int32, phase: Int32, n: int):
            """Next slot of an n-deep ring: (stage + 1) mod n, the phase flipped at the wrap."""
            stage = stage + 1
            if stage == n:
                stage = Int32(0)
                phase = phase ^ 1
            return stage, phase

        # ------------------------------------------------------------------ kernel
        @cute.kernel
        def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_q: cute.CopyAtom, mQ: cute.Tensor,
                   tma_s: cute.CopyAtom, mKs: cute.Tensor, mW: cute.Tensor, mQs: cute.Tensor, mKsIdx: cute.Tensor,
                   mKeIdx: cute.Tensor, mOut: cute.Tensor, tiled_mma: cute.TiledMma, sK_l: cute.ComposedLayout,
                   sQ_l: cute.ComposedLayout, sKs_l: cute.Layout):
            tidx, _, _ = cute.arch.thread_idx()
            cta, _, _ = cute.arch.block_idx()
            G, _, _ = cute.arch.grid_dim()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg = cute.arch.make_warp_uniform(tidx // 128)
            lane = cute.arch.lane_idx()
            S_st, QS = self.stages, self.q_stages
            T = mOut.shape[0]
            S = mOut.shape[1]
            U = (T + (QUNIT - 1)) // QUNIT
            n_my = Int32(0)
            if cta < U:
                n_my = (U - 1 - cta) // G + 1

            st = SmemAllocator().allocate(self.smem)
            kfull = st.kfull.data_ptr().toint()
            kempty = st.kempty.data_ptr().toint()
            qfull = st.qfull.data_ptr().toint()
            qempty = st.qempty.data_ptr().toint()
            ks_base = st.ks.data_ptr().toint()
            if tidx == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_q)
                cpasync.prefetch_descriptor(tma_s)
                for i in cutlass.range_constexpr(S_st):
                    ptx.mbar_init(kfull + 8 * i, 1)
                    ptx.mbar_init(kempty + 8 * i, 4 * WGS)
                for i in cutlass.range_constexpr(QS):
                    ptx.mbar_init(qfull + 8 * i, 1)
                    ptx.mbar_init(qempty + 8 * i, 4 * WGS)
                ptx.mbar_fence_init()
            cute.arch.sync_threads()
            sK = st.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
            sQ = st.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
            sKs = st.ks.get_tensor(sKs_l)
            # (slot, phase) of the key ring and of the query ring: the producer and the math
            # warpgroups walk both from slot 0, phase 0
            stage = Int32(0)
            phase = Int32(0)
            qst = Int32(0)
            qph = Int32(0)

            if wg == 0:
                # ======================= producer =======================
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp == 0:
                    gK = cute.local_tile(mK, (TILE, 128), (None, None))
                    gQ = cute.local_tile(mQ, (BQ * 64, 128), (None, None))
                    gS = cute.local_tile(mKs, (TILE,), (None,))
                    tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                                     cute.group_modes(gK, 0, 2))
                    tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                     cute.group_modes(gQ, 0, 2))
                    tSs, tSg = cpasync.tma_partition(tma_s, 0, cute.make_layout(1), cute.group_modes(sKs, 0, 1),
                                                     cute.group_modes(gS, 0, 1))
                    kfull_p = st.kfull.data_ptr()
                    qfull_p = st.qfull.data_ptr()
                    for k in cutlass.range(n_my, unroll=1):
                        u, tile0, tile1 = self.unit_tiles(mKsIdx, mKeIdx, k, cta, G, U, T, S)
                        ptx.mbar_wait(qempty + 8 * qst, qph ^ 1)
                        # expect-tx by one elected lane; the TMA copies by the WHOLE warp (a TMA
                        # cute.copy elects its own issuing lane with elect.sync over the full warp:
                        # inside a lane-0 branch that elect.sync waits for 31 absent lanes)
                        with cute.arch.elect_one():
                            ptx.mbar_arrive_expect_tx(qfull + 8 * qst, WGS * BQ * 64 * 128 * self.elt)
                        for w in cutlass.range_constexpr(WGS):
                            cute.copy(tma_q, tQg[(None, u * WGS + w, 0)], tQs[(None, qst * WGS + w)],
                                      tma_bar_ptr=qfull_p + qst)
                        qst, qph = self.advance(qst, qph, QS)
                        for tile in cutlass.range(tile0, tile1, unroll=1):
                            ptx.mbar_wait(kempty + 8 * stage, phase ^ 1)
                            with cute.arch.elect_one():
                                ptx.mbar_arrive_expect_tx(kfull + 8 * stage, TILE * 128 * self.elt + TILE * 4)
                            cute.copy(tma_k, tKg[(None, tile, 0)], tKs[(None, stage)], tma_bar_ptr=kfull_p + stage)
                            cute.copy(tma_s, tSg[(None, tile)], tSs[(None, stage)], tma_bar_ptr=kfull_p + stage)
                            stage, phase = self.advance(stage, phase, S_st)
            else:
                # ======================= math warpgroups =======================
                cute.arch.setmaxregister_increase(MATH_REGS)
                w = wg - 1
                mt = tidx - 128 * wg                    # thread in this warpgroup
                mwarp = warp - 4 * wg
                thr = tiled_mma.get_slice(mt)
                tCrA = tiled_mma.make_fragment_A(thr.partition_A(sK))
                tCrB = tiled_mma.make_fragment_B(thr.partition_B(sQ))
                acc_shape = thr.partition_C(cute.make_identity_tensor((TILE, BQ * 64))).shape
                acc = cute.make_rmem_tensor(acc_shape, Float32)
                rW = cute.make_rmem_tensor((BQ * 16,), Float32)
                rLo = cute.make_rmem_tensor((BQ,), Int32)
                rHi = cute.make_rmem_tensor((BQ,), Int32)
                n_kb = cute.size(tCrA, mode=[2])
                m0 = mwarp * 16 + lane // 4
                q4 = lane % 4
                for k in cutlass.range(n_my, unroll=1):
                    u, tile0, tile1 = self.unit_tiles(mKsIdx, mKeIdx, k, cta, G, U, T, S)
                    t0 = u * QUNIT + w * BQ
                    for r in cutlass.range_constexpr(BQ):
                        t = t0 + r
                        rLo[r] = Int32(0)
                        rHi[r] = Int32(0)
                        for j in cutlass.range_constexpr(16):
                            rW[r * 16 + j] = Float32(0.0)
                        if t < T:
                            rLo[r] = Int32(mKsIdx[t])
                            rHi[r] = Int32(mKeIdx[t])
                            for j in cutlass.range_constexpr(16):
                                hh = 8 * (j // 2) + 2 * q4 + (j % 2)
                                wv = Float32(mW[t, hh])
                                if cutlass.const_expr(self.has_qscale):
                                    wv = wv * Float32(mQs[t, hh])
                                rW[r * 16 + j] = wv
                    qb = qst * WGS + w
                    ptx.mbar_wait(qfull + 8 * qst, qph)
                    # one accumulator per warpgroup: MMA, wait, release the key stage, epilogue;
                    # the other three warpgroups keep the tensor core busy meanwhile
                    for tile in cutlass.range(tile0, tile1, unroll=1):
                        ptx.mbar_wait(kfull + 8 * stage, phase)
                        ks_addr = ks_base + stage * (TILE * 4)
                        ksc0 = ptx.ld_shared_f32(ks_addr + m0 * 4)
                        ksc1 = ptx.ld_shared_f32(ks_addr + (m0 + 8) * 4)
                        self.mma_tile(acc, tCrA, tCrB, stage, qb, n_kb)
                        warpgroup.wait_group(0)
                        cute.arch.sync_warp()
                        if lane == 0:
                            ptx.mbar_arrive(kempty + 8 * stage)
                        self.epilogue(acc, rW, rLo, rHi, mOut, t0, tile, ksc0, ksc1, m0, q4, T, S)
                        stage, phase = self.advance(stage, phase, S_st)
                    # release the query stage (every WGMMA reading it has completed)
                    cute.arch.sync_warp()
                    if lane == 0:
                        ptx.mbar_arrive(qempty + 8 * qst)
                    qst, qph = self.advance(qst, qph, QS)
                    # columns of these rows outside the computed tiles: -inf
                    c0 = cutlass.min(tile0 * TILE, S)
                    c1 = cutlass.min(tile1 * TILE, S)
                    for r in cutlass.range_constexpr(BQ):
                        t = t0 + r
                        if t < T:
                            for col in cutlass.range(mt, c0, 128, unroll=1):
                                mOut[t, col] = Float32(NEG_INF)
                            for col in cutlass.range(c1 + mt, S, 128, unroll=1):
                                mOut[t, col] = Float32(NEG_INF)


def _fake_args(has_qscale: bool, operand: str = "e4m3"):
    """Fake tensors: every extent symbolic (the launch marks all layouts dynamic); T, S shared."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    sym = cute.sym_int32
    T, S = sym(symbol="T"), sym(symbol="S")
    TH = sym(divisibility=64, symbol="T64")
    D = sym(divisibility=128, symbol="D")
    H = sym(divisibility=64, symbol="H")
    ab = Float8E4M3FN if operand == "e4m3" else BFloat16
    q = make_fake_compact_tensor(ab, (TH, D), stride_order=(1, 0), assumed_align=16)
    k = make_fake_compact_tensor(ab, (S, D), stride_order=(1, 0), assumed_align=16)
    ks = make_fake_compact_tensor(Float32, (S,), assumed_align=16)
    w = make_fake_compact_tensor(Float32, (T, H), stride_order=(1, 0), assumed_align=16)
    qs = make_fake_compact_tensor(Float32, (T, H), stride_order=(1, 0), assumed_align=16)
    a = make_fake_compact_tensor(Int32, (T,), assumed_align=4)
    b = make_fake_compact_tensor(Int32, (T,), assumed_align=4)
    o = make_fake_compact_tensor(Float32, (T, S), stride_order=(1, 0), assumed_align=4)
    return q, k, ks, w, qs, a, b, o, Int32(132), make_fake_stream()


def compile_prefill(has_qscale: bool, arch: str, extra: str = "", operand: str = "e4m3"):
    """``operand``: ``"e4m3"`` (MXFP4 keys folded to FP8, FP8 WGMMA) or ``"bf16"`` (FP8 keys decoded
    exactly to BF16, BF16 WGMMA m64n128k16: full FP32 accumulation)."""
    from ._compile import compile_options
    return cute.compile(PrefillLogitsKernel(has_qscale, operand), *_fake_args(has_qscale, operand),
                        options=compile_options(arch, extra))


def compile_check(dump_dir=None, arch: str = "sm_90a") -> dict:
    from ._compile import compile_variants
    return compile_variants("indexer_prefill", {
        name: (lambda arch, extra, hq=hq, operand=operand: compile_prefill(hq, arch, extra, operand))
        for name, hq, operand in (("mxfp4-e4m3", True, "e4m3"), ("fp8-e4m3", False, "e4m3"), ("fp8-bf16", False, "bf16"))},
        dump_dir, arch)
