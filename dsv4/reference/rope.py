"""Rotary position embedding of DSV4 (interleaved pairs, optional YaRN), torch reference.

Source: dsv4_spec.md 1 / 2.2 / 2.3 (FLASH-REF model.py ``precompute_freqs_cis`` and
``apply_rotary_emb``). Compressed layers (CSA/HCA) and their indexer use
``compress_rope_theta = 160000`` with YaRN (factor 16, original_max_position_embeddings
65536, beta_fast 32, beta_slow 1); SWA-only layers use ``rope_theta = 10000`` without YaRN.

* :func:`precompute_freqs_cis` reproduces the reference formula (fp32 throughout,
  ``torch.polar``), complex64 ``[seqlen, dim/2]``.
* :func:`rope_cos_sin_table` is the same table as fp32 ``[seqlen, dim]`` with interleaved
  ``(cos_i, sin_i)`` pairs (``torch.view_as_real``), the layout the CUDA kernels read.
* :func:`apply_rope` rotates the interleaved pairs ``(x[2i], x[2i+1])`` of the last dim:
  ``y0 = x0*cos - x1*sin``, ``y1 = x0*sin + x1*cos``, each product and sum rounded in fp32
  (no FMA), exactly the complex64 multiply of the reference (ATen's vectorized complex
  multiply also rounds the four products before the add/sub), so kernels that do the same
  ``__fmul_rn``/``__fadd_rn`` sequence match bit for bit.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["COMPRESS_ROPE", "SWA_ROPE", "precompute_freqs_cis", "rope_cos_sin_table", "apply_rope"]

#: DSV4 compressed-layer RoPE (dim 64): (base, original_seq_len, factor, beta_fast, beta_slow)
COMPRESS_ROPE = dict(base=160000.0, original_seq_len=65536, factor=16.0, beta_fast=32, beta_slow=1)
#: DSV4 SWA-only layers: plain RoPE, no YaRN
SWA_ROPE = dict(base=10000.0, original_seq_len=0, factor=16.0, beta_fast=32, beta_slow=1)


@lru_cache(maxsize=8)
def precompute_freqs_cis(dim: int = 64, seqlen: int = 65536, original_seq_len: int = 65536,
                         base: float = 160000.0, factor: float = 16.0, beta_fast: int = 32,
                         beta_slow: int = 1) -> torch.Tensor:
    """Complex exponentials ``exp(i * t * freq_j)``, complex64 ``[seqlen, dim/2]`` (FLASH-REF L200-229).

    With ``original_seq_len > 0`` the YaRN frequency interpolation applies: frequencies
    outside the ``[beta_fast, beta_slow]`` correction range are divided by ``factor`` with a
    linear ramp in between.
    """
    def find_correction_dim(num_rotations, dim, base, max_seq_len):
        return dim * math.log(max_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_seq_len):
        low = math.floor(find_correction_dim(low_rot, dim, base, max_seq_len))
        high = math.ceil(find_correction_dim(high_rot, dim, base, max_seq_len))
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(lo, hi, n):
        if lo == hi:
            hi += 0.001
        return torch.clamp((torch.arange(n, dtype=torch.float32) - lo) / (hi - lo), 0, 1)

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        low, high = find_correction_range(beta_fast, beta_slow, dim, base, original_seq_len)
        smooth = 1 - linear_ramp_factor(low, high, dim // 2)
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    t = torch.arange(seqlen)
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_cos_sin_table(seqlen: int, dim: int = 64, *, compressed: bool = True, device=None) -> torch.Tensor:
    """fp32 ``[seqlen, dim]`` table, row t = ``(cos_0, sin_0, cos_1, sin_1, ...)`` at position t.

    ``compressed=True``: compress_rope_theta 160000 with YaRN (CSA/HCA layers, compressors,
    indexer); ``False``: rope_theta 10000 without YaRN (SWA-only layers).
    """
    cfg = COMPRESS_ROPE if compressed else SWA_ROPE
    fc = precompute_freqs_cis(dim, seqlen, cfg["original_seq_len"], cfg["base"], cfg["factor"],
                              cfg["beta_fast"], cfg["beta_slow"])
    return torch.view_as_real(fc).reshape(seqlen, dim).contiguous().to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [..., N, dim]`` at ``positions [N]`` (fp32 result).

    Args:
        x: float tensor ``[N, dim]`` or ``[N, H, dim]`` (cast to fp32).
        positions: int ``[N]`` row indices into ``table``.
        table: fp32 ``[P, dim]`` from :func:`rope_cos_sin_table`.
        inverse: rotate by ``-angle`` (conjugate), as the reference does on the attention output.

    Returns:
        fp32 tensor of ``x.shape``; the caller rounds (the reference copies into bf16).
    """
    cs = table[positions.long()].float()                     # [N, dim]
    c, s = cs[..., 0::2], cs[..., 1::2]                       # [N, dim/2]
    if x.dim() == 3:
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    if inverse:
        s = -s
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return torch.stack((y0, y1), dim=-1).flatten(-2)
