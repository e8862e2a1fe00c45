"""Op registry: one spec per op, an ordered list of lazily imported providers.

Model: Dao-AILab/quack ``quack/backends/`` (a provider protocol, a lazy registry, a
``Support`` answer that always carries a reason).

Providers are found by convention, so adding a provider is adding one file:

=========  ==============================  ===================================
kind       module                          what it is
=========  ==============================  ===================================
``dsl``    ``kernels_dsl.<module>``         CuTe DSL kernel
``cuda``   ``kernels_cuda.<module>``        raw CUDA C++ (.cu) compiled by NVRTC
``torch``  ``dsv4.reference.<module>``      plain-torch reference (the oracle)
=========  ==============================  ===================================

Each such module has a dict ``PROVIDERS = {op_name: ProviderClass}``. ``<module>`` is the
op's ``module`` (defaults to the op name). Selection = the first provider, in the op's kind
order, that is available and ``supports`` the problem on the target. Overrides:

* environment ``DSV4_OPS="op=kind,op2=kind"`` (``*=torch`` applies to every op);
* ``with registry.use(op="cuda"):`` for tests.

A forced provider that cannot run raises :class:`ProviderUnavailableError`; there is never a
silent fallback. Every dispatch records which provider ran and why (``last_choice``), which
``dsv4 ops`` prints; a name in either override that is not a registered op raises.

The eager hot path (bench/bench_eager.py, ``--breakdown`` times each stage) is: the op's argument
checks and its :meth:`~dsv4.layout.OpSpec.validate` (a generated checker), the op's handle
(:class:`CustomOp`: in plain eager mode a direct call of the op's Python kernel, else the
``torch.library`` dispatcher), then :meth:`Op.select` (two dict lookups: the choice is cached per
target, forced kind and problem) and the provider's ``run``. A problem is a frozen dataclass
(:class:`Problem`; a plain dict works too). In front of all that, each public op keeps a plan per
signature of its arguments (``dsv4/ops/_plan.py``): a repeat call skips the checks, the boundary and
the selection, and calls the recorded provider's ``run`` (or replays its recorded host trace,
``dsv4/ops/_trace.py``). :func:`use`, ``DSV4_OPS`` and :meth:`Op.clear_cache` invalidate plans.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping

from .config import env_flag
from .target import Target

__all__ = [
    "Support", "Problem", "Provider", "TorchProvider", "Op", "Choice", "ProviderUnavailableError", "register", "get_op",
    "all_ops", "use", "KINDS", "last_choice", "custom_op", "CustomOp", "sm90_support", "Sm90Provider",
]

KINDS = ("dsl", "cuda", "torch")
_MODULE_OF_KIND = {"dsl": "kernels_dsl.{}", "cuda": "kernels_cuda.{}", "torch": "dsv4.reference.{}"}


class ProviderUnavailableError(RuntimeError):
    """A provider was asked for (override or context manager) but cannot run this problem."""


@dataclass(frozen=True)
class Support:
    """Answer of ``available()`` / ``supports()``: ``ok`` plus a human reason (always set for 'no')."""

    ok: bool
    reason: str = ""
    #: True for "this op has no implementation of that kind" (no module / no entry in its
    #: ``PROVIDERS``): not a failure, the table says "not implemented" instead of a reason
    absent: bool = False

    @classmethod
    def yes(cls, reason: str = "supported") -> "Support":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str, *, absent: bool = False) -> "Support":
        if not reason:
            raise ValueError("Support.no() needs a reason")
        return cls(False, reason, absent)

    def __bool__(self) -> bool:
        return self.ok


class Problem:
    """Base of an op's problem: a frozen dataclass of the facts that select a provider and its
    config (formats, block sizes, a few shape classes; never tensors). Frozen means hashable: the
    problem itself is the registry's selection-cache key. Providers read fields as attributes or,
    like a mapping, ``problem["fmt"]`` / ``problem.get("fmt")`` / ``dict(problem, stage=1)`` (tests
    may hand a provider a plain dict; both work everywhere)."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def keys(self) -> list[str]:
        import dataclasses
        return [f.name for f in dataclasses.fields(self)]

    @classmethod
    def _key_getter(cls) -> Callable[[Any], tuple]:
        """``problem -> tuple of its field values`` (C-level ``attrgetter``): the selection-cache key,
        hashed and compared without the dataclass's Python ``__hash__`` / ``__eq__``."""
        g = cls.__dict__.get("_getter")
        if g is None:
            import dataclasses
            import operator
            names = [f.name for f in dataclasses.fields(cls)]
            g = operator.attrgetter(*names) if len(names) > 1 else (lambda o, n=names[0]: (getattr(o, n),))
            cls._getter = g
        return g


