"""Availability checks shared by the CUDA providers."""
from __future__ import annotations

import functools

from dsv4.registry import Support


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
