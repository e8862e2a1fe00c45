"""CuTe DSL providers of the MoE layer glue: ``moe_route``, ``moe_permute``, ``moe_combine``.

Contracts: docs/layouts/moe_route.md, moe_permute.md, moe_combine.md (``dsv4.ops.moe``). One
kernel class per op, one compiled call per op (one launch; route at decode sizes: its gate GEMM
kernel, then the top-k kernel), no host sync, CUDA-graph capturable; every size is a
runtime value (``cute.sym_int``), so one compile serves all token counts.

* :class:`RouteKernel` (``moe_route``): the gate GEMM ``logits = x_fp32 @ Wg_fp32^T``, then one
  warp per token. Where measured not slower on the device (:func:`gate_fused`: fp32 gate weights at
  ``8 <= T <= GATE_MAX_T``, bf16 ones at ``T <= GATE_MAX_T_BF16``; any decode size with
  ``set_gate_fused(True)``) the gate GEMM runs inside
  the same compiled call (one host call, the eager path's cost, issue 17): ``gate_kernel`` writes
  fp32 partial logits per ``GATE_KC``-wide K chunk (fp32 products of the exactly widened inputs added
  in k order, SIMT register tiles; the top-k kernel adds the chunks in order: deterministic, the
  reference's math in another summation order, ~1e-7 relative). Otherwise the gate GEMM on cuBLAS first (:func:`gate_logits`:
  bf16 inputs -> one tensor-core GEMM with fp32 output, the reference's math in another summation
  order; fp32 weights -> the reference's own fp32 GEMM, bit-exact route). Lane ``l`` holds the
  scores of experts ``32 j + l`` in registers: ``s = sqrt(softplus(logit))`` with torch's
  softplus (``x > 20 ? x : log1p(exp(x))``, libdevice ``expf`` / ``log1pf``, ``sqrt.rn``), then
  ``topk`` rounds of a warp arg-max over the 64-bit key ``(order-preserving bits of s + bias,
  ~expert)``: the largest selection score wins, ties go to the lower expert id (NaN ranks
  above every number, as in ``torch.topk``), the winner is retired. ``w = s[idx] / sum * route_scale``
  with the sum taken in slot order. Hash layers: ``idx = tid2eid[input_ids]``, scores re-read
  from the logits; an ``input_ids`` value outside ``[0, V)`` or a ``tid2eid`` value outside
  ``[0, E)`` gives ``idx = -1, w = 0`` (a dropped assignment) and the token's other weights are
  normalized over its valid slots.
* :class:`PermuteKernel` (``moe_permute``): stable counting sort of the ``T * k`` assignments by
  expert fused with DSV4 ``act_quant`` (FP8 E4M3, 1 x 128 blocks, UE8M0 scales, bit-exact with
  ``dsv4.formats.quantize_fp8_block``) and the gather into the grouped layout, one launch.
  Block ``b`` owns tokens ``[b * tpb, (b + 1) * tpb)``: (1) it histograms all assignment expert
  ids in shared memory (total counts, and counts of the assignments before its own: the
  expert offsets of its rows; 16-byte id loads, ``atom.shared.add``); (2) contiguous layout:
  exclusive scan of the totals over experts = ``row_start`` (block 0 writes ``row_start`` /
  ``row_count``); (3) the stable rank of each of its assignments among the block's earlier
  ones with the same expert: warp ``w`` ranks a contiguous sub-chunk in groups of 32 with
  ``match.any.sync`` + ``popc`` and per-warp counters, then adds the counts of the earlier
  warps; row = ``row_start[e] + offset[e] + rank`` (masked: ``e * max_m + offset + rank``,
  dropped with ``pos = -1`` when ``>= max_m``); writes ``pos`` and ``route_w``; (4) quantizes
  each of its tokens once (a half warp per 128-block: 16-byte loads, amax by shuffles,
  ``cvt.rn.satfinite.e4m3x2.f32``) and stores the FP8 row + scale to each of the token's rows.
  Out-of-range expert ids (negative or ``>= E``) are dropped assignments (``pos = -1``, no row).
* :class:`CombineKernel` (``moe_combine``): ``out[t] = sum_j y[pos[t * k + j]]`` in slot order
  starting from 0.0 (rows with ``pos`` outside ``[0, R)`` add 0), fp32, rounded once to the
  output dtype; 16-byte loads of the k rows issued together. Bit-exact with the torch reference.

Walls: none (everything above is CuTe DSL; ``match.any.sync`` and the E4M3 convert are one PTX
instruction each through ``llvm.inline_asm``, like ``prmt`` in ``dequant_fp4``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import (DslProvider, compile_cached, compile_options, compile_variants, dl, dsl_target_support,
                       f32, i32, launch_on)

try:  # the DSL is optional at import time: the providers then report "unavailable"
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32, Uint64
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass.memory import SmemAllocator

    from .sm90.fp4 import bits_to_f32, f32_to_bits
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["RouteKernel", "PermuteKernel", "CombineKernel", "PROVIDERS", "compile_check", "PTX_PATTERNS",
           "permute_tokens_per_block", "gate_logits"]

#: What every compiled variant's PTX must contain (tests/test_compile_dsl.py); per-kernel patterns
#: are checked in tests/test_moe_glue.py.
PTX_PATTERNS = (r"\.target\s+sm_90a",)
#: flush-to-zero would change subnormal activations / scores (bit-exactness)
PTX_FORBIDDEN = (r"\b(mul|add|div|sqrt|fma)\.[a-z.]*ftz",)

WARP = 32
#: route: tokens (warps) per CTA
ROUTE_WARPS = 4
#: route: partial logits loaded together (their loads all issued before their adds; fewer past 8 scores per lane)
ROUTE_PART_BATCH = 8
#: route: largest expert count (32 lanes x 32 registers) and top-k (one slot per lane)
ROUTE_MAX_E = 1024
ROUTE_MAX_K = 32
#: route, fused gate GEMM (decode sizes, :func:`gate_fused`): largest token count (x rows staged in shared
#: memory), K chunk per CTA (``S = ceil(D / GATE_KC)`` partial logits), experts per CTA, threads per CTA
GATE_MAX_T = 64
#: largest hidden size the fused gate serves (``S = D / GATE_KC`` partial logits: at D = 7168, E = 384 the
#: split-K partial sums made it 3x slower than cuBLAS on the device: docs/benchmarks.md)
GATE_MAX_D = 4096
GATE_KC = 256
GATE_EPC = 32
GATE_THREADS = 128
#: permute: threads per CTA (8 warps) and the largest assignment chunk of one CTA
PERMUTE_THREADS = 256
PERMUTE_CHUNK = 2048
#: permute: largest expert count (shared-memory histograms)
PERMUTE_MAX_E = 2048
#: combine: threads per CTA, 4 fp32 columns each
COMBINE_THREADS = 128
COMBINE_MAX_K = 16
FP8_MAX = 448.0
_INV448_F32 = 0.002232142956927418      # fp32(1/448), the constant of dsv4.formats.fp8
_AMAX_FLOOR_F32 = 9.999999747378752e-05  # fp32(1e-4) (DSV4 act_quant amax floor)
_X_DTYPES = ("bfloat16", "float16", "float32")
_IDX_DTYPES = ("int32", "int64")


def permute_tokens_per_block(T: int, k: int, sm_count: int) -> int:
    """Tokens per CTA of :class:`PermuteKernel`: enough CTAs (about 4 per SM) to stream the
    activations at full bandwidth, at most ``PERMUTE_CHUNK // k`` (the CTA's assignment chunk)."""
    want = -(-T // max(1, 4 * sm_count))
    return max(1, min(want, PERMUTE_CHUNK // max(1, k)))


if _HAVE_DSL:

    def _ir(v, ty, loc, ip):
        return ty(v).ir_value(loc=loc, ip=ip)

    @dsl_user_op
    def _match_any(v, *, loc=None, ip=None):
        """``match.any.sync.b32``: mask of the lanes of the (full) warp holding the same value."""
        return Uint32(llvm.inline_asm(
            T.i32(), [_ir(v, Int32, loc, ip), _ir(0xFFFFFFFF, Uint32, loc, ip)],
            "match.any.sync.b32 $0, $1, $2;", "=r,r,r",
            has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def _e4m3x4(a, b, c, d, *, loc=None, ip=None):
        """Four fp32 -> four E4M3 bytes ``[a, b, c, d]`` (little endian), RN, saturating to +-448."""
        return Uint32(llvm.inline_asm(
            T.i32(), [_ir(v, Float32, loc, ip) for v in (a, b, c, d)],
            "{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\nmov.b32 $0, {lo, hi};\n}",
            "=r,f,f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip))

    def _dtype(name: str):
        return {"bfloat16": BFloat16, "float16": Float16, "float32": Float32, "int32": Int32,
                "int64": Int64}[name]

    # ------------------------------------------------------------------------------ route
    class RouteKernel:
        """DSV4 gate top-k (module docstring): the gate GEMM's fp32 logits as ``S`` partial sums, then
        one warp per token. With ``gate`` (decode sizes) the gate GEMM runs first, in the same call.

        ``__call__(mX, mGw, mPart, mBias, mIds, mTid, mIdx, mW, route_scale, stream)``:

        * ``mX``: ``[T, D]`` hidden states, ``mGw``: ``[E, D]`` gate weight (bf16 / fp32, row-major,
          16-byte aligned, ``D % 8 == 0``), with ``gate``; else both ``None``;
        * ``mPart``: Float32 ``[S, T, E]`` row-major, ``S = n_part`` (compile-time): ``logit[t, e] =
          sum_s mPart[s, t, e]`` (summed in ``s`` order); with ``gate`` the :meth:`gate_kernel` writes
          it (``S = ceil(D / GATE_KC)``), else the caller (``S = 1``: ``x_fp32 @ Wg_fp32^T``);
        * ``mBias``: Float32 ``[E]`` selection bias or ``None``;
        * hash layers: ``mIds`` Int32/Int64 ``[T]``, ``mTid`` Int32/Int64 ``[V, K]`` row-major
          (else both ``None``);
        * ``mIdx`` Int32 ``[T, K]``, ``mW`` Float32 ``[T, K]`` outputs (row-major);
        * ``route_scale``: Float32.

        Constraints: ``E <= 32 * n_per_lane`` (``n_per_lane`` compile-time, <= 32), ``K <= 32``,
        ``K <= E``.
        """

        def __init__(self, topk: int, n_per_lane: int, hash_layer: bool, has_bias: bool, gate=None, n_part: int = 1,
                     kc: int = GATE_KC, max_t: int = GATE_MAX_T):
            if not 1 <= topk <= ROUTE_MAX_K:
                raise ValueError(f"topk must be in [1, {ROUTE_MAX_K}], got {topk}")
            if kc % 64 or not 64 <= kc <= 512 or max_t % 16 or not 16 <= max_t <= 64:
                raise ValueError(f"gate K chunk {kc} / staged tokens {max_t}: kc in 64..512 (multiple of 64), "
                                 "max_t in 16..64 (multiple of 16)")
            #: the fused gate's K chunk (columns per CTA) and staged token rows (the call's T <= max_t)
            self.kc, self.max_t = kc, max_t
            self.topk, self.npl, self.hash, self.has_bias = topk, n_per_lane, hash_layer, has_bias
            #: None, or the (x, gate weight) DSL element types of the fused gate GEMM
            self.gate = gate
            #: S, the partial sums per logit (compile-time: their loads are issued together)
            self.n_part = n_part

        @cute.jit
        def __call__(self, mX: Optional[cute.Tensor], mGw: Optional[cute.Tensor], mPart: cute.Tensor,
                     mBias: Optional[cute.Tensor], mIds: Optional[cute.Tensor], mTid: Optional[cute.Tensor],
                     mIdx: cute.Tensor, mW: cute.Tensor, route_scale: Float32, stream: cuda.CUstream):
            ntok = mPart.shape[1]
            if cutlass.const_expr(self.gate is not None):
                self.gate_kernel(mX, mGw, mPart).launch(
                    grid=[cute.ceil_div(mPart.shape[2], GATE_EPC), mPart.shape[0], 1], block=[GATE_THREADS, 1, 1],
                    stream=stream)
            self.kernel(mPart, mBias, mIds, mTid, mIdx, mW, route_scale).launch(
                grid=[cute.ceil_div(ntok, ROUTE_WARPS), 1, 1], block=[ROUTE_WARPS * WARP, 1, 1], stream=stream)

        @cute.kernel
        def gate_kernel(self, mX: cute.Tensor, mGw: cute.Tensor, mPart: cute.Tensor):
            """``mPart[s, t, e] = sum over the K chunk [s * GATE_KC, (s + 1) * GATE_KC) of fp32(x[t, k]) *
            fp32(Wg[e, k])``, added in k order from 0.0 (deterministic). CTA ``(b, s)``: experts
            ``[b * GATE_EPC, (b + 1) * GATE_EPC)`` x all ``T <= GATE_MAX_T`` tokens. (1) the chunk's x rows
            and weight rows into shared memory as fp32 (16-byte loads, all in flight, converted once;
            x rows padded by 16 bytes: conflict-free); (2) SIMT register tiles: thread ``(g, q)`` computes
            tokens ``q + 16 i`` x experts ``4 g + j`` (i, j < 4): per 4 columns 8 16-byte shared loads
            (the weight rows are the same across a half warp: broadcast) for 64 FMAs."""
            tidx, _, _ = cute.arch.thread_idx()
            bx, s, _ = cute.arch.block_idx()
            ntok, D = mX.shape
            n_exp = mGw.shape[0]
            xdt, wdt = self.gate
            KC, XS, MT = self.kc, self.kc + 4, self.max_t          # chunk columns, x row stride (fp32), x rows
            e0 = bx * GATE_EPC
            k0 = s * KC
            nk = cutlass.min(KC, D - k0)                            # this chunk's columns (a multiple of 8)
            smem = SmemAllocator()
            sX = smem.allocate_tensor(Float32, cute.make_layout(MT * XS), byte_alignment=16)
            sW = smem.allocate_tensor(Float32, cute.make_layout(GATE_EPC * KC), byte_alignment=16)
            st4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            # (1) staging: 8-element vectors (rows past T / E, columns past D: not loaded, never used)
            dv8 = D // 8
            for src, dst, dt, rows, row0, nrow, stride in ((mX, sX, xdt, ntok, 0, MT, XS),
                                                           (mGw, sW, wdt, n_exp, e0, GATE_EPC, KC)):
                nb = min(128, dt.width * 8)
                ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dt, num_bits_per_copy=nb, invariant=True)
                g8 = cute.zipped_divide(cute.make_tensor(src.iterator, cute.make_layout(Int64(rows) * Int64(D))), (8,))
                dst4 = cute.zipped_divide(dst, (4,))
                per_thread = nrow * (KC // 8) // GATE_THREADS
                for b0 in cutlass.range_constexpr(0, per_thread, 8):         # batches of 8 loads in flight
                    regs = []
                    for u in cutlass.range_constexpr(min(8, per_thread - b0)):
                        q = (b0 + u) * GATE_THREADS + tidx
                        r = q // (KC // 8)
                        c = q - r * (KC // 8)
                        rv = cute.make_rmem_tensor((8,), dt)
                        if row0 + r < rows:
                            if c * 8 < nk:
                                cute.copy(ld, cute.logical_divide(g8[(None, Int64(row0 + r) * Int64(dv8) + Int64(s * (KC // 8) + c))],
                                                                  (nb // dt.width,)),
                                          cute.logical_divide(rv, (nb // dt.width,)))
                        regs.append((rv, r, c))
                    for rv, r, c in regs:
                        if row0 + r < rows:
                            if c * 8 < nk:
                                f = cute.make_rmem_tensor((8,), Float32)
                                f.store(rv.load().to(Float32))
                                base = (r * stride + c * 8) // 4
                                f4 = cute.zipped_divide(f, (4,))
                                cute.copy(st4, f4[(None, 0)], dst4[(None, base)])
                                cute.copy(st4, f4[(None, 1)], dst4[(None, base + 1)])
            cute.arch.sync_threads()
            # (2) register tiles over the chunk's columns, 4 at a time
            q = tidx % 16
            g = tidx // 16
            ld4 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
            sX4 = cute.zipped_divide(sX, (4,))
            sW4 = cute.zipped_divide(sW, (4,))
            rAcc = cute.make_rmem_tensor((16,), Float32)
            rAcc.fill(0.0)
            n_ig = (ntok + 15) // 16                                # token row groups that hold tokens (uniform)
            for k in cutlass.range(0, nk, 4, unroll=4):
                rx = []
                rw = []
                for i in cutlass.range_constexpr(MT // 16):
                    vx = cute.make_rmem_tensor((4,), Float32)
                    if i < n_ig:
                        cute.copy(ld4, sX4[(None, ((q + 16 * i) * XS + k) // 4)], vx)
                    rx.append(vx)
                for j in cutlass.range_constexpr(4):
                    vw = cute.make_rmem_tensor((4,), Float32)
                    cute.copy(ld4, sW4[(None, ((4 * g + j) * KC + k) // 4)], vw)
                    rw.append(vw)
                for i in cutlass.range_constexpr(MT // 16):
                    if i < n_ig:                                    # (row groups past T: no loads, no FMAs)
                        for j in cutlass.range_constexpr(4):
                            a = rAcc[4 * i + j]
                            for c in cutlass.range_constexpr(4):
                                a = a + rx[i][c] * rw[j][c]
                            rAcc[4 * i + j] = a
            for i in cutlass.range_constexpr(MT // 16):
                t = q + 16 * i
                if t < ntok:
                    for j in cutlass.range_constexpr(4):
                        e = e0 + 4 * g + j
                        if e < n_exp:
                            mPart[s, t, e] = rAcc[4 * i + j]

        @cute.jit
        def _logit(self, mPart: cute.Tensor, t: Int32, c: Int32) -> Float32:
            """``sum_s mPart[s, t, c]`` in ``s`` order."""
            v = mPart[0, t, c]
            for s in cutlass.range_constexpr(1, self.n_part):
                v = v + mPart[s, t, c]
            return v

        @cute.jit
        def _score(self, logit: Float32) -> Float32:
            sp = logit
            if logit <= Float32(20.0):          # torch softplus(beta=1, threshold=20); NaN passes through
                sp = cute.math.log1p(cute.math.exp(logit))
            return cute.math.sqrt(sp)

        @cute.kernel
        def kernel(self, mPart: cute.Tensor, mBias: Optional[cute.Tensor], mIds: Optional[cute.Tensor],
                   mTid: Optional[cute.Tensor], mIdx: cute.Tensor, mW: cute.Tensor, route_scale: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % WARP
            t = bidx * ROUTE_WARPS + tidx // WARP
            _, ntok, n_exp = mPart.shape
            if t < ntok:                       # warp-uniform
                my_e = Int32(-1)
                my_s = Float32(0.0)
                acc = Float32(0.0)
                if cutlass.const_expr(self.hash):
                    # idx = tid2eid[input_ids[t]]; lane r < topk owns slot r
                    V = mTid.shape[0]
                    if lane < self.topk:
                        tok = Int64(mIds[t])
                        if tok >= Int64(0) and tok < Int64(V):
                            e64 = Int64(mTid[tok, lane])
                            if e64 >= Int64(0) and e64 < Int64(n_exp):
                                my_e = Int32(e64)
                                my_s = self._score(self._logit(mPart, t, my_e))
                    for r in cutlass.range_constexpr(self.topk):   # slot order
                        acc = acc + cute.arch.shuffle_sync(my_s, offset=r)
                else:
                    rS = cute.make_rmem_tensor((self.npl,), Float32)
                    rK = cute.make_rmem_tensor((self.npl,), Uint64)
                    # the logits of this lane's experts 32 j + lane: the S partials summed in order (the loads
                    # of one partial for all j issued together; an expert past E reads column E - 1, unused)
                    rL = cute.make_rmem_tensor((self.npl,), Float32)
                    for j in cutlass.range_constexpr(self.npl):
                        rL[j] = mPart[0, t, cutlass.min(j * WARP + lane, n_exp - 1)]
                    # the further partials ROUTE_PART_BATCH at a time: all their loads first, then the adds in s order
                    pb = max(1, min(ROUTE_PART_BATCH, 64 // self.npl))   # at most 64 registers of loads
                    for p0 in cutlass.range_constexpr(1, self.n_part, pb):
                        nb = min(pb, self.n_part - p0)
                        rP = cute.make_rmem_tensor((nb * self.npl,), Float32)
                        for b in cutlass.range_constexpr(nb):
                            for j in cutlass.range_constexpr(self.npl):
                                rP[b * self.npl + j] = mPart[p0 + b, t, cutlass.min(j * WARP + lane, n_exp - 1)]
                        for b in cutlass.range_constexpr(nb):
                            for j in cutlass.range_constexpr(self.npl):
                                rL[j] = rL[j] + rP[b * self.npl + j]
                    for j in cutlass.range_constexpr(self.npl):
                        c = j * WARP + lane
                        rS[j] = Float32(0.0)
                        rK[j] = Uint64(0)                 # 0 = not selectable
                        if c < n_exp:
                            s = self._score(rL[j])
                            rS[j] = s
                            sel = s
                            if cutlass.const_expr(self.has_bias):
                                sel = s + mBias[c]
                            b = f32_to_bits(sel)
                            # order-preserving map of fp32 bits to an unsigned key (NaN above +inf)
                            u = b ^ Uint32(cutlass.select_(Int32(b) < Int32(0), Uint32(0xFFFFFFFF), Uint32(0x80000000)))
                            rK[j] = (Uint64(u) << Uint64(32)) | Uint64(Uint32(0xFFFFFFFF) - Uint32(c))
                    for r in cutlass.range_constexpr(self.topk):
                        # unsigned 64-bit arg-max (select_ returns an untyped value: re-wrap it as
                        # Uint64 each time, else the next compare / shuffle would be signed)
                        best = Uint64(rK[0])
                        for j in cutlass.range_constexpr(1, self.npl):
                            best = Uint64(cutlass.select_(rK[j] > best, rK[j], best))
                        for o in cutlass.range_constexpr(5):
                            other = Uint64(cute.arch.shuffle_sync_bfly(best, offset=1 << (4 - o)))
                            best = Uint64(cutlass.select_(other > best, other, best))
                        col = Int32(Uint32(0xFFFFFFFF) - Uint32(best & Uint64(0xFFFFFFFF)))
                        sv = Float32(0.0)
                        for j in cutlass.range_constexpr(self.npl):
                            if col == j * WARP + lane:
                                sv = rS[j]
                                rK[j] = Uint64(0)     # retire the winner
                        sv = cute.arch.shuffle_sync(sv, offset=col % WARP)
                        acc = acc + sv                # slot order
                        if lane == r:
                            my_e = col
                            my_s = sv
                if lane < self.topk:
                    w = Float32(0.0)
                    if my_e >= Int32(0) and acc > Float32(0.0):
                        w = my_s / acc * route_scale
                    mIdx[t, lane] = my_e
                    mW[t, lane] = w

    # ------------------------------------------------------------------------------ permute
    class PermuteKernel:
        """Stable counting sort + FP8 act_quant + gather into the grouped layout (module docstring).

        ``__call__(mX, mIdx, mW, mA, mAs, mRowStart, mRowCount, mRouteW, mPos, n_exp, max_m, tpb, n_blk, stream)``:

        * ``mX``: ``[T, D]`` bf16 / fp16 / fp32 row-major, 16-byte aligned, ``D % 128 == 0``;
        * ``mIdx``: Int32/Int64 ``[T, k]`` expert ids, row-major (16-byte aligned); ``mW``: Float32
          ``[T, k]`` routing weights, row-major (both read flat, as ``[T * k]``: the op's tensors as
          they are, no view on the host);
        * ``mA``: fp8: Float8E4M3FN ``[R, D]`` (read as 32-bit words); bf16: BFloat16 ``[R, D]``;
          ``mAs``: Float32 ``[R, D / 128]`` (fp8) or ``None``;
        * ``mRowStart``, ``mRowCount``: Int32 ``[E]``; ``mRouteW``: Float32 ``[R]``; ``mPos``: Int64 ``[T * k]``;
        * ``n_exp`` (E), ``max_m`` (masked), ``tpb`` (tokens per CTA), ``n_blk = ceil(T / tpb)``: Int32.

        Constraints: ``E <= e_cap`` (compile-time, a multiple of 256, <= 2048), ``tpb * k <=
        PERMUTE_CHUNK``, ``R * D < 2^63``. Rows of ``a`` / ``a_s`` / ``route_w`` that hold no
        assignment are not written.
        """

        def __init__(self, act: str, layout: str, e_cap: int, x_dtype, idx_dtype):
            if act not in ("fp8", "bf16") or layout not in ("contiguous", "masked"):
                raise ValueError(f"act {act!r} / layout {layout!r}")
            if e_cap % PERMUTE_THREADS or not 0 < e_cap <= PERMUTE_MAX_E:
                raise ValueError(f"e_cap must be a multiple of {PERMUTE_THREADS} in (0, {PERMUTE_MAX_E}], got {e_cap}")
            self.act, self.layout, self.e_cap = act, layout, e_cap
            self.x_dtype, self.idx_dtype = x_dtype, idx_dtype
            self.idx_vec = 16 // (idx_dtype.width // 8)    # ids per 16-byte load
            self.x_vec = 8                                  # activations per thread and 128-block step

        @cute.jit
        def __call__(self, mX: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor,
                     mAs: Optional[cute.Tensor], mRowStart: cute.Tensor, mRowCount: cute.Tensor,
                     mRouteW: cute.Tensor, mPos: cute.Tensor, n_exp: Int32, max_m: Int32, tpb: Int32,
                     n_blk: Int32, stream: cuda.CUstream):
            n = mIdx.shape[0] * mIdx.shape[1]                   # the [T, k] routing, flat
            mIdxF = cute.make_tensor(mIdx.iterator, cute.make_layout((n,)))
            mWF = cute.make_tensor(mW.iterator, cute.make_layout((n,)))
            mA32 = mA
            if cutlass.const_expr(self.act == "fp8"):          # the E4M3 rows as 32-bit words [R, D / 4]
                d4 = mA.shape[1] // 4
                mA32 = cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=Int32),
                                        cute.make_layout((mA.shape[0], d4), stride=(d4, 1)))
            self.kernel(mX, mIdxF, mWF, mA32, mAs, mRowStart, mRowCount, mRouteW, mPos, n_exp, max_m, tpb).launch(
                grid=[n_blk, 1, 1], block=[PERMUTE_THREADS, 1, 1], stream=stream)

        @cute.jit
        def _expert(self, v, n_exp: Int32) -> Int32:
            """An id -> the expert, or -1 outside ``[0, E)`` (compared at the id's width)."""
            e = Int32(-1)
            if v >= self.idx_dtype(0) and v < self.idx_dtype(n_exp):
                e = Int32(v)
            return e

        @cute.kernel
        def kernel(self, mX: cute.Tensor, mIdx: cute.Tensor, mW: cute.Tensor, mA: cute.Tensor,
                   mAs: Optional[cute.Tensor], mRowStart: cute.Tensor, mRowCount: cute.Tensor,
                   mRouteW: cute.Tensor, mPos: cute.Tensor, n_exp: Int32, max_m: Int32, tpb: Int32):
            NW = PERMUTE_THREADS // WARP
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % WARP
            warp = tidx // WARP
            ntok, D = mX.shape
            n = mIdx.shape[0]
            k = n // ntok
            t0 = bidx * tpb
            t1 = cutlass.min(t0 + tpb, ntok)
            i0 = t0 * k
            C = (t1 - t0) * k                                   # assignments of this CTA

            # (0) this warp's first pair of 128-column units: its activation loads overlap the sort
            NB = D // 128
            units = (t1 - t0) * NB
            rX0 = cute.make_rmem_tensor((self.x_vec,), self.x_dtype)
            self._load_unit(mX, rX0, warp, t0, units, NB)

            smem = SmemAllocator()
            sTot = smem.allocate_tensor(Int32, cute.make_layout(self.e_cap), byte_alignment=16)
            sPre = smem.allocate_tensor(Int32, cute.make_layout(self.e_cap), byte_alignment=16)
            sStart = smem.allocate_tensor(Int32, cute.make_layout(self.e_cap), byte_alignment=16)
            sWh = smem.allocate_tensor(Int32, cute.make_layout((self.e_cap, NW)), byte_alignment=16)
            sIds = smem.allocate_tensor(Int32, cute.make_layout(PERMUTE_CHUNK), byte_alignment=16)
            sRow = smem.allocate_tensor(Int32, cute.make_layout(PERMUTE_CHUNK), byte_alignment=16)
            sScan = smem.allocate_tensor(Int32, cute.make_layout(NW), byte_alignment=16)

            for j in cutlass.range_constexpr(self.e_cap // PERMUTE_THREADS):
                e = j * PERMUTE_THREADS + tidx
                sTot[e] = Int32(0)
                sPre[e] = Int32(0)
                for w in cutlass.range_constexpr(NW):
                    sWh[e, w] = Int32(0)
            cute.arch.sync_threads()

            # (1) histograms of all ids (totals) and of the ids before this CTA's (offsets)
            V = self.idx_vec
            n_vec = n // V
            gIdxV = cute.zipped_divide(cute.make_tensor(mIdx.iterator, cute.make_layout(n_vec * V)), (V,))
            ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), self.idx_dtype, num_bits_per_copy=128, invariant=True)
            UNR = 4
            rV = cute.make_rmem_tensor((V, UNR), self.idx_dtype)
            for base in range(tidx, n_vec, PERMUTE_THREADS * UNR):
                for u in cutlass.range_constexpr(UNR):
                    c = base + u * PERMUTE_THREADS
                    if c < n_vec:
                        cute.copy(ld16, gIdxV[(None, c)], rV[(None, u)])
                for u in cutlass.range_constexpr(UNR):
                    c = base + u * PERMUTE_THREADS
                    if c < n_vec:
                        for v in cutlass.range_constexpr(V):
                            e = self._expert(rV[v, u], n_exp)
                            if e >= Int32(0):
                                cute.arch.atomic_add((sTot.iterator + e).llvm_ptr, Int32(1), scope="cta")
                                if c * V + v < i0:
                                    cute.arch.atomic_add((sPre.iterator + e).llvm_ptr, Int32(1), scope="cta")
            for i in range(n_vec * V + tidx, n, PERMUTE_THREADS):   # tail (< V ids)
                e = self._expert(mIdx[i], n_exp)
                if e >= Int32(0):
                    cute.arch.atomic_add((sTot.iterator + e).llvm_ptr, Int32(1), scope="cta")
                    if i < i0:
                        cute.arch.atomic_add((sPre.iterator + e).llvm_ptr, Int32(1), scope="cta")
            # this CTA's expert ids, for the ranks
            for j in cutlass.range_constexpr(PERMUTE_CHUNK // PERMUTE_THREADS):
                p = j * PERMUTE_THREADS + tidx
                if p < C:
                    sIds[p] = self._expert(mIdx[i0 + p], n_exp)
            cute.arch.sync_threads()

            # (2) contiguous: row_start = exclusive scan of the totals over experts
            EPT = self.e_cap // PERMUTE_THREADS
            if cutlass.const_expr(self.layout == "contiguous"):
                local = Int32(0)
                for j in cutlass.range_constexpr(EPT):
                    local = local + sTot[tidx * EPT + j]
                incl = local
                for o in cutlass.range_constexpr(5):
                    nb_incl = cute.arch.shuffle_sync_up(incl, offset=1 << o)
                    if lane >= (1 << o):
                        incl = incl + nb_incl
                if lane == WARP - 1:
                    sScan[warp] = incl
                cute.arch.sync_threads()
                run = incl - local
                for w in cutlass.range_constexpr(NW):
                    if w < warp:
                        run = run + sScan[w]
                for j in cutlass.range_constexpr(EPT):
                    sStart[tidx * EPT + j] = run
                    run = run + sTot[tidx * EPT + j]
                cute.arch.sync_threads()
            if bidx == 0:
                for j in cutlass.range_constexpr(EPT):
                    e = j * PERMUTE_THREADS + tidx
                    if e < n_exp:
                        if cutlass.const_expr(self.layout == "contiguous"):
                            mRowStart[e] = sStart[e]
                            mRowCount[e] = sTot[e]
                        else:
                            mRowStart[e] = e * max_m
                            mRowCount[e] = cutlass.min(sTot[e], max_m)

            # (3) stable ranks inside the CTA: warp w ranks items [w S, (w + 1) S) in order
            S = (C + NW - 1) // NW
            p_end = cutlass.min((warp + 1) * S, C)
            lt_mask = (Uint32(1) << Uint32(lane)) - Uint32(1)
            for g in range(warp * S, p_end, WARP):
                p = g + lane
                e = Int32(-1)
                if p < p_end:
                    e = sIds[p]
                peers = _match_any(e)
                before = Int32(0)
                if e >= Int32(0):
                    before = sWh[e, warp]
                cute.arch.sync_warp()
                if e >= Int32(0):
                    sRow[p] = before + cute.arch.popc(peers & lt_mask)
                    if (peers >> Uint32(lane)) == Uint32(1):       # highest lane of the group
                        sWh[e, warp] = before + cute.arch.popc(peers)
                cute.arch.sync_warp()
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr(PERMUTE_CHUNK // PERMUTE_THREADS):
                p = j * PERMUTE_THREADS + tidx
                if p < C:
                    e = sIds[p]
                    row = Int32(-1)
                    if e >= Int32(0):
                        g = sPre[e] + sRow[p]
                        wp = p // S
                        for w in cutlass.range_constexpr(NW):
                            if w < wp:
                                g = g + sWh[e, w]
                        if cutlass.const_expr(self.layout == "contiguous"):
                            row = sStart[e] + g
                        else:
                            if g < max_m:
                                row = e * max_m + g
                    mPos[i0 + p] = Int64(row)
                    if row >= Int32(0):
                        mRouteW[row] = mW[i0 + p]
                    sRow[p] = row
            cute.arch.sync_threads()

            # (4) each token once: act_quant (fp8) or bf16 cast, stored to each of its rows; a warp
            # takes two 128-column units per step (one per half warp); its first pair was loaded in (0)
            self._emit_unit(rX0, warp, t0, units, NB, k, sRow, mA, mAs, mRouteW.shape[0])
            for pair in range(warp + NW, (units + 1) // 2, NW):
                rX = cute.make_rmem_tensor((self.x_vec,), self.x_dtype)
                self._load_unit(mX, rX, pair, t0, units, NB)
                self._emit_unit(rX, pair, t0, units, NB, k, sRow, mA, mAs, mRouteW.shape[0])

        @cute.jit
        def _load_unit(self, mX: cute.Tensor, rX: cute.Tensor, pair: Int32, t0: Int32, units: Int32, NB: Int32):
            """16-byte loads of this lane's 8 activations of unit ``2 pair + half`` (0 past the last unit)."""
            ntok, D = mX.shape
            lane = cute.arch.lane_idx()
            u = pair * 2 + lane // 16
            xv = self.x_vec
            rX.fill(0)
            if u < units:
                tl = u // NB
                col = (u - tl * NB) * 128 + (lane % 16) * xv
                gX = cute.zipped_divide(cute.make_tensor(mX.iterator, cute.make_layout(Int64(ntok) * Int64(D))), (xv,))
                xbits = min(128, self.x_dtype.width * xv)
                ev = xbits // self.x_dtype.width        # elements per 16-byte load
                ldx = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), self.x_dtype, num_bits_per_copy=xbits, invariant=True)
                cute.copy(ldx, cute.logical_divide(gX[(None, (Int64(t0 + tl) * Int64(D) + Int64(col)) // xv)], (ev,)),
                          cute.logical_divide(rX, (ev,)))

        @cute.jit
        def _emit_unit(self, rX: cute.Tensor, pair: Int32, t0: Int32, units: Int32, NB: Int32, k: Int32,
                       sRow: cute.Tensor, mA: cute.Tensor, mAs: Optional[cute.Tensor], R: Int32):
            """act_quant (or bf16 cast) of one unit and its stores to the token's rows (whole warp:
            the amax shuffles stay inside each half warp)."""
            lane = cute.arch.lane_idx()
            hl = lane % 16
            u = pair * 2 + lane // 16
            ok = u < units
            tl = u // NB
            blk = u - tl * NB
            xv = self.x_vec
            col = blk * 128 + hl * xv
            D = NB * 128
            rF = cute.make_rmem_tensor((xv,), Float32)
            rF.store(rX.load().to(Float32))
            if cutlass.const_expr(self.act == "fp8"):
                gA = cute.zipped_divide(cute.make_tensor(cute.recast_ptr(mA.iterator, dtype=Uint32),
                                                         cute.make_layout(Int64(R) * Int64(D // 4))), (2,))
                st8 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=64)
                amax = Float32(0.0)
                for i in cutlass.range_constexpr(xv):
                    a = cute.math.abs(rF[i])
                    a = cutlass.select_(a < Float32(float("inf")), a, Float32(0.0))   # finite only
                    amax = cute.arch.fmax(amax, a)
                for o in cutlass.range_constexpr(4):
                    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=8 >> o))
                amax = cute.arch.fmax(amax, Float32(_AMAX_FLOOR_F32))
                sb = f32_to_bits(amax * Float32(_INV448_F32))
                ex = (sb >> Uint32(23)) & Uint32(0xFF)
                ex = ex + Uint32(cutlass.select_((sb & Uint32(0x7FFFFF)) != Uint32(0), Uint32(1), Uint32(0)))
                scale = bits_to_f32(ex << Uint32(23))                  # ue8m0_ceil(amax / 448), normal
                inv = bits_to_f32((Uint32(254) - ex) << Uint32(23))    # exact 1 / scale
                rQ = cute.make_rmem_tensor((2,), Uint32)
                for h in cutlass.range_constexpr(2):
                    v = []
                    for i in cutlass.range_constexpr(4):
                        q = rF[4 * h + i] * inv
                        v.append(cute.arch.fmin(cute.arch.fmax(q, Float32(-FP8_MAX)), Float32(FP8_MAX)))
                    wq = _e4m3x4(v[0], v[1], v[2], v[3])
                    for i in cutlass.range_constexpr(4):                # NaN -> canonical 0x7F
                        if rF[4 * h + i] != rF[4 * h + i]:
                            wq = (wq & Uint32(~(0xFF << (8 * i)) & 0xFFFFFFFF)) | Uint32(0x7F << (8 * i))
                    rQ[h] = wq
                if ok:
                    for j in range(k):
                        row = sRow[tl * k + j]
                        if row >= Int32(0):
                            cute.copy(st8, rQ, gA[(None, (Int64(row) * Int64(D) + Int64(col)) // 8)])
                            if hl == 0:
                                mAs[row, blk] = scale
            else:
                gA = cute.zipped_divide(cute.make_tensor(mA.iterator, cute.make_layout(Int64(R) * Int64(D))), (xv,))
                st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
                rB = cute.make_rmem_tensor((xv,), BFloat16)
                rB.store(rF.load().to(BFloat16))
                if ok:
                    for j in range(k):
                        row = sRow[tl * k + j]
                        if row >= Int32(0):
                            cute.copy(st16, rB, gA[(None, (Int64(row) * Int64(D) + Int64(col)) // xv)])

    # ------------------------------------------------------------------------------ combine
    class CombineKernel:
        """``out[t] = sum_j y[pos[t k + j]]`` (module docstring).

        ``__call__(mY, mPos, mOut, stream)``: ``mY`` Float32 ``[R, D]``, ``mPos`` Int64 ``[T * k]``,
        ``mOut`` ``[T, D]`` (Float32 / BFloat16 / Float16), all row-major, 16-byte aligned,
        ``D % 4 == 0``. ``k`` is compile-time (the k row loads are issued together).
        Grid ``(T, ceil(D / 512))``, 128 threads, 4 columns per thread.
        """

        def __init__(self, topk: int, out_dtype):
            if not 1 <= topk <= COMBINE_MAX_K:
                raise ValueError(f"topk must be in [1, {COMBINE_MAX_K}], got {topk}")
            self.k, self.out_dtype = topk, out_dtype

        @cute.jit
        def __call__(self, mY: cute.Tensor, mPos: cute.Tensor, mOut: cute.Tensor, stream: cuda.CUstream):
            ntok, D = mOut.shape
            self.kernel(mY, mPos, mOut).launch(
                grid=[ntok, cute.ceil_div(D, 4 * COMBINE_THREADS), 1], block=[COMBINE_THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mY: cute.Tensor, mPos: cute.Tensor, mOut: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            t, bx, _ = cute.arch.block_idx()
            R, D = mY.shape
            ntok = mOut.shape[0]
            col = (bx * COMBINE_THREADS + tidx) * 4
            if col < D:
                gY = cute.zipped_divide(cute.make_tensor(mY.iterator, cute.make_layout(Int64(R) * Int64(D))), (4,))
                ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128)
                rY = cute.make_rmem_tensor((4, self.k), Float32)
                rY.fill(0.0)
                for j in cutlass.range_constexpr(self.k):
                    p = mPos[t * self.k + j]
                    if p >= Int64(0) and p < Int64(R):
                        cute.copy(ld, gY[(None, (p * Int64(D) + Int64(col)) // 4)], rY[(None, j)])
                rO = cute.make_rmem_tensor((4,), Float32)
                for c in cutlass.range_constexpr(4):
                    acc = Float32(0.0)
                    for j in cutlass.range_constexpr(self.k):   # slot order, from 0.0
                        acc = acc + rY[c, j]
                    rO[c] = acc
                gO = cute.zipped_divide(cute.make_tensor(mOut.iterator, cute.make_layout(Int64(ntok) * Int64(D))), (4,))
                dst = gO[(None, (Int64(t) * Int64(D) + Int64(col)) // 4)]
                if cutlass.const_expr(self.out_dtype == Float32):
                    cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128), rO, dst)
                else:
                    rC = cute.make_rmem_tensor((4,), self.out_dtype)
                    rC.store(rO.load().to(self.out_dtype))
                    cute.copy(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=64),
                              rC, dst)


# ---------------------------------------------------------------------------------- compile
def _route_npl(E: int) -> int:
    return max(1, -(-E // WARP))


def _permute_e_cap(E: int) -> int:
    return PERMUTE_THREADS * max(1, -(-E // PERMUTE_THREADS))


def _fake_route(topk: int, hash_layer: bool, has_bias: bool, ids: str, tid: str, gate=None, n_part: int = 1):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    t, e = cute.sym_int32(symbol="T"), cute.sym_int32(symbol="E")
    mx = mgw = None
    if gate is not None:
        d = cute.sym_int32(divisibility=8, symbol="D")
        mx = make_fake_compact_tensor(_dtype(gate[0]), (t, d), stride_order=(1, 0), assumed_align=16)
        mgw = make_fake_compact_tensor(_dtype(gate[1]), (e, d), stride_order=(1, 0), assumed_align=16)
    part = make_fake_compact_tensor(Float32, (n_part, t, e), stride_order=(2, 1, 0), assumed_align=4)
    bias = make_fake_compact_tensor(Float32, (e,), assumed_align=4) if has_bias else None
    mids = mtid = None
    if hash_layer:
        mids = make_fake_compact_tensor(_dtype(ids), (t,), assumed_align=4)
        mtid = make_fake_compact_tensor(_dtype(tid), (cute.sym_int32(symbol="V"), cute.sym_int32(symbol="K")),
                                        stride_order=(1, 0), assumed_align=4)
    kk = cute.sym_int32(symbol="KO")
    idx = make_fake_compact_tensor(Int32, (t, kk), stride_order=(1, 0), assumed_align=4)
    w = make_fake_compact_tensor(Float32, (t, kk), stride_order=(1, 0), assumed_align=4)
    return mx, mgw, part, bias, mids, mtid, idx, w, Float32(1.5), make_fake_stream()


def _compile_route(topk, npl, hash_layer, has_bias, ids, tid, arch, extra="", gate=None, n_part=1, kc=GATE_KC,
                   max_t=GATE_MAX_T):
    """``gate``: None (logits given) or the (x, gate weight) dtype names of the fused gate GEMM; ``n_part``:
    the partial sums per logit (``ceil(D / kc)`` with ``gate``, else 1); ``kc`` / ``max_t``: the fused gate's
    K chunk and staged token rows."""
    kern = RouteKernel(topk, npl, hash_layer, has_bias, None if gate is None else (_dtype(gate[0]), _dtype(gate[1])),
                       n_part, kc, max_t)
    return cute.compile(kern, *_fake_route(topk, hash_layer, has_bias, ids, tid, gate, n_part),
                        options=compile_options(arch, extra))


def _fake_permute(act: str, x: str, idx: str):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    t = cute.sym_int32(symbol="T")
    d = cute.sym_int32(divisibility=128, symbol="D")
    n = cute.sym_int32(symbol="N")
    r = cute.sym_int32(symbol="R")
    mx = make_fake_compact_tensor(_dtype(x), (t, d), stride_order=(1, 0), assumed_align=16)
    kk = cute.sym_int32(symbol="K")
    mi = make_fake_compact_tensor(_dtype(idx), (t, kk), stride_order=(1, 0), assumed_align=16)
    mw = make_fake_compact_tensor(Float32, (t, kk), stride_order=(1, 0), assumed_align=4)
    if act == "fp8":
        ma = make_fake_compact_tensor(cutlass.Float8E4M3FN, (r, d), stride_order=(1, 0), assumed_align=16)
        mas = make_fake_compact_tensor(Float32, (r, cute.sym_int32(symbol="NB")), stride_order=(1, 0), assumed_align=4)
    else:
        ma = make_fake_compact_tensor(BFloat16, (r, d), stride_order=(1, 0), assumed_align=16)
        mas = None
    e = cute.sym_int32(symbol="E")
    rs = make_fake_compact_tensor(Int32, (e,), assumed_align=4)
    rc = make_fake_compact_tensor(Int32, (e,), assumed_align=4)
    rw = make_fake_compact_tensor(Float32, (r,), assumed_align=4)
    pos = make_fake_compact_tensor(Int64, (n,), assumed_align=8)
    return mx, mi, mw, ma, mas, rs, rc, rw, pos, Int32(1), Int32(1), Int32(1), Int32(1), make_fake_stream()


def _compile_permute(act, layout, e_cap, x, idx, arch, extra=""):
    kern = PermuteKernel(act, layout, e_cap, _dtype(x), _dtype(idx))
    return cute.compile(kern, *_fake_permute(act, x, idx), options=compile_options(arch, extra))


def _fake_combine(topk: int, out: str):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    d = cute.sym_int32(divisibility=4, symbol="D")
    y = make_fake_compact_tensor(Float32, (cute.sym_int32(symbol="R"), d), stride_order=(1, 0), assumed_align=16)
    pos = make_fake_compact_tensor(Int64, (cute.sym_int32(symbol="N"),), assumed_align=8)
    o = make_fake_compact_tensor(_dtype(out), (cute.sym_int32(symbol="T"), d), stride_order=(1, 0), assumed_align=16)
    return y, pos, o, make_fake_stream()


def _compile_combine(topk, out, arch, extra=""):
    return cute.compile(CombineKernel(topk, _dtype(out)), *_fake_combine(topk, out), options=compile_options(arch, extra))


#: specializations compiled by :func:`compile_check` (the DSV4 ones plus the dtype / layout variety)
CHECK_VARIANTS = {
    "route-topk6-e256-bias": lambda a, x: _compile_route(6, 8, False, True, "int32", "int32", a, x),
    "route-topk6-e384-nobias": lambda a, x: _compile_route(6, 12, False, False, "int32", "int32", a, x),
    "route-topk6-hash-int64": lambda a, x: _compile_route(6, 8, True, False, "int64", "int64", a, x),
    "route-gate-bf16-fp32-topk6-e256-bias": lambda a, x: _compile_route(6, 8, False, True, "int32", "int32", a, x,
                                                                         gate=("bfloat16", "float32"), n_part=16),
    "route-gate-bf16-bf16-topk6-hash-int32": lambda a, x: _compile_route(6, 1, True, False, "int32", "int32", a, x,
                                                                          gate=("bfloat16", "bfloat16"), n_part=2),
    "route-gate-bf16-bf16-topk6-e256-t16": lambda a, x: _compile_route(6, 8, False, True, "int32", "int32", a, x,
                                                                        gate=("bfloat16", "bfloat16"), n_part=16,
                                                                        max_t=GATE_SMALL_T),
    "permute-fp8-contiguous-bf16-int32": lambda a, x: _compile_permute("fp8", "contiguous", 256, "bfloat16", "int32", a, x),
    "permute-fp8-masked-fp32-int64": lambda a, x: _compile_permute("fp8", "masked", 512, "float32", "int64", a, x),
    "permute-bf16-contiguous-bf16-int32": lambda a, x: _compile_permute("bf16", "contiguous", 256, "bfloat16", "int32", a, x),
    "combine-k6-float32": lambda a, x: _compile_combine(6, "float32", a, x),
    "combine-k6-bfloat16": lambda a, x: _compile_combine(6, "bfloat16", a, x),
}


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a", variants=None) -> dict[str, str]:
    """Compile the :data:`CHECK_VARIANTS` for ``arch`` without a GPU; ``{variant: PTX text}``."""
    return compile_variants("moe_glue", CHECK_VARIANTS, dump_dir, arch, variants)


# ---------------------------------------------------------------------------------- providers
_dl = dl


def _aligned(t, align: int = 16):
    """``t`` contiguous with its data pointer ``align``-byte aligned (a copy only when it is not)."""
    t = t.contiguous()
    if t.data_ptr() % align:
        t = t.clone()
    return t


def _launch(fn, args, device) -> None:
    launch_on(device, fn, *args)


class _DslGlue(DslProvider):

    def _target(self, target) -> Support:
        no = dsl_target_support(target)
        return no if no is not None else Support.yes("sm_90a")


_MM_OUT_DTYPE: dict = {}


def gate_logits(x, gate_weight):
    """``x_fp32 @ Wg_fp32^T`` (fp32 ``[T, E]``) the fast way for the inputs at hand.

    bf16 (or fp16) ``x`` and gate weight: one tensor-core GEMM with fp32 output
    (``torch.mm(..., out_dtype=torch.float32)``, cuBLAS): the products of 8-bit-mantissa inputs are
    exact in fp32 and the sum is fp32, i.e. the reference's math with another summation order
    (about 1e-7 relative). Otherwise (fp32 weights, or a torch without ``out_dtype``): the
    reference's own fp32 GEMM ``x.float() @ gate_weight.float().t()``."""
    import torch
    if x.dtype == gate_weight.dtype and x.dtype in (torch.bfloat16, torch.float16) \
            and _MM_OUT_DTYPE.get("ok", True):
        try:
            return torch.mm(x, gate_weight.t(), out_dtype=torch.float32)
        except TypeError:        # torch without mm(out_dtype=...): raised before any launch
            _MM_OUT_DTYPE["ok"] = False
    return x.float() @ gate_weight.float().t()


#: when ``moe_route`` folds its gate GEMM into its own launch (:func:`gate_fused`): None = where it is measured
#: not slower on the device than cuBLAS + the top-k kernel (the default, :data:`GATE_MIN_T_FP32`), True = at
#: every supported decode size (eager-heavy callers: one host call, ~18 us instead of ~40; tests), False =
#: never. Set it through :func:`set_gate_fused`, which drops the plans recorded under the other value.
GATE_FUSED = None
#: the default folds the gate GEMM for fp32 gate weights from this many tokens (cuBLAS has no tensor-core
#: path for the exact fp32 GEMM: fused 17.4-18.8 us vs cast + SGEMM + top-k 18.8-22.2 us at T = 8..64, E = 256,
#: D = 4096; at T = 1 cuBLAS is faster, 10.0 vs 17.4 us); bf16 gate weights keep the tensor-core cuBLAS GEMM
#: (9.5-10.9 us vs 16.7-18.3 fused with 64 staged token rows; docs/benchmarks.md, "moe_route with the gate GEMM
#: folded") except at decode sizes up to GATE_MAX_T_BF16 tokens, where the gate kernel stages GATE_SMALL_T token
#: rows (half the shared memory) and the top-k kernel loads the partial logits 8 at a time: at E = 256, D = 4096
#: the fused call 10.5 / 11.0-11.1 us at T = 1 / 16 against the cuBLAS path's 9.6-10.5 / 11.0-11.1 (docs/benchmarks.md)
GATE_MIN_T_FP32 = 8
GATE_MAX_T_BF16 = 16
GATE_SMALL_T = 16


def set_gate_fused(on) -> object:
    """Set :data:`GATE_FUSED` (None / True / False, see there); returns the old value."""
    global GATE_FUSED
    old, GATE_FUSED = GATE_FUSED, (None if on is None else bool(on))
    from dsv4.registry import get_op
    get_op("moe_route").clear_cache()            # the recorded plans replay the path chosen when recorded
    return old


def gate_fused(x, gate_weight) -> bool:
    """Does ``moe_route`` run the gate GEMM inside its launch (``RouteKernel.gate_kernel``)? Supported at
    decode sizes: ``1 <= T <= GATE_MAX_T``, ``0 < D <= GATE_MAX_D``, ``D % 8 == 0``, both operands bf16 /
    fp32, row-major and 16-byte aligned; by default (:data:`GATE_FUSED` None) only where it is measured not
    slower on the device: fp32 gate weights at ``T >= GATE_MIN_T_FP32``, bf16 gate weights at ``T <=
    GATE_MAX_T_BF16`` (docs/benchmarks.md, "moe_route with the gate GEMM folded")."""
    import torch
    T, D = x.shape
    ok = (torch.bfloat16, torch.float32)
    if GATE_FUSED is False:
        return False
    if GATE_FUSED is None and not ((gate_weight.dtype == torch.float32 and T >= GATE_MIN_T_FP32)
                                   or (gate_weight.dtype == torch.bfloat16 and T <= GATE_MAX_T_BF16)):
        return False
    return (0 < T <= GATE_MAX_T and 0 < D <= GATE_MAX_D and D % 8 == 0 and x.dtype in ok
            and gate_weight.dtype in ok and x.is_contiguous() and gate_weight.is_contiguous()
            and x.data_ptr() % 16 == 0 and gate_weight.data_ptr() % 16 == 0)


@dataclass(frozen=True)
class RouteConfig:
    """Launch choices of ``moe_route`` (:func:`route_config`): ``gate_fused``: the gate GEMM runs inside the
    route call (:meth:`RouteKernel.gate_kernel`, :func:`gate_fused`) or on cuBLAS first (:func:`gate_logits`);
    ``n_part``: the partial logits per (token, expert) the top-k kernel adds (``ceil(D / GATE_KC)`` fused, else
    1); ``n_per_lane``: expert scores per lane (``ceil(E / 32)``; 1 for hash layers); ``warps_per_cta``: tokens
    per top-k CTA. ``gate_fused`` / ``n_part`` None: decided per call (token count, hidden size, dtypes: not
    in the problem; ``run`` records the call's config, ``registry.last_choice("moe_route")`` shows it)."""
    gate_fused: bool | None
    n_part: int | None
    n_per_lane: int
    warps_per_cta: int = ROUTE_WARPS
    gate_kc: int = GATE_KC
    gate_max_t: int = GATE_MAX_T

    def __str__(self) -> str:
        return self.explain()

    def explain(self) -> str:
        if self.gate_fused is None:
            gate = (f"gate GEMM per call (fused for fp32 weights at {GATE_MIN_T_FP32} <= T <= {GATE_MAX_T}, bf16 "
                    f"weights at T <= {GATE_MAX_T_BF16}, D <= {GATE_MAX_D}; else cuBLAS)")
        elif self.gate_fused:
            gate = (f"gate GEMM fused ({GATE_EPC} experts x {self.gate_kc} K x {self.gate_max_t} token rows per "
                    f"CTA, {GATE_THREADS} threads, {self.n_part} partial logits)")
        else:
            gate = "gate GEMM on cuBLAS (fp32 logits), then the top-k kernel"
        return f"{gate}; top-k: {self.warps_per_cta} tokens (warps) per CTA, {self.n_per_lane} scores per lane"


#: benchmark hook, empty in production: ``{"gate_kc": kc, "gate_max_t": rows}`` replaces the fused gate's K chunk /
#: staged token rows (a ``gate_max_t`` below the call's T is not applied)
ROUTE_VARIANT: dict = {}


def route_config(E: int, hash_layer: bool, x=None, gate_weight=None) -> RouteConfig:
    """The :class:`RouteConfig` of a ``moe_route`` call (``x`` / ``gate_weight`` given) or of its problem."""
    npl = 1 if hash_layer else _route_npl(E)
    if x is None:
        return RouteConfig(None, None, npl)
    if not gate_fused(x, gate_weight):
        return RouteConfig(False, 1, npl)
    import torch
    T = x.shape[0]
    kc = ROUTE_VARIANT.get("gate_kc", GATE_KC)
    mt = ROUTE_VARIANT.get("gate_max_t", GATE_SMALL_T if gate_weight.dtype == torch.bfloat16 and T <= GATE_SMALL_T
                           else GATE_MAX_T)
    if mt < T:
        mt = GATE_MAX_T
    return RouteConfig(True, -(-x.shape[1] // kc), npl, gate_kc=kc, gate_max_t=mt)


@dataclass(frozen=True)
class PermuteConfig:
    """Launch choices of ``moe_permute`` (:func:`permute_config`): ``threads`` per CTA, ``e_cap`` (the
    shared-memory histograms' expert capacity: E rounded up to a multiple of ``threads``), ``tokens_per_cta``
    (:func:`permute_tokens_per_block`; None: per call, it depends on the token count)."""
    threads: int
    e_cap: int
    tokens_per_cta: int | None

    def __str__(self) -> str:
        return self.explain()

    def explain(self) -> str:
        tpb = "per call (~4 CTAs per SM)" if self.tokens_per_cta is None else str(self.tokens_per_cta)
        return f"{self.threads} threads per CTA, expert capacity {self.e_cap}, tokens per CTA {tpb}"


def permute_config(E: int, k: int, T: int | None = None, sm_count: int = 0) -> PermuteConfig:
    """The :class:`PermuteConfig` of a ``moe_permute`` call (``T`` tokens on ``sm_count`` SMs) or problem."""
    tpb = None if T is None else permute_tokens_per_block(T, k, sm_count)
    return PermuteConfig(PERMUTE_THREADS, _permute_e_cap(E), tpb)


class DslMoERoute(_DslGlue):
    describe = ("CuTe DSL RouteKernel: fp32 gate weights at 8 <= T <= 64, bf16 ones at T <= 16: one call = the gate "
                "GEMM (fp32 FMA register tiles, K split in 256 chunks) + the top-k kernel, else the gate GEMM on cuBLAS "
                "(bf16 inputs -> fp32 out, else fp32) first; one warp per token: sqrt(softplus), bias-selected top-k "
                "arg-max, normalized weights")

    def supports(self, problem, target):
        s = self._target(target)
        if not s:
            return s
        if problem["E"] > ROUTE_MAX_E:
            return Support.no(f"dsl: E={problem['E']} > {ROUTE_MAX_E} (scores in 32 registers per lane)")
        if problem["topk"] > ROUTE_MAX_K:
            return Support.no(f"dsl: topk={problem['topk']} > {ROUTE_MAX_K} (one slot per lane)")
        return Support.yes(f"sm_90a, E <= {ROUTE_MAX_E}, topk <= {ROUTE_MAX_K}")

    def config(self, problem, target=None) -> RouteConfig:
        """The problem's :class:`RouteConfig` (the gate decision is per call: ``run`` records it)."""
        return route_config(problem["E"], problem["hash"])

    def run(self, problem, *, x, gate_weight, bias, input_ids, tid2eid, topk, route_scale):
        import torch

        from dsv4.target import Target
        T, E = x.shape[0], gate_weight.shape[0]
        idx = torch.empty((T, topk), dtype=torch.int32, device=x.device)
        w = torch.empty((T, topk), dtype=torch.float32, device=x.device)
        if T == 0:
            return idx, w
        hash_layer = tid2eid is not None
        cfg = route_config(E, hash_layer, x, gate_weight)
        self.op.record_config(cfg)
        if cfg.gate_fused:                             # one call: gate GEMM partials, then the top-k
            part = torch.empty((cfg.n_part, T, E), dtype=torch.float32, device=x.device)
            gate = (str(x.dtype).replace("torch.", ""), str(gate_weight.dtype).replace("torch.", ""))
        else:
            part = gate_logits(x, gate_weight).contiguous().unsqueeze(0)
            gate = None
        ids_dt = str(input_ids.dtype).replace("torch.", "") if hash_layer else "int32"
        tid_dt = str(tid2eid.dtype).replace("torch.", "") if hash_layer else "int32"
        npl, n_part = cfg.n_per_lane, cfg.n_part
        arch = Target.of(x.device).arch
        kc, mt = (cfg.gate_kc, cfg.gate_max_t) if gate else (GATE_KC, GATE_MAX_T)
        key = ("moe_route", topk, npl, hash_layer, bias is not None, ids_dt, tid_dt, gate, n_part, kc, mt, arch)
        fn = compile_cached(key, lambda: _compile_route(topk, npl, hash_layer, bias is not None, ids_dt, tid_dt, arch,
                                                        gate=gate, n_part=n_part, kc=kc, max_t=mt))
        args = (_dl(x, 16) if gate else None, _dl(gate_weight, 16) if gate else None, _dl(part, 4),
                _dl(bias.contiguous(), 4) if bias is not None else None,
                _dl(input_ids.contiguous(), 4) if hash_layer else None,
                _dl(tid2eid.contiguous(), 4) if hash_layer else None,
                _dl(idx, 4), _dl(w, 4), f32(route_scale))
        _launch(fn, args, x.device)
        return idx, w


class DslMoEPermute(_DslGlue):
    describe = ("CuTe DSL PermuteKernel: one launch = smem counting sort (stable) + FP8 1x128 UE8M0 act_quant "
                "+ gather into the contiguous / masked grouped layout")

    def supports(self, problem, target):
        s = self._target(target)
        if not s:
            return s
        if problem["E"] > PERMUTE_MAX_E:
            return Support.no(f"dsl: E={problem['E']} > {PERMUTE_MAX_E} (shared-memory histograms)")
        if problem["k"] > PERMUTE_CHUNK:
            return Support.no(f"dsl: topk={problem['k']} > {PERMUTE_CHUNK} (one token's assignments per CTA chunk)")
        if problem["D"] % 128:
            return Support.no(f"dsl: D={problem['D']} is not a multiple of 128 (a half warp per 128 columns)")
        return Support.yes(f"sm_90a, E <= {PERMUTE_MAX_E}, D % 128 == 0")

    def config(self, problem, target=None) -> PermuteConfig:
        """The problem's :class:`PermuteConfig` (tokens per CTA are per call: ``run`` records them)."""
        return permute_config(problem["E"], problem["k"])

    def run(self, problem, *, x, topk_idx, topk_w, num_experts, act, layout, max_m):
        import torch

        from dsv4.target import Target
        T, D = x.shape
        k = topk_idx.shape[1]
        n, E = T * k, num_experts
        dev = x.device
        R = n if layout == "contiguous" else E * max_m
        if R * max(1, D) >= 2 ** 62 or R >= 2 ** 31:
            raise ValueError(f"moe_permute: the grouped layout has R={R} rows; at most 2^31 - 1 are supported")
        a = torch.empty((R, D), dtype=torch.float8_e4m3fn if act == "fp8" else torch.bfloat16, device=dev)
        a_s = torch.empty((R, D // 128) if act == "fp8" else (0,), dtype=torch.float32, device=dev)
        rw = torch.empty((R,), dtype=torch.float32, device=dev)
        pos = torch.empty((n,), dtype=torch.int64, device=dev)
        if n == 0:
            rs = torch.zeros(E, dtype=torch.int32, device=dev) if layout == "contiguous" else \
                (torch.arange(E, device=dev, dtype=torch.int32) * max_m)
            return a, a_s, rs, torch.zeros(E, dtype=torch.int32, device=dev), rw, pos
        row_start = torch.empty((E,), dtype=torch.int32, device=dev)
        row_count = torch.empty((E,), dtype=torch.int32, device=dev)
        tgt = Target.of(dev)
        cfg = permute_config(E, k, T, tgt.sm_count)
        self.op.record_config(cfg)
        xs = _aligned(x)
        ids = _aligned(topk_idx)                     # [T, k] as they are (the kernel reads them flat)
        wt = topk_w.to(torch.float32).contiguous()
        x_dt = str(x.dtype).replace("torch.", "")
        idx_dt = str(topk_idx.dtype).replace("torch.", "")
        arch = tgt.arch
        key = ("moe_permute", act, layout, cfg.e_cap, x_dt, idx_dt, arch)
        fn = compile_cached(key, lambda: _compile_permute(act, layout, cfg.e_cap, x_dt, idx_dt, arch))
        a_arg = _dl(a, 16, cutlass.Float8E4M3FN) if act == "fp8" else _dl(a, 16)
        args = (_dl(xs, 16), _dl(ids, 16), _dl(wt, 4), a_arg, _dl(a_s, 4) if act == "fp8" else None,
                _dl(row_start, 4), _dl(row_count, 4), _dl(rw, 4), _dl(pos, 8),
                i32(E), i32(max_m if layout == "masked" else 0), i32(cfg.tokens_per_cta),
                i32(-(-T // cfg.tokens_per_cta)))
        _launch(fn, args, dev)
        return a, a_s, row_start, row_count, rw, pos


class DslMoECombine(_DslGlue):
    describe = "CuTe DSL CombineKernel: gather the k grouped rows of each token (16 B loads), sum in slot order"

    def supports(self, problem, target):
        s = self._target(target)
        if not s:
            return s
        if problem["y_dtype"] != "float32":
            return Support.no(f"dsl: y dtype {problem['y_dtype']} (the kernel reads fp32 GEMM2 rows)")
        if problem["k"] > COMBINE_MAX_K:
            return Support.no(f"dsl: topk={problem['k']} > {COMBINE_MAX_K} (k row loads kept in registers)")
        if problem["D"] % 4:
            return Support.no(f"dsl: D={problem['D']} is not a multiple of 4 (16-byte loads)")
        return Support.yes(f"sm_90a, fp32 rows, topk <= {COMBINE_MAX_K}, D % 4 == 0")

    def run(self, problem, *, y, pos, num_tokens, topk, out_dtype):
        import torch

        from dsv4.target import Target
        D = y.shape[1]
        out = torch.empty((num_tokens, D), dtype=out_dtype, device=y.device)
        if num_tokens == 0 or D == 0:
            return out
        if y.shape[0] == 0:
            return out.zero_()
        o_dt = str(out_dtype).replace("torch.", "")
        arch = Target.of(y.device).arch
        fn = compile_cached(("moe_combine", topk, o_dt, arch), lambda: _compile_combine(topk, o_dt, arch))
        _launch(fn, (_dl(_aligned(y), 16), _dl(pos.contiguous(), 8), _dl(out, 16)), y.device)
        return out


PROVIDERS = {"moe_route": DslMoERoute, "moe_permute": DslMoEPermute, "moe_combine": DslMoECombine}
