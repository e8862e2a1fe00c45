"""CuTe DSL providers of the Lightning Indexer ops (the default on sm_90a where they apply).

* ``indexer_logits_paged`` (decode): :class:`kernels_dsl.indexer_paged.PagedLogitsKernel` --
  persistent, device-side balanced schedule, bulk-copied pages, FP4 -> FP8 transform, FP8
  WGMMA, ReLU x w head-sum epilogue. MXFP4 and FP8 keys, next_n 1..4.
* ``indexer_logits`` (prefill, MXFP4, FP8 and NVFP4 keys): :class:`kernels_dsl.indexer_prefill.PrefillLogitsKernel`
  -- persistent WGMMA over TMA-loaded key tiles shared by four math warpgroups (8 queries per
  tile). MXFP4 keys / queries first go through :class:`kernels_dsl.indexer_fp8_rows.Fp8RowsKernel`
  (the same exponent fold, once per row) and run on E4M3 operands (exact products); FP8 keys are
  widened exactly to BF16 and run on BF16 operands with full FP32 accumulation (the E4M3-operand
  FP8 WGMMA keeps ~14 accumulator bits and leaves the 2e-3 contract on short rows, exactly as
  DeepGEMM's ``fp8_mqa_logits`` does on the same bytes); NVFP4 keys on BF16 operands after
  ``dequant_fp4``.
* ``indexer_topk_paged`` (decode selection): :class:`DslTopkPaged` -- the decode logits kernel, then
  the ``topk`` op (kernels_cuda/topk.cu), no host sync. Bitwise the two ops in sequence. (The fused
  variant -- a selection-histogram epilogue in the logits kernel + a histogram-fed select kernel --
  only tied this on the H200 and was deleted: docs/benchmarks.md.)

GPU validation runs, precision and timings of every path: docs/benchmarks.md ("Lightning Indexer").

NVFP4 keys: an E2M1 x E4M3-scale product needs up to 6 significand bits and is not an E4M3
value, so NVFP4 has no exact FP8 operand (rounding it to E4M3 would break the precision contract,
dsv4/ops/indexer.py). Prefill runs them on the BF16-operand kernel (``prefill_logits_dsl``:
``dequant_fp4`` to BF16, exact, then BF16 WGMMA; the only prefill provider besides torch); decode
stays on the ``cuda`` provider (the CUDA kernel decodes them exactly to BF16) because the DSL decode
kernel has only its FP8 register-sourced WGMMA path.

Configs (:class:`PagedConfig`) are frozen dataclasses chosen by :func:`paged_config` from the
format and next_n: ring depth from the shared-memory budget of ``ctas_per_sm`` CTAs per SM,
``ctas_per_sm`` from the kernel's register count (ptxas, sm_90a, no spills: MXFP4 next_n 1: 96
registers under the 4-CTA bound; FP8 next_n 1 and next_n 2..4 with the weights in smem: 122-128
under the 3-CTA bound; FP8 next_n 3, 4: 166-168 at 2 CTAs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import (DslProvider, compile_cached, compile_options, compile_variants, dl, dsl_target_support, i32,
                       launch_on)

__all__ = ["PagedConfig", "paged_config", "paged_smem_bytes", "DslPagedLogits", "DslLogits", "prefill_logits_dsl",
           "DslTopkPaged", "PREFILL_FORMATS", "PrefillConfig", "prefill_config", "PROVIDERS", "compile_check",
           "PTX_PATTERNS"]

#: what every compiled decode variant's PTX contains (tests/test_compile_dsl.py)
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3",
                r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes",
                r"mbarrier\.try_wait\.parity", r"fence\.proxy\.async")
DSL_FORMATS = ("mxfp4", "fp8")
#: key formats of the prefill kernel (NVFP4 on BF16 operands, see :func:`prefill_logits_dsl`)
PREFILL_FORMATS = ("mxfp4", "fp8", "nvfp4")
SMEM_PER_SM = 228 * 1024          # H100 / H200: 228 KiB per SM, 1 KiB reserved per CTA
MAX_SMEM_PER_CTA = 227 * 1024


@dataclass(frozen=True)
class PagedConfig:
    """Decode kernel specialization: ring depth (64-key tiles in flight per CTA) and CTAs per SM."""
    fmt: str
    next_n: int
    stages: int
    ctas_per_sm: int


def paged_smem_bytes(fmt: str, next_n: int, stages: int) -> int:
    """Shared memory of one decode CTA (mirrors ``PagedLogitsKernel``'s ``Smem`` struct, with
    alignment slack)."""
    from .indexer_paged import RAW_BYTES, VB
    raw = stages * RAW_BYTES[fmt]
    rows = 64 * next_n
    qraw = rows * VB[fmt] + (rows * 4 if fmt == "mxfp4" else 0) + rows * 4
    small = 2 * 8 * stages + 16 + 32 + 4 * stages + rows * 4
    return small + 128 + raw + 128 + qraw + 1024 + next_n * 8192


def paged_config(fmt: str, next_n: int) -> PagedConfig:
    """Heuristic: CTAs per SM from the register budget, then the deepest ring (<= 12 tiles) that
    fits that many CTAs in 228 KiB.

    * MXFP4 next_n 1: 4 CTAs (96 registers: accumulator + two A fragments + weights, no spills;
      faster than 3 at B = 32 and 128 x 32768).
    * FP8 next_n 1: 3 (4 would leave 4 ring stages: no gain).
    * next_n >= 2: 3 with the head weights re-read from smem per tile (``w_regs`` off, 128
      registers) when at least 4 ring stages fit (faster than 2 for MXFP4 next_n 2 / 4, FP8 next_n 2),
      else 2 (FP8 next_n 3, 4).

    Timings of each choice and the GPU validation of these configs: docs/benchmarks.md (the paged
    indexer decode kernel section).
    """
    def stages_for(ctas: int) -> int:
        budget = min(MAX_SMEM_PER_CTA, SMEM_PER_SM // ctas - 2048)
        for cand in range(12, 1, -1):
            if paged_smem_bytes(fmt, next_n, cand) <= budget:
                return cand
        return 0

    if next_n == 1:
        ctas = 4 if fmt == "mxfp4" else 3
    else:
        ctas = 3 if stages_for(3) >= 4 else 2
    return PagedConfig(fmt, next_n, max(2, stages_for(ctas)), ctas)


def _paged_fake_args(cfg: PagedConfig):
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint8
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    sym = cute.sym_int32
    q = make_fake_compact_tensor(Uint8, (sym(divisibility=16),), assumed_align=16)
    qs = make_fake_compact_tensor(Uint8, (sym(divisibility=16),), assumed_align=16)
    w = make_fake_compact_tensor(Float32, (sym(divisibility=4),), assumed_align=16)
    c = make_fake_compact_tensor(Uint8, (sym(), sym(divisibility=16)), stride_order=(1, 0), assumed_align=16)
    lens = make_fake_compact_tensor(Int32, (sym(),), assumed_align=4)
    bt = make_fake_compact_tensor(Int32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)
    out = make_fake_compact_tensor(Float32, (sym(), sym()), stride_order=(1, 0), assumed_align=4)
    return (q, qs, w, c, lens, bt, out, Int32(1), Int32(1), Int32(64), Int32(64), Int32(132), make_fake_stream())


def _compile_paged(cfg: PagedConfig, arch: str, extra: str = ""):
    import cutlass.cute as cute

    from .indexer_paged import PagedLogitsKernel
    kern = PagedLogitsKernel(cfg.fmt, cfg.next_n, stages=cfg.stages, ctas_per_sm=cfg.ctas_per_sm)
    return cute.compile(kern, *_paged_fake_args(cfg), options=compile_options(arch, extra))


def compile_paged_all(dump_dir: Optional[str] = None, arch: str = "sm_90a", variants=None) -> dict[str, str]:
    """Compile decode specializations (default: every fmt x next_n with the heuristic config) for
    ``arch`` without a GPU; ``{"<fmt>-nn<k>": PTX}``."""
    variants = variants or [(f, nn) for f in DSL_FORMATS for nn in (1, 2, 3, 4)]
    return compile_variants("indexer_paged", {
        f"{fmt}-nn{nn}": functools.partial(_compile_paged, paged_config(fmt, nn)) for fmt, nn in variants},
        dump_dir, arch)


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """The provider's default decode specialization (MXFP4, next_n 1) through its config path
    (tests/test_compile_dsl.py; every variant: kernels_dsl.indexer_paged.compile_check)."""
    return compile_paged_all(dump_dir, arch, [("mxfp4", 1)])


def _aligned(t, align: int = 16):
    """``t`` contiguous with a data pointer aligned to ``align`` bytes (a copy only when needed)."""
    t = t.contiguous()
    if t.data_ptr() % align:
        t = t.clone()
    return t


def _sm_count(device) -> int:
    from dsv4.target import Target
    return Target.of(device).sm_count           # memoized per device (get_device_properties costs us per call)


class _DslBase(DslProvider):

    def _target(self, problem, target, nvfp4: bool = False) -> Support | None:
        no = dsl_target_support(target, "WGMMA kernels are compiled for sm_90a only")
        if no is not None:
            return no
        if problem.get("fmt") == "nvfp4" and nvfp4:
            return None
        if problem.get("fmt") == "nvfp4":
            return Support.no("dsl: NVFP4 keys have no exact FP8 operand (E2M1 x E4M3 scale needs 6 significand "
                              "bits); the cuda provider decodes them exactly to BF16")
        if problem.get("fmt") not in DSL_FORMATS:
            return Support.no(f"dsl: unknown fmt {problem.get('fmt')!r}")
        return None


class DslPagedLogits(_DslBase):
    describe = ("CuTe DSL PagedLogitsKernel: persistent, device-balanced schedule, cp.async.bulk pages, "
                "FP4->FP8 fold, WGMMA m64n64k32 E4M3, ReLU x w head sum")

    def supports(self, problem, target):
        from dsv4.ops.indexer import paged_support
        return paged_support(problem, "dsl", self._target(problem, target),
                             "sm_90a, MXFP4 / FP8 keys, block_size % 64 == 0, next_n 1..4")

    def config(self, problem, target=None):
        """The :class:`PagedConfig` ``run`` launches (:func:`paged_config`)."""
        return paged_config(problem["fmt"], problem["next_n"])

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        import torch

        from dsv4.target import Target
        fmt = problem["fmt"]
        B, nn = q_data.shape[:2]
        max_ctx = problem["max_ctx"]
        out = torch.empty((B * nn, max_ctx), dtype=torch.float32, device=q_data.device)
        if B == 0 or max_ctx == 0:
            return out
        nb, bs = cache.shape[0], cache.shape[1]
        if nb == 0:   # no page can be read: every logit is -inf
            return out.fill_(float("-inf"))
        cfg = paged_config(fmt, nn)
        arch = Target.of(q_data.device).arch
        fn = compile_cached(("indexer_paged", cfg, arch), lambda: _compile_paged(cfg, arch))
        qd = _aligned(q_data).view(-1)
        qs = _aligned(q_sf).view(-1) if fmt == "mxfp4" else qd
        wv = _aligned(w).view(-1)
        cv = _aligned(cache).view(nb, -1)
        lv = lens.contiguous().view(-1)
        btv = block_table.contiguous()

        t = dl
        grid = cfg.ctas_per_sm * _sm_count(q_data.device)
        args = (t(qd, 16), t(qs, 16), t(wv, 16), t(cv, 16), t(lv, 4), t(btv, 4), t(out, 4),
                i32(B), i32(nb), i32(bs), i32(max_ctx), i32(grid))
        launch_on(q_data.device, fn, *args)
        return out


@dataclass(frozen=True)
class PrefillConfig:
    """Prefill kernel specialization: the WGMMA ``operand`` (``"e4m3"``: MXFP4 rows folded to E4M3 with a
    per-row scale, ``row_scales``; ``"bf16"``: FP8 / NVFP4 values widened exactly) and the key format."""
    fmt: str
    operand: str
    row_scales: bool

    def __str__(self) -> str:  # what registry.last_choice("indexer_logits").explain() shows
        how = "rows folded to E4M3 (one launch for q and K) + per-row scales" if self.row_scales else "widened exactly"
        return f"{self.fmt} keys, {self.operand.upper()} WGMMA operand ({how}), persistent grid <= SMs"


def prefill_config(fmt: str, operand: str | None = None) -> PrefillConfig:
    """The heuristic: MXFP4 -> E4M3 operand (exact products), FP8 / NVFP4 -> BF16 (full FP32 accumulation; the
    FP8 WGMMA keeps too few accumulator bits for FP8 keys, see :func:`prefill_logits_dsl`); ``operand`` forces one."""
    operand = operand or ("e4m3" if fmt == "mxfp4" else "bf16")
    return PrefillConfig(fmt, operand, fmt == "mxfp4")


def prefill_logits_dsl(q_data, q_sf, w, k_data, k_sf, ks, ke, *, fmt: str = "mxfp4", operand: str | None = None,
                       q_global=None, k_global=None):
    """Prefill indexer logits on the DSL kernels (kernels_dsl/indexer_prefill.py); same arguments
    and result as :func:`dsv4.ops.indexer.indexer_logits` for ``fmt`` in ``{"mxfp4", "fp8", "nvfp4"}``
    (CUDA tensors, already validated by the op).

    ``operand`` (the WGMMA input type): ``"e4m3"`` (default for MXFP4: rows folded to E4M3 by
    kernels_dsl/indexer_fp8_rows.py, exact products) or ``"bf16"`` (default for FP8 keys: E4M3
    values widened exactly to BF16, BF16 WGMMA with full FP32 accumulation; the only operand of
    NVFP4 keys: q and K decoded exactly to BF16 by ``dequant_fp4``, the product of the global scales
    ``q_global * k_global`` (float32 [1] each, required, > 0) applied per key after the head sum; FP8 keys through the
    FP8 WGMMA, ``operand="e4m3"``, keep only ~14 accumulator bits: 2.28e-3 x the row max on short
    rows in job idx-11, outside the op's 2e-3 contract). The ``dsl`` provider of ``indexer_logits``
    (:class:`DslLogits`) calls this for every format. MXFP4: two launches (q and K rows to
    E4M3 in one, then the GEMM kernel); no host sync, graph-capturable.
    """
    import torch
    from cutlass import Float8E4M3FN

    from dsv4.target import Target

    from .indexer_fp8_rows import mxfp4_rows_to_fp8_pair
    from .indexer_prefill import QUNIT, compile_prefill
    if fmt not in PREFILL_FORMATS:
        raise ValueError(f"prefill_logits_dsl: fmt must be one of {PREFILL_FORMATS}, got {fmt!r}")
    operand = prefill_config(fmt, operand).operand
    if (fmt, operand) not in (("mxfp4", "e4m3"), ("fp8", "e4m3"), ("fp8", "bf16"), ("nvfp4", "bf16")):
        raise ValueError(f"prefill_logits_dsl: operand {operand!r} is not offered for fmt={fmt!r} "
                         "(mxfp4: 'e4m3'; fp8: 'bf16' or 'e4m3'; nvfp4: 'bf16')")
    if fmt == "nvfp4" and (q_global is None or k_global is None):
        raise ValueError("prefill_logits_dsl: fmt='nvfp4' needs q_global and k_global (float32 [1])")
    T, S = q_data.shape[0], k_data.shape[0]
    out = torch.empty((T, S), dtype=torch.float32, device=q_data.device)
    if T == 0 or S == 0:
        return out
    if fmt == "mxfp4":
        qa, qsc, ka, ksc = mxfp4_rows_to_fp8_pair(q_data.reshape(T * 64, 64), q_sf.reshape(T * 64, 4), k_data, k_sf)
        qsc = qsc.view(T, 64)
    elif fmt == "nvfp4":         # exact: E2M1 x E4M3 block scale has <= 6 significant bits
        from dsv4.ops.dequant_fp4 import dequant_fp4
        one = torch.ones((1,), dtype=torch.float32, device=q_data.device)
        qa = dequant_fp4(_aligned(q_data).view(T * 64, 64), _aligned(q_sf).view(T * 64, 8).view(torch.float8_e4m3fn),
                         fmt="nvfp4", global_scale=one)
        ka = dequant_fp4(_aligned(k_data), _aligned(k_sf).view(torch.float8_e4m3fn), fmt="nvfp4", global_scale=one)
        # global decode scales (> 0) commute with ReLU: applied once per key after the head sum
        ksc = (q_global.float().reshape(1) * k_global.float().reshape(1)).expand(S).contiguous()
        qsc = None
    else:
        qa = _aligned(q_data).view(T * 64, 128)
        ka = _aligned(k_data)
        if operand == "bf16":       # exact: every E4M3 value (and NaN) is a BF16 value
            qa = qa.view(torch.float8_e4m3fn).to(torch.bfloat16)
            ka = ka.view(torch.float8_e4m3fn).to(torch.bfloat16)
        ksc = _aligned(k_sf).view(torch.float32).view(S)
        qsc = None
    has_qs = qsc is not None
    arch = Target.of(q_data.device).arch
    fn = compile_cached(("indexer_prefill", has_qs, operand, arch), lambda: compile_prefill(has_qs, arch, "", operand))

    def opnd(x):
        return dl(x, 16, Float8E4M3FN if operand == "e4m3" else None)

    t = dl
    wv = _aligned(w)
    units = -(-T // QUNIT)
    grid = min(units, _sm_count(q_data.device))
    args = (opnd(qa), opnd(ka), t(ksc, 16), t(wv, 16), t(qsc if has_qs else wv, 16), t(ks.contiguous(), 4),
            t(ke.contiguous(), 4), t(out, 4), i32(grid))
    launch_on(q_data.device, fn, *args)
    return out


#: Prefill validation on the H200 (every format of :data:`PREFILL_FORMATS`; errors vs fp64, recall and cosine
#: gates, graph capture): tests/test_indexer.py / tests/test_indexer_dsl.py ``-m gpu``; the measured errors and
#: timings are in docs/benchmarks.md (the prefill indexer sections).


class DslLogits(_DslBase):
    describe = ("CuTe DSL PrefillLogitsKernel: persistent, TMA key tiles shared by 4 math warpgroups (8 queries per "
                "tile), ReLU x w head sum; MXFP4: rows folded to FP8 once (Fp8RowsKernel), WGMMA m64n128k32 E4M3; "
                "FP8 keys: widened to BF16, WGMMA m64n128k16 BF16")

    def supports(self, problem, target):
        no = self._target(problem, target, nvfp4=True)
        if no is not None:
            return no
        if problem["fmt"] == "fp8":
            return Support.yes("sm_90a, FP8 keys widened exactly to BF16 (BF16 WGMMA, full FP32 accumulation)")
        if problem["fmt"] == "nvfp4":
            return Support.yes("sm_90a, NVFP4 keys decoded exactly to BF16 (dequant_fp4), BF16 WGMMA, global scales "
                               "in the epilogue")
        return Support.yes("sm_90a, MXFP4 keys (E2M1 folded to E4M3: exact products; FP32 promotion of the row scales)")

    def config(self, problem, target=None):
        """The :class:`PrefillConfig` ``run`` launches (:func:`prefill_config`)."""
        return prefill_config(problem["fmt"])

    def run(self, problem, *, q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global):
        cfg = self.config(problem)
        return prefill_logits_dsl(q_data, q_sf, w, k_data, k_sf, ks, ke, fmt=cfg.fmt, operand=cfg.operand,
                                  q_global=q_global, k_global=k_global)


#: the order of ``indexer_topk_paged``: its contract (dsv4/ops/indexer.py, and the torch provider's
#: reference) is score-sorted, while the ``topk`` op's default is ascending position (issue 15); the
#: provider passes it explicitly so that it stays bitwise the reference.
TOPK_PAGED_SORTED = True


class DslTopkPaged(DslPagedLogits):
    """``indexer_topk_paged`` on the DSL decode kernel: :class:`DslPagedLogits`, then the ``topk`` op
    (kernels_cuda/topk.cu) on the logits -- bitwise the two ops in sequence (score desc, ties by lower
    index, -1 padding, block_table mapping, deterministic), no host sync, graph-capturable.

    Measured and deleted (issue 15, on the H200): the fused variant -- the logits kernel
    with a selection-histogram epilogue (shared bucket counts per stored logit, a global flush per
    sequence) and a select kernel fed by that histogram (no histogram pass; 16 CTAs per row, a global
    ticket, one memset) -- was never more than on par with this path (docs/benchmarks.md)."""

    describe = "DSL PagedLogitsKernel (logits) -> topk op (kernels_cuda/topk.cu); no host sync"

    def supports(self, problem, target):
        s = super().supports(problem, target)
        if not s:
            return s
        if not 1 <= problem["k"] <= 2048:
            return Support.no(f"dsl: k={problem['k']} outside 1..2048")
        return Support.yes("sm_90a, MXFP4 / FP8 keys: logits kernel + topk op")

    # config(): the logits kernel's PagedConfig, inherited (the topk op records its own launch config)

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        from dsv4.ops.topk import topk
        logits = DslPagedLogits.run(self, problem, q_data=q_data, q_sf=q_sf, w=w, cache=cache, lens=lens,
                                    block_table=block_table, q_global=q_global, k_global=k_global)
        mapped = problem["mapped"]
        return topk(logits, lens.reshape(-1), problem["k"], block_table=block_table if mapped else None,
                    block_size=problem["block_size"] if mapped else 0, rows_per_seq=problem["next_n"],
                    return_scores=True, num_blocks=int(cache.shape[0]) if mapped else None,
                    sorted=TOPK_PAGED_SORTED)


PROVIDERS = {"indexer_logits_paged": DslPagedLogits, "indexer_logits": DslLogits,
             "indexer_topk_paged": DslTopkPaged}
# the quantizers (indexer_cache_write, indexer_q_quant) live in kernels_dsl/indexer_quant.py
from .indexer_quant import PROVIDERS as _QUANT_PROVIDERS  # noqa: E402

PROVIDERS.update(_QUANT_PROVIDERS)
