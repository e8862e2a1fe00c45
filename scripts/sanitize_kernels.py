"""Kernel coverage of the compute-sanitizer runs (issue 19 item 14; used by scripts/gpu_sanitize.sh).

* :data:`KERNELS`: every kernel the library launches -> the GPU test file whose ``sanitize`` subset
  (tests/conftest.py ``SANITIZE``) launches it. CuTe DSL kernels are named by the first element of
  their ``compile_cached`` key (one name per kernel class; specializations share it), NVRTC kernels
  by their ``extern "C"`` name. tests/test_sanitize_coverage.py checks on the CPU that the table
  lists exactly the kernels found in kernels_dsl/ and kernels_cuda/ and that every file has a subset.
* pytest plugin (``-p sanitize_kernels`` with scripts/ on ``sys.path``):
  - ``SANITIZE_KERNELS_OUT=path.json``: at the end of the session, write the kernels this process
    compiled or loaded (DSL ``compile_cached`` entries, NVRTC ``CudaModule.kernel`` look-ups; both
    happen at the launch) -> the evidence that a subset really launches its kernels.
  - ``SANITIZE_SHARD=k/N``: keep only every N-th selected test (from the k-th), so one file's
    subset (or any selection) can run in N parallel processes.
* ``python scripts/sanitize_kernels.py report DIR [tests/test_x.py ...]``: merge DIR/*.kernels.json and
  print the kernels of :data:`KERNELS` (of the given files) that no run launched (exit 1 if any).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: kernel -> test file whose sanitize subset launches it ("dsl:" = CuTe DSL compile key, "cuda:" = NVRTC)
KERNELS = {
    # quantize / dequant
    "dsl:quantize_fp4": "test_quantize.py",            # Fp4QuantizeKernel (NVFP4 / MXFP4)
    "dsl:quantize_amax": "test_quantize.py",           # AmaxPartialsKernel (NVFP4 device amax)
    "dsl:quantize_fp8": "test_quantize.py",            # Fp8QuantizeKernel
    "dsl:dequant_fp8": "test_quantize.py",             # Fp8DequantKernel
    "dsl:dequant_fp4": "test_dequant_fp4.py",          # DequantFp4Kernel
    "dsl:sm90.fp4_probe": "test_fp4_decode.py",        # Fp4DecodeProbe (the shared E2M1 decoder)
    # indexer
    "dsl:indexer_quant": "test_indexer_quant.py",      # DSL cache write + q quant
    "cuda:indexer_logits_kernel": "test_indexer.py",   # NVFP4 paged logits (decode)
    "dsl:indexer_paged": "test_indexer_dsl.py",        # PagedLogitsKernel
    "dsl:indexer_prefill": "test_indexer_dsl.py",      # PrefillLogitsKernel
    "dsl:indexer_fp8_rows": "test_indexer_dsl.py",     # Fp8RowsKernel
    # top-k
    "cuda:topk_kernel": "test_topk.py",
    # KV cache
    "dsl:kv_cache_append": "test_kv_cache.py",         # KvAppendKernel
    "dsl:kv_gather": "test_kv_cache.py",               # KvGatherKernel
    "cuda:kv_gather_kernel": "test_kv_cache.py",
    "cuda:kv_compress_prefill_kernel": "test_kv_cache.py",
    "cuda:kv_compress_decode_kernel": "test_kv_cache.py",
    # sparse attention + index lists
    "dsl:sparse_attention_fwd": "test_sparse_attention.py",      # SparseAttentionFwdKernel
    "dsl:sparse_attention_combine": "test_sparse_attention.py",  # SparseAttentionCombineKernel
    "dsl:attn_lists": "test_attn_lists.py",            # AttnListsKernel
    # MoE
    "dsl:moe_grouped_gemm": "test_moe.py",             # Fp4GroupedGemmKernel (small layer, both formats)
    "cuda:moe_decode_kernel": "test_moe_decode.py",
    "dsl:moe_route": "test_moe_glue.py",               # RouteKernel
    "dsl:moe_permute": "test_moe_glue.py",             # PermuteKernel
    "dsl:moe_combine": "test_moe_glue.py",             # CombineKernel
    # dense FP8 GEMM
    "dsl:fp8_gemm": "test_dsl_fp8_gemm.py",            # Fp8GemmKernel
}


def source_kernels() -> set[str]:
    """Every kernel name found in the sources: DSL ``compile_cached(("name", ...`` / ``key = ("name", ...``
    in kernels_dsl/**/*.py, NVRTC ``extern "C" __global__`` functions in kernels_cuda/*.cu."""
    found = set()
    for p in (ROOT / "kernels_dsl").rglob("*.py"):
        s = p.read_text()
        if "@cute.kernel" not in s and "compile_cached(" not in s:
            continue
        for m in re.finditer(r'(?:compile_cached\(\(|key = \()\s*"([\w.]+)"', s):
            found.add("dsl:" + m.group(1))
    for p in (ROOT / "kernels_cuda").glob("*.cu"):
        for m in re.finditer(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*|[A-Z_]+\s+)?(\w+)\s*\(',
                             p.read_text()):
            found.add("cuda:" + m.group(1))
    return found


# ------------------------------------------------------------------------------ pytest plugin
_seen_cuda: set[str] = set()


def _patch_cuda() -> None:
    try:
        from kernels_cuda import nvrtc
    except Exception:  # noqa: BLE001 - no cuda bindings: nothing to record
        return
    orig = nvrtc.CudaModule.kernel
    if getattr(orig, "_sanitize_wrapped", False):
        return

    def kernel(self, name):
        _seen_cuda.add(name)
        return orig(self, name)
    kernel._sanitize_wrapped = True
    nvrtc.CudaModule.kernel = kernel


if os.environ.get("SANITIZE_KERNELS_OUT"):
    _patch_cuda()


@pytest.hookimpl(trylast=True)                  # after -m / -k deselection
def pytest_collection_modifyitems(config, items):
    """``SANITIZE_SHARD=k/N``: keep items k, k + N, k + 2N, ... of the selected tests (after ``-m`` / ``-k``)."""
    shard = os.environ.get("SANITIZE_SHARD")
    if not shard:
        return
    k, n = (int(x) for x in shard.split("/"))
    drop = [it for i, it in enumerate(items) if i % n != k]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = items[k::n]


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("SANITIZE_KERNELS_OUT")
    if not out:
        return
    dsl = set()
    mod = sys.modules.get("kernels_dsl._compile")
    if mod is not None:
        for key in list(getattr(mod, "_cache", {})):
            while isinstance(key, tuple) and key and isinstance(key[0], tuple):   # (key, call path) entries
                key = key[0]
            if isinstance(key, tuple) and key and isinstance(key[0], str):
                dsl.add("dsl:" + key[0])
    Path(out).write_text(json.dumps(sorted(dsl | {"cuda:" + n for n in _seen_cuda})))


# ------------------------------------------------------------------------------ report
def report(d: str, files: list[str] | None = None) -> int:
    """Kernels of :data:`KERNELS` (those mapped to ``files``, default all) that no plain run launched."""
    want = {k for k, f in KERNELS.items() if not files or f in files}
    seen: dict[str, set[str]] = {}
    for p in sorted(Path(d).glob("*.kernels.json")):
        for k in json.loads(p.read_text()):
            seen.setdefault(k, set()).add(p.name.split(".")[0])
    missing = sorted(want - set(seen))
    print(f"kernels launched by the plain subset runs: {len(want & set(seen))}/{len(want)}"
          + (f" (of the files run; {len(KERNELS)} in all)" if len(want) < len(KERNELS) else "")
          + (f"; NOT launched: {', '.join(missing)}" if missing else " (all)"))
    extra = sorted(set(seen) - set(KERNELS))
    if extra:
        print(f"  launched but not in KERNELS: {', '.join(extra)}")
    return 1 if missing else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "report":
        sys.exit(report(sys.argv[2], [os.path.basename(f) for a in sys.argv[3:] for f in a.split("+")]))
    print(__doc__)
