// common.cuh: the one header of device helpers for the dsv4 NVRTC kernels (a kernel defines no
// second copy of these; tests/test_cuda_headers.py). No CUDA toolkit header is included: the
// sources must compile with a bare NVRTC (CI wheel) and with the GPU image's NVRTC 13.0.
// Sections: memory (16 / 8 B global ld/st), bit tricks + bf16, E2M1 LUT decode, scale decodes,
// warp reductions, shared memory, cp.async, mbarrier + bulk copy, WGMMA (wrappers generated into
// common_wgmma.cuh by kernels_cuda/gen_headers.py), fwht128, E2M1 / UE8M0 encode.
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
// E2M1 decode by byte LUT (prmt). Never arithmetic on the nibble.
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

// a * b (bf16x2, RN): exact whenever the product is representable (E2M1 levels times
// power-of-two or E4M3 scales always are)
DSV4_DEVICE u32 bf16x2_mul(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// 8 E2M1 (element i in nibble i of w) -> out[j] = bf16x2 {element j, element j + 4} * f2 (the
// words of the 8 elements in the order [0, 4, 1, 5, 2, 6, 3, 7]). A nibble n placed as the bf16 bit
// pattern (n & 8) << 12 | (n & 7) << 6 (sign, then the 3 magnitude bits as exponent field bits 8:7
// + mantissa bit 6) is the bf16 value E2M1(n) * 2^-126 exactly (code 1 is the subnormal 2^-127,
// codes 2..7 normals 2^(E-127)(1 + m/2)); elements j and j + 4 need the same shift (one multiply
// by 2^6 + 2^12 or 2^2 + 2^8 places both halves). One bf16x2 multiply by f2 (f2 = {2^126, 2^126}:
// the plain levels; or the scale folded in) restores E2M1(n) * f * 2^-126; never arithmetic on
// the level index.
DSV4_DEVICE void e2m1x8_bf16_pairs(u32 w, u32 f2, u32 out[4]) {
  const u32 M = 0x81C081C0u;
  const u32 w8 = w >> 8;
  out[0] = bf16x2_mul(((w & 0x000F000Fu) * 4160u) & M, f2);   // 2^6 + 2^12
  out[1] = bf16x2_mul(((w & 0x00F000F0u) * 260u) & M, f2);    // 2^2 + 2^8
  out[2] = bf16x2_mul(((w8 & 0x000F000Fu) * 4160u) & M, f2);
  out[3] = bf16x2_mul(((w8 & 0x00F000F0u) * 260u) & M, f2);
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

// ---------------------------------------------------------------------------------------
// generic helpers first written for kv_cache.cu (moved here: not kv-specific)
// 8-byte non-coherent load (read-only data)
DSV4_DEVICE u32x2 ld_global_nc_v2(const void* p) {
  u32x2 r;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}
// 16-byte non-coherent load as 4 floats
DSV4_DEVICE float4 ld_global_nc_f4(const float* p) {
  const u32x4 v = ld_global_nc_v4(p);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}
// coherent 16-byte load / store of 4 floats (data this kernel wrote earlier)
DSV4_DEVICE float4 ld_global_v4_f32(const float* p) {
  float4 r;
  asm volatile("ld.global.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "l"(p) : "memory");
  return r;
}
DSV4_DEVICE void st_global_v4_f32(float* p, float4 v) {
  asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};" :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
DSV4_DEVICE float neg_inf_f32() { return __int_as_float(0xff800000); }
// round to bf16 (RN) and back to fp32
DSV4_DEVICE float round_bf16(float x) { return bf16_lo_to_f32(pack_bf16x2(x, 0.f)); }
// |x| for finite x, 0 for NaN / Inf (block amax over finite elements, dsv4.formats.finite_absmax)
DSV4_DEVICE float finite_abs(float x) {
  const float a = fabsf(x);
  return a <= 3.402823466e38f ? a : 0.f;
}
// 2^(byte - 127) for an exponent byte in 1..254 (UE8M0 without the 0 / 0xFF special cases)
DSV4_DEVICE float exp2_byte(u32 byte) { return __uint_as_float(byte << 23); }
// 4 floats -> 4 E4M3 bytes (RN, satfinite), element 0 in byte 0
DSV4_DEVICE u32 f32x4_to_e4m3x4(float a, float b, float c, float d) {
  return f32x2_to_e4m3x2(a, b) | (f32x2_to_e4m3x2(c, d) << 16);
}

// ---------------------------------------------------------------------------------------
// shared memory: 32-bit shared-window addresses, loads and stores by address
DSV4_DEVICE u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
DSV4_DEVICE u32x4 ld_shared_v4(u32 a) {
  u32x4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a));
  return r;
}
DSV4_DEVICE u32 ld_shared_u32(u32 a) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
  return r;
}
DSV4_DEVICE void st_shared_v4(u32 a, u32 x, u32 y, u32 z, u32 w) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" :: "r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
}
DSV4_DEVICE void st_shared_u32(u32 a, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;" :: "r"(a), "r"(v) : "memory");
}

