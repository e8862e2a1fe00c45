"""CUDA (NVRTC) providers for the DSV4 MoE grouped GEMMs: the swap-AB decode kernel
``moe_decode.cu`` (few rows per expert; plan and launch in kernels_cuda/moe_decode.py), sm_90a.

Where they run (:class:`_CudaMoEBase`.supports): the registry tries ``cuda`` first
(``dsv4.ops.moe.GEMM_KINDS``) and this provider accepts exactly the decode-sized problems
(``<= moe_decode.DECODE_MAX_M`` rows per expert, :func:`kernels_cuda.moe_decode.plan`), where the
decode kernel is measured faster than the CuTe DSL grouped GEMM (kernels_dsl/moe.py; job moe-12,
2026-12-01: 1.4-1.6x at T=4..256). Prefill-sized groups go to ``dsl``, which replaced the former
``moe.cu`` prefill kernels (v1..v4, deleted 2026-12-01 after job moe-13 timed the DSL kernel
faster for every class: Flash T=4096 MXFP4 W4A8 1.29x v4 (moe-12), NVFP4 W4A8 1.07x v4,
MXFP4 W4A16 2.37x v3; NVFP4 W4A8 T=16384 1.09x v4). Forcing ``cuda`` on a problem it declines
raises ``ProviderUnavailableError``.
"""
from __future__ import annotations

from dsv4.registry import Support

from ._provider import CudaProvider
from . import moe_decode  # the decode kernel (few rows per expert); DSV4_MOE_DECODE=0 disables it


def _rows(problem) -> int:
    """Rows the decode plan sizes for: the assignments (``problem["rows"]`` = ``min(R, T * topk)``,
    dsv4/ops/moe.py), not the masked layout's ``E * max_m`` slots; the kernel reads the real
    per-expert counts on the device and cuts a hot expert into token chunks."""
    return int(problem.get("rows", problem.get("R", 0)) or 0)


class _CudaMoEBase(CudaProvider):
    arch_requirement = "decode kernel (moe_decode.cu) built for sm_90a only"
    stage = 0

    def supports_problem(self, problem):
        act, fmt = problem["act"], problem["fmt"]
        dp = moe_decode.plan(_rows(problem), problem["E"], problem["N"], problem["K"], act, fmt, self.stage)
        if dp is not None:
            return Support.yes(
                f"cuda moe_decode.cu (swap-AB decode kernel, {dp['nt']}-token chunks, <= "
                f"{moe_decode.DECODE_MAX_M} rows per expert): preferred over dsl, measured faster there (job "
                "moe-12, Flash MXFP4 W4A8 GEMM1 + GEMM2, cuda / dsl: T=4 186 / 281 us, T=64 1334 / 2038 us, "
                "T=256 1729 / 2524 us)")
        return Support.no(f"cuda: not decode-sized (> {moe_decode.DECODE_MAX_M} rows per expert on average, or "
                          f"N % 256 / K % 128 != 0, or DSV4_MOE_DECODE=0): dsl serves it (the DSL grouped GEMM is faster "
                          "than the deleted moe.cu prefill kernels for every class, jobs moe-12 / moe-13)")


class CudaMoEGemm1(_CudaMoEBase):
    stage = 1
    describe = ("moe_decode.cu stage 1: swap-AB (weight rows in M), FP4 -> BF16 decode in registers, "
                "mma.sync m16n8k16, device split-K, fused clamped SwiGLU + FP8 requant")

    def run(self, problem, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
        dp = moe_decode.plan(_rows(problem), w13.shape[0], w13.shape[1], a.shape[1], problem["act"], problem["fmt"], 1)
        if dp is None:  # supports() declined it; only a direct call gets here
            raise ValueError("cuda moe_gemm1_swiglu: the problem is not decode-sized (kernels_cuda/moe_decode.plan)")
        return moe_decode.gemm1_swiglu(dp, problem, a=a, a_s=a_s, w13=w13, w13_scale=w13_scale, g13=g13,
                                       row_start=row_start, row_count=row_count, route_w=route_w)


class CudaMoEGemm2(_CudaMoEBase):
    stage = 2
    describe = "moe_decode.cu stage 2: swap-AB, FP4 -> BF16 decode in registers, mma.sync m16n8k16, device split-K, fp32 out"

    def run(self, problem, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
        dp = moe_decode.plan(_rows(problem), w2.shape[0], w2.shape[1], h.shape[1], problem["act"], problem["fmt"], 2)
        if dp is None:  # supports() declined it; only a direct call gets here
            raise ValueError("cuda moe_gemm2: the problem is not decode-sized (kernels_cuda/moe_decode.plan)")
        return moe_decode.gemm2(dp, problem, h=h, h_s=h_s, w2=w2, w2_scale=w2_scale, g2=g2,
                                row_start=row_start, row_count=row_count)


PROVIDERS = {"moe_gemm1_swiglu": CudaMoEGemm1, "moe_gemm2": CudaMoEGemm2}
