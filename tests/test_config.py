"""dsv4/config.py: the environment-variable table, its validated readers, docs/configuration.md,
and that every DSV4_* variable read anywhere in the tree is registered (CPU only)."""
from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from dsv4 import config
from dsv4.config import VARS, env_choice, env_flag, env_int, env_str

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
_NAME = re.compile(r"^DSV4_[A-Z0-9_]*[A-Z0-9]$")
#: library files that still read DSV4_* variables with os.environ directly (everything else must go
#: through dsv4.config): DSV4_OPS parsing (registry) and the NVRTC cache dir (nvrtc.py).
_DIRECT_READERS = {"dsv4/registry.py": {"DSV4_OPS"}, "kernels_cuda/nvrtc.py": {"DSV4_CACHE_DIR"}}


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
    registered variable (.cu / .cuh macros such as DSV4_DEVICE excluded)."""
    used: dict[str, str] = {}
    for p in _py_files():
        if p.name == "test_config.py":
            continue
        for n in _names_in_py(p):
            used.setdefault(n, str(p.relative_to(ROOT)))
    for n in _names_in_scripts():
        used.setdefault(n, "scripts/*.sh")
    macros = _cu_macros()
    assert {"DSV4_DEVICE", "DSV4_E2M1_HI_A"} <= macros          # the scanner sees common.cuh's macros
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
    expected = {"DSV4_OPS": "", "DSV4_PRINT_LAYOUTS": 0, "DSV4_DSL_DISK_CACHE": 1, "DSV4_DSL_OPTIONS": ""}
    assert {k: VARS[k].default for k in expected} == expected


def test_only_overrides_caches_and_debugging():
    """Issue 17: environment variables only for DSV4_OPS, cache paths and debugging (and test output):
    no kernel tunable and no switch of a heuristic (those are config fields; kernels_cuda/moe_decode
    has override() for benchmarks)."""
    kinds = {"DSV4_OPS": "DSV4_OPS", "DSV4_CACHE_DIR": "cache", "DSV4_DSL_DISK_CACHE": "cache",
             "DSV4_PRINT_LAYOUTS": "debug", "DSV4_DSL_OPTIONS": "debug", "DSV4_RESULTS_DIR": "tests only"}
    rest = set(VARS) - set(kinds)
    assert not rest, f"not an override, cache path or debugging variable: {sorted(rest)}"
    for k, scope in kinds.items():
        if k in VARS and scope in ("debug", "tests only"):
            assert ("Debug" in VARS[k].doc or "debug" in VARS[k].doc) if scope == "debug" \
                else VARS[k].doc.startswith("Tests only"), k
    from kernels_cuda import moe_decode
    cfg = moe_decode.default_config(256, 256, 4096, 4096, "fp8", "mxfp4", 1)
    assert (cfg.splitk, cfg.mma, cfg.bulk, cfg.l2pf, moe_decode.MAX_M) == (4, 1, 0, 256, 16)   # measured defaults


# ------------------------------------------------------------------------------ readers
_TEST_VARS = {
    "DSV4_T_INT": config.Var("int", 256, (0, 64, 128, 256), "Tests only: an int."),
    "DSV4_T_COMPUTED": config.Var("int", None, range(2, 9), "Tests only: computed default."),
    "DSV4_T_FLAG": config.Var("flag", 1, (0, 1), "Tests only: a flag."),
    "DSV4_T_FLAG0": config.Var("flag", 0, (0, 1), "Tests only: a flag, default 0."),
    "DSV4_T_BIG": config.Var("int", 4096, range(0, 1 << 31), "Tests only: a large range."),
    "DSV4_T_STR": config.Var("str", "", None, "Tests only: a path."),
}


@pytest.fixture
def test_vars(clean_env):
    for k, v in _TEST_VARS.items():
        clean_env.setitem(config.VARS, k, v)
    return clean_env


def test_readers_defaults_and_values(test_vars):
    env = test_vars
    assert env_int("DSV4_T_INT") == 256
    assert env_int("DSV4_T_COMPUTED", None) is None and env_int("DSV4_T_COMPUTED", 3) == 3
    assert env_flag("DSV4_T_FLAG") is True and env_flag("DSV4_T_FLAG0") is False
    assert env_str("DSV4_T_STR") is None and env_str("DSV4_T_STR", "x") == "x"
    env.setenv("DSV4_T_INT", "64")
    env.setenv("DSV4_T_FLAG", "0")
    env.setenv("DSV4_T_STR", "/tmp/c")
    assert env_int("DSV4_T_INT") == 64 and env_flag("DSV4_T_FLAG") is False
    assert env_str("DSV4_T_STR") == "/tmp/c"
    assert env_choice("DSV4_T_STR", "/x", ("/x", "/tmp/c")) == "/tmp/c"   # explicit choices
    with pytest.raises(ValueError, match="DSV4_T_STR"):
        env_choice("DSV4_T_STR", "/x", ("/x", "/y"))
    for k in ("DSV4_T_INT", "DSV4_T_FLAG", "DSV4_T_STR"):
        env.setenv(k, "")                       # empty = unset = the default
    assert env_int("DSV4_T_INT") == 256 and env_flag("DSV4_T_FLAG") is True
    assert env_choice("DSV4_T_STR", "/x", ("/x", "/y")) == "/x"


@pytest.mark.parametrize("name,value,reader", [
    ("DSV4_T_INT", "100", env_int), ("DSV4_T_INT", "big", env_int),
    ("DSV4_T_FLAG", "2", env_flag), ("DSV4_T_BIG", "-1", env_int),
    ("DSV4_T_FLAG", "false", env_flag), ("DSV4_PRINT_LAYOUTS", "yes", env_flag),
])
def test_readers_reject_bad_values_naming_the_variable(test_vars, name, value, reader):
    test_vars.setenv(name, value)
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


# ------------------------------------------------------------------------------ call sites
def test_dsl_compile_env(clean_env):
    from kernels_dsl import _compile
    base = _compile.compile_options("sm_90a")
    assert base.startswith("--gpu-arch sm_90a") and "--opt-level" not in base
    clean_env.setenv("DSV4_DSL_OPTIONS", "--opt-level 2")
    assert _compile.compile_options("sm_90a") == base + " --opt-level 2"
    clean_env.setenv("DSV4_CACHE_DIR", "/tmp/dsv4cache")
    assert str(_compile.disk_cache_dir()) == "/tmp/dsv4cache/dsl"
    clean_env.setenv("DSV4_DSL_DISK_CACHE", "off")
    with pytest.raises(ValueError, match="DSV4_DSL_DISK_CACHE"):
        _compile.compile_cached(("test_config", "never-built"), lambda: pytest.fail("must not build"))
