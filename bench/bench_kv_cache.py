"""Benchmark the kv_cache ops (dsl / cuda providers) vs the torch reference and the copy-bandwidth roofline.

Cases (DSV4-Flash sizes): append (SWA / compressed cache insert), compressors (attention d=512 and
indexer d=128, CSA ratio 4 and HCA ratio 128) and the SWA + top-k gather, each at decode
(B = 128) and prefill (32k tokens) sizes.

Time per call = CUDA-graph replay of ITERS calls rotating over input copies whose total size
exceeds L2 (>= 256 MB where the case is large enough), median over REPS replays. Roofline =
compulsory bytes (read + written, listed per case) / measured device-to-device copy bandwidth
(bytes read + written of a 2 GiB copy). The torch reference (eager; it syncs, so no graph) is
timed with CUDA events, median.

    PYTHONPATH=. python3 bench/bench_kv_cache.py --json out.json [--providers dsl,cuda]
        [--only append,gather,compress] [--no-variants]

append / gather are timed for every provider in ``--providers`` (compressors: cuda only); the
variant section times the kv_cache.cu tuning macros and the DSL kernels' configs
(``kernels_dsl.kv_cache.VARIANT``), each checked bit for bit against the first variant.
"""
from __future__ import annotations

import argparse

import torch

from bench._util import copy_bandwidth, print_table, save_json, time_cuda
from bench._util import time_graph as _time_graph
from dsv4 import registry
from dsv4.ops.kv_cache import kv_cache_append, kv_compress_decode, kv_compress_prefill, kv_gather, new_compress_state
from dsv4.reference import kv_cache as ref
from dsv4.reference.rope import rope_cos_sin_table

ITERS, REPS = 20, 15


def time_graph(fns, iters: int = ITERS, reps: int = REPS) -> float:
    return _time_graph(fns, iters, reps)


