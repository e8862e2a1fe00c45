"""CUDA (NVRTC) providers for the Lightning Indexer ops: ``indexer.cu`` + ``indexer.cuh``.

* ``indexer_cache_write`` / ``indexer_q_quant``: ``indexer_quant_kernel``, one warp per 128-dim
  row (FWHT Hadamard by shuffles, MXFP4 / NVFP4 / FP8 encode), one launch.
* ``indexer_logits`` (prefill) and ``indexer_logits_paged`` (decode, NQ = next_n, N = 64*next_n):
  ``indexer_logits_kernel``, one launch for the whole batch, no host sync (graph capturable),
  cp.async key ring, ReLU + head-weighted sum fused in the epilogue, on one of two MMA paths:

  - FP8 path (``IDX_MMA8``; default for MXFP4 keys): E2M1 nibbles placed as E4M3 bytes without
    their scale (exact), one wgmma m64nNk32 e4m3 per 32-dim UE8M0 block into a fresh accumulator,
    folded exactly into an FP32 sum with the power-of-two block scales (exact: a k32 sum of
    E2M1 x E2M1 products fits Hopper's 13-bit FP8 accumulator). Prefill NQ = 2, decode next_n
    1..3 (next_n = 4 and NVFP4 run on the BF16 path). FP8 keys can use it too
    (``DSV4_INDEXER_FP8_KEYS=fold|nofold``: raw E4M3 bytes, not exact on Hopper; measured).
  - BF16 path: FP4/FP8 keys decoded exactly to BF16 in shared memory, wgmma m64nNk16 BF16
    (prefill NQ = 4). Default for NVFP4 and FP8 keys; ``DSV4_INDEXER_MMA=bf16`` selects it for
    MXFP4 too.

No CuTe DSL provider yet: the logits kernel builds its exact operand encodings in 128B-swizzled
shared memory, runs hand-built WGMMA descriptors on them and fuses the folds + ReLU + head
reduction across the accumulator fragment; it was written directly in CUDA C++ for control over
those layouts (a DSL port is a follow-up).

Status (2026-11-29, H200, scripts/gpu_indexer.sh, docs/benchmarks.md): both paths pass every GPU
gate; MXFP4 decode on the FP8 path B=32 x 32768 76.1 us (21.9% of copy BW; BF16 path 88.6 us);
MXFP4 prefill on the BF16 path 430 TFLOP/s (FP8 path 336), hence ``DSV4_INDEXER_MMA=auto``. FP8
keys on the FP8 path measured 1.5e-4 / 7.1e-4 gate (a) error (not exact): opt-in only. The
tuning knobs ``DSV4_INDEXER_BULK`` / ``_DEFER`` / ``_SPLIT_NN`` / ``_DECODE_ACCBUF`` passed gate (a) on
the H200 (scripts/gpu_final.sh); BULK was faster (B=128 x 32768: 222 vs 252 us) and is the default,
the others were not faster and stay off.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv4.config import env_choice, env_flag, env_int
from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load, set_max_dynamic_smem

_FMT = {"mxfp4": 0, "nvfp4": 1, "fp8": 2}
_VB = {"mxfp4": 64, "nvfp4": 64, "fp8": 128}
_SB = {"mxfp4": 4, "nvfp4": 8, "fp8": 4}
PREFILL_NQ = 4
MAX_CHUNK_TILES = 256            # paged (tuned): block-table entries prefetched to smem per CTA
SMEM_PER_SM = 228 * 1024         # H100/H200: 228 KiB per SM, 1 KiB reserved per CTA
_smem_set: set = set()


def tuned() -> bool:
    """The tuned configuration (default; ``DSV4_INDEXER_TUNED=0`` turns it off): exact
    bit-placement E2M1 decode (IDX_FASTDEC, verified on all 256 bytes on the H200),
    block-table prefetch + batched query loads (IDX_TUNED), max smem carveout, 3 CTAs/SM decode
    rings, one-wave decode grids, 64-tile prefill chunks. GPU gates passed with it on the H200
    (2026-11-29, tests/test_indexer.py)."""
    return env_flag("DSV4_INDEXER_TUNED")


def _fastdec() -> int:
    return 1 if tuned() else 0


def _prefill_chunk_tiles() -> int:
    return 64 if tuned() else 16


def logits_smem_bytes(fmt: str, nq: int, stages: int, paged: bool) -> int:
    """Dynamic shared memory of indexer_logits_kernel (mirrors ``struct LogitsSmem`` + 1 KiB align slack)."""
    n = 64 * nq
    size = (2 * n * 128 + 2 * 2 * 64 * 128 + stages * 64 * (_VB[fmt] + _SB[fmt]) + nq * 64 * 4 + 2 * 64 * 4
            + (4 * MAX_CHUNK_TILES if paged and tuned() else 0))
    return -(-size // 1024) * 1024 + 1024


def _stages(fmt: str, nq: int, paged: bool) -> int:
    """cp.async ring depth (tiles): decode picks the deepest ring that still fits 3 CTAs per SM
    for next_n = 1 (deep enough to cover HBM latency across 3 CTAs); prefill (keys L2-resident) 2."""
    if not paged:
        return 2
    if not tuned():
        return 4 if fmt == "fp8" else 6
    for st in (6, 5, 4, 3, 2):
        if ctas_per_sm(logits_smem_bytes(fmt, 1, st, True)) >= 3:
            return st
    return 2


def ctas_per_sm(smem: int) -> int:
    return max(1, SMEM_PER_SM // (smem + 1024))


def _set_carveout(kernel) -> None:
    """Prefer the maximum shared-memory carveout (the default may give fewer CTAs per SM)."""
    from cuda.bindings import driver
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    h = kernel.handle
    try:
        if isinstance(h, driver.CUkernel):
            from .nvrtc import _device
            driver.cuKernelSetAttribute(attr, 100, h, _device().device_id)
        else:
            driver.cuFuncSetAttribute(h, attr, 100)
    except Exception:  # noqa: BLE001 - a hint only
        pass


def mma_mode() -> str:
    """``DSV4_INDEXER_MMA`` for MXFP4 keys: ``auto`` (default: decode on the FP8 path, prefill on the
    BF16 path -- the faster of the two exact paths as measured on the H200, docs/benchmarks.md),
    ``fp8`` (both on wgmma m64nNk32 e4m3) or ``bf16`` (both on wgmma m64nNk16 BF16)."""
    return env_choice("DSV4_INDEXER_MMA")


def fp8_keys_mode() -> str:
    """``DSV4_INDEXER_FP8_KEYS`` (FP8 E4M3 keys): ``bf16`` (default: E4M3 -> BF16 exactly, BF16
    wgmma, FP32 accumulation -- exact), ``fold`` (raw E4M3 bytes on wgmma k32 e4m3, promotion per
    k32: fresh accumulator per 32 dims summed in FP32) or ``nofold`` (one tensor-core accumulator
    over the 128 dims). The two FP8-MMA modes are NOT exact on Hopper (its FP8 accumulator keeps
    ~13 mantissa bits and E4M3 x E4M3 products of one block span many binades): their gate (a)
    error is measured by tests/test_indexer.py::test_gpu_mma_variants_gate_a."""
    return env_choice("DSV4_INDEXER_FP8_KEYS")


def mma8_config(fmt: str, nq: int, paged: bool = True):
    """(IDX_FOLD, IDX_ACCBUF, CTAs per SM the registers allow) of the FP8 WGMMA path for ``nq``
    query rows per CTA (N = 64 nq), or None when that case runs on the BF16 path (NVFP4; N too
    large for the FP32 sum + block accumulators in 255 registers; the env switches above).
    Register counts from ptxas (sm_90a, no spills): MXFP4 nq 1 / 2 / 3: 128 / 230 / 229-235;
    FP8 fold nq 1 (2 buffers) 138, nq 2 (1 buffer) 207; FP8 no-fold nq 1 / 2 / 4: 64 / 128 / 164."""
    if fmt == "nvfp4":
        return None
    if fmt == "mxfp4":
        mode = mma_mode()
        if mode == "bf16" or (mode == "auto" and not paged):
            return None
        if paged and nq == 1 and env_int("DSV4_INDEXER_DECODE_ACCBUF") == 1:
            return (1, 1, 5)   # tuning knob (bench): one block accumulator, 96 registers, 5 CTAs/SM
        return {1: (1, 2, 4), 2: (1, 2, 2), 3: (1, 1, 2)}.get(nq)
    mode = fp8_keys_mode()
    if mode == "fold":
        return {1: (1, 2, 3), 2: (1, 1, 2)}.get(nq)
    if mode == "nofold":
        return {1: (0, 2, 4), 2: (0, 2, 4), 3: (0, 2, 3), 4: (0, 2, 3)}.get(nq)
    return None


def prefill_nq(fmt: str) -> int:
    """Query rows per CTA in prefill: 4 on the BF16 path and FP8 no-fold, 2 on the FP8 fold paths
    (FP32 sum + block accumulators must fit the registers)."""
    cfg = mma8_config(fmt, 2, False)
    if cfg is None or not cfg[0]:
        return PREFILL_NQ
    nq = env_int("DSV4_INDEXER_PREFILL_NQ")   # tuning knob (bench): 1..3
    return nq if mma8_config(fmt, nq, False) is not None else 2


def logits8_smem_bytes(fmt: str, nq: int, stages: int, paged: bool, bulk: bool = False) -> int:
    """Dynamic shared memory of the FP8 path (mirrors ``struct LogitsSmem8`` + 1 KiB align slack)."""
    n = 64 * nq
    if fmt == "mxfp4":
        size = n * 128 + 2 * 64 * 128 + stages * 64 * 68 + 2 * 64 * 16
    else:
        size = n * 128 + stages * (64 * 128 + 64 * 4)
    size += nq * 64 * 4 + (4 * MAX_CHUNK_TILES if paged and tuned() else 0) + (8 * stages if bulk else 0)
    return -(-size // 1024) * 1024 + 1024


def split_next_n() -> bool:
    """``DSV4_INDEXER_SPLIT_NN`` (default 0): decode with next_n > 1 on the FP8 path runs one CTA per
    query row (N = 64, 128 registers, 4 CTAs/SM) instead of one CTA per sequence (N = 64 next_n);
    the next_n CTAs of a sequence are adjacent in the grid and read the same pages (L2 hits)."""
    return env_flag("DSV4_INDEXER_SPLIT_NN")


def bulk_copies() -> bool:
    """``DSV4_INDEXER_BULK`` (default 1 since the H200 run of 2026-11-29: exact, gate (a) passed, decode
    B=128 x 32768 222 vs 252 us next_n 1, 389 vs 415 us next_n 2; ``=0`` restores cp.async): MXFP4 decode on the FP8 path loads each 64-key page slice
    with two ``cp.async.bulk`` copies issued by one thread (mbarrier ring, one CTA barrier per
    tile) instead of 16-byte ``cp.async`` by every thread (two barriers per tile)."""
    return env_flag("DSV4_INDEXER_BULK")


def _kernel(fmt: str, nq: int, paged: bool):
    """(kernel, dynamic smem bytes, CTAs per SM) for one specialization."""
    cfg = mma8_config(fmt, nq, paged)
    if cfg is not None:
        fold, accbuf, ctas = cfg
        bulk = paged and fmt == "mxfp4" and bulk_copies()
        if paged:
            st = 2
            for cand in (8, 7, 6, 5, 4, 3, 2):
                if ctas_per_sm(logits8_smem_bytes(fmt, nq, cand, True, bulk)) >= ctas:
                    st = cand
                    break
        else:
            st = 3
        smem = logits8_smem_bytes(fmt, nq, st, paged, bulk)
        defer = int(env_flag("DSV4_INDEXER_DEFER"))   # tuning knob (bench), default off
        mod = load("indexer.cu", IDX_FMT=_FMT[fmt], IDX_NQ=nq, IDX_PAGED=int(paged), IDX_STAGES=st,
                   IDX_TUNED=int(tuned()), IDX_MAX_CHUNK_TILES=MAX_CHUNK_TILES, IDX_MMA8=1, IDX_FOLD=fold,
                   IDX_ACCBUF=accbuf, IDX_BULK=int(bulk), IDX_DEFER=defer, IDX_MINB=ctas)
        ctas = min(ctas, ctas_per_sm(smem))
        key = (fmt, nq, paged, "mma8", fold, accbuf, bulk, defer, tuned(), torch.cuda.current_device())
    else:
        st = _stages(fmt, nq, paged)
        mod = load("indexer.cu", IDX_FMT=_FMT[fmt], IDX_NQ=nq, IDX_PAGED=int(paged), IDX_STAGES=st,
                   IDX_FASTDEC=_fastdec(), IDX_TUNED=int(tuned()), IDX_MAX_CHUNK_TILES=MAX_CHUNK_TILES)
        smem = logits_smem_bytes(fmt, nq, st, paged)
        ctas = ctas_per_sm(smem)
        key = (fmt, nq, paged, "bf16", tuned(), torch.cuda.current_device())
    k = mod.kernel("indexer_logits_kernel")
    if key not in _smem_set:
        set_max_dynamic_smem(k, smem)
        if tuned():
            _set_carveout(k)
        _smem_set.add(key)
    return k, smem, ctas


class _Base(CudaProvider):
    arch_requirement = "WGMMA kernels are built for sm_90a only"


class CudaCacheWrite(_Base):
    describe = "indexer.cu indexer_quant_kernel: warp per row, shuffle FWHT, E2M1/E4M3 encode, paged store"

    def run(self, problem, *, cache, k, slot_mapping, global_scale):
        fmt = problem["fmt"]
        n = k.shape[0]
        if n == 0:
            return None
        mod = load("indexer.cu", IDX_FMT=_FMT[fmt], IDX_HADAMARD=int(problem["hadamard"]))
        slot = slot_mapping.to(torch.int64)
        g = global_scale if global_scale is not None else slot
        launch(mod.kernel("indexer_quant_kernel"), (n + 3) // 4, 128, k, slot, g, cache, cache, slot, slot,
               np.int64(n), np.int32(cache.shape[1]), np.int32(0), np.int64(cache.shape[0] * cache.shape[1]))
        return None


class CudaQQuant(_Base):
    describe = "indexer.cu indexer_quant_kernel (mode 1): warp per (t, h) row"

    def run(self, problem, *, q, w, global_scale):
        fmt = problem["fmt"]
        T = q.shape[0]
        vb, sb = _VB[fmt], _SB[fmt]
        q_data = torch.empty((T, 64, vb), dtype=torch.uint8, device=q.device)
        q_sf = torch.empty((T, 64, 0 if fmt == "fp8" else sb), dtype=torch.uint8, device=q.device)
        w_out = torch.empty((T, 64), dtype=torch.float32, device=q.device)
        rows = T * 64
        if rows == 0:
            return q_data, q_sf, w_out
        mod = load("indexer.cu", IDX_FMT=_FMT[fmt], IDX_HADAMARD=int(problem["hadamard"]))
        g = global_scale if global_scale is not None else w
        sf = q_sf if fmt != "fp8" else q_data
        launch(mod.kernel("indexer_quant_kernel"), (rows + 3) // 4, 128, q, w, g, q_data, sf, w, w_out,
               np.int64(rows), np.int32(1), np.int32(1), np.int64(0))
        return q_data, q_sf, w_out


class CudaLogits(_Base):
    describe = ("indexer.cu indexer_logits_kernel: WGMMA m64n128k32 E4M3 (MXFP4, exact per-block folds) or "
                "m64n256k16 BF16 (exact FP4/FP8 decode), fused ReLU x w head sum")

    def run(self, problem, *, q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global):
        fmt = problem["fmt"]
        T, S = q_data.shape[0], k_data.shape[0]
        out = torch.empty((T, S), dtype=torch.float32, device=q_data.device)
        if T == 0 or S == 0:
            return out
        nq = prefill_nq(fmt)
        kern, smem, _ = _kernel(fmt, nq, False)
        ct = _prefill_chunk_tiles()
        grid = ((T + nq - 1) // nq, -(-S // (ct * 64)), 1)
        qg = q_global if q_global is not None else w
        kg = k_global if k_global is not None else w
        qsf = q_sf if q_sf.numel() else q_data
        launch(kern, grid, 128, q_data, qsf, w, qg, kg, k_data, k_sf, ks, ke, out,
               np.int32(T), np.int32(S), np.int64(S), np.int32(ct), np.int32(64), np.int32(0), np.int32(nq),
               np.int32(0), smem=smem)
        return out


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_chunk_tiles(B: int, ntiles: int, capacity: int) -> int:
    """64-key tiles per CTA: the fewest (most CTAs, shortest per-CTA chain) such that the grid
    B x ceil(ntiles / ct) fits one wave of ``capacity`` resident CTAs, capped at MAX_CHUNK_TILES."""
    ct = max(1, -(-B * ntiles // capacity))
    while B * -(-ntiles // ct) > capacity and ct < ntiles:
        ct += 1
    return max(1, min(ct, MAX_CHUNK_TILES, ntiles))


class CudaPagedLogits(_Base):
    describe = ("indexer.cu indexer_logits_kernel (paged): WGMMA m64n(64*next_n)k32 E4M3 (MXFP4) or k16 BF16, "
                "cp.async page ring")

    def supports_problem(self, problem):
        if problem["block_size"] % 64:
            return Support.no(f"cuda: block_size {problem['block_size']} is not a multiple of 64")
        if not 1 <= problem["next_n"] <= 4:
            return Support.no(f"cuda: next_n {problem['next_n']} outside 1..4 (N = 64*next_n <= 256)")
        return Support.yes("sm_90a, block_size % 64 == 0, next_n <= 4")

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        fmt = problem["fmt"]
        B, nn = q_data.shape[:2]
        max_ctx = problem["max_ctx"]
        out = torch.empty((B * nn, max_ctx), dtype=torch.float32, device=q_data.device)
        if B == 0:
            return out
        nq = nn
        if nn > 1 and split_next_n() and mma8_config(fmt, 1, True) is not None:
            nq = 1   # one CTA per query row; the next_n CTAs of a sequence share its pages via L2
        kern, smem, ctas = _kernel(fmt, nq, True)
        ntiles = -(-max_ctx // 64)
        rows = B * nn // nq
        if tuned():
            ct = decode_chunk_tiles(rows, ntiles, ctas * _sm_count(q_data.device))
        else:  # the configuration measured on the H200
            ct = max(1, min(ntiles, -(-(B * ntiles) // 800)))
        grid = (rows, -(-ntiles // ct), 1)
        qg = q_global if q_global is not None else w
        kg = k_global if k_global is not None else w
        qsf = q_sf if q_sf.numel() else q_data
        launch(kern, grid, 128, q_data, qsf, w, qg, kg, cache, cache, lens, block_table, out,
               np.int32(B * nn), np.int32(max_ctx), np.int64(max_ctx), np.int32(ct), np.int32(cache.shape[1]),
               np.int32(block_table.shape[1]), np.int32(nn), np.int32(cache.shape[0]), smem=smem)
        return out


PROVIDERS = {
    "indexer_cache_write": CudaCacheWrite,
    "indexer_q_quant": CudaQQuant,
    "indexer_logits": CudaLogits,
    "indexer_logits_paged": CudaPagedLogits,
}
