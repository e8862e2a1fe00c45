"""E2M1 (FP4) element format: 4-bit nibble codes, LUT decode, nibble packing.

Format (OCP Microscaling Formats (MX) v1.0, section 5.3.3 "FP4 (E2M1)"; the same
element type NVIDIA's NVFP4 uses; DSV4 ``convert.py`` ``FP4_TABLE``, dsv4_spec.md 2.1):

* A nibble is **sign-magnitude**: bit 3 is the sign, bits 2:0 are an **index** into the
  magnitude level set ``E2M1_LEVELS = (0, 0.5, 1, 1.5, 2, 3, 4, 6)``.  The index is *not*
  a linear integer magnitude (seed 000: treating it as 0..7 decodes 1 as 1.0 instead of
  0.5, 5 as 5.0 instead of 3.0, ...).  Decoding therefore always goes through a LUT.
* There is no Inf and no NaN encoding.  Nibble 0x8 is -0.0.
* Packing (DSV4 ``convert.py``, HF NVFP4 checkpoints, ``torch.float4_e2m1fn_x2``
  convention): a packed tensor is ``torch.uint8 [..., K/2]``; element ``2i`` lives in the
  LOW nibble of byte ``i`` and element ``2i+1`` in the HIGH nibble.

Rounding and special values of :func:`e2m1_encode` (matches ``ml_dtypes.float4_e2m1fn``
bit for bit on every non-NaN bf16 and fp16 input, Inf included; tested):

* round to nearest, ties to even *on the level set*: a tie goes to the level whose
  mantissa bit (= bit 0 of the index) is 0:
  0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5.0->4.0;
* |x| > 6 (including +-Inf) saturates to +-6 (0x7 / 0xF);
* the sign is kept for values that round to zero: -0.0 and tiny negatives -> 0x8;
* **NaN (any sign, any payload) -> 0x0 (+0.0)**.  E2M1 has no NaN, so a NaN must become
  a finite code; we make it +0 whatever its sign bit.  ``ml_dtypes`` also maps NaN to a
  zero, but with the *inverted* sign of the NaN (0x7FC00000 -> 0x8, 0xFFC00000 -> 0x0).
  The sign of a NaN carries no meaning and is not portable (on x86 ``0/0`` and
  ``inf - inf`` give the negative NaN 0xFFC00000, Python's ``float('nan')`` is positive,
  CUDA's canonical NaN is 0x7FFFFFFF), so a reference must not depend on it.  This is the
  one place we deviate from ml_dtypes; the magnitude (zero) agrees.
"""
from __future__ import annotations


import torch

from ._checks import require_dtype

__all__ = [
    "E2M1_LEVELS",
    "E2M1_MAX",
    "E2M1_NAN_CODE",
    "e2m1_levels",
    "e2m1_values",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
]

#: Magnitudes addressed by nibble bits 2:0 (index -> value).  Source: OCP MX v1.0 5.3.3,
#: DSV4 ``convert.py`` FP4_TABLE.
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Largest finite E2M1 magnitude.
E2M1_MAX = 6.0
#: Code produced for a NaN input, whatever the NaN's sign: +0.0 (see module docstring).
E2M1_NAN_CODE = 0x0

# Midpoints between consecutive levels, and the three midpoints at which round-to-nearest-
# even goes UP (the upper neighbour has an even index, i.e. mantissa bit 0):
#   0.25 (0 | 0.5)   -> 0      0.75 (0.5 | 1) -> 1.0    1.25 (1 | 1.5) -> 1.0
#   1.75 (1.5 | 2)   -> 2.0    2.5  (2 | 3)   -> 2.0    3.5  (3 | 4)   -> 4.0
#   5.0  (4 | 6)     -> 4.0
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)

_ENCODE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def e2m1_levels(device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 8 E2M1 magnitudes as a tensor.

    Args:
        device: device of the result (default: current default device).
        dtype: floating dtype of the result (default float32; all levels are exact in
            every float dtype).

    Returns:
        ``[8]`` tensor ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)``; entry ``i`` is the magnitude of
        nibble index ``i`` (bits 2:0).  Source: OCP MX v1.0 5.3.3.
    """
    return torch.tensor(E2M1_LEVELS, dtype=dtype, device=device)


def e2m1_values(device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16-entry decode LUT: signed value of every nibble code 0..15.

    Entry ``c`` is ``(-1)**(c >> 3) * E2M1_LEVELS[c & 7]``; entry 8 is -0.0.

    Returns:
        ``[16]`` tensor of ``dtype`` on ``device``.
    """
    dev = torch.device(device) if device is not None else torch.empty(0).device
    key = (dev, dtype)
    lut = _LUTS.get(key)
    if lut is None:   # built once per (device, dtype): no host->device copy on later calls
        lv = e2m1_levels(dev, dtype)
        lut = _LUTS[key] = torch.cat([lv, -lv])
    return lut


