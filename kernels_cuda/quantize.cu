// Quantization kernels: bf16/fp16 [M, K] -> NVFP4 / MXFP4 / FP8-block, and FP8-block dequant.
// Bit-exact with the torch reference dsv4/formats (nvfp4.py, mxfp4.py, fp8.py, swizzle.py);
// contracts: docs/layouts/quantize_*.md. Helpers and the E2M1 rounding argument: quantize.cuh.
//
// Thread mapping (all quantizers): a "chunk" is 16 bytes = 8 input elements; a warp tile is
// QJ*32 chunks; load j of lane l reads chunk (tile*QJ*32 + 32*j + l), so every warp load
// instruction reads 512 contiguous bytes (16-byte ld.global.nc.v4, fully coalesced). A scale
// block spans CPB consecutive lanes (NVFP4 2, MXFP4 4, FP8 B/8): its amax is a warp-shuffle
// max. Codes/scales are staged per warp in shared memory and written with 16-byte stores.
// Persistent grid-stride loop over warp tiles (optionally in reverse tile order, so that the
// tiles the amax pass read last -- still in L2 -- are quantized first).
//
// Macros:
//   DSV4_IN    0 bf16 | 1 fp16 input
//   DSV4_FMT   0 NVFP4 | 1 MXFP4 | 2 FP8 (E4M3)
//   DSV4_RULE  MXFP4: 0 dsv4 (ceil) | 1 ocp (floor);  FP8: 0 fp32 scale | 1 ue8m0 scale as fp32 |
//              2 ue8m0 scale as UE8M0 byte
//   DSV4_BLOCK FP8 block along K (128 | 64 | 32)
//   DSV4_SF    NVFP4 scale layout: 0 linear [M, K/16] | 1 swizzled 128x4
//   DSV4_GS    NVFP4 global scale: 0 computed from amax partials (quantize_amax_kernel) |
//              1 caller-supplied decode scale | 2 computed in-kernel (single CTA, one launch)
//   DSV4_QJ    16-byte loads per lane per warp tile: 8 (default) | 4 (launch geometry only)
//   DSV4_PREFETCH 0 (default) | 1: load the warp's next tile while encoding this one (<= 256 threads)
//   DSV4_OUT   dequant output: 0 bf16 | 1 fp16 | 2 fp32;  DSV4_SCALE dequant scale: 0 fp32 | 1 UE8M0
#include "quantize.cuh"

#ifndef DSV4_FMT
#define DSV4_FMT 0
#endif
#ifndef DSV4_RULE
#define DSV4_RULE 0
#endif
#ifndef DSV4_BLOCK
#define DSV4_BLOCK 128
#endif
#ifndef DSV4_SF
#define DSV4_SF 0
#endif
#ifndef DSV4_GS
#define DSV4_GS 0
#endif
#ifndef DSV4_OUT
#define DSV4_OUT 0
#endif
#ifndef DSV4_SCALE
#define DSV4_SCALE 0
#endif

#ifndef DSV4_QJ
#define DSV4_QJ 8
#endif
#define QJ DSV4_QJ                // 16-byte loads per lane per warp tile (8 default, 4 allowed)
#define TILE_CHUNKS (32 * QJ)     // QJ=8: 256 chunks = 2048 elements
static_assert(QJ == 4 || QJ == 8, "DSV4_QJ must be 4 or 8 (tile = whole scale blocks, 16-byte staged stores)");
#define MAX_THREADS 512

#if DSV4_FMT == 0
#define CPB 2                     // chunks per scale block
#define WPC 1                     // output words per chunk
#elif DSV4_FMT == 1
#define CPB 4
#define WPC 1
#else
#define CPB (DSV4_BLOCK / 8)
#define WPC 2
#endif
#define BLK_PER_TILE (TILE_CHUNKS / CPB)
#define SMEM_DATA_WORDS (TILE_CHUNKS * WPC)
#define SMEM_WARP_BYTES (SMEM_DATA_WORDS * 4 + 256)

#define F32_INV6 0x3E2AAAABu      // fp32(1/6)   (dsv4.formats _INV6_F32)
#define F32_INV448 0x3B124925u    // fp32(1/448) (dsv4.formats _INV448_F32)
#define F32_1EM4 0x38D1B717u      // fp32(1e-4)  FP8 amax floor
#define F32_MX_FLOOR 0x01C00000u  // 6 * 2^-126  MXFP4 amax floor

