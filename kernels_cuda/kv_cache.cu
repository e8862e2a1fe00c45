// kv_cache: DSV4 paged KV caches (SWA ring + CSA/HCA compressed), compressors, gather.
// Contracts: docs/layouts/kv_cache_*.md, kv_compress_*.md (dsv4/ops/kv_cache.py); byte layouts
// in kv_cache.cuh. Math: dsv4_spec.md 2.2 / 2.3 (FLASH-REF model.py Compressor, act_quant,
// fp4_act_quant, rotate_activation, apply_rotary_emb).
//
// Kernels (all extern "C", one launch per op, no host sync):
//   kv_gather_kernel          one warp per output row (SWA rows first, then compressed rows):
//                             logical index -> block_table -> page; -1 / out-of-range / at or
//                             past the request's length (lens[req]) -> zero row. 8 B E4M3 loads + one 8 B scale word, exact E4M3*2^k -> BF16,
//                             16 B stores.
//   kv_compress_prefill_kernel  one group of D/4 threads (x RS row groups) per compressed entry;
//                             each thread owns 4 channels (16 B loads of kv/score/ape), online
//                             per-channel softmax over the pooled rows (RS partials merged in
//                             shared memory in a fixed order), BF16 round, RMSNorm (warp shuffles +
//                             smem), RoPE (cos/sin table, no FMA), then
//                               D = 512: block-64 E4M3 + UE8M0 (fp8_ds_mla) or fake-quant BF16;
//                               D = 128: Hadamard (warp butterflies) + MXFP4 or fake-quant BF16.
//                             Extra CTAs write the FP32 decode state of every sequence's tail.
//   kv_compress_decode_kernel one CTA per sequence: appends the token's row to the FP32 state,
//                             and at a block boundary pools the state rows with the SAME device
//                             code and order as prefill (bit-identical entries), shifts the
//                             overlap rows, and writes the entry.
//
// Macros: KVC_FMT (0 quantized: fp8_ds_mla for D=512 / MXFP4 for D=128; 1 BF16 fake-quant),
//         KVC_D (512 | 128), KVC_RATIO (4 | 128), KVC_IDX64 (slot_mapping / positions int64),
//         tuning: KVC_ONLINE, KVC_GATHER_RPW (see below; the provider passes
//         kernels_cuda/kv_cache.py DEFAULTS). Measured on the H200 (docs/benchmarks.md): the
//         branch-free online softmax (KVC_ONLINE 1/2) is 1.5x faster than the branchy one (0) on
//         prefill (divergent expf on both paths); 2 or 4 gather rows per warp did not help.
#include "kv_cache.cuh"

#ifndef KVC_FMT
#define KVC_FMT 0
#endif
#ifndef KVC_D
#define KVC_D 512
#endif
#ifndef KVC_RATIO
#define KVC_RATIO 4
#endif
#ifndef KVC_IDX64
#define KVC_IDX64 0
#endif
// tuning variants (bench/bench_kv_cache.py times them; defaults = the validated choice)
#ifndef KVC_ONLINE      // 0 branchy expf, 1 branch-free expf (bit-identical to 0), 2 branch-free ex2 (base 2)
#define KVC_ONLINE 2
#endif
#ifndef KVC_GATHER_RPW  // gather: output rows per warp
#define KVC_GATHER_RPW 1
#endif

#if KVC_IDX64
typedef i64 idx_t;
#else
typedef i32 idx_t;
#endif

#define D KVC_D
#define R KVC_RATIO
#define OVL (R == 4)
#define COFF (OVL ? 2 : 1)
#define NR (COFF * R)                    // pooled rows per entry (= state rows)
#define CH (COFF * D)                    // channels of a kv / score / ape / state row
#define TPE (D / 4)                      // threads per row group (4 channels each)
#define RS (R == 128 ? 4 : 1)            // row groups (partials merged in smem)
#define RPG (NR / RS)                    // rows per group
#define EPC ((TPE * RS) >= 128 ? 1 : 128 / (TPE * RS))  // entries per CTA (prefill)
#define PF_THREADS (TPE * RS * EPC)
#define DC_THREADS (TPE * RS)
#define UNR (RPG < 8 ? RPG : 8)

