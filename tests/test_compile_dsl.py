"""CPU compile checks: every CuTe DSL kernel compiles for sm_90a without a GPU; assert on its PTX.

Protocol (how a DSL kernel module adds itself): ``kernels_dsl/<module>.py`` defines

* ``compile_check(dump_dir) -> {variant: ptx_text}``: compiles each specialization with fake
  tensors for sm_90a (``compile_options("sm_90a", f"--keep-ptx --dump-dir {dump_dir}")``)
  and returns the PTX text;
* ``PTX_PATTERNS``: regexes that every variant's PTX must contain (e.g. ``prmt\\.b32``,
  ``wgmma\\.mma_async``, a 128-bit vector load);
* optionally ``PTX_FORBIDDEN``: regexes that must not occur (e.g. ``\\.ftz``).

Modules without ``compile_check`` are listed by ``test_every_dsl_module_has_a_compile_check``.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # never the silent sm_100a default

pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")

import kernels_dsl  # noqa: E402

#: a 128-bit global load, plain or through the read-only path
VECTOR_LOAD_128 = r"ld\.global(\.nc)?(\.L[12]::\S+)*\.v4\.(b|u|s|f)32|ld\.global(\.nc)?\.v2\.(b|u|s|f)64"


def _dsl_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(kernels_dsl.__path__) if not m.name.startswith("_"))


def _has_compile_check(name: str) -> bool:
    return hasattr(importlib.import_module(f"kernels_dsl.{name}"), "compile_check")


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    # passed as --dump-dir with --keep-ptx; it must exist, else __ptx__ is a path string
    return str(tmp_path_factory.mktemp("cute_dsl_dump"))


@pytest.mark.parametrize("name", _dsl_modules())
def test_dsl_kernel_compiles_for_sm90a(name, dump_dir):
    mod = importlib.import_module(f"kernels_dsl.{name}")   # an import error fails here, named
    if not hasattr(mod, "compile_check"):
        pytest.skip(f"kernels_dsl.{name} has no compile_check() (see test_every_dsl_module_has_a_compile_check)")
    variants = mod.compile_check(dump_dir)
    if isinstance(variants, str):
        variants = {name: variants}
    assert variants, f"kernels_dsl.{name}.compile_check() returned no PTX"
    patterns = tuple(getattr(mod, "PTX_PATTERNS", ()))
    forbidden = tuple(getattr(mod, "PTX_FORBIDDEN", ()))
    for variant, ptx in variants.items():
        assert isinstance(ptx, str) and ".entry" in ptx, f"{name}/{variant}: not PTX text: {str(ptx)[:200]!r}"
        assert re.search(r"^\.target\s+sm_90a\b", ptx, re.M), f"{name}/{variant}: PTX is not for sm_90a"
        for pat in patterns:
            assert re.search(pat, ptx), f"{name}/{variant}: PTX lacks /{pat}/"
        for pat in forbidden:
            m = re.search(pat, ptx)
            assert m is None, f"{name}/{variant}: PTX contains forbidden /{pat}/: {ptx[max(0, m.start() - 80):m.end() + 40]!r}"


def test_dequant_fp4_ptx_has_lut_decode_and_128bit_memory(dump_dir):
    """The first op's contract, spelled out: prmt LUT, 16-byte loads and stores, sm_90a."""
    from kernels_dsl import dequant_fp4
    variants = dequant_fp4.compile_check(dump_dir)
    assert set(variants) == {"mxfp4-bfloat16", "mxfp4-float32", "nvfp4-bfloat16", "nvfp4-float32"}
    for v, ptx in variants.items():
        assert ".target sm_90a" in ptx
        assert len(re.findall(r"prmt\.b32", ptx)) >= 32, v       # 8 prmt per 32-bit word, 4 words
        assert re.search(VECTOR_LOAD_128, ptx), v
        n_st = len(re.findall(r"st\.global\.v4\.b32", ptx))
        tiles = dequant_fp4.DEFAULT_CONFIG.tiles                  # 512 B input tiles per warp
        assert n_st == tiles * (4 if "bfloat16" in v else 8), (v, n_st)  # 64 B / 128 B per thread and tile
        assert not re.search(r"\.ftz\b", ptx), v                  # subnormal scales must survive


