"""Declarative layout specs for every operand at a kernel boundary.

One :class:`OpSpec` per op lists its operands (:class:`TensorSpec`: dtype, symbolic shape,
major-ness, alignment, packing, scale-factor layout) and its constraints. The same object

(a) validates inputs before any launch (:meth:`OpSpec.validate`), raising :class:`LayoutError`
    that names the argument and says expected vs got;
(b) prints itself next to the actual tensors at the kernel boundary when
    ``DSV4_PRINT_LAYOUTS=1`` (and through ``dsv4 layouts OP``);
(c) renders its markdown (:meth:`OpSpec.markdown`); :mod:`dsv4.layout_docs` writes
    ``docs/layouts/<op>.md`` for every registered op (``python -m dsv4 layouts --write docs/layouts``).

This module knows nothing of the registry (the registry imports it, never the reverse).

Shapes are tuples of ints or expressions over symbols, e.g. ``("M", "K // 2")`` or
``("cdiv(M, 128)", "cdiv(K // 16, 4)", 32, 4, 4)``. A bare symbol is bound by the first operand
that has it; every other occurrence and every expression is checked against the binding.
"""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

__all__ = ["LayoutError", "TensorSpec", "Param", "OpSpec", "print_boundary", "dtype_name"]


class LayoutError(ValueError):
    """An argument does not match its layout spec. The message names the argument."""


_DTYPE_NAMES = {
    torch.uint8: "uint8", torch.int8: "int8", torch.int32: "int32", torch.int64: "int64",
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float64: "float64", torch.bool: "bool",
}
for _n in ("float8_e4m3fn", "float8_e8m0fnu", "float8_e5m2", "float4_e2m1fn_x2"):
    if hasattr(torch, _n):
        _DTYPE_NAMES[getattr(torch, _n)] = _n


def dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


# --------------------------------------------------------------------------------------------
# tiny safe expression evaluator for symbolic dims
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge}
_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min, "round_up": lambda a, b: -(-a // b) * b}


_COMPILED: dict[str, Any] = {}


def _check_ast(expr: str) -> None:
    """Allow only integer arithmetic, comparisons, and/or, symbols and the helper functions."""
    def ok(n: ast.AST) -> None:
        if isinstance(n, ast.Expression):
            return ok(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, bool)):
            return
        if isinstance(n, ast.Name):
            return
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return ok(n.left) or ok(n.right)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return ok(n.operand)
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and type(n.ops[0]) in _CMPOPS:
            return ok(n.left) or ok(n.comparators[0])
        if isinstance(n, ast.BoolOp):
            for v in n.values:
                ok(v)
            return
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _FUNCS and not n.keywords:
            for a in n.args:
                ok(a)
            return
        raise ValueError(f"unsupported expression {expr!r}")
    ok(ast.parse(expr, mode="eval"))


def _compiled(expr: str) -> Any:
    """The expression as a plain Python function of the symbol dict (validated once, cached):
    no ``ast`` work per call, so it is cheap and traceable by ``torch.compile``."""
    fn = _COMPILED.get(expr)
    if fn is None:
        _check_ast(expr)
        names = sorted({n.id for n in ast.walk(ast.parse(expr, mode="eval"))
                        if isinstance(n, ast.Name) and n.id not in _FUNCS})
        src = "lambda _e: (lambda " + ", ".join(names) + ": " + expr + ")(" + \
            ", ".join(f"_e[{n!r}]" for n in names) + ")" if names else "lambda _e: " + expr
        fn = eval(src, dict(_FUNCS, __builtins__={}))  # noqa: S307 - AST checked above
        _COMPILED[expr] = fn
    return fn


def _eval(expr: str, env: Mapping[str, int]) -> Any:
    """Evaluate a symbolic-dim expression; ``KeyError(name)`` when a symbol is unbound."""
    return _compiled(expr)(env)


def _is_symbol(d: Any) -> bool:
    return isinstance(d, str) and d.isidentifier()


@dataclass(frozen=True)
class TensorSpec:
    """One operand of an op.

    Args:
        name: argument name (as in the public function).
        dtype: allowed torch dtypes (one or a tuple).
        shape: symbolic shape, e.g. ``("num_blocks", "block_size", 68)``.
        major: ``"row"`` (fully contiguous, row-major), ``"inner"`` (last dim stride 1, other
            strides free) or ``"any"``.
        align: required byte alignment of the data pointer (checked on CUDA tensors).
        packing: how values are packed in elements, e.g. "2 x E2M1 per byte, element 2i in the low nibble".
        scale: the scale-factor layout this operand is or uses.
        doc: what the operand holds.
        optional: may be ``None``.
        output: produced by the op (documented, validated when the caller passes ``out=``).
    """

    name: str
    dtype: Any
    shape: tuple
    major: str = "row"
    align: int = 16
    packing: str = ""
    scale: str = ""
    doc: str = ""
    optional: bool = False
    output: bool = False

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self.dtype if isinstance(self.dtype, tuple) else (self.dtype,)

    def shape_str(self) -> str:
        return "[" + ", ".join(str(d) for d in self.shape) + "]"

    def dtype_str(self) -> str:
        return " or ".join(dtype_name(d) for d in self.dtypes)

    def describe(self) -> str:
        s = f"{self.name}: {self.dtype_str()} {self.shape_str()} ({self.major}-major, {self.align} B aligned)"
        if self.packing:
            s += f"; packing: {self.packing}"
        if self.scale:
            s += f"; scale: {self.scale}"
        return s


