"""Benchmark: the DSV4 routed-expert MoE layer (``moe_forward`` / ``moe_experts``) on the H200, as
users call it (routing, permutation, act_quant, both grouped GEMMs, combine), plus its parts.

Shapes: DSV4-Flash (D=4096, I=2048, E=256, route_scale 1.5) and Pro (D=7168, I=3072, E=384, 2.5),
top-6, T in {1, 4, 16, 64, 256, 1024, 4096, 16384} tokens, MXFP4 and NVFP4 weights (random bytes
with plausible scales: values do not change the timing), W4A8 (``act="fp8"``), contiguous layout
(masked too for T <= 256, ``max_m`` = the real largest expert count, as an engine would pass it).
Routings: ``uniform`` (random distinct top-6 per token) and ``skewed`` (one expert in every
token's top-6: T of the 6T assignments, the most a distinct top-k allows; the 25% of issue 12
cannot be reached with k = 6 distinct experts).

Rows per (shape, fmt, T, routing), all timed as CUDA-graph replays (``bench._util.time_graph``),
rotating over routings with different active experts while their weights fit in L2 several times:

* ``moe_forward`` (router included: fp32 gate GEMM + top-k) and ``moe_experts`` (given routing),
  default providers (``registry.last_choice`` of each op is stored in the JSON);
* ``glue`` = route + permute (+ act_quant) + combine alone, default providers and the torch glue
  (``glue torch``), i.e. what the layer costs beyond the two GEMMs;
* ``gemm1`` / ``gemm2``: ``moe_gemm1_swiglu`` / ``moe_gemm2`` on the layer's grouping, with
  whatever provider the registry picks;
* ``old cuda path``: ``moe_experts`` with the torch glue and the CUDA GEMMs (kernels_cuda/moe.py),
  where that provider serves the grouping (decode-sized groups);
* ``torch bf16 grouped mm``: ``torch._grouped_mm`` (bf16, CUTLASS, sm_90) on bf16 weights of the
  same shapes (pre-dequantized: the dequant is not timed; matmul + torch SwiGLU only; falls back
  to a ``torch.bmm`` over a padded [E, max_count] layout when ``_grouped_mm`` is missing).

Ceilings measured in the same run: device copy bandwidth (``bench._util.copy_bandwidth``,
read + write) -> floor = active experts' weight bytes (packed E2M1 + scale bytes of W13 and W2)
/ bandwidth; FP8 peak = ``torch._scaled_mm`` 8192^3 (and, without ``--quick``, the CuTe DSL FP8
dense GEMM at the per-expert prefill shapes: ``dsl_fp8_ceiling``).

Usage: PYTHONPATH=. python3 bench/bench_moe.py [--json out.json] [--quick] [--shapes flash,pro]
  [--fmts mxfp4,nvfp4] [--tokens 1,64,4096] [--no-baselines]
``--quick`` (about 100 s on the H200): flash, MXFP4 and NVFP4, all token counts, skewed routing at
T = 64 and 4096, torch baselines at those two, no masked rows, no DSL ceiling (measured: flash
MXFP4 over 6 token counts took 24 s, H200 2026-12-01). ``--gemm cuda|dsl`` forces the grouped
GEMM provider (default: the registry's choice).
Measured 2026-12-01 (H200, quick, ``--gemm cuda``): docs/benchmarks.md "MoE layer glue".
"""
from __future__ import annotations

import argparse
import math
import time
import traceback

import torch

from bench._util import copy_bandwidth, save_json, time_flush_l2, time_graph

