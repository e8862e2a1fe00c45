"""Sylvester-Hadamard rotation (DSV4 ``rotate_activation``), torch reference.

Source: dsv4_spec.md 2.3/2.4 (FLASH-REF model.py ``rotate_activation``:
``fast_hadamard_transform.hadamard_transform(x, scale=n^-0.5)`` on a bf16 tensor, bf16 result).
Used by the indexer compressor (K, d = 128) and the indexer query, before their quantization.

Matrix: ``H_n[i, j] = (-1)^popcount(i & j)`` (Sylvester order, no permutation), ``y = (H_n x) *
n^-0.5``. :func:`hadamard_matrix` is the independent oracle (matrix product) of the tests.

Precision contract (doctrine 5) -- :func:`rotate_activation_ref` is the definition every kernel of
this project follows, bit for bit: **fp32 butterflies in a fixed stage order** (index bit 0 first:
stage ``b`` = 0..6 maps the pair ``(i, i + 2^b)`` (bit ``b`` of ``i`` clear) to ``(a + b, a - b)``,
each ``add.rn.f32`` / ``sub.rn.f32``), then ONE fp32 multiply by ``fp32(128^-0.5)`` (= 0x3DB504F3),
then ONE round-to-nearest-even to bf16. This is the arithmetic of the official kernel
(``fast_hadamard_transform`` on a bf16 tensor: fp32 inside, bf16 out). The kernels
(``kernels_dsl/indexer_quant.py`` ``_rotate_lanes``, ``kernels_cuda/common.cuh`` ``fwht128``, used by
``kernels_cuda/kv_cache.cu``) run the same operations in the same
order (a cross-lane stage's upper lane computes ``p - d`` as ``fma(d, -1, p)``: the same single
rounding), so kernel == reference bit for bit.

Bound against the exact rotation ``y* = (H x) * 128^-0.5`` (fp64, :func:`hadamard_matrix`): a
rounding at stage ``k`` reaches each output through one +-1 path; the 2^(7-k) stage-``k`` partial
sums an output depends on have disjoint supports, so their magnitudes add up to at most
``||x||_1``: the 7 stages cost ``<= 7 * 2^-24 * ||x||_1`` (first order), the multiply one more
rounding. Before the bf16 rounding ``|y32 - y*| <= 8 * 2^-24 * ||x||_1 * 128^-0.5`` (+ second-order
terms), and the bf16 result obeys (2^-8 = half a bf16 ulp, relative; 2^-20 leaves margin)

    |y - y*| <= 2^-8 * |y*| + 2^-20 * ||x||_1 * 128^-0.5 + 2^-133

tested on rows with exponent spreads up to 2^+-40 (tests/test_indexer.py
``test_hadamard_contract_bound_cpu``, which also reports how often ``y`` is not the correctly
rounded bf16 of ``y*``: a one-ulp difference on a small fraction of outputs, none elsewhere).
Overflow: a partial sum above FLT_MAX is +-Inf in fp32 (as in the official kernel), which needs
inputs near bf16's own maximum. :func:`bf16_round` (one correct rounding fp64 -> bf16) is kept for
oracles that want the exact rotation's correctly rounded value.
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
    """DSV4 ``rotate_activation``: ``bf16((H_n x) * n^-0.5)`` computed as the module docstring's
    contract (fp32 butterflies, index bit 0 first; one fp32 multiply by ``fp32(n^-0.5)``; one RNE
    to bf16). ``x``: float ``[..., n]`` (bf16 in DSV4); returns bf16 ``[..., n]``. Error bound vs
    the exact rotation: module docstring."""
    return hadamard_fwht(x, dtype=torch.float32).to(torch.bfloat16)
