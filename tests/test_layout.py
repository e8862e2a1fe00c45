"""Layout specs: validation errors name the argument, docs are generated and up to date."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.layout import LayoutError, OpSpec, TensorSpec, _eval

ROOT = Path(__file__).resolve().parents[1]

SPEC = OpSpec(
    "toy", "toy op",
    inputs=(TensorSpec("cache", torch.uint8, ("num_blocks", "block_size", 68)),
            TensorSpec("table", torch.int32, ("B", "max_blocks"), align=4),
            TensorSpec("sf", (torch.float8_e8m0fnu,), ("M", "cdiv(K, 32)"), align=1, optional=True),
            TensorSpec("x", torch.bfloat16, ("M", "K"), major="inner")),
    constraints=(("K % 32 == 0", "K must be a multiple of 32"),),
)


def _ok(**over):
    t = dict(cache=torch.zeros(4, 64, 68, dtype=torch.uint8), table=torch.zeros(2, 3, dtype=torch.int32),
             sf=torch.zeros(5, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu), x=torch.zeros(5, 128, dtype=torch.bfloat16))
    t.update(over)
    return t


def test_valid_inputs_bind_symbols():
    env = SPEC.validate(_ok())
    assert env == {"num_blocks": 4, "block_size": 64, "B": 2, "max_blocks": 3, "M": 5, "K": 128}


@pytest.mark.parametrize("over,needle", [
    (dict(cache=torch.zeros(4, 64, 67, dtype=torch.uint8)), "argument 'cache' has shape [4, 64, 67]"),
    (dict(table=torch.zeros(2, 3, dtype=torch.int64)), "argument 'table' has dtype int64, expected int32"),
    (dict(x=torch.zeros(5, 128)), "argument 'x' has dtype float32, expected bfloat16"),
    (dict(sf=torch.zeros(5, 3, dtype=torch.uint8).view(torch.float8_e8m0fnu)), "argument 'sf' has shape [5, 3]"),
    (dict(cache=torch.zeros(4, 64, dtype=torch.uint8)), "argument 'cache' has shape [4, 64] (rank 2)"),
    (dict(x=torch.zeros(5, 80, dtype=torch.bfloat16), sf=None), "K must be a multiple of 32"),
    (dict(x=torch.zeros(128, 5, dtype=torch.bfloat16).t(), sf=None), "argument 'x' must have unit stride"),
    (dict(cache=torch.zeros(4, 68, 64, dtype=torch.uint8).transpose(1, 2)), "argument 'cache' must be contiguous"),
    (dict(table=[[0]]), "argument 'table' must be a torch.Tensor"),
    (dict(table=None), "argument 'table' is required"),
])
def test_errors_name_the_argument(over, needle):
    with pytest.raises(LayoutError) as e:
        SPEC.validate(_ok(**over))
    assert needle in str(e.value), str(e.value)


def test_optional_operand_may_be_absent():
    env = SPEC.validate(_ok(sf=None))
    assert env["M"] == 5 and env["K"] == 128


@given(st.integers(0, 10_000), st.integers(1, 300))
@settings(max_examples=200, deadline=None)
def test_expression_evaluator_matches_python(a, b):
    env = {"a": a, "b": b}
    assert _eval("cdiv(a, b)", env) == -(-a // b)
    assert _eval("a // b * b + a % b", env) == a
    assert _eval("round_up(a, b)", env) == -(-a // b) * b
    assert _eval("a % b == 0 and b > 0", env) == (a % b == 0)


def test_evaluator_rejects_code():
    with pytest.raises(ValueError):
        _eval("__import__('os')", {})


def test_spec_renders_text_and_markdown():
    txt, md = SPEC.text(), SPEC.markdown()
    assert "cache: uint8 [num_blocks, block_size, 68]" in txt
    assert "| `cache` | uint8 | `[num_blocks, block_size, 68]`" in md


def test_docs_layouts_are_up_to_date():
    r = subprocess.run([sys.executable, "-m", "dsv4", "layouts", "--check", "docs/layouts"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr + "\n(run: python -m dsv4 layouts --write docs/layouts)"


def test_every_op_has_a_documented_spec():
    from dsv4.registry import all_ops
    for op in all_ops():
        s = op.spec
        assert s.summary and s.inputs and (s.formula or s.notes), op.name
        assert (ROOT / "docs" / "layouts" / f"{op.name}.md").exists(), op.name
        for ts in s.inputs + s.outputs:
            assert ts.dtypes and ts.shape, (op.name, ts.name)


def test_spec_module_does_not_import_the_registry():
    """issue 17 item 5: dsv4/layout.py <-> dsv4/registry.py was an import circle (docs writing
    lived in the spec module); the registry imports the spec module, never the reverse."""
    import ast
    tree = ast.parse((ROOT / "dsv4" / "layout.py").read_text())
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            names.add((n.level, n.module or ""))
        elif isinstance(n, ast.Import):
            names.update((0, a.name) for a in n.names)
    assert not any(m in ("registry", "dsv4.registry", "layout_docs", "dsv4.layout_docs") for _, m in names), names
    r = subprocess.run([sys.executable, "-c", "import sys, dsv4.layout; print('dsv4.registry' in sys.modules)"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr

