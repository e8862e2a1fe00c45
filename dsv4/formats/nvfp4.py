"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements along K, plus an fp32 global scale.

Used by NVIDIA's DSV4 NVFP4 checkpoints (routed experts: ``weight`` uint8 ``[out, in/2]``
low nibble first, ``weight_scale`` e4m3 ``[out, in/16]``, ``weight_scale_2`` fp32;
``dequant = e2m1 * weight_scale * weight_scale_2``), DeepGEMM's NVFP4 MegaMoE and SGLang's
experimental NVFP4 KV codec (dsv4_spec.md 2.7).  Official DSV4 has no NVFP4.

Global scale (NVIDIA convention: TransformerEngine ``nvfp4_global_encode_scale`` / CUTLASS
block-scaled epilogue; dsv4_spec.md 2.7 notes the ``amax/(448*6)`` choice is a convention)::

    amax  = max |x|  over the tensor (per expert for grouped [E, M, K])
    g_enc = min(448 * 6 / amax, FLT_MAX)     encode multiplier  (NVFP4Tensor.global_encode_scale)
    g_enc = 1.0  if amax == 0                                (CUTLASS: amax > 0 ? ... : 1)
    g_enc = NaN  if amax is NaN or Inf (some element is)     (OCP MX rule, see below)
    g_dec = 1 / g_enc                         decode multiplier (NVFP4Tensor.global_scale,
                                              = amax / 2688; the checkpoints' weight_scale_2)

Per block of 16 (TransformerEngine NVFP4 reference quantizer ``_quantize_blockwise_reference``,
association order kept literally so codes are bit-exact with TE-style kernels)::

    vmax  = max |x_blk|
    s     = e4m3_rne(min(vmax * (g_enc * fp32(1/6)), 448))      block scale (saturates at 448)
    enc   = min(1 / (float(s) * g_dec), FLT_MAX)
    code  = e2m1_rne(clamp(x * enc, -6, 6))
    code  = sign-only (+-0) where s == 0                       (no NaN; TE would saturate them)

Algebraically ``s = e4m3(vmax/6 * g_enc)`` and ``code = e2m1(x * g_enc / s)``; the grouping
above only moves the fp32 intermediates by about an ulp, but that flips E4M3/E2M1 rounding
ties often enough to matter for bit-exact comparison: on random bf16 data the literal
``vmax/6*g_enc`` / ``x*g_enc/s`` form differs from this one in ~0.02% of block scales and
~0.1% of packed bytes.  A kernel that must match this reference bit for bit has to use the
grouping above (precomputed ``g_enc*(1/6)`` multiplier, ``1/(s*g_dec)`` reciprocal, and
true divisions, not ``a * (1/b)``, where a division is written).

Dequantization (all fp32, then one rounding to ``out_dtype``)::

    x = (e2m1(code) * float(s)) * global_scale         (e2m1 * s is exact in fp32)

Non-finite inputs (the OCP MX v1.0 section 6.3 rule, issue 19 item 13): a block whose amax
is NaN or Inf (a block holding any NaN or +-Inf) gets the NaN block scale (E4M3 byte 0x7F)
and all-zero codes, so it decodes to NaN; a non-finite tensor amax (computed global scale)
gives ``g_enc = g_dec = NaN`` and then every block of that tensor (expert) gets the NaN scale
and zero codes.  A caller-supplied global scale must be finite and > 0 (checked).  Overflow and
NaN upstream therefore stay visible instead of becoming silently finite.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ._checks import require_dtype, require_float_input, require_ndim, require_out_dtype
from .e2m1 import E2M1_MAX, e2m1_decode, e2m1_encode, pack_e2m1, unpack_e2m1
from .mxfp4 import _INV6_F32, finite_absmax  # fp32(1/6), as the kernels use
from .scales import E4M3_MAX
from .swizzle import swizzle_sf_128x4, swizzled_sf_shape, unswizzle_sf_128x4

__all__ = [
    "NVFP4_BLOCK",
    "NVFP4Tensor",
    "nvfp4_global_encode_scale",
    "nvfp4_global_decode_scale",
    "quantize_nvfp4",
    "dequantize_nvfp4",
]

#: Elements per E4M3 block scale.
NVFP4_BLOCK = 16
#: E4M3 byte of a NaN block scale (S.1111.111 with S = 0)
E4M3_NAN_BYTE = 0x7F
_FLT_MAX = torch.finfo(torch.float32).max
_SF_LAYOUTS = ("linear", "swizzled")


def _rdiv(num: float, t: torch.Tensor) -> torch.Tensor:
    """``num / t`` correctly rounded in fp32.

    ``python_scalar / tensor`` in torch is ``t.reciprocal() * num`` (two roundings, e.g.
    2688 / 10.533976 comes out 1 ulp low); kernels and TE divide once.
    """
    return torch.div(torch.full_like(t, num), t)


def nvfp4_global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``g_enc = min(448*6 / amax, FLT_MAX)``; 1.0 where ``amax <= 0``; NaN where ``amax`` is
    NaN or +-Inf (OCP MX rule: a non-finite amax gives a NaN scale).

    Args:
        amax: float tensor (any shape) of per-tensor absolute maxima.

    Returns:
        float32 tensor of ``amax.shape``: the *encode* multiplier (x * g_enc lands in
        ``[-2688, 2688]``).  Source: TransformerEngine / CUTLASS NVFP4 recipe.

    Raises:
        TypeError: ``amax`` is not a float tensor.
    """
    require_float_input("amax", amax, "per-tensor absolute maxima")
    a = amax.float()
    g = torch.clamp(_rdiv(E4M3_MAX * E2M1_MAX, a), max=_FLT_MAX)
    g = torch.where(a > 0, g, torch.ones_like(g))
    return torch.where(torch.isfinite(a), g, torch.full_like(g, float("nan")))


def nvfp4_global_decode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``1 / nvfp4_global_encode_scale(amax)`` (fp32): the dequant multiplier, ~``amax/2688``.

    This is what :attr:`NVFP4Tensor.global_scale` stores (= checkpoint ``weight_scale_2``).
    """
    return _rdiv(1.0, nvfp4_global_encode_scale(amax))


@dataclass
class NVFP4Tensor:
    """An NVFP4-quantized ``[M, K]`` matrix or ``[E, M, K]`` expert stack.

    Attributes:
        data: ``torch.uint8 [..., M, K/2]`` packed E2M1, element 2i in the low nibble.
        scale: ``torch.float8_e4m3fn`` block scales, one per 16 along K:
            ``sf_layout="linear"``: ``[..., M, K/16]``;
            ``sf_layout="swizzled"``: ``[..., ceil(M/128), ceil(K/64), 32, 4, 4]`` (the
            cuBLAS/CUTLASS 128x4 layout, see :mod:`dsv4.formats.swizzle`; padding = 0).
        global_scale: ``torch.float32`` **decode** multiplier ``g_dec = 1/g_enc``
            (~``amax/(448*6)``): 0-dim for 2-D tensors, ``[E]`` for ``[E, M, K]``.
            ``x ~= e2m1 * scale * global_scale``.
        shape: logical shape ``(M, K)`` or ``(E, M, K)`` (Python ints).
        sf_layout: ``"linear"`` or ``"swizzled"``.
        global_encode_scale: ``torch.float32`` **encode** multiplier ``g_enc``
            (~``448*6/amax``), same shape as ``global_scale``.  If omitted it is set to
            ``1 / global_scale``.

    Raises (on construction):
        TypeError / ValueError: any field with the wrong dtype or a shape inconsistent with
            ``shape`` and ``sf_layout``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    shape: Tuple[int, ...]
    sf_layout: str = "linear"
    global_encode_scale: Optional[torch.Tensor] = None

    def __post_init__(self):
        if not isinstance(self.shape, (tuple, list)) or len(self.shape) not in (2, 3) or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape):
            raise ValueError(f"shape: expected (M, K) or (E, M, K) of positive ints, got {self.shape!r}")
        self.shape = tuple(self.shape)
        *batch, M, K = self.shape
        batch = tuple(batch)
        if K % NVFP4_BLOCK:
            raise ValueError(f"shape: K={K} must be a multiple of 16 (one E4M3 scale per 16)")
        if self.sf_layout not in _SF_LAYOUTS:
            raise ValueError(f"sf_layout: expected 'linear' or 'swizzled', got {self.sf_layout!r}")
        require_dtype("data", self.data, (torch.uint8,), "[..., M, K/2] packed E2M1, low nibble first")
        if tuple(self.data.shape) != (*batch, M, K // 2):
            raise ValueError(f"data: expected shape {(*batch, M, K // 2)} ([..., M, K/2] packed E2M1), "
                             f"got {tuple(self.data.shape)}")
        require_dtype("scale", self.scale, (torch.float8_e4m3fn,),
                      "E4M3 block scales; reinterpret raw bytes with .view(torch.float8_e4m3fn)")
        want = (*batch, M, K // NVFP4_BLOCK) if self.sf_layout == "linear" else \
            (*batch, *swizzled_sf_shape(M, K // NVFP4_BLOCK))
        if tuple(self.scale.shape) != want:
            raise ValueError(f"scale: expected shape {want} for sf_layout={self.sf_layout!r}, "
                             f"got {tuple(self.scale.shape)}")
        require_dtype("global_scale", self.global_scale, (torch.float32,), "fp32 decode multiplier")
        if tuple(self.global_scale.shape) != batch:
            raise ValueError(f"global_scale: expected shape {batch} ({'0-dim' if not batch else '[E]'} fp32 "
                             f"decode multiplier), got {tuple(self.global_scale.shape)}")
        if self.global_encode_scale is None:
            self.global_encode_scale = _rdiv(1.0, self.global_scale)
        else:
            require_dtype("global_encode_scale", self.global_encode_scale, (torch.float32,),
                          "fp32 encode multiplier")
            if tuple(self.global_encode_scale.shape) != batch:
                raise ValueError(f"global_encode_scale: expected shape {batch}, "
                                 f"got {tuple(self.global_encode_scale.shape)}")

    @property
    def M(self) -> int:
        return self.shape[-2]

    @property
    def K(self) -> int:
        return self.shape[-1]

    def linear_scale(self) -> torch.Tensor:
        """Block scales in linear layout ``[..., M, K/16]`` (float8_e4m3fn)."""
        if self.sf_layout == "linear":
            return self.scale
        return unswizzle_sf_128x4(self.scale, self.M, self.K // NVFP4_BLOCK)

    def with_sf_layout(self, sf_layout: str) -> "NVFP4Tensor":
        """Same tensor with scales re-laid out as ``"linear"`` or ``"swizzled"``."""
        if sf_layout not in _SF_LAYOUTS:
            raise ValueError(f"sf_layout: expected 'linear' or 'swizzled', got {sf_layout!r}")
        lin = self.linear_scale()
        sc = lin if sf_layout == "linear" else swizzle_sf_128x4(lin)
        return NVFP4Tensor(self.data, sc, self.global_scale, self.shape, sf_layout, self.global_encode_scale)

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Shorthand for :func:`dequantize_nvfp4`."""
        return dequantize_nvfp4(self, out_dtype)


def quantize_nvfp4(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None,
                   sf_layout: str = "linear") -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 (formulas in the module docstring).

    Args:
        x: float32 / bfloat16 / float16 tensor ``[M, K]`` or grouped ``[E, M, K]`` (one global
            scale per expert); ``K % 16 == 0``; any ``M >= 1``.
        global_scale: ``None`` (computed from the finite amax: ``g_dec = 1/min(2688/amax,
            FLT_MAX)``, 1.0 for an all-zero tensor) or an fp32 tensor holding the **decode**
            multiplier (same meaning as :attr:`NVFP4Tensor.global_scale`; e.g. a checkpoint's
            ``weight_scale_2``): 0-dim or ``[1]`` for 2-D ``x``, ``[E]`` for 3-D ``x``; must be
            finite and > 0.  Then ``g_enc = 1/global_scale``.
        sf_layout: ``"linear"`` (scale ``[..., M, K/16]``) or ``"swizzled"`` (128x4 layout).

    Returns:
        :class:`NVFP4Tensor` (``global_scale`` 0-dim for 2-D input, ``[E]`` for 3-D).  Blocks
        holding a NaN / +-Inf get scale 0x7F (NaN) and zero codes; a non-finite tensor amax
        gives a NaN global scale and NaN block scales everywhere (module docstring).

    Raises:
        TypeError: bad dtypes.
        ValueError: bad shapes, ``K % 16 != 0``, non-positive / non-finite ``global_scale``,
            unknown ``sf_layout``.
    """
    require_float_input("x", x, "[M, K] or [E, M, K] values to quantize")
    require_ndim("x", x, (2, 3), "[M, K] or [E, M, K]")
    if sf_layout not in _SF_LAYOUTS:
        raise ValueError(f"sf_layout: expected 'linear' or 'swizzled', got {sf_layout!r}")
    *batch, M, K = x.shape
    batch = tuple(batch)
    if M == 0 or K == 0 or (batch and batch[0] == 0):
        raise ValueError(f"x: expected non-empty [M, K] / [E, M, K], got {tuple(x.shape)}")
    if K % NVFP4_BLOCK:
        raise ValueError(f"x: expected K % 16 == 0 (one E4M3 scale per 16 along K), got shape {tuple(x.shape)}")
    xf = x.float()

    if global_scale is None:
        amax = xf.reshape(*batch, M * K).abs().amax(dim=-1)       # () or [E]; NaN / Inf propagate
        amax = torch.where(torch.isnan(xf.reshape(*batch, M * K)).any(dim=-1), torch.full_like(amax, float("nan")),
                           amax)
        g_enc = nvfp4_global_encode_scale(amax)
        g_dec = _rdiv(1.0, g_enc)
    else:
        require_dtype("global_scale", global_scale, (torch.float32,), "fp32 decode multiplier (~amax/2688)")
        if batch:
            if tuple(global_scale.shape) != batch:
                raise ValueError(f"global_scale: expected shape {batch} (one fp32 decode multiplier per "
                                 f"expert) for x {tuple(x.shape)}, got {tuple(global_scale.shape)}")
            g_dec = global_scale.to(x.device)
        else:
            if global_scale.numel() != 1 or global_scale.dim() > 1:
                raise ValueError(f"global_scale: expected a 0-dim or [1] fp32 decode multiplier for 2-D x, "
                                 f"got shape {tuple(global_scale.shape)}")
            g_dec = global_scale.to(x.device).reshape(())
        if not bool((torch.isfinite(g_dec) & (g_dec > 0)).all()):
            raise ValueError("global_scale: expected finite values > 0 (decode multiplier ~amax/2688)")
        g_dec = g_dec.clone()
        g_enc = _rdiv(1.0, g_dec)

    bshape = (*batch, 1, 1, 1)  # broadcast over [..., M, K/16, 16]
    blk = xf.reshape(*batch, M, K // NVFP4_BLOCK, NVFP4_BLOCK)
    # NaN / Inf block, or NaN global scale -> NaN block scale 0x7F and zero codes (OCP MX 6.3)
    bad = (~torch.isfinite(blk)).any(dim=-1, keepdim=True) | torch.isnan(g_enc).reshape(bshape)
    vmax = finite_absmax(blk, dim=-1, keepdim=True)              # (bad blocks: overwritten below)
    mult = (g_enc * _INV6_F32).reshape(bshape)
    s_f32 = torch.clamp(vmax * mult, max=_FLT_MAX).clamp(-E4M3_MAX, E4M3_MAX)
    s_e4m3 = s_f32.to(torch.float8_e4m3fn)
    s = s_e4m3.float()
    enc = torch.clamp(_rdiv(1.0, s * g_dec.reshape(bshape)), max=_FLT_MAX)
    codes = e2m1_encode(torch.clamp(blk * enc, -E2M1_MAX, E2M1_MAX))
    codes = torch.where(s == 0, codes & 0x8, codes)
    codes = torch.where(bad, torch.zeros_like(codes), codes)
    sb = torch.where(bad, torch.full_like(s_e4m3.view(torch.uint8), E4M3_NAN_BYTE), s_e4m3.view(torch.uint8))
    data = pack_e2m1(codes.reshape(*batch, M, K))
    sc = sb.view(torch.float8_e4m3fn).squeeze(-1)
    if sf_layout == "swizzled":
        sc = swizzle_sf_128x4(sc)
    return NVFP4Tensor(data=data, scale=sc, global_scale=g_dec, shape=(*batch, M, K),
                       sf_layout=sf_layout, global_encode_scale=g_enc)


def dequantize_nvfp4(t: NVFP4Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 -> real values ``(e2m1(code) * float(scale)) * global_scale`` (fp32, one final rounding).

    Args:
        t: :class:`NVFP4Tensor` (either ``sf_layout``).
        out_dtype: float32 (default), bfloat16 or float16.

    Returns:
        ``t.shape`` tensor of ``out_dtype``.

    Raises:
        TypeError: ``t`` is not an :class:`NVFP4Tensor`, or bad ``out_dtype``.
    """
    if not isinstance(t, NVFP4Tensor):
        raise TypeError(f"t: expected an NVFP4Tensor, got {type(t).__name__}")
    require_out_dtype("out_dtype", out_dtype)
    *batch, M, K = t.shape
    vals = e2m1_decode(unpack_e2m1(t.data)).reshape(*batch, M, K // NVFP4_BLOCK, NVFP4_BLOCK)
    s = t.linear_scale().float().unsqueeze(-1)
    g = t.global_scale.reshape(*batch, 1, 1, 1)
    return ((vals * s) * g).reshape(t.shape).to(out_dtype)