#if (D != 512) && (D != 128)
#error "KVC_D must be 512 (attention) or 128 (indexer)"
#endif
#if (R != 4) && (R != 128)
#error "KVC_RATIO must be 4 (CSA) or 128 (HCA)"
#endif

// =======================================================================================
// gather: out[t, k] = dequant(row) for k < W from the SWA cache (swa_idx), else from the
// compressed cache (idx); logical index l -> page = bt[req, l / bs], slot l % bs.
// Row l of request req is read only when 0 <= l < lens[req] (isolation: a padded / stale
// block_table column past the request's length never exposes another request's entries).
DSV4_DEVICE const u8* kvc_row_addr(const u8* cache, i32 bs, i64 nb, const i32* bt, i32 bt_cols, i32 bt_rows,
                                   const i32* lens, int req, i32 l, const u8** sf) {
  if (l < 0 || req < 0 || req >= bt_rows) return nullptr;
  if (l >= __ldg(lens + req)) return nullptr;
  const i32 pi = l / bs;
  if (pi >= bt_cols) return nullptr;
  const i32 page = __ldg(bt + (i64)req * bt_cols + pi);
  if (page < 0 || (i64)page >= nb) return nullptr;
  const i32 off = l - pi * bs;
#if KVC_FMT == 0
  const u8* base = cache + (i64)page * bs * KVC_TOKEN_B;
  *sf = base + (i64)bs * KVC_DATA_B + (i64)off * KVC_SF_B;
  return base + (i64)off * KVC_DATA_B;
#else
  *sf = nullptr;
  return cache + ((i64)page * bs + off) * 1024;
#endif
}

// 8 E4M3 bytes (e) x 2^k (s) -> 8 BF16 (exact)
DSV4_DEVICE u32x4 kvc_e4m3x8_bf16(u32x2 e, float s) {
  float x[8];
  e4m3x2_to_f32x2(e.x & 0xFFFFu, x[0], x[1]);
  e4m3x2_to_f32x2(e.x >> 16, x[2], x[3]);
  e4m3x2_to_f32x2(e.y & 0xFFFFu, x[4], x[5]);
  e4m3x2_to_f32x2(e.y >> 16, x[6], x[7]);
  return u32x4{pack_bf16x2(x[0] * s, x[1] * s), pack_bf16x2(x[2] * s, x[3] * s), pack_bf16x2(x[4] * s, x[5] * s),
               pack_bf16x2(x[6] * s, x[7] * s)};
}
DSV4_DEVICE float kvc_sf_of(u32x2 sw, int g) {
  return exp2_byte(((g < 4 ? sw.x : sw.y) >> (8 * (g & 3))) & 0xFFu);
}

