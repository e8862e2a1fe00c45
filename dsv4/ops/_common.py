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


class GraphCase:
    """A CUDA-graph test case of one op (used by tests/test_graph_capture.py through each op
    module's ``graph_cases(device)``): static inputs, ``run()`` calls the public op on them and
    returns a tensor (a clone of the mutated buffer for in-place ops), ``refresh()`` rewrites
    the inputs in place (new data, same shapes). ``problem`` may be None: the test then probes
    which providers can run the case by running it."""

    def __init__(self, label: str, op: str, run, refresh, problem: dict | None = None):
        self.label, self.op, self.run, self.refresh, self.problem = label, op, run, refresh, problem


def bytes_of(*ts: torch.Tensor) -> torch.Tensor:
    """All tensors' bytes concatenated (uint8), to compare several outputs bit for bit."""
    return torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in ts])
