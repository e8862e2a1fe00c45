"""CUDA (NVRTC) provider for ``topk``: ``topk.cu``, one thread-block cluster per row, one launch.

Radix select on order-preserving composite keys (score, -index) + smem bitonic sort; see the
header of ``topk.cu``. Exact and deterministic for any launch configuration (cluster size,
threads, vector width): the selected set {C >= C_k} depends only on the data.

``topk_select_cuda`` (``topk_select_kernel``, built with ``TOPK_SELECT``) is the selection stage of
the fused ``indexer_topk_paged`` (kernels_dsl/indexer.py ``DslTopkPagedFused``): the same selection
from per-row bucket histograms that the decode logits kernel accumulated while writing the logits
(no histogram pass), ``select_splits`` independent CTAs per row, the row's last CTA (atomic
ticket) sorts and writes; bitwise the ``topk_kernel`` output on the same logits.

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


def _outputs(rows: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` op's outputs: int32 indices and fp32 scores ``[rows, k]``."""
    return (torch.empty((rows, k), dtype=torch.int32, device=dev),
            torch.empty((rows, k), dtype=torch.float32, device=dev))


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
    out_idx, out_sc = _outputs(rows, k, dev)
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


#: entries of the per-row control block after the histogram in a select workspace (topk.cu ctl)
CTL = 8


def select_workspace(rows: int, device) -> torch.Tensor:
    """Zeroed int32 ``[rows * (2048 + 8)]``: the per-row bucket histograms ``[rows, 2048]`` that the
    logits kernel's histogram epilogue accumulates (kernels_dsl/indexer_paged.py, ``hist=True``),
    then the ``[rows, 8]`` control words of ``topk_select_kernel``. One memset (a graph node)."""
    return torch.zeros(rows * (NBINS + CTL), dtype=torch.int32, device=device)


#: CTAs per SM that ``select_splits`` aims at (jobs fused-01 / fused-02, B=32 x 32768: 4 CTAs per
#: row 66.4 us for the fused op, 2: 69.5 us, 8: 71.0 us)
SPLIT_CTAS_PER_SM = 1


def select_splits(rows: int, ncols: int, sm_count: int) -> int:
    """CTAs per row of ``topk_select_kernel``: :data:`SPLIT_CTAS_PER_SM` CTAs per SM over the batch,
    >= 2048 positions each, at most 16."""
    s = max(1, (SPLIT_CTAS_PER_SM * sm_count) // max(rows, 1))
    return max(1, min(s, 16, -(-ncols // 2048)))


def topk_select_cuda(logits: torch.Tensor, lengths: torch.Tensor, ws: torch.Tensor, k: int, block_table=None,
                     block_size: int = 0, rows_per_seq: int = 1, *, splits: int | None = None,
                     threads: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_select_kernel``: the ``topk`` op's selection (decode rows ``[0, lengths)``) from the
    bucket histograms already in ``ws`` (:func:`select_workspace`, filled by the logits kernel; its
    control words must still be zero) -- no histogram pass, ``splits`` CTAs per row, the last CTA of
    each row refines, sorts and writes. Same output, bitwise, as :func:`topk_cuda` on the same logits
    (``logits`` fp32 ``[rows, ncols]`` with 16-byte aligned rows, unit inner stride). ``ws`` is
    consumed: its control words are no longer zero afterwards (one workspace per call)."""
    rows, ncols = logits.shape
    dev = logits.device
    out_idx, out_sc = _outputs(rows, k, dev)
    if rows == 0:
        return out_idx, out_sc
    row_stride = logits.stride(0) if rows > 1 else ncols
    if logits.data_ptr() % 16 or row_stride % 4 or logits.stride(1) != 1:
        raise ValueError("topk_select_cuda: logits rows must be 16-byte aligned and unit-stride")
    if ws.numel() < rows * (NBINS + CTL) or ws.dtype != torch.int32:
        raise ValueError(f"topk_select_cuda: ws must be int32 with >= {rows * (NBINS + CTL)} entries")
    if splits is None:
        from dsv4.target import Target
        splits = select_splits(rows, ncols, Target.of(dev).sm_count or 132)
    mod = load("topk.cu", TOPK_SELECT=1, TOPK_CLUSTER=1, TOPK_THREADS=threads, TOPK_CAP=CAP, TOPK_VEC=1, TOPK_APPEND=0)
    kern = mod.kernel("topk_select_kernel")
    nbytes = smem_bytes()
    if id(kern) not in _smem_ready:
        set_max_dynamic_smem(kern, nbytes)
        _smem_ready.add(id(kern))
    hist = ws[: rows * NBINS]
    ctl = ws[rows * NBINS: rows * (NBINS + CTL)]
    gsel = torch.empty((rows, KMAX), dtype=torch.int64, device=dev)
    gcand = torch.empty((rows, CAP), dtype=torch.int64, device=dev)
    has_bt = block_table is not None
    bt_stride = block_table.stride(0) if has_bt and block_table.shape[0] > 1 else (block_table.shape[1] if has_bt else 0)
    args = (logits, np.int64(row_stride), np.int32(ncols), lengths,
            block_table if has_bt else lengths, np.int64(bt_stride), np.int32(block_size if has_bt else 1),
            np.int32(rows_per_seq), np.int32(has_bt),
            np.int32(k), np.int32(rows), np.int32(splits), hist, ctl, gsel, gcand, out_idx, out_sc)
    launch(kern, rows * splits, threads, *args, smem=nbytes)
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