@dataclass(frozen=True)
class Param:
    """A scalar parameter of an op: name, type, allowed values/range (as text), meaning."""

    name: str
    type: str
    allowed: str
    doc: str = ""


@dataclass(frozen=True)
class OpSpec:
    """The boundary of one op: operands, scalar params, constraints, formula and its source."""

    name: str
    summary: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...] = ()
    params: tuple[Param, ...] = ()
    #: (boolean expression over symbols, message) checked after binding
    constraints: tuple[tuple[str, str], ...] = ()
    formula: str = ""
    source: str = ""
    notes: str = ""

    def operand(self, name: str) -> TensorSpec:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)

    # -- validation ------------------------------------------------------------------------
    def validate(self, tensors: Mapping[str, torch.Tensor | None], *, symbols: Mapping[str, int] | None = None,
                 specs: Sequence[TensorSpec] | None = None) -> dict[str, int]:
        """Check ``tensors`` against the spec; return the bound symbols.

        Raises:
            LayoutError: naming the first argument that does not match (dtype, rank, dim,
                contiguity, alignment, device), with expected vs got.

        Cost: a generated checker per operand list (:func:`_checker`, built once) accepts valid
        plain tensors in about a microsecond per operand; anything it does not accept (a bad
        argument, a tensor subclass such as a FakeTensor) goes through the full check below, which
        decides and words the error, so both paths accept exactly the same inputs.
        """
        if specs is None:
            specs = self.inputs
        if _FAST:
            memo = self.__dict__.get("_checkers")                     # per instance, not a field
            if memo is None:
                memo = self.__dict__.setdefault("_checkers", {})
            # a tuple the caller keeps is found by identity (the entry keeps it alive); torch.compile
            # cannot trace that identity test, it looks the checker up by the specs' ids
            compiling = _is_compiling()
            hit = None if compiling else memo.get(id(specs))
            if hit is not None and hit[0] is specs:
                fast = hit[1]
            else:
                given, specs = specs, tuple(specs)
                key = tuple(map(id, specs))
                fast = memo.get(key)
                if fast is None:
                    fast = memo[key] = _checker(self, specs)
                if not compiling and given is specs and len(memo) < 256:
                    memo[id(specs)] = (specs, fast)
            env = dict(symbols) if symbols else {}
            try:
                if fast(tensors, env):
                    return env
            except (KeyError, TypeError, AttributeError):
                pass
        return self._validate_full(tensors, symbols, tuple(specs))

    def _validate_full(self, tensors: Mapping[str, torch.Tensor | None], symbols: Mapping[str, int] | None,
                       specs: Sequence[TensorSpec]) -> dict[str, int]:
        """The reference check: decides every case and words the error (see :meth:`validate`)."""
        env: dict[str, int] = dict(symbols or {})
        device = None
        present: list[tuple[TensorSpec, torch.Tensor]] = []
        for ts in specs:
            t = tensors.get(ts.name)
            if t is None:
                if ts.optional or ts.output:
                    continue
                raise LayoutError(f"{self.name}: argument '{ts.name}' is required: expected {ts.describe()}")
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{self.name}: argument '{ts.name}' must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in ts.dtypes:
                raise LayoutError(f"{self.name}: argument '{ts.name}' has dtype {dtype_name(t.dtype)}, "
                                  f"expected {ts.dtype_str()} ({ts.describe()})")
            if t.dim() != len(ts.shape):
                raise LayoutError(f"{self.name}: argument '{ts.name}' has shape {list(t.shape)} (rank {t.dim()}), "
                                  f"expected rank {len(ts.shape)} {ts.shape_str()}")
            if device is None:
                device = t.device
            elif t.device != device:
                raise LayoutError(f"{self.name}: argument '{ts.name}' is on {t.device}, other arguments on {device}")
            present.append((ts, t))
            for d, n in zip(ts.shape, t.shape):
                if _is_symbol(d) and d not in env:
                    env[d] = int(n)
        for ts, t in present:
            for i, (d, n) in enumerate(zip(ts.shape, t.shape)):
                try:
                    want = d if isinstance(d, int) else _eval(d, env)
                except KeyError as e:
                    raise LayoutError(f"{self.name}: cannot check '{ts.name}' dim {i} ({d}): "
                                      f"symbol {e} is unbound") from None
                if int(n) != want:
                    bound = {k: v for k, v in env.items() if isinstance(d, str) and k in d}
                    raise LayoutError(
                        f"{self.name}: argument '{ts.name}' has shape {list(t.shape)}, expected "
                        f"{ts.shape_str()} = dim {i} should be {want} ({d} with {bound})")
            self._check_major(ts, t)
            if t.device.type == "cuda" and ts.align > 1 and t.numel() > 0 and not _is_fake(t):
                if t.data_ptr() % ts.align:
                    raise LayoutError(f"{self.name}: argument '{ts.name}' data pointer is not {ts.align}-byte "
                                      f"aligned (offset {t.data_ptr() % ts.align}); expected {ts.describe()}")
        for expr, msg in self.constraints:
            try:
                ok = _eval(expr, env)
            except KeyError:
                continue  # constraint on an absent optional operand
            if not ok:
                raise LayoutError(f"{self.name}: {msg} (violated: {expr} with "
                                  f"{ {k: v for k, v in env.items() if k in expr} })")
        return env

    def _check_major(self, ts: TensorSpec, t: torch.Tensor) -> None:
        if ts.major == "any" or t.numel() == 0:
            return
        if ts.major == "row" and not t.is_contiguous():
            raise LayoutError(f"{self.name}: argument '{ts.name}' must be contiguous row-major, got strides "
                              f"{list(t.stride())} for shape {list(t.shape)} (call .contiguous())")
        if ts.major == "inner" and t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
            raise LayoutError(f"{self.name}: argument '{ts.name}' must have unit stride in its last dim, got "
                              f"strides {list(t.stride())}")

    # -- rendering -------------------------------------------------------------------------
    def text(self) -> str:
        lines = [f"{self.name}: {self.summary}"]
        if self.formula:
            lines.append(f"  formula: {self.formula}")
        if self.source:
            lines.append(f"  source: {self.source}")
        for title, group in (("inputs", self.inputs), ("outputs", self.outputs)):
            if group:
                lines.append(f"  {title}:")
                for ts in group:
                    lines.append("    " + ts.describe() + (" (optional)" if ts.optional else ""))
                    if ts.doc:
                        lines.append("      " + ts.doc)
        if self.params:
            lines.append("  params:")
            for p in self.params:
                lines.append(f"    {p.name}: {p.type} in {p.allowed}" + (f" -- {p.doc}" if p.doc else ""))
        if self.constraints:
            lines.append("  constraints:")
            for expr, msg in self.constraints:
                lines.append(f"    {expr}  ({msg})")
        if self.notes:
            lines.append("  notes: " + self.notes)
        return "\n".join(lines)

    def markdown(self) -> str:
        out = [f"# `{self.name}`", "", self.summary, ""]
        out.append("<!-- generated by `python -m dsv4 layouts --write docs/layouts`; do not edit -->")
        out.append("")
        if self.formula:
            out += ["**Formula:** `" + self.formula + "`", ""]
        if self.source:
            out += ["**Source:** " + self.source, ""]
        for title, group in (("Inputs", self.inputs), ("Outputs", self.outputs)):
            if not group:
                continue
            out += [f"## {title}", "", "| operand | dtype | shape | major | align | packing | scale layout | meaning |",
                    "|---|---|---|---|---|---|---|---|"]
            for ts in group:
                out.append(f"| `{ts.name}`{' (optional)' if ts.optional else ''} | {ts.dtype_str()} | "
                           f"`{ts.shape_str()}` | {ts.major} | {ts.align} B | {ts.packing or '-'} | "
                           f"{ts.scale or '-'} | {ts.doc or '-'} |")
            out.append("")
        if self.params:
            out += ["## Parameters", "", "| name | type | allowed | meaning |", "|---|---|---|---|"]
            out += [f"| `{p.name}` | {p.type} | {p.allowed} | {p.doc or '-'} |" for p in self.params]
            out.append("")
        if self.constraints:
            out += ["## Constraints (checked before launch)", ""]
            out += [f"- `{e}`: {m}" for e, m in self.constraints]
            out.append("")
        if self.notes:
            out += ["## Notes", "", self.notes, ""]
        return "\n".join(out).rstrip() + "\n"


