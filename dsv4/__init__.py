"""dsv4-kernels: DeepSeek-V4 inference kernels for NVIDIA Hopper (sm_90a).

Public ops are in :mod:`dsv4.ops` (re-exported here lazily), number formats in
:mod:`dsv4.formats`, the provider registry in :mod:`dsv4.registry`, layout specs in
:mod:`dsv4.layout`.
"""
from __future__ import annotations

__version__ = "0.1.0"


_SUBMODULES = ("ops", "formats", "registry", "layout", "target", "data", "pipeline")


def __dir__() -> list[str]:
    import importlib
    return sorted(set(globals()) | set(importlib.import_module("dsv4.ops").__all__) | set(_SUBMODULES))


def __getattr__(name: str):
    import importlib
    ops = importlib.import_module("dsv4.ops")
    if name in getattr(ops, "__all__", ()):
        return getattr(ops, name)
    if name in _SUBMODULES:
        return importlib.import_module(f"dsv4.{name}")
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
