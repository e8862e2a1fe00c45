"""CuTe DSL provider for ``dequant_fp4``: packed E2M1 + block scales -> bf16 / fp32.

Contract: docs/layouts/dequant_fp4.md (``dsv4.ops.dequant_fp4.SPEC``). Per element, in fp32,
rounded once to the output dtype:

* MXFP4: ``out = e2m1(code) * 2^(sf - 127)``            (UE8M0, one per 32 along K)
* NVFP4: ``out = (e2m1(code) * e4m3(sf)) * global_scale`` (E4M3, one per 16 along K)

E2M1 is decoded with the project's one FP4 decoder (``kernels_dsl/sm90/fp4.py``
``e2m1x8_to_bf16x8``: a byte LUT through ``prmt.b32``, never arithmetic on the nibble, seed
000). Warp-tiled mapping (:class:`DequantFp4Kernel`): lanes load 16-byte chunks, park them in
shared memory, and every 16-byte store instruction of a warp writes one contiguous 512 B span,
for bf16 and fp32 output alike. NaN scales (UE8M0 0xFF, E4M3 0x7F / 0xFF) decode their block
to NaN; a NaN global scale gives NaN everywhere (issue 19 items 4 / 13).

The compiled kernel is specialized on ``(fmt, out dtype, arch)`` only; ``M`` and ``K`` are
symbolic (``cute.sym_int``), so one compile serves every size. Launches take tensors through
``cute.runtime.from_dlpack`` (no ``apache-tvm-ffi`` needed) and run on torch's current stream.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, dl, i32, launch_on

try:  # the DSL is optional at import time: the provider then reports "unavailable"
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint8, Uint32
    from cutlass.memory import SmemAllocator

    from ._quantize_ptx import kernel_prologue, pdl_epilogue, pdl_launch_kw
    from .sm90 import fp4
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["DequantFp4Config", "DequantFp4Kernel", "DslDequantFp4", "PROVIDERS", "compile_check", "PTX_PATTERNS"]

#: Scale block size (values per scale factor) of each format.
SF = {"mxfp4": 32, "nvfp4": 16}
#: What every compiled variant's PTX must contain (checked by tests/test_compile_dsl.py).
PTX_PATTERNS = (r"prmt\.b32", r"ld\.global\.nc\.v4\.(b|u)32", r"st\.global\.v4\.(b|u)32", r"griddepcontrol\.wait")
#: What it must not contain: flush-to-zero would break bit-exactness on subnormal scales.
PTX_FORBIDDEN = (r"\.ftz\b",)



@dataclass(frozen=True)
class DequantFp4Config:
    """Launch shape: ``threads`` per CTA, ``tiles`` 512-byte input tiles per warp (all loaded
    before the first decode: ``16 * tiles`` bytes in flight per lane); ``ctas_per_sm`` > 0 caps
    the grid at that many CTAs per SM, which then stride over the blocks of tiles (persistent);
    ``l2_prefetch`` (0, 64, 128, 256): the ``.L2::<n>B`` prefetch size of the input loads."""
    threads: int = 128
    tiles: int = 1
    ctas_per_sm: int = 0
    l2_prefetch: int = 0


#: the configuration the provider launches (bench/bench_dequant_fp4.py times others through
#: :data:`VARIANT`): 128 threads x 1 tile, the fastest of the launch geometries swept at 8192^2 with and
#: without PDL (docs/benchmarks.md, "dequant_fp4").
DEFAULT_CONFIG = DequantFp4Config()
#: benchmark hook: ``{"config": DequantFp4Config(...)}`` overrides the default; empty in production
VARIANT: dict = {}


if _HAVE_DSL:

    def l2_prefetch_kw(n: int) -> dict:
        """CopyG2ROp attributes of a read-once 16-byte load: ``ld.global.nc`` (0), or with an
        ``.L2::<n>B`` prefetch (64 / 128 / 256; the DSL does not combine it with ``.nc``)."""
        P = cute.nvgpu.L2PrefetchSize
        if n == 0:
            return {"invariant": True}
        return {"l2_prefetch_size": {64: P.SIZE_64B, 128: P.SIZE_128B, 256: P.SIZE_256B}[n]}

    class DequantFp4Kernel:
        """Block-scaled FP4 (E2M1) dequantization with warp-tiled, coalesced 16-byte accesses.

        ``__call__(mData, mScale, mOut, mGlobal, stream)``:

        * ``mData``: Uint8 ``[M, K/2]`` row-major, 16 B aligned base, 2 x E2M1 per byte
          (element 2i in the low nibble; nibble bit 3 = sign, bits 2:0 index the levels).
        * ``mScale``: Uint8 view of the scales, ``[M, K/SF]`` row-major: UE8M0 bytes (mxfp4,
          SF = 32) or E4M3 bytes (nvfp4, SF = 16).
        * ``mOut``: BFloat16 / Float32 ``[M, K]`` row-major, 16 B aligned base.
        * ``mGlobal``: nvfp4: Float32 ``[1]`` decode multiplier; mxfp4: ``None``.

        Mapping: all three tensors are walked as flat arrays (``K % 32 == 0``: a 32-value
        chunk never straddles a row). A warp owns ``tiles`` tiles of 32 chunks (a chunk = 16 B
        of packed input = 4 words = 32 values). Lane ``l`` loads chunk ``l`` of each tile with one
        ``ld.global.nc.v4`` (512 B contiguous per warp instruction) and the chunk's 1 (mxfp4)
        or 2 (nvfp4) scale bytes with one load, decodes the scales to fp32 and parks chunk and
        scales in shared memory. After ``bar.warp.sync``, store step ``j`` of a tile writes its
        16-byte output units ``32 j + l`` (lane ``l``): one unit is a word's 8 values (bf16) or
        half a word's 4 values (fp32), so every 16-byte store instruction of the warp writes one
        contiguous 512 B span, for both output dtypes (fp32: 8 steps of 512 B per tile).
        Shared memory reads: a word per unit (two lanes share it for fp32: broadcast) and its
        scale (broadcast). One launch, no host sync.

        Constraints: ``K % 32 == 0``; tensors contiguous; ``M * K / 32 < 2^62``.
        """

        def __init__(self, fmt: str, out_dtype, config: "DequantFp4Config" = None):
            if fmt not in SF:
                raise ValueError(f"fmt must be one of {sorted(SF)}, got {fmt!r}")
            cfg = config or DequantFp4Config()
            if cfg.threads % 32 or not 32 <= cfg.threads <= 1024:
                raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {cfg.threads}")
            self.fmt = fmt
            self.out_dtype = out_dtype
            self.cfg = cfg
            self.threads = cfg.threads
            self.tiles = cfg.tiles
            self.spc = 32 // SF[fmt]                 # scale bytes per chunk: 1 (mxfp4) or 2 (nvfp4)
            self.vec = 16 // (out_dtype.width // 8)  # values per 16-byte output unit: 8 or 4
            self.upw = 8 // self.vec                 # units per word: 1 (bf16) or 2 (fp32)

        @cute.jit
        def __call__(self, mData: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor,
                     mGlobal: Optional[cute.Tensor], max_ctas: Int32, stream: cuda.CUstream):
            m, kp = mData.shape
            n_chunks = Int64(m) * Int64(kp) // 16
            # flat views: data ((16),(n_chunks)) bytes, scales ((spc),(n_chunks)) bytes,
            # out ((vec),(n_units)) values
            gData = cute.zipped_divide(cute.make_tensor(mData.iterator, cute.make_layout(n_chunks * 16)), (16,))
            gScale = cute.zipped_divide(
                cute.make_tensor(mScale.iterator, cute.make_layout(n_chunks * self.spc)), (self.spc,))
            gOut = cute.zipped_divide(cute.make_tensor(mOut.iterator, cute.make_layout(n_chunks * 32)), (self.vec,))
            n_blocks = cute.ceil_div(n_chunks, self.threads * self.tiles)   # blocks of warps x tiles x 32 chunks
            grid = cutlass.min(n_blocks, Int64(max_ctas))
            self.kernel(gData, gScale, gOut, mGlobal, n_chunks, Int32(n_blocks)).launch(
                grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream, **pdl_launch_kw())

        @cute.kernel
        def kernel(self, gData: cute.Tensor, gScale: cute.Tensor, gOut: cute.Tensor,
                   mGlobal: Optional[cute.Tensor], n_chunks: Int64, n_blocks: Int32):
            _, lane, warp, bidx, gdim = kernel_prologue(True)      # (trigger at the start: quant9-02, 8192^2 equal)
            U = self.tiles

            # shared memory: chunk column (warp * U + u) * 32 + lane (4 words each, so a tile's
            # 128 words are contiguous), and its decoded scales
            smem = SmemAllocator()
            sData = smem.allocate_tensor(Uint32, cute.make_layout((4, self.threads * U)), byte_alignment=16)
            sScale = smem.allocate_tensor(Float32, cute.make_layout((self.spc, self.threads * U)), byte_alignment=16)

            ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=128,
                                       **l2_prefetch_kw(self.cfg.l2_prefetch))
            ld_sf = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=8 * self.spc, invariant=True)
            st16s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
            st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
            n_units = n_chunks * (4 * self.upw)
            vec = self.vec
            g = Float32(1.0)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                g = mGlobal[0]
            for blk in cutlass.range(Int32(bidx), n_blocks, Int32(gdim), unroll=1):
                # first chunk of this warp's tiles (tile u = chunks c0 + 32 u .. + 31)
                c0 = (Int64(blk) * (self.threads // 32) + Int64(warp)) * (32 * U)
                cute.arch.sync_warp()                        # smem of the previous block is consumed
                rData = cute.make_rmem_tensor((16, U), Uint8)
                rData.fill(0)
                rScale = cute.make_rmem_tensor((self.spc, U), Uint8)
                rScale.fill(0)
                for u in cutlass.range_constexpr(U):        # every load of the warp's tiles first
                    c = c0 + u * 32 + Int64(lane)
                    if c < n_chunks:
                        cute.copy(ld16, gData[(None, c)], rData[(None, u)])
                        cute.copy(ld_sf, gScale[(None, c)], rScale[(None, u)])
                for u in cutlass.range_constexpr(U):
                    col = (warp * U + u) * 32 + lane
                    cute.copy(st16s, cute.recast_tensor(rData[(None, u)], Uint32), sData[(None, col)])
                    for k in cutlass.range_constexpr(self.spc):
                        if cutlass.const_expr(self.fmt == "mxfp4"):
                            sScale[k, col] = fp4.ue8m0_to_f32(Uint32(rScale[k, u]))   # 0xFF -> NaN, 0 -> 2^-127
                        else:
                            sScale[k, col] = fp4.e4m3x2_to_f32x2(Uint32(rScale[k, u]))[0]  # exact; 0x7F/0xFF -> NaN
                cute.arch.sync_warp()

                for u in cutlass.range_constexpr(U):
                    col0 = (warp * U + u) * 32
                    sWords = cute.make_tensor(sData[(None, col0)].iterator, cute.make_layout(128))
                    sSc = cute.make_tensor(sScale[(None, col0)].iterator, cute.make_layout(32 * self.spc))
                    q0 = (c0 + u * 32) * (4 * self.upw)     # first output unit of the tile
                    for j in cutlass.range_constexpr(4 * self.upw):
                        q = j * 32 + lane                  # unit within the tile
                        wi = q // self.upw                 # its word
                        w = sWords[wi]
                        if cutlass.const_expr(self.upw == 2):
                            w = w >> ((q % 2) * 16)        # fp32: half q % 2 = nibbles 4h..4h+3
                        s = sSc[wi // (4 // self.spc)]     # chunk scale (mxfp4) / 16-value scale (nvfp4)
                        pairs = fp4.e2m1x8_to_bf16x8(w)
                        rOut = cute.make_rmem_tensor((vec,), Float32)
                        for p in cutlass.range_constexpr(vec // 2):
                            # bf16 -> fp32 is a 16-bit shift (the E2M1 levels are exact in bf16)
                            v_lo = fp4.bits_to_f32(pairs[p] << 16) * s
                            v_hi = fp4.bits_to_f32(pairs[p] & Uint32(0xFFFF0000)) * s
                            if cutlass.const_expr(self.fmt == "nvfp4"):
                                v_lo = v_lo * g
                                v_hi = v_hi * g
                            rOut[2 * p] = v_lo
                            rOut[2 * p + 1] = v_hi
                        qg = q0 + q
                        if qg < n_units:
                            # one rounding to the output dtype, then one 16-byte store (512 B contiguous per warp)
                            if cutlass.const_expr(self.out_dtype == Float32):
                                cute.copy(st16, rOut, gOut[(None, qg)])
                            else:
                                rCvt = cute.make_rmem_tensor((vec,), self.out_dtype)
                                rCvt.store(rOut.load().to(self.out_dtype))
                                cute.copy(st16, rCvt, gOut[(None, qg)])
            pdl_epilogue(True)


_OUT_DSL = {"bfloat16": "BFloat16", "float32": "Float32"}
#: byte alignment of the scale base pointer assumed by the kernel (the SPEC guarantees 2)
_SCALE_ALIGN = {"mxfp4": 1, "nvfp4": 2}


def _fake_args(fmt: str, out: str):
    """Fake tensors for one specialization: symbolic M and K (one compile serves all sizes)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    m = cute.sym_int32(symbol="M")
    kp = cute.sym_int32(divisibility=16, symbol="Kp")      # K/2, K % 32 == 0
    ks = cute.sym_int32(symbol="Ksf")                       # K/SF
    k = cute.sym_int32(divisibility=32, symbol="K")
    out_dt = getattr(cutlass, _OUT_DSL[out])
    data = make_fake_compact_tensor(Uint8, (m, kp), stride_order=(1, 0), assumed_align=16)
    scale = make_fake_compact_tensor(Uint8, (m, ks), stride_order=(1, 0), assumed_align=_SCALE_ALIGN[fmt])
    outt = make_fake_compact_tensor(out_dt, (m, k), stride_order=(1, 0), assumed_align=16)
    glob = make_fake_compact_tensor(Float32, (1,), assumed_align=4) if fmt == "nvfp4" else None
    return data, scale, outt, glob, Int32(1), make_fake_stream()