// KVC_GATHER_RPW output rows per warp; lane units: u0 = lane (E4M3 bytes [8u, 8u+8)), u1 = lane + 32
// (E4M3 for lane < 24, else rope bytes [448 + 16(lane-24), +16)); all loads first, then stores.
extern "C" __global__ void __launch_bounds__(256) kv_gather_kernel(
    const u8* __restrict__ cache, i32 bs, i64 nb, const i32* __restrict__ bt, i32 bt_cols, i32 bt_rows,
    const i32* __restrict__ lens,                        // [bt_rows] valid entries per request
    const i32* __restrict__ idx, i32 K,                  // [T, K] compressed logical indices
    const u8* __restrict__ swa_cache, i32 swa_bs, i64 swa_nb, const i32* __restrict__ swa_bt,
    i32 swa_bt_cols, i32 swa_bt_rows, const i32* __restrict__ swa_lens,          // [swa_bt_rows]
    const i32* __restrict__ swa_idx, i32 W,              // [T, W]
    const i32* __restrict__ req_idx,                     // [T] or null (req = t)
    u8* __restrict__ out, i64 T) {                       // [T, W + K, 512] bf16
  const int lane = threadIdx.x & 31;
  const i64 NS = (i64)W + K;
  const i64 total = T * NS;
  const i64 r0 = ((i64)blockIdx.x * 8 + (threadIdx.x >> 5)) * KVC_GATHER_RPW;
  const u8* src[KVC_GATHER_RPW];
#if KVC_FMT == 0
  u32x2 sw[KVC_GATHER_RPW], e0[KVC_GATHER_RPW], e1[KVC_GATHER_RPW];
  u32x4 rp[KVC_GATHER_RPW];
#else
  u32x4 v0[KVC_GATHER_RPW], v1[KVC_GATHER_RPW];
#endif
#pragma unroll
  for (int k = 0; k < KVC_GATHER_RPW; ++k) {
    const i64 r = r0 + k;
    src[k] = nullptr;
    if (r < total) {
      const i64 t = r / NS;
      const i32 c = (i32)(r - t * NS);
      const int req = req_idx ? __ldg(req_idx + t) : (int)t;
      const u8* sf = nullptr;
      if (c < W)
        src[k] = kvc_row_addr(swa_cache, swa_bs, swa_nb, swa_bt, swa_bt_cols, swa_bt_rows, swa_lens, req,
                              __ldg(swa_idx + t * W + c), &sf);
      else
        src[k] = kvc_row_addr(cache, bs, nb, bt, bt_cols, bt_rows, lens, req, __ldg(idx + t * K + (c - W)), &sf);
      if (src[k]) {
#if KVC_FMT == 0
        sw[k] = ld_global_nc_v2(sf);
        e0[k] = ld_global_nc_v2(src[k] + lane * 8);
        if (lane < 24) e1[k] = ld_global_nc_v2(src[k] + (lane + 32) * 8);
        else rp[k] = ld_global_nc_v4(src[k] + KVC_NOPE + (lane - 24) * 16);
#else
        v0[k] = ld_global_nc_v4(src[k] + lane * 16);
        v1[k] = ld_global_nc_v4(src[k] + 512 + lane * 16);
#endif
      }
    }
  }
  const u32x4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int k = 0; k < KVC_GATHER_RPW; ++k) {
    const i64 r = r0 + k;
    if (r >= total) break;
    u8* dst = out + r * 1024;
    if (src[k] == nullptr) {
      st_global_v4(dst + lane * 16, zero);
      st_global_v4(dst + 512 + lane * 16, zero);
      continue;
    }
#if KVC_FMT == 0
    st_global_v4(dst + lane * 16, kvc_e4m3x8_bf16(e0[k], kvc_sf_of(sw[k], lane >> 3)));
    if (lane < 24) st_global_v4(dst + (lane + 32) * 16, kvc_e4m3x8_bf16(e1[k], kvc_sf_of(sw[k], (lane + 32) >> 3)));
    else st_global_v4(dst + 896 + (lane - 24) * 16, rp[k]);
#else
    st_global_v4(dst + lane * 16, v0[k]);
    st_global_v4(dst + 512 + lane * 16, v1[k]);
#endif
  }
}

// =======================================================================================
// compressor
struct KvcPool {
  float m[4], l[4], a[4];
};

// destination of compressed entry b of sequence seq (nullptr: not addressable -> skipped)
DSV4_DEVICE u8* kvc_entry_dst(u8* cache, i32 bs, i64 nb, const i32* bt, i32 bt_cols, int seq, int b) {
  const i32 pi = b / bs;
  if (pi >= bt_cols) return nullptr;
  const i32 page = __ldg(bt + (i64)seq * bt_cols + pi);
  if (page < 0 || (i64)page >= nb) return nullptr;
  const i64 slot = (i64)page * bs + (b - pi * bs);
#if KVC_FMT == 1
  return cache + slot * (D * 2);
#elif D == 512
  return cache + (i64)page * bs * KVC_TOKEN_B + (i64)(b - pi * bs) * KVC_DATA_B;
#else
  return cache + (i64)page * bs * KVC_IDX_TOKEN_B + (i64)(b - pi * bs) * KVC_IDX_VB;
#endif
}
// scale address of the same entry (quantized formats)
DSV4_DEVICE u8* kvc_entry_sf(u8* cache, i32 bs, const i32* bt, i32 bt_cols, int seq, int b) {
  const i32 pi = b / bs;
  const i32 page = __ldg(bt + (i64)seq * bt_cols + pi);
#if D == 512
  return cache + (i64)page * bs * KVC_TOKEN_B + (i64)bs * KVC_DATA_B + (i64)(b - pi * bs) * KVC_SF_B;
#else
  return cache + (i64)page * bs * KVC_IDX_TOKEN_B + (i64)bs * KVC_IDX_VB + (i64)(b - pi * bs) * KVC_IDX_SB;
#endif
}
// both: the data row (returned; nullptr = not addressable, skipped) and, quantized formats, the
// scale bytes (sfd; nullptr otherwise) of compressed entry b of sequence seq
DSV4_DEVICE u8* kvc_entry_addrs(u8* cache, i32 bs, i64 nb, const i32* bt, i32 bt_cols, int seq, int b, u8*& sfd) {
  u8* dst = kvc_entry_dst(cache, bs, nb, bt, bt_cols, seq, b);
  sfd = nullptr;
#if KVC_FMT == 0
  if (dst) sfd = kvc_entry_sf(cache, bs, bt, bt_cols, seq, b);
#endif
  return dst;
}

