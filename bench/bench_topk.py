"""Benchmark the topk op (cuda provider): every launch configuration on the DSV4 shapes, sorted and
unsorted, the fused index transforms, vs torch.topk and the HBM byte floor, on the H200.

``--same-run``: ours vs FlashInfer (imported when available: ``source .peers/flashinfer/activate.sh``) and
kernel variants (``--variant NAME=SOURCE[,pdl]``: another ``topk_kernel`` source with the same signature,
optionally launched with programmatic dependent launch) on the FlashInfer tool's shapes and fused transforms,
INTERLEAVED: every candidate's CUDA graph (a fixed ``--n-inner`` back-to-back calls on rotating inputs, L2
cold) is built once, then ``--rounds`` rounds replay every graph in turn (order rotated per round), after a
clock warm-up; reported: median of the round medians and the spread (max - min) / median. Also the timing
artifact of a graph of 1-3 calls (what the shared tool's n_inner becomes when its one-call estimate is the
op's plan-recording call) and, with ``--kernel-times``, the kernels' device durations (profiler).

Times are per call, from CUDA-graph replays of up to 256 calls that rotate through input copies
(>= 256 MB in all, at most 256 copies: L2 cold, as .peers/flashinfer/bench_flashinfer_topk.py does),
median of REPS replays. Floor = rows * stride * 4 B / measured device-to-device copy bandwidth.
Every configuration's output is checked bitwise against the torch reference in both orders (sorted;
sorted=False, the op's default: ascending position) before it is timed.

    PYTHONPATH=. python3 bench/bench_topk.py [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import functools
import math

import torch

from bench._util import CallGraph, copy_bandwidth, event_us, save_json, time_graph

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
    ap.add_argument("--same-run", action="store_true", help="interleaved ours / FlashInfer / variants (see above)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n-inner", type=int, default=128, help="calls per graph (--same-run)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=SOURCE[,pdl]")
    ap.add_argument("--shapes", default="", help="--same-run: comma-separated indices into the tool's shapes, "
                                                 "'pt', 'rg' (fused cases) or RxNxK; default the tool's 5 + 2")
    ap.add_argument("--no-fi", action="store_true", help="--same-run without FlashInfer")
    ap.add_argument("--kernel-times", action="store_true", help="--same-run: device durations per kernel (profiler)")
    args = ap.parse_args()
    if args.same_run:
        return same_run(args)
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


# ---------------------------------------------------------------------------------------------------------------
# --same-run: interleaved rounds, ours vs FlashInfer vs kernel variants

FI_SHAPES = [(64, 65536, 512), (64, 131072, 1024), (1, 129280, 1024), (128, 8192, 512), (32, 32768, 512)]


def _flashinfer():
    """(flashinfer, tvm_ffi) when the peer bundle is on the path (.peers/flashinfer/activate.sh), else None."""
    try:
        import flashinfer
        import flashinfer.topk
        import tvm_ffi
        flashinfer.topk.get_topk_module()
        return flashinfer, tvm_ffi
    except Exception as e:  # noqa: BLE001
        print(f"# FlashInfer not available: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None


def _fi_ctx(tvm_ffi, algo):
    import contextlib
    import os

    @contextlib.contextmanager
    def ctx():
        old = os.environ.get("FLASHINFER_TOPK_ALGO")
        os.environ["FLASHINFER_TOPK_ALGO"] = algo
        try:
            with tvm_ffi.use_torch_stream():
                yield
        finally:
            if old is None:
                os.environ.pop("FLASHINFER_TOPK_ALGO", None)
            else:
                os.environ["FLASHINFER_TOPK_ALGO"] = old
    return ctx


def _graph(fn, xs, n, ctx=None):
    """A :class:`bench._util.CallGraph` of ``n`` back-to-back calls ``fn(xs[i % len(xs)])`` (3 eager warm-up calls)."""
    return CallGraph([lambda x=x: fn(x) for x in xs], n, ctx, warm=3)


def _rounds(graphs: dict, rounds: int, reps: int) -> dict:
    """Interleaved: per round every graph's median of ``reps`` replays, the order rotated per round."""
    import statistics
    names = list(graphs)
    per = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            per[n].append(graphs[n].time(reps))
    out = {}
    for n, v in per.items():
        med = statistics.median(v)
        out[n] = {"us": med, "min": min(v), "max": max(v), "spread": (max(v) - min(v)) / med, "rounds": v}
    return out


def _warm_clocks(g, seconds: float = 0.3) -> None:
    import time
    t0 = time.time()
    while time.time() - t0 < seconds:
        g.g.replay()
        torch.cuda.synchronize()


def _kernel_times(graphs: dict) -> dict:
    """Average device duration (us) of each kernel name in one replay of every graph (torch.profiler / CUPTI)."""
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for name, g in graphs.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.g.replay()
            torch.cuda.synchronize()
        ks = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time", None)
            if t is None:
                t = getattr(e, "cuda_time", 0.0)
            if e.count >= g.n and t > 0:
                ks[e.key[:60]] = (round(t, 2), e.count)
        out[name] = ks
    return out


