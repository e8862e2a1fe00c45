"""CuTe DSL FP8 (E4M3) block quantization along K and its inverse, bit-exact with
:mod:`dsv4.formats.fp8` (DSV4 ``act_quant``); contracts docs/layouts/quantize_fp8_block.md and
dequantize_fp8_block.md.

* :class:`Fp8QuantizeKernel` -- bf16/fp16 ``[M, K]`` -> E4M3 ``[M, K]`` + one scale per
  ``1 x block`` (block 32 / 64 / 128) along K: fp32 ``amax/448``, fp32 ``2^ceil(log2(amax/448))``
  or that power of two's UE8M0 byte. Mapping as ``kernels_dsl/quantize_fp4.py``: warp tiles of
  ``32 * QJ`` 16-byte chunks, lane ``l`` loads chunk ``32 j + l`` (512 contiguous bytes per warp
  load), a block spans ``block / 8`` lanes (``shfl.sync.bfly`` max), E4M3 bytes staged per warp in
  shared memory and written with 16-byte stores (``store_staged``). ``|x|`` max per chunk: packed ``max.NaN.xorsign.abs``
  half pairs (``_quantize_ptx.py`` ``chunk_absmax``). ``q = e4m3(x / s)`` with ``x / s``
  correctly rounded (fp32 scale: Markstein in 3 instructions, ``_quantize_ptx.py`` ``div_rn_by3``;
  power-of-two scale: ``x * (1/s)``, exact reciprocal, the same single rounding), then
  ``cvt.rn.satfinite.e4m3x2.f32`` (clamps to +-448). Register loads (16-byte ``ld.global.nc``; the
  bulk-copy ring of quantize_fp4.py and a register double buffer lost here, 3-7% at 8192^2:
  docs/benchmarks.md).
  Non-finite inputs (``dsv4.formats.fp8``, unchanged by issue 19 item 13): the block amax counts
  finite elements only; Inf -> +-448, NaN -> 0x7F. A warp tile holding an Inf / NaN takes one
  warp-uniform branch (``vote.any``) to the patching code (finite-only amax, byte patch); finite
  tiles never issue it (as predicated code it cost ~50 instructions per chunk).
* :class:`Fp8DequantKernel` -- E4M3 ``[M, K]`` + fp32 / UE8M0 scales -> bf16 / fp16 / fp32:
  ``out = e4m3(q) * s`` in fp32 (``cvt.rn.f16x2.e4m3x2``, exact), one rounding to the output
  dtype. A lane converts units of 16 output bytes (8 values for bf16/fp16 from an 8-byte load, 4
  for fp32 from a 4-byte load): every warp store instruction writes 512 contiguous bytes.

Constraints: contiguous tensors with 16-byte aligned bases (torch allocations), ``K % block == 0``;
bf16 / fp16 input (quantize).
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64, Uint32
    from cutlass.memory import SmemAllocator

    from ._quantize_ptx import (ABS_INF, F32_1EM4, F32_INV448, bits_f32, chunk_absmax, div_rn_by3, e4m3x2,
                               e4m3x2_to_f32x2, f32_bits, f32_to_bf16x2, f32_to_f16x2, finite_chunk_absmax, fmax,
                               fmul, frcp, half_to_f32, l2_evict_first, ld_nc_b32_if, ld_nc_u8_if, ld_nc_v2_if,
                               ld_nc_v4_if_any, lds_b32, lds_u8, shfl_bfly_max, st_b32, st_u8, st_v4_if,
                               store_staged, sts_b32, sts_u8, sts_v2,
                               ue8m0_ceil_byte, vote_any, warp_sync, word_to_f32x2, kernel_prologue, pdl_epilogue,
                               pdl_launch_kw)
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["Fp8Config", "Fp8QuantizeKernel", "Fp8DqConfig", "Fp8DequantKernel", "SCALE_FP32", "SCALE_POW2_F32", "SCALE_UE8M0"]

#: scale outputs of the quantizer: fp32 amax/448 | fp32 power of two | UE8M0 byte
SCALE_FP32, SCALE_POW2_F32, SCALE_UE8M0 = 0, 1, 2


@dataclass(frozen=True)
class Fp8Config:
    """Static specialization of :class:`Fp8QuantizeKernel`."""

    block: int = 128             # 32 | 64 | 128
    scale: int = SCALE_FP32      # SCALE_FP32 | SCALE_POW2_F32 | SCALE_UE8M0
    in_dtype: str = "bfloat16"   # "bfloat16" | "float16"
    qj: int = 8                  # 16-byte loads per lane per warp tile
    warps: int = 8
    min_blocks: int = 0          # launch bound: CTAs per SM the registers must allow (0: compiler's choice)
    l2_hint: bool = True         # 16-byte loads with an L2 evict_first policy (else plain ld.global.nc)
    pdl_early: bool = True       # PDL trigger at the kernel start (decode sizes), else at its end (_quantize_ptx.py)


@dataclass(frozen=True)
class Fp8DqConfig:
    """Static specialization of :class:`Fp8DequantKernel`."""

    block: int = 128
    ue8m0: bool = False          # scale bytes (UE8M0) instead of fp32
    out_dtype: str = "bfloat16"  # "bfloat16" | "float16" | "float32"
    units: int = 8               # 16-byte output units per lane per step
    warps: int = 8
    pdl_early: bool = True       # PDL trigger at the kernel start (decode sizes), else at its end (_quantize_ptx.py)


if _HAVE_DSL:

    def _bounds(cfg) -> dict:
        # (a preferred carveout must accompany min_blocks > 1, else the DSL asks the driver for one)
        return {"min_blocks_per_mp": cfg.min_blocks, "preferred_smem_carveout": 50} if cfg.min_blocks else {}

    def _trips(first, stop, stride):
        """Trip count of ``range(first, stop, stride)`` for a runtime ``stride > 0``."""
        return cutlass.max(stop - first + (stride - 1), stop - stop) // stride

    def _patch_nonfinite(p, w, abs_inf: int):
        """E4M3 bytes of the non-finite halves of chunk ``w``: NaN -> 0x7F, +-Inf -> +-448 (0x7E / 0xFE);
        ``p`` = 2 words of 4 bytes (elements 0..3, 4..7). Straight-line selects."""
        out = [Uint32(p[0]), Uint32(p[1])]
        for e in range(8):
            h = (Uint32(w[e // 2]) >> (16 * (e % 2))) & Uint32(0xFFFF)
            mag = h & Uint32(0x7FFF)
            byte = cutlass.select_(mag > Uint32(abs_inf), Uint32(0x7F), Uint32(0x7E) | ((h >> 8) & Uint32(0x80)))
            sh = 8 * (e % 4)
            patched = (out[e // 4] & Uint32((0xFF << sh) ^ 0xFFFFFFFF)) | (byte << sh)
            out[e // 4] = cutlass.select_(mag >= Uint32(abs_inf), patched, out[e // 4])
        return out

    class Fp8QuantizeKernel:
        """E4M3 block quantizer (module docstring).

        ``__call__(x, q, scale, n_chunks, n_ctas, stream)``: ``Int64`` addresses of ``x``
        (bf16/fp16 ``[M, K]``), ``q`` (E4M3 bytes ``[M, K]``) and ``scale`` (fp32 or UE8M0
        ``[M, K / block]``); ``n_chunks = M K / 8``; ``n_ctas`` the grid (grid-stride loop).
        """

        def __init__(self, cfg: Fp8Config):
            self.cfg = cfg
            self.fp16 = cfg.in_dtype == "float16"
            self.abs_inf = ABS_INF[cfg.in_dtype]
            self.cpb = cfg.block // 8
            self.tile = 32 * cfg.qj
            self.blk_per_tile = self.tile // self.cpb
            self.sbytes = 1 if cfg.scale == SCALE_UE8M0 else 4
            self.warp_bytes = self.tile * 8 + 256

        @cute.jit
        def __call__(self, x: Int64, q: Int64, scale: Int64, n_chunks: Int64, n_ctas: Int32, stream: cuda.CUstream):
            self.kernel(x, q, scale, n_chunks).launch(grid=[n_ctas, 1, 1], block=[32 * self.cfg.warps, 1, 1],
                                                      stream=stream, **_bounds(self.cfg), **pdl_launch_kw())

        @cute.kernel
        def kernel(self, x: Int64, q: Int64, scale: Int64, n_chunks: Int64):
            cfg = self.cfg
            _, lane, warp, bidx, gdim = kernel_prologue(cfg.pdl_early)
            alloc = SmemAllocator()
            stage = alloc.allocate_tensor(Uint32, cute.make_layout(cfg.warps * self.warp_bytes // 4), byte_alignment=16)
            sd = stage.iterator.toint() + warp * self.warp_bytes
            ss = sd + self.tile * 8
            pol = l2_evict_first()
            n_tiles = (n_chunks + (self.tile - 1)) // self.tile
            n_blocks = n_chunks // self.cpb
            t0 = Int64(bidx) * cfg.warps + Int64(warp)
            stride = Int64(gdim) * cfg.warps
            for it in cutlass.range(_trips(t0, n_tiles, stride), unroll=1):
                cb = (t0 + it * stride) * self.tile
                ws = self._load(x, cb, Int32(cutlass.min(n_chunks - cb, Int64(self.tile))), lane, pol)
                # one warp-uniform branch per tile: a finite tile never runs the non-finite patch code
                nf = Uint32(0)
                for j in cutlass.range_constexpr(cfg.qj):
                    nf = nf | Uint32(chunk_absmax(ws[j], self.fp16) >= Uint32(self.abs_inf))
                if vote_any(Int32(nf)) != Uint32(0):     # rare: an Inf / NaN somewhere in this warp tile
                    self._chunks(ws, lane, sd, ss, True)
                else:
                    self._chunks(ws, lane, sd, ss, False)
                warp_sync()
                full = cb + self.tile <= n_chunks
                # ---- E4M3 bytes: two words per chunk, staged -> 16-byte stores (store_staged)
                store_staged(q + cb * 8, sd, lane, self.tile * 8, full, 2 * (n_chunks - cb))
                # ---- scales: whole words for a full tile whose scales fill words, else one store per block
                bb = cb // self.cpb
                nbv = n_blocks - bb
                nwords = self.blk_per_tile * self.sbytes // 4       # staged scale words of a full tile
                if cutlass.const_expr(nwords * 4 == self.blk_per_tile * self.sbytes):
                    if full:
                        for isw in cutlass.range_constexpr((nwords + 31) // 32):
                            if 32 * isw + lane < nwords:
                                st_b32(scale + bb * self.sbytes + Int64(32 * isw + lane) * 4,
                                       lds_b32(ss + (32 * isw + lane) * 4))
                    else:
                        self._scales_per_block(scale, ss, bb, nbv, lane)
                else:
                    self._scales_per_block(scale, ss, bb, nbv, lane)
                warp_sync()
            pdl_epilogue(cfg.pdl_early)

        def _load(self, x, cb, rem, lane, pol):
            """The ``qj`` chunks ``cb + 32 j + lane`` of a warp tile with ``rem`` valid chunks; past them the values
            are undefined (whole blocks are in or out of range, and out-of-range results are never stored)."""
            return [ld_nc_v4_if_any(x + (cb + (32 * j) + Int64(lane)) * 16, pol, Int32((32 * j) + lane < rem),
                                    self.cfg.l2_hint) for j in range(self.cfg.qj)]

        @cute.jit
        def _scales_per_block(self, scale, ss, bb, nbv, lane):
            """Staged scales of a warp tile, one store per block (the first ``nbv`` blocks)."""
            for isb in cutlass.range_constexpr((self.blk_per_tile + 31) // 32):
                if 32 * isb + lane < self.blk_per_tile:
                    if Int64(32 * isb + lane) < nbv:
                        if cutlass.const_expr(self.cfg.scale == SCALE_UE8M0):
                            st_u8(scale + bb + Int64(32 * isb + lane), lds_u8(ss + 32 * isb + lane))
                        else:
                            st_b32(scale + bb * 4 + Int64(32 * isb + lane) * 4, lds_b32(ss + (32 * isb + lane) * 4))

        @cute.jit
        def _chunks(self, ws, lane, sd, ss, slow: cutlass.Constexpr):
            """Quantize the ``qj`` chunks of a warp tile into the staging buffers; ``slow``: every chunk
            through the non-finite path (finite-only amax, byte patch), else none (a finite tile)."""
            cfg = self.cfg
            for j in cutlass.range_constexpr(cfg.qj):
                w = ws[j]
                hb = chunk_absmax(w, self.fp16)
                if cutlass.const_expr(slow):
                    hb = finite_chunk_absmax(w, self.abs_inf)
                for o in cutlass.range_constexpr(self.cpb.bit_length() - 1):
                    hb = shfl_bfly_max(hb, 1 << o)
                # s = max(amax, 1e-4) * fp32(1/448) [ue8m0: 2^ceil(log2(.))]
                s = fmul(fmax(half_to_f32(hb, self.fp16), bits_f32(Uint32(F32_1EM4))), bits_f32(Uint32(F32_INV448)))
                sbyte = Uint32(0)
                if cutlass.const_expr(cfg.scale != SCALE_FP32):
                    sbyte = ue8m0_ceil_byte(s)
                    s = bits_f32(sbyte << 23)
                r = frcp(s)
                qv = []
                for k in cutlass.range_constexpr(4):
                    a, b = word_to_f32x2(w[k], self.fp16)
                    if cutlass.const_expr(cfg.scale == SCALE_FP32):
                        qv.append(e4m3x2(div_rn_by3(a, s, r), div_rn_by3(b, s, r)))
                    else:
                        # s = 2^k: x / s = x * 2^-k exactly rounded once (r = 1/s is exact), one mul.rn
                        qv.append(e4m3x2(fmul(a, r), fmul(b, r)))
                p0 = Uint32(qv[0] | (qv[1] << 16))
                p1 = Uint32(qv[2] | (qv[3] << 16))
                if cutlass.const_expr(slow):
                    pp = _patch_nonfinite((p0, p1), w, self.abs_inf)
                    p0 = Uint32(pp[0])
                    p1 = Uint32(pp[1])
                ci = 32 * j + lane
                sts_v2(sd + ci * 8, p0, p1)
                if lane % self.cpb == 0:
                    if cutlass.const_expr(cfg.scale == SCALE_UE8M0):
                        sts_u8(ss + ci // self.cpb, sbyte)
                    else:
                        sts_b32(ss + (ci // self.cpb) * 4, f32_bits(s))

    def _dq_unit(words, s, f32: bool, bf16: bool):
        """E4M3 bytes of ``words`` times ``s`` (fp32, exact decode, ``mul.rn``) -> 4 output words
        (fp32 values, or bf16 / fp16 pairs rounded once)."""
        vals = []
        for wd in words:
            a, b = e4m3x2_to_f32x2(Uint32(wd) & Uint32(0xFFFF))
            c, d = e4m3x2_to_f32x2(Uint32(wd) >> 16)
            vals += [fmul(a, s), fmul(b, s), fmul(c, s), fmul(d, s)]
        if f32:
            return [f32_bits(v) for v in vals]
        cvt = f32_to_bf16x2 if bf16 else f32_to_f16x2
        return [cvt(vals[2 * i], vals[2 * i + 1]) for i in range(4)]

    class Fp8DequantKernel:
        """E4M3 block dequantizer (module docstring).

        ``__call__(q, scale, out, n_units, n_ctas, stream)``: ``Int64`` addresses; ``n_units = M K / E``
        with ``E`` = 8 (bf16 / fp16 out) or 4 (fp32 out) values per 16-byte output unit.
        """

        def __init__(self, cfg: Fp8DqConfig):
            self.cfg = cfg
            self.f32 = cfg.out_dtype == "float32"
            self.E = 4 if self.f32 else 8

        @cute.jit
        def __call__(self, q: Int64, scale: Int64, out: Int64, n_units: Int64, n_ctas: Int32, stream: cuda.CUstream):
            self.kernel(q, scale, out, n_units).launch(grid=[n_ctas, 1, 1], block=[32 * self.cfg.warps, 1, 1],
                                                       stream=stream, **pdl_launch_kw())

        @cute.kernel
        def kernel(self, q: Int64, scale: Int64, out: Int64, n_units: Int64):
            cfg = self.cfg
            _, lane, warp, bidx, gdim = kernel_prologue(cfg.pdl_early)
            E = self.E
            tile = 32 * cfg.units
            n_tiles = (n_units + (tile - 1)) // tile
            t0 = Int64(bidx) * cfg.warps + Int64(warp)
            stride = Int64(gdim) * cfg.warps
            for it in cutlass.range(_trips(t0, n_tiles, stride), unroll=1):
                ub = (t0 + it * stride) * tile
                raw = []
                sc = []
                for j in cutlass.range_constexpr(cfg.units):
                    u = ub + (32 * j) + Int64(lane)
                    ok = Int32(u < n_units)
                    if cutlass.const_expr(self.f32):
                        raw.append((ld_nc_b32_if(q + u * 4, ok),))
                    else:
                        raw.append(ld_nc_v2_if(q + u * 8, ok))
                    blk = (u * E) // cfg.block
                    if cutlass.const_expr(cfg.ue8m0):
                        sc.append(ld_nc_u8_if(scale + blk, ok))
                    else:
                        sc.append(ld_nc_b32_if(scale + blk * 4, ok))
                for j in cutlass.range_constexpr(cfg.units):
                    u = ub + (32 * j) + Int64(lane)
                    if cutlass.const_expr(cfg.ue8m0):
                        # UE8M0 byte b -> 2^(b-127); b = 0 -> 2^-127 (subnormal), 0xFF -> NaN
                        b = sc[j]
                        bits = cutlass.select_(b == Uint32(0), Uint32(0x00400000), b << 23)
                        s = bits_f32(cutlass.select_(b == Uint32(0xFF), Uint32(0x7FFFFFFF), bits))
                    else:
                        s = bits_f32(sc[j])
                    o = _dq_unit(raw[j], s, self.f32, cfg.out_dtype == "bfloat16")
                    st_v4_if(out + u * 16, o[0], o[1], o[2], o[3], Int32(u < n_units))
            pdl_epilogue(cfg.pdl_early)


# ------------------------------------------------------------------------------ CPU compile checks
#: every variant: 16-byte (4-byte for tiles under 512 bytes) stores, exact E4M3 converts; no flush-to-zero, no float -> int, no local memory
PTX_PATTERNS = (r"st\.global\.(v4\.)?b32", r"cvt\.rn\.(satfinite\.e4m3x2\.f32|f16x2\.e4m3x2)", r"griddepcontrol\.wait")
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")

CHECK_VARIANTS = {
    "quant-bf16-b128-fp32": ("q", dict(block=128, scale=SCALE_FP32, pdl_early=False)),
    "quant-fp16-b32-ue8m0": ("q", dict(block=32, scale=SCALE_UE8M0, in_dtype="float16")),
    "quant-bf16-b64-pow2-qj4": ("q", dict(block=64, scale=SCALE_POW2_F32, qj=4)),
    "quant-bf16-b128-ue8m0-qj1": ("q", dict(block=128, scale=SCALE_UE8M0, qj=1, warps=4)),
    "dequant-b128-fp32-bf16": ("d", dict(block=128, ue8m0=False, out_dtype="bfloat16", pdl_early=False)),
    "dequant-b32-ue8m0-f32": ("d", dict(block=32, ue8m0=True, out_dtype="float32")),
    "dequant-b64-fp32-f16": ("d", dict(block=64, ue8m0=False, out_dtype="float16")),
}


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile every :data:`CHECK_VARIANTS` entry for ``arch`` on the CPU; ``{variant: PTX text}``."""
    from ._compile import compile_variants
    from .quantize import compile_fp8, compile_fp8_dq

    def build(kind, kw):
        if kind == "q":
            return lambda arch, extra: compile_fp8(Fp8Config(**kw), arch, extra)
        return lambda arch, extra: compile_fp8_dq(Fp8DqConfig(**kw), arch, extra)
    return compile_variants("quantize_fp8", {n: build(*v) for n, v in CHECK_VARIANTS.items()}, dump_dir, arch, only)
