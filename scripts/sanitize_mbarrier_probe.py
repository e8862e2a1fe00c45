"""Minimal mbarrier producer / consumer ring under compute-sanitizer racecheck (issue 19 item 14).

Question: kernels_cuda/moe_decode.cu's racecheck report (hazards between the producer warp's B-tile
``st.shared`` and the consumers' ``ld.shared``, ordered only by the full / empty mbarrier ring): a
real race, or the tool not modelling the inline-PTX mbarrier? This probe is the same protocol, small
and obviously correct, built from the same kernels_cuda/common.cuh helpers (``mbar_init``,
``mbar_arrive`` = ``mbarrier.arrive.shared::cta.b64``, ``mbar_wait`` = a ``mbarrier.try_wait.parity``
loop, ``fence_proxy_async_smem``, ``__syncwarp``): one producer warp fills a ``STAGES``-deep ring of
shared tiles, 4 consumer warps read every word of each tile (words written by other lanes), over
``ROUNDS`` rounds. Variants (one kernel each):

* ``warp``: the moe_decode pattern: all 32 producer lanes ``st.shared``, ``fence.proxy.async``,
  ``__syncwarp``, lane 0 arrives on full[s] (count 1); each consumer warp reads, ``__syncwarp``,
  lane 0 arrives on empty[s] (count 4). Correct by the PTX memory model (``bar.warp.sync`` orders the
  lanes' accesses; the release arrive is cumulative; ``try_wait`` acquires).
* ``thread``: every thread arrives (full count 32, empty count 128): no warp-level step at all.
* ``bar``: negative control: the same ring ordered by ``__syncthreads`` only (no mbarrier).
* ``racy``: positive control: ``bar`` without the ``__syncthreads`` between the producer's stores and
  the consumers' loads (a real race; no mbarrier, so it cannot hang): the tool must report it.
* ``named``: the named-barrier producer / consumer pair of kernels_dsl/sparse_attention_fwd.py
  (``BAR_P_READY`` / ``BAR_P_FREE``): the producer ``bar.arrive 1, 160`` after its stores, the
  consumers ``bar.sync 1, 160`` before their loads; back: consumers ``bar.arrive 2, 160``, the
  producer ``bar.sync 2, 160`` before it overwrites. Correct (``bar.arrive`` orders the arriving
  thread's prior accesses before the completing ``bar.sync``'s later ones).
* ``partial``: the same ping-pong on a PART of the block, as in sparse attention (2 of its 3
  warpgroups): warps 0-1 produce, warps 2-3 consume (``bar.* 1|2, 128``), warp 4 takes no part
  (its own shared words, ``__syncwarp`` only); sparse attention's loop order exactly (the consumer
  skips the last ``P_FREE`` arrive, the producer the first wait), then a last publish with
  ``bar.arrive 3, 128`` / ``bar.sync 3, 128`` (its ``BAR_EPI``). Correct.
* ``single``: ``partial`` on ONE buffer, as sparse attention's ``sScale`` (64 words, written by every
  other producer thread, 2 words each; read by every consumer thread): the consumer's read of round g
  and the producer's write of round g + 1 are ordered by the ``P_FREE`` arrive -> sync alone (in
  ``partial`` the ring puts two rounds between them). Correct.
* ``mbar``: ``single`` inside sparse attention's mbarrier pipeline: warp 4 is the KV producer (waits
  empty[s], stores a tile, every lane arrives on full[s]); the producer pair waits full[s] before its
  ``single`` store, the consumer pair after its ``bar.sync 1`` and before its ``single`` load; both read
  the tile and every thread arrives on empty[s] (``PipelineAsync`` with per-thread arrivals, like the
  kernel's 128-thread producer / 256-thread consumer groups). Correct.
* ``wgmma``: sparse attention's CTA shape and loop (384 threads = 3 warpgroups, named barriers of 256):
  warpgroup 2 produces 64 x 16 bf16 K stages (stores, ``fence.proxy.async``, 128 per-thread arrivals on
  full[s]); warpgroup 0 waits full[s], ``wgmma`` S = Q K^T (m64n64k16, smem operands), [``bar.sync 2, 256``],
  lanes ``% 4 == 0`` store the two 64-word ``sScale`` rows of their accumulator fragment, stores its P tile,
  ``fence.proxy.async``, ``bar.arrive 1, 256``, ``wgmma`` P V; warpgroup 1 ``bar.sync 1, 256``, waits
  full[s], loads its two ``sScale`` rows, ``wgmma`` P V, [``bar.arrive 2, 256``]; both arrive on empty[s]
  (256). The operands are zeros (the MMAs only have to run between the barriers). Correct.
* ``cpwarp``: kernels_cuda/moe_decode.cu's weight-slab path: the producer lanes fill the stage with
  ``cp.async`` (16 B each, from global) and each arrives with ``cp.async.mbarrier.arrive.noinc`` on
  full[s] (count 32); the consumer warps read, ``__syncwarp``, lane 0 arrives on empty[s] (count 4),
  before the producer's next ``cp.async`` into the stage. Correct (as ``warp``).
* ``cpthread``: ``cpwarp`` with every consumer thread arriving on empty[s] (count 128). Correct.

Usage: ``python scripts/sanitize_mbarrier_probe.py VARIANT`` (GPU); prints ``MBAR_PROBE <variant>
ok=<bool> ...`` (``ok``: the consumers' sums equal the exact value; ``racy`` may or may not differ).
scripts/gpu_sanitize.sh runs each variant under racecheck and prints the hazard counts.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES, ROUNDS, WORDS = 2, 8, 8          # ring depth, tiles per launch, words per producer lane per tile
VARIANTS = {"warp": 0, "thread": 1, "racy": 2, "bar": 3, "named": 4, "partial": 5, "single": 6, "mbar": 7,
            "wgmma": 8, "cpwarp": 9, "cpthread": 10}
THREADS = {"wgmma": 384}                 # the others: 160

SRC = r"""
#include "common.cuh"
#define STAGES @STAGES@
#define ROUNDS @ROUNDS@
#define WORDS @WORDS@
#define TILE_WORDS (32 * WORDS)