// block-wide max of a u32 (all threads call; result valid in every thread)
DSV4_DEVICE u32 block_max_u32(u32 v) {
  __shared__ u32 red[MAX_THREADS / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  const int warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  u32 r = 0u;
  for (int i = 0; i < nw; ++i) r = max(r, red[i]);
  return r;
}

// Finite |x| max (as |bits|) over the warp tiles first, first+stride, ... (lane mapping as the
// quantizer). kHint: chunks >= keep_from are loaded with L2::evict_last (kept for the second pass).
template <bool kHint>
DSV4_DEVICE u32 amax_bits_tiles(const u8* __restrict__ x, i64 n_chunks, i64 first, i64 stride, i64 keep_from) {
  const int lane = threadIdx.x & 31;
  const i64 n_tiles = (n_chunks + TILE_CHUNKS - 1) / TILE_CHUNKS;
  u32 acc = 0u;
  for (i64 t = first; t < n_tiles; t += stride) {
    const i64 cb = t * TILE_CHUNKS;
    u32x4 w[QJ];
#pragma unroll
    for (int j = 0; j < QJ; ++j) {
      const i64 c = cb + 32 * j + lane;
      if (c < n_chunks) {
        w[j] = (kHint && c >= keep_from) ? ld_keep_v4(x + c * 16) : ld_stream_v4(x + c * 16);
      } else {
        w[j] = u32x4{0u, 0u, 0u, 0u};
      }
    }
#pragma unroll
    for (int j = 0; j < QJ; ++j) acc = max_u16x2(acc, chunk_absmax_u16x2(w[j]));
  }
  // |bits| max including Inf / NaN (NaN > Inf > finite): a non-finite tensor amax gives the NaN
  // global scale (OCP MX rule, dsv4.formats.nvfp4)
  return hmax_u16x2(acc);
}

// Kernel 1 of the two-launch NVFP4 path: per-CTA finite amax partials (fp32), no atomics, no
// state: the quantize kernel reduces the partials itself.
extern "C" __global__ void __launch_bounds__(MAX_THREADS, 2) quantize_amax_kernel(
    const u8* __restrict__ x,       // [M, K] bf16/fp16
    float* __restrict__ partials,   // [gridDim.x]
    i64 n_chunks,                   // M * K / 8
    i64 keep_from) {                // first chunk loaded with L2::evict_last
  const int nw = blockDim.x >> 5;
  const u32 h = amax_bits_tiles<true>(x, n_chunks, (i64)blockIdx.x * nw + (threadIdx.x >> 5),
                                      (i64)gridDim.x * nw, keep_from);
  const u32 m = block_max_u32(__float_as_uint(half_bits_to_f32(h)));
  if (threadIdx.x == 0) partials[blockIdx.x] = __uint_as_float(m);
}

// byte offset of linear scale (m, k) in the 128x4 swizzled layout (dsv4.formats.swizzled_sf_offset)
DSV4_DEVICE i64 swz_off(i64 m, i64 k, i64 Kt) {
  return ((m >> 7) * Kt + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3);
}

// one warp tile of 16-byte loads (zeros past n_chunks)
DSV4_DEVICE void load_tile(u32x4 (&w)[QJ], const u8* __restrict__ x, i64 cb, i64 n_chunks, int lane) {
  const bool full = cb + TILE_CHUNKS <= n_chunks;
#pragma unroll
  for (int j = 0; j < QJ; ++j) {
    const i64 c = cb + 32 * j + lane;
    w[j] = (full || c < n_chunks) ? ld_stream_v4(x + c * 16) : u32x4{0u, 0u, 0u, 0u};
  }
}

#ifndef DSV4_PREFETCH
#define DSV4_PREFETCH 0  // 1: software-pipelined tiles (next tile's loads in flight during encode)
#endif
#if DSV4_PREFETCH
#define QK_BOUNDS __launch_bounds__(256, 2)   // 2 tiles of registers: up to 128 regs, <= 256 threads
#else
#define QK_BOUNDS __launch_bounds__(MAX_THREADS, 2)
#endif

extern "C" __global__ void QK_BOUNDS quantize_kernel(
    const u8* __restrict__ x,        // [M, K] bf16/fp16
    u8* __restrict__ data,           // E2M1: [M, K/2] u8 ; FP8: [M, K] e4m3
    u8* __restrict__ scale,          // block scales (layout per format / DSV4_SF)
    float* __restrict__ gs_out,      // NVFP4: [2] = (decode g_dec, encode g_enc); unused otherwise
    const float* __restrict__ gs_src,// NVFP4 GS=0: [n_src] amax partials ; GS=1: [1] decode scale
    i32 n_src,
    i64 n_chunks,                    // M * K / 8
    i32 M, i32 Ksf, i32 Kt, i32 Mpad,// swizzle geometry (NVFP4 swizzled): Ksf = K/16, Kt = ceil(Ksf/4)
    i32 reverse) {                   // process warp tiles in reverse order
  extern __shared__ __align__(16) u8 smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  u32* sd = reinterpret_cast<u32*>(smem + warp * SMEM_WARP_BYTES);  // staged output words
  u8* ss = smem + warp * SMEM_WARP_BYTES + SMEM_DATA_WORDS * 4;     // staged scales (<= 256 B)
  const i64 n_blocks = n_chunks / CPB;

#if DSV4_FMT == 0
  // ---- global scale (dsv4.formats.nvfp4: g_enc = min(2688 / amax, FLT_MAX), 1 if amax == 0,
  //      NaN if amax is Inf / NaN (then every block gets the NaN scale); g_dec = 1/g_enc) ----
  float g_enc, g_dec;
#if DSV4_GS == 1
  g_dec = __ldg(gs_src);
  g_enc = __frcp_rn(g_dec);
#else
  u32 mb = 0u;
#if DSV4_GS == 0
  for (int i = threadIdx.x; i < n_src; i += blockDim.x) mb = max(mb, __float_as_uint(__ldg(gs_src + i)));
#else
  mb = __float_as_uint(half_bits_to_f32(amax_bits_tiles<false>(x, n_chunks, warp, nw, 0)));
#endif
  mb = block_max_u32(mb);
  const float amax = __uint_as_float(mb);
  g_enc = amax > 0.0f ? fminf(__fdiv_rn(2688.0f, amax), DSV4_FLT_MAX) : 1.0f;
  if (mb >= 0x7F800000u) g_enc = __uint_as_float(0x7FFFFFFFu);   // amax Inf / NaN -> NaN global scale
  g_dec = __frcp_rn(g_enc);
#endif
  const bool gnan = g_enc != g_enc;                              // every block NaN
  const float mult = g_enc * __uint_as_float(F32_INV6);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    gs_out[0] = g_dec;
    gs_out[1] = g_enc;
  }
#endif

  const i64 n_tiles = (n_chunks + TILE_CHUNKS - 1) / TILE_CHUNKS;
  const i64 stride = (i64)gridDim.x * nw;
#if DSV4_PREFETCH
  u32x4 nxt[QJ];
  {
    const i64 t0 = (i64)blockIdx.x * nw + warp;
    if (t0 < n_tiles) load_tile(nxt, x, (reverse ? n_tiles - 1 - t0 : t0) * TILE_CHUNKS, n_chunks, lane);
  }
#endif
  for (i64 t = (i64)blockIdx.x * nw + warp; t < n_tiles; t += stride) {
    const i64 tile = reverse ? n_tiles - 1 - t : t;
    const i64 cb = tile * TILE_CHUNKS;
    const bool full = cb + TILE_CHUNKS <= n_chunks;
    u32x4 w[QJ];
#if DSV4_PREFETCH
#pragma unroll
    for (int j = 0; j < QJ; ++j) w[j] = nxt[j];
    {
      const i64 tn = t + stride;
      if (tn < n_tiles) load_tile(nxt, x, (reverse ? n_tiles - 1 - tn : tn) * TILE_CHUNKS, n_chunks, lane);
    }
#else
    load_tile(w, x, cb, n_chunks, lane);
#endif
#pragma unroll
    for (int j = 0; j < QJ; ++j) {
      bool nf;
#if DSV4_FMT == 2
      u32 hb = chunk_finite_absmax(w[j], nf);     // FP8: finite-only block amax, NaN/Inf patched per element
#else
      // FP4: |bits| max including Inf / NaN; a block holding one gets the NaN scale and zero codes
      u32 hb = hmax_u16x2(chunk_absmax_u16x2(w[j]));
      nf = false;
#endif
#pragma unroll
      for (int o = 1; o < CPB; o <<= 1) hb = max(hb, __shfl_xor_sync(0xFFFFFFFFu, hb, o));
#if DSV4_FMT != 2
      const bool bad = hb >= DSV4_ABS_INF;
#endif
      const float vmax = half_bits_to_f32(hb);
      float f[8];
      chunk_to_f32(w[j], f);
      const int ci = 32 * j + lane;  // chunk index inside the tile
#if DSV4_FMT == 0
      // NVFP4 block of 16 (TE reference order): s = e4m3(min(vmax * (g_enc/6), 448));
      // enc = min(1 / (s * g_dec), FLT_MAX); code = e2m1(x * enc); sign-only codes where s == 0
      const float sf = fminf(vmax * mult, 448.0f);
      const u32 sbyte = f32x2_to_e4m3x2(sf, 0.0f) & 0xFFu;
      const float s = e4m3_to_f32(sbyte);
      const float enc = fminf(__frcp_rn(s * g_dec), DSV4_FLT_MAX);
      u32 code = e2m1x8<false>(f, enc);
      if (s == 0.0f) code &= 0x88888888u;
      const bool nanb = bad || gnan;
      sd[ci] = nanb ? 0u : code;
      if ((lane & 1) == 0) ss[ci >> 1] = (u8)(nanb ? 0x7Fu : sbyte);
#elif DSV4_FMT == 1
      // MXFP4 block of 32: UE8M0 scale s, code = e2m1(x / s) = e2m1(x * 2^-log2(s)) (exact)
      u32 sbyte;
      float inv;
#if DSV4_RULE == 0
      const float tt = fmaxf(vmax, __uint_as_float(F32_MX_FLOOR)) * __uint_as_float(F32_INV6);
      sbyte = ue8m0_ceil_byte(tt);                 // 1..253
      inv = __uint_as_float((254u - sbyte) << 23);  // 2^(127 - sbyte)
#else
      int e = vmax > 0.0f ? floor_log2(vmax) - 2 : -127;
      e = min(max(e, -127), 127);
      sbyte = (u32)(e + 127);
      inv = exp2_int(-e);
#endif
      sd[ci] = bad ? 0u : e2m1x8<false>(f, inv);
      if ((lane & 3) == 0) ss[ci >> 2] = (u8)(bad ? 0xFFu : sbyte);
#else
      // FP8 block: amax = max(vmax, 1e-4); s = amax * fp32(1/448) [or 2^ceil(log2(.))];
      // q = e4m3(clamp(x / s, -448, 448)) with x / s correctly rounded
      float s = fmaxf(vmax, __uint_as_float(F32_1EM4)) * __uint_as_float(F32_INV448);
#if DSV4_RULE >= 1
      const u32 sbyte = ue8m0_ceil_byte(s);
      s = __uint_as_float(sbyte << 23);
#endif
      const float r = __frcp_rn(s);
      u32 p[4];
      if (!nf) {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = f32x2_to_e4m3x2(div_rn_by(f[2 * i], s, r), div_rn_by(f[2 * i + 1], s, r));
      } else {
        float q[8];
        u32 nanmask = 0u;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float v = f[i];
          if (v != v) nanmask |= 1u << i;
          q[i] = (fabsf(v) == __uint_as_float(0x7F800000u)) ? copysignf(448.0f, v) : div_rn_by(v, s, r);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          p[i] = f32x2_to_e4m3x2((nanmask >> (2 * i)) & 1u ? 0.0f : q[2 * i],
                                 (nanmask >> (2 * i + 1)) & 1u ? 0.0f : q[2 * i + 1]);
          if ((nanmask >> (2 * i)) & 1u) p[i] = (p[i] & 0xFF00u) | 0x7Fu;
          if ((nanmask >> (2 * i + 1)) & 1u) p[i] = (p[i] & 0x00FFu) | 0x7F00u;
        }
      }
      sd[2 * ci] = p[0] | (p[1] << 16);
      sd[2 * ci + 1] = p[2] | (p[3] << 16);
      if ((lane & (CPB - 1)) == 0) {
#if DSV4_RULE == 2
        ss[ci / CPB] = (u8)sbyte;
#else
        reinterpret_cast<float*>(ss)[ci / CPB] = s;
#endif
      }
#endif
    }
    __syncwarp();

    // ---- data: staged words -> 16-byte stores ----
    u8* dbase = data + cb * (4 * WPC);
    if (full) {
#pragma unroll
      for (int i = 0; i < SMEM_DATA_WORDS / 128; ++i) {
        const int v = 32 * i + lane;  // 16-byte unit
        st_global_v4(dbase + 16 * v, reinterpret_cast<const u32x4*>(sd)[v]);
      }
    } else {
      const i64 nw_valid = (n_chunks - cb) * WPC;
      for (int i = lane; i < SMEM_DATA_WORDS; i += 32)
        if (i < nw_valid) st_global_u32(dbase + 4 * i, sd[i]);
    }
    // ---- scales ----
    const i64 bb = cb / CPB;  // first block of the tile
    const i64 nb_valid = full ? (i64)BLK_PER_TILE : n_blocks - bb;
#if DSV4_FMT == 2 && DSV4_RULE != 2
    for (int i = lane; i < BLK_PER_TILE; i += 32)
      if (i < nb_valid) st_global_u32(scale + 4 * (bb + i), reinterpret_cast<const u32*>(ss)[i]);
#elif DSV4_FMT == 0 && DSV4_SF == 1
    {
      const i64 g0 = bb + 4 * lane;   // 4 consecutive flat blocks per lane (128 per tile)
      if ((Ksf & 3) == 0) {           // a group of 4 never straddles rows: one u32 store
        if (4 * lane < nb_valid) {
          const i64 m = g0 / Ksf, k = g0 - m * Ksf;
          st_global_u32(scale + swz_off(m, k, Kt), reinterpret_cast<const u32*>(ss)[lane]);
        }
      } else {
        for (int b = 0; b < 4; ++b) {
          if (4 * lane + b < nb_valid) {
            const i64 g = g0 + b, m = g / Ksf, k = g - m * Ksf;
            st_global_u8(scale + swz_off(m, k, Kt), ss[4 * lane + b]);
          }
        }
      }
    }
#else
    // one byte per block, linear: BLK_PER_TILE bytes at scale + bb
    if (full) {
      if (4 * lane < BLK_PER_TILE) st_global_u32(scale + bb + 4 * lane, reinterpret_cast<const u32*>(ss)[lane]);
    } else {
      for (int i = lane; i < BLK_PER_TILE; i += 32)
        if (i < nb_valid) st_global_u8(scale + bb + i, ss[i]);
    }
#endif
    __syncwarp();
  }

