"""Benchmark the topk op (cuda provider): every launch configuration on the DSV4 shapes, sorted and
unsorted, the fused index transforms, vs torch.topk and the HBM byte floor, on the H200.

Times are per call, from CUDA-graph replays of up to 256 calls that rotate through input copies
(>= 256 MB in all, at most 256 copies: L2 cold, as .peers/flashinfer/bench_flashinfer_topk.py does),
median of REPS replays. Floor = rows * stride * 4 B / measured device-to-device copy bandwidth.
Every configuration's output is checked bitwise against the torch reference in both orders (sorted;
sorted=False, the op's default: ascending position) before it is timed.

    PYTHONPATH=. python3 bench/bench_topk.py [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse

import torch

from bench._util import copy_bandwidth, save_json, time_graph

SHAPES = [(64, 65536, 512), (64, 131072, 1024), (1, 129280, 1024), (128, 8192, 512), (32, 32768, 512),
          (1, 32768, 512), (4, 65536, 512)]   # the last two: decode batches of 1-4 rows
#: (cluster CTAs per row, threads, row slice in registers) timed besides the default, per shape
ALTERNATIVES = {
    (64, 65536): [(2, 1024, False), (4, 1024, True), (8, 512, True)],
    (64, 131072): [(2, 1024, False), (4, 1024, False)],
    (1, 129280): [(8, 1024, True), (16, 1024, True), (16, 512, True)],
    (128, 8192): [(1, 512, True), (1, 1024, True), (2, 256, True)],
    (32, 32768): [(2, 1024, True), (4, 1024, True), (4, 512, True)],
    (1, 32768): [(2, 1024, True), (4, 512, True), (8, 512, True)],
    (4, 65536): [(4, 1024, True), (8, 512, True)],
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    import dsv4
    from dsv4.reference.topk import topk_ref
    from dsv4.target import Target
    from kernels_cuda.topk import TopkConfig, default_config, topk_cuda
    sm = Target.of(torch.device("cuda")).sm_count
    bw = copy_bandwidth() * 1e9                       # bytes/s (read + write)
    res = {"gpu": torch.cuda.get_device_name(), "sm_count": sm, "copy_bw_GBps": bw / 1e9, "rows": []}
    print(f"# {res['gpu']}, {sm} SMs, d2d copy bandwidth {bw / 1e9:.0f} GB/s (read+write)", flush=True)

    def timed(fn_of_x, xs):
        n = min(256, len(xs))
        return time_graph([lambda x=x: fn_of_x(x) for x in xs[:n]], iters=n, reps=args.reps)

    for rows, n, k in SHAPES:
        nbytes = rows * n * 4
        nb = int(min(256, max(2, -(-(256 << 20) // nbytes))))
        g = torch.Generator(device="cuda").manual_seed(0)
        xs = [torch.randn(rows, n, device="cuda", generator=g) for _ in range(nb)]
        L = torch.full((rows,), n, dtype=torch.int32, device="cuda")
        wi, ws = topk_ref(xs[0], L, k)
        ui, us_ = topk_ref(xs[0], L, k, sorted=False)
        dflt = default_config(rows, n, sm)
        row = {"rows": rows, "stride": n, "k": k, "bytes": nbytes, "default": dflt.explain(), "configs": {},
               "exact": True}
        cfgs = [dflt] + ([TopkConfig(*c) for c in ALTERNATIVES.get((rows, n), []) if TopkConfig(*c) != dflt]
                         if not args.quick else [])
        for cfg in cfgs:
            for srt in (True, False):
                name = f"{cfg.cluster}x{cfg.threads}{'r' if cfg.resident else 's'}{'-sorted' if srt else ''}"
                try:
                    gi, gs = topk_cuda(xs[0], L, k, sorted=srt, config=cfg)
                    ri, rs = (wi, ws) if srt else (ui, us_)
                    ok = bool(torch.equal(gi, ri) and torch.equal(gs.view(torch.int32), rs.view(torch.int32)))
                    us = timed(lambda x, c=cfg, s=srt: topk_cuda(x, L, k, sorted=s, config=c), xs)
                except Exception as e:  # noqa: BLE001
                    ok, us = False, float("nan")
                    print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                row["configs"][name] = {"us": us, "exact": ok}
                row["exact"] &= ok
                if not ok:
                    print(f"  [{rows}, {n}] {name}: NOT EXACT vs reference", flush=True)
        row["op_us"] = timed(lambda x: dsv4.topk(x, L, k, return_scores=True), xs)     # the public op, default
        row["op_sorted_us"] = timed(lambda x: dsv4.topk(x, L, k, return_scores=True, sorted=True), xs)
        row["k16_us"] = timed(lambda x: topk_cuda(x, L, 16, config=dflt), xs)      # the k-independent part
        row["torch_topk_us"] = timed(lambda x: torch.topk(x, k, dim=1), xs[:64])
        row["floor_us"] = nbytes / bw * 1e6
        # data-dependent paths: indexer-like (relu sums) and candidate overflow (narrow range)
        xi = [torch.relu(torch.randn(rows, n, 4, device="cuda", generator=g)).sum(-1) for _ in range(min(nb, 16))]
        ii, si = topk_cuda(xi[0], L, k)
        row["exact"] &= bool(torch.equal(ii, topk_ref(xi[0], L, k, sorted=False)[0]))
        row["indexer_data_us"] = timed(lambda x: topk_cuda(x, L, k), xi)
        del xi
        xn = [1.0 + torch.rand(rows, n, device="cuda", generator=g) * 2.0 ** -12 for _ in range(min(nb, 16))]
        io, so = topk_cuda(xn[0], L, k)
        row["exact"] &= bool(torch.equal(io, topk_ref(xn[0], L, k, sorted=False)[0]))
        row["overflow_path_us"] = timed(lambda x: topk_cuda(x, L, k), xn)
        del xn
        res["rows"].append(row)
        print(f"[{rows}, {n}] k={k}: op {row['op_us']:.2f} us (sorted {row['op_sorted_us']:.2f}), "
              + ", ".join(f"{c} {v['us']:.2f}{'' if v['exact'] else ' WRONG'}" for c, v in row["configs"].items())
              + f"; k=16 {row['k16_us']:.2f}; torch.topk {row['torch_topk_us']:.1f}; indexer data {row['indexer_data_us']:.2f}, overflow "
              f"{row['overflow_path_us']:.1f}; exact {row['exact']}", flush=True)
        del xs
        torch.cuda.empty_cache()

    # fused index transforms at [64, 65536] k=512 (the FlashInfer peer script's cases)
    rows, n, k, bs = 64, 65536, 512, 64
    g = torch.Generator(device="cpu").manual_seed(5)
    xs = [torch.randn(rows, n, device="cuda") for _ in range(16)]
    lengths = torch.randint(n // 2, n + 1, (rows,), generator=g, dtype=torch.int32).cuda()
    bt = torch.randperm(rows * (n // bs), generator=g).view(rows, n // bs).to(torch.int32).cuda()
    ends = torch.randint(n // 2, n + 1, (rows,), generator=g, dtype=torch.int32).cuda()
    starts = (ends.cpu() * torch.rand(rows, generator=g) * 0.25).to(torch.int32).cuda()
    fused = {}
    for name, fn, ref in (
            ("page_table", lambda x, s=False: dsv4.topk(x, lengths, k, block_table=bt, block_size=bs, sorted=s),
             lambda x, s=False: topk_ref(x, lengths, k, None, bt, bs, sorted=s)[0]),
            ("ragged_starts", lambda x, s=False: dsv4.topk(x, ends, k, starts=starts, sorted=s),
             lambda x, s=False: topk_ref(x, ends, k, starts, sorted=s)[0])):
        ok = bool(torch.equal(fn(xs[0]), ref(xs[0])) and torch.equal(fn(xs[0], True), ref(xs[0], True)))
        fused[name] = {"us": timed(fn, xs), "sorted_us": timed(lambda x: fn(x, True), xs), "exact": ok}
        print(f"fused {name}: {fused[name]['us']:.2f} us (sorted {fused[name]['sorted_us']:.2f}), exact {ok}",
              flush=True)
    res["fused"] = fused
    print()
    print(f"{'shape':>16} {'k':>5} | {'op':>7} {'sorted':>8} | {'best cfg':>22} | {'torch.topk':>10} | {'floor':>6} | exact")
    for r in res["rows"]:
        best = min(r["configs"].items(), key=lambda kv: kv[1]["us"] if kv[1]["us"] == kv[1]["us"] else 1e9)
        print(f"{'[%d, %d]' % (r['rows'], r['stride']):>16} {r['k']:>5} | {r['op_us']:7.2f} {r['op_sorted_us']:8.2f} | "
              f"{best[0]:>15} {best[1]['us']:6.2f} | {r['torch_topk_us']:10.1f} | {r['floor_us']:6.2f} | {r['exact']}")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
