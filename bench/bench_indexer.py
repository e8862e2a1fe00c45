"""Benchmark the Lightning Indexer logits ops on the H200 (default providers: the CuTe DSL kernels
for MXFP4 / FP8 keys, CUDA for NVFP4), with DeepGEMM's SM90 kernels in the same process when it
is importable (``--peers``; the peer job builds it: .gpuq/README.md, '# carry: peers').

Decode (paged, block_size 64): B = 32 / 128 sequences x 32768 entries (128k tokens) and an uneven
batch (64 sequences of 256..32768 entries = 1k..128k tokens), next_n 1 / 2 (+ 3 / 4 for MXFP4),
MXFP4 / FP8 / NVFP4 keys. Ratio = key-cache bytes read / time over the device-to-device copy
bandwidth measured in the same run (read + write bytes / time). DeepGEMM
``fp8_paged_mqa_logits`` runs on the same FP8 bytes (this project's FP8 cache is byte-identical to
its ``[blocks, 64, 1, 132]``), the same ``context_lens [B, next_n]`` and block table; its
schedule-metadata kernel is timed separately (computed once per step and shared by the layers).
Prefill: 8192 queries x 16384 entries, causal (the last 8192 tokens of a 65536-token sequence),
and 8192 x 8192 full; TFLOP/s = 2 * 64 * 128 * allowed pairs / time vs the 1716 TFLOP/s FP8 peak;
DeepGEMM ``fp8_mqa_logits`` with ``clean_logits=True`` (-inf outside the ranges, the same
output contract as ours) and ``False``.
Decode top-k op (``indexer_topk_paged``, its registry provider; the ``dsl`` one runs the logits
kernel, then the top-k kernel): time vs logits alone
(``topk_paged_over_logits``) and vs the two ops in sequence, ``indexer_logits_paged`` + ``topk``
(``us_composed512``).

Times: CUDA-graph replays (bench._util.time_graph), median; caches rotated past L2 when smaller
than 240 MB. Cache contents are random bytes with sane scales (timing does not depend on values;
correctness is the tests' job).

    PYTHONPATH=. python3 bench/bench_indexer.py --json out.json [--quick] [--peers] [--budget 150]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from bench._util import FP8_PEAK_TFLOPS, copy_bandwidth, print_table, save_json
from bench._util import time_graph as _time_graph
from dsv4 import registry
from dsv4.ops.indexer import FORMATS, indexer_logits, indexer_logits_paged, indexer_topk

H, D = 64, 128


def time_graph(fns, iters: int = 20, reps: int = 7) -> float:
    return _time_graph(fns, iters, reps)


class Budget:
    def __init__(self, seconds):
        self.t0, self.seconds = time.time(), seconds

    def left(self):
        return self.seconds - (time.time() - self.t0)


def rand_q(rows: int, fmt: str, dev):
    vb, sb = FORMATS[fmt]
    if fmt == "fp8":
        qd = torch.randn(rows, H, vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
        return qd, qd[..., :0], torch.randn(rows, H, device=dev)
    qd = torch.randint(0, 256, (rows, H, vb), dtype=torch.uint8, device=dev)
    qs = torch.randint(118, 123, (rows, H, sb), dtype=torch.uint8, device=dev) if fmt == "mxfp4" else \
        torch.full((rows, H, sb), 0x38, dtype=torch.uint8, device=dev)
    return qd, qs, torch.randn(rows, H, device=dev)


def rand_cache(nblocks: int, fmt: str, dev):
    vb, sb = FORMATS[fmt]
    c = torch.randint(0, 256, (nblocks, 64, vb + sb), dtype=torch.uint8, device=dev)
    flat = c.view(nblocks, -1)
    if fmt == "fp8":
        flat[:, : 64 * vb] = torch.randn(nblocks, 64 * vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
        flat[:, 64 * vb:] = torch.full((nblocks, 64), 0.5, device=dev).view(torch.uint8)
    elif fmt == "mxfp4":
        flat[:, 64 * vb:] = torch.randint(118, 123, (nblocks, 64 * sb), dtype=torch.uint8, device=dev)
    else:
        flat[:, 64 * vb:] = 0x38
    return c


def _deep_gemm(args):
    if not args.peers:
        return None
    try:
        import deep_gemm
        return deep_gemm
    except Exception as e:  # noqa: BLE001
        print(f"DeepGEMM not importable ({type(e).__name__}: {e}); peer columns skipped", file=sys.stderr)
        return None


def _provider(op: str) -> str:
    c = registry.last_choice(op)
    return c.kind if c else "?"


# ---------------------------------------------------------------------------------------------
def decode_cases(quick: bool):
    g = torch.Generator().manual_seed(5)
    uneven = torch.randint(256, 32769, (64,), generator=g).tolist()
    cases = [(32, [32768] * 32, nn, fmt) for nn in (1, 2) for fmt in ("mxfp4", "fp8", "nvfp4")]
    cases += [(32, [32768] * 32, nn, "mxfp4") for nn in (3, 4)]
    cases += [(128, [32768] * 128, 1, "mxfp4"), (128, [32768] * 128, 1, "fp8"), (64, uneven, 1, "mxfp4"),
              (64, uneven, 1, "fp8")]
    if quick:
        cases = [c for c in cases if c[2] <= 2 and c[3] != "nvfp4"]
    return cases


def bench_decode(args, bw, rows_out, dev, budget, dg):
    for B, ctx, nn, fmt in decode_cases(args.quick):
        name = f"decode {fmt} B={B} {'uneven' if len(set(ctx)) > 1 else max(ctx)} next_n={nn}"
        if budget.left() < 0:
            print(f"budget exhausted: skipping {name}", file=sys.stderr)
            continue
        bpt = sum(FORMATS[fmt])
        mb = max(-(-c // 64) for c in ctx)
        nblk = B * mb
        kbytes = sum(ctx) * bpt
        nrot = max(1, min(8, -(-(240 << 20) // (nblk * 64 * bpt))))
        caches = [rand_cache(nblk, fmt, dev) for _ in range(nrot)]
        bt = torch.randperm(nblk, device=dev).to(torch.int32).reshape(B, mb)
        qd, qs, w = rand_q(B * nn, fmt, dev)
        qd4, qs4 = qd.reshape(B, nn, H, -1), qs.reshape(B, nn, H, -1)
        lens = torch.tensor(ctx, dtype=torch.int32, device=dev)[:, None].repeat(1, nn).contiguous()
        g1 = torch.ones(1, device=dev) if fmt == "nvfp4" else None

        def mk(c):
            return lambda: indexer_logits_paged(qd4, qs4, w, c, lens, bt, fmt=fmt, q_global=g1, k_global=g1)
        us = time_graph([mk(c) for c in caches])
        r = dict(kind="decode", fmt=fmt, provider=_provider("indexer_logits_paged"), B=B,
                 entries="uneven" if len(set(ctx)) > 1 else max(ctx), next_n=nn, us=us,
                 key_GBps=kbytes / us / 1e3, pct_copy_bw=100 * kbytes / us / 1e3 / bw)
        if dg is not None and fmt in ("fp8", "mxfp4"):
            try:
                c8 = [rand_cache(nblk, "fp8", dev) for _ in range(max(1, min(8, -(-(240 << 20) // (nblk * 64 * 132)))))]
                q8, _, w8 = rand_q(B * nn, "fp8", dev)
                q8 = q8.view(torch.float8_e4m3fn).view(B, nn, H, D)
                meta = dg.get_paged_mqa_logits_metadata(lens, 64, dg.get_num_sms())
                mctx = mb * 64

                def mkd(c):
                    kv = c.view(nblk, 64, 1, D + 4)
                    return lambda: dg.fp8_paged_mqa_logits(q8, kv, w8, lens, bt, meta, mctx, clean_logits=False)
                r["deepgemm_fp8_us"] = time_graph([mkd(c) for c in c8])
                r["ours_over_deepgemm"] = us / r["deepgemm_fp8_us"]
                r["deepgemm_meta_us"] = time_graph([lambda: dg.get_paged_mqa_logits_metadata(lens, 64, dg.get_num_sms())])
                del c8
            except Exception as e:  # noqa: BLE001
                print(f"DeepGEMM decode failed on {name}: {type(e).__name__}: {e}", file=sys.stderr)
        if nn == 1 and fmt != "nvfp4" and budget.left() > 0:
            try:
                out = indexer_logits_paged(qd4, qs4, w, caches[0], lens, bt, fmt=fmt)
                r["us_topk512"] = time_graph([lambda: indexer_topk(out, lens.view(-1), 512)])
                r["us_composed512"] = time_graph(
                    [lambda c=c: indexer_topk(indexer_logits_paged(qd4, qs4, w, c, lens, bt, fmt=fmt), lens.view(-1), 512)
                     for c in caches])
                tp = _topk_paged(fmt, nn, mb * 64, dev)
                if tp is not None:   # indexer_topk_paged: its provider says whether it is fused
                    r["us_topk_paged512"] = time_graph(
                        [lambda c=c: tp(qd4, qs4, w, c, lens, bt, 512, fmt=fmt) for c in caches])
                    r["topk_paged_provider"] = _provider("indexer_topk_paged")
                    r["topk_paged_over_logits"] = r["us_topk_paged512"] / us
            except Exception as e:  # noqa: BLE001
                print(f"top-k timing failed on {name}: {type(e).__name__}: {e}", file=sys.stderr)
        rows_out.append(r)
        print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        del caches
        torch.cuda.empty_cache()


def _topk_paged(fmt: str, nn: int, max_ctx: int, dev):
    """``indexer_topk_paged`` when a kernel provider (not the torch reference) would run it."""
    from dsv4.ops.indexer import TOPK_PAGED_OP, indexer_topk_paged
    from dsv4.target import Target
    prob = {"fmt": fmt, "next_n": nn, "block_size": 64, "max_ctx": max_ctx, "k": 512, "mapped": False,
            "device": dev.type}
    try:
        _, ch = TOPK_PAGED_OP.select(prob, Target.of(dev))
    except Exception:  # noqa: BLE001
        return None
    return None if ch.kind == "torch" else indexer_topk_paged


def bench_prefill(args, rows_out, dev, budget, dg):
    T = 8192
    cases = [(16384, fmt, True) for fmt in ("mxfp4", "fp8", "nvfp4")] + [(8192, fmt, False) for fmt in ("mxfp4", "fp8")]
    if args.quick:
        cases = cases[:2]
    for S, fmt, causal in cases:
        if budget.left() < 0:
            print(f"budget exhausted: skipping prefill {fmt} S={S}", file=sys.stderr)
            continue
        qd, qs, w = rand_q(T, fmt, dev)
        vb, sb = FORMATS[fmt]
        kd = torch.randint(0, 256, (S, vb), dtype=torch.uint8, device=dev)
        ksf = torch.randint(118, 123, (S, sb), dtype=torch.uint8, device=dev)
        if fmt == "fp8":
            kd = torch.randn(S, vb, device=dev).to(torch.float8_e4m3fn).view(torch.uint8)
            ksf = torch.full((S,), 0.5, device=dev).view(torch.uint8).reshape(S, 4)
        elif fmt == "nvfp4":
            ksf = torch.full((S, sb), 0x38, dtype=torch.uint8, device=dev)
        g1 = torch.ones(1, device=dev) if fmt == "nvfp4" else None
        ks = torch.zeros(T, dtype=torch.int32, device=dev)
        if causal:
            pos = torch.arange(4 * S - T, 4 * S, device=dev)
            ke = ((pos + 1) // 4).to(torch.int32)
        else:
            ke = torch.full((T,), S, dtype=torch.int32, device=dev)
        pairs = int((ke - ks).sum())
        us = time_graph([lambda: indexer_logits(qd, qs, w, kd, ksf, ks, ke, fmt=fmt, q_global=g1, k_global=g1)],
                        iters=4, reps=5)
        tf = 2 * H * D * pairs / (us * 1e-6) / 1e12
        r = dict(kind="prefill", fmt=fmt, provider=_provider("indexer_logits"), T=T, S=S, causal=causal, us=us,
                 TFLOPs=tf, pct_fp8_peak=100 * tf / FP8_PEAK_TFLOPS)
        if args.dsl_prefill and fmt != "nvfp4":
            try:   # the DSL prefill kernel, whichever provider the registry picks (kernels_dsl/indexer.py)
                from kernels_dsl.indexer import prefill_logits_dsl
                r["dsl_us"] = time_graph([lambda: prefill_logits_dsl(qd, qs, w, kd, ksf, ks, ke, fmt=fmt)], iters=4, reps=5)
                r["dsl_TFLOPs"] = 2 * H * D * pairs / (r["dsl_us"] * 1e-6) / 1e12
            except Exception as e:  # noqa: BLE001
                print(f"DSL prefill failed: {type(e).__name__}: {e}", file=sys.stderr)
        if dg is not None and fmt != "nvfp4":
            try:
                q8, _, w8 = rand_q(T, "fp8", dev)
                q8 = q8.view(torch.float8_e4m3fn)
                k8 = torch.randn(S, D, device=dev).to(torch.float8_e4m3fn)
                k8s = torch.full((S,), 0.5, device=dev)
                r["deepgemm_fp8_us"] = time_graph([lambda: dg.fp8_mqa_logits(q8, (k8, k8s), w8, ks, ke, clean_logits=True)],
                                                  iters=4, reps=5)
                r["deepgemm_fp8_noclean_us"] = time_graph(
                    [lambda: dg.fp8_mqa_logits(q8, (k8, k8s), w8, ks, ke, clean_logits=False)], iters=4, reps=5)
                r["ours_over_deepgemm"] = us / r["deepgemm_fp8_us"]
                if "dsl_us" in r:
                    r["dsl_over_deepgemm"] = r["dsl_us"] / r["deepgemm_fp8_us"]
            except Exception as e:  # noqa: BLE001
                print(f"DeepGEMM prefill failed: {type(e).__name__}: {e}", file=sys.stderr)
        rows_out.append(r)
        print(f"prefill {fmt} S={S} causal={causal}", {k: (round(v, 2) if isinstance(v, float) else v)
                                                      for k, v in r.items()}, flush=True)
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="next_n <= 2, no NVFP4, two prefill rows")
    ap.add_argument("--peers", action="store_true", help="time DeepGEMM (deep_gemm importable) in the same run")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--only", choices=["decode", "prefill"], default=None)
    ap.add_argument("--prefill-first", action="store_true", help="prefill rows before the decode rows (short budgets)")
    ap.add_argument("--dsl-prefill", action="store_true",
                    help="also time the DSL prefill kernel directly (kernels_dsl.indexer.prefill_logits_dsl)")
    # accepted for the session scripts: the torch eager / compile baselines were dropped (the peer
    # is DeepGEMM, --peers); these flags do nothing
    ap.add_argument("--no-baseline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_indexer: times the indexer kernels and needs a CUDA GPU (none is visible); "
              "on a CPU machine run the tests (pytest tests/test_indexer.py)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    budget = Budget(args.budget)
    bw = copy_bandwidth()
    dg = _deep_gemm(args)
    print(f"copy bandwidth {bw:.0f} GB/s (read+write); FP8 peak for ratios {FP8_PEAK_TFLOPS:.0f} TFLOP/s; "
          f"DeepGEMM {'%s' % getattr(dg, '__version__', '?') if dg else 'not used'}", flush=True)
    rows: list[dict] = []
    import signal
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))   # `timeout` -> still save the JSON
    try:
        parts = [("decode", lambda: bench_decode(args, bw, rows, dev, budget, dg)),
                 ("prefill", lambda: bench_prefill(args, rows, dev, budget, dg))]
        for name, run in (parts[::-1] if args.prefill_first else parts):
            if args.only in (None, name):
                run()
    finally:
        save_json(args.json, {"copy_GBps": bw, "fp8_peak_ref": FP8_PEAK_TFLOPS, "deep_gemm": bool(dg),
                              "elapsed_s": time.time() - budget.t0, "rows": rows})
    print_table([r for r in rows if r["kind"] == "decode"],
                ["fmt", "provider", "B", "entries", "next_n", "us", "pct_copy_bw", "deepgemm_fp8_us",
                 "ours_over_deepgemm", "us_topk512", "us_composed512", "us_topk_paged512", "topk_paged_provider",
                 "topk_paged_over_logits"],
                title="\ndecode (paged) logits")
    print_table([r for r in rows if r["kind"] == "prefill"],
                ["fmt", "provider", "S", "causal", "us", "TFLOPs", "pct_fp8_peak", "dsl_us", "dsl_TFLOPs",
                 "deepgemm_fp8_us", "deepgemm_fp8_noclean_us", "ours_over_deepgemm", "dsl_over_deepgemm"],
                title="\nprefill logits (T = 8192)")
    print(f"bench elapsed {time.time() - budget.t0:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
