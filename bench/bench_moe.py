"""Benchmark: DSV4 FP4-weight MoE grouped GEMMs (moe.cu) at DSV4-Flash / Pro shapes on the H200.

Decode (masked layout, m tokens per active expert): % of measured copy bandwidth on the weight
bytes of the active experts (W13 + W2 packed E2M1 + scales). Prefill (contiguous, >= 2048 rows
per expert): TFLOP/s vs the measured FP8 dense peak (torch._scaled_mm 8192^3 in the same run).
Baselines in the same process: torch bf16 ``torch._grouped_mm`` (or a bmm) on pre-dequantized
weights (matmul only; generous to the baseline) and, for decode, torch dequant + matmul.

Usage: PYTHONPATH=. python3 bench/bench_moe.py [--json out.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench._util import copy_bandwidth, time_graph


def bench(fn, warmup=3, rep=20):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3  # us


def fp8_peak():
    M = 8192
    a = torch.randn(M, M, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(M, M, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.ones(M, 1, device="cuda")
    sb = torch.ones(1, M, device="cuda")
    t = bench(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return 2 * M ** 3 / (t * 1e-6) / 1e12


def make_weights(E, D, I, fmt):
    """Random packed E2M1 bytes and plausible scales (bytes 118..122 UE8M0 / E4M3 around 1)."""
    from dsv4.ops import moe
    SF = 32 if fmt == "mxfp4" else 16
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randint(0, 256, (E, 2 * I, D // 2), dtype=torch.uint8, device="cuda", generator=g)
    w2 = torch.randint(0, 256, (E, D, I // 2), dtype=torch.uint8, device="cuda", generator=g)
    if fmt == "mxfp4":
        s13 = torch.randint(118, 123, (E, 2 * I, D // SF), dtype=torch.uint8, device="cuda", generator=g)
        s2 = torch.randint(118, 123, (E, D, I // SF), dtype=torch.uint8, device="cuda", generator=g)
        s13, s2 = s13.view(torch.float8_e8m0fnu), s2.view(torch.float8_e8m0fnu)
        g13 = g2 = None
    else:
        s13 = torch.randint(0x30, 0x40, (E, 2 * I, D // SF), dtype=torch.uint8, device="cuda", generator=g)
        s2 = torch.randint(0x30, 0x40, (E, D, I // SF), dtype=torch.uint8, device="cuda", generator=g)
        s13, s2 = s13.view(torch.float8_e4m3fn), s2.view(torch.float8_e4m3fn)
        g13 = torch.full((E, 2), 0.01, device="cuda")
        g2 = torch.full((E,), 0.01, device="cuda")
    W = moe.moe_prepare_weights(w13, s13, w2, s2, fmt=fmt, w13_global=g13, w2_global=g2)
    del w13, w2
    return W


def grouped(E, D, act, counts, layout, max_m=None):
    """A grouped layout with the given per-expert row counts (device tensors), random activations."""
    from dsv4.ops.moe import MoEGrouped
    counts = counts.to(torch.int32)
    if layout == "contiguous":
        R = int(counts.sum())
        row_start = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    else:
        R = E * max_m
        row_start = (torch.arange(E, device="cuda") * max_m).to(torch.int32)
    x = torch.randn(R, D, device="cuda")
    if act == "fp8":
        from dsv4.formats import quantize_fp8_block
        a, a_s = quantize_fp8_block(x, 128, "ue8m0")
    else:
        a, a_s = x.to(torch.bfloat16), None
    rw = torch.rand(R, device="cuda")
    return MoEGrouped(a, a_s, row_start, counts, rw, torch.zeros(1, dtype=torch.int64, device="cuda"))


def bench_graph(fn):
    """Time ``fn`` replayed from a CUDA graph (no Python / dispatch overhead, as in decode serving)."""
    return time_graph([fn], iters=10, reps=20)


def run_gemms(g, W):
    from dsv4.ops import moe
    h, h_s = moe.moe_gemm1_swiglu(g, W)
    return moe.moe_gemm2(h, h_s, g, W)


def baseline_bf16(n_active, m, D, I, w13_bf, w2_bf):
    """torch bf16 grouped matmul on pre-dequantized weights: [n, m, D] x [n, D, 2I] -> swiglu -> x [n, I, D]."""
    x = torch.randn(n_active, m, D, device="cuda", dtype=torch.bfloat16)

    def f():
        hh = torch.bmm(x, w13_bf.transpose(1, 2))
        gate, up = hh[..., :I].float(), hh[..., I:].float()
        h = (torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)).to(torch.bfloat16)
        return torch.bmm(h, w2_bf.transpose(1, 2))
    return bench(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from dsv4.registry import use
    from dsv4.ops import moe
    from dsv4.reference.moe import dequant_fp4_weight
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth()
    peak = fp8_peak()
    print(f"copy bandwidth {bw:.0f} GB/s, fp8 _scaled_mm 8192^3 {peak:.0f} TFLOP/s")
    rows = []
    shapes = {"flash": (4096, 2048, 256), "pro": (7168, 3072, 384)}
    for name, (D, I, E) in shapes.items():
        for fmt in (("mxfp4",) if args.quick else ("mxfp4", "nvfp4")):
            W = make_weights(E, D, I, fmt)
            SF = 32 if fmt == "mxfp4" else 16
            bytes_per_expert = (2 * I * D + D * I) // 2 + (2 * I * D + D * I) // SF
            for act in ("fp8", "bf16"):
                # decode: n_active experts x m tokens, masked layout
                for n_active, m in ((8, 1), (64, 4), (E, 16)):
                    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
                    counts[torch.randperm(E, device="cuda")[:n_active]] = m
                    g = grouped(E, D, act, counts, "masked", max_m=m)
                    for ver in (("v3", "v2", "v1") if (name == "flash" and act == "fp8") else ("v3", "v2")):
                        os.environ["DSV4_MOE_KERNEL"] = ver
                        with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                            t_eager = bench(lambda: run_gemms(g, W))
                            t = bench_graph(lambda: run_gemms(g, W))
                        floor = n_active * bytes_per_expert / (bw * 1e9) * 1e6
                        rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"decode-graph-{ver}", experts=n_active,
                                         m=m, us=t, us_eager=t_eager, floor_us=floor, pct_bw=100 * floor / t,
                                         tflops=2 * n_active * m * 3 * I * D / (t * 1e-6) / 1e12))
                        print(rows[-1], flush=True)
                    os.environ.pop("DSV4_MOE_KERNEL", None)
                    if name == "flash" and fmt == "mxfp4" and n_active == E:  # diagnostics (wrong results)
                        for diag in ("1", "2"):
                            os.environ["DSV4_MOE_DIAG"] = diag
                            with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                                td = bench_graph(lambda: run_gemms(g, W))
                            os.environ.pop("DSV4_MOE_DIAG")
                            rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"diag{diag}-" + ("no-wgmma" if diag == "1" else "no-decode"),
                                             experts=n_active, m=m, us=td, tflops=float("nan")))
                            print(rows[-1], flush=True)
                # prefill: contiguous, 2048 (and 4096) rows per expert
                for n_active, m in ((16, 2048),) if args.quick else ((16, 2048), (8, 4096)):
                    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
                    counts[torch.randperm(E, device="cuda")[:n_active]] = m
                    g = grouped(E, D, act, counts, "contiguous")
                    for ver in (("v3", "v2", "v1") if (name == "flash" and act == "fp8") else ("v3", "v2")):
                        os.environ["DSV4_MOE_KERNEL"] = ver
                        with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                            t = bench(lambda: run_gemms(g, W), rep=10)
                        fl = 2 * n_active * m * 3 * I * D
                        rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"prefill-{ver}", experts=n_active, m=m,
                                         us=t, tflops=fl / (t * 1e-6) / 1e12,
                                         pct_peak=100 * fl / (t * 1e-6) / 1e12 / peak))
                        print(rows[-1], flush=True)
                    os.environ.pop("DSV4_MOE_KERNEL", None)
                    if name == "flash" and fmt == "mxfp4" and m == 2048:  # diagnostics (wrong results)
                        for diag in ("1", "2"):
                            os.environ["DSV4_MOE_DIAG"] = diag
                            with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                                td = bench(lambda: run_gemms(g, W), rep=10)
                            os.environ.pop("DSV4_MOE_DIAG")
                            rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"diag{diag}-" + ("no-wgmma" if diag == "1" else "no-decode"),
                                             experts=n_active, m=m, us=td, tflops=float("nan")))
                            print(rows[-1], flush=True)
            # baselines (bf16 torch on pre-dequantized weights), once per shape/fmt
            for n_active, m in ((8, 1), (16, 2048)):
                from dsv4.reference.moe import _unpermute_w13
                w13_bf = _unpermute_w13(dequant_fp4_weight(W.w13[:n_active], W.w13_scale[:n_active], fmt), I)
                w13_bf = (w13_bf * W.g13[:n_active, :1, None]).to(torch.bfloat16)
                w2_bf = (dequant_fp4_weight(W.w2[:n_active], W.w2_scale[:n_active], fmt)).to(torch.bfloat16)
                t = baseline_bf16(n_active, m, D, I, w13_bf, w2_bf)
                tdq = bench(lambda: (dequant_fp4_weight(W.w13[:n_active], W.w13_scale[:n_active], fmt).to(torch.bfloat16),
                                     dequant_fp4_weight(W.w2[:n_active], W.w2_scale[:n_active], fmt).to(torch.bfloat16)), rep=5)
                floor = n_active * bytes_per_expert / (bw * 1e9) * 1e6
                rows.append(dict(shape=name, fmt=fmt, act="torch-bf16", mode="baseline", experts=n_active, m=m,
                                 us=t, us_with_dequant=t + tdq, floor_us=floor, pct_bw=100 * floor / t,
                                 tflops=2 * n_active * m * 3 * I * D / (t * 1e-6) / 1e12))
                print(rows[-1], flush=True)
                del w13_bf, w2_bf
            del W
            torch.cuda.empty_cache()
    print("\n| shape | fmt | act | mode | experts x m | us | floor us | % copy BW | TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fmt']} | {r['act']} | {r['mode']} | {r['experts']} x {r['m']} | {r['us']:.1f} | "
              f"{r.get('floor_us', float('nan')):.1f} | {r.get('pct_bw', float('nan')):.0f} | {r['tflops']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw_GBps": bw, "fp8_peak_tflops": peak, "rows": rows,
                       "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}, f, indent=1)


if __name__ == "__main__":
    main()
