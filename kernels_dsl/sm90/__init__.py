"""Shared CuTe DSL building blocks of this project's Hopper (sm_90a) kernels.

One place for what the MoE grouped GEMMs, the Lightning Indexer and sparse attention share:

* :mod:`kernels_dsl.sm90.fp4` -- E2M1 -> E4M3 / BF16 operand decode (prmt LUTs, UE8M0
  exponent folding), with bit-exact Python models.

Every module here that defines kernels contributes to :func:`compile_check` (the CPU compile
gate of tests/test_compile_dsl.py, which treats this package as one DSL module).
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

#: regexes every compiled variant of this package's kernels must contain
PTX_PATTERNS = (r"prmt\.b32", r"cvt\.rn\.satfinite\.e4m3x2\.f32")


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a") -> dict[str, str]:
    """Compile this package's kernels for ``arch`` without a GPU; ``{variant: PTX text}``."""
    from . import fp4
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = dump_dir or tmp
        os.makedirs(d, exist_ok=True)
        fn = fp4.probe_compile(arch, f"--keep-ptx --dump-dir {d}")
        ptx = fn.__ptx__
        if ptx is None or not ptx.lstrip().startswith(("//", ".version")):
            raise RuntimeError(f"no PTX text for sm90.fp4 probe (got {str(ptx)[:200]!r})")
        res["fp4_probe"] = ptx
    return res