#: False: every validation takes the full path (tests compare both paths, tests/test_fuzz_specs.py)
_FAST = True
_is_compiling = torch.compiler.is_compiling


def _checker(spec: OpSpec, specs: Sequence[TensorSpec]):
    """Generate ``check(tensors, env) -> bool`` for one operand list: True when every operand is a
    plain ``torch.Tensor`` that passes every check of :meth:`OpSpec._validate_full` (then ``env``
    holds the bound symbols), False (or an exception) otherwise: the caller then runs the full
    check, which raises the worded error. Straight-line code, no loops over specs per call."""
    g: dict[str, Any] = {"Tensor": torch.Tensor}
    src = ["def check(tensors, env):", "    dev = None"]
    reads = []                                    # (index, spec, indent of the code that reads it)
    for i, ts in enumerate(specs):
        t, sh = f"t{i}", f"s{i}"
        g[f"D{i}"] = frozenset(ts.dtypes)
        src.append(f"    {t} = tensors.get({ts.name!r})")
        if ts.optional or ts.output:
            src.append(f"    if {t} is not None:")
            ind = "        "
        else:
            src.append(f"    if {t} is None: return False")
            ind = "    "
        src += [f"{ind}if type({t}) is not Tensor or {t}.dtype not in D{i}: return False",
                f"{ind}{sh} = {t}.shape",
                f"{ind}if len({sh}) != {len(ts.shape)}: return False",
                f"{ind}if dev is None: dev = {t}.device",
                f"{ind}elif {t}.device != dev: return False"]
        for j, d in enumerate(ts.shape):
            if _is_symbol(d):                     # the first operand with the symbol binds it, the others compare
                src += [f"{ind}v = env.get({d!r})", f"{ind}if v is None: env[{d!r}] = {sh}[{j}]",
                        f"{ind}elif v != {sh}[{j}]: return False"]
        reads.append((i, ts, ind))
    src.append("    cuda = dev is not None and dev.type == 'cuda'")
    for i, ts, ind in reads:
        t, sh = f"t{i}", f"s{i}"
        body = []
        for j, d in enumerate(ts.shape):
            if isinstance(d, int):
                body.append(f"if {sh}[{j}] != {d}: return False")
            elif _is_symbol(d):
                continue                              # bound or compared where the operand is read
            else:
                body.append(f"if {sh}[{j}] != {_inline(d, g)}: return False")
        if ts.major == "row":
            body.append(f"if not {t}.is_contiguous() and {t}.numel() != 0: return False")
        elif ts.major == "inner" and ts.shape:
            body.append(f"if {t}.stride(-1) != 1 and {sh}[-1] != 1 and {t}.numel() != 0: return False")
        if ts.align > 1:
            body.append(f"if cuda and {t}.data_ptr() % {ts.align} and {t}.numel() != 0: return False")
        if ind != "    ":
            src.append(f"    if {t} is not None:")
        src += [ind + b for b in body]
    for expr, _msg in spec.constraints:
        src += ["    try:", f"        ok = {_inline(expr, g)}", "    except KeyError:", "        ok = True",
                "    if not ok: return False"]
    src.append("    return True")
    exec("\n".join(src), g)  # noqa: S102 - generated from the spec's own fields (names are identifiers)
    return g["check"]


