"""CuTe DSL providers of the quantization ops (registry module ``quantize``).

Kernels: ``kernels_dsl/quantize_fp4.py`` (NVFP4 / MXFP4 quantizers + the NVFP4 amax-partials
kernel) and ``kernels_dsl/quantize_fp8.py`` (FP8 block quantizer and dequantizer); inline PTX in
``kernels_dsl/_quantize_ptx.py``; the E2M1 encoder in ``kernels_dsl/sm90/fp4.py``. All bit-exact
with :mod:`dsv4.formats` (OCP MX NaN rule for the FP4 formats).

Every kernel is compiled once per static specialization (format, input dtype, rule / layout,
global-scale source, geometry, arch; :func:`compile_fp4` / :func:`compile_fp8` /
:func:`compile_fp8_dq`); sizes and pointers are runtime scalars (``Int64`` addresses, the op has
validated every tensor), so one compile serves every shape and a launch needs no DLPack
conversion. No host sync, CUDA-graph capturable, one launch per op except NVFP4 with a device
amax: one launch for small tensors (a single CTA up to ``TUNING["fused_max_chunks"]`` 16-byte
chunks; or, with ``TUNING["grid_sync"]``, a grid-synchronized launch for tensors of at most one
4-warp CTA per SM, whose tiles stay in registers across the grid-wide amax: x read once), else
two (amax partials, then quantize; x read twice, its last ``l2_keep_bytes`` kept in L2).

The grid-synchronized path keeps one 8-byte counter per (device, stream) (:func:`_grid_workspace`,
zero at rest, reset by each launch): launches of it that share a stream are serialized by the
stream; two streams get two counters.
"""
from __future__ import annotations

import functools

from dsv4.config import env_int
from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, launch_on

try:
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

_IN = ("bfloat16", "float16")
#: Launch tuning (never changes results): warp-tile loads per lane, warps per CTA, CTAs per SM cap of the
#: grid-stride loop, register launch bound, L2 load policy; NVFP4 device amax: single-CTA limit (linear
#: layout; swizzled only with ``fused_swizzled``: the 128-row zero padding makes one CTA slow), L2 keep
#: window of the amax pass, reverse tile order, the grid-synchronized one-launch path (``grid_sync``,
#: ``grid_warps`` per CTA); ``tuned``: apply :data:`TUNED`. The DSV4_QUANT_* environment overrides are
#: read once at import (dsv4/config.py).
TUNING = {"qj": 8, "warps": 8, "ctas_per_sm": 4, "min_blocks": 0, "l2_hint": 1,
          "fused_max_chunks": env_int("DSV4_QUANT_FUSED_MAX_CHUNKS"), "fused_swizzled": 0,
          "l2_keep_bytes": env_int("DSV4_QUANT_L2_KEEP_MB") << 20, "reverse": env_int("DSV4_QUANT_REVERSE"),
          "grid_sync": env_int("DSV4_QUANT_GRID_SYNC"), "grid_warps": 4, "tuned": 1}

#: Geometries measured faster at 8192 x 8192 by ``bench/bench_quantize.py --sweep`` (H200, job quant-02,
#: 2026-12-01) and verified bit-exact there for exactly these specializations: (format, input dtype,
#: layout / rule) -> TUNING overrides. NVFP4 swizzled bf16: given scale 55.3 us (73.2% of copy BW) vs 65.9
#: at the default geometry, device amax 91.0 vs 96.4; MXFP4 dsv4 bf16: 51.0 us (78.3%) vs 60.0.
TUNED = {("nvfp4", "bfloat16", "swizzled"): {"min_blocks": 3, "ctas_per_sm": 3},
         ("mxfp4", "bfloat16", "dsv4"): {"qj": 4, "min_blocks": 4}}


def _geo(key) -> dict:
    """The launch geometry for a (format, input dtype, variant) specialization."""
    g = {k: TUNING[k] for k in ("qj", "warps", "ctas_per_sm", "min_blocks", "l2_hint")}
    if TUNING["tuned"]:
        g.update(TUNED.get(key, {}))
    g["l2_hint"] = g["l2_hint"] != 0
    return g


