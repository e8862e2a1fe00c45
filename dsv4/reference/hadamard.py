"""Sylvester-Hadamard rotation (DSV4 ``rotate_activation``), torch reference.

Source: dsv4_spec.md 2.3/2.4 (FLASH-REF model.py ``rotate_activation``:
``fast_hadamard_transform.hadamard_transform(x, scale=n^-0.5)``). Used by the indexer
compressor (K, d = 128) and the indexer query.

Matrix: ``H_n[i, j] = (-1)^popcount(i & j)`` (Sylvester order, no permutation), ``y = (H_n x) *
n^-0.5``. :func:`hadamard_fwht` computes it with log2(n) butterfly stages in fp32, **bit 0
first**: stage k maps the pair ``(a, b) = (x[i], x[i | 2^k])`` (bit k of i clear) to
``(a + b, a - b)``, then multiplies by ``fp32(n^-0.5)`` once at the end. The CUDA kernels
(``kernels_cuda/kv_cache.cu``, ``kernels_cuda/indexer.cu`` ``fwht128``) perform the same fp32
operations in the same order, so the two agree bit for bit. :func:`hadamard_matrix` is the
independent oracle (fp64 matrix product) used in the tests.
"""
from __future__ import annotations

import math

import torch

__all__ = ["hadamard_matrix", "hadamard_fwht", "rotate_activation_ref"]


def hadamard_matrix(n: int = 128, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard matrix ``H[i, j] = (-1)^popcount(i & j)``, ``[n, n]``.

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n}")
    i = torch.arange(n, device=device)
    a = i.view(-1, 1) & i.view(1, -1)
    pc = torch.zeros_like(a)
    for b in range(max(1, int(math.log2(n)))):
        pc += (a >> b) & 1
    return (1 - 2 * (pc % 2)).to(dtype)


def hadamard_fwht(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``(H_n x) * scale`` over the last dim by fp32 butterflies (bit 0 first), fp32 result.

    Args:
        x: ``[..., n]`` float tensor, n a power of two (128 in DSV4).
        scale: multiplier applied once at the end, in fp32; default ``n ** -0.5``.

    Returns:
        float32 ``[..., n]``.

    Raises:
        ValueError: last dim not a power of two.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_fwht: last dim must be a power of two, got {tuple(x.shape)}")
    y = x.float()
    lead = y.shape[:-1]
    h = 1
    while h < n:
        v = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    s = torch.tensor(n ** -0.5 if scale is None else scale, dtype=torch.float32)
    return y * s.to(y.device)


def rotate_activation_ref(x: torch.Tensor) -> torch.Tensor:
    """DSV4 ``rotate_activation``: bf16 in, ``bf16((H x) * n^-0.5)`` out (fp32 math)."""
    return hadamard_fwht(x).to(torch.bfloat16)
