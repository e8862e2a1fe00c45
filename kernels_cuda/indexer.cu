// Lightning Indexer (DSV4 CSA layers) on sm_90a: paged logits on tensor cores (NVFP4 keys).
// Contract: docs/layouts/indexer_*.md (dsv4/ops/indexer.py). Math (dsv4_spec.md 2.4):
//     I[r, s] = sum_h w[r, h] * ReLU(q[r, h] . K[s])        fp32, h = 0..63, dims = 128
//
// Kernels
//   indexer_logits_kernel  (paged decode, NVFP4) one warpgroup (128 threads) per CTA; CTA = the
//                          NQ = next_n query rows of one sequence x a chunk of keys. Keys are the
//                          WGMMA M dimension (64 keys per tile), the NQ x 64 heads are the N
//                          dimension (N = 64*NQ <= 256), K = 128 dims. Raw key bytes stream
//                          through a STAGES-deep cp.async ring; each tile is decoded EXACTLY to
//                          BF16 in smem (E2M1 x E4M3 block scale is exact in BF16), then 8
//                          wgmma.mma_async m64nNk16 BF16 (fp32 accumulate) while the next tile
//                          is decoded into the other buffer. Epilogue in registers: ReLU,
//                          x w[r,h], sum over the thread's heads, quad shuffle reduce, x the
//                          NVFP4 global scales, -inf outside the row range.
//
// indexer_logits_kernel is the paged DECODE kernel for NVFP4 keys only (IDX_FMT 1): MXFP4 and FP8
// decode and every prefill run on the CuTe DSL kernels (kernels_dsl/indexer_paged.py decode,
// indexer_prefill.py prefill; measured faster, docs/benchmarks.md). NVFP4 decode stays here: its
// E2M1 x E4M3-scale products have no exact FP8 operand and the DSL decode kernel has only its FP8
// register-sourced WGMMA path. The quantizers (cache write, q quant) are the
// CuTe DSL kernels of kernels_dsl/indexer_quant.py (this file's former one lost and was deleted). Generic device helpers (smem
// addresses, cp.async, WGMMA wrappers, fwht128, E2M1 / UE8M0 encode) come from common.cuh.
//
// Macros: IDX_FMT (0 MXFP4, 1 NVFP4, 2 FP8; the logits kernel exists for 1 only), IDX_NQ (1..4 query rows per CTA),
//         IDX_STAGES (cp.async ring),
//         IDX_MAX_CHUNK_TILES (decode: block-table
//         entries prefetched to smem per CTA).
#include "common.cuh"

#ifndef IDX_FMT
#define IDX_FMT 1   // the one format the logits kernel serves (the provider always passes it)
#endif
#ifndef IDX_NQ
#define IDX_NQ 1
#endif
#ifndef IDX_STAGES
#define IDX_STAGES 4
#endif

#if IDX_FMT == 2
#define IDX_VB 128  // value bytes per 128-dim row (E4M3)
#define IDX_SB 4    // scale bytes per row (one fp32, power of two)
#else
#define IDX_VB 64   // 128 x E2M1
#if IDX_FMT == 0
#define IDX_SB 4    // 4 x UE8M0 (one per 32)
#else
#define IDX_SB 8    // 8 x E4M3 (one per 16)
#endif
#endif
#define IDX_BPT (IDX_VB + IDX_SB)
#define IDX_N (64 * IDX_NQ)
#define IDX_TILE 64
#ifndef IDX_MAX_CHUNK_TILES
#define IDX_MAX_CHUNK_TILES 512      // paged: tiles per CTA at most (host clamps chunk_tiles)
#endif
#define IDX_RAW_BYTES (IDX_TILE * IDX_BPT)

#define NEG_INF __int_as_float(0xff800000)

// ---------------------------------------------------------------------------------------
// small PTX helpers (the generic ones: smem_u32, cp.async, ld/st.shared, WGMMA + descriptors,
// fwht128, the E2M1 -> BF16 decode e2m1x8_bf16_pairs, E2M1 / UE8M0 encode live in common.cuh)

