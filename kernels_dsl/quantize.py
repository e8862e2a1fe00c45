"""CuTe DSL providers of the quantization ops (registry module ``quantize``).

Kernels: ``kernels_dsl/quantize_fp4.py`` (NVFP4 / MXFP4 quantizers + the NVFP4 amax-partials
kernel) and ``kernels_dsl/quantize_fp8.py`` (FP8 block quantizer and dequantizer); inline PTX in
``kernels_dsl/_quantize_ptx.py``; the E2M1 encoder in ``kernels_dsl/sm90/fp4.py``. All bit-exact
with :mod:`dsv4.formats` (OCP MX NaN rule for the FP4 formats).

Every kernel is compiled once per static specialization (format, input dtype, rule / layout,
global-scale source, geometry, arch; :func:`compile_fp4` / :func:`compile_fp8` /
:func:`compile_fp8_dq`); sizes and pointers are runtime scalars (``Int64`` addresses, the op has
validated every tensor), so one compile serves every shape and a launch needs no DLPack
conversion. Every kernel is launched with programmatic dependent launch (``_quantize_ptx.py`` ``pdl_*``: it
waits for the preceding grid before any global access; the plan puts the trigger for the next launch at the
kernel start for decode sizes, at its end for the large class). No host sync, CUDA-graph capturable, one
launch per op except NVFP4 with a device amax: one launch for small tensors (a single CTA up to ``FUSED_MAX_CHUNKS`` 16-byte chunks, linear
layout; or a grid-synchronized launch for tensors of at most one 4-warp CTA per SM, whose tiles
stay in registers across the grid-wide amax: x read once), else two (amax partials, then quantize;
x read twice, its last ``L2_KEEP_BYTES`` kept in L2).

Launch geometry: each provider's ``config`` (:func:`plan_nvfp4` / :func:`plan_mxfp4` / :func:`plan_fp8` /
:func:`plan_dequant`: a frozen :class:`Plan` per problem: kernel config + grid cap) from the size class -- the measured :data:`LARGE` geometry for tensors of two or more waves of warp
tiles, small 4-warp CTAs with short tiles at decode sizes (:func:`_geometry`).

The grid-synchronized path keeps one 8-byte counter per (device, stream) (:func:`_grid_workspace`,
zero at rest, reset by each launch): launches of it that share a stream are serialized by the
stream; two streams get two counters.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, i32, i64, launch_on

try:
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

_IN = ("bfloat16", "float16")

#: Launch constants of the NVFP4 device-amax paths (never change results; formerly the DSV4_QUANT_*
#: environment switches): the single-CTA path up to FUSED_MAX_CHUNKS 16-byte chunks (linear layout:
#: the swizzled layout's 128-row zero padding makes one CTA slow), the grid-synchronized one-launch
#: path for tensors of at most one GRID_WARPS-warp CTA per SM, else two launches whose amax pass keeps
#: the last L2_KEEP_BYTES of x in L2 (evict_last) for the quantize pass, which walks the tiles in reverse.
FUSED_MAX_CHUNKS = 4096
GRID_WARPS = 4
L2_KEEP_BYTES = 32 << 20


@dataclass(frozen=True)
class Plan:
    """One quantizer launch as the provider's ``config`` chose it: the kernel specialization (its compile key) and
    the persistent-grid cap (CTAs of ``cfg.warps`` warps per SM)."""

    cfg: Any                 # Fp4Config | Fp8Config | Fp8DqConfig
    ctas_per_sm: int
    path: str = ""           # NVFP4 global scale: "given" | "partials" | "fused" | "grid"


#: Geometry of the large-tensor class (at least two waves of warp tiles) per kernel family: kernel-config
#: fields + ctas_per_sm, the fastest of the geometries swept at 8192 x 8192 bf16 on the H200 (NVFP4 given scale:
#: a bulk-copy ring of 2 tiles in 4-warp CTAs; the device-amax path and the others: register loads); re-swept with
#: PDL: none faster by more than the run-to-run spread. Numbers: docs/benchmarks.md ("quantize, indexer quantizers,
#: kv_gather" and "quantize / dequant memory pattern").
LARGE_DEFAULT = {"qj": 8, "warps": 8, "min_blocks": 0, "ctas_per_sm": 4}
LARGE = {
    "nvfp4": {"qj": 8, "warps": 4, "min_blocks": 4, "ctas_per_sm": 2, "pipe": 2, "lut": 32},
    "nvfp4-amax": {"qj": 4, "warps": 8, "min_blocks": 4, "ctas_per_sm": 4, "pipe": 0, "lut": 32},
    "mxfp4": {"qj": 4, "warps": 8, "min_blocks": 4, "ctas_per_sm": 4},
    "fp8": {"qj": 4, "warps": 8, "min_blocks": 4, "ctas_per_sm": 4},
    "dequant": {"units": 4, "warps": 4, "ctas_per_sm": 16},
}
#: benchmark / test hook, empty in production: ``{"fp4" | "fp8" | "dequant": {field: value}}`` replaces
#: fields of the planned kernel config (and ``ctas_per_sm``) at every size; ``"nvfp4_path"``: force the
#: device-amax path ("fused" | "grid" | "partials"); ``"reverse": False``: the quantize pass of the
#: two-launch path walks the tiles in order
OVERRIDE: dict = {}


def flat_override(over: dict) -> dict:
    """:data:`OVERRIDE` for launch choices given as flat keys (benchmark sweeps, tests): kernel-config fields go
    to every family that has them (``dq_*``: the dequantizer), ``ctas_per_sm`` too; ``path`` / ``reverse`` to
    the NVFP4 device-amax launch."""
    import dataclasses

    from .quantize_fp4 import Fp4Config
    from .quantize_fp8 import Fp8Config, Fp8DqConfig
    out: dict = {}
    for fam, cls in (("fp4", Fp4Config), ("fp8", Fp8Config), ("dequant", Fp8DqConfig)):
        names = {f.name for f in dataclasses.fields(cls)} | {"ctas_per_sm"}
        src = {k[3:]: v for k, v in over.items() if k.startswith("dq_")} if fam == "dequant" else over
        d = {k: v for k, v in src.items() if k in names}
        if d:
            out[fam] = d
    if "path" in over:
        out["nvfp4_path"] = over["path"]
    if "reverse" in over:
        out["reverse"] = over["reverse"] not in (0, False)
    return out


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(dev) -> int:
    import torch
    return _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def _geometry(family: str, n_chunks: int, sms: int) -> dict:
    """Launch geometry for ``n_chunks`` 16-byte input chunks: the LARGE entry when the tensor holds at
    least two waves of its warp tiles (PDL trigger at the kernel end), else 4-warp CTAs with the largest tile
    (qj 8 / 4 / 2 / 1) that still gives every SM 4 warps and no per-CTA setup (``lut`` 0; PDL trigger at the
    start; decode sizes: latency, not bandwidth)."""
    g = dict(LARGE_DEFAULT, **LARGE.get(family, {}), pdl_early=False)
    wave = sms * g["ctas_per_sm"] * g["warps"] * 32 * g["qj"]
    if n_chunks >= 2 * wave:
        return g
    qj = 8
    while qj > 1 and n_chunks < 4 * sms * 32 * qj:
        qj //= 2
    return {"qj": qj, "warps": 4, "min_blocks": 0, "ctas_per_sm": 4, "pipe": 0, "lut": 0, "pdl_early": True}


def _override(family: str, cfg, cps: int):
    o = OVERRIDE.get(family)
    if not o:
        return cfg, cps
    o = dict(o)
    cps = o.pop("ctas_per_sm", cps)
    return replace(cfg, **o), cps


def plan_nvfp4(in_dtype: str, swizzled: bool, given: bool, M: int, K: int, sms: int) -> Plan:
    """The NVFP4 launch for an ``[M, K]`` input (global scale given or from the device amax)."""
    from .quantize_fp4 import GS_FUSED, GS_GIVEN, GS_GRID, GS_PARTIALS, Fp4Config
    n_chunks = M * K // 8
    force = OVERRIDE.get("nvfp4_path")
    if not given and force in (None, "fused", "grid"):
        if force == "fused" or (force is None and n_chunks <= FUSED_MAX_CHUNKS and not swizzled):
            return Plan(Fp4Config("nvfp4", in_dtype, swizzled=swizzled, gs=GS_FUSED, qj=8, warps=16, lut=0), 1,
                        "fused")
        ksf, kt, mt = K // 16, -(-(K // 16) // 4), -(-M // 128)
        pad = ((mt * 128 - M) * kt + M * (4 * kt - ksf)) if swizzled else 0
        for qj in (1, 2, 4, 8):            # one co-resident CTA per SM, few padding words per thread
            grid_n = -(-n_chunks // (32 * qj * GRID_WARPS))
            if grid_n <= sms and pad <= grid_n * 32 * GRID_WARPS * 32 and force in (None, "grid"):
                return Plan(Fp4Config("nvfp4", in_dtype, swizzled=swizzled, gs=GS_GRID, qj=qj, warps=GRID_WARPS,
                                       lut=0),
                            1, "grid")
    g = _geometry("nvfp4" if given else "nvfp4-amax", n_chunks, sms)
    cfg = Fp4Config("nvfp4", in_dtype, swizzled=swizzled, gs=GS_GIVEN if given else GS_PARTIALS, qj=g["qj"],
                    warps=g["warps"], min_blocks=g["min_blocks"], pipe=g.get("pipe", 0), lut=g.get("lut", 0),
                    prefetch=g.get("prefetch", False), pdl_early=g["pdl_early"])
    cfg, cps = _override("fp4", cfg, g["ctas_per_sm"])
    return Plan(cfg, cps, "given" if given else "partials")


def plan_mxfp4(in_dtype: str, rule: str, M: int, K: int, sms: int) -> Plan:
    from .quantize_fp4 import Fp4Config
    g = _geometry("mxfp4", M * K // 8, sms)
    cfg = Fp4Config("mxfp4", in_dtype, rule=rule, qj=g["qj"], warps=g["warps"], min_blocks=g["min_blocks"],
                    pipe=g.get("pipe", 0), pdl_early=g["pdl_early"])
    return Plan(*_override("fp4", cfg, g["ctas_per_sm"]))


def plan_fp8(block: int, scale: int, in_dtype: str, M: int, K: int, sms: int) -> Plan:
    from .quantize_fp8 import Fp8Config
    g = _geometry("fp8", M * K // 8, sms)
    cfg = Fp8Config(block, scale, in_dtype, qj=g["qj"], warps=g["warps"], min_blocks=g["min_blocks"],
                    pdl_early=g["pdl_early"])
    return Plan(*_override("fp8", cfg, g["ctas_per_sm"]))


def plan_dequant(block: int, ue8m0: bool, out_dtype: str, M: int, K: int, sms: int) -> Plan:
    """FP8 dequant: LARGE["dequant"] for two waves or more (PDL trigger at the end), else 4-warp CTAs of 1..8
    units per lane (trigger at the start)."""
    from .quantize_fp8 import Fp8DqConfig
    g = dict(LARGE["dequant"], pdl_early=False)
    n_units = M * K // (4 if out_dtype == "float32" else 8)
    if n_units < 2 * sms * g["ctas_per_sm"] * g["warps"] * 32 * g["units"]:
        u = 8
        while u > 1 and n_units < 4 * sms * 4 * 32 * u:
            u //= 2
        g = {"units": u, "warps": 4, "ctas_per_sm": 8, "pdl_early": True}
    cfg = Fp8DqConfig(block, ue8m0, out_dtype, g["units"], g["warps"], g["pdl_early"])
    return Plan(*_override("dequant", cfg, g["ctas_per_sm"]))


def _fp8_scale(problem) -> int:
    """The FP8 quantizer's scale mode of a problem: fp32, UE8M0 bytes, or powers of two as fp32."""
    from .quantize_fp8 import SCALE_FP32, SCALE_POW2_F32, SCALE_UE8M0
    if problem["scale_fmt"] == "fp32":
        return SCALE_FP32
    return SCALE_UE8M0 if problem["scale_dtype"] == "float8_e8m0fnu" else SCALE_POW2_F32


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


