"""Environment variables of dsv4-kernels: one table (:data:`VARS`) and validated readers.

Every ``DSV4_*`` environment variable the library, the benchmarks, the scripts or the tests read is
an entry of :data:`VARS` (name -> :class:`Var` ``(type, default, allowed, doc)``); the table is the
single source of truth for defaults, allowed values and ``docs/configuration.md``, which is
generated from it::

    python -m dsv4.config --write docs/configuration.md     # regenerate
    python -m dsv4.config --check docs/configuration.md     # exit 1 if stale (tests/test_config.py)

Readers (:func:`env_int`, :func:`env_flag`, :func:`env_choice`, :func:`env_str`) take the default and
the allowed values from the table unless given explicitly (computed defaults), treat an unset or
empty variable as its default, and raise ``ValueError`` naming the variable, the allowed values and
the value found. Reading a name that is not in the table raises ``KeyError`` (register it first).

This module imports nothing beyond the standard library (safe to import from anywhere in dsv4).
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple, Sequence

__all__ = ["Var", "VARS", "env_int", "env_flag", "env_choice", "env_str", "default", "render_markdown",
           "write_config_doc"]


class Var(NamedTuple):
    """One environment variable.

    Attributes:
        type: ``"flag"`` (``0`` / ``1``), ``"int"``, ``"choice"`` (one of ``allowed``, strings) or
            ``"str"`` (free text / path).
        default: value used when unset or empty; ``None`` when computed (``doc`` says how).
        allowed: tuple of values, a ``range``, or ``None`` (free text).
        doc: what it does, who reads it, scope (production / tuning / bench / tests).
    """

    type: str
    default: Any
    allowed: Any
    doc: str


_FLAG = (0, 1)

#: name -> Var. Grouped by area; the order is the order of docs/configuration.md.
VARS: dict[str, Var] = {
    # ---------------------------------------------------------------- general
    "DSV4_OPS": Var("str", "", None,
        "Force providers: `op=kind[,op=kind]` (`*=torch` applies to every op), e.g. `DSV4_OPS='*=torch'`. "
        "A forced provider that cannot run raises. Parsed by `dsv4/registry.py`."),
    "DSV4_PRINT_LAYOUTS": Var("flag", 0, _FLAG,
        "Debug only: 1 prints every operand's dtype / shape / stride next to its layout spec at each "
        "dispatch (`dsv4/registry.py`)."),
    "DSV4_CACHE_DIR": Var("str", "~/.cache/dsv4", None,
        "Cache: root of the on-disk compile caches: NVRTC cubins (`kernels_cuda/nvrtc.py`) and CuTe DSL `.o` "
        "exports under `dsl/` (`kernels_dsl/_compile.py`). Empty = the default."),
    "DSV4_DSL_OPTIONS": Var("str", "", None,
        "Debug only: extra options appended to every `cute.compile` options string after `--gpu-arch ARCH` "
        "(`kernels_dsl/_compile.py`), e.g. `--keep-ptx --dump-dir /tmp/d`."),
    "DSV4_DSL_DISK_CACHE": Var("flag", 1, _FLAG,
        "Cache: 0 = do not load or store compiled CuTe DSL kernels on disk (`kernels_dsl/_compile.py`); the "
        "in-memory cache stays on."),
    # ---------------------------------------------------------------- tests only
    "DSV4_RESULTS_DIR": Var("str", "", None,
        "Tests only: directory where `tests/test_indexer.py` GPU gates write their measured results "
        "(JSON); empty = not written."),
}


def _spec(name: str) -> Var:
    try:
        return VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not a registered environment variable: add it to dsv4.config.VARS "
                       "(and regenerate docs/configuration.md)") from None


def _fmt_allowed(allowed: Any) -> str:
    if allowed is None:
        return "any"
    if isinstance(allowed, range):
        return f"{allowed.start}..{allowed.stop - 1}" + (f" step {allowed.step}" if allowed.step != 1 else "")
    return ", ".join(str(a) for a in allowed)


_UNSET = object()


def _raw(name: str) -> str | None:
    v = os.environ.get(name)
    return None if v is None or v == "" else v


def default(name: str) -> Any:
    """The table default of ``name`` (``None`` when computed)."""
    return _spec(name).default


def _lookup(name: str, default: Any, choices: Any) -> tuple[Any, Any, str | None]:
    """(default, allowed values, raw value or None) of ``name``, the table filling what is ``_UNSET``."""
    spec = _spec(name)
    return (spec.default if default is _UNSET else default,
            spec.allowed if choices is _UNSET else choices, _raw(name))


def env_int(name: str, default: Any = _UNSET, choices: Sequence[int] | range | None = _UNSET) -> Any:  # noqa: A002
    """Integer value of environment variable ``name``.

    Args: ``default`` (returned when unset or empty; default: the table's, may be ``None``),
    ``choices`` (allowed values: tuple or ``range``; default: the table's; ``None`` = any int).
    Raises: ``ValueError`` naming ``name``, the allowed values and the value found, when the value is
    not an integer or not allowed; ``KeyError`` when ``name`` is not in :data:`VARS`.
    """
    default, choices, v = _lookup(name, default, choices)
    if v is None:
        return default
    try:
        x = int(v, 10)
    except ValueError:
        raise ValueError(f"{name} must be an integer ({_fmt_allowed(choices)}), got {v!r}") from None
    if choices is not None and x not in choices:
        raise ValueError(f"{name} must be one of {_fmt_allowed(choices)}, got {v!r}")
    return x


def env_flag(name: str, default: Any = _UNSET) -> bool:  # noqa: A002
    """Boolean value of environment variable ``name``: ``1`` -> True, ``0`` -> False, unset or
    empty -> ``default`` (default: the table's). Raises ``ValueError`` naming ``name`` for any other
    value; ``KeyError`` when ``name`` is not in :data:`VARS`."""
    default, _, v = _lookup(name, default, None)
    if v is None:
        return bool(default)
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {v!r}")
    return v == "1"


def env_choice(name: str, default: Any = _UNSET, choices: Sequence[str] = _UNSET) -> str:  # noqa: A002
    """String value of environment variable ``name``, one of ``choices`` (default: the table's;
    compared exactly, case-sensitive). Unset or empty -> ``default``. Raises ``ValueError`` naming
    ``name``, the allowed values and the value found; ``KeyError`` when ``name`` is not in :data:`VARS`."""
    default, choices, v = _lookup(name, default, choices)
    if v is None:
        return default
    if v not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {v!r}")
    return v


def env_str(name: str, default: Any = _UNSET) -> Any:  # noqa: A002
    """Free-text value of environment variable ``name`` (unset or empty -> ``default``, default:
    ``None``, not the table's display default). ``KeyError`` when ``name`` is not in :data:`VARS`."""
    _spec(name)
    v = os.environ.get(name)
    return (None if default is _UNSET else default) if v is None or v == "" else v


# ------------------------------------------------------------------------------------- docs
_HEADER = """# Configuration: environment variables

Generated from `dsv4/config.py` (`VARS`) by `python -m dsv4.config --write docs/configuration.md`;
`tests/test_config.py` fails when this file is stale. Do not edit by hand.

Environment variables exist only to force providers (`DSV4_OPS`), for cache paths, for debugging
and for test output. Kernel tunables are fields of each kernel's frozen config dataclass, chosen by
its heuristic and shown by `registry.last_choice(op).explain()` and `dsv4 ops --verbose`.

Every variable is optional. Unset or empty means the default. Variables read through the
`dsv4.config` helpers (all but `DSV4_OPS` and `DSV4_CACHE_DIR`) are validated: a bad value raises
`ValueError` naming the variable, the allowed values and the value found (flags accept exactly `0`
or `1`). They are read at each use (set them before the call) unless the entry says otherwise.

| variable | type | default | allowed | what it does |
|---|---|---|---|---|
"""


def render_markdown() -> str:
    """docs/configuration.md, rendered from :data:`VARS`."""
    rows = []
    for name, v in VARS.items():
        d = "computed" if v.default is None else ("(empty)" if v.default == "" else str(v.default))
        rows.append(f"| `{name}` | {v.type} | {d} | {_fmt_allowed(v.allowed)} | {v.doc} |")
    return _HEADER + "\n".join(rows) + "\n"


def write_config_doc(path: str, check: bool = False) -> bool:
    """Write :func:`render_markdown` to ``path`` (with ``check``: only compare). Returns True when
    the file was stale (missing or different)."""
    md = render_markdown()
    old = open(path).read() if os.path.exists(path) else None
    stale = old != md
    if stale and not check:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write(md)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m dsv4.config", description="render docs/configuration.md")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="PATH")
    g.add_argument("--check", metavar="PATH")
    a = p.parse_args(argv)
    if a.write:
        print(f"{a.write}: " + ("written" if write_config_doc(a.write) else "already up to date"))
        return 0
    if a.check:
        if write_config_doc(a.check, check=True):
            print(f"{a.check} is out of date; run: python -m dsv4.config --write {a.check}")
            return 1
        print(f"{a.check}: up to date")
        return 0
    print(render_markdown(), end="")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
