"""CuTe DSL providers of the Lightning Indexer ops (the default on sm_90a where they apply).

* ``indexer_logits_paged`` (decode): :class:`kernels_dsl.indexer_paged.PagedLogitsKernel` --
  persistent, device-side balanced schedule, bulk-copied pages, FP4 -> FP8 transform, FP8
  WGMMA, ReLU x w head-sum epilogue. MXFP4 and FP8 keys, next_n 1..4.
  Validated on the H200 (issue 13, GPU job idx-03: every format x next_n, block_size 128, one-hot
  decode exact, graph capture; the contract numbers in docs/benchmarks.md).
* ``indexer_logits`` (prefill, MXFP4 keys): :class:`kernels_dsl.indexer_prefill.PrefillLogitsKernel`
  -- persistent FP8 WGMMA over TMA-loaded key tiles shared by four math warpgroups (8 queries
  per tile); MXFP4 keys / queries first go through :class:`kernels_dsl.indexer_fp8_rows.Fp8RowsKernel`
  (the same exponent fold, once per row). Validated on the H200 (jobs idx-11 / idx-12: contract,
  recall gate (b), attention cosine gate (c), graph capture). FP8-key prefill stays on the exact
  CUDA BF16 kernel (:data:`PREFILL_VALIDATED`: the FP8 WGMMA's accumulation misses 2e-3 x the row
  max on short rows; the BF16-operand variant meant for FP8 keys has not run on the H200 yet);
  :func:`prefill_logits_dsl` runs the kernel for either format directly.
* ``indexer_topk_paged`` (decode selection): :class:`DslTopkPagedComposed` -- the decode logits
  kernel, then the ``topk`` op, two launches (NOT fused; the fused single-pass kernel is open).

NVFP4 keys stay on the ``cuda`` provider: an E2M1 x E4M3-scale product needs up to 6
significand bits and is not an E4M3 value, so NVFP4 has no exact FP8 operand and rounding it
to E4M3 would break the precision contract (dsv4/ops/indexer.py); the CUDA kernel decodes it
exactly to BF16.

Configs (:class:`PagedConfig`) are frozen dataclasses chosen by :func:`paged_config` from the
format and next_n: ring depth from the shared-memory budget of ``ctas_per_sm`` CTAs per SM,
``ctas_per_sm`` from the kernel's register count (ptxas, sm_90a, no spills: next_n 1: 128
registers under the 3-CTA bound (mxfp4 and fp8); next_n 2..4: 165-168).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Optional

from dsv4.registry import Support

from ._compile import DslProvider, compile_cached, compile_options, dl, dsl_target_support, launch_on

__all__ = ["PagedConfig", "paged_config", "paged_smem_bytes", "DslPagedLogits", "DslLogits", "prefill_logits_dsl",
           "DslTopkPagedComposed", "PREFILL_VALIDATED", "PROVIDERS", "compile_check", "PTX_PATTERNS"]

#: what every compiled decode variant's PTX contains (tests/test_compile_dsl.py)
PTX_PATTERNS = (r"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.e4m3\.e4m3",
                r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes",
                r"mbarrier\.try_wait\.parity", r"fence\.proxy\.async")
DSL_FORMATS = ("mxfp4", "fp8")
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
    """Heuristic: CTAs per SM from the register budget (3 for next_n = 1, else 2), then the
    deepest ring (<= 12 tiles) that fits that many CTAs in 228 KiB."""
    ctas = 3 if next_n == 1 else 2
    budget = min(MAX_SMEM_PER_CTA, SMEM_PER_SM // ctas - 2048)
    st = 2
    for cand in range(12, 1, -1):
        if paged_smem_bytes(fmt, next_n, cand) <= budget:
            st = cand
            break
    return PagedConfig(fmt, next_n, st, ctas)


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
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = dump_dir or tmp
        os.makedirs(d, exist_ok=True)
        for fmt, nn in variants:
            fn = _compile_paged(paged_config(fmt, nn), arch, f"--keep-ptx --dump-dir {d}")
            ptx = fn.__ptx__
            if ptx is None or not ptx.lstrip().startswith(("//", ".version")):
                raise RuntimeError(f"no PTX text for indexer_paged {fmt}/nn{nn} (got {str(ptx)[:200]!r})")
            res[f"{fmt}-nn{nn}"] = ptx
    return res


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
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


class _DslBase(DslProvider):

    def _target(self, problem, target) -> Support | None:
        no = dsl_target_support(target, "WGMMA kernels are compiled for sm_90a only")
        if no is not None:
            return no
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
        no = self._target(problem, target)
        if no is not None:
            return no
        if problem["block_size"] % 64:
            return Support.no(f"dsl: block_size {problem['block_size']} is not a multiple of 64")
        if not 1 <= problem["next_n"] <= 4:
            return Support.no(f"dsl: next_n {problem['next_n']} outside 1..4")
        return Support.yes("sm_90a, MXFP4 / FP8 keys, block_size % 64 == 0, next_n 1..4")

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        import torch
        from cutlass import Int32

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
                Int32(B), Int32(nb), Int32(bs), Int32(max_ctx), Int32(grid))
        launch_on(q_data.device, fn, *args)
        return out


def prefill_logits_dsl(q_data, q_sf, w, k_data, k_sf, ks, ke, *, fmt: str = "mxfp4", operand: str | None = None):
    """Prefill indexer logits on the DSL kernels (kernels_dsl/indexer_prefill.py); same arguments
    and result as :func:`dsv4.ops.indexer.indexer_logits` for ``fmt`` in ``{"mxfp4", "fp8"}`` (CUDA
    tensors, already validated by the op).

    ``operand`` (the WGMMA input type): ``"e4m3"`` (default for MXFP4: rows folded to E4M3 by
    kernels_dsl/indexer_fp8_rows.py, exact products) or ``"bf16"`` (default for FP8 keys: E4M3
    values widened exactly to BF16, BF16 WGMMA with full FP32 accumulation; FP8 keys through the
    FP8 WGMMA, ``operand="e4m3"``, keep only ~14 accumulator bits: 2.28e-3 x the row max on short
    rows in job idx-11, outside the op's 2e-3 contract). The ``dsl`` provider of ``indexer_logits``
    (:class:`DslLogits`) calls this for the formats in :data:`PREFILL_VALIDATED`. Two launches
    (operand conversion of q and K, then the GEMM kernel); no host sync, graph-capturable.
    """
    import torch
    from cutlass import Float8E4M3FN, Int32
    from cutlass.cute.runtime import from_dlpack

    from dsv4.target import Target

    from .indexer_fp8_rows import mxfp4_rows_to_fp8
    from .indexer_prefill import QUNIT, compile_prefill
    if fmt not in DSL_FORMATS:
        raise ValueError(f"prefill_logits_dsl: fmt must be one of {DSL_FORMATS}, got {fmt!r}")
    operand = operand or ("e4m3" if fmt == "mxfp4" else "bf16")
    if (fmt, operand) not in (("mxfp4", "e4m3"), ("fp8", "e4m3"), ("fp8", "bf16")):
        raise ValueError(f"prefill_logits_dsl: operand {operand!r} is not offered for fmt={fmt!r} "
                         "(mxfp4: 'e4m3'; fp8: 'bf16' or 'e4m3')")
    T, S = q_data.shape[0], k_data.shape[0]
    out = torch.empty((T, S), dtype=torch.float32, device=q_data.device)
    if T == 0 or S == 0:
        return out
    if fmt == "mxfp4":
        qa, qsc = mxfp4_rows_to_fp8(q_data.reshape(T * 64, 64), q_sf.reshape(T * 64, 4))
        ka, ksc = mxfp4_rows_to_fp8(k_data, k_sf)
        qsc = qsc.view(T, 64)
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
        t = from_dlpack(x, assumed_align=16)
        if operand == "e4m3":
            t.element_type = Float8E4M3FN
        return t.mark_layout_dynamic(leading_dim=1)

    t = dl
    wv = _aligned(w)
    units = -(-T // QUNIT)
    grid = min(units, _sm_count(q_data.device))
    args = (opnd(qa), opnd(ka), t(ksc, 16), t(wv, 16), t(qsc if has_qs else wv, 16), t(ks.contiguous(), 4),
            t(ke.contiguous(), 4), t(out, 4), Int32(grid))
    launch_on(q_data.device, fn, *args)
    return out


#: Key formats whose prefill passed its GPU gates on the H200 (jobs idx-11 / idx-12, 2026-12-01: MXFP4
#: max error 4.5e-7 x row max vs fp64 on the same values, recall (b) identical to the exact CUDA path,
#: graph capture; idx-12: this 4-warpgroup kernel, bitwise the logits of the idx-11 version, and
#: tests/test_indexer.py's prefill / recall / cosine gates with it as the default). FP8 keys are NOT in it: the FP8 WGMMA accumulation (K = 128 in one chain, ~14
#: bits kept, as in DeepGEMM) reached 2.28e-3 x the row max on a short-row case (contract: 2e-3);
#: FP8 keys now go to the BF16-operand variant (exact widening, full FP32 accumulation), which is
#: compiled and compile-checked but has NOT run on the H200 (the device budget ran out before job
#: idx-14): add "fp8" here once ``pytest -m gpu tests/test_indexer_dsl.py -k prefill`` passes on it.
#: Until then FP8 prefill stays on the exact CUDA BF16 kernel. ``DSV4_RUN_UNVALIDATED=1`` lets the
#: registry pick the kernel for the other formats too (validation jobs only).
PREFILL_VALIDATED = ("mxfp4",)


class DslLogits(_DslBase):
    describe = ("CuTe DSL PrefillLogitsKernel: persistent, TMA key tiles shared by 4 math warpgroups (8 queries per "
                "tile), WGMMA m64n128k32 E4M3, ReLU x w head sum; MXFP4 rows folded to FP8 once (Fp8RowsKernel)")

    def supports(self, problem, target):
        no = self._target(problem, target)
        if no is not None:
            return no
        from dsv4.config import env_flag
        if problem["fmt"] not in PREFILL_VALIDATED and not env_flag("DSV4_RUN_UNVALIDATED"):
            return Support.no("dsl: FP8-key prefill: the FP8-WGMMA variant misses the 2e-3 x row-max bound on short "
                              "rows (2.28e-3, job idx-11); the exact BF16-operand variant has not run on the H200 yet")
        return Support.yes("sm_90a, MXFP4 keys (E2M1 folded to E4M3: exact products; FP32 promotion of the row scales)")

    def run(self, problem, *, q_data, q_sf, w, k_data, k_sf, ks, ke, q_global, k_global):
        return prefill_logits_dsl(q_data, q_sf, w, k_data, k_sf, ks, ke, fmt=problem["fmt"])


class DslTopkPagedComposed(DslPagedLogits):
    """``indexer_topk_paged`` as two launches on the device, NOT fused: the DSL decode logits kernel
    writes ``[B*next_n, max_ctx]`` fp32 logits to HBM, then the ``topk`` op (its registry choice,
    the CUDA radix kernel on sm_90a) selects from them (mapping through block_table in the same
    launch). No host sync, graph-capturable. tests/test_indexer_topk_paged.py's GPU tests passed on
    the H200 (job idx-12: bitwise the two ops in sequence, recall >= 99.5% vs the exact selection,
    graph capture). What is left (issue 13 item 2): the fused single-pass kernel that keeps each
    CTA's candidates on chip and merges them in a final pass."""

    describe = ("composed, not fused: DSL PagedLogitsKernel -> fp32 logits in HBM -> topk op (CUDA radix select); "
                "no host sync")

    def supports(self, problem, target):
        s = super().supports(problem, target)
        if not s:
            return s
        return Support.yes("sm_90a, MXFP4 / FP8 keys: DSL logits kernel + topk op (2 launches, not fused)")

    def run(self, problem, *, q_data, q_sf, w, cache, lens, block_table, q_global, k_global):
        from dsv4.ops.topk import topk
        logits = super().run(problem, q_data=q_data, q_sf=q_sf, w=w, cache=cache, lens=lens,
                             block_table=block_table, q_global=q_global, k_global=k_global)
        mapped = problem["mapped"]
        return topk(logits, lens.reshape(-1), problem["k"], block_table=block_table if mapped else None,
                    block_size=problem["block_size"] if mapped else 0, rows_per_seq=problem["next_n"],
                    return_scores=True)


PROVIDERS = {"indexer_logits_paged": DslPagedLogits, "indexer_logits": DslLogits,
             "indexer_topk_paged": DslTopkPagedComposed}