// arrive on the mbarrier at bar: every thread (count = threads) or, after __syncwarp, lane 0 (count = warps)
DSV4_DEVICE void release(u32 bar, bool every_thread, int lane) {
  if (every_thread) {
    mbar_arrive(bar);
  } else {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  }
}

template <int V>
DSV4_DEVICE void ring(u32* out, const u32* src) {
  __shared__ __align__(16) u32 tile[STAGES][TILE_WORDS];
  __shared__ __align__(8) u64 bars[2 * STAGES];
  __shared__ u32 side[96];                         // V 5: the non-participating warp's words + the epilogue words
  __shared__ u32 one[64];                          // V 6 / 7: the single buffer (sparse attention's sScale)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 bar0 = smem_u32(bars);
  if ((V < 2 || V == 7 || V >= 9) && tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar0 + 8 * s, V == 0 ? 1 : 32);                    // full[s]
      mbar_init(bar0 + 8 * (STAGES + s), (V == 0 || V == 9) ? 4 : 128);   // empty[s]
    }
    mbar_fence_init();
  }
  __syncthreads();
  u32 acc = 0;
  for (int g = 0; g < ROUNDS; ++g) {
    const int s = g % STAGES;
    const u32 ph = (u32)(g / STAGES) & 1u;
    const u32 full = bar0 + 8 * s, empty = bar0 + 8 * (STAGES + s);
    const u32 base = smem_u32(&tile[s][0]);
    if (V == 4) {                                   // named-barrier ping-pong (arrive / sync)
      if (warp == 4) {
        if (g > 0) asm volatile("bar.sync 2, 160;" ::: "memory");
        for (int i = 0; i < WORDS; ++i) st_shared_u32(base + 4 * (lane + 32 * i), (u32)(g * 1000 + lane + 32 * i));
        asm volatile("bar.arrive 1, 160;" ::: "memory");
      } else {
        asm volatile("bar.sync 1, 160;" ::: "memory");
        for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
        if (g + 1 < ROUNDS) asm volatile("bar.arrive 2, 160;" ::: "memory");
      }
      continue;
    }
    if (V == 5) {                                   // partial-block named-barrier ping-pong (warps 0-3 of 5)
      if (warp < 2) {
        if (g > 0) asm volatile("bar.sync 2, 128;" ::: "memory");
        for (int i = 0; i < WORDS / 2; ++i) {
          const int w = tid + 64 * i;
          st_shared_u32(base + 4 * w, (u32)(g * 1000 + w));
        }
        asm volatile("bar.arrive 1, 128;" ::: "memory");
      } else if (warp < 4) {
        asm volatile("bar.sync 1, 128;" ::: "memory");
        for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
        if (g + 1 < ROUNDS) asm volatile("bar.arrive 2, 128;" ::: "memory");
      } else {
        st_shared_u32(smem_u32(&side[lane]), (u32)g);
        __syncwarp();
        acc += ld_shared_u32(smem_u32(&side[(lane + 1) & 31]));
        __syncwarp();
      }
      if (g + 1 == ROUNDS && warp < 4) {            // epilogue publish (BAR_EPI): one word per producer thread
        if (warp < 2) {
          st_shared_u32(smem_u32(&side[32 + tid]), (u32)(tid + 1));
          asm volatile("bar.arrive 3, 128;" ::: "memory");
        } else {
          asm volatile("bar.sync 3, 128;" ::: "memory");
          acc += ld_shared_u32(smem_u32(&side[32 + (tid - 64)])) - (u32)(tid - 63);   // adds 0 when ordered
        }
      }
      continue;
    }
    if (V == 6 || V == 7) {                         // single-buffer ping-pong (V 7: in an mbarrier ring)
      if (warp == 4) {
        if (V == 7) {                               // KV producer: every lane arrives
          mbar_wait(empty, ph ^ 1u);
          for (int i = 0; i < WORDS; ++i) st_shared_u32(base + 4 * (lane + 32 * i), (u32)(g * 1000 + lane + 32 * i));
          mbar_arrive(full);
        }
        continue;
      }
      if (warp < 2) {                               // WG0: wait the tile, [P_FREE], store, P_READY
        if (V == 7) mbar_wait(full, ph);
        if (g > 0) asm volatile("bar.sync 2, 128;" ::: "memory");
        if ((tid & 1) == 0) {
          st_shared_u32(smem_u32(&one[tid >> 1]), (u32)(g * 100 + (tid >> 1)));
          st_shared_u32(smem_u32(&one[32 + (tid >> 1)]), (u32)(g * 100 + 32 + (tid >> 1)));
        }
        asm volatile("bar.arrive 1, 128;" ::: "memory");
        if (V == 7) { acc += ld_shared_u32(base + 4 * ((tid * 7 + 5) % TILE_WORDS)); mbar_arrive(empty); }
      } else {                                      // WG1: P_READY, wait the tile, load, [P_FREE]
        asm volatile("bar.sync 1, 128;" ::: "memory");
        if (V == 7) mbar_wait(full, ph);
        acc += ld_shared_u32(smem_u32(&one[(tid - 64) & 63])) + ld_shared_u32(smem_u32(&one[(tid - 57) & 63]));
        if (V == 7) { acc += ld_shared_u32(base + 4 * ((tid * 7 + 5) % TILE_WORDS)); mbar_arrive(empty); }
        if (g + 1 < ROUNDS) asm volatile("bar.arrive 2, 128;" ::: "memory");
      }
      continue;
    }
    if (V >= 9) {                                   // cp.async ring (moe_decode's weight slabs)
      if (warp == 4) {
        mbar_wait(empty, ph ^ 1u);
        for (int i = 0; i < WORDS / 4; ++i)
          cp_async_cg16<0>(base + 16 * (lane + 32 * i), src + g * TILE_WORDS + 4 * (lane + 32 * i));
        cp_async_mbar_arrive_noinc(full);
      } else {
        mbar_wait(full, ph);
        for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
        release(empty, V == 10, lane);
      }
      continue;
    }
    if (V == 2 || V == 3) {                         // __syncthreads ring (V 2: without the RAW barrier)
      if (warp == 4)
        for (int i = 0; i < WORDS; ++i) st_shared_u32(base + 4 * (lane + 32 * i), (u32)(g * 1000 + lane + 32 * i));
      if (V == 3) __syncthreads();
      if (warp < 4)
        for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
      __syncthreads();
      continue;
    }
    if (warp == 4) {                                // producer warp
      mbar_wait(empty, ph ^ 1u);
      for (int i = 0; i < WORDS; ++i) st_shared_u32(base + 4 * (lane + 32 * i), (u32)(g * 1000 + lane + 32 * i));
      fence_proxy_async_smem();
      release(full, V == 1, lane);
    } else {                                        // consumer warps 0..3
      mbar_wait(full, ph);
      for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
      release(empty, V == 1, lane);
    }
  }
  if (warp < 4) out[blockIdx.x * 128 + tid] = ((V == 5 || V == 6) && warp < 2) ? 0u : acc;
}

