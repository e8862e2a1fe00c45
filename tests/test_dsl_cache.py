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


@pytest.mark.parametrize("fast", [False, True], ids=["dsl-path", "tvm-ffi"])
def test_launch_on_current_and_other_device(monkeypatch, fast):
    import contextlib

    import torch
    calls, entered = [], []
    monkeypatch.setattr(C, "_FAST", fast)
    monkeypatch.setattr(C, "current_stream", lambda: "stream")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda i: "stream", raising=False)
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


# ------------------------------------------------------------------ TVM-FFI call path (CPU checks)
@pytest.fixture
def tvm(monkeypatch):
    """The TVM-FFI call path on for one test (skipped where apache-tvm-ffi is not installed)."""
    if not C.tvm_ffi_available():
        pytest.skip(f"apache-tvm-ffi not usable: {C.tvm_ffi_available().reason}")
    monkeypatch.setattr(C, "_FAST", True)


def _mxfp4_args(torch, M=8, K=128, **over):
    a = {"data": torch.zeros((M, K // 2), dtype=torch.uint8), "scale": torch.zeros((M, K // 32), dtype=torch.uint8),
         "out": torch.empty((M, K), dtype=torch.bfloat16)}
    a.update(over)
    return a


def test_tvm_ffi_kernel_takes_torch_tensors_and_checks_them_in_c(fresh, tvm):
    """Compiled with --enable-tvm-ffi, the kernel is a plain tvm_ffi.Function called with torch tensors;
    its C-level check names the argument (here: CPU tensors for a CUDA kernel) before any launch."""
    import torch
    import tvm_ffi
    assert "--enable-tvm-ffi" in C.compile_options("sm_90a")
    fn = C.compile_cached(("dequant_fp4", "mxfp4", "bfloat16", "sm_90a", "tvm"),
                          lambda: D._compile("mxfp4", "bfloat16", "sm_90a"))
    assert type(fn) is tvm_ffi.Function
    a = _mxfp4_args(torch)
    assert C.dl(a["data"], 16) is a["data"]                   # no conversion on this path
    with pytest.raises(ValueError, match=r"argument #0.*mData.*expected device_type=cuda"):
        fn(C.dl(a["data"]), C.dl(a["scale"], 1), C.dl(a["out"]), None, 132, 0)
    with pytest.raises(TypeError):                             # the stream is a required argument
        fn(a["data"], a["scale"], a["out"], None, 132)


def test_tvm_ffi_kernels_reload_from_disk_and_are_kept_apart_from_dsl_ones(fresh, tvm, monkeypatch):
    import tvm_ffi
    key = ("dequant_fp4", "mxfp4", "bfloat16", "sm_90a", "tvm-disk")
    calls = []

    def build():
        calls.append(C.fast_call())
        return D._compile("mxfp4", "bfloat16", "sm_90a")
    C.compile_cached(key, build)
    monkeypatch.setattr(C, "_cache", {})                                  # "new process"
    f2 = C.compile_cached(key, build)
    assert calls == [True] and type(f2) is tvm_ffi.Function              # loaded from the .o
    monkeypatch.setattr(C, "_FAST", False)                                # the DSL's own path: its own entry
    f3 = C.compile_cached(key, build)
    assert calls == [True, False] and type(f3) is not tvm_ffi.Function
    assert len(list(fresh.glob("*.o"))) == 2


def test_dl_follows_the_call_path(monkeypatch):
    import torch
    from cutlass import Float8E4M3FN, Uint32
    x = torch.zeros((4, 16), dtype=torch.uint8)
    monkeypatch.setattr(C, "_FAST", True)
    assert C.dl(x) is x and C.dl(x, 16, Float8E4M3FN).dtype == torch.float8_e4m3fn
    assert C.dl(x.view(torch.int32), 4, Uint32).dtype == torch.uint32
    monkeypatch.setattr(C, "_FAST", False)
    t = C.dl(x, 16, Float8E4M3FN)
    assert t.element_type is Float8E4M3FN and not isinstance(t, torch.Tensor)
    assert C.dl(x, 16, layout="rows") is not None and C.dl(x, 16, layout="static") is not None
    with pytest.raises(ValueError, match="layout"):
        C.dl(x, 16, layout="nope")


def test_set_fast_call_without_tvm_ffi_raises(monkeypatch):
    from dsv4.registry import Support
    monkeypatch.setattr(C, "tvm_ffi_available", lambda: Support.no("tvm_ffi: ModuleNotFoundError"))
    monkeypatch.setattr(C, "_FAST", None)
    with pytest.raises(RuntimeError, match="apache-tvm-ffi"):
        C.set_fast_call(True)
    assert C.fast_call() is False and "--enable-tvm-ffi" not in C.compile_options("sm_90a")


def test_scalar_arguments_follow_the_call_path(monkeypatch):
    """TVM-FFI: plain Python numbers (the compiled function converts them in C); DSL path: cutlass types."""
    from cutlass import Float32, Int32, Int64
    monkeypatch.setattr(C, "_FAST", True)
    assert type(C.i32(7)) is int and type(C.i64(1 << 40)) is int and type(C.f32(1.5)) is float
    import numpy as np
    assert type(C.i32(np.int64(3))) is int and C.i32(np.int64(3)) == 3
    monkeypatch.setattr(C, "_FAST", False)
    assert isinstance(C.i32(7), Int32) and isinstance(C.i64(1 << 40), Int64) and isinstance(C.f32(1.5), Float32)
