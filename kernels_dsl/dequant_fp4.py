"""CuTe DSL provider for ``dequant_fp4``: packed E2M1 + block scales -> bf16 / fp32.

Contract: docs/layouts/dequant_fp4.md (``dsv4.ops.dequant_fp4.SPEC``). Per element, in fp32,
rounded once to the output dtype:

* MXFP4: ``out = e2m1(code) * 2^(sf - 127)``            (UE8M0, one per 32 along K)
* NVFP4: ``out = (e2m1(code) * e4m3(sf)) * global_scale`` (E4M3, one per 16 along K)

Same algorithm as ``kernels_cuda/dequant_fp4.cu`` (the ``cuda`` provider) so the two agree
bit for bit: E2M1 is decoded with a byte LUT through ``prmt.b32`` (never arithmetic on the
nibble, seed 000), and the same coalesced warp-tiled mapping: a warp owns 128 packed words;
each lane loads one 16-byte chunk (``ld.global.nc.v4``, transposed through 512 B of shared
memory per warp) and in step j decodes word 32 j + lane, so every 16-byte store instruction of
the warp writes one contiguous 512 B span (bf16).

The compiled kernel is specialized on ``(fmt, out dtype, arch)`` only; ``M`` and ``K`` are
symbolic (``cute.sym_int``), so one compile serves every size. Launches take tensors through
``cute.runtime.from_dlpack`` (no ``apache-tvm-ffi`` needed) and run on torch's current stream.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, launch_on

try:  # the DSL is optional at import time: the provider then reports "unavailable"
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int64, Uint8, Uint32
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T, dsl_user_op
    from cutlass.memory import SmemAllocator
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["DequantFp4Kernel", "DslDequantFp4", "PROVIDERS", "compile_check", "PTX_PATTERNS"]

#: Scale block size (values per scale factor) of each format.
SF = {"mxfp4": 32, "nvfp4": 16}
#: What every compiled variant's PTX must contain (checked by tests/test_compile_dsl.py).
PTX_PATTERNS = (r"prmt\.b32", r"ld\.global\.nc\.v4\.(b|u)32", r"st\.global\.v4\.(b|u)32")
#: What it must not contain: flush-to-zero would break bit-exactness on subnormal scales.
PTX_FORBIDDEN = (r"\.ftz\b",)

# bf16 byte LUTs of the E2M1 magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6] = bf16 0x0000 0x3F00 0x3F80
# 0x3FC0 0x4000 0x4040 0x4080 0x40C0 (same constants as kernels_cuda/common.cuh). prmt with the
# 3-bit index as selector picks byte idx of the 8-byte pool {B:A}.
_E2M1_HI_A = 0x3F3F3F00  # idx 3..0 -> 3F 3F 3F 00 (high bytes)
_E2M1_HI_B = 0x40404040  # idx 7..4
_E2M1_LO_A = 0xC0800000  # idx 3..0 -> C0 80 00 00 (low bytes)
_E2M1_LO_B = 0xC0804000  # idx 7..4 -> C0 80 40 00
_F32_2POW_M127 = 0x00400000  # UE8M0 byte 0 = 2^-127, an fp32 subnormal
_F32_QNAN = 0x7FC00000       # UE8M0 byte 0xFF


if _HAVE_DSL:

    @dsl_user_op
    def _prmt(a, b, sel, *, loc=None, ip=None):
        """``prmt.b32 d, a, b, sel``: byte permute of the pool {b:a} (pure: no side effects)."""
        return Uint32(llvm.inline_asm(
            T.i32(),
            [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip),
             Uint32(sel).ir_value(loc=loc, ip=ip)],
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc, ip=ip))

    @dsl_user_op
    def _bits_to_f32(u, *, loc=None, ip=None):
        """Reinterpret 32 bits as fp32."""
        return Float32(llvm.bitcast(T.f32(), Uint32(u).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))

    class DequantFp4Kernel:
        """Block-scaled FP4 (E2M1) dequantization with warp-tiled, coalesced stores.

        ``__call__(mData, mScale, mOut, mGlobal, stream)``:

        * ``mData``: Uint8 ``[M, K/2]`` row-major, 16 B aligned base, 2 x E2M1 per byte
          (element 2i in the low nibble; nibble bit 3 = sign, bits 2:0 index the levels).
        * ``mScale``: Uint8 view of the scales, ``[M, K/SF]`` row-major: UE8M0 bytes (mxfp4,
          SF = 32) or E4M3 bytes (nvfp4, SF = 16).
        * ``mOut``: BFloat16 / Float32 ``[M, K]`` row-major, 16 B aligned base.
        * ``mGlobal``: nvfp4: Float32 ``[1]`` decode multiplier; mxfp4: ``None``.

        Mapping (same as ``kernels_cuda/dequant_fp4.cu``): all three tensors are walked as flat
        arrays (``K % 32 == 0``: a 32-value chunk never straddles a row). A warp owns a tile of
        128 packed 32-bit words (1024 values). Lane ``l`` loads the tile's 16-byte chunk ``l``
        with one coalesced ``ld.global.nc.v4`` (512 B per warp instruction) and parks it in
        shared memory; after ``bar.warp.sync`` it reads back word ``32 j + l`` for steps
        ``j = 0..3`` (conflict-free ``ld.shared.b32``), decodes its 8 values and stores them
        with one 16 B (bf16) or two 16 B (fp32) stores next to its neighbours': every store
        instruction of the warp writes one contiguous 512 B (bf16) span. The 4 scale bytes
        (one per word: byte ``i >> 2`` for mxfp4, ``i >> 1`` for nvfp4) are loaded before
        the first decode. ``threads`` per CTA, 16 B of shared memory per thread.

        Constraints: ``K % 32 == 0``; tensors contiguous; ``M * K / 8 < 2^63`` (64-bit word index).
        """

        def __init__(self, fmt: str, out_dtype, threads: int = 256):
            if fmt not in SF:
                raise ValueError(f"fmt must be one of {sorted(SF)}, got {fmt!r}")
            if threads % 32:
                raise ValueError(f"threads must be a multiple of 32, got {threads}")
            self.fmt = fmt
            self.out_dtype = out_dtype
            self.threads = threads
            self.sf_per_chunk = 32 // SF[fmt]  # scale bytes per 32-value chunk: 1 or 2

        @cute.jit
        def __call__(self, mData: cute.Tensor, mScale: cute.Tensor, mOut: cute.Tensor,
                     mGlobal: Optional[cute.Tensor], stream: cuda.CUstream):
            m, kp = mData.shape
            n_chunks = Int64(m) * Int64(kp) // 16
            # flat views (every operand is compact row-major, a chunk never straddles a row):
            # data ((16),(n_chunks)) bytes, scale ((1),(n_sf)) bytes, out ((8),(n_words)) values
            gData = cute.zipped_divide(cute.make_tensor(mData.iterator, cute.make_layout(n_chunks * 16)), (16,))
            gScale = cute.zipped_divide(
                cute.make_tensor(mScale.iterator, cute.make_layout(n_chunks * self.sf_per_chunk)), (1,))
            gOut = cute.zipped_divide(cute.make_tensor(mOut.iterator, cute.make_layout(n_chunks * 32)), (8,))
            self.kernel(gData, gScale, gOut, mGlobal, n_chunks).launch(
                grid=[cute.ceil_div(n_chunks, self.threads), 1, 1], block=[self.threads, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, gData: cute.Tensor, gScale: cute.Tensor, gOut: cute.Tensor,
                   mGlobal: Optional[cute.Tensor], n_chunks: Int64):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            warp = tidx // 32
            c = Int64(bidx) * self.threads + Int64(tidx)           # the 16-byte chunk this lane loads
            base = (Int64(bidx) * self.threads + Int64(warp * 32)) * 4   # first word of the warp tile
            n_words = n_chunks * 4

            # per-warp staging tile: 32 lanes x 16 B, written as chunks, read back as words
            sTile = SmemAllocator().allocate_tensor(Uint32, cute.make_layout((4, self.threads)), byte_alignment=16)
            sChunks = sTile[(None, tidx)]                            # this lane's 16 B
            sWords = cute.make_tensor(sTile[(None, warp * 32)].iterator, cute.make_layout(128))  # the warp's 128 words

            # 16 B of packed E2M1 through the read-only path: ld.global.nc.v4, coalesced per warp
            ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=128, invariant=True)
            rData = cute.make_rmem_tensor((16,), Uint8)
            rData.fill(0)
            if c < n_chunks:
                cute.copy(ld16, gData[(None, c)], rData)
            st16s = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
            cute.copy(st16s, cute.recast_tensor(rData, Uint32), sChunks)

            # the 4 scale bytes of words base + 32 j + lane, all issued before the first decode
            ld_sf = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=8, invariant=True)
            rScale = cute.make_rmem_tensor((4,), Uint8)
            rScale.fill(0)
            for j in cutlass.range_constexpr(4):
                i = base + j * 32 + Int64(lane)
                if i < n_words:
                    sf_idx = i >> 2 if cutlass.const_expr(self.fmt == "mxfp4") else i >> 1
                    cute.copy(ld_sf, gScale[(None, sf_idx)], cute.zipped_divide(rScale, (1,))[(None, j)])
            g = Float32(1.0)
            if cutlass.const_expr(self.fmt == "nvfp4"):
                g = mGlobal[0]
            sv = cute.make_rmem_tensor((4,), Float32)
            if cutlass.const_expr(self.fmt == "mxfp4"):
                for j in cutlass.range_constexpr(4):
                    # UE8M0 byte b -> 2^(b-127): exponent field b; b = 0 -> 2^-127 (subnormal); 0xFF -> NaN
                    b = Uint32(rScale[j])
                    bits = b << 23
                    bits = Uint32(cutlass.select_(b == 0, Uint32(_F32_2POW_M127), bits))
                    bits = Uint32(cutlass.select_(b == 0xFF, Uint32(_F32_QNAN), bits))
                    sv[j] = _bits_to_f32(bits)
            else:
                # E4M3 bytes -> fp32 (exact: every E4M3 value is an fp16/fp32 value)
                sv.store(cute.recast_tensor(rScale, cutlass.Float8E4M3FN).load().to(Float32))

            cute.arch.sync_warp()
            vec = 16 // (self.out_dtype.width // 8)  # elements per 16-byte store
            st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
            for j in cutlass.range_constexpr(4):
                i = base + j * 32 + Int64(lane)
                w = sWords[j * 32 + lane]                            # ld.shared.b32, conflict-free
                s = sv[j]
                idx = w & Uint32(0x77777777)
                lo_a = _prmt(_E2M1_LO_A, _E2M1_LO_B, idx)              # low bytes of values 0..3
                hi_a = _prmt(_E2M1_HI_A, _E2M1_HI_B, idx)              # high bytes of values 0..3
                lo_b = _prmt(_E2M1_LO_A, _E2M1_LO_B, idx >> 16)        # values 4..7
                hi_b = _prmt(_E2M1_HI_A, _E2M1_HI_B, idx >> 16)
                sg = w & Uint32(0x88888888)                            # sign of value e at bit 4e+3
                # bf16 pairs {value 2p (low half), value 2p+1 (high half)}, sign moved to bit 15 / 31
                p0 = _prmt(lo_a, hi_a, 0x5140) | ((sg << 12) & Uint32(0x00008000)) | ((sg << 24) & Uint32(0x80000000))
                p1 = _prmt(lo_a, hi_a, 0x7362) | ((sg << 4) & Uint32(0x00008000)) | ((sg << 16) & Uint32(0x80000000))
                p2 = _prmt(lo_b, hi_b, 0x5140) | ((sg >> 4) & Uint32(0x00008000)) | ((sg << 8) & Uint32(0x80000000))
                p3 = _prmt(lo_b, hi_b, 0x7362) | ((sg >> 12) & Uint32(0x00008000)) | (sg & Uint32(0x80000000))
                pairs = (p0, p1, p2, p3)
                rOut = cute.make_rmem_tensor((8,), Float32)
                for p in cutlass.range_constexpr(4):
                    # bf16 -> fp32 is a 16-bit shift (the E2M1 levels are exact in bf16)
                    v_lo = _bits_to_f32(pairs[p] << 16) * s
                    v_hi = _bits_to_f32(pairs[p] & Uint32(0xFFFF0000)) * s
                    if cutlass.const_expr(self.fmt == "nvfp4"):
                        v_lo = v_lo * g
                        v_hi = v_hi * g
                    rOut[2 * p] = v_lo
                    rOut[2 * p + 1] = v_hi
                if i < n_words:
                    # one rounding to the output dtype, then 16-byte stores (512 B contiguous per warp)
                    dst = cute.logical_divide(gOut[(None, i)], (vec,))
                    if cutlass.const_expr(self.out_dtype == Float32):
                        cute.copy(st16, cute.logical_divide(rOut, (vec,)), dst)
                    else:
                        rCvt = cute.make_rmem_tensor((8,), self.out_dtype)
                        rCvt.store(rOut.load().to(self.out_dtype))
                        cute.copy(st16, cute.logical_divide(rCvt, (vec,)), dst)


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
    return data, scale, outt, glob, make_fake_stream()


def _compile(fmt: str, out: str, arch: str, extra: str = ""):
    kern = DequantFp4Kernel(fmt, getattr(cutlass, _OUT_DSL[out]))
    return cute.compile(kern, *_fake_args(fmt, out), options=compile_options(arch, extra))


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile every specialization for ``arch`` without a GPU; return ``{variant: PTX text}``.

    Used by tests/test_compile_dsl.py (which asserts ``PTX_PATTERNS`` / ``PTX_FORBIDDEN``).
    """
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = dump_dir or tmp
        os.makedirs(d, exist_ok=True)
        for fmt in SF:
            for o in _OUT_DSL:
                fn = _compile(fmt, o, arch, f"--keep-ptx --dump-dir {d}")
                ptx = fn.__ptx__
                if ptx is None or not ptx.lstrip().startswith(("//", ".version")):
                    raise RuntimeError(f"no PTX text for dequant_fp4 {fmt}/{o} (got {str(ptx)[:200]!r})")
                out[f"{fmt}-{o}"] = ptx
    return out