// no-swizzle K-major WGMMA descriptor of a 64 x 16 bf16 tile (8 x 8 core matrices: K neighbours 128 B
// apart, 8-row groups 256 B apart: 2 KB)
DSV4_DEVICE u64 desc64x16(u32 addr) { return wgmma_desc(addr, 128, 256); }

// sparse attention's three-warpgroup loop (see the module docstring, variant "wgmma")
DSV4_DEVICE void wgmma_ring(u32* out) {
  __shared__ __align__(1024) u32 sQ[512];           // 64 x 16 bf16
  __shared__ __align__(1024) u32 sK[STAGES][512];
  __shared__ __align__(1024) u32 sP[512];
  __shared__ __align__(8) u64 bars[2 * STAGES];
  __shared__ float sScale[64];
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const u32 bar0 = smem_u32(bars);
  for (int i = tid; i < 512; i += 384) st_shared_u32(smem_u32(&sQ[i]), 0u);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) { mbar_init(bar0 + 8 * s, 128); mbar_init(bar0 + 8 * (STAGES + s), 256); }
    mbar_fence_init();
  }
  fence_proxy_async_smem();
  __syncthreads();
  const int r0 = (wtid >> 5) * 16 + ((wtid & 31) >> 2), r1 = r0 + 8;   // this thread's accumulator rows
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.f;
  u32 acc = 0;
  for (int g = 0; g < ROUNDS; ++g) {
    const int s = g % STAGES;
    const u32 ph = (u32)(g / STAGES) & 1u;
    const u32 full = bar0 + 8 * s, empty = bar0 + 8 * (STAGES + s);
    const u64 dq = desc64x16(smem_u32(sQ)), dk = desc64x16(smem_u32(&sK[s][0])), dp = desc64x16(smem_u32(sP));
    if (wg == 2) {                                  // KV producer
      mbar_wait(empty, ph ^ 1u);
      for (int j = 0; j < 4; ++j) st_shared_u32(smem_u32(&sK[s][wtid * 4 + j]), 0u);
      fence_proxy_async_smem();
      mbar_arrive(full);
    } else if (wg == 0) {                           // S = Q K^T, softmax stand-in, P -> smem, O0 += P V
      mbar_wait(full, ph);
      wgmma_fence();
      wgmma_m64n64k16_bf16(d, dq, dk, 1);
      wgmma_commit();
      wgmma_wait<0>();
      if (g > 0) asm volatile("bar.sync 2, 256;" ::: "memory");
      if ((wtid & 3) == 0) {
        sScale[r0] = (float)(g * 100 + r0) + d[0];
        sScale[r1] = (float)(g * 100 + r1) + d[2];
      }
      for (int j = 0; j < 4; ++j) st_shared_u32(smem_u32(&sP[wtid * 4 + j]), 0u);
      fence_proxy_async_smem();
      asm volatile("bar.arrive 1, 256;" ::: "memory");
      wgmma_fence();
      wgmma_m64n64k16_bf16(d, dp, dk, 1);
      wgmma_commit();
      wgmma_wait<0>();
      mbar_arrive(empty);
    } else {                                        // O1 += P V with the rescale rows from sScale
      asm volatile("bar.sync 1, 256;" ::: "memory");
      mbar_wait(full, ph);
      acc += (u32)sScale[r0] + (u32)sScale[r1];
      wgmma_fence();
      wgmma_m64n64k16_bf16(d, dp, dk, 1);
      wgmma_commit();
      wgmma_wait<0>();
      mbar_arrive(empty);
      if (g + 1 < ROUNDS) asm volatile("bar.arrive 2, 256;" ::: "memory");
    }
  }
  if (wg == 1) out[blockIdx.x * 128 + wtid] = acc + (u32)d[1];      // d stays 0 (zero operands)
}

