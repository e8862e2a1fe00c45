"""Torch reference implementations of the number formats DSV4 kernels read and write.

Pure torch, vectorized, device-agnostic (CPU or GPU).  Byte conventions at every boundary:

* packed FP4: ``torch.uint8 [..., K/2]``, element 2i in the LOW nibble, 2i+1 in the high;
  a nibble is sign-magnitude E2M1 (bit 3 sign, bits 2:0 index ``(0, .5, 1, 1.5, 2, 3, 4, 6)``);
* E4M3 scales / FP8 data: ``torch.float8_e4m3fn``; UE8M0 scales: ``torch.float8_e8m0fnu``
  (byte b = 2^(b-127), 0xFF NaN);
* raw bytes <-> float8 only through ``.view(dtype)``, never ``.to(dtype)`` (seed 003).

Modules: :mod:`.e2m1` (element codes, LUT decode, packing), :mod:`.scales` (E4M3 / UE8M0),
:mod:`.nvfp4`, :mod:`.mxfp4`, :mod:`.fp8` (block quantizers), :mod:`.swizzle` (128x4 SF layout).
"""
from .e2m1 import (E2M1_LEVELS, E2M1_MAX, E2M1_NAN_CODE, e2m1_decode, e2m1_encode, e2m1_levels,
                   e2m1_values, pack_e2m1, unpack_e2m1)
from .fp8 import FP8_AMAX_FLOOR, dequantize_fp8_block, quantize_fp8_block
from .mxfp4 import MXFP4_AMAX_FLOOR, MXFP4_BLOCK, dequantize_mxfp4, finite_absmax, quantize_mxfp4
from .nvfp4 import (NVFP4_BLOCK, NVFP4Tensor, dequantize_nvfp4, nvfp4_global_decode_scale,
                    nvfp4_global_encode_scale, quantize_nvfp4)
from .scales import (E4M3_MAX, UE8M0_NAN_BYTE, e4m3_bytes, e4m3_encode, e4m3_from_bytes, ue8m0_bytes,
                     ue8m0_ceil, ue8m0_decode, ue8m0_encode_pow2, ue8m0_floor, ue8m0_from_bytes)
from .swizzle import swizzle_sf_128x4, swizzled_sf_offset, swizzled_sf_shape, unswizzle_sf_128x4

__all__ = [
    # e2m1
    "E2M1_LEVELS", "E2M1_MAX", "E2M1_NAN_CODE", "e2m1_levels", "e2m1_values", "e2m1_encode",
    "e2m1_decode", "pack_e2m1", "unpack_e2m1",
    # scales
    "E4M3_MAX", "UE8M0_NAN_BYTE", "e4m3_bytes", "e4m3_from_bytes", "e4m3_encode", "ue8m0_bytes",
    "ue8m0_from_bytes", "ue8m0_decode", "ue8m0_encode_pow2", "ue8m0_ceil", "ue8m0_floor",
    # nvfp4
    "NVFP4_BLOCK", "NVFP4Tensor", "nvfp4_global_encode_scale", "nvfp4_global_decode_scale",
    "quantize_nvfp4", "dequantize_nvfp4",
    # mxfp4
    "MXFP4_BLOCK", "MXFP4_AMAX_FLOOR", "quantize_mxfp4", "dequantize_mxfp4", "finite_absmax",
    # fp8
    "FP8_AMAX_FLOOR", "quantize_fp8_block", "dequantize_fp8_block",
    # swizzle
    "swizzle_sf_128x4", "unswizzle_sf_128x4", "swizzled_sf_offset", "swizzled_sf_shape",
]
