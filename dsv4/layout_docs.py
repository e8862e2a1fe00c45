"""``docs/layouts/``: one markdown page per registered op, rendered from its :class:`~dsv4.layout.OpSpec`
(``python -m dsv4 layouts --write docs/layouts``; ``--check`` lists stale pages, tests/test_layout.py).

Kept out of :mod:`dsv4.layout` so that the spec module does not import the registry."""
from __future__ import annotations

import os

from .registry import all_ops

__all__ = ["write_docs"]


def _sync(path: str, text: str, check: bool, stale: list[str]) -> None:
    """Record ``path`` as stale when its content differs from ``text``; write it unless ``check``."""
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        stale.append(path)
        if not check:
            with open(path, "w") as f:
                f.write(text)


def write_docs(directory: str, check: bool = False) -> list[str]:
    """Write ``<directory>/<op>.md`` for every registered op and the index ``README.md``, and remove
    pages of ops that no longer exist (with ``check``: change nothing). Returns the stale paths."""
    stale: list[str] = []
    os.makedirs(directory, exist_ok=True)
    index = ["# Layout specs", "", "Generated from each op's `OpSpec` (`python -m dsv4 layouts --write docs/layouts`).", ""]
    for op in all_ops():
        index.append(f"- [`{op.name}`]({op.name}.md): {op.spec.summary}")
        _sync(os.path.join(directory, f"{op.name}.md"), op.spec.markdown(), check, stale)
    known = {f"{op.name}.md" for op in all_ops()} | {"README.md"}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".md") and f not in known:        # an op that no longer exists
            stale.append(os.path.join(directory, f))
            if not check:
                os.remove(os.path.join(directory, f))
    _sync(os.path.join(directory, "README.md"), "\n".join(index) + "\n", check, stale)
    return stale
