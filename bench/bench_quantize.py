"""Benchmark the quantization ops on the H200: every GPU provider (the CuTe DSL ``kernels_dsl/quantize*.py``; the
CUDA ``kernels_cuda/quantize.cu`` was deleted in the seventh session, job mem7-02) in one process.

For each op, shape and provider: kernel time (CUDA-graph replay of ``--graph-calls`` calls over rotating inputs
larger than L2, so neither Python, launch overhead nor L2 flatters it; the graph's own launch latency is shared
by those calls: with one call per rotating input, 2 at 8192^2, it added ~3 us to every call, job quant9-01),
a torch copy of the same bytes timed the same way at 8192^2 ("copy same bytes"), achieved bandwidth = (bytes read + written,
minimal traffic) / time against the device copy bandwidth measured in the same run, and for NVFP4 with
a device amax the ratio to its two-read floor (x read twice + outputs, at copy bandwidth); the eager
call time of the default provider (what a caller pays without graphs) and the torch reference.
``--sweep`` times the DSL launch plans of :data:`SWEEP` at 8192^2 (``kernels_dsl.quantize.OVERRIDE``).

    PYTHONPATH=. python3 bench/bench_quantize.py --json $OUT/quantize.json [--sweep]
"""
from __future__ import annotations

import argparse

import torch

import dsv4.formats as F
from bench._util import copy_bandwidth, print_table, rotating, save_json, time_cuda, time_graph
from dsv4 import registry
from dsv4.ops import dequantize_fp8_block, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4

SHAPES = [(8192, 8192), (2048, 7168), (128, 7168), (16, 7168), (1, 7168)]
#: calls per CUDA graph (cycling over the rotating inputs): amortizes the graph launch (event -> first kernel)
GRAPH_CALLS = 24
_GS = None
#: DSL launch geometries timed by --sweep at 8192^2: kernel-config fields of kernels_dsl/quantize.py's plans
#: (its OVERRIDE hook; every family that has the field takes it, dq_* = the dequantizer)
SWEEP = [{"qj": 8, "warps": 8, "min_blocks": 3, "ctas_per_sm": 3, "pipe": 0, "dq_units": 4},
         {"qj": 4, "warps": 8, "min_blocks": 4, "ctas_per_sm": 4, "pipe": 0, "dq_units": 16},
         {"qj": 8, "warps": 4, "min_blocks": 4, "ctas_per_sm": 2, "pipe": 2, "dq_ctas_per_sm": 8},
         {"qj": 4, "warps": 8, "min_blocks": 3, "ctas_per_sm": 3, "pipe": 2, "dq_ctas_per_sm": 64},
         {"lut": 0, "dq_warps": 4, "dq_ctas_per_sm": 8}, {"lut": 1, "dq_units": 2, "dq_ctas_per_sm": 16}]


def _x(M, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g)
    x = x * (1 + 60 * (torch.rand(K, device="cuda", generator=g) < 0.02))
    return x.to(torch.bfloat16)


def _nv_bytes(M, K):
    return 2 * M * K + M * K // 2 + M * K // 16


