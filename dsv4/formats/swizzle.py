"""The 128x4 swizzled scale-factor layout of cuBLAS / CUTLASS block-scaled GEMMs.

Source: cuBLAS documentation, "1D Block Scaling Factors Layout" (the layout
``CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3`` / ``VEC32_UE8M0`` operands use); CUTLASS
``Sm1xxBlockScaledConfig`` SfAtom ``((32,4),(SFVecSize,4)) : ((16,4),(0,1))``; TransformerEngine
NVFP4 reference ``_recover_swizzled_scales``.  Seed 003's remap bugs (K groups lost, garbage
in padding) are what this module's tests pin down.

A linear scale tensor ``sf [M, Ksf]`` (one scale per row and per K block) is tiled into
128-row x 4-column tiles.  Element ``(m, k)`` lands at

    sw[m // 128, k // 4, m % 32, (m // 32) % 4, k % 4]      (sw shape [Mt, Kt, 32, 4, 4])

with ``Mt = ceil(M/128)``, ``Kt = ceil(Ksf/4)``; equivalently at byte offset (for 1-byte
scales)

    (m // 128 * Kt + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4

of the flattened tensor.  Each 512-byte tile is contiguous; tiles are ordered K-tile
fastest.  Rows ``M..Mt*128-1`` and columns ``Ksf..Kt*4-1`` are padding and are filled with
ZERO bytes (for UE8M0 a zero byte is 2^-127, for E4M3 it is +0.0).
"""
from __future__ import annotations

import torch

from ._checks import require_min_ndim, require_nonneg_int, require_positive_int, require_tensor

__all__ = ["swizzle_sf_128x4", "unswizzle_sf_128x4", "swizzled_sf_offset", "swizzled_sf_shape"]

_ROWS = 128
_COLS = 4


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def swizzled_sf_shape(M: int, Ksf: int) -> tuple:
    """Shape ``(ceil(M/128), ceil(Ksf/4), 32, 4, 4)`` of the swizzled form of ``[M, Ksf]``.

    Raises:
        TypeError / ValueError: ``M`` or ``Ksf`` is not a positive int.
    """
    require_positive_int("M", M)
    require_positive_int("Ksf", Ksf)
    return (_cdiv(M, _ROWS), _cdiv(Ksf, _COLS), 32, 4, 4)


def _zeros_like_bits(shape, like: torch.Tensor) -> torch.Tensor:
    """All-zero-bytes tensor of ``like``'s dtype (through a uint8 view for 1-byte dtypes,
    because float8 dtypes do not support every fill kernel)."""
    if like.element_size() == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=like.device).view(like.dtype)
    return torch.zeros(shape, dtype=like.dtype, device=like.device)


