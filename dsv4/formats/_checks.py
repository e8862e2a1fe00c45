"""Small argument validators shared by the format modules (private).

Every error names the argument and states the expected layout, so that a caller that
passes e.g. packed bytes where nibbles are expected learns it from the message.
"""
from __future__ import annotations

from typing import Iterable

import torch

FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def require_dtype(name: str, t: torch.Tensor, dtypes: Iterable[torch.dtype], layout: str) -> None:
    require_tensor(name, t)
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want} ({layout}), got {t.dtype}")


def require_float_input(name: str, t: torch.Tensor, layout: str) -> None:
    require_dtype(name, t, FLOAT_INPUT_DTYPES, layout)


def require_ndim(name: str, t: torch.Tensor, ndims: Iterable[int], layout: str) -> None:
    ndims = tuple(ndims)
    if t.dim() not in ndims:
        raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))}-D tensor {layout}, "
                         f"got shape {tuple(t.shape)}")


def require_min_ndim(name: str, t: torch.Tensor, n: int, layout: str) -> None:
    if t.dim() < n:
        raise ValueError(f"{name}: expected at least {n}-D tensor {layout}, got shape {tuple(t.shape)}")


def require_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected a Python int, got {type(v).__name__}")
    if v <= 0:
        raise ValueError(f"{name}: expected a positive int, got {v}")
    return v


def require_nonneg_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected a Python int, got {type(v).__name__}")
    if v < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {v}")
    return v


def require_out_dtype(name: str, dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{name}: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