_LUTS: dict = {}


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round real values to E2M1 nibble codes (one code per element, not packed).

    Args:
        x: float tensor (float32, bfloat16, float16 or float64), any shape, any device.
            Values are taken as they are (no scaling): the caller divides by its block
            scale first.

    Returns:
        ``torch.uint8`` tensor of ``x.shape`` with codes in ``0..15`` (bit 3 = sign,
        bits 2:0 = index into :data:`E2M1_LEVELS`).

    Rounding: nearest level, ties to even mantissa bit (see module docstring); |x| > 6
    and +-Inf saturate to +-6; the sign of values rounding to zero is kept (-0.0 -> 0x8);
    NaN of either sign -> 0x0 (+0.0).  Identical to ``ml_dtypes.float4_e2m1fn`` conversion
    except for the sign of NaN results (see module docstring).  bf16/fp16 inputs
    are widened to float32 exactly; float64 inputs are rounded directly in float64 (no
    double rounding).

    Raises:
        TypeError: ``x`` is not a tensor or not one of the float dtypes above.
    """
    require_dtype("x", x, _ENCODE_DTYPES, "real values to round to E2M1")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(work)
    a = xf.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=work, device=x.device)
    # number of midpoints strictly below |x| = index when no tie goes up
    idx = torch.bucketize(a, mids, right=False)
    tie_up = torch.zeros_like(a, dtype=torch.bool)
    for t in _TIES_UP:  # 3 constant comparisons, vectorized over all elements
        tie_up |= a == t
    idx = (idx + tie_up.to(idx.dtype)).clamp_(max=7)
    code = idx.to(torch.uint8) | (torch.signbit(xf).to(torch.uint8) << 3)
    return torch.where(torch.isnan(xf), torch.full_like(code, E2M1_NAN_CODE), code)


def _require_nibbles(name: str, n: torch.Tensor) -> None:
    require_dtype(name, n, (torch.uint8,), "unpacked E2M1 nibble codes 0..15, one per element")
    if not n.numel():
        return
    if n.device.type == "cpu":
        if int(n.max()) > 15:
            raise ValueError(
                f"{name}: expected unpacked E2M1 nibble codes in 0..15 (one per byte); got a byte "
                f"value {int(n.max())} > 15 (packed bytes? use unpack_e2m1 first)")
    else:
        # no host sync on GPU tensors (graph capture): a device-side assert instead
        torch._assert_async((n <= 15).all(), f"{name}: E2M1 nibble codes must be 0..15 (packed bytes?)")


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 nibble codes to float32 through the 16-entry LUT.

    Never does arithmetic on the nibble (seed 000): the value is
    ``LUT[code] = (-1)**bit3 * E2M1_LEVELS[bits 2:0]``.

    Args:
        nibbles: ``torch.uint8`` tensor of codes ``0..15``, any shape (unpacked: one code
            per byte; use :func:`unpack_e2m1` on packed data first).

    Returns:
        float32 tensor of the same shape; code 0x8 decodes to -0.0.

    Raises:
        TypeError: ``nibbles`` is not ``torch.uint8``.
        ValueError: some byte is > 15 (packed bytes were passed).
    """
    _require_nibbles("nibbles", nibbles)
    lut = e2m1_values(nibbles.device, torch.float32)
    return lut[nibbles.long()]


def pack_e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    """Pack pairs of E2M1 nibble codes along the last dim into bytes.

    Byte ``i`` = ``nibbles[..., 2i] | nibbles[..., 2i+1] << 4`` (element ``2i`` in the LOW
    nibble; DSV4 ``convert.py``, NVFP4 checkpoints, ``torch.float4_e2m1fn_x2``).

    Args:
        nibbles: ``torch.uint8 [..., K]`` codes ``0..15``, ``K`` even, at least 1-D.

    Returns:
        ``torch.uint8 [..., K/2]`` (contiguous).

    Raises:
        TypeError: wrong dtype.
        ValueError: 0-D input, odd ``K``, or a value > 15.
    """
    _require_nibbles("nibbles", nibbles)
    if nibbles.dim() == 0 or nibbles.shape[-1] % 2:
        raise ValueError(f"nibbles: expected uint8 [..., K] with K even (2 codes per byte), "
                         f"got shape {tuple(nibbles.shape)}")
    lo = nibbles[..., 0::2]
    hi = nibbles[..., 1::2]
    return (lo | (hi << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`: ``uint8 [..., K/2]`` -> nibble codes ``uint8 [..., K]``.

    ``out[..., 2i] = packed[..., i] & 0xF``, ``out[..., 2i+1] = packed[..., i] >> 4``.

    Args:
        packed: ``torch.uint8 [..., K/2]``, at least 1-D.  (A ``torch.float4_e2m1fn_x2``
            tensor must be reinterpreted first with ``.view(torch.uint8)``; it is
            rejected here so that the conversion is explicit.)

    Returns:
        contiguous ``torch.uint8 [..., K]`` with values ``0..15``.

    Raises:
        TypeError: ``packed`` is not ``torch.uint8``.
        ValueError: ``packed`` is 0-D.
    """
    require_dtype("packed", packed, (torch.uint8,), "packed E2M1, 2 codes per byte, low nibble first "
                  "(reinterpret float4_e2m1fn_x2 with .view(torch.uint8))")
    if packed.dim() == 0:
        raise ValueError("packed: expected uint8 [..., K/2], got a 0-D tensor")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
