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

The replay makes only the tensor objects the kernels and the result need (each costs about as much
as an allocation on the host, 1.5-2 us): a view (or a view of a view ...) is built at its first use
as an object from its root (an argument, an allocation, another op's output) with one op, or none
when it has the root's facts (a full-extent narrow, a same-shape view); an address (a pointer
argument, an NVRTC argument) needs no object: the root's ``data_ptr()`` + an offset recorded once
(the same in every call of the signature); an allocation used only through one view of all its
bytes is allocated as that view; an allocation nothing uses is dropped; and the kernels' workspaces
(allocations that only launches use) are kept per thread with the views of them
(:data:`PERSISTENT_WORKSPACES`): reusing them on the recorded stream is what the caching
allocator does with a per-call allocation's block.

A run is not replayable (the plan calls ``run`` instead) when it reads tensor values on the host (an
op returning a Python scalar, ``item`` / ``tolist`` ...), passes a kernel an argument the trace cannot
name (a device pointer inside more than one known tensor, a TMA descriptor, the DSL's own call path's
objects), changes a tensor's metadata in place, launches on a stream other than torch's current one,
or calls a dsv4 op through the dispatcher. A replay runs only on the device and stream it was
recorded on (else ``run``). An int kernel argument of 2^32 or more inside no known tensor is a
constant (e.g. 2^63 - 1, "no bound", or the address of a buffer the provider keeps).

Recording cost (what a new signature pays once): the generated code is compiled once per *structure*
(:func:`exec_generated`: its numbers are globals, so a new shape with the same steps only binds them), a
replay that a plan's hit inlines is never compiled on its own (:class:`Generated`), and the dispatch
mode runs without torch's ``_dynamo.disable`` wrapper (:class:`Watch`).
"""
from __future__ import annotations

import math
import re
import threading
import weakref
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
#: op overload -> (its name, a dsv4 op, changes metadata in place): what :meth:`Trace.op` asks of every op
_FUNC_INFO: dict = {}


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
    makes it, the trace (no replay) when the provider's run does; the run's ops go to its trace.

    Its ``__torch_dispatch__`` is not wrapped in ``torch._dynamo.disable`` (TorchDispatchMode's default: the
    first call imports ``torch._dynamo``, about a second, and each op pays the wrapper): a recording runs only
    in plain eager mode (:func:`dsv4.ops._plan._plain_eager`: never while compiling)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

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


_raw = Watch.__dict__["__torch_dispatch__"]
if getattr(_raw, "__wrapped__", None) is not None:      # (a torch that wraps it whatever _should_skip_dynamo says)
    Watch.__torch_dispatch__ = _raw.__wrapped__
del _raw


# --------------------------------------------------------------------------------------------
# generated code: compiled once per structure
#: a generated function's source with its numeric literals (and tuples of them) replaced by globals is the
#: same for every signature of one trace structure (the shapes, strides, offsets differ): compiled once
#: (:func:`exec_generated`), a new shape of that structure only binds its literals. Bounded (cleared when full).
_CODE: dict[str, Any] = {}
CODE_MAX = 2048
#: ``compiled`` / ``reused``: generated functions compiled / taken from :data:`_CODE` (tests, bench)
CODE_STATS = {"compiled": 0, "reused": 0}
_NUM = r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?"
_LITERALS = re.compile(r"""(?=[0-9'"(])(?:('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")"""   # a string: kept
                       rf"|(?<![\w)\].])(\((?:\s*{_NUM}\s*,)+(?:\s*{_NUM}\s*)?\))"   # a tuple of numbers
                       r"|(?<![\w.])(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)(?![\w.]))")          # a number


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)


