"""CUDA (NVRTC) provider for ``topk``: ``topk.cu``, one thread-block cluster per row, one launch.

Radix select on order-preserving composite keys (score, -index), rank refinement of the threshold
bucket (warp-register ranks), a counting sort over sub-buckets of the selected range for the sorted
order; see the header of ``topk.cu``. Exact and deterministic for any launch configuration (cluster
size, threads, register-resident slices, vector width): the selected set {C >= C_k} depends only on
the data.

Order contract of ``sorted=False`` (the op's default since issue 15): ascending position (logical
positions, before the block_table mapping), padding last -- a function of the selected set only,
never of atomic arrival order, so bitwise the same across runs, launch configurations and the torch
reference: register tiles of >= 8 CTAs store pass B in position order and the leader merges the two
position-sorted runs (winners, selected threshold-bin candidates: a binary search per entry, ``TOPK_PRUN``);
otherwise the leader orders its gathered selected set with a bitmap of the row's positions (one bit per
entry, per-word prefix counts from one block scan; each entry's slot = the prefix of its word + the set
bits below it). Measurements (and the variants measured and deleted): docs/benchmarks.md, top-k sections.

Shape-adaptive, one op (:func:`default_config` returns a :class:`TopkConfig`): short rows: one CTA
per row with the row in registers (``resident``: one global read); few or long rows: the smallest
cluster (up to 8 CTAs per row, DSMEM histogram merge) whose slices fit one register tile, 16 CTAs
for 1-4 rows of up to 128k; rows too long for that: 2-CTA clusters that stream the row twice (the
second pass mostly hits L1/L2); more rows than SMs: one 512-thread CTA per row, two passes.

Why CUDA and not the CuTe DSL (the wall, stated in :meth:`CudaTopk.supports_problem`): it is NOT a
missing primitive -- CuTe DSL 4.8 has ballot / popc / shuffles / shared atomics (``cute.arch``) and
inline PTX for ``mapa`` / ``atom.shared::cluster``. The kernel is warp-synchronous integer code with
data-dependent, block-uniform loops and no TMA / WGMMA part for the DSL's layouts to help with. A DSL
port is open work (issue 15 item 3), not a wall of the language.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load, set_max_dynamic_smem

CAP = 4096          # candidate buffer entries (threshold bin); larger bins re-read the row
KMAX = 2048
NBINS = 2048
UNROLL = 4          # groups of 4 positions per thread and tile (TOPK_UNROLL)
INT32_MAX = 2 ** 31 - 1
#: launch ``topk_kernel`` with programmatic dependent launch (PDL): on a stream / in a CUDA graph its CTAs may be
#: scheduled while the preceding kernel drains; the kernel waits (``griddepcontrol.wait``) before its first global
#: access, so the result is the same either way. Job topk10-01 (graphs of 128 back-to-back calls, interleaved
#: rounds): 0.9-1.0 us less per call on every DSV4 shape (e.g. [1, 129280] 13.46 -> 12.56, [128, 8192] 9.59 -> 8.61)
PDL = True
_smem_ready: set[int] = set()


def smem_bytes(cap: int = CAP) -> int:
    """Dynamic shared memory of ``topk_kernel`` (TOPK_SMEM_BASE in topk.cu)."""
    return 8 * KMAX + 8 * cap + 8 * NBINS + 1024


@dataclass(frozen=True)
class TopkConfig:
    """Launch configuration of ``topk_kernel``: ``cluster`` CTAs per row (1/2/4/8; 16 non-portable), ``threads`` per
    CTA (256/512/1024), ``resident``: each CTA's slice fits one register tile (``threads * 16``
    positions) and is read once, ``vec``: 16-byte loads (aligned rows)."""
    cluster: int
    threads: int
    resident: bool
    vec: bool = True

    def __str__(self) -> str:  # what registry.last_choice("topk").explain() shows
        return self.explain()

    def explain(self) -> str:
        return (f"{self.cluster} CTA{'s' if self.cluster > 1 else ''}/row x {self.threads} threads, "
                f"{'row slice in registers' if self.resident else 'two passes over the row'}"
                f"{'' if self.vec else ', scalar loads'}")


def fits_resident(ncols: int, cluster: int, threads: int) -> bool:
    """Every CTA's slice of a row of ``ncols`` is at most one tile (``TOPK_RES`` precondition)."""
    groups = -(-ncols // 4)
    return -(-groups // cluster) <= threads * UNROLL


def default_config(rows: int, ncols: int, sm_count: int) -> TopkConfig:
    """The shape-adaptive choice, one wave of CTAs (rows * cluster <= SMs) where the batch allows:

    * 1-4 rows (latency-bound): the smallest cluster (1..16 CTAs; 16 is non-portable) whose slices fit
      512-thread register tiles (8192 positions): job topk9-01, [1, 32768] 4 x 512 10.2 us vs 2 x 1024
      13.2, [4, 65536] 8 x 512 10.9 vs 4 x 1024 13.7, [1, 129280] 16 x 512 14.0 vs 8 x 1024 15.7;
    * else the smallest cluster (1..8 CTAs per row) whose slices fit one register tile of 1024 threads
      (16384 positions): the row is read once; 512 threads up to 8192 positions per CTA;
    * rows too long for that: the largest cluster with >= 2048 positions per CTA, 1024 threads,
      two passes over the row (the second mostly from L1/L2);
    * more rows than SMs: one CTA of 512 threads per row, two passes, 2 CTAs per SM.

    Timed side by side in bench/bench_topk.py (docs/benchmarks.md, jobs topk-01 / topk7-02 on the H200):
    e.g. [32, 32768] k=512 2 x 1024 resident 15.2 us vs 4 x 512 resident 21.0; [1, 129280] k=1024
    16 x 512 resident 15.6 vs 8 x 1024 resident 17.8 and 16 x 1024 18.1."""
    if rows > sm_count:   # more than one wave anyway: 1 CTA per row, 2 CTAs per SM (<= 64 registers)
        return TopkConfig(1, 512, False)
    cap = max(1, sm_count // max(rows, 1))
    if rows <= 4:         # few rows: latency-bound, the most CTAs that 512-thread register tiles need (<= 16)
        cluster = 1
        while cluster < 16 and 2 * cluster <= cap and not fits_resident(ncols, cluster, 512):
            cluster *= 2
        if fits_resident(ncols, cluster, 512):
            return TopkConfig(cluster, 512, True)
    cluster = 1
    while cluster < 8 and 2 * cluster <= cap and not fits_resident(ncols, cluster, 1024):
        cluster *= 2
    if fits_resident(ncols, cluster, 1024):
        threads = 512 if fits_resident(ncols, cluster, 512) else 1024
        return TopkConfig(cluster, threads, True)
    cluster = 1
    while cluster < 8 and 2 * cluster <= cap and -(-ncols // (cluster * 2)) >= 2048:
        cluster *= 2
    return TopkConfig(cluster, 1024, False)


def _outputs(rows: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk`` op's outputs: int32 indices and fp32 scores ``[rows, k]``."""
    return (torch.empty((rows, k), dtype=torch.int32, device=dev),
            torch.empty((rows, k), dtype=torch.float32, device=dev))


def _num_blocks(num_blocks) -> int:
    return INT32_MAX if num_blocks is None else int(min(max(num_blocks, 0), INT32_MAX))


def _allow_cluster_16(kernel) -> None:
    """Clusters of 16 CTAs are "non-portable" on sm_90: the kernel must opt in."""
    from cuda.bindings import driver
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    h = kernel.handle
    if isinstance(h, driver.CUkernel):
        from .nvrtc import _device
        (err,) = driver.cuKernelSetAttribute(attr, 1, h, _device().device_id)
    else:
        (err,) = driver.cuFuncSetAttribute(h, attr, 1)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot allow clusters of 16 CTAs: {err}")


def _kernel(mod, name: str, cluster: int = 1):
    kern = mod.kernel(name)
    if id(kern) not in _smem_ready:
        set_max_dynamic_smem(kern, smem_bytes())
        if cluster > 8:
            _allow_cluster_16(kern)
        _smem_ready.add(id(kern))
    return kern


def launch_config(logits: torch.Tensor, config: TopkConfig | None = None, *, cluster: int | None = None,
                  threads: int | None = None, resident: bool | None = None, vec: bool | None = None) -> TopkConfig:
    """The :class:`TopkConfig` a call on ``logits`` runs with: ``config`` or :func:`default_config`
    (single fields overridden by ``cluster`` / ``threads`` / ``resident`` / ``vec``), with ``vec``
    cleared where the rows are not 16-byte aligned (the kernel then uses scalar loads)."""
    rows, ncols = logits.shape
    if config is None:
        from dsv4.target import Target
        d = default_config(rows, ncols, Target.of(logits.device).sm_count or 132)
        cl, th = cluster or d.cluster, threads or d.threads
        res = (d.resident if (cl, th) == (d.cluster, d.threads) else fits_resident(ncols, cl, th)) \
            if resident is None else bool(resident)
        config = TopkConfig(cl, th, res, True if vec is None else bool(vec))
    elif vec is not None:
        config = replace(config, vec=config.vec and bool(vec))
    row_stride = logits.stride(0) if rows > 1 else ncols
    aligned = logits.data_ptr() % 16 == 0 and (rows == 1 or row_stride % 4 == 0) and logits.stride(1) == 1
    return config if aligned or not config.vec else replace(config, vec=False)


def topk_cuda(logits: torch.Tensor, lengths: torch.Tensor, k: int, starts=None, block_table=None,
              block_size: int = 0, rows_per_seq: int = 1, *, sorted: bool = False, num_blocks: int | None = None,
              config: TopkConfig | None = None, cluster: int | None = None, threads: int | None = None,
              resident: bool | None = None, vec: bool | None = None, pdl: bool | None = None,
              source: str = "topk.cu") -> tuple[torch.Tensor, torch.Tensor]:
    """Launch ``topk_kernel`` (arguments already validated by :func:`dsv4.ops.topk.topk`).

    ``config`` (or the single fields ``cluster`` 1/2/4/8, ``threads`` 256/512/1024, ``resident``,
    ``vec``) overrides :func:`default_config` (tests check bitwise equality across them; bench sweeps
    them). ``resident=True`` is refused when a slice does not fit one tile. ``pdl``: programmatic
    dependent launch (None: :data:`PDL`). ``source``: the kernel file (bench A/B of a variant with the
    same signature).
    """
    rows, ncols = logits.shape
    dev = logits.device
    out_idx, out_sc = _outputs(rows, k, dev)
    if rows == 0:
        return out_idx, out_sc
    config = launch_config(logits, config, cluster=cluster, threads=threads, resident=resident, vec=vec)
    row_stride = logits.stride(0) if rows > 1 else ncols
    if config.resident and not fits_resident(ncols, config.cluster, config.threads):
        raise ValueError(f"topk_cuda: resident config {config} does not fit rows of {ncols}")
    mod = load(source, TOPK_CLUSTER=config.cluster, TOPK_THREADS=config.threads, TOPK_CAP=CAP,
               TOPK_VEC=int(config.vec), TOPK_RES=int(config.resident))
    kern = _kernel(mod, "topk_kernel", config.cluster)
    has_st = starts is not None
    has_bt = block_table is not None
    bt_stride = block_table.stride(0) if has_bt and block_table.shape[0] > 1 else (block_table.shape[1] if has_bt else 0)
    # cuda.core: with `cluster`, LaunchConfig's grid counts CLUSTERS, not blocks -> grid = rows
    launch(kern, rows, config.threads,
           logits, np.int64(row_stride), np.int32(ncols),
           lengths, starts if has_st else lengths, np.int32(has_st),
           block_table if has_bt else lengths, np.int64(bt_stride), np.int32(block_size if has_bt else 1),
           np.int32(rows_per_seq), np.int32(has_bt), np.int32(_num_blocks(num_blocks)),
           np.int32(k), np.int32(bool(sorted)), np.int32(rows), out_idx, out_sc,
           smem=smem_bytes(), cluster=config.cluster if config.cluster > 1 else None, pdl=PDL if pdl is None else pdl)
    return out_idx, out_sc


class CudaTopk(CudaProvider):
    describe = ("topk.cu: shape-adaptive radix select (1 CTA/row, row in registers; or a cluster of up to 16 CTAs/row), "
                "rank refinement, bucket-segment sort")
    arch_requirement = "built for sm_90a only (thread-block clusters, DSMEM)"

    def supports_problem(self, problem):
        if not 1 <= problem["k"] <= KMAX:
            return Support.no(f"cuda: k={problem['k']} outside 1..{KMAX}")
        return Support.yes("sm_90a, k <= 2048 (CUDA, not a DSL wall: warp-synchronous integer code on cluster DSMEM; "
                           "DSL port open, see kernels_cuda/topk.py)")

    def run(self, problem, *, logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted=False,
            num_blocks=None):
        config = launch_config(logits) if logits.shape[0] else None
        self.op.record_config(config)
        return topk_cuda(logits, lengths, k, starts, block_table, block_size, rows_per_seq, sorted=sorted,
                         num_blocks=num_blocks, config=config)


PROVIDERS = {"topk": CudaTopk}
