"""Public ops. Importing this package registers every op with :mod:`dsv4.registry`.

The ops of one area live in one module here (``dsv4/ops/<area>.py``, e.g. ``moe.py`` holds the
six MoE ops and ``moe_experts`` / ``moe_forward``): per op its :class:`~dsv4.layout.OpSpec`,
its public function, and its ``torch.library`` custom op (``torch.ops.dsv4.<name>``) with a
fake implementation. Modules are discovered automatically (``pkgutil``): nothing is imported
by hand.
Public functions are re-exported here (each module lists them in ``__all__``).
"""
from __future__ import annotations

import importlib
import pkgutil

__all__: list[str] = []

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name.startswith("_"):
        continue
    _mod = importlib.import_module(f"{__name__}.{_m.name}")
    for _name in getattr(_mod, "__all__", ()):
        if not _name.isupper():
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