_WS: dict = {}


def _grid_workspace(dev):
    """The grid-barrier counter + generation (2 x int32, zero at rest) of the one-launch device-amax
    NVFP4 path, one per (device, stream): launches sharing it must be serialized."""
    import torch
    key = (dev.index, torch.cuda.current_stream(dev).cuda_stream)
    w = _WS.get(key)
    if w is None:
        w = _WS[key] = torch.zeros(2, dtype=torch.int32, device=dev)
    return w


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(dev) -> int:
    import torch
    return _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def _grid(n_tiles: int, warps: int, dev, pad_threads: int = 0, ctas_per_sm: int | None = None) -> int:
    cap = _sms(dev) * (ctas_per_sm or TUNING["ctas_per_sm"]) * max(1, 8 // warps)
    need = max(-(-n_tiles // warps), -(-pad_threads // (32 * warps * 8)))
    return max(1, min(need, cap))


def _fake():
    from cutlass.cute.runtime import make_fake_stream
    return make_fake_stream()


def compile_fp4(cfg, arch: str = "sm_90a", extra: str = ""):
    from .quantize_fp4 import Fp4QuantizeKernel
    z, i = Int64(0), Int32(0)
    return cute.compile(Fp4QuantizeKernel(cfg), z, z, z, z, z, i, z, i, i, i, i, i, z, i, _fake(),
                        options=compile_options(arch, extra))


def compile_amax(qj: int, warps: int, arch: str = "sm_90a", extra: str = ""):
    from .quantize_fp4 import AmaxPartialsKernel
    z, i = Int64(0), Int32(0)
    return cute.compile(AmaxPartialsKernel(qj, warps), z, z, z, z, i, _fake(), options=compile_options(arch, extra))


def _fp4_fn(cfg, arch):
    return compile_cached(("quantize_fp4", cfg, arch), lambda: compile_fp4(cfg, arch))


#: Ops whose DSL kernels passed the bit-exact H200 checks (job quant-02, 2026-12-01: 761 checks, every
#: family, input dtype, layout / rule, launch path and 6 launch geometries, CUDA-graph replay); an op
#: set to False answers "no" (never a default, never forced).
VALIDATED = {"quantize_nvfp4": True, "quantize_mxfp4": True, "quantize_fp8_block": True,
             "dequantize_fp8_block": True}


def _unvalidated(op: str):
    if not VALIDATED.get(op):
        return Support.no("dsl: kernel not validated on the H200 (issue 16)")
    return None


def _prefer_other(op: str, reason: str):
    """``Support.no(reason)`` where the cuda provider was measured faster for this problem class, unless
    the dsl provider is forced (``registry.use`` / ``DSV4_OPS``): then it runs (it is bit-exact)."""
    from dsv4 import registry
    if registry._forced_kind(op) == "dsl":
        return None
    return Support.no(reason)


#: The measurements behind the provider preference (bench/bench_quantize.py, H200, job quant-02, 2026-12-01,
#: CUDA-graph us, dsl / cuda; copy bandwidth 4252 GB/s).
MEASURED = {
    "quantize_nvfp4": "device amax 8192^2 swz 91.0 / 102.7 (tuned geometry), lin 95.1 / 98.7, 2048x7168 swz 24.7 / "
                      "27.2, 128x7168 6.1 (1 launch) / 6.8, 16x7168 swz 6.2 (1 launch) / 6.5, lin 5.3 / 5.6, 1x7168 "
                      "swz 6.7 (2 launches) / 16.9, lin 3.2 / 4.0; given scale swz 8192^2 55.3 / 65.0, 2048x7168 16.1 "
                      "/ 17.5",
    "quantize_nvfp4-given-small": "cuda measured faster for a caller-supplied global scale except bf16 swizzled at "
                                  "M > 128 (given swz: 128x7168 4.00 / dsl 4.21, 16x7168 3.95 / 5.51, 1x7168 4.16 / "
                                  "4.41; 8192^2 at the untuned dsl geometry 65.0 / 67.0)",
    "quantize_mxfp4": "bf16 at M * K >= 2^20: dsv4 8192^2 51.0 / 56.6 (tuned geometry), 2048x7168 13.0 / 15.4; ocp "
                      "60.3 / 60.5, 15.3 / 16.4",
    "quantize_mxfp4-small": "cuda measured faster below 2^20 elements and for fp16 input (dsv4 128x7168 3.40 / dsl "
                            "4.08, 16x7168 2.83 / 3.04; ocp 3.62 / 5.59, 3.05 / 3.87; fp16 runs the untuned dsl "
                            "geometry: 8192^2 bf16 there 56.6 / 64.0)",
    "quantize_fp8_block": "cuda measured faster at every size (b128 fp32 8192^2 60.5 / dsl 80.0 at its best "
                          "geometry, 2048x7168 15.6 / 21.3, 16x7168 3.7 / 4.8; ue8m0 62.1 / 74.8)",
    "dequantize_fp8_block": "cuda measured faster or equal at every size (8192^2 57.0 / dsl 56.8 at its best "
                            "geometry, 2048x7168 12.3 / 13.5, 128x7168 2.8 / 4.8, 16x7168 2.0 / 3.0)",
}


def _supports(problem, k_mult: int) -> Support:
    if problem.get("in_dtype", "bfloat16") not in _IN:
        return Support.no(f"dsl: input dtype {problem.get('in_dtype')} (kernels read bf16/fp16)")
    if problem["K"] % k_mult:
        return Support.no(f"dsl: K={problem['K']} is not a multiple of {k_mult}")
    return Support.yes("sm_90a, bf16/fp16, 16-byte chunks")


class DslQuantizeNvfp4(DslProvider):
    describe = ("quantize_fp4.py: magic-add E2M1 RNE, E4M3 scales, 16 B ld/st; device amax: 1 launch (single "
                "CTA, or grid-synchronized up to one 4-warp CTA per SM), else amax partials + quantize")

    def supports_problem(self, problem):
        no = _unvalidated("quantize_nvfp4")          # (a Support.no is falsy: no `or` chains here)
        if no is not None:
            return no
        s = _supports(problem, 16)
        if not s:
            return s
        if problem.get("global_scale") and not (problem.get("in_dtype") == "bfloat16"
                                                and problem.get("sf_layout") == "swizzled"
                                                and problem.get("M", 1 << 30) > 128):
            no = _prefer_other("quantize_nvfp4", "dsl: " + MEASURED["quantize_nvfp4-given-small"])
            if no is not None:
                return no
        return Support.yes("sm_90a, bf16/fp16; measured faster: " + MEASURED["quantize_nvfp4"])

    def run(self, problem, *, x, global_scale):
        import torch

        from dsv4.target import Target

        from .quantize_fp4 import GS_FUSED, GS_GIVEN, GS_GRID, GS_PARTIALS, Fp4Config
        M, K = x.shape
        dev = x.device
        swz = problem["sf_layout"] == "swizzled"
        ksf, kt, mt = K // 16, -(-(K // 16) // 4), -(-M // 128)
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        scale = torch.empty((mt, kt, 32, 4, 4) if swz else (M, ksf), dtype=torch.uint8, device=dev)
        gs = torch.empty((2,), dtype=torch.float32, device=dev)
        n_chunks = M * K // 8
        arch = Target.of(dev).arch
        ind = problem["in_dtype"]
        g = _geo(("nvfp4", ind, "swizzled" if swz else "linear"))
        qj, warps, cps = g["qj"], g["warps"], g["ctas_per_sm"]
        n_tiles = -(-n_chunks // (32 * qj))
        pad = ((mt * 128 - M) * kt + M * (4 * kt - ksf)) if swz else 0
        geo = (Int32(M), Int32(ksf), Int32(kt), Int32(mt * 128 if swz else M))
        gw = TUNING["grid_warps"]
        grid_n = -(-n_tiles // gw)
        fused = n_chunks <= TUNING["fused_max_chunks"] and (not swz or TUNING["fused_swizzled"])
        # one grid-synchronized launch: at most one CTA per SM, and (swizzled) few padding words per thread
        grid_ok = TUNING["grid_sync"] and grid_n <= _sms(dev) and pad <= grid_n * 32 * gw * 32
        if global_scale is not None:
            cfg = Fp4Config("nvfp4", ind, swizzled=swz, gs=GS_GIVEN, qj=qj, warps=warps, min_blocks=g["min_blocks"],
                            l2_hint=g["l2_hint"])
            launch_on(dev, _fp4_fn(cfg, arch), Int64(x.data_ptr()), Int64(data.data_ptr()), Int64(scale.data_ptr()),
                      Int64(gs.data_ptr()), Int64(global_scale.data_ptr()), Int32(1), Int64(n_chunks), *geo,
                      Int32(0), Int64(0), Int32(_grid(n_tiles, warps, dev, pad, cps)))
        elif not fused and grid_ok:
            grid = grid_n
            partials = torch.empty((grid,), dtype=torch.int32, device=dev)
            cfg = Fp4Config("nvfp4", ind, swizzled=swz, gs=GS_GRID, qj=qj, warps=gw)
            launch_on(dev, _fp4_fn(cfg, arch), Int64(x.data_ptr()), Int64(data.data_ptr()), Int64(scale.data_ptr()),
                      Int64(gs.data_ptr()), Int64(partials.data_ptr()), Int32(grid), Int64(n_chunks), *geo, Int32(0),
                      Int64(_grid_workspace(dev).data_ptr()), Int32(grid))
        elif fused:
            cfg = Fp4Config("nvfp4", ind, swizzled=swz, gs=GS_FUSED, qj=qj, warps=16)
            launch_on(dev, _fp4_fn(cfg, arch), Int64(x.data_ptr()), Int64(data.data_ptr()), Int64(scale.data_ptr()),
                      Int64(gs.data_ptr()), Int64(0), Int32(0), Int64(n_chunks), *geo, Int32(0), Int64(0), Int32(1))
        else:
            grid1 = _grid(n_tiles, warps, dev, 0, cps)
            partials = torch.empty((grid1,), dtype=torch.int32, device=dev)
            amax = compile_cached(("quantize_amax", qj, warps, arch), lambda: compile_amax(qj, warps, arch))
            keep_from = max(0, n_chunks - TUNING["l2_keep_bytes"] // 16)
            launch_on(dev, amax, Int64(x.data_ptr()), Int64(partials.data_ptr()), Int64(n_chunks), Int64(keep_from),
                      Int32(grid1))
            cfg = Fp4Config("nvfp4", ind, swizzled=swz, gs=GS_PARTIALS, qj=qj, warps=warps, min_blocks=g["min_blocks"],
                            l2_hint=g["l2_hint"])
            launch_on(dev, _fp4_fn(cfg, arch), Int64(x.data_ptr()), Int64(data.data_ptr()), Int64(scale.data_ptr()),
                      Int64(gs.data_ptr()), Int64(partials.data_ptr()), Int32(grid1), Int64(n_chunks), *geo,
                      Int32(TUNING["reverse"]), Int64(0), Int32(_grid(n_tiles, warps, dev, pad, cps)))
        return data, scale.view(torch.float8_e4m3fn), gs


class DslQuantizeMxfp4(DslProvider):
    describe = "quantize_fp4.py: UE8M0 per 32 (dsv4 ceil / ocp floor), magic-add E2M1 RNE, 16 B ld/st, 1 launch"

    def supports_problem(self, problem):
        no = _unvalidated("quantize_mxfp4")
        if no is not None:
            return no
        s = _supports(problem, 32)
        if not s:
            return s
        if problem.get("in_dtype") != "bfloat16" or problem.get("M", 1 << 30) * problem["K"] < (1 << 20):
            no = _prefer_other("quantize_mxfp4", "dsl: " + MEASURED["quantize_mxfp4-small"])
            if no is not None:
                return no
        return Support.yes("sm_90a, bf16/fp16; measured faster: " + MEASURED["quantize_mxfp4"])

    def run(self, problem, *, x):
        import torch

        from dsv4.target import Target

        from .quantize_fp4 import Fp4Config
        M, K = x.shape
        dev = x.device
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        scale = torch.empty((M, K // 32), dtype=torch.uint8, device=dev)
        n_chunks = M * K // 8
        if n_chunks:
            g = _geo(("mxfp4", problem["in_dtype"], problem["rule"]))
            qj, warps = g["qj"], g["warps"]
            cfg = Fp4Config("mxfp4", problem["in_dtype"], rule=problem["rule"], qj=qj, warps=warps,
                            min_blocks=g["min_blocks"], l2_hint=g["l2_hint"])
            fn = _fp4_fn(cfg, Target.of(dev).arch)
            n_tiles = -(-n_chunks // (32 * qj))
            launch_on(dev, fn, Int64(x.data_ptr()), Int64(data.data_ptr()), Int64(scale.data_ptr()), Int64(0), Int64(0),
                      Int32(0), Int64(n_chunks), Int32(M), Int32(K // 32), Int32(0), Int32(M), Int32(0), Int64(0),
                      Int32(_grid(n_tiles, warps, dev, 0, g["ctas_per_sm"])))
        return data, scale.view(torch.float8_e8m0fnu)


PROVIDERS = {
    "quantize_nvfp4": DslQuantizeNvfp4,
    "quantize_mxfp4": DslQuantizeMxfp4,
}


def compile_fp8(cfg, arch: str = "sm_90a", extra: str = ""):
    from .quantize_fp8 import Fp8QuantizeKernel
    z, i = Int64(0), Int32(0)
    return cute.compile(Fp8QuantizeKernel(cfg), z, z, z, z, i, _fake(), options=compile_options(arch, extra))


def compile_fp8_dq(cfg, arch: str = "sm_90a", extra: str = ""):
    from .quantize_fp8 import Fp8DequantKernel
    z, i = Int64(0), Int32(0)
    return cute.compile(Fp8DequantKernel(cfg), z, z, z, z, i, _fake(), options=compile_options(arch, extra))


class DslQuantizeFp8Block(DslProvider):
    describe = "quantize_fp8.py: E4M3 per 1 x block (128/64/32), fp32 or UE8M0 scale, correctly rounded x/s, 1 launch"

    def supports_problem(self, problem):
        no = _unvalidated("quantize_fp8_block")
        if no is not None:
            return no
        if problem["block"] not in (32, 64, 128):
            return Support.no(f"dsl: block {problem['block']} not in (32, 64, 128)")
        s = _supports(problem, problem["block"])
        if not s:
            return s
        no = _prefer_other("quantize_fp8_block", "dsl: " + MEASURED["quantize_fp8_block"])
        return no if no is not None else s

    def run(self, problem, *, x):
        import torch

        from dsv4.target import Target

        from .quantize_fp8 import SCALE_FP32, SCALE_POW2_F32, SCALE_UE8M0, Fp8Config
        M, K = x.shape
        B = problem["block"]
        e8 = problem["scale_dtype"] == "float8_e8m0fnu"
        sc = SCALE_FP32 if problem["scale_fmt"] == "fp32" else (SCALE_UE8M0 if e8 else SCALE_POW2_F32)
        dev = x.device
        q = torch.empty((M, K), dtype=torch.uint8, device=dev)
        scale = torch.empty((M, K // B), dtype=torch.uint8 if e8 else torch.float32, device=dev)
        n_chunks = M * K // 8
        if n_chunks:
            qj, warps = TUNING["qj"], TUNING["warps"]
            cfg = Fp8Config(B, sc, problem["in_dtype"], qj, warps, TUNING["min_blocks"], TUNING["l2_hint"] != 0)
            arch = Target.of(dev).arch
            fn = compile_cached(("quantize_fp8", cfg, arch), lambda: compile_fp8(cfg, arch))
            launch_on(dev, fn, Int64(x.data_ptr()), Int64(q.data_ptr()), Int64(scale.data_ptr()), Int64(n_chunks),
                      Int32(_grid(-(-n_chunks // (32 * qj)), warps, dev)))
        return q.view(torch.float8_e4m3fn), (scale.view(torch.float8_e8m0fnu) if e8 else scale)


#: dequant geometry: 16-byte output units per lane per step, warps per CTA
DQ_TUNING = {"units": 8, "warps": 8, "ctas_per_sm": 4}


class DslDequantizeFp8Block(DslProvider):
    describe = "quantize_fp8.py Fp8DequantKernel: cvt e4m3x2 -> f16x2 -> fp32, one rounding, 16 B stores, 1 launch"

    def supports_problem(self, problem):
        no = _unvalidated("dequantize_fp8_block")
        if no is not None:
            return no
        if problem["block"] not in (32, 64, 128):
            return Support.no(f"dsl: block {problem['block']} not in (32, 64, 128)")
        if problem["K"] % problem["block"]:
            return Support.no(f"dsl: K={problem['K']} is not a multiple of block {problem['block']}")
        no = _prefer_other("dequantize_fp8_block", "dsl: " + MEASURED["dequantize_fp8_block"])
        return no if no is not None else Support.yes("sm_90a")

    def run(self, problem, *, q, scale):
        import torch

        from dsv4.ops._common import str_dtype
        from dsv4.target import Target

        from .quantize_fp8 import Fp8DqConfig
        M, K = q.shape
        od = problem["out_dtype"]
        out = torch.empty((M, K), dtype=str_dtype(od), device=q.device)
        E = 4 if od == "float32" else 8
        n_units = M * K // E
        if n_units:
            units, warps = DQ_TUNING["units"], DQ_TUNING["warps"]
            cfg = Fp8DqConfig(problem["block"], problem["scale_dtype"] == "float8_e8m0fnu", od, units, warps)
            arch = Target.of(q.device).arch
            fn = compile_cached(("dequant_fp8", cfg, arch), lambda: compile_fp8_dq(cfg, arch))
            n_tiles = -(-n_units // (32 * units))
            grid = max(1, min(-(-n_tiles // warps), _sms(q.device) * DQ_TUNING["ctas_per_sm"] * max(1, 8 // warps)))
            launch_on(q.device, fn, Int64(q.data_ptr()), Int64(scale.data_ptr()), Int64(out.data_ptr()),
                      Int64(n_units), Int32(grid))
        return out


PROVIDERS.update({
    "quantize_fp8_block": DslQuantizeFp8Block,
    "dequantize_fp8_block": DslDequantizeFp8Block,
})


# ------------------------------------------------------------------------------ CPU compile check
PTX_PATTERNS = (r"st\.global\.(v4\.)?b32",)
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")


def default_configs() -> dict:
    """The specializations the providers launch by default (bf16, current TUNING): name -> build."""
    from .quantize_fp4 import GS_GIVEN, GS_PARTIALS, Fp4Config
    from .quantize_fp8 import SCALE_UE8M0, Fp8Config, Fp8DqConfig
    qj, warps, mb = TUNING["qj"], TUNING["warps"], TUNING["min_blocks"]
    return {
        "nvfp4-swz-partials": lambda a, e: compile_fp4(Fp4Config("nvfp4", swizzled=True, gs=GS_PARTIALS, qj=qj,
                                                                  warps=warps, min_blocks=mb), a, e),
        "nvfp4-swz-given": lambda a, e: compile_fp4(Fp4Config("nvfp4", swizzled=True, gs=GS_GIVEN, qj=qj, warps=warps,
                                                               min_blocks=mb), a, e),
        "mxfp4-dsv4": lambda a, e: compile_fp4(Fp4Config("mxfp4", qj=qj, warps=warps, min_blocks=mb), a, e),
        "fp8-b128-ue8m0": lambda a, e: compile_fp8(Fp8Config(128, SCALE_UE8M0, "bfloat16", qj, warps, mb), a, e),
        "dequant-b128-bf16": lambda a, e: compile_fp8_dq(Fp8DqConfig(128, False, "bfloat16", DQ_TUNING["units"],
                                                                     DQ_TUNING["warps"]), a, e),
    }


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile the providers' default specializations (:func:`default_configs`) for ``arch`` on the CPU."""
    from ._compile import compile_variants
    return compile_variants("quantize", default_configs(), dump_dir, arch, only)