// pool the rows of one entry: row group g handles rows [g*RPG, (g+1)*RPG) in order.
// fetch(j, kv4, sc4) returns row j's kv and (score + ape) for this thread's 4 channels.
template <class F>
DSV4_DEVICE void kvc_pool(const F& fetch, int g, KvcPool& p) {
#pragma unroll
  for (int k = 0; k < 4; ++k) { p.m[k] = neg_inf_f32(); p.l[k] = 0.f; p.a[k] = 0.f; }
  for (int j0 = 0; j0 < RPG; j0 += UNR) {
    float4 kv4[UNR], sc4[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) fetch(g * RPG + j0 + u, kv4[u], sc4[u]);
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
#if KVC_ONLINE == 0
      kvc_online(p.m[0], p.l[0], p.a[0], sc4[u].x, kv4[u].x);
      kvc_online(p.m[1], p.l[1], p.a[1], sc4[u].y, kv4[u].y);
      kvc_online(p.m[2], p.l[2], p.a[2], sc4[u].z, kv4[u].z);
      kvc_online(p.m[3], p.l[3], p.a[3], sc4[u].w, kv4[u].w);
#else
#if KVC_ONLINE == 2
      const float L2E = 1.4426950408889634f;  // scores in base-2 units: exp(s) = 2^(s * log2 e)
      sc4[u] = make_float4(__fmul_rn(sc4[u].x, L2E), __fmul_rn(sc4[u].y, L2E), __fmul_rn(sc4[u].z, L2E),
                           __fmul_rn(sc4[u].w, L2E));
#endif
      kvc_online_sel<KVC_ONLINE>(p.m[0], p.l[0], p.a[0], sc4[u].x, kv4[u].x);
      kvc_online_sel<KVC_ONLINE>(p.m[1], p.l[1], p.a[1], sc4[u].y, kv4[u].y);
      kvc_online_sel<KVC_ONLINE>(p.m[2], p.l[2], p.a[2], sc4[u].z, kv4[u].z);
      kvc_online_sel<KVC_ONLINE>(p.m[3], p.l[3], p.a[3], sc4[u].w, kv4[u].w);
#endif
    }
  }
}

// merge the RS row-group partials (fixed order 0, 1, ..); result valid in group 0.
// Every thread of the CTA must call it (it synchronizes when RS > 1).
DSV4_DEVICE void kvc_merge_groups(KvcPool& p, int g, int t, float* sm) {
#if RS > 1
  float* sm_m = sm;
  float* sm_l = sm + RS * D;
  float* sm_a = sm + 2 * RS * D;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    sm_m[g * D + 4 * t + k] = p.m[k];
    sm_l[g * D + 4 * t + k] = p.l[k];
    sm_a[g * D + 4 * t + k] = p.a[k];
  }
  __syncthreads();
  if (g == 0) {
#pragma unroll
    for (int gg = 1; gg < RS; ++gg)
#pragma unroll
      for (int k = 0; k < 4; ++k)
        kvc_merge<KVC_ONLINE>(p.m[k], p.l[k], p.a[k], sm_m[gg * D + 4 * t + k], sm_l[gg * D + 4 * t + k], sm_a[gg * D + 4 * t + k]);
  }
