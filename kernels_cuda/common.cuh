// Shared device helpers for dsv4 NVRTC kernels. No CUDA toolkit header is included: the
// sources must compile with a bare NVRTC (CI wheel) and with the GPU image's NVRTC 13.0.
//
// Conventions (see docs/layouts/*.md):
//   * packed FP4: 2 x E2M1 per byte, element 2i in the LOW nibble; nibble bit 3 = sign,
//     bits 2:0 index the levels [0, 0.5, 1, 1.5, 2, 3, 4, 6].
//   * E4M3 = float8_e4m3fn bytes (bias 7, no inf, 0x7F/0xFF NaN, max 448).
//   * UE8M0 byte b means 2^(b-127); 0xFF is NaN.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;
typedef int i32;
typedef long long i64;

#define DSV4_DEVICE __device__ __forceinline__

struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(8) u32x2 { u32 x, y; };

// ---------------------------------------------------------------------------------------
// memory
DSV4_DEVICE u32x4 ld_global_nc_v4(const void* p) {
  u32x4 r;
  asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
DSV4_DEVICE void st_global_v4(void* p, u32x4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
DSV4_DEVICE void st_global_v2(void* p, u32x2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1,%2};" :: "l"(p), "r"(v.x), "r"(v.y) : "memory");
}

// ---------------------------------------------------------------------------------------
// bit tricks
DSV4_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
DSV4_DEVICE float u32_as_f32(u32 u) { return __uint_as_float(u); }
DSV4_DEVICE u32 f32_as_u32(float f) { return __float_as_uint(f); }

// bf16 helpers (bit level). cvt.rn.bf16x2.f32 d, hi, lo : d = {bf16(hi) << 16 | bf16(lo)}
DSV4_DEVICE u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
DSV4_DEVICE u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
DSV4_DEVICE float bf16_lo_to_f32(u32 v) { return __uint_as_float(v << 16); }
DSV4_DEVICE float bf16_hi_to_f32(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }
DSV4_DEVICE float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// ---------------------------------------------------------------------------------------
// E2M1 decode by byte LUT (prmt). Never arithmetic on the nibble (seed 000).
//
// bf16 bit patterns of the magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]:
//   0x0000 0x3F00 0x3F80 0x3FC0 0x4000 0x4040 0x4080 0x40C0
// so the high byte is LUT_HI[idx] and the low byte LUT_LO[idx]; prmt with the 3-bit index as
// selector picks a byte from the 8-byte pool {b, a}. The sign (nibble bit 3) goes to bit 15.
#define DSV4_E2M1_HI_A 0x3F3F3F00u  // idx 3..0 -> 3F 3F 3F 00
#define DSV4_E2M1_HI_B 0x40404040u  // idx 7..4
#define DSV4_E2M1_LO_A 0xC0800000u  // idx 3..0 -> C0 80 00 00
#define DSV4_E2M1_LO_B 0xC0804000u  // idx 7..4 -> C0 80 40 00

// 8 E2M1 values packed in w (element i in nibble i) -> 8 bf16 in out[0..3]
// (out[j] = bf16(e_{2j}) | bf16(e_{2j+1}) << 16).
DSV4_DEVICE void e2m1x8_to_bf16x8(u32 w, u32 out[4]) {
  const u32 idx = w & 0x77777777u;
  const u32 lo_a = prmt(DSV4_E2M1_LO_A, DSV4_E2M1_LO_B, idx);        // low bytes, e0..e3
  const u32 hi_a = prmt(DSV4_E2M1_HI_A, DSV4_E2M1_HI_B, idx);        // high bytes, e0..e3
  const u32 lo_b = prmt(DSV4_E2M1_LO_A, DSV4_E2M1_LO_B, idx >> 16);  // e4..e7
  const u32 hi_b = prmt(DSV4_E2M1_HI_A, DSV4_E2M1_HI_B, idx >> 16);
  // interleave {lo, hi} byte pairs: selector picks bytes from pool {hi(4..7), lo(0..3)}
  out[0] = prmt(lo_a, hi_a, 0x5140u);
  out[1] = prmt(lo_a, hi_a, 0x7362u);
  out[2] = prmt(lo_b, hi_b, 0x5140u);
  out[3] = prmt(lo_b, hi_b, 0x7362u);
  // sign bits: nibble bit 3 of element e sits at bit 4e+3 of w; move to bit 15 / 31 of the pair
  const u32 s = w & 0x88888888u;
  out[0] |= ((s << 12) & 0x00008000u) | ((s << 24) & 0x80000000u);
  out[1] |= ((s << 4) & 0x00008000u) | ((s << 16) & 0x80000000u);
  out[2] |= ((s >> 4) & 0x00008000u) | ((s << 8) & 0x80000000u);
  out[3] |= ((s >> 12) & 0x00008000u) | (s & 0x80000000u);
}

// ---------------------------------------------------------------------------------------
// scale decodes
// UE8M0 byte -> float 2^(b-127) (b = 0 -> 2^-127, a subnormal; 0xFF -> NaN)
DSV4_DEVICE float ue8m0_to_f32(u32 b) {
  b &= 0xFFu;
  if (b == 0xFFu) return __uint_as_float(0x7FC00000u);
  if (b == 0u) return __uint_as_float(0x00400000u);
  return __uint_as_float(b << 23);
}
// E4M3 (fn) byte -> float, exact (via f16: e4m3x2 -> f16x2 is exact on sm_89+).
DSV4_DEVICE float e4m3_to_f32(u32 b) {
  u32 h2;
  u16 v = (u16)(b & 0xFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
  return f16_to_f32((u16)(h2 & 0xFFFFu));
}
// two E4M3 bytes (low 16 bits of v) -> two floats
DSV4_DEVICE void e4m3x2_to_f32x2(u32 v, float& lo, float& hi) {
  u32 h2;
  u16 vv = (u16)(v & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(vv));
  lo = f16_to_f32((u16)(h2 & 0xFFFFu));
  hi = f16_to_f32((u16)(h2 >> 16));
}
// float pair -> two E4M3 bytes (RN, satfinite) in the low 16 bits: lo in byte 0.
DSV4_DEVICE u32 f32x2_to_e4m3x2(float lo, float hi) {
  u16 r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return (u32)r;
}

// ---------------------------------------------------------------------------------------
// warp reductions
DSV4_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
DSV4_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}
