"""Every benchmark module imports on a CPU machine (its main() runs only on a GPU) and uses the
shared timing helpers of bench/_util.py rather than a private copy."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "bench").glob("bench_*.py"))


@pytest.mark.parametrize("name", BENCH)
def test_benchmark_imports_and_has_main(name):
    mod = importlib.import_module(f"bench.{name}")
    assert callable(getattr(mod, "main", None)), f"bench/{name}.py needs a main()"
    src = Path(mod.__file__).read_text()
    assert "def copy_bandwidth(" not in src, "use bench._util.copy_bandwidth"
    assert "CUDAGraph()" not in src, "use bench._util.time_graph / time_cuda(graph=True)"