#endif
}

// pooled -> BF16 -> RMSNorm -> RoPE (-> Hadamard) -> quantize -> store. Called by every thread
// of the entry's CTA part; only row group 0 (active) computes and stores. t = channel thread,
// lane = t & 31. red: smem for the cross-warp RMS reduction (D = 512).
DSV4_DEVICE void kvc_finish(const KvcPool& p, bool active, int t, float* red, const float* __restrict__ norm_w,
                            const float* __restrict__ cos_sin, i64 n_pos, int b, float eps, u8* dst, u8* sfdst) {
  const int lane = t & 31;
  const int c = 4 * t;
  float x[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) x[k] = active ? round_bf16(__fdiv_rn(p.a[k], p.l[k])) : 0.f;  // kv.to(bf16)
  float ss = __fmul_rn(x[0], x[0]);
  ss = __fmaf_rn(x[1], x[1], ss);
  ss = __fmaf_rn(x[2], x[2], ss);
  ss = __fmaf_rn(x[3], x[3], ss);
  ss = warp_sum(ss);
#if D == 512
  if (active && lane == 0) red[t >> 5] = ss;
  __syncthreads();
  ss = ((red[0] + red[1]) + red[2]) + red[3];
#endif
  if (!active || dst == nullptr) return;
  const float rr = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ss * (1.0f / D), eps)));
  const float4 w4 = ld_global_nc_f4(norm_w + c);
  const float w[4] = {w4.x, w4.y, w4.z, w4.w};
  float y[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) y[k] = round_bf16(__fmul_rn(w[k], __fmul_rn(x[k], rr)));
  if (c >= D - KVC_ROPE) {  // interleaved pairs (c, c+1), (c+2, c+3) at position b * R
    i64 pos = (i64)b * R;
    pos = pos < n_pos ? pos : n_pos - 1;  // documented clamp (debug_check validates)
    const float4 cs = ld_global_nc_f4(cos_sin + pos * KVC_ROPE + (c - (D - KVC_ROPE)));
    const float y0 = __fsub_rn(__fmul_rn(y[0], cs.x), __fmul_rn(y[1], cs.y));
    const float y1 = __fadd_rn(__fmul_rn(y[0], cs.y), __fmul_rn(y[1], cs.x));
    const float y2 = __fsub_rn(__fmul_rn(y[2], cs.z), __fmul_rn(y[3], cs.w));
    const float y3 = __fadd_rn(__fmul_rn(y[2], cs.w), __fmul_rn(y[3], cs.z));
    y[0] = round_bf16(y0); y[1] = round_bf16(y1); y[2] = round_bf16(y2); y[3] = round_bf16(y3);
  }
#if D == 512
  // act_quant(nope, 64, ue8m0): 16 threads per block of 64
  float amax = fmaxf(fmaxf(finite_abs(y[0]), finite_abs(y[1])), fmaxf(finite_abs(y[2]), finite_abs(y[3])));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 4));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 8));
  const u32 sb = kvc_fp8_scale_byte(amax);
  const float s = exp2_byte(sb);
  const u32 q = f32x4_to_e4m3x4(__fdiv_rn(y[0], s), __fdiv_rn(y[1], s), __fdiv_rn(y[2], s), __fdiv_rn(y[3], s));
#if KVC_FMT == 0
  if (c < KVC_NOPE) {
    *reinterpret_cast<u32*>(dst + c) = q;
    if ((t & 15) == 0) sfdst[c >> 6] = (u8)sb;
  } else {
    st_global_v2(dst + KVC_NOPE + (c - KVC_NOPE) * 2, u32x2{pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3])});
    if (c == KVC_NOPE) sfdst[7] = 0;
  }
#else
  if (c < KVC_NOPE) {
    float d0, d1, d2, d3;
    e4m3x2_to_f32x2(q & 0xFFFFu, d0, d1);
    e4m3x2_to_f32x2(q >> 16, d2, d3);
    st_global_v2(dst + c * 2, u32x2{pack_bf16x2(d0 * s, d1 * s), pack_bf16x2(d2 * s, d3 * s)});
  } else {
    st_global_v2(dst + c * 2, u32x2{pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3])});
  }
