"""Per-signature plan cache of the public ops' eager path (issue 17: <= 20 us of host time per call).

A public op function decorated with :func:`planned` keeps, per *signature* of its arguments, a plan
recorded from its second call with that signature (the first runs plain, so one-time set-up is not
recorded): the chosen provider, the problem, where each argument of the provider's ``run`` came
from (an argument of the public call, a field of one, a view of one, or a constant), and how the
result is built from the provider's outputs. A later call with the same signature skips the argument
checks, the spec validation, the op boundary and the provider selection (they passed, or chose,
for exactly these facts) and replays the provider's recorded host trace (:data:`TRACE`,
dsv4/ops/_trace.py: its allocations, views and kernel launches, none of its Python), or calls its
``run`` where the trace cannot be replayed. Model: the guards of ``torch.compile`` / CUDA-graph
trees: a cheap key, checked per call, that covers everything the skipped work depends on.

The signature (the cache key, built from C-level attribute reads) is: the type of every argument
and keyword name; per tensor its shape, strides, dtype, device and ``data_ptr() % 16`` (the spec
checks read nothing else of a tensor: contiguity is the strides, alignments are <= 16 bytes); every
other argument's value (ints, floats, strings, None, dtypes, and the fields of tuples / NamedTuples
/ dataclasses such as ``MoEGrouped`` / ``MoEWeights``, recursively); and the registry state
(the thread's :func:`dsv4.registry.use` stack, ``DSV4_OPS``). It is built by a key function generated
per argument structure (number of positional arguments, keyword names) for the types it was made for:
straight-line attribute reads, no per-argument calls (:func:`_key_function`; an argument of another
type falls back to :func:`_key`). :meth:`dsv4.registry.Op.clear_cache` empties every plan cache.
One tensor passed as two arguments is recorded as the first of them: the plan's hit checks that they
are still one tensor (else the full path).

What is never planned (the call always takes the full path; a negative entry makes that one dict
lookup): a call whose public function reads tensor values on the host (``debug_check=True``, the
value checks of CPU tensors: found during the recording by a torch dispatch mode, which flags ops
with a value-dependent result such as ``item`` / ``nonzero`` / boolean masks, and by watching
``Tensor.__bool__`` / ``tolist`` / ``numpy`` ..., so no op has to declare them), a call that makes
no dispatch or more than one (an early return, a composite such as ``moe_experts``: its inner ops
are planned on their own), a call whose provider arguments include a tensor that is not one of the
caller's or a view of one (built inside the public function), or a result that is not the
provider's outputs re-packed.

The plan path is taken only in plain eager mode, the same test as the eager direct call
(:data:`dsv4.registry.EAGER_DIRECT`, not compiling / exporting, no torch dispatch or function mode,
no functorch transform, the profiler off), outside CUDA-graph capture and without
``DSV4_PRINT_LAYOUTS``; anything else is the full path. Bounded: :data:`MAX_PLANS` per op (LRU).
:data:`ENABLED` = False switches it off (tests, ``bench_eager.py --variants``).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .. import registry
from . import _trace

__all__ = ["ENABLED", "MAX_PLANS", "clear", "plan_of", "planned", "stats"]

#: False: every call takes the full path (the checks, validation, dispatch)
ENABLED = True
#: plans kept per public function (least recently used dropped first)
MAX_PLANS = 256
_HALF = MAX_PLANS // 2
#: True: a plan replays the host trace of its provider's ``run`` recorded on the signature's second call
#: (dsv4/ops/_trace.py: the allocations, views and launches only); False (or a run the trace cannot
#: replay): the plan calls ``run``. Bit-identical to the full path for every graph case of every op on
#: the H200 (tests/test_plan_cache.py's GPU part)
TRACE = True

_Tensor, _Param = torch.Tensor, torch.nn.Parameter
_ATOMS = frozenset((int, float, bool, str, type(None), torch.dtype, torch.device, bytes))
_CACHES: list[OrderedDict] = []
_stats = {"hits": 0, "misses": 0, "planned": 0, "unplanned": 0}
_lock = threading.Lock()


class _Unkeyable(Exception):
    """An argument the key cannot describe (a tensor subclass, an arbitrary object): full path."""


def _k(v: Any) -> Any:
    """The key of one argument (see the module docstring)."""
    tp = type(v)
    if tp is _Tensor or tp is _Param:
        return (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15)
    if tp is int or tp is float or tp is bool:                  # 1 == 1.0 == True: the type is part of it
        return (tp, v)
    if tp in _ATOMS:
        return v
    if isinstance(v, tuple) or tp is list:                      # tuples, NamedTuples (MoEGrouped), lists
        return (tp, tuple(map(_k, v)))
    d = getattr(v, "__dict__", None)
    if d is not None and dataclasses.is_dataclass(tp):          # MoEWeights
        return (tp, tuple(d), tuple(map(_k, d.values())))
    raise _Unkeyable(tp.__name__)


def _key(args: tuple, kwargs: dict, k=_k, tls=registry._tls, getenv=registry._getenv) -> tuple:
    """The signature key of a call (see the module docstring): its arguments and the registry state."""
    return (tuple(map(k, args)), tuple(kwargs), tuple(map(k, kwargs.values())), tls.token, getenv("DSV4_OPS"))


_ENV = getattr(os.environ, "_data", None)
_ENV_GET = _ENV.get if os.name == "posix" and isinstance(_ENV, dict) else None


#: a key function for at least this many tensor arguments checks their facts with TensorGuards (C++, the
#: guards of torch.compile) instead of reading them: about 0.15 us a tensor instead of 0.6
GUARD_MIN_TENSORS = 2
#: distinct tensor-fact sets a key function keeps guards for (newest first; beyond: the oldest is dropped)
MAX_GUARDS = 32
_GUARDS: list = []


def _guards_ok() -> bool:
    """Does ``torch._C._dynamo.guards.TensorGuards`` work here (checked once, on two CPU tensors)?"""
    if not _GUARDS:
        try:
            from torch._C._dynamo.guards import TensorGuards
            a, b = torch.empty(2, 3), torch.empty(3, 2)
            tg = TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [3, 2]], dynamic_dims_strides=[[3, 1], [2, 1]])
            ok = tg.check(a, b) and not tg.check(b, a) and not tg.check(a, a.t())
            _GUARDS.append(TensorGuards if ok else None)
        except Exception:  # noqa: BLE001 - not in this torch: the key reads the facts
            _GUARDS.append(None)
    return _GUARDS[0] is not None


def _new_guard(gl: list, ts: tuple) -> Any:
    """A TensorGuards of ``ts``'s facts, put first in ``gl`` (None: it cannot hold them)."""
    tg = _GUARDS[0](*ts, dynamic_dims_sizes=[list(x.shape) for x in ts],
                    dynamic_dims_strides=[list(x.stride()) for x in ts])
    if not tg.check(*ts):          # (one tensor passed twice: TensorGuards rejects duplicates) the plain key
        return None
    gl.insert(0, tg)
    del gl[MAX_GUARDS:]
    return tg


