// kv_cache.cuh: device helpers of kv_cache.cu (DSV4 paged KV caches, compressors, gather).
// Byte layouts (docs/layouts/kv_cache_append.md, dsv4/ops/kv_cache.py):
//   fp8_ds_mla (FlashMLA "MODEL1" / vLLM DSV4), 584 B per token, paged block of bs tokens:
//     block base = page * bs * 584
//     token data  at base + off * 576:  [0, 448) E4M3 nope dims, [448, 576) 64 x BF16 rope dims
//     token scales at base + bs * 576 + off * 8: 7 x UE8M0 (one per 64 nope dims), 1 pad byte (0)
//   indexer MXFP4, 68 B per token: block base = page * bs * 68
//     values at base + off * 64 (128 x E2M1, element 2i in the low nibble)
//     scales at base + bs * 64 + off * 4 (4 x UE8M0, one per 32)
#pragma once
#include "common.cuh"

#define KVC_D_ATTN 512
#define KVC_NOPE 448
#define KVC_ROPE 64
#define KVC_DATA_B 576
#define KVC_SF_B 8
#define KVC_TOKEN_B 584
#define KVC_D_IDX 128
#define KVC_IDX_VB 64
#define KVC_IDX_SB 4
#define KVC_IDX_TOKEN_B 68
#define KVC_FULL 0xFFFFFFFFu

DSV4_DEVICE float kvc_neg_inf() { return __int_as_float(0xff800000); }

// 8-byte non-coherent load (read-only data: kv inputs, caches read by gather)
DSV4_DEVICE u32x2 kvc_ld_nc_v2(const void* p) {
  u32x2 r;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
DSV4_DEVICE float4 kvc_ld_nc_f4(const float* p) {
  const u32x4 v = ld_global_nc_v4(p);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}
// coherent 16-byte load (state rows written earlier by this kernel)
DSV4_DEVICE float4 kvc_ld_f4(const float* p) {
  float4 r;
  asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p) : "memory");
  return r;
}
DSV4_DEVICE void kvc_st_f4(float* p, float4 v) {
  asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}

// round to bf16 (RN) and back
DSV4_DEVICE float kvc_bf16r(float x) { return bf16_lo_to_f32(pack_bf16x2(x, 0.f)); }

// |x| for finite x, 0 for NaN / Inf (the block amax counts finite elements only, as
// dsv4.formats.finite_absmax)
DSV4_DEVICE float kvc_finite_abs(float x) {
  const float a = fabsf(x);
  return a <= 3.402823466e38f ? a : 0.f;
}
// UE8M0 byte of 2^ceil(log2(x)) for a normal positive fp32 x (DSV4 kernel.py fast_round_scale)
DSV4_DEVICE u32 kvc_ue8m0_ceil_byte(float x) {
  const u32 b = __float_as_uint(x);
  return ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u);
}
DSV4_DEVICE float kvc_pow2(u32 byte) { return __uint_as_float(byte << 23); }  // byte in 1..254

// DSV4 act_quant (block 64, ue8m0): byte of s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))
DSV4_DEVICE u32 kvc_fp8_scale_byte(float amax) {
  return kvc_ue8m0_ceil_byte(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f));
}
// DSV4 fp4_act_quant (block 32): byte of s = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6)))
DSV4_DEVICE u32 kvc_fp4_scale_byte(float amax) {
  return kvc_ue8m0_ceil_byte(__fmul_rn(fmaxf(amax, 6.0f * 1.1754943508222875e-38f), 1.0f / 6.0f));
}

// E2M1 code (bit 3 = sign) of x already divided by its scale and clamped to [-6, 6]:
// round to nearest, ties to the even level code (midpoints of [0,.5,1,1.5,2,3,4,6]).
// The sign of values rounding to 0 is kept (-0 -> 0x8), as dsv4.formats.e2m1_encode.
DSV4_DEVICE u32 kvc_e2m1_code(float x) {
  const float a = fabsf(x);
  const u32 i = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return i | ((__float_as_uint(x) >> 28) & 8u);
}

// 4 floats -> 4 E4M3 bytes (RN, satfinite), element 0 in byte 0
DSV4_DEVICE u32 kvc_e4m3x4(float a, float b, float c, float d) {
  return f32x2_to_e4m3x2(a, b) | (f32x2_to_e4m3x2(c, d) << 16);
}

