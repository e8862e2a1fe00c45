"""Decode path of the CUDA MoE grouped GEMMs: ``moe_decode.cu`` (swap AB, few tokens per expert).

Not a provider module (no ``PROVIDERS``): the ``cuda`` providers of ``kernels_cuda/moe.py`` call
:func:`default_config` in ``supports`` (they serve exactly the problems it configures, where this
kernel is faster than the CuTe DSL grouped GEMM: docs/benchmarks.md) and in ``run``. Same op
semantics and outputs as the other providers (``moe_gemm1_swiglu``, ``moe_gemm2``).

When it applies (:func:`default_config`): ``ceil(R / E) <= MAX_M`` where the providers pass as
``R`` the assignments ``min(R, T * topk)`` (kernels_cuda/moe.py ``_rows``; the masked layout's
``E * max_m`` slots are mostly empty at decode): few rows per expert on average; any per-expert
distribution is correct, an expert with many rows (up to ``max_m`` in the masked layout) is cut into
chunks of ``nt`` tokens, and the grid (:func:`grid_size`) is bounded from the real ``R``),
``N % 256 == 0``, ``K % 128 == 0``. To run the CuTe DSL kernel there instead, force it:
``DSV4_OPS=moe_gemm1_swiglu=dsl,moe_gemm2=dsl`` or ``registry.use(...)``.

Tunables: a frozen :class:`DecodeConfig` chosen by :func:`default_config` (shown by
``registry.last_choice(op).explain()`` and ``dsv4 ops --verbose``). Benchmarks and debugging
sessions change a field with :func:`override` (``with moe_decode.override(mma=0, splitk=1):``);
nothing reads the environment.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from .nvrtc import launch, load, set_max_dynamic_smem

__all__ = ["DecodeConfig", "default_config", "override", "gemm1_swiglu", "gemm2", "smem_bytes", "grid_size",
           "MAX_M"]

#: largest average assignments per expert, ``ceil(R / E)``, sent to the decode kernel (the kernel
#: chunks at most 16 tokens; above that the DSL grouped GEMM is faster: docs/benchmarks.md)
MAX_M = 16
_UCAP_MAX = 1 << 16  # split-K units (and arrival counters) per launch
_FMT = {"mxfp4": 0, "nvfp4": 1}
_ACT = {"fp8": 0, "bf16": 1}
_SMEM_PER_SM = 233472  # 228 KiB (sm_90)
_SMEM_OPTIN = 232448   # 227 KiB: largest dynamic shared memory per block (sm_90 opt-in)


@dataclass(frozen=True)
class DecodeConfig:
    """One specialization of ``moe_decode_kernel`` (the ``MD_*`` macros of moe_decode.cu) and its launch.

    Attributes:
        stage: 1 = GEMM1 (W13) + clamped SwiGLU * routing weight (+ FP8 requant), 2 = GEMM2 (W2).
        act, fmt: ``'fp8'`` | ``'bf16'`` activations, ``'mxfp4'`` | ``'nvfp4'`` weights.
        nt: tokens per chunk (WGMMA / mma N): 8 when ``ceil(R / E) <= 8``, else 16.
        nwg: consumer warpgroups per CTA (128 weight rows each); stage 1 with FP8 activations
            always 2 (the 1x128 requant needs the 256 rows = 128 h columns of both).
        stages: ring depth: the deepest (at most 6, at least 2) that fits ``minb`` CTAs per SM.
        minb: CTAs per SM the registers are budgeted for (``__launch_bounds__``): 2 with 2
            warpgroups, else 4.
        smem: dynamic shared memory (bytes, :func:`smem_bytes`).
        splitk: largest device-side split-K factor (the kernel picks the smallest power of two whose
            static schedule fills the grid to >= 90%, e.g. 8 experts x 1 token: 2 (Flash), 4 (Pro
            GEMM1)); 1 = off.
        mma: consumer math: 1 = per-warp ``mma.sync`` m16n8k16 (measured faster), 0 = warpgroup RS
            WGMMA m64nNk16 (same A fragments; its best rate, 41% of copy BW, is consistent with an
            issue limit of one tiny m64n8k16 per 1024 weights). Same results up to FP32 order.
        bulk: weight copies: 0 = 16-byte ``cp.async`` by the producer warp (measured 2.8x faster),
            1 = one 64-byte 1-D bulk copy per row and stage (TMA issue-bound at this size).
        l2pf: L2 prefetch-size hint (bytes: 0, 64, 128, 256) on the ``cp.async`` weight / scale
            copies: each stage reads 64 B per weight row, 256 makes the L2 fetch the row's aligned
            256 B (4 stages) at once.

    Measured reasons of the defaults: docs/benchmarks.md ("MoE decode").
    """

    stage: int
    act: str
    fmt: str
    nt: int
    nwg: int
    stages: int
    minb: int
    smem: int
    splitk: int = 4
    mma: int = 1
    bulk: int = 0
    l2pf: int = 256

    def defines(self) -> dict:
        """The ``MD_*`` preprocessor values of moe_decode.cu for this config."""
        return dict(MD_ACT=_ACT[self.act], MD_WFMT=_FMT[self.fmt], MD_STAGE=self.stage, MD_NT=self.nt,
                    MD_NWG=self.nwg, MD_STAGES=self.stages, MD_BULK=self.bulk, MD_MINB=self.minb, MD_MMA=self.mma,
                    MD_L2PF=self.l2pf)

    def explain(self) -> str:
        what = "gemm1+swiglu" + ("+fp8 requant" if self.act == "fp8" else "") if self.stage == 1 else "gemm2"
        return (f"cuda moe_decode.cu {what} {self.act}/{self.fmt}: swap-AB, {self.nt}-token chunks, "
                f"{self.nwg} consumer wg x 128 weight rows, {self.stages}-stage "
                f"{'bulk-copy' if self.bulk else 'cp.async'} ring (L2 hint {self.l2pf} B), {self.minb} cta/sm, "
                f"{self.smem} B smem, {'mma.sync m16n8k16' if self.mma else f'wgmma m64n{self.nt}k16'}, "
                f"device split-K <= {self.splitk}")


#: fields :func:`override` may set and their allowed values (``max_m``: the dispatch threshold)
_ALLOWED = {"max_m": range(0, MAX_M + 1), "nwg": (1, 2), "stages": range(2, 9), "splitk": (1, 2, 4, 8, 16),
            "mma": (0, 1), "bulk": (0, 1), "l2pf": (0, 64, 128, 256)}
_OVERRIDE: dict = {}


@contextlib.contextmanager
def override(**fields: int) -> Iterator[None]:
    """Benchmarks / debugging only: change tunables of every :func:`default_config` inside the block,
    e.g. ``with override(mma=0, splitk=1):`` (fields and allowed values: ``max_m`` (the dispatch
    threshold, 0 = never), ``nwg``, ``stages``, ``splitk``, ``mma``, ``bulk``, ``l2pf``; see
    :class:`DecodeConfig`). ``nwg`` does not apply to stage 1 with FP8 activations (always 2); a
    ring over the 227 KiB opt-in limit makes the problem not decode-sized. The registry's cached
    choices of the two GEMM ops are dropped on entry and exit (``max_m`` / ``nwg`` / ``stages``
    decide which provider serves a problem). Raises ``ValueError`` naming a bad field or value."""
    for k, v in fields.items():
        if k not in _ALLOWED:
            raise ValueError(f"moe_decode.override: unknown field {k!r}; known: {sorted(_ALLOWED)}")
        if v not in _ALLOWED[k]:
            a = _ALLOWED[k]
            allowed = f"{a.start}..{a.stop - 1}" if isinstance(a, range) else ", ".join(map(str, a))
            raise ValueError(f"moe_decode.override: {k} must be one of {allowed}, got {v!r}")
    old = dict(_OVERRIDE)
    _OVERRIDE.update(fields)
    _forget_choices()
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _OVERRIDE.update(old)
        _forget_choices()


def _forget_choices() -> None:
    from dsv4.registry import get_op
    for name in ("moe_gemm1_swiglu", "moe_gemm2"):
        get_op(name).clear_cache()


def smem_bytes(nt: int, nwg: int, stages: int, fmt: str, E: int) -> int:
    """Dynamic shared memory of ``moe_decode_kernel`` (bytes): ``stages`` ring slots of
    [packed E2M1 128*nwg rows x 64 B | bf16 B tile nt x 128 | scale bytes 128*nwg x (4|8)], the
    full/empty mbarriers, the FP8 amax exchange, the NVFP4 scale table and the per-expert chunk prefix."""
    slab = 128 * nwg
    slot = slab * 64 + nt * 256 + slab * (4 if fmt == "mxfp4" else 8)
    return stages * slot + 16 * stages + 4 * nwg * 4 * nt + 4 * 256 + 16 + 4 * (E + 1)


def default_config(R: int, E: int, N: int, K: int, act: str, fmt: str, stage: int) -> Optional[DecodeConfig]:
    """Heuristic: the decode-kernel configuration for a grouped GEMM, or ``None`` when the problem is
    not decode-sized (the cuda provider then declines it). Pure host arithmetic on static shapes.

    Args: ``R`` grouped rows (the providers pass the assignments), ``E`` experts, ``N`` output rows
    of the weight (stage 1: 2I, stage 2: D), ``K`` reduction size, ``act`` 'fp8'|'bf16', ``fmt``
    'mxfp4'|'nvfp4', ``stage`` 1|2. Fields set by :func:`override` replace the heuristic's values.
    """
    o = _OVERRIDE
    if R <= 0 or E <= 0:
        return None
    m = -(-R // E)
    if m > o.get("max_m", MAX_M):
        return None
    nwg = 2 if (stage == 1 and act == "fp8") else o.get("nwg", 2)
    if N % (128 * nwg) or K % 128 or (stage == 1 and N % 256):
        return None
    nt = 8 if m <= 8 else 16
    minb = 2 if nwg == 2 else 4  # CTAs per SM (registers: __launch_bounds__(128 * nwg + 32, minb))
    fixed = smem_bytes(nt, nwg, 0, fmt, E)
    slot = smem_bytes(nt, nwg, 1, fmt, E) - fixed
    fit = (_SMEM_PER_SM // minb - 1024 - fixed) // slot
    stages = o.get("stages", max(2, min(6, fit)))
    smem = smem_bytes(nt, nwg, stages, fmt, E)
    if smem > _SMEM_OPTIN:
        return None
    tun = {k: o[k] for k in ("splitk", "mma", "bulk", "l2pf") if k in o}
    return DecodeConfig(stage, act, fmt, nt, nwg, stages, minb, smem, **tun)


_configured: set = set()


def _kernel(cfg: DecodeConfig):
    mod = load("moe_decode.cu", **cfg.defines())
    k = mod.kernel("moe_decode_kernel")
    # Raise the kernel's dynamic shared-memory limit once to the sm_90 opt-in maximum: the launch
    # size varies with E and the config, and a limit set for a smaller launch must never stick
    # (keying the attribute on the size makes a later larger launch fail with INVALID_VALUE).
    key = (id(mod), torch.cuda.current_device())
    if key not in _configured:
        set_max_dynamic_smem(k, _SMEM_OPTIN)
        _configured.add(key)
    return k


@functools.lru_cache(maxsize=None)
def _sm_count(idx: int) -> int:
    return torch.cuda.get_device_properties(idx).multi_processor_count


def grid_size(cfg: DecodeConfig, R: int, E: int, N: int, sms: int) -> int:
    """Persistent grid: min(upper bound of work items, resident CTAs). Items = (expert, chunk of
    ``nt`` rows, slab of 128*nwg weight rows); every non-empty expert adds at most one partial chunk."""
    items = (-(-R // cfg.nt) + min(E, R)) * (N // (128 * cfg.nwg))
    per_sm = max(1, min(cfg.minb, _SMEM_PER_SM // (cfg.smem + 1024)))
    return max(1, min(items, per_sm * sms))


_counters: dict = {}


def _split_buffers(cfg: DecodeConfig, grid: int, device):
    """(fp32 partials workspace, int32 arrival counters, unit capacity) of the device-side split-K.
    The counters are one persistent zeroed buffer per (device, stream): the kernel's last arriving
    unit resets its counter, so it is zero again after every launch, and launches on one stream are
    serialized by the stream. Launches on different streams use different buffers, so the MoE may
    overlap other work on another stream. Constraint: two CUDA graphs captured on the SAME stream
    share that stream's buffer and must not be replayed concurrently."""
    if cfg.splitk <= 1:
        z = torch.empty((1,), dtype=torch.float32, device=device)
        return z, z.view(torch.int32), 0
    ucap = min(cfg.splitk * grid, _UCAP_MAX)
    key = (device.index or 0, torch.cuda.current_stream(device).cuda_stream)
    cnt = _counters.get(key)
    if cnt is None:
        cnt = _counters[key] = torch.zeros((_UCAP_MAX,), dtype=torch.int32, device=device)
    ws = torch.empty((ucap * 128 * cfg.nwg * cfg.nt,), dtype=torch.float32, device=device)
    return ws, cnt, ucap


