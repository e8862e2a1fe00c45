"""Compile-once cache for CuTe DSL kernels, with the arch always explicit.

* ``cute.compile`` never caches (shared/reference/cutedsl_guide.md 2.3), so every compiled
  kernel is kept here, keyed by its specialization ``(op, dtypes, static shape params, arch)``.
* The arch is always passed (``--gpu-arch sm_90a``): with no GPU visible the DSL would
  silently target sm_100a.
* On-disk cache: the DSL's export path (``export_to_c`` + ``cute.runtime.load_module``) needs
  ``apache-tvm-ffi`` at load time, which the GPU image does not ship; we therefore keep
  compiled kernels in memory only (one compile per process per specialization). See
  docs/design.md "Compilation caches".
* ``cute.compile`` is not thread-safe: a process-wide lock serializes compiles.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any, Callable, Hashable

from dsv4.registry import Support

__all__ = ["dsl_available", "compile_cached", "compile_options", "stats", "current_stream"]

_cache: dict[Hashable, Any] = {}
_lock = threading.Lock()
_stats = {"compiles": 0, "hits": 0, "seconds": 0.0}


@functools.lru_cache(maxsize=None)
def dsl_available() -> Support:
    """Is the CuTe DSL importable?"""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return Support.no(f"dsl: nvidia-cutlass-dsl not importable ({type(e).__name__}: {e})")
    return Support.yes("nvidia-cutlass-dsl importable")


def compile_options(arch: str, extra: str = "") -> str:
    """Options string for ``cute.compile``; always names the arch."""
    opt = f"--gpu-arch {arch}"
    env = os.environ.get("DSV4_DSL_OPTIONS")
    if env:
        opt += " " + env
    if extra:
        opt += " " + extra
    return opt


def compile_cached(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, calling ``build()`` (which runs ``cute.compile``) once."""
    fn = _cache.get(key)
    if fn is not None:
        _stats["hits"] += 1
        return fn
    with _lock:
        fn = _cache.get(key)
        if fn is None:
            t0 = time.perf_counter()
            fn = build()
            _stats["seconds"] += time.perf_counter() - t0
            _stats["compiles"] += 1
            _cache[key] = fn
    return fn


def stats() -> dict:
    """Compile counters: number of compiles, cache hits, seconds spent compiling."""
    return dict(_stats, entries=len(_cache))


def current_stream():
    """torch's current stream as a ``cuda.CUstream`` for DSL launches."""
    import cuda.bindings.driver as cuda
    import torch
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)
