"""Benchmark: DSV4 FP4-weight MoE grouped GEMMs at DSV4-Flash / Pro shapes on the H200.

Kernels: decode = kernels_cuda/moe_decode.cu (default for few rows per expert) vs the grouped v3
kernel of moe.cu; prefill = moe.cu v4 (default for FP8 activations) vs v3 (+ v4 diagnostics).
Ceiling: the CuTe DSL FP8 dense GEMM (kernels_dsl/fp8_gemm.py) at the per-expert GEMM shapes.

Decode (masked layout, m tokens per active expert): % of measured copy bandwidth on the weight
bytes of the active experts (W13 + W2 packed E2M1 + scales). Prefill (contiguous, >= 2048 rows
per expert): TFLOP/s vs the measured FP8 dense peak (torch._scaled_mm 8192^3 in the same run).
Baselines in the same process: torch bf16 ``torch._grouped_mm`` (or a bmm) on pre-dequantized
weights (matmul only; generous to the baseline) and, for decode, torch dequant + matmul.

Usage: PYTHONPATH=. python3 bench/bench_moe.py [--json out.json] [--quick]
(on the H200 with the ceiling rows: source .dsl/activate.sh first)
"""
from __future__ import annotations

import argparse
import time

import torch

from bench._util import copy_bandwidth, env_vars, save_json, time_flush_l2, time_graph


