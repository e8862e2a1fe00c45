"""Compile-once cache for CuTe DSL kernels, with the arch always explicit.

* ``cute.compile`` never caches (shared/reference/cutedsl_guide.md 2.3), so every compiled
  kernel is kept here, keyed by its specialization ``(op, dtypes, static shape params, arch)``.
* The arch is always passed (``--gpu-arch sm_90a``): with no GPU visible the DSL would
  silently target sm_100a.
* On-disk cache: each compiled kernel is also exported (``compiled.export_to_c`` -> ``.o``; the
  CuTe ABI on the DSL's own call path, a TVM-FFI function on the fast one, below) under ``$DSV4_CACHE_DIR/dsl`` (default
  ``~/.cache/dsv4/dsl``) and reloaded with ``cute.runtime.load_module`` in later processes
  (milliseconds instead of a compile, bit-exact; a ``.o`` built on a CPU machine with the cu12
  wheel loads and runs under the GPU's cu13 bundle; docs/benchmarks.md). The
  key hashes the specialization key, the DSL version and every ``kernels_dsl/**/*.py`` source (sm90/ included);
  writes are atomic; an entry that fails to load is deleted and recompiled.
  ``DSV4_DSL_DISK_CACHE=0`` turns it off.
* ``cute.compile`` is not thread-safe: a process-wide lock serializes compiles.
* Fast call path (TVM-FFI): when ``apache-tvm-ffi`` imports (the ``[cu13]`` install), every kernel
  is compiled with ``--enable-tvm-ffi`` (:func:`compile_options` adds it) and called with the torch
  tensors themselves: the compiled function checks each argument against its fake tensor in C
  (dtype, rank, symbolic / static extents, base-pointer alignment, device type; the strides of a
  compact fake tensor are derived, not checked: a strided view is accepted, so the ops' spec
  validation stays the contiguity check) and raises a ``TypeError`` / ``ValueError``
  naming the argument, instead of the DSL's per-call Python conversion (``from_dlpack`` +
  ``mark_layout_dynamic`` per tensor, ``cutlass.Int32`` per scalar, argument packing). Providers
  build tensor arguments with :func:`dl`, scalars with :func:`i32` / :func:`i64` / :func:`f32`
  and launch with :func:`launch_on` / :func:`current_stream`, which follow the mode, so a
  provider has no branch. Bit-exact with the DSL's own path and graph-capturable; it cuts the eager
  host time per DSL op several-fold (docs/benchmarks.md, "TVM-FFI DSL call path"). The on-disk
  cache holds TVM-FFI objects too (``export_to_c`` -> ``.o``, ``load_module(..., enable_tvm_ffi=True)``;
  the mode is part of the key; the reload is checked on the CPU, tests/test_dsl_cache.py). Without ``tvm_ffi`` the DSL's own call path is used.
  :func:`set_fast_call` switches (benchmarks: ``bench_eager.py --dsl-call dsl``, tests).
"""
from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Hashable

from dsv4.config import env_flag, env_str
from dsv4.registry import Sm90Provider, Support, sm90_support

__all__ = ["dsl_available", "compile_cached", "compile_options", "stats", "current_stream", "launch_on",
           "dsl_target_support", "DslProvider", "dl", "i32", "i64", "f32", "fast_call", "set_fast_call",
           "tvm_ffi_available"]

_cache: dict[Hashable, Any] = {}
_lock = threading.Lock()
_stats = {"compiles": 0, "hits": 0, "disk_hits": 0, "seconds": 0.0}


#: the install that gives a working DSL provider on a CUDA 13 Hopper machine (README "GPU install")
DSL_INSTALL_HINT = "on a CUDA 13 GPU machine: pip install -e '.[cu13]' (README, GPU install)"


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - not installed, or a bundle without dist metadata
        return None


def dsl_cuda_flavor() -> int | None:
    """CUDA major of the CuTe DSL libraries the process loaded (``_cutlass_ir.cu12`` / ``.cu13``:
    with both flavors installed, the DSL picks the newest one the driver supports), or None."""
    import re
    import sys
    m = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
    hit = re.search(r"\.cu(\d+)\.", os.path.basename(getattr(m, "__file__", "") or ""))
    return int(hit.group(1)) if hit else None