class Provider:
    """Base class of an op implementation.

    Subclasses set ``kind`` and implement ``supports`` and ``run``; ``available`` defaults to
    "importable" (the module already imported). ``run(problem, **args)`` gets the problem
    built by the op (a :class:`Problem`) and the validated tensors, and returns the op's outputs;
    ``config(problem, target)`` names the tunables it uses (a frozen dataclass from the kernel's
    heuristic), for ``explain()``.
    """

    kind: str = "?"
    #: one line for ``dsv4 ops``: what this implementation is
    describe: str = ""

    def __init__(self, op: "Op"):
        self.op = op

    def available(self) -> Support:
        return Support.yes("importable")

    def supports(self, problem: Mapping[str, Any], target: Target) -> Support:  # pragma: no cover
        raise NotImplementedError

    def run(self, problem: Mapping[str, Any], **args: Any) -> Any:  # pragma: no cover
        raise NotImplementedError

    def config(self, problem: Mapping[str, Any], target: Target) -> Any:
        """The tunables ``run`` uses for ``problem`` on ``target``: a frozen dataclass chosen by the
        kernel's heuristic (``None``: no tunables). Not called on the hot path: :func:`last_choice`
        and ``dsv4 ops --verbose`` ask for it when they explain a choice."""
        return None


def sm90_support(kind: str, target: Target, requirement: str) -> Support | None:
    """``Support.no`` (reason prefixed by ``kind``) when ``target`` is not a Hopper (sm_90a) GPU,
    else ``None``: the arch gate of the compiled providers (``kernels_dsl`` / ``kernels_cuda``)."""
    if not target.is_cuda:
        return Support.no(f"{kind}: the target is not a CUDA device (CPU tensors or no GPU)")
    if target.arch != "sm_90a":
        return Support.no(f"{kind}: {requirement}, device is {target.arch}")
    return None


class Sm90Provider(Provider):
    """Base of the compiled providers (``kernels_cuda.CudaProvider``, ``kernels_dsl.DslProvider``):
    supports sm_90a targets (:func:`sm90_support`, ``arch_requirement`` says why not), then asks
    :meth:`supports_problem` (override it for shape / format limits)."""

    #: reason text when the device is not sm_90a
    arch_requirement = "built for sm_90a only"

    def supports(self, problem: Mapping[str, Any], target: Target) -> Support:
        no = sm90_support(self.kind, target, self.arch_requirement)   # (a Support.no is falsy: no `or`)
        return no if no is not None else self.supports_problem(problem)

    def supports_problem(self, problem: Mapping[str, Any]) -> Support:
        return Support.yes("sm_90a")


class TorchProvider(Provider):
    """Base of the plain-torch references (kind ``torch``): they run any problem on any device."""

    kind = "torch"
    #: the reason ``supports`` gives
    support_reason = "reference, any device"

    def supports(self, problem: Mapping[str, Any], target: Target) -> Support:
        return Support.yes(self.support_reason)