def _launch(cfg: DecodeConfig, a, a_s, w, w_s, w_g, row_start, row_count, route_w, out, out_s):
    R, K = a.shape
    E, N = w.shape[0], w.shape[1]
    k = _kernel(cfg)
    grid = grid_size(cfg, R, E, N, _sm_count(a.device.index or 0))
    ws, cnt, ucap = _split_buffers(cfg, grid, a.device)
    launch(k, grid, 128 * cfg.nwg + 32, a, a_s, w, w_s, w_g, row_start, row_count, route_w, out, out_s, ws, cnt,
           np.int32(E), np.int32(N), np.int32(K), np.int32(cfg.splitk), np.int32(ucap), np.int64(R), smem=cfg.smem)


def gemm1_swiglu(cfg: DecodeConfig, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
    """``moe_gemm1_swiglu`` on the decode kernel (``cfg`` from :func:`default_config`, stage 1); outputs as
    every provider of the op: fp8: ``(h e4m3 [R, I], h_s fp32 [R, I/128])``; bf16: ``(h bf16 [R, I], empty
    fp32 [0])``."""
    R = a.shape[0]
    I = w13.shape[1] // 2
    if cfg.act == "fp8":
        h = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=a.device)
        h_s = torch.empty((R, I // 128), dtype=torch.float32, device=a.device)
    else:
        h = torch.empty((R, I), dtype=torch.bfloat16, device=a.device)
        h_s = torch.empty((0,), dtype=torch.float32, device=a.device)
    _launch(cfg, a, a_s if a_s is not None else route_w, w13, w13_scale, g13, row_start, row_count,
            route_w, h, h_s if cfg.act == "fp8" else route_w)
    return h, h_s


def gemm2(cfg: DecodeConfig, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
    """``moe_gemm2`` on the decode kernel (``cfg`` stage 2): fp32 ``y [R, D]`` (rows outside every expert
    unspecified)."""
    y = torch.empty((h.shape[0], w2.shape[1]), dtype=torch.float32, device=h.device)
    _launch(cfg, h, h_s if (h_s is not None and h_s.numel()) else g2, w2, w2_scale, g2, row_start,
            row_count, g2, y, g2)
    return y
