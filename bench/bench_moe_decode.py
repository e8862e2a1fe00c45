"""Benchmark: MoE decode (masked layout, few tokens per active expert), decode kernel
(kernels_cuda/moe_decode.cu, its tuning variants) vs the CuTe DSL grouped GEMM (kernels_dsl/moe.py,
forced, with the ``max_m`` hint) on the same inputs, against the weight-byte floor, in one process on
the H200.

Timed: GEMM1 (W13 + clamped SwiGLU + routing weight + FP8 requant / bf16 h) + GEMM2 (W2), replayed
from a CUDA graph (``bench._util.time_graph``) that rotates over several routings whose active
experts are disjoint (the weights of one replay are not in L2 from the previous one).
Floor = weight bytes of the active experts (packed E2M1 + scale bytes of W13 and W2) / device
copy bandwidth measured in the same run (``bench._util.copy_bandwidth``, read + write bytes).

Usage: PYTHONPATH=. python3 bench/bench_moe_decode.py [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import time

import torch

from bench._util import copy_bandwidth, print_table, save_json, time_graph
from bench.bench_moe import make_weights  # same random weights as the MoE benchmark

SHAPES = {"flash": (4096, 2048, 256, ((8, 1), (64, 4), (256, 16))),
          "pro": (7168, 3072, 384, ((8, 1), (64, 4)))}


def masked_group(E, D, act, experts, m, seed):
    """Masked layout [E, m] with ``m`` rows on each expert of ``experts``, random activations."""
    from dsv4.ops.moe import MoEGrouped
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
    counts[experts] = m
    R = E * m
    row_start = (torch.arange(E, device="cuda") * m).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(R, D, device="cuda", generator=g)
    if act == "fp8":
        from dsv4.formats import quantize_fp8_block
        a, a_s = quantize_fp8_block(x, 128, "ue8m0")
    else:
        a, a_s = x.to(torch.bfloat16), None
    rw = torch.rand(R, device="cuda", generator=g)
    # pos: one entry per assignment (the ops size the cuda decode config from pos.numel(), dsv4/ops/moe.py)
    pos = torch.full((len(experts) * m,), -1, dtype=torch.int64, device="cuda")
    return MoEGrouped(a, a_s, row_start, counts, rw, pos)


def groups_for(E, D, act, n, m):
    """Up to 8 routings with disjoint active expert sets (rotation defeats L2 reuse)."""
    nrot = max(1, min(8, E // n))
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(n * 131 + m)).cuda()
    return [masked_group(E, D, act, perm[i * n:(i + 1) * n], m, seed=i) for i in range(nrot)]


def stage_fns(gs, W, which, max_m=None):
    from dsv4.ops import moe
    fns = []
    for g in gs:
        if which == "both":
            def f(g=g):
                h, h_s = moe.moe_gemm1_swiglu(g, W, max_m=max_m)
                return moe.moe_gemm2(h, h_s, g, W, max_m=max_m)
        elif which == "gemm1":
            def f(g=g):
                return moe.moe_gemm1_swiglu(g, W)
        else:
            h, h_s = moe.moe_gemm1_swiglu(g, W)

            def f(g=g, h=h, h_s=h_s):
                return moe.moe_gemm2(h, h_s, g, W)
        fns.append(f)
    return fns


def timed(fns, m):
    iters = max(len(fns), {1: 32, 4: 16}.get(m, 4))
    return time_graph(fns, iters=iters, reps=10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="MXFP4 only, no variants")
    args = ap.parse_args()
    from dsv4.registry import use
    from kernels_cuda.moe_decode import override
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    t0 = time.time()
    for name, (D, I, E, cases) in SHAPES.items():
        for fmt in (("mxfp4",) if args.quick else ("mxfp4", "nvfp4")):
            W = make_weights(E, D, I, fmt)
            SF = 32 if fmt == "mxfp4" else 16
            b13 = 2 * I * D // 2 + 2 * I * D // SF
            b2 = D * I // 2 + D * I // SF
            for act in ("fp8", "bf16"):
                for n, m in cases:
                    gs = groups_for(E, D, act, n, m)
                    floor = n * (b13 + b2) / (bw * 1e9) * 1e6
                    # DecodeConfig fields changed through moe_decode.override (None: the dsl provider)
                    MMA, WG = {"mma": 1}, {"mma": 0}
                    variants = [("decode mma.sync", MMA), ("decode wgmma", WG), ("dsl (kernels_dsl/moe.py)", None)]
                    if not args.quick and fmt == "mxfp4" and m == 1:
                        variants += [("mma.sync splitk=1", {**MMA, "splitk": 1}), ("wgmma splitk=1", {**WG, "splitk": 1})]
                    if not args.quick and name == "flash" and fmt == "mxfp4" and m in (1, 4):
                        variants += [("wgmma bulk (1st run)", {**WG, "bulk": 1, "l2pf": 0}),
                                     ("wgmma l2pf=0", {**WG, "l2pf": 0}), ("mma.sync l2pf=0", {**MMA, "l2pf": 0}),
                                     ("wgmma nwg=1", {**WG, "nwg": 1}), ("mma.sync nwg=1", {**MMA, "nwg": 1}),
                                     ("mma.sync stages=3", {**MMA, "stages": 3})]
                    for label, kv in variants:
                        prov = "dsl" if kv is None else "cuda"
                        with override(**(kv or {})), use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
                            t = timed(stage_fns(gs, W, "both", max_m=m if prov == "dsl" else None), m)
                        rows.append(dict(shape=name, fmt=fmt, act=act, experts=n, m=m, kernel=label, us=t,
                                         floor_us=floor, pct_bw=100 * floor / t))
                        print(rows[-1], flush=True)
                    if not args.quick and fmt == "mxfp4" and m in (1, 4):  # per-stage times of the decode kernel
                        for lab, kv in (("mma.sync", MMA), ("wgmma", WG)):
                            with override(**kv), use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                                for which, b in (("gemm1", b13), ("gemm2", b2)):
                                    t = timed(stage_fns(gs, W, which), m)
                                    fl = n * b / (bw * 1e9) * 1e6
                                    rows.append(dict(shape=name, fmt=fmt, act=act, experts=n, m=m,
                                                     kernel=f"{lab} {which} only", us=t, floor_us=fl, pct_bw=100 * fl / t))
                                    print(rows[-1], flush=True)
                    del gs
            del W
            torch.cuda.empty_cache()
    print(f"bench time {time.time() - t0:.0f} s")
    print_table(rows, ["shape", "fmt", "act", "experts", "m", "kernel", "us", "floor_us", "pct_bw"],
                title=f"MoE decode (GEMM1+SwiGLU + GEMM2, CUDA graph), copy BW {bw:.0f} GB/s; target pct_bw >= 75")
    save_json(args.json, {"copy_bw_GBps": bw, "rows": rows})


if __name__ == "__main__":
    main()