@functools.lru_cache(maxsize=None)
def _dsl_mismatch_note() -> str:
    """On a machine with a CUDA device: a warning when the loaded DSL libraries and cuda-bindings are
    built for different CUDA majors (e.g. the default cu12 DSL next to cuda-bindings 13 on a CUDA 13
    machine), else '' (a CPU-only machine only compiles: no warning)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return ""
    except Exception:  # noqa: BLE001
        return ""
    flavor = dsl_cuda_flavor()
    bind = _dist_version("cuda-bindings")
    if flavor is None or not bind or not bind.split(".")[0].isdigit() or int(bind.split(".")[0]) == flavor:
        return ""
    return (f"; warning: CuTe DSL CUDA {flavor} libraries next to cuda-bindings {bind} (CUDA {bind.split('.')[0]}): "
            f"{DSL_INSTALL_HINT}")


@functools.lru_cache(maxsize=None)
def dsl_available() -> Support:
    """Is the CuTe DSL installed and usable (imports, with its CUDA libraries)? The reason says which
    of: not installed, installed but unusable (the import error, e.g. no CUDA flavor compatible with
    the driver, and the install that fixes it), or usable (version, CUDA flavor, and a warning when
    the DSL's CUDA major differs from cuda-bindings')."""
    ver = _dist_version("nvidia-cutlass-dsl")
    try:
        import cutlass
        import cutlass.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001
        if ver is None and isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cutlass":
            return Support.no(f"dsl: nvidia-cutlass-dsl is not installed ({DSL_INSTALL_HINT})")
        return Support.no(f"dsl: nvidia-cutlass-dsl {ver or ''} is installed but unusable ({DSL_INSTALL_HINT}): "
                          f"{type(e).__name__}: {str(e)[:300]}".replace("  ", " "))
    ver = ver or getattr(cutlass, "__version__", "?")
    flavor = dsl_cuda_flavor()
    return Support.yes(f"nvidia-cutlass-dsl {ver}" + (f" (CUDA {flavor} libraries)" if flavor else "")
                       + _dsl_mismatch_note())


@functools.lru_cache(maxsize=None)
def tvm_ffi_available() -> Support:
    """Can kernels be compiled for the TVM-FFI call path (``apache-tvm-ffi`` and the DSL's provider
    for it import)? The reason names the version or the import error."""
    try:
        import tvm_ffi
        import cutlass.cutlass_dsl.tvm_ffi_provider  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or unusable: the DSL's own call path
        return Support.no(f"tvm_ffi: {type(e).__name__}: {str(e)[:200]}")
    return Support.yes(f"apache-tvm-ffi {getattr(tvm_ffi, '__version__', '?')}")


#: None: not decided yet (first use: on when :func:`tvm_ffi_available` and :data:`FAST_CALL_DEFAULT`)
_FAST: bool | None = None
#: the default of :func:`fast_call` where tvm_ffi imports (on: on the H200 it is bit-exact with the DSL's own
#: path and graph-capturable, and the DSL providers' GPU tests pass on it)
FAST_CALL_DEFAULT = True


def fast_call() -> bool:
    """Is the TVM-FFI call path on (kernels compiled with ``--enable-tvm-ffi``, torch tensors passed)?"""
    global _FAST
    if _FAST is None:
        _FAST = FAST_CALL_DEFAULT and bool(tvm_ffi_available())
    return _FAST


def set_fast_call(on: bool | None) -> bool:
    """Switch the call path (None: back to the default); returns the previous mode. Compiled kernels
    are cached per mode, so switching is safe between launches (not while another thread launches)."""
    global _FAST
    prev = fast_call()
    if on and not tvm_ffi_available():
        raise RuntimeError(f"the TVM-FFI call path needs apache-tvm-ffi: {tvm_ffi_available().reason}")
    _FAST = None if on is None else bool(on)
    from dsv4 import registry
    for f in registry._INVALIDATE:        # the eager plans' replays call the kernels of the previous path
        f()
    return prev


def compile_options(arch: str, extra: str = "") -> str:
    """Options string for ``cute.compile``; always names the arch; ``--enable-tvm-ffi`` when
    :func:`fast_call` is on."""
    opt = f"--gpu-arch {arch}"
    if fast_call():
        opt += " --enable-tvm-ffi"
    env = env_str("DSV4_DSL_OPTIONS")
    if env:
        opt += " " + env
    if extra:
        opt += " " + extra
    return opt


def disk_cache_dir() -> Path:
    base = env_str("DSV4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsv4")
    return Path(base) / "dsl"


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for p in sorted(root.rglob("*.py")):          # kernels_dsl/*.py and the shared kernels_dsl/sm90/*.py
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    try:
        from importlib.metadata import version
        h.update(version("nvidia-cutlass-dsl").encode())
    except Exception:  # noqa: BLE001 - the bundle on the GPU machine has no dist metadata
        import cutlass
        h.update(str(getattr(cutlass, "__version__", "?")).encode())
    return h.hexdigest()


def _disk_name(key: Hashable) -> str:
    return "k" + hashlib.sha256((repr(key) + _sources_digest()).encode()).hexdigest()[:24]


def _disk_load(name: str, fast: bool) -> Any | None:
    path = disk_cache_dir() / f"{name}.o"
    if not path.exists():
        return None
    try:
        from cutlass.cute.runtime import load_module
        fn = load_module(str(path), enable_tvm_ffi=True)[name] if fast else load_module(str(path))[name]
        _stats["disk_hits"] += 1
        return fn
    except Exception:  # noqa: BLE001 - a corrupt or stale entry: drop it and recompile
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _disk_store(name: str, compiled: Any, fast: bool) -> None:
    d = disk_cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            if fast:                     # the TVM-FFI export takes the object file's path
                compiled.export_to_c(os.path.join(tmp, f"{name}.o"), name)
            else:
                compiled.export_to_c(tmp, name)
            os.replace(os.path.join(tmp, f"{name}.o"), d / f"{name}.o")
    except Exception:  # noqa: BLE001 - the disk cache is an optimization, never an error
        pass


def _callable(compiled: Any) -> Any:
    """The plain ``tvm_ffi.Function`` behind a TVM-FFI compiled kernel (the DSL's wrapper class adds
    a Python kwargs layer per call), else the compiled kernel itself."""
    get = getattr(compiled, "__tvm_ffi_object__", None)
    fn = get() if get is not None else None
    return fn if fn is not None else compiled


def compile_cached(key: Hashable, build: Callable[[], Any], *, disk: bool = True) -> Any:
    """Return the compiled kernel for ``key``: from memory, else from the on-disk ``.o``
    cache, else ``build()`` (which runs ``cute.compile``) once, then stored in both.
    Kernels are kept per call path (:func:`fast_call`): ``build`` compiles for the current one."""
    fast = _FAST if _FAST is not None else fast_call()
    ck = (key, fast)
    fn = _cache.get(ck)
    if fn is not None:
        _stats["hits"] += 1
        return fn if _launch_hook is None else _launch_hook(fn)
    use_disk = disk and env_flag("DSV4_DSL_DISK_CACHE")
    with _lock:
        fn = _cache.get(ck)
        if fn is None:
            name = _disk_name((key, "tvm-ffi") if fast else key) if use_disk else ""
            fn = _disk_load(name, fast) if use_disk else None
            if fn is None:
                t0 = time.perf_counter()
                compiled = build()
                _stats["seconds"] += time.perf_counter() - t0
                _stats["compiles"] += 1
                if use_disk:
                    _disk_store(name, compiled, fast)
                fn = _callable(compiled) if fast else compiled
            _cache[ck] = fn
    return fn if _launch_hook is None else _launch_hook(fn)


#: set while a plan records a provider's run (dsv4/ops/_trace.py): ``hook(fn) -> fn`` wraps the compiled
#: kernel handed out so that its launches are recorded (None: the kernel itself)
_launch_hook: Callable[[Any], Any] | None = None


def stats() -> dict:
    """Compile counters: number of compiles, cache hits, seconds spent compiling."""
    return dict(_stats, entries=len(_cache))


def current_stream():
    """torch's current stream (current device) for DSL launches: its raw handle (an int) on the
    TVM-FFI path, a ``cuda.CUstream`` on the DSL's own path."""
    import torch
    h = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
    if _FAST or (_FAST is None and fast_call()):
        return h
    import cuda.bindings.driver as cuda
    return cuda.CUstream(h)


