"""Tests of the MoE decode kernel (kernels_cuda/moe_decode.cu via kernels_cuda/moe_decode.py).

CPU: bit-exact emulation of the in-register E2M1 -> bf16 decode (every code, every scale byte),
a port of the kernel's K permutation (producer B tile + consumer A fragments) through the WGMMA
fragment semantics (cute ALayout_64x16, K-major no-swizzle descriptor) against a dense matmul,
the dispatch decision (:func:`kernels_cuda.moe_decode.default_config`), NVRTC compile + PTX/ptxas checks.
GPU (@pytest.mark.gpu): the grouped ops against the torch oracles on the prepared layout (tight:
only FP32 summation order differs) and the whole expert layer against the checkpoint-layout
reference, MXFP4 / NVFP4 (non-power-of-two block scales) x FP8 / BF16 activations, m in {1, 3, 16}
tokens per expert, odd expert counts, zero-token experts, CUDA-graph capture.
"""
from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

ml = pytest.importorskip("ml_dtypes")

from kernels_cuda import moe_decode  # noqa: E402


# ------------------------------------------------------------------------------ bit emulation
LEVELS = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
U32 = np.uint64(0xFFFFFFFF)


def bf16_to_f64(bits):
    return (np.asarray(bits, dtype=np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def f64_to_bf16_exact(x):
    """bf16 bits of x; asserts that x is exactly representable (the kernel's products are exact)."""
    f = np.asarray(x, dtype=np.float32)
    assert np.array_equal(f.astype(np.float64), np.asarray(x, dtype=np.float64)), "not fp32-exact"
    b = f.view(np.uint32)
    assert np.all((b & 0xFFFF) == 0), "not bf16-exact"
    return (b >> 16).astype(np.uint32)


def ue8m0_f2(b):  # moe_decode.cuh
    e = np.minimum(np.asarray(b, np.uint32) + 118, 254)
    return ((e << 7) | (e << 23)).astype(np.uint32)


def e4m3_f2(b):
    f = np.asarray(b, np.uint8).view(ml.float8_e4m3fn).astype(np.float64) * 2.0 ** 118
    h = f64_to_bf16_exact(f)
    return (h | (h << 16)).astype(np.uint32)


def bf16x2_mul(a, b):
    """common.cuh bf16x2_mul (mul.rn.bf16x2) for exact products (asserted)."""
    lo = bf16_to_f64(a & 0xFFFF) * bf16_to_f64(b & 0xFFFF)
    hi = bf16_to_f64(a >> 16) * bf16_to_f64(b >> 16)
    return (f64_to_bf16_exact(lo) | (f64_to_bf16_exact(hi) << 16)).astype(np.uint32)


def e2m1x8_bf16_pairs(w, f2):
    """Port of common.cuh e2m1x8_bf16_pairs: out[j] = (element j, element j + 4)."""
    w = np.asarray(w, dtype=np.uint64)
    M = np.uint64(0x81C081C0)
    w8 = w >> np.uint64(8)
    outs = [((w & np.uint64(0x000F000F)) * np.uint64(4160)) & U32 & M,
            ((w & np.uint64(0x00F000F0)) * np.uint64(260)) & U32 & M,
            ((w8 & np.uint64(0x000F000F)) * np.uint64(4160)) & U32 & M,
            ((w8 & np.uint64(0x00F000F0)) * np.uint64(260)) & U32 & M]
    return [bf16x2_mul(o.astype(np.uint32), f2) for o in outs]


def nib_val(n):
    n = np.asarray(n)
    return np.where(n & 8, -1.0, 1.0) * LEVELS[n & 7]


def test_decode_pairs_exact_all_codes_and_scales():
    """Every E2M1 code in every nibble position, every UE8M0 byte in [3, 136] and every finite
    E4M3 scale byte: the decoded bf16 equals level * scale * 2^-8 exactly (products asserted exact)."""
    rng = np.random.default_rng(0)
    words = np.concatenate([
        np.array([sum(((a if i in (j, j + 4) else 0) << (4 * i)) for i in range(8)) for j in range(4)
                  for a in range(16)], dtype=np.uint64),
        np.array([(a << (4 * j)) | (b << (4 * (j + 4))) for j in range(4) for a in range(16) for b in range(16)],
                 dtype=np.uint64),
        rng.integers(0, 2 ** 32, 4000, dtype=np.uint64)])
    nibs = np.stack([(words >> np.uint64(4 * i)) & np.uint64(15) for i in range(8)], -1).astype(np.int64)
    scales = [(ue8m0_f2(b), 2.0 ** (b - 127)) for b in list(range(3, 137))]
    e4 = np.arange(256, dtype=np.uint8)
    e4v = e4.view(ml.float8_e4m3fn).astype(np.float64)
    scales += [(e4m3_f2(b), e4v[b]) for b in range(256) if np.isfinite(e4v[b])]
    for f2, s in scales:
        out = e2m1x8_bf16_pairs(words, np.uint32(f2))
        for j in range(4):
            lo, hi = bf16_to_f64(out[j] & 0xFFFF), bf16_to_f64(out[j] >> 16)
            assert np.array_equal(lo, nib_val(nibs[:, j]) * s * 2.0 ** -8), (j, s)
            assert np.array_equal(hi, nib_val(nibs[:, j + 4]) * s * 2.0 ** -8), (j, s)


# ------------------------------------------------------------------------------ permutation port
def kpos(s, p):
    """K (inside a 128-K block) of WGMMA fragment position p of k16-step s (moe_decode.cu header)."""
    c = (p & 7) >> 1
    return 32 * c + 8 * (s >> 1) + 2 * (s & 1) + (p >> 3) + 4 * (p & 1)


def test_k_permutation_is_a_bijection():
    ks = sorted(kpos(s, p) for s in range(8) for p in range(16))
    assert ks == list(range(128))


@pytest.mark.parametrize("mode", ["wgmma", "mma"])
@pytest.mark.parametrize("nt,fmt,act", [(8, "mxfp4", "fp8"), (16, "nvfp4", "bf16"), (16, "mxfp4", "fp8")])
def test_stage_emulation_matches_dense(nt, fmt, act, mode):
    """One 128-K stage of one m64 tile: B tile bytes built as the producer does (build_b, b_off),
    A fragments as the consumers do (16-byte chunk per thread, e2m1x8_bf16_pairs, fragment regs
    {R[q][j0], R8[q][j0], R[q][j0+1], R8[q][j0+1]}), multiplied with the WGMMA semantics (cute
    ALayout_64x16 + K-major no-swizzle descriptor, LBO 128 / SBO 256) or the mma.sync m16n8k16
    semantics (B fragments loaded per lane): equals W_deq @ x^T * 2^-8."""
    rng = np.random.default_rng(nt)
    packed = rng.integers(0, 256, (64, 64), dtype=np.uint8)       # 64 rows x 128 E2M1
    if fmt == "mxfp4":
        sc = rng.integers(110, 130, (64, 4), dtype=np.uint8)
        s_val = np.repeat(2.0 ** (sc.astype(np.float64) - 127), 32, 1)
    else:
        sc = rng.integers(0x20, 0x60, (64, 8), dtype=np.uint8)  # general (non power-of-two) E4M3
        s_val = np.repeat(sc.view(ml.float8_e4m3fn).astype(np.float64), 16, 1)
    el = np.stack([packed & 15, packed >> 4], -1).reshape(64, 128)
    w_deq = nib_val(el) * s_val
    if act == "fp8":
        xq = rng.standard_normal((nt, 128)).astype(ml.float8_e4m3fn)
        sa = 2.0 ** rng.integers(-8, 4, nt)
        x = xq.astype(np.float64) * sa[:, None]
    else:
        x = rng.standard_normal((nt, 128)).astype(ml.bfloat16).astype(np.float64)
    # ---- producer: B tile (bf16 bits per byte offset / 2)
    B = np.zeros(nt * 128, dtype=np.uint32)
    lpt, kpl = 32 // nt, 128 // (32 // nt)

    def b_off(t, s, p):
        return s * (nt * 32) + (((t >> 3) * 2 + (p >> 3)) << 7) + ((t & 7) << 4) + ((p & 7) << 1)
    for lane in range(32):
        t, k0 = lane // lpt, (lane % lpt) * kpl
        for g in range(kpl // 8):
            k = k0 + 8 * g
            c, q = k >> 5, (k >> 3) & 3
            for j in range(4):
                for hi in range(2):
                    v = f64_to_bf16_exact(np.array(x[t, k + j + 4 * hi]))
                    off = b_off(t, 2 * q + (j >> 1), 8 * (j & 1) + 2 * c + hi)
                    assert off % 2 == 0
                    B[off // 2] = v
    # ---- B operand as the tensor core sees it: Bmat[s][p, n]
    Bmat = np.zeros((8, 16, nt))
    if mode == "wgmma":  # K-major no-swizzle descriptor: core (n>>3, p>>3) at base + 256 (n>>3) + 128 (p>>3)
        for s_ in range(8):
            for p in range(16):
                for n in range(nt):
                    off = s_ * (nt * 32) + (n >> 3) * 256 + (p >> 3) * 128 + (n & 7) * 16 + (p & 7) * 2
                    Bmat[s_, p, n] = bf16_to_f64(B[off // 2])
    else:  # mma.sync: lane loads b0 = u32 at base + ng*256 + (lane>>2)*16 + 4c, b1 = +128 (moe_decode.cu MD_MMA)
        for s_ in range(8):
            for ng in range(nt // 8):
                for lane in range(32):
                    c = lane & 3
                    ba = s_ * (nt * 32) + ng * 256 + (lane >> 2) * 16 + 4 * c
                    for bi, off in enumerate((ba, ba + 128)):
                        w32 = int(B[off // 2]) | (int(B[off // 2 + 1]) << 16)
                        for e_ in range(2):  # b{0,1}: k = 2c + e (+8), n = lane / 4
                            Bmat[s_, 2 * c + e_ + 8 * bi, 8 * ng + (lane >> 2)] = bf16_to_f64((w32 >> (16 * e_)) & 0xFFFF)
    # ---- consumers: A fragments (per warp 16 rows) x Bmat
    D = np.zeros((64, nt))
    for warp in range(4):
        Amat = np.zeros((8, 16, 16))
        for lane in range(32):
            c, r = lane & 3, lane >> 2
            R = {}
            for h in range(2):
                row = 16 * warp + r + 8 * h
                words = packed[row, 16 * c:16 * c + 16].view("<u4").astype(np.uint64)
                if fmt == "mxfp4":
                    f0 = f1 = ue8m0_f2(sc[row, c])
                else:
                    f0, f1 = e4m3_f2(sc[row, 2 * c]), e4m3_f2(sc[row, 2 * c + 1])
                R[h] = [e2m1x8_bf16_pairs(np.array([words[qq]]), np.uint32(f0 if qq < 2 else f1)) for qq in range(4)]
            for s_ in range(8):
                q, j0 = s_ >> 1, 2 * (s_ & 1)
                regs = [R[0][q][j0], R[1][q][j0], R[0][q][j0 + 1], R[1][q][j0 + 1]]
                # A fragment (cute ALayout_64x16 per warp = mma m16n8k16 A): reg0 (r, k..k+1),
                # reg1 (r+8, k..), reg2 (r, k+8..), reg3 (r+8, k+8..), k = 2c
                for ri, reg in enumerate(regs):
                    for e_ in range(2):
                        Amat[s_, r + 8 * (ri & 1), 2 * c + e_ + 8 * (ri >> 1)] = bf16_to_f64((int(reg[0]) >> (16 * e_)) & 0xFFFF)
        for s_ in range(8):
            D[16 * warp:16 * warp + 16] += Amat[s_] @ Bmat[s_]
    ref = w_deq @ x.T * 2.0 ** -8
    np.testing.assert_allclose(D, ref, rtol=1e-12, atol=1e-300)


# ------------------------------------------------------------------------------ dispatch
def test_default_config_dispatch():
    P = moe_decode.default_config
    E, D, I = 256, 4096, 2048
    p = P(E * 1, E, 2 * I, D, "fp8", "mxfp4", 1)
    assert p is not None and p.nt == 8 and p.nwg == 2 and p.smem <= 233472 // p.minb - 1024
    assert (p.stage, p.act, p.fmt, p.splitk, p.mma, p.bulk, p.l2pf) == (1, "fp8", "mxfp4", 4, 1, 0, 256)  # measured defaults
    assert P(E * 8, E, D, I, "bf16", "nvfp4", 2).nt == 8
    assert P(E * 9, E, 2 * I, D, "fp8", "nvfp4", 1).nt == 16
    assert P(E * 16, E, 2 * I, D, "fp8", "mxfp4", 1).nt == 16
    assert P(E * 17, E, 2 * I, D, "fp8", "mxfp4", 1) is None            # max_m 17: prefill kernel
    assert P(384 * 4, 384, 7168, 3072, "fp8", "mxfp4", 2).nt == 8        # Pro GEMM2
    assert P(0, E, 2 * I, D, "fp8", "mxfp4", 1) is None
    assert P(E, E, 2 * I + 128, D, "fp8", "mxfp4", 1) is None            # N % 256
    assert P(E, E, 2 * I, D + 64, "fp8", "mxfp4", 1) is None             # K % 128
    assert P(2048 * 6, 33, 2048, 2048, "fp8", "mxfp4", 1) is None        # prefill-sized groups
    with moe_decode.override(nwg=1):
        assert P(E, E, 2 * I, D, "fp8", "mxfp4", 1).nwg == 2               # FP8 requant needs 256 rows
        assert P(E, E, D, I, "fp8", "mxfp4", 2).nwg == 1
    with moe_decode.override(max_m=0):
        assert P(E, E, 2 * I, D, "fp8", "mxfp4", 1) is None
    with moe_decode.override(max_m=8):
        assert P(E * 9, E, 2 * I, D, "fp8", "mxfp4", 1) is None
        assert P(E * 8, E, 2 * I, D, "fp8", "mxfp4", 1) is not None
    assert P(E * 9, E, 2 * I, D, "fp8", "mxfp4", 1) is not None           # restored on exit


def test_override_fields_and_validation():
    P = lambda: moe_decode.default_config(256, 256, 4096, 2048, "bf16", "mxfp4", 2)  # noqa: E731
    p = P()
    assert (p.mma, p.bulk, p.l2pf, p.splitk, p.nwg) == (1, 0, 256, 4, 2)
    with moe_decode.override(mma=0, bulk=1, l2pf=0, splitk=1, nwg=1, stages=3):
        q = P()
        assert (q.mma, q.bulk, q.l2pf, q.splitk, q.nwg, q.stages) == (0, 1, 0, 1, 1, 3)
        assert q.defines()["MD_MMA"] == 0 and q.defines()["MD_STAGES"] == 3
        with moe_decode.override(mma=1):                                  # nested: inner wins, outer restored
            assert P().mma == 1 and P().bulk == 1
        assert P().mma == 0
    assert P() == p
    for k, v in (("max_m", 17), ("nwg", 3), ("stages", 1), ("bulk", 2), ("mma", "x"), ("l2pf", 100),
                 ("splitk", 3), ("tile", 64)):
        with pytest.raises(ValueError, match=k):
            with moe_decode.override(**{k: v}):
                pass
    assert "mma.sync" in p.explain() and "split-K <= 4" in p.explain()


def test_grid_bounds_items():
    p = moe_decode.default_config(256, 256, 4096, 4096, "fp8", "mxfp4", 1)
    assert moe_decode.grid_size(p, 256, 256, 4096, 132) == 264           # 2 CTAs / SM resident
    assert moe_decode.grid_size(p, 3, 256, 4096, 132) == (1 + 3) * 16     # item upper bound
    assert not hasattr(moe_decode, "PROVIDERS")


def test_provider_dispatch_is_wired():
    """kernels_cuda/moe.py's providers configure through moe_decode.default_config in supports (their
    config()) and in run (the cuda provider serves exactly the decode-config problems; the moe.cu
    prefill kernels are deleted)."""
    from pathlib import Path
    src = (Path(moe_decode.__file__).parent / "moe.py").read_text()
    assert src.count("moe_decode.default_config(") == 2 and "moe_decode.gemm1_swiglu(" in src \
        and "moe_decode.gemm2(" in src


# ------------------------------------------------------------------------------ compile checks
def _compile(defs):
    """(ptx, ptxas log) of moe_decode.cu with ``defs`` for sm_90a (one NVRTC compile, no GPU)."""
    from kernels_cuda import nvrtc
    return nvrtc.CudaModule("moe_decode.cu", tuple(sorted((k, str(v)) for k, v in defs.items()))).ptxas_report()


@pytest.mark.parametrize("act,fmt,stage,nt,nwg,bulk,mma", [
    (a, f, s, n, 2, 0, m) for a, f, s, n, m in itertools.product((0, 1), (0, 1), (1, 2), (8, 16), (0, 1))
] + [(1, 0, 2, 16, 1, 1, 0), (0, 1, 2, 8, 1, 0, 1), (0, 0, 1, 16, 2, 1, 0)])
def test_kernel_compiles_no_spills(act, fmt, stage, nt, nwg, bulk, mma):
    pytest.importorskip("cuda.bindings")
    ptx, log = _compile(dict(MD_ACT=act, MD_WFMT=fmt, MD_STAGE=stage, MD_NT=nt, MD_NWG=nwg, MD_BULK=bulk,
                             MD_MINB=2 if nwg == 2 else 4, MD_MMA=mma))
    if mma:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx and "wgmma" not in ptx
    else:
        assert f"wgmma.mma_async.sync.aligned.m64n{nt}k16.f32.bf16.bf16" in ptx
    assert "mul.rn.bf16x2" in ptx and "mbarrier.try_wait.parity" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx) == bool(bulk)
    if not bulk:
        assert "cp.async.cg.shared.global.L2::256B" in ptx  # L2 prefetch-size hint (DECODE_L2PF = 256)
    assert "fence.proxy.async" in ptx and "ld.global.nc.v4" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert " 0 bytes spill stores" in log and " 0 bytes spill loads" in log, log


def test_fp8_stage1_needs_two_warpgroups():
    pytest.importorskip("cuda.bindings")
    from kernels_cuda.nvrtc import CompileError
    with pytest.raises((CompileError, AssertionError)) as ei:
        _compile(dict(MD_ACT=0, MD_STAGE=1, MD_NWG=1))
    assert "stage 1 with FP8 requant needs MD_NWG == 2" in str(ei.value), str(ei.value)[:400]  # the #error, not any failure


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(params=["wgmma", "mmasync"])
def consumer(request, monkeypatch):
    """Both consumer variants (kernels_cuda/moe_decode.py DecodeConfig.mma) with 16-byte cp.async copies."""
    with moe_decode.override(mma=1 if request.param == "mmasync" else 0):
        yield request.param


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _case(fmt, act, m, E=33, D=2048, I=1024, seed=0, empty=(0, 5, 17), pow2=False):
    from tests.test_moe import make_weights, make_x, prep
    from dsv4.ops import moe
    dev = "cuda"
    ck = make_weights(E, D, I, fmt=fmt, seed=seed, gscale_spread=2.0, device=dev, pow2_nvfp4=pow2)
    W = prep(ck, fmt)
    active = [e for e in range(E) if e not in empty]
    g = torch.Generator().manual_seed(seed + 1)
    # tokens routed so that active experts get 1..m rows (top-k 1 per "token"), masked layout [E, m]
    rows = []
    for e in active:
        rows += [e] * int(torch.randint(1, m + 1, (1,), generator=g)) if m > 1 else [e]
    T = len(rows)
    idx = torch.tensor(rows, dtype=torch.int32, device=dev).view(T, 1)
    w = (torch.rand(T, 1, generator=g) + 0.1).to(dev)
    x = make_x(T, D, seed=seed + 2, device=dev)
    gr = moe.moe_permute(x, idx, w, E, act=act, layout="masked", max_m=m)
    return ck, W, gr, x, idx, w


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("act", ["fp8", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_decode_matches_oracles(fmt, act, m, consumer):
    """GEMM1 and GEMM2 of the decode kernel vs the torch oracles on the same inputs: identical up
    to FP32 summation order (NVFP4 with general E4M3 block scales included: bf16 decode is exact)."""
    ck, W, gr, *_ = _case(fmt, act, m)
    assert moe_decode.default_config(gr.a.shape[0], W.E, 2 * W.I, W.D, act, fmt, 1) is not None
    err_y, err_h, same_s, same_h = _gemms_vs_oracles(gr, W, act, "cuda", f"{consumer}] {fmt} {act} m={m}")
    if act == "fp8":
        assert same_s > 0.99 and same_h > 0.99 and err_h < 1e-2
    else:
        assert same_h > 0.99 and err_h < 2e-3
    assert err_y < 1e-5


def _gemms_vs_oracles(gr, W, act, prov, label, max_m=None):
    """GEMM1 + GEMM2 on ``prov`` vs the torch oracles on the same inputs (GEMM2 oracle on the
    provider's own h), over the rows that hold an assignment: ``(rel err y, rel err h (fp8: after
    the h_s scales), fraction of equal h_s (fp8; else None), fraction of bit-equal h elements)``."""
    from tests.test_moe import gemms_and_oracles
    h, h_s, y, h_r, h_s_r, y_r = gemms_and_oracles(gr, W, prov, max_m)
    valid = _valid(gr)
    err_y = _rel(y[valid], y_r[valid])
    bits = torch.uint8 if act == "fp8" else torch.int16                 # element-wise bit equality
    same_h = (h.view(bits)[valid] == h_r.view(bits)[valid]).float().mean().item()
    same_s = None
    if act == "fp8":
        err_h = _rel(h.float()[valid] * h_s[valid].repeat_interleave(128, 1),
                     h_r.float()[valid] * h_s_r[valid].repeat_interleave(128, 1))
        same_s = (h_s[valid] == h_s_r[valid]).float().mean().item()
    else:
        err_h = _rel(h[valid], h_r[valid])
    print(f"\n[moe decode {label}: y rel {err_y:.2e}, h rel {err_h:.2e}, h_s equal {same_s}, h equal {same_h:.4f}")
    return err_y, err_h, same_s, same_h


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "fp8"), ("nvfp4", "bf16")])
def test_gpu_decode_splitk_deterministic(fmt, act, consumer, monkeypatch):
    """3 active experts of 33 (few work items: the kernel splits K on the device and the last
    arriving unit sums the partials in a fixed order): equals the unsplit kernel up to FP32 order,
    bitwise reproducible, matches the oracles."""
    from dsv4.ops import moe
    from dsv4.registry import use
    ck, W, gr, *_ = _case(fmt, act, 2, empty=[e for e in range(33) if e not in (3, 16, 32)])
    outs = {}
    rows = torch.cat([torch.arange(int(gr.row_start[e]), int(gr.row_start[e] + gr.row_count[e])) for e in (3, 16, 32)]).cuda()
    for sk in ("4", "4", "1"):
        with moe_decode.override(splitk=int(sk)), use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
            h, h_s = moe.moe_gemm1_swiglu(gr, W)
            y = moe.moe_gemm2(h, h_s, gr, W)
        if sk in outs:  # rows of the 3 experts only (other rows are unspecified)
            assert torch.equal(outs[sk][2][rows], y[rows])
            assert torch.equal(outs[sk][0].view(torch.uint8)[rows], h.view(torch.uint8)[rows])
        outs[sk] = (h, h_s, y)
    with use(moe_gemm1_swiglu="torch", moe_gemm2="torch"):
        y_r = moe.moe_gemm2(outs["4"][0], outs["4"][1], gr, W)
    e_split = _rel(outs["4"][2][rows], outs["1"][2][rows])
    e_ref = _rel(outs["4"][2][rows], y_r[rows])
    print(f"\n[moe decode split-K {consumer}] {fmt} {act}: split vs unsplit {e_split:.2e}, vs oracle {e_ref:.2e}")
    assert e_split < 1e-2 and e_ref < 1e-5


def test_choice_cache_follows_the_decode_override(monkeypatch):
    """The registry caches its choice per problem; moe_decode.override drops the cached choices of
    both GEMM ops on entry and exit, so override(max_m=0) after a decode dispatch re-decides (dsl)
    instead of reusing the cached cuda choice, and leaving it goes back. The choice explains the
    provider's config (DecodeConfig / GroupedGemmConfig). CPU: availability stubbed, no launch."""
    from dsv4.ops import moe as mo
    from dsv4.target import Target
    from dsv4.registry import Support
    from kernels_cuda import moe as km
    from kernels_dsl import moe as dm
    monkeypatch.setattr(km.CudaMoEGemm1, "available", lambda self: Support.yes("stub"))
    monkeypatch.setattr(dm.DslMoEGemm1, "available", lambda self: Support.yes("stub"))
    t = Target("cuda", "sm_90a", "H200", 132, 0)
    prob = mo.GemmProblem("mxfp4", "fp8", 256, 4096, 4096, 256, 256, None, "cuda")
    op = mo.GEMM1_OP
    ch = op.select(prob, t)[1]
    assert ch.kind == "cuda"
    cfg = op.config_of(ch)
    assert isinstance(cfg, moe_decode.DecodeConfig) and cfg.nt == 8 and "DecodeConfig(" in \
        __import__("dataclasses").replace(ch, config=cfg).explain()
    with moe_decode.override(max_m=0):
        ch = op.select(prob, t)[1]
        assert ch.kind == "dsl" and "not decode-sized" in ch.explain()
        assert type(op.config_of(ch)).__name__ == "GroupedGemmConfig"
    assert op.select(prob, t)[1].kind == "cuda"


def test_masked_hot_expert_plans_from_assignments():
    """The cuda (decode) provider sizes its plan from the assignments (``min(R, T * topk)``), not
    from the masked layout's ``E * max_m`` slots: one hot expert (max_m 64) at decode keeps the
    decode kernel (it cuts that expert into token chunks); without the hint it is declined."""
    from dsv4.ops import moe as mo
    from dsv4.registry import get_op
    from kernels_cuda import moe as km
    E, D, I = 256, 4096, 2048
    a = torch.empty((E * 64, D), dtype=torch.float8_e4m3fn)
    w13 = torch.empty((E, 2 * I, D // 2), dtype=torch.uint8)
    p = mo._gemm_problem(a, w13, "mxfp4", 64, 64 * 6)                      # T = 64, top-6
    assert p["R"] == E * 64 and p["rows"] == 384 and p["max_m"] == 64
    assert km.CudaMoEGemm1(get_op("moe_gemm1_swiglu")).supports_problem(p).ok
    p2 = mo._gemm_problem(a, w13, "mxfp4", 64)                             # no assignment count
    assert p2["rows"] == E * 64 and not km.CudaMoEGemm1(get_op("moe_gemm1_swiglu")).supports_problem(p2).ok
    assert mo._gemm_problem(a, w13, "mxfp4", 64, 10 ** 9)["rows"] == E * 64  # capped by R


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "fp8"), ("nvfp4", "bf16")])
def test_gpu_decode_masked_hot_expert(fmt, act):
    """Masked layout, one expert with 40 of 71 rows (max_m 48): the registry keeps the decode kernel
    (planned from the assignments) and it matches the torch oracle on the same inputs."""
    from tests.test_moe import make_weights, make_x, prep
    from dsv4.ops import moe
    from dsv4.registry import last_choice, use
    E, D, I = 33, 2048, 1024
    ck = make_weights(E, D, I, fmt=fmt, seed=3, gscale_spread=2.0, device="cuda")
    W = prep(ck, fmt)
    rows = [7] * 40 + [e for e in range(E) if e != 7][:31]
    T = len(rows)
    idx = torch.tensor(rows, dtype=torch.int32, device="cuda").view(T, 1)
    w = torch.rand(T, 1, device="cuda") + 0.1
    x = make_x(T, D, seed=4, device="cuda")
    gr = moe.moe_permute(x, idx, w, E, act=act, layout="masked", max_m=48)
    h, h_s = moe.moe_gemm1_swiglu(gr, W, max_m=48)
    assert last_choice("moe_gemm1_swiglu").kind == "cuda", last_choice("moe_gemm1_swiglu").explain()
    y = moe.moe_gemm2(h, h_s, gr, W, max_m=48)
    assert last_choice("moe_gemm2").kind == "cuda"
    with use(moe_gemm1_swiglu="torch", moe_gemm2="torch"):
        h_r, h_s_r = moe.moe_gemm1_swiglu(gr, W)
        y_r = moe.moe_gemm2(h, h_s, gr, W)
    valid = _valid(gr)
    assert int(gr.row_count[7]) == 40 and int(valid.sum()) == T
    # GEMM1 too (the hot expert's 40 rows go through several token chunks), bounds as
    # test_gpu_decode_matches_oracles
    if act == "fp8":
        hd, hd_r = h.float() * h_s.repeat_interleave(128, 1), h_r.float() * h_s_r.repeat_interleave(128, 1)
        assert _rel(hd[valid], hd_r[valid]) < 1e-2
    else:
        assert _rel(h[valid], h_r[valid]) < 2e-3
    assert _rel(y[valid], y_r[valid]) < 1e-5


def _flash_shape_graph_and_contiguous(prov: str) -> None:
    """DSV4-Flash shape (D 4096, I 2048, E 257 odd), 1 token on 9 experts, GEMMs forced to ``prov``:
    CUDA-graph replay equals eager; the contiguous layout of the same routing gives the same rows
    (same math; the split-K choice (FP32 order) may differ); both match the checkpoint reference."""
    from tests.test_moe import capture_replay, make_weights, make_x, prep, ref_out
    from dsv4.ops import moe
    from dsv4.registry import use
    E, D, I = 257, 4096, 2048
    base = make_weights(3, D, I, device="cuda")
    ck = {kk: (v.repeat(86, *([1] * (v.dim() - 1)))[:E].contiguous() if v is not None else None) for kk, v in base.items()}
    W = prep(ck, "mxfp4")
    T = 9
    idx = torch.tensor([[e] for e in (1, 2, 30, 31, 100, 128, 200, 255, 256)], dtype=torch.int32, device="cuda")
    w = torch.rand(T, 1, device="cuda") + 0.1
    x = make_x(T, D, device="cuda")
    with use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
        out_c = moe.moe_experts(x, idx, w, W, layout="contiguous")
        out, out_g = capture_replay(lambda: moe.moe_experts(x, idx, w, W, layout="masked", max_m=1))
    assert torch.equal(out_g, out)
    assert _rel(out_c, out) < 1e-2
    assert _rel(out, ref_out(x, ck, "mxfp4", "fp8", idx, w)) < 1e-2


@pytest.mark.gpu
def test_gpu_decode_flash_shape_graph_and_contiguous(consumer):
    _flash_shape_graph_and_contiguous("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "fp8"), ("nvfp4", "fp8"), ("nvfp4", "bf16")])
def test_gpu_decode_layer_vs_checkpoint_reference_and_dsl(fmt, act):
    """The whole routed-expert layer (masked, m = 4) vs moe_layer_ref (checkpoint layout, exact
    dequant); for MXFP4 also vs the same layer on the CuTe DSL grouped GEMMs."""
    from tests.test_moe import make_weights, make_x, prep, random_routing, ref_out
    from dsv4.ops import moe
    from dsv4.registry import use
    E, D, I, T, k = 31, 2048, 1024, 24, 6
    ck = make_weights(E, D, I, fmt=fmt, gscale_spread=2.0, device="cuda")
    W = prep(ck, fmt)
    x = make_x(T, D, device="cuda")
    idx, w = random_routing(T, E, k, device="cuda", only=[e for e in range(E) if e % 4])
    with use(moe_gemm1_swiglu="cuda", moe_gemm2="cuda"):
        out = moe.moe_experts(x, idx, w, W, act=act, layout="masked", max_m=16)
    with use(moe_gemm1_swiglu="dsl", moe_gemm2="dsl"):
        out_dsl = moe.moe_experts(x, idx, w, W, act=act, layout="masked", max_m=16)
    ref = ref_out(x, ck, fmt, act, idx, w)
    err = _rel(out, ref)
    print(f"\n[moe decode layer] {fmt} {act}: vs reference {err:.2e}, dsl vs reference {_rel(out_dsl, ref):.2e}")
    assert err < (1e-2 if act == "fp8" else 3e-3)
    if fmt == "mxfp4":
        assert _rel(out, out_dsl) < (1e-2 if act == "fp8" else 3e-3)


# ------------------------------------------------------------------------------ schedule port (CPU)
def _split_choice(total, G, KB, ksplit_max, ucap):
    """Port of the kernel's device-side split-K choice (moe_decode.cu)."""
    ks = 1
    best = total / (G * (-(-total // G))) if total > 0 else 1.0
    k = 2
    while k <= ksplit_max and best < 0.9:
        u = total * k
        if KB % k or KB // k < 2 or u > ucap:
            break
        eff = u / (G * (-(-u // G)))
        if eff > best + 0.02:
            best, ks = eff, k
        k *= 2
    return ks


def test_split_choice_for_decode_shapes():
    p = moe_decode.default_config(256, 256, 4096, 4096, "fp8", "mxfp4", 1)
    G = moe_decode.grid_size(p, 256, 256, 4096, 132)
    assert _split_choice(8 * 16, G, 32, 4, 4 * G) == 2          # Flash 8 x 1, GEMM1 (128 items)
    assert _split_choice(8 * 16, G, 16, 4, 4 * G) == 2          # Flash 8 x 1, GEMM2
    assert _split_choice(8 * 24, G, 56, 4, 4 * G) == 4          # Pro 8 x 1, GEMM1 (192 items)
    assert _split_choice(64 * 16, G, 32, 4, 4 * G) == 1         # Flash 64 x 4: enough items
    assert _split_choice(0, G, 32, 4, 4 * G) == 1


@pytest.mark.parametrize("seed", range(4))
def test_schedule_port_covers_every_block_once(seed):
    """Port of the prefix / md_item / unit loop: over random per-expert counts (zeros included),
    the units of all CTAs cover every (expert, token, weight row slab, 128-K block) exactly once
    and nothing of an empty expert."""
    rng = np.random.default_rng(seed)
    E, N, K, NT, nwg = 37, 1024, 1024, 8, 2
    counts = rng.integers(0, 20, E) * (rng.random(E) < 0.6)
    SLAB, KB = 128 * nwg, K // 128
    prefix = np.concatenate([[0], np.cumsum((counts + NT - 1) // NT)])
    NS = N // SLAB
    total = int(prefix[-1]) * NS
    G = 50
    ks = _split_choice(total, G, KB, 4, 4 * G)
    seen = collections.Counter()
    for b in range(G):
        for un in range(b, total * ks, G):
            item = un // ks
            mt, nt = divmod(item, NS)
            e = int(np.searchsorted(prefix, mt, side="right") - 1)
            ch = (mt - prefix[e]) * NT
            ntok = min(NT, counts[e] - ch)
            assert ntok >= 1
            kb0 = (un % ks) * (KB // ks)
            for t in range(ntok):
                for kb in range(kb0, kb0 + KB // ks):
                    seen[(e, ch + t, nt, kb)] += 1
    want = {(e, t, nt, kb) for e in range(E) for t in range(counts[e]) for nt in range(NS) for kb in range(KB)}
    assert set(seen) == want and all(v == 1 for v in seen.values())

# ================================================================================================
# The CuTe DSL grouped GEMM (kernels_dsl/sm90/grouped_gemm.py via kernels_dsl/moe.py) in the decode
# regime: a CPU port of its device scheduler (kernels_dsl/sm90/scheduler.py: clamped counts, M-tile
# prefix sums, unit -> (expert, N tile, rows)) that must cover every valid (expert, row, N tile)
# exactly once for random and invalid row_start / row_count values; its configuration heuristic
# (the real per-expert maximum, not the average, picks the token tile); GPU tests of the forced
# dsl provider vs the torch oracles within its contract (GEMM2 <= 5e-3 W4A8, <= 1e-5 W4A16).
from kernels_dsl.sm90 import config as C  # noqa: E402


# ------------------------------------------------------------------------------ scheduler port (CPU)
def _schedule_port(row_start, row_count, R, tile_m):
    """Port of build_schedule: (prefix, rstart, count) with the documented clamping."""
    E = len(row_start)
    cnt, rst = [], []
    for rs, rc in zip(row_start, row_count):
        ok = 0 <= rs < R and rc > 0
        cnt.append(min(rc, R - rs) if ok else 0)
        rst.append(rs if ok else 0)
    prefix = [0]
    for c in cnt:
        prefix.append(prefix[-1] + -(-c // tile_m))
    return prefix, rst, cnt


def _unit_port(u, n_tiles, prefix, rst, cnt, tile_m):
    """Port of unit_lookup (binary search for the largest e with prefix[e] <= M-tile)."""
    mt_glob, nt = divmod(u, n_tiles)
    lo, hi = 0, len(rst)
    for _ in range(C.e_cap_for(len(rst)).bit_length()):
        mid = (lo + hi) // 2
        if prefix[mid] <= mt_glob:
            lo = mid
        else:
            hi = mid
    e = lo
    mt = mt_glob - prefix[e]
    return e, nt, rst[e] + mt * tile_m, min(cnt[e] - mt * tile_m, tile_m)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tile_m", [64, 128])
def test_dsl_scheduler_port_covers_every_row_once(seed, tile_m):
    rng = np.random.default_rng(seed)
    E, NT = int(rng.integers(1, 40)), int(rng.integers(1, 5))
    counts = (rng.integers(0, 300, E) * (rng.random(E) < 0.6)).tolist()
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    R = int(sum(counts)) + int(rng.integers(0, 50))
    if seed % 2:  # invalid metadata: negative / out-of-range starts, negative / huge counts
        for e in rng.choice(E, size=max(1, E // 4), replace=False):
            starts[e], counts[e] = [(-5, 10), (R + 7, 3), (starts[e], -4), (starts[e], 10 ** 7)][int(rng.integers(0, 4))]
    prefix, rst, cnt = _schedule_port(starts, counts, R, tile_m)
    seen = collections.Counter()
    for u in range(prefix[-1] * NT):
        e, nt, row0, nrows = _unit_port(u, NT, prefix, rst, cnt, tile_m)
        assert 0 <= e < E and 1 <= nrows <= tile_m and 0 <= row0 and row0 + nrows <= R
        for r in range(row0, row0 + nrows):
            seen[(e, r, nt)] += 1
    want = set()
    for e in range(E):
        if 0 <= starts[e] < R and counts[e] > 0:
            want |= {(e, r, nt) for r in range(starts[e], starts[e] + min(counts[e], R - starts[e])) for nt in range(NT)}
    assert set(seen) == want and all(v == 1 for v in seen.values())


def test_dsl_decode_config_from_the_real_maximum():
    E, D, I = 256, 4096, 2048
    dec = C.choose(stage=1, act="fp8", fmt="mxfp4", R=E * 4, E=E, N=2 * I, K=D, max_m=4)
    assert dec.tile_m == 64 and dec.consumers == 1 and dec.stages >= 4
    # contiguous batch with one hot expert: the average says decode, the hint says prefill tile
    assert C.choose(stage=2, act="fp8", fmt="mxfp4", R=600, E=E, N=D, K=I).tile_m == 64
    assert C.choose(stage=2, act="fp8", fmt="mxfp4", R=600, E=E, N=D, K=I, max_m=400).tile_m == 128
    assert "tile 64x256x128" in dec.explain()


# ------------------------------------------------------------------------------ GPU
@pytest.fixture(params=["dsl"])
def prov(request):
    """The CuTe DSL provider (kernels_dsl/moe.py), forced: the registry default is cuda."""
    return request.param


def _valid(gr):
    valid = torch.zeros(gr.a.shape[0], dtype=torch.bool, device=gr.a.device)
    for e, c in enumerate(gr.row_count.tolist()):
        valid[gr.row_start[e]:gr.row_start[e] + c] = True
    return valid


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("act", ["fp8", "bf16"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gpu_dsl_decode_matches_oracles(fmt, act, m, prov):
    """GEMM1 and GEMM2 in the decode regime vs the torch oracles on the same inputs (NVFP4 with
    general E4M3 block scales): GEMM2 within the contract, h within bf16 / FP8 rounding."""
    ck, W, gr, *_ = _case(fmt, act, m)
    err_y, err_h, same_s, _ = _gemms_vs_oracles(gr, W, act, prov, f"{prov}] {fmt} {act} m={m}", max_m=m)
    if act == "fp8":
        assert same_s > 0.99 and err_h < 1e-2 and err_y < 5e-3
    else:
        assert err_h < 2e-3 and err_y < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "fp8"), ("nvfp4", "bf16")])
def test_gpu_dsl_decode_deterministic_and_tile_independent(fmt, act, prov):
    """3 active experts of 33: two runs are bitwise equal (no atomics, fixed summation order);
    the 64-row and the 128-row token tiles (hint) agree within the contract."""
    from dsv4.ops import moe
    from dsv4.registry import use
    ck, W, gr, *_ = _case(fmt, act, 2, empty=[e for e in range(33) if e not in (3, 16, 32)])
    rows = _valid(gr)
    with use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
        outs = []
        for hint in (2, 2, 1000):
            h, h_s = moe.moe_gemm1_swiglu(gr, W, max_m=hint)
            outs.append((h, moe.moe_gemm2(h, h_s, gr, W, max_m=hint)))
    assert torch.equal(outs[0][1][rows], outs[1][1][rows])
    assert torch.equal(outs[0][0].view(torch.uint8)[rows] if act == "fp8" else outs[0][0][rows],
                       outs[1][0].view(torch.uint8)[rows] if act == "fp8" else outs[1][0][rows])
    assert _rel(outs[2][1][rows], outs[0][1][rows]) < (5e-3 if act == "fp8" else 1e-5)


@pytest.mark.gpu
def test_gpu_dsl_decode_flash_shape_graph_and_contiguous(prov):
    _flash_shape_graph_and_contiguous(prov)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,act", [("mxfp4", "fp8"), ("nvfp4", "fp8"), ("nvfp4", "bf16")])
def test_gpu_dsl_decode_layer_vs_checkpoint_reference(fmt, act, prov):
    """The whole routed-expert layer (masked, up to 16 rows per expert) vs moe_layer_ref
    (checkpoint layout, exact dequant)."""
    from tests.test_moe import make_weights, make_x, prep, random_routing, ref_out
    from dsv4.ops import moe
    from dsv4.registry import use
    E, D, I, T, k = 31, 2048, 1024, 24, 6
    ck = make_weights(E, D, I, fmt=fmt, gscale_spread=2.0, device="cuda")
    W = prep(ck, fmt)
    x = make_x(T, D, device="cuda")
    idx, w = random_routing(T, E, k, device="cuda", only=[e for e in range(E) if e % 4])
    with use(moe_gemm1_swiglu=prov, moe_gemm2=prov):
        out = moe.moe_experts(x, idx, w, W, act=act, layout="masked", max_m=16)
    ref = ref_out(x, ck, fmt, act, idx, w)
    err = _rel(out, ref)
    print(f"\n[moe decode layer {prov}] {fmt} {act}: vs reference {err:.2e}")
    assert err < (1e-2 if act == "fp8" else 3e-3)
