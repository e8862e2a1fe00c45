"""Host-side trace of one provider ``run`` and its replay: the prepared launch of a plan (dsv4/ops/_plan.py).

While a signature's plan is recorded, its provider's ``run`` executes under :class:`Trace`: a torch
dispatch mode records every aten op it makes (allocations, views, fills, copies ...), and the two
launch paths record every kernel launch (``kernels_dsl._compile.compile_cached`` hands out a
recording wrapper of the compiled TVM-FFI function, ``kernels_cuda.nvrtc.launch`` reports its
launches). Every tensor argument is named: an argument of ``run``, the output of an earlier step, or
a tensor the provider holds (a persistent workspace: kept as it is). :meth:`Trace.replay` turns the
steps into straight-line Python that does exactly those ops and launches on the arguments of a later
call of the same signature (same shapes, strides, dtypes, alignment: what the steps' constants
depend on) and returns the same outputs; the provider's Python (heuristics, launch configs, byte
views, argument packing) is not run again. Model: CUDA-graph trees / ``make_fx``, at the host level.

A run is not replayable (the plan calls ``run`` instead) when it reads tensor values on the host (an
op returning a Python scalar, ``item`` / ``tolist`` ...), passes a kernel an argument the trace cannot
name (a device pointer that is not inside a known tensor, a TMA descriptor, the DSL's own call path's
objects), launches on a stream other than torch's current one, or calls a dsv4 op through the
dispatcher. A replay runs only on the device and stream it was recorded on (else ``run``).
"""
from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import registry

__all__ = ["NotReplayable", "Trace", "Watch", "value_dependent"]

_Tensor = torch.Tensor
_CONST_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_PTR_MIN = 1 << 32
#: ops whose output is a fresh allocation (contents unspecified) / a fresh zero-filled one
_ALLOCS = frozenset(("aten.empty.memory_format", "aten.empty_strided.default", "aten.new_empty.default",
                     "aten.new_empty_strided.default", "aten.empty_like.default"))
_ZEROS = frozenset(("aten.zeros.default", "aten.new_zeros.default", "aten.zeros_like.default"))          # an int kernel argument this large is taken for a device pointer: it must be named


class NotReplayable(Exception):
    pass


_DYNAMIC, _DATA = torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output


def value_dependent(func, args, out) -> bool:
    """Does the op's result on the host depend on tensor values: a Python scalar out (``item``, ``equal``,
    ``is_nonzero``), or an output shape set by the data (``nonzero``, boolean-mask indexing, ``unique``)?"""
    tags = func.tags
    if _DATA in tags:
        return True
    if _DYNAMIC in tags:
        if str(func) == "aten.index.Tensor":       # integer index tensors: the shape is theirs, not data
            idx = args[1] if len(args) > 1 else ()
            return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in idx)
        return True
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(o is not None and not isinstance(o, _Tensor) for o in outs)


