"""CLI smoke tests on CPU: ops, layouts, bench dispatch, and `dsv4 run` (reference path)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dsv4(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsv4", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_ops_table_lists_every_op_and_reason():
    r = dsv4("ops", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    from dsv4.registry import all_ops
    names = {op.name for op in all_ops()}
    assert {row["op"] for row in rows} == names
    for row in rows:
        assert row["provider"] in ("dsl", "cuda", "torch") and row["reason"]
    # on a CPU machine every op with a torch provider chooses it
    chosen = {row["op"]: row["provider"] for row in rows if row["chosen"]}
    for n in names:
        assert chosen.get(n) == "torch", (n, chosen)


def test_ops_pretty_table():
    r = dsv4("ops", "dequant_fp4")
    assert r.returncode == 0 and "dequant_fp4" in r.stdout and "DSV4_OPS" in r.stdout


def test_ops_unknown_op_exit_2():
    """issue 19 item 5: `dsv4 ops nosuch` printed an empty table with exit 0."""
    r = dsv4("ops", "nosuch")
    assert r.returncode == 2 and "unknown op 'nosuch'" in r.stderr and "topk" in r.stderr
    assert "Traceback" not in r.stderr and "┃" not in r.stdout


def test_ops_bad_env_override_exit_2():
    import os
    r = subprocess.run([sys.executable, "-m", "dsv4", "ops"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DSV4_OPS="nosuchop=torch"))
    assert r.returncode == 2 and "unknown op 'nosuchop'" in r.stderr and "Traceback" not in r.stderr


def test_ops_verbose_explains_the_choice():
    r = dsv4("ops", "--verbose", "topk")
    assert r.returncode == 0, r.stderr
    assert "topk: dsl: not implemented" in r.stdout and "using torch: reference" in r.stdout
    assert "not implemented for this op" in r.stdout          # the table's reason for a missing kind


def test_layouts_prints_specs():
    r = dsv4("layouts", "dequant_fp4")
    assert r.returncode == 0
    assert "data: uint8 [M, Kp]" in r.stdout and "element 2i in the low nibble" in r.stdout


def test_layouts_unknown_op_fails():
    r = dsv4("layouts", "no_such_op")
    assert r.returncode == 2 and "unknown op" in r.stderr and "Traceback" not in r.stderr


def test_bench_unknown_op_exit_2():
    r = dsv4("bench", "no_such_op")
    assert r.returncode == 2 and "available" in r.stderr


# ------------------------------------------------------------------------------------------ dsv4 run
RUN_KEYS = {"config", "copy_bandwidth_gbps", "stages", "quality", "schema"}
STAGE_KEYS = {"name", "op", "provider", "reason", "time_us", "bytes", "flops", "roofline", "pct_roofline",
              "gbps", "tflops", "timing"}
STAGES = ["kv_cache_append", "indexer_cache_write", "indexer_q_quant", "indexer_logits_paged", "topk",
          "attn_lists", "sparse_attention"]
LAYER_STAGES = {"hca": ["kv_compress_prefill", "kv_cache_append", "attn_lists", "sparse_attention"],
                "swa": ["kv_cache_append", "attn_lists", "sparse_attention"]}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    r = dsv4("run", "--no-progress", "--json", str(d / "run.json"), "--plot", str(d / "run.png"))
    return r, d


def test_run_cpu_reference_path_prints_the_table(cpu_run):
    r, d = cpu_run
    assert r.returncode == 0, r.stderr[-2000:]
    assert "torch REFERENCE path" in r.stdout
    for s in STAGES:
        assert s in r.stdout
    assert "top-k recall" in r.stdout and "cosine" in r.stdout
    assert (d / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_json_schema_is_stable(cpu_run):
    _, d = cpu_run
    out = json.loads((d / "run.json").read_text())
    assert set(out) == RUN_KEYS and out["schema"] == 2
    assert out["config"]["reference_path"] is True and out["config"]["entries"] == out["config"]["context"] // 4
    assert out["config"]["layer"] == "csa"
    assert [s["name"] for s in out["stages"]] == STAGES
    for s in out["stages"]:
        assert set(s) == STAGE_KEYS and s["provider"] == "torch" and s["time_us"] > 0 and s["reason"]
        # issue 19 item 8: the reason says plainly what ran and why, not "skipped dsl: ... does not exist"
        assert s["reason"].startswith("torch: reference"), s["reason"]
        assert "skipped" not in s["reason"] and "does not exist" not in s["reason"], s["reason"]
    q = out["quality"]
    # the FP4 (MXFP4 + Hadamard) selection must be close to the FP32 one on the generated data
    assert 0.9 < q["topk_recall_mean"] <= 1.0 and 0.99 < q["attn_cosine_mean"] <= 1.0


@pytest.mark.parametrize("layer", ["hca", "swa"])
def test_run_other_layers_cpu(tmp_path, layer):
    """--layer hca (compressor + attention over every compressed entry) and swa (window only)."""
    r = dsv4("run", "--no-progress", "--layer", layer, "--context", "2048", "--next-n", "2", "--json",
             str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{layer.upper()} layer" in r.stdout and "cosine" in r.stdout and "top-k recall" not in r.stdout
    out = json.loads((tmp_path / "o.json").read_text())
    assert [s["name"] for s in out["stages"]] == LAYER_STAGES[layer]
    assert out["config"]["layer"] == layer
    assert out["config"]["entries"] == (2048 // 128 if layer == "hca" else 0)
    assert out["quality"]["topk_recall_mean"] is None
    assert 0.999 < out["quality"]["attn_cosine_mean"] <= 1.0
    for s in out["stages"]:
        assert set(s) == STAGE_KEYS and s["time_us"] > 0 and s["reason"]


def test_run_inputs_only_for_csa(tmp_path):
    f = tmp_path / "cap.safetensors"
    _write_inputs(f)
    r = dsv4("run", "--no-progress", "--layer", "swa", "--inputs", str(f))
    assert r.returncode == 2 and "--inputs" in r.stderr and "--layer swa" in r.stderr


def _write_inputs(path, B=1, S=512, next_n=1, drop=None, bad_shape=None):
    from safetensors.torch import save_file
    from dsv4.data import attention_kv, indexer_inputs
    inp = indexer_inputs(next_n, S, seed=3)
    _, kv, _ = attention_kv(inp, seed=3)
    d = {"q": inp.q.repeat(B, 1, 1), "K": inp.k.unsqueeze(0).repeat(B, 1, 1), "w": inp.w.repeat(B, 1),
         "kv": kv.unsqueeze(0).repeat(B, 1, 1)}
    if drop:
        d.pop(drop)
    if bad_shape:
        d[bad_shape] = d[bad_shape][..., :-1].contiguous()
    save_file({k: v.contiguous() for k, v in d.items()}, str(path))


def test_run_with_inputs_file(tmp_path):
    f = tmp_path / "cap.safetensors"
    _write_inputs(f, B=2, S=512, next_n=2)
    r = dsv4("run", "--no-progress", "--inputs", str(f), "--json", str(tmp_path / "o.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "o.json").read_text())["config"]
    assert (cfg["batch"], cfg["next_n"], cfg["entries"]) == (2, 2, 512)


@pytest.mark.parametrize("drop,bad,needle", [
    ("K", None, "missing 'K'"),
    ("w", None, "missing 'w'"),
    (None, "kv", "'kv' has shape"),
    (None, "q", "'q' has shape"),
])
def test_bad_inputs_file_is_a_clear_error_exit_2(tmp_path, drop, bad, needle):
    f = tmp_path / "bad.safetensors"
    _write_inputs(f, drop=drop, bad_shape=bad)
    r = dsv4("run", "--no-progress", "--inputs", str(f))
    assert r.returncode == 2, (r.returncode, r.stderr[-1000:])
    assert needle in r.stderr and "Required keys" in r.stderr


@pytest.mark.parametrize("extra,needle", [
    ({"sink": (7,)}, "'sink' has shape [7], expected [64]"),
    ({"q_attn": (1, 32, 512)}, "'q_attn' has shape [1, 32, 512], expected [1, 64, 512]"),
    ({"kv_swa": (1, 64, 512)}, "'kv_swa' has shape [1, 64, 512], expected [1, 128, 512]"),
])
def test_bad_optional_inputs_are_a_clear_error_exit_2(tmp_path, extra, needle):
    import torch
    from safetensors.torch import load_file, save_file
    f = tmp_path / "opt.safetensors"
    _write_inputs(f)
    d = load_file(str(f))
    d.update({k: torch.zeros(shape) for k, shape in extra.items()})
    save_file(d, str(f))
    r = dsv4("run", "--no-progress", "--inputs", str(f))
    assert r.returncode == 2, (r.returncode, r.stderr[-1000:])
    assert needle in r.stderr, r.stderr[-1000:]


def test_inputs_file_not_safetensors(tmp_path):
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"definitely not safetensors")
    r = dsv4("run", "--inputs", str(f))
    assert r.returncode == 2 and "not a readable safetensors file" in r.stderr
    r = dsv4("run", "--inputs", str(tmp_path / "missing.safetensors"))
    assert r.returncode == 2 and "no such file" in r.stderr


def test_bench_without_gpu_is_a_clear_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    r = dsv4("bench", "topk")
    assert r.returncode == 2 and "need a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [(["--batch", "0"], "--batch must be >= 1"),
                                         (["--context", "100"], "--context must be a multiple")])
def test_run_bad_sizes_exit_2(args, needle):
    r = dsv4("run", "--no-progress", *args)
    assert r.returncode == 2 and needle in r.stderr


def test_version():
    r = dsv4("--version")
    assert r.returncode == 0 and "dsv4-kernels" in r.stdout


# ----------------------------------------------------------------------------- issue 19 items 6, 7
@pytest.mark.parametrize("flag,path,needle", [
    ("--json", "/nonexistent_dir_xyz/out.json", "does not exist"),
    ("--json", "out.txt", "must end in .json"),
    ("--plot", "out.jpg", "must end in .png / .svg / .pdf"),
    ("--plot", "/nonexistent_dir_xyz/p.png", "does not exist"),
])
def test_run_checks_output_paths_before_running(tmp_path, flag, path, needle):
    """A bad --json / --plot path used to end in a traceback after the whole run."""
    p = path if path.startswith("/") else str(tmp_path / path)
    r = dsv4("run", "--no-progress", "--context", "256", "--batch", "1", flag, p, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]
    assert "dsv4 run: DSV4" not in r.stdout                      # nothing ran


def test_run_unwritable_output_dir(tmp_path):
    import os
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        if os.access(d, os.W_OK):
            pytest.skip("running as a user that can write anywhere (root)")
        r = dsv4("run", "--no-progress", "--json", str(d / "o.json"), timeout=60)
        assert r.returncode == 2 and "not writable" in r.stderr
    finally:
        d.chmod(0o700)


def test_run_inputs_with_no_entries_is_a_clear_error(tmp_path):
    """S = 0 (and S below one page) used to end in a traceback."""
    import torch
    from safetensors.torch import save_file
    f = tmp_path / "empty.safetensors"
    save_file({"q": torch.zeros(1, 64, 128), "K": torch.zeros(1, 0, 128), "w": torch.zeros(1, 64),
               "kv": torch.zeros(1, 0, 512)}, str(f))
    r = dsv4("run", "--no-progress", "--inputs", str(f))
    assert r.returncode == 2 and "'K' has shape [1, 0, 128]" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_run_inputs_override_of_sizes_is_said_on_stderr(tmp_path):
    f = tmp_path / "cap.safetensors"
    _write_inputs(f, B=1, S=512)
    r = dsv4("run", "--no-progress", "--inputs", str(f), "--context", "4096", "--batch", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--inputs sets the batch, context and next_n from the file" in r.stderr
    assert "--context 4096" in r.stderr and "--batch 3" in r.stderr and "batch 1 x next_n 1" in r.stdout


def test_run_help_states_the_context_rule():
    r = dsv4("run", "--help")
    assert r.returncode == 0 and ">= 256" in r.stdout and "multiple of 4" in r.stdout


def _fake_result(on_gpu):
    from dsv4.pipeline import LayerResult, StageResult
    st = [StageResult("kv_cache_append", "kv_cache_append", "cuda", "cuda: sm_90a", 1.0, 1e6, 0.0, "bw", 61.5, 1e3),
          StageResult("sparse_attention", "sparse_attention", "dsl", "dsl: sm_90a", 300_000.0, 1e6, 1e12, "flops",
                      12.25, 3.3, 3.3)]
    return LayerResult({}, "dsv4 run: test banner", on_gpu, 4000.0, st, {})


@pytest.mark.parametrize("on_gpu", [False, True])
def test_plot_labels_values_and_says_when_no_roofline(tmp_path, on_gpu):
    """issue 19 item 7: bars carry their values, the time axis is logarithmic (a 1 us stage stays
    visible next to 300 ms), and a CPU run says on the figure that no roofline applies."""
    import matplotlib
    from dsv4 import cli
    matplotlib.rcParams["svg.fonttype"] = "none"           # text stays text in the SVG
    path = tmp_path / "p.svg"
    cli.plot_result(_fake_result(on_gpu), str(path))
    svg = path.read_text()
    assert "1.0 us" in svg and "300.00 ms" in svg and "log scale" in svg
    if on_gpu:
        assert "61.5% BW" in svg and "12.2% BF16" in svg and "no roofline" not in svg
    else:
        assert "no roofline on a CPU run" in svg and "not applicable (CPU)" in svg


def test_bench_eager_runs_on_cpu(tmp_path):
    """bench/bench_eager.py (issue 17 item 1) measures the library's own host time on a CPU machine."""
    r = dsv4("bench", "eager", "--lib-only", "--ops", "moe_combine,quantize_mxfp4", "--json", str(tmp_path / "e.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "eager host time per call" in r.stdout and "moe_combine" in r.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert {row["op"] for row in rows if "lib_us" in row} == {"moe_combine", "quantize_mxfp4"}
    assert all(row["lib_us"] > 0 for row in rows if "lib_us" in row)