// SW128 K-major tile: `rows` rows x 128 dims bf16 = two regions (dims 0..63, 64..127) of
// rows x 128 B; 16-byte chunk c of row r lives at chunk c ^ (r % 8) (1024-B aligned base).
DSV4_DEVICE u32 sw128_addr(u32 base, int rows, int r, int half, int c) {
  return base + (u32)(half * rows * 128 + r * 128 + ((c ^ (r & 7)) << 4));
}

#if IDX_FMT == 1
// Decode one half row (64 dims) held in vw[] (8 words of E2M1) with its 4 E4M3 block scales `sc`
// into the SW128 tile (E2M1 x E4M3 is exact in BF16). The 8 dims of a word land in the order
// [0, 4, 1, 5, 2, 6, 3, 7] (e2m1x8_bf16_pairs); q uses the same order (a permutation of the
// reduction dim leaves q . K unchanged). Bit-exact for all 256 bytes
// (tests/test_indexer.py::test_gpu_e2m1_decode_exhaustive).
DSV4_DEVICE void decode_half(const u32* vw, const u8* sc, u32 tile, int rows, int r, int half) {
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    u32 o[4];
    e2m1x8_bf16_pairs(vw[c], 0x7E807E80u, o);      // bf16x2 {2^126, 2^126}: the plain levels
    const float sf = e4m3_to_f32(sc[c >> 1]);
    const u32 sb = pack_bf16x2(sf, sf) & 0xFFFFu;
    const u32 s2 = sb | (sb << 16);
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = bf16x2_mul(o[k], s2);
    st_shared_v4(sw128_addr(tile, rows, r, half, c), o[0], o[1], o[2], o[3]);
  }
}

// ---------------------------------------------------------------------------------------
// logits (BF16 path)
struct __align__(1024) LogitsSmem {
  u8 q[2 * IDX_N * 128];               // B operand: N rows x 128 dims bf16, SW128
  u8 k[2][2 * IDX_TILE * 128];         // A operand: 64 keys x 128 dims bf16, SW128, double buffer
  u8 raw[IDX_STAGES][IDX_RAW_BYTES];   // raw key bytes: 64 x VB values, then 64 x SB scales
  float w[IDX_NQ][64];                 // head weights of the CTA's query rows
  i32 pages[IDX_MAX_CHUNK_TILES];      // page of each tile of the CTA's chunk (block_table prefetch)
};


// Issue the cp.async copies of one 64-key tile (rows >= nvalid are zero-filled, never read).
DSV4_DEVICE void load_tile_async(u32 raw, const u8* vals, const u8* sfs, int nvalid, int tid) {
  constexpr int VC = IDX_TILE * IDX_VB / 16;   // value chunks
  constexpr int CPK = IDX_VB / 16;             // chunks per key
#pragma unroll
  for (int i = tid; i < VC; i += 128) {
    const int key = i / CPK;
    cp_async16(raw + i * 16, vals + i * 16, key < nvalid ? 16 : 0);
  }
  constexpr int SC = IDX_TILE * IDX_SB / 16;   // scale chunks
  constexpr int KPC = 16 / IDX_SB;             // keys per scale chunk
  if (tid < SC) {
    int nb = (nvalid - tid * KPC) * IDX_SB;
    nb = nb < 0 ? 0 : (nb > 16 ? 16 : nb);
    cp_async16(raw + IDX_TILE * IDX_VB + tid * 16, sfs + tid * 16, nb);
  }
}