// ---------------------------------------------------------------------------------------
// cp.async (sm_80+). PF: L2 prefetch-size hint in bytes (0 = none, 64, 128, 256): the L2 fetches
// the aligned sector group around the copied bytes (a hint, no semantic change).
// 16 bytes, cache-global, zero-filling the bytes past src_bytes (0..16)
DSV4_DEVICE void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
template <int PF> DSV4_DEVICE void cp_async_cg16(u32 dst, const void* src) {
  if constexpr (PF == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
  } else if constexpr (PF == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
  } else if constexpr (PF == 64) {
    asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
  }
}
// 8 or 4 bytes (cache-all; cp.async.cg copies 16 bytes only)
template <int PF, int BYTES> DSV4_DEVICE void cp_async_ca(u32 dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  if constexpr (PF == 256) {
    asm volatile("cp.async.ca.shared.global.L2::256B [%0], [%1], %2;\n" :: "r"(dst), "l"(src), "n"(BYTES) : "memory");
  } else if constexpr (PF == 128) {
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2;\n" :: "r"(dst), "l"(src), "n"(BYTES) : "memory");
  } else if constexpr (PF == 64) {
    asm volatile("cp.async.ca.shared.global.L2::64B [%0], [%1], %2;\n" :: "r"(dst), "l"(src), "n"(BYTES) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(dst), "l"(src), "n"(BYTES) : "memory");
  }
}
DSV4_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> DSV4_DEVICE void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// arrive on mbarrier bar once all prior cp.async of this thread have completed (one arrival)
DSV4_DEVICE void cp_async_mbar_arrive_noinc(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

// ---------------------------------------------------------------------------------------
// mbarrier (sm_90), 1-D bulk copies, proxy fence, named barriers
DSV4_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
DSV4_DEVICE void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
DSV4_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
}
DSV4_DEVICE void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory");
}
DSV4_DEVICE void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred p;\nDSV4_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra DSV4_MBAR_WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
// global -> shared bulk copy of `bytes` (multiple of 16, 16-byte aligned), completing on bar's tx count
DSV4_DEVICE void bulk_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// generic-proxy smem writes -> visible to the async proxy (WGMMA / TMA reads)
DSV4_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
DSV4_DEVICE void named_sync(u32 id, u32 nthreads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
}

// ---------------------------------------------------------------------------------------
// WGMMA (sm_90a): fence / commit / wait, register fence on accumulators, generated wrappers
DSV4_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
DSV4_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> DSV4_DEVICE void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// keeps the compiler from moving an accumulator's reads / writes across the asynchronous WGMMA
// issue / wait (CUTLASS warpgroup_fence_operand)
DSV4_DEVICE void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading /
// stride dimension byte offsets lbo / sbo (16-byte units, 14 bits each), base offset 0, swizzle
// mode in bits 62-63 (0 none, 1 128B, 2 64B, 3 32B; a swizzled tile's atoms 1024-B aligned)
DSV4_DEVICE u64 wgmma_desc(u32 saddr, u32 lbo, u32 sbo, u32 swizzle = 0) {
  u64 d = 0;
  d |= (u64)((saddr & 0x3FFFFu) >> 4);
  d |= (u64)((lbo >> 4) & 0x3FFFu) << 16;
  d |= (u64)((sbo >> 4) & 0x3FFFu) << 32;
  d |= (u64)(swizzle & 3u) << 62;
  return d;
}
#include "common_wgmma.cuh"

// ---------------------------------------------------------------------------------------
// Sylvester-Hadamard over 128 dims held by one warp (lane l: dims 4l..4l+3) = DSV4
// rotate_activation, the fp32 contract of dsv4/reference/hadamard.py rotate_activation_ref:
// H[i][j] = (-1)^popcount(i & j); the 7 butterfly stages in fp32 in the reference's order (index
// bit 0 first: 2 in-thread, then 5 by __shfl_xor_sync, the upper lane computing p - d), one fp32
// multiply by fp32(128^-0.5), one RNE to bf16 (round_bf16); v[] returns the bf16 values as fp32.
// Bit-exact with the reference (explicit _rn intrinsics: nothing is contracted into an FMA).
DSV4_DEVICE void fwht128(float v[4], int lane) {
  const float a0 = __fadd_rn(v[0], v[1]), a1 = __fsub_rn(v[0], v[1]);
  const float a2 = __fadd_rn(v[2], v[3]), a3 = __fsub_rn(v[2], v[3]);
  float d[4] = {__fadd_rn(a0, a2), __fadd_rn(a1, a3), __fsub_rn(a0, a2), __fsub_rn(a1, a3)};
#pragma unroll
  for (int b = 0; b < 5; ++b) {
    const bool upper = (lane >> b) & 1;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float p = __shfl_xor_sync(0xffffffffu, d[i], 1 << b);
      d[i] = upper ? __fsub_rn(p, d[i]) : __fadd_rn(d[i], p);
    }
  }
  const float s = __uint_as_float(0x3DB504F3u);  // fp32(128^-0.5)
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = round_bf16(__fmul_rn(d[i], s));
}

// ---------------------------------------------------------------------------------------
// E2M1 encode by thresholds: round-to-nearest-even code (bit 3 = sign, kept for values that round
// to 0, as dsv4.formats.e2m1_encode) of x already divided by its scale; |x| > 5 -> 6 (code 7).
// The thresholds are the midpoints of [0, .5, 1, 1.5, 2, 3, 4, 6], ties to the even code.
DSV4_DEVICE u32 e2m1_code_rne(float x) {
  const float a = fabsf(x);
  const u32 i = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return i | ((__float_as_uint(x) >> 28) & 8u);
}
// UE8M0 byte of 2^ceil(log2(x)) for a normal positive fp32 x (DSV4 kernel.py fast_round_scale)
DSV4_DEVICE u32 ue8m0_byte_ceil(float x) {
  const u32 b = __float_as_uint(x);
  return ((b >> 23) & 0xFFu) + ((b & 0x7FFFFFu) != 0u);
}
