"""Helpers shared by op modules: dtype <-> string for problems, target lookup."""
from __future__ import annotations

import torch

from ..layout import dtype_name
from ..target import Target

__all__ = ["target_of", "dtype_name", "str_dtype"]

_BY_NAME = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e8m0fnu": torch.float8_e8m0fnu,
}


def target_of(t: torch.Tensor) -> Target:
    return Target.of(t.device)


def str_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown dtype name {name!r}; known {sorted(_BY_NAME)}") from None
