"""Argument validation of the public ops and the CLI (CPU only, fast).

Every bad argument must raise before any launch with the documented exception type and a
message that names the argument (reviewer findings: empty quantize inputs, MoE router /
combine / forward / experts / permute arguments, indexer_topk's k, indexer_prefill_ranges,
new_compress_state, dequant_fp4's out_dtype, docstring sections, CLI --device / --inputs /
bench --help, README set-up).
"""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import formats as F
from dsv4.layout import LayoutError
from dsv4.ops import moe
from dsv4.ops.dequant_fp4 import dequant_fp4
from dsv4.ops.indexer import indexer_prefill_ranges, indexer_topk
from dsv4.ops.kv_cache import COMPRESS_RATIOS, new_compress_state
from dsv4.ops.quantize import quantize_fp8_block, quantize_mxfp4

ROOT = Path(__file__).resolve().parents[1]


def _raises(exc, names, fn, *a, **kw):
    """``fn`` raises exactly ``exc`` (or a subclass) and the message names every string in ``names``."""
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    msg = str(ei.value)
    for n in ([names] if isinstance(names, str) else names):
        assert n in msg, (n, msg)
    return msg


# ------------------------------------------------------------------------------ 1. empty quantize inputs
@pytest.mark.parametrize("shape", [(0, 64), (0, 256), (2, 0, 128), (0, 3, 64)])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_quantize_mxfp4_empty_input_gives_empty_outputs(shape, dt):
    x = torch.empty(shape, dtype=dt)
    data, scale = quantize_mxfp4(x)
    K = shape[-1]
    assert data.shape == (*shape[:-1], K // 2) and data.dtype == torch.uint8
    assert scale.shape == (*shape[:-1], K // 32) and scale.dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("shape", [(0, 128), (0, 512), (3, 0, 256)])
@pytest.mark.parametrize("block,fmt,sdt", [(128, "fp32", torch.float32), (64, "ue8m0", torch.float8_e8m0fnu),
                                           (32, "ue8m0", torch.float32)])
def test_quantize_fp8_block_empty_input_gives_empty_outputs(shape, block, fmt, sdt):
    x = torch.empty(shape, dtype=torch.bfloat16)
    q, s = quantize_fp8_block(x, block=block, scale_fmt=fmt, scale_dtype=sdt)
    K = shape[-1]
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn
    assert s.shape == (*shape[:-1], K // block) and s.dtype == sdt


def test_quantize_nonempty_unchanged_by_the_explicit_sizes():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 256, generator=g) * (1 + 30 * (torch.rand(256, generator=g) < 0.03))
    d, s = quantize_mxfp4(x)
    d0, s0 = F.quantize_mxfp4(x.reshape(15, 256))
    assert torch.equal(d.reshape(15, -1), d0) and torch.equal(s.reshape(15, -1).view(torch.uint8), s0.view(torch.uint8))
    q, qs = quantize_fp8_block(x, block=128)
    q0, qs0 = F.quantize_fp8_block(x.reshape(15, 256), 128, "fp32")
    assert torch.equal(q.reshape(15, -1).view(torch.uint8), q0.view(torch.uint8)) and torch.equal(qs.reshape(15, -1), qs0)


# ------------------------------------------------------------------------------ MoE fixtures
E, D, I, T = 4, 256, 128, 8


@pytest.fixture(scope="module")
def mw():
    g = torch.Generator().manual_seed(11)
    a13, s13 = F.quantize_mxfp4(torch.randn(E, 2 * I, D, generator=g) * 0.02)
    a2, s2 = F.quantize_mxfp4(torch.randn(E, D, I, generator=g) * 0.02)
    W = moe.moe_prepare_weights(a13, s13, a2, s2, fmt="mxfp4")
    x = torch.randn(T, D, generator=g)
    gw = torch.randn(E, D, generator=g) * 0.05
    idx, wt = moe.moe_route(x, gw, topk=2)
    return W, x, gw, idx, wt


# ------------------------------------------------------------------------------ 2. moe_route
@pytest.mark.parametrize("topk", [E + 1, 0, -1])
def test_moe_route_topk_out_of_range(mw, topk):
    _, x, gw, _, _ = mw
    _raises(ValueError, ["topk", f"{topk}"], moe.moe_route, x, gw, topk=topk)


@pytest.mark.parametrize("topk", [2.5, True, "2"])
def test_moe_route_topk_must_be_int(mw, topk):
    _, x, gw, _, _ = mw
    _raises(ValueError, ["topk", "int"], moe.moe_route, x, gw, topk=topk)


def test_moe_route_topk_equal_E_ok_and_route_scale_checked(mw):
    _, x, gw, _, _ = mw
    idx, w = moe.moe_route(x, gw, topk=E)
    assert idx.shape == (T, E) and torch.equal(idx.sort(1).values, torch.arange(E, dtype=torch.int32).expand(T, E))
    _raises(ValueError, "route_scale", moe.moe_route, x, gw, topk=2, route_scale=0.0)
    _raises(ValueError, "route_scale", moe.moe_route, x, gw, topk=2, route_scale="1.5")
    _raises(ValueError, "route_scale", moe.moe_route, x, gw, topk=2, route_scale=float("nan"))
    import numpy as np
    a = moe.moe_route(x, gw, topk=np.int64(2), route_scale=np.float32(1.5))
    b = moe.moe_route(x, gw, topk=2, route_scale=1.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_moe_route_hash_layer_shapes_and_debug_ranges(mw):
    _, x, gw, _, _ = mw
    V = 10
    tid2eid = torch.stack([torch.randperm(E)[:2] for _ in range(V)]).to(torch.int32)
    ids = torch.randint(0, V, (T,))
    idx, _ = moe.moe_route(x, gw, topk=2, input_ids=ids, tid2eid=tid2eid, debug_check=True)
    assert torch.equal(idx, tid2eid[ids])
    _raises(LayoutError, "tid2eid", moe.moe_route, x, gw, topk=3, input_ids=ids, tid2eid=tid2eid)
    _raises(LayoutError, "input_ids", moe.moe_route, x, gw, topk=2, input_ids=ids[:-1], tid2eid=tid2eid)
    _raises(LayoutError, "input_ids", moe.moe_route, x, gw, topk=2, input_ids=ids.float(), tid2eid=tid2eid)
    _raises(LayoutError, ["input_ids", "tid2eid"], moe.moe_route, x, gw, topk=2, tid2eid=tid2eid)
    bad_ids = ids.clone()
    bad_ids[3] = V
    _raises(ValueError, ["input_ids", f"V={V}"], moe.moe_route, x, gw, topk=2, input_ids=bad_ids, tid2eid=tid2eid,
            debug_check=True)
    _raises(ValueError, ["tid2eid", f"E={E}"], moe.moe_route, x, gw, topk=2, input_ids=ids, tid2eid=tid2eid + E,
            debug_check=True)
    assert "tid2eid" in moe.moe_route.__doc__ and "[0, E)" in moe.moe_route.__doc__


# ------------------------------------------------------------------------------ 3. moe_combine
def test_moe_combine_wrong_num_tokens_or_topk(mw):
    W, x, _, idx, wt = mw
    g = moe.moe_permute(x, idx, wt, E)
    y = torch.randn(g.a.shape[0], D)
    out = moe.moe_combine(y, g.pos, T, 2)
    assert out.shape == (T, D) and out.dtype == torch.float32
    _raises(LayoutError, ["'pos'", "num_tokens", f"[{T + 1} * 2]"], moe.moe_combine, y, g.pos, T + 1, 2)
    _raises(LayoutError, ["'pos'", "topk", f"[{T} * 3]"], moe.moe_combine, y, g.pos, T, 3)
    _raises(ValueError, "num_tokens", moe.moe_combine, y, g.pos, float(T), 2)
    _raises(ValueError, "topk", moe.moe_combine, y, g.pos, T, 0)
    _raises(LayoutError, "'pos'", moe.moe_combine, y, g.pos.int(), T, 2)
    _raises(LayoutError, "'y'", moe.moe_combine, y[0], g.pos, T, 2)


# ------------------------------------------------------------------------------ 4. moe_forward out_dtype
def test_moe_forward_out_dtype_must_be_floating(mw):
    W, x, gw, _, _ = mw
    _raises(ValueError, ["out_dtype", "int32"], moe.moe_forward, x, W, gw, topk=2, out_dtype=torch.int32)
    _raises(ValueError, "out_dtype", moe.moe_forward, x, W, gw, topk=2, out_dtype=torch.bool)
    _raises(TypeError, ["out_dtype", "torch.dtype", "str"], moe.moe_forward, x, W, gw, topk=2, out_dtype="float32")
    out = moe.moe_forward(x, W, gw, topk=2, out_dtype=torch.bfloat16, act="bf16")
    ref = moe.moe_forward(x, W, gw, topk=2, act="bf16")
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref.to(torch.bfloat16))


# ------------------------------------------------------------------------------ 5. experts / permute vs weights
def test_moe_forward_gate_weight_vs_weights(mw):
    W, x, gw, _, _ = mw
    gw8 = torch.randn(2 * E, D) * 0.05
    _raises(LayoutError, ["gate_weight", f"w.E = {E}"], moe.moe_forward, x, W, gw8, topk=2)


def test_moe_experts_weights_mismatch(mw):
    W, x, _, idx, wt = mw
    _raises(LayoutError, ["'w'", "w.E = 8"], moe.moe_experts, x, idx, wt, dataclasses.replace(W, E=8))
    _raises(LayoutError, ["'x'", f"w.D = {D}"], moe.moe_experts, x[:, :128].contiguous(), idx, wt, W)
    _raises(LayoutError, "'w'", moe.moe_experts, x, idx, wt, {"E": E})
    bad = idx.clone()
    bad[0, 0] = E
    _raises(ValueError, ["topk_idx", f"num_experts={E}"], moe.moe_experts, x, bad, wt, W, debug_check=True)


def test_moe_permute_arguments(mw):
    _, x, _, idx, wt = mw
    _raises(ValueError, "num_experts", moe.moe_permute, x, idx, wt, 0)
    _raises(ValueError, "num_experts", moe.moe_permute, x, idx, wt, 4.0)
    _raises(ValueError, ["topk_idx", "num_experts=2"], moe.moe_permute, x, idx, wt, 2, debug_check=True)
    _raises(LayoutError, "topk_idx", moe.moe_permute, x, idx.float(), wt, E)
    _raises(LayoutError, "topk_idx", moe.moe_permute, x, idx[:-1], wt[:-1], E)
    _raises(LayoutError, "topk_w", moe.moe_permute, x, idx, wt[:, :1], E)
    _raises(LayoutError, "'x'", moe.moe_permute, x.to(torch.int32), idx, wt, E)
    _raises(LayoutError, ["'x'", "D % 128"], moe.moe_permute, x[:, :64].contiguous(), idx, wt, E)
    _raises(ValueError, "max_m", moe.moe_permute, x, idx, wt, E, layout="masked")
    _raises(ValueError, "max_m", moe.moe_permute, x, idx, wt, E, layout="masked", max_m=0)
    g = moe.moe_permute(x, idx, wt, E, layout="masked", max_m=T, debug_check=True)
    assert g.row_start.shape == (E,) and int(g.row_count.sum()) == idx.numel()
    assert "[0, num_experts)" in moe.moe_permute.__doc__


def test_w13_tile_permutation():
    p = moe.w13_tile_permutation(256)
    assert p.dtype == torch.int64 and torch.equal(p.sort().values, torch.arange(512))
    assert p[:64].tolist() == list(range(64)) and p[64:128].tolist() == list(range(256, 320))
    for bad in (100, 0, 128.0):
        _raises(LayoutError, "I=", moe.w13_tile_permutation, bad)


# ------------------------------------------------------------------------------ 6. indexer_topk k
@pytest.mark.parametrize("k", [3.7, "4", True, 4.0, None])
def test_indexer_topk_k_must_be_int(k):
    lg = torch.randn(2, 64)
    ln = torch.full((2,), 64, dtype=torch.int32)
    _raises(ValueError, ["'k'", "int", type(k).__name__], indexer_topk, lg, ln, k)


def test_indexer_topk_int_k_ok_and_range():
    import numpy as np
    lg = torch.randn(2, 64)
    ln = torch.full((2,), 64, dtype=torch.int32)
    idx = indexer_topk(lg, ln, 4)
    assert idx.shape == (2, 4) and torch.equal(idx.long(), lg.topk(4, dim=1).indices)
    assert torch.equal(indexer_topk(lg, ln, np.int64(4)), idx)      # numpy integers are ints
    _raises(ValueError, "'k'", indexer_topk, lg, ln, 0)


# ------------------------------------------------------------------------------ 7. indexer_prefill_ranges
def test_indexer_prefill_ranges_arguments():
    _raises(ValueError, ["seq_lens", "-3"], indexer_prefill_ranges, [5, -3])
    _raises(ValueError, ["seq_lens", "float"], indexer_prefill_ranges, [5, 2.0])
    _raises(ValueError, "seq_lens", indexer_prefill_ranges, 5)
    _raises(ValueError, "ratio", indexer_prefill_ranges, [5, 3], ratio=0)
    _raises(ValueError, "ratio", indexer_prefill_ranges, [5, 3], ratio=4.0)
    ks, ke, pos = indexer_prefill_ranges([])
    assert ks.shape == ke.shape == pos.shape == (0,) and ks.dtype == torch.int32
    ks, ke, pos = indexer_prefill_ranges([9, 0, 5])
    assert ks.tolist() == [0] * 9 + [2] * 5
    assert ke.tolist() == [(p + 1) // 4 for p in range(9)] + [2 + (p + 1) // 4 for p in range(5)]
    assert pos.tolist() == list(range(9)) + list(range(5))


# ------------------------------------------------------------------------------ 8. new_compress_state
def test_new_compress_state_arguments():
    _raises(ValueError, ["ratio", "5"], new_compress_state, 2, 5, 512)
    _raises(ValueError, ["batch", "-2"], new_compress_state, -2, 4, 512)
    _raises(ValueError, "batch", new_compress_state, 2.0, 4, 512)
    _raises(ValueError, "head_dim", new_compress_state, 2, 4, 100)
    assert COMPRESS_RATIOS == (4, 128)
    for ratio, d, shape in [(4, 512, (2, 8, 1024)), (128, 128, (2, 128, 128)), (4, 128, (2, 8, 256))]:
        ks, ss = new_compress_state(2, ratio, d)
        assert ks.shape == ss.shape == shape and ks.dtype == torch.float32
        assert not ks.any() and bool((ss == float("-inf")).all())
    ks, ss = new_compress_state(0, 4, 512)
    assert ks.shape == (0, 8, 1024)


# ------------------------------------------------------------------------------ 9. dequant_fp4 out_dtype
def test_dequant_fp4_out_dtype_string_says_torch_dtype():
    d, s = F.quantize_mxfp4(torch.randn(4, 64))
    msg = _raises(TypeError, ["out_dtype", "torch.dtype", "str"], dequant_fp4, d, s, out_dtype="bfloat16")
    assert "'bfloat16'" in msg
    _raises(ValueError, "out_dtype", dequant_fp4, d, s, out_dtype=torch.float16)


# ------------------------------------------------------------------------------ 10. docstrings
DOCS = [(moe.moe_experts, ("Args:", "Returns:", "Raises:")), (moe.moe_combine, ("Args:", "Returns:", "Raises:")),
        (moe.moe_permute, ("Args:", "Returns:", "Raises:")), (moe.moe_forward, ("Args:", "Returns:", "Raises:")),
        (moe.moe_gemm2, ("Args:", "Returns:", "Raises:")), (moe.moe_route, ("Args:", "Returns:", "Raises:")),
        (moe.w13_tile_permutation, ("Args:", "Returns:", "Raises:")),
        (indexer_prefill_ranges, ("Args:", "Returns:", "Raises:")), (indexer_topk, ("Args:", "Returns:", "Raises:")),
        (new_compress_state, ("Args:", "Returns:", "Raises:"))]


@pytest.mark.parametrize("fn,sections", DOCS, ids=[f.__name__ for f, _ in DOCS])
def test_docstring_sections(fn, sections):
    doc = fn.__doc__ or ""
    for sec in sections:
        assert sec in doc, (fn.__name__, sec)


def test_indexer_cache_write_docstring_has_returns():
    from dsv4.ops.indexer import indexer_cache_write
    assert "Returns:" in indexer_cache_write.__doc__


# ------------------------------------------------------------------------------ 11. CLI
def dsv4(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dsv4", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("cmd", ["run", "ops"])
def test_cli_device_choices(cmd):
    r = dsv4(cmd, "--device", "mps")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--device" in r.stderr and "invalid choice" in r.stderr and "cpu" in r.stderr and "cuda" in r.stderr


def test_cli_ops_device_cpu_and_cuda_without_gpu():
    r = dsv4("ops", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    if not torch.cuda.is_available():
        r = dsv4("ops", "--device", "cuda")
        assert r.returncode == 2 and "no CUDA device" in r.stderr and "Traceback" not in r.stderr


def test_cli_bench_help_lists_benchmarks():
    r = dsv4("bench", "--help")
    assert r.returncode == 0, r.stderr
    names = sorted(p.stem[len("bench_"):] for p in (ROOT / "bench").glob("bench_*.py"))
    assert names
    for n in names:
        assert re.search(rf"^\s+{n}\s", r.stdout, re.M), (n, r.stdout)
    assert "dsv4 bench OP --help" in r.stdout


def test_cli_bench_own_help_without_gpu():
    r = dsv4("bench", "topk", "--help")
    assert r.returncode == 0 and "--json" in r.stdout and "Traceback" not in r.stderr
    r = dsv4("bench")
    assert r.returncode == 2 and "OP" in r.stderr


def _write_inputs(path, S=64, nan_key=None):
    from safetensors.torch import save_file
    from dsv4.data import attention_kv, indexer_inputs
    inp = indexer_inputs(1, S, seed=3)
    _, kv, _ = attention_kv(inp, seed=3)
    d = {"q": inp.q, "K": inp.k.unsqueeze(0), "w": inp.w, "kv": kv.unsqueeze(0)}
    if nan_key:
        t = d[nan_key].clone()
        t.view(-1)[::7] = float("nan")
        d[nan_key] = t
    save_file({k: v.contiguous() for k, v in d.items()}, str(path))


def test_cli_run_warns_on_nonfinite_inputs(tmp_path):
    f = tmp_path / "nan.safetensors"
    _write_inputs(f, nan_key="K")
    r = dsv4("run", "--no-progress", "--inputs", str(f))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING" in r.stderr and "non-finite" in r.stderr and "'K'" in r.stderr and "NaN" in r.stderr
    assert "'q'" not in r.stderr


def test_cli_run_clean_inputs_no_warning_and_trivial_recall_note(tmp_path):
    f = tmp_path / "ok.safetensors"
    _write_inputs(f, S=64)
    r = dsv4("run", "--no-progress", "--inputs", str(f), "--device", "cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING" not in r.stderr
    assert "trivially 1.0" in r.stdout and "top-512 >= 64" in r.stdout


def test_cli_run_small_context_says_recall_trivial():
    r = dsv4("run", "--no-progress", "--context", "256", "--batch", "1", "--device", "auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trivially 1.0" in r.stdout


# ------------------------------------------------------------------------------ 12. README
def test_readme_setup_two_commands_cpu_torch():
    text = (ROOT / "README.md").read_text()
    sec = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = sec.split("```bash", 1)[1].split("```", 1)[0]
    cmds = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(cmds) == 2, cmds
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in cmds[0]
    assert "pytest" in cmds[1]
    assert "skipped" in sec and "docs/configuration.md" in text


def test_ci_runs_the_readme_install_and_test_commands():
    """Issue 19 item 10: .ci/run runs exactly the README's two set-up commands (CPU torch index
    included), read from the README itself, and installs nothing else."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up", 1)[1].split("\n## ", 1)[0].split("```bash", 1)[1].split("```", 1)[0]
    want = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    r = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print-commands"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines() == want, (r.stdout, r.stderr, want)
    assert "--index-url https://download.pytorch.org/whl/cpu" in want[0] and "pytest" in want[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install" not in ci.replace("pip install` ", "")  # the only installs are the README's


def test_gpu_install_extra_and_docs():
    """Issue 19 item 11 (as far as a CPU allows): the cu13 extra pins the CuTe DSL's CUDA 13 libraries,
    cuda-bindings 13 and NVRTC 13; the README's GPU install uses it; the DSL provider's "unusable"
    reason names the same install."""
    import tomllib
    from kernels_dsl._compile import DSL_INSTALL_HINT
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cu13 = " ".join(extras["cu13"])
    assert "nvidia-cutlass-dsl[cu13]" in cu13 and "cuda-bindings>=13,<14" in cu13 and "nvidia-cuda-nvrtc>=13,<14" in cu13
    assert all("<13" in d for d in extras["cu12"] if not d.startswith("apache-tvm-ffi"))
    assert any(d.startswith("apache-tvm-ffi") for d in extras["cu13"])   # the DSL's fast call path
    readme = (ROOT / "README.md").read_text()
    gpu = readme.split("### GPU install", 1)[1].split("\n## ", 1)[0]
    assert "pip install -e '.[cu13]'" in gpu and "pip install -e '.[cu13]'" in DSL_INSTALL_HINT


def test_dsv4_ops_says_dsl_installed_but_unusable():
    """Issue 19 item 11: when the CuTe DSL is installed but its import fails (e.g. no CUDA flavor the
    driver supports), every dsl row of ``dsv4 ops`` says so, why, and the fix (before: "not importable")."""
    code = (
        "import sys, importlib.abc\n"
        "class F(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cutlass' or name.startswith('cutlass.'):\n"
        "            raise RuntimeError('None of the installed toolkit flavors (cu12) are compatible with the CUDA driver')\n"
        "sys.meta_path.insert(0, F())\n"
        "from dsv4.cli import main\n"
        "sys.exit(main(['ops']))\n")
    env = {**__import__("os").environ, "COLUMNS": "400"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    rows = [ln for ln in r.stdout.splitlines() if "│ dsl " in ln and "not implemented" not in ln]
    assert r.returncode == 0 and rows, (r.stdout[-2000:], r.stderr[-2000:])
    for ln in rows:
        assert "installed but unusable" in ln and "pip install -e '.[cu13]'" in ln and "toolkit flavors" in ln, ln


# ------------------------------------------------------------------------------ compressor value checks
def _compress_case(B_lens, ratio=4, d=512, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    T = sum(B_lens)
    kv = torch.randn(T, coff * d, generator=g)
    score = torch.randn(T, coff * d, generator=g)
    ape = torch.randn(ratio, coff * d, generator=g) * 0.5
    w = torch.rand(d, generator=g) + 0.5
    from dsv4.reference.rope import rope_cos_sin_table
    from dsv4.reference.kv_cache import TOKEN_BYTES
    return dict(kv=kv.to(device), score=score.to(device), ape=ape.to(device), w=w.to(device),
                table=rope_cos_sin_table(256, device=device),
                cache=torch.zeros(32, 4 * TOKEN_BYTES, dtype=torch.uint8, device=device))


def _compress_device_rule(dev, prefill, decode) -> dict:
    """The documented device-side behaviour of bad ``cu_seqlens`` / ``positions`` (what runs without
    ``debug_check`` on a GPU), by value: each bad call equals an equivalent clean call bit for bit.
    ``prefill(kv, score, ape, w, table, cu, bt, cache, ks, ss)`` / ``decode(...)`` run one provider."""
    res = {}
    c = _compress_case([40], device=dev)
    kv, score, ape, w, table = c["kv"], c["score"], c["ape"], c["w"], c["table"]
    i32 = dict(dtype=torch.int32, device=dev)
    bt = torch.arange(32, **i32).view(4, 8)
    # prefill: seq 1 decreasing (10 -> 5), seq 3 past T = 40: both empty; seqs 0 and 2 as alone
    cu = torch.tensor([0, 10, 5, 20, 47], **i32)
    cache = c["cache"].clone()
    ks, ss = new_compress_state(4, 4, 512, dev)
    prefill(kv, score, ape, w, table, cu, bt, cache, ks, ss)
    want = c["cache"].clone()
    wks, wss = new_compress_state(4, 4, 512, dev)
    prefill(kv, score, ape, w, table, torch.tensor([0, 10], **i32), bt[0:1], want, wks[0:1], wss[0:1])
    prefill(kv[5:20], score[5:20], ape, w, table, torch.tensor([0, 15], **i32), bt[2:3], want, wks[2:3], wss[2:3])
    res["prefill-bad-cu_seqlens"] = (torch.equal(cache, want) and torch.equal(ks, wks) and torch.equal(ss, wss)
                                     and int(cache.count_nonzero()) > 0)
    if not res["prefill-bad-cu_seqlens"]:      # details for the report
        res["prefill-diff"] = (f"cache bytes differing {int((cache != want).sum())}/{int((want != 0).sum())}, "
                               f"kv_state equal {torch.equal(ks, wks)}, score_state equal {torch.equal(ss, wss)}")
    # decode: -5 skips like -1; 10^9 + 3 and 2^40 + 3 (entry past the block table) update the state like
    # position 3 on a page -1 (no entry written)
    g = torch.Generator().manual_seed(5)
    ks0 = torch.randn(4, 8, 1024, generator=g).to(dev)
    ss0 = torch.randn(4, 8, 1024, generator=g).to(dev)
    kd, sd = kv[:4].contiguous(), score[:4].contiguous()
    out = {}
    for name, pos, table_rows in (("bad", [-5, 7, 10 ** 9 + 3, 2 ** 40 + 3], bt),
                                  ("clean", [-1, 7, 3, 3], torch.cat([bt[:2], torch.full((2, 8), -1, **i32)]))):
        cache, k1, s1 = c["cache"].clone(), ks0.clone(), ss0.clone()
        decode(kd, sd, ape, w, table, torch.tensor(pos, dtype=torch.int64, device=dev), table_rows, cache, k1, s1)
        out[name] = (cache, k1, s1)
    res["decode-bad-positions"] = all(torch.equal(a, b) for a, b in zip(out["bad"], out["clean"])) and \
        not torch.equal(out["bad"][1], ks0) and torch.equal(out["bad"][1][0], ks0[0])
    if not res["decode-bad-positions"]:
        res["decode-diff"] = "equal (cache, kv_state, score_state): " + str(
            [torch.equal(a, b) for a, b in zip(out["bad"], out["clean"])])
    return res


def _ref_calls():
    from dsv4.reference import kv_cache as R
    return (lambda kv, sc, ape, w, tb, cu, bt, c, ks, ss: R.kv_compress_prefill_ref(kv, sc, ape, w, tb, cu, bt, c, ks, ss),
            lambda kv, sc, ape, w, tb, p, bt, c, ks, ss: R.kv_compress_decode_ref(kv, sc, ape, w, tb, p, bt, c, ks, ss))


def test_kv_compress_bad_values_raise_on_cpu():
    """Issue 19 item 4: on CPU tensors the value checks are free, so bad positions / cu_seqlens raise
    ValueError naming the argument (before: accepted, or a bare IndexError from the reference)."""
    from dsv4.ops.kv_cache import kv_compress_decode, kv_compress_prefill
    c = _compress_case([40])
    bt = torch.arange(32, dtype=torch.int32).view(4, 8)
    ks, ss = new_compress_state(4, 4, 512)
    for pos, needle in (([-5, 0, 1, 2], "positions[0] = -5"), ([0, 10 ** 9, 1, 2], "positions[1] = 1000000000"),
                        ([0, 1, 2, 2 ** 40], "positions[3]")):
        _raises(ValueError, ["kv_compress_decode", "'positions'", needle], kv_compress_decode, c["kv"][:4],
                c["score"][:4], c["ape"], c["w"], c["table"], torch.tensor(pos), bt, c["cache"], ks, ss)
    for cu, needle in (([0, 10, 5, 20, 40], "cu_seqlens[2] = 5 after cu_seqlens[1] = 10"),
                       ([0, 10, 20, 30, 47], "cu_seqlens[4] = 47"), ([-2, 10, 20, 30, 40], "cu_seqlens[0] = -2")):
        _raises(ValueError, ["kv_compress_prefill", "'cu_seqlens'", needle, "T=40"], kv_compress_prefill, c["kv"],
                c["score"], c["ape"], c["w"], c["table"], torch.tensor(cu, dtype=torch.int32), bt, c["cache"])
    kv_compress_decode(c["kv"][:4], c["score"][:4], c["ape"], c["w"], c["table"], torch.tensor([-1, 0, 3, 127]), bt,
                       c["cache"], ks, ss)                                   # in range: accepted
    for fn, args in ((kv_compress_decode, (c["kv"][:4], c["score"][:4], c["ape"], c["w"], c["table"][:0],
                                           torch.tensor([-1, 0, 3, 127]), bt, c["cache"], ks, ss)),
                     (kv_compress_prefill, (c["kv"], c["score"], c["ape"], c["w"], c["table"][:0],
                                            torch.tensor([0, 10, 20, 30, 40], dtype=torch.int32), bt, c["cache"]))):
        _raises(LayoutError, ["'rope_cos_sin'", "0 rows"], fn, *args)   # a shape check: free on every device


def test_kv_compress_device_rule_reference_cpu():
    """The torch provider (what a GPU runs without debug_check) follows the documented rule for bad
    cu_seqlens / positions, by value (before: IndexError for cu_seqlens past T)."""
    res = _compress_device_rule("cpu", *_ref_calls())
    assert len(res) == 2 and all(v is True for v in res.values()), res


def _compress_child():
    import json
    from dsv4 import registry
    from dsv4.ops.kv_cache import kv_compress_decode, kv_compress_prefill
    res = {}
    for prov in ("cuda", "torch"):
        def pf(*a, prov=prov):
            with registry.use(kv_compress_prefill=prov):
                kv_compress_prefill(*a[:8], kv_state=a[8], score_state=a[9])

        def dc(*a, prov=prov):
            with registry.use(kv_compress_decode=prov):
                kv_compress_decode(*a)
        try:
            res.update({f"{k}-{prov}": v for k, v in _compress_device_rule("cuda", pf, dc).items()})
        except Exception as e:  # noqa: BLE001
            res[f"error-{prov}"] = f"{type(e).__name__}: {str(e)[:300]}"
    torch.cuda.synchronize()
    res["context-alive"] = torch.ones(4, device="cuda").sum().item() == 4.0
    print("KVC_JSON " + json.dumps(res))


@pytest.mark.gpu
def test_gpu_kv_compress_bad_values_device_rule_subprocess():
    """On CUDA tensors (no host sync, no debug_check): bad cu_seqlens / positions follow the documented
    device-side rule on the cuda kernels and the torch provider, by value, and the context survives
    (a child process: a device fault there is a failed test, not a dead test process)."""
    import json
    import os
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    r = subprocess.run([sys.executable, "-c", "import test_validation as t; t._compress_child()"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"child process died (rc={r.returncode}; a device fault?): {r.stderr[-3000:]}"
    res = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("KVC_JSON ")][-1][len("KVC_JSON "):])
    assert len(res) == 5 and all(v is True for v in res.values()), res


# ------------------------------------------------------------------------------ sanitizer subset
def test_sanitize_subset_covers_every_gpu_test_file():
    """Issue 19 item 14: every test file with a GPU test has a `sanitize` subset (tests/conftest.py
    SANITIZE, run by scripts/gpu_sanitize.sh), and every entry of the table names a collected GPU test."""
    import conftest
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = [ln.strip() for ln in r.stdout.splitlines() if "::" in ln]
    assert ids, r.stdout[-2000:] + r.stderr[-2000:]
    by_file: dict = {}
    for i in ids:
        f, name = i.split("::", 1)
        by_file.setdefault(Path(f).name, []).append(name)
    missing, stale = sorted(set(by_file) - set(conftest.SANITIZE)), sorted(set(conftest.SANITIZE) - set(by_file))
    assert not missing and not stale, (f"GPU test files without a sanitize subset: {missing} (add small-shape tests to "
                                       f"tests/conftest.py SANITIZE); table files without GPU tests: {stale}")
    for f, pats in conftest.SANITIZE.items():
        for p in pats:
            assert any(conftest.sanitize_selected(f, n) and (n == p or p.endswith("*")) for n in by_file[f]), \
                f"tests/conftest.py SANITIZE[{f!r}] entry {p!r} names no GPU test of {f} (renamed?)"
    script = (ROOT / "scripts" / "gpu_sanitize.sh").read_text()
    assert '-m "gpu and sanitize"' in script and all(t in script for t in ("memcheck", "racecheck", "synccheck"))
