"""Decode path of the CUDA MoE grouped GEMMs: ``moe_decode.cu`` (swap AB, few tokens per expert).

Not a provider module (no ``PROVIDERS``): the ``cuda`` providers of ``kernels_cuda/moe.py`` call
:func:`plan` in ``supports`` (they serve exactly the problems it plans, where this kernel is
measured faster than the CuTe DSL grouped GEMM: job moe-12) and in ``run``. Same op semantics and
outputs as the other providers (``moe_gemm1_swiglu``, ``moe_gemm2``).

When it applies (:func:`plan`): ``ceil(R / E) <= DECODE_MAX_M`` where the providers pass as ``R``
the assignments ``min(R, T * topk)`` (kernels_cuda/moe.py ``_rows``; the masked layout's ``E * max_m``
slots are mostly empty at decode): few rows per expert on average; any per-expert distribution is
correct, an expert with many rows (up to ``max_m`` in the masked layout) is cut into chunks of ``NT``
tokens, and the grid (:func:`grid_size`) is bounded from the real ``R``), ``N % 256 == 0``,
``K % 128 == 0``. Environment: ``DSV4_MOE_DECODE=0`` turns it off (the grouped GEMMs then
run on the CuTe DSL provider);
``DSV4_MOE_DECODE_MAXM`` (default :data:`DECODE_MAX_M`), and for benchmarks
``DSV4_MOE_DECODE_BULK`` (:data:`DECODE_BULK`), ``DSV4_MOE_DECODE_MMA`` (:data:`DECODE_MMA`),
``DSV4_MOE_DECODE_L2PF`` (:data:`DECODE_L2PF`),
``DSV4_MOE_DECODE_STAGES``,
``DSV4_MOE_DECODE_NWG`` (consumer warpgroups per CTA, 1 or 2; stage 1 with FP8 always uses 2),
``DSV4_MOE_DECODE_SPLITK`` (largest device-side split-K factor, default :data:`DECODE_SPLITK`; 1 = off).
Defaults and allowed values of these variables: ``dsv4/config.py`` (``VARS``, docs/configuration.md); a
bad value raises ``ValueError`` naming the variable.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from dsv4.config import default as _env_default
from dsv4.config import env_flag, env_int

from .nvrtc import launch, load, set_max_dynamic_smem

__all__ = ["plan", "gemm1_swiglu", "gemm2", "smem_bytes", "DECODE_MAX_M"]

# The defaults below are the table defaults of dsv4/config.py (VARS), the single source of truth.
#: largest ``ceil(R / E)`` (= ``max_m`` of the masked layout) sent to the decode kernel
DECODE_MAX_M = _env_default("DSV4_MOE_DECODE_MAXM")  # 16
#: largest split-K factor the kernel may pick on the device (it picks the smallest power of two whose
#: static schedule fills the grid to >= 90%, e.g. 8 experts x 1 token: 2 (Flash), 4 (Pro GEMM1))
DECODE_SPLITK = _env_default("DSV4_MOE_DECODE_SPLITK")  # 4
#: weight copies: 0 = 16-byte cp.async by the producer warp (default: measured 2.8x faster on the H200,
#: 2026-11-29), 1 = one 64-byte 1-D bulk copy per row and stage (TMA issue-bound at this size)
DECODE_BULK = _env_default("DSV4_MOE_DECODE_BULK")  # 0
#: consumer math: 1 = per-warp mma.sync m16n8k16 (default), 0 = warpgroup RS WGMMA m64nNk16 (same
#: A fragments; its best rate, 41% of copy BW, is consistent with a suspected issue limit of one tiny
#: m64n8k16 per 1024 weights). Both pass the GPU tests on the H200 (2026-11-29, tests/test_moe_decode.py:
#: 33 passed, both consumers). mma.sync timed there (bench/bench_moe.py, docs/benchmarks.md: DSV4-Flash
#: MXFP4, FP8 activations, CUDA-graph replay, active experts x tokens each, % of the measured copy
#: bandwidth on their weight bytes): 8 x 1 80.8 us (31%), 64 x 4 417 us (48%), 256 x 16 1793 us (45%).
DECODE_MMA = _env_default("DSV4_MOE_DECODE_MMA")  # 1
#: L2 prefetch-size hint (bytes: 0, 64, 128, 256) on the cp.async weight / scale copies: each stage
#: reads 64 B per weight row, the hint makes the L2 fetch the row's aligned 256 B (4 stages) at once
DECODE_L2PF = _env_default("DSV4_MOE_DECODE_L2PF")  # 256
_UCAP_MAX = 1 << 16  # split-K units (and arrival counters) per launch
_FMT = {"mxfp4": 0, "nvfp4": 1}
_ACT = {"fp8": 0, "bf16": 1}
_SMEM_PER_SM = 233472  # 228 KiB (sm_90)
_SMEM_OPTIN = 232448   # 227 KiB: largest dynamic shared memory per block (sm_90 opt-in)


def smem_bytes(nt: int, nwg: int, stages: int, fmt: str, E: int) -> int:
    """Dynamic shared memory of ``moe_decode_kernel`` (bytes): ``stages`` ring slots of
    [packed E2M1 128*nwg rows x 64 B | bf16 B tile nt x 128 | scale bytes 128*nwg x (4|8)], the
    full/empty mbarriers, the FP8 amax exchange, the NVFP4 scale table and the per-expert chunk prefix."""
    slab = 128 * nwg
    slot = slab * 64 + nt * 256 + slab * (4 if fmt == "mxfp4" else 8)
    return stages * slot + 16 * stages + 4 * nwg * 4 * nt + 4 * 256 + 16 + 4 * (E + 1)


def plan(R: int, E: int, N: int, K: int, act: str, fmt: str, stage: int) -> dict | None:
    """The decode-kernel configuration for a grouped GEMM, or ``None`` when the problem is not
    decode-sized (the cuda provider then declines it). Pure host arithmetic on static shapes.

    Args: ``R`` grouped rows, ``E`` experts, ``N`` output rows of the weight (stage 1: 2I, stage 2:
    D), ``K`` reduction size, ``act`` 'fp8'|'bf16', ``fmt`` 'mxfp4'|'nvfp4', ``stage`` 1|2.
    Returns ``{"nt" tokens per chunk (8|16), "nwg" consumer warpgroups, "stages" ring depth, "bulk",
    "minb" CTAs per SM, "smem" bytes, "splitk" largest device split, "mma", "l2pf"}`` or ``None``.
    Raises: ValueError naming the variable for a bad value of any ``DSV4_MOE_DECODE*`` variable
    (allowed values: dsv4/config.py ``VARS``).
    """
    if not env_flag("DSV4_MOE_DECODE") or R <= 0 or E <= 0:
        return None
    m = -(-R // E)
    if m > min(env_int("DSV4_MOE_DECODE_MAXM"), 16):
        return None
    nwg_env = env_int("DSV4_MOE_DECODE_NWG")  # validated even where it is overridden
    nwg = 2 if (stage == 1 and act == "fp8") else nwg_env
    if N % (128 * nwg) or K % 128 or (stage == 1 and N % 256):
        return None
    nt = 8 if m <= 8 else 16
    minb = 2 if nwg == 2 else 4  # CTAs per SM (registers: __launch_bounds__(128 * nwg + 32, minb))
    # default ring depth: the deepest that still fits minb CTAs per SM (at most 6)
    fixed = smem_bytes(nt, nwg, 0, fmt, E)
    slot = smem_bytes(nt, nwg, 1, fmt, E) - fixed
    fit = (_SMEM_PER_SM // minb - 1024 - fixed) // slot
    stages = env_int("DSV4_MOE_DECODE_STAGES", max(2, min(6, fit)))
    smem = smem_bytes(nt, nwg, stages, fmt, E)
    if smem > _SMEM_OPTIN:
        return None
    return {"nt": nt, "nwg": nwg, "stages": stages, "bulk": env_int("DSV4_MOE_DECODE_BULK"),
            "minb": minb, "smem": smem, "splitk": env_int("DSV4_MOE_DECODE_SPLITK"),
            "mma": env_int("DSV4_MOE_DECODE_MMA"), "l2pf": env_int("DSV4_MOE_DECODE_L2PF")}


_configured: set = set()


def _kernel(p: dict, act: str, fmt: str, stage: int):
    mod = load("moe_decode.cu", MD_ACT=_ACT[act], MD_WFMT=_FMT[fmt], MD_STAGE=stage, MD_NT=p["nt"], MD_NWG=p["nwg"],
               MD_STAGES=p["stages"], MD_BULK=p["bulk"], MD_MINB=p["minb"], MD_MMA=p["mma"], MD_L2PF=p["l2pf"])
    k = mod.kernel("moe_decode_kernel")
    # Raise the kernel's dynamic shared-memory limit once to the sm_90 opt-in maximum: the launch
    # size varies with E and the plan, and a limit set for a smaller launch must never stick
    # (keying the attribute on the size makes a later larger launch fail with INVALID_VALUE).
    key = (id(mod), torch.cuda.current_device())
    if key not in _configured:
        set_max_dynamic_smem(k, _SMEM_OPTIN)
        _configured.add(key)
    return k


@functools.lru_cache(maxsize=None)
def _sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def grid_size(p: dict, R: int, E: int, N: int, sms: int) -> int:
    """Persistent grid: min(upper bound of work items, resident CTAs). Items = (expert, chunk of
    ``nt`` rows, slab of 128*nwg weight rows); every non-empty expert adds at most one partial chunk."""
    items = (-(-R // p["nt"]) + min(E, R)) * (N // (128 * p["nwg"]))
    per_sm = max(1, min(p["minb"], _SMEM_PER_SM // (p["smem"] + 1024)))
    return max(1, min(items, per_sm * sms))


_counters: dict = {}


def _split_buffers(p: dict, grid: int, device):
    """(fp32 partials workspace, int32 arrival counters, unit capacity) of the device-side split-K.
    The counters are one persistent zeroed buffer per (device, stream): the kernel's last arriving
    unit resets its counter, so it is zero again after every launch, and launches on one stream are
    serialized by the stream. Launches on different streams use different buffers, so the MoE may
    overlap other work on another stream. Constraint: two CUDA graphs captured on the SAME stream
    share that stream's buffer and must not be replayed concurrently."""
    if p["splitk"] <= 1:
        z = torch.empty((1,), dtype=torch.float32, device=device)
        return z, z.view(torch.int32), 0
    ucap = min(p["splitk"] * grid, _UCAP_MAX)
    key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream)
    cnt = _counters.get(key)
    if cnt is None:
        cnt = _counters[key] = torch.zeros((_UCAP_MAX,), dtype=torch.int32, device=device)
    ws = torch.empty((ucap * 128 * p["nwg"] * p["nt"],), dtype=torch.float32, device=device)
    return ws, cnt, ucap


