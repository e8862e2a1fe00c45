"""Benchmark the sparse_attention DSL kernels vs the torch reference and the measured rooflines.

Cases (issue 14 targets):

* decode H=128, B=64, next_n=2, 128 SWA + 1024 compressed (DSV4-Pro): >= 420 TFLOP/s
* decode H=64, B=64, next_n=1, 128 + 512 (DSV4-Flash): >= 350 TFLOP/s
* decode H=32 / H=16 (tensor-parallel shards), B=64, 128 + 512: >= 70% of copy bandwidth over
  the KV bytes read
* prefill H=64, 8192 tokens, top-512 + 128 SWA: >= 600 TFLOP/s

Inputs: every request owns its pages of a compressed fp8_ds_mla cache (8192 entries = a 32k
context at ratio 4, shuffled block table) and of an SWA cache; CSA lists are random distinct
entries of the request (all valid), SWA lists the 128-token window. The caches exceed the L2.
FLOPs = 4 * H * 512 * entries per row (QK^T + PV); KV bytes = rows * entries * 584. Time = median
of CUDA-graph replays of the public op (the provider's launch glue and the split-KV combine included). Rooflines:
bytes / measured device copy bandwidth (read + written) and FLOPs / measured dense BF16 matmul
peak (torch.matmul 8192^3 in the same run). The torch reference (gather + fp32 math) is timed
eagerly on the decode cases.

    PYTHONPATH=. python3 bench/bench_sparse_attention.py --json out.json
"""
from __future__ import annotations

import argparse

import torch

from bench._util import copy_bandwidth, print_table, save_json, time_cuda

CASES = [
    # name, rows (B * next_n), heads, swa width, compressed width, target
    ("decode H=128 B=64 n=2 128+1024", 128, 128, 128, 1024, ("tflops", 420.0)),
    ("decode H=64 B=64 n=1 128+512", 64, 64, 128, 512, ("tflops", 350.0)),
    ("decode H=32 B=64 n=1 128+512", 64, 32, 128, 512, ("bw", 0.70)),
    ("decode H=16 B=64 n=1 128+512", 64, 16, 128, 512, ("bw", 0.70)),
    ("prefill H=64 T=8192 512+128", 8192, 64, 128, 512, ("tflops", 600.0)),
]
ENTRIES_PER_REQ = 8192
BS = 64


def bf16_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    us = time_cuda(lambda: a @ b, warmup=3, iters=10)
    return 2 * 8192 ** 3 / (us * 1e-6) / 1e12