def fp8_peak():
    M = 8192
    a = torch.randn(M, M, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(M, M, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.ones(M, 1, device="cuda")
    sb = torch.ones(1, M, device="cuda")
    t = time_flush_l2(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    return 2 * M ** 3 / (t * 1e-6) / 1e12


#: Per-expert prefill GEMM shapes (M rows per expert, N, K): GEMM1 = [m, D] x [2I, D]^T, GEMM2 = [m, I] x [D, I]^T.
CEILING_SHAPES = [(f"{name} gemm{g}", m, n, k)
                  for name, (D, I, _E) in {"flash": (4096, 2048, 256), "pro": (7168, 3072, 384)}.items()
                  for m in (2048, 4096)
                  for g, n, k in ((1, 2 * I, D), (2, D, I))] + [("dense 8192^3", 8192, 8192, 8192)]


#: CuTe DSL FP8 GEMM configurations tried per shape (tile_n, cluster_m, epilogue); the fastest is the row.
#: (on the H200 the TMA-store epilogue won every shape; CTA pairs never did: docs/benchmarks.md)
CEILING_CONFIGS = ((256, 1, "tma"), (128, 1, "tma"), (256, 1, "direct"))


def dsl_fp8_ceiling(peak, shapes=None, configs=CEILING_CONFIGS):
    """Rows "cute-dsl fp8 dense (ceiling)": the CuTe DSL FP8 dense GEMM (kernels_dsl/fp8_gemm.py,
    bf16 out) at the grouped GEMMs' per-expert prefill shapes and at 8192^3, as TFLOP/s and % of
    ``peak`` (torch._scaled_mm 8192^3, same run); torch._scaled_mm at the same shape alongside.
    ``us``: bench._util.time_flush_l2 median (L2 flushed, like the other prefill rows) of the fastest of
    ``configs`` (all kept in ``configs_us``); ``us_graph``: CUDA-graph replay (warm L2, no host
    overhead). Skipped with a printed reason when the CuTe DSL is not importable or fails."""
    try:
        from kernels_dsl import fp8_gemm as G
        if not G._HAVE_DSL:
            raise ImportError("nvidia-cutlass-dsl not importable (on the H200: source .dsl/activate.sh)")
    except Exception as e:  # noqa: BLE001
        print(f"skipped cute-dsl fp8 dense (ceiling) rows: {type(e).__name__}: {e}", flush=True)
        return []
    rows = []
    for label, M, N, K in shapes or CEILING_SHAPES:
        a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
        fl = 2 * M * N * K
        times = {}
        for tile_n, cluster_m, epi in configs:
            name = f"n{tile_n}-c{cluster_m}-{epi}"
            try:
                # validate + compile (or load the cached .o) once, outside the timing
                launch, _ = G.fp8_gemm_launcher(a, b, tile_n=tile_n, cluster_m=cluster_m, epilogue=epi)
                launch()
                times[name] = (time_flush_l2(launch), bench_graph(launch))
            except Exception as e:  # noqa: BLE001
                print(f"skipped cute-dsl fp8 dense (ceiling) {label} {M}x{N}x{K} {name}: "
                      f"{type(e).__name__}: {str(e)[:200]}", flush=True)
        if not times:
            continue
        best = min(times, key=lambda c: times[c][0])
        t, tg = times[best]
        sa, sb = torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda")
        smm = lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
        ts, tsg = time_flush_l2(smm), bench_graph(smm)
        rows.append(dict(shape=label, fmt="-", act="fp8", mode="cute-dsl fp8 dense (ceiling)", experts=1, m=M,
                         n=N, k=K, config=best, us=t, us_graph=tg, tflops=fl / (t * 1e-6) / 1e12,
                         pct_peak=100 * fl / (t * 1e-6) / 1e12 / peak,
                         configs_us={c: v[0] for c, v in times.items()},
                         scaled_mm_us=ts, scaled_mm_us_graph=tsg, scaled_mm_tflops=fl / (ts * 1e-6) / 1e12))
        print(rows[-1], flush=True)
    return rows


#: Decode kernels compared (env of kernels_cuda/moe.py): the default decode kernel (moe_decode.cu) and
#: the grouped prefill kernel it replaced for small per-expert row counts.
DECODE_KERNELS = (("decode-kernel", {}), ("v3 (DSV4_MOE_DECODE=0)", {"DSV4_MOE_DECODE": "0", "DSV4_MOE_KERNEL": "v3"}))
#: Prefill kernels compared: default v4 (warp-specialized) and v3; diagnostics time v4 with parts switched
#: off (wrong results, timing only): 1 = no WGMMA, 2 = no FP4 decode, 3 = neither (loads + barriers).
PREFILL_KERNELS = (("default (fp8: v4, bf16: v3)", {}), ("v3", {"DSV4_MOE_KERNEL": "v3"}))
#: (DSV4_MOE_DIAG is refused unless DSV4_BENCH_DIAGNOSTICS=1 is set too: dsv4/config.py)
PREFILL_DIAG = tuple((f"v4 diag{d}", {"DSV4_MOE_KERNEL": "v4", "DSV4_MOE_DIAG": d, "DSV4_BENCH_DIAGNOSTICS": "1"})
                     for d in ("1", "2", "3"))


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
    return time_flush_l2(f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="MXFP4 only, fewer rows, 2 ceiling configs")
    ap.add_argument("--shapes", default="flash,pro", help="comma list of flash, pro")
    args = ap.parse_args()
    from dsv4.registry import use
    from dsv4.reference.moe import dequant_fp4_weight
    torch.backends.cuda.matmul.allow_tf32 = True
    bw = copy_bandwidth()
    peak = fp8_peak()
    print(f"copy bandwidth {bw:.0f} GB/s, fp8 _scaled_mm 8192^3 {peak:.0f} TFLOP/s")
    rows = dsl_fp8_ceiling(peak, configs=CEILING_CONFIGS[:2] if args.quick else CEILING_CONFIGS)
    shapes = {"flash": (4096, 2048, 256), "pro": (7168, 3072, 384)}
    shapes = {k: shapes[k] for k in args.shapes.split(",")}
    for name, (D, I, E) in shapes.items():
        for fmt in (("mxfp4",) if args.quick else ("mxfp4", "nvfp4")):
            W = make_weights(E, D, I, fmt)
            SF = 32 if fmt == "mxfp4" else 16
            bytes_per_expert = (2 * I * D + D * I) // 2 + (2 * I * D + D * I) // SF
            for act in ("fp8", "bf16"):
                # decode: n_active experts x m tokens, masked layout; several routings with disjoint
                # active experts are replayed in turn so one replay's weights are not in L2 from the last
                for n_active, m in ((8, 1), (64, 4), (E, 16)):
                    n_rot = max(1, min(4, E // n_active))
                    perm = torch.randperm(E, device="cuda")
                    gs = []
                    for r in range(n_rot):
                        counts = torch.zeros(E, dtype=torch.int32, device="cuda")
                        counts[perm[r * n_active:(r + 1) * n_active]] = m
                        gs.append(grouped(E, D, act, counts, "masked", max_m=m))
                    for label, kv in DECODE_KERNELS:
                        with env_vars(**kv), use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                            t_eager = time_flush_l2(lambda: run_gemms(gs[0], W))
                            t = time_graph([lambda g=g: run_gemms(g, W) for g in gs], iters=max(4, n_rot), reps=10)
                        floor = n_active * bytes_per_expert / (bw * 1e9) * 1e6
                        rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"decode-graph {label}", experts=n_active,
                                         m=m, us=t, us_eager=t_eager, floor_us=floor, pct_bw=100 * floor / t,
                                         tflops=2 * n_active * m * 3 * I * D / (t * 1e-6) / 1e12))
                        print(rows[-1], flush=True)
                # prefill: contiguous, 2048 (and 4096) rows per expert
                for n_active, m in ((16, 2048),) if args.quick else ((16, 2048), (8, 4096)):
                    counts = torch.zeros(E, dtype=torch.int32, device="cuda")
                    counts[torch.randperm(E, device="cuda")[:n_active]] = m
                    g = grouped(E, D, act, counts, "contiguous")
                    fl = 2 * n_active * m * 3 * I * D
                    kernels = PREFILL_KERNELS if act == "fp8" else PREFILL_KERNELS[:1]  # W4A16 always runs v3
                    if act == "fp8" and name == "flash" and fmt == "mxfp4" and m == 2048 and not args.quick:
                        kernels = kernels + PREFILL_DIAG
                    for label, kv in kernels:
                        with env_vars(**kv), use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
                            t = time_flush_l2(lambda: run_gemms(g, W), rep=10)
                        rows.append(dict(shape=name, fmt=fmt, act=act, mode=f"prefill {label}", experts=n_active, m=m,
                                         us=t, tflops=fl / (t * 1e-6) / 1e12 if "diag" not in label else float("nan"),
                                         pct_peak=100 * fl / (t * 1e-6) / 1e12 / peak if "diag" not in label
                                         else float("nan")))
                        print(rows[-1], flush=True)
            # baselines (bf16 torch on pre-dequantized weights), once per shape/fmt
            for n_active, m in ((8, 1), (16, 2048)):
                from dsv4.reference.moe import _unpermute_w13
                w13_bf = _unpermute_w13(dequant_fp4_weight(W.w13[:n_active], W.w13_scale[:n_active], fmt), I)
                w13_bf = (w13_bf * W.g13[:n_active, :1, None]).to(torch.bfloat16)
                w2_bf = (dequant_fp4_weight(W.w2[:n_active], W.w2_scale[:n_active], fmt)).to(torch.bfloat16)
                t = baseline_bf16(n_active, m, D, I, w13_bf, w2_bf)
                tdq = time_flush_l2(lambda: (dequant_fp4_weight(W.w13[:n_active], W.w13_scale[:n_active], fmt).to(torch.bfloat16),
                                     dequant_fp4_weight(W.w2[:n_active], W.w2_scale[:n_active], fmt).to(torch.bfloat16)), rep=5)
                floor = n_active * bytes_per_expert / (bw * 1e9) * 1e6
                rows.append(dict(shape=name, fmt=fmt, act="torch-bf16", mode="baseline", experts=n_active, m=m,
                                 us=t, us_with_dequant=t + tdq, floor_us=floor, pct_bw=100 * floor / t,
                                 tflops=2 * n_active * m * 3 * I * D / (t * 1e-6) / 1e12))
                print(rows[-1], flush=True)
                del w13_bf, w2_bf
            del W
            torch.cuda.empty_cache()
    print("\n| shape | fmt | act | mode | experts x m | us | floor us | % copy BW | TFLOP/s | % FP8 peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fmt']} | {r['act']} | {r['mode']} | {r['experts']} x {r['m']} | {r['us']:.1f} | "
              f"{r.get('floor_us', float('nan')):.1f} | {r.get('pct_bw', float('nan')):.0f} | {r['tflops']:.0f} | "
              f"{r.get('pct_peak', float('nan')):.0f} |")
    # NaN (diagnostics rows, missing columns) -> null: strict JSON (bench/_util.py save_json)
    save_json(args.json, {"copy_bw_GBps": bw, "fp8_peak_tflops": peak, "rows": rows,
                          "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")})


if __name__ == "__main__":
    main()
