"""NVRTC compile + on-disk cubin cache + launch through cuda.core on torch's current stream.

* Sources live next to this file (``kernels_cuda/<op>.cu``) and may ``#include "common.cuh"``.
  They include no CUDA toolkit header (NVRTC's own builtins only), so they compile on CI
  (NVRTC wheel, no toolkit) and on the GPU image (NVRTC 13.0, no bundled headers) alike.
* Specialization is by ``-D`` macros; kernels are ``extern "C"`` (stable names, no mangling).
* Cubins are cached on disk under ``$DSV4_CACHE_DIR`` (default ``~/.cache/dsv4``)/nvrtc, keyed
  by sha256(source + every ``.cuh`` here + options + arch + NVRTC version). Writes are atomic
  (temp file + ``os.replace``); an entry whose checksum does not match is recompiled.
* Compilation needs no GPU (raw ``cuda.bindings.nvrtc``), so CI compiles every ``.cu`` for
  sm_90a and inspects the PTX. Loading and launching need a GPU.
* Scalars must be passed with explicit widths (``np.int32``, ``np.float32``, ``np.int64``):
  cuda.core passes a Python ``int`` as a pointer-sized integer, which is wrong for ``int``
  parameters; :func:`launch` rejects bare Python numbers.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

__all__ = ["CudaModule", "load", "launch", "nvrtc_version", "CompileError", "KERNEL_DIR", "cache_dir"]

KERNEL_DIR = Path(__file__).resolve().parent
_lock = threading.Lock()


class CompileError(RuntimeError):
    """NVRTC rejected a source; the message holds the compiler log."""


def cache_dir() -> Path:
    base = os.environ.get("DSV4_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsv4")
    return Path(base) / "nvrtc"


@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def _check(err: Any, what: str, log: str = "") -> None:
    from cuda.bindings import nvrtc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}\n{log}")


def _headers_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(KERNEL_DIR.glob("*.cuh")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _include_dirs() -> list[str]:
    dirs = [str(KERNEL_DIR)]
    # Optional toolkit headers (not required by our sources; useful for experiments).
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and os.path.isdir(os.path.join(cand, "include")):
            dirs.append(os.path.join(cand, "include"))
            break
    return dirs


def _nvrtc_compile(src: str, name: str, opts: list[str], want: str, with_log: bool = False):
    """``want`` ('ptx' | 'cubin') bytes of ``src`` compiled with ``opts``; with ``with_log``,
    ``(bytes, compile log)``. Raises :class:`CompileError` with the log on failure."""
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        err_l, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_s = log.decode(errors="replace").rstrip("\x00 ")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC failed to compile {name} with {' '.join(opts)}:\n{log_s}")
        if want == "cubin":
            err, size = nvrtc.nvrtcGetCUBINSize(prog)
            _check(err, "nvrtcGetCUBINSize")
            buf = b" " * size
            (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        else:
            err, size = nvrtc.nvrtcGetPTXSize(prog)
            _check(err, "nvrtcGetPTXSize")
            buf = b" " * size
            (err,) = nvrtc.nvrtcGetPTX(prog, buf)
        _check(err, f"nvrtcGet{want}")
        return (bytes(buf), log_s) if with_log else bytes(buf)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


@dataclass
class CudaModule:
    """One ``.cu`` source specialized by macros, compiled for one arch.

    Args:
        source: file name under ``kernels_cuda/`` (e.g. ``"kv_cache.cu"``).
        defines: ``-D`` macros (values are rendered with ``str``).
        arch: e.g. ``"sm_90a"`` (always explicit).
        extra: extra NVRTC options.
    """

    source: str
    defines: tuple[tuple[str, str], ...] = ()
    arch: str = "sm_90a"
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        self._module = None
        self._kernels: dict[str, Any] = {}

    @property
    def path(self) -> Path:
        return KERNEL_DIR / self.source

    def options(self) -> list[str]:
        opts = [f"--gpu-architecture={self.arch}", "-std=c++17", "-lineinfo", "--device-as-default-execution-space"]
        opts += [f"-I{d}" for d in _include_dirs()]
        opts += [f"-D{k}={v}" for k, v in self.defines]
        opts += list(self.extra)
        return opts

    def key(self) -> str:
        h = hashlib.sha256()
        h.update(self.path.read_bytes())
        h.update(_headers_digest().encode())
        # include dirs are machine-specific paths; hash the option *meaning* without them
        h.update(json.dumps([o for o in self.options() if not o.startswith("-I")]).encode())
        h.update(repr(nvrtc_version()).encode())
        return h.hexdigest()[:32]

    def ptx(self) -> str:
        """PTX text (compiled fresh; used by compile checks)."""
        return _nvrtc_compile(self.path.read_text(), self.source, self.options(), "ptx").decode(errors="replace")

    def ptxas_report(self) -> tuple[str, str]:
        """``(ptx, log)`` of one fresh compile with ``--ptxas-options=-v``: the log holds ptxas's
        registers / spill / shared-memory lines per kernel (compile checks, no GPU needed).
        Raises :class:`CompileError` (with the log) when the source does not compile."""
        ptx, log = _nvrtc_compile(self.path.read_text(), self.source, self.options() + ["--ptxas-options=-v"],
                                  "ptx", with_log=True)
        return ptx.decode(errors="replace"), log

    def cubin(self) -> bytes:
        """The cubin, from the disk cache or compiled (then cached atomically)."""
        d = cache_dir()
        k = self.key()
        f, meta = d / f"{k}.cubin", d / f"{k}.json"
        try:
            data = f.read_bytes()
            m = json.loads(meta.read_text())
            if m.get("sha256") == hashlib.sha256(data).hexdigest() and data[:4] == b"\x7fELF":
                return data
        except (OSError, ValueError):
            pass
        data = _nvrtc_compile(self.path.read_text(), self.source, self.options(), "cubin")
        try:
            d.mkdir(parents=True, exist_ok=True)
            _atomic_write(f, data)
            _atomic_write(meta, json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "source": self.source,
                                            "defines": self.defines, "arch": self.arch,
                                            "nvrtc": nvrtc_version()}).encode())
        except OSError:
            pass  # a read-only cache is not an error; we just recompile next time
        return data

    def kernel(self, name: str):
        """A launchable ``cuda.core.Kernel`` (needs a GPU)."""
        k = self._kernels.get(name)
        if k is None:
            with _lock:
                if self._module is None:
                    from cuda.core import ObjectCode
                    _device()
                    self._module = ObjectCode.from_cubin(self.cubin())
                k = self._module.get_kernel(name)
                self._kernels[name] = k
        return k


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@functools.lru_cache(maxsize=None)
def load(source: str, arch: str = "sm_90a", **defines: Any) -> CudaModule:
    """The (cached) :class:`CudaModule` for ``source`` specialized by ``defines``."""
    return CudaModule(source, tuple(sorted((k, str(v)) for k, v in defines.items())), arch)


# ---------------------------------------------------------------------------------------------
# launching
_devices: dict[int, Any] = {}
_streams: dict[int, Any] = {}


def _device():
    import torch
    idx = torch.cuda.current_device()
    dev = _devices.get(idx)
    if dev is None:
        from cuda.core import Device
        torch.cuda.init()
        dev = Device(idx)
        dev.set_current()  # shares torch's primary context
        _devices[idx] = dev
    return dev


class _TorchStream:
    def __init__(self, handle: int):
        self._h = handle

    def __cuda_stream__(self):
        return (0, self._h)


def _raw_stream() -> int:
    """Handle of torch's current stream on the current device (no Python Stream object)."""
    import torch
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _stream():
    h = _raw_stream()
    s = _streams.get(h)
    if s is None:
        s = _device().create_stream(_TorchStream(h))
        _streams[h] = s
    return s


_ALLOWED = (np.integer, np.floating, np.bool_)
try:
    from torch import Tensor as _Tensor
except ImportError:  # pragma: no cover - torch is a dependency
    _Tensor = ()


def set_max_dynamic_smem(kernel: Any, nbytes: int) -> None:
    """Raise a kernel's dynamic shared-memory limit (needed above 48 KiB)."""
    from cuda.bindings import driver
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    h = kernel.handle
    if isinstance(h, driver.CUkernel):
        dev = _device()
        (err,) = driver.cuKernelSetAttribute(attr, nbytes, h, dev.device_id)
    else:
        (err,) = driver.cuFuncSetAttribute(h, attr, nbytes)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cannot set max dynamic shared memory to {nbytes}: {err}")


def launch(kernel: Any, grid: Iterable[int] | int, block: Iterable[int] | int, *args: Any, smem: int = 0,
           cluster: Iterable[int] | int | None = None, pdl: bool = False) -> None:
    """Launch ``kernel`` on torch's current stream.

    ``args``: torch tensors (passed as device pointers), numpy scalars (explicit widths), or
    objects accepted by cuda.core (e.g. a TensorMapDescriptor). Bare Python ints/floats are
    rejected so that every scalar's width is explicit.

    ``cluster``: thread-block cluster shape. NOTE: with a cluster, cuda.core reads ``grid`` as
    the number of *clusters*, not blocks (total blocks = grid * cluster).

    ``pdl``: programmatic dependent launch (the programmatic-stream-serialization attribute): the kernel's
    CTAs may start while the preceding kernel on the stream drains, so the kernel must run
    ``griddepcontrol.wait`` before its first global access. A plan that records this run sees the launch
    through ``_launch_hook`` without the attribute and replays it plainly (same kernel, same result).

    Two direct driver launches were timed against ``cuda.core.launch`` and deleted, neither faster (both
    exact, cluster launches and graph capture included; numbers in docs/benchmarks.md, "Eager host
    overhead"): ``cuLaunchKernel`` through ctypes with struct-packed parameters, and cuda.bindings'
    ``cuLaunchKernel`` / ``cuLaunchKernelEx`` with a parameter block built once per kernel signature and
    one ``struct.pack_into`` per launch.
    """
    if _launch_hook is not None:                         # a plan records this run (dsv4/ops/_trace.py)
        _launch_hook(kernel, grid, block, args, smem, cluster)
    conv = list(args)
    for i, a in enumerate(conv):
        t = type(a)
        if t is _Tensor or isinstance(a, _Tensor):
            conv[i] = a.data_ptr()
        elif t is int or t is float or t is bool:
            raise TypeError(f"kernel argument {i} is a bare Python {t.__name__}; "
                            "pass np.int32/np.int64/np.float32 to make its width explicit")
    _core_launch(_stream(), _config(grid, block, int(smem), cluster, pdl), kernel, *conv)


#: set while a plan records a provider's run (dsv4/ops/_trace.py): called with every launch's arguments
_launch_hook: Any = None


def _core_launch(*a: Any) -> None:
    global _core_launch
    from cuda.core import launch as _launch
    _core_launch = _launch             # bound once: the import is not repeated per call
    _launch(*a)


_configs: dict[tuple, Any] = {}


def _config(grid: Any, block: Any, smem: int, cluster: Any, pdl: bool = False) -> Any:
    """The ``cuda.core.LaunchConfig`` of a launch shape, built once (its constructor validates
    and costs several microseconds; launches repeat the same few shapes)."""
    key = (grid, block, smem, cluster, pdl)
    try:
        cfg = _configs.get(key)
    except TypeError:                                   # a list: unhashable
        key = tuple(tuple(v) if isinstance(v, list) else v for v in key)
        cfg = _configs.get(key)
    if cfg is None:
        from cuda.core import LaunchConfig
        kw = {"grid": grid, "block": block, "shmem_size": smem}
        if cluster is not None:
            kw["cluster"] = cluster
        if pdl:
            kw["programmatic_stream_serialization"] = True
        cfg = LaunchConfig(**kw)
        if len(_configs) < 4096:
            _configs[key] = cfg
    return cfg
