// kv_cache.cuh: device helpers of kv_cache.cu (DSV4 paged KV caches, compressors, gather).
// Byte layouts (docs/layouts/kv_cache_append.md, dsv4/ops/kv_cache.py):
//   fp8_ds_mla (FlashMLA "MODEL1" / vLLM DSV4), 584 B per token, paged block of bs tokens:
//     block base = page * bs * 584
//     token data  at base + off * 576:  [0, 448) E4M3 nope dims, [448, 576) 64 x BF16 rope dims
//     token scales at base + bs * 576 + off * 8: 7 x UE8M0 (one per 64 nope dims), 1 pad byte (0)
//   indexer MXFP4, 68 B per token: block base = page * bs * 68
//     values at base + off * 64 (128 x E2M1, element 2i in the low nibble)
//     scales at base + bs * 64 + off * 4 (4 x UE8M0, one per 32)
#pragma once
#include "common.cuh"

#define KVC_D_ATTN 512
#define KVC_NOPE 448
#define KVC_ROPE 64
#define KVC_DATA_B 576
#define KVC_SF_B 8
#define KVC_TOKEN_B 584
#define KVC_D_IDX 128
#define KVC_IDX_VB 64
#define KVC_IDX_SB 4
#define KVC_IDX_TOKEN_B 68
#define KVC_FULL 0xFFFFFFFFu

// DSV4 act_quant (block 64, ue8m0): byte of s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448)))
DSV4_DEVICE u32 kvc_fp8_scale_byte(float amax) {
  return ue8m0_byte_ceil(__fmul_rn(fmaxf(amax, 1e-4f), 1.0f / 448.0f));
}
// DSV4 fp4_act_quant (block 32): byte of s = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6)))
DSV4_DEVICE u32 kvc_fp4_scale_byte(float amax) {
  return ue8m0_byte_ceil(__fmul_rn(fmaxf(amax, 6.0f * 1.1754943508222875e-38f), 1.0f / 6.0f));
}

// All arithmetic is pinned (__fmaf_rn / __fadd_rn) so that prefill and decode, which share
// this code, produce bit-identical results regardless of the compiler's contraction choices.
// online (streaming) softmax-weighted sum for one channel: rows with score -inf carry no
// weight (exp(-inf) = 0) and are skipped, which also avoids (-inf) - (-inf).
DSV4_DEVICE void kvc_online(float& m, float& l, float& a, float s, float v) {
  if (s == neg_inf_f32()) return;
  if (s > m) {
    const float al = expf(m - s);  // m = -inf -> 0
    a = __fmaf_rn(a, al, v);
    l = __fmaf_rn(l, al, 1.0f);
    m = s;
  } else {
    const float e = expf(s - m);
    a = __fmaf_rn(v, e, a);
    l = __fadd_rn(l, e);
  }
}
// Branch-free variant (same operations per case as kvc_online, so bit-identical for
// KVC_ONLINE == 1): one exp of -|s - m|, both updates computed, selects.
// KVC_ONLINE == 2: scores are pre-scaled by log2(e) and the exp is ex2.approx (MUFU);
// ex2(0) is forced to exactly 1 so single-row (one-hot) pooling stays exact.
DSV4_DEVICE float kvc_ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
template <int MODE>
DSV4_DEVICE void kvc_online_sel(float& m, float& l, float& a, float s, float v) {
  const float arg = -fabsf(__fsub_rn(s, m));   // NaN only when s = m = -inf (then skipped)
  float x;
  if (MODE == 2) x = (arg == 0.f) ? 1.0f : kvc_ex2(arg);
  else x = expf(arg);
  const bool gt = s > m;
  const float a1 = __fmaf_rn(a, x, v), l1 = __fmaf_rn(l, x, 1.0f);  // s > m: rescale, new weight 1
  const float a2 = __fmaf_rn(v, x, a), l2 = __fadd_rn(l, x);        // s <= m: new weight x
  const bool skip = s == neg_inf_f32();
  a = skip ? a : (gt ? a1 : a2);
  l = skip ? l : (gt ? l1 : l2);
  m = gt ? s : m;
}
// merge a second partial (m2, l2, a2) into (m, l, a)
template <int MODE>
DSV4_DEVICE void kvc_merge(float& m, float& l, float& a, float m2, float l2, float a2) {
  if (m2 == neg_inf_f32()) return;
  if (m == neg_inf_f32()) { m = m2; l = l2; a = a2; return; }
  const float mn = fmaxf(m, m2);
  const float f1 = MODE == 2 ? exp2f(m - mn) : expf(m - mn), f2 = MODE == 2 ? exp2f(m2 - mn) : expf(m2 - mn);
  a = __fmaf_rn(a, f1, __fmul_rn(a2, f2));
  l = __fmaf_rn(l, f1, __fmul_rn(l2, f2));
  m = mn;
}