def test_every_dsl_module_has_a_compile_check():
    missing = [n for n in _dsl_modules() if not _has_compile_check(n)]
    assert not missing, f"kernels_dsl modules without compile_check(): {missing}"


def test_kv_cache_ptx_16byte_rows_exact_conversions(dump_dir):
    """kv_cache_append / kv_gather (kernels_dsl/kv_cache.py): 16-byte row loads and stores, E4M3 via
    cvt.rn.satfinite.e4m3x2 (append) and cvt.rn.f16x2.e4m3x2 (gather, exact), smem staging of fp8 rows,
    shuffles for the slot / row broadcast, no local memory, no flush-to-zero."""
    from kernels_dsl import kv_cache
    variants = kv_cache.compile_check(dump_dir)
    assert set(variants) == set(kv_cache.CHECK_VARIANTS)
    for v, ptx in variants.items():
        assert re.search(VECTOR_LOAD_128, ptx) and re.search(r"st\.global\.v4\.b32", ptx), v
        assert "shfl.sync" in ptx and ".local" not in ptx and not re.search(r"\.ftz\b", ptx), v
        if v.startswith("append"):
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, v
            assert ("st.global.v2.b32" in ptx) == ("fp8_ds_mla" in v), v       # the 8-byte scale word
        elif "fp8_ds_mla" in v:
            assert "cvt.rn.f16x2.e4m3x2" in ptx and "st.shared.v4" in ptx, v


def test_attn_lists_ptx_has_16byte_stores_and_loads(dump_dir):
    """attn_lists: every output chunk is one 16-byte store (2 outputs for swa, 4 for csa / hca); the CSA
    top-k entries come in 16-byte loads; sm_90a."""
    from kernels_dsl import attn_lists
    variants = attn_lists.compile_check(dump_dir)
    assert set(variants) == set(attn_lists.CHECK_VARIANTS)
    for v, ptx in variants.items():
        n_st = len(re.findall(r"st\.global\.v4\.b32", ptx))
        assert n_st == (2 if v.startswith("swa") else 4), (v, n_st)
        assert bool(re.search(VECTOR_LOAD_128, ptx)) == v.startswith("csa"), v
        assert re.search(r"\bdiv\.s64", ptx), v                 # int64 page / position math


def test_quantize_ptx_exact_roundings_and_16byte_memory(dump_dir):
    """quantize_fp4 / quantize_fp8 (issue 16): the E2M1 magic-add encoder (integer madd + fp32 add.rn,
    never a float -> int convert), E4M3 by cvt.rn.satfinite, Markstein x/s (fma.rn), 16-byte loads and
    stores, shuffle block amax, the grid barrier's acquire/release atomics; no flush-to-zero."""
    from kernels_dsl import quantize_fp4, quantize_fp8
    v = quantize_fp4.compile_check(dump_dir, only=("nvfp4-bf16-swz-grid", "mxfp4-fp16-ocp-qj4"))
    for name, ptx in v.items():
        assert ptx.count("mad.lo.u32") >= 8 and "add.rn.f32" in ptx and "shfl.sync.bfly" in ptx, name
        assert re.search(VECTOR_LOAD_128, ptx) and "st.global.v4.b32" in ptx, name
        assert not re.search(r"cvt\.r[nzmp]i\.[su]\d+\.f32|\.ftz\b", ptx), name
    assert "cvt.rn.satfinite.e4m3x2.f32" in v["nvfp4-bf16-swz-grid"] and "rcp.rn.f32" in v["nvfp4-bf16-swz-grid"]
    assert "atom.add.acq_rel.gpu" in v["nvfp4-bf16-swz-grid"] and "ld.acquire.gpu" in v["nvfp4-bf16-swz-grid"]
    assert "clz.b32" in v["mxfp4-fp16-ocp-qj4"] and "cvt.f32.f16" in v["mxfp4-fp16-ocp-qj4"]
    w = quantize_fp8.compile_check(dump_dir, only=("quant-bf16-b128-fp32", "dequant-b32-ue8m0-f32"))
    assert "fma.rn.f32" in w["quant-bf16-b128-fp32"] and "cvt.rn.satfinite.e4m3x2.f32" in w["quant-bf16-b128-fp32"]
    assert "cvt.rn.f16x2.e4m3x2" in w["dequant-b32-ue8m0-f32"] and "st.global.v4.b32" in w["dequant-b32-ue8m0-f32"]