def _key_function(args: tuple, kwargs: dict) -> Callable[[tuple, dict], tuple]:
    """A key function specialized to the argument structure of this call (the number of positional
    arguments, the keyword names in order) and the types it has: straight-line attribute reads, no
    per-argument calls. Its keys are flat tuples that start with a marker of their own (never equal to
    a key of :func:`_key` or of another structure); an argument of another type than the one it was made
    for falls back to :func:`_key` (a different, equally valid key)."""
    g: dict[str, Any] = {"GENERIC": _key, "K": _k, "TLS": registry._tls, "T": _Tensor, "P": _Param,
                         "SID": object(), "ENV": _ENV_GET, "GETENV": registry._getenv}
    lines, parts = [], ["SID"]
    flat: list[tuple[str, Any]] = []           # (expression, value) of every leaf, containers guarded

    def walk(src: str, v: Any, depth: int) -> None:
        x = f"x{len(lines)}"
        lines.append(f"{x} = {src}")
        tp = type(v)
        d = getattr(v, "__dict__", None)
        if depth and (tp is tuple or tp is list or (isinstance(v, tuple) and hasattr(tp, "_fields"))):
            g[f"TY{x}"] = tp
            lines.append(f"if type({x}) is not TY{x} or len({x}) != {len(v)}:\n        return GENERIC(a, kw)")
            for i, y in enumerate(v):
                walk(f"{x}[{i}]", y, depth - 1)
        elif depth and d is not None and dataclasses.is_dataclass(tp) and all(n.isidentifier() for n in d):
            g[f"TY{x}"] = tp
            lines.append(f"if type({x}) is not TY{x} or len({x}.__dict__) != {len(d)}:\n        return GENERIC(a, kw)")
            for n, y in d.items():
                walk(f"{x}.{n}", y, depth - 1)
        else:
            flat.append((x, v))

    for i, v in enumerate(args):
        walk(f"a[{i}]", v, 3)
    for n, v in kwargs.items():
        walk(f"kw[{n!r}]", v, 3)
    n_t = sum(type(v) is _Tensor or type(v) is _Param for _, v in flat)
    guarded = n_t >= GUARD_MIN_TENSORS and _guards_ok()
    ts = []
    seen: dict[int, str] = {}
    for x, v in flat:
        tp = type(v)
        if (tp is _Tensor or tp is _Param) and id(v) in seen:
            # one tensor in two places (attn_lists hca: swa_block_table is block_table): the key holds while it is
            # (TensorGuards rejects a tensor twice), another call takes the generic key
            lines.append(f"if {x} is not {seen[id(v)]}:\n        return GENERIC(a, kw)")
        elif tp is _Tensor or tp is _Param:
            seen[id(v)] = x
            lines.append(f"if type({x}) is not {'T' if tp is _Tensor else 'P'}:\n        return GENERIC(a, kw)")
            if guarded:
                ts.append(x)
                parts.append(f"{x}.data_ptr() & 15")
            else:
                parts += [f"{x}.shape", f"{x}.stride()", f"{x}.dtype", f"{x}.device", f"{x}.data_ptr() & 15"]
        elif v is None:
            lines.append(f"if {x} is not None:\n        return GENERIC(a, kw)")
        elif tp is torch.dtype:              # (dtypes are singletons: the guard is the key)
            g[f"V{x}"] = v
            lines.append(f"if {x} is not V{x}:\n        return GENERIC(a, kw)")
        elif tp in (int, float, bool, str):
            g[f"TY{x}"] = tp
            lines.append(f"if type({x}) is not TY{x}:\n        return GENERIC(a, kw)")
            parts.append(x)
        else:
            parts.append(f"K({x})")
    parts += ["TLS.token", "ENV(b'DSV4_OPS')" if _ENV_GET is not None else "GETENV('DSV4_OPS')"]
    if guarded:
        # the tensors' shapes, strides, dtypes, devices (dispatch keys, requires_grad) checked in C by one
        # TensorGuards per set of facts seen (newest first); the key holds that guard object
        gl: list = []
        g["GL"], g["NEWG"] = gl, functools.partial(_new_guard, gl)
        lines += [f"ts = ({''.join(x + ', ' for x in ts)})", "for G in GL:", "    if G.check(*ts):", "        break",
                  "else:", "    G = NEWG(ts)", "    if G is None:", "        return GENERIC(a, kw)"]
        parts.insert(1, "G")
    src = "def key(a, kw):\n" + "".join(f"    {ln}\n" for ln in lines) + f"    return ({', '.join(parts)},)\n"
    return _trace.exec_generated(src, g, "key", literals=False)   # (made once per argument structure)


