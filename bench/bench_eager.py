"""Eager host overhead of every public op at decode sizes: CPU-timer microseconds per call.

What users pay when they call an op outside a CUDA graph: argument checks, spec validation,
registry selection, the ``torch.library`` boundary and the provider's launch glue. Issue 17
target: <= 20 us of host time per call for every op.

Method: the inputs are each op module's graph cases (``graph_cases(device)`` in
``dsv4/ops/<module>.py``: decode-sized static tensors; ``dequant_fp4``'s are built here). One run
of a case records every top-level public op call it makes (arguments included); each recorded
call is then replayed on its own: warm-up (compiles, caches), then per call ``synchronize`` (not
timed), ``perf_counter``, the call, ``perf_counter``; ``host_us`` is the median of such calls (the
minimum over ``--rounds`` separate rounds of it: a burst of host noise does not set it). On CUDA
the call returns once its kernels are queued, so that is host time, launch glue included. On CPU
the torch reference does its math inside the call, so the table also times each call with null
providers (each provider's ``run`` returns the output recorded from a real run instead of running,
and plans call ``run`` instead of replaying a trace): ``lib_us`` is the library's own time (the plan
key and lookup on a repeat signature; else argument checks, spec validation, registry selection,
the op boundary). The target applies to ``host_us`` on CUDA and to ``lib_us`` on CPU. The warm-up
makes every timed call a repeat signature: the default path is the per-signature plan that replays
the provider's recorded host trace (dsv4/ops/_plan.py, dsv4/ops/_trace.py).

    PYTHONPATH=. python bench/bench_eager.py [--json out.json] [--ops topk,kv_gather] [--budget 0.2]
        [--lib-only] [--deadline S] [--first topk,quantize] [--dsl-call tvm-ffi|dsl]
        [--breakdown] [--cprofile N] [--lines] [--rounds 3] [--variants old,direct,plan,replay] [--record] [--bare]
        (or: dsv4 bench eager ...)

``--record`` adds the cost of each call's plan recording (its signature's second call, :func:`time_record`) against
the plain full path; ``--bare`` times a bare torch op before each row (the same-process host-speed baseline: a
loaded host shows in it).

``--lines`` prints each planned call's host time by stage (plain-eager test, key, hit) and by line of its
replayed trace (:func:`line_profile`); ``--breakdown`` adds the per-stage columns of :class:`Stages`; ``--variants`` times each call again
under each named setting of the library's eager switches (:data:`VARIANTS`: ``old`` = every call through
the ``torch.library`` dispatcher, ``direct`` = the eager direct call with every check per call, ``plan`` = the
per-signature plan cache (dsv4/ops/_plan.py), ``replay`` = plans that replay the provider's recorded trace)
in the same process.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

try:
    from bench._util import print_table, save_json
except ImportError:  # run as a script from bench/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench._util import print_table, save_json

TARGET_US = 20.0
#: runs without a GPU too (``dsv4 bench eager`` on CPU measures the library's own share)
CPU_OK = True


@dataclass
class Call:
    label: str          # graph case it came from
    name: str           # public function
    fn: Callable
    args: tuple
    kwargs: dict
    ops: list = field(default_factory=list)   # registered ops it dispatched (with the provider)


def _dequant_fp4_cases(dev):
    m = sys.modules["dsv4.ops.dequant_fp4"]            # looked up per call (record() patches it)
    from dsv4.ops._common import GraphCase
    M, K = 8, 7168
    data = torch.randint(0, 256, (M, K // 2), dtype=torch.uint8).to(dev)
    out = []
    for fmt, sf, sdt in (("mxfp4", 32, torch.float8_e8m0fnu), ("nvfp4", 16, torch.float8_e4m3fn)):
        scale = torch.randint(100, 120, (M, K // sf), dtype=torch.uint8).to(dev).view(sdt)
        g = torch.ones(1, device=dev) if fmt == "nvfp4" else None
        out.append(GraphCase(f"dequant_fp4-{fmt}", "dequant_fp4",
                             lambda scale=scale, g=g, fmt=fmt: m.dequant_fp4(data, scale, fmt=fmt, global_scale=g),
                             lambda: None))
    return out


def collect_cases(dev) -> list:
    import dsv4.ops as ops_pkg
    cases = list(_dequant_fp4_cases(dev))
    for m in sorted(pkgutil.iter_modules(ops_pkg.__path__), key=lambda m: m.name):
        if m.name.startswith("_"):
            continue
        mod = importlib.import_module(f"dsv4.ops.{m.name}")
        if hasattr(mod, "graph_cases"):
            cases += mod.graph_cases(dev)
    return cases


def _public_functions() -> dict[int, tuple[str, Callable]]:
    import dsv4.ops as ops_pkg
    out = {}
    for name in ops_pkg.__all__:
        f = getattr(ops_pkg, name)
        if callable(f) and not isinstance(f, type):
            out[id(f)] = (name, f)
    return out


def record(case) -> list[Call]:
    """The top-level public op calls that ``case.run()`` makes (each module's globals patched)."""
    import dsv4.ops as ops_pkg
    from dsv4 import registry
    pub = _public_functions()
    calls: list[Call] = []
    depth = [0]
    mods = [sys.modules[n] for n in list(sys.modules) if n.startswith("dsv4.ops")]
    patched = []

    def wrap(name, f):
        def w(*a, **k):
            if depth[0] == 0:
                calls.append(Call(case.label, name, f, a, k))
            depth[0] += 1
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
        return w

    wrappers = {i: wrap(n, f) for i, (n, f) in pub.items()}
    for m in mods + [ops_pkg]:
        for k, v in list(vars(m).items()):
            if id(v) in wrappers and v is pub[id(v)][1]:
                patched.append((m, k, v))
                setattr(m, k, wrappers[id(v)])
    orig_dispatch = registry.Op.dispatch

    def dispatch(self, problem, target, **args):
        if calls:
            _p, ch = self.select(problem, target)
            calls[-1].ops.append(f"{self.name}:{ch.kind}")
        return orig_dispatch(self, problem, target, **args)
    registry.Op.dispatch = dispatch
    from dsv4.ops import _plan
    plans, _plan.ENABLED = _plan.ENABLED, False          # every call dispatches: the providers are recorded
    try:
        case.run()
    finally:
        _plan.ENABLED = plans
        registry.Op.dispatch = orig_dispatch
        for m, k, v in patched:
            setattr(m, k, v)
    return calls


class _NullProviders:
    """Inside the block every provider's ``run`` returns the output it gave for the same call
    (recorded on entry) instead of running, the rest of the call path (checks, validation, selection,
    op boundary, or the signature's plan) as usual: what is left of the call's time is the library's own."""

    def __init__(self, c: Call):
        from dsv4 import registry
        self.c, self.outs = c, []
        self.providers = [p for op in registry.all_ops() for p in op._providers.values()
                          if isinstance(p, registry.Provider)]

    def __enter__(self):
        from dsv4.ops import _plan
        self.plan_mod, self.trace = _plan, _plan.TRACE
        _plan.TRACE = False                          # plans call the (null) run, never a replay of the real one
        _plan.clear()
        outs = self.outs
        for p in self.providers:                     # capture: the real run, its output kept
            def capture(problem, _run=p.run, **args):
                r = _run(problem, **args)
                outs.append(r)
                return r
            p.run = capture
        try:
            self.c.fn(*self.c.args, **self.c.kwargs)
        finally:
            self._restore()
        it = [0]

        def replay(problem, **args):
            r = outs[it[0] % len(outs)]
            it[0] += 1
            return r
        if outs:
            for p in self.providers:
                p.run = replay
        return self

    def _restore(self):
        for p in self.providers:
            p.__dict__.pop("run", None)

    def __exit__(self, *exc):
        self._restore()
        self.plan_mod.TRACE = self.trace
        self.plan_mod.clear()


class Stages:
    """Per-stage ``perf_counter_ns`` timers around one call (``--breakdown``): inside the block the
    call path is patched so that every call adds its time to a stage (nested calls, e.g. an op that
    calls another, add to the same stages):

    * ``checks``: the public function's own Python (argument checks, :meth:`OpSpec.validate`, the
      problem's inputs) = total - ``op_call``; on a planned call (``dsv4/ops/_plan.py``: the signature's
      plan skips checks, boundary and select) the key and the plan lookup = total - the provider's
      ``run``; ``validate`` = the part inside ``OpSpec.validate``;
    * ``boundary``: calling the custom op until :meth:`Op.dispatch` (the dispatcher or the eager
      direct call, the problem, ``Target.of``) = ``op_call`` - ``dispatch``;
    * ``select``: :meth:`Op.select`; ``glue``: the provider's ``run`` less ``alloc`` and ``launch``;
    * ``alloc``: ``torch.empty`` / ``zeros`` / ``empty_like`` / ``new_empty`` ... (``n_alloc`` calls);
    * ``launch``: the compiled DSL function's call (TVM-FFI) and the NVRTC launches (``n_launch``).

    Only the outermost occurrence of a stage is timed: what an op's provider does through another op
    (``indexer_topk_paged`` -> ``topk``) counts as the outer op's ``glue``. The patches cost about
    0.3 us each, so the stages add up to a little more than ``host_us``."""

    _ALLOC = ("empty", "zeros", "empty_like", "zeros_like", "full", "ones", "empty_strided", "full_like")

    def __init__(self):
        self.t = dict.fromkeys(("total", "op_call", "dispatch", "select", "run", "validate", "alloc", "launch",
                                "run_direct"), 0)
        self.n = {"alloc": 0, "launch": 0}
        self.depth = dict.fromkeys(self.t, 0)
        self._undo = []

    def _timed(self, stage: str, f: Callable, count: bool = False) -> Callable:
        st, clock, depth = self, time.perf_counter_ns, self.depth

        def w(*a, **k):
            if depth[stage]:                          # a nested occurrence: in the outer one's time
                return f(*a, **k)
            depth[stage] = 1
            t0 = clock()
            try:
                return f(*a, **k)
            finally:
                dt = clock() - t0
                st.t[stage] += dt
                if stage == "run" and not depth["op_call"]:   # a planned call (dsv4/ops/_plan.py): no op boundary
                    st.t["run_direct"] += dt
                depth[stage] = 0
                if count:
                    st.n[stage] += 1
        return w

    def _patch(self, obj, name: str, stage: str, count: bool = False) -> None:
        f = getattr(obj, name)
        self._undo.append((obj, name, f))
        setattr(obj, name, self._timed(stage, f, count))

    def __enter__(self):
        from dsv4 import layout, registry
        self._patch(registry.CustomOp, "__call__", "op_call")
        self._patch(registry.Op, "dispatch", "dispatch")
        self._patch(registry.Op, "select", "select")
        self._patch(layout.OpSpec, "validate", "validate")
        for name in self._ALLOC:
            self._patch(torch, name, "alloc", True)
        for name in ("new_empty", "new_zeros", "new_full"):
            self._patch(torch.Tensor, name, "alloc", True)
        orig_run = {}
        for op in registry.all_ops():                      # each chosen provider's run
            for p in op._providers.values():
                if isinstance(p, registry.Provider) and id(p) not in orig_run:
                    orig_run[id(p)] = p
                    self._undo.append((p, "run", None))
                    p.run = self._timed("run", p.run)
        try:
            from kernels_cuda import nvrtc
            if nvrtc._core_launch.__module__ != __name__:
                self._patch(nvrtc, "_core_launch", "launch", True)
        except ImportError:
            pass
        try:
            from kernels_dsl import _compile
            saved = dict(_compile._cache)
            self._undo.append((_compile, "_cache", saved))
            for k, f in saved.items():
                _compile._cache[k] = self._timed("launch", f, True)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        for obj, name, f in reversed(self._undo):
            if name == "_cache":
                obj._cache.clear()
                obj._cache.update(f)
            elif f is None:
                del obj.__dict__[name]                   # the instance attribute over the class's run
            else:
                setattr(obj, name, f)

    def per_call(self, calls: int) -> dict:
        t = {k: v / calls / 1e3 for k, v in self.t.items()}
        return {"checks_us": t["total"] - t["op_call"] - t["run_direct"], "validate_us": t["validate"],
                "boundary_us": t["op_call"] - t["dispatch"], "select_us": t["select"],
                "glue_us": t["run"] - t["alloc"] - t["launch"], "alloc_us": t["alloc"], "launch_us": t["launch"],
                "n_alloc": self.n["alloc"] / calls, "n_launch": self.n["launch"] / calls, "staged_us": t["total"]}


def breakdown(c: Call, cuda: bool, iters: int = 200) -> dict:
    """:class:`Stages` of ``c`` per call (mean over ``iters`` calls after warm-up)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    with Stages() as st:
        for _ in range(5):
            c.fn(*c.args, **c.kwargs)
        st.t = dict.fromkeys(st.t, 0)
        st.n = dict.fromkeys(st.n, 0)
        clock = time.perf_counter_ns
        for _ in range(iters):
            sync()
            t0 = clock()
            c.fn(*c.args, **c.kwargs)
            st.t["total"] += clock() - t0
    return st.per_call(iters)


def cprofile_call(c: Call, cuda: bool, top: int, iters: int = 300) -> str:
    """``top`` functions by own time (cProfile) over ``iters`` calls of ``c``, per call."""
    import cProfile
    import io
    import pstats
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        c.fn(*c.args, **c.kwargs)
    pr.disable()
    sync()
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"cProfile {c.name} [{c.label}] us/call own (cum) calls/call function"]
    for (fn, ln, name), (cc, nc, tt, ct, _) in rows:
        lines.append(f"  {tt / iters * 1e6:7.2f} ({ct / iters * 1e6:7.2f}) {nc / iters:5.1f}  "
                     f"{os.path.basename(fn)}:{ln}:{name}")
    return "\n".join(lines)


def line_profile(c: Call, cuda: bool, iters: int = 200) -> str:
    """Per-line host time of ``c``'s planned call (``--lines``): the plan-cache wrapper's stages (plain-eager
    test, key, lookup), then each line of its replayed trace (dsv4/ops/_trace.py), medians in us."""
    from dsv4.ops import _plan
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    hit = _plan.plan_of(c.fn, *c.args, **c.kwargs)
    if not callable(hit):
        return f"LINES {c.name} [{c.label}]: no plan ({hit!r}: {_plan.WHY_NOT.get(c.name, '')})"
    clock = time.perf_counter_ns

    def med(f, n=iters):
        ts = []
        for _ in range(n):
            sync()
            t0 = clock()
            f()
            ts.append(clock() - t0)
        return statistics.median(ts) / 1e3
    a, kw = c.args, c.kwargs
    rows = [("plain", med(_plan._plain)), ("key", med(lambda: _plan.key_of(c.fn, *a, **kw))),
            ("hit", med(lambda: hit(a, kw))), ("call", med(lambda: c.fn(*a, **kw)))]
    out = [f"LINES {c.name} [{c.label}] " + "  ".join(f"{k} {v:.2f}" for k, v in rows)]
    L = hit.launch
    if L is None:
        return out[0] + f"  (run: {_plan.WHY_NOT_REPLAYED.get(c.name, '')})"
    units: list[list[str]] = []                  # top-level statements with their indented blocks / else:
    for s in L.source.split("\n")[1:]:
        if not s.strip():
            continue
        if s.startswith(("     ", "    else:", "    elif ")):
            units[-1].append(s)
        else:
            units.append([s])
    units = [u for u in units if not u[0].startswith(("    if C._cuda_getDevice()", "    if S != STREAM"))]
    stmts = [" / ".join(x.strip() for x in u) for u in units]
    src = "def probe(" + L.source.split("(", 1)[1].split(")", 1)[0] + "):\n    _T = [_PC()]\n"
    for u in units:
        if u[0].startswith("    return "):
            src += f"    _R = {u[0][11:]}\n    _T.append(_PC())\n    return _T\n"
        else:
            src += "".join(x + "\n" for x in u) + "    _T.append(_PC())\n"
    g = dict(L.__globals__)
    g["_PC"] = clock
    try:
        exec(src, g)  # noqa: S102 - the replay's own lines, timed
    except SyntaxError as e:                     # (a diagnostic: the probe's lines around the error)
        ls = src.split("\n")
        lo = max(0, (e.lineno or 1) - 4)
        return out[0] + f"  (probe: SyntaxError line {e.lineno}: " + " | ".join(ls[lo:lo + 6])[:600] + ")"
    probe = g["probe"]
    args = hit.args_of(a, kw)
    per = [[] for _ in stmts]
    for _ in range(iters):
        sync()
        T = probe(*args)
        for j in range(len(stmts)):
            per[j].append(T[j + 1] - T[j])
    for s, ts in zip(stmts, per):
        out.append(f"  {statistics.median(ts) / 1e3:6.2f}  {s[:150]}")
    return "\n".join(out)


#: ``--variants`` settings: name -> {flag: value}; flags are set by :func:`apply_flags`
VARIANTS = {
    "old": {"eager_direct": False, "plans": False},   # every op call through the torch.library dispatcher
    "direct": {"eager_direct": True, "plans": False},  # eager direct call, every check per call (eighth session)
    "plan": {"eager_direct": True, "plans": True, "replay": False},   # + the per-signature plan cache
    "replay": {"eager_direct": True, "plans": True, "replay": True},  # + the provider's run replayed from its trace
}


def apply_flags(flags: dict) -> dict:
    """Set the library's eager-path switches (returns the previous values): ``eager_direct``
    (:data:`dsv4.registry.EAGER_DIRECT`), ``plans`` (:data:`dsv4.ops._plan.ENABLED`), ``replay``
    (:data:`dsv4.ops._plan.TRACE`)."""
    from dsv4 import registry
    from dsv4.ops import _plan
    prev = {}
    if "plans" in flags:
        prev["plans"], _plan.ENABLED = _plan.ENABLED, flags["plans"]
    if "replay" in flags:
        prev["replay"], _plan.TRACE = _plan.TRACE, flags["replay"]
    if prev.get("plans") != flags.get("plans") or prev.get("replay") != flags.get("replay"):
        _plan.clear()                                    # plans made under other switches
    if "eager_direct" in flags:
        prev["eager_direct"], registry.EAGER_DIRECT = registry.EAGER_DIRECT, flags["eager_direct"]
    return prev


def time_host(c: Call, cuda: bool, budget_s: float, max_iters: int = 400) -> list[float]:
    """Seconds per call (synchronized before each call, not timed), after a 3-call warm-up."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    sync()
    host = []
    t_end = time.perf_counter() + budget_s
    while len(host) < max_iters and (len(host) < 10 or time.perf_counter() < t_end):
        sync()
        t0 = time.perf_counter()
        c.fn(*c.args, **c.kwargs)
        host.append(time.perf_counter() - t0)
    sync()
    return host


def time_lib(c: Call, iters: int = 200) -> list[float]:
    """Seconds per call with null providers (:class:`_NullProviders`): the library's own share."""
    lib = []
    with _NullProviders(c):
        for _ in range(50):                                      # warm the null path
            c.fn(*c.args, **c.kwargs)
        for _ in range(iters):
            t0 = time.perf_counter()
            c.fn(*c.args, **c.kwargs)
            lib.append(time.perf_counter() - t0)
    return lib


def time_rounds(c: Call, cuda: bool, budget_s: float, max_iters: int, rounds: int) -> tuple[float, list[float]]:
    """``(min over rounds of the round's median, all samples)``: ``rounds`` separate timings of ``budget_s /
    rounds`` each, so that a burst of host noise (another process, a GC) longer than one round does not set
    the result (the minimum of medians, as pyperf-style benchmarks report)."""
    meds, every = [], []
    for _ in range(max(1, rounds)):
        h = time_host(c, cuda, budget_s / max(1, rounds), max_iters)
        meds.append(statistics.median(h))
        every += h
    return min(meds), every


def time_bare(dev: torch.device, cuda: bool, budget_s: float, rounds: int) -> float:
    """Seconds per call of a bare torch op (``buf.zero_()``: one kernel launch on CUDA) timed like the op calls:
    the same-process baseline that shows how fast this host is at the moment (noise shows in it too)."""
    buf = torch.empty(256, device=dev)
    return time_rounds(Call("bare", "zero_", buf.zero_, (), {}), cuda, budget_s, 400, rounds)[0]


def time_record(c: Call, cuda: bool, reps: int = 3) -> dict:
    """The cost of a signature's recording call (its second: dsv4/ops/_plan.py records the plan and the
    provider's host trace, generates the replay code) against the plain full path of the same call:
    ``full_us`` (median, plans off), ``first_us`` (the signature's first call, plans on: the full path and a
    cache entry), ``rec_new_us`` (the recording when the trace's structure is new to the process: its code
    compiled), ``rec_us`` (median of ``reps`` recordings of a structure already compiled: what a new shape of
    a known structure pays, dsv4/ops/_trace.py :func:`exec_generated`)."""
    from dsv4.ops import _plan, _trace
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prev = apply_flags({"plans": False})
    try:
        full = time_rounds(c, cuda, 0.01, 100, 1)[0]
    finally:
        apply_flags(prev)
    firsts, recs = [], []
    clock = time.perf_counter
    for i in range(reps + 1):
        if i == 0:
            _trace._CODE.clear()
        _plan.clear()
        sync()
        t0 = clock()
        c.fn(*c.args, **c.kwargs)
        t1 = clock()
        sync()
        t2 = clock()
        c.fn(*c.args, **c.kwargs)
        t3 = clock()
        sync()
        firsts.append(t1 - t0)
        recs.append(t3 - t2)
    plan = _plan.plan_of(c.fn, *c.args, **c.kwargs)
    kind = ("replay" if plan.launch is not None else "run") if callable(plan) else "full"
    for _ in range(3):                               # (the plan back for what is timed next)
        c.fn(*c.args, **c.kwargs)
    sync()
    return {"full_us": full * 1e6, "first_us": statistics.median(firsts) * 1e6, "rec_new_us": recs[0] * 1e6,
            "rec_us": statistics.median(recs[1:]) * 1e6, "rec_x": statistics.median(recs[1:]) / full,
            "plan": kind}


def time_call(c: Call, cuda: bool, budget_s: float, max_iters: int = 400, lib_only: bool = False,
              variants: tuple[str, ...] = (), rounds: int = 3, rec: bool = False) -> dict:
    med, host = (float("nan"), []) if lib_only else time_rounds(c, cuda, budget_s, max_iters, rounds)
    row = {"case": c.label, "op": c.name, "providers": ",".join(dict.fromkeys(c.ops)) or "-"}
    if rec:
        try:
            row.update(time_record(c, cuda))
        except Exception as e:  # noqa: BLE001 - a diagnostic column: reported, never fatal
            row.update(plan=f"error: {type(e).__name__}: {e}"[:80], rec_us=float("nan"), rec_new_us=float("nan"),
                       full_us=float("nan"), rec_x=float("nan"))
    for v in variants:                                   # same call, the library's switches set per variant
        prev = apply_flags(VARIANTS[v])
        try:
            if not lib_only:
                row[f"{v}_us"] = time_rounds(c, cuda, budget_s, max_iters, rounds)[0] * 1e6
            row[f"{v}_lib_us"] = statistics.median(time_lib(c)) * 1e6
        finally:
            apply_flags(prev)
    lib = time_lib(c)
    host = host or [float("nan")]
    row.update({"host_us": med * 1e6, "p10_us": sorted(host)[len(host) // 10] * 1e6,
                "iters": len(lib), "lib_us": statistics.median(lib) * 1e6})
    row["target_met"] = (row["host_us"] if cuda else row["lib_us"]) <= TARGET_US
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ops", default="", help="comma list of public op names (default: all)")
    ap.add_argument("--budget", type=float, default=0.2, help="seconds of timing per call")
    ap.add_argument("--rounds", type=int, default=3,
                    help="host_us = the minimum over this many timing rounds of each round's median")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds: start no new case after this (0 = none; first compiles can be slow)")
    ap.add_argument("--lib-only", action="store_true",
                    help="time only the library's share (null providers): fast on CPU, where the references compute")
    ap.add_argument("--first", default="", help="comma list of op-module names whose cases run first")
    ap.add_argument("--dsl-call", choices=("default", "tvm-ffi", "dsl"), default="default",
                    help="DSL kernels' call path: TVM-FFI (torch tensors checked in C) or the DSL's own (from_dlpack)")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-stage time of each call (checks, validate, boundary, select, glue, alloc, launch)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the top N functions (cProfile) of each call")
    ap.add_argument("--lines", action="store_true",
                    help="per-line host time of each planned call (key, lookup, each replayed trace line)")
    ap.add_argument("--variants", default="", help=f"comma list of switch settings timed per call: {sorted(VARIANTS)}")
    ap.add_argument("--record", action="store_true",
                    help="time each call's recording call (its signature's second, :func:`time_record`) "
                         "against the plain full path")
    ap.add_argument("--bare", action="store_true",
                    help="time a bare torch op (buf.zero_()) before each row: the same-process host-speed baseline")
    a = ap.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown {v!r}; known {sorted(VARIANTS)}")
    if a.dsl_call != "default":
        from kernels_dsl import _compile
        _compile.set_fast_call(a.dsl_call == "tvm-ffi")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    want = {s for s in a.ops.split(",") if s}
    rows, seen = [], set()
    t_start = time.perf_counter()
    first = [m for m in a.first.split(",") if m]
    cases = sorted(collect_cases(dev), key=lambda c: next((i for i, m in enumerate(first) if c.op.startswith(m)),
                                                          len(first)))
    for case in cases:
        if want and case.op not in want and not any(case.label.startswith(w) for w in want):
            continue                                     # (its warm-up would compile kernels not asked for)
        if a.deadline and time.perf_counter() - t_start > a.deadline:
            rows.append({"case": case.label, "op": case.op, "providers": "not run (deadline)"})
            continue
        try:
            case.run()                                   # warm-up: compiles, caches
            calls = record(case)
        except Exception as e:  # noqa: BLE001 - a case that cannot run here is reported, not fatal
            rows.append({"case": case.label, "op": case.op, "providers": f"error: {type(e).__name__}: {e}"[:120]})
            continue
        for c in calls:
            if (want and c.name not in want) or (c.name, c.label) in seen:
                continue
            seen.add((c.name, c.label))
            bare = time_bare(dev, cuda, a.budget / 2, a.rounds) * 1e6 if a.bare else float("nan")
            rows.append(time_call(c, cuda, a.budget, lib_only=a.lib_only, variants=variants, rounds=a.rounds,
                                  rec=a.record))
            r = rows[-1]
            r["bare_us"] = bare
            if a.breakdown:
                r.update(breakdown(c, cuda))
            print(f"  {r['op']:<22} {r['case']:<38} host {r['host_us']:8.1f} us  lib {r['lib_us']:6.1f} us  "
                  + "".join(f"{v} {r.get(v + '_us', float('nan')):6.1f}/{r[v + '_lib_us']:5.1f} us  " for v in variants)
                  + (f"bare {bare:5.1f} us  " if a.bare else "")
                  + (f"rec {r['rec_us']:8.0f} (new {r['rec_new_us']:8.0f}) / full {r['full_us']:6.1f} us "
                     f"= {r['rec_x']:5.1f}x ({r['plan']})  " if a.record else "")
                  + f"{r['providers']}",
                  file=sys.stderr, flush=True)
            if a.cprofile:
                print(cprofile_call(c, cuda, a.cprofile), flush=True)
            if a.lines:
                try:
                    print(line_profile(c, cuda), flush=True)
                except Exception as e:  # noqa: BLE001 - a diagnostic: reported, never fatal
                    print(f"LINES {c.name} [{c.label}] failed: {type(e).__name__}: {e}", flush=True)
    cols = ["op", "case", "providers", "host_us", "p10_us", "lib_us", "target_met"] + \
        [f"{v}_{k}us" for v in variants for k in ("", "lib_")]
    if a.bare:
        cols.insert(cols.index("lib_us") + 1, "bare_us")
    if a.record:
        cols += ["full_us", "first_us", "rec_new_us", "rec_us", "rec_x", "plan"]
    if a.breakdown:
        cols += ["checks_us", "validate_us", "boundary_us", "select_us", "glue_us", "alloc_us", "n_alloc",
                 "launch_us", "n_launch", "staged_us"]
    try:
        from kernels_dsl import _compile
        call_path = "tvm-ffi" if _compile.fast_call() else "dsl"
    except Exception:  # noqa: BLE001 - no DSL installed
        call_path = "-"
    print_table(rows, cols, title=f"eager host time per call on {dev} (median, CPU timer; target <= {TARGET_US:g} us "
                                  f"{'host' if cuda else 'lib'} time; DSL call path: {call_path})")
    timed = [r for r in rows if "host_us" in r]
    met = sum(bool(r.get("target_met")) for r in timed)
    print(f"{met}/{len(timed)} calls within {TARGET_US:g} us")
    save_json(a.json, {"bench": "eager", "device": str(dev), "target_us": TARGET_US, "dsl_call": call_path, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
