"""CuTe DSL providers of ``indexer_cache_write`` and ``indexer_q_quant`` (registered by
``kernels_dsl/indexer.py``): optional Sylvester-Hadamard rotation, then MXFP4 / NVFP4 / FP8
quantization of 128-dim rows, bit-exact with ``dsv4/reference/indexer.py`` (rotation
:func:`dsv4.reference.hadamard.rotate_activation_ref`, formats :mod:`dsv4.formats` incl. the OCP
MX non-finite block rule); contracts docs/layouts/indexer_cache_write.md / indexer_q_quant.md.

:class:`IndexerQuantKernel` -- ``lanes`` (4 / 8 / 16) lanes per row, ``32 / lanes`` rows per warp step,
``groups`` steps per warp iteration (every row load of an iteration in flight before the first rotation):

* lane ``q = lane % lanes`` of a row holds its ``nc = 16 / lanes`` contiguous 8-element chunks (elements
  ``8 (nc q + c) .. + 7``, 16-byte loads; L1-allocating when a lane reads more than one chunk, so the
  chunks of a 32-byte sector are fetched once);
* Hadamard (``hadamard``): the fp32 contract of ``dsv4.reference.hadamard`` (the official kernel's
  arithmetic): butterflies in its stage order (index bit 0 first): the index bits below ``log2(8 nc)``
  in-thread (``add.rn`` / ``sub.rn``), the rest by ``shfl.bfly`` over the row's lanes (one
  ``fma.rn.f32(d, +-1, p)`` per value); then one ``mul.rn.f32`` by fp32(128^-0.5) and one
  ``cvt.rn.bf16x2.f32``: bit-exact with the reference;
* quantization with the roundings of ``kernels_dsl/quantize_fp4.py`` / ``quantize_fp8.py``: MXFP4 (DSV4
  ceil rule) blocks of 32 elements, NVFP4 (caller's global decode scale, TE order) blocks of 16, FP8 one
  power-of-two UE8M0 scale per row (finite amax; Inf -> +-448, NaN -> 0x7F); a block inside one lane
  needs no shuffle (4 lanes: one MXFP4 block per lane), else its max goes over ``shfl.bfly``; E2M1 by
  ``e2m1x8_encode_rn`` (kernels_dsl/_quantize_ptx.py);
* stores: ``indexer_cache_write`` writes token ``n`` at ``slot_mapping[n]`` of the paged cache
  (per block: the values of every token, then the scales; slots outside ``[0, num_blocks *
  block_size)`` are skipped; the page division is the host's magic multiply, :func:`slot_magic`);
  ``indexer_q_quant`` writes ``q_data`` / ``q_sf`` rows and ``w_out`` (FP8: ``w * s``).

Plans (:func:`plan`, measured on the H200: docs/benchmarks.md): 16 lanes, one step, 4 CTAs per
SM while that grid fits one wave (decode sizes: the shortest chain per row); 4 lanes, one step, 8 CTAs per SM above
(about 650 SASS instructions per lane and row with the packed-bf16 MXFP4 encoder = 2600 per row; the former 8-lane
kernel needed about 4800 and was issue-bound at 45% of copy bandwidth).

Constraints: bf16 ``[rows, 128]`` contiguous input, 16-byte aligned; ``num_blocks * block_size
< 2^31`` (32-bit slot arithmetic; a larger cache does not fit an H200). One launch, no host sync,
graph-capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, compile_variants, i32, i64, launch_on
from .quantize import _sms
from .sm90.ptx import slot_magic

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from ._quantize_ptx import (ABS_INF, F32_1EM4, F32_FLT_MAX, F32_INV6, F32_INV448, F32_MX_FLOOR, _v,
                                bits_f32, chunk_absmax, e4m3_to_f32, f32_bits, e4m3x2, finite_chunk_absmax,
                                f32_to_bf16x2, fmax, fmin, fmul, frcp, half_to_f32, l2_evict_first, ld_nc_b32, ld_nc_f32,
                                shfl_bfly_max, st_b32, st_f32, st_u8, ue8m0_ceil_byte, vote_any,
                                e2m1x8_encode_rn)
    from .quantize_fp8 import _patch_nonfinite
    from .sm90.fp4 import e2m1x8_signs
    from .sm90.ptx import mulhi_shift
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["IndexerQuantConfig", "IndexerQuantKernel", "DslCacheWrite", "DslQQuant", "PROVIDERS", "compile_check"]

F32_RSQRT128 = 0x3DB504F3             # fp32(128^-0.5), the reference's torch.tensor(128 ** -0.5, float32)

#: what every variant's PTX contains (16-byte loads, 4-byte stores); the Hadamard variants also HADAMARD_PTX
PTX_PATTERNS = (r"ld\.global\.nc(\.L1::no_allocate)?\.L2::cache_hint\.v4\.u32", r"st\.global\.b32")
HADAMARD_PTX = (r"add\.rn\.f32", r"shfl\.sync\.bfly", r"fma\.rn\.f32", r"cvt\.rn\.bf16x2\.f32")
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")


@dataclass(frozen=True)
class IndexerQuantConfig:
    """Static specialization (the compile key) of :class:`IndexerQuantKernel`."""

    fmt: str = "mxfp4"           # "mxfp4" | "nvfp4" | "fp8"
    hadamard: bool = True
    cache: bool = True           # True: indexer_cache_write (paged, slot_mapping); False: indexer_q_quant
    slot64: bool = True          # slot_mapping dtype int64 (else int32)
    lanes: int = 4               # lanes per row (4 / 8 / 16): 16 / lanes chunks of 8 elements per lane
    groups: int = 1              # (32 / lanes)-row steps per warp iteration (their loads all in flight)
    warps: int = 4
    min_blocks: int = 0          # launch bound: CTAs per SM the registers must allow (0: none)
    bf16_mx: bool = True         # MXFP4 E2M1 in packed bf16x2 arithmetic (else e2m1x8_encode_rn)


if _HAVE_DSL:

    # ------------------------------------------------------------------ fp32 rotation helpers (exact PTX)
    @dsl_user_op
    def _f32_pair(a, b, *, loc=None, ip=None):
        """(a + b, a - b) in fp32 (``add.rn`` / ``sub.rn``: never contracted)."""
        r = llvm.inline_asm(llvm.StructType.get_literal([T.f32(), T.f32()]),
                            [_v(a, Float32, loc, ip), _v(b, Float32, loc, ip)],
                            "add.rn.f32 $0, $2, $3;\nsub.rn.f32 $1, $2, $3;", "=f,=f,f,f", has_side_effects=False,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return (Float32(llvm.extractvalue(T.f32(), r, [0], loc=loc, ip=ip)),
                Float32(llvm.extractvalue(T.f32(), r, [1], loc=loc, ip=ip)))

    @dsl_user_op
    def _f32_bfly(d, m: int, sgn, *, loc=None, ip=None):
        """One butterfly stage across lanes ``lane ^ m``: ``fma.rn(d, sgn, p)`` with ``p`` the
        partner's value, ``sgn`` +1 on the lower lane (``d + p``), -1 on the upper (``p - d``):
        one rounding, the reference's ``a + b`` / ``a - b``."""
        return Float32(llvm.inline_asm(
            T.f32(), [_v(d, Float32, loc, ip), _v(sgn, Float32, loc, ip)],
            "{\n.reg .f32 p;\n"
            f"shfl.sync.bfly.b32 p, $1, {int(m)}, 0x1f, 0xffffffff;\n"
            "fma.rn.f32 $0, $1, $2, p;\n}",
            "=f,f,f", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    def _rotate_lanes(ws, lane, LPR: int):
        """Hadamard of the row held by ``LPR`` lanes, ``16 / LPR`` contiguous chunks per lane (``ws``: lists of 4
        bf16 words; element ``8 (nc q + c) + i``) -> the bf16 words of every chunk; the contract of
        ``dsv4.reference.hadamard``: index bits below ``log2(8 nc)`` in-thread, the rest by ``shfl.bfly`` over the
        row's lanes, in index-bit order (bit 0 first), one ``mul.rn.f32`` by fp32(128^-0.5), ``cvt.rn.bf16x2``."""
        d = []
        for w in ws:
            d += _f32x8(w)
        n = len(d)
        h = 1
        while h < n:                               # in-thread index bits
            for i in range(n):
                if i & h == 0:
                    d[i], d[i + h] = _f32_pair(d[i], d[i + h])
            h *= 2
        m = 1
        while m < LPR:                             # lane bits
            sgn = cutlass.select_((lane & m) != 0, Float32(-1.0), Float32(1.0))
            d = [_f32_bfly(v, m, sgn) for v in d]
            m *= 2
        rs = bits_f32(Uint32(F32_RSQRT128))
        y = [fmul(v, rs) for v in d]
        return [[f32_to_bf16x2(y[8 * c + 2 * k], y[8 * c + 2 * k + 1]) for k in range(4)] for c in range(n // 8)]

    @dsl_user_op
    def _e2m1x8_pow2_bf16(w0, w1, w2, w3, s2, *, loc=None, ip=None):
        """E2M1 magnitude codes (nibble i = level index of element i, no signs) of the 8 bf16 values in the
        words ``w0..w3`` times the power of two ``s2`` (bf16x2, both halves; the MXFP4 decode-scale inverse),
        in packed bf16x2 arithmetic: ``v = |w * s2|`` (exact: a power-of-two scaling; ``v <= 6`` by the MXFP4
        scale rule), ``e = max(exponent(v), 127)``, magic ``M = 64, 130, 264`` for ``e = 127, 128, 129``
        (bits ``0x4280 + (e - 127) * 0x82``: on the grid 0.5 / 1 / 2 of the binade, offset so that) one
        ``add.rn.bf16x2 s = v + M`` rounds ``v`` to the E2M1 level set with ties to even and leaves the level
        index in the low 3 bits of ``s``. Bit-identical to ``e2m1x8_encode(f, 2^-k, w)`` without the signs."""
        body = ["{", ".reg .b32 v, e, m, a, b, x, y, c7f, c7;", "mov.b32 c7f, 0x007F007F;", "mov.b32 c7, 0x07070707;"]
        for k in range(4):
            body += [f"mul.rn.bf16x2 v, ${k + 1}, $5;", "and.b32 v, v, 0x7FFF7FFF;", "shr.b32 e, v, 7;",
                     "and.b32 e, e, 0x00FF00FF;", "max.u16x2 e, e, c7f;", "mad.lo.u32 m, e, 130, 0x02020202;",
                     f"add.rn.bf16x2 {'abxy'[k]}, v, m;"]
        body += ["prmt.b32 a, a, b, 0x6420;", "prmt.b32 b, x, y, 0x6420;", "and.b32 a, a, c7;", "and.b32 b, b, c7;",
                 "shr.b32 x, a, 4;", "or.b32 a, a, x;", "shr.b32 y, b, 4;", "or.b32 b, b, y;",
                 "prmt.b32 $0, a, b, 0x6420;", "}"]
        return _u32_asm("\n".join(body), "=r,r,r,r,r,r", [w0, w1, w2, w3, s2], loc, ip)

    def _u32_asm(ptx, cons, args, loc, ip):
        return Uint32(llvm.inline_asm(T.i32(), [_v(a, Uint32, loc, ip) for a in args], ptx, cons, has_side_effects=False,
                                      is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))

    @dsl_user_op
    def _ld_v4_if(addr, pol, pred, l1: bool, *, loc=None, ip=None):
        """16-byte read-only load predicated on ``pred != 0`` (zeros otherwise), L2 policy ``pol``; ``l1``: allocate
        in L1 (a lane's neighbouring chunks share 32-byte sectors), else ``L1::no_allocate``."""
        hint = "" if l1 else ".L1::no_allocate"
        r = llvm.inline_asm(llvm.StructType.get_literal([T.i32()] * 4),
                            [_v(addr, Int64, loc, ip), _v(pol, Int64, loc, ip), _v(pred, Int32, loc, ip)],
                            "{\n.reg .pred p;\nsetp.ne.b32 p, $6, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\n"
                            f"mov.b32 $3, 0;\n@p ld.global.nc{hint}.L2::cache_hint.v4.u32 {{$0, $1, $2, $3}}, [$4], $5;\n}}",
                            "=r,=r,=r,=r,l,l,r", has_side_effects=True, is_align_stack=False,
                            asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
        return [Uint32(llvm.extractvalue(T.i32(), r, [i], loc=loc, ip=ip)) for i in range(4)]

    def _f32x8(w):
        out = []
        for k in range(4):
            out += [bits_f32(Uint32(w[k]) << 16), bits_f32(Uint32(w[k]) & Uint32(0xFFFF0000))]
        return out

    class IndexerQuantKernel:
        """``__call__(x, slots, gsrc, out, sf_out, w_in, w_out, rows, bs, num_slots, n_ctas, stream)``:
        ``Int64`` addresses; ``x`` bf16 ``[rows, 128]``; cache mode: ``slots`` int32 / int64 ``[rows]``,
        ``out`` the cache base, ``bs`` its block size, ``num_slots = num_blocks * bs``; q mode:
        ``out`` / ``sf_out`` the q value / scale rows, ``w_in`` / ``w_out`` fp32 ``[rows]``;
        ``gsrc`` the NVFP4 fp32 global decode scale."""

        def __init__(self, cfg: IndexerQuantConfig):
            from dsv4.ops.indexer import FORMATS     # fmt -> (value bytes, scale bytes) per row
            self.cfg = cfg
            self.vb, self.sb = FORMATS[cfg.fmt]

        @cute.jit
        def __call__(self, x: Int64, slots: Int64, gsrc: Int64, out: Int64, sf_out: Int64, w_in: Int64, w_out: Int64,
                     rows: Int64, bs: Int32, num_slots: Int64, dm: Int64, dsh: Int32, n_ctas: Int32,
                     stream: cuda.CUstream):
            lb = {"min_blocks_per_mp": self.cfg.min_blocks, "preferred_smem_carveout": 50} if self.cfg.min_blocks else {}
            self.kernel(x, slots, gsrc, out, sf_out, w_in, w_out, rows, bs, num_slots, dm, dsh).launch(
                grid=[n_ctas, 1, 1], block=[32 * self.cfg.warps, 1, 1], stream=stream, **lb)

        @cute.kernel
        def kernel(self, x: Int64, slots: Int64, gsrc: Int64, out: Int64, sf_out: Int64, w_in: Int64,
                         w_out: Int64, rows: Int64, bs: Int32, num_slots: Int64, dm: Int64, dsh: Int32):
            """``lanes`` lanes per row, ``32 / lanes`` rows per warp step, ``groups`` steps per iteration; lane
            ``q`` of a row holds its ``16 / lanes`` contiguous 8-element chunks (elements ``8 (nc q + c) + i``)."""
            cfg = self.cfg
            G, LPR = cfg.groups, cfg.lanes
            NC, RS = 16 // LPR, 32 // LPR
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            lane = tidx % 32
            warp = tidx // 32
            q = lane % LPR
            pol = l2_evict_first()
            abs_inf = ABS_INF["bfloat16"]
            g_dec = Float32(1.0)
            mult = Float32(1.0)
            gnan = Uint32(0)
            if cutlass.const_expr(cfg.fmt == "nvfp4"):
                g_dec = ld_nc_f32(gsrc)
                g_enc = frcp(g_dec)
                mult = fmul(g_enc, bits_f32(Uint32(F32_INV6)))
                gnan = Uint32(g_enc != g_enc)
            step = RS * G
            n_it = Int32((rows + (step - 1)) // step)
            w0 = Int32(bidx) * cfg.warps + Int32(warp)
            for it in cutlass.range(w0, n_it, Int32(gdim) * cfg.warps, unroll=1):
                rbase = Int64(it) * step
                raw = []
                sl = []
                for g in cutlass.range_constexpr(G):
                    r = rbase + (RS * g) + Int64(lane // LPR)
                    ok = Int32(r < rows)
                    src = x + r * 256 + Int64(q) * (16 * NC)
                    raw.append([_ld_v4_if(src + 16 * c, pol, ok, NC > 1) for c in range(NC)])
                    # the slot with the row (one memory round trip), not after the rotation
                    # cache: the slot; q: the head weight (bits) -- issued with the row (one memory round trip)
                    slot = Int64(-1)
                    rr = cutlass.select_(r < rows, r, Int64(0))
                    if cutlass.const_expr(cfg.cache):
                        if cutlass.const_expr(cfg.slot64):
                            slot = (Int64(ld_nc_b32(slots + rr * 8 + 4)) << 32) | Int64(ld_nc_b32(slots + rr * 8))
                        else:
                            slot = Int64(Int32(ld_nc_b32(slots + rr * 4)))
                    else:
                        slot = Int64(ld_nc_b32(w_in + rr * 4))
                    sl.append(slot)
                # skip a warp step whose rows are all out of range / skipped; the test also depends on one word of
                # every load, so that all of them issue before the first rotation (ptxas otherwise sinks a load
                # next to its first use: a second memory round trip). A data word equal to the magic only runs the
                # (store-free) work anyway.
                live = Int32(0)
                pin = Uint32(0)
                for g in cutlass.range_constexpr(G):
                    r = rbase + (RS * g) + Int64(lane // LPR)
                    okg = r < rows
                    if cutlass.const_expr(cfg.cache):
                        okg = okg & (sl[g] >= Int64(0)) & (sl[g] < num_slots)
                    live = live | Int32(okg)
                    pin = pin ^ Uint32(sl[g])
                    for c in cutlass.range_constexpr(NC):
                        pin = pin ^ raw[g][c][0]
                if vote_any(live | Int32(pin == Uint32(0x9E3779B9))) != Uint32(0):
                    for g in cutlass.range_constexpr(G):
                        r = rbase + (RS * g) + Int64(lane // LPR)
                        ws = raw[g]
                        if cutlass.const_expr(cfg.hadamard):
                            ws = _rotate_lanes(ws, lane, LPR)
                        self._quantize_row(r, sl[g], ws, q, rows, out, sf_out, w_in, w_out, bs, num_slots, dm, dsh,
                                             g_dec, mult, gnan, abs_inf)

        @cute.jit
        def _quantize_row(self, r, slot, ws, q, rows, out, sf_out, w_in, w_out, bs, num_slots, dm, dsh, g_dec,
                            mult, gnan, abs_inf: cutlass.Constexpr):
            cfg = self.cfg
            VB, SB = self.vb, self.sb
            LPR = cfg.lanes
            NC = 16 // LPR
            ok = r < rows
            vdst = out + r * VB
            sdst = sf_out + r * SB
            if cutlass.const_expr(cfg.cache):
                ok = ok & (slot >= Int64(0)) & (slot < num_slots)
                s32 = Uint32(cutlass.select_(ok, slot, Int64(0)))
                blk = mulhi_shift(s32, Uint32(dm), dsh)          # slot // bs (slot < 2^31)
                j = s32 - blk * Uint32(bs)
                base = out + Int64(blk) * (Int64(bs) * (VB + SB))
                vdst = base + Int64(j) * VB
                sdst = base + Int64(bs) * VB + Int64(j) * SB
            fs = [_f32x8(w) for w in ws]
            hs = [chunk_absmax(w) for w in ws]
            if cutlass.const_expr(cfg.fmt == "fp8"):
                nf = Int32(hs[0] >= Uint32(abs_inf))
                for c in cutlass.range_constexpr(1, NC):
                    nf = nf | Int32(hs[c] >= Uint32(abs_inf))
                m = hs[0]
                for c in cutlass.range_constexpr(1, NC):
                    m = cutlass.max(m, hs[c])
                slow = vote_any(nf) != Uint32(0)
                if slow:
                    m = finite_chunk_absmax(ws[0], abs_inf)
                    for c in cutlass.range_constexpr(1, NC):
                        m = cutlass.max(m, finite_chunk_absmax(ws[c], abs_inf))
                for o in cutlass.range_constexpr(LPR.bit_length() - 1):
                    m = shfl_bfly_max(m, 1 << o)
                s = fmul(fmax(half_to_f32(m, False), bits_f32(Uint32(F32_1EM4))), bits_f32(Uint32(F32_INV448)))
                sb = ue8m0_ceil_byte(s)                             # 105 <= sb <= 246 (amax floor 1e-4, finite)
                s = bits_f32(sb << 23)
                rs = bits_f32((Uint32(254) - sb) << 23)              # 1 / s exactly
                codes = cute.make_rmem_tensor((2 * NC,), Uint32)
                for c in cutlass.range_constexpr(NC):
                    f = fs[c]
                    p = [e4m3x2(fmul(f[2 * k], rs), fmul(f[2 * k + 1], rs)) for k in range(4)]
                    codes[2 * c] = Uint32(p[0] | (p[1] << 16))
                    codes[2 * c + 1] = Uint32(p[2] | (p[3] << 16))
                if slow:
                    for c in cutlass.range_constexpr(NC):
                        pp = _patch_nonfinite((codes[2 * c], codes[2 * c + 1]), ws[c], abs_inf)
                        codes[2 * c] = Uint32(pp[0])
                        codes[2 * c + 1] = Uint32(pp[1])
                if ok:
                    for k in cutlass.range_constexpr(2 * NC):
                        st_b32(vdst + Int64(q) * (8 * NC) + 4 * k, codes[k])
                    if q == 0:
                        if cutlass.const_expr(cfg.cache):
                            st_f32(sdst, s)
                        else:
                            st_f32(w_out + r * 4, fmul(bits_f32(Uint32(slot)), s))
            else:
                B = 4 if cfg.fmt == "mxfp4" else 2                   # chunks per scale block
                codes, sbytes = self._fp4_lanes(fs, ws, hs, NC, B, g_dec, mult, gnan, abs_inf)
                if ok:
                    for c in cutlass.range_constexpr(NC):
                        st_b32(vdst + Int64(q) * (4 * NC) + 4 * c, codes[c])
                    if cutlass.const_expr(B <= NC):
                        for b in cutlass.range_constexpr(NC // B):
                            st_u8(sdst + Int64(q) * (NC // B) + b, sbytes[b])
                    else:
                        if q % (B // NC) == 0:
                            st_u8(sdst + Int64(q // (B // NC)), sbytes[0])
                    if cutlass.const_expr(not cfg.cache):
                        if q == 0:
                            st_b32(w_out + r * 4, Uint32(slot))

        def _fp4_lanes(self, fs, ws, hs, NC: int, B: int, g_dec, mult, gnan, abs_inf: int):
            """Code words of a lane's ``NC`` chunks and its scale bytes: blocks of ``B`` chunks, inside the lane
            (``B <= NC``) or over ``B / NC`` lanes (max by ``shfl.bfly``; every lane gets the block's byte)."""
            codes, sbytes = [], []
            if B <= NC:
                for b in range(NC // B):
                    hb = hs[B * b]
                    for c in range(B * b + 1, B * b + B):
                        hb = cutlass.max(hb, hs[c])
                    enc, sbyte, bad, zero = self._fp4_scale(hb, g_dec, mult, gnan, abs_inf)
                    for c in range(B * b, B * b + B):
                        codes.append(self._fp4_code(fs[c], ws[c], enc, bad, zero))
                    sbytes.append(cutlass.select_(bad, Uint32(self._nan_byte()), sbyte))
                return codes, sbytes
            hb = hs[0]
            for c in range(1, NC):
                hb = cutlass.max(hb, hs[c])
            for o in range((B // NC).bit_length() - 1):
                hb = shfl_bfly_max(hb, 1 << o)
            enc, sbyte, bad, zero = self._fp4_scale(hb, g_dec, mult, gnan, abs_inf)
            for c in range(NC):
                codes.append(self._fp4_code(fs[c], ws[c], enc, bad, zero))
            sbytes.append(cutlass.select_(bad, Uint32(self._nan_byte()), sbyte))
            return codes, sbytes

        def _nan_byte(self) -> int:
            return 0x7F if self.cfg.fmt == "nvfp4" else 0xFF

        def _fp4_scale(self, hb, g_dec, mult, gnan, abs_inf: int):
            """(encode multiplier, scale byte, non-finite block flag, NVFP4 zero-scale flag) of a block with
            max |bits| ``hb`` (the scale rules of ``quantize_fp4.py``)."""
            bad = (Uint32(hb >= Uint32(abs_inf)) | gnan) != Uint32(0)
            vmax = half_to_f32(hb, False)
            if self.cfg.fmt == "nvfp4":
                sf = fmin(fmul(vmax, mult), Float32(448.0))
                sbyte = e4m3x2(sf, Float32(0.0))
                s = e4m3_to_f32(sbyte)
                enc = fmin(frcp(fmul(s, g_dec)), bits_f32(Uint32(F32_FLT_MAX)))
                return enc, sbyte, bad, s == Float32(0.0)
            tt = fmul(fmax(vmax, bits_f32(Uint32(F32_MX_FLOOR))), bits_f32(Uint32(F32_INV6)))
            sbyte = ue8m0_ceil_byte(tt)
            return bits_f32((Uint32(254) - sbyte) << 23), sbyte, bad, None

        def _fp4_code(self, f, w, enc, bad, zero):
            """The code word of one chunk: MXFP4 (power-of-two ``enc``) in packed bf16x2 arithmetic
            (:func:`_e2m1x8_pow2_bf16`), NVFP4 by ``e2m1x8_encode_rn``; zeros for a non-finite block."""
            if self.cfg.fmt == "mxfp4" and self.cfg.bf16_mx:
                e16 = (f32_bits(enc) >> 16) * Uint32(0x10001)           # 2^-k as bf16x2 (exact)
                code = _e2m1x8_pow2_bf16(w[0], w[1], w[2], w[3], e16) | e2m1x8_signs(w[0], w[1], w[2], w[3])
            else:
                code = e2m1x8_encode_rn(f, enc, w)
                if self.cfg.fmt == "nvfp4":
                    code = cutlass.select_(zero, code & Uint32(0x88888888), code)
            return cutlass.select_(bad, Uint32(0), code)


def model_e2m1x8_pow2_bf16(words, enc_byte: int) -> int:
    """Bit model of :func:`_e2m1x8_pow2_bf16` (numpy, no signs): 4 words of 2 bf16 halves times ``2^(127 -
    enc_byte)`` (``enc_byte`` = the bf16 exponent field of the MXFP4 decode-scale inverse, ``254 - sbyte``) -> 8
    nibbles of E2M1 level indices (element i at bits 4i..4i+2). Every step as the PTX: the exact product, ``|v|``,
    ``e = max(exponent field, 127)``, the magic half ``0x4280 + (e - 127) * 0x82``, one bf16 round-to-nearest-even
    add, the low 3 bits."""
    import numpy as np
    out = 0
    for i in range(8):
        h = (int(words[i // 2]) >> (16 * (i % 2))) & 0xFFFF
        v = float(np.array([h << 16], dtype=np.uint32).view(np.float32)[0]) * 2.0 ** (int(enc_byte) - 127)
        vb = int(np.array([abs(v)], dtype=np.float32).view(np.uint32)[0]) >> 16      # exact (a power-of-two scaling)
        e = max((vb >> 7) & 0xFF, 127)
        m = 0x4280 + (e - 127) * 0x82
        a32 = np.array([vb << 16], dtype=np.uint32).view(np.float32)[0]
        m32 = np.array([m << 16], dtype=np.uint32).view(np.float32)[0]
        t = int(np.array([a32 + m32], dtype=np.float32).view(np.uint32)[0])            # exact in fp32
        t = (t + 0x7FFF + ((t >> 16) & 1)) >> 16                                        # RNE to bf16
        out |= (t & 7) << (4 * i)
    return out


def compile_indexer_quant(cfg: IndexerQuantConfig, arch: str = "sm_90a", extra: str = ""):
    from cutlass.cute.runtime import make_fake_stream
    z, i = Int64(0), Int32(0)
    return cute.compile(IndexerQuantKernel(cfg), z, z, z, z, z, z, z, z, i, z, z, i, i, make_fake_stream(),
                        options=compile_options(arch, extra))


def _fn(cfg, dev):
    from dsv4.target import Target
    arch = Target.of(dev).arch
    return compile_cached(("indexer_quant", cfg, arch), lambda: compile_indexer_quant(cfg, arch))


#: benchmark hook ({"lanes": l, "groups": g, "warps": w, "min_blocks": b, "bf16_mx": m, "ctas_per_sm": c} override
#: the plan); empty in production
VARIANT: dict = {}

#: (lanes, groups, CTAs per SM) of the plans: the measured winners of the lane / step / CTA sweeps at prefill and
#: decode sizes (H200, CUDA-graph us, bit-exact; docs/benchmarks.md, "kv_cache_append and the indexer quantizers").
PLAN_SMALL = (16, 1, 4)
PLAN_MID = (8, 1, 8)
PLAN_LARGE = {"mxfp4": (4, 1, 8), "nvfp4": (4, 1, 6), "fp8": (4, 1, 8)}


def plan(rows: int, sms: int, fmt: str = "mxfp4") -> tuple[int, int, int]:
    """(lanes, groups, CTAs per SM) for ``rows`` rows: 16 lanes while their grid fits one wave of 4-warp CTAs at 4 per
    SM (decode: the shortest chain per row), 8 lanes while a 4-lane grid would not fill one wave at 8 CTAs per SM, else
    4 lanes (prefill: the fewest instructions per row)."""
    if rows <= 2 * 4 * 4 * sms:
        return PLAN_SMALL
    if rows <= 8 * 4 * 8 * sms:
        return PLAN_MID
    return PLAN_LARGE[fmt]


def _grid(rows: int, cfg: IndexerQuantConfig, sms: int, per_sm: int) -> int:
    need = -(-rows // ((32 // cfg.lanes) * cfg.groups * cfg.warps))
    return max(1, min(need, sms * VARIANT.get("ctas_per_sm", per_sm)))      # persistent: grid-stride rows


def _cfg(fmt: str, hadamard: bool, cache: bool, slot64: bool, rows: int, sms: int) -> tuple[IndexerQuantConfig, int]:
    """(config, grid) of a problem on ``sms`` SMs: :func:`plan`, or the :data:`VARIANT` overrides."""
    lanes, groups, per_sm = plan(rows, sms, fmt)
    cfg = IndexerQuantConfig(fmt, hadamard, cache, slot64, VARIANT.get("lanes", lanes), VARIANT.get("groups", groups),
                             VARIANT.get("warps", 4), VARIANT.get("min_blocks", 0), VARIANT.get("bf16_mx", True))
    return cfg, _grid(rows, cfg, sms, per_sm)


#: Ops whose DSL kernel passed the bit-exact H200 checks (tests/test_indexer_quant.py -m gpu: every format x
#: Hadamard x slot dtype, skipped / out-of-range slots, NaN / Inf rows, extreme magnitudes and exponent spreads, the
#: plans and the other geometries); False: never a default, never forced.
VALIDATED = {"indexer_cache_write": True, "indexer_q_quant": True}
#: why this provider is the default (timings: docs/benchmarks.md, "kv_cache_append and the indexer quantizers")
WHY_FIRST = ("at or below the deleted CUDA quantizer at every measured size, 1.3-3.0x faster at prefill sizes; "
             "timings: docs/benchmarks.md")


class _Base(DslProvider):
    def config(self, problem, target):
        """The :class:`IndexerQuantConfig` of the problem's row class (:func:`_cfg`, the one heuristic ``run`` calls
        with its exact row count: the plan at a class boundary may differ)."""
        cache = self.op.name == "indexer_cache_write"
        return _cfg(problem["fmt"], problem["hadamard"] in (True, 1), cache, True, problem["rows"], target.sm_count)[0]

    def _gate(self, problem):
        """Validated on the H200 (:data:`VALIDATED`), else not offered."""
        if not VALIDATED[self.op.name]:
            return Support.no("dsl: kernel not validated on the H200 yet (issue 16)")
        return None


class DslCacheWrite(_Base):
    describe = ("indexer_quant.py: 4 / 16 lanes per row, fp32 FWHT (in-thread + shfl.bfly stages), packed-bf16 MXFP4 / "
                "E2M1 / E4M3 encode, paged store")

    def supports_problem(self, problem):
        no = self._gate(problem)
        return no if no is not None else Support.yes(f"sm_90a, every format, hadamard or not ({WHY_FIRST})")

    def run(self, problem, *, cache, k, slot_mapping, global_scale):
        n = k.shape[0]
        if n == 0:
            return None
        nb, bs = cache.shape[0], cache.shape[1]
        if nb * bs >= 1 << 31:
            raise ValueError(f"indexer_cache_write (dsl): num_blocks * block_size = {nb * bs} must be < 2^31")
        cfg, grid = _cfg(problem["fmt"], problem["hadamard"] in (True, 1), True, slot_mapping.dtype.itemsize == 8, n,
                         _sms(k.device))
        g = global_scale if global_scale is not None else k
        dm, dsh = slot_magic(bs)
        launch_on(k.device, _fn(cfg, k.device), i64(k.data_ptr()), i64(slot_mapping.data_ptr()), i64(g.data_ptr()),
                  i64(cache.data_ptr()), i64(0), i64(0), i64(0), i64(n), i32(bs), i64(nb * bs), i64(dm), i32(dsh),
                  i32(grid))
        return None


class DslQQuant(_Base):
    describe = "indexer_quant.py (q mode): 4 / 16 lanes per (t, h) row, fp32 FWHT, encode as the cache writer"

    def supports_problem(self, problem):
        no = self._gate(problem)
        return no if no is not None else Support.yes(f"sm_90a, every format, hadamard or not ({WHY_FIRST})")

    def run(self, problem, *, q, w, global_scale):
        from dsv4.ops.indexer import q_quant_outputs
        fmt = problem["fmt"]
        q_data, q_sf, w_out = q_quant_outputs(q, fmt)
        rows = q.shape[0] * 64
        if rows == 0:
            return q_data, q_sf, w_out
        cfg, grid = _cfg(fmt, problem["hadamard"] in (True, 1), False, True, rows, _sms(q.device))
        g = global_scale if global_scale is not None else w
        sfp = q_sf if fmt != "fp8" else q_data
        launch_on(q.device, _fn(cfg, q.device), i64(q.data_ptr()), i64(0), i64(g.data_ptr()), i64(q_data.data_ptr()),
                  i64(sfp.data_ptr()), i64(w.data_ptr()), i64(w_out.data_ptr()), i64(rows), i32(1), i64(0), i64(1 << 31),
                  i32(31), i32(grid))
        return q_data, q_sf, w_out


PROVIDERS = {"indexer_cache_write": DslCacheWrite, "indexer_q_quant": DslQQuant}

#: the specializations the CPU compile check builds (every format, both modes, both slot dtypes)
CHECK_VARIANTS = {
    "cache-mxfp4-had-i64-l4": {"fmt": "mxfp4"},
    "cache-nvfp4-had-i32-l16": {"fmt": "nvfp4", "slot64": False, "lanes": 16},
    "cache-fp8-nohad-i64-l4": {"fmt": "fp8", "hadamard": False},
    "cache-mxfp4-had-i64-l16-rn": {"fmt": "mxfp4", "lanes": 16, "bf16_mx": False},
    "q-mxfp4-had-l16": {"fmt": "mxfp4", "cache": False, "lanes": 16},
    "q-nvfp4-nohad-l4": {"fmt": "nvfp4", "hadamard": False, "cache": False},
    "q-fp8-had-l8": {"fmt": "fp8", "cache": False, "lanes": 8},
    "q-mxfp4-had-l4g2": {"fmt": "mxfp4", "cache": False, "groups": 2},
}


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile every :data:`CHECK_VARIANTS` entry for ``arch`` on the CPU; ``{variant: PTX text}``."""
    builds = {n: (lambda a, e, kw=kw: compile_indexer_quant(IndexerQuantConfig(**kw), a, e))
              for n, kw in CHECK_VARIANTS.items()}
    return compile_variants("indexer_quant", builds, dump_dir, arch, only)
