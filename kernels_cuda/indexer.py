"""CUDA (NVRTC) providers for the Lightning Indexer ops: ``indexer.cu`` (helpers in ``common.cuh``).

* ``indexer_cache_write`` / ``indexer_q_quant``: no cuda provider; the CuTe DSL quantizers
  (kernels_dsl/indexer_quant.py) matched or beat this file's former warp-per-row kernel at every size
  (docs/benchmarks.md) and it was deleted.
* ``indexer_logits_paged`` (decode), **NVFP4 keys only**: ``indexer_logits_kernel``, the exact
  BF16 WGMMA path (E2M1 x E4M3 scale decoded exactly to BF16 in smem, wgmma m64nNk16, fused ReLU
  x w head sum), one launch, no host sync. MXFP4 and FP8 keys run on the CuTe DSL provider
  (kernels_dsl/indexer.py, measured faster: docs/benchmarks.md); NVFP4 has no exact FP8 operand
  and the DSL decode kernel no BF16 path, so NVFP4 decode stays here.
* ``indexer_logits`` (prefill): no cuda provider; every format runs on the CuTe DSL prefill kernel
  (kernels_dsl/indexer.py ``prefill_logits_dsl``), measured faster than this file's former
  prefill path (deleted).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load, set_max_dynamic_smem

_FMT = {"mxfp4": 0, "nvfp4": 1, "fp8": 2}
_VB = {"mxfp4": 64, "nvfp4": 64, "fp8": 128}
_SB = {"mxfp4": 4, "nvfp4": 8, "fp8": 4}
MAX_CHUNK_TILES = 256            # paged: block-table entries prefetched to smem per CTA
SMEM_PER_SM = 228 * 1024         # H100/H200: 228 KiB per SM, 1 KiB reserved per CTA
#: key formats the decode provider takes (MXFP4 / FP8: the DSL provider, see the docstring)
PAGED_FORMATS = ("nvfp4",)
_smem_set: set = set()


def logits_smem_bytes(fmt: str, nq: int, stages: int) -> int:
    """Dynamic shared memory of indexer_logits_kernel (mirrors ``struct LogitsSmem`` + 1 KiB align slack)."""
    n = 64 * nq
    size = 2 * n * 128 + 2 * 2 * 64 * 128 + stages * 64 * (_VB[fmt] + _SB[fmt]) + nq * 64 * 4 + 4 * MAX_CHUNK_TILES
    return -(-size // 1024) * 1024 + 1024


def ctas_per_sm(smem: int) -> int:
    return max(1, SMEM_PER_SM // (smem + 1024))


def _stages(fmt: str, nq: int) -> int:
    """cp.async ring depth (tiles): the deepest ring that still fits 3 CTAs per SM for next_n = 1
    (deep enough to cover HBM latency across 3 CTAs)."""
    for st in (6, 5, 4, 3, 2):
        if ctas_per_sm(logits_smem_bytes(fmt, 1, st)) >= 3:
            return st
    return 2


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


@dataclass(frozen=True)
class LogitsConfig:
    """Specialization of ``indexer_logits_kernel``: key format, ``next_n`` (N = 64 * next_n), cp.async ring
    ``stages``, dynamic ``smem`` bytes and the CTAs per SM they allow (the chunk tiles per CTA follow the batch:
    :func:`decode_chunk_tiles`)."""
    fmt: str
    next_n: int
    stages: int
    smem: int
    ctas_per_sm: int

    def __str__(self) -> str:  # what registry.last_choice("indexer_logits_paged").explain() shows
        return (f"{self.fmt} keys, N = {64 * self.next_n}, {self.stages}-stage page ring, "
                f"{self.smem // 1024} KiB smem, {self.ctas_per_sm} CTA{'s' if self.ctas_per_sm > 1 else ''}/SM")


@functools.lru_cache(maxsize=None)
def logits_config(fmt: str, next_n: int) -> LogitsConfig:
    """The heuristic: the deepest ring that keeps 3 CTAs per SM at next_n = 1 (:func:`_stages`)."""
    st = _stages(fmt, next_n)
    smem = logits_smem_bytes(fmt, next_n, st)
    return LogitsConfig(fmt, next_n, st, smem, ctas_per_sm(smem))


def _kernel(cfg: LogitsConfig):
    """The compiled kernel of one :class:`LogitsConfig` (NVFP4 keys only: the logits kernel is compiled
    for ``IDX_FMT=1`` alone, see indexer.cu)."""
    if cfg.fmt != "nvfp4":
        raise ValueError(f"indexer.cu logits kernel: fmt must be 'nvfp4' (MXFP4 / FP8 keys run on the dsl "
                         f"provider), got {cfg.fmt!r}")
    mod = load("indexer.cu", IDX_FMT=_FMT[cfg.fmt], IDX_NQ=cfg.next_n, IDX_STAGES=cfg.stages,
               IDX_MAX_CHUNK_TILES=MAX_CHUNK_TILES)
    key = (cfg.fmt, cfg.next_n, torch.cuda.current_device())
    k = mod.kernel("indexer_logits_kernel")
    if key not in _smem_set:
        set_max_dynamic_smem(k, cfg.smem)
        _set_carveout(k)
        _smem_set.add(key)
    return k


def _paged_format(problem) -> Support | None:
    if problem["fmt"] not in PAGED_FORMATS:
        return Support.no(f"cuda: {problem['fmt']} decode runs on the dsl provider (FP8 WGMMA, measured 1.3-3.0x "
                          "faster on the H200); this BF16 kernel serves NVFP4 decode only")
    return None


class _Base(CudaProvider):
    arch_requirement = "WGMMA kernels are built for sm_90a only"


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
    describe = "indexer.cu indexer_logits_kernel (paged): exact BF16 WGMMA m64n(64*next_n)k16, cp.async page ring"

    def supports_problem(self, problem):
        from dsv4.ops.indexer import paged_support
        return paged_support(problem, "cuda", _paged_format(problem), "sm_90a, NVFP4 keys, block_size % 64 == 0, "
                             "next_n <= 4")

    def config(self, problem, target=None):
        """The :class:`LogitsConfig` ``run`` launches (:func:`logits_config`)."""
        return logits_config(problem["fmt"], problem["next_n"])

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        B, nn = q_data.shape[:2]
        max_ctx = problem["max_ctx"]
        out = torch.empty((B * nn, max_ctx), dtype=torch.float32, device=q_data.device)
        if B == 0:
            return out
        cfg = self.config(problem)
        kern = _kernel(cfg)
        ntiles = -(-max_ctx // 64)
        ct = decode_chunk_tiles(B, ntiles, cfg.ctas_per_sm * _sm_count(q_data.device))
        grid = (B, -(-ntiles // ct), 1)
        qg = q_global if q_global is not None else w
        kg = k_global if k_global is not None else w
        qsf = q_sf if q_sf.numel() else q_data
        launch(kern, grid, 128, q_data, qsf, w, qg, kg, cache, cache, lens, block_table, out,
               np.int32(B * nn), np.int32(max_ctx), np.int64(max_ctx), np.int32(ct), np.int32(cache.shape[1]),
               np.int32(block_table.shape[1]), np.int32(nn), np.int32(cache.shape[0]), smem=cfg.smem)
        return out


PROVIDERS = {
    "indexer_logits_paged": CudaPagedLogits,
}