class Watch(TorchDispatchMode):
    """The dispatch mode of a plan's recording (the whole first call): an op whose host-visible result
    depends on tensor values marks the recording (``rec.read_values``: no plan) when the public function
    makes it, the trace (no replay) when the provider's run does; the run's ops go to its trace."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rec = self.rec
        dyn = value_dependent(func, args, out)
        if not rec.in_run:
            if dyn:
                rec.read_values = True
        elif rec.trace is not None:
            if dyn:
                rec.trace.why = rec.trace.why or f"{func}: a value-dependent result on the host"
            else:
                rec.trace.op(func, args, kwargs, out)
        return out


class Trace:
    """Records one provider run (``with Trace(run_args) as tr: out = run(...)``), then :meth:`replay`."""

    def __init__(self, run_args: dict[str, Any]):
        self.g: dict[str, Any] = {}
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.keep: list[Any] = []
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.why = ""
        self.device = None
        self.stream = None
        self.params = list(run_args)
        for n, v in run_args.items():
            if isinstance(v, _Tensor):
                self._name(v, n)

    # -- naming ------------------------------------------------------------------------------
    def _name(self, t: torch.Tensor, name: str) -> str:
        self.names[id(t)] = name
        self.keep.append(t)
        self.tensors.append((name, t))
        return name

    def _const(self, v: Any) -> str:
        n = f"K{len(self.g)}"
        self.g[n] = v
        self.keep.append(v)
        return n

    def fail(self, why: str) -> None:
        if not self.why:
            self.why = why
        raise NotReplayable(why)

    def expr(self, v: Any, launch: bool = False) -> str:
        """Source of argument ``v`` at replay time (``launch``: a kernel argument, where a large int is a
        device pointer that must be named)."""
        if isinstance(v, _Tensor):
            n = self.names.get(id(v))
            if n is None:
                if type(v) is not _Tensor and type(v) is not torch.nn.Parameter:
                    self.fail(f"a {type(v).__name__} argument")
                n = self._name(v, self._const(v))     # a tensor the provider holds: used as it is
            return n
        tp = type(v)
        if tp is int and launch and abs(v) >= _PTR_MIN:
            return self._pointer(v, None)
        if tp in _CONST_TYPES:
            return repr(v) if tp in (int, bool, type(None)) or (tp is float and math.isfinite(v)) else self._const(v)
        if tp is list or tp is tuple:
            inner = ", ".join(self.expr(x, launch) for x in v)
            return f"[{inner}]" if tp is list else f"({inner}{',' if len(v) == 1 else ''})"
        if tp is torch.Size:
            return repr(tuple(v))
        if isinstance(v, torch.Generator):
            return self._const(v)
        import numpy as np
        if isinstance(v, np.integer):
            if launch and abs(int(v)) >= _PTR_MIN:
                return self._pointer(int(v), type(v))
            return self._const(v)
        if isinstance(v, (np.floating, np.bool_)):
            return self._const(v)
        self.fail(f"an argument of type {tp.__name__}")

    def _pointer(self, p: int, np_type) -> str:
        holders = []
        for n, t in self.tensors:
            if t.device.type != "cpu" and t.numel():
                lo = t.data_ptr()
                hi = lo + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
                if lo <= p < hi:
                    holders.append((n, p - lo))
        if len({n for n, _ in holders}) != 1 and not (holders and all(o == 0 for _, o in holders)):
            self.fail("a device pointer that is not inside exactly one known tensor")
        n, off = holders[0]
        e = f"{n}.data_ptr()" + (f" + {off}" if off else "")
        if np_type is not None:
            e = f"{self._const(np_type)}({e})"
        return e

    # -- steps -------------------------------------------------------------------------------
    def op(self, func, args, kwargs, out) -> None:
        if self.why:
            return
        try:
            if func.namespace == "dsv4":
                self.fail(f"{func} through the dispatcher")
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                if not isinstance(o, _Tensor) and o is not None:
                    self.fail(f"{func} returns a {type(o).__name__} (a value read on the host)")
            call = self._fast(func, args, kwargs, out)
            if call is None:                 # any other op: through its overload (correct, a few us slower)
                a = ", ".join([self.expr(x) for x in args] + [f"{k}={self.expr(v)}" for k, v in kwargs.items()])
                call = f"{self._const(func._op if hasattr(func, '_op') else func)}({a})"
            lhs = []
            for o in outs:
                lhs.append(self._name(o, f"t{len(self.tensors)}") if isinstance(o, _Tensor) else "_")
            if isinstance(out, (tuple, list)):
                self.lines.append(f"({', '.join(lhs)}{',' if len(lhs) == 1 else ''}) = {call}")
            elif isinstance(out, _Tensor):
                self.lines.append(f"{lhs[0]} = {call}")
            else:
                self.lines.append(call)
        except NotReplayable:
            pass

    def _fast(self, func, args, kwargs, out) -> str | None:
        """The op as the torch Python API call that does exactly it (an overload's own call costs 3-4x a
        ``torch.empty``), for the ops providers' host glue makes; None for any other op or argument form."""
        name = str(func)                     # e.g. "aten.empty.memory_format"
        e = self.expr
        n = len(args)
        plain = kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory") \
            and kwargs.get("memory_format") in (None, torch.contiguous_format)
        fac = set(kwargs) <= {"dtype", "layout", "device", "pin_memory", "memory_format"}

        def dd():
            return f"dtype={e(kwargs.get('dtype'))}, device={e(kwargs.get('device'))}"
        fresh = isinstance(out, _Tensor) and not kwargs.get("pin_memory") and out.layout == torch.strided
        if fresh and name in _ALLOCS:
            # a new allocation, whatever op made it: torch.empty_strided with the output's facts (the cheapest
            # allocating call: ~1.8 us against 2.9 for torch.empty on the H200 host, job eager9-01)
            return f"EMPTY_STRIDED({tuple(out.shape)!r}, {out.stride()!r}, dtype={e(out.dtype)}, device={e(out.device)})"
        if fresh and name in _ZEROS and out.is_contiguous():
            return f"ZEROS({tuple(out.shape)!r}, dtype={e(out.dtype)}, device={e(out.device)})"
        if name == "aten.full.default" and n == 2 and fac and plain:
            return f"FULL({e(args[0])}, {e(args[1])}, {dd()})"
        if name in ("aten.detach.default", "aten.alias.default") and n == 1 and not kwargs \
                and isinstance(args[0], _Tensor) and not args[0].requires_grad:
            # a torch dispatch mode sees a detach after every factory call and dtype view (its own autograd
            # bookkeeping: the plain call makes none); without grad the alias is the tensor itself
            return e(args[0])
        if name == "aten._to_copy.default" and n == 1 and set(kwargs) <= {"dtype"} and kwargs:
            return f"{e(args[0])}.to(dtype={e(kwargs['dtype'])})"
        if kwargs:
            return None
        if name in ("aten.view.default", "aten.view.dtype") and n == 2:
            return f"{e(args[0])}.view({e(args[1])})"
        if name == "aten.as_strided.default" and n in (3, 4):
            return f"{e(args[0])}.as_strided({', '.join(e(x) for x in args[1:])})"
        if name == "aten.select.int" and n == 3:
            return f"{e(args[0])}.select({e(args[1])}, {e(args[2])})"
        if name == "aten.slice.Tensor" and n >= 2 and (n < 5 or args[4] == 1) and isinstance(args[0], _Tensor):
            dim = args[1] if n > 1 else 0
            size = args[0].shape[dim]
            start = 0 if n < 3 or args[2] is None else args[2]
            end = size if n < 4 or args[3] is None else args[3]
            start = max(0, min(size, start + size if start < 0 else start))
            end = max(start, min(size, end + size if end < 0 else end))
            return f"{e(args[0])}.narrow({dim}, {start}, {end - start})"
        if name == "aten.expand.default" and n == 2:
            return f"{e(args[0])}.expand({e(args[1])})"
        if name in ("aten.unsqueeze.default", "aten.squeeze.dim", "aten.permute.default",
                    "aten.transpose.int", "aten.t.default", "aten.zero_.default", "aten.fill_.Scalar",
                    "aten.copy_.default", "aten.clone.default", "aten.contiguous.default"):
            meth = name.split(".")[1]
            return f"{e(args[0])}.{meth}({', '.join(e(x) for x in args[1:])})"
        if name in ("aten.mm.default", "aten.bmm.default") and n == 2:
            return f"TORCH.{name.split('.')[1]}({e(args[0])}, {e(args[1])})"
        if name == "aten.lift_fresh.default" and n == 1:
            return e(args[0])
        return None

    def _check_stream(self, dev: int, stream: int) -> None:
        if self.device is None:
            self.device, self.stream = dev, stream
        elif (self.device, self.stream) != (dev, stream):
            self.fail("launches on more than one device / stream")

    def dsl_call(self, fn, args) -> None:
        """A compiled TVM-FFI kernel called with ``args`` (the last one: the stream handle)."""
        if self.why:
            return
        try:
            C = torch._C
            dev = C._cuda_getDevice()
            if not args or type(args[-1]) is not int or args[-1] != C._cuda_getCurrentRawStream(dev):
                self.fail("a DSL launch whose last argument is not the current stream")
            self._check_stream(dev, args[-1])
            a = ", ".join([self.expr(x, True) for x in args[:-1]] + ["S"])
            self.lines.append(f"{self._const(fn)}({a})")
        except NotReplayable:
            pass

    def nvrtc_launch(self, kernel, grid, block, args, smem, cluster) -> None:
        """An NVRTC kernel launched by ``kernels_cuda.nvrtc.launch``."""
        if self.why:
            return
        try:
            from kernels_cuda import nvrtc
            C = torch._C
            dev = C._cuda_getDevice()
            self._check_stream(dev, C._cuda_getCurrentRawStream(dev))
            conv = []
            for x in args:
                if isinstance(x, _Tensor):
                    conv.append(f"{self.expr(x)}.data_ptr()")
                else:
                    conv.append(self.expr(x, True))
            self.g["NV"] = nvrtc
            cfg = self._const(nvrtc._config(grid, block, int(smem), cluster))
            self.lines.append(f"NV._core_launch(NV._streams.get(S) or NV._stream(), {cfg}, {self._const(kernel)}, "
                              f"{', '.join(conv)})")
        except NotReplayable:
            pass

    # -- recording ---------------------------------------------------------------------------
    def __enter__(self):
        _hooks(self, True)
        return self

    def __exit__(self, *exc):
        _hooks(self, False)
        return False

    def replay(self, out: Any, fallback) -> Any:
        """``launch(**run_args) -> out`` doing the recorded steps, or None (``self.why`` says why)."""
        if self.why:
            return None
        try:
            ret = self._out(out)
        except NotReplayable:
            return None
        g = self.g
        g["FALLBACK"], g["C"] = fallback, torch._C
        g.update(EMPTY_STRIDED=torch.empty_strided, ZEROS=torch.zeros, FULL=torch.full, TORCH=torch)
        body = []
        if self.device is not None:
            g["DEV"], g["STREAM"] = self.device, self.stream
            body += ["if C._cuda_getDevice() != DEV:",
                     f"    return FALLBACK({', '.join(f'{p}={p}' for p in self.params)})",
                     "S = C._cuda_getCurrentRawStream(DEV)",
                     "if S != STREAM:",
                     f"    return FALLBACK({', '.join(f'{p}={p}' for p in self.params)})"]
        body += self.lines + [f"return {ret}"]
        src = f"def launch({', '.join(self.params)}):\n" + "".join(f"    {ln}\n" for ln in body)
        exec(src, g)  # noqa: S102 - generated from the recorded steps
        fn = g["launch"]
        fn.source = src
        return fn

    def _out(self, v: Any) -> str:
        if v is None:
            return "None"
        if isinstance(v, _Tensor):
            n = self.names.get(id(v))
            if n is None or n.startswith("K"):
                self.fail("an output the trace did not make")
            return n
        if isinstance(v, tuple) and (type(v) is tuple or hasattr(type(v), "_fields")):
            inner = ", ".join(self._out(x) for x in v)
            if type(v) is tuple:
                return f"({inner}{',' if len(v) == 1 else ''})"
            return f"{self._const(type(v))}({inner})"
        if type(v) in _CONST_TYPES:
            return self.expr(v)
        self.fail(f"an output of type {type(v).__name__}")