@dataclass
class Choice:
    """What dispatch picked for one problem: the kind, the reason, and why others were skipped.

    ``skipped``: ``(kind, reason)`` of every provider tried before ``kind``, in preference order
    (``absent`` names those that do not exist for this op). ``config``: the tunables of the chosen
    provider (a frozen dataclass chosen by its heuristic, or None), filled in by :func:`last_choice`
    and :meth:`Op.table`. ``problem`` / ``target``: what the choice was made for.
    """

    kind: str
    reason: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    forced: bool = False
    absent: tuple[str, ...] = ()
    config: Any = None
    problem: Any = field(default=None, repr=False, compare=False)
    target: Any = field(default=None, repr=False, compare=False)

    def summary(self) -> str:
        """One plain line: which provider ran and why, then why the preferred ones did not
        (the ``dsv4 run`` reason column), e.g. ``"cuda: sm_90a, k <= 2048; no dsl kernel for this
        op"`` or ``"torch: reference, any device; cuda not used: no CUDA device"``."""
        s = f"{self.kind}{' (forced by DSV4_OPS / registry.use)' if self.forced else ''}: " \
            f"{_strip_kind(self.kind, self.reason)}"
        for k, r in self.skipped:
            s += f"; no {k} kernel for this op" if k in self.absent else f"; {k} not used: {_strip_kind(k, r)}"
        return s

    def explain(self) -> str:
        """Every provider considered and why, the choice, and the tunables of the last call."""
        parts = [f"{k}: {'not implemented (' + r + ')' if k in self.absent else _strip_kind(k, r)}"
                 for k, r in self.skipped]
        parts.append(f"using {self.kind}" + (" (forced)" if self.forced else "") + f": "
                     f"{_strip_kind(self.kind, self.reason)}")
        if self.config is not None:
            parts.append(f"config: {self.config}")
        return "; ".join(parts)


def _strip_kind(kind: str, reason: str) -> str:
    """``"cuda: no CUDA device"`` -> ``"no CUDA device"`` (providers prefix their reasons)."""
    return reason[len(kind) + 2:] if reason.startswith(f"{kind}: ") else reason


