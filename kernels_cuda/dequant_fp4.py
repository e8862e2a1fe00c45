"""CUDA (NVRTC) provider for dequant_fp4: ``dequant_fp4.cu``, one thread per 16-byte chunk."""
from __future__ import annotations

import numpy as np
import torch

from dsv4.registry import Support

from ._provider import CudaProvider
from .nvrtc import launch, load

_FMT = {"mxfp4": 0, "nvfp4": 1}
_OUT = {"bfloat16": 0, "float32": 1}


class CudaDequantFp4(CudaProvider):
    describe = "dequant_fp4.cu: prmt byte-LUT E2M1 decode, warp-tiled coalesced 16 B stores"

    def supports_problem(self, problem):
        if problem["K"] % 32:
            return Support.no(f"cuda: K={problem['K']} is not a multiple of 32 (one 16-byte chunk per thread)")
        return Support.yes("sm_90a, K % 32 == 0")

    def run(self, problem, *, data, scale, global_scale):
        from dsv4.ops._common import str_dtype
        M, K = data.shape[0], 2 * data.shape[1]
        out = torch.empty((M, K), dtype=str_dtype(problem["out_dtype"]), device=data.device)
        n_words = M * K // 8                      # 32-bit words of packed data
        if n_words == 0:
            return out
        mod = load("dequant_fp4.cu", DSV4_FMT=_FMT[problem["fmt"]], DSV4_OUT=_OUT[problem["out_dtype"]])
        g = global_scale if global_scale is not None else data  # unused pointer for mxfp4
        words_per_block = 8 * 32 * 4              # 8 warps x 32 lanes x 4 words
        launch(mod.kernel("dequant_fp4_kernel"), -(-n_words // words_per_block), 256, data, scale, g, out,
               np.int64(n_words))
        return out


PROVIDERS = {"dequant_fp4": CudaDequantFp4}