// All arithmetic is pinned (__fmaf_rn / __fadd_rn) so that prefill and decode, which share
// this code, produce bit-identical results regardless of the compiler's contraction choices.
// online (streaming) softmax-weighted sum for one channel: rows with score -inf carry no
// weight (exp(-inf) = 0) and are skipped, which also avoids (-inf) - (-inf).
DSV4_DEVICE void kvc_online(float& m, float& l, float& a, float s, float v) {
  if (s == kvc_neg_inf()) return;
  if (s > m) {
    const float al = expf(m - s);  // m = -inf -> 0
    a = __fmaf_rn(a, al, v);
    l = __fmaf_rn(l, al, 1.0f);
    m = s;
  } else {
    const float e = expf(s - m);
    a = __fmaf_rn(v, e, a);
    l = __fadd_rn(l, e);
  }
}
// Branch-free variant (same operations per case as kvc_online, so bit-identical for
// KVC_ONLINE == 1): one exp of -|s - m|, both updates computed, selects.
// KVC_ONLINE == 2: scores are pre-scaled by log2(e) and the exp is ex2.approx (MUFU);
// ex2(0) is forced to exactly 1 so single-row (one-hot) pooling stays exact.
DSV4_DEVICE float kvc_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
template <int MODE>
DSV4_DEVICE void kvc_online_sel(float& m, float& l, float& a, float s, float v) {
  const float arg = -fabsf(__fsub_rn(s, m));   // NaN only when s = m = -inf (then skipped)
  float x;
  if (MODE == 2) x = (arg == 0.f) ? 1.0f : kvc_ex2(arg);
  else x = expf(arg);
  const bool gt = s > m;
  const float a1 = __fmaf_rn(a, x, v), l1 = __fmaf_rn(l, x, 1.0f);  // s > m: rescale, new weight 1
  const float a2 = __fmaf_rn(v, x, a), l2 = __fadd_rn(l, x);        // s <= m: new weight x
  const bool skip = s == kvc_neg_inf();
  a = skip ? a : (gt ? a1 : a2);
  l = skip ? l : (gt ? l1 : l2);
  m = gt ? s : m;
}
// merge a second partial (m2, l2, a2) into (m, l, a)
template <int MODE>
DSV4_DEVICE void kvc_merge(float& m, float& l, float& a, float m2, float l2, float a2) {
  if (m2 == kvc_neg_inf()) return;
  if (m == kvc_neg_inf()) { m = m2; l = l2; a = a2; return; }
  const float mn = fmaxf(m, m2);
  const float f1 = MODE == 2 ? exp2f(m - mn) : expf(m - mn), f2 = MODE == 2 ? exp2f(m2 - mn) : expf(m2 - mn);
  a = __fmaf_rn(a, f1, __fmul_rn(a2, f2));
  l = __fmaf_rn(l, f1, __fmul_rn(l2, f2));
  m = mn;
}

// Sylvester-Hadamard over 128 dims held by one warp (lane l: dims 4l..4l+3) = DSV4
// rotate_activation (dsv4/reference/hadamard.py rotate_activation_ref; same as indexer.cu
// fwht128): fp64 butterflies (exact sums of bf16 inputs), x fp64(128^-0.5), ONE correct
// rounding fp64 -> bf16; v[] returns the bf16 values as fp32.
DSV4_DEVICE float kvc_bf16r_f64(double x) {
  const float f = __double2float_rn(x);
  u32 b = __float_as_uint(f);
  if ((b & 0xFFFFu) == 0x8000u && (double)f != x) b = fabs(x) > fabs((double)f) ? b + 1u : b - 1u;
  return kvc_bf16r(__uint_as_float(b));
}
DSV4_DEVICE void kvc_fwht128(float v[4], int lane) {
  double d[4] = {(double)v[0], (double)v[1], (double)v[2], (double)v[3]};
  const double a0 = d[0] + d[1], a1 = d[0] - d[1], a2 = d[2] + d[3], a3 = d[2] - d[3];
  d[0] = a0 + a2; d[2] = a0 - a2; d[1] = a1 + a3; d[3] = a1 - a3;
#pragma unroll
  for (int b = 0; b < 5; ++b) {
    const bool upper = (lane >> b) & 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const double p = __shfl_xor_sync(KVC_FULL, d[i], 1 << b);
      d[i] = upper ? (p - d[i]) : (d[i] + p);
    }
  }
  const double s = 0.08838834764831845;  // fp64(128^-0.5)
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = kvc_bf16r_f64(d[i] * s);
}