def _parse_variants(specs):
    out = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        parts = rest.split(",")
        out.append((name, parts[0] or "topk.cu", "pdl" in parts[1:]))
    return out


def _same_run_cands(case, xs, rows, n, k, variants, fi):
    """(label, {name: (fn(x), capture context or None, reference on xs[0] or None (FlashInfer))})."""
    import dsv4
    from dsv4.reference.topk import topk_ref
    from kernels_cuda.topk import topk_cuda
    fused = case in ("pt", "rg")
    cands = {}
    if not fused:
        L = torch.full((rows,), n, dtype=torch.int32, device="cuda")
        ref_u, ref_s = topk_ref(xs[0], L, k, sorted=False), topk_ref(xs[0], L, k)
        cands["ours"] = (lambda x: dsv4.topk(x, L, k, return_scores=True), None, ref_u)
        cands["ours sorted"] = (lambda x: dsv4.topk(x, L, k, return_scores=True, sorted=True), None, ref_s)
        for vn, src, pdl in variants:
            cands[vn] = (lambda x, s=src, p=pdl: topk_cuda(x, L, k, pdl=p, source=s), None, ref_u)
        if fi:
            for algo, nm in (("default", "FI radix"), ("cub", "FI cub")):
                cands[nm] = (lambda x: fi[0].top_k(x, k), _fi_ctx(fi[1], algo), None)
        label = f"[{rows},{n}] k={k}"
    else:
        g = torch.Generator(device="cpu").manual_seed(5)
        lengths = torch.randint(n // 2, n + 1, (rows,), generator=g, dtype=torch.int32).cuda()
        bs = 64
        bt = torch.randperm(rows * (n // bs), generator=g).view(rows, n // bs).to(torch.int32).cuda()
        ends = torch.randint(n // 2, n + 1, (rows,), generator=g, dtype=torch.int32).cuda()
        starts = (ends.cpu() * torch.rand(rows, generator=g) * 0.25).to(torch.int32).cuda()
        fi_len = (ends - starts).contiguous()
        if case == "pt":
            label = "page_table [64,65536] k=512"
            cands["ours"] = (lambda x: dsv4.topk(x, lengths, k, block_table=bt, block_size=bs), None,
                             topk_ref(xs[0], lengths, k, None, bt, bs, sorted=False)[0])
            for vn, src, pdl in variants:
                cands[vn] = (lambda x, s=src, p=pdl: topk_cuda(x, lengths, k, None, bt, bs, pdl=p, source=s)[0],
                             None, cands["ours"][2])
            if fi:
                for algo, nm in (("default", "FI radix"), ("cub", "FI cub")):
                    cands[nm] = (lambda x: fi[0].top_k_page_table_transform(x, bt, lengths, k, page_size=bs),
                                 _fi_ctx(fi[1], algo), None)
        else:
            label = "ragged/starts [64,65536] k=512"
            cands["ours"] = (lambda x: dsv4.topk(x, ends, k, starts=starts), None,
                             topk_ref(xs[0], ends, k, starts, sorted=False)[0])
            for vn, src, pdl in variants:
                cands[vn] = (lambda x, s=src, p=pdl: topk_cuda(x, ends, k, starts, pdl=p, source=s)[0], None,
                             cands["ours"][2])
            if fi:
                for algo, nm in (("default", "FI radix"), ("cub", "FI cub")):
                    cands[nm] = (lambda x: fi[0].top_k_ragged_transform(x, starts, fi_len, k, row_starts=starts),
                                 _fi_ctx(fi[1], algo), None)
    return label, cands


def same_run(args):
    import time

    import dsv4
    fi = None if args.no_fi else _flashinfer()
    variants = _parse_variants(args.variant)
    sel = [s for s in args.shapes.split(",") if s] or [str(i) for i in range(len(FI_SHAPES))] + ["pt", "rg"]
    res = {"gpu": torch.cuda.get_device_name(), "n_inner": args.n_inner, "rounds": args.rounds, "reps": args.reps,
           "flashinfer": getattr(fi[0], "__version__", None) if fi else None, "cases": []}
    print(f"# same-run: {res['gpu']}, FlashInfer {res['flashinfer']}, graphs of {args.n_inner} calls, "
          f"{args.rounds} interleaved rounds x median of {args.reps} replays; variants {variants}", flush=True)

    # the shared tool's one-call estimate: host + device time of the 1st / 2nd / 3rd eager call of a new signature
    x0 = torch.randn(64, 65536, device="cuda")
    L0 = torch.full((64,), 65536, dtype=torch.int32, device="cuda")
    est = []
    for _ in range(4):
        torch.cuda.synchronize()
        est.append(round(event_us(functools.partial(dsv4.topk, x0, L0, 511, return_scores=True)), 1))
    res["eager_call_us_1st_to_4th"] = est
    print(f"# eager call 1..4 of a new signature (event time, us; the tool sizes its graph from the 2nd): {est}",
          flush=True)
    del x0

    for case in sel:
        t0 = time.time()
        fused = case in ("pt", "rg")
        if fused:
            rows, n, k = 64, 65536, 512
        elif "x" in case:                                    # e.g. 1x32768x512: a shape of your own
            rows, n, k = (int(v) for v in case.split("x"))
        else:
            rows, n, k = FI_SHAPES[int(case)]
        nbytes = rows * n * 4
        nb = 16 if fused else int(min(256, max(2, -(-(256 << 20) // nbytes))))
        torch.manual_seed(0)
        xs = [torch.randn(rows, n, device="cuda") for _ in range(nb)]
        label, cands = _same_run_cands(case, xs, rows, n, k, variants, fi)
        checks = {}
        # correctness on xs[0]: ours / variants bitwise == the torch reference; FlashInfer the same index sets
        ours0 = cands["ours"][0](xs[0])
        oi = ours0[0] if isinstance(ours0, tuple) else ours0
        for nm, (fn, ctx, ref) in cands.items():
            try:
                import contextlib
                with (ctx or contextlib.nullcontext)():
                    out = fn(xs[0])
                if ref is not None:
                    if isinstance(ref, tuple):
                        ok = torch.equal(out[0], ref[0]) and torch.equal(out[1].view(torch.int32),
                                                                         ref[1].view(torch.int32))
                    else:
                        ok = torch.equal(out if not isinstance(out, tuple) else out[0], ref)
                else:
                    fidx = (out[1] if isinstance(out, tuple) else out).to(torch.int64)
                    big = torch.iinfo(torch.int64).max
                    a = torch.sort(torch.where(oi < 0, big, oi.to(torch.int64)), 1).values
                    b = torch.sort(torch.where(fidx < 0, big, fidx), 1).values
                    ok = torch.equal(a, b)
                checks[nm] = bool(ok)
            except Exception as e:  # noqa: BLE001
                checks[nm] = f"{type(e).__name__}: {str(e)[:200]}"
        graphs = {}
        for nm, (fn, ctx, _) in cands.items():
            if checks[nm] is not True and not isinstance(checks[nm], bool):
                continue
            try:
                graphs[nm] = _graph(fn, xs, args.n_inner, ctx)
            except Exception as e:  # noqa: BLE001
                checks[nm] = f"graph: {type(e).__name__}: {str(e)[:200]}"
        if case == sel[0]:   # the graph-size artifact: the op in graphs of 1 / 3 calls (same run)
            for m in (1, 3):
                graphs[f"ours n_inner={m}"] = _graph(cands["ours"][0], xs, m)
            if fi:
                graphs["FI cub n_inner=1"] = _graph(cands["FI cub"][0], xs, 1, cands["FI cub"][1])
        _warm_clocks(next(iter(graphs.values())))
        t = _rounds(graphs, args.rounds, args.reps)
        kt = None
        if args.kernel_times:
            try:
                kt = _kernel_times(graphs)
            except Exception as e:  # noqa: BLE001 - a diagnostic
                kt = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        fi_best = min([t[c]["us"] for c in ("FI cub", "FI radix") if c in t], default=float("nan"))
        row = {"case": label, "times": t, "checks": checks, "fi_best": fi_best, "kernel_times": kt}
        res["cases"].append(row)
        print(f"{label} ({time.time() - t0:.1f}s): " + "; ".join(
            f"{nm} {v['us']:.2f} [{v['min']:.2f}-{v['max']:.2f}]{'' if checks.get(nm, True) is True else ' CHECK=' + str(checks[nm])}"
            + (f" ({fi_best / v['us']:.2f}x)" if not math.isnan(fi_best) and not nm.startswith("FI") else "")
            for nm, v in t.items()), flush=True)
        if kt:
            print(f"  kernel times: {kt}", flush=True)
        bad = {nm: c for nm, c in checks.items() if c is not True}
        if bad:
            print(f"  NOT TIMED / WRONG: {bad}", flush=True)
        del graphs, xs
        torch.cuda.empty_cache()
    print()
    names = []
    for r in res["cases"]:
        names += [nm for nm in r["times"] if nm not in names and "n_inner" not in nm]
    print("SAME-RUN TABLE (per-call us, median of rounds [spread %]; ratio = best FI / ours)")
    print(f"{'case':>30} | " + " | ".join(f"{nm:>16}" for nm in names) + " | best FI / ours | best FI / best variant")
    for r in res["cases"]:
        cells = []
        for nm in names:
            v = r["times"].get(nm)
            cells.append(f"{v['us']:8.2f} [{100 * v['spread']:3.0f}%]" if v else f"{'-':>16}")
        o = r["times"].get("ours")
        ratio = f"{r['fi_best'] / o['us']:.2f}x" if o and not math.isnan(r["fi_best"]) else "-"
        vs = [(v["us"], nm) for nm, v in r["times"].items()
              if not nm.startswith("FI") and "n_inner" not in nm and "sorted" not in nm]
        bv = min(vs) if vs else None
        ratio_v = f"{r['fi_best'] / bv[0]:.2f}x ({bv[1]})" if bv and not math.isnan(r["fi_best"]) else "-"
        print(f"{r['case']:>30} | " + " | ".join(cells) + f" | {ratio:>14} | {ratio_v}")
    save_json(args.json, res)


if __name__ == "__main__":
    main()