def _plain_eager() -> Callable[[], bool]:
    C = torch._C
    modes, fmode = C._len_torch_dispatch_stack, C._is_torch_function_mode_enabled
    functorch, profiling = C._functorch.peek_interpreter_stack, C._autograd._profiler_enabled
    compiling = torch.compiler.is_compiling
    capturing = getattr(C, "_cuda_isCurrentStreamCapturing", None)
    initialized = torch.cuda.is_initialized
    getenv, tls = registry._getenv, registry._tls
    env = _ENV_GET or (lambda k: getenv(k.decode()))     # (os.environ's bytes dict: no per-call key encoding)

    def plain() -> bool:
        if (compiling() or not registry.EAGER_DIRECT or tls.rec is not None or modes() or fmode()
                or functorch() is not None or profiling() or env(b"DSV4_PRINT_LAYOUTS")):
            return False
        # CUDA-graph capture keeps the full path (asked only once CUDA is initialized: never initializes it;
        # not torch.cuda.is_available(), which reads an environment variable per call)
        return not (capturing is not None and initialized() and capturing())
    return plain


_plain = _plain_eager()
registry._INVALIDATE.append(lambda: clear())


# --------------------------------------------------------------------------------------------
# recording the first call of a signature
class _Recorder:
    """What one full call did: its dispatches, and whether it read tensor values on the host."""

    def __init__(self):
        self.dispatches: list[tuple] = []
        self.read_values = False
        self.in_run = 0
        #: the :class:`~dsv4.ops._trace.Trace` of the provider's run while it runs (its launch hooks read it)
        self.trace = None
        #: the op handles call their kernels directly (under the recording's dispatch mode, as in plain eager)
        self.direct = True

    def dispatched(self, op, provider, choice, problem, args):   # called by Op.dispatch
        if self.in_run:                  # an op the provider calls (indexer_topk_paged -> topk): part of its run
            return provider.run(problem, **args)
        self.in_run += 1
        tr = _trace.Trace(args) if TRACE else None
        try:
            if tr is None:
                out = provider.run(problem, **args)
            else:
                self.trace = tr
                with tr:
                    out = provider.run(problem, **args)
        finally:
            self.in_run -= 1
            self.trace = None
        self.dispatches.append((op, provider, choice, problem, args, out, tr, registry._CONFIG.get(op.name)))
        return out


_READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "cpu")
_watch = {"n": 0, "saved": {}}


def _watch_reads(on: bool) -> None:
    """Patch (on) / restore (off) the Tensor methods that read values on the host: a read made by the
    public function (not by the provider's run) while a recording is active marks it."""
    with _lock:
        if on:
            _watch["n"] += 1
            if _watch["n"] > 1:
                return
            for name in _READS:
                orig = getattr(_Tensor, name)
                _watch["saved"][name] = (orig, _Tensor.__dict__.get(name))

                def w(self, *a, _orig=orig, _name=name, **k):
                    rec = registry._tls.rec
                    if rec is not None:
                        if not rec.in_run:
                            rec.read_values = True
                        elif rec.trace is not None and not rec.trace.why:    # the provider's run: no replay
                            rec.trace.why = f"reads tensor values on the host (Tensor.{_name})"
                    return _orig(self, *a, **k)
                setattr(_Tensor, name, w)
        else:
            _watch["n"] -= 1
            if _watch["n"]:
                return
            for name, (_orig, own) in _watch["saved"].items():
                if own is None:
                    delattr(_Tensor, name)
                else:
                    setattr(_Tensor, name, own)
            _watch["saved"].clear()


def _bases(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """``(expression, tensor)`` of every tensor of a call: an argument (``a[i]`` positional, ``kw[name]``
    keyword) or a field of one (tuples / NamedTuples / dataclasses, one level deep), which the same
    expression finds in another call of the same signature."""
    out: list[tuple[str, torch.Tensor]] = []

    def add(v, expr, depth):
        if isinstance(v, _Tensor):
            out.append((expr, v))
        elif depth and isinstance(v, (tuple, list)):
            for i, x in enumerate(v):
                add(x, f"{expr}[{i}]", depth - 1)
        elif depth and dataclasses.is_dataclass(type(v)) and hasattr(v, "__dict__"):
            for n, x in v.__dict__.items():
                if n.isidentifier():
                    add(x, f"{expr}.{n}", depth - 1)
    for i, v in enumerate(args):
        add(v, f"a[{i}]", 1)
    for n, v in kwargs.items():
        add(v, f"kw[{n!r}]", 1)
    return out


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """``[first, last)`` byte addresses that ``t`` can touch."""
    lo = hi = t.data_ptr()
    es = t.element_size()
    for n, st in zip(t.shape, t.stride()):
        if n == 0:
            return lo, lo
        if st > 0:
            hi += (n - 1) * st * es
        else:
            lo += (n - 1) * st * es
    return lo, hi + es


def _derive(v: torch.Tensor, bases: list[tuple[str, torch.Tensor]], g: dict, args: bool = True) -> str | None:
    """Source that rebuilds ``v`` from one of ``bases`` in a call of the same signature: the base itself,
    or a view of it (``.view(shape)`` of a contiguous re-shape / re-type at the same address, else
    ``as_strided`` at the same element offset). A view is accepted only when exactly one base holds
    ``v``'s bytes (arguments that alias each other would make the choice ambiguous); None otherwise.
    One tensor passed as two arguments (``args``: ``bases`` are the call's) is either of them: the hit then
    checks that they are still one tensor (else the full path)."""
    same = [e for e, b in bases if v is b]
    if same:
        # one tensor passed as two arguments: the plan holds only while they are one tensor (a guard of its hit)
        if args:
            g.setdefault("__guards__", []).extend(f"{same[0]} is not {e}" for e in same[1:])
        return same[0]
    if v.numel() == 0:
        return None
    lo, hi = _extent(v)
    holders = []
    for e, b in bases:
        if b.device == v.device and b.numel():
            blo, bhi = _extent(b)
            if blo <= lo and hi <= bhi:
                holders.append((e, b))
    if len(holders) > 1 and args and all(b is holders[0][1] for _, b in holders):
        g.setdefault("__guards__", []).extend(f"{holders[0][0]} is not {e}" for e, _ in holders[1:])
        holders = holders[:1]
    if len(holders) != 1:
        return None
    e, b = holders[0]
    shape = tuple(v.shape)
    if v.data_ptr() == b.data_ptr() and v.dtype == b.dtype and v.shape == b.shape and v.stride() == b.stride():
        return e             # a view with the base's facts (a same-shape reshape): the base itself, no op
    if (v.data_ptr() == b.data_ptr() and v.is_contiguous() and b.is_contiguous()
            and v.numel() * v.element_size() == b.numel() * b.element_size()):
        if v.dtype != b.dtype:
            g[f"_DT{len(g)}"] = v.dtype
            e = f"{e}.view(_DT{len(g) - 1})"
        return f"{e}.view({shape})"
    if v.dtype == b.dtype and (v.data_ptr() - b.data_ptr()) % v.element_size() == 0:
        off = (v.data_ptr() - b.data_ptr()) // v.element_size()
        return f"{e}.as_strided({shape}, {tuple(v.stride())}, {e}.storage_offset() + {off})"
    return None


def _out_expr(r: Any, outs: list[tuple[str, torch.Tensor]], g: dict) -> str | None:
    """Source of the public function's result ``r`` over the provider's outputs (``outs``: ``o`` or
    ``o[i]``): an output or a view of one, ``None``, a constant, a tuple / NamedTuple of those, or a
    dataclass of those (built without its ``__init__`` / ``__post_init__``: they checked and normalized
    the same fields on the first call); None when it is anything else (a tensor computed by the
    public function)."""
    if r is None:
        return "None"
    if isinstance(r, _Tensor):
        if r.dim() == 0:
            e = _element(r, outs, g)
            if e is not None:
                return e
        return _derive(r, outs, g, args=False)
    if type(r) in _ATOMS:
        g[f"_K{len(g)}"] = r
        return f"_K{len(g) - 1}"
    if isinstance(r, tuple) and (type(r) is tuple or hasattr(type(r), "_fields")):
        if all(type(x) in _ATOMS for x in r):
            g[f"_K{len(g)}"] = r
            return f"_K{len(g) - 1}"
        parts = [_out_expr(x, outs, g) for x in r]
        if None in parts:
            return None
        if type(r) is tuple:
            return "(" + "".join(p + ", " for p in parts) + ")"
        g[f"_R{len(g)}"] = type(r)
        return f"_R{len(g) - 1}(" + ", ".join(parts) + ")"
    d = getattr(r, "__dict__", None)
    if d is not None and dataclasses.is_dataclass(type(r)) and all(n.isidentifier() for n in d):
        parts = [_out_expr(x, outs, g) for x in d.values()]
        if None in parts:
            return None
        g["_NEW"] = _trusted_new
        g[f"_R{len(g)}"] = type(r)
        return f"_NEW(_R{len(g) - 1}, {{" + ", ".join(f"{n!r}: {p}" for n, p in zip(d, parts)) + "})"
    return None


def _element(r: torch.Tensor, outs: list[tuple[str, torch.Tensor]], g: dict) -> str | None:
    """A 0-dim result that is element ``j`` of a small 1-D output (``NVFP4Tensor.global_scale`` /
    ``global_encode_scale``): one ``as_strided`` of that output (element 0: no offset to read; cheaper than
    ``unbind`` on the H200 host: docs/benchmarks.md); None otherwise."""
    for e, b in outs:
        if (b.dim() == 1 and 0 < b.numel() <= 16 and b.stride() == (1,) and b.dtype == r.dtype
                and b.device == r.device):
            d = r.data_ptr() - b.data_ptr()
            if 0 <= d < b.numel() * b.element_size() and d % b.element_size() == 0:
                j = d // b.element_size()
                return f"{e}.as_strided((), ())" if j == 0 else f"{e}.as_strided((), (), {e}.storage_offset() + {j})"
    return None


def _trusted_new(cls: type, fields: dict) -> Any:
    """An instance of the dataclass ``cls`` with ``fields`` (its ``__dict__``), without running its ``__init__``."""
    obj = object.__new__(cls)
    obj.__dict__ = fields
    return obj


def _make_plan(fn: Callable, name: str, args: tuple, kwargs: dict, rec: _Recorder, result: Any) -> Callable | None:
    """The hit path of this signature (``hit(a, kw) -> result``), or None when it cannot be planned."""
    if rec.read_values or len(rec.dispatches) != 1:
        return _why(name, "reads tensor values on the host" if rec.read_values else
                    f"{len(rec.dispatches)} dispatches")
    op, provider, choice, problem, pargs, out, tr, config = rec.dispatches[0]
    bases = _bases(args, kwargs)
    # (plan-level names start with "_": the replay's own code, inlined below, has none)
    g: dict[str, Any] = {"_P": provider, "_PB": problem, "_CH": choice, "_OP": op, "_LAST": registry._LAST,
                         "_CONFIG": registry._CONFIG, "_CFG": config}
    parts, exprs = [], []
    for n, v in pargs.items():
        if isinstance(v, _Tensor):
            e = _derive(v, bases, g)
            if e is None:
                return _why(name, f"run argument {n!r} is a tensor built inside the public function")
        elif type(v) in _ATOMS:
            g[f"_C{len(g)}"] = v
            e = f"_C{len(g) - 1}"
        else:
            return _why(name, f"run argument {n!r} is a {type(v).__name__}")
        parts.append(f"{n}={e}")
        exprs.append(e)
    outs = [("_o", out)] if isinstance(out, _Tensor) else \
        [(f"_o[{i}]", x) for i, x in enumerate(out) if isinstance(x, _Tensor)] if isinstance(out, tuple) else []
    o = _out_expr(result, outs, g)
    if o is None:
        return _why(name, f"the result ({type(result).__name__}) is not the provider's outputs re-packed")
    call = f"_P.run(_PB, {', '.join(parts)})"
    launch = tr.replay(out, functools.partial(_run, provider, problem)) if tr is not None else None
    if launch is not None:
        call = f"_L({', '.join(exprs)})"                 # (its parameters are run's, in order)
    elif tr is not None:
        WHY_NOT_REPLAYED[name] = tr.why
    guards = sorted(set(g.pop("__guards__", [])))
    g["_FULL"] = fn
    guard = f"    if {' or '.join(guards)}:\n        return _FULL(*a, **kw)\n" if guards else ""
    head = f"def hit(a, kw):\n{guard}    _OP.last = _LAST[{op.name!r}] = _CH\n    _CONFIG[{op.name!r}] = _CFG\n"
    src_code = f"{head}    _o = {call}\n    return {o}\n"
    fused = _inline(launch, exprs, g) if launch is not None and INLINE else None
    if fused is not None:                              # the replay's code in the hit itself: one call less
        g, body = fused
        src_code = f"{head}{body}    return {o}\n"
    elif launch is not None:
        g["_L"] = launch.fn()                            # (compiled now: the hit calls it)
    # (generated from the recorded call, names are the run's parameters; compiled once per structure)
    hit = _trace.exec_generated(src_code, g, "hit")
    # run's arguments of a call (bench --lines): compiled when first asked for
    hit.args_of = _trace.Generated(f"def _args_of(a, kw):\n    return ({''.join(e + ', ' for e in exprs)})\n",
                                   g, "_args_of")
    hit.provider, hit.op, hit.launch = provider, op.name, launch
    return hit


#: True: a plan's hit runs its replay's code inline (no call of the replay function)
INLINE = True
_WORDS = re.compile(r"\w+")


def _inline(launch: Callable, exprs: list[str], g: dict) -> tuple[dict, str] | None:
    """``(globals, body)`` of a hit that does ``launch(*exprs)``'s steps itself, ending with ``_o`` = its
    result; None when a name would clash (a run parameter named like a global of either code)."""
    params, lines, ret = launch.parts
    lg = launch.__globals__
    if any(p in lg or p in g or p in ("a", "kw", "_o") or p.startswith("_") for p in params):
        return None
    gg = dict(lg)
    gg.update(g)
    ind = "    "
    code = "\n".join(lines) + "\n" + ret
    names = set(_WORDS.findall(code))
    used = [(p, e) for p, e in zip(params, exprs) if p in names]   # (the others: constants)
    body = f"{ind}({''.join(p + ', ' for p, _ in used)}) = ({''.join(e + ', ' for _, e in used)})\n" if used else ""
    if launch.device is not None:
        fb = ", ".join(f"{p}={e}" for p, e in zip(params, exprs))
        body += (f"{ind}if C._cuda_getDevice() != DEV or C._cuda_getCurrentRawStream(DEV) != STREAM:\n"
                 f"{ind}    _o = FALLBACK({fb})\n{ind}else:\n{ind}    S = STREAM\n")
        ind += "    "
    body += "".join(f"{ind}{ln}\n" for ln in lines) + f"{ind}_o = {ret}\n"
    return gg, body


def _run(provider, problem, **args):
    """The provider's ``run`` (a replay's fallback: another device or stream than the recorded one)."""
    return provider.run(problem, **args)


#: public function -> why its last unplanned signature was not planned (``dsv4 bench eager``, tests)
WHY_NOT: dict[str, str] = {}
#: public function -> why its last plan calls the provider's ``run`` instead of a replay of its trace
WHY_NOT_REPLAYED: dict[str, str] = {}


def _why(name: str, reason: str) -> None:
    WHY_NOT[name] = reason


# --------------------------------------------------------------------------------------------
def planned(fn: Callable) -> Callable:
    """Decorate a public op function with the plan cache (see the module docstring)."""
    cache: OrderedDict = OrderedDict()
    _CACHES.append(cache)
    name = fn.__name__

    keyfns: dict = {}                                    # argument structure -> its key function

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not ENABLED or not _plain():                  # (also inside another op's first call: it records)
            return fn(*args, **kwargs)
        try:
            kf = keyfns.get((len(args), *kwargs) if kwargs else len(args))
            if kf is None:
                kf = keyfns[(len(args), *kwargs) if kwargs else len(args)] = _key_function(args, kwargs)
            key = kf(args, kwargs)
        except _Unkeyable:
            return fn(*args, **kwargs)
        hit = cache.get(key)
        if hit is not None:
            if hit is False:
                return fn(*args, **kwargs)
            if hit is _SEEN:                             # the second call of the signature: recorded
                return _record(fn, name, cache, key, args, kwargs)
            if len(cache) > _HALF:                       # LRU order kept once eviction is near (a tuple
                cache.move_to_end(key)                   # hash is not cached: each costs one more hash)
            _stats["hits"] += 1
            return hit(args, kwargs)
        _stats["misses"] += 1                            # the first: the full path (one-time set-up runs here,
        with _lock:                                      # so the recorded second call is a steady-state one)
            cache[key] = _SEEN
            while len(cache) > MAX_PLANS:
                cache.popitem(last=False)
        return fn(*args, **kwargs)

    call.__wrapped_plan_cache__ = cache
    call.__wrapped_key_functions__ = keyfns
    return call


_SEEN = object()


def _record(fn, name, cache, key, args, kwargs):
    """The second call of a signature: the full call, recorded, then its plan (or a negative entry)
    stored under ``key``."""
    _stats["misses"] += 1
    tls = registry._tls
    rec = _Recorder()
    tls.rec = rec
    _watch_reads(True)
    try:
        with _trace.Watch(rec):
            result = fn(*args, **kwargs)
    finally:
        tls.rec = None
        _watch_reads(False)
    plan = _make_plan(fn, name, args, kwargs, rec, result)
    _stats["planned" if plan is not None else "unplanned"] += 1
    with _lock:
        cache[key] = plan if plan is not None else False
        while len(cache) > MAX_PLANS:
            cache.popitem(last=False)
    return result


def clear() -> None:
    """Forget every plan (called by :meth:`dsv4.registry.Op.clear_cache`)."""
    with _lock:
        for c in _CACHES:
            c.clear()


def stats() -> dict:
    """Hit / miss counters and the number of plans held."""
    return dict(_stats, entries=sum(len(c) for c in _CACHES))


def plan_of(fn: Callable, *args, **kwargs) -> Callable | None | bool:
    """The plan ``fn(*args, **kwargs)`` would use: the hit function (``.source`` shows it), ``False``
    (never planned: full path), or ``None`` (not recorded yet). For tests and debugging."""
    cache = getattr(fn, "__wrapped_plan_cache__", None)
    if cache is None:
        return None
    try:
        return cache.get(key_of(fn, *args, **kwargs))
    except _Unkeyable:
        return False


def key_of(fn: Callable, *args, **kwargs) -> tuple:
    """The cache key ``fn(*args, **kwargs)`` has (its structure's key function; for tests and benchmarks)."""
    kf = fn.__wrapped_key_functions__.get((len(args), *kwargs) if kwargs else len(args))
    return kf(args, kwargs) if kf is not None else _key(args, kwargs)
