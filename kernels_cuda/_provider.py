"""Availability and target checks shared by the CUDA providers."""
from __future__ import annotations

import functools

from dsv4.registry import Sm90Provider, Support, sm90_support

__all__ = ["cuda_available", "target_support", "CudaProvider"]


@functools.lru_cache(maxsize=None)
def cuda_available() -> Support:
    """NVRTC + cuda.core importable and a CUDA device visible to torch."""
    import torch
    try:
        import cuda.core  # noqa: F401
        from cuda.bindings import nvrtc  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return Support.no(f"cuda: cuda-python not importable ({e})")
    if not torch.cuda.is_available():
        return Support.no("cuda: no CUDA device")
    return Support.yes("nvrtc + cuda.core")


def target_support(target, requirement: str = "built for sm_90a only") -> Support | None:
    """``Support.no`` when the tensors are not on a Hopper (sm_90a) GPU, else ``None``."""
    return sm90_support("cuda", target, requirement)


class CudaProvider(Sm90Provider):
    """Base of the NVRTC providers: available when cuda-python and a GPU are there; supports
    sm_90a targets, then asks :meth:`supports_problem` (override it for shape limits)."""

    kind = "cuda"
    #: reason text when the device is not sm_90a
    arch_requirement = "built for sm_90a only"

    def available(self) -> Support:
        return cuda_available()