#: name -> (D, I, E, route_scale)
SHAPES = {"flash": (4096, 2048, 256, 1.5), "pro": (7168, 3072, 384, 2.5)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
TOPK = 6
ROUTINGS = ("uniform", "skewed")
QUICK_TOKENS = TOKENS
QUICK_SKEWED = (64, 4096)
#: L2 of the H200 is 60 MB: rotate over routings until their weights exceed it this many times
L2_BYTES = 60 << 20
ROTATE_FACTOR = 3
MAX_ROTATIONS = 4


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




def bench_graph(fn):
    """Time ``fn`` replayed from a CUDA graph (no Python / dispatch overhead, as in decode serving)."""
    return time_graph([fn], iters=10, reps=20)


def expert_bytes(D: int, I: int, fmt: str) -> int:
    """Bytes of one expert's weights as the kernels read them: packed E2M1 + scale bytes, W13 + W2."""
    SF = 32 if fmt == "mxfp4" else 16
    return (3 * I * D) // 2 + (3 * I * D) // SF


def make_routing(T: int, E: int, kind: str, seed: int, route_scale: float):
    """(topk_idx int32 [T, 6], topk_w fp32 [T, 6]) on the GPU: random distinct experts per token;
    ``skewed``: expert ``seed % E`` replaces the last slot of every token that lacks it."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(T, E, device="cuda", generator=g).topk(TOPK, dim=1).indices
    if kind == "skewed":
        hot = seed % E
        lacks = ~(idx == hot).any(1)
        idx[:, -1] = torch.where(lacks, torch.full_like(idx[:, -1], hot), idx[:, -1])
    w = torch.rand(T, TOPK, device="cuda", generator=g) + 0.05
    w = w / w.sum(1, keepdim=True) * route_scale
    return idx.to(torch.int32).contiguous(), w.contiguous()


def make_gate(E: int, D: int, kind: str, seed: int):
    """bf16 gate weight [E, D] (as stored in the DSV4 checkpoint; the gate GEMM is fp32 math) and
    the fp32 selection bias [E]; ``skewed``: a +1e3 bias puts expert ``seed % E`` into every
    token's top-6 (the router's share of the skew)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gw = (torch.randn(E, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.zeros(E, device="cuda")
    if kind == "skewed":
        bias[seed % E] = 1e3
    return gw, bias


def make_x(T: int, D: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)


def _counts(idx: torch.Tensor, E: int) -> torch.Tensor:
    return torch.bincount(idx.reshape(-1).long(), minlength=E)


def grouped_mm_baseline(gs, w13_bf, w2_bf, I: int):
    """torch bf16 grouped GEMMs on bf16 weights for each grouping of ``gs`` (list of
    (a_bf16 [R, D], offs int32 [E])): ``_grouped_mm`` -> clamped SwiGLU -> ``_grouped_mm``."""
    have = hasattr(torch, "_grouped_mm")

    def swiglu(hh):
        gate, up = hh[:, :I].float(), hh[:, I:].float()
        return (torch.nn.functional.silu(gate.clamp(max=10)) * up.clamp(-10, 10)).to(torch.bfloat16)

    fns = []
    for a, offs, padded in gs:
        if have:
            def f(a=a, offs=offs):
                hh = torch._grouped_mm(a, w13_bf.transpose(-2, -1), offs=offs)
                return torch._grouped_mm(swiglu(hh), w2_bf.transpose(-2, -1), offs=offs)
        else:   # loop-free fallback: bmm over [E, max_count] padded rows
            def f(padded=padded):
                hh = torch.bmm(padded, w13_bf.transpose(1, 2))
                E_, M_, _ = hh.shape
                h = swiglu(hh.view(E_ * M_, -1)).view(E_, M_, -1)
                return torch.bmm(h, w2_bf.transpose(1, 2))
        fns.append(f)
    return fns, ("torch._grouped_mm" if have else "torch.bmm (padded)")


class LayerCase:
    """Inputs of one (shape, fmt, T, routing) point: ``n_rot`` rotations of (x, idx, w) and of
    (x, gate weight, bias) for moe_forward, their groupings and active-expert counts."""

    def __init__(self, name, W, T, kind, fmt, seed=0):
        D, I, E, rs = SHAPES[name]
        self.name, self.W, self.T, self.kind, self.fmt = name, W, T, kind, fmt
        self.D, self.I, self.E, self.route_scale = D, I, E, rs
        per_token = expert_bytes(D, I, fmt)
        est_active = min(E, T * TOPK)
        self.n_rot = max(1, min(MAX_ROTATIONS, -(-ROTATE_FACTOR * L2_BYTES // max(1, est_active * per_token))))
        self.rot = []
        for r in range(self.n_rot):
            s = seed + 1000 * r + 7
            x = make_x(T, D, s)
            idx, w = make_routing(T, E, kind, s, rs)
            gw, bias = make_gate(E, D, kind, s)
            self.rot.append(dict(x=x, idx=idx, w=w, gw=gw, bias=bias))
        # host-side statistics (outside any timing): active experts averaged over the rotations
        from dsv4.ops import moe
        cs = [_counts(r["idx"], E) for r in self.rot]
        fs = [_counts(moe.moe_route(r["x"], r["gw"], topk=TOPK, route_scale=rs, bias=r["bias"])[0], E) for r in self.rot]
        self.active = sum(int((c > 0).sum()) for c in cs) / self.n_rot
        self.active_forward = sum(int((c > 0).sum()) for c in fs) / self.n_rot
        self.max_count = max(int(c.max()) for c in cs)
        self.bytes = int(self.active * per_token)
        self.bytes_forward = int(self.active_forward * per_token)
        self.flops = 2 * T * TOPK * 3 * I * D

    # -- callables (each returns the layer output) -----------------------------------------
    def experts_fns(self, layout="contiguous"):
        from dsv4.ops import moe
        mm = self.max_count if layout == "masked" else None
        return [lambda r=r: moe.moe_experts(r["x"], r["idx"], r["w"], self.W, layout=layout, max_m=mm) for r in self.rot]

    def forward_fns(self):
        from dsv4.ops import moe
        return [lambda r=r: moe.moe_forward(r["x"], self.W, r["gw"], topk=TOPK, route_scale=self.route_scale,
                                            bias=r["bias"]) for r in self.rot]

    def glue_fns(self):
        """route + permute + combine (on a stand-in GEMM2 output of the right shape)."""
        from dsv4.ops import moe
        fns = []
        for r in self.rot:
            y = torch.empty(self.T * TOPK, self.D, device="cuda")

            def f(r=r, y=y):
                idx, w = moe.moe_route(r["x"], r["gw"], topk=TOPK, route_scale=self.route_scale, bias=r["bias"])
                g = moe.moe_permute(r["x"], idx, w, self.E)
                return moe.moe_combine(y, g.pos, self.T, TOPK)
            fns.append(f)
        return fns

    def gemm_fns(self, which):
        from dsv4.ops import moe
        fns = []
        for r in self.rot:
            g = moe.moe_permute(r["x"], r["idx"], r["w"], self.E)
            if which == "gemm1":
                fns.append(lambda g=g: moe.moe_gemm1_swiglu(g, self.W))
            else:
                h, h_s = moe.moe_gemm1_swiglu(g, self.W)
                fns.append(lambda g=g, h=h, h_s=h_s: moe.moe_gemm2(h, h_s, g, self.W))
        return fns

    def baseline_inputs(self):
        out = []
        for r in self.rot:
            c = _counts(r["idx"], self.E)
            offs = torch.cumsum(c, 0).to(torch.int32)
            a = torch.randn(self.T * TOPK, self.D, device="cuda").to(torch.bfloat16)
            padded = None if hasattr(torch, "_grouped_mm") else \
                torch.randn(self.E, int(c.max()), self.D, device="cuda").to(torch.bfloat16)
            out.append((a, offs, padded))
        return out


def _iters(n_fns: int, est_us: float) -> tuple[int, int]:
    """(calls per graph, replays): about 20 ms of work per replay, at least one call per rotation."""
    per = max(n_fns, min(40, int(20000 / max(est_us, 1.0))))
    per = -(-per // n_fns) * n_fns
    return per, (10 if est_us < 2000 else 5)


def timed(fns, est_us=100.0):
    for f in fns:   # compile / warm up outside the graph
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fns[0]()
    torch.cuda.synchronize()
    est = max(est_us, (time.perf_counter() - t0) * 1e6 * 0.5)
    iters, reps = _iters(len(fns), est)
    return time_graph(fns, iters=iters, reps=reps)


def _choices():
    from dsv4 import registry
    out = {}
    for op in ("moe_route", "moe_permute", "moe_gemm1_swiglu", "moe_gemm2", "moe_combine"):
        c = registry.last_choice(op)
        if c is not None:
            out[op] = c.kind + ": " + c.reason
    return out


class DeviceDead(RuntimeError):
    """A sticky CUDA error (illegal address, ...): the context cannot run anything more."""


def layer_rows(case: LayerCase, bw: float, peak: float, args, w_bf=None, rows=None) -> list[dict]:
    from dsv4 import registry
    rows = [] if rows is None else rows
    base = dict(shape=case.name, fmt=case.fmt, act="fp8", routing=case.kind, T=case.T, active=case.active,
                max_count=case.max_count, rotations=case.n_rot)
    gemm_ctx = {} if args.gemm == "default" else {"moe_gemm1_swiglu": args.gemm, "moe_gemm2": args.gemm}

    def add(mode, build, *, nbytes=None, flops=None, layout="contiguous", ctx=None, est=100.0, extra=None):
        """Time the callables ``build()`` returns (built under the row's provider overrides)."""
        try:
            with registry.use(dict(gemm_ctx, **(ctx or {}))):
                us = timed(build(), est)
                ch = _choices()
        except Exception as e:  # noqa: BLE001 - one failing row must not stop the run
            print(f"  {mode}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc()
            rows.append(dict(base, mode=mode, layout=layout, us=float("nan"), error=f"{type(e).__name__}: {e}"[:500]))
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001
                raise DeviceDead(f"{mode} at T={case.T}: {type(e2).__name__}: {str(e2)[:200]}") from e
            return float("nan")
        r = dict(base, mode=mode, layout=layout, us=us, providers=ch)
        if nbytes:
            r["floor_us"] = nbytes / (bw * 1e9) * 1e6
            r["pct_bw"] = 100 * r["floor_us"] / us
        if flops:
            r["tflops"] = flops / (us * 1e-6) / 1e12
            r["pct_peak"] = 100 * r["tflops"] / peak
        if extra:
            r.update(extra)
        rows.append(r)
        print(f"  {mode:24s} {layout:10s} {us:10.1f} us" + (f"  {r['pct_bw']:5.1f}% BW" if nbytes else "")
              + (f"  {r['tflops']:7.1f} TFLOP/s" if flops else ""), flush=True)
        return us

    est = max(20.0, case.flops / 400e12 * 1e6, case.bytes / 2e12 * 1e6)
    t_exp = add("moe_experts", case.experts_fns, nbytes=case.bytes, flops=case.flops, est=est)
    add("moe_forward", case.forward_fns, nbytes=case.bytes_forward, flops=case.flops, est=est)
    if case.T <= 256 and not args.quick:
        add("moe_experts", lambda: case.experts_fns("masked"), nbytes=case.bytes, flops=case.flops, layout="masked", est=est,
            extra={"max_m": case.max_count})
    add("glue", case.glue_fns, est=10.0)
    add("glue torch", case.glue_fns, ctx={"moe_route": "torch", "moe_permute": "torch", "moe_combine": "torch"},
        est=50.0)
    g1 = 2 * case.T * TOPK * 2 * case.I * case.D
    add("gemm1", lambda: case.gemm_fns("gemm1"), nbytes=case.bytes * 2 // 3, flops=g1, est=est * 2 / 3)
    add("gemm2", lambda: case.gemm_fns("gemm2"), nbytes=case.bytes // 3, flops=case.flops - g1, est=est / 3)
    if not args.no_old and _old_cuda_available(case):
        add("old cuda path", case.experts_fns, nbytes=case.bytes, flops=case.flops, est=max(est, t_exp or 0),
            ctx={"moe_route": "torch", "moe_permute": "torch", "moe_combine": "torch", "moe_gemm1_swiglu": "cuda",
                 "moe_gemm2": "cuda"})
    if w_bf is not None and (not args.quick or case.T in QUICK_SKEWED):
        fns, what = grouped_mm_baseline(case.baseline_inputs(), w_bf[0], w_bf[1], case.I)
        add("torch bf16 grouped mm", lambda: fns, nbytes=case.active * 3 * case.I * case.D * 2, flops=case.flops, est=est,
            extra={"baseline": what + " on pre-dequantized bf16 weights (matmul + SwiGLU)"})
    return rows


def _old_cuda_available(case) -> bool:
    """Whether the cuda GEMM provider serves this case's grouping (it declines prefill-sized groups,
    kernels_cuda/moe.py: the DSL grouped GEMM is faster there)."""
    from dsv4 import registry
    from dsv4.target import Target
    p = {"fmt": case.fmt, "act": "fp8", "E": case.E, "N": 2 * case.I, "K": case.D, "R": case.T * TOPK,
         "max_m": None, "device": "cuda"}
    return bool(registry.get_op("moe_gemm1_swiglu").check("cuda", p, Target.of("cuda")))


def bf16_weights(E: int, D: int, I: int):
    """bf16 W13 [E, 2I, D] and W2 [E, D, I] for the torch baseline (uniform values: the timing
    does not depend on them; dequantizing 13-51 GB of FP4 would cost more than the whole run)."""
    w13 = torch.empty(E, 2 * I, D, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02)
    w2 = torch.empty(E, D, I, device="cuda", dtype=torch.bfloat16).uniform_(-0.02, 0.02)
    return w13, w2


def _fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def print_tables(rows):
    print("\n| shape | fmt | routing | T | active | mode | layout | us | floor us | % copy BW | TFLOP/s | % FP8 peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "T" not in r:
            continue
        print(f"| {r['shape']} | {r['fmt']} | {r['routing']} | {r['T']} | {r['active']:.0f} | {r['mode']} | {r['layout']} | "
              f"{_fmt(r.get('us'), '.1f')} | {_fmt(r.get('floor_us'), '.1f')} | {_fmt(r.get('pct_bw'), '.0f')} | "
              f"{_fmt(r.get('tflops'), '.0f')} | {_fmt(r.get('pct_peak'), '.0f')} |")
    glue = [r for r in rows if r.get("mode") in ("glue", "glue torch") and r.get("routing") == "uniform"]
    if glue:
        print("\nglue alone (route + permute/act_quant + combine, graph replay, uniform routing):")
        for r in glue:
            print(f"  {r['shape']} {r['fmt']} T={r['T']:>5} {r['mode']:10s} {_fmt(r.get('us'), '.1f')} us")


def main(argv=None):
    ap = argparse.ArgumentParser(description="DSV4 MoE layer benchmark (H200)")
    ap.add_argument("--json", default=None, help="write all rows as strict JSON here")
    ap.add_argument("--quick", action="store_true", help="flash, both formats, about 100 s")
    ap.add_argument("--shapes", default="flash,pro", help="comma list of flash, pro")
    ap.add_argument("--fmts", default="mxfp4,nvfp4", help="comma list of mxfp4, nvfp4")
    ap.add_argument("--tokens", default=None, help="comma list of token counts (default: all 8, quick: 6)")
    ap.add_argument("--no-baselines", action="store_true", help="skip the torch bf16 grouped mm rows")
    ap.add_argument("--no-old", action="store_true", help="skip the old CUDA path rows")
    ap.add_argument("--ceiling", action="store_true", help="also time the CuTe DSL FP8 dense ceiling rows")
    ap.add_argument("--gemm", default="default", choices=("default", "dsl", "cuda", "torch"),
                    help="force the provider of moe_gemm1_swiglu / moe_gemm2 (default: the registry's choice)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        import sys
        print("bench_moe needs a CUDA GPU (H200)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False   # the gate GEMM is fp32, as in the reference
    t_start = time.perf_counter()
    bw = copy_bandwidth()
    peak = fp8_peak()
    print(f"copy bandwidth {bw:.0f} GB/s, fp8 _scaled_mm 8192^3 {peak:.0f} TFLOP/s; torch._grouped_mm "
          f"{'available' if hasattr(torch, '_grouped_mm') else 'missing (bmm fallback)'}", flush=True)
    rows = dsl_fp8_ceiling(peak, configs=CEILING_CONFIGS) if args.ceiling else []
    shapes = args.shapes.split(",")
    fmts = args.fmts.split(",")
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TOKENS)
    if args.quick:
        shapes = shapes[:1]
        tokens = [t for t in tokens if t in QUICK_TOKENS] if args.tokens else list(QUICK_TOKENS)
    for name in shapes:
        D, I, E, _ = SHAPES[name]
        w_bf = None if args.no_baselines else bf16_weights(E, D, I)
        for fmt in fmts:
            W = make_weights(E, D, I, fmt)
            for T in tokens:
                for kind in ROUTINGS:
                    if kind == "skewed" and args.quick and T not in QUICK_SKEWED:
                        continue
                    print(f"{name} {fmt} T={T} {kind} (+{time.perf_counter() - t_start:.0f}s)", flush=True)
                    try:
                        case = LayerCase(name, W, T, kind, fmt, seed=T)
                        layer_rows(case, bw, peak, args, w_bf, rows)
                    except DeviceDead as e:
                        print(f"ABORT: the CUDA context is dead ({e}); rows so far are kept", flush=True)
                        print_tables(rows)
                        save_json(args.json, {"copy_bw_GBps": bw, "fp8_peak_tflops": peak, "rows": rows,
                                              "aborted": str(e), "gpu": torch.cuda.get_device_name()})
                        return 3
                    del case
                    torch.cuda.empty_cache()
            del W
            torch.cuda.empty_cache()
        del w_bf
        torch.cuda.empty_cache()
    print_tables(rows)
    print(f"total {time.perf_counter() - t_start:.0f}s")
    save_json(args.json, {"copy_bw_GBps": bw, "fp8_peak_tflops": peak, "rows": rows,
                          "grouped_mm": "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "torch.bmm (padded)",
                          "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
