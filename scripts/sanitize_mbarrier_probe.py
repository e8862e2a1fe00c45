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
VARIANTS = {"warp": 0, "thread": 1, "racy": 2, "bar": 3, "named": 4, "partial": 5}

SRC = r"""
#include "common.cuh"
#define STAGES @STAGES@
#define ROUNDS @ROUNDS@
#define WORDS @WORDS@
#define TILE_WORDS (32 * WORDS)

template <int V>
DSV4_DEVICE void ring(u32* out) {
  __shared__ __align__(16) u32 tile[STAGES][TILE_WORDS];
  __shared__ __align__(8) u64 bars[2 * STAGES];
  __shared__ u32 side[96];                         // V 5: the non-participating warp's words + the epilogue words
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const u32 bar0 = smem_u32(bars);
  if (V < 2 && tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar0 + 8 * s, V == 1 ? 32 : 1);                    // full[s]
      mbar_init(bar0 + 8 * (STAGES + s), V == 1 ? 128 : 4);        // empty[s]
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
      if (V == 1) {
        mbar_arrive(full);
      } else {
        __syncwarp();
        if (lane == 0) mbar_arrive(full);
      }
    } else {                                        // consumer warps 0..3
      mbar_wait(full, ph);
      for (int i = 0; i < WORDS; ++i) acc += ld_shared_u32(base + 4 * ((tid * 7 + 32 * i + 5) % TILE_WORDS));
      if (V == 1) {
        mbar_arrive(empty);
      } else {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty);
      }
    }
  }
  if (warp < 4) out[blockIdx.x * 128 + tid] = (V == 5 && warp < 2) ? 0u : acc;
}

extern "C" __global__ void __launch_bounds__(160) mbar_probe_0(u32* out) { ring<0>(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_1(u32* out) { ring<1>(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_2(u32* out) { ring<2>(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_3(u32* out) { ring<3>(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_4(u32* out) { ring<4>(out); }
extern "C" __global__ void __launch_bounds__(160) mbar_probe_5(u32* out) { ring<5>(out); }
"""

for _k, _v in (("@STAGES@", STAGES), ("@ROUNDS@", ROUNDS), ("@WORDS@", WORDS)):
    SRC = SRC.replace(_k, str(_v))


def expected(blocks: int, variant: str = "warp"):
    """Exact consumer sums (the protocol is deterministic when correct); ``partial``: warps 0-1 are
    the producers (0), warps 2-3 the consumers."""
    import torch
    tid = torch.arange(128, dtype=torch.int64)
    tw = 32 * WORDS
    acc = torch.zeros(128, dtype=torch.int64)
    for g in range(ROUNDS):
        for i in range(WORDS):
            acc += g * 1000 + (tid * 7 + 32 * i + 5) % tw
    if variant == "partial":
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
    nvrtc.launch(k, blocks, 160, out)
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
