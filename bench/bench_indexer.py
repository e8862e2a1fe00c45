"""Benchmark the Lightning Indexer kernels (cuda provider) on the H200: the issue-4 table in one run.

Decode (paged): B in {1, 32, 128} x 8192 / 32768 entries per sequence (32k / 128k tokens) x
next_n 1 and 2, MXFP4 and FP8 keys, each on both MMA paths ("fp8mma" = wgmma k32 e4m3, "bf16mma"
= wgmma k16 BF16; FP8 keys also "fp8mma_fold" / "fp8mma_nofold", not exact) and NVFP4 rows (BF16
path). Ratio = key-cache bytes (B * entries * BPT) / time over the device-to-device copy bandwidth
measured in the same run (read + write bytes / time). `top-512` = the registry top-k op on the
produced logits.
Prefill: 8192 queries x 2048..16384 entries (every query sees every entry, plus one causal
case), TFLOP/s (2 * 64 * 128 * allowed pairs) vs the FP8 dense peak (1716 TFLOP/s, CUTLASS
FP8 GEMM example on this H200) and vs torch._scaled_mm 8192^3 measured in the same run.
Baselines in the same process: torch eager (dequantize MXFP4 keys + einsum + ReLU + weighted
sum + torch.topk(512)) on every decode shape with MXFP4 keys (next_n 1) and two prefill shapes,
and torch.compile of the same function on representative rows only (decode B=32 x 32768 and
B=128 x 8192, prefill 8192 x 4096; each compile costs 10-40 s), skipped when --budget runs out.

Times: CUDA-graph replays of calls rotating over enough cache copies to exceed L2 (> 240 MB),
median. Cache contents are random bytes (timing does not depend on values; correctness is the
tests' job).

    PYTHONPATH=. python3 bench/bench_indexer.py --json out.json [--quick] [--budget 170]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench._util import FP8_PEAK_TFLOPS, copy_bandwidth, print_table, save_json, time_cuda
from dsv4.ops.indexer import FORMATS, indexer_logits, indexer_logits_paged, indexer_topk
from dsv4.registry import use
from bench._util import time_graph as _time_graph

H, D = 64, 128
# shapes (module constants so that a CPU smoke run can shrink them)
DECODE_ENTRIES = (8192, 32768)
DECODE_BS = (1, 32, 128)
PREFILL_T = 8192
PREFILL_SIZES = (2048, 4096, 8192, 16384)


def time_graph(fns, iters: int = 24, reps: int = 9) -> float:
    return _time_graph(fns, iters, reps)


def time_eager(fn, iters: int = 5) -> float:
    """Median microseconds of eager ``fn()`` after one warm-up call (bench._util.time_cuda)."""
    return time_cuda(fn, warmup=1, iters=iters)


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
    qs = torch.full((rows, H, sb), 120 if fmt == "mxfp4" else 0x38, dtype=torch.uint8, device=dev)
    return qd, qs, torch.randn(rows, H, device=dev)


def rand_cache(nblocks: int, fmt: str, dev):
    vb, sb = FORMATS[fmt]
    c = torch.randint(0, 256, (nblocks, 64, vb + sb), dtype=torch.uint8, device=dev)
    flat = c.view(nblocks, -1)
    if fmt == "fp8":  # sane e4m3 values and fp32 scales (random bytes may be NaN: same speed, cleaner)
        flat[:, : 64 * vb] = torch.randn(nblocks, 64 * vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
        flat[:, 64 * vb:] = torch.full((nblocks, 64), 0.5, device=dev).view(torch.uint8)
    else:
        flat[:, 64 * vb:] = 120 if fmt == "mxfp4" else 0x38   # UE8M0 2^-7 / E4M3 1.0
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


VARIANTS = {  # (fmt, variant) -> env of kernels_cuda/indexer.py
    ("mxfp4", "fp8mma"): {"DSV4_INDEXER_MMA": "fp8"},
    # opt-in tuning knobs of the FP8 path (kernels_cuda/indexer.py env switches)
    ("mxfp4", "fp8mma_cpasync"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_BULK": "0"},
    ("mxfp4", "fp8mma_defer"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_BULK": "0", "DSV4_INDEXER_DEFER": "1"},
    ("mxfp4", "fp8mma_bulk_defer"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_BULK": "1", "DSV4_INDEXER_DEFER": "1"},
    ("mxfp4", "fp8mma_acc1"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_BULK": "0", "DSV4_INDEXER_DECODE_ACCBUF": "1"},  # decode nn=1 knob
    ("mxfp4", "fp8mma_split"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_BULK": "0", "DSV4_INDEXER_SPLIT_NN": "1"},      # decode nn>1 knob
    ("fp8", "fp8mma_nofold_split"): {"DSV4_INDEXER_FP8_KEYS": "nofold", "DSV4_INDEXER_SPLIT_NN": "1"},
    ("mxfp4", "bf16mma"): {"DSV4_INDEXER_MMA": "bf16"},
    ("mxfp4", "fp8mma_nq1"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_PREFILL_NQ": "1"},   # prefill tuning
    ("mxfp4", "fp8mma_nq3"): {"DSV4_INDEXER_MMA": "fp8", "DSV4_INDEXER_PREFILL_NQ": "3"},
    ("fp8", "bf16mma"): {"DSV4_INDEXER_FP8_KEYS": "bf16"},
    ("fp8", "fp8mma_fold"): {"DSV4_INDEXER_FP8_KEYS": "fold"},
    ("fp8", "fp8mma_nofold"): {"DSV4_INDEXER_FP8_KEYS": "nofold"},
    ("nvfp4", "bf16mma"): {},
}
_ENV_KEYS = ("DSV4_INDEXER_MMA", "DSV4_INDEXER_FP8_KEYS", "DSV4_INDEXER_PREFILL_NQ", "DSV4_INDEXER_BULK",
             "DSV4_INDEXER_DECODE_ACCBUF", "DSV4_INDEXER_DEFER", "DSV4_INDEXER_SPLIT_NN")


class variant_env:
    """Set the env switches of one MMA variant (restored on exit)."""

    def __init__(self, fmt, variant):
        self.env = VARIANTS[(fmt, variant)]

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in _ENV_KEYS}
        for k in _ENV_KEYS:
            os.environ.pop(k, None)
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.time(), seconds

    def left(self):
        return self.seconds - (time.time() - self.t0)


def _gscale(fmt, dev):
    return torch.ones(1, device=dev) if fmt == "nvfp4" else None


def _decode_variants(fmt, quick):
    if fmt == "mxfp4":
        return ["fp8mma", "bf16mma"]  # + tuning knobs (bench_decode / bench_prefill)
    if fmt == "fp8":
        return ["bf16mma", "fp8mma_fold"] if quick else ["bf16mma", "fp8mma_fold", "fp8mma_nofold"]
    return ["bf16mma"]


def bench_decode(args, bw, rows_out, dev, budget):
    Bs = list(DECODE_BS) if not args.quick else list(DECODE_BS[:2])
    E = DECODE_ENTRIES
    shapes = [(e, B, nn, fmt) for e in E for B in Bs for nn in (1, 2) for fmt in ("mxfp4", "fp8")]
    shapes += [(E[-1], Bs[min(1, len(Bs) - 1)], 1, "nvfp4"), (E[0], Bs[-1], 2, "nvfp4")]
    for entries, B, nn, fmt in shapes:
        if budget.left() < 0:
            print(f"budget exhausted: skipping decode {fmt} B={B} entries={entries} next_n={nn}", file=sys.stderr)
            continue
        bpt = sum(FORMATS[fmt])
        mb = entries // 64
        cache_bytes = B * mb * 64 * bpt
        nrot = max(1, min(16, -(-(240 << 20) // cache_bytes)))
        caches = [rand_cache(B * mb, fmt, dev) for _ in range(nrot)]
        bt = torch.randperm(B * mb, device=dev).to(torch.int32).reshape(B, mb)
        qd, qs, w = rand_q(B * nn, fmt, dev)
        qd4, qs4 = qd.reshape(B, nn, H, -1), qs.reshape(B, nn, H, -1)
        lens = torch.full((B,), entries, dtype=torch.int32, device=dev)
        lens2 = (lens[:, None] - nn + 1 + torch.arange(nn, device=dev)).to(torch.int32).reshape(-1)
        g = _gscale(fmt, dev)
        kbytes = B * entries * bpt
        base_row = None
        variants = _decode_variants(fmt, args.quick)
        if fmt == "mxfp4":
            variants = variants + ["fp8mma_cpasync", "fp8mma_defer", "fp8mma_bulk_defer"] + (
                ["fp8mma_acc1"] if nn == 1 else ["fp8mma_split"])
        if fmt == "fp8" and nn > 1 and not args.quick:
            variants = variants + ["fp8mma_nofold_split"]
        for variant in variants:
            outs = {}

            def mk(c):
                def f():
                    outs["l"] = indexer_logits_paged(qd4, qs4, w, c, lens, bt, fmt=fmt, q_global=g, k_global=g)
                return f
            with variant_env(fmt, variant), use(indexer_logits_paged="cuda"):
                us = time_graph([mk(c) for c in caches])
            r = dict(kind="decode", fmt=fmt, variant=variant, B=B, entries=entries, next_n=nn, us=us,
                     key_GBps=kbytes / us / 1e3, pct_copy_bw=100 * kbytes / us / 1e3 / bw,
                     out_MB=B * nn * entries * 4 / 1e6)
            if base_row is None:
                base_row = r
                try:
                    logits = outs["l"]
                    r["us_topk512"] = time_graph([lambda: indexer_topk(logits, lens2, 512)])
                except Exception as e:  # noqa: BLE001
                    print("topk timing failed:", e, file=sys.stderr)
            rows_out.append(r)
        del caches
        torch.cuda.empty_cache()


def _prefill_base(qreal, kreal, w, T):
    outs = []
    for t0 in range(0, T, 1024):  # chunked to bound memory (T x 64 x S fp32)
        s = torch.einsum("thd,sd->ths", qreal[t0:t0 + 1024], kreal).float().relu_()
        outs.append(torch.einsum("ths,th->ts", s, w[t0:t0 + 1024]))
    return torch.topk(torch.cat(outs), 512, dim=1).indices


def bench_prefill(args, peak_meas, rows_out, dev, budget):
    T = PREFILL_T
    sizes = list(PREFILL_SIZES) if not args.quick else [PREFILL_SIZES[1], PREFILL_SIZES[-1]]
    cases = [(S, fmt, causal) for S in sizes for fmt in ("mxfp4", "fp8") for causal in ((False, True) if S == T else (False,))]
    cases.append((sizes[-1], "nvfp4", False))
    for S, fmt, causal in cases:
        if budget.left() < 0:
            print(f"budget exhausted: skipping prefill {fmt} S={S}", file=sys.stderr)
            continue
        qd, qs, w = rand_q(T, fmt, dev)
        vb, sb = FORMATS[fmt]
        kd = torch.randint(0, 256, (S, vb), dtype=torch.uint8, device=dev)
        ksf = torch.full((S, sb), 120 if fmt == "mxfp4" else 0x38, dtype=torch.uint8, device=dev)
        if fmt == "fp8":
            kd = torch.randn(S, vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
            ksf = torch.full((S,), 0.5, device=dev).view(torch.uint8).reshape(S, 4)
        g = _gscale(fmt, dev)
        ks = torch.zeros(T, dtype=torch.int32, device=dev)
        if causal:  # queries are the last T tokens of a 4S-token sequence
            pos = torch.arange(4 * S - T, 4 * S, device=dev)
            ke = ((pos + 1) // 4).to(torch.int32)
        else:
            ke = torch.full((T,), S, dtype=torch.int32, device=dev)
        pairs = int((ke - ks).sum())
        variants = _decode_variants(fmt, args.quick)
        if fmt == "mxfp4" and not args.quick:
            variants = variants + ["fp8mma_nq1", "fp8mma_nq3", "fp8mma_defer"]
        for variant in variants:
            with variant_env(fmt, variant), use(indexer_logits="cuda"):
                us = time_graph([lambda: indexer_logits(qd, qs, w, kd, ksf, ks, ke, fmt=fmt, q_global=g, k_global=g)],
                                iters=4, reps=5)
            tf = 2 * H * D * pairs / (us * 1e-6) / 1e12
            r = dict(kind="prefill", fmt=fmt, variant=variant, T=T, S=S, causal=causal, us=us, TFLOPs=tf,
                     pct_fp8_peak_1716=100 * tf / FP8_PEAK_TFLOPS, pct_fp8_peak_measured=100 * tf / peak_meas)
            rows_out.append(r)
        torch.cuda.empty_cache()


def bench_baselines(args, rows, dev, budget):
    """Same-process torch baselines, after every kernel row (they are the first thing dropped when
    the budget runs out): eager on all MXFP4 next_n=1 decode shapes and two prefill shapes; then
    torch.compile on the representative rows while at least 45 s of budget remain."""
    dec = [r for r in rows if r["kind"] == "decode" and r["fmt"] == "mxfp4" and r["variant"] == "fp8mma" and r["next_n"] == 1]
    pre = [r for r in rows if r["kind"] == "prefill" and r["fmt"] == "mxfp4" and r["variant"] == "fp8mma"
           and not r["causal"] and r["S"] in (PREFILL_SIZES[1], PREFILL_SIZES[-1])]
    jobs = []   # (row, make_fn, compile?)
    for r in dec:
        B, entries = r["B"], r["entries"]

        def make(B=B, entries=entries):
            mb = entries // 64
            cache = rand_cache(B * mb, "mxfp4", dev)
            bt = torch.randperm(B * mb, device=dev).to(torch.int32).reshape(B, mb)
            w = torch.randn(B, H, device=dev)
            qreal = torch.randn(B, 1, H, D, device=dev, dtype=torch.bfloat16)
            lens = torch.full((B,), entries, dtype=torch.int32, device=dev)

            def base():
                return torch_decode(qreal, w, torch_dequant_mxfp4_cache(cache), bt, lens, 512)
            return base
        jobs.append((r, make, (B, entries) in ((DECODE_BS[1], DECODE_ENTRIES[-1]), (DECODE_BS[-1], DECODE_ENTRIES[0]))))
    for r in pre:
        S = r["S"]

        def make(S=S):
            T = PREFILL_T
            qreal = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
            kreal = torch.randn(S, D, device=dev, dtype=torch.bfloat16)
            w = torch.randn(T, H, device=dev)
            return lambda: _prefill_base(qreal, kreal, w, T)
        jobs.append((r, make, S == PREFILL_SIZES[1]))
    for r, make, _ in jobs:
        if budget.left() < 0:
            break
        r["torch_eager_us"] = time_eager(make(), iters=3)
        torch.cuda.empty_cache()
    if not args.compile:
        return
    for r, make, rep in jobs:
        if rep and budget.left() > 45:
            t0 = time.time()
            cf = torch.compile(make())
            r["torch_compile_us"] = time_eager(cf, iters=3)
            r["torch_compile_s"] = time.time() - t0
            torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="time torch.compile baselines on the representative rows (default on)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; later rows / compiles are skipped past it")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_indexer: times the CUDA indexer kernels and needs a CUDA GPU (none is visible); "
              "on a CPU machine run the tests (pytest tests/test_indexer.py)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    budget = Budget(args.budget)
    bw = copy_bandwidth()
    peak = fp8_peak()
    print(f"copy bandwidth {bw:.0f} GB/s (read+write); torch._scaled_mm FP8 8192^3 {peak:.0f} TFLOP/s; "
          f"FP8 peak used for ratios {FP8_PEAK_TFLOPS:.0f} TFLOP/s (CUTLASS example)")
    rows: list[dict] = []
    import signal
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))   # `timeout` -> still save the JSON
    try:
        if args.only in (None, "decode"):
            bench_decode(args, bw, rows, dev, budget)
        if args.only in (None, "prefill"):
            bench_prefill(args, peak, rows, dev, budget)
        if not args.no_baseline:
            bench_baselines(args, rows, dev, budget)
    finally:
        save_json(args.json, {"copy_GBps": bw, "fp8_scaled_mm_TFLOPs": peak, "fp8_peak_ref": FP8_PEAK_TFLOPS,
                              "elapsed_s": time.time() - budget.t0, "rows": rows})
    print_table([r for r in rows if r["kind"] == "decode"],
                ["fmt", "variant", "B", "entries", "next_n", "us", "key_GBps", "pct_copy_bw", "us_topk512",
                 "torch_eager_us", "torch_compile_us"], title="\ndecode (paged) logits")
    print_table([r for r in rows if r["kind"] == "prefill"],
                ["fmt", "variant", "S", "causal", "us", "TFLOPs", "pct_fp8_peak_1716", "pct_fp8_peak_measured",
                 "torch_eager_us", "torch_compile_us"], title="\nprefill logits (T = 8192)")
    print(f"bench elapsed {time.time() - budget.t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
