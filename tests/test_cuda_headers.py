"""kernels_cuda/common.cuh is the one header of device helpers (issue 17 item 2).

* the generated part (common_wgmma.cuh) is what kernels_cuda/gen_headers.py renders;
* no .cu / .cuh defines a device helper under a name common.cuh already defines (a second copy
  of the same logic), and no prefixed copies (``md_`` / ``kvc_``) of the shared helpers remain in
  the kernels that moved to common.cuh;
* every WGMMA wrapper compiles and its PTX holds the instruction it names.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

KDIR = Path(__file__).resolve().parents[1] / "kernels_cuda"
_DEF = re.compile(r"^(?:template\s*<[^>]*>\s*)?DSV4_DEVICE\s+[\w:<>, ]+?\s+(\w+)\s*\(", re.M)


def _defs(path: Path) -> list[str]:
    return _DEF.findall(path.read_text())


def test_generated_wgmma_header_is_current():
    from kernels_cuda import gen_headers
    assert gen_headers.PATH.read_text() == gen_headers.render(), "run: python -m kernels_cuda.gen_headers --write"
    assert gen_headers.main(["--check"]) == 0


def test_no_second_definition_of_a_common_helper():
    common = set(_defs(KDIR / "common.cuh")) | set(_defs(KDIR / "common_wgmma.cuh"))
    assert {"smem_u32", "cp_async16", "mbar_wait", "bulk_g2s", "wgmma_fence", "fwht128", "e2m1_code_rne",
            "ue8m0_byte_ceil", "wgmma_m64n64k16_bf16", "wgmma_m64n8k16_rs"} <= common
    clashes = {}
    for p in sorted(KDIR.glob("*.cu")) + sorted(KDIR.glob("*.cuh")):
        if p.name in ("common.cuh", "common_wgmma.cuh"):
            continue
        again = sorted(set(_defs(p)) & common)
        if again:
            clashes[p.name] = again
    assert not clashes, clashes


@pytest.mark.parametrize("name", [n for n in ("indexer.cu", "moe_decode.cu", "moe_decode.cuh", "kv_cache.cu", "kv_cache.cuh")
                                  if (KDIR / n).exists()])
def test_moved_kernels_keep_no_prefixed_copies(name):
    """The kernels whose helpers moved to common.cuh keep no ``md_`` / ``kvc_`` twins of them."""
    common = set(_defs(KDIR / "common.cuh"))
    prefixed = [d for d in _defs(KDIR / name) if re.sub(r"^(md|kvc|idx)_", "", d) in common and d not in common]
    assert not prefixed, prefixed


def test_wgmma_wrappers_compile_to_their_instructions():
    """A tiny kernel calling every generated wrapper compiles for sm_90a; the PTX names each shape."""
    from kernels_cuda import gen_headers
    from kernels_cuda.nvrtc import KERNEL_DIR, _nvrtc_compile
    calls = "\n".join(f"  wgmma_m64n{n}k16_bf16(d, da, db, acc);" for n in gen_headers.SS_N) + "\n" + \
        "\n".join(f"  wgmma_m64n{n}k16_rs(d, a, db);" for n in gen_headers.RS_N)
    src = ('#include "common.cuh"\nextern "C" __global__ void k(float* out, u64 da, u64 db, int acc) {\n'
           "  float d[128] = {};\n  u32 a[4] = {1u, 2u, 3u, 4u};\n  wgmma_fence();\n" + calls +
           "\n  wgmma_commit();\n  wgmma_wait<0>();\n  for (int i = 0; i < 128; ++i) out[i] = d[i];\n}\n")
    ptx = _nvrtc_compile(src, "wgmma_check.cu", ["--gpu-architecture=sm_90a", "-std=c++17", f"-I{KERNEL_DIR}",
                                                 "--device-as-default-execution-space"], "ptx").decode(errors="replace")
    for n in gen_headers.SS_N + gen_headers.RS_N:
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in ptx, n
    assert "wgmma.commit_group.sync.aligned" in ptx and "wgmma.wait_group.sync.aligned 0" in ptx
