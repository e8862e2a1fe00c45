"""Torch references (the ``torch`` providers) of the quantization ops: thin calls into
:mod:`dsv4.formats`, which defines the formats bit for bit. Not graph-capturable (the format
functions validate with host syncs); use them as oracles."""
from __future__ import annotations

import torch

from .. import formats as F
from ..registry import TorchProvider


class _TorchBase(TorchProvider):
    support_reason = "reference (dsv4.formats), any device"


class TorchQuantizeNvfp4(_TorchBase):
    describe = "dsv4.formats.quantize_nvfp4 (fp32 torch math)"

    def run(self, problem, *, x, global_scale):
        t = F.quantize_nvfp4(x, global_scale=global_scale, sf_layout=problem["sf_layout"])
        gs = torch.stack([t.global_scale.reshape(()), t.global_encode_scale.reshape(())]).float()
        return t.data, t.scale, gs


class TorchQuantizeMxfp4(_TorchBase):
    describe = "dsv4.formats.quantize_mxfp4 (fp32 torch math)"

    def run(self, problem, *, x):
        return F.quantize_mxfp4(x, rule=problem["rule"])


class TorchQuantizeFp8Block(_TorchBase):
    describe = "dsv4.formats.quantize_fp8_block (fp32 torch math)"

    def run(self, problem, *, x):
        q, s = F.quantize_fp8_block(x, block=problem["block"], scale_fmt=problem["scale_fmt"])
        if problem["scale_dtype"] == "float8_e8m0fnu":
            s = F.ue8m0_ceil(s)  # s is an exact power of two: ceil is the lossless encoding
        return q, s


class TorchDequantizeFp8Block(_TorchBase):
    describe = "dsv4.formats.dequantize_fp8_block (fp32 torch math)"

    def run(self, problem, *, q, scale):
        from ..ops._common import str_dtype
        if scale.dtype == torch.float8_e8m0fnu:
            scale = F.ue8m0_decode(scale)
        return F.dequantize_fp8_block(q, scale, block=problem["block"], out_dtype=str_dtype(problem["out_dtype"]))


PROVIDERS = {
    "quantize_nvfp4": TorchQuantizeNvfp4,
    "quantize_mxfp4": TorchQuantizeMxfp4,
    "quantize_fp8_block": TorchQuantizeFp8Block,
    "dequantize_fp8_block": TorchDequantizeFp8Block,
}
