"""dsv4/config.py: the environment-variable table, its validated readers, docs/configuration.md,
and that every DSV4_* variable read anywhere in the tree is registered (CPU only)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4 import config
from dsv4.config import VARS, env_choice, env_flag, env_int, env_str

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
_NAME = re.compile(r"^DSV4_[A-Z0-9_]*[A-Z0-9]$")
#: library files that still read DSV4_* variables with os.environ directly (everything else must go
#: through dsv4.config): DSV4_OPS parsing (registry), import-time arch (target), the NVRTC cache dir
#: (nvrtc.py, shared), and the indexer (owned by another change; its variables are in the table).
_DIRECT_READERS = {"dsv4/registry.py": {"DSV4_OPS"}, "dsv4/target.py": {"DSV4_COMPILE_ARCH"},
                   "kernels_cuda/nvrtc.py": {"DSV4_CACHE_DIR"}}


@pytest.fixture
def clean_env(monkeypatch):
    """No DSV4_* variable set (the test sets what it needs)."""
    for k in list(os.environ):
        if k.startswith("DSV4_"):
            monkeypatch.delenv(k)
    return monkeypatch


def _py_files():
    for d in ("dsv4", "kernels_cuda", "kernels_dsl", "bench", "tests"):
        yield from sorted((ROOT / d).rglob("*.py"))


def _names_in_py(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and _NAME.match(n.value)}


def _cu_macros() -> set[str]:
    """DSV4_* preprocessor macros of the .cu / .cuh sources (passed to NVRTC, not environment variables)."""
    out = set()
    for p in sorted((ROOT / "kernels_cuda").glob("*.cu*")):
        out |= set(re.findall(r"#\s*(?:ifndef|ifdef|define)\s+(DSV4_[A-Z0-9_]+)", p.read_text()))
    return out


def _names_in_scripts() -> set[str]:
    out = set()
    for p in sorted((ROOT / "scripts").glob("*.sh")):
        out |= set(re.findall(r"\bDSV4_[A-Z0-9_]+\b", p.read_text()))
    return out


# ------------------------------------------------------------------------------ table and docs
def test_docs_configuration_is_up_to_date():
    assert not config.write_config_doc(str(DOC), check=True), \
        "docs/configuration.md is stale: run python -m dsv4.config --write docs/configuration.md"


def test_check_cli_reports_stale(tmp_path):
    p = tmp_path / "c.md"
    assert config.main(["--check", str(p)]) == 1
    assert config.main(["--write", str(p)]) == 0 and p.read_text() == config.render_markdown()
    assert config.main(["--check", str(p)]) == 0


def test_every_variable_read_in_the_tree_is_registered():
    """Any string constant DSV4_* in Python code (library, benchmarks, tests) or in scripts/*.sh is a
    registered variable (.cu macros such as DSV4_QJ excluded)."""
    used: dict[str, str] = {}
    for p in _py_files():
        if p.name == "test_config.py":
            continue
        for n in _names_in_py(p):
            used.setdefault(n, str(p.relative_to(ROOT)))
    for n in _names_in_scripts():
        used.setdefault(n, "scripts/*.sh")
    macros = _cu_macros()
    assert {"DSV4_QJ", "DSV4_FMT", "DSV4_OUT"} <= macros
    missing = {n: where for n, where in used.items() if n not in VARS and n not in macros}
    assert not missing, f"add these to dsv4.config.VARS: {missing}"


def test_every_registered_variable_is_used():
    used = set(_names_in_scripts())
    for p in _py_files():
        if p.name in ("config.py", "test_config.py"):
            continue
        used |= _names_in_py(p)
    assert set(VARS) - used == set(), "stale VARS entries (nothing reads them)"


def test_library_reads_go_through_config():
    """No os.environ / os.getenv read of a DSV4_* name in dsv4/, kernels_cuda/, kernels_dsl/ outside
    dsv4/config.py and the listed direct readers."""
    bad = []
    for d in ("dsv4", "kernels_cuda", "kernels_dsl"):
        for p in sorted((ROOT / d).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            if rel == "dsv4/config.py":
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                name = None
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
                    f = ast.unparse(node.func)
                    if f in ("os.environ.get", "os.getenv", "environ.get") and isinstance(node.args[0], ast.Constant):
                        name = node.args[0].value
                elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
                    if isinstance(node.slice, ast.Constant):
                        name = node.slice.value
                if isinstance(name, str) and name.startswith("DSV4_") and name not in _DIRECT_READERS.get(rel, ()):
                    bad.append(f"{rel}:{node.lineno} {name}")
    assert not bad, f"read these through dsv4.config (env_int / env_flag / env_choice / env_str): {bad}"


def test_table_entries_are_well_formed():
    for name, v in VARS.items():
        assert v.type in ("flag", "int", "choice", "str"), name
        assert v.doc and v.doc.strip().endswith((".", ")")), name
        if v.type == "flag":
            assert v.allowed == (0, 1) and v.default in (0, 1), name
        if v.type in ("int", "choice") and v.default is not None:
            assert v.default in v.allowed, name
        if v.default is None:
            assert "default" in v.doc, f"{name}: a computed default must be described in the doc"


def test_defaults_are_unchanged():
    """The defaults the code had before the table (a change here changes behaviour: deliberate only)."""
    expected = {
        "DSV4_PRINT_LAYOUTS": 0, "DSV4_DSL_DISK_CACHE": 1, "DSV4_COMPILE_ARCH": "sm_90a",
        "DSV4_QUANT_FUSED_MAX_CHUNKS": 4096, "DSV4_QUANT_L2_KEEP_MB": 32, "DSV4_QUANT_REVERSE": 1,
        "DSV4_MOE_DECODE": 1, "DSV4_MOE_DECODE_MAXM": 16, "DSV4_MOE_DECODE_MMA": 1, "DSV4_MOE_DECODE_BULK": 0,
        "DSV4_MOE_DECODE_L2PF": 256, "DSV4_MOE_DECODE_STAGES": None, "DSV4_MOE_DECODE_NWG": 2,
        "DSV4_MOE_DECODE_SPLITK": 4,
    }
    assert {k: VARS[k].default for k in expected} == expected
    from kernels_cuda import moe_decode, quantize
    assert (moe_decode.DECODE_MAX_M, moe_decode.DECODE_MMA, moe_decode.DECODE_BULK, moe_decode.DECODE_L2PF,
            moe_decode.DECODE_SPLITK) == (16, 1, 0, 256, 4)
    if not any(k.startswith("DSV4_QUANT_") for k in os.environ):
        assert (quantize.TUNING["fused_max_chunks"], quantize.TUNING["l2_keep_bytes"], quantize.TUNING["reverse"]) \
            == (4096, 32 << 20, 1)


# ------------------------------------------------------------------------------ readers
def test_readers_defaults_and_values(clean_env):
    assert env_int("DSV4_MOE_DECODE_L2PF") == 256
    assert env_int("DSV4_MOE_DECODE_STAGES", None) is None and env_int("DSV4_MOE_DECODE_STAGES", 3) == 3
    assert env_flag("DSV4_MOE_DECODE") is True and env_flag("DSV4_PRINT_LAYOUTS") is False
    assert env_str("DSV4_CACHE_DIR") is None and env_str("DSV4_CACHE_DIR", "x") == "x"
    clean_env.setenv("DSV4_MOE_DECODE_L2PF", "64")
    clean_env.setenv("DSV4_MOE_DECODE", "0")
    clean_env.setenv("DSV4_CACHE_DIR", "/tmp/c")
    assert env_int("DSV4_MOE_DECODE_L2PF") == 64 and env_flag("DSV4_MOE_DECODE") is False
    assert env_str("DSV4_CACHE_DIR") == "/tmp/c"
    assert env_choice("DSV4_CACHE_DIR", "/x", ("/x", "/tmp/c")) == "/tmp/c"   # explicit choices
    with pytest.raises(ValueError, match="DSV4_CACHE_DIR"):
        env_choice("DSV4_CACHE_DIR", "/x", ("/x", "/y"))
    for k in ("DSV4_MOE_DECODE_L2PF", "DSV4_MOE_DECODE", "DSV4_CACHE_DIR"):
        clean_env.setenv(k, "")                       # empty = unset = the default
    assert env_int("DSV4_MOE_DECODE_L2PF") == 256 and env_flag("DSV4_MOE_DECODE") is True
    assert env_choice("DSV4_CACHE_DIR", "/x", ("/x", "/y")) == "/x"


@pytest.mark.parametrize("name,value,reader", [
    ("DSV4_MOE_DECODE_L2PF", "100", env_int), ("DSV4_MOE_DECODE_L2PF", "big", env_int),
    ("DSV4_MOE_DECODE_MMA", "2", env_int), ("DSV4_QUANT_FUSED_MAX_CHUNKS", "-1", env_int),
    ("DSV4_MOE_DECODE", "false", env_flag), ("DSV4_MOE_DECODE", "2", env_flag),
])
def test_readers_reject_bad_values_naming_the_variable(clean_env, name, value, reader):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError) as e:
        reader(name)
    msg = str(e.value)
    assert name in msg and repr(value) in msg
    allowed = VARS[name].allowed
    if reader is env_flag:
        assert "0 or 1" in msg
    elif reader is env_choice:
        assert all(repr(a) in msg for a in allowed)
    else:
        assert config._fmt_allowed(allowed) in msg


def test_unregistered_name_is_refused(clean_env):
    with pytest.raises(KeyError, match="VARS"):
        env_int("DSV4_NOT_A_VARIABLE", 1)


# ------------------------------------------------------------------------------ MoE call sites
@pytest.mark.parametrize("name,value", [
    ("DSV4_MOE_DECODE", "no"), ("DSV4_MOE_DECODE_MAXM", "abc"), ("DSV4_MOE_DECODE_MAXM", "32"),
    ("DSV4_MOE_DECODE_NWG", "3"), ("DSV4_MOE_DECODE_STAGES", "1"), ("DSV4_MOE_DECODE_BULK", "2"),
    ("DSV4_MOE_DECODE_MMA", "x"), ("DSV4_MOE_DECODE_L2PF", "100"), ("DSV4_MOE_DECODE_SPLITK", "3"),
])
def test_moe_decode_plan_validates(clean_env, name, value):
    from kernels_cuda import moe_decode
    clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        moe_decode.plan(256, 256, 4096, 4096, "fp8", "mxfp4", 1)   # stage 1 FP8 still validates NWG


def test_moe_decode_plan_overrides(clean_env):
    from kernels_cuda import moe_decode
    P = lambda: moe_decode.plan(256, 256, 4096, 2048, "bf16", "mxfp4", 2)  # noqa: E731
    p = P()
    assert (p["mma"], p["bulk"], p["l2pf"], p["splitk"], p["nwg"]) == (1, 0, 256, 4, 2)
    for k, v in (("DSV4_MOE_DECODE_MMA", "0"), ("DSV4_MOE_DECODE_BULK", "1"), ("DSV4_MOE_DECODE_L2PF", "0"),
                 ("DSV4_MOE_DECODE_SPLITK", "1"), ("DSV4_MOE_DECODE_NWG", "1"), ("DSV4_MOE_DECODE_STAGES", "3")):
        clean_env.setenv(k, v)
    p = P()
    assert (p["mma"], p["bulk"], p["l2pf"], p["splitk"], p["nwg"], p["stages"]) == (0, 1, 0, 1, 1, 3)
    clean_env.setenv("DSV4_MOE_DECODE", "0")
    assert P() is None


# ------------------------------------------------------------------------------ other call sites
@pytest.mark.parametrize("module,name,value", [
    ("kernels_cuda.quantize", "DSV4_QUANT_L2_KEEP_MB", "lots"),
    ("kernels_cuda.quantize", "DSV4_QUANT_REVERSE", "yes"),
])
def test_import_time_variables_validate(module, name, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV4_")}
    env.update({name: value, "PYTHONPATH": str(ROOT)})
    r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "ValueError" in r.stderr and name in r.stderr, r.stderr[-2000:]


def test_dsl_compile_env(clean_env):
    from kernels_dsl import _compile
    assert _compile.compile_options("sm_90a") == "--gpu-arch sm_90a"
    clean_env.setenv("DSV4_DSL_OPTIONS", "--opt-level 2")
    assert _compile.compile_options("sm_90a") == "--gpu-arch sm_90a --opt-level 2"
    clean_env.setenv("DSV4_CACHE_DIR", "/tmp/dsv4cache")
    assert str(_compile.disk_cache_dir()) == "/tmp/dsv4cache/dsl"
    clean_env.setenv("DSV4_DSL_DISK_CACHE", "off")
    with pytest.raises(ValueError, match="DSV4_DSL_DISK_CACHE"):
        _compile.compile_cached(("test_config", "never-built"), lambda: pytest.fail("must not build"))