def launch_on(device, fn, *args) -> None:
    """Call the compiled kernel ``fn(*args, stream)`` on torch's current stream of ``device``.

    The DSL launches in the current CUDA context, so a tensor on another GPU than the current
    one is launched inside ``torch.cuda.device(device)``."""
    import torch
    cur = torch._C._cuda_getDevice()
    if device.index is None or device.index == cur:
        if _FAST:
            fn(*args, torch._C._cuda_getCurrentRawStream(cur))
        else:
            fn(*args, current_stream())
    else:
        with torch.cuda.device(device):
            fn(*args, current_stream())


def dsl_target_support(target, requirement: str = "compiled for sm_90a only") -> Support | None:
    """``Support.no`` when the tensors are not on a Hopper (sm_90a) GPU, else ``None``."""
    return sm90_support("dsl", target, requirement)


class DslProvider(Sm90Provider):
    """Base of the CuTe DSL providers: available when the DSL imports; supports sm_90a targets,
    then asks :meth:`supports_problem` (override it for shape / format limits)."""

    kind = "dsl"
    #: reason text when the device is not sm_90a
    arch_requirement = "compiled for sm_90a only"

    def available(self) -> Support:
        return dsl_available()

    def supports(self, problem, target) -> Support:
        ok = super().supports(problem, target)
        note = _dsl_mismatch_note() if ok else ""    # a mismatched install is shown on every dsl row it serves
        return Support.yes(ok.reason + note) if note else ok