def n_sets(bytes_each: int, min_total: int = 256 << 20) -> int:
    return max(1, min(8, -(-min_total // max(1, bytes_each))))


def _gather_case(R, T, K, ne, bs, dev):
    """A kv_gather problem: R requests with ``ne`` compressed entries each (pages of ``bs``, random
    block_table) and a 128-slot SWA ring, T rows of K random indices (``n_sets`` sets, rotated past
    L2); returns the tensors, the number of index sets and the bytes moved per call."""
    pages = ne // bs
    cache = torch.empty(R * pages, bs * 584, dtype=torch.uint8, device=dev)
    swa = torch.empty(R * 2, 64 * 584, dtype=torch.uint8, device=dev)
    kv_cache_append(cache, kv_rows(R * pages * bs, 1, dev), torch.arange(R * pages * bs, device=dev))
    kv_cache_append(swa, kv_rows(R * 128, 2, dev), torch.arange(R * 128, device=dev))
    bt = torch.randperm(R * pages, device=dev).view(R, pages).to(torch.int32)
    swa_bt = torch.arange(R * 2, dtype=torch.int32, device=dev).view(R, 2)
    k = n_sets(T * (128 + K) * 1024)
    idx = [torch.randint(-1, ne, (T, K), device=dev, dtype=torch.int32) for _ in range(k)]
    swa_idx = torch.arange(128, dtype=torch.int32, device=dev).repeat(T, 1)
    lens = torch.full((R,), ne, dtype=torch.int32, device=dev)
    swa_lens = torch.full((R,), 128, dtype=torch.int32, device=dev)
    return cache, swa, bt, swa_bt, idx, swa_idx, lens, swa_lens, k, T * (128 + K) * (584 + 1024 + 4)


def kv_rows(n, gen_seed, dev):
    g = torch.Generator(device=dev).manual_seed(gen_seed)
    x = torch.randn(n, 512, device=dev, generator=g) * 2
    x[:, 7] *= 50
    return x.bfloat16()


PROVIDERS = ("dsl", "cuda")


def bench_append(dev, bw, rows):
    # random slots (the target case), and the same slots sorted (what the DRAM scatter costs)
    for label, N in (("decode B=128", 128), ("prefill 32k", 32768), ("prefill 32k sorted slots", 32768),
                     ("prefill 32k dense random slots", 32768), ("prefill 32k random pages", 32768)):
        nb, bs = max(64, 4 * N // 64), 64
        if "dense" in label:
            nb = N // bs
        cache = torch.zeros(nb, bs * 584, dtype=torch.uint8, device=dev)
        k = n_sets(N * 1024)
        xs = [kv_rows(N, i, dev) for i in range(k)]
        sl = [torch.randperm(nb * bs, device=dev)[:N] for _ in range(k)]
        if "sorted" in label:
            sl = [s.sort().values for s in sl]
        if "pages" in label:             # a prefill's slots: whole 64-token pages in random order
            sl = [(torch.randperm(nb, device=dev)[:N // bs, None] * bs + torch.arange(bs, device=dev)).reshape(-1)
                  for _ in range(k)]
        nbytes = N * (1024 + 584 + 8)
        tr = time_cuda(lambda: ref.kv_cache_append_ref(cache, xs[0], sl[0]), warmup=2, iters=10)
        for prov in PROVIDERS:
            with registry.use(kv_cache_append=prov):
                t = time_graph([lambda i=i: kv_cache_append(cache, xs[i], sl[i]) for i in range(k)])
            rows.append(dict(op="append fp8_ds_mla", case=label, provider=prov, us=t, ref_us=tr, MB=nbytes / 1e6,
                             roof_us=nbytes / bw * 1e6))


def _compress_inputs(T, d, ratio, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    kv = torch.randn(T, coff * d, device=dev, generator=g)
    sc = torch.randn(T, coff * d, device=dev, generator=g)
    return kv, sc


def bench_compress(dev, bw, rows):
    for d, ratio in ((512, 4), (512, 128), (128, 4), (128, 128)):
        coff = 2 if ratio == 4 else 1
        ch = coff * d
        per = 584 if d == 512 else 68
        ape = torch.randn(ratio, ch, device=dev)
        w = torch.rand(d, device=dev) + 0.5
        table = rope_cos_sin_table(65536, device=dev)
        name = f"compress d={d} r={ratio}"
        # ---- prefill: one 32k-token sequence
        T = 32768
        E = T // ratio
        k = n_sets(T * ch * 8)
        ins = [_compress_inputs(T, d, ratio, dev, i) for i in range(k)]
        cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
        bs = 64
        bt = torch.arange(E // bs + 1, dtype=torch.int32, device=dev).view(1, -1)
        cache = torch.zeros(E // bs + 1, bs * per, dtype=torch.uint8, device=dev)
        ks, ss = new_compress_state(1, ratio, d, dev)
        nbytes = T * ch * 8 + E * per + ks.numel() * 8
        with registry.use(kv_compress_prefill="cuda"):
            t = time_graph([lambda i=i: kv_compress_prefill(ins[i][0], ins[i][1], ape, w, table, cu, bt, cache,
                                                            kv_state=ks, score_state=ss) for i in range(k)])
        tr = time_cuda(lambda: ref.kv_compress_prefill_ref(ins[0][0], ins[0][1], ape, w, table, cu, bt, cache, ks, ss),
                       warmup=2, iters=5)
        rows.append(dict(op=name, case="prefill 32k", provider="cuda", us=t, ref_us=tr, MB=nbytes / 1e6, roof_us=nbytes / bw * 1e6))
        # ---- decode: B = 128, every sequence at a block boundary (worst case) / mid-block
        B = 128
        nr = coff * ratio
        kstate = [new_compress_state(B, ratio, d, dev) for _ in range(n_sets(B * nr * ch * 8))]
        for st in kstate:
            st[0].normal_()
            st[1].normal_()
        dins = [_compress_inputs(B, d, ratio, dev, 100 + i) for i in range(len(kstate))]
        btd = torch.arange(B * 8, dtype=torch.int32, device=dev).view(B, 8)
        cached = torch.zeros(B * 8, bs * per, dtype=torch.uint8, device=dev)
        for label, off in (("decode B=128 emit", ratio - 1), ("decode B=128 no-emit", 0)):
            pos = (torch.arange(B, device=dev) * 7 % 100) * ratio + off
            emit = off == ratio - 1
            state_b = (ch * 8 + (nr * d * 8 + (2 * ratio * ch * 8 if ratio == 4 else 0) if emit else 0))
            nbytes = B * (ch * 8 + state_b + (per if emit else 0))
            with registry.use(kv_compress_decode="cuda"):
                t = time_graph([lambda i=i: kv_compress_decode(dins[i][0], dins[i][1], ape, w, table, pos, btd, cached,
                                                               kstate[i][0], kstate[i][1]) for i in range(len(kstate))])
            tr = time_cuda(lambda: ref.kv_compress_decode_ref(dins[0][0], dins[0][1], ape, w, table, pos, btd, cached,
                                                              kstate[0][0], kstate[0][1]), warmup=2, iters=10)
            rows.append(dict(op=name, case=label, provider="cuda", us=t, ref_us=tr, MB=nbytes / 1e6,
                             roof_us=nbytes / bw * 1e6))
        del ins, kstate, dins
        torch.cuda.empty_cache()


def bench_gather(dev, bw, rows):
    bs = 64
    for label, R, T, K, ctx in (("decode B=128 (128+512)", 128, 128, 512, 8192),
                                ("prefill 8 x 32k ctx (128+8192)", 8, 8, 8192, 32768)):
        ne = ctx // 4                                   # C4 compressed entries per request
        pages = ne // bs
        nbc = R * pages
        cache = torch.empty(nbc, bs * 584, dtype=torch.uint8, device=dev)
        swa = torch.empty(R * 2, 64 * 584, dtype=torch.uint8, device=dev)
        kv_cache_append(cache, kv_rows(nbc * bs, 1, dev), torch.arange(nbc * bs, device=dev))
        kv_cache_append(swa, kv_rows(R * 128, 2, dev), torch.arange(R * 128, device=dev))
        bt = torch.randperm(nbc, device=dev).view(R, pages).to(torch.int32)
        swa_bt = torch.arange(R * 2, dtype=torch.int32, device=dev).view(R, 2)
        rows_out = T * (128 + K)
        k = n_sets(rows_out * 1024)
        idx = [torch.randint(0, ne, (T, K), device=dev, dtype=torch.int32) for _ in range(k)]
        if K == ne:
            idx = [torch.arange(ne, dtype=torch.int32, device=dev).repeat(T, 1) for _ in range(k)]
        swa_idx = torch.arange(128, dtype=torch.int32, device=dev).repeat(T, 1)
        nbytes = rows_out * (584 + 1024 + 4)
        lens = torch.full((R,), ne, dtype=torch.int32, device=dev)
        swa_lens = torch.full((R,), 128, dtype=torch.int32, device=dev)
        tr = time_cuda(lambda: ref.kv_gather_ref(cache, bt, idx[0], lens, None, swa, swa_bt, swa_idx, swa_lens),
                       warmup=2, iters=10)
        for prov in PROVIDERS:
            with registry.use(kv_gather=prov):
                t = time_graph([lambda i=i: kv_gather(cache, bt, idx[i], lens=lens, swa_cache=swa, swa_block_table=swa_bt,
                                                      swa_indices=swa_idx, swa_lens=swa_lens) for i in range(k)])
            rows.append(dict(op="gather fp8_ds_mla", case=label, provider=prov, us=t, ref_us=tr, MB=nbytes / 1e6,
                             roof_us=nbytes / bw * 1e6))
        del cache, swa, idx
        torch.cuda.empty_cache()


IDX_FMTS = ("mxfp4", "fp8", "nvfp4")


def _idx_case(N, fmt, dev, seed=0):
    """indexer_cache_write inputs: N keys, ``n_sets`` input sets (keys + random slots into a cache of 2N
    slots, 64-token pages), the NVFP4 global scale; returns (cache, ks, sls, g, bytes per call)."""
    from dsv4.ops.indexer import FORMATS as IF
    vb, sb = IF[fmt]
    bs = 64
    nb = max(2, -(-2 * N // bs))
    cache = torch.zeros(nb, bs, vb + sb, dtype=torch.uint8, device=dev)
    k = n_sets(N * 512)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ks = [(torch.randn(N, 128, device=dev, generator=gen) * 3).bfloat16() for _ in range(k)]
    sls = [torch.randperm(nb * bs, device=dev, generator=gen)[:N] for _ in range(k)]
    g = torch.tensor([0.01], device=dev) if fmt == "nvfp4" else None
    return cache, ks, sls, g, N * (256 + vb + sb + 8)


class _Rows(list):
    """A result list that prints each row as it is added (a long run that is cut short keeps what it printed)."""

    def __init__(self, bw: float):
        super().__init__()
        self.bw = bw

    def append(self, r: dict) -> None:
        super().append(r)
        _progress(r, self.bw)


def _progress(r: dict, bw: float) -> None:
    """One result line as soon as it is measured."""
    print(f"ROW {r['op']:<34} {r['case']:<44} {r.get('provider', ''):<5} {r['us']:9.2f} us "
          f"{100.0 * r['roof_us'] / r['us']:6.1f}% copy {'' if 'same' not in r else 'same=' + str(r['same'])}", flush=True)


def bench_indexer(dev, bw, rows, vrows, variants: bool = True):
    """indexer_cache_write (8 x 32768 keys = prefill, 128 = decode; random slots) and indexer_q_quant
    (T = 1, 64, 4096), Hadamard on, every format, per provider; then the DSL kernel's geometries
    (kernels_dsl.indexer_quant.VARIANT) at 8 x 32768 MXFP4, each output compared bit for bit with the
    first's."""
    import kernels_dsl.indexer_quant as iq
    from dsv4.ops.indexer import FORMATS as IF
    from dsv4.ops.indexer import indexer_cache_write, indexer_q_quant
    def provs(op):      # the kinds of PROVIDERS this op has (the cuda quantizers may be absent)
        return [p for p in PROVIDERS if not isinstance(registry.get_op(op).provider(p), registry.Support)]

    for fmt in IDX_FMTS:
        for label, N in (("prefill 8 x 32768 keys", 8 * 32768), ("decode 128 keys", 128)):
            cache, ks, sls, g, nbytes = _idx_case(N, fmt, dev)
            for prov in provs("indexer_cache_write"):
                with registry.use(indexer_cache_write=prov):
                    t = time_graph([lambda i=i: indexer_cache_write(cache, ks[i], sls[i], fmt=fmt, global_scale=g)
                                    for i in range(len(ks))])
                rows.append(dict(op=f"indexer_cache_write {fmt}", case=label, provider=prov, us=t, ref_us=float("nan"),
                                 MB=nbytes / 1e6, roof_us=nbytes / bw * 1e6))
            del cache, ks, sls
        vb, sb = IF[fmt]
        for T in (1, 64, 4096):
            k = n_sets(T * 64 * 256)
            gen = torch.Generator(device=dev).manual_seed(T)
            qs = [(torch.randn(T, 64, 128, device=dev, generator=gen) * 3).bfloat16() for _ in range(k)]
            w = torch.rand(T, 64, device=dev)
            g = torch.tensor([0.01], device=dev) if fmt == "nvfp4" else None
            nbytes = T * 64 * (256 + vb + (0 if fmt == "fp8" else sb) + 8)
            for prov in provs("indexer_q_quant"):
                with registry.use(indexer_q_quant=prov):
                    t = time_graph([lambda i=i: indexer_q_quant(qs[i], w, fmt=fmt, global_scale=g) for i in range(k)])
                rows.append(dict(op=f"indexer_q_quant {fmt}", case=f"T={T}", provider=prov, us=t, ref_us=float("nan"),
                                 MB=nbytes / 1e6, roof_us=nbytes / bw * 1e6))
            del qs
    # geometries of the DSL kernel (prefill MXFP4)
    if "dsl" not in PROVIDERS or not variants:
        return
    for fmt in ("mxfp4",):
        cache, ks, sls, g, nbytes = _idx_case(8 * 32768, fmt, dev)
        base = None
        for v in ({}, {"groups": 2, "ctas_per_sm": 6}, {"ctas_per_sm": 6}, {"ctas_per_sm": 10}, {"bf16_mx": False},
                  {"lanes": 8}, {"lanes": 16}):
            cache.zero_()
            with registry.use(indexer_cache_write="dsl"):
                t, o = _run_variant(iq.VARIANT, v, lambda: [lambda i=i: indexer_cache_write(
                    cache, ks[i], sls[i], fmt=fmt, global_scale=g) for i in range(len(ks))][::-1], lambda: cache)
            base = o if base is None else base
            vrows.append(dict(op=f"dsl indexer_cache_write {fmt}", case=f"8 x 32768 {v}", us=t,
                              roof_us=nbytes / bw * 1e6, same=bool(torch.equal(o, base))))
        del cache, ks, sls
        torch.cuda.empty_cache()


def _run_variant(variant: dict, settings: dict, make_fns, out_fn):
    """Time ``make_fns()`` (CUDA-graph replay) with ``settings`` in a module's ``VARIANT`` dict, then
    run the first call once more and return (us, a copy of ``out_fn()``) for the bit-equality check."""
    variant.clear()
    variant.update(settings)
    try:
        fns = make_fns()
        t = time_graph(fns)
        fns[0]()
        torch.cuda.synchronize()
        return t, out_fn().clone()
    finally:
        variant.clear()


def _append_variant_case(dev):
    """The variant sections' append case: 32k rows into a 2048 x 64 cache, 8 random slot sets, every
    50th slot of the first set -1 (skipped)."""
    N, nb, bs = 32768, 2048, 64
    cache = torch.zeros(nb, bs * 584, dtype=torch.uint8, device=dev)
    xs = [kv_rows(N, i, dev) for i in range(8)]
    sl = [torch.randperm(nb * bs, device=dev)[:N] for _ in range(8)]
    sl[0][::50] = -1
    return N, cache, xs, sl


def bench_variants(dev, bw, rows):
    """Tuning variants of kv_cache.cu: time + bit-equality against the default's output."""
    import kernels_cuda.kv_cache as kc

    def run_variant(v, make_fns, out_fn):
        return _run_variant(kc.VARIANT, v, make_fns, out_fn)

    # gather, decode B=128 and prefill 8 x 8320 (64-token pages)
    for label, R, T, K, ne in (("decode", 128, 128, 512, 2048), ("prefill", 8, 8, 8192, 8192)):
        cache, swa, bt, swa_bt, idx, swa_idx, lens, swa_lens, k, nbytes = _gather_case(R, T, K, ne, 64, dev)
        base = None
        for rpw in (1, 2, 4):
            outs = {}

            def mk():
                return [lambda i=i: outs.__setitem__(i, kv_gather(cache, bt, idx[i], lens=lens, swa_cache=swa,
                                                                  swa_block_table=swa_bt, swa_indices=swa_idx,
                                                                  swa_lens=swa_lens)) for i in range(k)]
            with registry.use(kv_gather="cuda"):
                t, o = run_variant({"KVC_GATHER_RPW": rpw}, mk, lambda: outs[0])
            base = o if base is None else base
            rows.append(dict(op="gather", case=f"{label} RPW={rpw}", us=t, roof_us=nbytes / bw * 1e6,
                             same=bool(torch.equal(o.view(torch.int16), base.view(torch.int16)))))
        del cache, swa, idx
        torch.cuda.empty_cache()
    # compressors, prefill 32k + decode B=128 emit
    for d, ratio in ((512, 4), (512, 128), (128, 4), (128, 128)):
        coff = 2 if ratio == 4 else 1
        ch, per = coff * d, (584 if d == 512 else 68)
        ape = torch.randn(ratio, ch, device=dev)
        w = torch.rand(d, device=dev) + 0.5
        table = rope_cos_sin_table(65536, device=dev)
        T = 32768
        E = T // ratio
        ins = [_compress_inputs(T, d, ratio, dev, i) for i in range(n_sets(T * ch * 8))]
        cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
        bt = torch.arange(E // 64 + 1, dtype=torch.int32, device=dev).view(1, -1)
        cache = torch.zeros(E // 64 + 1, 64 * per, dtype=torch.uint8, device=dev)
        ks, ss = new_compress_state(1, ratio, d, dev)
        nbytes = T * ch * 8 + E * per + ks.numel() * 8
        base = None
        for mode in (0, 1, 2):
            with registry.use(kv_compress_prefill="cuda"):
                t, o = run_variant({"KVC_ONLINE": mode}, lambda: [
                    lambda i=i: kv_compress_prefill(ins[i][0], ins[i][1], ape, w, table, cu, bt, cache, kv_state=ks,
                                                    score_state=ss) for i in range(len(ins))], lambda: cache)
            base = o if base is None else base
            rows.append(dict(op=f"compress d={d} r={ratio}", case=f"prefill 32k ONLINE={mode}", us=t,
                             roof_us=nbytes / bw * 1e6, same=bool(torch.equal(o, base)),
                             eq_frac=float((o == base).float().mean())))
        del ins
        torch.cuda.empty_cache()


def bench_dsl_variants(dev, bw, rows, only=("append", "gather")):
    """Configs of the DSL kernels (kernels_dsl.kv_cache.VARIANT): time + bit-equality vs the first."""
    import kernels_dsl.kv_cache as kd

    def run_variant(key, cfg, fns, out_fn):
        return _run_variant(kd.VARIANT, {key: cfg}, lambda: fns, out_fn)

    if "append" in only:
        N, cache, xs, sl = _append_variant_case(dev)
        base = None
        for cfg in (kd.DEFAULT_APPEND, kd.KvAppendConfig(128), kd.KvAppendConfig(512)):
            cache.zero_()
            with registry.use(kv_cache_append="dsl"):
                t, o = run_variant("append", cfg, [lambda i=i: kv_cache_append(cache, xs[i], sl[i]) for i in range(8)][::-1],
                                   lambda: cache)
            base = o if base is None else base
            rows.append(dict(op="dsl append", case=f"prefill 32k {cfg}", us=t, roof_us=N * (1024 + 584 + 8) / bw * 1e6,
                             same=bool(torch.equal(o, base))))
        del xs, cache
    if "gather" in only:
        bs = 64
        for label, R, T, K, ne in (("decode", 128, 128, 512, 2048), ("prefill", 8, 8, 8192, 8192)):
            cache, swa, bt, swa_bt, idx, swa_idx, lens, swa_lens, k, nbytes = _gather_case(R, T, K, ne, bs, dev)
            base = None
            for cfg in (kd.DEFAULT_GATHER, kd.KvGatherConfig(2, 2), kd.KvGatherConfig(4, 4), kd.KvGatherConfig(4, 2, 256),
                        kd.KvGatherConfig(4, 2, 128, 128), kd.KvGatherConfig(4, 1)):
                outs = {}
                fns = [lambda i=i: outs.__setitem__(i, kv_gather(cache, bt, idx[i], lens=lens, swa_cache=swa,
                                                                 swa_block_table=swa_bt, swa_indices=swa_idx,
                                                                 swa_lens=swa_lens)) for i in range(k)]
                with registry.use(kv_gather="dsl"):
                    t, o = run_variant("gather", cfg, fns, lambda: outs[0])
                base = o if base is None else base
                rows.append(dict(op="dsl gather", case=f"{label} {cfg}", us=t, roof_us=nbytes / bw * 1e6,
                                 same=bool(torch.equal(o.view(torch.int16), base.view(torch.int16)))))
            del cache, swa, idx
            torch.cuda.empty_cache()


def main():
    global PROVIDERS
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-variants", action="store_true", help="skip the tuning-variant sections")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="append / gather providers to time")
    ap.add_argument("--only", default="append,gather,compress,indexer", help="sections: append,gather,compress,indexer")
    args = ap.parse_args()
    PROVIDERS = tuple(args.providers.split(","))
    only = set(args.only.split(","))
    dev = torch.device("cuda")
    bw = copy_bandwidth() * 1e9                          # bytes / s (read + write)
    rows: list[dict] = _Rows(bw)
    if "append" in only:
        bench_append(dev, bw, rows)
    if "gather" in only:
        bench_gather(dev, bw, rows)
    if "compress" in only:
        bench_compress(dev, bw, rows)
    vrows: list[dict] = _Rows(bw)
    if "indexer" in only:
        bench_indexer(dev, bw, rows, vrows, not args.no_variants)
    if not args.no_variants:
        if "dsl" in PROVIDERS:
            bench_dsl_variants(dev, bw, vrows, only)
        if "cuda" in PROVIDERS and only >= {"append", "gather", "compress"}:
            bench_variants(dev, bw, vrows)
        for r in vrows:
            r["pct_copy_bw"] = 100.0 * r["roof_us"] / r["us"]
    for r in rows:
        r["pct_copy_bw"] = 100.0 * r["roof_us"] / r["us"]
        r["GB/s"] = r["MB"] * 1e6 / (r["us"] * 1e-6) / 1e9
        r["speedup_vs_torch"] = r["ref_us"] / r["us"]
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s")
    print_table(rows, ["op", "case", "provider", "us", "roof_us", "pct_copy_bw", "GB/s", "ref_us", "speedup_vs_torch",
                       "MB"], title="kv_cache ops vs roofline and torch reference")
    if vrows:
        print_table(vrows, ["op", "case", "us", "roof_us", "pct_copy_bw", "same", "eq_frac"],
                    title="tuning variants (same = output bit-identical to the first variant)")
    save_json(args.json, {"copy_bw_GBps": bw / 1e9, "rows": rows, "variants": vrows})


if __name__ == "__main__":
    main()
