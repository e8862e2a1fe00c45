"""CuTe DSL decode kernel of ``indexer_logits_paged``: the Lightning Indexer over the paged
FP4 / FP8 key cache, FP8 WGMMA, one persistent launch for the batch.

Contract: docs/layouts/indexer_logits_paged.md (``dsv4.ops.indexer.PAGED_SPEC``)::

    logits[b*nn + i, s] = sum_h w[b*nn+i, h] * relu(q[b, i, h] . K[page(b, s), s % bs])   s < len[b, i]
                        = -inf                                                             otherwise

Kernel structure (own code; structure learned from DeepGEMM ``sm90_fp8_paged_mqa_logits``):

* Work = the 64-key tiles of every sequence (``ceil(max_i len[b, i] / 64)`` tiles for sequence
  b), flattened sequence-major; a persistent grid of ``G`` CTAs (2-4 per SM,
  ``kernels_dsl.indexer.paged_config``) splits the tiles
  evenly: CTA c owns tiles ``[c D / G, (c+1) D / G)`` (D = total). The split is computed **on
  the device** by every CTA from ``context_lens`` (a warp scan over the batch; no host sync,
  graph-capturable): uneven lengths are balanced over the SMs (DeepGEMM's
  ``get_paged_mqa_logits_metadata`` idea, without the second launch). The columns past a
  sequence's last tile (``-inf``) are split over the CTAs the same way.
* 160 threads: warp 4 is the producer, warps 0-3 one math warpgroup.
  - Producer: walks ``block_table`` (32 entries per warp load, shuffled out), and per tile
    issues two 1-D bulk copies (``cp.async.bulk``: the 64 x VB value bytes and the 64 x SB scale
    bytes of the tile's page slice, both contiguous in the per-block "values then scales"
    layout) into a ``stages``-deep ring, completed on an mbarrier (transaction bytes). Pages
    outside ``[0, num_blocks)`` are never read: the stage is flagged and its keys get -inf.
    At every new sequence it also bulk-copies that sequence's raw queries + weights.
  - Math warpgroup, per tile: every thread decodes ITS OWN part of the landed tile (keys
    16 warp + lane / 4 and + 8, the 32 dims of block lane % 4 = one UE8M0 scale, one 16-byte
    shared load per key) straight into the A fragment of a register-sourced FP8 WGMMA
    ``m64n64k32`` x 4 (keys = M, the 64 heads of one query row = N, K = 128; a fixed K
    permutation, shared with the queries in the smem B operand, makes each thread's 32 dims
    contiguous), releases the ring stage (each warp reads only its own rows: no CTA barrier per
    tile), and runs the ReLU x w head-sum epilogue on the CUDA cores (in-thread sums + a
    transposed 2-shuffle quad reduction) x the per-key scale, masked and stored. The E2M1 ->
    E4M3 decode is ``fp4.e2m1x8_to_e4m3x8_sm`` (9 integer instructions per 8 codes: the signs
    through the sign-replicate mode of ``prmt``), the fold per key a few byte extracts and
    exponent-field operations (:meth:`PagedLogitsKernel.transform_mxfp4`). Two A fragments and two accumulators
    ping-pong: the decode of tile t+1 runs while tile t's WGMMAs fly; next_n rows pipeline
    through the two accumulators.
* Operand formats (one FP8 dot of K = 128 per (head, key), DeepGEMM-style FP32 promotion of
  the remaining power-of-two scales; kernels_dsl.sm90.fp4):
  - MXFP4 keys: block scales folded relative to the row's largest block exponent ``E``:
    E4M3 byte = ``level * 2^(e_b - E + 6)`` (exact while ``e_b >= E - 14``; round-to-nearest
    below, error <= 2^-12.5 of the row's largest block value), key scale ``2^(E - 133)``
    applied after the head sum. Queries alike (per head), their ``2^(E_h - 133)`` folded into w.
  - FP8 keys: the E4M3 bytes as stored, the fp32 per-token scale after the head sum; FP8
    queries as quantized (their scale is already in w).
  Accumulation: Hopper's FP8 tensor-core accumulator (~14 bits, DeepSeek-V3 sec. 3.3.2)
  over K = 128, then FP32. Error contract: dsv4/ops/indexer.py (<= 2e-3 x row max |logit|).

Constraints: ``block_size % 64 == 0``; ``next_n`` 1..4; q_data / q_sf / w / cache base
addresses 16-byte aligned (the provider checks and copies otherwise).

Timings, the variants measured and deleted, the ncu profile: docs/benchmarks.md ("Lightning Indexer
decode kernel tuning"). Loop shape: a cross-iteration WGMMA overlap (tile t+1 issued before tile t's
epilogue, in flight across the loop back-edge) makes ptxas serialize every WGMMA (C7514).
"""
from __future__ import annotations


try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float8E4M3FN, Float32, Int32, Int64, Uint8, Uint32
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from .sm90 import fp4, ptx
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["PagedLogitsKernel", "VB", "SB", "RAW_BYTES", "compile_check", "PTX_PATTERNS"]

#: what every compiled variant's PTX contains (tests/test_compile_dsl.py): FP8 WGMMA with A from
#: registers, bulk page copies completed on mbarriers, the E2M1 LUT decode
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3",
                r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes",
                r"mbarrier\.try_wait\.parity", r"ld\.shared\.v4")

