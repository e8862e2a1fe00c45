// moe.cuh: device helpers of the FP4-weight MoE grouped GEMMs (moe.cu). Hopper sm_90a only.
//
// * WGMMA (wgmma.mma_async, inline PTX) m64n128 with FP32 accumulators, operands in shared
//   memory through matrix descriptors, K-major, no swizzle ("INTERLEAVE" canonical layout,
//   cute: ((8,m),(T,2)):((1T,SBO),(1,LBO)) in 16-byte units):
//     core matrix = 8 rows x 16 bytes stored contiguously (128 B);
//     LBO = byte distance between the two K-adjacent core matrices of one instruction (128 B here);
//     SBO = byte distance between 8-row groups (NCORE * 128 B, NCORE = 16-byte chunks per tile row).
//   descriptor bits: [0,14) start>>4, [16,30) LBO>>4, [32,46) SBO>>4, [62,64) layout (0 = none).
// * Accumulator fragment of m64nN (per thread of the warpgroup, warp w = tid/32 % 4, lane l):
//     d[i]: row = 16*w + l/4 + 8*((i>>1)&1), col = 8*(i>>2) + 2*(l%4) + (i&1).
// * FP4 decode by byte LUT (prmt): E2M1 magnitude index -> E4M3 byte of (level * 2^d), one LUT
//   per scale group; the sign nibble bit goes to the E4M3 sign bit. E2M1 levels times 2^d are
//   exact in E4M3 for d in [-8, 6] (0.5*2^-8 = 2^-9 is the smallest E4M3 subnormal, 6*2^6 = 384).
#pragma once
#include "common.cuh"

DSV4_DEVICE u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// K-major, no-swizzle WGMMA shared-memory matrix descriptor.
DSV4_DEVICE u64 make_desc(u32 saddr, u32 lbo, u32 sbo) {
  u64 d = 0;
  d |= (u64)((saddr & 0x3FFFFu) >> 4);
  d |= (u64)((lbo >> 4) & 0x3FFFu) << 16;
  d |= (u64)((sbo >> 4) & 0x3FFFu) << 32;
  return d;  // base offset 0, layout type 0 (no swizzle)
}

DSV4_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
DSV4_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
DSV4_DEVICE void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
DSV4_DEVICE void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
DSV4_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

