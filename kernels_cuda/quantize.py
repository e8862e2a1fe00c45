"""CUDA (NVRTC) providers of the quantization ops: ``quantize.cu`` / ``quantize.cuh``.

* ``quantize_nvfp4``: caller-supplied global scale -> one launch; computed global scale ->
  one launch (single CTA computes the amax and quantizes, tensors up to
  ``TUNING["fused_max_chunks"]`` 16-byte chunks) or two launches (``quantize_amax_kernel``
  writes per-CTA amax partials; ``quantize_kernel`` reduces them in its prologue, then
  quantizes, in reverse tile order so that the tail the amax pass kept in L2 is consumed
  first). No host sync, no atomics, no persistent device state: graph-capturable and
  stream-safe.
* ``quantize_mxfp4`` / ``quantize_fp8_block``: one launch. ``dequantize_fp8_block``: one launch.

The CuTe DSL providers (``kernels_dsl/quantize.py``, same algorithms, bit-exact) are preferred where
they were measured faster (NVFP4 with a device amax; NVFP4 given scale bf16 swizzled at M > 128;
MXFP4 bf16 from 2^20 elements); these CUDA providers serve the other classes -- decode-sized MXFP4
and given-scale NVFP4, FP8 block quant and dequant -- where they measured faster (numbers:
``kernels_dsl/quantize.py`` ``MEASURED``, docs/benchmarks.md, job quant-02, 2026-12-01).
FP4 non-finite rule (OCP MX, issue 19 item 13): a block holding a NaN / Inf gets the NaN scale and
zero codes; a non-finite NVFP4 device amax gives a NaN global scale.

Launch geometry: a warp owns 2048-element tiles (8 x 16-byte loads per lane), persistent
grid-stride loop, CTAs of up to 8 warps, at most ``TUNING["ctas_per_sm"]`` x 256 threads per SM.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from dsv4.config import env_int
from dsv4.formats import E2M1_NAN_CODE
from dsv4.registry import Support

from ._provider import CudaProvider, target_support
from .nvrtc import launch, load

_IN = {"bfloat16": 0, "float16": 1}
_RULE = {"dsv4": 0, "ocp": 1}
_OUT = {"bfloat16": 0, "float16": 1, "float32": 2}
TILE_ELEMS = 2048           # elements per warp tile (32 lanes x 8 loads x 8 elements)
SMEM_WARP = {0: 256 * 4 + 256, 1: 256 * 4 + 256, 2: 512 * 4 + 256}  # per FMT

#: Launch tuning (benchmarks may override; values never change results). The three environment
#: overrides are read once at import (defaults 4096 / 32 MiB / 1 and allowed values: dsv4/config.py).
TUNING = {
    "fused_max_chunks": env_int("DSV4_QUANT_FUSED_MAX_CHUNKS"),                       # single-CTA NVFP4 path
    "l2_keep_bytes": env_int("DSV4_QUANT_L2_KEEP_MB") << 20,                          # amax pass evict_last tail
    "reverse": env_int("DSV4_QUANT_REVERSE"),                                         # quantize tail-first
    "ctas_per_sm": 4,                                                                 # x 256 threads
    "qj": 8,                                                                          # loads/lane/tile (8|4)
    "prefetch": 0,                                                                    # 1: pipelined tiles
}


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _geometry(n_chunks: int, device: torch.device, pad_words: int = 0) -> tuple[int, int]:
    """(threads per CTA, CTAs) for a persistent warp-tile loop over n_chunks 16-byte chunks
    (and, for the swizzled NVFP4 layout, enough threads for ~8 padding words each)."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    n_tiles = -(-n_chunks // (32 * TUNING["qj"]))
    wpc = 8
    while wpc > 1 and n_tiles < wpc * sms:
        wpc //= 2
    threads = 32 * wpc
    cap = sms * TUNING["ctas_per_sm"] * (256 // threads)
    need = max(-(-n_tiles // wpc), -(-pad_words // (8 * threads)))
    return threads, max(1, min(need, cap))


def _common_supports(problem, target, k_mult: int) -> Support:
    base = target_support(target)
    if base is not None:
        return base
    if problem.get("in_dtype", "bfloat16") not in _IN:
        return Support.no(f"cuda: input dtype {problem['in_dtype']} (kernels read bf16/fp16)")
    if problem["K"] % k_mult:
        return Support.no(f"cuda: K={problem['K']} is not a multiple of {k_mult}")
    return Support.yes("sm_90a, bf16/fp16, 16-byte chunks")


class _CudaBase(CudaProvider):
    pass


class CudaQuantizeNvfp4(_CudaBase):
    describe = ("quantize.cu: amax partials + quantize (2 launches; 1 for small tensors or a given global "
                "scale), magic-add E2M1 RNE, 16 B ld/st")

    def supports(self, problem, target):
        return _common_supports(problem, target, 16)

    def run(self, problem, *, x, global_scale):
        M, K = x.shape
        swz = problem["sf_layout"] == "swizzled"
        dev = x.device
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=dev)
        ksf, kt = K // 16, -(-(K // 16) // 4)
        mt = -(-M // 128)
        if swz:
            scale = torch.empty((mt, kt, 32, 4, 4), dtype=torch.uint8, device=dev)
        else:
            scale = torch.empty((M, ksf), dtype=torch.uint8, device=dev)
        gs = torch.empty((2,), dtype=torch.float32, device=dev)
        n_chunks = M * K // 8
        base = dict(DSV4_IN=_IN[problem["in_dtype"]], DSV4_FMT=0, DSV4_SF=int(swz), DSV4_E2M1_NAN=E2M1_NAN_CODE,
                    DSV4_QJ=TUNING["qj"])
        pf = TUNING["prefetch"]
        geo = (np.int32(M), np.int32(ksf), np.int32(kt), np.int32(mt * 128 if swz else M))
        pad_words = ((mt * 128 - M) * kt + M * (4 * kt - ksf)) if swz else 0
        if global_scale is not None:
            threads, grid = _geometry(n_chunks, dev, pad_words)
            mod = load("quantize.cu", DSV4_GS=1, DSV4_PREFETCH=pf, **base)
            launch(mod.kernel("quantize_kernel"), grid, threads, x, data, scale, gs, global_scale, np.int32(1),
                   np.int64(n_chunks), *geo, np.int32(0), smem=SMEM_WARP[0] * threads // 32)
        elif n_chunks <= TUNING["fused_max_chunks"]:
            mod = load("quantize.cu", DSV4_GS=2, DSV4_PREFETCH=0, **base)   # 512 threads: no prefetch
            launch(mod.kernel("quantize_kernel"), 1, 512, x, data, scale, gs, gs, np.int32(0),
                   np.int64(n_chunks), *geo, np.int32(0), smem=SMEM_WARP[0] * 16)
        else:
            threads, grid1 = _geometry(n_chunks, dev)
            _, grid = _geometry(n_chunks, dev, pad_words)
            mod = load("quantize.cu", DSV4_GS=0, DSV4_PREFETCH=pf, **base)
            partials = torch.empty((grid1,), dtype=torch.float32, device=dev)
            keep_from = max(0, n_chunks - TUNING["l2_keep_bytes"] // 16)
            launch(mod.kernel("quantize_amax_kernel"), grid1, threads, x, partials, np.int64(n_chunks),
                   np.int64(keep_from))
            launch(mod.kernel("quantize_kernel"), grid, threads, x, data, scale, gs, partials, np.int32(grid1),
                   np.int64(n_chunks), *geo, np.int32(TUNING["reverse"]), smem=SMEM_WARP[0] * threads // 32)
        return data, scale.view(torch.float8_e4m3fn), gs


class CudaQuantizeMxfp4(_CudaBase):
    describe = "quantize.cu: UE8M0 per 32 (dsv4 ceil / ocp floor), magic-add E2M1 RNE, 16 B ld/st, 1 launch"

    def supports(self, problem, target):
        return _common_supports(problem, target, 32)

    def run(self, problem, *, x):
        M, K = x.shape
        data = torch.empty((M, K // 2), dtype=torch.uint8, device=x.device)
        scale = torch.empty((M, K // 32), dtype=torch.uint8, device=x.device)
        n_chunks = M * K // 8
        if n_chunks:
            threads, grid = _geometry(n_chunks, x.device)
            mod = load("quantize.cu", DSV4_IN=_IN[problem["in_dtype"]], DSV4_FMT=1, DSV4_RULE=_RULE[problem["rule"]],
                       DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=TUNING["qj"], DSV4_PREFETCH=TUNING["prefetch"])
            launch(mod.kernel("quantize_kernel"), grid, threads, x, data, scale, scale, scale, np.int32(0),
                   np.int64(n_chunks), np.int32(M), np.int32(K // 32), np.int32(0), np.int32(M), np.int32(0),
                   smem=SMEM_WARP[1] * threads // 32)
        return data, scale.view(torch.float8_e8m0fnu)


class CudaQuantizeFp8Block(_CudaBase):
    describe = "quantize.cu: E4M3 per 1 x block (128/64/32), fp32 or UE8M0 scale, correctly rounded x/s, 1 launch"

    def supports(self, problem, target):
        return _common_supports(problem, target, problem["block"])

    def run(self, problem, *, x):
        M, K = x.shape
        B = problem["block"]
        e8 = problem["scale_dtype"] == "float8_e8m0fnu"
        rule = 0 if problem["scale_fmt"] == "fp32" else (2 if e8 else 1)
        q = torch.empty((M, K), dtype=torch.uint8, device=x.device)
        scale = torch.empty((M, K // B), dtype=torch.uint8 if e8 else torch.float32, device=x.device)
        n_chunks = M * K // 8
        if n_chunks:
            threads, grid = _geometry(n_chunks, x.device)
            mod = load("quantize.cu", DSV4_IN=_IN[problem["in_dtype"]], DSV4_FMT=2, DSV4_RULE=rule, DSV4_BLOCK=B,
                       DSV4_QJ=TUNING["qj"], DSV4_PREFETCH=TUNING["prefetch"])
            launch(mod.kernel("quantize_kernel"), grid, threads, x, q, scale, scale, scale, np.int32(0),
                   np.int64(n_chunks), np.int32(M), np.int32(K // B), np.int32(0), np.int32(M), np.int32(0),
                   smem=SMEM_WARP[2] * threads // 32)
        return q.view(torch.float8_e4m3fn), (scale.view(torch.float8_e8m0fnu) if e8 else scale)


class CudaDequantizeFp8Block(_CudaBase):
    describe = "quantize.cu dequant_fp8_kernel: cvt e4m3x2 -> f16x2 -> fp32, staged 16 B stores, 1 launch"

    def supports(self, problem, target):
        s = _common_supports(problem, target, 16)
        if not s:
            return s
        if problem["block"] % 16:
            return Support.no(f"cuda: block {problem['block']} is not a multiple of 16")
        return s

    def run(self, problem, *, q, scale):
        from dsv4.ops._common import str_dtype
        M, K = q.shape
        out = torch.empty((M, K), dtype=str_dtype(problem["out_dtype"]), device=q.device)
        n16 = M * K // 16
        if n16:
            sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device())
            grid = max(1, min(-(-n16 // 512), sms * 6))
            mod = load("quantize.cu", DSV4_OUT=_OUT[problem["out_dtype"]],
                       DSV4_SCALE=int(problem["scale_dtype"] == "float8_e8m0fnu"), DSV4_BLOCK=problem["block"])
            launch(mod.kernel("dequant_fp8_kernel"), grid, 256, q.view(torch.uint8), scale, out, np.int64(n16))
        return out


PROVIDERS = {
    "quantize_nvfp4": CudaQuantizeNvfp4,
    "quantize_mxfp4": CudaQuantizeMxfp4,
    "quantize_fp8_block": CudaQuantizeFp8Block,
    "dequantize_fp8_block": CudaDequantizeFp8Block,
}


def variants() -> list[dict]:
    """Every macro set the providers above can pass to ``load("quantize.cu", ...)`` (compile checks):
    all formats at the default DSV4_QJ=8, plus the DSV4_QJ=4 geometry for each format family."""
    out = []
    for i in (0, 1):
        for sf in (0, 1):
            for gs in (0, 1, 2):
                out.append(dict(DSV4_IN=i, DSV4_FMT=0, DSV4_SF=sf, DSV4_GS=gs, DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=8,
                                DSV4_PREFETCH=0))
        for rule in (0, 1):
            out.append(dict(DSV4_IN=i, DSV4_FMT=1, DSV4_RULE=rule, DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=8,
                            DSV4_PREFETCH=0))
        for rule in (0, 1, 2):
            for b in (32, 64, 128):
                out.append(dict(DSV4_IN=i, DSV4_FMT=2, DSV4_RULE=rule, DSV4_BLOCK=b, DSV4_QJ=8, DSV4_PREFETCH=0))
    for qj, pf in ((4, 0), (8, 1), (4, 1)):   # launch-geometry variants (TUNING), one per format family
        out += [dict(DSV4_IN=0, DSV4_FMT=0, DSV4_SF=1, DSV4_GS=0, DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=qj, DSV4_PREFETCH=pf),
                dict(DSV4_IN=0, DSV4_FMT=0, DSV4_SF=0, DSV4_GS=1, DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=qj, DSV4_PREFETCH=pf),
                dict(DSV4_IN=0, DSV4_FMT=1, DSV4_RULE=0, DSV4_E2M1_NAN=E2M1_NAN_CODE, DSV4_QJ=qj, DSV4_PREFETCH=pf),
                dict(DSV4_IN=0, DSV4_FMT=2, DSV4_RULE=0, DSV4_BLOCK=128, DSV4_QJ=qj, DSV4_PREFETCH=pf)]
    for o in (0, 1, 2):
        for sc in (0, 1):
            for b in (32, 64, 128):
                out.append(dict(DSV4_OUT=o, DSV4_SCALE=sc, DSV4_BLOCK=b))
    return out
