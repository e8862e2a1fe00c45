// topk: exact, deterministic top-k of fp32 indexer logits per row (radix select + bucket sort).
// Contract: docs/layouts/topk.md (dsv4/ops/topk.py). Per row r the valid range is [lo, hi) with
//   hi = clamp(lengths[r], 0, ncols), lo = clamp(starts[r], 0, hi) (lo = 0 without starts).
// Selectable = in range, not NaN, not -inf. Output: the k best by (score desc, index asc), sorted
// (or, with sorted = 0, the same set in ascending position order), padded with (-1, -inf); indices
// optionally mapped through block_table (entries outside [0, num_blocks) -> -1).
//
// Algorithm (one cluster of TOPK_CLUSTER CTAs per row, one launch for the batch):
//   composite key  C(p) = key32(score) << 32 | (hi - 1 - p)      (unique per position)
//   key32 = order-preserving uint32 of the fp32 bits (-0.0 canonicalized to +0.0), so
//   "larger C" == "higher score, then lower index"; the selected set is {C >= C_k}, which is a
//   property of the data only -> bitwise identical for any launch configuration.
//   1. pass A: each CTA of the cluster histograms its contiguous slice of the row into 2048 bins
//      of a monotone bucket (top 11 bits of the order-preserving fp16 code: 32 bins per octave);
//      with TOPK_RES the slice is one register tile (host-checked) and stays in registers for
//      pass B (with <= 512 threads as decoded 16-bit bucket codes, TOPK_BC). The histograms are summed
//      through DSMEM: register tiles of 4 / 8 / 16 CTAs hierarchically (TOPK_HM: every CTA gathers the
//      peers' 64 coarse bins, finds the coarse bin of the k-th best, gathers the peers' 32 buckets of
//      it; one cluster barrier); 2-CTA tiles and streamed slices with 2 / 4 CTAs: every CTA reads every
//      peer's bins (vector loads, peers staggered); streamed 8 / 16 CTAs: reduce-scatter of 2048 /
//      CLUSTER-bin chunks, then only the chunk that holds the k-th best. Result: the bin b0.
//   2. pass B: elements with bucket > b0 ("winners") go to the leader's selected buffer, elements
//      of bin b0 to its candidate buffer (if the bin fits TOPK_CAP; else the leader re-reads the
//      row), with the AND/OR of their keys. Register-resident slices: a block-wide scan of the
//      per-thread counts, this CTA's first slots (TOPK_HM: the exclusive prefix of the gathered
//      per-CTA counts; 2-CTA tiles: one 64-bit DSMEM reservation per CTA), direct stores into the
//      leader's buffers. Streamed slices (a re-read that mostly hits L1/L2): warp-aggregated shared atomics
//      on the CTA's own buffers (no barrier per tile), then one reservation per buffer at the
//      leader and a copy.
//   3. leader, threshold inside b0: if n_cand^2 <= TOPK_RANKW * threads, every candidate counts the
//      candidates above it (its rank; a warp ranks 8 (1024 threads: 4) candidates in registers, the
//      counts summed by a shuffle reduce-scatter): rank < need -> selected, and the rank is its place
//      in the sorted output. Else radix refinement over C, 11-bit digits from
//      the highest bit where candidates differ, until the k-th composite is pinned. Ties at equal
//      score are resolved by the index bits of C (lower index wins), exactly.
//   4. leader, sorted output: a counting sort of the k selected composites over 2048 sub-buckets
//      of their range [C_min, C_max] (top 11 bits of C - C_min: monotone, and spread by the index
//      bits when scores tie), then every entry counts the larger composites of its own sub-bucket
//      (its rank inside it). No comparison network; ~8 barriers.
//   4'. leader, unsorted output (sorted = 0, the op's default): ascending position order. Register tiles of
//      >= 4 CTAs (TOPK_PRUN): pass B stored the winners and the candidates in position order, the rank path
//      keeps the selected candidates in it, and every entry's slot = its index in its run + the entries of
//      the other run before it (one binary search). Else from a bitmap of the selected positions (per-word
//      prefix counts, one block scan); rows too long for the bitmap sort (position, key) composites with
//      the counting sort of 4.
//   5. scores rebuilt from key32 (+-0.0 re-read for the exact sign); map through block_table; write.
// Memory: with TOPK_VEC=1 a CTA may read the rest of the aligned 16-byte chunk that holds a
// row's first / last valid element (never crosses a 16 B boundary, so never faults); those
// lanes are masked out. No other out-of-range access: lengths/starts are clamped on device,
// block_table entries are range-checked before use.
// Programmatic dependent launch: griddepcontrol.launch_dependents + wait before the first global access (the
// host launches with the PDL attribute: kernels_cuda/topk.py PDL; without it both are no-ops).
// Barrier rule (seed 002): every loop that contains __syncthreads / cluster barriers / full-warp
// votes has a block-uniform trip count; element predicates are data, never control flow around
// a barrier.
//
// Macros: TOPK_THREADS (256/512/1024), TOPK_CLUSTER (1/2/4/8/16 CTAs per row), TOPK_CAP (candidate
// buffer entries, >= 2048), TOPK_VEC (1: 16-byte loads, needs 16 B aligned rows; 0: scalar loads),
// TOPK_RES (1: every CTA's slice of the row is at most one tile of TOPK_THREADS * 16 positions).
#include "common.cuh"

#ifndef TOPK_THREADS
#define TOPK_THREADS 512
#endif
#ifndef TOPK_CLUSTER
#define TOPK_CLUSTER 1
#endif
#ifndef TOPK_CAP
#define TOPK_CAP 4096
#endif
#ifndef TOPK_VEC
#define TOPK_VEC 1
#endif
#ifndef TOPK_RES
#define TOPK_RES 0
#endif
// Paths by launch shape (structural, not tuning switches):
//   TOPK_HM: register-resident slices of 1 or >= 4 CTAs -- hierarchical histogram merge (coarse 64 bins, then the
//     32 buckets of the coarse bin of the k-th best; one cluster barrier) and pass-B slots from the merged
//     per-CTA counts (no reservation atomics); 2-CTA clusters gather both full histograms (faster there, topk9-01)
//   TOPK_BC: register tiles of <= 512 threads -- each slot decoded once into a 16-bit bucket code
#define TOPK_HM (TOPK_RES && TOPK_CLUSTER != 2)
//   TOPK_PRUN: register tiles of >= 8 CTAs (TOPK_HM: pass-B slots known in cluster-rank order) -- pass B stores in
//   slot order (unroll, thread, position) = ascending position, so the leader's winners and (rank path) selected
//   candidates are two runs sorted by position, and the default order merges them (a binary search per entry)
//   instead of the position bitmap (per call, PDL: [1, 129280] 16 x 512 12.10 us vs 12.55 (topk10-03), [4, 65536]
//   8 x 512 9.75 vs 9.79; not for [1, 32768] 4 x 512: 9.14 vs 8.93, nor one CTA, [128, 8192]: 9.98 vs 9.59
//   without PDL, topk10-01)
#ifndef TOPK_PRUN
#define TOPK_PRUN 1
#endif
#define TOPK_PRUN_ON (TOPK_PRUN && TOPK_HM && TOPK_CLUSTER >= 8)
#define TOPK_BC (TOPK_RES && TOPK_THREADS <= 512)

#define TOPK_KMAX 2048
#define TOPK_NBINS 2048
#define TOPK_NWARPS (TOPK_THREADS / 32)
#define TOPK_BPT (TOPK_NBINS / TOPK_THREADS)
// resident slices: one CTA per SM by design (the configs give one wave), so the register budget is
// the whole file; else 2048 threads' worth per SM
#define TOPK_MINB ((TOPK_RES || TOPK_THREADS >= 1024) ? 1 : (1024 / TOPK_THREADS))
#define TOPK_UNROLL 4
#define TOPK_TILE (TOPK_THREADS * TOPK_UNROLL)  // groups of 4 positions per tile
#define TOPK_RANKW 256                          // rank refinement while n_cand^2 <= RANKW * threads
// unsorted order: position bitmap (u32 words) + per-word prefix (u16) over S.cand, S.hist, S.seg
#define TOPK_BMW (((TOPK_CAP + TOPK_NBINS) * 4 / 3) & ~31)
#define FULL 0xFFFFFFFFu

static_assert(TOPK_NBINS % TOPK_THREADS == 0, "bins per thread must be integral");
static_assert(TOPK_NWARPS <= 32, "at most 32 warps");
static_assert(TOPK_CAP >= TOPK_KMAX, "the candidate buffer doubles as the sort's scratch (k entries)");
static_assert(6 * TOPK_BMW <= 8 * TOPK_CAP + 8 * TOPK_NBINS, "unsorted bitmap + prefix fit S.cand, S.hist, S.seg");
// hierarchical merge (TOPK_HM, clusters): S.seg[HM_COARSE, +64) = this CTA's coarse bins (read by peers),
// S.seg[0, 98 * CLUSTER) = the gathered coarse bins, buckets of the coarse bin B0, per-CTA pass-B counts
#define TOPK_HM_COARSE (TOPK_NBINS - 64)
static_assert(98 * TOPK_CLUSTER <= TOPK_HM_COARSE, "hierarchical merge scratch fits S.seg");

