// Device helpers of the quantization kernels (quantize.cu). Bit-exact with dsv4/formats:
//   * block amax on packed bf16/fp16 pairs (max.u16x2 on |bits|; NaN > Inf > finite): FP4 blocks with
//     a NaN / Inf get the NaN scale (OCP MX rule); FP8 uses the finite-only amax (NaN/Inf count as 0);
//   * E2M1 round-to-nearest-even on the level set {0,.5,1,1.5,2,3,4,6} without a hardware
//     e2m1 convert (sm_90 has none) and without a compare ladder: one magic-number fp32 add
//     rounds |y| at the E2M1 ulp of its binade, an integer subtract reads the level index;
//   * E4M3 via cvt.rn.satfinite.e4m3x2.f32 (common.cuh), UE8M0 by exponent-field arithmetic.
#pragma once
#include "common.cuh"

#ifndef DSV4_IN
#define DSV4_IN 0  // 0 = bf16, 1 = fp16 input
#endif

#if DSV4_IN == 0
#define DSV4_ABS_INF 0x7F80u   // |bf16| bits >= this: Inf or NaN
#else
#define DSV4_ABS_INF 0x7C00u   // |fp16| bits >= this: Inf or NaN
#endif

#define DSV4_FLT_MAX 3.402823466e+38f

#ifndef DSV4_E2M1_NAN
#define DSV4_E2M1_NAN 0u  // E2M1 code of a NaN input: dsv4.formats.E2M1_NAN_CODE (the provider passes it)
#endif

