"""CuTe DSL sparse attention with a per-head sink over the DSV4 fp8_ds_mla caches (sm_90a).

One kernel serves decode (``T = B * next_n`` query rows) and prefill (``T`` = every token of a
ragged batch): each query row ``t`` attends, with all its heads, to its own list of entries
``[SWA window slots] ++ [compressed slots]`` (physical slot ids ``page * bs + off`` of two
584 B/token caches), one softmax over the union plus the sink (``dsv4.ops.sparse_attention``
has the contract). Design (own code, after FlashMLA's SM90 sparse FP8 decode kernel and the
CuTe DSL Hopper FMHA examples; nothing copied):

* CTA = (query row ``t``, block of 64 heads, KV split); 384 threads = 3 warpgroups.
* Warpgroup 2, the producer (``setmaxnreg.dec``): thread 0 loads the CTA's Q block
  ``[64 heads, 512]`` once with TMA (rows past ``H`` are zero-filled by TMA, so H = 16 / 32
  need no padded copy); then per tile of 64 list entries every thread owns 2 entries x 16
  dims of each 64-dim block: it resolves the slot (SWA part, then compressed part, entries
  past the row's lengths / ``-1`` / out of ``[0, num_slots)`` = invalid: never dereferenced),
  loads the 448 E4M3 bytes + 128 B BF16 rope + 8 B scales of the row with 16-byte
  ``ld.global.nc`` (the list indices of the next tile are prefetched), decodes E4M3 -> BF16
  with integer ops and two exact bf16 multiplies by powers of two
  (:mod:`kernels_dsl.sm90.attention`) once for all heads, and stores the BF16 row into a
  2-stage 128B-swizzled K tile ``[64, 512]`` (invalid rows: zeros + score bias ``-inf``).
  ``fence.proxy.async`` + mbarrier arrive publish a stage to the tensor cores.
* Warpgroup 0: ``S = Q K^T`` (``wgmma m64n64k16``, both operands in smem), online softmax in
  base 2 (scale folded in; running max floor -1e30 so empty rows stay finite), P rounded to
  bf16 in registers, ``O[:, 0:256] += P V`` (``wgmma m64n256k16``, P from registers, V = the
  same smem tile read MN-major), P and the row rescale factors also go to smem for
* warpgroup 1: ``O[:, 256:512] += P V`` (both operands in smem). The rescale factors (``sScale``)
  are double-buffered by tile parity: WG0 writes tile ``i + 1``'s factors into the buffer WG1 did not
  read last (compute-sanitizer racecheck does not order a read before ``bar.arrive`` against a write
  after the completing ``bar.sync``: a false WAR report on a single buffer, reproduced by
  scripts/sanitize_mbarrier_probe.py ``single`` / ``wgmma``; docs/status.md, sanitizer section).
  512 = 2 x 256 because WGMMA N <= 256 and a 64 x 512 fp32 accumulator does not fit one
  warpgroup's registers.
* Epilogue: ``o = O / (l + 2^(sink2 - m2))`` (bf16), ``lse = ln(sum exp(s) + exp(sink))``; with
  KV splits each split writes ``O / l`` (fp32) and its own base-2 LSE without the sink, merged by
  :mod:`kernels_dsl.sparse_attention_combine`.

Constraints (checked by the provider): q bf16 ``[T, H, 512]`` contiguous; H >= 1 (any, in
blocks of 64); caches uint8 fp8_ds_mla with an even page size, 16 B aligned; index lists int32
contiguous ``[T, n]``. Runtime sizes are symbolic: one compile per (split / no split, arch).

GPU tests (tests/test_sparse_attention.py): H = 16 / 32 / 64 / 128, CSA / HCA / SWA-only / diffuse /
no-sink lists, adversarial lists, KV splits 1 / 3 / auto, decode next_n 2, prefill rows. Compiles for
sm_90a with 0 spills within the 112 / 224 / 168 setmaxnreg budgets (they must sum to 3 x 168: a larger increase waits forever for registers
nobody released). Two bugs found on the way, both worth knowing for any DSL kernel:

* every fake-tensor extent must be symbolic (:func:`make_fake_args`): a static extent changes the
  compiled ABI and the runtime tensors were read with wrong strides;
* a TMA ``cute.copy`` elects its issuing lane with ``elect.sync`` over the FULL warp, so it must be
  called by a whole warp: inside an ``if tid == 0`` branch the other 31 lanes never arrive (observed:
  a CTA with >= 3 list tiles hung on a reused K stage, since one producer warp never left the Q load;
  1-2 tiles finished by luck). Found with printf traces of every pipeline step per warp.
"""
from __future__ import annotations

