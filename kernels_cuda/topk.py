"""CUDA (NVRTC) provider for ``topk``: ``topk.cu``, one thread-block cluster per row, one launch.

Radix select on order-preserving composite keys (score, -index) + smem bitonic sort; see the
header of ``topk.cu``. Exact and deterministic for any launch configuration (cluster size,
threads, vector width): the selected set {C >= C_k} depends only on the data.

Why no CuTe DSL provider: the kernel needs block-wide radix histograms with warp-aggregated
shared-memory atomics, ballot/popc compaction into another CTA's shared memory
(``mapa`` + ``atom.shared::cluster``), cluster-wide histogram reductions through DSMEM, and a
data-dependent, block-uniform refinement loop with ``__reduce_and/or_sync``. CuTe DSL 4.8
exposes none of these conveniently (no DSMEM atomics or warp-aggregated compaction helpers),
so this op is raw CUDA C++ per the DSL-wall doctrine.
"""
from __future__ import annotations

import numpy as np
import torch

from dsv4.config import env_int
from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load, set_max_dynamic_smem

CAP = 8192          # candidate buffer entries (threshold bin); larger bins re-read the row
#: Compaction scheme of the selected / candidate entries (``TOPK_APPEND`` in topk.cu):
#: 0 = warp-aggregated atomics on one shared counter (validated on the H200, but the counter
#: serializes: ~10-30 us per row batch); 1 = block-wide scan compaction, one atomic per CTA per
#: tile (CPU-compiled, spill-free, logic emulated; NOT yet run on the GPU -> not the default until
#: ``DSV4_TOPK_APPEND=1 pytest -m gpu tests/test_topk.py`` passes).
APPEND = env_int("DSV4_TOPK_APPEND")  # read at import; 0 or 1 (dsv4/config.py)
KMAX = 2048
NBINS = 2048
_smem_ready: set[int] = set()


def smem_bytes(cap: int = CAP) -> int:
    """Dynamic shared memory of ``topk_kernel`` (matches the static_assert in topk.cu)."""
    return 8 * KMAX + 8 * cap + 4 * NBINS + 512


def default_config(rows: int, ncols: int, sm_count: int) -> tuple[int, int]:
    """(cluster CTAs per row, threads per CTA): enough CTAs to fill the SMs, >= 4096 positions each.

    Measured on the H200 (bench/bench_topk.py, docs/benchmarks.md): [64, 65536] best at 2 x 1024,
    [1, 129280] at 8 x 1024, [128, 8192] at 1 x 512.
    """
    cluster = 1
    while cluster < 8 and rows * cluster * 2 <= sm_count and -(-ncols // (cluster * 2)) >= 4096:
        cluster *= 2
    return cluster, (1024 if cluster > 1 else 512)


def topk_cuda(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts=None, block_table=None,
              block_size: int = 0, rows_per_seq: int = 1, *, cluster: int | None = None,
              threads: int | None = None, vec: bool | None = None,
              append: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``topk_kernel`` (arguments already validated by :func:`dsv4.ops.topk.topk`).

    ``cluster`` (1/2/4/8), ``threads`` (256/512/1024) and ``vec`` override the launch
    configuration (tests check bitwise equality across them; bench sweeps them).
    """
    rows, ncols = logits.shape
    dev = logits.device
    out_idx = torch.empty((rows, k), dtype=torch.int32, device=dev)
    out_sc = torch.empty((rows, k), dtype=torch.float32, device=dev)
    if rows == 0:
        return out_idx, out_sc
    if cluster is None or threads is None:
        from dsv4.target import Target
        c0, t0 = default_config(rows, ncols, Target.of(dev).sm_count or 132)
        cluster = cluster or c0
        threads = threads or t0
    row_stride = logits.stride(0) if rows > 1 else ncols
    if vec is None:
        vec = logits.data_ptr() % 16 == 0 and (rows == 1 or row_stride % 4 == 0) and logits.stride(1) == 1
    append = APPEND if append is None else int(append)
    mod = load("topk.cu", TOPK_CLUSTER=cluster, TOPK_THREADS=threads, TOPK_CAP=CAP, TOPK_VEC=int(bool(vec)),
               TOPK_APPEND=append)
    kern = mod.kernel("topk_kernel")
    nbytes = smem_bytes()
    if id(kern) not in _smem_ready:
        set_max_dynamic_smem(kern, nbytes)
        _smem_ready.add(id(kern))
    has_st = starts is not None
    has_bt = block_table is not None
    bt_stride = block_table.stride(0) if has_bt and block_table.shape[0] > 1 else (block_table.shape[1] if has_bt else 0)
    # cuda.core: with `cluster`, LaunchConfig's grid counts CLUSTERS, not blocks -> grid = rows
    launch(kern, rows, threads,
           logits, np.int64(row_stride), np.int32(ncols),
           lengths, starts if has_st else lengths, np.int32(has_st),
           block_table if has_bt else lengths, np.int64(bt_stride), np.int32(block_size if has_bt else 1),
           np.int32(rows_per_seq), np.int32(has_bt),
           np.int32(k), np.int32(rows), out_idx, out_sc,
           smem=nbytes, cluster=cluster if cluster > 1 else None)
    return out_idx, out_sc


class CudaTopk(CudaProvider):
    describe = "topk.cu: cluster radix select (fp16-bucket pass + composite-key refinement), bitonic sort"
    arch_requirement = "built for sm_90a only (thread-block clusters, DSMEM)"

    def supports_problem(self, problem):
        if not 1 <= problem["k"] <= KMAX:
            return Support.no(f"cuda: k={problem['k']} outside 1..{KMAX}")
        return Support.yes("sm_90a, k <= 2048")

    def run(self, problem, *, logits, lengths, k, starts, block_table, block_size, rows_per_seq):
        return topk_cuda(logits, lengths, k, starts, block_table, block_size, rows_per_seq)


PROVIDERS = {"topk": CudaTopk}
