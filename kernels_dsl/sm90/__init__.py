"""Shared CuTe DSL building blocks of this project's Hopper (sm_90a) kernels.

One place for what the MoE grouped GEMMs, the Lightning Indexer and sparse attention share:

* :mod:`kernels_dsl.sm90.fp4` -- E2M1 -> E4M3 / BF16 operand decode (prmt LUTs, UE8M0
  exponent folding), with bit-exact Python models.

Every module here that defines kernels contributes to :func:`compile_check` (the CPU compile
gate of tests/test_compile_dsl.py, which treats this package as one DSL module).
"""
from __future__ import annotations

from typing import Optional

#: regexes every compiled variant of this package's kernels must contain
PTX_PATTERNS = (r"prmt\.b32", r"cvt\.rn\.satfinite\.e4m3x2\.f32")


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile this package's kernels for ``arch`` without a GPU; ``{variant: PTX text}``."""
    from .._compile import compile_variants
    from . import fp4
    return compile_variants("sm90.fp4 probe", {"fp4_probe": fp4.probe_compile}, dump_dir, arch)