import math
from typing import Optional

from ._compile import compile_options, compile_variants

try:  # the DSL is optional at import time
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import BFloat16, Float32, Int32, Int64, Uint32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from .sm90.attention import (acc_frg_a_layout, dequant_e4m3x4, make_acc_mn_view, st_shared_v4, sw128_offset,
                                 ue8m0_bf16_multipliers)
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["SparseAttentionFwdKernel", "compile_check", "PTX_PATTERNS", "BLOCK_H", "TILE_N", "HEAD_DIM",
           "STAGES", "make_fake_args", "compile_kernel"]

BLOCK_H = 64          # heads per CTA (WGMMA M)
TILE_N = 64           # list entries per K tile
HEAD_DIM = 512
NOPE = 448
STAGES = 2
TOKEN_BYTES = 584
DATA_BYTES = 576
#: per-thread register budgets of the three warpgroups. setmaxnreg only moves registers inside the
#: CTA's launch allocation (384 threads x 168 = 64512), so the three must sum to 3 x 168: a larger
#: increase would wait forever for registers nobody released.
PRODUCER_REGS = 112
MMA0_REGS = 224
MMA1_REGS = 168       # = the launch allocation for 384 threads (no setmaxnreg)
assert PRODUCER_REGS + MMA0_REGS + MMA1_REGS == 3 * 168
#: running-max floor: exp2(s - m) never sees (-inf) - (-inf)
M_FLOOR = -1.0e30
LOG2E = math.log2(math.e)
# named barriers (0 = __syncthreads)
BAR_P_READY, BAR_P_FREE, BAR_EPI, BAR_OUT = 1, 2, 3, 4

#: What the compiled PTX must contain (tests/test_compile_dsl.py).
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16",
                r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16",
                r"cp\.async\.bulk\.tensor\.3d\.shared::(cta|cluster)\.global",
                r"ld\.global\.nc\.v4\.(b|u|s)32",
                r"st\.shared\.v4\.(b|u|s)32",
                r"mul\.rn\.bf16x2",
                r"prmt\.b32",
                r"setmaxnreg\.dec\.sync\.aligned\.u32\s+%d" % PRODUCER_REGS,
                r"setmaxnreg\.inc\.sync\.aligned\.u32\s+%d" % MMA0_REGS)


def _check_k_layout(sK_l) -> None:
    """The producer writes the K tile at hand-computed addresses: pin the layout it assumes
    (8-entry x 64-dim 128B-swizzled atoms, entries first, then 64-dim blocks, then stages)."""
    want = "S<3,4,3> o 0 o ((8,8),(64,8),(1,%d)):((64,512),(1,4096),(0,32768))" % STAGES
    if str(sK_l) != want:
        raise RuntimeError(f"sparse_attention_fwd: K tile layout {sK_l} differs from the assumed {want}")


