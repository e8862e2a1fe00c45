// dequant_fp4: packed E2M1 [M, K/2] + block scales -> bf16 / fp32 [M, K].
// Contract: docs/layouts/dequant_fp4.md. Math per element, in fp32, rounded once at the end:
//   MXFP4: out = e2m1(code) * 2^(sf - 127)                    (UE8M0, one per 32 along K)
//   NVFP4: out = (e2m1(code) * e4m3(sf)) * global_scale       (E4M3, one per 16 along K)
// Decode: byte LUT via prmt (common.cuh), never arithmetic on the nibble (seed 000).
// One thread = one 16-byte load = 32 elements; 16-byte stores.
//
// Macros: DSV4_FMT (0 = MXFP4, 1 = NVFP4), DSV4_OUT (0 = bf16, 1 = fp32).
#include "common.cuh"

#ifndef DSV4_FMT
#define DSV4_FMT 0
#endif
#ifndef DSV4_OUT
#define DSV4_OUT 0
#endif

extern "C" __global__ void __launch_bounds__(256) dequant_fp4_kernel(
    const u8* __restrict__ data,          // [M, K/2]
    const u8* __restrict__ scale,         // MXFP4: [M, K/32] UE8M0 ; NVFP4: [M, K/16] E4M3
    const float* __restrict__ global_scale,  // NVFP4: [1] fp32 decode multiplier; unused for MXFP4
    void* __restrict__ out,               // [M, K] bf16 or fp32
    i64 n_chunks) {                        // M * K / 32
  const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n_chunks) return;
  const u32x4 w = ld_global_nc_v4(data + c * 16);
  float s0, s1;
#if DSV4_FMT == 0
  s0 = ue8m0_to_f32(__ldg(scale + c));
  s1 = s0;
  const float g = 1.0f;
#else
  const u32 two = (u32)__ldg(reinterpret_cast<const u16*>(scale) + c);
  e4m3x2_to_f32x2(two, s0, s1);
  const float g = __ldg(global_scale);
#endif
  const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {            // 8 elements per word; words 0,1 use s0, 2,3 use s1
    u32 b[4];
    e2m1x8_to_bf16x8(words[q], b);
    const float s = (q < 2) ? s0 : s1;
    float f[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      f[2 * j] = bf16_lo_to_f32(b[j]) * s;
      f[2 * j + 1] = bf16_hi_to_f32(b[j]) * s;
#if DSV4_FMT == 1
      f[2 * j] *= g;
      f[2 * j + 1] *= g;
#endif
    }
#if DSV4_OUT == 0
    u32x4 o = {pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7])};
    st_global_v4(reinterpret_cast<u8*>(out) + c * 64 + q * 16, o);
#else
    u32x4 o0 = {f32_as_u32(f[0]), f32_as_u32(f[1]), f32_as_u32(f[2]), f32_as_u32(f[3])};
    u32x4 o1 = {f32_as_u32(f[4]), f32_as_u32(f[5]), f32_as_u32(f[6]), f32_as_u32(f[7])};
    st_global_v4(reinterpret_cast<u8*>(out) + c * 128 + q * 32, o0);
    st_global_v4(reinterpret_cast<u8*>(out) + c * 128 + q * 32 + 16, o1);
#endif
  }
}
