"""CuTe DSL provider of ``sparse_attention`` (``dsv4.ops.sparse_attention``): launch glue and the
KV-split heuristic for the two kernels

* :mod:`kernels_dsl.sparse_attention_fwd` -- the attention kernel (decode and prefill rows alike;
  with KV splits it writes fp32 partials), and
* :mod:`kernels_dsl.sparse_attention_combine` -- the split-KV merge (with the sink).

Split heuristic (:func:`choose_config`): CTAs = T * ceil(H / 64). When they fill fewer than ~one
wave of the SMs and a row has more than 2 list tiles of 64 entries, each row is split into
``min(floor(SMs / CTAs), tiles / 2)`` contiguous ranges of tiles (one CTA fits an SM, 207 KB of smem: the
split CTAs stay within one wave), decided from shapes only (no sync;
the lengths are device values, so a split may see no entries: it writes ``lse = -inf``), at most
65535 (gridDim.z). More than 65535 rows (gridDim.y) run as consecutive launches of row chunks.
Everything stays on the device and is CUDA-graph capturable.

The registry default for fp8_ds_mla caches on sm_90a (GPU tests: tests/test_sparse_attention.py; the
kernel's constraints and pitfalls: :mod:`kernels_dsl.sparse_attention_fwd`; timings: docs/benchmarks.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, current_stream, dl, f32, i32

__all__ = ["DslSparseAttention", "sparse_attention_dsl", "PROVIDERS", "SplitConfig", "choose_config", "compile_check", "PTX_PATTERNS"]

TILE_N = 64
BLOCK_H = 64
#: rows per fwd launch and KV splits: the grid is [ceil(H / 64), T, splits]; CUDA caps gridDim.y / z at 65535
MAX_ROWS_PER_LAUNCH = 65535
MAX_SPLITS = 65535
LOG2E = math.log2(math.e)
#: compile_check / PTX patterns live in the kernel modules; this module only checks it imports them
PTX_PATTERNS = ()


@dataclass(frozen=True)
class SplitConfig:
    """KV split of each row's list: ``num_splits`` ranges of ``tiles_per_split`` 64-entry tiles."""

    num_splits: int
    tiles_per_split: int

    def __str__(self) -> str:  # what registry.last_choice("sparse_attention").explain() shows
        return self.explain()

    def explain(self) -> str:
        if self.num_splits == 1:
            return f"no KV split ({self.tiles_per_split} list tiles of {TILE_N} per CTA)"
        return (f"{self.num_splits} KV splits of {self.tiles_per_split} list tiles of {TILE_N}, merged by the "
                "combine kernel")