if _HAVE_DSL:

    class SparseAttentionFwdKernel:
        """Sparse attention over two fp8_ds_mla caches, one CTA per (row, 64 heads, split).

        ``__call__(mQ, mSwa, mSwaIdx, mSwaLen, mComp, mCompIdx, mCompLen, mSink, mO, mLse,
        swa_bs, swa_slots, comp_bs, comp_slots, scale_log2, tiles_per_split, num_splits, stream)``:

        * ``mQ``: BFloat16 ``[T, H, 512]`` contiguous.
        * ``mSwa`` / ``mComp``: Uint8 ``[bytes]`` flat fp8_ds_mla caches (16 B aligned), page
          size ``*_bs`` (even) tokens, ``*_slots`` = pages * bs valid slot ids.
        * ``mSwaIdx`` / ``mCompIdx``: Int32 ``[T, Ws]`` / ``[T, Kc]`` physical slots; ``mSwaLen`` /
          ``mCompLen``: Int32 ``[T]`` valid prefix lengths (clamped to ``[0, n]``).
        * ``mSink``: Float32 ``[H]`` (natural-log units; ``-inf`` = no sink).
        * no split: ``mO`` BFloat16 ``[T, H, 512]``, ``mLse`` Float32 ``[T, H]`` natural log incl. sink;
          split: ``mO`` Float32 ``[S, T, H, 512]`` = ``O / l``, ``mLse`` Float32 ``[S, T, H]`` =
          ``m2 + log2(l)`` (base 2, no sink; ``-inf`` if the split saw no valid entry).
        * ``scale_log2`` = softmax scale * log2(e); split ``s`` takes list tiles
          ``[s * tiles_per_split, (s + 1) * tiles_per_split)`` of the row's compacted list.
        """

        def __init__(self, split: bool):
            self.split = split
            self.threads = 384

        @cute.jit
        def __call__(self, mQ: cute.Tensor, mSwa: cute.Tensor, mSwaIdx: cute.Tensor, mSwaLen: cute.Tensor,
                     mComp: cute.Tensor, mCompIdx: cute.Tensor, mCompLen: cute.Tensor, mSink: cute.Tensor,
                     mO: cute.Tensor, mLse: cute.Tensor, swa_bs: Int32, swa_slots: Int32, comp_bs: Int32,
                     comp_slots: Int32, scale_log2: Float32, tiles_per_split: Int32, num_splits: Int32,
                     stream: cuda.CUstream):
            T = mQ.shape[0]
            H = mQ.shape[1]
            # Q as (H, 512, T): a TMA box of 64 heads x 512 dims per row t; heads >= H read as zeros
            mQ_hdt = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
            tile_qk = (BLOCK_H, TILE_N, HEAD_DIM)
            sQ_l = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_qk, BFloat16, 1)
            sK_l = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_qk, BFloat16, STAGES)
            sP_l = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BLOCK_H, HEAD_DIM // 2, TILE_N), BFloat16, 1)
            _check_k_layout(sK_l)
            tma_q, tQ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mQ_hdt,
                                                    cute.slice_(sQ_l, (None, None, 0)), (BLOCK_H, HEAD_DIM))
            mma_qk = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
                (1, 1, 1), tiler_mn=(BLOCK_H, TILE_N))
            mma_pv_rs = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                (1, 1, 1), tiler_mn=(BLOCK_H, HEAD_DIM // 2), a_source=warpgroup.OperandSource.RMEM)
            mma_pv_ss = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
                (1, 1, 1), tiler_mn=(BLOCK_H, HEAD_DIM // 2))

            @cute.struct
            class SharedStorage:
                mbar_kv: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
                mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
                sBias: cute.struct.MemRange[Float32, STAGES * TILE_N]
                sScale: cute.struct.MemRange[Float32, 2 * BLOCK_H]          # (64 rows, tile parity)
                sOScale: cute.struct.MemRange[Float32, BLOCK_H]
                sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_l)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_l)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sP_l)], 1024]

            self.shared_storage = SharedStorage
            hb = cute.ceil_div(H, BLOCK_H)
            self.kernel(tma_q, tQ, mSwa, mSwaIdx, mSwaLen, mComp, mCompIdx, mCompLen, mSink, mO, mLse,
                        swa_bs, swa_slots, comp_bs, comp_slots, scale_log2, tiles_per_split, H,
                        mma_qk, mma_pv_rs, mma_pv_ss, sQ_l, sK_l, sP_l).launch(
                grid=[hb, T, num_splits], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

        @cute.kernel
        def kernel(self, tma_q: cute.CopyAtom, tQ: cute.Tensor, mSwa: cute.Tensor, mSwaIdx: cute.Tensor,
                   mSwaLen: cute.Tensor, mComp: cute.Tensor, mCompIdx: cute.Tensor, mCompLen: cute.Tensor,
                   mSink: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor, swa_bs: Int32, swa_slots: Int32,
                   comp_bs: Int32, comp_slots: Int32, scale_log2: Float32, tiles_per_split: Int32, H: Int32,
                   mma_qk: cute.TiledMma, mma_pv_rs: cute.TiledMma, mma_pv_ss: cute.TiledMma,
                   sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sP_l: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            hblk, t, split = cute.arch.block_idx()
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            wtid = tidx % 128
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_q)

            storage = SmemAllocator().allocate(self.shared_storage)
            bar_q = storage.mbar_q.data_ptr()
            if tidx == 0:
                cute.arch.mbarrier_init(bar_q, 1)
            # KV stages: full <- 128 producer threads, empty <- 256 consumer threads
            pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_kv.data_ptr(), num_stages=STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256))
            sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
            sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)          # (64 entries, 512, stage)
            sP = storage.sP.get_tensor(sP_l.outer, swizzle=sP_l.inner)          # (64 heads, 64 entries)
            sBias = storage.sBias.get_tensor(cute.make_layout((TILE_N, STAGES)))
            sScale = storage.sScale.get_tensor(cute.make_layout((BLOCK_H, 2)))
            sOScale = storage.sOScale.get_tensor(cute.make_layout(BLOCK_H))
            # V^T view of the same tile for the PV MMAs: (512 dims, 64 entries, stage)
            sVt = cute.composition(sK, cute.make_ordered_layout((HEAD_DIM, TILE_N, STAGES), order=(1, 0, 2)))

            # the row's compacted list: n_swa SWA entries, then n_c compressed entries
            n_swa = cutlass.max(cutlass.min(mSwaLen[t], mSwaIdx.shape[1]), 0)
            n_c = cutlass.max(cutlass.min(mCompLen[t], mCompIdx.shape[1]), 0)
            n_tot = n_swa + n_c
            tile0 = split * tiles_per_split
            tile1 = cutlass.min(tile0 + tiles_per_split, (n_tot + TILE_N - 1) // TILE_N)
            n_tiles = cutlass.max(tile1 - tile0, 0)

            if wg_idx == 2:
                # ============================ producer warpgroup ============================
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                # the TMA copy elects its issuing lane with elect.sync over the full warp: issue it from
                # the whole warp 0 (inside a one-thread branch the other 31 lanes never arrive: a hang)
                if wtid == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(bar_q, BLOCK_H * HEAD_DIM * 2)
                if wtid < 32:
                    gQ = cute.local_tile(tQ[(None, None, t)], (BLOCK_H, HEAD_DIM), (hblk, 0))
                    tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                                     cute.group_modes(gQ, 0, 2))
                    cute.copy(tma_q, tQg, tQs[(None, 0)], tma_bar_ptr=bar_q)
                self._produce(pipe, storage.sK.data_ptr().toint(), sBias, mSwa, mSwaIdx, mComp, mCompIdx, swa_bs, swa_slots, comp_bs,
                              comp_slots, t, n_swa, n_tot, tile0, n_tiles, wtid)
            elif wg_idx == 0:
                # ===================== consumer 0: QK^T, softmax, O[:, :256] =====================
                cute.arch.setmaxregister_increase(MMA0_REGS)
                self._consume0(pipe, bar_q, sQ, sK, sVt, sP, sBias, sScale, sOScale, mSink, mO, mLse, mma_qk,
                               mma_pv_rs, scale_log2, t, hblk, split, H, n_tiles, wtid)
            else:
                # ================== consumer 1: O[:, 256:] (keeps the launch's 168 registers) ==================
                self._consume1(pipe, sVt, sP, sScale, sOScale, mO, mma_pv_ss, t, hblk, split, H, n_tiles, wtid)

        # ------------------------------------------------------------------ producer
        @cute.jit
        def _slot(self, j, mSwaIdx, mCompIdx, t, n_swa, n_tot):
            """Slot id of list position j of row t (-1 past the end); 1 = from the SWA cache."""
            slot = Int32(-1)
            is_swa = Int32(0)
            if j < n_swa:
                slot = mSwaIdx[t, j]
                is_swa = Int32(1)
            elif j < n_tot:
                slot = mCompIdx[t, j - n_swa]
            return slot, is_swa

        @cute.jit
        def _produce(self, pipe, sK_base, sBias, mSwa, mSwaIdx, mComp, mCompIdx, swa_bs, swa_slots, comp_bs,
                     comp_slots, t, n_swa, n_tot, tile0, n_tiles, wtid):
            warp = wtid // 32
            lane = wtid % 32
            g = lane // 8                    # 16-dim group of each 64-dim block this lane owns
            ld128 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=128, invariant=True)
            ld64 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint32, num_bits_per_copy=64, invariant=True)
            swa_base = mSwa.iterator.toint()
            comp_base = mComp.iterator.toint()
            ps = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
            # list positions owned by this thread in a tile: e = warp * 8 + lane % 8 + 32 r
            nxt = cute.make_rmem_tensor((2, 2), Int32)          # (slot, is_swa) x round, prefetched
            for r in cutlass.range_constexpr(2):
                s, w = self._slot(tile0 * TILE_N + r * 32 + warp * 8 + lane % 8, mSwaIdx, mCompIdx, t, n_swa, n_tot)
                nxt[0, r] = s
                nxt[1, r] = w
            for it in cutlass.range(n_tiles, unroll=1):
                tile = tile0 + it
                # --- issue the global loads of both rounds (before waiting for the stage) ---
                rNope = cute.make_rmem_tensor((4, 7, 2), Uint32)
                rRope = cute.make_rmem_tensor((4, 2, 2), Uint32)
                rSf = cute.make_rmem_tensor((2, 2), Uint32)
                rNope.fill(0)
                rRope.fill(0)
                rSf.fill(0)
                valid = cute.make_rmem_tensor((2,), Int32)
                for r in cutlass.range_constexpr(2):
                    slot = nxt[0, r]
                    from_swa = nxt[1, r] != 0
                    bs = comp_bs
                    nslots = comp_slots
                    base = comp_base
                    if from_swa:
                        bs = swa_bs
                        nslots = swa_slots
                        base = swa_base
                    ok = (slot >= 0) & (slot < nslots)
                    valid[r] = Int32(ok)
                    if ok:
                        page = slot // bs
                        off = slot - page * bs
                        page_bytes = Int64(page) * Int64(bs) * TOKEN_BYTES
                        row = base + page_bytes + Int64(off) * DATA_BYTES
                        for b in cutlass.range_constexpr(7):
                            src = cute.make_tensor(cute.make_ptr(Uint32, row + (b * 64 + g * 16), cute.AddressSpace.gmem,
                                                                 assumed_align=16), cute.make_layout(4))
                            cute.copy(ld128, src, rNope[(None, b, r)])
                        for h in cutlass.range_constexpr(2):
                            src = cute.make_tensor(cute.make_ptr(Uint32, row + (NOPE + g * 32 + h * 16),
                                                                 cute.AddressSpace.gmem, assumed_align=16),
                                                   cute.make_layout(4))
                            cute.copy(ld128, src, rRope[(None, h, r)])
                        sfp = base + page_bytes + Int64(bs) * DATA_BYTES + Int64(off) * 8
                        src = cute.make_tensor(cute.make_ptr(Uint32, sfp, cute.AddressSpace.gmem, assumed_align=8),
                                               cute.make_layout(2))
                        cute.copy(ld64, src, rSf[(None, r)])
                # --- prefetch the next tile's slots ---
                for r in cutlass.range_constexpr(2):
                    s, w = self._slot((tile + 1) * TILE_N + r * 32 + warp * 8 + lane % 8, mSwaIdx, mCompIdx, t,
                                      n_swa, n_tot)
                    nxt[0, r] = s
                    nxt[1, r] = w
                # --- decode into the stage (16-byte st.shared at the 128B-swizzled addresses) ---
                pipe.producer_acquire(ps)
                stage = ps.index
                stage_base = sK_base + stage * (TILE_N * HEAD_DIM * 2)
                for r in cutlass.range_constexpr(2):
                    e = r * 32 + warp * 8 + lane % 8
                    row_base = stage_base + (e // 8) * 1024
                    for b in cutlass.range_constexpr(7):
                        sf_word = rSf[b // 4, r]
                        sf = (sf_word >> Uint32(8 * (b % 4))) & Uint32(0xFF)
                        m1, m2 = ue8m0_bf16_multipliers(sf)
                        for h in cutlass.range_constexpr(2):
                            w0, w1 = dequant_e4m3x4(rNope[2 * h, b, r], m1, m2)
                            w2, w3 = dequant_e4m3x4(rNope[2 * h + 1, b, r], m1, m2)
                            st_shared_v4(row_base + b * 8192 + sw128_offset(e, 2 * g + h), w0, w1, w2, w3)
                    for h in cutlass.range_constexpr(2):
                        st_shared_v4(row_base + 7 * 8192 + sw128_offset(e, 2 * g + h), rRope[0, h, r], rRope[1, h, r],
                                     rRope[2, h, r], rRope[3, h, r])
                    if g == 0:
                        sBias[e, stage] = cutlass.select_(valid[r] != 0, Float32(0.0), -Float32.inf)
                # WGMMA reads the stage through the async proxy
                cute.arch.fence_view_async_shared()
                pipe.producer_commit(ps)
                ps.advance()

        # ------------------------------------------------------------------ consumer 0
        @cute.jit
        def _consume0(self, pipe, bar_q, sQ, sK, sVt, sP, sBias, sScale, sOScale, mSink, mO, mLse, mma_qk,
                      mma_pv_rs, scale_log2, t, hblk, split, H, n_tiles, wtid):
            thr_qk = mma_qk.get_slice(wtid)
            tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))          # (MMA, 1, 32) descriptors
            tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))          # (MMA, 1, 32, STAGES)
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_H, TILE_N)), Float32)
            thr_pv = mma_pv_rs.get_slice(wtid)
            sV0 = cute.local_tile(sVt, (HEAD_DIM // 2, TILE_N), (0, 0, None))  # dims [0, 256)
            tOrV = mma_pv_rs.make_fragment_B(thr_pv.partition_B(sV0))      # (MMA, 1, 4, STAGES)
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, HEAD_DIM // 2)), Float32)
            # P: bf16 copy of acc_s, viewed as the register A operand of the PV MMA
            rP = cute.make_rmem_tensor(acc_s.layout, BFloat16)
            tOrP = cute.make_tensor(rP.iterator, acc_frg_a_layout(rP.layout))
            # P -> smem for warpgroup 1 (stmatrix)
            r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), BFloat16),
                                         mma_qk)
            thr_r2s = r2s.get_slice(wtid)
            tPsP = thr_r2s.partition_D(sP)
            tPrP = thr_r2s.retile(rP)
            # coordinates of this thread's accumulator elements
            cS = make_acc_mn_view(thr_qk.partition_C(cute.make_identity_tensor((BLOCK_H, TILE_N))))
            acc_s_mn = make_acc_mn_view(acc_s)
            acc_o_mn = make_acc_mn_view(acc_o)
            n_rows = cute.size(acc_s_mn, mode=[0])        # 2
            n_cols = cute.size(acc_s_mn, mode=[1])        # 16
            row_max = cute.make_rmem_tensor((n_rows,), Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), Float32)
            row_max.fill(M_FLOOR)
            row_sum.fill(0.0)
            mma_qk.set(warpgroup.Field.ACCUMULATE, True)
            mma_pv_rs.set(warpgroup.Field.ACCUMULATE, True)
            acc_o.fill(0.0)
            cute.arch.mbarrier_wait(bar_q, 0)
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for it in cutlass.range(n_tiles, unroll=1):
                stage = cs.index
                pipe.consumer_wait(cs)
                acc_s.fill(0.0)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(HEAD_DIM // 16):
                    cute.gemm(mma_qk, acc_s, tSrQ[(None, None, kb, 0)], tSrK[(None, None, kb, stage)], acc_s)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if it > 0:
                    cute.arch.barrier(barrier_id=BAR_P_FREE, number_of_threads=256)   # WG1 done with sP
                # ---- online softmax (base 2), per row of this thread ----
                for i in cutlass.range_constexpr(n_rows):
                    m_cur = row_max[i]
                    for j in cutlass.range_constexpr(n_cols):
                        col = cS[i, j][1]
                        v = acc_s_mn[i, j] * scale_log2 + sBias[col, stage]
                        acc_s_mn[i, j] = v
                        m_cur = cutlass.max(m_cur, v)
                    m_cur = cutlass.max(m_cur, cute.arch.shuffle_sync_bfly(m_cur, offset=1))
                    m_cur = cutlass.max(m_cur, cute.arch.shuffle_sync_bfly(m_cur, offset=2))
                    scale_old = cute.math.exp2(row_max[i] - m_cur, fastmath=True)
                    row_max[i] = m_cur
                    s = Float32(0.0)
                    for j in cutlass.range_constexpr(n_cols):
                        p = cute.math.exp2(acc_s_mn[i, j] - m_cur, fastmath=True)
                        acc_s_mn[i, j] = p
                        s = s + p
                    row_sum[i] = row_sum[i] * scale_old + s
                    for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                        acc_o_mn[i, j] = acc_o_mn[i, j] * scale_old
                    if wtid % 4 == 0:
                        sScale[cS[i, 0][0], it % 2] = scale_old
                rP.store(acc_s.load().to(BFloat16))
                cute.copy(r2s, tPrP, tPsP[(None, None, None, 0)])
                cute.arch.fence_view_async_shared()              # sP is read by WG1's WGMMA
                cute.arch.barrier_arrive(barrier_id=BAR_P_READY, number_of_threads=256)
                # ---- O[:, :256] += P V ----
                warpgroup.fence()
                for kb in cutlass.range_constexpr(TILE_N // 16):
                    cute.gemm(mma_pv_rs, acc_o, tOrP[(None, None, kb)], tOrV[(None, None, kb, stage)], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pipe.consumer_release(cs)
                cs.advance()
            # ---- epilogue: row sums over the quad, sink, scale, LSE ----
            h0 = hblk * BLOCK_H
            for i in cutlass.range_constexpr(n_rows):
                l = row_sum[i]
                l = l + cute.arch.shuffle_sync_bfly(l, offset=1)
                l = l + cute.arch.shuffle_sync_bfly(l, offset=2)
                m = row_max[i]
                row = cS[i, 0][0]
                h = h0 + row
                o_scale = Float32(0.0)
                lse = -Float32.inf
                if cutlass.const_expr(self.split):
                    if l > 0.0:
                        o_scale = 1.0 / l
                        lse = m + cute.math.log2(l)
                else:
                    sink2 = -Float32.inf
                    if h < H:
                        sink2 = mSink[h] * LOG2E
                    lse = -Float32.inf
                    if h < H:
                        lse = mSink[h]              # no valid entry: the sink alone, exactly
                    if l > 0.0:
                        o_scale = 1.0 / (l + cute.math.exp2(sink2 - m))
                        mm = cutlass.max(m, sink2)
                        lse = (mm + cute.math.log2(l * cute.math.exp2(m - mm) + cute.math.exp2(sink2 - mm))) / LOG2E
                for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    acc_o_mn[i, j] = acc_o_mn[i, j] * o_scale
                if wtid % 4 == 0:
                    sOScale[row] = o_scale
                    if h < H:
                        if cutlass.const_expr(self.split):
                            mLse[split, t, h] = lse
                        else:
                            mLse[t, h] = lse
            cute.arch.sync_warp()          # reconverge after the wtid % 4 / h < H stores (aligned bar.arrive)
            # sOScale published to WG1: arrive only (WG0 reads no smem after this; one tile per CTA), the
            # producer / consumer form of BAR_P_READY; two bar.sync instructions of one barrier in two code
            # paths are what compute-sanitizer synccheck reports as divergent threads in the block
            cute.arch.barrier_arrive(barrier_id=BAR_EPI, number_of_threads=256)
            self._store_o(acc_o, thr_pv, mO, t, hblk, split, H, 0)

        # ------------------------------------------------------------------ consumer 1
        @cute.jit
        def _consume1(self, pipe, sVt, sP, sScale, sOScale, mO, mma_pv_ss, t, hblk, split, H, n_tiles, wtid):
            thr_pv = mma_pv_ss.get_slice(wtid)
            sV1 = cute.local_tile(sVt, (HEAD_DIM // 2, TILE_N), (1, 0, None))  # dims [256, 512)
            tOrV = mma_pv_ss.make_fragment_B(thr_pv.partition_B(sV1))
            tOrP = mma_pv_ss.make_fragment_A(thr_pv.partition_A(sP))
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_H, HEAD_DIM // 2)), Float32)
            acc_o_mn = make_acc_mn_view(acc_o)
            cO = make_acc_mn_view(thr_pv.partition_C(cute.make_identity_tensor((BLOCK_H, HEAD_DIM // 2))))
            n_rows = cute.size(acc_o_mn, mode=[0])
            mma_pv_ss.set(warpgroup.Field.ACCUMULATE, True)
            acc_o.fill(0.0)
            cs = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            for it in cutlass.range(n_tiles, unroll=1):
                stage = cs.index
                cute.arch.barrier(barrier_id=BAR_P_READY, number_of_threads=256)
                pipe.consumer_wait(cs)
                for i in cutlass.range_constexpr(n_rows):
                    sc = sScale[cO[i, 0][0], it % 2]
                    for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                        acc_o_mn[i, j] = acc_o_mn[i, j] * sc
                warpgroup.fence()
                for kb in cutlass.range_constexpr(TILE_N // 16):
                    cute.gemm(mma_pv_ss, acc_o, tOrP[(None, None, kb, 0)], tOrV[(None, None, kb, stage)], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pipe.consumer_release(cs)
                cs.advance()
                if it + 1 < n_tiles:
                    cute.arch.barrier_arrive(barrier_id=BAR_P_FREE, number_of_threads=256)
            cute.arch.barrier(barrier_id=BAR_EPI, number_of_threads=256)
            for i in cutlass.range_constexpr(n_rows):
                sc = sOScale[cO[i, 0][0]]
                for j in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    acc_o_mn[i, j] = acc_o_mn[i, j] * sc
            self._store_o(acc_o, thr_pv, mO, t, hblk, split, H, 1)

        # ------------------------------------------------------------------ epilogue store
        @cute.jit
        def _store_o(self, acc_o, thr_pv, mO, t, hblk, split, H, half: cutlass.Constexpr):
            """Rows h < H of this warpgroup's 64 x 256 half of O -> global (bf16, or fp32 partial)."""
            if cutlass.const_expr(self.split):
                gO = mO[(split, t, None, None)]
            else:
                gO = mO[(t, None, None)]
            cO = make_acc_mn_view(thr_pv.partition_C(cute.make_identity_tensor((BLOCK_H, HEAD_DIM // 2))))
            acc_mn = make_acc_mn_view(acc_o)
            if cutlass.const_expr(self.split):
                r_out = acc_mn
            else:
                r_out = cute.make_rmem_tensor(acc_o.layout, BFloat16)
                r_out.store(acc_o.load().to(BFloat16))
                r_out = make_acc_mn_view(r_out)
            n_rows = cute.size(acc_mn, mode=[0])
            n_cols = cute.size(acc_mn, mode=[1])
            for i in cutlass.range_constexpr(n_rows):
                h = hblk * BLOCK_H + cO[i, 0][0]
                if h < H:
                    for j in cutlass.range_constexpr(n_cols):
                        gO[h, half * (HEAD_DIM // 2) + cO[i, j][1]] = r_out[i, j]


def make_fake_args(split: bool):
    """Fake tensors / scalars for one specialization. Every dim is symbolic (T, H, list widths,
    cache sizes, and the head dim too): a static extent in a compact fake tensor changes the
    compiled ABI (its strides are derived, not passed) and the runtime ``from_dlpack`` tensors,
    marked dynamic, would then be read with wrong strides (observed on the H200: a static 512
    made the T stride read as 512)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    T = cute.sym_int32(symbol="T")
    H = cute.sym_int32(symbol="H")
    D = cute.sym_int32(divisibility=64, symbol="D")
    S = cute.sym_int32(symbol="S")
    ws = cute.sym_int32(symbol="Ws")
    kc = cute.sym_int32(symbol="Kc")
    nsb = cute.sym_int32(divisibility=16, symbol="swa_bytes")
    ncb = cute.sym_int32(divisibility=16, symbol="comp_bytes")
    q = make_fake_compact_tensor(BFloat16, (T, H, D), stride_order=(2, 1, 0), assumed_align=16)
    swa = make_fake_compact_tensor(cutlass.Uint8, (nsb,), assumed_align=16)
    comp = make_fake_compact_tensor(cutlass.Uint8, (ncb,), assumed_align=16)
    swa_idx = make_fake_compact_tensor(Int32, (T, ws), stride_order=(1, 0), assumed_align=4)
    comp_idx = make_fake_compact_tensor(Int32, (T, kc), stride_order=(1, 0), assumed_align=4)
    swa_len = make_fake_compact_tensor(Int32, (T,), assumed_align=4)
    comp_len = make_fake_compact_tensor(Int32, (T,), assumed_align=4)
    sink = make_fake_compact_tensor(Float32, (H,), assumed_align=4)
    if split:
        o = make_fake_compact_tensor(Float32, (S, T, H, D), stride_order=(3, 2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (S, T, H), stride_order=(2, 1, 0), assumed_align=4)
    else:
        o = make_fake_compact_tensor(BFloat16, (T, H, D), stride_order=(2, 1, 0), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (T, H), stride_order=(1, 0), assumed_align=4)
    return (q, swa, swa_idx, swa_len, comp, comp_idx, comp_len, sink, o, lse, Int32(64), Int32(64), Int32(64),
            Int32(64), Float32(1.0), Int32(1), Int32(1), make_fake_stream())


def compile_kernel(split: bool, arch: str, extra: str = ""):
    return cute.compile(SparseAttentionFwdKernel(split), *make_fake_args(split),
                        options=compile_options(arch, extra))


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile both specializations (no split / KV split) for ``arch`` on the CPU; ``{variant: PTX}``."""
    return compile_variants("sparse_attention_fwd", {
        "nosplit": lambda arch, extra: compile_kernel(False, arch, extra),
        "split": lambda arch, extra: compile_kernel(True, arch, extra)}, dump_dir, arch)