class Op:
    """A registered op: name, layout spec, provider lookup and dispatch.

    Args:
        name: op name (also the ``torch.library`` name ``dsv4::<name>``).
        spec: the op's :class:`dsv4.layout.OpSpec`.
        module: module basename under ``kernels_dsl`` / ``kernels_cuda`` / ``dsv4.reference``
            (default: ``name``).
        kinds: provider kinds in preference order.
        example_problem: ``f(target) -> problem`` (the op's :class:`Problem`) used by ``dsv4 ops`` to
            show what would run.

    A provider's ``supports`` depends on the problem and the target only (the choice is cached on
    them); what changes it otherwise calls :meth:`clear_cache`. Likewise for what a provider's ``run``
    does for one signature of its arguments when plans replay it (``dsv4/ops/_plan.py`` ``TRACE``):
    a module switch changed at run time calls :meth:`clear_cache`.
    """

    def __init__(self, name: str, spec: Any, *, module: str | None = None,
                 kinds: tuple[str, ...] = KINDS,
                 example_problem: Callable[[Target], Any] | None = None):
        self.name = name
        self.spec = spec
        self.module = module or name
        self.kinds = kinds
        self.example_problem = example_problem
        self._providers: dict[str, Provider | Support] = {}
        #: id(target) -> (target, {(forced kind, problem key): (provider, choice)}): the lookup select uses
        self._by_target: dict[int, tuple[Target, dict]] = {}
        self.last: Choice | None = None
        self._lock = threading.Lock()

    # -- providers -------------------------------------------------------------------------
    def provider(self, kind: str) -> Provider | Support:
        """The provider of ``kind``, imported lazily, or a ``Support.no`` saying why there is none."""
        if kind not in self._providers:
            mod_name = _MODULE_OF_KIND[kind].format(self.module)
            try:
                mod = importlib.import_module(mod_name)
            except ModuleNotFoundError as e:
                if e.name == mod_name:
                    res: Provider | Support = Support.no(f"no {kind} provider ({mod_name} does not exist)",
                                                         absent=True)
                else:
                    res = Support.no(f"{mod_name} cannot be imported: {e}")
            except Exception as e:  # noqa: BLE001 - report any import failure as a reason
                res = Support.no(f"{mod_name} failed to import: {type(e).__name__}: {e}")
            else:
                cls = getattr(mod, "PROVIDERS", {}).get(self.name)
                res = cls(self) if cls is not None else Support.no(
                    f"{mod_name} has no provider for {self.name}", absent=True)
            self._providers[kind] = res
        return self._providers[kind]

    def check(self, kind: str, problem: Mapping[str, Any], target: Target) -> Support:
        p = self.provider(kind)
        if isinstance(p, Support):
            return p
        a = p.available()
        if not a:
            return a
        return p.supports(problem, target)

    # -- selection ---------------------------------------------------------------------------
    def select(self, problem: Mapping[str, Any], target: Target) -> tuple[Provider, Choice]:
        """The provider for ``problem`` on ``target`` and the :class:`Choice` that names it.

        Decided once per (forced kind, target, problem) and cached: a repeat
        call costs one dict lookup (the eager hot path, bench/bench_eager.py)."""
        forced = _forced_kind(self.name)
        tp = type(problem)
        if tp is dict:
            pk = tuple(problem.items())
        elif issubclass(tp, Problem):
            g = tp.__dict__.get("_getter")
            pk = (tp, (g or tp._key_getter())(problem))
        else:
            pk = problem
        # per target (looked up by identity: Target.of returns one object per device, and hashing a
        # Target costs a Python __hash__ call), then per (forced kind, problem)
        per = self._by_target.get(id(target))           # (the entry keeps its target alive: ids are unique)
        if per is None:
            with self._lock:
                if len(self._by_target) >= 64:          # Targets built per call by a caller: do not grow
                    self._by_target.clear()
                per = self._by_target.setdefault(id(target), (target, {}))
        cache = per[1]
        key = (forced, pk)
        try:
            hit = cache.get(key)
        except TypeError:                    # a list / dict value, or a Mapping that is not a dict
            key = (forced, _freeze(problem))
            hit = cache.get(key)
        if hit is None:
            choice = self._choose(problem, target, forced)
            choice.problem, choice.target = problem, target
            p = self.provider(choice.kind)
            assert isinstance(p, Provider)
            hit = (p, choice)
            with self._lock:
                cache[key] = hit
        self.last = _LAST[self.name] = hit[1]
        return hit

    def _choose(self, problem, target, forced) -> Choice:
        if forced is not None:
            if forced not in self.kinds:
                raise ProviderUnavailableError(
                    f"{self.name}: provider {forced!r} requested, but this op's providers are {self.kinds}")
            s = self.check(forced, problem, target)
            if not s:
                raise ProviderUnavailableError(
                    f"{self.name}: provider {forced!r} was requested (DSV4_OPS or registry.use) but "
                    f"cannot run this problem on {target}: {s.reason}")
            return Choice(forced, s.reason, [], forced=True)
        skipped, absent = [], []
        for kind in self.kinds:
            s = self.check(kind, problem, target)
            if s:
                return Choice(kind, s.reason, skipped, absent=tuple(absent))
            skipped.append((kind, s.reason))
            if s.absent:
                absent.append(kind)
        raise ProviderUnavailableError(
            f"{self.name}: no provider can run this problem on {target}: "
            + "; ".join(f"{k}: {r}" for k, r in skipped))

    def dispatch(self, problem: Mapping[str, Any], target: Target, **args: Any) -> Any:
        """Select a provider for ``problem`` on ``target`` and run it."""
        p, choice = self.select(problem, target)
        if _getenv("DSV4_PRINT_LAYOUTS") and env_flag("DSV4_PRINT_LAYOUTS") and self.spec is not None:
            from .layout import print_boundary
            print_boundary(self.spec, choice, args)
        _CONFIG[self.name] = None
        rec = _tls.rec
        if rec is not None:                   # the first call of a signature (dsv4/ops/_plan.py) records it
            return rec.dispatched(self, p, choice, problem, args)
        return p.run(problem, **args)

    def record_config(self, config: Any) -> None:
        """Called by a provider's ``run`` with the tunables it chose for this call (a frozen
        dataclass from its heuristic) when they depend on more than the problem (else the
        provider's :meth:`Provider.config` says it): :func:`last_choice` shows them."""
        _CONFIG[self.name] = config

    def config_of(self, choice: Choice) -> Any:
        """The chosen provider's :meth:`Provider.config` for the choice's problem and target (None
        when it has none; a failure is returned as its text: explaining never raises)."""
        p = self.provider(choice.kind)
        if isinstance(p, Support) or choice.problem is None:
            return None
        try:
            return p.config(choice.problem, choice.target)
        except Exception as e:  # noqa: BLE001
            return f"(config not available: {type(e).__name__}: {e})"

    def clear_cache(self) -> None:
        """Forget the cached choices (after a change of what a provider's ``supports`` depends on
        other than the problem, e.g. ``kernels_cuda.moe_decode.override``)."""
        with self._lock:
            self._by_target.clear()
        for f in _INVALIDATE:                 # the public ops' plans (dsv4/ops/_plan.py) hold choices too
            f()

    def table(self, target: Target) -> list[dict]:
        """Rows for ``dsv4 ops``: each provider, whether it can run the example problem, and why
        (``implemented`` False: this op has no provider of that kind). The chosen row's
        ``explain`` is :meth:`Choice.explain` of the example problem."""
        problem = self.example_problem(target) if self.example_problem else {}
        rows = []
        ch = None
        try:
            ch = self.select(problem, target)[1] if problem else None
        except ProviderUnavailableError:
            pass
        for kind in self.kinds:
            s = self.check(kind, problem, target) if problem else Support.no("no example problem")
            chosen = ch is not None and ch.kind == kind
            rows.append({"op": self.name, "provider": kind, "ok": s.ok, "implemented": not s.absent,
                         "reason": s.reason, "chosen": chosen,
                         "explain": replace(ch, config=self.config_of(ch)).explain() if chosen else ""})
        return rows


