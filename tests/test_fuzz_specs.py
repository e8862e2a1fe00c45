"""Hypothesis layout fuzzing over the real OpSpecs (issue 17 item 6).

For every registered op, strategies draw from the op's own :class:`~dsv4.layout.OpSpec`: symbol
bindings (so every shape expression is exercised), each operand's dtype among the allowed ones,
present / absent optional operands, and a memory layout allowed by the operand's major-ness
(storage offsets, padded row pitches for ``inner``, permuted strides for ``any``). Then one
mutation or none: a wrong dtype, rank, dim, stride, a missing required operand, a non-tensor.

* ``test_validation_accepts_exactly_the_valid_layouts``: ``OpSpec.validate`` accepts exactly the
  cases an independent oracle (written here from the documented rules, with its own evaluator)
  calls valid, binds the drawn symbols, and names the argument or the constraint when it rejects.
* ``test_fast_and_full_validation_agree``: the generated fast checker and the full check give the
  same verdict and the same bound symbols on every draw.
* ``test_accepted_layouts_run_and_match``: for ops whose call needs nothing beyond the spec's
  operands (dequant / quantize / top-k), every accepted draw runs through the public function and
  equals the same call on contiguous copies (CPU, torch provider; ``-m gpu``: the default provider
  against the torch reference on the same GPU tensors).
"""
from __future__ import annotations

import ast
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dsv4 import layout, registry
from dsv4.layout import LayoutError

OPS = sorted(op.name for op in registry.all_ops())
SPECS = {op.name: op.spec for op in registry.all_ops()}
_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min, "round_up": lambda a, b: -(-a // b) * b}
#: symbol values: small, with enough powers of two that the specs' divisibility constraints hold often
NICE = (1, 2, 3, 4, 8, 16, 32, 64, 128)
MAX_ELEMS = 1 << 19
ALL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32, torch.float16, torch.bfloat16,
              torch.float8_e4m3fn, torch.float8_e8m0fnu)


def _fuzz(examples: int):
    """Deterministic hypothesis settings with ``examples`` draws (no deadline: a draw builds tensors)."""
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


FUZZ = _fuzz(20)


def _every_op(test):
    """``test(name, data)`` for every registered op, with :data:`FUZZ` hypothesis draws."""
    return pytest.mark.parametrize("name", OPS)(FUZZ(given(data=st.data())(test)))


def _names(expr) -> set[str]:
    if isinstance(expr, int):
        return set()
    return {n.id for n in ast.walk(ast.parse(str(expr), mode="eval")) if isinstance(n, ast.Name) and n.id not in _FUNCS}


def _py_eval(expr, env):
    """The oracle's own evaluator: Python's eval over the symbols (no dsv4.layout code)."""
    return expr if isinstance(expr, int) else eval(str(expr), dict(_FUNCS, __builtins__={}), dict(env))  # noqa: S307


def _symbols(spec):
    bare, every = set(), set()
    for ts in spec.inputs:
        for d in ts.shape:
            every |= _names(d)
            if isinstance(d, str) and d.isidentifier():
                bare.add(d)
    for expr, _ in spec.constraints:
        every |= _names(expr)
    return bare, every


def oracle(spec, tensors, symbols) -> dict | None:
    """The documented rules (dsv4/layout.py module docstring, TensorSpec fields), re-written:
    dtype allowed, rank, one device, a bare symbol bound by the first present operand that has it,
    every dim equal to its value, row = contiguous, inner = unit last stride (size-1 last dim or
    empty tensors exempt), the data-pointer alignment on CUDA tensors, constraints over the bound symbols (skipped when a symbol is unbound).
    Returns the bound symbols, or None for an invalid case."""
    env, dev, present = dict(symbols), None, []
    for ts in spec.inputs:
        t = tensors.get(ts.name)
        if t is None:
            if ts.optional or ts.output:
                continue
            return None
        if not isinstance(t, torch.Tensor) or t.dtype not in ts.dtypes or t.dim() != len(ts.shape):
            return None
        if dev is not None and t.device != dev:
            return None
        dev = t.device
        present.append((ts, t))
        for d, n in zip(ts.shape, t.shape):
            if isinstance(d, str) and d.isidentifier():
                env.setdefault(d, n)
    for ts, t in present:
        for d, n in zip(ts.shape, t.shape):
            try:
                if n != _py_eval(d, env):
                    return None
            except NameError:
                return None
        if t.numel() and ts.major == "row" and not t.is_contiguous():
            return None
        if t.numel() and ts.major == "inner" and t.dim() and t.stride(-1) != 1 and t.shape[-1] != 1:
            return None
        if t.device.type == "cuda" and ts.align > 1 and t.numel() and t.data_ptr() % ts.align:
            return None
    for expr, _ in spec.constraints:
        try:
            if not _py_eval(expr, env):
                return None
        except NameError:
            pass
    return env


