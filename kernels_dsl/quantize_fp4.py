"""CuTe DSL FP4 quantizers: bf16/fp16 ``[M, K]`` -> NVFP4 (E2M1 + E4M3 per 16 + FP32 global
scale) and MXFP4 (E2M1 + UE8M0 per 32), bit-exact with :mod:`dsv4.formats` (nvfp4.py, mxfp4.py,
swizzle.py); contracts docs/layouts/quantize_nvfp4.md / quantize_mxfp4.md.

Two kernels:

* :class:`Fp4QuantizeKernel` -- the quantizer (one variant per format, specialized at trace
  time on format, input dtype, scale rule / layout, global-scale source and geometry).
* :class:`AmaxPartialsKernel` -- first launch of the NVFP4 device-amax path for tensors larger
  than one CTA handles: per-CTA max ``|x|`` bits (no atomics, no state; the quantizer reduces
  them in its prologue). Its tail chunks are loaded with L2 ``evict_last`` and the quantizer
  walks the tiles in reverse, so the part of ``x`` still in L2 is consumed first.

Mapping (both): ``x`` is walked as a flat array of 16-byte chunks (8 elements; a scale block
never straddles a row since ``K % 16 == 0``). A warp tile is ``32 * QJ`` chunks; load ``j`` of
lane ``l`` reads chunk ``tile * 32 QJ + 32 j + l`` (every warp load instruction reads 512
contiguous bytes, ``ld.global.nc.v4`` with an L2 ``evict_first`` policy, predicated off past the
end; 32-bit predicates from the tile's valid-chunk count). With ``pipe`` P > 0 the warp's tiles
come instead through a ring of P tiles in shared memory filled by bulk copies (``cp.async.bulk``,
one per tile, lane 0; ``_quantize_ptx.py`` ``ring_*``): P tiles stay in flight while the warp
encodes, whatever its register budget; with ``prefetch`` (register loads) the next tile's loads are
issued before the current tile is encoded (a register double buffer, ``ld_tile_into``). A scale block
spans ``CPB`` consecutive lanes (NVFP4 2, MXFP4 4): its ``|x|`` max is three packed
``max.NaN.xorsign.abs.{bf16x2,f16x2}`` per chunk plus ``shfl.sync.bfly`` maxima (the amax-partials
kernel: integer ``max.u16x2`` on the magnitude bits). NVFP4 with ``lut`` copies takes the per-block encode scale ``min(1 / (s g_dec), FLT_MAX)``
from a shared table indexed by the E4M3 scale byte (one copy per bank: conflict-free), else
computes it. Codes and scales are staged per warp in shared memory and written with 16-byte
stores (``store_staged``; 4-byte stores for tiles under 512 bytes) / 4-byte scale stores; the
swizzled scale offsets divide by ``K / 16`` with a magic multiply. Grid-stride loop over warp
tiles (the host sizes the grid; ``n_ctas`` warp-tiles per step).

Rounding (no float -> int convert anywhere): E2M1 by the project's magic-add encoder
``kernels_dsl/sm90/fp4.py:e2m1x8_encode`` (6 instructions per element: one binade-dependent magic whose
mantissa offset makes the low byte of the sum the level index); E4M3 scale by ``cvt.rn.satfinite.e4m3x2.f32``; UE8M0
by exponent-field arithmetic; every fp32 step is an explicit ``.rn`` PTX instruction in the
reference's association order (``kernels_dsl/_quantize_ptx.py``).

Non-finite inputs (OCP MX v1.0, issue 19 item 13): a block whose ``|x|`` max is Inf or NaN gets
the NaN scale (UE8M0 0xFF / E4M3 0x7F) and zero codes; a non-finite NVFP4 device amax gives
``g_dec = g_enc = NaN`` and every block the NaN scale.

Constraints: bf16 / fp16 input, contiguous; ``K % 16 == 0`` (NVFP4) / ``K % 32 == 0`` (MXFP4);
every base pointer 16-byte aligned (torch allocations); ``M * K / 16 < 2^31`` and the swizzled
scale tensor under 2^31 bytes (32-bit scale offsets).
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass.memory import SmemAllocator

    from ._quantize_ptx import (ABS_INF, F32_FLT_MAX, F32_INV6, F32_MX_FLOOR, F32_QNAN, bar_sync, bits_f32, f32_bits,
                                chunk_absmax, clz, e4m3_to_f32, e4m3x2, exp2_int, fdiv, floor_log2, fmax, fmin, fmul,
                                frcp, grid_arrive_wait, half_to_f32, l2_evict_first, l2_evict_last, ld_nc_b32,
                                ld_nc_f32, ld_nc_v4_if, ld_nc_v4_if_any, ld_relaxed_b32, lds_b32,
                                lds_u8, redux_max, shfl_bfly_max, st_b32, st_f32, st_u8, store_staged,
                                sts_b32, sts_b32_if, sts_u8, ue8m0_ceil_byte, umax, warp_sync, word_to_f32x2,
                                ring_alloc, ring_init, ring_issue, ring_read, ld_tile_into,
                                kernel_prologue, pdl_epilogue, pdl_launch_kw)
    from ._quantize_ptx import e2m1x8_encode_rn as e2m1x8_encode
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["Fp4Config", "Fp4QuantizeKernel", "AmaxPartialsKernel", "GS_PARTIALS", "GS_GIVEN", "GS_FUSED", "GS_GRID"]

#: NVFP4 global-scale sources
GS_PARTIALS, GS_GIVEN, GS_FUSED, GS_GRID = 0, 1, 2, 3


@dataclass(frozen=True)
class Fp4Config:
    """Static specialization of :class:`Fp4QuantizeKernel` (the compile key)."""

    fmt: str                 # "nvfp4" | "mxfp4"
    in_dtype: str = "bfloat16"   # "bfloat16" | "float16"
    rule: str = "dsv4"       # MXFP4 scale rule: "dsv4" (ceil) | "ocp" (floor)
    swizzled: bool = False   # NVFP4 scale layout: 128x4 swizzled (else linear [M, K/16])
    gs: int = GS_GIVEN       # NVFP4 global scale: GS_PARTIALS | GS_GIVEN | GS_FUSED (one CTA) | GS_GRID
    qj: int = 8              # 16-byte loads per lane per warp tile
    warps: int = 8           # warps per CTA
    min_blocks: int = 0      # launch bound: CTAs per SM the registers must allow (0: compiler's choice)
    l2_hint: bool = True     # 16-byte loads with an L2 evict_first policy (else plain ld.global.nc)
    lut: int = 32            # NVFP4: per-block encode scale from a shared table indexed by the E4M3 byte, with
                             # `lut` copies (32: lane l reads copy l, conflict-free; 0: computed per block)
    pipe: int = 0            # 0: register loads; 1/2/4: per-warp bulk-copy (TMA) ring of that many warp tiles in smem
    prefetch: bool = False   # register loads: the next tile's loads are issued before this tile is encoded
    pdl_early: bool = True   # PDL trigger at the kernel start (decode sizes), else at its end (_quantize_ptx.py)

    @property
    def cpb(self) -> int:    # chunks (lanes) per scale block
        return 2 if self.fmt == "nvfp4" else 4

    @property
    def tile(self) -> int:   # chunks per warp tile
        return 32 * self.qj


if _HAVE_DSL:

    def _bounds(cfg) -> dict:
        # (a preferred carveout must accompany min_blocks > 1, else the DSL asks the driver for one)
        return {"min_blocks_per_mp": cfg.min_blocks, "preferred_smem_carveout": 50} if cfg.min_blocks else {}

    def _trips(first, stop, stride):
        """Trip count of ``range(first, stop, stride)`` for a runtime ``stride > 0`` (the DSL's
        ``cutlass.range`` cannot take a runtime step)."""
        return cutlass.max(stop - first + (stride - 1), stop - stop) // stride

    def _load_tile(x, cb, lane, pol, n_chunks, qj: int):
        """The ``qj`` 16-byte chunks ``cb + 32 j + lane`` of a warp tile (L2 policy ``pol``), zeros past
        ``n_chunks``."""
        return [ld_nc_v4_if(x + (cb + (32 * j) + Int64(lane)) * 16, pol, Int32(cb + (32 * j) + Int64(lane) < n_chunks))
                for j in range(qj)]

    def _load_tile32(x, cb, lane, pol, rem, qj: int, hint: bool = True):
        """The ``qj`` 16-byte chunks ``cb + 32 j + lane`` of a warp tile with ``rem`` valid chunks
        (Int32, 32-bit predicate); the others undefined (values that are never stored)."""
        return [ld_nc_v4_if_any(x + (cb + (32 * j) + Int64(lane)) * 16, pol, Int32((32 * j) + lane < rem), hint)
                for j in range(qj)]

    def _block_max(v, red_addr, warp, lane, nw: int):
        """CTA-wide unsigned max (every thread calls; the result is in every thread). Straight-line
        code (a predicated shared store), so it can be called from kernel bodies."""
        v = redux_max(v)
        sts_b32_if(red_addr + warp * 4, v, Int32(lane == 0))
        bar_sync()
        r = lds_b32(red_addr)
        for i in range(1, nw):
            r = umax(r, lds_b32(red_addr + i * 4))
        bar_sync()
        return r

    class AmaxPartialsKernel:
        """Per-CTA ``max |x|`` as magnitude bits (Uint32; NaN > Inf > finite) over a grid-stride walk
        of the warp tiles of :class:`Fp4QuantizeKernel` (same tile geometry).

        ``__call__(x, partials, n_chunks, keep_from, n_ctas, stream)``: ``x`` / ``partials`` are
        64-bit addresses (``Int64``); ``partials`` holds ``n_ctas`` Uint32; chunks ``>= keep_from``
        are loaded with L2 ``evict_last`` (kept for the quantizer)."""

        def __init__(self, qj: int = 8, warps: int = 8):
            self.qj, self.warps = qj, warps

        @cute.jit
        def __call__(self, x: Int64, partials: Int64, n_chunks: Int64, keep_from: Int64, n_ctas: Int32,
                     stream: cuda.CUstream):
            self.kernel(x, partials, n_chunks, keep_from).launch(
                grid=[n_ctas, 1, 1], block=[32 * self.warps, 1, 1], stream=stream, **pdl_launch_kw())

        @cute.kernel
        def kernel(self, x: Int64, partials: Int64, n_chunks: Int64, keep_from: Int64):
            tidx, lane, warp, bidx, gdim = kernel_prologue(False)  # (the two-launch path: large tensors only)
            red = SmemAllocator().allocate_tensor(Uint32, cute.make_layout(self.warps), byte_alignment=16)
            red_addr = red.iterator.toint()
            tile = 32 * self.qj
            n_tiles = (n_chunks + (tile - 1)) // tile
            p_first = l2_evict_first()
            p_last = l2_evict_last()
            acc = Uint32(0)
            t0 = Int64(bidx) * self.warps + Int64(warp)
            stride = Int64(gdim) * self.warps
            for it in cutlass.range(_trips(t0, n_tiles, stride), unroll=1):
                cb = (t0 + it * stride) * tile
                ws = []
                for j in cutlass.range_constexpr(self.qj):
                    c = cb + (32 * j) + Int64(lane)
                    pol = cutlass.select_(c >= keep_from, p_last, p_first)
                    ws.append(ld_nc_v4_if(x + c * 16, pol, Int32(c < n_chunks)))
                for j in cutlass.range_constexpr(self.qj):
                    acc = umax(acc, chunk_absmax(ws[j]))
            m = _block_max(acc, red_addr, warp, lane, self.warps)
            if tidx == 0:
                st_b32(partials + Int64(bidx) * 4, m)
            pdl_epilogue(False)

    class Fp4QuantizeKernel:
        """NVFP4 / MXFP4 quantizer (module docstring: mapping, rounding, NaN rule).

        ``__call__(x, data, scale, gs_out, gs_src, n_src, n_chunks, M, Ksf, Kt, Mpad, reverse,
        n_ctas, stream)`` -- all pointers are ``Int64`` addresses:

        * ``x``: ``[M, K]`` bf16 / fp16; ``data``: uint8 ``[M, K/2]`` (element 2i in the low nibble);
        * ``scale``: NVFP4 E4M3 bytes, linear ``[M, K/16]`` or 128x4 swizzled
          ``[cdiv(M,128), Kt, 32, 4, 4]`` (``Ksf = K/16``, ``Kt = cdiv(Ksf, 4)``, ``Mpad = 128 cdiv(M,128)``;
          padding written as 0); MXFP4 UE8M0 bytes ``[M, K/32]``;
        * ``gs_out`` (NVFP4): fp32 ``[2]`` = (g_dec, g_enc); ``gs_src``: GS_GIVEN fp32 ``[1]``
          decode scale, GS_PARTIALS ``n_src`` Uint32 amax partials, GS_FUSED unused (this single
          CTA reads ``x`` twice: amax, then quantize);
        * ``n_chunks = M K / 8``; ``reverse``: walk the tiles last-first; ``n_ctas``: grid size.
        """

        def __init__(self, cfg: Fp4Config):
            self.cfg = cfg
            self.fp16 = cfg.in_dtype == "float16"
            self.abs_inf = ABS_INF[cfg.in_dtype]
            self.nv = cfg.fmt == "nvfp4"
            self.tile = cfg.tile
            self.cpb = cfg.cpb
            self.blk_per_tile = self.tile // self.cpb
            self.warp_bytes = self.tile * 4 + 256   # staged code words + staged scale bytes

        @cute.jit
        def __call__(self, x: Int64, data: Int64, scale: Int64, gs_out: Int64, gs_src: Int64, n_src: Int32,
                     n_chunks: Int64, M: Int32, Ksf: Int32, Kt: Int32, Mpad: Int32, reverse: Int32, wsp: Int64,
                     n_ctas: Int32, stream: cuda.CUstream):
            self.kernel(x, data, scale, gs_out, gs_src, n_src, n_chunks, M, Ksf, Kt, Mpad, reverse, wsp).launch(
                grid=[n_ctas, 1, 1], block=[32 * self.cfg.warps, 1, 1], stream=stream,
                **_bounds(self.cfg), **pdl_launch_kw())

        @cute.kernel
        def kernel(self, x: Int64, data: Int64, scale: Int64, gs_out: Int64, gs_src: Int64, n_src: Int32,
                   n_chunks: Int64, M: Int32, Ksf: Int32, Kt: Int32, Mpad: Int32, reverse: Int32, wsp: Int64):
            cfg = self.cfg
            tidx, lane, warp, bidx, gdim = kernel_prologue(cfg.pdl_early)
            alloc = SmemAllocator()
            stage = alloc.allocate_tensor(Uint32, cute.make_layout(cfg.warps * self.warp_bytes // 4), byte_alignment=16)
            red = alloc.allocate_tensor(Uint32, cute.make_layout(cfg.warps), byte_alignment=16)
            red_addr = red.iterator.toint()
            lut = alloc.allocate_tensor(Uint32, cute.make_layout(128 * max(cfg.lut, 1)), byte_alignment=16)
            lut_addr = lut.iterator.toint()
            sd = stage.iterator.toint() + warp * self.warp_bytes     # this warp's staged code words
            ss = sd + self.tile * 4                                  # this warp's staged scale bytes
            pol = l2_evict_first()
            n_tiles = (n_chunks + (self.tile - 1)) // self.tile
            t0 = Int64(bidx) * cfg.warps + Int64(warp)
            stride = Int64(gdim) * cfg.warps
            trips = _trips(t0, n_tiles, stride)
            pos = (t0, stride, n_tiles, n_chunks, reverse)     # tile positions (:meth:`_pos`)
            P = cfg.pipe if cfg.gs not in (GS_GRID, GS_FUSED) else 0
            rbuf = Int32(0)
            rbar = Int32(0)
            if cutlass.const_expr(P > 0):
                # bulk-copy ring of P warp tiles per warp (ring_alloc ...): P tiles in flight during the encode
                rbuf, rbar = ring_alloc(alloc, cfg.warps, warp, P, self.tile * 16)
                if lane == 0:
                    ring_init(rbar, P)
                warp_sync()
                for s_ in cutlass.range_constexpr(P):
                    if (lane == 0) & (Int64(s_) < trips):
                        self._issue(rbuf, rbar, x, s_, Int64(s_), pos, pol)

            if cutlass.const_expr(self.nv and cfg.swizzled):
                # zero padding of the 128x4 layout: rows M..Mpad-1 (whole 4-byte groups) and columns Ksf..4Kt-1
                # (first: independent of the data, it overlaps the grid-wide amax wait of GS_GRID)
                gt = Int32(bidx) * (32 * cfg.warps) + tidx
                GT = Int32(gdim) * (32 * cfg.warps)
                # rows M..Mpad-1 live in the last 128-row block: walk its Kt x 128 words in memory order (word j of a
                # 512 B cell group = row 32 (j & 3) + (j >> 2) of the block), so a warp's stores are 128 contiguous
                # bytes (as scattered 4-byte stores the padding cost 0.55 us at [16, 7168]: docs/benchmarks.md)
                b_last = (Mpad >> 7) - 1
                p1 = cutlass.select_(Mpad > M, Kt * 128, Int32(0))
                for k1 in cutlass.range(_trips(gt, p1, GT), unroll=1):
                    i1 = gt + k1 * GT
                    jw = i1 & 127
                    if b_last * 128 + 32 * (jw & 3) + (jw >> 2) >= M:
                        st_b32(scale + Int64((b_last * Kt + (i1 >> 7)) * 512 + jw * 4), Uint32(0))
                padc = 4 * Kt - Ksf
                p2 = M * padc
                for k2 in cutlass.range(_trips(gt, p2, GT), unroll=1):
                    i2 = gt + k2 * GT
                    st_u8(scale + self._swz(i2 // padc, Ksf + (i2 - (i2 // padc) * padc), Kt), Uint32(0))

            g_dec = Float32(1.0)
            mult = Float32(1.0)
            gnan = Uint32(0)
            if cutlass.const_expr(self.nv):
                # ---- global scale (dsv4.formats.nvfp4: g_enc = min(2688 / amax, FLT_MAX), 1 if amax == 0,
                #      NaN if amax is not finite; g_dec = 1 / g_enc)
                g_enc = Float32(1.0)
                if cutlass.const_expr(cfg.gs == GS_GIVEN):
                    g_dec = ld_nc_f32(gs_src)
                    g_enc = frcp(g_dec)
                else:
                    mb = Uint32(0)
                    if cutlass.const_expr(cfg.gs == GS_PARTIALS):
                        for ip_ in cutlass.range(tidx, n_src, 32 * cfg.warps, unroll=1):
                            mb = umax(mb, ld_nc_b32(gs_src + Int64(ip_) * 4))
                    elif cutlass.const_expr(cfg.gs == GS_GRID):
                        # one tile per warp, kept in registers across a grid-wide barrier (all CTAs
                        # co-resident: the host launches at most one CTA per SM): CTA amax -> gs_src[bidx],
                        # arrive on the counter at wsp[0] / wait for the generation wsp[1] to move, then
                        # reduce the n_src = gridDim partials (written during this launch: ld.relaxed.gpu)
                        cbg = (Int64(bidx) * cfg.warps + Int64(warp)) * self.tile
                        ws_pre = _load_tile(x, cbg, lane, pol, n_chunks, cfg.qj)
                        for j in cutlass.range_constexpr(cfg.qj):
                            mb = umax(mb, chunk_absmax(ws_pre[j]))
                        mb = _block_max(mb, red_addr, warp, lane, cfg.warps)
                        grid_arrive_wait(gs_src + Int64(bidx) * 4, mb, wsp, Uint32(n_src - 1), Int32(tidx == 0))
                        bar_sync()
                        mb = Uint32(0)
                        for ig in cutlass.range(tidx, n_src, 32 * cfg.warps, unroll=1):
                            mb = umax(mb, ld_relaxed_b32(gs_src + Int64(ig) * 4))
                    else:   # GS_FUSED: this (single) CTA reads the whole tensor once for the amax
                        pol_keep = l2_evict_last()
                        n_tiles0 = (n_chunks + (self.tile - 1)) // self.tile
                        for t in cutlass.range(Int64(warp), n_tiles0, cfg.warps, unroll=1):
                            cb = t * self.tile
                            ws = []
                            for j in cutlass.range_constexpr(cfg.qj):
                                c = cb + (32 * j) + Int64(lane)
                                ws.append(ld_nc_v4_if(x + c * 16, pol_keep, Int32(c < n_chunks)))
                            for j in cutlass.range_constexpr(cfg.qj):
                                mb = umax(mb, chunk_absmax(ws[j]))
                    mb = _block_max(mb, red_addr, warp, lane, cfg.warps)
                    amax = half_to_f32(mb, self.fp16)
                    g_enc = fmin(fdiv(Float32(2688.0), amax), bits_f32(Uint32(F32_FLT_MAX)))
                    g_enc = cutlass.select_(mb == Uint32(0), Float32(1.0), g_enc)
                    g_enc = cutlass.select_(mb >= Uint32(self.abs_inf), bits_f32(Uint32(F32_QNAN)), g_enc)
                    g_dec = frcp(g_enc)
                mult = fmul(g_enc, bits_f32(Uint32(F32_INV6)))
                gnan = Uint32(g_enc != g_enc)
                if cutlass.const_expr(cfg.lut > 0):
                    # enc of every E4M3 scale byte 0..127 (the block scale is >= 0): min(1 / (s g_dec), FLT_MAX);
                    # byte 0 (s = 0) -> 0, so that x * enc = +-0 gives the sign-only code of the reference.
                    # Entry i = byte * lut + copy.
                    for i in cutlass.range(tidx, 128 * cfg.lut, 32 * cfg.warps, unroll=1):
                        bq = Uint32(i // cfg.lut)
                        el = fmin(frcp(fmul(e4m3_to_f32(bq), g_dec)), bits_f32(Uint32(F32_FLT_MAX)))
                        sts_b32(lut_addr + i * 4, f32_bits(cutlass.select_(bq == Uint32(0), Float32(0.0), el)))
                    bar_sync()
                if bidx == 0:
                    if tidx == 0:
                        st_f32(gs_out, g_dec)
                        st_f32(gs_out + 4, g_enc)

            n_blocks = n_chunks // self.cpb
            kdiv_m = Int64(0)
            kdiv_s = Int64(0)
            if cutlass.const_expr(self.nv and cfg.swizzled):
                # n // Ksf = (n * kdiv_m) >> kdiv_s for 0 <= n < 2^31 (Granlund-Montgomery, N = 31:
                # l = ceil(log2 Ksf), kdiv_m = ceil(2^(31+l) / Ksf) < 2^32)
                lg = Int64(Int32(32) - Int32(clz(Uint32(Ksf - 1))))
                kdiv_s = lg + 31
                kdiv_m = ((Int64(1) << kdiv_s) + Int64(Ksf - 1)) // Int64(Ksf)
            PF = cfg.prefetch and P == 0 and cfg.gs not in (GS_GRID, GS_FUSED)
            rnext = cute.make_rmem_tensor((4 * cfg.qj,), Uint32)
            if cutlass.const_expr(PF):
                # register double buffer: tile it+1 is loaded while tile it is encoded
                self._prefetch(rnext, x, Int64(0), trips, pos, lane, pol)
            for it in cutlass.range(trips, unroll=1):
                cb, rem = self._pos(it, pos)                              # first chunk, valid chunks of this tile
                if cutlass.const_expr(cfg.gs == GS_GRID):
                    ws = ws_pre      # (loaded before the grid barrier; the grid covers every tile once)
                elif cutlass.const_expr(P > 0):
                    slot, ws = ring_read(rbuf, rbar, P, self.tile * 16, it, lane, cfg.qj)
                    warp_sync()
                    if (lane == 0) & (it + P < trips):
                        self._issue(rbuf, rbar, x, slot, it + P, pos, pol)
                elif cutlass.const_expr(PF):
                    ws = [tuple(rnext[4 * j + k] for k in range(4)) for j in range(cfg.qj)]
                    self._prefetch(rnext, x, it + 1, trips, pos, lane, pol)
                else:
                    ws = _load_tile32(x, cb, lane, pol, rem, cfg.qj, cfg.l2_hint)
                for j in cutlass.range_constexpr(cfg.qj):
                    w = ws[j]
                    hb = chunk_absmax(w, self.fp16)
                    for o in cutlass.range_constexpr(self.cpb.bit_length() - 1):
                        hb = shfl_bfly_max(hb, 1 << o)
                    bad = (Uint32(hb >= Uint32(self.abs_inf)) | gnan) != Uint32(0)
                    vmax = half_to_f32(hb, self.fp16)
                    f = []
                    for k in cutlass.range_constexpr(4):
                        a, b = word_to_f32x2(w[k], self.fp16)
                        f += [a, b]
                    if cutlass.const_expr(self.nv):
                        # TE reference order: s = e4m3(min(vmax * (g_enc/6), 448)); enc = min(1/(s g_dec), FLT_MAX)
                        sf = fmin(fmul(vmax, mult), Float32(448.0))
                        sbyte = e4m3x2(sf, Float32(0.0))                      # (byte 1 = e4m3(0) = 0)
                        if cutlass.const_expr(cfg.lut > 0):
                            li = sbyte * cfg.lut + (lane % cfg.lut)
                            code = e2m1x8_encode(f, bits_f32(lds_b32(lut_addr + li * 4)), w)
                        else:
                            s = e4m3_to_f32(sbyte)
                            enc = fmin(frcp(fmul(s, g_dec)), bits_f32(Uint32(F32_FLT_MAX)))
                            code = e2m1x8_encode(f, enc, w)
                            code = cutlass.select_(s == Float32(0.0), code & Uint32(0x88888888), code)
                        nan_byte = 0x7F
                    else:
                        if cutlass.const_expr(cfg.rule == "dsv4"):
                            tt = fmul(fmax(vmax, bits_f32(Uint32(F32_MX_FLOOR))), bits_f32(Uint32(F32_INV6)))
                            sbyte = ue8m0_ceil_byte(tt)                           # 1..253 for finite blocks
                            inv = bits_f32((Uint32(254) - sbyte) << 23)           # 2^(127 - sbyte), exact
                        else:
                            e = cutlass.select_(hb == Uint32(0), Int32(-127), floor_log2(vmax) - 2)
                            e = cutlass.max(cutlass.min(e, Int32(127)), Int32(-127))
                            sbyte = Uint32(e + 127)
                            inv = exp2_int(-e)
                        code = e2m1x8_encode(f, inv, w)
                        nan_byte = 0xFF
                    code = cutlass.select_(bad, Uint32(0), code)
                    sbyte = cutlass.select_(bad, Uint32(nan_byte), sbyte)
                    ci = 32 * j + lane
                    sts_b32(sd + ci * 4, code)
                    if lane % self.cpb == 0:
                        sts_u8(ss + ci // self.cpb, sbyte)
                warp_sync()
                full = rem == self.tile
                # ---- codes: one word per chunk, staged -> 16-byte stores (store_staged)
                store_staged(data + cb * 4, sd, lane, self.tile * 4, full, Int64(rem))
                # ---- scales
                bb = cb // self.cpb
                nbv = n_blocks - bb
                if cutlass.const_expr(self.nv and cfg.swizzled):
                    if 4 * lane < self.blk_per_tile:
                        g0 = Int32(bb) + 4 * lane
                        if Ksf % 4 == 0:            # a group of 4 never straddles rows: one 4-byte store
                            if Int64(4 * lane) < nbv:
                                r0 = Int32((Int64(g0) * kdiv_m) >> kdiv_s)     # g0 // Ksf (magic multiply)
                                st_b32(scale + self._swz32(r0, g0 - r0 * Ksf, Kt), lds_b32(ss + 4 * lane))
                        else:
                            for bq in cutlass.range_constexpr(4):
                                if Int64(4 * lane + bq) < nbv:
                                    st_u8(scale + self._swz((g0 + bq) // Ksf, (g0 + bq) - ((g0 + bq) // Ksf) * Ksf, Kt),
                                          lds_u8(ss + 4 * lane + bq))
                else:
                    if full:
                        if 4 * lane < self.blk_per_tile:
                            st_b32(scale + bb + Int64(4 * lane), lds_b32(ss + 4 * lane))
                    else:
                        for isb in cutlass.range_constexpr((self.blk_per_tile + 31) // 32):
                            if 32 * isb + lane < self.blk_per_tile:
                                if Int64(32 * isb + lane) < nbv:
                                    st_u8(scale + bb + Int64(32 * isb + lane), lds_u8(ss + 32 * isb + lane))
                warp_sync()
            pdl_epilogue(cfg.pdl_early)


        def _pos(self, i, pos):
            """(first chunk, valid chunks) of this warp's tile at step ``i``: grid-stride warp tiles (``reverse``:
            last tile first)."""
            t0, stride, n_tiles, n_chunks, reverse = pos
            t = t0 + i * stride
            cb = cutlass.select_(reverse != 0, n_tiles - 1 - t, t) * self.tile
            return cb, Int32(cutlass.min(n_chunks - cb, Int64(self.tile)))

        def _prefetch(self, buf, x, i, trips, pos, lane, pol):
            """Load this warp's tile at step ``i`` (nothing past ``trips``) into ``buf``."""
            cb, rem = self._pos(i, pos)
            ld_tile_into(buf, x, cb, lane, pol, cutlass.select_(i < trips, rem, Int32(0)), self.cfg.qj,
                         self.cfg.l2_hint)

        def _issue(self, rbuf, rbar, x, slot, i, pos, pol):
            """Bulk-copy this warp's tile at step ``i`` into ring slot ``slot`` (a tile with no valid chunk copies
            16 bytes of ``x`` instead: never used)."""
            cb, rem = self._pos(i, pos)
            ok = rem > 0
            ring_issue(rbuf, rbar, self.tile * 16, slot, x + cutlass.select_(ok, cb, Int64(0)) * 16,
                       cutlass.max(rem, Int32(1)) * 16, pol)

        @staticmethod
        def _swz32(m, k, Kt):
            """:meth:`_swz` in 32-bit arithmetic (every offset < 2^31: ``M K / 16 < 2^31``), widened."""
            m = Int32(m)
            k = Int32(k)
            return Int64(((m >> 7) * Kt + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3))

        @staticmethod
        def _swz(m, k, Kt):
            """Byte offset (Int64) of linear scale (m, k) in the 128x4 layout (dsv4.formats.swizzled_sf_offset)."""
            m = Int64(m)
            k = Int64(k)
            return ((m >> 7) * Int64(Kt) + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3)