#endif
#else   // D == 128: indexer key: Hadamard, bf16, MXFP4 (block 32 = 8 lanes)
  fwht128(y, lane);   // rotate_activation: bf16 in, bf16 out (fp32 contract, dsv4.reference.hadamard)
  float amax = fmaxf(fmaxf(finite_abs(y[0]), finite_abs(y[1])), fmaxf(finite_abs(y[2]), finite_abs(y[3])));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 2));
  amax = fmaxf(amax, __shfl_xor_sync(KVC_FULL, amax, 4));
  // OCP MX rule (dsv4.formats.quantize_mxfp4, issue 19 item 13): a block of 32 holding a NaN / Inf
  // gets the NaN scale 0xFF and zero codes (it decodes to NaN)
  u32 nf = (finite_abs(y[0]) != fabsf(y[0])) | (finite_abs(y[1]) != fabsf(y[1])) |
           (finite_abs(y[2]) != fabsf(y[2])) | (finite_abs(y[3]) != fabsf(y[3]));
  nf |= __shfl_xor_sync(KVC_FULL, nf, 1);
  nf |= __shfl_xor_sync(KVC_FULL, nf, 2);
  nf |= __shfl_xor_sync(KVC_FULL, nf, 4);
  const u32 sb = nf ? 0xFFu : kvc_fp4_scale_byte(amax);
  const float s = nf ? __uint_as_float(0x7FC00000u) : exp2_byte(sb);
  u32 codes = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) codes |= e2m1_code_rne(fminf(fmaxf(__fdiv_rn(y[k], s), -6.f), 6.f)) << (4 * k);
  if (nf) codes = 0;
#if KVC_FMT == 0
  *reinterpret_cast<u16*>(dst + 2 * lane) = (u16)codes;
  u32 word = 0;
#pragma unroll
  for (int g = 0; g < 4; ++g) word |= __shfl_sync(KVC_FULL, sb, 8 * g) << (8 * g);
  if (lane == 0) *reinterpret_cast<u32*>(sfdst) = word;
#else
  u32 bv[4];
  e2m1x8_to_bf16x8(codes, bv);  // exact E2M1 levels as bf16 (nibbles 0..3 -> bv[0], bv[1])
  st_global_v2(dst + c * 2, u32x2{pack_bf16x2(bf16_lo_to_f32(bv[0]) * s, bf16_hi_to_f32(bv[0]) * s),
                                  pack_bf16x2(bf16_lo_to_f32(bv[1]) * s, bf16_hi_to_f32(bv[1]) * s)});
#endif
#endif
}

