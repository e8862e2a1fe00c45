"""Every benchmark module imports on a CPU machine (its main() runs only on a GPU) and uses the
shared timing helpers of bench/_util.py rather than a private copy."""
from __future__ import annotations

import ast
import importlib
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = sorted(p.stem for p in (ROOT / "bench").glob("bench_*.py"))
#: calls that make a function a private timing helper (only bench/_util.py may contain them)
TIMING_CALLS = ("torch.cuda.Event", "triton.testing.do_bench", "torch.cuda.CUDAGraph")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def private_timing_functions(src: str) -> list[str]:
    """``name (line): call`` for every function of ``src`` that calls a timing primitive itself
    (also via an alias: ``from torch.cuda import Event``, ``import triton.testing as tt``, a bare
    ``do_bench`` / ``Event`` / ``CUDAGraph`` name), plus module-level calls."""
    tree = ast.parse(src)
    tails = {c.rsplit(".", 1)[1] for c in TIMING_CALLS}
    aliases = {}   # local name -> dotted origin
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def is_timing(call: ast.Call) -> str | None:
        name = _dotted(call.func)
        if not name:
            return None
        head, _, rest = name.partition(".")
        full = aliases.get(head, head) + ("." + rest if rest else "")
        if full in TIMING_CALLS or full.rsplit(".", 1)[-1] in tails and (
                full.startswith(("torch", "triton")) or "." not in full):
            return full
        return None

    found = []

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{child.name} (line {child.lineno})")
                continue
            if isinstance(child, ast.Call):
                hit = is_timing(child)
                if hit:
                    found.append(f"{owner}: {hit}")
            visit(child, owner)

    visit(tree, "<module>")
    return found


def test_detector_finds_private_copies():
    src = ("import torch, statistics\nfrom triton.testing import do_bench\nimport triton.testing as tt\n"
           "def a(fn):\n    e = torch.cuda.Event(enable_timing=True)\n"
           "def b(fn):\n    return do_bench(fn)\n"
           "def c(fn):\n    return tt.do_bench(fn)\n"
           "def d(fn):\n    def inner():\n        torch.cuda.CUDAGraph()\n    return inner\n"
           "def ok(fn):\n    return time_cuda(fn)\n")
    hits = private_timing_functions(src)
    assert [h.split(" ")[0] for h in hits] == ["a", "b", "c", "inner"], hits


@pytest.mark.parametrize("name", BENCH)
def test_benchmark_imports_and_has_main(name):
    mod = importlib.import_module(f"bench.{name}")
    assert callable(getattr(mod, "main", None)), f"bench/{name}.py needs a main()"
    src = Path(mod.__file__).read_text()
    assert "def copy_bandwidth(" not in src, "use bench._util.copy_bandwidth"


@pytest.mark.parametrize("name", BENCH)
def test_benchmark_has_no_private_timing_copy(name):
    """Timing goes through bench/_util.py (time_cuda, time_graph, time_flush_l2): no function of a
    benchmark calls torch.cuda.Event, triton.testing.do_bench or torch.cuda.CUDAGraph itself."""
    hits = private_timing_functions((ROOT / "bench" / f"{name}.py").read_text())
    assert not hits, f"bench/{name}.py has private timing code (use bench/_util.py helpers): {hits}"


def test_save_json_writes_strict_json(tmp_path):
    from bench._util import save_json
    p = tmp_path / "sub" / "r.json"
    save_json(str(p), {"rows": [{"us": float("nan"), "t": (1.5, float("inf"))}], "bw": -float("inf"), "n": 3})
    text = p.read_text()
    assert "NaN" not in text and "Infinity" not in text
    d = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert d["rows"] == [{"us": None, "t": [1.5, None]}] and d["bw"] is None and d["n"] == 3 and "env" in d
    save_json(None, {"x": math.nan})   # no path: nothing written, no error


def test_bench_indexer_without_gpu_exits_with_message(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from bench import bench_indexer
    assert bench_indexer.main(["--quick"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