@st.composite
def _tensor(draw, shape, dtype, major):
    """A zero-filled tensor of ``shape`` / ``dtype`` in a layout ``major`` allows."""
    n = math.prod(shape)
    off = draw(st.sampled_from((0, 0, 1, 16)))
    if major == "inner" and len(shape) >= 2 and n:
        pitch = shape[-1] + draw(st.sampled_from((0, 1, 5)))
        rows = math.prod(shape[:-1])
        base = _zeros([off + rows * pitch], dtype)
        strides = [pitch * math.prod(shape[i + 1:-1]) for i in range(len(shape) - 1)] + [1]
        return base.as_strided(shape, strides, off)
    if major == "any" and len(shape) >= 2 and n and draw(st.booleans()):
        perm = list(reversed(range(len(shape))))
        t = _zeros([shape[i] for i in perm], dtype, off)
        return t.permute(*[perm.index(i) for i in range(len(shape))])
    return _zeros(shape, dtype, off)


def _zeros(shape, dtype, off=0):
    n = math.prod(shape)
    if dtype.is_floating_point:
        buf = torch.zeros(off + n, dtype=torch.float32).to(dtype)
    else:
        buf = torch.zeros(off + n, dtype=dtype)
    return buf[off:off + n].view(shape)


def _steer(spec, env, draw) -> None:
    """Make the common constraint forms hold (so that valid cases are frequent): ``S % N == 0``
    draws S among N, 2N; ``S == expr`` / ``expr == S`` sets S to the expression's value."""
    for expr, _ in spec.constraints:
        body = ast.parse(expr, mode="eval").body
        for part in body.values if isinstance(body, ast.BoolOp) else [body]:
            if not (isinstance(part, ast.Compare) and len(part.ops) == 1 and isinstance(part.ops[0], ast.Eq)):
                continue
            left, right = part.left, part.comparators[0]
            if (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Mod) and isinstance(left.left, ast.Name)
                    and isinstance(left.right, ast.Constant) and isinstance(right, ast.Constant) and right.value == 0):
                env[left.left.id] = left.right.value * draw(st.sampled_from((1, 2)))
            elif isinstance(right, ast.Name) and right.id in env:
                env[right.id] = _py_eval(ast.unparse(left), env)
            elif isinstance(left, ast.Name) and left.id in env:
                env[left.id] = _py_eval(ast.unparse(right), env)


MUTATIONS = ("none", "none", "none", "dtype", "rank", "dim", "stride", "missing", "not_tensor", "device_meta")


@st.composite
def layout_cases(draw, spec, mutate=True):
    """(tensors, symbols, mutation, mutated operand name) drawn from ``spec``."""
    bare, every = _symbols(spec)
    env = {s: draw(st.sampled_from(NICE), label=s) for s in sorted(every)}
    if draw(st.integers(0, 3)):              # mostly: steer the symbols into the constraints' shapes
        _steer(spec, env, draw)
    tensors = {}
    for ts in spec.inputs:
        if ts.optional and draw(st.booleans()):
            tensors[ts.name] = None
            continue
        try:
            shape = [int(_py_eval(d, env)) for d in ts.shape]
        except (ZeroDivisionError, NameError):
            assume(False)
        assume(all(n >= 0 for n in shape) and math.prod(shape) <= MAX_ELEMS)
        tensors[ts.name] = draw(_tensor(shape, draw(st.sampled_from(ts.dtypes)), ts.major))
    symbols = {k: env[k] for k in every - bare}       # symbols no operand binds: passed by the op
    kind = draw(st.sampled_from(MUTATIONS)) if mutate else "none"
    names = [n for n, t in tensors.items() if t is not None]
    victim = draw(st.sampled_from(names)) if names and kind != "none" else None
    if victim is not None:
        t = tensors[victim]
        if kind == "dtype":
            tensors[victim] = _zeros(list(t.shape), draw(st.sampled_from([d for d in ALL_DTYPES if d != t.dtype])))
        elif kind == "rank":
            tensors[victim] = t.unsqueeze(0) if draw(st.booleans()) or t.dim() == 0 else t.reshape(-1)
        elif kind == "dim" and t.dim():
            i = draw(st.integers(0, t.dim() - 1))
            shape = list(t.shape)
            shape[i] += draw(st.sampled_from((1, -1) if shape[i] > 0 else (1,)))
            tensors[victim] = _zeros(shape, t.dtype)
        elif kind == "stride" and t.dim() >= 1 and t.numel() > 1:
            big = _zeros(list(t.shape[:-1]) + [t.shape[-1] * 2], t.dtype)
            tensors[victim] = big[..., ::2]                 # last stride 2
        elif kind == "missing":
            tensors[victim] = None
        elif kind == "not_tensor":
            tensors[victim] = t.tolist() if t.numel() < 64 and t.dtype in (torch.int32, torch.int64) else "x"
        elif kind == "device_meta" and len(names) > 1:
            tensors[victim] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return tensors, symbols, kind, victim


def _validated(spec, tensors, symbols):
    """``(bound symbols, None)`` from the public ``spec.validate``, or ``(None, message)`` when it rejects."""
    try:
        return spec.validate(tensors, symbols=symbols), None
    except LayoutError as e:
        return None, str(e)


@_every_op
def test_validation_accepts_exactly_the_valid_layouts(name, data):
    spec = SPECS[name]
    tensors, symbols, kind, victim = data.draw(layout_cases(spec))
    want = oracle(spec, tensors, symbols)
    got, msg = _validated(spec, tensors, symbols)
    assert (got is None) == (want is None), (kind, victim, {
        k: None if v is None else (getattr(v, "dtype", type(v)), getattr(v, "shape", None)) for k, v in tensors.items()})
    if got is not None:
        assert got == want                                  # the same symbols bound to the same values
    else:
        assert msg.startswith(f"{spec.name}: ")
        assert "argument '" in msg or any(m in msg for _, m in spec.constraints) or "cannot check" in msg, msg


@_every_op
def test_fast_and_full_validation_agree(name, data):
    spec = SPECS[name]
    tensors, symbols, _, _ = data.draw(layout_cases(spec))
    fast = layout._checker(spec, spec.inputs)
    env = dict(symbols)
    try:
        ok = bool(fast(tensors, env))
    except (KeyError, TypeError, AttributeError):
        ok = False
    try:
        full = spec._validate_full(tensors, symbols, spec.inputs)
    except LayoutError:
        full = None
    if ok:                                  # the fast path may only accept what the full check accepts
        assert full == env
    # and the public entry point gives the full check's verdict either way
    assert _validated(spec, tensors, symbols)[0] == full