def exec_generated(src: str, g: dict, name: str, literals: bool = True) -> Any:
    """``exec`` of the generated ``def name(...)`` in ``src`` with globals ``g``; returns the function. Its
    literals become globals ``_lit_<name>_<i>`` of ``g`` (the code is that of every source of the same
    structure: compiled once, see :data:`_CODE`); ``literals=False``: kept as they are (code made once per
    structure anyway, e.g. a key function). ``.source`` is ``src``."""
    vals: list[Any] = []
    pre = f"_lit_{name}_"

    def sub(m):
        if m.group(1) is not None:
            return m.group(1)
        vals.append(tuple(map(_number, filter(None, map(str.strip, m.group(2)[1:-1].split(",")))))
                    if m.group(2) is not None else _number(m.group(3)))
        return f"{pre}{len(vals) - 1}"
    generic = src if not literals or pre in src else _LITERALS.sub(sub, src)
    code = _CODE.get(generic)
    if code is None:
        try:
            code = compile(generic, f"<dsv4 generated {name}>", "exec")
        except SyntaxError:                        # (a literal the rewrite got wrong: the source as it is)
            generic, vals = src, []
            code = compile(src, f"<dsv4 generated {name}>", "exec")
        if len(_CODE) >= CODE_MAX:
            _CODE.clear()
        _CODE[generic] = code
        CODE_STATS["compiled"] += 1
    else:
        CODE_STATS["reused"] += 1
    for i, v in enumerate(vals):
        g[f"{pre}{i}"] = v
    exec(code, g)  # noqa: S102 - generated code (see the callers)
    fn = g[name]
    fn.source = src
    return fn


class Generated:
    """A generated function compiled at its first call (:func:`exec_generated`): a replay whose code a plan's
    hit inlines is never called itself, so never compiled. ``source``, ``__globals__`` (the dict it will run
    with), :meth:`fn` (the function)."""
    __slots__ = ("__globals__", "_fn", "device", "name", "parts", "source")

    def __init__(self, src: str, g: dict, name: str):
        self.source, self.__globals__, self.name, self._fn = src, g, name, None
        self.parts = self.device = None

    def fn(self) -> Any:
        f = self._fn
        if f is None:
            f = self._fn = exec_generated(self.source, self.__globals__, self.name)
        return f

    def __call__(self, *args, **kwargs):
        return self.fn()(*args, **kwargs)


#: replays keep the workspaces of their kernels (allocations only launches use) per thread instead of
#: allocating them per call (:meth:`Trace._workspaces`): up to WORKSPACE_MAX_BYTES per replay, and
#: WORKSPACE_TOTAL_BYTES held by all replays together (beyond: allocated per call, as the run does)
PERSISTENT_WORKSPACES = True
WORKSPACE_MAX_BYTES = 16 << 20
WORKSPACE_TOTAL_BYTES = 256 << 20
_ws_held = [0]


class _Workspaces(dict):
    """thread id -> the kept workspaces of one replay (released with the replay)."""


def _ws_take(cache: _Workspaces, nbytes: int) -> bool:
    """Reserve ``nbytes`` of the total for one more thread's workspaces of ``cache`` (False: over budget)."""
    with _hooks_lock:
        if _ws_held[0] + nbytes > WORKSPACE_TOTAL_BYTES:
            return False
        _ws_held[0] += nbytes
    weakref.finalize(cache, _ws_release, nbytes)
    return True


def _ws_release(nbytes: int) -> None:
    with _hooks_lock:
        _ws_held[0] -= nbytes
_WS_DEVICES = ("cuda",)
#: replays keep the view of an argument that only their launches use while the argument is the same tensor
#: object at the same address (:meth:`Trace._materialize`): one identity test instead of a view op per call
MEMO_INPUT_VIEWS = True
MEMO_MAX_MISSES = 8
_MEMO_NONE = (lambda: None, None, None)


def _memo_make(memo: list, k: int, base: torch.Tensor, view: torch.Tensor) -> tuple:
    """Entry ``k`` of a replay's view memo: ``(weakref to base, base's address, view)``; the entry is dropped
    when ``base`` dies (the view, which keeps its storage alive, must not outlive the caller's tensor; kept
    detached: a view's ``_base`` would keep ``base`` itself alive)."""
    def drop(_, memo=memo, k=k):
        memo[k] = _MEMO_NONE
    return (weakref.ref(base, drop), base.data_ptr(), view.detach())


