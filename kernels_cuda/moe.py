"""CUDA (NVRTC) providers for the DSV4 MoE grouped GEMMs: ``moe_decode.cu`` (swap-AB decode kernel,
few rows per expert) and ``moe.cu`` (WGMMA prefill kernels, sm_90a).

Where they run (:class:`_CudaMoEBase`.supports): the registry tries ``cuda`` first
(``dsv4.ops.moe.GEMM_KINDS``) and this provider accepts a problem only where a CUDA kernel is
measured faster than the CuTe DSL grouped GEMM (kernels_dsl/moe.py), with that reason: the decode
kernel at ``<= DECODE_MAX_M`` rows per expert (job moe-12, 2026-12-01: 1.4-1.6x dsl at T=4..256),
and the moe.cu prefill kernels for the (act, fmt) classes in :data:`PREFILL_FASTER` (none: the DSL
kernel is 1.29-1.48x faster for Flash MXFP4 W4A8 prefill in the same job). Everything else goes to
``dsl``. (Forcing ``cuda`` on a problem it declines raises ``ProviderUnavailableError``.)

One prefill kernel source, specialized by macros: MOE_ACT (0 FP8 E4M3 / 1 BF16 activations), MOE_WFMT
(0 MXFP4 / 1 NVFP4 weights), MOE_STAGE (1 = GEMM1 + SwiGLU (+ FP8 requant), 2 = GEMM2).
Persistent launch: grid = min(upper bound of tiles, #SMs); the kernel reads per-expert row
counts on the device (no host sync; CUDA-graph capturable).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from dsv4.config import env_choice, env_flag, env_int
from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load, set_max_dynamic_smem
from . import moe_decode  # decode path (few rows per expert): moe_decode.cu; DSV4_MOE_DECODE=0 disables

BM, BN, BK = 64, 256, 128
_FMT = {"mxfp4": 0, "nvfp4": 1}
_ACT = {"fp8": 0, "bf16": 1}


@functools.lru_cache(maxsize=None)
def _sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def kernel_version() -> str:
    """``DSV4_MOE_KERNEL``: ``v4`` (default: warp-specialized producer/consumer warpgroups through
    mbarriers, 128-row tiles; FP8 activations only, W4A16 runs v3) or ``v3`` (cp.async ring + smem
    decode by the WGMMA warps, 128B-swizzled operands). Both pass the GPU tests on the H200
    (2026-11-29); W4A8 prefill: v4 is 1.6-1.7x faster than v3. (v1 / v2, slower than v3, were deleted.)
    Per (act, fmt) the kernel actually run is :func:`effective_version`.
    Raises: ValueError naming ``DSV4_MOE_KERNEL`` for any other value (dsv4/config.py)."""
    return env_choice("DSV4_MOE_KERNEL", DEFAULT_VERSION)


def effective_version(act: str, fmt: str, version: str | None = None) -> str:
    """The kernel run for ``(act, fmt)``: v4 has no BF16 (W4A16) path -> v3."""
    v = version or kernel_version()
    if v == "v4" and act != "fp8":
        return "v3"
    return v


DEFAULT_VERSION = "v4"  # GPU tests pass (H200, 2026-11-29, 1 and 2 producer warpgroups); 1.6-1.7x v3 in W4A8 prefill


def v4_producer_warpgroups() -> int:
    """``DSV4_MOE_V4_PWG``: producer warpgroups of the v4 kernel (1 or 2, default 2).
    Raises: ValueError naming the variable for any other value."""
    return env_int("DSV4_MOE_V4_PWG")


def v4_stages(lo: int) -> int:
    """v4 ring depth: ``DSV4_MOE_V4_STAGES`` (tuning only, 2..8) or 3 (NVFP4 W4A8: hi + lo tiles) / 4.
    Raises: ValueError naming the variable for a non-integer or out-of-range value."""
    return env_int("DSV4_MOE_V4_STAGES", 3 if lo else 4)


def smem_bytes(act: str, E: int, version: str = DEFAULT_VERSION, fmt: str = "mxfp4") -> int:
    kbytes = 128 if act == "fp8" else 256
    lo = int(act == "fp8" and fmt == "nvfp4")  # NVFP4 W4A8: hi + lo decoded tiles (moe.cu MOE_LO)
    if version == "v4":  # moe.cu V4_*: slot = A, B hi (, B lo) 16 KiB tiles + packed + scales + 1 KiB
        stages = v4_stages(lo)
        slot = (2 + lo) * 16384 + 8192 + 1024 * v4_producer_warpgroups() + 1024
        return 1024 + stages * slot + 16 * stages + 16 * 8 + 4 * (E + 1)
    small = 2 * BN * 4 + 2 * BM * 4 + 4 * (E + 1)
    stages = (3 if lo else 4) if act == "fp8" else 2
    slot = BM * kbytes + BN * 64 + BN * 8
    return stages * slot + 2 * (1 + lo) * BN * kbytes + small + 16 * 8 + 1024  # + 1024: swizzle atom alignment


_configured: dict = {}  # kernel config -> largest dynamic smem limit set so far


def diag_macros(ver: str) -> dict:
    """Extra ``moe.cu`` macros from the tuning / diagnostics environment (dsv4/config.py):
    ``MOE_DIAG`` (``DSV4_MOE_DIAG`` 1..3: diagnostics kernels with WRONG results, benchmarks only),
    and for v4 ``V4_PWG``, ``V4_STAGES`` (``DSV4_MOE_V4_STAGES``, when set), ``V4_WCOAL``
    (``DSV4_MOE_V4_WCOAL=1``). Pure host code.
    Raises: ValueError naming the variable for a bad value, and naming ``DSV4_MOE_DIAG`` and
    ``DSV4_BENCH_DIAGNOSTICS`` when a diagnostics kernel is requested without
    ``DSV4_BENCH_DIAGNOSTICS=1``."""
    diag = {}
    d = env_int("DSV4_MOE_DIAG")
    if d:
        if not env_flag("DSV4_BENCH_DIAGNOSTICS"):
            raise ValueError(f"DSV4_MOE_DIAG={d} selects a diagnostics kernel that computes WRONG results "
                             "(benchmarks only); it is honoured only together with DSV4_BENCH_DIAGNOSTICS=1 "
                             "(unset DSV4_MOE_DIAG for correct results)")
        diag["MOE_DIAG"] = d
    if ver == "v4":
        diag["V4_PWG"] = v4_producer_warpgroups()
        st = env_int("DSV4_MOE_V4_STAGES", None)  # tuning only
        if st is not None:
            diag["V4_STAGES"] = st
        wc = env_int("DSV4_MOE_V4_WCOAL")  # tuning only: coalesced weight copies (moe.cu V4_WCOAL)
        if wc:
            diag["V4_WCOAL"] = wc
    return diag


def _kernel(act: str, fmt: str, stage: int, E: int):
    ver = effective_version(act, fmt)
    diag = diag_macros(ver)
    mod = load("moe.cu", MOE_ACT=_ACT[act], MOE_WFMT=_FMT[fmt], MOE_STAGE=stage, **diag)
    k = mod.kernel("moe_gemm_kernel_v4" if ver == "v4" else "moe_gemm_kernel_v3")
    smem = smem_bytes(act, E, ver, fmt)
    # The limit is an attribute of the kernel, shared by every E: only ever raise it (lowering it
    # for a small E made a later launch with a larger E fail with CUDA_ERROR_INVALID_VALUE).
    key = (ver, act, fmt, stage, torch.cuda.current_device(), tuple(diag.items()))
    if _configured.get(key, -1) < smem:
        set_max_dynamic_smem(k, smem)
        _configured[key] = smem
    return k, smem


def _grid(R: int, E: int, n_tiles: int, device) -> int:
    # upper bound of m-tiles: every expert may add one partial tile
    mt_upper = min(-(-R // BM) + E, R)
    return max(1, min(mt_upper * n_tiles, _sm_count(device.index or 0)))


def _geom(act: str, fmt: str, stage: int, R: int, E: int, N: int, device) -> tuple[int, int]:
    """(persistent grid, threads per CTA) of the kernel :func:`_kernel` picks. v4: 128-row m-tiles,
    n-tiles of 256 W13 rows (stage 1) or 128 output columns (stage 2), 256 consumer threads + 128 per
    producer warpgroup."""
    if effective_version(act, fmt) != "v4":
        return _grid(R, E, N // BN, device), 256
    mt_upper = min(-(-R // 128) + E, R)
    nt = N // 256 if stage == 1 else N // 128
    return max(1, min(mt_upper * nt, _sm_count(device.index or 0))), 256 + 128 * v4_producer_warpgroups()


#: (act, fmt) whose prefill-sized groups (more than ``moe_decode.DECODE_MAX_M`` rows per expert on
#: average) the moe.cu kernels still serve because they are measured faster than the CuTe DSL
#: grouped GEMM there: none (job moe-12, H200 2026-12-01, Flash MXFP4 W4A8 GEMM1 + GEMM2, dsl / cuda
#: v4: T=1024 2536 / 3746 us, T=4096 2924 / 3762 us, T=16384 9749 / 12879 us).
PREFILL_FASTER: frozenset = frozenset()


class _CudaMoEBase(CudaProvider):
    arch_requirement = "WGMMA kernel built for sm_90a only"
    stage = 0

    def supports_problem(self, problem):
        if problem["K"] % BK:
            return Support.no(f"cuda: K={problem['K']} is not a multiple of {BK}")
        if problem["N"] % BN:
            return Support.no(f"cuda: N={problem['N']} is not a multiple of {BN}")
        if problem["E"] > 2048:
            return Support.no(f"cuda: E={problem['E']} > 2048 (prefix table in shared memory)")
        act, fmt = problem["act"], problem["fmt"]
        dp = moe_decode.plan(int(problem.get("R", 0) or 0), problem["E"], problem["N"], problem["K"], act, fmt,
                             self.stage)
        if dp is not None:
            return Support.yes(
                f"cuda moe_decode.cu (swap-AB decode kernel, {dp['nt']}-token chunks, <= "
                f"{moe_decode.DECODE_MAX_M} rows per expert): preferred over dsl, measured faster there (job "
                "moe-12, Flash MXFP4 W4A8 GEMM1 + GEMM2, cuda / dsl: T=4 186 / 281 us, T=64 1334 / 2038 us, "
                "T=256 1729 / 2524 us)")
        if (act, fmt) in PREFILL_FASTER:
            return Support.yes(f"cuda moe.cu {effective_version(act, fmt)}: measured faster than dsl for {act}/{fmt} "
                               "prefill")
        measured = "" if (act, fmt) == ("fp8", "mxfp4") else (
            f"; {act}/{fmt} not yet timed against moe.cu in one run: moe-12 had dsl at 225 (NVFP4 W4A8) / 317 "
            "(MXFP4 W4A16) TFLOP/s at T=4096; scripts/gpuq/moe_prefill_compare.sh decides")
        return Support.no(f"cuda: prefill-sized groups (> {moe_decode.DECODE_MAX_M} rows per expert on average): "
                          "the CuTe DSL grouped GEMM is faster (job moe-12, Flash MXFP4 W4A8: T=1024 / 4096 / 16384 "
                          "1.48x / 1.29x / 1.32x moe.cu v4" + measured + ")")


class CudaMoEGemm1(_CudaMoEBase):
    stage = 1
    describe = "moe.cu stage 1: FP4->FP8/BF16 prmt decode + WGMMA m64n128 x2, 1x128 promotion, fused clamped SwiGLU + FP8 requant"

    def run(self, problem, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
        act, fmt = problem["act"], problem["fmt"]
        dp = moe_decode.plan(a.shape[0], w13.shape[0], w13.shape[1], a.shape[1], act, fmt, 1)
        if dp is not None:  # decode kernel (kernels_cuda/moe_decode.py)
            return moe_decode.gemm1_swiglu(dp, problem, a=a, a_s=a_s, w13=w13, w13_scale=w13_scale, g13=g13,
                                           row_start=row_start, row_count=row_count, route_w=route_w)
        R, K = a.shape
        E, N = w13.shape[0], w13.shape[1]
        I = N // 2
        if act == "fp8":
            h = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=a.device)
            h_s = torch.empty((R, I // 128), dtype=torch.float32, device=a.device)
        else:
            h = torch.empty((R, I), dtype=torch.bfloat16, device=a.device)
            h_s = torch.empty((0,), dtype=torch.float32, device=a.device)
        if R == 0:
            return h, h_s
        k, smem = _kernel(act, fmt, 1, E)
        grid, nthr = _geom(act, fmt, 1, R, E, N, a.device)
        launch(k, grid, nthr, a, a_s if a_s is not None else a, w13, w13_scale, g13, row_start, row_count, route_w,
               h, h_s if act == "fp8" else route_w, np.int32(E), np.int32(N), np.int32(K), smem=smem)
        return h, h_s


class CudaMoEGemm2(_CudaMoEBase):
    stage = 2
    describe = "moe.cu stage 2: FP4->FP8/BF16 prmt decode + WGMMA m64n128 x2, 1x128 promotion, fp32 out"

    def run(self, problem, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
        act, fmt = problem["act"], problem["fmt"]
        dp = moe_decode.plan(h.shape[0], w2.shape[0], w2.shape[1], h.shape[1], act, fmt, 2)
        if dp is not None:  # decode kernel (kernels_cuda/moe_decode.py)
            return moe_decode.gemm2(dp, problem, h=h, h_s=h_s, w2=w2, w2_scale=w2_scale, g2=g2,
                                    row_start=row_start, row_count=row_count)
        R, K = h.shape
        E, N = w2.shape[0], w2.shape[1]
        y = torch.empty((R, N), dtype=torch.float32, device=h.device)
        if R == 0:
            return y
        k, smem = _kernel(act, fmt, 2, E)
        grid, nthr = _geom(act, fmt, 2, R, E, N, h.device)
        launch(k, grid, nthr, h, h_s if h_s is not None else g2, w2, w2_scale, g2, row_start, row_count, g2,
               y, g2, np.int32(E), np.int32(N), np.int32(K), smem=smem)
        return y


PROVIDERS = {"moe_gemm1_swiglu": CudaMoEGemm1, "moe_gemm2": CudaMoEGemm2}
