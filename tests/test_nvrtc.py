"""NVRTC toolchain: every .cu compiles for sm_90a on a CPU-only machine; the cubin cache is
keyed, atomic and self-healing; launch() refuses scalars of implicit width."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from kernels_cuda import nvrtc

CU_FILES = sorted(p.name for p in nvrtc.KERNEL_DIR.glob("*.cu"))


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    return tmp_path / "nvrtc"


@pytest.mark.parametrize("source", CU_FILES)
def test_every_cu_compiles_for_sm90a(source, tmp_cache):
    """Default macros; op-specific tests check their variants and the instructions they need."""
    m = nvrtc.CudaModule(source)
    ptx = m.ptx()
    assert ".target sm_90a" in ptx
    assert ".entry" in ptx, f"{source}: no kernel entry point"
    cubin = m.cubin()
    assert cubin[:4] == b"\x7fELF"


def test_sm90_without_a_is_rejected_for_wgmma(tmp_cache, tmp_path, monkeypatch):
    src = tmp_path / "probe_wgmma.cu"   # absolute paths are accepted as sources
    src.write_text('extern "C" __global__ void k(){ asm volatile("wgmma.fence.sync.aligned;"); }\n')
    assert "wgmma.fence" in nvrtc.CudaModule(str(src), arch="sm_90a").ptx()
    with pytest.raises(nvrtc.CompileError):
        nvrtc.CudaModule(str(src), arch="sm_90").cubin()


def test_cubin_cache_hit_key_and_corruption(tmp_cache):
    m = nvrtc.CudaModule("kv_cache.cu", (("KVC_FMT", "1"),))
    a = m.cubin()
    files = sorted(tmp_cache.glob("*.cubin"))
    assert len(files) == 1
    meta = json.loads(files[0].with_suffix(".json").read_text())
    assert meta["sha256"] == hashlib.sha256(a).hexdigest() and meta["arch"] == "sm_90a"
    # different macros -> different key
    m2 = nvrtc.CudaModule("kv_cache.cu", (("KVC_FMT", "0"),))
    assert m2.key() != m.key()
    m2.cubin()
    assert len(list(tmp_cache.glob("*.cubin"))) == 2
    # corrupt entry -> recompiled and rewritten
    files[0].write_bytes(b"garbage")
    b = nvrtc.CudaModule("kv_cache.cu", (("KVC_FMT", "1"),)).cubin()
    assert b == a and files[0].read_bytes() == a
    assert not list(tmp_cache.glob("*.tmp"))


def test_key_depends_on_nvrtc_version_and_arch(tmp_cache, monkeypatch):
    m = nvrtc.CudaModule("kv_cache.cu")
    k1 = m.key()
    assert nvrtc.CudaModule("kv_cache.cu", arch="sm_100a").key() != k1
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: (99, 0))
    assert m.key() != k1


def test_compile_error_has_log(tmp_cache, tmp_path):
    src = tmp_path / "probe_bad.cu"
    src.write_text('extern "C" __global__ void k(){ this is not c++; }\n')
    with pytest.raises(nvrtc.CompileError, match="probe_bad.cu"):
        nvrtc.CudaModule(str(src)).cubin()


@pytest.mark.parametrize("bad", [1, 2.0, True])
def test_launch_rejects_bare_python_scalars(bad):
    with pytest.raises(TypeError, match="explicit"):
        nvrtc.launch(object(), 1, 1, np.int32(1), bad)
