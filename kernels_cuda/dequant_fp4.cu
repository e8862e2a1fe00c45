// dequant_fp4: packed E2M1 [M, K/2] + block scales -> bf16 / fp32 [M, K].
// Contract: docs/layouts/dequant_fp4.md. Math per element, in fp32, rounded once at the end:
//   MXFP4: out = e2m1(code) * 2^(sf - 127)                    (UE8M0, one per 32 along K)
//   NVFP4: out = (e2m1(code) * e4m3(sf)) * global_scale       (E4M3, one per 16 along K)
// Decode: byte LUT via prmt (common.cuh), never arithmetic on the nibble (seed 000).
//
// Coalescing: the output is 4x (bf16) or 8x (fp32) the input bytes, so the mapping is chosen
// for the stores. A warp owns a tile of 128 packed 32-bit words (1024 values); in step j
// (0..3) lane l decodes word j*32 + l (8 values) and stores its 16 B (bf16) or 2 x 16 B
// (fp32) next to its neighbours': every store instruction writes one contiguous 512 B (bf16)
// span. Loads are 4 B per lane, 128 B contiguous per warp instruction; all 4 are issued
// before the first decode.
//
// Macros: DSV4_FMT (0 = MXFP4, 1 = NVFP4), DSV4_OUT (0 = bf16, 1 = fp32).
#include "common.cuh"

#ifndef DSV4_FMT
#define DSV4_FMT 0
#endif
#ifndef DSV4_OUT
#define DSV4_OUT 0
#endif

#define DQ_WORDS_PER_LANE 4

extern "C" __global__ void __launch_bounds__(256) dequant_fp4_kernel(
    const u8* __restrict__ data,             // [M, K/2]
    const u8* __restrict__ scale,            // MXFP4: [M, K/32] UE8M0 ; NVFP4: [M, K/16] E4M3
    const float* __restrict__ global_scale,  // NVFP4: [1] fp32 decode multiplier; unused for MXFP4
    void* __restrict__ out,                  // [M, K] bf16 or fp32
    i64 n_words) {                           // M * K / 8 (32-bit words of packed data)
  const int lane = threadIdx.x & 31;
  const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const i64 base = warp * (32 * DQ_WORDS_PER_LANE);
  const u32* __restrict__ words = reinterpret_cast<const u32*>(data);
#if DSV4_FMT == 1
  const float g = __ldg(global_scale);
#endif
  u32 w[DQ_WORDS_PER_LANE];
  float s[DQ_WORDS_PER_LANE];
#pragma unroll
  for (int j = 0; j < DQ_WORDS_PER_LANE; ++j) {
    const i64 i = base + j * 32 + lane;
    w[j] = 0u;
    s[j] = 0.f;
    if (i < n_words) {
      w[j] = __ldg(words + i);
#if DSV4_FMT == 0
      s[j] = ue8m0_to_f32(__ldg(scale + (i >> 2)));   // 4 words = 32 values share a scale
#else
      s[j] = e4m3_to_f32(__ldg(scale + (i >> 1)));    // 2 words = 16 values share a scale
#endif
    }
  }
#pragma unroll
  for (int j = 0; j < DQ_WORDS_PER_LANE; ++j) {
    const i64 i = base + j * 32 + lane;
    if (i >= n_words) continue;
    u32 b[4];
    e2m1x8_to_bf16x8(w[j], b);
    float f[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      f[2 * q] = bf16_lo_to_f32(b[q]) * s[j];
      f[2 * q + 1] = bf16_hi_to_f32(b[q]) * s[j];
#if DSV4_FMT == 1
      f[2 * q] *= g;
      f[2 * q + 1] *= g;
#endif
    }
#if DSV4_OUT == 0
    u32x4 o = {pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7])};
    st_global_v4(reinterpret_cast<u8*>(out) + i * 16, o);
#else
    u32x4 o0 = {f32_as_u32(f[0]), f32_as_u32(f[1]), f32_as_u32(f[2]), f32_as_u32(f[3])};
    u32x4 o1 = {f32_as_u32(f[4]), f32_as_u32(f[5]), f32_as_u32(f[6]), f32_as_u32(f[7])};
    st_global_v4(reinterpret_cast<u8*>(out) + i * 32, o0);
    st_global_v4(reinterpret_cast<u8*>(out) + i * 32 + 16, o1);
#endif
  }
}