def _launch(p, act, fmt, stage, a, a_s, w, w_s, w_g, row_start, row_count, route_w, out, out_s):
    R, K = a.shape
    E, N = w.shape[0], w.shape[1]
    k = _kernel(p, act, fmt, stage)
    grid = grid_size(p, R, E, N, _sm_count(a.device.index or 0))
    ws, cnt, ucap = _split_buffers(p, grid, a.device)
    launch(k, grid, 128 * p["nwg"] + 32, a, a_s, w, w_s, w_g, row_start, row_count, route_w, out, out_s, ws, cnt,
           np.int32(E), np.int32(N), np.int32(K), np.int32(p["splitk"]), np.int32(ucap), np.int64(R), smem=p["smem"])


def gemm1_swiglu(p: dict, problem: dict, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
    """``moe_gemm1_swiglu`` on the decode kernel (plan ``p`` from :func:`plan`); outputs as every provider of the op:
    fp8: ``(h e4m3 [R, I], h_s fp32 [R, I/128])``; bf16: ``(h bf16 [R, I], empty fp32 [0])``."""
    act, fmt = problem["act"], problem["fmt"]
    R = a.shape[0]
    I = w13.shape[1] // 2
    if act == "fp8":
        h = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=a.device)
        h_s = torch.empty((R, I // 128), dtype=torch.float32, device=a.device)
    else:
        h = torch.empty((R, I), dtype=torch.bfloat16, device=a.device)
        h_s = torch.empty((0,), dtype=torch.float32, device=a.device)
    _launch(p, act, fmt, 1, a, a_s if a_s is not None else route_w, w13, w13_scale, g13, row_start, row_count,
            route_w, h, h_s if act == "fp8" else route_w)
    return h, h_s


def gemm2(p: dict, problem: dict, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
    """``moe_gemm2`` on the decode kernel: fp32 ``y [R, D]`` (rows outside every expert unspecified)."""
    act, fmt = problem["act"], problem["fmt"]
    y = torch.empty((h.shape[0], w2.shape[1]), dtype=torch.float32, device=h.device)
    _launch(p, act, fmt, 2, h, h_s if (h_s is not None and h_s.numel()) else g2, w2, w2_scale, g2, row_start,
            row_count, g2, y, g2)
    return y
