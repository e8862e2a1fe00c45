"""CuTe DSL split-KV combine of :mod:`kernels_dsl.sparse_attention_fwd` (sm_90a).

Each KV split ``s`` of a query row wrote ``o_s = O_s / l_s`` (fp32) and ``lse_s = m_s + log2(l_s)``
(base 2, without the sink; ``-inf`` when the split saw no valid entry). Per (row ``t``, head ``h``),
with ``sink2 = sink[h] * log2(e)``::

    M   = max(sink2, max_s lse_s)
    den = 2^(sink2 - M) + sum_s 2^(lse_s - M)
    out = sum_s 2^(lse_s - M) o_s / den                          (bf16, one rounding)
    lse = (M + log2(den)) / log2(e)                              (natural log, includes the sink)

A row none of whose splits saw a valid entry gets ``out = 0`` and ``lse = sink[h]`` exactly (``-inf``
without a sink). One warp per (t, h): lane
``l`` owns dims ``[16 l, 16 l + 16)`` (four 16-byte loads per split, two 16-byte bf16 stores).
One launch, no host sync, graph-capturable.
"""
from __future__ import annotations

import math
from typing import Optional

from ._compile import compile_options, compile_variants

try:  # the DSL is optional at import time
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import BFloat16, Float32
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["SparseAttentionCombineKernel", "compile_check", "PTX_PATTERNS", "compile_kernel", "make_fake_args"]

HEAD_DIM = 512
WARPS = 4
LOG2E = math.log2(math.e)

#: What the compiled PTX must contain (tests/test_compile_dsl.py).
PTX_PATTERNS = (r"ld\.global(\.nc)?\.v4\.(f|b|u)32", r"st\.global\.v4\.(b|u)32", r"ex2\.approx")


if _HAVE_DSL:

    class SparseAttentionCombineKernel:
        """Merge KV-split partials into the final bf16 output and natural-log LSE.

        ``__call__(mOp, mLp, mSink, mO, mLse, stream)``: ``mOp`` Float32 ``[S, T, H, 512]``,
        ``mLp`` Float32 ``[S, T, H]`` (base-2 split LSEs), ``mSink`` Float32 ``[H]``, ``mO``
        BFloat16 ``[T, H, 512]``, ``mLse`` Float32 ``[T, H]``. All contiguous.
        """

        @cute.jit
        def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mSink: cute.Tensor, mO: cute.Tensor,
                     mLse: cute.Tensor, stream: cuda.CUstream):
            rows = mO.shape[0] * mO.shape[1]
            self.kernel(mOp, mLp, mSink, mO, mLse).launch(
                grid=[cute.ceil_div(rows, WARPS), 1, 1], block=[32 * WARPS, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mSink: cute.Tensor, mO: cute.Tensor,
                   mLse: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            lane = tidx % 32
            S = mOp.shape[0]
            T = mO.shape[0]
            H = mO.shape[1]
            row = bidx * WARPS + tidx // 32
            if row < T * H:
                t = row // H
                h = row - t * H
                sink2 = mSink[h] * LOG2E
                m = sink2
                for s in cutlass.range(S, unroll=1):
                    m = cutlass.max(m, mLp[s, t, h])
                acc = cute.make_rmem_tensor((16,), Float32)
                acc.fill(0.0)
                den = Float32(0.0)
                if m > -Float32.inf:
                    den = cute.math.exp2(sink2 - m, fastmath=True)
                    ld = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Float32, num_bits_per_copy=128, invariant=True)
                    for s in cutlass.range(S, unroll=1):
                        w = cute.math.exp2(mLp[s, t, h] - m, fastmath=True)
                        den = den + w
                        src = cute.local_tile(mOp[(s, t, h, None)], (16,), (lane,))
                        r = cute.make_rmem_tensor((16,), Float32)
                        cute.copy(ld, cute.logical_divide(src, (4,)), cute.logical_divide(r, (4,)))
                        for i in cutlass.range_constexpr(16):
                            acc[i] = acc[i] + w * r[i]
                    inv = 1.0 / den
                    for i in cutlass.range_constexpr(16):
                        acc[i] = acc[i] * inv
                out = cute.make_rmem_tensor((16,), BFloat16)
                out.store(acc.load().to(BFloat16))
                st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128)
                dst = cute.local_tile(mO[(t, h, None)], (16,), (lane,))
                cute.copy(st, cute.logical_divide(out, (8,)), cute.logical_divide(dst, (8,)))
                if lane == 0:
                    # no split saw a valid entry: the sink alone, exactly (its natural-log value)
                    lse = mSink[h]
                    m_kv = -Float32.inf
                    for s in cutlass.range(S, unroll=1):
                        m_kv = cutlass.max(m_kv, mLp[s, t, h])
                    if m_kv > -Float32.inf:
                        lse = (m + cute.math.log2(den)) / LOG2E
                    mLse[t, h] = lse


def make_fake_args():
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    # every dim symbolic (a static extent changes the compiled ABI: see sparse_attention_fwd.make_fake_args)
    S = cute.sym_int32(symbol="S")
    T = cute.sym_int32(symbol="T")
    H = cute.sym_int32(symbol="H")
    D = cute.sym_int32(divisibility=64, symbol="D")
    op = make_fake_compact_tensor(Float32, (S, T, H, D), stride_order=(3, 2, 1, 0), assumed_align=16)
    lp = make_fake_compact_tensor(Float32, (S, T, H), stride_order=(2, 1, 0), assumed_align=4)
    sink = make_fake_compact_tensor(Float32, (H,), assumed_align=4)
    o = make_fake_compact_tensor(BFloat16, (T, H, D), stride_order=(2, 1, 0), assumed_align=16)
    lse = make_fake_compact_tensor(Float32, (T, H), stride_order=(1, 0), assumed_align=4)
    return op, lp, sink, o, lse, make_fake_stream()


def compile_kernel(arch: str, extra: str = ""):
    return cute.compile(SparseAttentionCombineKernel(), *make_fake_args(), options=compile_options(arch, extra))


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile the combine kernel for ``arch`` on the CPU; ``{"combine": PTX}``."""
    return compile_variants("sparse_attention_combine", {"combine": compile_kernel}, dump_dir, arch)