def swizzle_sf_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Linear scale factors ``[..., M, Ksf]`` -> swizzled ``[..., ceil(M/128), ceil(Ksf/4), 32, 4, 4]``.

    Element ``(m, k)`` goes to ``[..., m//128, k//4, m%32, (m//32)%4, k%4]``; padding rows
    and columns are zero bytes.  Any ``M >= 1`` and ``Ksf >= 1`` (not only multiples of
    128 / 4); leading batch dims (e.g. experts ``[E, M, Ksf]``) are kept.

    Args:
        sf: ``[..., M, Ksf]`` tensor of any dtype (normally ``float8_e4m3fn`` or
            ``float8_e8m0fnu``), at least 2-D.

    Returns:
        new contiguous tensor of ``sf.dtype`` on ``sf.device``.

    Raises:
        TypeError: ``sf`` is not a tensor.
        ValueError: fewer than 2 dims, or ``M == 0`` / ``Ksf == 0``.
    """
    require_tensor("sf", sf)
    require_min_ndim("sf", sf, 2, "[..., M, Ksf] (linear scale factors)")
    *batch, M, Ksf = sf.shape
    if M == 0 or Ksf == 0:
        raise ValueError(f"sf: expected [..., M, Ksf] with M >= 1 and Ksf >= 1, got {tuple(sf.shape)}")
    Mt, Kt = _cdiv(M, _ROWS), _cdiv(Ksf, _COLS)
    padded = _zeros_like_bits((*batch, Mt * _ROWS, Kt * _COLS), sf)
    padded[..., :M, :Ksf] = sf
    nb = len(batch)
    # m = mt*128 + a*32 + r  (a = (m//32)%4, r = m%32);  k = kt*4 + c
    t = padded.reshape(*batch, Mt, 4, 32, Kt, _COLS)
    t = t.permute(*range(nb), nb + 0, nb + 3, nb + 2, nb + 1, nb + 4)  # [.., Mt, Kt, r, a, c]
    return t.contiguous()


def unswizzle_sf_128x4(sw: torch.Tensor, M: int, Ksf: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_sf_128x4`: ``[..., ceil(M/128), ceil(Ksf/4), 32, 4, 4]`` -> ``[..., M, Ksf]``.

    Padding entries of ``sw`` are dropped (whatever they contain never reaches the result).

    Args:
        sw: swizzled scale factors, at least 5-D, any dtype.
        M: number of real rows (>= 1).
        Ksf: number of real scale columns (>= 1).

    Returns:
        new contiguous ``[..., M, Ksf]`` tensor of ``sw.dtype``.

    Raises:
        TypeError: ``sw`` not a tensor, ``M``/``Ksf`` not ints.
        ValueError: ``sw``'s trailing shape is not ``(ceil(M/128), ceil(Ksf/4), 32, 4, 4)``.
    """
    require_tensor("sw", sw)
    want = swizzled_sf_shape(M, Ksf)
    if sw.dim() < 5 or tuple(sw.shape[-5:]) != want:
        raise ValueError(f"sw: expected [..., {want[0]}, {want[1]}, 32, 4, 4] (swizzled 128x4 layout for "
                         f"M={M}, Ksf={Ksf}), got shape {tuple(sw.shape)}")
    batch = sw.shape[:-5]
    nb = len(batch)
    Mt, Kt = want[0], want[1]
    t = sw.permute(*range(nb), nb + 0, nb + 3, nb + 2, nb + 1, nb + 4)  # [.., Mt, a, r, Kt, c]
    t = t.reshape(*batch, Mt * _ROWS, Kt * _COLS)
    return t[..., :M, :Ksf].contiguous()


def swizzled_sf_offset(m, k, Ksf: int):
    """Element offset of linear scale ``(m, k)`` inside the flattened swizzled tensor.

    ``(m // 128 * ceil(Ksf/4) + k // 4) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4``
    (cuBLAS "1D Block Scaling Factors Layout").  For 1-byte scales this is the byte
    offset.  For a batched tensor ``[E, Mt, Kt, 32, 4, 4]`` add ``e * Mt * Kt * 512``.

    Args:
        m: row index (Python int or integer tensor), ``>= 0``.
        k: scale-column index (Python int or integer tensor), ``0 <= k < Ksf``.
        Ksf: number of scale columns of the *linear* tensor (>= 1).

    Returns:
        Python int if ``m`` and ``k`` are ints, otherwise an integer tensor (broadcast).

    Raises:
        TypeError / ValueError: bad ``Ksf``; negative ``m``/``k`` or ``k >= Ksf`` for int
            arguments.
    """
    require_positive_int("Ksf", Ksf)
    kt = _cdiv(Ksf, _COLS)
    if isinstance(m, int) and isinstance(k, int):
        require_nonneg_int("m", m)
        require_nonneg_int("k", k)
        if k >= Ksf:
            raise ValueError(f"k: expected 0 <= k < Ksf={Ksf}, got {k}")
    for name, v in (("m", m), ("k", k)):
        if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype == torch.bool):
            raise TypeError(f"{name}: expected an integer index tensor, got {v.dtype}")
    return ((m // _ROWS) * kt + k // _COLS) * 512 + (m % 32) * 16 + ((m // 32) % 4) * 4 + k % _COLS
