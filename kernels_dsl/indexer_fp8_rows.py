"""CuTe DSL kernel: MXFP4 indexer rows -> FP8 (E4M3) rows + one fp32 power-of-two scale per row.

The prefill indexer (kernels_dsl/indexer_prefill.py) multiplies every key tile with many query
blocks, so MXFP4 keys (and queries) are converted once, here, into the operand format of the
FP8 WGMMA instead of once per (query block, key tile) inside the GEMM. Same fold as the decode
kernel (kernels_dsl/indexer_paged.py) and kernels_dsl.sm90.fp4:

    row r: 128 E2M1 codes (64 B, element 2i in the low nibble) + 4 UE8M0 scales e_b (one per 32)
    E = max_b e_b;  out[r, j] = E4M3(level_j * 2^(e_b(j) - E + 6))  (exact while e_b >= E - 14)
    scale[r] = 2^(E - 133)   so that  out[r, j] * scale[r] == level_j * 2^(e_b(j) - 127)

Mapping: one thread per 16-byte chunk of packed codes = one 32-code block (its own UE8M0 scale);
``ld.global.nc.v4`` in, two 16-byte stores out, the scale word read once per thread (4 threads
of a row read the same word). Two row sets (queries and keys) per launch; both row counts are
symbolic: one compile serves every size.
"""
from __future__ import annotations

try:
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Int64, Uint8, Uint32

    from .sm90 import fp4
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["Fp8RowsKernel", "compile_check", "PTX_PATTERNS", "mxfp4_rows_to_fp8", "mxfp4_rows_to_fp8_pair"]

PTX_PATTERNS = (r"prmt\.b32", r"ld\.global\.nc\.v4\.(b|u)32", r"st\.global\.v4\.(b|u)32")
THREADS = 256


if _HAVE_DSL:

    class Fp8RowsKernel:
        """Two row sets (the prefill's queries and keys) in one launch.
        ``__call__(mValsA, mSfA, mOutA, mScaleA, mValsB, mSfB, mOutB, mScaleB, stream)``, per set:

        * ``mVals``: Uint8 ``[rows, 64]`` packed E2M1 (row-major, 16 B aligned).
        * ``mSf``: Uint8 ``[rows, 4]`` UE8M0 scales.
        * ``mOut``: Uint8 ``[rows, 128]`` E4M3 bytes (16 B aligned).
        * ``mScale``: Float32 ``[rows]`` per-row scale ``2^(E - 133)``.

        Chunks ``[0, 4 rowsA)`` convert set A, ``[4 rowsA, 4 (rowsA + rowsB))`` set B (either may be empty).
        """

        @cute.jit
        def __call__(self, mValsA: cute.Tensor, mSfA: cute.Tensor, mOutA: cute.Tensor, mScaleA: cute.Tensor,
                     mValsB: cute.Tensor, mSfB: cute.Tensor, mOutB: cute.Tensor, mScaleB: cute.Tensor,
                     stream: cuda.CUstream):
            n = (Int64(mValsA.shape[0]) + Int64(mValsB.shape[0])) * 4
            self.kernel(mValsA, mSfA, mOutA, mScaleA, mValsB, mSfB, mOutB, mScaleB).launch(
                grid=[cute.ceil_div(n, THREADS), 1, 1], block=[THREADS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mValsA: cute.Tensor, mSfA: cute.Tensor, mOutA: cute.Tensor, mScaleA: cute.Tensor,
                   mValsB: cute.Tensor, mSfB: cute.Tensor, mOutB: cute.Tensor, mScaleB: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            c = Int64(bidx) * THREADS + Int64(tidx)      # 16-byte chunk = (set, row, 32-code block qb)
            na = Int64(mValsA.shape[0]) * 4
            if c < na:
                self.chunk(mValsA, mSfA, mOutA, mScaleA, c)
            elif c < na + Int64(mValsB.shape[0]) * 4:
                self.chunk(mValsB, mSfB, mOutB, mScaleB, c - na)

        @cute.jit
        def chunk(self, mVals: cute.Tensor, mSf: cute.Tensor, mOut: cute.Tensor, mScale: cute.Tensor, c: Int64):
            """Chunk ``c`` (< 4 rows) of one row set: 32 codes of row ``c // 4`` to E4M3, the row scale once."""
            r = c // 4
            qb = Int32(c % 4)
            ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=128, invariant=True)
            src = cute.zipped_divide(mVals[(r, None)], (16,))
            rv = cute.make_rmem_tensor((16,), Uint8)
            cute.copy(ld16, src[(None, qb)], rv)
            ld4 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Uint8, num_bits_per_copy=32, invariant=True)
            rs = cute.make_rmem_tensor((4,), Uint8)
            cute.copy(ld4, mSf[(r, None)], rs)
            u = cute.recast_tensor(rs, Uint32)[0]
            e01 = cutlass.max(Int32(u & Uint32(0xFF)), Int32((u >> 8) & Uint32(0xFF)))
            e23 = cutlass.max(Int32((u >> 16) & Uint32(0xFF)), Int32(u >> 24))
            ek = cutlass.max(e01, e23)
            d = Int32((u >> (Uint32(qb) * 8)) & Uint32(0xFF)) - ek + 6
            lo, hi = fp4.e4m3_lut(d)
            w = cute.recast_tensor(rv, Uint32)
            ro = cute.make_rmem_tensor((8,), Uint32)
            for j in cutlass.range_constexpr(4):
                o0, o1 = fp4.e2m1x8_to_e4m3x8(w[j], lo, hi)
                ro[2 * j] = o0
                ro[2 * j + 1] = o1
            st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Uint32, num_bits_per_copy=128)
            dst = cute.zipped_divide(cute.recast_tensor(mOut[(r, None)], Uint32), (4,))
            rov = cute.zipped_divide(ro, (4,))
            cute.copy(st16, rov[(None, 0)], dst[(None, 2 * qb)])
            cute.copy(st16, rov[(None, 1)], dst[(None, 2 * qb + 1)])
            if qb == 0:
                mScale[r] = fp4.ue8m0_to_f32(Uint32(ek)) * Float32(2.0 ** -6)