def choose_config(T: int, H: int, entries: int, sms: int, num_splits: Optional[int] = None) -> SplitConfig:
    """The split of each row's ``entries``-wide list (SWA + compressed widths) for ``sms`` SMs."""
    tiles = max(1, -(-entries // TILE_N))
    if num_splits is None:
        ctas = max(1, T * -(-H // BLOCK_H))
        num_splits = 1
        if ctas < 0.8 * sms and tiles > 2:
            num_splits = max(1, min(sms // ctas, tiles // 2))        # never more than one wave
    num_splits = max(1, min(num_splits, tiles, MAX_SPLITS))
    tps = -(-tiles // num_splits)
    return SplitConfig(-(-tiles // tps), tps)


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Both kernels of this provider, compiled for ``arch`` (PTX patterns: their own modules)."""
    from . import sparse_attention_combine, sparse_attention_fwd
    return {**{f"fwd-{k}": v for k, v in sparse_attention_fwd.compile_check(dump_dir, arch).items()},
            **sparse_attention_combine.compile_check(dump_dir, arch)}


def _bs(cache) -> int:
    return cache.shape[1] // 584 if cache.dim() == 2 else cache.shape[1]


class DslSparseAttention(DslProvider):
    describe = ("CuTe DSL SparseAttentionFwdKernel: producer warpgroup gathers + decodes fp8_ds_mla rows to bf16 "
                "smem, 2 WGMMA warpgroups (QK^T + softmax + PV halves), split-KV combine")

    def supports_problem(self, problem):
        if problem.get("fmt") != "fp8_ds_mla":
            return Support.no(f"dsl: reads fp8_ds_mla (584 B/token) caches only, got {problem.get('fmt')}")
        return Support.yes("sm_90a, fp8_ds_mla caches")

    def config(self, problem, target):
        """The :class:`SplitConfig` ``run`` launches (:func:`choose_config`, the one heuristic; rows past
        ``MAX_ROWS_PER_LAUNCH`` run as chunks that each choose again; a SWA-only call counts the one
        column of its empty compressed list too)."""
        return choose_config(min(problem["T"], MAX_ROWS_PER_LAUNCH), problem["H"], problem["entries"],
                             target.sm_count, problem["split"])

    def run(self, problem, *, q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale, num_splits):
        return sparse_attention_dsl(q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale,
                                    num_splits)


def sparse_attention_dsl(q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale, num_splits=None, *,
                         out=None, lse=None):
    """Launch the kernels on validated operands (``dsv4.ops.sparse_attention`` validates them);
    ``out`` / ``lse`` may be preallocated (tests poison them to catch unwritten elements). The fwd
    grid is ``[ceil(H / 64), T, splits]`` and CUDA caps gridDim.y at 65535: a larger ``T`` (a long
    ragged prefill) runs as consecutive row chunks of at most ``MAX_ROWS_PER_LAUNCH`` rows (row
    slices of every per-row operand, each chunk with its own split choice; still no sync)."""
    import torch
    T, H = q.shape[0], q.shape[1]
    dev = q.device
    if out is None:
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    if T == 0:
        return out, lse
    for t0 in range(0, T, MAX_ROWS_PER_LAUNCH):      # one launch unless T > 65535 (gridDim.y)
        rows = slice(t0, min(T, t0 + MAX_ROWS_PER_LAUNCH))
        _launch(q[rows], swa_cache, swa_indices[rows], swa_lens[rows], sink, cache,
                None if indices is None else indices[rows], None if lens is None else lens[rows], scale, num_splits,
                out[rows], lse[rows])
    return out, lse


def _launch(q, swa_cache, swa_indices, swa_lens, sink, cache, indices, lens, scale, num_splits, out, lse):
    """One launch of the fwd kernel (+ the combine with KV splits) for ``1 <= T <= MAX_ROWS_PER_LAUNCH`` rows."""
    import torch

    from dsv4.target import Target

    from . import sparse_attention_combine, sparse_attention_fwd
    T, H = q.shape[0], q.shape[1]
    dev = q.device
    if cache is None:          # SWA-only layer: an empty compressed list over the same cache
        cache, indices = swa_cache, torch.full((T, 1), -1, dtype=torch.int32, device=dev)
        lens = torch.zeros((T,), dtype=torch.int32, device=dev)
    if sink is None:
        sink = torch.full((H,), float("-inf"), dtype=torch.float32, device=dev)
    target = Target.of(dev)
    cfg = choose_config(T, H, swa_indices.shape[1] + indices.shape[1], target.sm_count, num_splits)
    split = cfg.num_splits > 1
    arch = target.arch
    fwd = compile_cached(("sparse_attention_fwd", split, arch),
                         lambda: sparse_attention_fwd.compile_kernel(split, arch))

    t = dl

    def cache_base(c):
        # the kernel only takes the base pointer (it computes the slot addresses itself, in 64 bits)
        return dl(c.view(-1)[:16])

    sbs, cbs = _bs(swa_cache), _bs(cache)
    if split:
        o_part = torch.empty((cfg.num_splits, T, H, 512), dtype=torch.float32, device=dev)
        l_part = torch.empty((cfg.num_splits, T, H), dtype=torch.float32, device=dev)
        o_arg, l_arg = t(o_part), t(l_part, 4)
    else:
        o_arg, l_arg = t(out), t(lse, 4)
    args = (t(q), cache_base(swa_cache), t(swa_indices, 4), t(swa_lens, 4), cache_base(cache), t(indices, 4),
            t(lens, 4), t(sink, 4), o_arg, l_arg, i32(sbs), i32(swa_cache.shape[0] * sbs), i32(cbs),
            i32(cache.shape[0] * cbs), f32(float(scale) * LOG2E), i32(cfg.tiles_per_split),
            i32(cfg.num_splits))
    with torch.cuda.device(dev):
        fwd(*args, current_stream())
        if split:
            comb = compile_cached(("sparse_attention_combine", arch),
                                  lambda: sparse_attention_combine.compile_kernel(arch))
            comb(t(o_part), t(l_part, 4), t(sink, 4), t(out), t(lse, 4), current_stream())
    return out, lse


PROVIDERS = {"sparse_attention": DslSparseAttention}
