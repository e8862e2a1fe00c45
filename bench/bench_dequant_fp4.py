"""Benchmark dequant_fp4 (dsl / torch providers) against the copy-bandwidth roofline.

Bytes = packed input + scales + output (read + written). Roofline = bytes / measured
device-to-device copy bandwidth (read + write) in the same run. Inputs rotate past L2, in the
eager timing and in the CUDA-graph replay alike (``bench._util.time_graph`` over the rotating sets, ``--graph-calls``
calls per graph: the graph's launch latency is shared by them, bench/bench_quantize.py GRAPH_CALLS).

    PYTHONPATH=. python3 bench/bench_dequant_fp4.py [--json out.json] [--providers dsl,torch]
        [--shapes 8192x8192,16x7168] [--dsl-configs 256x1,256x2,...]

``--dsl-configs THREADSxTILES[xCTAS_PER_SM],...`` adds rows for DSL launch configs
(``DequantFp4Config``; ``kernels_dsl.dequant_fp4.VARIANT``), provider label ``dsl[...]``.
"""
from __future__ import annotations

import argparse

import torch

from bench._util import copy_bandwidth, print_table, rotating, save_json, time_cuda, time_graph
from bench.bench_quantize import GRAPH_CALLS
from dsv4 import registry
from dsv4.formats import quantize_mxfp4, quantize_nvfp4
from dsv4.ops import dequant_fp4

SHAPES = [(8192, 8192), (8192, 7168), (128, 7168), (16, 7168), (1, 7168)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--providers", default="dsl,torch")
    ap.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES))
    ap.add_argument("--dsl-configs", default="")
    ap.add_argument("--out", default="bfloat16,float32")
    ap.add_argument("--graph-calls", type=int, default=GRAPH_CALLS)
    a = ap.parse_args()
    import kernels_dsl.dequant_fp4 as kd
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",")]
    outs = [getattr(torch, o) for o in a.out.split(",")]
    provs = a.providers.split(",") + [f"dsl[{c}]" for c in a.dsl_configs.split(",") if c]
    bw = copy_bandwidth()
    rows = []
    for M, K in shapes:
        for fmt in ("mxfp4", "nvfp4"):
            for out_dtype in outs:
                def make(i, M=M, K=K, fmt=fmt):
                    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * (1 + i)
                    if fmt == "mxfp4":
                        d, s = quantize_mxfp4(x)
                        return d, s, None
                    t = quantize_nvfp4(x)
                    return t.data, t.scale, t.global_scale.reshape(1).float()
                nbytes = M * K // 2 + M * K // (32 if fmt == "mxfp4" else 16) + M * K * out_dtype.itemsize
                sets = rotating(make, nbytes)
                for prov in provs:
                    kd.VARIANT.clear()
                    if prov.startswith("dsl["):
                        kd.VARIANT["config"] = kd.DequantFp4Config(*(int(v) for v in prov[4:-1].split("x")))
                    try:
                        with registry.use(dequant_fp4=prov.split("[")[0]):
                            calls = [lambda d=d, s=s, g=g: dequant_fp4(d, s, fmt=fmt, global_scale=g,
                                                                       out_dtype=out_dtype) for d, s, g in sets]
                            it = iter(range(1 << 30))
                            us = time_cuda(lambda: calls[next(it) % len(calls)](), iters=30)
                            usg = time_graph(calls, iters=max(a.graph_calls, len(calls)), reps=15)
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(shape=f"{M}x{K}", fmt=fmt, out=str(out_dtype)[6:], provider=prov,
                                         note=f"skipped: {type(e).__name__}: {str(e)[:60]}"))
                        continue
                    finally:
                        kd.VARIANT.clear()
                    rows.append(dict(shape=f"{M}x{K}", fmt=fmt, out=str(out_dtype)[6:], provider=prov,
                                     us=us, us_graph=usg, GBps=nbytes / (usg * 1e-6) / 1e9,
                                     pct_bw=100 * nbytes / (usg * 1e-6) / 1e9 / bw, floor_us=nbytes / bw / 1e3))
    print_table(rows, ["shape", "fmt", "out", "provider", "us", "us_graph", "GBps", "pct_bw", "floor_us", "note"],
                title=f"dequant_fp4 (copy bandwidth {bw:.0f} GB/s; us = eager incl. host overhead, "
                      f"us_graph = CUDA-graph replay)")
    save_json(a.json, {"copy_bw_gbps": bw, "rows": rows})


if __name__ == "__main__":
    main()