_REF = re.compile("\x00([TP])(\\d+)(?::(\\d+))?\x00")
#: ops whose output is a view of their first argument (metadata only): recorded lazily, built at their first use
#: as an object from the view's root with the cheapest op (:meth:`Trace._materialize`), or never built when
#: only its address is used
_VIEWS = frozenset(("aten.view.default", "aten.view.dtype", "aten.as_strided.default", "aten.select.int",
                    "aten.slice.Tensor", "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.dim",
                    "aten.squeeze.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
                    "aten.detach.default", "aten.alias.default", "aten.lift_fresh.default", "aten._reshape_alias.default",
                    "aten.unflatten.int", "aten.flatten.using_ints"))
#: in-place ops that change a tensor's metadata (a lazily built view would see the new one): not replayable
_META_MUTATING = frozenset(("resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_",
                            "t_", "swapdims_", "swapaxes_", "detach_", "unsqueeze_copy_"))


class _Info:
    """A tensor of the trace: ``kind`` "arg" (of ``run``), "const" (held by the provider), "alloc" (a fresh
    allocation, storage offset 0), "op" (another op's output) or "view" (of ``src``, by the op ``vtext``)."""
    __slots__ = ("alloc", "built", "kind", "name", "rep", "src", "t", "vtext")

    def __init__(self, t, name, kind, src=None, vtext=None):
        self.t, self.name, self.kind, self.src, self.vtext = t, name, kind, src, vtext
        self.alloc = None            # alloc: (maker, zero-filled) for the allocation's line
        self.rep = None              # alloc: the index of the view allocated in its place (same bytes)
        self.built = kind != "view"  # has an object at this point of the generated code


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr() and a.device == b.device)


