"""CuTe DSL compile cache: in memory once per key, exported .o on disk reloaded (CPU-only check;
the GPU run of a reloaded kernel is in tests/test_dequant_fp4.py::...gpu tests via the provider)."""
from __future__ import annotations

import pytest

pytest.importorskip("cutlass.cute")

from kernels_dsl import _compile as C  # noqa: E402
from kernels_dsl import dequant_fp4 as D  # noqa: E402


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(C, "_cache", {})
    return tmp_path / "dsl"


def test_compile_once_then_disk_reload(fresh, monkeypatch):
    key = ("dequant_fp4", "mxfp4", "bfloat16", "sm_90a", "test")
    calls = []

    def build():
        calls.append(1)
        return D._compile("mxfp4", "bfloat16", "sm_90a")
    before = C.stats()
    f1 = C.compile_cached(key, build)
    assert C.compile_cached(key, build) is f1 and len(calls) == 1        # memory hit
    objs = list(fresh.glob("*.o"))
    assert len(objs) == 1 and objs[0].stat().st_size > 1000
    monkeypatch.setattr(C, "_cache", {})                                  # "new process"
    f2 = C.compile_cached(key, build)
    assert len(calls) == 1, "second process must load the .o, not recompile"
    assert C.stats()["disk_hits"] == before["disk_hits"] + 1 and f2 is not None


def test_corrupt_entry_is_recompiled(fresh, monkeypatch):
    key = ("dequant_fp4", "nvfp4", "float32", "sm_90a", "test")
    n = []
    build = lambda: (n.append(1), D._compile("nvfp4", "float32", "sm_90a"))[1]  # noqa: E731
    C.compile_cached(key, build)
    (obj,) = fresh.glob("*.o")
    obj.write_bytes(b"not an object file")
    monkeypatch.setattr(C, "_cache", {})
    C.compile_cached(key, build)
    assert len(n) == 2 and obj.exists() and obj.read_bytes()[:4] == b"\x7fELF"


def test_disk_cache_can_be_disabled(fresh, monkeypatch):
    monkeypatch.setenv("DSV4_DSL_DISK_CACHE", "0")
    C.compile_cached(("dequant_fp4", "mxfp4", "float32", "sm_90a", "nodisk"),
                     lambda: D._compile("mxfp4", "float32", "sm_90a"))
    assert not list(fresh.glob("*.o")) if fresh.exists() else True
