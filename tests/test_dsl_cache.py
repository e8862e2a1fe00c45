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


def test_sources_digest_covers_the_shared_sm90_package():
    """Editing kernels_dsl/sm90/*.py must invalidate the disk cache of every kernel using it."""
    from pathlib import Path
    C._sources_digest.cache_clear()
    try:
        root = Path(C.__file__).resolve().parent
        assert any(p.parent.name == "sm90" for p in root.rglob("*.py"))
        real = Path.read_bytes

        def patched(self):
            data = real(self)
            return data + b"#edit" if self.name == "fp4.py" and self.parent.name == "sm90" else data
        d0 = C._sources_digest()
        C._sources_digest.cache_clear()
        import unittest.mock as mock
        with mock.patch.object(Path, "read_bytes", patched):
            assert C._sources_digest() != d0
    finally:
        C._sources_digest.cache_clear()


def test_launch_on_current_and_other_device(monkeypatch):
    import contextlib

    import torch
    calls, entered = [], []
    monkeypatch.setattr(C, "current_stream", lambda: "stream")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(entered.append(d)))
    C.launch_on(torch.device("cuda", 0), lambda *a: calls.append(a), 1, 2)
    C.launch_on(torch.device("cuda"), lambda *a: calls.append(a), 3)
    assert calls == [(1, 2, "stream"), (3, "stream")] and entered == []
    C.launch_on(torch.device("cuda", 1), lambda *a: calls.append(a), 4)
    assert calls[-1] == (4, "stream") and entered == [torch.device("cuda", 1)]


def test_dsl_provider_base_target_checks():
    from dsv4.registry import Support
    from dsv4.target import Target

    class P(C.DslProvider):
        def supports_problem(self, problem):
            return Support.no("dsl: too big") if problem["n"] > 4 else Support.yes("small")
    p = P(op=None)
    h200 = Target("cuda", "sm_90a", "H200", 132, 0)
    assert p.kind == "dsl" and p.supports({"n": 1}, h200).reason == "small"
    assert p.supports({"n": 9}, h200).reason == "dsl: too big"
    assert "not a CUDA device" in p.supports({"n": 1}, Target("cpu", None, "cpu", 0)).reason
    r = p.supports({"n": 1}, Target("cuda", "sm_100a", "B200", 148, 0))
    assert not r and "sm_90a" in r.reason and "sm_100a" in r.reason
