"""CuTe DSL providers of ``indexer_cache_write`` and ``indexer_q_quant`` (registered by
``kernels_dsl/indexer.py``): optional Sylvester-Hadamard rotation, then MXFP4 / NVFP4 / FP8
quantization of 128-dim rows, bit-exact with ``dsv4/reference/indexer.py`` (rotation
:func:`dsv4.reference.hadamard.rotate_activation_ref`, formats :mod:`dsv4.formats` incl. the OCP
MX non-finite block rule); contracts docs/layouts/indexer_cache_write.md / indexer_q_quant.md.

:class:`IndexerQuantKernel` -- 8 lanes per row, 4 rows per warp step, ``groups`` steps per warp
iteration (every row load of an iteration in flight before the first rotation):

* lane ``q = lane % 8`` of row ``lane // 8`` loads the two 16-byte chunks A = elements
  ``8q .. 8q+7`` and B = ``64 + 8q .. 64 + 8q + 7`` (every warp load instruction reads 4 x 128
  contiguous bytes);
* Hadamard (``hadamard``): the rows are rotated by the fp32 contract of ``dsv4.reference.hadamard``
  (the official kernel's arithmetic): butterflies in its stage order (index bit 0 first): bits 0-2
  inside a chunk, bits 3-5 by ``shfl.bfly`` over the row's 8 lanes (one ``fma.rn.f32(d, +-1, p)``
  per value), bit 6 (A with B) in-thread; then one ``mul.rn.f32`` by fp32(128^-0.5) and one
  ``cvt.rn.bf16x2.f32``: bit-exact with the reference;
* each chunk of 8 values is then one quantizer "chunk" of ``kernels_dsl/quantize_fp4.py`` /
  ``quantize_fp8.py`` (same roundings, same instructions): MXFP4 (DSV4 ceil rule) blocks of 32 =
  4 lanes, NVFP4 (caller's global decode scale, TE order) blocks of 16 = 2 lanes, FP8 one
  power-of-two UE8M0 scale per row (8 lanes, finite amax; Inf -> +-448, NaN -> 0x7F);
* stores: ``indexer_cache_write`` writes token ``n`` at ``slot_mapping[n]`` of the paged cache
  (per block: the values of every token, then the scales; slots outside ``[0, num_blocks *
  block_size)`` are skipped); ``indexer_q_quant`` writes ``q_data`` / ``q_sf`` rows and ``w_out``
  (FP8: ``w * s``).

Constraints: bf16 ``[rows, 128]`` contiguous input, 16-byte aligned; ``num_blocks * block_size
< 2^31`` (32-bit slot arithmetic; a larger cache does not fit an H200). One launch, no host sync,
graph-capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, compile_variants, i32, i64, launch_on

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op

    from ._quantize_ptx import (ABS_INF, F32_1EM4, F32_FLT_MAX, F32_INV6, F32_INV448, F32_MX_FLOOR, _v,
                                bits_f32, chunk_absmax, clz, e4m3_to_f32, e4m3x2, finite_chunk_absmax,
                                f32_to_bf16x2, fmax, fmin, fmul, frcp, half_to_f32, l2_evict_first, ld_nc_b32, ld_nc_f32,
                                ld_nc_v4_if, shfl_bfly_max, st_b32, st_f32, st_u8, ue8m0_ceil_byte, vote_any)
    from .quantize_fp8 import _patch_nonfinite
    from .sm90.fp4 import e2m1x8_encode
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["IndexerQuantConfig", "IndexerQuantKernel", "DslCacheWrite", "DslQQuant", "PROVIDERS", "compile_check"]

F32_RSQRT128 = 0x3DB504F3             # fp32(128^-0.5), the reference's torch.tensor(128 ** -0.5, float32)

#: what every variant's PTX contains (16-byte loads, 4-byte stores); the Hadamard variants also HADAMARD_PTX
PTX_PATTERNS = (r"ld\.global\.nc\.L1::no_allocate\.L2::cache_hint\.v4\.u32", r"st\.global\.b32")
HADAMARD_PTX = (r"add\.rn\.f32", r"shfl\.sync\.bfly", r"fma\.rn\.f32", r"cvt\.rn\.bf16x2\.f32")
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")


@dataclass(frozen=True)
class IndexerQuantConfig:
    """Static specialization (the compile key) of :class:`IndexerQuantKernel`."""

    fmt: str = "mxfp4"           # "mxfp4" | "nvfp4" | "fp8"
    hadamard: bool = True
    cache: bool = True           # True: indexer_cache_write (paged, slot_mapping); False: indexer_q_quant
    slot64: bool = True          # slot_mapping dtype int64 (else int32)
    groups: int = 4              # 4-row steps per warp iteration (loads in flight: 2 x groups 16-byte per lane)
    warps: int = 4
    min_blocks: int = 0          # launch bound: CTAs per SM the registers must allow (0: none)


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

    def _rotate_row(wa, wb, lane):
        """Hadamard of the row this lane's 8-lane group holds (chunks ``wa`` / ``wb`` of 4 bf16 words
        each) -> (bf16 words of A, of B), the contract of ``dsv4.reference.hadamard``: fp32
        butterflies in the reference's stage order (index bit 0 first), one ``mul.rn.f32`` by
        fp32(128^-0.5), one ``cvt.rn.bf16x2.f32``."""
        d = _f32x8(wa) + _f32x8(wb)
        for h in (1, 2, 4):                        # index bits 0, 1, 2: inside a chunk
            for i in range(16):
                if i & h == 0:
                    d[i], d[i + h] = _f32_pair(d[i], d[i + h])
        for m in (1, 2, 4):                        # index bits 3, 4, 5 = lane bits 0, 1, 2
            sgn = cutlass.select_((lane & m) != 0, Float32(-1.0), Float32(1.0))
            d = [_f32_bfly(v, m, sgn) for v in d]
        for i in range(8):                         # index bit 6: chunk A (elements < 64) with chunk B
            d[i], d[i + 8] = _f32_pair(d[i], d[i + 8])
        rs = bits_f32(Uint32(F32_RSQRT128))
        y = [fmul(v, rs) for v in d]
        wa2 = [f32_to_bf16x2(y[2 * k], y[2 * k + 1]) for k in range(4)]
        wb2 = [f32_to_bf16x2(y[8 + 2 * k], y[8 + 2 * k + 1]) for k in range(4)]
        return wa2, wb2

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
                     rows: Int64, bs: Int32, num_slots: Int64, n_ctas: Int32, stream: cuda.CUstream):
            lb = {"min_blocks_per_mp": self.cfg.min_blocks, "preferred_smem_carveout": 50} if self.cfg.min_blocks else {}
            self.kernel(x, slots, gsrc, out, sf_out, w_in, w_out, rows, bs, num_slots).launch(
                grid=[n_ctas, 1, 1], block=[32 * self.cfg.warps, 1, 1], stream=stream, **lb)

        @cute.kernel
        def kernel(self, x: Int64, slots: Int64, gsrc: Int64, out: Int64, sf_out: Int64, w_in: Int64, w_out: Int64,
                   rows: Int64, bs: Int32, num_slots: Int64):
            cfg = self.cfg
            G = cfg.groups
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            lane = tidx % 32
            warp = tidx // 32
            q = lane % 8
            pol = l2_evict_first()
            abs_inf = ABS_INF["bfloat16"]
            # NVFP4 global scale (GS_GIVEN of quantize_fp4.py: g_enc = RN(1 / g_dec))
            g_dec = Float32(1.0)
            mult = Float32(1.0)
            gnan = Uint32(0)
            if cutlass.const_expr(cfg.fmt == "nvfp4"):
                g_dec = ld_nc_f32(gsrc)
                g_enc = frcp(g_dec)
                mult = fmul(g_enc, bits_f32(Uint32(F32_INV6)))
                gnan = Uint32(g_enc != g_enc)
            # slot // bs by a magic multiply (0 <= slot < 2^31; l = ceil(log2 bs), m = ceil(2^(31+l) / bs))
            dsh = Int64(Int32(32) - Int32(clz(Uint32(bs - 1)))) + 31
            dm = ((Int64(1) << dsh) + Int64(bs - 1)) // Int64(bs)
            step = 4 * G
            n_it = (rows + (step - 1)) // step
            w0 = Int64(bidx) * cfg.warps + Int64(warp)
            wstride = Int64(gdim) * cfg.warps
            trips = cutlass.max(n_it - w0 + (wstride - 1), n_it - n_it) // wstride
            for it in cutlass.range(trips, unroll=1):
                rbase = (w0 + it * wstride) * step
                raw = []
                for g in cutlass.range_constexpr(G):
                    r = rbase + (4 * g) + Int64(lane // 8)
                    ok = Int32(r < rows)
                    src = x + r * 256 + Int64(q) * 16
                    raw.append((ld_nc_v4_if(src, pol, ok), ld_nc_v4_if(src + 128, pol, ok)))
                for g in cutlass.range_constexpr(G):
                    r = rbase + (4 * g) + Int64(lane // 8)
                    wa, wb = raw[g]
                    if cutlass.const_expr(cfg.hadamard):
                        wa, wb = _rotate_row(wa, wb, lane)
                    self._quantize_row(r, wa, wb, lane, q, rows, slots, out, sf_out, w_in, w_out, bs, num_slots,
                                       dm, dsh, g_dec, mult, gnan, abs_inf)

        @cute.jit
        def _quantize_row(self, r, wa, wb, lane, q, rows, slots, out, sf_out, w_in, w_out, bs, num_slots, dm, dsh,
                          g_dec, mult, gnan, abs_inf: cutlass.Constexpr):
            cfg = self.cfg
            VB, SB = self.vb, self.sb
            # ---- destination (every lane of the row computes it)
            ok = r < rows
            vdst = out + r * VB
            sdst = sf_out + r * SB
            if cutlass.const_expr(cfg.cache):
                slot = Int64(0)
                rr = cutlass.select_(ok, r, Int64(0))
                if cutlass.const_expr(cfg.slot64):
                    s_lo = ld_nc_b32(slots + rr * 8)
                    s_hi = ld_nc_b32(slots + rr * 8 + 4)
                    slot = (Int64(s_hi) << 32) | Int64(s_lo)
                else:
                    slot = Int64(Int32(ld_nc_b32(slots + rr * 4)))
                ok = ok & (slot >= Int64(0)) & (slot < num_slots)
                s32 = cutlass.select_(ok, slot, Int64(0))
                blk = (s32 * dm) >> dsh
                j = s32 - blk * Int64(bs)
                base = out + blk * Int64(bs) * (VB + SB)
                vdst = base + j * VB
                sdst = base + Int64(bs) * VB + j * SB
            fa = _f32x8(wa)
            fb = _f32x8(wb)
            if cutlass.const_expr(cfg.fmt == "fp8"):
                ha = chunk_absmax(wa)
                hb = chunk_absmax(wb)
                nf = Int32((ha >= Uint32(abs_inf)) | (hb >= Uint32(abs_inf)))
                slow = vote_any(nf) != Uint32(0)
                if slow:
                    ha = finite_chunk_absmax(wa, abs_inf)
                    hb = finite_chunk_absmax(wb, abs_inf)
                m = cutlass.max(ha, hb)
                for o in cutlass.range_constexpr(3):
                    m = shfl_bfly_max(m, 1 << o)
                # s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))) (ue8m0, as an fp32 power of two)
                s = fmul(fmax(half_to_f32(m, False), bits_f32(Uint32(F32_1EM4))), bits_f32(Uint32(F32_INV448)))
                s = bits_f32(ue8m0_ceil_byte(s) << 23)
                rs = frcp(s)
                pa = [e4m3x2(fmul(fa[2 * k], rs), fmul(fa[2 * k + 1], rs)) for k in range(4)]
                pb = [e4m3x2(fmul(fb[2 * k], rs), fmul(fb[2 * k + 1], rs)) for k in range(4)]
                a0 = Uint32(pa[0] | (pa[1] << 16))
                a1 = Uint32(pa[2] | (pa[3] << 16))
                b0 = Uint32(pb[0] | (pb[1] << 16))
                b1 = Uint32(pb[2] | (pb[3] << 16))
                if slow:
                    pp = _patch_nonfinite((a0, a1), wa, abs_inf)
                    a0 = Uint32(pp[0])
                    a1 = Uint32(pp[1])
                    pp = _patch_nonfinite((b0, b1), wb, abs_inf)
                    b0 = Uint32(pp[0])
                    b1 = Uint32(pp[1])
                if ok:
                    st_b32(vdst + Int64(q) * 8, a0)
                    st_b32(vdst + Int64(q) * 8 + 4, a1)
                    st_b32(vdst + 64 + Int64(q) * 8, b0)
                    st_b32(vdst + 64 + Int64(q) * 8 + 4, b1)
                    if q == 0:
                        if cutlass.const_expr(cfg.cache):
                            st_f32(sdst, s)
                        else:
                            st_f32(w_out + r * 4, fmul(ld_nc_f32(w_in + r * 4), s))
            else:
                cpb = 4 if cfg.fmt == "mxfp4" else 2
                ca, sa = self._fp4_chunk(fa, wa, cpb, g_dec, mult, gnan, abs_inf)
                cb, sbb = self._fp4_chunk(fb, wb, cpb, g_dec, mult, gnan, abs_inf)
                if ok:
                    st_b32(vdst + Int64(q) * 4, ca)
                    st_b32(vdst + 32 + Int64(q) * 4, cb)
                    if q % cpb == 0:
                        st_u8(sdst + Int64(q // cpb), sa)
                        st_u8(sdst + (8 // cpb) + Int64(q // cpb), sbb)
                    if cutlass.const_expr(not cfg.cache):
                        if q == 0:
                            st_b32(w_out + r * 4, ld_nc_b32(w_in + r * 4))

        def _fp4_chunk(self, f, w, cpb: int, g_dec, mult, gnan, abs_inf: int):
            """(code word, scale byte) of one 8-value chunk, the per-chunk body of
            ``quantize_fp4.py`` (MXFP4 DSV4 rule / NVFP4 given global scale, OCP NaN rule)."""
            hb = chunk_absmax(w)
            for o in range(cpb.bit_length() - 1):
                hb = shfl_bfly_max(hb, 1 << o)
            bad = (Uint32(hb >= Uint32(abs_inf)) | gnan) != Uint32(0)
            vmax = half_to_f32(hb, False)
            if self.cfg.fmt == "nvfp4":
                sf = fmin(fmul(vmax, mult), Float32(448.0))
                sbyte = e4m3x2(sf, Float32(0.0))
                s = e4m3_to_f32(sbyte)
                enc = fmin(frcp(fmul(s, g_dec)), bits_f32(Uint32(F32_FLT_MAX)))
                code = e2m1x8_encode(f, enc, w)
                code = cutlass.select_(s == Float32(0.0), code & Uint32(0x88888888), code)
                nan_byte = 0x7F
            else:
                tt = fmul(fmax(vmax, bits_f32(Uint32(F32_MX_FLOOR))), bits_f32(Uint32(F32_INV6)))
                sbyte = ue8m0_ceil_byte(tt)
                code = e2m1x8_encode(f, bits_f32((Uint32(254) - sbyte) << 23), w)
                nan_byte = 0xFF
            return cutlass.select_(bad, Uint32(0), code), cutlass.select_(bad, Uint32(nan_byte), sbyte)


def compile_indexer_quant(cfg: IndexerQuantConfig, arch: str = "sm_90a", extra: str = ""):
    from cutlass.cute.runtime import make_fake_stream
    z, i = Int64(0), Int32(0)
    return cute.compile(IndexerQuantKernel(cfg), z, z, z, z, z, z, z, z, i, z, i, make_fake_stream(),
                        options=compile_options(arch, extra))


def _fn(cfg, dev):
    from dsv4.target import Target
    arch = Target.of(dev).arch
    return compile_cached(("indexer_quant", cfg, arch), lambda: compile_indexer_quant(cfg, arch))


def plan_groups(rows: int, sms: int) -> int:
    """4-row steps per warp iteration: 4 (16 rows, 8 loads per lane in flight) once every SM gets 4 warps of
    them, else 1 (decode sizes: the most warps, the shortest chain)."""
    return 4 if rows >= 16 * 4 * 4 * sms else 1


#: benchmark hook ({"groups": g, "warps": w, "ctas_per_sm": c} override the plan); empty in production
VARIANT: dict = {}


#: CTAs per SM and launch bound of the 16-rows-per-warp plan (groups 4; job kvmem8-01, 8 x 32768 MXFP4 keys,
#: bit-identical: 4 CTAs, no bound 48.6 us; 6 CTAs, bound 6 (<= 80 registers) 45.4; 8 / bound 8 46.8; groups 2 with
#: 12 / 12 45.4, with 8 / none 48.3; groups 1 with 16 46.7); the decode plan (groups 1) keeps 4 CTAs, no bound
LARGE_CTAS = 6


def _grid(rows: int, cfg: IndexerQuantConfig, dev) -> int:
    from .quantize import _sms
    need = -(-rows // (4 * cfg.groups * cfg.warps))
    per_sm = LARGE_CTAS if cfg.groups == 4 else 4                  # persistent: CTAs of 4 warps per SM
    return max(1, min(need, _sms(dev) * VARIANT.get("ctas_per_sm", per_sm)))


def _cfg(fmt: str, hadamard: bool, cache: bool, slot64: bool, rows: int, dev) -> IndexerQuantConfig:
    from .quantize import _sms
    g = VARIANT.get("groups", plan_groups(rows, _sms(dev)))
    return IndexerQuantConfig(fmt, hadamard, cache, slot64, g, VARIANT.get("warps", 4),
                              VARIANT.get("min_blocks", LARGE_CTAS if g == 4 else 0))


#: Ops whose DSL kernel passed the bit-exact H200 checks (jobs mem7-02 / mem7-03, 2026-12-01, with the fp64 rotation;
#: job kvmem8-01 with the fp32 contract: tests/test_indexer_quant.py -m gpu; every format x Hadamard x slot dtype,
#: skipped / out-of-range slots, NaN / Inf rows, extreme magnitudes and exponent spreads, both row plans, graph
#: replay); False: never a default, never forced.
VALIDATED = {"indexer_cache_write": True, "indexer_q_quant": True}
#: H200, job kvmem8-01 (CUDA-graph us, dsl / the CUDA indexer_quant_kernel, Hadamard on (fp32 contract), random
#: slots, copy BW 4276 GB/s): cache write 8 x 32768 keys MXFP4 48.7 / 99.8, FP8 59.0 / 72.9, NVFP4 49.1 / 96.7;
#: 128 keys 2.63 / 2.26, 2.41 / 2.07, 2.48 / 2.00; q quant T=4096 MXFP4 46.3 / 87.2, FP8 53.8 / 62.4, NVFP4 44.8 /
#: 84.4; T=64 (4096 rows) 2.79 / 3.12, 2.75 / 2.57, 2.69 / 2.96; T=1 2.33 / 2.08, 2.17 / 1.92, 2.22 / 1.87.
MEASURED = ("H200 kvmem8-01: cuda faster up to 128 keys / 64 q rows (2.26 vs dsl 2.63 us, MXFP4), even at 4096 rows "
            "(+-0.3 us), dsl 1.2-2.1x faster at 262144 rows (8x32k keys 48.7 vs 99.8 us)")


#: the smallest row-count class (``problem["rows"]``, dsv4.ops.indexer.row_class) from which this provider is the
#: default (below it the cuda provider, measured faster there: :data:`MEASURED`); forcing it works at every size
MIN_ROWS = {"indexer_cache_write": 1 << 13, "indexer_q_quant": 1 << 13}


class _Base(DslProvider):
    def _gate(self, problem):
        """Validated, and a problem of at least :data:`MIN_ROWS` rows, or forced (``registry.use`` /
        ``DSV4_OPS``)."""
        if not VALIDATED[self.op.name]:
            return Support.no("dsl: kernel not validated on the H200 yet (issue 16)")
        from dsv4 import registry
        if registry._forced_kind(self.op.name) == "dsl":
            return None
        if problem.get("rows", 0) < MIN_ROWS[self.op.name]:
            return Support.no(f"dsl: a row class under {MIN_ROWS[self.op.name]}: the cuda provider ({MEASURED})")
        return None


class DslCacheWrite(_Base):
    describe = ("indexer_quant.py: 8 lanes per row, fp32 FWHT (in-thread + 3 shuffle stages), E2M1/E4M3 encode "
                "as quantize_fp4/fp8.py, paged store")

    def supports_problem(self, problem):
        no = self._gate(problem)
        return no if no is not None else Support.yes(f"sm_90a, every format, hadamard or not ({MEASURED})")

    def run(self, problem, *, cache, k, slot_mapping, global_scale):
        n = k.shape[0]
        if n == 0:
            return None
        nb, bs = cache.shape[0], cache.shape[1]
        if nb * bs >= 1 << 31:
            raise ValueError(f"indexer_cache_write (dsl): num_blocks * block_size = {nb * bs} must be < 2^31")
        cfg = _cfg(problem["fmt"], problem["hadamard"] in (True, 1), True, slot_mapping.dtype.itemsize == 8, n, k.device)
        g = global_scale if global_scale is not None else k
        launch_on(k.device, _fn(cfg, k.device), i64(k.data_ptr()), i64(slot_mapping.data_ptr()), i64(g.data_ptr()),
                  i64(cache.data_ptr()), i64(0), i64(0), i64(0), i64(n), i32(bs), i64(nb * bs),
                  i32(_grid(n, cfg, k.device)))
        return None


class DslQQuant(_Base):
    describe = "indexer_quant.py (q mode): 8 lanes per (t, h) row, fp32 FWHT, encode as quantize_fp4/fp8.py"

    def supports_problem(self, problem):
        no = self._gate(problem)
        return no if no is not None else Support.yes(f"sm_90a, every format, hadamard or not ({MEASURED})")

    def run(self, problem, *, q, w, global_scale):
        from dsv4.ops.indexer import q_quant_outputs
        fmt = problem["fmt"]
        q_data, q_sf, w_out = q_quant_outputs(q, fmt)
        rows = q.shape[0] * 64
        if rows == 0:
            return q_data, q_sf, w_out
        cfg = _cfg(fmt, problem["hadamard"] in (True, 1), False, True, rows, q.device)
        g = global_scale if global_scale is not None else w
        sfp = q_sf if fmt != "fp8" else q_data
        launch_on(q.device, _fn(cfg, q.device), i64(q.data_ptr()), i64(0), i64(g.data_ptr()), i64(q_data.data_ptr()),
                  i64(sfp.data_ptr()), i64(w.data_ptr()), i64(w_out.data_ptr()), i64(rows), i32(1), i64(0),
                  i32(_grid(rows, cfg, q.device)))
        return q_data, q_sf, w_out


PROVIDERS = {"indexer_cache_write": DslCacheWrite, "indexer_q_quant": DslQQuant}

#: the specializations the CPU compile check builds (every format, both modes, both slot dtypes)
CHECK_VARIANTS = {
    "cache-mxfp4-had-i64": dict(fmt="mxfp4"),
    "cache-nvfp4-had-i32": dict(fmt="nvfp4", slot64=False),
    "cache-fp8-nohad-i64": dict(fmt="fp8", hadamard=False),
    "q-mxfp4-had": dict(fmt="mxfp4", cache=False),
    "q-nvfp4-nohad": dict(fmt="nvfp4", hadamard=False, cache=False),
    "q-fp8-had": dict(fmt="fp8", cache=False),
}


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile every :data:`CHECK_VARIANTS` entry for ``arch`` on the CPU; ``{variant: PTX text}``."""
    builds = {n: (lambda a, e, kw=kw: compile_indexer_quant(IndexerQuantConfig(**kw), a, e))
              for n, kw in CHECK_VARIANTS.items()}
    return compile_variants("indexer_quant", builds, dump_dir, arch, only)