DSV4_DEVICE void cp_async16(u32 saddr, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(saddr), "l"(g) : "memory");
}
DSV4_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
DSV4_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
DSV4_DEVICE void st_shared_v4(u32 saddr, u32 a, u32 b, u32 c, u32 d) {
  asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" :: "r"(saddr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
DSV4_DEVICE u32 ld_global_nc_u32(const void* p) {
  u32 r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}
DSV4_DEVICE u32x2 ld_global_nc_v2(const void* p) {
  u32x2 r;
  asm volatile("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

// E2M1 LUT for one scale group: bytes of e4m3(level_i * f), i = 0..7 (levels 0,.5,1,1.5,2,3,4,6).
// Exact when level*f is representable (f = 2^d, d in [-8, 6]); otherwise RN, saturating.
DSV4_DEVICE void e2m1_e4m3_lut(float f, u32& lut_a, u32& lut_b) {
  lut_a = f32x2_to_e4m3x2(0.0f, 0.5f * f) | (f32x2_to_e4m3x2(f, 1.5f * f) << 16);
  lut_b = f32x2_to_e4m3x2(2.0f * f, 3.0f * f) | (f32x2_to_e4m3x2(4.0f * f, 6.0f * f) << 16);
}
// 8 E2M1 (element i in nibble i of w) -> 8 E4M3 bytes (element i in byte i of {o0, o1}).
DSV4_DEVICE void e2m1x8_to_e4m3x8(u32 w, u32 lut_a, u32 lut_b, u32& o0, u32& o1) {
  const u32 idx = w & 0x77777777u;        // selector nibbles 0..7 (bit 3 = prmt sign mode: cleared)
  const u32 s = w & 0x88888888u;
  o0 = prmt(lut_a, lut_b, idx & 0xFFFFu);
  o1 = prmt(lut_a, lut_b, idx >> 16);
  o0 |= ((s << 4) & 0x80u) | ((s << 8) & 0x8000u) | ((s << 12) & 0x800000u) | ((s << 16) & 0x80000000u);
  o1 |= ((s >> 12) & 0x80u) | ((s >> 8) & 0x8000u) | ((s >> 4) & 0x800000u) | (s & 0x80000000u);
}
// 8 E2M1 -> 8 bf16 times the group scale sc (exact: <= 5 significant bits), packed pairs.
DSV4_DEVICE void e2m1x8_to_bf16x8_scaled(u32 w, float sc, u32 out[4]) {
  u32 b[4];
  e2m1x8_to_bf16x8(w, b);
#pragma unroll
  for (int j = 0; j < 4; ++j) out[j] = pack_bf16x2(bf16_lo_to_f32(b[j]) * sc, bf16_hi_to_f32(b[j]) * sc);
}
DSV4_DEVICE float exp2i(int e) {  // exact 2^e for e in [-149, 127]
  return e >= -126 ? __uint_as_float((u32)(e + 127) << 23) : __uint_as_float(1u << (e + 149));
}
DSV4_DEVICE float round_bf16(float x) { return bf16_lo_to_f32(pack_bf16x2(x, 0.0f) & 0xFFFFu); }

// WGMMA m64n128, FP32 accumulators d[64]; scale_d = 0 overwrites, 1 accumulates.
DSV4_DEVICE void wgmma_m64n128k32_e4m3(float* d, u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// as wgmma_m64n128k32_e4m3, executed only when guard != 0 (guard must be warpgroup-uniform): a
// predicated instruction instead of a branch, so ptxas does not serialize the WGMMAs (C7519).
DSV4_DEVICE void wgmma_m64n128k32_e4m3_if(float* d, u64 da, u64 db, int scale_d, int guard) {
  asm volatile(
      "{\n.reg .pred p, g;\nsetp.ne.b32 p, %66, 0;\nsetp.ne.b32 g, %67, 0;\n"
      "@g wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d), "r"(guard));
}

DSV4_DEVICE void wgmma_m64n128k16_bf16(float* d, u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}


// ---------------------------------------------------------------------------------------
// v2 decode: 8 E2M1 -> 8 E4M3 with 3 ops per FP4 byte. Magnitudes: 2 prmt over the 3-bit
// indices (LUT bytes); signs: prmt duplicates the source bytes [b0 b0 b1 b1] so that the sign of
// nibble 2j+1 is already at bit 7 of output byte 2j+1, and nibble 2j's sign (bit 3) moves by 4.
DSV4_DEVICE void e2m1x8_to_e4m3x8_v2(u32 w, u32 lut_a, u32 lut_b, u32& o0, u32& o1) {
  const u32 idx = w & 0x77777777u;
  const u32 m0 = prmt(lut_a, lut_b, idx);
  const u32 m1 = prmt(lut_a, lut_b, idx >> 16);
  const u32 u0 = prmt(w, 0u, 0x1100u);
  const u32 u1 = prmt(w, 0u, 0x3322u);
  o0 = m0 | ((((u0 << 4) & 0x00FF00FFu) | (u0 & 0xFF00FF00u)) & 0x80808080u);
  o1 = m1 | ((((u1 << 4) & 0x00FF00FFu) | (u1 & 0xFF00FF00u)) & 0x80808080u);
}
DSV4_DEVICE u32x4 ld_shared_v4(u32 saddr) {
  u32x4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(saddr));
  return r;
}
DSV4_DEVICE u32x2 ld_shared_v2(u32 saddr) {
  u32x2 r;
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "r"(saddr));
  return r;
}
DSV4_DEVICE u32 ld_shared_u32(u32 saddr) {
  u32 r;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(saddr));
  return r;
}
DSV4_DEVICE void cp_async4(u32 saddr, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(saddr), "l"(g) : "memory");
}
DSV4_DEVICE void cp_async8(u32 saddr, const void* g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(saddr), "l"(g) : "memory");
}
template <int N>
DSV4_DEVICE void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// ---------------------------------------------------------------------------------------
// NVFP4 under W4A8, exact two-term split. A decoded weight v = level * f (f = sf * 2^-base, the
// E4M3 block scale relative to the 128-K block base, f < 64) has <= 6 significant bits (level: <= 2,
// sf: <= 4). hi = e4m3_rn(v) keeps the top 4; lo = v - hi (exact in fp32) satisfies |lo| <= ulp(hi)/2
// and is a multiple of u = 2^lsb(v), so lo is in {0, +-u, +-2u}: exact in E4M3 while u >= 2^-9 (the
// smallest E4M3 subnormal). Then hi + lo == v exactly (moe.cu header: the condition per block).
// LUT byte i (level i) of the lo table; the weight's sign is applied by XOR (lo may be negative).
DSV4_DEVICE void e2m1_e4m3_lut_lo(float f, u32& lut_a, u32& lut_b) {
  const u32 h0 = f32x2_to_e4m3x2(0.0f, 0.5f * f), h1 = f32x2_to_e4m3x2(f, 1.5f * f);
  const u32 h2 = f32x2_to_e4m3x2(2.0f * f, 3.0f * f), h3 = f32x2_to_e4m3x2(4.0f * f, 6.0f * f);
  float a0, a1, b0, b1, c0, c1, d0, d1;
  e4m3x2_to_f32x2(h0, a0, a1);
  e4m3x2_to_f32x2(h1, b0, b1);
  e4m3x2_to_f32x2(h2, c0, c1);
  e4m3x2_to_f32x2(h3, d0, d1);
  lut_a = f32x2_to_e4m3x2(0.0f - a0, 0.5f * f - a1) | (f32x2_to_e4m3x2(f - b0, 1.5f * f - b1) << 16);
  lut_b = f32x2_to_e4m3x2(2.0f * f - c0, 3.0f * f - c1) | (f32x2_to_e4m3x2(4.0f * f - d0, 6.0f * f - d1) << 16);
}
// as e2m1x8_to_e4m3x8_v2, sign applied by XOR (for LUT entries that may carry a sign)
DSV4_DEVICE void e2m1x8_to_e4m3x8_xs(u32 w, u32 lut_a, u32 lut_b, u32& o0, u32& o1) {
  const u32 idx = w & 0x77777777u;
  const u32 m0 = prmt(lut_a, lut_b, idx);
  const u32 m1 = prmt(lut_a, lut_b, idx >> 16);
  const u32 u0 = prmt(w, 0u, 0x1100u);
  const u32 u1 = prmt(w, 0u, 0x3322u);
  o0 = m0 ^ ((((u0 << 4) & 0x00FF00FFu) | (u0 & 0xFF00FF00u)) & 0x80808080u);
  o1 = m1 ^ ((((u1 << 4) & 0x00FF00FFu) | (u1 & 0xFF00FF00u)) & 0x80808080u);
}
// true when the E4M3 byte (sign ignored) is zero or a power of two (then lo == 0 for every level)
DSV4_DEVICE bool e4m3_is_pow2_or_zero(u32 b) {
  b &= 0x7Fu;
  const u32 ex = b >> 3, m = b & 7u;
  return ex != 0u ? m == 0u : (m & (m - 1u)) == 0u;
}

// ---------------------------------------------------------------------------------------
// mbarriers (v4 warp-specialized pipeline), named barriers, register reallocation
DSV4_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
DSV4_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" :: "r"(bar) : "memory");
}
DSV4_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
  u32 ok;
  asm volatile(
      "{\n.reg .pred P1;\nmbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\nselp.u32 %0, 1, 0, P1;\n}\n"
      : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok != 0u;
}
// wait for the phase with the given parity to complete; traps after ~2^34 cycles (~10 s): a
// pipeline bug must fail the launch, never hang the device
DSV4_DEVICE void mbar_wait(u32 bar, u32 parity) {
  if (mbar_try_wait(bar, parity)) return;
  const long long t0 = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - t0 > (1ll << 34)) __trap();
}
DSV4_DEVICE void named_bar_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(nthreads) : "memory");
}
template <int N>
DSV4_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N)); }
template <int N>
DSV4_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N)); }
