"""Torch reference for dequant_fp4 (also the ``torch`` provider)."""
from __future__ import annotations

import torch

from ..formats import e2m1_decode, unpack_e2m1, ue8m0_decode
from ..registry import TorchProvider


def dequant_fp4_ref(data: torch.Tensor, scale: torch.Tensor, fmt: str, global_scale: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 math: mxfp4 ``e2m1 * 2^(sf-127)``; nvfp4 ``(e2m1 * e4m3(sf)) * global``; one rounding."""
    vals = e2m1_decode(unpack_e2m1(data))                       # [M, K] fp32
    sf_block = 32 if fmt == "mxfp4" else 16
    s = ue8m0_decode(scale) if fmt == "mxfp4" else scale.float()
    out = vals * s.repeat_interleave(sf_block, dim=-1)
    if fmt == "nvfp4":
        out = out * global_scale.float()
    return out.to(out_dtype)


class TorchDequantFp4(TorchProvider):
    describe = "torch reference (LUT decode, fp32 math)"

    def run(self, problem, *, data, scale, global_scale):
        from ..ops._common import str_dtype
        return dequant_fp4_ref(data, scale, problem["fmt"], global_scale, str_dtype(problem["out_dtype"]))


PROVIDERS = {"dequant_fp4": TorchDequantFp4}
