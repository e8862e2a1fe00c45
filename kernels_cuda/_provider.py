"""Availability and target checks shared by the CUDA providers."""
from __future__ import annotations

import functools

from dsv4.registry import Provider, Support

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
    if not target.is_cuda:
        return Support.no("cuda: the target is not a CUDA device (CPU tensors or no GPU)")
    if target.arch != "sm_90a":
        return Support.no(f"cuda: {requirement}, device is {target.arch}")
    return None


class CudaProvider(Provider):
    """Base of the NVRTC providers: available when cuda-python and a GPU are there; supports
    sm_90a targets, then asks :meth:`supports_problem` (override it for shape limits)."""

    kind = "cuda"
    #: reason text when the device is not sm_90a
    arch_requirement = "built for sm_90a only"

    def available(self) -> Support:
        return cuda_available()

    def supports(self, problem, target) -> Support:
        no = target_support(target, self.arch_requirement)   # (a Support.no is falsy: no `or` here)
        return no if no is not None else self.supports_problem(problem)

    def supports_problem(self, problem) -> Support:
        return Support.yes("sm_90a")