#: SMs assumed when a config is explained for a target without SMs (the CPU: ``dsv4 ops --verbose``): the H200's
EXPLAIN_SMS = 132


def _target_sms(target) -> int:
    return (getattr(target, "sm_count", 0) if target is not None else 0) or EXPLAIN_SMS


def _grid(n_tiles: int, warps: int, dev, ctas_per_sm: int, pad_threads: int = 0) -> int:
    """Persistent grid: enough CTAs for the tiles (and the swizzled zero padding), at most
    ``ctas_per_sm`` CTAs of 8 warps per SM (scaled up for smaller CTAs)."""
    cap = _sms(dev) * ctas_per_sm * max(1, 8 // warps)
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


#: Ops whose DSL kernels pass the bit-exact H200 checks (every family, input dtype, layout / rule, NVFP4 launch path,
#: size class and launch geometry, NaN / Inf blocks, CUDA-graph replay, with PDL: tests/test_quantize.py -m gpu); an
#: op set to False answers "no" (never a default, never forced).
VALIDATED = {"quantize_nvfp4": True, "quantize_mxfp4": True, "quantize_fp8_block": True,
             "dequantize_fp8_block": True}


def _unvalidated(op: str):
    if not VALIDATED.get(op):
        return Support.no("dsl: kernel not validated on the H200 (issue 16)")
    return None


#: why the DSL providers are the GPU default (the CUDA quantizers they replaced were deleted)
_WHY = "faster than the deleted CUDA provider at every measured size: docs/benchmarks.md"


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
        return Support.yes(f"sm_90a, bf16/fp16 ({_WHY})")

    def config(self, problem, target=None) -> Plan:
        """The :class:`Plan` ``run`` launches (:func:`plan_nvfp4`: kernel config, grid cap, global-scale path)."""
        return plan_nvfp4(problem["in_dtype"], problem["sf_layout"] == "swizzled", problem["global_scale"] in (True, 1),
                          problem["M"], problem["K"], _target_sms(target))

    def run(self, problem, *, x, global_scale):
        import torch

        from dsv4.target import Target
        M, K = x.shape
        dev = x.device
        target = Target.of(dev)
        swz = problem["sf_layout"] == "swizzled"
        ksf, kt, mt = K // 16, -(-(K // 16) // 4), -(-M // 128)
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        scale = torch.empty((mt, kt, 32, 4, 4) if swz else (M, ksf), dtype=torch.uint8, device=dev)
        gs = torch.empty((2,), dtype=torch.float32, device=dev)
        n_chunks = M * K // 8
        arch = target.arch
        p = self.config(problem, target)
        cfg = p.cfg
        n_tiles = -(-n_chunks // (32 * cfg.qj))
        pad = ((mt * 128 - M) * kt + M * (4 * kt - ksf)) if swz else 0
        geo = (i32(M), i32(ksf), i32(kt), i32(mt * 128 if swz else M))
        ptrs = (i64(x.data_ptr()), i64(data.data_ptr()), i64(scale.data_ptr()), i64(gs.data_ptr()))
        if p.path == "given":
            launch_on(dev, _fp4_fn(cfg, arch), *ptrs, i64(global_scale.data_ptr()), i32(1), i64(n_chunks), *geo,
                      i32(0), i64(0), i32(_grid(n_tiles, cfg.warps, dev, p.ctas_per_sm, pad)))
        elif p.path == "grid":
            grid = -(-n_tiles // cfg.warps)
            partials = torch.empty((grid,), dtype=torch.int32, device=dev)
            launch_on(dev, _fp4_fn(cfg, arch), *ptrs, i64(partials.data_ptr()), i32(grid), i64(n_chunks), *geo, i32(0),
                      i64(_grid_workspace(dev).data_ptr()), i32(grid))
        elif p.path == "fused":
            launch_on(dev, _fp4_fn(cfg, arch), *ptrs, i64(0), i32(0), i64(n_chunks), *geo, i32(0), i64(0), i32(1))
        else:   # partials: amax pass (keeps the tail of x in L2), then the quantizer walks the tiles in reverse
            grid1 = _grid(n_tiles, cfg.warps, dev, p.ctas_per_sm)
            partials = torch.empty((grid1,), dtype=torch.int32, device=dev)
            amax = compile_cached(("quantize_amax", cfg.qj, cfg.warps, arch), lambda: compile_amax(cfg.qj, cfg.warps, arch))
            keep_from = max(0, n_chunks - L2_KEEP_BYTES // 16)
            launch_on(dev, amax, i64(x.data_ptr()), i64(partials.data_ptr()), i64(n_chunks), i64(keep_from), i32(grid1))
            launch_on(dev, _fp4_fn(cfg, arch), *ptrs, i64(partials.data_ptr()), i32(grid1), i64(n_chunks), *geo,
                      i32(int(OVERRIDE.get("reverse", True))), i64(0),
                      i32(_grid(n_tiles, cfg.warps, dev, p.ctas_per_sm, pad)))
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
        return Support.yes(f"sm_90a, bf16/fp16 ({_WHY})")

    def config(self, problem, target=None) -> Plan:
        """The :class:`Plan` ``run`` launches (:func:`plan_mxfp4`)."""
        return plan_mxfp4(problem["in_dtype"], problem["rule"], problem["M"], problem["K"], _target_sms(target))

    def run(self, problem, *, x):
        import torch

        from dsv4.target import Target
        M, K = x.shape
        dev = x.device
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        scale = torch.empty((M, K // 32), dtype=torch.uint8, device=dev)
        n_chunks = M * K // 8
        if n_chunks:
            target = Target.of(dev)
            p = self.config(problem, target)
            fn = _fp4_fn(p.cfg, target.arch)
            n_tiles = -(-n_chunks // (32 * p.cfg.qj))
            launch_on(dev, fn, i64(x.data_ptr()), i64(data.data_ptr()), i64(scale.data_ptr()), i64(0), i64(0),
                      i32(0), i64(n_chunks), i32(M), i32(K // 32), i32(0), i32(M), i32(0), i64(0),
                      i32(_grid(n_tiles, p.cfg.warps, dev, p.ctas_per_sm)))
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
        return Support.yes(f"sm_90a, bf16/fp16 ({_WHY})")

    def config(self, problem, target=None) -> Plan:
        """The :class:`Plan` ``run`` launches (:func:`plan_fp8`)."""
        return plan_fp8(problem["block"], _fp8_scale(problem), problem["in_dtype"], problem["M"], problem["K"],
                        _target_sms(target))

    def run(self, problem, *, x):
        import torch

        from dsv4.target import Target
        M, K = x.shape
        B = problem["block"]
        e8 = problem["scale_dtype"] == "float8_e8m0fnu"
        dev = x.device
        q = torch.empty((M, K), dtype=torch.uint8, device=dev)
        scale = torch.empty((M, K // B), dtype=torch.uint8 if e8 else torch.float32, device=dev)
        n_chunks = M * K // 8
        if n_chunks:
            target = Target.of(dev)
            p = self.config(problem, target)
            arch = target.arch
            fn = compile_cached(("quantize_fp8", p.cfg, arch), lambda: compile_fp8(p.cfg, arch))
            launch_on(dev, fn, i64(x.data_ptr()), i64(q.data_ptr()), i64(scale.data_ptr()), i64(n_chunks),
                      i32(_grid(-(-n_chunks // (32 * p.cfg.qj)), p.cfg.warps, dev, p.ctas_per_sm)))
        return q.view(torch.float8_e4m3fn), (scale.view(torch.float8_e8m0fnu) if e8 else scale)


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
        return Support.yes(f"sm_90a ({_WHY})")

    def config(self, problem, target=None) -> Plan:
        """The :class:`Plan` ``run`` launches (:func:`plan_dequant`)."""
        return plan_dequant(problem["block"], problem["scale_dtype"] == "float8_e8m0fnu", problem["out_dtype"],
                            problem["M"], problem["K"], _target_sms(target))

    def run(self, problem, *, q, scale):
        import torch

        from dsv4.ops._common import str_dtype
        from dsv4.target import Target

        M, K = q.shape
        od = problem["out_dtype"]
        out = torch.empty((M, K), dtype=str_dtype(od), device=q.device)
        E = 4 if od == "float32" else 8
        n_units = M * K // E
        if n_units:
            target = Target.of(q.device)
            p = self.config(problem, target)
            arch = target.arch
            fn = compile_cached(("dequant_fp8", p.cfg, arch), lambda: compile_fp8_dq(p.cfg, arch))
            n_tiles = -(-n_units // (32 * p.cfg.units))
            launch_on(q.device, fn, i64(q.data_ptr()), i64(scale.data_ptr()), i64(out.data_ptr()), i64(n_units),
                      i32(_grid(n_tiles, p.cfg.warps, q.device, p.ctas_per_sm)))
        return out


PROVIDERS.update({
    "quantize_fp8_block": DslQuantizeFp8Block,
    "dequantize_fp8_block": DslDequantizeFp8Block,
})


# ------------------------------------------------------------------------------ CPU compile check
PTX_PATTERNS = (r"st\.global\.(v4\.)?b32", r"griddepcontrol\.wait")
PTX_FORBIDDEN = (r"\.ftz\b", r"cvt\.r[nzmp]i\.[su]\d+\.f(32|64)", r"\.local\b")


def default_configs() -> dict:
    """The specializations the providers launch for bf16 8192 x 8192 and 16 x 7168 on a 132-SM H200
    (:func:`plan_nvfp4` ...): name -> build."""
    from .quantize_fp8 import SCALE_UE8M0
    out = {}
    for (M, K) in ((8192, 8192), (16, 7168)):
        for name, p in (("nvfp4-swz-given", plan_nvfp4("bfloat16", True, True, M, K, 132)),
                        ("nvfp4-swz-amax", plan_nvfp4("bfloat16", True, False, M, K, 132)),
                        ("mxfp4-dsv4", plan_mxfp4("bfloat16", "dsv4", M, K, 132))):
            out[f"{name}-{M}x{K}"] = lambda a, e, c=p.cfg: compile_fp4(c, a, e)
        out[f"fp8-b128-ue8m0-{M}x{K}"] = lambda a, e, c=plan_fp8(128, SCALE_UE8M0, "bfloat16", M, K, 132).cfg: \
            compile_fp8(c, a, e)
        out[f"dequant-b128-bf16-{M}x{K}"] = lambda a, e, c=plan_dequant(128, False, "bfloat16", M, K, 132).cfg: \
            compile_fp8_dq(c, a, e)
    return out


def compile_check(dump_dir=None, arch: str = "sm_90a", only=None) -> dict:
    """Compile the providers' default specializations (:func:`default_configs`) for ``arch`` on the CPU."""
    from ._compile import compile_variants
    return compile_variants("quantize", default_configs(), dump_dir, arch, only)
