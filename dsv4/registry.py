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
``dsv4 ops`` prints.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from .config import env_flag
from .target import Target

__all__ = [
    "Support", "Provider", "TorchProvider", "Op", "Choice", "ProviderUnavailableError", "register", "get_op",
    "all_ops", "use", "KINDS", "last_choice",
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

    @classmethod
    def yes(cls, reason: str = "supported") -> "Support":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> "Support":
        if not reason:
            raise ValueError("Support.no() needs a reason")
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok


class Provider:
    """Base class of an op implementation.

    Subclasses set ``kind`` and implement ``supports`` and ``run``; ``available`` defaults to
    "importable" (the module already imported). ``run(problem, **args)`` gets the problem
    dict built by the op and the validated tensors, and returns the op's outputs.
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


class TorchProvider(Provider):
    """Base of the plain-torch references (kind ``torch``): they run any problem on any device."""

    kind = "torch"
    #: the reason ``supports`` gives
    support_reason = "reference, any device"

    def supports(self, problem: Mapping[str, Any], target: Target) -> Support:
        return Support.yes(self.support_reason)


@dataclass
class Choice:
    """What dispatch picked for one problem: the kind, the reason, and why others were skipped."""

    kind: str
    reason: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    forced: bool = False

    def explain(self) -> str:
        parts = [r if r.startswith(f"{k}: ") else f"{k}: {r}" for k, r in self.skipped]
        parts.append(f"using {self.kind}" + (" (forced)" if self.forced else "") + f": {self.reason}")
        return "; ".join(parts)


class Op:
    """A registered op: name, layout spec, provider lookup and dispatch.

    Args:
        name: op name (also the ``torch.library`` name ``dsv4::<name>``).
        spec: the op's :class:`dsv4.layout.OpSpec`.
        module: module basename under ``kernels_dsl`` / ``kernels_cuda`` / ``dsv4.reference``
            (default: ``name``).
        kinds: provider kinds in preference order.
        example_problem: ``f(target) -> problem`` used by ``dsv4 ops`` to show what would run.
        env: environment variables the providers' ``supports`` read (e.g. the MoE decode plan's
            ``DSV4_MOE_DECODE*``): their values are part of the choice cache key, so changing one
            between calls re-decides instead of reusing a choice made under the old value.
    """

    def __init__(self, name: str, spec: Any, *, module: str | None = None,
                 kinds: tuple[str, ...] = KINDS,
                 example_problem: Callable[[Target], dict] | None = None,
                 env: tuple[str, ...] = ()):
        self.name = name
        self.env = tuple(env)
        self.spec = spec
        self.module = module or name
        self.kinds = kinds
        self.example_problem = example_problem
        self._providers: dict[str, Provider | Support] = {}
        self._cache: dict[tuple, Choice] = {}
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
                    res: Provider | Support = Support.no(f"no {kind} provider ({mod_name} does not exist)")
                else:
                    res = Support.no(f"{mod_name} cannot be imported: {e}")
            except Exception as e:  # noqa: BLE001 - report any import failure as a reason
                res = Support.no(f"{mod_name} failed to import: {type(e).__name__}: {e}")
            else:
                cls = getattr(mod, "PROVIDERS", {}).get(self.name)
                res = cls(self) if cls is not None else Support.no(
                    f"{mod_name} has no provider for {self.name}")
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
        forced = _forced_kind(self.name)
        key = (forced, target, _freeze(problem), tuple(os.environ.get(v) for v in self.env))
        choice = self._cache.get(key)
        if choice is None:
            choice = self._choose(problem, target, forced)
            with self._lock:
                self._cache[key] = choice
        self.last = choice
        _LAST[self.name] = choice
        p = self.provider(choice.kind)
        assert isinstance(p, Provider)
        return p, choice

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
        skipped = []
        for kind in self.kinds:
            s = self.check(kind, problem, target)
            if s:
                return Choice(kind, s.reason, skipped)
            skipped.append((kind, s.reason))
        raise ProviderUnavailableError(
            f"{self.name}: no provider can run this problem on {target}: "
            + "; ".join(f"{k}: {r}" for k, r in skipped))

    def dispatch(self, problem: Mapping[str, Any], target: Target, **args: Any) -> Any:
        """Select a provider for ``problem`` on ``target`` and run it."""
        p, choice = self.select(problem, target)
        if env_flag("DSV4_PRINT_LAYOUTS") and self.spec is not None:
            from .layout import print_boundary
            print_boundary(self.spec, choice, args)
        return p.run(problem, **args)

    def table(self, target: Target) -> list[dict]:
        """Rows for ``dsv4 ops``: each provider, whether it can run the example problem, and why."""
        problem = self.example_problem(target) if self.example_problem else {}
        rows = []
        chosen = None
        try:
            _, ch = self.select(problem, target) if problem else (None, None)
            chosen = ch.kind if ch else None
        except ProviderUnavailableError as e:
            chosen = f"none ({e})"
        for kind in self.kinds:
            s = self.check(kind, problem, target) if problem else Support.no("no example problem")
            rows.append({"op": self.name, "provider": kind, "ok": s.ok, "reason": s.reason,
                         "chosen": chosen == kind})
        return rows


_REGISTRY: dict[str, Op] = {}
_LAST: dict[str, Choice] = {}
_tls = threading.local()


def register(op: Op) -> Op:
    """Add an op to the registry (idempotent by name)."""
    _REGISTRY[op.name] = op
    return op


def get_op(name: str) -> Op:
    import dsv4.ops  # noqa: F401  (imports register every op)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known: {sorted(_REGISTRY)}") from None


def all_ops() -> list[Op]:
    import dsv4.ops  # noqa: F401
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def last_choice(op: str) -> Choice | None:
    """Which provider the last dispatch of ``op`` used, and why."""
    return _LAST.get(op)


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
        if k not in ("*", current) and k not in _REGISTRY:
            import dsv4.ops  # noqa: F401  (registers every op)
            if k not in _REGISTRY:
                raise ValueError(f"DSV4_OPS: unknown op {k!r}; known: {sorted(_REGISTRY)}")
        out[k] = v
    return out


def _forced_kind(op: str) -> str | None:
    stack = getattr(_tls, "stack", None)
    if stack:
        for m in reversed(stack):
            if op in m:
                return m[op]
            if "*" in m:
                return m["*"]
    env = os.environ.get("DSV4_OPS", "")
    if env:
        m = _parse_env(env, op)
        return m.get(op, m.get("*"))
    return None


@contextlib.contextmanager
def use(mapping: Mapping[str, str] | None = None, **ops: str) -> Iterator[None]:
    """Force providers inside a block: ``with use(dequant_fp4="cuda"):`` or ``use({"*": "torch"})``."""
    m = dict(mapping or {}, **ops)
    for k, v in m.items():
        if v not in KINDS:
            raise ValueError(f"registry.use: provider for {k!r} must be one of {KINDS}, got {v!r}")
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    stack.append(m)
    try:
        yield
    finally:
        stack.pop()


def _freeze(x: Any) -> Any:
    if isinstance(x, Mapping):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x