def _config() -> DequantFp4Config:
    return VARIANT.get("config", DEFAULT_CONFIG)


def _compile(fmt: str, out: str, arch: str, extra: str = "", config: DequantFp4Config | None = None):
    kern = DequantFp4Kernel(fmt, getattr(cutlass, _OUT_DSL[out]), config or _config())
    return cute.compile(kern, *_fake_args(fmt, out), options=compile_options(arch, extra))


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile every specialization for ``arch`` without a GPU; return ``{variant: PTX text}``.

    Used by tests/test_compile_dsl.py (which asserts ``PTX_PATTERNS`` / ``PTX_FORBIDDEN``).
    """
    from ._compile import compile_variants
    return compile_variants("dequant_fp4", {
        f"{fmt}-{o}": (lambda arch, extra, fmt=fmt, o=o: _compile(fmt, o, arch, extra)) for fmt in SF for o in _OUT_DSL},
        dump_dir, arch)


class DslDequantFp4(DslProvider):
    describe = ("CuTe DSL DequantFp4Kernel: prmt byte-LUT E2M1 decode, 16 B ld.global.nc, smem transpose, "
                "512 B-contiguous 16 B warp stores (bf16 and fp32)")

    def supports_problem(self, problem):
        if problem.get("fmt") not in SF:
            return Support.no(f"dsl: unknown fmt {problem.get('fmt')!r}")
        if problem.get("out_dtype") not in _OUT_DSL:
            return Support.no(f"dsl: out_dtype {problem.get('out_dtype')} not in {sorted(_OUT_DSL)}")
        if problem["K"] % 32:
            return Support.no(f"dsl: K={problem['K']} is not a multiple of 32 (one 16-byte chunk = 32 values per thread)")
        return Support.yes("sm_90a, K % 32 == 0, bf16 / fp32 out (timings: docs/benchmarks.md)")

    def config(self, problem, target=None):
        """The :class:`DequantFp4Config` ``run`` launches (one for every size)."""
        return _config()

    def run(self, problem, *, data, scale, global_scale):
        import torch

        from dsv4.ops._common import str_dtype
        from dsv4.target import Target
        fmt, out_name = problem["fmt"], problem["out_dtype"]
        M, K = data.shape[0], 2 * data.shape[1]
        out = torch.empty((M, K), dtype=str_dtype(out_name), device=data.device)
        if M == 0 or K == 0:
            return out
        target = Target.of(data.device)
        arch = target.arch
        cfg = self.config(problem)
        fn = compile_cached(("dequant_fp4", fmt, out_name, arch, cfg),
                            lambda: _compile(fmt, out_name, arch, config=cfg))
        g = dl(global_scale, 4, layout="static") if fmt == "nvfp4" else None   # static [1], like the fake
        args = (dl(data, 16), dl(scale.view(torch.uint8), _SCALE_ALIGN[fmt]), dl(out, 16), g)
        max_ctas = target.sm_count * cfg.ctas_per_sm if cfg.ctas_per_sm > 0 else 2 ** 31 - 1
        launch_on(data.device, fn, *args, i32(max_ctas))
        return out


PROVIDERS = {"dequant_fp4": DslDequantFp4}