# ------------------------------------------------------------------------------ CPU compile checks
#: What every compiled variant's PTX must contain (tests/test_compile_dsl.py): 16-byte read-only loads
#: with an L2 policy (or, with a ring, bulk copies), 16-byte or 4-byte stores, packed |x| max (half pairs: the
#: quantizers; integer: the amax-partials kernel).
PTX_PATTERNS = (r"ld\.global\.nc\.L1::no_allocate\.L2::cache_hint\.v4\.u32|cp\.async\.bulk\.shared::cluster\.global",
                r"st\.global\.(v4\.)?b32", r"max\.(u16x2|NaN\.xorsign\.abs\.b?f16x2)", r"griddepcontrol\.wait")
#: What none may contain: flush-to-zero (subnormal scales / values), float -> int conversions (the
#: roundings are magic adds), local memory.
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")

#: the specializations the CPU compile check builds (every feature once)
CHECK_VARIANTS = {
    "nvfp4-bf16-swz-partials": dict(fmt="nvfp4", swizzled=True, gs=GS_PARTIALS),
    "nvfp4-fp16-lin-given": dict(fmt="nvfp4", in_dtype="float16", gs=GS_GIVEN),
    "nvfp4-bf16-lin-fused": dict(fmt="nvfp4", gs=GS_FUSED, warps=16),
    "nvfp4-bf16-swz-grid": dict(fmt="nvfp4", swizzled=True, gs=GS_GRID, warps=4),
    "mxfp4-bf16-dsv4": dict(fmt="mxfp4"),
    "mxfp4-fp16-ocp-qj4": dict(fmt="mxfp4", in_dtype="float16", rule="ocp", qj=4),
    "nvfp4-bf16-swz-given-qj1": dict(fmt="nvfp4", swizzled=True, gs=GS_GIVEN, qj=1, warps=4, lut=0),
    "nvfp4-bf16-lin-given-ring-lut": dict(fmt="nvfp4", gs=GS_GIVEN, qj=8, warps=4, pipe=2, lut=32),
    "nvfp4-bf16-swz-given-ring-late": dict(fmt="nvfp4", swizzled=True, gs=GS_GIVEN, qj=8, warps=4, pipe=2,
                                           pdl_early=False),
    "nvfp4-fp16-swz-partials-pf-late": dict(fmt="nvfp4", in_dtype="float16", swizzled=True, gs=GS_PARTIALS, qj=4,
                                            warps=8, min_blocks=3, prefetch=True, pdl_early=False),
}


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile every :data:`CHECK_VARIANTS` entry (plus the amax-partials kernel) for ``arch`` on the
    CPU; ``{variant: PTX text}``."""
    from ._compile import compile_variants
    from .quantize import compile_amax, compile_fp4
    builds = {n: (lambda arch, extra, kw=kw: compile_fp4(Fp4Config(**kw), arch, extra)) for n, kw in CHECK_VARIANTS.items()}
    builds["amax-partials"] = lambda arch, extra: compile_amax(8, 8, arch, extra)
    out = compile_variants("quantize_fp4", builds, dump_dir, arch, only)
    return out