class DslDequantFp4(DslProvider):
    describe = "CuTe DSL DequantFp4Kernel: prmt byte-LUT E2M1 decode, 16 B ld.global.nc / st.global"

    def supports_problem(self, problem):
        if problem.get("fmt") not in SF:
            return Support.no(f"dsl: unknown fmt {problem.get('fmt')!r}")
        if problem.get("out_dtype") not in _OUT_DSL:
            return Support.no(f"dsl: out_dtype {problem.get('out_dtype')} not in {sorted(_OUT_DSL)}")
        if problem["K"] % 32:
            return Support.no(f"dsl: K={problem['K']} is not a multiple of 32 (one 16-byte chunk = 32 values per thread)")
        return Support.yes("sm_90a, K % 32 == 0")

    def run(self, problem, *, data, scale, global_scale):
        import torch
        from cutlass.cute.runtime import from_dlpack

        from dsv4.ops._common import str_dtype
        from dsv4.target import Target
        fmt, out_name = problem["fmt"], problem["out_dtype"]
        M, K = data.shape[0], 2 * data.shape[1]
        out = torch.empty((M, K), dtype=str_dtype(out_name), device=data.device)
        if M == 0 or K == 0:
            return out
        arch = Target.of(data.device).arch
        fn = compile_cached(("dequant_fp4", fmt, out_name, arch), lambda: _compile(fmt, out_name, arch))
        g = None
        if fmt == "nvfp4":
            g = from_dlpack(global_scale, assumed_align=4)  # static [1], like the fake tensor
        args = (from_dlpack(data, assumed_align=16).mark_layout_dynamic(leading_dim=1),
                from_dlpack(scale.view(torch.uint8), assumed_align=_SCALE_ALIGN[fmt]).mark_layout_dynamic(leading_dim=1),
                from_dlpack(out, assumed_align=16).mark_layout_dynamic(leading_dim=1), g)
        launch_on(data.device, fn, *args)
        return out


PROVIDERS = {"dequant_fp4": DslDequantFp4}
