"""Benchmark the Lightning Indexer kernels (cuda provider) on the H200.

Decode (paged): B in {1, 32, 128}, 8192 / 32768 entries per sequence (32k / 128k tokens),
next_n 1 and 2, MXFP4 vs FP8 keys. Ratio = key-cache bytes (B * entries * BPT) / time, over
the device-to-device copy bandwidth measured in the same run (read + write bytes / time).
Prefill: 8192 queries x 2048..16384 entries (every query sees every entry, plus one causal
case), TFLOP/s (2 * 64 * 128 * allowed pairs) vs the FP8 dense peak (1716 TFLOP/s, CUTLASS
FP8 GEMM example on this H200; torch._scaled_mm re-measured in the same run).
Baselines: torch eager (dequantize + einsum + ReLU + weighted sum + torch.topk), and
torch.compile of the same function for two shapes.

Times: CUDA-graph replays of calls rotating over enough cache copies to exceed L2 (> 240 MB),
median. Cache contents are random bytes (timing does not depend on values; correctness is the
tests' job).

    PYTHONPATH=. python3 bench/bench_indexer.py --json out.json [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench._util import FP8_PEAK_TFLOPS, copy_bandwidth, print_table, save_json
from dsv4.ops.indexer import FORMATS, indexer_logits, indexer_logits_paged, indexer_topk
from dsv4.registry import use
from bench._util import time_graph as _time_graph

H, D = 64, 128


def time_graph(fns, iters: int = 24, reps: int = 9) -> float:
    return _time_graph(fns, iters, reps)


def time_eager(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def fp8_peak() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.ones(n, 1, device="cuda")
    sb = torch.ones(1, n, device="cuda")
    us = time_eager(lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), iters=10)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def rand_q(rows: int, fmt: str, dev):
    vb, sb = FORMATS[fmt]
    qd = torch.randint(0, 256, (rows, H, vb), dtype=torch.uint8, device=dev)
    if fmt == "fp8":
        qd = torch.randn(rows, H, vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
        return qd, qd[..., :0], torch.randn(rows, H, device=dev)
    qs = torch.full((rows, H, sb), 120, dtype=torch.uint8, device=dev)
    return qd, qs, torch.randn(rows, H, device=dev)


def rand_cache(nblocks: int, fmt: str, dev):
    vb, sb = FORMATS[fmt]
    c = torch.randint(0, 256, (nblocks, 64, vb + sb), dtype=torch.uint8, device=dev)
    flat = c.view(nblocks, -1)
    if fmt == "fp8":  # sane e4m3 values and fp32 scales (random bytes may be NaN: same speed, cleaner)
        flat[:, : 64 * vb] = torch.randn(nblocks, 64 * vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
        flat[:, 64 * vb:] = torch.full((nblocks, 64), 0.5, device=dev).view(torch.uint8)
    else:
        flat[:, 64 * vb:] = 120
    return c


# ---------------------------------------------------------------------------------------------
# torch baselines
def torch_decode(q_real, w, kcache_real, block_table, lens, k):
    """q_real [B, nn, 64, 128] bf16, kcache_real [nb, 64, 128] bf16 -> top-k [B*nn, k]."""
    B, nn = q_real.shape[:2]
    kb = kcache_real[block_table.long()].flatten(1, 2)                   # [B, ctx, 128]
    s = torch.einsum("bnhd,bsd->bnhs", q_real, kb).float().relu_()
    logits = torch.einsum("bnhs,bnh->bns", s, w.view(B, nn, H)).flatten(0, 1)
    cols = torch.arange(logits.shape[1], device=logits.device)
    logits = logits.masked_fill(cols[None] >= lens.view(-1, 1), float("-inf"))
    return torch.topk(logits, k, dim=1).indices


def torch_dequant_mxfp4_cache(cache):
    """uint8 [nb, 64, 68] -> bf16 [nb, 64, 128] (LUT decode in torch)."""
    nb = cache.shape[0]
    flat = cache.view(nb, -1)
    v = flat[:, : 64 * 64].view(nb, 64, 64)
    s = flat[:, 64 * 64:].view(nb, 64, 4)
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device=cache.device)
    vals = torch.stack((lut[(v & 15).long()], lut[(v >> 4).long()]), -1).flatten(-2)   # [nb, 64, 128]
    sc = torch.exp2(s.float() - 127).repeat_interleave(32, -1)
    return (vals * sc).to(torch.bfloat16)


def bench_decode(args, bw, rows_out, dev):
    Bs = [1, 32, 128] if not args.quick else [1, 32]
    for entries in (8192, 32768):
        for B in Bs:
            for nn in (1, 2):
                for fmt in ("mxfp4", "fp8"):
                    bpt = sum(FORMATS[fmt])
                    mb = entries // 64
                    cache_bytes = B * mb * 64 * bpt
                    nrot = max(1, min(16, -(-(240 << 20) // cache_bytes)))
                    caches = [rand_cache(B * mb, fmt, dev) for _ in range(nrot)]
                    bt = torch.randperm(B * mb, device=dev).to(torch.int32).reshape(B, mb)
                    qd, qs, w = rand_q(B * nn, fmt, dev)
                    qd4, qs4 = qd.reshape(B, nn, H, -1), qs.reshape(B, nn, H, -1)
                    lens = torch.full((B,), entries, dtype=torch.int32, device=dev)
                    outs = {}

                    def mk(c):
                        def f():
                            outs["l"] = indexer_logits_paged(qd4, qs4, w, c, lens, bt, fmt=fmt)
                        return f
                    with use(indexer_logits_paged="cuda"):
                        us = time_graph([mk(c) for c in caches])
                        lens2 = (lens[:, None] - nn + 1 + torch.arange(nn, device=dev)).to(torch.int32).reshape(-1)
                        logits = outs["l"]
                        try:
                            us_topk = time_graph([lambda: indexer_topk(logits, lens2, 512)])
                        except Exception as e:  # noqa: BLE001
                            us_topk = float("nan")
                            print("topk timing failed:", e, file=sys.stderr)
                    kbytes = B * entries * bpt
                    r = dict(kind="decode", fmt=fmt, B=B, entries=entries, next_n=nn, us=us,
                             key_GBps=kbytes / us / 1e3, pct_copy_bw=100 * kbytes / us / 1e3 / bw,
                             out_MB=B * nn * entries * 4 / 1e6, us_topk512=us_topk)
                    if fmt == "mxfp4" and ((B == 32 and nn == 1) or (B == 128 and entries == 8192 and nn == 1)) \
                            and not args.no_baseline:
                        kreal = torch_dequant_mxfp4_cache(caches[0])
                        qreal = torch.randn(B, nn, H, D, device=dev, dtype=torch.bfloat16)

                        def base():
                            return torch_decode(qreal, w, torch_dequant_mxfp4_cache(caches[0]), bt, lens2, 512)
                        r["torch_eager_us"] = time_eager(base)
                        if args.compile and B == 32:
                            cf = torch.compile(lambda: torch_decode(qreal, w, torch_dequant_mxfp4_cache(caches[0]),
                                                                    bt, lens2, 512))
                            r["torch_compile_us"] = time_eager(cf)
                        del kreal
                    rows_out.append(r)
                    del caches
                    torch.cuda.empty_cache()


def bench_prefill(args, peak_meas, rows_out, dev):
    T = 8192
    sizes = [2048, 4096, 8192, 16384] if not args.quick else [4096, 16384]
    for S in sizes:
        for fmt in ("mxfp4", "fp8"):
            for causal in (False, True) if S == 8192 else (False,):
                qd, qs, w = rand_q(T, fmt, dev)
                vb, sb = FORMATS[fmt]
                kd = torch.randint(0, 256, (S, vb), dtype=torch.uint8, device=dev)
                ksf = torch.full((S, sb), 120, dtype=torch.uint8, device=dev)
                if fmt == "fp8":
                    kd = torch.randn(S, vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
                    ksf = torch.full((S,), 0.5, device=dev).view(torch.uint8).reshape(S, 4)
                ks = torch.zeros(T, dtype=torch.int32, device=dev)
                if causal:  # queries are the last T tokens of a 4S-token sequence
                    pos = torch.arange(4 * S - T, 4 * S, device=dev)
                    ke = ((pos + 1) // 4).to(torch.int32)
                else:
                    ke = torch.full((T,), S, dtype=torch.int32, device=dev)
                pairs = int((ke - ks).sum())
                with use(indexer_logits="cuda"):
                    us = time_graph([lambda: indexer_logits(qd, qs, w, kd, ksf, ks, ke, fmt=fmt)], iters=4, reps=5)
                tf = 2 * H * D * pairs / (us * 1e-6) / 1e12
                r = dict(kind="prefill", fmt=fmt, T=T, S=S, causal=causal, us=us, TFLOPs=tf,
                         pct_fp8_peak_1716=100 * tf / FP8_PEAK_TFLOPS, pct_fp8_peak_measured=100 * tf / peak_meas)
                if fmt == "mxfp4" and not causal and S in (4096, 16384) and not args.no_baseline:
                    qreal = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
                    kreal = torch.randn(S, D, device=dev, dtype=torch.bfloat16)

                    def base():
                        outs = []
                        for t0 in range(0, T, 1024):  # chunked to bound memory (T x 64 x S fp32)
                            s = torch.einsum("thd,sd->ths", qreal[t0:t0 + 1024], kreal).float().relu_()
                            outs.append(torch.einsum("ths,th->ts", s, w[t0:t0 + 1024]))
                        return torch.topk(torch.cat(outs), 512, dim=1).indices
                    r["torch_eager_us"] = time_eager(base, iters=3)
                rows_out.append(r)
                torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile baselines")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    peak = fp8_peak()
    print(f"copy bandwidth {bw:.0f} GB/s (read+write); torch._scaled_mm FP8 8192^3 {peak:.0f} TFLOP/s; "
          f"FP8 peak used for ratios {FP8_PEAK_TFLOPS:.0f} TFLOP/s (CUTLASS example)")
    rows: list[dict] = []
    if args.only in (None, "decode"):
        bench_decode(args, bw, rows, dev)
        print_table([r for r in rows if r["kind"] == "decode"],
                    ["fmt", "B", "entries", "next_n", "us", "key_GBps", "pct_copy_bw", "us_topk512",
                     "torch_eager_us", "torch_compile_us"], title="\ndecode (paged) logits")
    if args.only in (None, "prefill"):
        bench_prefill(args, peak, rows, dev)
        print_table([r for r in rows if r["kind"] == "prefill"],
                    ["fmt", "T", "S", "causal", "us", "TFLOPs", "pct_fp8_peak_1716", "pct_fp8_peak_measured",
                     "torch_eager_us"], title="\nprefill logits")
    import os
    save_json(args.json, {"fastdec": os.environ.get("DSV4_INDEXER_FASTDEC", "1"), "copy_GBps": bw, "fp8_scaled_mm_TFLOPs": peak, "fp8_peak_ref": FP8_PEAK_TFLOPS,
                          "rows": rows})


if __name__ == "__main__":
    main()