def compile_variants(label: str, variants: dict, dump_dir: str | None = None, arch: str = "sm_90a",
                     only=None) -> dict[str, str]:
    """CPU compile check of a module's ``{name: build(arch, extra_options)}`` variants for ``arch``:
    ``{name: PTX text}`` (``only``: a subset of names). Raises if a variant yields no PTX text."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = dump_dir or tmp
        os.makedirs(d, exist_ok=True)
        for name, build in variants.items():
            if only is not None and name not in only:
                continue
            fn = build(arch, f"--keep-ptx --dump-dir {d}")
            ptx = fn.__ptx__
            if ptx is None or not ptx.lstrip().startswith(("//", ".version")):
                raise RuntimeError(f"no PTX text for {label} {name} (got {str(ptx)[:200]!r})")
            out[name] = ptx
    return out


def i32(v):
    """A scalar kernel argument of DSL type Int32: a Python int on the TVM-FFI path (the compiled
    function checks and converts it in C; a ``cutlass.Int32`` costs microseconds to build), else
    ``cutlass.Int32(v)``. :func:`i64` / :func:`f32` likewise."""
    if _FAST or (_FAST is None and fast_call()):
        return int(v)
    from cutlass import Int32
    return Int32(v)


def i64(v):
    if _FAST or (_FAST is None and fast_call()):
        return int(v)
    from cutlass import Int64
    return Int64(v)


def f32(v):
    if _FAST or (_FAST is None and fast_call()):
        return float(v)
    from cutlass import Float32
    return Float32(v)


#: torch dtypes of the DSL element types a provider retypes a tensor to (``dl(..., dtype=...)``)
_TORCH_OF = {"Float8E4M3FN": "float8_e4m3fn", "Float8E5M2": "float8_e5m2", "Float8E8M0FNU": "float8_e8m0fnu",
             "Uint32": "uint32", "Int32": "int32", "Uint8": "uint8", "Int8": "int8", "BFloat16": "bfloat16",
             "Float32": "float32", "Int64": "int64", "Uint64": "uint64", "Float16": "float16"}


def dl(t, align: int = 16, dtype=None, layout: str = "dynamic"):
    """A torch tensor as a kernel argument. ``align``: the byte alignment the kernel may assume of
    its base pointer; ``dtype``: a DSL element type to reinterpret the bytes as (same width, e.g.
    ``Float8E4M3FN`` for uint8 E4M3 bytes); ``layout``: what is runtime in the compiled kernel's
    fake tensor: ``"dynamic"`` (shape and strides, unit stride in the last dim), ``"rows"`` (only the
    extent of mode 0, compact), ``"static"`` (nothing).

    TVM-FFI path: the torch tensor itself (retyped with ``Tensor.view``); the compiled function
    checks it against its fake tensor (dtype, rank, extents, alignment, device). DSL path:
    ``from_dlpack`` + marks."""
    if _FAST or (_FAST is None and fast_call()):
        if dtype is not None:
            import torch
            td = getattr(torch, _TORCH_OF[dtype.__name__])
            if t.dtype != td:
                t = t.view(td)
        return t
    from cutlass.cute.runtime import from_dlpack
    if dtype is not None:
        import torch
        x = from_dlpack(t.view(torch.uint8) if t.element_size() == 1 else t, assumed_align=align)
        x.element_type = dtype
    else:
        x = from_dlpack(t, assumed_align=align)
    if layout == "dynamic":
        return x.mark_layout_dynamic(leading_dim=t.dim() - 1)
    if layout == "rows":
        return x.mark_compact_shape_dynamic(mode=0)
    if layout == "static":
        return x
    raise ValueError(f"dl: layout must be 'dynamic', 'rows' or 'static', got {layout!r}")
