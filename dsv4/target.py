"""Where an op runs: device type, GPU architecture (e.g. ``sm_90a``), SM count.

The arch string is what compilers are given explicitly (the CuTe DSL silently targets
``sm_100a`` when it sees no GPU, see shared/reference/cutedsl_guide.md section 2.1), so it is
computed here once per device and passed to every compile.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Target", "arch_of_cc"]


def arch_of_cc(major: int, minor: int) -> str:
    """Compute capability -> the arch string compilers want ('a' suffix for sm_90 and newer)."""
    s = f"sm_{major}{minor}"
    return s + "a" if major >= 9 else s


@dataclass(frozen=True)
class Target:
    """A device to run on.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        arch: e.g. ``"sm_90a"`` for Hopper, ``None`` on CPU.
        name: device name as the driver reports it.
        sm_count: number of SMs (0 on CPU).
        index: CUDA device index (-1 on CPU).
    """

    device_type: str
    arch: str | None
    name: str
    sm_count: int
    index: int = -1

    def __hash__(self) -> int:            # part of every dispatch's selection key: computed once
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.device_type, self.arch, self.name, self.sm_count, self.index))
            object.__setattr__(self, "_hash", h)
        return h

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    @property
    def is_hopper(self) -> bool:
        return self.arch == "sm_90a"

    @staticmethod
    def of(device: torch.device | str | int | None = None) -> "Target":
        """The target for a torch device (default: the current CUDA device, else CPU)."""
        t = _BY_DEVICE.get(device)           # hot path: the same torch.device object every call
        if t is not None:
            return t
        if device is None:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda":
            if device.index is not None:
                return _BY_DEVICE.setdefault(device, _cuda_target(device.index))
            return _cuda_target(torch.cuda.current_device())
        return _CPU

    def __str__(self) -> str:
        if self.is_cuda:
            return f"{self.name} ({self.arch}, {self.sm_count} SMs)"
        return "cpu"


#: explicit devices (``cuda:0``, ``cpu``) -> Target; ``cuda`` without an index means the
#: current device, which may change, so it is never memoized here.
_BY_DEVICE: dict = {}
_CPU = Target("cpu", None, "cpu", 0, -1)
_BY_DEVICE[torch.device("cpu")] = _CPU


@functools.lru_cache(maxsize=None)
def _cuda_target(idx: int) -> Target:
    p = torch.cuda.get_device_properties(idx)
    return Target("cuda", arch_of_cc(p.major, p.minor), p.name, p.multi_processor_count, idx)