class Trace:
    """Records one provider run (``with Trace(run_args) as tr: out = run(...)``), then :meth:`replay`.

    Recorded steps are source lines whose tensors are references (``\\x00T<i>\\x00``: the object,
    ``\\x00P<i>:<off>\\x00``: its address + ``off`` bytes) resolved by :meth:`replay`, which builds an object
    only for a tensor that is used as one (a launch's tensor argument, another op's argument, an output):
    a view of a view of ... is one op on its root (or none: a full-extent narrow, a same-shape view), an
    address needs no object (the root's ``data_ptr()`` + a recorded offset: the same in every call of the
    signature), and an allocation used only through one view of all its bytes is allocated as that view."""

    def __init__(self, run_args: dict[str, Any]):
        self.g: dict[str, Any] = {}
        self.lines: list[tuple[str, Any]] = []
        self.info: list[_Info] = []
        self.ids: dict[int, int] = {}
        self.keep: list[Any] = []
        self.why = ""
        self.device = None
        self.stream = None
        self.params = list(run_args)
        self._ws_roots: set[int] = set()             # (code generation: the kept workspaces, their lines)
        self._ws_lines: list[str] = []
        self._memo_ok: set[int] = set()
        self._memos: list[int] = []
        for n, v in run_args.items():
            if isinstance(v, _Tensor):
                if v.requires_grad:
                    self.why = f"run argument {n!r} requires grad"
                self._name(v, n, "arg")

    # -- naming ------------------------------------------------------------------------------
    def _name(self, t: torch.Tensor, name: str | None, kind: str, src: int | None = None, vtext: str = "") -> int:
        i = len(self.info)
        self.info.append(_Info(t, name or f"t{i}", kind, src, vtext))
        self.ids[id(t)] = i
        self.keep.append(t)
        return i

    def _const(self, v: Any) -> str:
        n = f"K{len(self.g)}"
        self.g[n] = v
        self.keep.append(v)
        return n

    def fail(self, why: str) -> None:
        if not self.why:
            self.why = why
        raise NotReplayable(why)

    def _index(self, v: torch.Tensor) -> int:
        i = self.ids.get(id(v))
        if i is None:
            if type(v) is not _Tensor and type(v) is not torch.nn.Parameter:
                self.fail(f"a {type(v).__name__} argument")
            i = self._name(v, self._const(v), "const")     # a tensor the provider holds: used as it is
        return i

    def expr(self, v: Any, launch: bool = False) -> str:
        """Source of argument ``v`` at replay time (``launch``: a kernel argument, where a large int is a
        device pointer that must be named)."""
        if isinstance(v, _Tensor):
            return f"\x00T{self._index(v)}\x00"
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
        for i, inf in enumerate(self.info):
            t = inf.t
            if t.numel() and t.device.type != "meta":
                lo = t.data_ptr()
                hi = lo + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
                if lo <= p < hi:
                    holders.append((i, p - lo))
        if not holders:          # inside no tensor the run can touch (e.g. 2^63 - 1, "no bound"): a constant
            return repr(p) if np_type is None else f"{self._const(np_type)}({p})"
        if len({self._root(i)[0] for i, _ in holders}) != 1 and not all(o == 0 for _, o in holders):
            self.fail("a device pointer that is not inside exactly one known tensor")
        i, off = holders[0]
        e = f"\x00P{i}:{off}\x00"
        if np_type is not None:
            e = f"{self._const(np_type)}({e})"
        return e

    # -- steps -------------------------------------------------------------------------------
    def op(self, func, args, kwargs, out) -> None:
        if self.why:
            return
        try:
            info = _FUNC_INFO.get(func)
            if info is None:
                base = func.__name__.split(".")[0] if hasattr(func, "__name__") else ""
                info = _FUNC_INFO[func] = (str(func), func.namespace == "dsv4", base in _META_MUTATING)
            name, dsv4_op, meta_mutating = info
            if dsv4_op:
                self.fail(f"{func} through the dispatcher")
            if meta_mutating:
                self.fail(f"{func} changes a tensor's metadata in place")
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                if not isinstance(o, _Tensor) and o is not None:
                    self.fail(f"{func} returns a {type(o).__name__} (a value read on the host)")
            call = self._fast(func, args, kwargs, out, name)
            if call is None:                 # any other op: through its overload (correct, a few us slower)
                a = ", ".join([self.expr(x) for x in args] + [f"{k}={self.expr(v)}" for k, v in kwargs.items()])
                call = f"{self._const(func._op if hasattr(func, '_op') else func)}({a})"
            if (name in _VIEWS and isinstance(out, _Tensor) and args and isinstance(args[0], _Tensor)
                    and type(out) is _Tensor and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
                    and out.device == args[0].device):
                self._name(out, None, "view", self._index(args[0]), call)
                return
            lhs = [self._name(o, None, "op") if isinstance(o, _Tensor) else None for o in outs]
            if isinstance(out, _Tensor) and call.startswith(("EMPTY_STRIDED(", "ZEROS(")):
                self.info[lhs[0]].kind = "alloc"
                self.info[lhs[0]].alloc = call.startswith("ZEROS(")
                self.lines.append(("alloc", lhs[0]))
            else:
                self.lines.append(("op", (lhs, isinstance(out, (tuple, list)), call)))
        except NotReplayable:
            pass

    def _fast(self, func, args, kwargs, out, name: str) -> str | None:
        """The op as the torch Python API call that does exactly it (an overload's own call costs 3-4x a
        ``torch.empty``), for the ops providers' host glue makes; None for any other op or argument form.
        ``name``: ``str(func)``, e.g. "aten.empty.memory_format"."""
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
            # allocating call on the H200 host: docs/benchmarks.md's eager sections)
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
            self.lines.append(("launch", f"{self._const(fn)}({a})"))
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
                    conv.append(f"\x00P{self._index(x)}:0\x00")      # its address: no object needed
                else:
                    conv.append(self.expr(x, True))
            self.g["NV"] = nvrtc
            cfg = self._const(nvrtc._config(grid, block, int(smem), cluster))
            call = (f"NV._core_launch(NV._streams.get(S) or NV._stream(), {cfg}, {self._const(kernel)}, "
                    f"{', '.join(conv)})")
            self.lines.append(("launch", call))
        except NotReplayable:
            pass

    # -- recording ---------------------------------------------------------------------------
    def __enter__(self):
        _hooks(self, True)
        return self

    def __exit__(self, *exc):
        _hooks(self, False)
        return False

    # -- code generation ---------------------------------------------------------------------
    def _root(self, i: int) -> tuple[int, int]:
        """``(index, byte offset)`` of the root tensor that tensor ``i`` is a view of (an allocation made
        as one of its views: that view) and where ``i``'s data starts in it."""
        r = i
        while self.info[r].kind == "view":
            r = self.info[r].src
        rep = self.info[r].rep
        if rep is not None:
            r = rep
        return r, self.info[i].t.data_ptr() - self.info[r].t.data_ptr()

    def _materialize(self, i: int, out: list[str]) -> str:
        """The name of tensor ``i`` as an object at this point of the code (lines building it go to ``out``):
        the root itself when ``i`` has its facts, else one ``as_strided`` of the root (or of one dtype view
        of it), checked on the recorded tensors; else the recorded op on its built source."""
        inf = self.info[i]
        if inf.built:
            return inf.name
        t = inf.t
        if not t.numel():
            # a view with no elements (a part of one buffer that is empty at this size): its ``data_ptr()`` is 0,
            # it has no bytes in its root -- a fresh empty tensor of its facts is the same to every reader
            out.append(f"{inf.name} = EMPTY_STRIDED({tuple(t.shape)!r}, {t.stride()!r}, dtype={self._const(t.dtype)}, "
                       f"device={self._const(t.device)})")
            inf.built = True
            return inf.name
        r, off = self._root(i)
        if r in self._ws_roots and out is not self._ws_lines:   # a view of a workspace: made with it, once
            return self._materialize(i, self._ws_lines)
        rt, t = self.info[r].t, inf.t
        rn = self._materialize(r, out)
        fresh = self.info[r].kind == "alloc"          # a fresh allocation: storage offset 0 in every call
        pre, code = [], None
        if _same(t, rt):
            code = rn
        else:
            base, bt = rn, rt
            if t.dtype != rt.dtype:
                try:
                    bt = rt.view(t.dtype)
                except RuntimeError:
                    bt = None
                if bt is not None and _same(bt, t):
                    code = f"{rn}.view({self._const(t.dtype)})"
                elif bt is not None:
                    base = f"{inf.name}_"
                    pre.append(f"{base} = {rn}.view({self._const(t.dtype)})")
            es = t.element_size()
            if code is None and bt is not None and off % es == 0:
                k = off // es
                cand = bt.as_strided(tuple(t.shape), t.stride(), bt.storage_offset() + k)
                if _same(cand, t):
                    so = "" if k == 0 else f", {k}" if fresh else f", {base}.storage_offset() + {k}"
                    code = f"{base}.as_strided({tuple(t.shape)!r}, {t.stride()!r}{so})"
                else:
                    pre = []
        if code is None:                          # the recorded op on its (built) source
            if not inf.vtext:
                self.fail("a view the replay cannot rebuild")
            pre, code = [], self._sub(inf.vtext, out)
        if code == rn:
            inf.name = rn
        elif MEMO_INPUT_VIEWS and self.info[r].kind == "arg" and i in self._memo_ok:
            # a view of an argument that only launches use: the same one while the argument is the same tensor
            # at the same address (a KV cache, a weight, a static buffer); dropped with the argument
            k = len(self._memos)
            self._memos.append(i)
            # (an argument that is a new tensor every call stops being kept after MEMO_MAX_MISSES misses in a row)
            out += [f"_e = MEMO[{k}]", f"if _e[0]() is {rn} and {rn}.data_ptr() == _e[1]:", f"    {inf.name} = _e[2]",
                    f"    MISS[{k}] = 0", "else:"] + [f"    {ln}" for ln in pre] + [
                    f"    {inf.name} = {code}", f"    if MISS[{k}] < {MEMO_MAX_MISSES}:", f"        MISS[{k}] += 1",
                    f"        MEMO[{k}] = MEMO_MAKE(MEMO, {k}, {rn}, {inf.name})"]
        else:
            out += pre
            out.append(f"{inf.name} = {code}")
        inf.built = True
        return inf.name

    def _sub(self, text: str, out: list[str]) -> str:
        def ref(m):
            i = int(m.group(2))
            if m.group(1) == "T":
                return self._materialize(i, out)
            if not self.info[i].t.numel():          # (no elements: data_ptr() is 0, as the run passed it)
                return "0"
            r, off = self._root(i)
            off += int(m.group(3))
            return f"{self._materialize(r, out)}.data_ptr()" + (f" + {off}" if off else "")
        return _REF.sub(ref, text)

    def _plan_allocs(self, ret: str) -> set[int]:
        """An allocation never used as an object whose bytes are exactly those of one view used as one:
        allocated as that view (one op instead of two). Returns the allocations nothing uses (dropped)."""
        texts = [x if kind == "launch" else x[2] for kind, x in self.lines if kind != "alloc"] + [ret]
        refs = [(m.group(1), int(m.group(2))) for s in texts for m in _REF.finditer(s)]
        used = {i for k, i in refs if k == "T"}
        live = set()
        for _, i in refs:                        # every tensor referenced, and what it is a view of
            while i not in live:
                live.add(i)
                if self.info[i].kind != "view":
                    break
                i = self.info[i].src
        dead = {a for kind, a in self.lines if kind == "alloc" and a not in live}
        for kind, a in self.lines:
            if kind != "alloc" or a in used or a in dead:
                continue
            at = self.info[a].t
            for v in sorted(used):
                inf = self.info[v]
                if inf.kind != "view":
                    continue
                r = v
                while self.info[r].kind == "view":
                    r = self.info[r].src
                t = inf.t
                if (r == a and t.data_ptr() == at.data_ptr() and t.is_contiguous() and at.is_contiguous()
                        and t.numel() * t.element_size() == at.numel() * at.element_size() and t.numel()):
                    self.info[a].rep = v
                    self.info[a].built = False        # (built from the view, should anything need it)
                    inf.kind, inf.built, inf.alloc = "alloc", True, self.info[a].alloc
                    break
        return dead

    def _workspaces(self, ret: str, dead: set[int]) -> list[int]:
        """The allocations that are workspaces of the run's kernels: CUDA, not zero-filled, used by kernel
        launches only (no torch op, not the result, directly or through a view), at most
        :data:`WORKSPACE_MAX_BYTES` together. The replay keeps them (one set per thread) instead of allocating
        them per call: a launch on the same stream is ordered after the previous call's launches, as is the
        caching allocator's reuse of the block a per-call allocation would get."""
        if not PERSISTENT_WORKSPACES or self.device is None:
            return []
        seen = set()
        for kind, x in self.lines:
            if kind == "op":
                seen |= {self._root(int(m.group(2)))[0] for m in _REF.finditer(x[2])}
        seen |= {self._root(int(m.group(2)))[0] for m in _REF.finditer(ret)}
        out, total = [], 0
        for kind, a in self.lines:
            if kind != "alloc" or a in dead or self.info[a].alloc:
                continue
            j = self.info[a].rep if self.info[a].rep is not None else a
            t = self.info[j].t
            nbytes = t.numel() * t.element_size()
            if j in seen or a in seen or t.device.type not in _WS_DEVICES or total + nbytes > WORKSPACE_MAX_BYTES:
                continue
            out.append(a)
            total += nbytes
        return out

    def _alloc_line(self, a: int) -> tuple[int, str]:
        inf = self.info[a]
        j = inf.rep if inf.rep is not None else a
        t = self.info[j].t
        dt, dev = self._const(t.dtype), self._const(t.device)
        if inf.alloc:
            return j, f"ZEROS({tuple(t.shape)!r}, dtype={dt}, device={dev})"
        return j, f"EMPTY_STRIDED({tuple(t.shape)!r}, {t.stride()!r}, dtype={dt}, device={dev})"

    def replay(self, out: Any, fallback) -> Any:
        """``launch(**run_args) -> out`` doing the recorded steps, or None (``self.why`` says why)."""
        if self.why:
            return None
        try:
            ret = self._out(out)
            dead = self._plan_allocs(ret)
            ws = self._workspaces(ret, dead)
            lines: list[str] = []
            op_refs = {int(m.group(2)) for kind, x in self.lines if kind == "op" for m in _REF.finditer(x[2])}
            op_refs |= {int(m.group(2)) for m in _REF.finditer(ret)}
            self._memo_ok = {int(m.group(2)) for kind, x in self.lines if kind == "launch"
                             for m in _REF.finditer(x) if m.group(1) == "T"} - op_refs
            self._memos = []
            self._ws_roots = {self.info[a].rep if self.info[a].rep is not None else a for a in ws}
            self._ws_lines = []
            for a in ws:
                j, code = self._alloc_line(a)
                self._ws_lines.append(f"{self.info[j].name} = {code}")
            for kind, x in self.lines:
                if kind == "alloc":
                    if x in dead or x in ws:     # (used by nothing: no effect / kept by the replay)
                        continue
                    j, code = self._alloc_line(x)
                    lines.append(f"{self.info[j].name} = {code}")
                elif kind == "launch":
                    code = self._sub(x, lines)
                    lines.append(code)
                else:
                    lhs, multi, call = x
                    code = self._sub(call, lines)
                    names = [self.info[i].name if i is not None else "_" for i in lhs]
                    if multi:
                        lines.append(f"({', '.join(names)}{',' if len(names) == 1 else ''}) = {code}")
                    elif lhs[0] is not None:
                        lines.append(f"{names[0]} = {code}")
                    else:
                        lines.append(code)
            ret = self._sub(ret, lines)
            if ws:          # the workspaces and the views of them, made once per thread
                names = "".join(n + ", " for n in dict.fromkeys(ln.split(" = ", 1)[0] for ln in self._ws_lines))
                nbytes = sum(self.info[self.info[a].rep if self.info[a].rep is not None else a].t.nbytes for a in ws)
                self.g["WS"], self.g["TID"], self.g["TAKE"] = _Workspaces(), threading.get_ident, _ws_take
                mk = ("def MAKE_WS(tid):\n" + "".join(f"    {ln}\n" for ln in self._ws_lines)
                      + f"    W = ({names})\n    if TAKE(WS, {nbytes}):\n        WS[tid] = W\n    return W\n")
                exec_generated(mk, self.g, "MAKE_WS")       # the workspaces' allocations, once per thread
                lines[:0] = ["W = WS.get(TID())", "if W is None:", "    W = MAKE_WS(TID())", f"({names}) = W"]
        except NotReplayable:
            return None
        except Exception as e:  # noqa: BLE001 - a code generation bug must not fail the call: run() instead
            self.why = f"replay code generation failed: {type(e).__name__}: {e}"
            return None
        g = self.g
        g["FALLBACK"], g["C"] = fallback, torch._C
        if self._memos:
            g["MEMO"], g["MEMO_MAKE"], g["MISS"] = [_MEMO_NONE] * len(self._memos), _memo_make, [0] * len(self._memos)
        g.update(EMPTY_STRIDED=torch.empty_strided, ZEROS=torch.zeros, FULL=torch.full, TORCH=torch)
        body = []
        if self.device is not None:
            g["DEV"], g["STREAM"] = self.device, self.stream
            body += ["if C._cuda_getDevice() != DEV:",
                     f"    return FALLBACK({', '.join(f'{p}={p}' for p in self.params)})",
                     "S = C._cuda_getCurrentRawStream(DEV)",
                     "if S != STREAM:",
                     f"    return FALLBACK({', '.join(f'{p}={p}' for p in self.params)})"]
        body += lines + [f"return {ret}"]
        src = f"def launch({', '.join(self.params)}):\n" + "".join(f"    {ln}\n" for ln in body)
        fn = Generated(src, g, "launch")                 # (compiled at its first call: a plan inlines it)
        fn.parts, fn.device = (list(self.params), lines, ret), self.device    # (for a plan's inlined hit)
        return fn

    def _out(self, v: Any) -> str:
        if v is None:
            return "None"
        if isinstance(v, _Tensor):
            i = self.ids.get(id(v))
            if i is None or self.info[i].kind == "const":
                self.fail("an output the trace did not make")
            return f"\x00T{i}\x00"
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