#define TOPK_SMEM_BASE (8 * TOPK_KMAX + 8 * TOPK_CAP + 8 * TOPK_NBINS + 1024)  // dynamic smem (host: smem_bytes)

struct TopkSmem {
  u64 sel[TOPK_KMAX];     // the selected composites (leader); after the sort's scatter, the output order
  u64 cand[TOPK_CAP];     // candidates of the threshold bin; then the bucket-grouped sort scratch
  u32 hist[TOPK_NBINS];   // histogram (each CTA); radix digits / segment cursors (leader)
  u32 seg[TOPK_NBINS];    // sort: per sub-bucket start in the output << 16 | count
  u32 scan[32];
  u32 n_sel, n_cand;          // adjacent, 8-byte aligned: one 64-bit atomic reserves both (pass B)
  u32 and_hi, or_hi, total, res_above, res_cnt;  // and/or: of b0 keys
  int res_bin;
  u32 gb_sel, gb_cand;        // pass B: this CTA's first slots in the leader's S.sel / S.cand
  u32 tot_sel;                // TOPK_HM: entries pass B sends to the leader's S.sel (all CTAs)
  u32 ctot[16];               // reduce-scatter merge: every CTA's merged chunk total (cluster rank order)
  u64 base;                   // pass B: this tile's reservation (n_cand << 32 | n_sel before it)
  u64 cmin, cmax;             // sort: composite range of the selected entries
  u64 thr;                    // the k-th composite (bin b0 entries with C >= thr are selected)
  u32 uscan[4 * 32];          // TOPK_PRUN pass B: per (unroll slot, warp) packed counts sel | cand << 16
};
// host side reserves TOPK_SMEM_BASE = 8*KMAX + 8*CAP + 8*NBINS + 1024 bytes
static_assert(sizeof(TopkSmem) <= TOPK_SMEM_BASE, "smem layout");
// n_sel / n_cand form one 8-byte aligned word: every member before them is a multiple of 8 bytes long
static_assert((8 * TOPK_KMAX + 8 * TOPK_CAP + 8 * TOPK_NBINS + 4 * 32) % 8 == 0, "n_sel / n_cand: one 64-bit word");