// entry e -> (seq, b) over the ragged sequences (warp-cooperative prefix scan of L_i / R);
// seq = -1 when e is past the last complete block. Sequences whose cu_seqlens range is not
// inside [0, T] count as empty (never read out of bounds).
DSV4_DEVICE void kvc_find_entry(i64 e, const i32* __restrict__ cu, int n_seq, i64 T, int& seq, int& b) {
  const int lane = threadIdx.x & 31;
  i64 acc = 0;
  seq = -1;
  b = 0;
  for (int base = 0; base < n_seq; base += 32) {
    const int i = base + lane;
    int cnt = 0;
    if (i < n_seq) {
      const i32 s0 = __ldg(cu + i), s1 = __ldg(cu + i + 1);
      cnt = (s0 >= 0 && s1 >= s0 && (i64)s1 <= T) ? (s1 - s0) / R : 0;
    }
    int inc = cnt;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(KVC_FULL, inc, o);
      if (lane >= o) inc += y;
    }
    const i64 excl = acc + inc - cnt;
    const u32 hit = __ballot_sync(KVC_FULL, cnt > 0 && e >= excl && e < excl + cnt);
    if (hit) {
      const int src = __ffs(hit) - 1;
      seq = base + src;
      b = (int)(e - __shfl_sync(KVC_FULL, excl, src));
      return;
    }
    acc += __shfl_sync(KVC_FULL, inc, 31);
  }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS) kv_compress_prefill_kernel(
    const float* __restrict__ kv, const float* __restrict__ score,   // [T, CH] fp32
    const float* __restrict__ ape,                                   // [R, CH] fp32
    const float* __restrict__ norm_w,                                // [D] fp32
    const float* __restrict__ cos_sin, i64 n_pos,                    // [P, 64] fp32
    const i32* __restrict__ cu, i32 n_seq, i64 T,                    // [B + 1]
    const i32* __restrict__ bt, i32 bt_cols,                         // [B, bt_cols]
    u8* __restrict__ cache, i32 bs, i64 nb,
    float* __restrict__ kv_state, float* __restrict__ score_state,   // [>= B, NR, CH] or null
    i32 n_entry_ctas, float eps) {
  __shared__ float sm[(RS > 1 ? 3 * RS * D : 1) + 4];
  if ((i32)blockIdx.x >= n_entry_ctas) {
    // ---- decode-state writer: one CTA per (sequence, state row)
    const i64 h = (i64)blockIdx.x - n_entry_ctas;
    const int s = (int)(h / NR), row = (int)(h % NR);
    if (s >= n_seq) return;
    const i32 s0 = __ldg(cu + s), s1 = __ldg(cu + s + 1);
    const bool ok = s0 >= 0 && s1 >= s0 && (i64)s1 <= T;
    const int L = ok ? s1 - s0 : 0, cutoff = L - L % R, rem = L % R;
    int tok;
    bool v;
    if (OVL && row < R) { tok = cutoff - R + row; v = cutoff >= R; }
    else { const int j = row - (OVL ? R : 0); tok = cutoff + j; v = j < rem; }
    const float* ap = ape + (i64)(row % R) * CH;
    float* kd = kv_state + ((i64)s * NR + row) * CH;
    float* sd = score_state + ((i64)s * NR + row) * CH;
    const i64 src = ((i64)s0 + tok) * CH;
    for (int q = threadIdx.x; q < CH / 4; q += blockDim.x) {
      float4 k4 = make_float4(0.f, 0.f, 0.f, 0.f);
      float4 s4 = make_float4(neg_inf_f32(), neg_inf_f32(), neg_inf_f32(), neg_inf_f32());
      if (v) {
        k4 = ld_global_nc_f4(kv + src + 4 * q);
        const float4 a4 = ld_global_nc_f4(ap + 4 * q), r4 = ld_global_nc_f4(score + src + 4 * q);
        s4 = make_float4(r4.x + a4.x, r4.y + a4.y, r4.z + a4.z, r4.w + a4.w);
      }
      st_global_v4_f32(kd + 4 * q, k4);
      st_global_v4_f32(sd + 4 * q, s4);
    }
    return;
  }
  // ---- compressed entries
  const int tid = threadIdx.x;
  const int eloc = tid / (TPE * RS), gt = tid % (TPE * RS);
  const int g = gt / TPE, t = gt % TPE;
  const int c = 4 * t;
  const i64 e = (i64)blockIdx.x * EPC + eloc;
  int seq, b;
  kvc_find_entry(e, cu, n_seq, T, seq, b);
  if (seq < 0) return;  // uniform over the entry's threads (EPC > 1 only when no __syncthreads)
  const i64 tok0 = (i64)__ldg(cu + seq) + (i64)b * R;
  auto fetch = [&](int j, float4& k4, float4& s4) {
    i64 tok;
    int off, aj;
    if (OVL && j < R) {
      if (b == 0) {
        k4 = make_float4(0.f, 0.f, 0.f, 0.f);
        s4 = make_float4(neg_inf_f32(), neg_inf_f32(), neg_inf_f32(), neg_inf_f32());
        return;
      }
      tok = tok0 - R + j; off = 0; aj = j;
    } else {
      aj = OVL ? j - R : j;
      tok = tok0 + aj;
      off = OVL ? D : 0;
    }
    k4 = ld_global_nc_f4(kv + tok * CH + off + c);
    const float4 r4 = ld_global_nc_f4(score + tok * CH + off + c);
    const float4 a4 = ld_global_nc_f4(ape + (i64)aj * CH + off + c);
    s4 = make_float4(r4.x + a4.x, r4.y + a4.y, r4.z + a4.z, r4.w + a4.w);
  };
  KvcPool p;
  kvc_pool(fetch, g, p);
  kvc_merge_groups(p, g, t, sm);
  u8* sfd;
  u8* dst = kvc_entry_addrs(cache, bs, nb, bt, bt_cols, seq, b, sfd);
  kvc_finish(p, g == 0, t, sm + (RS > 1 ? 3 * RS * D : 0), norm_w, cos_sin, n_pos, b, eps, dst, sfd);
}

