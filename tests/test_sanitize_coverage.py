"""Issue 19 item 14: the compute-sanitizer runs (scripts/gpu_sanitize.sh) cover every kernel.

CPU checks: scripts/sanitize_kernels.py ``KERNELS`` lists exactly the kernels found in the sources
(CuTe DSL ``compile_cached`` keys, NVRTC ``extern "C"`` kernels), each mapped to a GPU test file that
has a ``sanitize`` subset (tests/conftest.py ``SANITIZE``); the plugin's shard filter partitions a
selection; the mbarrier ring probe compiles with the shared common.cuh helpers. On the GPU the plain
runs of gpu_sanitize.sh record the kernels each subset really launched and report missing ones.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def _mod(name):
    return importlib.import_module(name)


def test_kernel_table_is_every_kernel_of_the_sources():
    sk = _mod("sanitize_kernels")
    found = sk.source_kernels()
    assert len(found) >= 24, sorted(found)
    assert not found - set(sk.KERNELS), f"kernels with no sanitize coverage entry in scripts/sanitize_kernels.py " \
                                        f"KERNELS: {sorted(found - set(sk.KERNELS))}"
    assert not set(sk.KERNELS) - found, f"KERNELS entries no source defines (renamed?): {sorted(set(sk.KERNELS) - found)}"


def test_every_kernel_maps_to_a_file_with_a_sanitize_subset():
    import conftest
    sk = _mod("sanitize_kernels")
    bad = {k: f for k, f in sk.KERNELS.items() if not conftest.SANITIZE.get(f) or not (ROOT / "tests" / f).exists()}
    assert not bad, f"KERNELS entries whose test file has no sanitize subset: {bad}"


def test_source_scan_sees_both_kinds(tmp_path, monkeypatch):
    """The scan's patterns match the forms used in the sources: a DSL key tuple or ``key = (...)``, a
    ``__launch_bounds__(...)`` or a bounds macro before the NVRTC kernel's name."""
    sk = _mod("sanitize_kernels")
    found = sk.source_kernels()
    assert {"dsl:indexer_paged", "dsl:moe_route", "cuda:moe_decode_kernel", "cuda:kv_compress_prefill_kernel"} <= found
    cu = tmp_path / "kernels_cuda"
    cu.mkdir()
    (cu / "x.cu").write_text('extern "C" __global__ void QK_BOUNDS probe_kernel(int* p) {}\n'
                             'extern "C" __global__ void __launch_bounds__(256, 2) other_kernel(int* p) {}\n')
    (tmp_path / "kernels_dsl").mkdir()
    monkeypatch.setattr(sk, "ROOT", tmp_path)
    assert sk.source_kernels() == {"cuda:probe_kernel", "cuda:other_kernel"}


def test_shard_filter_partitions_a_selection():
    sk = _mod("sanitize_kernels")

    class Hook:
        def __init__(self):
            self.dropped = []

        def pytest_deselected(self, items):
            self.dropped += items

    class Cfg:
        hook = Hook()

    import os
    seen = []
    old = os.environ.get("SANITIZE_SHARD")
    try:
        for k in range(3):
            os.environ["SANITIZE_SHARD"] = f"{k}/3"
            items = list(range(10))
            sk.pytest_collection_modifyitems(Cfg(), items)
            seen += items
    finally:
        if old is None:
            os.environ.pop("SANITIZE_SHARD", None)
        else:
            os.environ["SANITIZE_SHARD"] = old
    assert sorted(seen) == list(range(10))


def test_mbarrier_probe_compiles_with_the_shared_helpers():
    pytest.importorskip("cuda.bindings")
    probe = _mod("sanitize_mbarrier_probe")
    from kernels_cuda import nvrtc
    opts = ["--gpu-architecture=sm_90a", "-std=c++17", "--device-as-default-execution-space", f"-I{nvrtc.KERNEL_DIR}"]
    ptx = nvrtc._nvrtc_compile(probe.SRC, "mbar_probe.cu", opts, "ptx").decode()
    assert sorted(probe.VARIANTS.values()) == list(range(11))
    for v in probe.VARIANTS.values():
        assert f".entry mbar_probe_{v}(" in ptx
    # the moe_decode protocol: the same inline-PTX mbarrier ops (common.cuh), a warp sync before lane 0 arrives
    for op in ("mbarrier.init.shared::cta.b64", "mbarrier.arrive.shared::cta.b64",
               "mbarrier.try_wait.parity.shared::cta.b64", "bar.warp.sync", "fence.proxy.async.shared::cta",
               "bar.arrive 1, 160", "bar.sync 2, 160", "bar.arrive 1, 128", "bar.sync 3, 128"):
        assert op in ptx, op
    assert probe.expected(2).shape == (256,) and not probe.expected(1, "partial")[:64].any()
    # single / mbar (sparse attention's single sScale buffer): warps 2-3 read the 64 words, g * 100 + index
    assert not probe.expected(1, "single")[:64].any() and probe.expected(1, "mbar")[:64].all()
    assert int(probe.expected(1, "single")[64]) == sum(2 * g * 100 + 0 + 7 for g in range(probe.ROUNDS))


def test_sanitize_script_runs_the_three_tools_the_plugin_and_the_probe():
    s = (ROOT / "scripts" / "gpu_sanitize.sh").read_text()
    assert '-m "gpu and sanitize"' in s and "-p sanitize_kernels" in s
    assert all(t in s for t in ("memcheck", "racecheck", "synccheck", "--report-api-errors no"))
    assert "sanitize_mbarrier_probe.py" in s and "sanitize_kernels.py report" in s
    probe = _mod("sanitize_mbarrier_probe")
    for line in s.splitlines():                     # every probe variant runs and is reported
        if line.strip().startswith("for v in "):
            assert sorted(line.split("for v in ")[1].split(";")[0].split()) == sorted(probe.VARIANTS), line


def test_sanitize_script_writes_the_table_to_summary_txt_and_prints_it_last():
    """The count table goes to $LOG/../summary.txt and is the last output (a transfer that keeps only the
    tail of the log lost it when the coverage / probe / record sections came after it)."""
    s = (ROOT / "scripts" / "gpu_sanitize.sh").read_text()
    assert 'SUM=$LOG/../summary.txt' in s
    code = [ln.strip() for ln in s.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert code[-1] == "exit $bad" and code[-2].startswith("echo; cat \"$SUM\""), code[-3:]
    head = s.index('"file (sanitize subset)"')
    assert s[head - 200:head + 200].count('> "$SUM"') == 1          # the header starts the file
    assert s.count('>> "$SUM"') == 2                               # the rows and the total line


def test_plugin_records_dsl_cache_keys_of_both_forms(tmp_path, monkeypatch):
    """The launch record reads kernels_dsl._compile._cache: plain keys and (key, call-path) keys."""
    import json
    import types
    sk = _mod("sanitize_kernels")
    fake = types.SimpleNamespace(_cache={(("dequant_fp4", "mxfp4"), False): 1, ("fp8_gemm", "bf16"): 2, "junk": 3})
    monkeypatch.setitem(sys.modules, "kernels_dsl._compile", fake)
    monkeypatch.setattr(sk, "_seen_cuda", {"topk_kernel"})
    out = tmp_path / "x.kernels.json"
    monkeypatch.setenv("SANITIZE_KERNELS_OUT", str(out))
    sk.pytest_sessionfinish(None, 0)
    assert json.loads(out.read_text()) == ["cuda:topk_kernel", "dsl:dequant_fp4", "dsl:fp8_gemm"]
    assert sk.report(str(tmp_path)) == 1          # most KERNELS entries not launched: reported