_active: list[Trace] = []
_hooks_lock = threading.Lock()


def _dsl_wrap(fn):
    def traced(*args, **kwargs):
        rec = registry._tls.rec
        tr = getattr(rec, "trace", None)
        if tr is not None:
            if kwargs:
                tr.why = tr.why or "a DSL launch with keyword arguments"
            else:
                tr.dsl_call(fn, args)
        return fn(*args, **kwargs)
    return traced


def _nvrtc_hook(kernel, grid, block, args, smem, cluster) -> None:
    rec = registry._tls.rec
    tr = getattr(rec, "trace", None)
    if tr is not None:
        tr.nvrtc_launch(kernel, grid, block, args, smem, cluster)


def _hooks(tr: Trace, on: bool) -> None:
    """Install (first active trace) / remove (last) the launch hooks of both launch paths (the hooks
    record only for the thread whose recording is active)."""
    with _hooks_lock:
        if on:
            _active.append(tr)
        else:
            _active.remove(tr)
        _set_hooks(bool(_active))


def _set_hooks(want: bool) -> None:
    try:
        from kernels_dsl import _compile
        _compile._launch_hook = _dsl_wrap if want else None
    except ImportError:
        pass
    try:
        from kernels_cuda import nvrtc
        nvrtc._launch_hook = _nvrtc_hook if want else None
    except ImportError:
        pass