#if DSV4_FMT == 0 && DSV4_SF == 1
  // ---- zero padding of the swizzled layout: rows M..Mpad-1 and columns Ksf..4*Kt-1 ----
  // (32-bit index math: (Mpad - M) * Kt and M * (4 * Kt - Ksf) are far below 2^32)
  {
    const u32 gt = blockIdx.x * blockDim.x + threadIdx.x, GT = gridDim.x * blockDim.x;
    const u32 ukt = (u32)Kt;
    const u32 p1 = (u32)(Mpad - M) * ukt;
    for (u32 i = gt; i < p1; i += GT) {
      const u32 r = i / ukt;
      st_global_u32(scale + swz_off((i64)(M + (int)r), 4 * (i64)(i - r * ukt), Kt), 0u);
    }
    const u32 padc = (u32)(4 * Kt - Ksf);
    if (padc) {
      const u32 p2 = (u32)M * padc;
      for (u32 i = gt; i < p2; i += GT) {
        const u32 m = i / padc;
        st_global_u8(scale + swz_off((i64)m, (i64)(Ksf + (int)(i - m * padc)), Kt), 0u);
      }
    }
  }
#endif
}

// ---------------------------------------------------------------------------------------
// FP8 block dequant: E4M3 [M, K] + scale [M, K/B] (fp32 or UE8M0) -> bf16/fp16/fp32 [M, K].
// out = e4m3(q) * scale in fp32, one rounding (dsv4.formats.dequantize_fp8_block).
// A lane converts one 16-byte chunk (16 elements, inside one block since B >= 32); results are
// staged per warp in shared memory (XOR-swizzled 16-byte units, conflict-free) and written with
// coalesced 16-byte stores.
#if DSV4_OUT == 2
#define DQ_UNITS 4   // 16-byte output units per chunk
#define DQ_SH 1
#else
#define DQ_UNITS 2
#define DQ_SH 2
#endif
#define DQ_J 2       // chunks per lane per step