#: name: (op name, kernel call, reference call, bytes moved, two-read floor bytes or None)
OPS = {
    "nvfp4 amax swz": ("quantize_nvfp4", lambda x: quantize_nvfp4(x, sf_layout="swizzled"),
                       lambda x: F.quantize_nvfp4(x, sf_layout="swizzled"), _nv_bytes, lambda M, K: _nv_bytes(M, K) + 2 * M * K),
    "nvfp4 amax lin": ("quantize_nvfp4", lambda x: quantize_nvfp4(x), lambda x: F.quantize_nvfp4(x), _nv_bytes,
                       lambda M, K: _nv_bytes(M, K) + 2 * M * K),
    "nvfp4 given swz": ("quantize_nvfp4", lambda x: quantize_nvfp4(x, global_scale=_GS, sf_layout="swizzled"),
                        lambda x: F.quantize_nvfp4(x, _GS, sf_layout="swizzled"), _nv_bytes, None),
    "nvfp4 given lin": ("quantize_nvfp4", lambda x: quantize_nvfp4(x, global_scale=_GS),
                        lambda x: F.quantize_nvfp4(x, _GS), _nv_bytes, None),
    "mxfp4 dsv4": ("quantize_mxfp4", lambda x: quantize_mxfp4(x), lambda x: F.quantize_mxfp4(x, "dsv4"),
                   lambda M, K: 2 * M * K + M * K // 2 + M * K // 32, None),
    "mxfp4 ocp": ("quantize_mxfp4", lambda x: quantize_mxfp4(x, rule="ocp"), lambda x: F.quantize_mxfp4(x, "ocp"),
                  lambda M, K: 2 * M * K + M * K // 2 + M * K // 32, None),
    "fp8 b128 ue8m0": ("quantize_fp8_block",
                       lambda x: quantize_fp8_block(x, scale_fmt="ue8m0", scale_dtype=torch.float8_e8m0fnu),
                       lambda x: F.quantize_fp8_block(x, 128, "ue8m0"), lambda M, K: 3 * M * K + M * K // 128, None),
    "fp8 b128 fp32": ("quantize_fp8_block", lambda x: quantize_fp8_block(x), lambda x: F.quantize_fp8_block(x, 128, "fp32"),
                      lambda M, K: 3 * M * K + 4 * M * K // 128, None),
    "fp8 b64 fp32": ("quantize_fp8_block", lambda x: quantize_fp8_block(x, block=64),
                     lambda x: F.quantize_fp8_block(x, 64, "fp32"), lambda M, K: 3 * M * K + 4 * M * K // 64, None),
    "dequant fp8->bf16": ("dequantize_fp8_block", lambda qs: dequantize_fp8_block(qs[0], qs[1]),
                          lambda qs: F.dequantize_fp8_block(qs[0], qs[1], 128, torch.bfloat16),
                          lambda M, K: M * K + 4 * M * K // 128 + 2 * M * K, None),
}


def _kinds(op: str) -> list[str]:
    """GPU provider kinds that exist for ``op`` (the DSL first)."""
    o = registry.get_op(op)
    return [k for k in ("dsl", "cuda") if not isinstance(o.provider(k), registry.Support)]


def main():
    global _GS
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--ops", default=None, help="comma-separated subset of: " + ", ".join(OPS))
    ap.add_argument("--shapes", default=None, help="e.g. 8192x8192,16x7168")
    ap.add_argument("--sweep", action="store_true", help="also time the DSL launch geometries (SWEEP) at 8192^2")
    ap.add_argument("--reps", type=int, default=15, help="graph replays per timing (median)")
    ap.add_argument("--no-ref", action="store_true", help="skip the eager / torch-reference timings")
    ap.add_argument("--graph-calls", type=int, default=GRAPH_CALLS, help="calls per CUDA graph (>= the input sets)")
    args = ap.parse_args()
    _GS = torch.tensor([0.0123], device="cuda")
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw:.0f} GB/s (read + write)")
    names = args.ops.split(",") if args.ops else list(OPS)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows = []
    for (M, K) in shapes:
        xs = rotating(lambda i: _x(M, K, i), 2 * M * K)
        qs = [F.quantize_fp8_block(x, 128, "fp32") for x in xs]
        n_calls = max(args.graph_calls, len(xs))
        if M * K >= 1 << 24:      # the roofline at this size: a torch copy of the NVFP4 quantizer's bytes
            nb = _nv_bytes(M, K) // 8 * 4
            a_s = [torch.empty(nb // 4, dtype=torch.float32, device="cuda").uniform_() for _ in range(3)]
            b_s = [torch.empty_like(a) for a in a_s]
            t = time_graph([(lambda a=a, b=b: b.copy_(a)) for a, b in zip(a_s, b_s)], iters=n_calls, reps=args.reps)
            rows.append({"op": "copy same bytes", "shape": f"{M}x{K}", "provider": "torch", "us_graph": t,
                         "GBps": 2 * nb / (t * 1e-6) / 1e9, "pct_copy": 100 * 2 * nb / (t * 1e-6) / 1e9 / bw})
            print(f"ROW {'copy same bytes':18s} {M:5d}x{K:<5d} torch {t:9.2f} us {rows[-1]['pct_copy']:5.1f}% copy", flush=True)
            del a_s, b_s
        for name in names:
            op, kern, ref, nbytes, floor = OPS[name]
            src = qs if name.startswith("dequant") else xs
            per = {}
            for kind in _kinds(op):
                try:
                    with registry.use({op: kind}):
                        per[kind] = time_graph([(lambda a=a: kern(a)) for a in src], iters=n_calls, reps=args.reps)
                except registry.ProviderUnavailableError as e:
                    print(f"{name} {M}x{K}: {kind} unavailable: {e}")
            t_eager = t_ref = None
            if not args.no_ref:
                t_eager = time_cuda(lambda: kern(src[0]), warmup=3, iters=30)
                with registry.use({op: "torch"}):
                    t_ref = time_cuda(lambda: ref(src[0]), warmup=1, iters=3)
            chosen = registry.last_choice(op).kind if registry.last_choice(op) else "?"
            for kind, t in per.items():
                gbs = nbytes(M, K) / (t * 1e-6) / 1e9
                other = [v for k, v in per.items() if k != kind]
                rows.append(dict(op=name, shape=f"{M}x{K}", provider=kind + ("*" if kind == chosen else ""),
                                 us_graph=t, GBps=gbs, pct_copy=100 * gbs / bw,
                                 x_floor2=(t / (floor(M, K) / bw / 1e3)) if floor else None,
                                 vs_other=(other[0] / t) if other else None, us_eager_default=t_eager,
                                 ref_us=t_ref, x_ref=(t_ref / t) if t_ref else None))
                r = rows[-1]
                print(f"ROW {name:18s} {M:5d}x{K:<5d} {r['provider']:5s} {t:9.2f} us {r['pct_copy']:5.1f}% copy"
                      + (f"  x_floor2 {r['x_floor2']:.2f}" if r["x_floor2"] else "")
                      + (f"  vs_other {r['vs_other']:.2f}" if r["vs_other"] else ""), flush=True)
        del xs, qs
    tune_rows = []
    if args.sweep:
        import kernels_dsl.quantize as KQ
        M, K = 8192, 8192
        xs = rotating(lambda i: _x(M, K, i), 2 * M * K)
        qs = [F.quantize_fp8_block(x, 128, "fp32") for x in xs]
        for name in ("nvfp4 given swz", "nvfp4 amax swz", "mxfp4 dsv4", "fp8 b128 fp32", "dequant fp8->bf16"):
            op, kern, _, nbytes, _ = OPS[name]
            src = qs if name.startswith("dequant") else xs
            for sw in [{}] + SWEEP:
                KQ.OVERRIDE.update(KQ.flat_override(sw))
                try:
                    with registry.use({op: "dsl"}):
                        t = time_graph([(lambda a=a: kern(a)) for a in src], iters=max(args.graph_calls, len(src)),
                                       reps=args.reps)
                finally:
                    KQ.OVERRIDE.clear()
                gbs = nbytes(M, K) / (t * 1e-6) / 1e9
                tune_rows.append(dict(op=name, geometry=str(sw or "default"), us_graph=t, pct_copy=100 * gbs / bw))
                print(f"SWEEP {name:18s} {str(sw or 'default'):60s} {t:9.2f} us {100 * gbs / bw:5.1f}% copy", flush=True)
        print_table(tune_rows, ["op", "geometry", "us_graph", "pct_copy"], "DSL launch geometry at 8192x8192")
    print_table(rows, ["op", "shape", "provider", "us_graph", "GBps", "pct_copy", "x_floor2", "vs_other",
                       "us_eager_default", "ref_us", "x_ref"],
                f"quantize ops vs copy bandwidth {bw:.0f} GB/s (* = the registry's default; x_floor2 = time / "
                f"two-read floor; vs_other = other provider's time / this one)")
    save_json(args.json, {"copy_GBps": bw, "rows": rows, "tuning": tune_rows})


if __name__ == "__main__":
    main()