DSV4_DEVICE u32 max_u16x2(u32 a, u32 b) {
  u32 r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// 16-byte loads with an L2 eviction-priority cache policy (createpolicy, sm_80+), no L1 allocation.
// (The .L2::evict_* qualifiers on ld itself need 256-bit loads, i.e. sm_100.)
DSV4_DEVICE u64 l2_policy_evict_first() {
  u64 p;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
DSV4_DEVICE u64 l2_policy_evict_last() {
  u64 p;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
  return p;
}
DSV4_DEVICE u32x4 ld_hint_v4(const void* p, u64 pol) {
  u32x4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p), "l"(pol));
  return r;
}
DSV4_DEVICE u32x4 ld_stream_v4(const void* p) { return ld_hint_v4(p, l2_policy_evict_first()); }
DSV4_DEVICE u32x4 ld_keep_v4(const void* p) { return ld_hint_v4(p, l2_policy_evict_last()); }
DSV4_DEVICE void st_global_u32(void* p, u32 v) {
  asm volatile("st.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
DSV4_DEVICE void st_global_u8(void* p, u32 v) {
  asm volatile("st.global.u8 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// one input half (bits in the low 16 bits of h) -> fp32, exact
DSV4_DEVICE float half_bits_to_f32(u32 h) {
#if DSV4_IN == 0
  return __uint_as_float(h << 16);
#else
  return f16_to_f32((u16)(h & 0xFFFFu));
#endif
}
// the 8 elements of a 16-byte chunk -> fp32 (element 2j = low half of word j)
DSV4_DEVICE void chunk_to_f32(const u32x4& w, float f[8]) {
  const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#if DSV4_IN == 0
    f[2 * j] = __uint_as_float(ws[j] << 16);
    f[2 * j + 1] = __uint_as_float(ws[j] & 0xFFFF0000u);
#else
    f[2 * j] = f16_to_f32((u16)(ws[j] & 0xFFFFu));
    f[2 * j + 1] = f16_to_f32((u16)(ws[j] >> 16));
#endif
  }
}

// packed |x| maximum of a chunk: max.u16x2 over (w & 0x7FFF7FFF). |bits| order = |value| order.
DSV4_DEVICE u32 chunk_absmax_u16x2(const u32x4& w) {
  const u32 m = 0x7FFF7FFFu;
  return max_u16x2(max_u16x2(w.x & m, w.y & m), max_u16x2(w.z & m, w.w & m));
}
DSV4_DEVICE u32 hmax_u16x2(u32 v) { return max(v & 0xFFFFu, v >> 16); }

// finite-only |x| max of a chunk as |bits| (NaN/Inf count as 0, dsv4.formats.finite_absmax).
// `nonfinite` tells whether the chunk holds an Inf or NaN (then the slow encoders run).
DSV4_DEVICE u32 chunk_finite_absmax(const u32x4& w, bool& nonfinite) {
  u32 h = hmax_u16x2(chunk_absmax_u16x2(w));
  nonfinite = h >= DSV4_ABS_INF;
  if (nonfinite) {  // rare: drop the non-finite elements
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
    h = 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const u32 lo = ws[j] & 0x7FFFu, hi = (ws[j] >> 16) & 0x7FFFu;
      if (lo < DSV4_ABS_INF) h = max(h, lo);
      if (hi < DSV4_ABS_INF) h = max(h, hi);
    }
  }
  return h;
}

// ---------------------------------------------------------------------------------------
// E2M1 encode of one fp32 y (y = x * enc, enc > 0): nibble = sign << 3 | level index.
// |y| is clamped to 6 (saturation; +-Inf -> +-6). For a in [0, 6] with binade exponent
// eb = max(expfield(a), 127) the E2M1 ulp is 2^(eb-128) (0.5 below 2, 1 in [2,4), 2 in [4,6]);
// adding M = 2^(eb-127+22) rounds a at that ulp with the fp32 adder's round-to-nearest-even,
// which is exactly E2M1 RNE (ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4);
// bits(a + M) - bits(M) = round(a / ulp) = k and the level index is k + 2*(eb - 127).
// NaN is NOT handled here (e2m1_code_nan does it): the fast path runs only on chunks with no
// Inf/NaN input, where y cannot be NaN.
DSV4_DEVICE u32 e2m1_code(float y) {
  const float a = fminf(fabsf(y), 6.0f);
  const u32 u = __float_as_uint(a);
  const u32 eb = max(u >> 23, 127u);
  const u32 mb = (eb + 22u) << 23;
  const float s = a + __uint_as_float(mb);
  const u32 idx = __float_as_uint(s) - mb + 2u * eb - 254u;
  return idx | ((__float_as_uint(y) >> 28) & 8u);
}
// NaN -> DSV4_E2M1_NAN (dsv4.formats.E2M1_NAN_CODE, whatever the NaN's sign), otherwise e2m1_code.
DSV4_DEVICE u32 e2m1_code_nan(float y) { return (y != y) ? (u32)(DSV4_E2M1_NAN) : e2m1_code(y); }

// 8 elements (fp32) times `enc` -> 8 nibbles, element i at bits 4i..4i+3.
// Fast path (no NaN possible): the level index of element i is
//   idx = bits(a + M) - M + 2*eb - 254 = t - C,  t = bits(a + M) + eb * (2 - 2^23),
//   C = (22 << 23) + 254,
// and since the nibbles do not overlap, sum_i idx_i << 4i = sum_i t_i << 4i - C * 0x11111111
// (mod 2^32): one IMAD + one LEA per element, the constant is subtracted once per word.
#define DSV4_E2M1_C ((22u << 23) + 254u)
template <bool kNanAware>
DSV4_DEVICE u32 e2m1x8(const float f[8], float enc) {
  if (kNanAware) {
    u32 w = 0u;
#pragma unroll
    for (int i = 0; i < 8; ++i) w |= e2m1_code_nan(f[i] * enc) << (4 * i);
    return w;
  }
  u32 acc = 0u, sgn = 0u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float y = f[i] * enc;
    const float a = fminf(fabsf(y), 6.0f);
    const u32 eb = max(__float_as_uint(a) >> 23, 127u);
    const float s = a + __uint_as_float((eb + 22u) << 23);
    const u32 t = __float_as_uint(s) + eb * (2u - (1u << 23));
    acc += t << (4 * i);
    sgn |= (__float_as_uint(y) >> (28 - 4 * i)) & (8u << (4 * i));
  }
  return (acc - DSV4_E2M1_C * 0x11111111u) | sgn;
}

// ---------------------------------------------------------------------------------------
// UE8M0 helpers (normal positive fp32 t)
// ceil to a power of two: byte = expfield + (mantissa != 0)   (dsv4 kernel.py fast_round_scale)
DSV4_DEVICE u32 ue8m0_ceil_byte(float t) {
  const u32 b = __float_as_uint(t);
  return (b >> 23) + ((b & 0x7FFFFFu) != 0u ? 1u : 0u);
}
// exact 2^k for integer k in [-127, 127] (2^-127 is the fp32 subnormal 0x00400000)
DSV4_DEVICE float exp2_int(int k) {
  return k <= -127 ? __uint_as_float(0x00400000u) : __uint_as_float((u32)(k + 127) << 23);
}
// exact floor(log2(a)) for finite a > 0, subnormals included
DSV4_DEVICE int floor_log2(float a) {
  const u32 b = __float_as_uint(a);
  return b >= 0x00800000u ? (int)(b >> 23) - 127 : (31 - __clz((int)b)) - 149;
}

// ---------------------------------------------------------------------------------------
// correctly rounded x / s for s > 0 given r = RN(1/s) (Markstein: q0 within 1 ulp, the fma
// residual is exact, RN(q0 + e*r) = RN(x/s)); the sign is taken from x so that -0 stays -0.
DSV4_DEVICE float div_rn_by(float x, float s, float r) {
  const float q0 = x * r;
  const float e = fmaf(-q0, s, x);
  const float q = fmaf(e, r, q0);
  return __uint_as_float((__float_as_uint(q) & 0x7FFFFFFFu) | (__float_as_uint(x) & 0x80000000u));
}