# ------------------------------------------------------------------------- accepted cases run
def _fill(t: torch.Tensor, gen: torch.Generator, kind: str) -> None:
    """Valid random contents for operand ``kind`` (in place, whatever the strides)."""
    if kind == "fp4":
        v = torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8)
    elif kind == "ue8m0":
        v = torch.randint(100, 150, t.shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    elif kind == "e4m3":
        v = (torch.rand(t.shape, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)
    elif kind == "len":
        v = torch.randint(0, 2 * max(1, t.numel()) + 4, t.shape, generator=gen, dtype=torch.int32)
    elif kind == "pos":
        v = torch.ones(t.shape, dtype=torch.float32) * 0.5
    else:
        v = torch.randn(t.shape, generator=gen).to(t.dtype)
    t.copy_(v.to(t.dtype) if v.dtype != t.dtype else v)


def _run_dequant_fp4(tensors, symbols, gen):
    fmt = "mxfp4" if tensors["scale"].dtype == torch.float8_e8m0fnu else "nvfp4"
    if symbols.get("SF") != {"mxfp4": 32, "nvfp4": 16}[fmt]:
        return None
    _fill(tensors["data"], gen, "fp4")
    _fill(tensors["scale"], gen, "ue8m0" if fmt == "mxfp4" else "e4m3")
    g = tensors.get("global_scale")
    if (fmt == "nvfp4") != (g is not None):
        return None
    if g is not None:
        _fill(g, gen, "pos")
    from dsv4.ops import dequant_fp4
    return lambda ts: dequant_fp4(ts["data"], ts["scale"], fmt=fmt, global_scale=ts.get("global_scale"))


def _run_topk(tensors, symbols, gen):
    from dsv4.ops import topk
    _fill(tensors["logits"], gen, "x")
    for k in ("lengths", "starts"):
        if tensors.get(k) is not None:
            _fill(tensors[k], gen, "len")
    bt = tensors.get("block_table")
    bs, rps = symbols.get("block_size", 0), symbols.get("rows_per_seq", 1)
    if bt is not None:
        bt.copy_(torch.randint(-1, 64, bt.shape, generator=gen, dtype=torch.int32))
    else:
        bs = 0
    k = int(torch.randint(1, 9, (1,), generator=gen))
    return lambda ts: topk(ts["logits"], ts["lengths"], k, starts=ts.get("starts"), block_table=ts.get("block_table"),
                           block_size=bs, rows_per_seq=rps, return_scores=True)


def _run_quant(op):
    def make(tensors, symbols, gen):
        from dsv4 import ops
        x = tensors.get("x")
        if x is not None:
            _fill(x, gen, "x")
        if op == "quantize_mxfp4":
            return lambda ts: ops.quantize_mxfp4(ts["x"])
        if op == "quantize_nvfp4":
            g = tensors.get("global_scale")
            if g is not None:
                _fill(g, gen, "pos")
            return lambda ts: ops.quantize_nvfp4(ts["x"], global_scale=ts.get("global_scale"))
        if op == "quantize_fp8_block":
            b = symbols.get("block")
            return None if b not in (32, 64, 128) else lambda ts: ops.quantize_fp8_block(ts["x"], block=b)
        if op == "dequantize_fp8_block":
            b = symbols.get("block")
            if b not in (32, 64, 128):
                return None
            _fill(tensors["q"], gen, "x")
            _fill(tensors["scale"], gen, "ue8m0" if tensors["scale"].dtype == torch.float8_e8m0fnu else "pos")
            return lambda ts: ops.dequantize_fp8_block(ts["q"], ts["scale"], block=b)
    return make


RUNNERS = {"dequant_fp4": _run_dequant_fp4, "topk": _run_topk,
           **{op: _run_quant(op) for op in ("quantize_mxfp4", "quantize_nvfp4", "quantize_fp8_block",
                                            "dequantize_fp8_block")}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a, b) -> bool:
    """Bitwise equality of op outputs (tensors, tuples of them, dataclasses such as NVFP4Tensor)."""
    import dataclasses
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    return a == b


def _accepted_case(name, data, device):
    spec = SPECS[name]
    tensors, symbols, _, _ = data.draw(layout_cases(spec, mutate=False))
    if device != "cpu":   # same strides and offsets; the alignment rule then applies (CUDA tensors only)
        tensors = {k: None if v is None else _to(v, device) for k, v in tensors.items()}
    assume(oracle(spec, tensors, symbols))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 30)))
    call = RUNNERS[name](tensors, symbols, gen)
    assume(call is not None)
    return call, tensors


def _to(t, device):
    """``t`` on ``device`` with the same strides and storage offset (the layout is the point)."""
    buf = torch.empty(t.untyped_storage().nbytes() // t.element_size(), dtype=t.dtype, device=device)
    out = buf.as_strided(t.shape, t.stride(), t.storage_offset())
    out.copy_(t)
    return out


@pytest.mark.parametrize("name", sorted(RUNNERS))
@_fuzz(12)
@given(data=st.data())
def test_accepted_layouts_run_and_match(name, data):
    """Every accepted layout runs, and its result does not depend on the layout (offsets, padded
    rows): equal, bit for bit, to the same call on contiguous copies."""
    call, tensors = _accepted_case(name, data, "cpu")
    got = call(tensors)
    want = call({k: None if v is None else v.contiguous().clone() for k, v in tensors.items()})
    assert _same(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(RUNNERS))
@_fuzz(8)
@given(data=st.data())
def test_accepted_layouts_match_the_reference_gpu(name, data):
    """GPU: the default provider on the fuzzed CUDA layout vs the torch reference on the same tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    call, tensors = _accepted_case(name, data, "cuda")
    got = call(tensors)
    with registry.use({name: "torch"}):
        want = call(tensors)
    torch.cuda.synchronize()
    assert _same(got, want), registry.last_choice(name)
