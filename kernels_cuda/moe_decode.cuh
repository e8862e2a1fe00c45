// moe_decode.cuh: device helpers of the MoE decode kernel (moe_decode.cu). Hopper sm_90a only.
// Self-contained (includes only common.cuh).
//
// * mbarrier, 1-D bulk copies, cp.async (+ cp.async.mbarrier.arrive.noinc), the RS WGMMA wrappers:
//   common.cuh. Here: the MMA descriptor / fragment conventions and the E2M1 decode.
// * WGMMA m64nNk16 bf16 with A from registers (swap AB: the weight rows are M) and B (the
//   tokens, N = 8 / 16) from shared memory through a K-major no-swizzle descriptor:
//   core matrix = 8 rows x 16 bytes contiguous; LBO = distance of the two K-adjacent core matrices
//   (128 B here), SBO = distance of 8-row groups (256 B here); bits [0,14) start>>4, [16,30)
//   LBO>>4, [32,46) SBO>>4, layout type 0.
//   A register fragment (cute ALayout_64x16): thread l of warp w holds rows m = 16w + l/4 (+8),
//   K positions 2(l%4) + {0,1} (+8): reg0 = (m, k..k+1), reg1 = (m+8, k..k+1), reg2 = (m, k+8..k+9),
//   reg3 = (m+8, k+8..k+9). Accumulator m64nN: d[i]: row = 16w + l/4 + 8((i>>1)&1),
//   col = 8(i>>2) + 2(l%4) + (i&1).
// * E2M1 -> bf16 without a table: for a word w of 8 nibbles (element i in nibble i), pair j
//   (j = 0..3) = (nibble j, nibble j+4) -> one bf16x2: the 4 nibble bits are isolated by one mask,
//   one integer multiply by (2^a + 2^(a+6)) writes two non-overlapping copies (no carries): the
//   magnitude bits (e1 e0 m) land on bf16 bits [8:6] (exponent bits 1:0 + mantissa msb) and the
//   sign on bit 15 (same for the high half, +16); one mask keeps them. The bf16 value is then
//   exactly level * 2^-126 (E2M1 subnormal 0.5 -> bf16 subnormal 2^-127), and one mul.rn.bf16x2 by
//   f = scale * 2^118 gives level * scale * 2^-8 exactly (<= 6 significant bits); the 2^8 goes
//   into the epilogue's global scale.
#pragma once
#include "common.cuh"

// cp.async L2 prefetch-size hint (MD_L2PF = 0 / 64 / 128 / 256 bytes) of the weight / scale copies:
// the L2 fetches the aligned 256-B sector group around the 16 bytes, i.e. the next 3 stages' chunks
// of the same weight row, so that HBM sees 256-B requests instead of 64-B ones (common.cuh cp_async_cg16).
#ifndef MD_L2PF
#define MD_L2PF 256
#endif

// ------------------------------------------------------------------------------------------
// WGMMA (A from registers, B descriptor: common.cuh wgmma_desc)
// wgmma_m64n8k16_rs / wgmma_m64n16k16_rs (A from registers): common_wgmma.cuh (generated).

// mma.sync m16n8k16 bf16 (per warp; MD_MMA=1): A fragment = the per-warp slice of the WGMMA A
// fragment above (reg0 (r, k..k+1), reg1 (r+8, ..), reg2 (r, k+8..), reg3 (r+8, k+8..)), B fragment
// b0 = (k = 2(l%4) + {0,1}, n = l/4), b1 = (k + 8, n); D: d0,d1 = (r, 2(l%4) + {0,1}), d2,d3 = (r+8, ..),
// i.e. the m64n8 accumulator layout of one warp.
DSV4_DEVICE void mma_m16n8k16_bf16(float* d, const u32* a, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ------------------------------------------------------------------------------------------
// decode (the E2M1 words: common.cuh e2m1x8_bf16_pairs with f = bf16x2 {scale * 2^118, same})
// bf16x2 {f, f} with f = 2^(b - 127) * 2^118 for a UE8M0 byte b (exact for b in [0, 136])
DSV4_DEVICE u32 ue8m0_f2(u32 b) {
  const u32 e = min(b + 118u, 254u);
  return (e << 7) | (e << 23);
}
// bf16x2 {f, f} with f = e4m3(b) * 2^118 (exact for every E4M3 byte; NaN stays NaN)
DSV4_DEVICE u32 e4m3_f2(u32 b) {
  const float f = e4m3_to_f32(b) * 3.3230699894622794e+35f;  // 2^118
  return pack_bf16x2(f, f);
}