// Decode a landed raw tile into a bf16 SW128 A tile: thread = (key tid/2, half tid%2).
DSV4_DEVICE void decode_tile(const u8* raw_p, u32 raw, u32 ktile, int tid) {
  const int r = tid >> 1, half = tid & 1;
  u32 vw[8];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const u32x4 v = ld_shared_v4(raw + r * IDX_VB + half * 32 + i * 16);
    vw[4 * i] = v.x; vw[4 * i + 1] = v.y; vw[4 * i + 2] = v.z; vw[4 * i + 3] = v.w;
  }
  const u8* sc = raw_p + IDX_TILE * IDX_VB + r * IDX_SB + half * (IDX_SB / 2);
  decode_half(vw, sc, ktile, IDX_TILE, r, half);
}


// Register fence on every accumulator (common.cuh fence_reg).
DSV4_DEVICE void fence_acc(float* acc) {
#pragma unroll
  for (int i = 0; i < IDX_N / 2; ++i) fence_reg(acc[i]);
}

DSV4_DEVICE void mma_tile(float* acc, u32 ktile, u32 qtile) {
  fence_acc(acc);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int half = kk >> 2;
    // K-major, 128-byte swizzle: SBO = 1024 B (8 rows x 128 B), LBO unused when swizzled (16 B)
    const u64 da = wgmma_desc(ktile + half * IDX_TILE * 128 + (kk & 3) * 32, 16, 1024, 1);
    const u64 db = wgmma_desc(qtile + half * IDX_N * 128 + (kk & 3) * 32, 16, 1024, 1);
#if IDX_NQ == 1
    wgmma_m64n64k16_bf16(acc, da, db, kk > 0);
#elif IDX_NQ == 2
    wgmma_m64n128k16_bf16(acc, da, db, kk > 0);
#elif IDX_NQ == 3
    wgmma_m64n192k16_bf16(acc, da, db, kk > 0);
#else
    wgmma_m64n256k16_bf16(acc, da, db, kk > 0);
#endif
  }
  wgmma_commit();
  fence_acc(acc);
}

