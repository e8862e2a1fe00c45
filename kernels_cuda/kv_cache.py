"""CUDA (NVRTC) providers for the DSV4 KV cache ops: ``kv_cache.cu`` (+ ``kv_cache.cuh``).

``kv_cache_append`` has no CUDA provider: the CuTe DSL kernel (``kernels_dsl/kv_cache.py``, 64-bit
addresses) beat the deleted ``kv_append_kernel`` at every size, caches over 8 GiB included
(docs/benchmarks.md, "kv_cache_append and the indexer quantizers").
``kv_gather``: the DSL provider comes first and was measured faster (docs/benchmarks.md); this
kernel remains the path for caches / outputs over 2^31 32-bit words (8 GiB), which the DSL gather
kernel's int32 flat extents do not cover (to delete once it takes 64-bit extents).
The compressors (``kv_compress_prefill`` / ``kv_compress_decode``) have no DSL provider yet:
warp-level prefix scans (entry -> ragged sequence), online softmax with pinned fp32 rounding
shared bit-for-bit by prefill and decode, shuffle reductions over 4/8/16-lane groups.
No host sync, one launch per op.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ._provider import CudaProvider
from .nvrtc import launch, load

_NULL = np.uint64(0)
_FMT = {"fp8_ds_mla": 0, "mxfp4": 0, "bf16": 1}


def _ptr(t):
    return t if t is not None else _NULL


#: Tuning macros of kv_cache.cu (KVC_ONLINE, KVC_GATHER_RPW); empty = the .cu defaults.
#: Benchmarks set entries to time variants; launch grids follow RPW.
DEFAULTS: dict[str, int] = {"KVC_ONLINE": 2, "KVC_GATHER_RPW": 1}
VARIANT: dict[str, int] = {}


def _tune(name: str) -> int:
    return VARIANT.get(name, DEFAULTS[name])


def _module(fmt: str, d: int = 512, ratio: int = 4, idx64: bool = False):
    return load("kv_cache.cu", KVC_FMT=_FMT[fmt], KVC_D=d, KVC_RATIO=ratio, KVC_IDX64=int(idx64),
                **{k: _tune(k) for k in DEFAULTS})


def _bs(cache: torch.Tensor, d: int) -> int:
    if cache.dtype == torch.uint8 and cache.dim() == 2:
        return cache.shape[1] // (584 if d == 512 else 68)
    return cache.shape[1]


@dataclass(frozen=True)
class GatherConfig:
    """``kv_gather_kernel`` launch: ``rows_per_warp`` output rows per warp (KVC_GATHER_RPW), 8 warps per CTA."""
    rows_per_warp: int

    @property
    def rows_per_cta(self) -> int:
        return 8 * self.rows_per_warp

    def __str__(self) -> str:  # what registry.last_choice("kv_gather").explain() shows
        return f"256 threads/CTA, {self.rows_per_warp} row(s) per warp ({self.rows_per_cta} rows/CTA)"


def gather_config() -> GatherConfig:
    """The heuristic (one for every size): :data:`DEFAULTS` (a benchmark's :data:`VARIANT` overrides it)."""
    return GatherConfig(_tune("KVC_GATHER_RPW"))


@dataclass(frozen=True)
class CompressConfig:
    """Compressor launch: ``threads`` per CTA and ``entries_per_cta`` (mirrors the TPE / RS / EPC macros of
    kv_cache.cu: ``d / 4`` threads per entry, 4 row slices for HCA, prefill packs entries into >= 128 threads)."""
    threads: int
    entries_per_cta: int

    def __str__(self) -> str:  # what registry.last_choice("kv_compress_*").explain() shows
        n = self.entries_per_cta
        return f"{self.threads} threads/CTA, {n} entr{'ies' if n > 1 else 'y'}/CTA"


def compress_config(d: int, ratio: int, prefill: bool) -> CompressConfig:
    """The heuristic of both compressors (:class:`CompressConfig`)."""
    tpe, rs = d // 4, (4 if ratio == 128 else 1)
    epc = 1 if (tpe * rs >= 128 or not prefill) else 128 // (tpe * rs)
    return CompressConfig(tpe * rs * epc, epc)


class _Cuda(CudaProvider):
    pass


class CudaKvGather(_Cuda):
    describe = "kv_cache.cu kv_gather_kernel: warp per row, block_table lookup + lens check, exact E4M3 -> BF16"

    def config(self, problem, target=None):
        """The :class:`GatherConfig` ``run`` launches (:func:`gather_config`)."""
        return gather_config()

    def run(self, problem, *, cache, block_table, indices, lens, req_idx, swa_cache, swa_block_table, swa_indices,
            swa_lens):
        T, K = indices.shape
        W = swa_indices.shape[1] if swa_indices is not None else 0
        out = torch.empty((T, W + K, 512), dtype=torch.bfloat16, device=indices.device)
        rows = T * (W + K)
        if rows == 0:
            return out
        mod = _module(problem["fmt"])
        bs = _bs(cache, 512)
        if swa_indices is not None:
            sargs = (swa_cache, np.int32(_bs(swa_cache, 512)), np.int64(swa_cache.shape[0]), swa_block_table,
                     np.int32(swa_block_table.shape[1]), np.int32(swa_block_table.shape[0]), swa_lens, swa_indices,
                     np.int32(W))
        else:
            sargs = (_NULL, np.int32(1), np.int64(0), _NULL, np.int32(0), np.int32(0), _NULL, _NULL, np.int32(0))
        per_cta = self.config(problem).rows_per_cta
        launch(mod.kernel("kv_gather_kernel"), (rows + per_cta - 1) // per_cta, 256, cache, np.int32(bs), np.int64(cache.shape[0]),
               block_table, np.int32(block_table.shape[1]), np.int32(block_table.shape[0]), lens, indices, np.int32(K),
               *sargs, _ptr(req_idx), out, np.int64(T))
        return out


class _Compress(_Cuda):
    prefill: bool

    def config(self, problem, target=None):
        """The :class:`CompressConfig` ``run`` launches (:func:`compress_config`)."""
        return compress_config(problem["d"], problem["ratio"], self.prefill)


class CudaKvCompressPrefill(_Compress):
    describe = ("kv_cache.cu kv_compress_prefill_kernel: thread group per entry, online per-channel softmax, "
                "RMSNorm/RoPE/(Hadamard) + FP8 or MXFP4 quant, state tail CTAs")
    prefill = True

    def run(self, problem, *, kv, score, ape, norm_weight, rope_cos_sin, cu_seqlens, block_table, cache,
            kv_state, score_state):
        d, ratio = problem["d"], problem["ratio"]
        T = kv.shape[0]
        B = cu_seqlens.shape[0] - 1
        cfg = self.config(problem)
        threads, epc = cfg.threads, cfg.entries_per_cta
        n_entries = T // ratio
        n_entry_ctas = (n_entries + epc - 1) // epc
        nr = (2 if ratio == 4 else 1) * ratio
        n_state = B * nr if kv_state is not None else 0
        if n_entry_ctas + n_state == 0:
            return
        mod = _module(problem["fmt"], d, ratio)
        launch(mod.kernel("kv_compress_prefill_kernel"), n_entry_ctas + n_state, threads, kv, score, ape,
               norm_weight, rope_cos_sin, np.int64(rope_cos_sin.shape[0]), cu_seqlens, np.int32(B), np.int64(T),
               block_table, np.int32(block_table.shape[1]), cache, np.int32(_bs(cache, d)), np.int64(cache.shape[0]),
               _ptr(kv_state), _ptr(score_state), np.int32(n_entry_ctas), np.float32(problem["eps"]))


class CudaKvCompressDecode(_Compress):
    describe = "kv_cache.cu kv_compress_decode_kernel: CTA per sequence, state append + prefill's pooling code"
    prefill = False

    def run(self, problem, *, kv, score, ape, norm_weight, rope_cos_sin, positions, block_table, cache,
            kv_state, score_state):
        d, ratio = problem["d"], problem["ratio"]
        B = positions.shape[0]
        threads = self.config(problem).threads
        mod = _module(problem["fmt"], d, ratio, positions.dtype == torch.int64)
        launch(mod.kernel("kv_compress_decode_kernel"), B, threads, kv, score, ape, norm_weight, rope_cos_sin,
               np.int64(rope_cos_sin.shape[0]), positions, np.int32(B), block_table, np.int32(block_table.shape[1]),
               cache, np.int32(_bs(cache, d)), np.int64(cache.shape[0]), kv_state, score_state,
               np.float32(problem["eps"]))


PROVIDERS = {
    "kv_gather": CudaKvGather,
    "kv_compress_prefill": CudaKvCompressPrefill,
    "kv_compress_decode": CudaKvCompressDecode,
}