extern "C" __global__ void __launch_bounds__(DC_THREADS) kv_compress_decode_kernel(
    const float* __restrict__ kv, const float* __restrict__ score,   // [B, CH] fp32 (this step's token)
    const float* __restrict__ ape, const float* __restrict__ norm_w,
    const float* __restrict__ cos_sin, i64 n_pos,
    const idx_t* __restrict__ positions, i32 n_seq,                  // [B], -1 = skip
    const i32* __restrict__ bt, i32 bt_cols,
    u8* __restrict__ cache, i32 bs, i64 nb,
    float* __restrict__ kv_state, float* __restrict__ score_state,   // [>= B, NR, CH]
    float eps) {
  __shared__ float sm[(RS > 1 ? 3 * RS * D : 1) + 4];
  const int s = blockIdx.x;
  if (s >= n_seq) return;
  const i64 pos = (i64)__ldg(positions + s);
  if (pos < 0) return;
  const int j = (int)(pos % R);
  const int row = (OVL ? R : 0) + j;
  float* kst = kv_state + (i64)s * NR * CH;
  float* sst = score_state + (i64)s * NR * CH;
  for (int q = threadIdx.x; q < CH / 4; q += blockDim.x) {
    const float4 k4 = ld_global_nc_f4(kv + (i64)s * CH + 4 * q);
    const float4 r4 = ld_global_nc_f4(score + (i64)s * CH + 4 * q), a4 = ld_global_nc_f4(ape + (i64)j * CH + 4 * q);
    st_global_v4_f32(kst + (i64)row * CH + 4 * q, k4);
    st_global_v4_f32(sst + (i64)row * CH + 4 * q, make_float4(r4.x + a4.x, r4.y + a4.y, r4.z + a4.z, r4.w + a4.w));
  }
  if ((pos + 1) % R != 0) return;  // uniform over the CTA
  __syncthreads();
  const int tid = threadIdx.x, g = tid / TPE, t = tid % TPE, c = 4 * t;
  auto fetch = [&](int jj, float4& k4, float4& s4) {
    const int off = (OVL && jj < R) ? 0 : (OVL ? D : 0);
    k4 = ld_global_v4_f32(kst + (i64)jj * CH + off + c);
    s4 = ld_global_v4_f32(sst + (i64)jj * CH + off + c);
  };
  KvcPool p;
  kvc_pool(fetch, g, p);
  kvc_merge_groups(p, g, t, sm);
#if OVL
  __syncthreads();  // every pooled read is done before the overlap rows are overwritten
  for (int q = threadIdx.x; q < R * CH / 4; q += blockDim.x) {
    const int rr = q / (CH / 4), cc = q % (CH / 4);
    st_global_v4_f32(kst + (i64)rr * CH + 4 * cc, ld_global_v4_f32(kst + (i64)(R + rr) * CH + 4 * cc));
    st_global_v4_f32(sst + (i64)rr * CH + 4 * cc, ld_global_v4_f32(sst + (i64)(R + rr) * CH + 4 * cc));
  }
#endif
  const int b = (int)min(pos / R, (i64)0x7FFFFFFF);  // a huge position: entry past every block table, not written
  u8* sfd;
  u8* dst = kvc_entry_addrs(cache, bs, nb, bt, bt_cols, s, b, sfd);
  kvc_finish(p, g == 0, t, sm + (RS > 1 ? 3 * RS * D : 0), norm_w, cos_sin, n_pos, b, eps, dst, sfd);
}