extern "C" __global__ void __launch_bounds__(160) mbar_probe_0(u32* out, const u32* src) { ring<0>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_1(u32* out, const u32* src) { ring<1>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_2(u32* out, const u32* src) { ring<2>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_3(u32* out, const u32* src) { ring<3>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_4(u32* out, const u32* src) { ring<4>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_5(u32* out, const u32* src) { ring<5>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_6(u32* out, const u32* src) { ring<6>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_7(u32* out, const u32* src) { ring<7>(out, src); }
extern "C" __global__ void __launch_bounds__(384, 1) mbar_probe_8(u32* out, const u32*) { wgmma_ring(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_9(u32* out, const u32* src) { ring<9>(out, src); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_10(u32* out, const u32* src) { ring<10>(out, src); }
"""

for _k, _v in (("@STAGES@", STAGES), ("@ROUNDS@", ROUNDS), ("@WORDS@", WORDS)):
    SRC = SRC.replace(_k, str(_v))


def expected(blocks: int, variant: str = "warp"):
    """Exact consumer sums (the protocol is deterministic when correct); ``partial`` / ``single``: warps
    0-1 are the producers (0), warps 2-3 the consumers; ``mbar``: every thread of warps 0-3 reads one tile
    word per round, warps 2-3 also the two ``single`` words."""
    import torch
    tid = torch.arange(128, dtype=torch.int64)
    tw = 32 * WORDS
    acc = torch.zeros(128, dtype=torch.int64)
    if variant == "wgmma":                          # warpgroup 1's thread t: rows r0, r0 + 8 of every round
        r0 = (tid // 32) * 16 + (tid % 32) // 4
        return (sum(2 * g * 100 + 2 * r0 + 8 for g in range(ROUNDS)) % (1 << 32)).repeat(blocks)
    for g in range(ROUNDS):
        if variant in ("single", "mbar"):
            one = (tid - 64) % 64, (tid - 57) % 64
            acc[64:] += (2 * g * 100 + one[0] + one[1])[64:]
            if variant == "mbar":
                acc += g * 1000 + (tid * 7 + 5) % tw
            continue
        for i in range(WORDS):
            acc += g * 1000 + (tid * 7 + 32 * i + 5) % tw
    if variant in ("partial", "single"):
        acc[:64] = 0
    return (acc % (1 << 32)).repeat(blocks)


def main(variant: str, blocks: int = 4) -> bool:
    import torch
    from cuda.core import ObjectCode

    from kernels_cuda import nvrtc
    opts = ["--gpu-architecture=sm_90a", "-std=c++17", "-lineinfo", "--device-as-default-execution-space",
            f"-I{nvrtc.KERNEL_DIR}"]
    cubin = nvrtc._nvrtc_compile(SRC, "mbar_probe.cu", opts, "cubin")
    nvrtc._device()
    k = ObjectCode.from_cubin(cubin).get_kernel(f"mbar_probe_{VARIANTS[variant]}")
    out = torch.zeros(blocks * 128, dtype=torch.int32, device="cuda")
    tw = 32 * WORDS                                  # cp.async source: round g's tile holds g * 1000 + word
    src = (torch.arange(ROUNDS).view(-1, 1) * 1000 + torch.arange(tw)).to(torch.int32).cuda()
    nvrtc.launch(k, blocks, THREADS.get(variant, 160), out, src)
    torch.cuda.synchronize()
    got = out.to(torch.int64) % (1 << 32)
    ok = bool(torch.equal(got.cpu(), expected(blocks, variant)))
    print(f"MBAR_PROBE {variant} ok={ok} blocks={blocks} stages={STAGES} rounds={ROUNDS}", flush=True)
    return ok


if __name__ == "__main__":
    v = sys.argv[1] if len(sys.argv) > 1 else "warp"
    if v not in VARIANTS:
        raise SystemExit(f"variant must be one of {sorted(VARIANTS)}")
    ok = main(v)
    sys.exit(0 if ok or v == "racy" else 1)