#: value / scale bytes per key row and format (dsv4.ops.indexer.FORMATS)
VB = {"mxfp4": 64, "fp8": 128}
SB = {"mxfp4": 4, "fp8": 4}
TILE = 64
#: raw bytes of one 64-key tile (values then scales)
RAW_BYTES = {f: TILE * (VB[f] + SB[f]) for f in VB}
MATH_THREADS = 128
THREADS = MATH_THREADS + 32
NEG_INF = float("-inf")
BAR_MATH = 1      # named barrier id of the math warpgroup (128 threads)
BAR_ALL = 2       # named barrier id of all 160 threads (schedule published)


if _HAVE_DSL:

    def _qbytes(fmt: str, nn: int) -> tuple[int, int, int]:
        """(q value bytes, q scale bytes, weight bytes) of one sequence's next_n rows."""
        rows = nn * 64
        return rows * VB[fmt], (rows * 4 if fmt == "mxfp4" else 0), rows * 4

    class PagedLogitsKernel:
        """Persistent paged decode indexer logits (module docstring).

        ``__call__(mQ, mQsf, mW, mCache, mLens, mBT, mOut, B, num_blocks, block_size, max_ctx, stream)``:

        * ``mQ``: Uint8 ``[B * nn * 64 * VB]`` quantized queries (flat, 16 B aligned).
        * ``mQsf``: Uint8 ``[B * nn * 64 * 4]`` MXFP4 query UE8M0 scales (fp8: any 16 B aligned
          dummy, unread).
        * ``mW``: Float32 ``[B * nn * 64]`` head weights (flat, 16 B aligned).
        * ``mCache``: Uint8 ``[num_blocks * block_size * BPT]`` paged cache (flat, 16 B aligned).
        * ``mLens``: Int32 ``[B * nn]`` visible entries per row.
        * ``mBT``: Int32 ``[B, max_blocks]`` block table (row stride dynamic).
        * ``mOut``: Float32 ``[B * nn, max_ctx]`` logits (row stride dynamic).
        * ``B``, ``num_blocks``, ``block_size``, ``max_ctx``: Int32.

        Static: ``fmt`` (``"mxfp4"`` / ``"fp8"``), ``nn`` (next_n 1..4), ``stages`` (raw tile
        ring depth), ``ctas_per_sm`` (launch bound and grid = ctas_per_sm x SMs, passed at
        launch as ``grid``), ``w_regs`` (head weights in registers; default: next_n 1).
        """

        def __init__(self, fmt: str, nn: int, stages: int = 6, ctas_per_sm: int = 2, w_regs: bool | None = None):
            if fmt not in VB:
                raise ValueError(f"fmt must be one of {sorted(VB)}, got {fmt!r}")
            if not 1 <= nn <= 4:
                raise ValueError(f"next_n must be 1..4, got {nn}")
            self.fmt, self.nn, self.stages, self.ctas_per_sm = fmt, nn, stages, ctas_per_sm
            #: head weights held in registers (next_n 1), else re-read from smem per tile (16 x next_n fewer
            #: registers: what lets next_n >= 2 run 3 CTAs per SM, kernels_dsl.indexer.paged_config)
            self.w_regs = (nn == 1) if w_regs is None else bool(w_regs)
            self.raw = RAW_BYTES[fmt]
            self.qv, self.qs, self.qw = _qbytes(fmt, nn)

        # ------------------------------------------------------------------ host side
        @cute.jit
        def __call__(self, mQ: cute.Tensor, mQsf: cute.Tensor, mW: cute.Tensor, mCache: cute.Tensor,
                     mLens: cute.Tensor, mBT: cute.Tensor, mOut: cute.Tensor, B: Int32,
                     num_blocks: Int32, block_size: Int32, max_ctx: Int32, grid: Int32, stream: cuda.CUstream):
            tiled_mma = self.make_mma()
            # B: 64 heads x 128 dims E4M3 per next_n row, K-major SW128 (A = the keys, in registers)
            sB_l = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE, 64, 128), Float8E4M3FN, self.nn)
            S = self.stages

            @cute.struct
            class Smem:
                bar_full: cute.struct.MemRange[cutlass.Int64, S]
                bar_empty: cute.struct.MemRange[cutlass.Int64, S]
                bar_q: cute.struct.MemRange[cutlass.Int64, 2]          # q full, q empty
                sched: cute.struct.MemRange[Int32, 8]
                flags: cute.struct.MemRange[Int32, S]                  # page valid per raw stage
                sw: cute.struct.Align[cute.struct.MemRange[Float32, self.nn * 64], 16]   # ld.shared.v2
                raw: cute.struct.Align[cute.struct.MemRange[Uint8, S * self.raw], 128]
                qraw: cute.struct.Align[cute.struct.MemRange[Uint8, self.qv + self.qs + self.qw], 128]
                sB: cute.struct.Align[cute.struct.MemRange[Float8E4M3FN, cute.cosize(sB_l)], 1024]

            self.smem = Smem
            self.kernel(mQ, mQsf, mW, mCache, mLens, mBT, mOut, B, num_blocks, block_size, max_ctx,
                        tiled_mma, sB_l).launch(
                grid=[grid, 1, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=self.ctas_per_sm,
                preferred_smem_carveout=100)

        def make_mma(self):
            """WGMMA m64n64k32 E4M3 x E4M3 -> FP32, both operands K-major in smem, one warpgroup."""
            return sm90_utils.make_trivial_tiled_mma(
                Float8E4M3FN, Float8E4M3FN, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                tiler_mn=(TILE, 64), a_source=warpgroup.OperandSource.RMEM)

        # ------------------------------------------------------------------ device helpers
        @cute.jit
        def seq_tiles(self, mLens: cute.Tensor, b: Int32, max_ctx: Int32) -> Int32:
            """Data tiles of sequence b: ceil(min(max_i len[b, i], max_ctx) / 64) (lens < 0 -> 0)."""
            L = Int32(0)
            for i in cutlass.range_constexpr(self.nn):
                L = cutlass.max(L, Int32(mLens[b * self.nn + i]))
            L = cutlass.min(L, max_ctx)
            return (L + (TILE - 1)) // TILE

        @cute.jit
        def seq_tiles_tail(self, mLens: cute.Tensor, b: Int32, B: Int32, max_ctx: Int32, nct: Int32):
            """(data tiles, tail column chunks = nct - data tiles) of sequence b; (0, 0) for b >= B."""
            n_b = Int32(0)
            tl = Int32(0)
            if b < B:
                n_b = self.seq_tiles(mLens, b, max_ctx)
                tl = nct - n_b
            return n_b, tl

        @cute.jit
        def schedule(self, mLens: cute.Tensor, B: Int32, max_ctx: Int32, sched_addr: Int32):
            """Producer warp: this CTA's [start, start + count) of the flattened data tiles and of
            the tail column chunks (as (sequence, tile) starts), written to smem ``sched``:
            [b0, t0, count, tb0, tc0, tcount]."""
            lane = cute.arch.lane_idx()
            cta, _, _ = cute.arch.block_idx()
            G, _, _ = cute.arch.grid_dim()
            nct = (max_ctx + (TILE - 1)) // TILE
            tot_d = Int32(0)
            tot_t = Int32(0)
            for c0 in cutlass.range(0, B, 32, unroll=1):
                b = c0 + lane
                n_b, tl = self.seq_tiles_tail(mLens, b, B, max_ctx, nct)
                tot_d = tot_d + cute.arch.warp_reduction_sum(n_b)
                tot_t = tot_t + cute.arch.warp_reduction_sum(tl)
            d0 = Int32(Int64(cta) * Int64(tot_d) // Int64(G))
            d1 = Int32((Int64(cta) + 1) * Int64(tot_d) // Int64(G))
            e0 = Int32(Int64(cta) * Int64(tot_t) // Int64(G))
            e1 = Int32((Int64(cta) + 1) * Int64(tot_t) // Int64(G))
            # locate the sequences holding flat tile d0 and tail chunk e0 (inclusive prefix scan)
            pd = Int32(0)
            pt = Int32(0)
            b0 = Int32(B)
            t0 = Int32(0)
            tb0 = Int32(B)
            tc0 = Int32(0)
            for c0 in cutlass.range(0, B, 32, unroll=1):
                b = c0 + lane
                n_b, tl = self.seq_tiles_tail(mLens, b, B, max_ctx, nct)
                xd = n_b
                xt = tl
                for off in cutlass.range_constexpr(5):
                    yd = cute.arch.shuffle_sync_up(xd, offset=1 << off)
                    yt = cute.arch.shuffle_sync_up(xt, offset=1 << off)
                    if lane >= (1 << off):
                        xd = xd + yd
                        xt = xt + yt
                incl_d = pd + xd          # tiles of sequences <= b
                incl_t = pt + xt
                # first lane whose inclusive prefix exceeds d0 owns tile d0
                hit_d = cute.arch.vote_ballot_sync((incl_d > d0) & (b < B))
                hit_t = cute.arch.vote_ballot_sync((incl_t > e0) & (b < B))
                if (b0 == B) & (hit_d != 0):
                    src = Int32(31) - Int32(cute.arch.clz(Int32(hit_d) & -Int32(hit_d)))   # lowest hit lane
                    b0 = c0 + src
                    t0 = d0 - (cute.arch.shuffle_sync(incl_d, offset=src) - cute.arch.shuffle_sync(n_b, offset=src))
                if (tb0 == B) & (hit_t != 0):
                    src = Int32(31) - Int32(cute.arch.clz(Int32(hit_t) & -Int32(hit_t)))
                    tb0 = c0 + src
                    tc0 = e0 - (cute.arch.shuffle_sync(incl_t, offset=src) - cute.arch.shuffle_sync(tl, offset=src))
                pd = cute.arch.shuffle_sync(incl_d, offset=31)
                pt = cute.arch.shuffle_sync(incl_t, offset=31)
            if lane == 0:
                ptx.st_shared_b32(sched_addr + 0, Uint32(b0))
                ptx.st_shared_b32(sched_addr + 4, Uint32(t0))
                ptx.st_shared_b32(sched_addr + 8, Uint32(d1 - d0))
                ptx.st_shared_b32(sched_addr + 12, Uint32(tb0))
                ptx.st_shared_b32(sched_addr + 16, Uint32(tc0))
                ptx.st_shared_b32(sched_addr + 20, Uint32(e1 - e0))

        @cute.jit
        def max_exponent(self, u: Uint32) -> Int32:
            """Largest of the 4 UE8M0 bytes of ``u``."""
            e01 = cutlass.max(Int32(u & Uint32(0xFF)), Int32((u >> 8) & Uint32(0xFF)))
            e23 = cutlass.max(Int32((u >> 16) & Uint32(0xFF)), Int32(u >> 24))
            return cutlass.max(e01, e23)

        @cute.jit
        def transform_regs(self, raw: Int32, wA: cute.Tensor, rKs: cute.Tensor, lane: Int32, warp: Int32):
            """Landed raw tile at smem ``raw`` -> this thread's WGMMA A fragment (registers).

            The thread holds keys r = 16 warp + lane / 4 and r + 8 and, of each, the 32 dims of
            block c = lane % 4 (one UE8M0 scale): fragment word h + 2 kh + 4 s (k-step s, key
            r + 8 h, k-half kh) = E4M3 bytes of dims 32 c + 8 s + 4 kh + 0..3, i.e. the WGMMA K
            index k = 32 s + 16 kh + 4 c + j carries dim 32 c + 8 s + 4 kh + j (the queries use the
            same permutation, so q . k is unchanged). Also the keys' fp32 scales ``rKs[h]``."""
            c = lane % 4
            r = warp * 16 + lane // 4
            if cutlass.const_expr(self.fmt == "mxfp4"):
                self.transform_mxfp4(raw, wA, rKs, c, r)
            else:
                for h in cutlass.range_constexpr(2):
                    m = r + 8 * h
                    v = ptx.ld_shared_v4(raw + m * 128 + c * 32)
                    v2 = ptx.ld_shared_v4(raw + m * 128 + c * 32 + 16)
                    for q in cutlass.range_constexpr(8):
                        word = v[q] if q < 4 else v2[q - 4]
                        wA[h + 2 * (q % 2) + 4 * (q // 2)] = word
                    rKs[h] = ptx.ld_shared_f32(raw + TILE * 128 + m * 4)

        @cute.jit
        def transform_mxfp4(self, raw: Int32, wA: cute.Tensor, rKs: cute.Tensor, c: Int32, r: Int32):
            """MXFP4 part of :meth:`transform_regs` (keys r and r + 8, block c): per key the row
            maximum ``E`` of the 4 UE8M0 bytes (``prmt`` byte extracts) and ``d = e_c - E + 6``, the
            shift LUT (``-5 <= d <= 6``: exponent-field add) and the key scale ``2^(E - 133)`` built
            in the fp32 exponent field; one branch for both keys takes the exact LUT / UE8M0
            conversion when a block sits more than 5 binades below its row maximum or ``E`` is
            outside ``[7, 254]`` (rare). The E2M1 decode: :func:`fp4.e2m1x8_to_e4m3x8_sm` (9 integer
            instructions per 8 codes). Bit-identical to the per-key exact fold (GPU tests:
            tests/test_indexer_dsl.py)."""
            selc = Uint32(0x4440) + Uint32(c)      # prmt selector: byte c, zero-extended
            es = [Int32(0), Int32(0)]
            ds = [Int32(0), Int32(0)]
            luts = [Uint32(0), Uint32(0), Uint32(0), Uint32(0)]
            rare = Int32(0)
            for h in cutlass.range_constexpr(2):
                u = ptx.ld_shared_b32(raw + TILE * 64 + (r + 8 * h) * 4)
                b0 = Int32(u & Uint32(0xFF))
                b1 = Int32(fp4.prmt(u, Uint32(0), Uint32(0x4441)))
                b2 = Int32(fp4.prmt(u, Uint32(0), Uint32(0x4442)))
                b3 = Int32(u >> 24)
                ek = cutlass.max(cutlass.max(b0, b1), cutlass.max(b2, b3))
                d = Int32(fp4.prmt(u, Uint32(0), selc)) - ek + 6
                lo, hi = fp4.e4m3_lut_shift(cutlass.max(d, Int32(fp4.SHIFT_RANGE[0])))
                luts[2 * h] = lo
                luts[2 * h + 1] = hi
                rKs[h] = fp4.bits_to_f32(Uint32(ek - 6) << 23)     # 2^(E - 133) for 7 <= E <= 254
                es[h] = ek
                ds[h] = d
                if (d < fp4.SHIFT_RANGE[0]) | (ek < 7) | (ek > 254):
                    rare = Int32(1)
            if rare != 0:
                for h in cutlass.range_constexpr(2):
                    lo, hi = fp4.e4m3_lut(ds[h])
                    luts[2 * h] = lo
                    luts[2 * h + 1] = hi
                    rKs[h] = fp4.ue8m0_to_f32(Uint32(es[h])) * Float32(2.0 ** -6)
            for h in cutlass.range_constexpr(2):
                v = ptx.ld_shared_v4(raw + (r + 8 * h) * 64 + c * 16)
                for i in cutlass.range_constexpr(4):
                    o0, o1 = fp4.e2m1x8_to_e4m3x8_sm(v[i], luts[2 * h], luts[2 * h + 1])
                    wA[h + 4 * i] = o0
                    wA[h + 2 + 4 * i] = o1

        @cute.jit
        def convert_q(self, qraw: Int32, b_base: Int32, sw_base: Int32, tidx: Int32):
            """Raw queries + weights of one sequence (smem ``qraw``: values, [scales], weights) ->
            the E4M3 B operand (nn stages of 64 heads x 128, SW128 K-major, the K permutation of
            :meth:`transform_regs`: dim 32 c + 8 s + 4 kh + j at k = 32 s + 16 kh + 4 c + j) and
            the weights ``w'`` (MXFP4: x 2^(E_h - 133), the head's folded exponent)."""
            rows = self.nn * 64
            c = tidx % 4
            for k in cutlass.range_constexpr(rows // 32):
                n = tidx // 4 + 32 * k
                rr = n % 64
                row = b_base + (n // 64) * (64 * 128) + rr * 128
                words = [Uint32(0)] * 8
                if cutlass.const_expr(self.fmt == "mxfp4"):
                    u = ptx.ld_shared_b32(qraw + self.qv + n * 4)
                    eh = self.max_exponent(u)
                    d = Int32((u >> (Uint32(c) * 8)) & Uint32(0xFF)) - eh + 6
                    lo, hi = fp4.e4m3_lut(d)
                    v = ptx.ld_shared_v4(qraw + n * 64 + c * 16)
                    for i in cutlass.range_constexpr(4):
                        o0, o1 = fp4.e2m1x8_to_e4m3x8(v[i], lo, hi)
                        words[2 * i] = o0
                        words[2 * i + 1] = o1
                    if c == 0:
                        wv = ptx.ld_shared_f32(qraw + self.qv + self.qs + n * 4)
                        ptx.st_shared_f32(sw_base + n * 4, wv * fp4.ue8m0_to_f32(Uint32(eh)) * Float32(2.0 ** -6))
                else:
                    v = ptx.ld_shared_v4(qraw + n * 128 + c * 32)
                    v2 = ptx.ld_shared_v4(qraw + n * 128 + c * 32 + 16)
                    for q in cutlass.range_constexpr(8):
                        words[q] = v[q] if q < 4 else v2[q - 4]
                    if c == 0:
                        ptx.st_shared_f32(sw_base + n * 4, ptx.ld_shared_f32(qraw + self.qv + n * 4))
                for q in cutlass.range_constexpr(8):
                    # word q = dims 32 c + 4 q .. + 3 -> k = 32 (q // 2) + 16 (q % 2) + 4 c
                    chunk = 2 * (q // 2) + (q % 2)
                    ptx.st_shared_b32(row + ((chunk ^ (rr % 8)) << 4) + 4 * c, words[q])

        @cute.jit
        def head_sum(self, acc: cute.Tensor, rW: cute.Tensor, r: int, swp: Int32, q4: Int32):
            """ReLU x w summed over this thread's 16 heads of next_n row r (accumulator register i:
            key m0 + 8 ((i >> 1) & 1), head 8 (i >> 2) + 2 q4 + (i & 1)), then over the quad:
            returns ``(v, v)`` with v = the sum of key m0 = 16 warp + lane / 4 on even lanes, of key
            m0 + 8 on odd lanes (lanes q4 = 0 / 1 store keys m0 / m0 + 8). Weights from registers
            (``w_regs``: next_n 1) or from smem (next_n >= 2: 3 CTAs per SM)."""
            wv = [Float32(0.0)] * 16
            if cutlass.const_expr(self.w_regs):
                for j in cutlass.range_constexpr(16):
                    wv[j] = rW[r * 16 + j]
            else:
                for j in cutlass.range_constexpr(8):
                    w0, w1 = ptx.ld_shared_v2_f32(swp + (r * 64 + 8 * j + 2 * q4) * 4)
                    wv[2 * j] = w0
                    wv[2 * j + 1] = w1
            s = [Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)]
            for i in cutlass.range_constexpr(32):
                half = (i >> 1) & 1
                par = i & 1
                wj = (i >> 2) * 2 + par
                s[2 * half + par] = s[2 * half + par] + cute.arch.fmax(acc[i], Float32(0.0)) * wv[wj]
            v0 = s[0] + s[1]
            v1 = s[2] + s[3]
            # transposed quad reduction: even lanes end with key m0's sum, odd lanes with m0 + 8's
            # (2 shuffles instead of 4; the same additions in the same order as a butterfly per key)
            odd = (q4 & 1) != 0
            keep = cutlass.select_(odd, v1, v0)
            keep = keep + cute.arch.shuffle_sync_bfly(cutlass.select_(odd, v0, v1), offset=1)
            keep = keep + cute.arch.shuffle_sync_bfly(keep, offset=2)
            return keep, keep

        # ------------------------------------------------------------------ the kernel
        @cute.kernel
        def kernel(self, mQ: cute.Tensor, mQsf: cute.Tensor, mW: cute.Tensor, mCache: cute.Tensor,
                   mLens: cute.Tensor, mBT: cute.Tensor, mOut: cute.Tensor, B: Int32,
                   num_blocks: Int32, block_size: Int32, max_ctx: Int32, tiled_mma: cute.TiledMma,
                   sB_l: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            lane = cute.arch.lane_idx()
            S = self.stages
            nn = self.nn
            st = SmemAllocator().allocate(self.smem)
            full0 = st.bar_full.data_ptr().toint()
            empty0 = st.bar_empty.data_ptr().toint()
            qfull = st.bar_q.data_ptr().toint()
            qempty = qfull + 8
            sched = st.sched.data_ptr().toint()
            flags = st.flags.data_ptr().toint()
            swp = st.sw.data_ptr().toint()
            raw0 = st.raw.data_ptr().toint()
            qraw = st.qraw.data_ptr().toint()
            b0p = st.sB.data_ptr().toint()
            bpt = VB[self.fmt] + SB[self.fmt]
            nct = (max_ctx + (TILE - 1)) // TILE

            if tidx == MATH_THREADS:
                for i in cutlass.range_constexpr(S):
                    ptx.mbar_init(full0 + 8 * i, 1)
                    ptx.mbar_init(empty0 + 8 * i, 4)       # one arrival per math warp
                ptx.mbar_init(qfull, 1)
                ptx.mbar_init(qempty, 4)
                ptx.mbar_fence_init()
            cute.arch.sync_threads()

            if warp == 4:
                self.schedule(mLens, B, max_ctx, sched)
                cute.arch.sync_warp()             # reconverge after schedule()'s lane-0 stores
            # schedule published: ONE bar.sync instruction for all 160 threads (an aligned barrier reached from
            # two code paths is what compute-sanitizer synccheck reports as divergent threads in the block)
            ptx.named_barrier(BAR_ALL, THREADS)
            if warp == 4:
                # ======================= producer warp =======================
                b, t, count, n_b = self.sched_start(mLens, sched, max_ctx)
                cache0 = mCache.iterator.toint()
                q0 = mQ.iterator.toint()
                qs0 = mQsf.iterator.toint()
                w0 = mW.iterator.toint()
                bt_base = Int32(-1)
                bt_val = Int32(-1)
                new_seq = Int32(1)
                qphase = Int32(0)
                stage = Int32(0)
                phase = Int32(0)
                for _ in cutlass.range(count, unroll=1):
                    if new_seq != 0:
                        # the sequence's raw queries + weights (one q stage: wait until converted)
                        ptx.mbar_wait(qempty, qphase ^ 1)
                        qphase = qphase ^ 1
                        if lane == 0:
                            ptx.mbar_arrive_expect_tx(qfull, self.qv + self.qs + self.qw)
                            ptx.bulk_g2s(qraw, q0 + Int64(b) * self.qv, self.qv, qfull)
                            if cutlass.const_expr(self.qs > 0):
                                ptx.bulk_g2s(qraw + self.qv, qs0 + Int64(b) * self.qs, self.qs, qfull)
                            ptx.bulk_g2s(qraw + self.qv + self.qs, w0 + Int64(b) * self.qw, self.qw, qfull)
                        bt_base = Int32(-1)
                        new_seq = Int32(0)
                    blk = (t * TILE) // block_size
                    j0 = (t * TILE) % block_size
                    if (bt_base < 0) | (blk >= bt_base + 32):
                        bt_base = blk
                        e = blk + lane
                        bt_val = Int32(-1)
                        if e < mBT.shape[1]:
                            bt_val = Int32(mBT[b, e])
                    page = cute.arch.shuffle_sync(bt_val, offset=blk - bt_base)
                    ptx.mbar_wait(empty0 + 8 * stage, phase ^ 1)
                    if lane == 0:
                        dst = raw0 + stage * self.raw
                        if (page >= 0) & (page < num_blocks):
                            ptx.st_shared_b32(flags + 4 * stage, Uint32(1))
                            ptx.mbar_arrive_expect_tx(full0 + 8 * stage, self.raw)
                            pbase = cache0 + Int64(page) * Int64(block_size) * bpt
                            ptx.bulk_g2s(dst, pbase + Int64(j0) * VB[self.fmt], TILE * VB[self.fmt], full0 + 8 * stage)
                            ptx.bulk_g2s(dst + TILE * VB[self.fmt],
                                         pbase + Int64(block_size) * VB[self.fmt] + Int64(j0) * SB[self.fmt],
                                         TILE * SB[self.fmt], full0 + 8 * stage)
                        else:
                            ptx.st_shared_b32(flags + 4 * stage, Uint32(0))
                            ptx.mbar_arrive(full0 + 8 * stage)
                    stage, phase = self.ring_advance(stage, phase)
                    b, t, n_b, new_seq = self.next_tile(mLens, b, t, n_b, B, max_ctx)
            else:
                # ======================= math warpgroup =======================
                thr = tiled_mma.get_slice(tidx)
                sB = st.sB.get_tensor(sB_l.outer, swizzle=sB_l.inner)
                tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
                a_shape = thr.partition_A(cute.make_identity_tensor((TILE, 128))).shape
                rA = (cute.make_rmem_tensor(a_shape, Float8E4M3FN), cute.make_rmem_tensor(a_shape, Float8E4M3FN))
                wA = (cute.recast_tensor(rA[0], Uint32), cute.recast_tensor(rA[1], Uint32))
                rKs = (cute.make_rmem_tensor((2,), Float32), cute.make_rmem_tensor((2,), Float32))
                rOk = (cute.make_rmem_tensor((1,), Int32), cute.make_rmem_tensor((1,), Int32))
                acc_shape = thr.partition_C(cute.make_identity_tensor((TILE, 64))).shape
                accs = (cute.make_rmem_tensor(acc_shape, Float32), cute.make_rmem_tensor(acc_shape, Float32))
                rW = cute.make_rmem_tensor(((nn if self.w_regs else 1) * 16,), Float32)
                rLen = cute.make_rmem_tensor((nn,), Int32)
                b, t, count, n_b = self.sched_start(mLens, sched, max_ctx)
                qphase = Int32(0)
                stage = Int32(0)
                phase = Int32(0)
                ring = (raw0, full0, empty0, flags)

                # ---- the first tile's sequence queries and A fragment
                if count > 0:
                    self.q_switch(mLens, b, qfull, qempty, qphase, qraw, b0p, swp, rW, rLen, tidx, lane)
                    qphase = qphase ^ 1
                    self.load_regs(ring, stage, phase, wA[0], rKs[0], rOk[0], lane, warp)
                    stage, phase = self.ring_advance(stage, phase)
                # ---- tiles, unrolled by two: tile i's A fragment / key scales live in buffer i % 2
                for i2 in cutlass.range(count // 2, unroll=1):
                    b, t, n_b, stage, phase, qphase = self.tile_step(
                        rA[0], wA[1], rKs[0], rKs[1], rOk[0], rOk[1], accs, tCrB, rW, rLen, mLens, mOut, ring,
                        b, t, n_b, stage, phase, qphase, Int32(1), B, max_ctx, qfull, qempty, qraw, b0p, swp,
                        tidx, lane, warp)
                    more = Int32(0)
                    if 2 * i2 + 2 < count:
                        more = Int32(1)
                    b, t, n_b, stage, phase, qphase = self.tile_step(
                        rA[1], wA[0], rKs[1], rKs[0], rOk[1], rOk[0], accs, tCrB, rW, rLen, mLens, mOut, ring,
                        b, t, n_b, stage, phase, qphase, more, B, max_ctx, qfull, qempty, qraw, b0p, swp,
                        tidx, lane, warp)
                if count % 2 == 1:
                    b, t, n_b, stage, phase, qphase = self.tile_step(
                        rA[0], wA[1], rKs[0], rKs[1], rOk[0], rOk[1], accs, tCrB, rW, rLen, mLens, mOut, ring,
                        b, t, n_b, stage, phase, qphase, Int32(0), B, max_ctx, qfull, qempty, qraw, b0p, swp,
                        tidx, lane, warp)

                # ---- tail: columns past each sequence's last data tile are -inf
                tb, tc, tcount, ntl = self.sched_start(mLens, sched + 12, max_ctx)
                tc = tc + ntl                     # tail chunk index -> column tile index
                for _ in cutlass.range(tcount, unroll=1):
                    col = tc * TILE + tidx % 64
                    if col < max_ctx:
                        for r in cutlass.range_constexpr((nn + 1) // 2):
                            rr = 2 * r + tidx // 64
                            if rr < nn:
                                mOut[tb * nn + rr, col] = Float32(NEG_INF)
                    tc = tc + 1
                    if tc >= nct:                 # next sequence that has tail columns
                        tb = tb + 1
                        while (tb < B) & (tc >= nct):
                            tc = self.seq_tiles(mLens, tb, max_ctx)
                            if tc >= nct:
                                tb = tb + 1

        @cute.jit
        def sched_start(self, mLens: cute.Tensor, addr: Int32, max_ctx: Int32):
            """One (sequence, tile, count) start of :meth:`schedule` read from smem ``addr`` (data
            tiles: ``sched``, tail chunks: ``sched + 12``), with the data tiles of that sequence (0
            when count = 0): ``(b, t, count, n_b)``."""
            b = Int32(ptx.ld_shared_b32(addr + 0))
            t = Int32(ptx.ld_shared_b32(addr + 4))
            count = Int32(ptx.ld_shared_b32(addr + 8))
            n_b = Int32(0)
            if count > 0:
                n_b = self.seq_tiles(mLens, b, max_ctx)
            return b, t, count, n_b

        @cute.jit
        def next_tile(self, mLens: cute.Tensor, b: Int32, t: Int32, n_b: Int32, B: Int32, max_ctx: Int32):
            """The flattened data tile after tile t of sequence b (which has n_b tiles): the next
            tile of b, else tile 0 of the next sequence that has tiles (b = B past the last).
            Returns (b, t, n_b, new_seq) with new_seq = 1 where the sequence changed."""
            t = t + 1
            new_seq = Int32(0)
            if t >= n_b:
                t = Int32(0)
                b = b + 1
                new_seq = Int32(1)
                n_b = Int32(0)
                while (b < B) & (n_b == 0):
                    n_b = self.seq_tiles(mLens, b, max_ctx)
                    if n_b == 0:
                        b = b + 1
            return b, t, n_b, new_seq

        @cute.jit
        def ring_advance(self, stage: Int32, phase: Int32):
            stage = stage + 1
            if stage == self.stages:
                stage = Int32(0)
                phase = phase ^ 1
            return stage, phase

        def mma_row(self, acc: cute.Tensor, rA: cute.Tensor, tCrB: cute.Tensor, r: int):
            """Issue the 4 k32 WGMMAs of next_n row r: A = the key fragment in registers, B = the
            row's 64 heads in smem, into a fresh accumulator (first k-block: scale-d = 0). Traced
            inline with a fresh atom (its ACCUMULATE toggles stay local to this call site)."""
            tm = self.make_mma()
            warpgroup.fence()
            for kb in range(4):
                tm.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(tm, acc, rA[(None, None, kb)], tCrB[(None, None, kb, r)], acc)
            warpgroup.commit_group()

        @cute.jit
        def load_regs(self, ring, stage: Int32, phase: Int32, wA: cute.Tensor, rKs: cute.Tensor, rOk: cute.Tensor,
                      lane: Int32, warp: Int32):
            """Wait for ring stage ``stage``, transform this thread's rows into the A fragment,
            release the stage (one arrival per warp: each warp reads only its own 16 keys)."""
            raw0, full0, empty0, flags = ring
            ptx.mbar_wait(full0 + 8 * stage, phase)
            rOk[0] = Int32(ptx.ld_shared_b32(flags + 4 * stage))
            self.transform_regs(raw0 + stage * self.raw, wA, rKs, lane, warp)
            cute.arch.sync_warp()
            if lane == 0:
                ptx.mbar_arrive(empty0 + 8 * stage)

        @cute.jit
        def tile_step(self, rA_cur: cute.Tensor, wA_next: cute.Tensor, rKs_cur: cute.Tensor, rKs_next: cute.Tensor,
                      rOk_cur: cute.Tensor, rOk_next: cute.Tensor, accs, tCrB: cute.Tensor, rW: cute.Tensor,
                      rLen: cute.Tensor, mLens: cute.Tensor, mOut: cute.Tensor, ring, b: Int32, t: Int32, n_b: Int32,
                      stage: Int32, phase: Int32, qphase: Int32, has_next: Int32, B: Int32, max_ctx: Int32,
                      qfull: Int32, qempty: Int32, qraw: Int32, b0p: Int32, swp: Int32, tidx: Int32, lane: Int32,
                      warp: Int32):
            """One 64-key tile: WGMMAs of its next_n rows (A = ``rA_cur``), the next tile's transform
            into the other fragment while they run (at a sequence change: after the epilogue and
            the query switch), the ReLU x w epilogue. Returns the advanced (b, t, n_b, stage,
            phase, qphase)."""
            nn = self.nn
            m0 = warp * 16 + lane // 4
            q4 = lane % 4
            base_s = t * TILE
            nbq, nt, nnb, next_new = self.next_tile(mLens, b, t, n_b, B, max_ctx)
            next_same = (has_next != 0) & (next_new == 0)
            next_other = (has_next != 0) & (next_new != 0)
            for r in cutlass.range_constexpr(min(nn, 2)):
                self.mma_row(accs[r % 2], rA_cur, tCrB, r)
            if next_same:
                self.load_regs(ring, stage, phase, wA_next, rKs_next, rOk_next, lane, warp)
                stage, phase = self.ring_advance(stage, phase)
            ks0 = rKs_cur[0]
            ks1 = rKs_cur[1]
            pok = rOk_cur[0] != 0
            for r in cutlass.range_constexpr(nn):
                if cutlass.const_expr(r + 1 < nn):
                    warpgroup.wait_group(1)
                else:
                    warpgroup.wait_group(0)
                v0, v1 = self.head_sum(accs[r % 2], rW, r, swp, q4)
                if cutlass.const_expr(r + 2 < nn):
                    self.mma_row(accs[r % 2], rA_cur, tCrB, r + 2)
                s = base_s + m0 + 8 * q4
                v = cutlass.select_(q4 == 1, v1 * ks1, v0 * ks0)
                if (q4 < 2) & (s < max_ctx):
                    ok = pok & (s < rLen[r])
                    mOut[b * nn + r, s] = cutlass.select_(ok, v, Float32(NEG_INF))
            if next_other:
                self.q_switch(mLens, nbq, qfull, qempty, qphase, qraw, b0p, swp, rW, rLen, tidx, lane)
                qphase = qphase ^ 1
                self.load_regs(ring, stage, phase, wA_next, rKs_next, rOk_next, lane, warp)
                stage, phase = self.ring_advance(stage, phase)
            return nbq, nt, nnb, stage, phase, qphase

        @cute.jit
        def q_switch(self, mLens: cute.Tensor, b: Int32, qfull: Int32, qempty: Int32, qphase: Int32, qraw: Int32,
                     b0p: Int32, swp: Int32, rW: cute.Tensor, rLen: cute.Tensor, tidx: Int32, lane: Int32):
            """New sequence b: wait for its raw queries, convert them into the B operand and the
            weights, load this thread's 16 x nn weights and the rows' lengths into registers."""
            ptx.mbar_wait(qfull, qphase)
            self.convert_q(qraw, b0p, swp, tidx)
            ptx.fence_proxy_async()
            cute.arch.sync_warp()                 # reconverge after convert_q (aligned bar.sync)
            ptx.named_barrier(BAR_MATH, MATH_THREADS)
            cute.arch.sync_warp()
            if lane == 0:
                ptx.mbar_arrive(qempty)
            for r in cutlass.range_constexpr(self.nn):
                rLen[r] = Int32(mLens[b * self.nn + r])
                if cutlass.const_expr(self.w_regs):
                    for j in cutlass.range_constexpr(16):
                        hh = 8 * (j // 2) + 2 * (lane % 4) + (j % 2)
                        rW[r * 16 + j] = ptx.ld_shared_f32(swp + (r * 64 + hh) * 4)


def compile_check(dump_dir=None, arch: str = "sm_90a") -> dict:
    """Every decode specialization (fmt x next_n, heuristic configs) compiled for ``arch``."""
    from .indexer import compile_paged_all
    return compile_paged_all(dump_dir, arch)
