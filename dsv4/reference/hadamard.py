"""Sylvester-Hadamard rotation (DSV4 ``rotate_activation``), torch reference.

Source: dsv4_spec.md 2.3/2.4 (FLASH-REF model.py ``rotate_activation``:
``fast_hadamard_transform.hadamard_transform(x, scale=n^-0.5)`` on a bf16 tensor, bf16 result).
Used by the indexer compressor (K, d = 128) and the indexer query, before their quantization.

Matrix: ``H_n[i, j] = (-1)^popcount(i & j)`` (Sylvester order, no permutation), ``y = (H_n x) *
n^-0.5``. :func:`hadamard_matrix` is the independent oracle (matrix product) of the tests.

:func:`rotate_activation_ref` is the definition every kernel of this project follows: the
butterflies run in **fp64** (a sum of 128 bf16 values with +-1 coefficients is exact in fp64
for any exponent spread below 38 binades, so the order of the stages does not matter), one
fp64 multiply by ``fp64(n^-0.5)``, then ONE correctly rounded conversion fp64 -> bf16
(:func:`bf16_round`; torch's own ``double.to(bfloat16)`` rounds twice, via fp32). The result is
the bf16 of the exact ``(H x) * n^-0.5`` except within 2^-52 (relative) of a bf16 rounding
midpoint. The CUDA kernels (``kernels_cuda/indexer.cu`` ``fwht128``, ``kernels_cuda/kv_cache.cuh``
``kvc_fwht128``) do the same fp64 operations and the same rounding, so the three agree bit for
bit. This is the project's definition, not a bit-for-bit copy of the official kernel:
``fast_hadamard_transform`` accumulates in fp32 and converts once, which agrees with it on typical
activations (randn rows: no difference measured) but can differ by one bf16 ulp when a row's
exponents spread widely (measured 2026-12-01: 18 of 256,000 outputs for inputs spread over
2^+-20). :func:`hadamard_fwht` (fp32 butterflies, bit 0 first) is kept for callers that want the
rotation without the bf16 rounding.
"""
from __future__ import annotations

import math

import torch

__all__ = ["hadamard_matrix", "hadamard_fwht", "bf16_round", "rotate_activation_ref"]


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


def hadamard_fwht(x: torch.Tensor, scale: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(H_n x) * scale`` over the last dim by butterflies (bit 0 first) in ``dtype``.

    Args:
        x: ``[..., n]`` float tensor, n a power of two (128 in DSV4).
        scale: multiplier applied once at the end, in ``dtype``; default ``n ** -0.5``.
        dtype: arithmetic and result dtype (float32 default, float64 for the exact rotation).

    Returns:
        ``dtype`` ``[..., n]``.

    Raises:
        ValueError: last dim not a power of two.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_fwht: last dim must be a power of two, got {tuple(x.shape)}")
    y = x.to(dtype)
    lead = y.shape[:-1]
    h = 1
    while h < n:
        v = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    s = torch.tensor(n ** -0.5 if scale is None else scale, dtype=dtype)
    return y * s.to(y.device)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """fp64 -> bf16 with ONE round-to-nearest-even (torch's ``.to(bfloat16)`` from float64 goes
    through fp32 and can round twice). Method: ``f = fp32_rn(x)``; a double rounding can only
    happen when ``f`` lies exactly on a bf16 midpoint (low 16 bits 0x8000) while ``x != f``:
    then ``f`` is moved one fp32 ulp towards ``x`` before the fp32 -> bf16 rounding. The CUDA
    kernels do the same (``bf16r_f64``)."""
    x = x.double()
    f = x.float()
    mid = ((f.view(torch.int32) & 0xFFFF) == 0x8000) & (f.double() != x)
    toward = torch.where(x > f.double(), torch.full_like(f, float("inf")), torch.full_like(f, float("-inf")))
    f = torch.where(mid, torch.nextafter(f, toward), f)
    return f.to(torch.bfloat16)


def rotate_activation_ref(x: torch.Tensor) -> torch.Tensor:
    """DSV4 ``rotate_activation``: ``bf16((H_n x) * n^-0.5)`` (fp64 butterflies, one fp64
    multiply, one correct rounding to bf16; module docstring). ``x``: float ``[..., n]``
    (bf16 in DSV4); returns bf16 ``[..., n]``."""
    return bf16_round(hadamard_fwht(x, dtype=torch.float64))