def _env_reader():
    """``get(name) -> str | None`` for ``os.environ`` without its per-call key encoding: on POSIX
    ``os.environ`` keeps the process environment in a bytes dict (``_data``) that every
    assignment through ``os.environ`` updates; elsewhere (or if that ever changes) plain
    ``os.environ.get``. About 0.1 us instead of 1 us: dispatch reads two variables per call."""
    data = getattr(os.environ, "_data", None)
    if os.name != "posix" or not isinstance(data, dict):
        return os.environ.get
    enc = os.environ.encodekey if hasattr(os.environ, "encodekey") else (lambda k: k.encode())
    keys: dict[str, bytes] = {}

    def get(name: str) -> str | None:
        k = keys.get(name)
        if k is None:
            k = keys[name] = enc(name)
        v = data.get(k)
        return None if v is None else os.fsdecode(v)
    return get


_getenv = _env_reader()

_REGISTRY: dict[str, Op] = {}
_LAST: dict[str, Choice] = {}
_CONFIG: dict[str, Any] = {}


class _Overrides(threading.local):
    """Per thread: the stack of :func:`use` mappings (innermost last). ``threading.local`` runs
    ``__init__`` on a thread's first access, so dispatch reads ``_tls.stack`` without the exception a
    missing attribute costs (``getattr(local, name, None)``: about 1 us)."""

    def __init__(self):
        self.stack: list[dict[str, str]] = []
        #: identifies this thread's current stack: 0 = empty, else a number unique to one :func:`use`
        #: block (part of the plan-cache key, dsv4/ops/_plan.py)
        self.token = 0
        #: the recorder of a public op's first call of a signature (dsv4/ops/_plan.py), else None
        self.rec = None


_tls = _Overrides()
_TOKENS = itertools.count(1)
#: called by :meth:`Op.clear_cache` (the plan caches of dsv4/ops/_plan.py register here)
_INVALIDATE: list[Callable[[], None]] = []


# ---------------------------------------------------------------------------------------------
# the torch.library boundary
_LIBS: dict[str, Any] = {}


#: the eager fast path of :meth:`CustomOp.__call__` (False: every call goes through the dispatcher;
#: bench/bench_eager.py ``--variants`` and tests/test_registry.py compare the two)
EAGER_DIRECT = True