DSV4_DEVICE int dq_phys(int u) {
  const int s = u / DQ_UNITS, i = u % DQ_UNITS;
  return DQ_UNITS * s + (i ^ ((s >> DQ_SH) & (DQ_UNITS - 1)));
}

extern "C" __global__ void __launch_bounds__(256) dequant_fp8_kernel(
    const u8* __restrict__ q,        // [M, K] e4m3
    const u8* __restrict__ scale,    // [M, K/B] fp32 or UE8M0
    u8* __restrict__ out,            // [M, K] out dtype
    i64 n_chunks) {                  // M * K / 16
  __shared__ __align__(16) u32x4 st[8][DQ_J * 32 * DQ_UNITS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const i64 step = (i64)gridDim.x * 8 * 32 * DQ_J;
  for (i64 base = ((i64)blockIdx.x * 8 + warp) * 32 * DQ_J; base < n_chunks; base += step) {
    u32x4 w[DQ_J];
#pragma unroll
    for (int jj = 0; jj < DQ_J; ++jj) {
      const i64 c = base + 32 * jj + lane;
      w[jj] = c < n_chunks ? ld_stream_v4(q + c * 16) : u32x4{0u, 0u, 0u, 0u};
    }
#pragma unroll
    for (int jj = 0; jj < DQ_J; ++jj) {
      const i64 c = base + 32 * jj + lane;
      const i64 b = c < n_chunks ? (c * 16) / DSV4_BLOCK : 0;
#if DSV4_SCALE == 0
      const float s = __ldg(reinterpret_cast<const float*>(scale) + b);
#else
      const float s = ue8m0_to_f32(__ldg(scale + b));
#endif
      const u32 ws[4] = {w[jj].x, w[jj].y, w[jj].z, w[jj].w};
      float f[16];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        e4m3x2_to_f32x2(ws[k] & 0xFFFFu, f[4 * k], f[4 * k + 1]);
        e4m3x2_to_f32x2(ws[k] >> 16, f[4 * k + 2], f[4 * k + 3]);
      }
#pragma unroll
      for (int k = 0; k < 16; ++k) f[k] *= s;
      u32x4* sw = st[warp] + jj * 32 * DQ_UNITS;
#if DSV4_OUT == 2
#pragma unroll
      for (int u = 0; u < 4; ++u)
        sw[dq_phys(DQ_UNITS * lane + u)] = u32x4{__float_as_uint(f[4 * u]), __float_as_uint(f[4 * u + 1]),
                                                 __float_as_uint(f[4 * u + 2]), __float_as_uint(f[4 * u + 3])};
#else
#pragma unroll
      for (int u = 0; u < 2; ++u) {
#if DSV4_OUT == 0
        sw[dq_phys(DQ_UNITS * lane + u)] = u32x4{pack_bf16x2(f[8 * u], f[8 * u + 1]), pack_bf16x2(f[8 * u + 2], f[8 * u + 3]),
                                                 pack_bf16x2(f[8 * u + 4], f[8 * u + 5]), pack_bf16x2(f[8 * u + 6], f[8 * u + 7])};
#else
        sw[dq_phys(DQ_UNITS * lane + u)] = u32x4{pack_f16x2(f[8 * u], f[8 * u + 1]), pack_f16x2(f[8 * u + 2], f[8 * u + 3]),
                                                 pack_f16x2(f[8 * u + 4], f[8 * u + 5]), pack_f16x2(f[8 * u + 6], f[8 * u + 7])};
#endif
      }
#endif
    }
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < DQ_J; ++jj) {
      const i64 c0 = base + 32 * jj;  // first chunk of this 32-chunk group
#pragma unroll
      for (int i = 0; i < DQ_UNITS; ++i) {
        const int v = 32 * i + lane;  // logical 16-byte unit of the group
        if (c0 + v / DQ_UNITS < n_chunks)
          st_global_v4(out + (c0 * DQ_UNITS + v) * 16, st[warp][jj * 32 * DQ_UNITS + dq_phys(v)]);
      }
    }
    __syncwarp();
  }
}
