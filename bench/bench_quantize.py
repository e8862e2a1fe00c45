"""Benchmark the quantization kernels (kernels_cuda/quantize.cu) on the H200.

For each op and shape: kernel time (CUDA-graph replay over rotating inputs, so neither Python
nor launch overhead nor L2 flatters it), eager call time (one Python call, what a caller pays
without graphs), achieved bandwidth = (bytes read + bytes written, minimal traffic) / time
against the device copy bandwidth measured in the same run, and speedup over the torch
reference (dsv4.formats) eager and torch.compile'd (time-boxed).

    PYTHONPATH=. python3 bench/bench_quantize.py --json $OUT/quantize.json
"""
from __future__ import annotations

import argparse
import signal
import time

import torch

import dsv4.formats as F
import kernels_cuda.quantize as kq
from bench._util import copy_bandwidth, print_table, rotating, save_json, time_cuda, time_graph
from dsv4 import registry
from dsv4.ops import dequantize_fp8_block, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

SHAPES = [(8192, 8192), (1, 7168), (16, 7168), (128, 7168)]


def _x(M, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g)
    x = x * (1 + 60 * (torch.rand(K, device="cuda", generator=g) < 0.02))
    return x.to(torch.bfloat16)


def graph_time(fns, iters=20) -> float:
    """Median us per call of a CUDA graph that runs every fn in ``fns`` once (rotating inputs)."""
    return time_graph(fns, iters=len(fns), reps=iters)