def _fake_args():
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    sets = []
    for name in ("rows_a", "rows_b"):                 # only the two row counts are symbolic
        rows = cute.sym_int32(symbol=name)
        sets += [make_fake_compact_tensor(Uint8, (rows, 64), stride_order=(1, 0), assumed_align=16),
                 make_fake_compact_tensor(Uint8, (rows, 4), stride_order=(1, 0), assumed_align=4),
                 make_fake_compact_tensor(Uint8, (rows, 128), stride_order=(1, 0), assumed_align=16),
                 make_fake_compact_tensor(Float32, (rows,), assumed_align=4)]
    return (*sets, make_fake_stream())


def compile_rows(arch: str, extra: str = ""):
    from ._compile import compile_options
    return cute.compile(Fp8RowsKernel(), *_fake_args(), options=compile_options(arch, extra))


def compile_check(dump_dir=None, arch: str = "sm_90a") -> dict:
    from ._compile import compile_variants
    return compile_variants("indexer_fp8_rows", {"mxfp4-to-fp8": compile_rows}, dump_dir, arch)


def _prepared(vals, sf):
    vals, sf = vals.contiguous(), sf.contiguous()
    if vals.data_ptr() % 16:
        vals = vals.clone()
    if sf.data_ptr() % 4:
        sf = sf.clone()
    return vals, sf


def _pair_into(vals_a, sf_a, out_a, scale_a, vals_b, sf_b, out_b, scale_b) -> None:
    """The launch of :class:`Fp8RowsKernel` on prepared row sets and their outputs."""
    from dsv4.target import Target

    from ._compile import compile_cached, current_stream, dl
    arch = Target.of(vals_a.device).arch
    fn = compile_cached(("indexer_fp8_rows", arch), lambda: compile_rows(arch))
    # only the row counts are symbolic in the compiled kernel
    fn(dl(vals_a, 16, layout="rows"), dl(sf_a, 4, layout="rows"), dl(out_a, 16, layout="rows"), dl(scale_a, 4),
       dl(vals_b, 16, layout="rows"), dl(sf_b, 4, layout="rows"), dl(out_b, 16, layout="rows"), dl(scale_b, 4),
       current_stream())


def mxfp4_rows_to_fp8_pair(vals_a, sf_a, vals_b, sf_b):
    """Two row sets in ONE launch: torch uint8 ``[rows_x, 64]`` + ``[rows_x, 4]`` (CUDA) per set ->
    ``(out_a, scale_a, out_b, scale_b)``, uint8 ``[rows_x, 128]`` E4M3 bytes and fp32 ``[rows_x]``
    scales with the fold of the module docstring (the prefill's queries and keys)."""
    import torch
    dev = vals_a.device
    ra, rb = vals_a.shape[0], vals_b.shape[0]
    out_a = torch.empty((ra, 128), dtype=torch.uint8, device=dev)
    scale_a = torch.empty((ra,), dtype=torch.float32, device=dev)
    out_b = torch.empty((rb, 128), dtype=torch.uint8, device=dev)
    scale_b = torch.empty((rb,), dtype=torch.float32, device=dev)
    if ra + rb:
        _pair_into(*_prepared(vals_a, sf_a), out_a, scale_a, *_prepared(vals_b, sf_b), out_b, scale_b)
    return out_a, scale_a, out_b, scale_b


def mxfp4_rows_to_fp8(vals, sf):
    """torch uint8 ``[rows, 64]`` + ``[rows, 4]`` (CUDA) -> (uint8 ``[rows, 128]`` E4M3 bytes,
    fp32 ``[rows]`` scales) with the fold of the module docstring: one launch of the pair kernel
    on the two halves of the rows (both written into one output pair)."""
    import torch
    rows = vals.shape[0]
    out = torch.empty((rows, 128), dtype=torch.uint8, device=vals.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=vals.device)
    if rows == 0:
        return out, scale
    vals, sf = _prepared(vals, sf)
    h = (rows + 1) // 2
    _pair_into(vals[:h], sf[:h], out[:h], scale[:h], vals[h:], sf[h:], out[h:], scale[h:])
    return out, scale