// ------------------------------------------------------------------------------------------
// shared-memory address helpers (smem_u32: common.cuh); leader buffers are addressed in the shared::cluster window
DSV4_DEVICE u32 lanemask_lt() {
  u32 m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

#if TOPK_CLUSTER > 1
#define TOPK_SPACE "shared::cluster"
DSV4_DEVICE u32 cl_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
DSV4_DEVICE u32 cl_map(u32 a, u32 rank) {
  u32 r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
DSV4_DEVICE void cl_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
#else
#define TOPK_SPACE "shared"
DSV4_DEVICE u32 cl_rank() { return 0; }
DSV4_DEVICE u32 cl_map(u32 a, u32) { return a; }
DSV4_DEVICE void cl_sync() { __syncthreads(); }
#endif

DSV4_DEVICE void sp_st64(u32 a, u64 v) {
  asm volatile("st." TOPK_SPACE ".u64 [%0], %1;" :: "r"(a), "l"(v) : "memory");
}
DSV4_DEVICE u32 sp_add(u32 a, u32 v) {
  u32 old;
  asm volatile("atom." TOPK_SPACE ".add.u32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
  return old;
}
DSV4_DEVICE u32 sp_ld32(u32 a) {
  u32 v;
  asm volatile("ld." TOPK_SPACE ".u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
DSV4_DEVICE void sp_st32(u32 a, u32 v) { asm volatile("st." TOPK_SPACE ".u32 [%0], %1;" :: "r"(a), "r"(v) : "memory"); }
DSV4_DEVICE u64 sp_add64(u32 a, u64 v) {
  u64 old;
  asm volatile("atom." TOPK_SPACE ".add.u64 %0, [%1], %2;" : "=l"(old) : "r"(a), "l"(v) : "memory");
  return old;
}
// TOPK_BPT consecutive histogram words at a (aligned to 4 * TOPK_BPT bytes), in one or two vector loads
DSV4_DEVICE void sp_ld_bins(u32 a, u32 (&v)[TOPK_BPT]) {
#if TOPK_BPT == 2
  asm volatile("ld." TOPK_SPACE ".v2.u32 {%0,%1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "r"(a));
#else
#pragma unroll
  for (int q = 0; q < TOPK_BPT; q += 4)
    asm volatile("ld." TOPK_SPACE ".v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v[q]), "=r"(v[q + 1]), "=r"(v[q + 2]), "=r"(v[q + 3]) : "r"(a + 4u * q));
#endif
}
DSV4_DEVICE void sp_and(u32 a, u32 v) {
  u32 old;
  asm volatile("atom." TOPK_SPACE ".and.b32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
}
DSV4_DEVICE void sp_or(u32 a, u32 v) {
  u32 old;
  asm volatile("atom." TOPK_SPACE ".or.b32 %0, [%1], %2;" : "=r"(old) : "r"(a), "r"(v) : "memory");
}

// ------------------------------------------------------------------------------------------
// keys
// bucket of canonical fp32 bits u (-0.0 already +0.0): top 11 bits of the order-preserving fp16
// code of the value (monotone non-decreasing in key32).
DSV4_DEVICE u32 bucket_of(u32 u) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(__uint_as_float(u)));
  u32 hh = h;
  hh = (hh & 0x8000u) ? (~hh & 0xFFFFu) : (hh | 0x8000u);
  return hh >> 5;
}
// fp32 bits -> (valid, key32, bucket). key32: order-preserving, -0.0 == +0.0.
DSV4_DEVICE u32 key_of(u32 u) {
  u = (u == 0x80000000u) ? 0u : u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
DSV4_DEVICE void decode(u32 u, bool in_range, bool& valid, u32& key, u32& bucket) {
  valid = in_range && ((u & 0x7FFFFFFFu) <= 0x7F800000u) && (u != 0xFF800000u);
  key = key_of(u);
  bucket = bucket_of((u == 0x80000000u) ? 0u : u);
}
// inverse of key32 (canonical fp32 bits)
DSV4_DEVICE u32 key_bits(u32 key) { return (key & 0x80000000u) ? (key ^ 0x80000000u) : ~key; }

// one group of 4 consecutive positions 4g..4g+3 (all-NaN bits when the group is not ours)
DSV4_DEVICE void load_group(const float* __restrict__ rowp, int g, bool mine, int lo, int hi, u32 w[4]) {
#if TOPK_VEC
  if (mine) {
    const u32x4 v = ld_global_nc_v4(rowp + 4 * (i64)g);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else {
    w[0] = w[1] = w[2] = w[3] = 0xFFFFFFFFu;
  }
#else
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int p = 4 * g + j;
    w[j] = (mine && p >= lo && p < hi) ? __float_as_uint(__ldg(rowp + p)) : 0xFFFFFFFFu;
  }
#endif
}

// A tile: TOPK_UNROLL groups per thread, groups g0 + u * THREADS + tid.
DSV4_DEVICE void tile_load(const float* __restrict__ rowp, int g0, int ghi, int lo, int hi, u32 (&w)[TOPK_UNROLL][4]) {
#pragma unroll
  for (int u = 0; u < TOPK_UNROLL; ++u) {
    const int g = g0 + u * TOPK_THREADS + (int)threadIdx.x;
    load_group(rowp, g, g < ghi, lo, hi, w[u]);
  }
}
// f(key, pos, bucket, valid, slot) for every slot (0..15) of the tile, by every thread (so f may use
// full-warp votes)
template <typename F>
DSV4_DEVICE void tile_visit(const u32 (&w)[TOPK_UNROLL][4], int g0, int ghi, int lo, int hi, F&& f) {
#pragma unroll
  for (int u = 0; u < TOPK_UNROLL; ++u) {
    const int g = g0 + u * TOPK_THREADS + (int)threadIdx.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int p = 4 * g + j;
      bool valid;
      u32 key, bucket;
      decode(w[u][j], g < ghi && p >= lo && p < hi, valid, key, bucket);
      f(key, p, bucket, valid, 4 * u + j);
    }
  }
}
#if TOPK_BC
// TOPK_BC: bc[s / 2] holds slot s's code (bucket + 1 if selectable, else 0) in its (s & 1) half
DSV4_DEVICE void tile_codes(const u32 (&w)[TOPK_UNROLL][4], int g0, int ghi, int lo, int hi, u32 (&bc)[2 * TOPK_UNROLL]) {
#pragma unroll
  for (int q = 0; q < 2 * TOPK_UNROLL; ++q) bc[q] = 0u;
  tile_visit(w, g0, ghi, lo, hi, [&](u32, int, u32 bucket, bool valid, int s) {
    bc[s >> 1] |= (valid ? bucket + 1u : 0u) << (16 * (s & 1));
  });
}
// tile_visit from the codes: f(key, pos, bucket, valid, slot) as tile_visit gives them (key from the bits)
template <typename F>
DSV4_DEVICE void tile_visit_bc(const u32 (&bc)[2 * TOPK_UNROLL], const u32 (&w)[TOPK_UNROLL][4], int g0, F&& f) {
#pragma unroll
  for (int u = 0; u < TOPK_UNROLL; ++u) {
    const int g = g0 + u * TOPK_THREADS + (int)threadIdx.x;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int sl = 4 * u + j;
      const u32 code = (bc[sl >> 1] >> (16 * (sl & 1))) & 0xFFFFu;
      f(key_of(w[u][j]), 4 * g + j, code - 1u, code != 0u, sl);
    }
  }
}
#define TOPK_VISIT(w, bc, g0, ghi, lo, hi, ...) tile_visit_bc(bc, w, g0, __VA_ARGS__)
#else
#define TOPK_VISIT(w, bc, g0, ghi, lo, hi, ...) tile_visit(w, g0, ghi, lo, hi, __VA_ARGS__)
#endif
// Visit groups [glo, ghi) tile by tile (block-uniform trip count).
template <typename F>
DSV4_DEVICE void scan_groups(const float* __restrict__ rowp, int glo, int ghi, int lo, int hi, F&& f) {
  for (int g0 = glo; g0 < ghi; g0 += TOPK_TILE) {
    u32 w[TOPK_UNROLL][4];
    tile_load(rowp, g0, ghi, lo, hi, w);
    tile_visit(w, g0, ghi, lo, hi, f);
  }
}

// ------------------------------------------------------------------------------------------
// warp-level helpers (call with the full warp)
DSV4_DEVICE void hist_add(u32* hist, u32 bin, bool pred) {
  const u32 lane = threadIdx.x & 31;
  const u32 b0 = __shfl_sync(FULL, bin, 0);
  if (__all_sync(FULL, pred && bin == b0)) {  // whole warp in one bin (ties, constant rows)
    if (lane == 0) atomicAdd(&hist[b0], 32u);
  } else if (pred) {
    atomicAdd(&hist[bin], 1u);
  }
}

// append v to this CTA's shared buffer buf (counter cnt, capacity cap): one atomic per warp
DSV4_DEVICE void append(u64* buf, u32* cnt, u64 v, bool pred, u32 cap) {
  const u32 m = __ballot_sync(FULL, pred);
  if (m == 0u) return;
  const u32 lane = threadIdx.x & 31;
  const u32 src = __ffs(m) - 1;
  u32 base = 0;
  if (lane == src) base = atomicAdd(cnt, (u32)__popc(m));
  base = __shfl_sync(FULL, base, src);
  if (pred) {
    const u32 slot = base + __popc(m & lanemask_lt());
    if (slot < cap) buf[slot] = v;
  }
}

// inclusive prefix sum over the warp's lanes (full warp)
DSV4_DEVICE u32 warp_incl_scan(u32 v) {
  const u32 lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(FULL, v, o);
    if (lane >= (u32)o) v += y;
  }
  return v;
}

DSV4_DEVICE u64 shfl_xor64(u64 v, int m) {
  const u32 lo = __shfl_xor_sync(FULL, (u32)v, m);
  const u32 hi = __shfl_xor_sync(FULL, (u32)(v >> 32), m);
  return ((u64)hi << 32) | lo;
}

// ------------------------------------------------------------------------------------------
// pass B, one tile: the tile's winners (bucket > b0; with all_b0 also bucket == b0) and, with
// store_cand, its candidates (bucket == b0) are compacted into the leader's buffers S.sel / S.cand
// (shared::cluster window addresses lsel / lcand, counters n_sel | n_cand << 32 at lcnt): a 16-bit
// mask per thread and stream, a block-wide exclusive scan of the packed counts (sel | cand << 16,
// <= 16384 each per tile), ONE 64-bit reservation per tile and CTA, then every thread stores its
// entries. a_and / a_or accumulate the AND / OR of the candidates' key32. Contains barriers.
DSV4_DEVICE void tile_compact(TopkSmem& S, const u32 (&w)[TOPK_UNROLL][4], const u32 (&bc)[2 * TOPK_UNROLL], int g0,
                             int ghi, int lo, int hi, int b0, bool all_b0, bool store_cand, u32 lsel, u32 lcand,
                             u32 lcnt, u32& a_and, u32& a_or, bool known) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  u32 msel = 0u, mcand = 0u;
  TOPK_VISIT(w, bc, g0, ghi, lo, hi, [&](u32 key, int, u32 bucket, bool valid, int s) {
    const int bk = (int)bucket;
    const bool to_sel = valid && (bk > b0 || (all_b0 && bk == b0));
    const bool to_cand = valid && !all_b0 && bk == b0;
    msel |= (u32)to_sel << s;
    mcand |= (u32)to_cand << s;
    if (to_cand) {
      a_and &= key;
      a_or |= key;
    }
  });
  if (!store_cand) mcand = 0u;
#if TOPK_PRUN_ON
  if (known) {  // block-uniform: slots in (unroll u, thread, position) order == ascending position
    // per-u counts (<= 4 each) in 8-bit fields: warp sums <= 128 stay in their field
    u32 ps = 0u, pc = 0u;
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
      ps |= (u32)__popc((msel >> (4 * u)) & 0xFu) << (8 * u);
      pc |= (u32)__popc((mcand >> (4 * u)) & 0xFu) << (8 * u);
    }
    const u32 is = warp_incl_scan(ps), ic = warp_incl_scan(pc);
    if (lane == 31) {
#pragma unroll
      for (int u = 0; u < TOPK_UNROLL; ++u)
        S.uscan[u * TOPK_NWARPS + warp] = ((is >> (8 * u)) & 0xFFu) | (((ic >> (8 * u)) & 0xFFu) << 16);
    }
    __syncthreads();
    // every warp: the exclusive prefix of the (u, warp) totals in u-major order (sel | cand << 16, block sums
    // <= 4 * 4 * THREADS < 2^16)
    u32 off = 0u, bs[TOPK_UNROLL];
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
      const u32 t = (lane < TOPK_NWARPS) ? S.uscan[u * TOPK_NWARPS + lane] : 0u;
      const u32 e = warp_incl_scan(t);
      bs[u] = off + __shfl_sync(FULL, e - t, warp);
      off += __shfl_sync(FULL, e, 31);
    }
    const u32 es = is - ps, ec = ic - pc;  // this thread's exclusive prefix in its warp, per field
    u32 os[TOPK_UNROLL], oc[TOPK_UNROLL];
#pragma unroll
    for (int u = 0; u < TOPK_UNROLL; ++u) {
      os[u] = S.gb_sel + (bs[u] & 0xFFFFu) + ((es >> (8 * u)) & 0xFFu);
      oc[u] = S.gb_cand + (bs[u] >> 16) + ((ec >> (8 * u)) & 0xFFu);
    }
    TOPK_VISIT(w, bc, g0, ghi, lo, hi, [&](u32 key, int p, u32, bool, int s) {
      const u64 comp = ((u64)key << 32) | (u32)(hi - 1 - p);
      if ((msel >> s) & 1u) {
        if (os[s >> 2] < (u32)TOPK_KMAX) sp_st64(lsel + 8u * os[s >> 2], comp);
        ++os[s >> 2];
      }
      if ((mcand >> s) & 1u) {
        if (oc[s >> 2] < (u32)TOPK_CAP) sp_st64(lcand + 8u * oc[s >> 2], comp);
        ++oc[s >> 2];
      }
    });
    return;
  }
#endif
  const u32 v = (u32)__popc(msel) | ((u32)__popc(mcand) << 16);
  const u32 incl = warp_incl_scan(v);
  if (lane == 31) S.scan[warp] = incl;
  __syncthreads();
  const u32 t = (lane < TOPK_NWARPS) ? S.scan[lane] : 0u;
  const u32 wi = warp_incl_scan(t);
  const u32 wex = __shfl_sync(FULL, wi - t, warp), tot = __shfl_sync(FULL, wi, 31);
  u64 base;
  if (known) {  // block-uniform. This CTA's first slots came from the merged histograms (S.gb_*, thread 0, before
    base = ((u64)S.gb_cand << 32) | S.gb_sel;  // the barrier above): no reservation, no second barrier
  } else {
    if (tid == 0) S.base = tot ? sp_add64(lcnt, ((u64)(tot >> 16) << 32) | (tot & 0xFFFFu)) : 0ull;
    __syncthreads();  // S.base published; every warp has read S.scan
    base = S.base;
  }
  const u32 ex = wex + incl - v;
  u32 os = (u32)base + (ex & 0xFFFFu), oc = (u32)(base >> 32) + (ex >> 16);
  TOPK_VISIT(w, bc, g0, ghi, lo, hi, [&](u32 key, int p, u32, bool, int s) {
    const u64 comp = ((u64)key << 32) | (u32)(hi - 1 - p);
    if ((msel >> s) & 1u) {
      if (os < (u32)TOPK_KMAX) sp_st64(lsel + 8u * os, comp);
      ++os;
    }
    if ((mcand >> s) & 1u) {
      if (oc < (u32)TOPK_CAP) sp_st64(lcand + 8u * oc, comp);
      ++oc;
    }
  });
}

// pass B over this CTA's slice (groups [my_lo, my_hi)) into the leader's buffers (rank 0 of the
// cluster; the CTA itself without one), then the AND / OR of the candidates' keys into the leader's
// words (shared atomics, then one DSMEM atomic each). RESIDENT: w holds the slice (one tile) -> the
// block-scan compaction (tile_compact) straight into the leader's buffers. Streamed (two passes, the
// second mostly from L1 / L2): warp-aggregated appends to this CTA's own buffers (no barrier per tile,
// so the warps' re-reads overlap), then one reservation per buffer at the leader and a copy (the
// per-tile block scan made the streamed pass B slower on the H200, job topk7-02: [64, 65536] 26.8 us
// vs 24.6 with these appends in topk-02). Contains barriers.
template <bool RESIDENT>
DSV4_DEVICE void pass_b(TopkSmem& S, const float* __restrict__ rowp, u32 (&w)[TOPK_UNROLL][4],
                        const u32 (&bc)[2 * TOPK_UNROLL], int my_lo, int my_hi, int lo, int hi, int b0, bool all_b0,
                        bool store_cand, u32 rank, bool andor = true, bool known = false) {
  const int tid = threadIdx.x;
  u32 a_and = 0xFFFFFFFFu, a_or = 0u;
  if (RESIDENT) {
    const u32 lsel = cl_map(smem_u32(S.sel), 0), lcand = cl_map(smem_u32(S.cand), 0);
    tile_compact(S, w, bc, my_lo, my_hi, lo, hi, b0, all_b0, store_cand, lsel, lcand, cl_map(smem_u32(&S.n_sel), 0),
                 a_and, a_or, known);
  } else {
    scan_groups(rowp, my_lo, my_hi, lo, hi, [&](u32 key, int p, u32 bucket, bool valid, int) {
      const int bk = (int)bucket;
      const bool to_sel = valid && (bk > b0 || (all_b0 && bk == b0));
      const bool to_cand = valid && !all_b0 && bk == b0;
      if (!__any_sync(FULL, to_sel || to_cand)) return;  // common case: nothing here
      const u64 comp = ((u64)key << 32) | (u32)(hi - 1 - p);
      append(S.sel, &S.n_sel, comp, to_sel, TOPK_KMAX);
      if (store_cand) append(S.cand, &S.n_cand, comp, to_cand, TOPK_CAP);
      if (to_cand) {
        a_and &= key;
        a_or |= key;
      }
    });
  }
  if (!all_b0 && andor) {  // block-uniform (!andor: the leader takes the rank path, which needs no AND / OR)
    const u32 ah = __reduce_and_sync(FULL, a_and), oh = __reduce_or_sync(FULL, a_or);
    if ((tid & 31) == 0 && ah != 0xFFFFFFFFu) atomicAnd(&S.and_hi, ah);
    if ((tid & 31) == 0 && oh != 0u) atomicOr(&S.or_hi, oh);
  }
#if TOPK_CLUSTER > 1
  __syncthreads();  // this CTA's appends and AND / OR are complete
  if (rank != 0) {
    if (tid == 0 && !all_b0 && andor) {
      if (S.and_hi != 0xFFFFFFFFu) sp_and(cl_map(smem_u32(&S.and_hi), 0), S.and_hi);
      if (S.or_hi != 0u) sp_or(cl_map(smem_u32(&S.or_hi), 0), S.or_hi);
    }
    if (!RESIDENT) {  // copy the appended entries into one reserved range of the leader's buffers
      const u32 ns = min(S.n_sel, (u32)TOPK_KMAX), nc = store_cand ? min(S.n_cand, (u32)TOPK_CAP) : 0u;
      if (tid == 0 && !known) {  // 32-bit atomics, as the leader's own appends on the same words (no mixed sizes)
        S.gb_sel = ns ? sp_add(cl_map(smem_u32(&S.n_sel), 0), ns) : 0u;
        S.gb_cand = nc ? sp_add(cl_map(smem_u32(&S.n_cand), 0), nc) : 0u;
      }  // known: S.gb_* were set by thread 0 from the merged histograms
      __syncthreads();
      const u32 L_sel = cl_map(smem_u32(S.sel), 0), L_cand = cl_map(smem_u32(S.cand), 0);
      const u32 bs = S.gb_sel, bc = S.gb_cand;
      for (u32 i = tid; i < ns; i += TOPK_THREADS)
        if (bs + i < (u32)TOPK_KMAX) sp_st64(L_sel + 8u * (bs + i), S.sel[i]);
      for (u32 i = tid; i < nc; i += TOPK_THREADS)
        if (bc + i < (u32)TOPK_CAP) sp_st64(L_cand + 8u * (bc + i), S.cand[i]);
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------
// warp 0 only: S.scan[0, NWARPS) (the warp totals) -> their exclusive prefix; returns the inclusive sum (the grand
// total in lane 31)
DSV4_DEVICE u32 scan_warp_totals(TopkSmem& S) {
  const int lane = threadIdx.x & 31;
  const u32 v = (lane < TOPK_NWARPS) ? S.scan[lane] : 0u;
  const u32 inc = warp_incl_scan(v);
  __syncwarp();
  if (lane < TOPK_NWARPS) S.scan[lane] = inc - v;
  return inc;
}

// Block-wide: c[j] = count of bin (NBINS-1 - (tid*BPT + j)) (bins visited from the top).
// Finds the bin d with above(d) < need <= above(d) + count(d); S.res_bin = -1 if the total is
// < need. Results in S.res_*, S.total. With seg: seg[bin] = (entries in higher bins) << 16 |
// count, both clamped to 16 bits (exact for every bin >= d: they hold < need <= 2048 entries).
// Contains barriers: call from block-uniform code.
DSV4_DEVICE void select_bin(TopkSmem& S, const u32 (&c)[TOPK_BPT], u32 need, u32* seg) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  u32 sum = 0;
#pragma unroll
  for (int j = 0; j < TOPK_BPT; ++j) sum += c[j];
  const u32 incl = warp_incl_scan(sum);
  __syncthreads();  // previous readers of S.scan / S.res_* are done
  if (lane == 31) S.scan[warp] = incl;
  if (tid == 0) S.res_bin = -1;
  __syncthreads();
  if (warp == 0) {
    const u32 t = scan_warp_totals(S);
    if (lane == 31) S.total = t;
  }
  __syncthreads();
  u32 acc = S.scan[warp] + incl - sum;
#pragma unroll
  for (int j = 0; j < TOPK_BPT; ++j) {
    if (acc < need && acc + c[j] >= need) {
      S.res_bin = TOPK_NBINS - 1 - (tid * TOPK_BPT + j);
      S.res_above = acc;
      S.res_cnt = c[j];
    }
    if (seg) seg[TOPK_NBINS - 1 - (tid * TOPK_BPT + j)] = (min(acc, 0xFFFFu) << 16) | min(c[j], 0xFFFFu);
    acc += c[j];
  }
  __syncthreads();
}

// thread 0: the CTA's append counters, AND / OR words and sort range to their initial values
DSV4_DEVICE void init_counters(TopkSmem& S) {
  if (threadIdx.x == 0) {
    S.n_sel = 0u;
    S.n_cand = 0u;
    S.and_hi = 0xFFFFFFFFu;
    S.or_hi = 0u;
    S.cmin = ~0ull;
    S.cmax = 0ull;
  }
}

DSV4_DEVICE void load_local_bins(const TopkSmem& S, u32 (&c)[TOPK_BPT]) {
#pragma unroll
  for (int j = 0; j < TOPK_BPT; ++j) c[j] = S.hist[TOPK_NBINS - 1 - (threadIdx.x * TOPK_BPT + j)];
}

// rank path of pin_threshold (see there): warp w ranks the candidates RB at a time (in registers; batches w,
// w + NWARPS, ... of RB); its lanes stream the list 32 candidates per shared load (one load per lane and chunk
// serves the RB candidates), then the RB warp sums by a reduce-scatter of 16-bit count pairs (counts <= n_c <=
// 512): RB / 2 words per lane, halved by xor-16 (-8, -4) exchanges, then a butterfly over the other lanes; lane l
// ends with the pair of word w(l) -> candidates 2 w + (l & 1). Selected (rank < need0): prun -> a flag bit in
// S.hist, else S.sel[above0 + rank]; the k-th composite -> S.thr. Warp-synchronous, no block barrier.
template <int RB>
DSV4_DEVICE void rank_cands(TopkSmem& S, int n_c, u32 need0, u32 above0, bool prun) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  for (int i0 = warp * RB; i0 < n_c; i0 += TOPK_NWARPS * RB) {  // warp-uniform
    u64 ci[RB];
    u32 cnt[RB];
#pragma unroll
    for (int t = 0; t < RB; ++t) {
      ci[t] = (i0 + t < n_c) ? S.cand[i0 + t] : ~0ull;
      cnt[t] = 0u;
    }
    for (int j0 = 0; j0 < n_c; j0 += 32) {  // warp-uniform
      const u64 v = (j0 + lane < n_c) ? S.cand[j0 + lane] : 0ull;
#pragma unroll
      for (int t = 0; t < RB; ++t) cnt[t] += (v > ci[t]) ? 1u : 0u;
    }
    u32 pk[RB / 2];
#pragma unroll
    for (int q = 0; q < RB / 2; ++q) pk[q] = cnt[2 * q] | (cnt[2 * q + 1] << 16);
    const bool h16 = (lane & 16) != 0, h8 = (lane & 8) != 0, h4 = (lane & 4) != 0;
    u32 z;
    int wsel;
    bool act;
    if constexpr (RB == 4) {  // words 0, 1
      z = (h16 ? pk[1] : pk[0]) + __shfl_xor_sync(FULL, h16 ? pk[0] : pk[1], 16);
      z += __shfl_xor_sync(FULL, z, 8);
      z += __shfl_xor_sync(FULL, z, 4);
      wsel = h16 ? 1 : 0;
      act = (lane & 14) == 0;
    } else if constexpr (RB == 8) {  // words 0..3
      const u32 k0 = (h16 ? pk[2] : pk[0]) + __shfl_xor_sync(FULL, h16 ? pk[0] : pk[2], 16);
      const u32 k1 = (h16 ? pk[3] : pk[1]) + __shfl_xor_sync(FULL, h16 ? pk[1] : pk[3], 16);
      z = (h8 ? k1 : k0) + __shfl_xor_sync(FULL, h8 ? k0 : k1, 8);
      z += __shfl_xor_sync(FULL, z, 4);
      wsel = 2 * (h16 ? 1 : 0) + (h8 ? 1 : 0);
      act = (lane & 6) == 0;
    } else {  // RB == 16: words 0..7
      static_assert(RB == 16, "RB: 4, 8 or 16");
      u32 k4[4], k2[2];
#pragma unroll
      for (int q = 0; q < 4; ++q)
        k4[q] = (h16 ? pk[4 + q] : pk[q]) + __shfl_xor_sync(FULL, h16 ? pk[q] : pk[4 + q], 16);
#pragma unroll
      for (int q = 0; q < 2; ++q)
        k2[q] = (h8 ? k4[2 + q] : k4[q]) + __shfl_xor_sync(FULL, h8 ? k4[q] : k4[2 + q], 8);
      z = (h4 ? k2[1] : k2[0]) + __shfl_xor_sync(FULL, h4 ? k2[0] : k2[1], 4);
      wsel = 4 * (h16 ? 1 : 0) + 2 * (h8 ? 1 : 0) + (h4 ? 1 : 0);
      act = (lane & 2) == 0;
    }
    z += __shfl_xor_sync(FULL, z, 2);
    z += __shfl_xor_sync(FULL, z, 1);
    const int t = 2 * wsel + (lane & 1);
    const u32 r = (lane & 1) ? (z >> 16) : (z & 0xFFFFu);
    if (act && i0 + t < n_c && r < need0) {
      const u64 cv = S.cand[i0 + t];
      if (prun)
        atomicOr(&S.hist[(i0 + t) >> 5], 1u << ((i0 + t) & 31));
      else
        S.sel[above0 + r] = cv;  // winners: exactly above0 from bins above b0
      if (r == need0 - 1u) S.thr = cv;  // the k-th composite: the threshold
    }
  }
}

// ------------------------------------------------------------------------------------------
// Leader of a row, bin b0 not taken whole (!all_b0): S.cand holds the candidates of bin b0 (S.n_cand, if
// store_cand; else the row is re-read), S.and_hi / S.or_hi the AND / OR of their keys. Pins the
// threshold inside b0: S.thr = the smallest selected composite bound ({b0 entries with C >= S.thr} are
// the selected ones), and the selected b0 entries join S.sel (rank path: at S.sel[above0 + rank];
// radix path: appended at S.n_sel). Returns the count placed by the rank path. Block-uniform control
// flow (contains barriers).
DSV4_DEVICE u32 pin_threshold(TopkSmem& S, const float* __restrict__ rowp, int lo, int hi, int b0, u32 above0,
                              bool store_cand, u32 kk0, bool prun) {
  const int tid = threadIdx.x;
  const int g_lo = lo >> 2, g_hi = (hi + 3) >> 2;
  u32 n_placed = 0;
  {
    const u32 need0 = kk0 - above0;
    const int n_c = store_cand ? (int)min(S.n_cand, (u32)TOPK_CAP) : 0;
    if (store_cand && (u32)n_c * (u32)n_c <= (u32)(TOPK_RANKW * TOPK_THREADS)) {
      // ---- rank path: rank(i) = #{j : cand[j] > cand[i]} (rank_cands)
      // prun (block-uniform): S.cand is in position order; the selected ones keep it (flag bits in S.hist, free
      // here: n_c <= TOPK_CAP bits), then S.sel[above0 + j] = the j-th selected by position
      if (prun) {
        for (int i = tid; i < (n_c + 31) / 32; i += TOPK_THREADS) S.hist[i] = 0u;
        __syncthreads();
      }
#if TOPK_THREADS >= 1024
      rank_cands<4>(S, n_c, need0, above0, prun);  // 64 registers
#elif TOPK_RES
      // 16 per warp and round where 8 would take two rounds (job topk10-03, [1, 129280] ~180 candidates: 11.94 us
      // vs 12.10 per call; 16 everywhere: +0.35 us at [128, 8192] ~30 candidates)
      if (n_c > TOPK_NWARPS * 8)
        rank_cands<16>(S, n_c, need0, above0, prun);
      else
        rank_cands<8>(S, n_c, need0, above0, prun);
#else
      rank_cands<8>(S, n_c, need0, above0, prun);  // 2 CTAs per SM: <= 64 registers
#endif
      if (prun) {  // block-uniform
        __syncthreads();
        for (int i = tid; i < n_c; i += TOPK_THREADS) {
          const u32 wd = S.hist[i >> 5];
          if ((wd >> (i & 31)) & 1u) {
            u32 j = (u32)__popc(wd & ((1u << (i & 31)) - 1u));
            for (int q = 0; q < (i >> 5); ++q) j += (u32)__popc(S.hist[q]);
            S.sel[above0 + j] = S.cand[i];
          }
        }
      }
      n_placed = need0;
    } else {
      // ---- radix path: 11-bit digits of C from the highest bit where the candidates differ
      // candidates agree on every composite bit >= hib: key bits above the highest differing
      // key bit; if all keys are equal (ties), the index part has < 32 - clz(hi - 1 - lo) bits.
      u32 c[TOPK_BPT];
      const u32 kdiff = S.and_hi ^ S.or_hi;
      int hib = kdiff ? 64 - __clz((int)kdiff) : 32 - __clz((int)(hi - 1 - lo));
      u64 prefix = (hib >= 64) ? 0ull : ((((u64)S.and_hi) << 32) & (~0ull << hib));
      u32 need = need0;
      // visit every candidate: f(comp, pred), block-uniform trip count
      auto for_each_cand = [&](auto&& f) {
        if (store_cand) {
          for (int base = 0; base < n_c; base += TOPK_THREADS) {
            const int i = base + tid;
            const bool pr = i < n_c;
            f(pr ? S.cand[i] : 0ull, pr);
          }
        } else {  // bin b0 overflowed the buffer: re-read the whole row, keep bucket == b0
          scan_groups(rowp, g_lo, g_hi, lo, hi, [&](u32 key, int p, u32 bucket, bool valid, int) {
            f(((u64)key << 32) | (u32)(hi - 1 - p), valid && (int)bucket == b0);
          });
        }
      };
      for (int it = 0; it < 8; ++it) {  // block-uniform; terminates: composites are unique
        const int sh = hib > 11 ? hib - 11 : 0;
        const u32 dmask = (1u << (hib - sh)) - 1u;
        const u64 pmask = (hib >= 64) ? 0ull : (~0ull << hib);
        for (int i = tid; i < TOPK_NBINS; i += TOPK_THREADS) S.hist[i] = 0u;
        __syncthreads();
        for_each_cand([&](u64 cv, bool pr) {
          const bool m = pr && ((cv ^ prefix) & pmask) == 0ull;
          hist_add(S.hist, (u32)(cv >> sh) & dmask, m);
        });
        __syncthreads();
        load_local_bins(S, c);
        select_bin(S, c, need, nullptr);
        const u32 d = (u32)S.res_bin, ab = S.res_above, cn = S.res_cnt;
        const bool fin = (cn == need - ab);
        for_each_cand([&](u64 cv, bool pr) {
          const bool m = pr && ((cv ^ prefix) & pmask) == 0ull;
          const u32 dg = (u32)(cv >> sh) & dmask;
          append(S.sel, &S.n_sel, cv, m && (dg > d || (fin && dg == d)), TOPK_KMAX);
        });
        need -= ab;
        prefix |= (u64)d << sh;
        hib = sh;
        __syncthreads();
        if (fin) break;
      }
      if (tid == 0) S.thr = prefix;  // {C >= prefix} is the selected part of bin b0 (low bits zero)
    }
  }
  __syncthreads();
  return n_placed;
}

// position p of a row -> the output index (block_table mapped: -1 for entries outside [0, num_blocks))
DSV4_DEVICE i32 map_pos(int p, const i32* __restrict__ bt, i32 has_bt, i32 block_size, i32 num_blocks) {
  if (!has_bt) return p;
  const int blk = p / block_size;
  const i32 e = __ldg(bt + blk);
  const i64 v = (i64)e * block_size + (p - blk * block_size);
  return (e >= 0 && e < num_blocks && v <= 0x7FFFFFFFll) ? (i32)v : -1;  // bad entry: -1
}

// ------------------------------------------------------------------------------------------
// Leader of a row: S.sel holds the winners (bucket > b0; S.n_sel of them), S.cand the candidates
// of bin b0 (S.n_cand, if store_cand), S.and_hi / S.or_hi the AND / OR of the b0 keys. Pins the
// threshold inside b0 (the selected b0 entries join S.sel), orders the selected composites
// (sorted: by score; else by position) and writes the row. S.cmin / S.cmax must be ~0 / 0 on entry.
// Block-uniform control flow (contains barriers).
DSV4_DEVICE void finish_row(TopkSmem& S, const float* __restrict__ rowp, i64 row, int lo, int hi, int b0,
                            u32 above0, bool all_b0, bool store_cand, i32 k, i32 sorted,
                            const i32* __restrict__ block_table, i64 bt_stride, i32 block_size, i32 rows_per_seq,
                            i32 has_bt, i32 num_blocks, i32* __restrict__ out_idx, float* __restrict__ out_score) {
  const int tid = threadIdx.x;
  const u32 kk0 = (u32)k;
  const bool prun = TOPK_PRUN_ON && !sorted;  // pass B stored in position order (TOPK_PRUN)
  const u32 n_placed = all_b0 ? 0u : pin_threshold(S, rowp, lo, hi, b0, above0, store_cand, kk0, prun);
  const u32 n_tot = min(S.n_sel + n_placed, kk0);  // the selected composites: S.sel[0, n_tot)
  // TOPK_PRUN: S.sel[0, n_run) (the winners; all selected when all_b0) and S.sel[n_run, n_tot) (the rank path's
  // selected candidates) are both in ascending position; the radix / overflow path appended: use the bitmap
  const bool runs = prun && (all_b0 || n_placed > 0u);
  const u32 n_run = n_tot - n_placed;

  // ---- unsorted (the default of the op): ascending position order, a function of the selected set
  // only (so bitwise the same for every launch configuration and kernel). A bitmap of the row's
  // positions over the free S.cand / S.hist / S.seg words (rows of <= TOPK_BMW * 32 positions): one
  // bit per selected entry, then per word the count of selected entries before it (warp scans over
  // conflict-free word chunks + one scan of the warp totals); every entry's output slot is that count
  // plus the set bits below its own. Longer rows: the sort below
  // on (position, key) composites (swapped halves: descending hi - 1 - p == ascending p).
  const u32 span = (u32)(hi - lo), nw = (span + 31u) >> 5;
  const bool by_pos = !sorted && !runs && n_tot > 1u;
  const bool do_bitmap = by_pos && nw <= (u32)TOPK_BMW;
  const bool swapped = by_pos && !do_bitmap;
  u32* __restrict__ bm = reinterpret_cast<u32*>(S.cand);                            // [nw] position bits
  unsigned short* __restrict__ wpre = reinterpret_cast<unsigned short*>(bm + TOPK_BMW);  // [nw] entries before
  if (do_bitmap) {  // block-uniform
    for (u32 i = tid; i < nw; i += TOPK_THREADS) bm[i] = 0u;
    __syncthreads();
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) {
      const u32 q = span - 1u - (u32)S.sel[i];  // p - lo
      atomicOr(&bm[q >> 5], 1u << (q & 31u));
    }
    __syncthreads();
    // warp w owns words [w * 32 * wpt, (w + 1) * 32 * wpt), lane l word w * 32 * wpt + 32 j + l (conflict-free);
    // wpre = entries before the word within its warp's chunk, S.scan[w] = entries before the chunk
    const int lane = tid & 31, warp = tid >> 5;
    const u32 wpt = (nw + TOPK_THREADS - 1) / TOPK_THREADS;
    u32 run = 0u;
    for (u32 j = 0; j < wpt; ++j) {  // warp-uniform
      const u32 wi = (u32)warp * 32u * wpt + 32u * j + (u32)lane;
      const u32 c = (wi < nw) ? (u32)__popc(bm[wi]) : 0u;
      const u32 inc = warp_incl_scan(c);
      if (wi < nw) wpre[wi] = (unsigned short)(run + inc - c);
      run += __shfl_sync(FULL, inc, 31);
    }
    if (lane == 0) S.scan[warp] = run;  // S.scan's last readers passed the barriers above
    __syncthreads();
    if (warp == 0) scan_warp_totals(S);
    __syncthreads();
  }
  if (swapped) {  // block-uniform
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) S.sel[i] = (S.sel[i] << 32) | (S.sel[i] >> 32);
    __syncthreads();
  }
  // ---- sorted: counting sort over 2048 sub-buckets of the composite range (monotone), then every
  // entry counts the larger composites of its own sub-bucket (its rank inside it)
  const bool do_sort = (sorted || swapped) && n_tot > 1u;
  if (do_sort) {  // block-uniform
    u64 mn = ~0ull, mx = 0ull;
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) {
      const u64 cv = S.sel[i];
      mn = cv < mn ? cv : mn;
      mx = cv > mx ? cv : mx;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const u64 a = shfl_xor64(mn, o), b = shfl_xor64(mx, o);
      mn = a < mn ? a : mn;
      mx = b > mx ? b : mx;
    }
    if ((tid & 31) == 0) {
      atomicMin(reinterpret_cast<unsigned long long*>(&S.cmin), (unsigned long long)mn);
      atomicMax(reinterpret_cast<unsigned long long*>(&S.cmax), (unsigned long long)mx);
    }
    for (int i = tid; i < TOPK_NBINS; i += TOPK_THREADS) S.hist[i] = 0u;
    __syncthreads();
    const u64 base = S.cmin, span = S.cmax - S.cmin;
    const int sh = (span >> 11) ? 64 - __clzll((long long)span) - 11 : 0;  // span >> sh < 2048
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) atomicAdd(&S.hist[(u32)((S.sel[i] - base) >> sh)], 1u);
    __syncthreads();
    u32 c[TOPK_BPT];
    load_local_bins(S, c);
    select_bin(S, c, n_tot, S.seg);  // seg[b] = (entries in higher sub-buckets) << 16 | count
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) {
      const u64 cv = S.sel[i];
      const u32 slot = atomicAdd(&S.seg[(u32)((cv - base) >> sh)], 0x10000u) >> 16;
      if (slot < (u32)TOPK_KMAX) S.cand[slot] = cv;
    }
    __syncthreads();  // S.sel is free from here: it receives the output order
    for (u32 i = tid; i < n_tot; i += TOPK_THREADS) {
      const u64 cv = S.cand[i];
      const u32 sg = S.seg[(u32)((cv - base) >> sh)];  // now (start + count) << 16 | count
      const u32 en = min(sg >> 16, (u32)TOPK_KMAX), st = (sg >> 16) - (sg & 0xFFFFu);
      u32 r = 0;
      for (u32 j = st; j < en; ++j) r += (S.cand[j] > cv) ? 1u : 0u;
      if (st + r < (u32)TOPK_KMAX) S.sel[st + r] = cv;
    }
    __syncthreads();
  }

  i32* __restrict__ oi = out_idx + row * (i64)k;
  float* __restrict__ os = out_score + row * (i64)k;
  const i32* __restrict__ bt = block_table + (has_bt ? (row / rows_per_seq) * bt_stride : 0);
  for (int j = tid; j < k; j += TOPK_THREADS) {
    i32 idx = -1;
    float sc = __uint_as_float(0xFF800000u);
    int slot = j;  // sorted, padding, swapped: in place; bitmap: the entry's rank by position
    if ((u32)j < n_tot) {
      u64 cv = S.sel[j];
      if (swapped) cv = (cv << 32) | (cv >> 32);
      const int p = hi - 1 - (int)(u32)cv;
      if (runs) {  // merge of the two position runs: the entries of the other run with a lower position
        const bool first = (u32)j < n_run;
        const u32 b = first ? n_run : 0u, n = first ? n_tot - n_run : n_run, L = (u32)cv;  // L = hi - 1 - p
        u32 a = 0u, e = n;  // lower position == higher L; a run in ascending position has descending L
        while (a < e) {
          const u32 m = (a + e) >> 1;
          if ((u32)S.sel[b + m] > L) a = m + 1u; else e = m;
        }
        slot = (int)((first ? (u32)j : (u32)j - n_run) + a);
      }
      if (do_bitmap) {
        const u32 q = (u32)(p - lo);
        const u32 wd = q >> 5, chunk = 32u * ((nw + TOPK_THREADS - 1) / TOPK_THREADS);
        slot = (int)(S.scan[wd / chunk] + wpre[wd]) + __popc(bm[wd] & ((1u << (q & 31u)) - 1u));
      }
      const u32 u = key_bits((u32)(cv >> 32));
      sc = (u == 0u) ? __ldg(rowp + p) : __uint_as_float(u);  // +-0.0: exact bits from memory
      idx = map_pos(p, bt, has_bt, block_size, num_blocks);
    }
    oi[slot] = idx;
    os[slot] = sc;
  }
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS, TOPK_MINB) topk_kernel(
    const float* __restrict__ logits,      // [rows, >= ncols], row stride row_stride (elements)
    i64 row_stride, i32 ncols,
    const i32* __restrict__ lengths,       // [rows] end of the valid range (clamped to [0, ncols])
    const i32* __restrict__ starts,        // [rows] start of the valid range, or unused
    i32 has_starts,
    const i32* __restrict__ block_table,   // [B, max_blocks] or unused
    i64 bt_stride, i32 block_size, i32 rows_per_seq, i32 has_bt,
    i32 num_blocks,                        // block_table entries outside [0, num_blocks) map to -1
    i32 k,                                 // 1..2048
    i32 sorted,                            // 0: the same set, unspecified order
    i32 rows,
    i32* __restrict__ out_idx,             // [rows, k]
    float* __restrict__ out_score) {       // [rows, k]
  extern __shared__ __align__(16) unsigned char smem_raw[];
  TopkSmem& S = *reinterpret_cast<TopkSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31;
  const i64 row = blockIdx.x / TOPK_CLUSTER;
  const u32 rank = cl_rank();
  if (row >= rows) return;  // cluster-uniform (whole clusters only): harmless over-launch guard
  // programmatic dependent launch (a no-op unless the launch carries the PDL attribute, kernels_cuda/topk.py):
  // let the next PDL kernel on the stream be scheduled now; nothing here touches global memory before the
  // preceding grid has completed and flushed its writes (the logits may be its output)
  asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory");

  int hi = lengths[row];
  hi = hi < 0 ? 0 : (hi > ncols ? ncols : hi);
  int lo = has_starts ? starts[row] : 0;
  lo = lo < 0 ? 0 : (lo > hi ? hi : lo);
  const float* __restrict__ rowp = logits + row * row_stride;
  const u32 kk0 = (u32)k;

  // this CTA's slice of the row, in groups of 4 positions
  const int g_lo = lo >> 2, g_hi = (hi + 3) >> 2, ng = g_hi - g_lo;
  const int per = (ng + TOPK_CLUSTER - 1) / TOPK_CLUSTER;
  const int my_lo = g_lo + min((int)rank * per, ng);
  const int my_hi = g_lo + min((int)rank * per + per, ng);

  for (int i = tid; i < TOPK_NBINS; i += TOPK_THREADS) S.hist[i] = 0u;
  init_counters(S);
#if TOPK_RES
  u32 w[TOPK_UNROLL][4];  // the whole slice (host guarantees my_hi - my_lo <= TOPK_TILE)
  u32 bc[2 * TOPK_UNROLL];  // TOPK_BC: the slots' bucket codes (else unused)
  tile_load(rowp, my_lo, my_hi, lo, hi, w);
#endif
  __syncthreads();
#if TOPK_BC
  tile_codes(w, my_lo, my_hi, lo, hi, bc);
#endif

  int b0;
  u32 above0, cnt0;
  // ---- pass A: bucket histogram of this slice
#if TOPK_RES
  TOPK_VISIT(w, bc, my_lo, my_hi, lo, hi, [&](u32, int, u32 bucket, bool valid, int) {
    hist_add(S.hist, bucket, valid);
  });
#else
  scan_groups(rowp, my_lo, my_hi, lo, hi, [&](u32, int, u32 bucket, bool valid, int) {
    hist_add(S.hist, bucket, valid);
  });
#endif
#if TOPK_HM && TOPK_CLUSTER > 1
  // coarse bins of this CTA (32 buckets each: the top 6 bits of the fp16 code), for the peers to gather
  __syncthreads();  // this CTA's histogram complete
  {
    constexpr int TPC = 32 / TOPK_BPT;  // threads per coarse bin
    u32 sum = 0u;
#pragma unroll
    for (int j = 0; j < TOPK_BPT; ++j) sum += S.hist[tid * TOPK_BPT + j];
#pragma unroll
    for (int o = 1; o < TPC; o <<= 1) sum += __shfl_xor_sync(FULL, sum, o);
    if ((tid & (TPC - 1)) == 0) S.seg[TOPK_HM_COARSE + (tid * TOPK_BPT) / 32] = sum;
  }
#endif
  cl_sync();  // histograms complete (and leader counters initialized) cluster-wide

  // ---- merged histogram -> bin b0 of the k-th best
#if TOPK_HM && TOPK_CLUSTER > 1
  // hierarchical: gather every CTA's 64 coarse bins (C x 64 remote words), find the coarse bin B0 of the k-th
  // best, gather every CTA's 32 buckets of B0 (C x 32 words) -> b0, above0, cnt0 exactly as the full merge;
  // the per-CTA counts also give every CTA its slots in the leader's buffers (exclusive prefix in rank
  // order: no reservation atomics). One cluster barrier; the peers' histograms stay intact until the last one.
  {
    constexpr int C = TOPK_CLUSTER;
    u32* __restrict__ cg = S.seg;           // [C][64] every CTA's coarse bins
    u32* __restrict__ fg = S.seg + C * 64;  // [C][32] every CTA's buckets of the coarse bin B0
    u32* __restrict__ pc = S.seg + C * 96;  // [2][C] every CTA's pass-B counts (to S.sel, to S.cand)
    const int warp = tid >> 5;
    const u32 ca = smem_u32(S.seg + TOPK_HM_COARSE), ha = smem_u32(S.hist);
    {
      constexpr int N = C * 64, PER = (N + TOPK_THREADS - 1) / TOPK_THREADS;
      u32 v[PER];
#pragma unroll
      for (int q = 0; q < PER; ++q) {
        const int i = tid + q * TOPK_THREADS;
        v[q] = (i < N) ? sp_ld32(cl_map(ca + 4u * (u32)(i & 63), (u32)(i >> 6))) : 0u;
      }
#pragma unroll
      for (int q = 0; q < PER; ++q) {
        const int i = tid + q * TOPK_THREADS;
        if (i < N) cg[i] = v[q];
      }
    }
    __syncthreads();
    if (warp == 0) {  // merged coarse bins from the top: lane l owns 63 - 2l (a) and 62 - 2l (b)
      u32 a = 0u, b = 0u;
#pragma unroll
      for (int p = 0; p < C; ++p) {
        a += cg[p * 64 + 63 - 2 * lane];
        b += cg[p * 64 + 62 - 2 * lane];
      }
      const u32 s2 = a + b, inc = warp_incl_scan(s2), ex = inc - s2;
      int cb = -1;
      u32 ab = 0u;
      if (ex < kk0 && ex + a >= kk0) {
        cb = 63 - 2 * lane;
        ab = ex;
      } else if (ex + a < kk0 && inc >= kk0) {
        cb = 62 - 2 * lane;
        ab = ex + a;
      }
      const u32 m = __ballot_sync(FULL, cb >= 0);
      const int src = m ? __ffs(m) - 1 : 0;
      cb = __shfl_sync(FULL, cb, src);
      ab = __shfl_sync(FULL, ab, src);
      const u32 total = __shfl_sync(FULL, inc, 31);
      if (lane == 0) {
        S.res_bin = m ? cb : -1;
        S.res_above = ab;
        S.total = total;
      }
    }
    __syncthreads();
    const int B0 = S.res_bin;  // -1: fewer than k selectable
    const u32 aboveC = S.res_above, total = S.total;
    if (B0 >= 0) {  // block-uniform
      constexpr int N = C * 32, PER = (N + TOPK_THREADS - 1) / TOPK_THREADS;
      u32 v[PER];
#pragma unroll
      for (int q = 0; q < PER; ++q) {
        const int i = tid + q * TOPK_THREADS;
        v[q] = (i < N) ? sp_ld32(cl_map(ha + 4u * (u32)(B0 * 32 + (i & 31)), (u32)(i >> 5))) : 0u;
      }
#pragma unroll
      for (int q = 0; q < PER; ++q) {
        const int i = tid + q * TOPK_THREADS;
        if (i < N) fg[i] = v[q];
      }
    }
    __syncthreads();  // also: every thread has read S.res_bin / S.res_above / S.total
    if (warp < C) {   // warp-uniform; each such warp: the merged buckets of B0 (lane l owns 31 - l), then its CTAs
      int f0 = 31;
      u32 ab0 = 0u, cn0 = 0u;
      if (B0 >= 0) {
        u32 sb = 0u;
#pragma unroll
        for (int q = 0; q < C; ++q) sb += fg[q * 32 + 31 - lane];
        const u32 inc = warp_incl_scan(sb), acc = aboveC + inc - sb;
        const u32 m = __ballot_sync(FULL, acc < kk0 && acc + sb >= kk0);  // one lane: B0 holds the k-th best
        const int src = m ? __ffs(m) - 1 : 0;
        f0 = 31 - src;
        ab0 = __shfl_sync(FULL, acc, src);
        cn0 = __shfl_sync(FULL, sb, src);
      }
      const bool allb = (B0 < 0) || (ab0 + cn0 == kk0);
      const bool stc = !allb && cn0 <= (u32)TOPK_CAP;
      if (warp == 0 && lane == 0) {
        S.res_bin = B0 < 0 ? -1 : B0 * 32 + f0;
        S.res_above = ab0;
        S.res_cnt = cn0;
      }
      for (int p = warp; p < C; p += TOPK_NWARPS) {  // warp-uniform
        const u32* __restrict__ cp = cg + p * 64;
        u32 a = ((2 * lane > B0) ? cp[2 * lane] : 0u) + ((2 * lane + 1 > B0) ? cp[2 * lane + 1] : 0u);
        u32 cnd = 0u;
        if (B0 >= 0) {
          a += (lane > f0) ? fg[p * 32 + lane] : 0u;
          cnd = fg[p * 32 + f0];
        }
        const u32 above_p = __reduce_add_sync(FULL, a);
        if (lane == 0) {
          pc[p] = above_p + (allb ? cnd : 0u);
          pc[C + p] = stc ? cnd : 0u;
        }
      }
    }
    __syncthreads();
    b0 = S.res_bin;
    above0 = S.res_above;
    cnt0 = S.res_cnt;
    if (warp == 0) {  // pass B's first slots of this CTA (exclusive prefix over the lower ranks)
      const u32 vs = (lane < C) ? pc[lane] : 0u, vc = (lane < C) ? pc[C + lane] : 0u;
      const u32 is = warp_incl_scan(vs), ic = warp_incl_scan(vc);
      const u32 os = __shfl_sync(FULL, is - vs, (int)rank), oc = __shfl_sync(FULL, ic - vc, (int)rank);
      if (lane == 0) {
        S.gb_sel = os;
        S.gb_cand = oc;
        S.tot_sel = (b0 < 0) ? total : above0 + ((above0 + cnt0 == kk0) ? cnt0 : 0u);  // for the leader's counters
      }
    }
  }
#else
  u32 c[TOPK_BPT];
#if TOPK_CLUSTER >= 8
  // reduce-scatter (clusters of 8 / 16; job topk7-02, [1, 129280]: 16 x 512 threads 15.7 vs 17.9 us
  // all-gather, 8 x 1024 on par; 4 x 1024 all-gather faster): CTA r merges chunk r (W bins) of every
  // peer's histogram into its S.seg[0, W) and sends the chunk's total to every CTA (S.ctot[r]); after
  // a cluster barrier each CTA finds the chunk c* that holds the k-th best
  // (from the top), reads c*'s merged bins from CTA c* and stands the total above c* in for the bins
  // above it (select_bin then finds b0, above0, cnt0 exactly). Per CTA W x CLUSTER + W remote words.
  {
    constexpr int W = TOPK_NBINS / TOPK_CLUSTER;
    static_assert(W <= TOPK_THREADS, "one thread per bin of the chunk");
    const int warp = tid >> 5;
    u32 sum = 0u;
    if (tid < W) {
      const u32 a = smem_u32(S.hist) + 4u * (rank * W + tid);
#pragma unroll
      for (int i = 0; i < TOPK_CLUSTER; ++i) sum += sp_ld32(cl_map(a, (rank + (u32)i) % TOPK_CLUSTER));
      S.seg[tid] = sum;
    }
    const u32 ws = __reduce_add_sync(FULL, sum);
    if (lane == 0 && warp < (W + 31) / 32) S.scan[warp] = ws;
    __syncthreads();
    if (tid < TOPK_CLUSTER) {
      u32 tot = 0u;
      for (int q = 0; q < (W + 31) / 32; ++q) tot += S.scan[q];
      sp_st32(cl_map(smem_u32(&S.ctot[rank]), (u32)tid), tot);
    }
    cl_sync();  // chunk totals in every CTA, merged chunks readable
    int cs = -1;
    u32 above = 0u;
#pragma unroll
    for (int q = TOPK_CLUSTER - 1; q >= 0; --q) {
      const u32 t = S.ctot[q];
      if (cs < 0) {
        if (above + t >= kk0) cs = q;
        else above += t;
      }
    }
    const u32 sbase = smem_u32(S.seg);
#pragma unroll
    for (int j = 0; j < TOPK_BPT; ++j) {
      const int bin = TOPK_NBINS - 1 - (tid * TOPK_BPT + j);
      u32 v = 0u;
      if (cs >= 0 && bin / W == cs) v = sp_ld32(cl_map(sbase + 4u * (bin - cs * W), (u32)cs));
      else if (bin == (cs < 0 ? TOPK_NBINS - 1 : (cs + 1) * W)) v = above;  // the total above chunk c*
      c[j] = v;
    }
  }
#else
  {
    // this thread's bins NBINS - BPT * (tid + 1) + i (i < BPT; c[j] is element BPT - 1 - j), one vector
    // load per peer; peers visited from this CTA's own rank on, so that the CTAs read different peers
    const u32 a = smem_u32(S.hist) + 4u * (TOPK_NBINS - TOPK_BPT * (tid + 1));
#pragma unroll
    for (int j = 0; j < TOPK_BPT; ++j) c[j] = 0u;
#pragma unroll
    for (int i = 0; i < TOPK_CLUSTER; ++i) {
      u32 v[TOPK_BPT];
      sp_ld_bins(cl_map(a, (rank + (u32)i) % TOPK_CLUSTER), v);
#pragma unroll
      for (int j = 0; j < TOPK_BPT; ++j) c[j] += v[TOPK_BPT - 1 - j];
    }
  }
#endif
  select_bin(S, c, kk0, nullptr);
  b0 = S.res_bin;          // -1: fewer than k selectable -> take all
  above0 = S.res_above;
  cnt0 = S.res_cnt;
#if TOPK_HM
  if (tid == 0) {  // one CTA: its slots start at 0; S.total is the full count here
    S.gb_sel = 0u;
    S.gb_cand = 0u;
    S.tot_sel = (b0 < 0) ? S.total : above0 + ((above0 + cnt0 == kk0) ? cnt0 : 0u);
  }
#endif
#endif
  const bool all_b0 = (b0 < 0) || (above0 + cnt0 == kk0);
  const bool store_cand = !all_b0 && cnt0 <= (u32)TOPK_CAP;
  // the leader's threshold refinement (pin_threshold) ranks the candidates iff this holds (its n_cand == cnt0);
  // the radix path needs the candidates' key AND / OR (without them it is still exact, from the top bit)
  const bool use_rank = store_cand && cnt0 * cnt0 <= (u32)(TOPK_RANKW * TOPK_THREADS);

  // ---- pass B: winners and b0 candidates straight into the leader's buffers
#if TOPK_RES
  pass_b<true>(S, rowp, w, bc, my_lo, my_hi, lo, hi, b0, all_b0, store_cand, rank, !use_rank, TOPK_HM);
#else
  u32 w[TOPK_UNROLL][4], bc[2 * TOPK_UNROLL];  // (bc: unused by streamed slices)
  pass_b<false>(S, rowp, w, bc, my_lo, my_hi, lo, hi, b0, all_b0, store_cand, rank, !use_rank, TOPK_HM);
#endif
#if TOPK_HM
  // the leader's counters: nobody reserved (resident: no appends; streamed: its own appends are done)
  if (rank == 0 && tid == 0) {
    S.n_sel = S.tot_sel;
    S.n_cand = cnt0;
  }
#endif
  cl_sync();  // all entries visible at the leader; nobody reads a peer's smem after this
  if (rank != 0) return;

  finish_row(S, rowp, row, lo, hi, b0, above0, all_b0, store_cand, k, sorted, block_table, bt_stride, block_size,
             rows_per_seq, has_bt, num_blocks, out_idx, out_score);
}