OPS = {
    # name: (kernel call on x, reference call on x, bytes moved per element-count (M, K))
    "nvfp4 amax+quant swz": (lambda x: quantize_nvfp4(x, sf_layout="swizzled"),
                             lambda x: F.quantize_nvfp4(x, sf_layout="swizzled"),
                             lambda M, K: 2 * M * K + M * K // 2 + M * K // 16),
    "nvfp4 amax+quant lin": (lambda x: quantize_nvfp4(x),
                             lambda x: F.quantize_nvfp4(x),
                             lambda M, K: 2 * M * K + M * K // 2 + M * K // 16),
    "nvfp4 given-gs swz": (lambda x: quantize_nvfp4(x, global_scale=_GS, sf_layout="swizzled"),
                           lambda x: F.quantize_nvfp4(x, _GS, sf_layout="swizzled"),
                           lambda M, K: 2 * M * K + M * K // 2 + M * K // 16),
    "mxfp4 dsv4": (lambda x: quantize_mxfp4(x),
                   lambda x: F.quantize_mxfp4(x, "dsv4"),
                   lambda M, K: 2 * M * K + M * K // 2 + M * K // 32),
    "fp8 b128 ue8m0": (lambda x: quantize_fp8_block(x, scale_fmt="ue8m0"),
                       lambda x: F.quantize_fp8_block(x, 128, "ue8m0"),
                       lambda M, K: 2 * M * K + M * K + 4 * M * K // 128),
    "fp8 b128 fp32": (lambda x: quantize_fp8_block(x),
                      lambda x: F.quantize_fp8_block(x, 128, "fp32"),
                      lambda M, K: 2 * M * K + M * K + 4 * M * K // 128),
    "dequant fp8->bf16": (lambda qs: dequantize_fp8_block(qs[0], qs[1]),
                          lambda qs: F.dequantize_fp8_block(qs[0], qs[1], 128, torch.bfloat16),
                          lambda M, K: M * K + 4 * M * K // 128 + 2 * M * K),
}
_GS = None


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def main():
    global _GS
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--compile-budget", type=float, default=90.0, help="seconds for all torch.compile work")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time launch geometries (TUNING qj x prefetch x ctas_per_sm) at 8192^2")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    _GS = torch.tensor([0.0123], device="cuda")
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw:.0f} GB/s (read + write)")
    rows, tune_rows = [], []
    compile_left = 0.0 if args.no_compile else args.compile_budget
    compiled = {}
    signal.signal(signal.SIGALRM, _alarm)
    with registry.use({"*": "cuda"}):
        for name, (kern, ref, nbytes) in OPS.items():
            for (M, K) in SHAPES:
                each = 2 * M * K
                xs = rotating(lambda i: _x(M, K, i), each)
                if name.startswith("dequant"):
                    xs = [F.quantize_fp8_block(x, 128, "fp32") for x in xs]
                fns = [(lambda a=a: kern(a)) for a in xs]
                t_graph = graph_time(fns)
                t_eager = time_cuda(fns[0], warmup=3, iters=30)
                with registry.use({"*": "torch"}):
                    t_ref = time_cuda(lambda: ref(xs[0]), warmup=1, iters=5)
                t_comp = None
                key = name
                if compile_left > 5:
                    t0 = time.time()
                    try:
                        signal.alarm(max(1, int(compile_left)))
                        if key not in compiled:
                            compiled[key] = torch.compile(ref)
                        cf = compiled[key]
                        cf(xs[0])
                        signal.alarm(0)
                        t_comp = time_cuda(lambda: cf(xs[0]), warmup=1, iters=10)
                    except _Timeout:
                        print(f"torch.compile time budget exhausted at {name} {M}x{K}")
                        compile_left = 0.0
                    except Exception as e:  # noqa: BLE001
                        print(f"torch.compile failed for {name}: {type(e).__name__}: {str(e)[:200]}")
                    finally:
                        signal.alarm(0)
                        compile_left -= time.time() - t0
                gbs = nbytes(M, K) / (t_graph * 1e-6) / 1e9
                rows.append(dict(op=name, shape=f"{M}x{K}", us_graph=t_graph, us_eager=t_eager, GBps=gbs,
                                 pct_copy=100 * gbs / bw, ref_us=t_ref, x_ref=t_ref / t_graph,
                                 compile_us=t_comp, x_compile=(t_comp / t_graph) if t_comp else None))
                del xs, fns
        # launch-path tuning (results never change): NVFP4 computed-amax paths and L2 policy
        for (M, K) in SHAPES:
            xs = rotating(lambda i: _x(M, K, i), 2 * M * K)
            for label, over in (("2-launch", dict(fused_max_chunks=0)),
                                ("1-launch 1-CTA", dict(fused_max_chunks=1 << 40)),
                                ("2-launch no-reverse", dict(fused_max_chunks=0, reverse=0)),
                                ("2-launch no-L2-keep", dict(fused_max_chunks=0, l2_keep_bytes=0)),
                                ("2-launch no-reverse no-keep", dict(fused_max_chunks=0, reverse=0, l2_keep_bytes=0))):
                if label.startswith("1-launch") and M * K // 8 > 16384:
                    continue
                if "no-" in label and M < 8192:
                    continue
                old = dict(kq.TUNING)
                kq.TUNING.update(over)
                try:
                    t = graph_time([(lambda a=a: quantize_nvfp4(a, sf_layout="swizzled")) for a in xs])
                finally:
                    kq.TUNING.clear()
                    kq.TUNING.update(old)
                gbs = (2 * M * K + M * K // 2 + M * K // 16) / (t * 1e-6) / 1e9
                tune_rows.append(dict(shape=f"{M}x{K}", path=label, us_graph=t, GBps=gbs, pct_copy=100 * gbs / bw))
            del xs
        if args.sweep:
            M, K = 8192, 8192
            xs = rotating(lambda i: _x(M, K, i), 2 * M * K)
            for name in ("nvfp4 given-gs swz", "mxfp4 dsv4", "fp8 b128 fp32"):
                kern, _, nbytes = OPS[name]
                for qj, pf in ((8, 0), (4, 0), (8, 1), (4, 1)):
                    for cps in (2, 4, 8):
                        old = dict(kq.TUNING)
                        kq.TUNING.update(qj=qj, ctas_per_sm=cps, prefetch=pf)
                        try:
                            t = graph_time([(lambda a=a: kern(a)) for a in xs])
                        finally:
                            kq.TUNING.clear()
                            kq.TUNING.update(old)
                        gbs = nbytes(M, K) / (t * 1e-6) / 1e9
                        tune_rows.append(dict(shape=f"{M}x{K}", path=f"{name} qj={qj} pf={pf} ctas/sm={cps}", us_graph=t,
                                              GBps=gbs, pct_copy=100 * gbs / bw))
            del xs
    print_table(tune_rows, ["shape", "path", "us_graph", "GBps", "pct_copy"], "launch paths / geometry")
    print_table(rows, ["op", "shape", "us_graph", "us_eager", "GBps", "pct_copy", "ref_us", "x_ref", "compile_us",
                       "x_compile"], f"quantize kernels vs copy bandwidth {bw:.0f} GB/s and torch reference")
    save_json(args.json, {"copy_GBps": bw, "rows": rows, "tuning": tune_rows, "tuning_defaults": kq.TUNING})


if __name__ == "__main__":
    main()