// Decode (paged): batch b = blockIdx.x, rows r = b*NQ + qi (NQ = next_n), cache
//   k_data = [num_blocks, block_size * BPT] (values then scales per block), page of key s =
//   block_table[b, s / block_size]; row range [0, lens[r]) clamped to n_keys; ld = n_keys.
extern "C" __global__ void __launch_bounds__(128) indexer_logits_kernel(
    const u8* __restrict__ q_data,     // [R, 64, VB]
    const u8* __restrict__ q_sf,       // [R, 64, 8] NVFP4 E4M3 block scales
    const float* __restrict__ w,       // [R, 64]
    const float* __restrict__ q_gs,    // [1] q global scale
    const float* __restrict__ k_gs,    // [1] k global scale
    const u8* __restrict__ k_data,     // paged cache base
    const u8* __restrict__ k_sf,       // unused (the scales live in the cache pages)
    const i32* __restrict__ range_lo,  // lens [R]
    const i32* __restrict__ range_hi,  // block_table [B, max_blocks]
    float* __restrict__ logits,        // [R, ld]
    i32 R, i32 n_keys, i64 ld, i32 chunk_tiles, i32 block_size, i32 max_blocks,
    i32 rows_per_seq,    // == IDX_NQ on this path (one CTA row block per sequence)
    i32 num_blocks) {    // pages of the cache; block_table entries outside [0, num_blocks)
                         // are never dereferenced (block 0 is loaded instead) and their keys get -inf
  extern __shared__ __align__(1024) u8 smem_raw[];
  LogitsSmem& sm = *reinterpret_cast<LogitsSmem*>(
      (reinterpret_cast<unsigned long long>(smem_raw) + 1023ull) & ~1023ull);
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int row0 = blockIdx.x * IDX_NQ;
  const int c0 = blockIdx.y * chunk_tiles * IDX_TILE;
  const int c1 = min(n_keys, c0 + chunk_tiles * IDX_TILE);
  if (c0 >= n_keys) return;

  // per-row ranges (every thread computes all NQ; tiny)
  int lo[IDX_NQ], hi[IDX_NQ];
  int kmin = 0x7fffffff, kmax = 0;
#pragma unroll
  for (int qi = 0; qi < IDX_NQ; ++qi) {
    const int r = row0 + qi;
    int a = 0, b = 0;
    if (r < R) {
      a = 0;
      b = __ldg(range_lo + r);
      a = max(a, 0);
      b = min(b, n_keys);
      if (b < a) b = a;
    }
    lo[qi] = a; hi[qi] = b;
    if (b > a) { kmin = min(kmin, a); kmax = max(kmax, b); }
  }
  // tiles processed by this CTA: [p0, p1), 64-aligned, inside [c0, c1)
  int p0 = max(c0, kmin & ~63), p1 = min(c1, kmax);
  if (p1 <= p0) { p0 = c0; p1 = c0; }
  const int ntiles = (p1 - p0 + 63) >> 6;
  const int p1a = min(c1, p0 + ntiles * 64);

  // -inf outside the processed tiles (inside them, the epilogue masks)
#pragma unroll
  for (int qi = 0; qi < IDX_NQ; ++qi) {
    const int r = row0 + qi;
    if (r >= R) continue;
    float* out = logits + (i64)r * ld;
    for (int s = c0 + tid; s < p0; s += 128) out[s] = NEG_INF;
    for (int s = p1a + tid; s < c1; s += 128) out[s] = NEG_INF;
  }
  if (ntiles == 0) return;

  const u32 q_s = smem_u32(sm.q);
  const u32 k_s[2] = {smem_u32(sm.k[0]), smem_u32(sm.k[1])};
  const u32 raw0 = smem_u32(sm.raw[0]);
#define RAW_S(i) (raw0 + (u32)(i) * (u32)IDX_RAW_BYTES)

  const i32* btab = range_hi + (i64)blockIdx.x * max_blocks;
  auto page_ok = [&](int s) -> bool {  // key s lies in a valid page
    return (u32)__ldg(btab + s / block_size) < (u32)num_blocks;
  };
  auto tile_ptrs = [&](int s0, const u8*& vals, const u8*& sfs) {
    const i64 page = (i64)sm.pages[(s0 - p0) >> 6];
    const u8* base = k_data + ((u64)page < (u64)num_blocks ? page : 0) * block_size * IDX_BPT;
    const int off = s0 % block_size;
    vals = base + (i64)off * IDX_VB;
    sfs = base + (i64)block_size * IDX_VB + (i64)off * IDX_SB;
  };
  auto issue = [&](int t) {
    if (t < ntiles) {
      const int s0 = p0 + t * 64;
      const u8 *vals, *sfs;
      tile_ptrs(s0, vals, sfs);
      load_tile_async(RAW_S(t % IDX_STAGES), vals, sfs, min(64, kmax - s0), tid);
    }
    cp_async_commit();
  };
  for (int t = tid; t < ntiles; t += 128) sm.pages[t] = __ldg(btab + (p0 + t * 64) / block_size);
  __syncthreads();
#pragma unroll
  for (int t = 0; t < IDX_STAGES; ++t) issue(t);

  // queries -> bf16 SW128 B tile (exact), weights -> smem. Thread tid owns the NQ tasks
  // (row n = tid/2 + 64*i, half tid%2); all global loads are issued before any decode.
  {
    constexpr int QW = IDX_VB / 8;     // words per half row (8)
    u32 qv[IDX_NQ][QW];
    u8 qsc[IDX_NQ][4];
    const int half = tid & 1;
#pragma unroll
    for (int i = 0; i < IDX_NQ; ++i) {
      const int n = (tid >> 1) + 64 * i;
      const int r = row0 + (n >> 6), h = n & 63;
      const int rr = r < R ? r : 0;
      const u8* src = q_data + ((i64)rr * 64 + h) * IDX_VB + half * (IDX_VB / 2);
#pragma unroll
      for (int k = 0; k < QW / 4; ++k) {
        const u32x4 v = ld_global_nc_v4(src + k * 16);
        qv[i][4 * k] = v.x; qv[i][4 * k + 1] = v.y; qv[i][4 * k + 2] = v.z; qv[i][4 * k + 3] = v.w;
      }
#pragma unroll
      for (int k = 0; k < IDX_SB / 2; ++k) qsc[i][k] = __ldg(q_sf + ((i64)rr * 64 + h) * IDX_SB + half * (IDX_SB / 2) + k);
    }
#pragma unroll
    for (int i = 0; i < IDX_NQ; ++i) {
      const int n = (tid >> 1) + 64 * i;
      if (row0 + (n >> 6) < R) {
        decode_half(qv[i], qsc[i], q_s, IDX_N, n, half);
      } else {
#pragma unroll
        for (int c = 0; c < 8; ++c) st_shared_v4(sw128_addr(q_s, IDX_N, n, half, c), 0u, 0u, 0u, 0u);
      }
    }
  }
  for (int i = tid; i < IDX_NQ * 64; i += 128) {
    const int r = row0 + i / 64;
    sm.w[i / 64][i % 64] = r < R ? __ldg(w + (i64)r * 64 + (i % 64)) : 0.f;
  }
  const float gscale = __ldg(q_gs) * __ldg(k_gs);

  // first tile
  cp_async_wait<IDX_STAGES - 1>();
  __syncthreads();
  decode_tile(sm.raw[0], RAW_S(0), k_s[0], tid);
  fence_proxy_async_smem();
  __syncthreads();
  issue(IDX_STAGES);

  float acc[IDX_N / 2];
#pragma unroll
  for (int i = 0; i < IDX_N / 2; ++i) acc[i] = 0.f;
  const int rA = warp * 16 + (lane >> 2);  // key rows rA, rA + 8 of the tile
  const int hc = 2 * (lane & 3);           // head column offset within each 8-column group
  for (int t = 0; t < ntiles; ++t) {
    mma_tile(acc, k_s[t & 1], q_s);
    if (t + 1 < ntiles) {
      cp_async_wait<IDX_STAGES - 1>();
      __syncthreads();
      const int st = (t + 1) % IDX_STAGES;
      decode_tile(sm.raw[st], RAW_S(st), k_s[(t + 1) & 1], tid);
    }
    wgmma_wait<0>();
    fence_acc(acc);
    fence_proxy_async_smem();
    __syncthreads();
    issue(t + 1 + IDX_STAGES);

    // epilogue: rows rA / rA+8 of tile t; columns = heads of query qi
    const int s0 = p0 + t * 64;
    const float kscale0 = gscale, kscale1 = gscale;
#pragma unroll
    for (int qi = 0; qi < IDX_NQ; ++qi) {
      float v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int jj = 0; jj < 8; ++jj) {
        const int j = qi * 8 + jj;
        const float2 wv = *reinterpret_cast<const float2*>(&sm.w[qi][8 * jj + hc]);
        v0 = fmaf(wv.x, fmaxf(acc[4 * j + 0], 0.f), v0);
        v0 = fmaf(wv.y, fmaxf(acc[4 * j + 1], 0.f), v0);
        v1 = fmaf(wv.x, fmaxf(acc[4 * j + 2], 0.f), v1);
        v1 = fmaf(wv.y, fmaxf(acc[4 * j + 3], 0.f), v1);
      }
      v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
      v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
      v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
      v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
      const int r = row0 + qi;
      const int q4 = lane & 3;
      if (r < R && q4 < 2) {
        const int s = s0 + rA + 8 * q4;
        const float v = q4 == 0 ? v0 * kscale0 : v1 * kscale1;
        if (s < c1) logits[(i64)r * ld + s] = (s >= lo[qi] && s < hi[qi] && page_ok(s)) ? v : NEG_INF;
      }
    }
  }
  cp_async_wait<0>();
}
#endif  // IDX_FMT == 1: indexer_logits_kernel
