"""CuTe DSL providers of the MoE grouped GEMMs: ``moe_gemm1_swiglu`` and ``moe_gemm2``
(``dsv4/ops/moe.py``), on :class:`kernels_dsl.sm90.grouped_gemm.Fp4GroupedGemmKernel`.

Both ops, every variant: MXFP4 / NVFP4 weights x FP8 (W4A8) / BF16 (W4A16) activations x
contiguous / masked grouped layouts x prefill / decode (one kernel; the configuration -- tile,
ring depth -- is picked per problem by :func:`kernels_dsl.sm90.config.choose`, whose
``explain()`` line is the provider's support reason, i.e. what ``registry.last_choice(op)
.explain()`` and ``dsv4 ops`` print).

The registry default for prefill-sized groups (> 16 rows per expert on average: the cuda provider,
asked first, declines them; kernels_cuda/moe.py). Decode-sized groups go to cuda's moe_decode.cu
(measured faster there); force this one with ``registry.use(moe_gemm1_swiglu="dsl", moe_gemm2="dsl")``
or ``DSV4_OPS``. GPU test runs and timings: docs/benchmarks.md ("MoE grouped GEMMs in CuTe DSL",
"MoE layer").

Scheduling hint: ``problem["max_m"]`` (the largest per-expert row count, when the caller knows
it: masked layout = its ``max_m``; DeepGEMM's ``expected_m_per_group``) selects the token tile;
without it the average ``R / E`` is used. Only performance depends on it.

Precision contract (tests/test_moe.py, tests/test_moe_decode.py; measured numbers in
docs/benchmarks.md): GEMM2 relative (Frobenius) error vs the exact-dequant fp32 reference on
the same inputs <= 5e-3 under W4A8 (FP8 WGMMA per 128-K block promoted into fp32, DeepGEMM
style; NVFP4 through the exact hi + lo E4M3 split), <= 1e-5 under W4A16 (exact BF16 products,
fp32 accumulation). GEMM1's ``h`` goes through bf16 and FP8 (DSV4 act_quant) exactly like the
reference; ``h_s`` equals the reference's except where an amax lands on a power-of-two boundary.

Bad input: any ``row_start`` / ``row_count`` values are safe (clamped to ``[0, R)``, experts with
no valid row are skipped, no weight outside ``[0, E)`` is ever read; see
:mod:`kernels_dsl.sm90.scheduler`). Rows outside every expert's range are unspecified.
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_variants, dl, i32, launch_on
from .sm90 import config as _cfg

__all__ = ["DslMoEGemm1", "DslMoEGemm2", "PROVIDERS", "compile_check", "PTX_PATTERNS", "launch_gemm"]

#: what every compiled variant's PTX must contain (tests/test_compile_dsl.py)
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n128k(32\.f32\.e4m3\.e4m3|16\.f32\.bf16\.bf16)",
                r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global", r"prmt\.b32", r"mbarrier\.try_wait",
                r"setmaxnreg\.inc\.sync\.aligned\.u32", r"setmaxnreg\.dec\.sync\.aligned\.u32",
                r"st\.shared\.v4\.b32", r"bar\.arrive")
#: what it must not contain (local-memory arrays; a few ptxas spill slots are reported separately)
PTX_FORBIDDEN = ()

_MAX_E = 1024

#: tests only: cap on the persistent grid (None = min(work units, SMs x CTAs per SM)); a small cap
#: makes every CTA walk many work units (the row-prologue ring and the per-unit pipeline hand-offs)
GRID_CAP: Optional[int] = None


@functools.lru_cache(maxsize=None)
def _sm90_digest() -> str:
    """Hash of the sm90 package sources (kernels_dsl/_compile.py's disk-cache digest covers only
    the top-level kernels_dsl/*.py files)."""
    h = hashlib.sha256()
    for p in sorted((Path(__file__).resolve().parent / "sm90").glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def config_for(problem: dict) -> "_cfg.GroupedGemmConfig":
    """The kernel configuration :func:`kernels_dsl.sm90.config.choose` picks for an op problem."""
    return _cfg.choose(stage=problem["stage"], act=problem["act"], fmt=problem["fmt"], R=problem.get("R", 0),
                       E=problem["E"], N=problem["N"], K=problem["K"], max_m=problem.get("max_m"))


def _supports(problem) -> Support:
    K, N, E = problem["K"], problem["N"], problem["E"]
    bk = 128 if problem["act"] == "fp8" else 64
    if K % 128:
        return Support.no(f"dsl: K={K} is not a multiple of 128")
    if N % _cfg.TILE_N:
        return Support.no(f"dsl: N={N} is not a multiple of {_cfg.TILE_N} (weight tile)")
    if E > _MAX_E:
        return Support.no(f"dsl: E={E} > {_MAX_E} experts (on-chip schedule table)")
    del bk
    return Support.yes(config_for(problem).explain())


def _t(x, align=16, dtype=None):
    return dl(x, align, dtype)   # fp8 (dtype): the bytes retyped


def launch_gemm(cfg, *, a, a_s, w, w_s, g, row_start, row_count, route_w, out, out_s, debug: int = 0):
    """Compile (cached) and launch the grouped GEMM for ``cfg`` on torch's current stream.

    ``w`` / ``w_s``: ``[E, N, K/2]`` / ``[E, N, K/SF]`` uint8; ``g``: fp32 ``[E, 2]`` or ``[E]``;
    ``out``: GEMM1 ``[R, N/2]`` uint8 (E4M3 bytes) or bf16, GEMM2 fp32 ``[R, N]``; ``out_s``: fp32
    ``[R, N/256]`` (GEMM1 FP8) or any fp32 placeholder. No host sync. ``debug``: diagnostics
    kernels with WRONG results (:class:`~kernels_dsl.sm90.grouped_gemm.Fp4GroupedGemmKernel`).
    """
    import torch
    from cutlass import Float8E4M3FN
    from dsv4.target import Target
    from .sm90.grouped_gemm import compile_kernel
    import dataclasses
    R = a.shape[0]
    E, N, Kp = w.shape
    dev = a.device
    if cfg.scale_tma and (w_s.data_ptr() % 16 or w_s.shape[2] % 16):
        cfg = dataclasses.replace(cfg, scale_tma=False)   # the TMA box needs 16-byte aligned scale rows
    arch = Target.of(dev).arch
    fn = compile_cached(("moe_grouped_gemm", cfg.key(), arch, debug, _sm90_digest()),
                        lambda: compile_kernel(cfg, arch, debug=debug))
    sms = Target.of(dev).sm_count
    nt = N // _cfg.TILE_N
    units_ub = (-(-R // cfg.tile_m) + min(E, R)) * nt
    grid = max(1, min(units_ub, sms * cfg.ctas_per_sm, GRID_CAP or units_ub))
    fp8 = a.dtype == torch.float8_e4m3fn
    args = (_t(a, 16, Float8E4M3FN if fp8 else None), _t(a_s, 4), _t(w.view(E * N, Kp), 16),
            _t(w_s.view(E * N, w_s.shape[2]), 16 if cfg.scale_tma else 4), _t(g.view(E, -1), 4), _t(row_start, 4), _t(row_count, 4),
            _t(route_w, 4), _t(out, 16), _t(out_s, 4), i32(N), i32(grid))
    launch_on(dev, fn, *args)


def _f32_placeholder(dev):
    import torch
    return torch.zeros((1, 1), dtype=torch.float32, device=dev)


class _DslMoEBase(DslProvider):
    arch_requirement = "compiled for sm_90a only (WGMMA, TMA)"

    def supports_problem(self, problem):
        return _supports(dict(problem, stage=self.stage))

    def config(self, problem, target=None):
        """The :class:`~kernels_dsl.sm90.config.GroupedGemmConfig` :func:`config_for` picks (what ``run`` launches)."""
        return config_for(dict(problem, stage=self.stage))


class DslMoEGemm1(_DslMoEBase):
    describe = ("CuTe DSL Fp4GroupedGemmKernel stage 1: TMA ring, consumer-side prmt E2M1 decode, WGMMA m64n128 "
                "(FP8 with per-128-K fp32 promotion / BF16), clamped SwiGLU * route_w (+ FP8 1x128 UE8M0 requant)")
    stage = 1

    def run(self, problem, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
        import torch
        R, K = a.shape
        E, N = w13.shape[0], w13.shape[1]
        I = N // 2
        fp8 = problem["act"] == "fp8"
        dev = a.device
        if fp8:
            h = torch.empty((R, I), dtype=torch.float8_e4m3fn, device=dev)
            h_s = torch.empty((R, I // 128), dtype=torch.float32, device=dev)
        else:
            h = torch.empty((R, I), dtype=torch.bfloat16, device=dev)
            h_s = torch.empty((0,), dtype=torch.float32, device=dev)
        if R == 0:
            return h, h_s
        cfg = config_for(dict(problem, stage=1, R=R))
        launch_gemm(cfg, a=a, a_s=a_s if fp8 else _f32_placeholder(dev), w=w13, w_s=w13_scale, g=g13,
                    row_start=row_start, row_count=row_count, route_w=route_w,
                    out=h.view(torch.uint8) if fp8 else h, out_s=h_s if fp8 else _f32_placeholder(dev))
        return h, h_s


class DslMoEGemm2(_DslMoEBase):
    describe = ("CuTe DSL Fp4GroupedGemmKernel stage 2: TMA ring, consumer-side prmt E2M1 decode, WGMMA m64n128 "
                "(FP8 with per-128-K fp32 promotion / BF16), fp32 rows")
    stage = 2

    def run(self, problem, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
        import torch
        R = h.shape[0]
        E, N = w2.shape[0], w2.shape[1]
        y = torch.empty((R, N), dtype=torch.float32, device=h.device)
        if R == 0:
            return y
        fp8 = problem["act"] == "fp8"
        dev = h.device
        cfg = config_for(dict(problem, stage=2, R=R))
        ph = _f32_placeholder(dev)
        launch_gemm(cfg, a=h, a_s=h_s if fp8 else ph, w=w2, w_s=w2_scale, g=g2, row_start=row_start,
                    row_count=row_count, route_w=ph.view(-1), out=y, out_s=ph)
        return y


PROVIDERS = {"moe_gemm1_swiglu": DslMoEGemm1, "moe_gemm2": DslMoEGemm2}


# ------------------------------------------------------------------------------------ compile check
def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a",
                  variants: Optional[tuple] = None) -> dict[str, str]:
    """Compile the grouped GEMM for ``arch`` without a GPU: ``{"s<stage>-<act>-<fmt>-m<tile_m>[-gs]": PTX}``.
    ``variants``: tuples ``(stage, act, fmt, tile_m[, scale_tma])`` (scale_tma default True; ``-gs`` =
    scale bytes from global memory). Default: both stages x both activations x both formats at tile_m
    128, the decode tile (64) for stage 1 FP8 MXFP4, and that one with global scale loads
    (tests/test_compile_dsl.py, tests/test_moe.py)."""
    from .sm90.grouped_gemm import compile_kernel
    variants = variants or tuple((s, a, f, 128) for s in (1, 2) for a in ("fp8", "bf16") for f in ("mxfp4", "nvfp4")) \
        + ((1, "fp8", "mxfp4", 64), (1, "fp8", "mxfp4", 64, False))
    builds = {}
    for v in variants:
        s, a, f, tm = v[:4]
        st = v[4] if len(v) > 4 else True
        cfg = _cfg.GroupedGemmConfig(s, a, f, tm, 3, 256, 1, st)
        builds[f"s{s}-{a}-{f}-m{tm}" + ("" if st else "-gs")] = functools.partial(compile_kernel, cfg)
    return compile_variants("moe grouped gemm", builds, dump_dir, arch)