def _eager_probe():
    """``plain(args, tensor_pos) -> bool``: True when a call with ``args`` may skip the ``torch.library``
    dispatcher and run the op's Python kernel directly, because the dispatcher would do exactly that:
    not inside ``torch.compile`` / export tracing (checked by the caller), no torch dispatch mode
    (FakeTensorMode, FunctionalTensorMode, make_fx ...), no torch function mode (``with
    torch.device(...)``), no functorch transform (vmap, grad), the profiler off (it records the op by
    name), every tensor argument (``args[i]`` for ``i`` in ``tensor_pos``, the schema's Tensor / Tensor?
    / Tensor[] parameters) a plain ``torch.Tensor`` or ``nn.Parameter``, and the first one not on the
    meta device (a FakeTensor or another subclass, or meta tensors, take the dispatcher to its fake
    kernel; an op's spec validation puts every tensor on the first one's device)."""
    import torch
    C = torch._C
    dispatch_modes = C._len_torch_dispatch_stack
    function_mode = C._is_torch_function_mode_enabled
    functorch = C._functorch.peek_interpreter_stack
    profiling = C._autograd._profiler_enabled
    plain = frozenset((torch.Tensor, torch.nn.Parameter))
    Tensor = torch.Tensor

    def ok(args: tuple, tensor_pos: tuple[int, ...]) -> bool:
        if dispatch_modes() or function_mode() or functorch() is not None or profiling():
            return False
        first = None
        for i in tensor_pos:
            a = args[i]
            if a is None:
                continue
            if type(a) not in plain:
                if type(a) is not list and type(a) is not tuple:
                    return False
                for x in a:
                    if isinstance(x, Tensor) and (type(x) not in plain or x.is_meta):
                        return False
            elif first is None:
                first = a
                if a.is_meta:
                    return False
        return True
    return ok


#: schema types whose arguments the eager probe checks (str() of ``torch._C.Argument.type``)
_TENSOR_TYPES = ("Tensor", "Optional[Tensor", "List[Tensor", "Optional[List[Tensor")
_plain_eager: Callable[[tuple, tuple], bool] = lambda args, pos: False     # set by the first custom_op()
_is_compiling: Callable[[], bool] = lambda: True


class CustomOp:
    """Handle of an op defined by :func:`custom_op`: ``register_fake(fn)`` (decorator) and call.

    Calling the handle is calling ``torch.ops.<ns>.<name>``, with an eager fast path: in plain
    eager mode (:func:`_eager_probe`) it calls the op's Python kernel directly, which is what the
    dispatcher would run, without the dispatcher's argument round trip (about 6 us on the CI
    machine). Under torch.compile, export, FakeTensor / functional tracing, vmap or the profiler it
    is the dispatcher call, so the op stays one node in a graph and its fake kernel is used."""

    def __init__(self, qualname: str, fn: Callable):
        self.qualname, self._fn = qualname, fn
        ns, name = qualname.split("::")
        self._packet = getattr(getattr(__import__("torch").ops, ns), name)
        params = self._packet.default._schema.arguments
        #: positions of the Tensor / Tensor? / Tensor[] parameters, and the parameter count: a call
        #: with every argument positional takes the eager fast path
        self._tensor_pos = tuple(i for i, a in enumerate(params) if str(a.type).startswith(_TENSOR_TYPES))
        self._nargs = len(params)

    def register_fake(self, fn: Callable) -> Callable:
        import torch
        torch.library.register_fake(self.qualname, fn, lib=_LIBS[self.qualname.split("::")[0]])
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (a plan's recording runs the call under a dispatch mode: the op runs inside it, as in plain eager)
        if (EAGER_DIRECT and not kwargs and len(args) == self._nargs and not _is_compiling()
                and (_plain_eager(args, self._tensor_pos) or getattr(_tls.rec, "direct", False))):
            return self._fn(*args)
        return self._packet(*args, **kwargs)


def custom_op(qualname: str, fn: Callable | None = None, *, mutates_args: tuple[str, ...] | str) -> Any:
    """Define ``torch.ops.<ns>.<name>`` from a type-annotated Python function, like
    ``torch.library.custom_op`` (same schema inference, same ``mutates_args``, a
    ``.register_fake`` for torch.compile / FakeTensor tracing), at a fraction of its eager cost.

    ``torch.library.custom_op`` runs three Python layers per call (autograd wrapper, redispatch,
    dynamo-disable wrapper: about 10 us on a 2-core CI machine); this registers ``fn`` directly
    as the op's CPU and CUDA kernel with ``torch.library.Library.impl``, so an eager call is the
    C++ dispatcher plus ``fn`` (about 2 us). The ops are inference ops: no autograd formula (a
    backward through one warns, as for any op without an Autograd kernel), and mutated
    arguments are declared in the schema (``Tensor(a!)``) for functionalization, but their
    version counters are not bumped.
    """
    import torch
    global _plain_eager, _is_compiling
    if _plain_eager.__name__ == "<lambda>":
        _plain_eager, _is_compiling = _eager_probe(), torch.compiler.is_compiling

    def define(f: Callable) -> CustomOp:
        ns, name = qualname.split("::")
        lib = _LIBS.get(ns)
        if lib is None:
            lib = _LIBS[ns] = torch.library.Library(ns, "FRAGMENT")
        schema = torch.library.infer_schema(f, mutates_args=mutates_args)
        lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, f, key)
        return CustomOp(qualname, f)

    return define(fn) if fn is not None else define


