"""CUDA (NVRTC) providers for the DSV4 MoE grouped GEMMs: the swap-AB decode kernel
``moe_decode.cu`` (few rows per expert; config and launch in kernels_cuda/moe_decode.py), sm_90a.

Where they run (:class:`_CudaMoEBase`.supports): the registry tries ``cuda`` first
(``dsv4.ops.moe.GEMM_KINDS``) and this provider accepts exactly the decode-sized problems
(``<= moe_decode.MAX_M`` rows per expert on average, :func:`kernels_cuda.moe_decode.default_config`),
where the decode kernel is faster than the CuTe DSL grouped GEMM (kernels_dsl/moe.py; numbers in
docs/benchmarks.md, "MoE grouped GEMMs in CuTe DSL"). Prefill-sized groups go to ``dsl`` (which
replaced the deleted ``moe.cu`` prefill kernels). Forcing ``cuda`` on a problem it declines raises
``ProviderUnavailableError``. The tunables of a call are :class:`kernels_cuda.moe_decode.DecodeConfig`
(``config``; ``registry.last_choice(op).explain()``).
"""
from __future__ import annotations

from dsv4.registry import Support

from ._provider import CudaProvider
from . import moe_decode  # the decode kernel (few rows per expert)


def _rows(problem) -> int:
    """Rows the decode config sizes for: the assignments (``problem["rows"]`` = ``min(R, T * topk)``,
    dsv4/ops/moe.py), not the masked layout's ``E * max_m`` slots; the kernel reads the real
    per-expert counts on the device and cuts a hot expert into token chunks."""
    return int(problem.get("rows", problem.get("R", 0)) or 0)


class _CudaMoEBase(CudaProvider):
    arch_requirement = "decode kernel (moe_decode.cu) built for sm_90a only"
    stage = 0

    def config(self, problem, target=None):
        """The :class:`~kernels_cuda.moe_decode.DecodeConfig` of ``problem``, or None (not decode-sized)."""
        return moe_decode.default_config(_rows(problem), problem["E"], problem["N"], problem["K"], problem["act"],
                                         problem["fmt"], self.stage)

    def supports_problem(self, problem):
        cfg = self.config(problem)
        if cfg is not None:
            return Support.yes(
                f"cuda moe_decode.cu (swap-AB decode kernel, {cfg.nt}-token chunks, <= "
                f"{moe_decode.MAX_M} rows per expert): faster than dsl at decode sizes (docs/benchmarks.md)")
        return Support.no(f"cuda: not decode-sized (> {moe_decode.MAX_M} rows per expert on average, or "
                          "N % 256 / K % 128 != 0): the DSL grouped GEMM is faster there and serves it")

    def _config_of_call(self, problem, R: int, E: int, N: int, K: int):
        cfg = moe_decode.default_config(R, E, N, K, problem["act"], problem["fmt"], self.stage)
        if cfg is None:  # supports() declined it; only a direct call gets here
            raise ValueError(f"cuda {self.op.name}: the problem is not decode-sized "
                             "(kernels_cuda/moe_decode.default_config)")
        return cfg


class CudaMoEGemm1(_CudaMoEBase):
    stage = 1
    describe = ("moe_decode.cu stage 1: swap-AB (weight rows in M), FP4 -> BF16 decode in registers, "
                "mma.sync m16n8k16, device split-K, fused clamped SwiGLU + FP8 requant")

    def run(self, problem, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
        cfg = self._config_of_call(problem, _rows(problem), w13.shape[0], w13.shape[1], a.shape[1])
        return moe_decode.gemm1_swiglu(cfg, a=a, a_s=a_s, w13=w13, w13_scale=w13_scale, g13=g13,
                                       row_start=row_start, row_count=row_count, route_w=route_w)


class CudaMoEGemm2(_CudaMoEBase):
    stage = 2
    describe = "moe_decode.cu stage 2: swap-AB, FP4 -> BF16 decode in registers, mma.sync m16n8k16, device split-K, fp32 out"

    def run(self, problem, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
        cfg = self._config_of_call(problem, _rows(problem), w2.shape[0], w2.shape[1], h.shape[1])
        return moe_decode.gemm2(cfg, h=h, h_s=h_s, w2=w2, w2_scale=w2_scale, g2=g2,
                                row_start=row_start, row_count=row_count)


PROVIDERS = {"moe_gemm1_swiglu": CudaMoEGemm1, "moe_gemm2": CudaMoEGemm2}