def _inline(expr: str, g: dict[str, Any]) -> str:
    """``expr`` as Python source over the generated checker's ``env`` (``M`` -> ``env['M']``; an unbound
    symbol raises ``KeyError`` as :func:`_eval` does), its helper functions put in ``g``: no function
    call per expression. The AST is checked first (:func:`_check_ast`)."""
    _check_ast(expr)

    class Sub(ast.NodeTransformer):
        def visit_Name(self, n: ast.Name) -> ast.AST:
            if n.id in _FUNCS:
                g[f"F_{n.id}"] = _FUNCS[n.id]
                return ast.copy_location(ast.Name(f"F_{n.id}", ast.Load()), n)
            return ast.copy_location(ast.Subscript(ast.Name("env", ast.Load()), ast.Constant(n.id), ast.Load()), n)
    tree = ast.fix_missing_locations(Sub().visit(ast.parse(expr, mode="eval")))
    return "(" + ast.unparse(tree) + ")"


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ in ("FakeTensor", "FunctionalTensor") or t.device.type == "meta"


def print_boundary(spec: OpSpec, choice: Any, args: Mapping[str, Any]) -> None:
    """Print the spec next to the actual operands (``DSV4_PRINT_LAYOUTS=1``)."""
    lines = [f"[dsv4] {spec.name} -> {getattr(choice, 'kind', choice)} ({getattr(choice, 'reason', '')})"]
    for k, v in args.items():
        if isinstance(v, torch.Tensor):
            try:
                want = spec.operand(k).describe()
            except KeyError:
                want = "(internal)"
            lines.append(f"    {k}: got {dtype_name(v.dtype)} {list(v.shape)} stride {list(v.stride())} "
                         f"on {v.device} | spec {want}")
        elif v is not None and not callable(v):
            lines.append(f"    {k} = {v!r}")
    print("\n".join(lines), flush=True)