def register(op: Op) -> Op:
    """Add an op to the registry (idempotent by name)."""
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> Op:
    import dsv4.ops  # noqa: F401  (imports register every op)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def all_ops() -> list[Op]:
    import dsv4.ops  # noqa: F401
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def last_choice(op: str) -> Choice | None:
    """Which provider the last dispatch of ``op`` used, why, and (``config``) its tunables (the ones
    recorded by that call, else the provider's :meth:`Provider.config` of the problem); ``None``
    before the first dispatch. ``.explain()`` says it all."""
    ch = _LAST.get(op)
    if ch is None:
        return None
    cfg = _CONFIG.get(op)
    if cfg is None:
        cfg = _REGISTRY[op].config_of(ch)
    return ch if cfg is None else replace(ch, config=cfg)


def _check_names(names: Any, what: str) -> None:
    """Raise ``ValueError`` listing the known ops when a name is neither ``*`` nor a registered op."""
    unknown = [k for k in names if k != "*" and k not in _REGISTRY]
    if unknown:
        import dsv4.ops  # noqa: F401  (registers every op)
        unknown = [k for k in unknown if k not in _REGISTRY]
    if unknown:
        raise ValueError(f"{what}: unknown op {unknown[0]!r}; known: {sorted(_REGISTRY)} (or '*' for every op)")


def _parse_env(s: str, current: str | None = None) -> dict[str, str]:
    """``DSV4_OPS`` -> ``{op: kind}``; an op name that is neither registered nor ``current`` (the op
    being dispatched) raises, so a misspelled name is never silently ignored."""
    out = {}
    for item in filter(None, (x.strip() for x in s.split(","))):
        if "=" not in item:
            raise ValueError(f"DSV4_OPS: expected 'op=provider' items, got {item!r}")
        k, v = (x.strip() for x in item.split("=", 1))
        if v not in KINDS:
            raise ValueError(f"DSV4_OPS: provider for {k!r} must be one of {KINDS}, got {v!r}")
        if k != current:
            _check_names((k,), "DSV4_OPS")
        out[k] = v
    return out


#: (DSV4_OPS value, op) -> parsed mapping (parsing validates names, so it is done once per value)
_PARSED_ENV: dict[tuple[str, str], dict[str, str]] = {}


def _forced_kind(op: str) -> str | None:
    stack = _tls.stack
    if stack:
        for m in reversed(stack):
            if op in m:
                return m[op]
            if "*" in m:
                return m["*"]
    env = _getenv("DSV4_OPS")
    if env:
        m = _PARSED_ENV.get((env, op))
        if m is None:
            m = _parse_env(env, op)
            if len(_PARSED_ENV) < 256:
                _PARSED_ENV[(env, op)] = m
        return m.get(op, m.get("*"))
    return None


@contextlib.contextmanager
def use(mapping: Mapping[str, str] | None = None, **ops: str) -> Iterator[None]:
    """Force providers inside a block: ``with use(dequant_fp4="cuda"):`` or ``use({"*": "torch"})``."""
    m = dict(mapping or {}, **ops)
    for k, v in m.items():
        if v not in KINDS:
            raise ValueError(f"registry.use: provider for {k!r} must be one of {KINDS}, got {v!r}")
    _check_names(m, "registry.use")
    stack, prev = _tls.stack, _tls.token
    stack.append(m)
    _tls.token = next(_TOKENS)
    try:
        yield
    finally:
        stack.pop()
        _tls.token = prev


def _freeze(x: Any) -> Any:
    if isinstance(x, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x
