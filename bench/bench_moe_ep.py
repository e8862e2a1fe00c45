"""Benchmark: expert-parallel MoE (``dsv4.distributed.moe_experts_ep``): dispatch + local experts +
combine per token count, with the communication share.

DSV4-Flash (D=4096, I=2048, E=256, top-6, MXFP4 W4A8), ``E / world`` experts per rank, uniform random
routing over all experts, T tokens per rank. Per row: the exact-split mode (one host sync for the
split sizes) and the low-latency mode (fixed buffers, no host sync), each phase timed with CUDA
events on fixed inputs (median of ``--iters``; low-latency: CUDA-graph replays, exact: eager calls), rank 0 prints the maximum over ranks; ``comm share`` =
(dispatch + combine) / total. Target of issue 18 (8 GPUs, T=256 per rank): dispatch + combine <= 2x
the local expert time.

Launch: ``torchrun --nproc-per-node N bench/bench_moe_ep.py [--tokens 1,16,64,256,1024] [--json out.json]``
(NCCL, one GPU per rank); without torchrun it runs one rank (world 1: the collectives are local copies,
so the row shows the local expert time and the dispatch glue). Keep NVLink multicast off
(NCCL_NVLS_ENABLE=0) on the lent machines.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._util import print_table, save_json, time_cuda
from bench.bench_moe import make_weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,16,64,256,1024")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from dsv4 import distributed as ddist
    from dsv4.ops.moe import moe_experts
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    E, D, I, K = 256, 4096, 2048, 6
    W = make_weights(E // world, D, I, "mxfp4")          # this rank's shard (random bytes: values do not change timing)
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(rank)
        idx = torch.argsort(torch.rand(T, E, device="cuda", generator=g), dim=1)[:, :K].to(torch.int32)
        w = torch.rand(T, K, device="cuda", generator=g) + 0.1
        x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
        for ll in (False, True):
            # every rank runs the same calls in the same order (the collectives pair up); each phase on
            # fixed inputs, median of --iters calls (bench._util.time_cuda: CUDA events per call); the
            # low-latency mode is timed as CUDA-graph replays (it has no host sync, as a decode step runs it),
            # the exact mode eagerly (its split sizes need the host)
            d = ddist.ep_dispatch(x, idx, w, experts_per_rank=W.E, low_latency=ll)
            y = moe_experts(d.x, d.topk_idx, d.topk_w, W, act="fp8")
            t = {"dispatch": time_cuda(lambda x=x, idx=idx, w=w, ll=ll: ddist.ep_dispatch(
                     x, idx, w, experts_per_rank=W.E, low_latency=ll), iters=args.iters, graph=ll),
                 "experts": time_cuda(lambda d=d: moe_experts(d.x, d.topk_idx, d.topk_w, W, act="fp8"),
                                      iters=args.iters, graph=ll),
                 "combine": time_cuda(lambda d=d, y=y: ddist.ep_combine(y, d), iters=args.iters, graph=ll)}
            tt = torch.tensor([t["dispatch"], t["experts"], t["combine"]], device="cuda")
            dist.all_reduce(tt, op=dist.ReduceOp.MAX)
            dsp, exp, cmb = tt.tolist()
            rows.append({"world": world, "T/rank": T, "mode": "low-latency" if ll else "exact",
                         "dispatch us": round(dsp, 1), "experts us": round(exp, 1), "combine us": round(cmb, 1),
                         "total us": round(dsp + exp + cmb, 1), "comm share": f"{(dsp + cmb) / (dsp + exp + cmb):.0%}",
                         "(dispatch+combine)/experts": round((dsp + cmb) / exp, 2)})
    if rank == 0:
        print_table(rows, list(rows[0].keys()),
                    title=f"EP MoE, DSV4-Flash MXFP4 W4A8, {world} rank(s), {torch.cuda.get_device_name()}")
        save_json(args.json, {"world": world, "rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