def make_case(rows, H, Ws, K, seed=0):
    from dsv4.ops.kv_cache import kv_cache_append
    from dsv4.reference.kv_cache import TOKEN_BYTES
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    B = min(rows, 64)
    per_row_req = torch.arange(rows, device=dev) * B // rows          # rows -> requests (prefill: 128 rows each)
    pages = ENTRIES_PER_REQ // BS
    comp = torch.empty(B * pages, BS * TOKEN_BYTES, dtype=torch.uint8, device=dev)
    for i in range(0, B * pages * BS, 1 << 18):                          # fill in chunks
        n = min(1 << 18, B * pages * BS - i)
        x = (torch.randn(n, 512, device=dev, generator=g) * 2).bfloat16()
        kv_cache_append(comp, x, torch.arange(i, i + n, device=dev))
    bt = torch.randperm(B * pages, device=dev, generator=g).view(B, pages).int()
    swa_pages = 128 // BS
    swa = torch.empty(B * swa_pages, BS * TOKEN_BYTES, dtype=torch.uint8, device=dev)
    kv_cache_append(swa, (torch.randn(B * 128, 512, device=dev, generator=g) * 2).bfloat16(),
                    torch.arange(B * 128, device=dev))
    # lists: window = the request's 128 ring slots; CSA = K distinct random entries of the request
    sidx = (per_row_req.view(-1, 1) * 128 + torch.arange(Ws, device=dev).view(1, -1)).int()
    ent = torch.argsort(torch.rand(rows, ENTRIES_PER_REQ, device=dev, generator=g), dim=1)[:, :K]
    cidx = (bt[per_row_req.view(-1, 1), ent // BS].long() * BS + ent % BS).int()
    q = (torch.randn(rows, H, 512, device=dev, generator=g) * 0.3).bfloat16()
    sink = torch.randn(H, device=dev, generator=g)
    slen = torch.full((rows,), Ws, dtype=torch.int32, device=dev)
    clen = torch.full((rows,), K, dtype=torch.int32, device=dev)
    return q, swa, sidx.contiguous(), slen, sink, comp, cidx.contiguous(), clen


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results as JSON")
    ap.add_argument("--cases", default="", help="comma-separated substrings selecting cases (default: all)")
    ap.add_argument("--no-ref", action="store_true", help="skip timing the torch reference")
    args = ap.parse_args()
    from dsv4 import registry
    from dsv4.ops.sparse_attention import sparse_attention
    from dsv4.reference.sparse_attention import sparse_attention_paged_ref
    bw = copy_bandwidth()
    peak = bf16_peak()
    rows_out = []
    for name, rows, H, Ws, K, (kind, target) in CASES:
        if args.cases and not any(c.strip() and c.strip() in name for c in args.cases.split(",")):
            continue
        q, swa, sidx, slen, sink, comp, cidx, clen = make_case(rows, H, Ws, K)

        # the public op as users call it (validation + registry dispatch + launch glue; the dsl provider is
        # the registry default for fp8_ds_mla caches on sm_90a)
        def run(q=q, swa=swa, sidx=sidx, slen=slen, sink=sink, comp=comp, cidx=cidx, clen=clen):
            return sparse_attention(q, swa, sidx, slen, sink, cache=comp, indices=cidx, lens=clen)
        run()
        if registry.last_choice("sparse_attention").kind != "dsl":
            raise SystemExit(f"sparse_attention ran {registry.last_choice('sparse_attention').kind}, not dsl: "
                             f"{registry.last_choice('sparse_attention')}")
        from kernels_dsl.sparse_attention import choose_config
        from dsv4.target import Target
        cfg = choose_config(rows, H, Ws + K, Target.of("cuda").sm_count)
        us = time_cuda(run, warmup=3, iters=30, graph=True)
        ref_us = float("nan")
        if not args.no_ref and rows <= 256:
            ref_us = time_cuda(lambda a=(q, swa, sidx, slen, sink, comp, cidx, clen): sparse_attention_paged_ref(*a),
                               warmup=1, iters=5)
        n = Ws + K
        flops = 4.0 * rows * H * 512 * n
        kv_bytes = rows * n * 584.0
        io_bytes = kv_bytes + rows * H * 512 * 2 * 2 + rows * n * 4
        tf = flops / (us * 1e-6) / 1e12
        gbs = kv_bytes / (us * 1e-6) / 1e9
        row = dict(case=name, us=us, tflops=tf, pct_bf16_peak=100 * tf / peak, kv_GBps=gbs, pct_copy_bw=100 * gbs / bw,
                   all_bytes_pct_bw=100 * io_bytes / (us * 1e-6) / 1e9 / bw, splits=cfg.num_splits,
                   ref_us=ref_us, speedup_vs_ref=ref_us / us,
                   target=(f">= {target:.0f} TFLOP/s" if kind == "tflops" else f">= {100 * target:.0f}% copy BW"),
                   met=(tf >= target) if kind == "tflops" else (gbs / bw >= target))
        rows_out.append(row)
        del q, swa, sidx, slen, sink, comp, cidx, clen, run
        torch.cuda.empty_cache()
    print_table(rows_out, ["case", "us", "tflops", "pct_bf16_peak", "kv_GBps", "pct_copy_bw", "all_bytes_pct_bw",
                           "splits", "ref_us", "speedup_vs_ref", "target", "met"],
                title=f"sparse_attention (dsl) on {torch.cuda.get_device_name()}: copy BW {bw:.0f} GB/s, "
                      f"BF16 matmul peak {peak:.0f} TFLOP/s")
    save_json(args.json, {"copy_bandwidth_gbps": bw, "bf16_peak_tflops": peak, "rows": rows_out})


if __name__ == "__main__":
    main()
