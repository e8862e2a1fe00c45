"""quantize_nvfp4 / quantize_mxfp4 / quantize_fp8_block / dequantize_fp8_block.

CPU (CI):
* the kernel arithmetic, emulated in numpy fp32 line by line (magic-add E2M1 rounding,
  2688/amax global scale, Markstein-corrected x/s, the OCP MX NaN / Inf block rule), is bit-exact
  with ``dsv4.formats`` on exhaustive bf16/fp16 sweeps and on data with outliers, zero blocks,
  NaN/Inf -- this pins the algorithm before any GPU time is spent; the DSL encoder's bit model
  (``kernels_dsl/sm90/fp4.py``) likewise; the CuTe DSL kernels' sm_90a compile checks live in
  tests/test_compile_dsl.py; the frozen launch plans by size class;
* argument validation (names the argument), registry behaviour, torch.library opcheck, and
  a source check that the GPU providers have no host sync.

GPU (``-m gpu``, H200): every kernel of the GPU provider (CuTe DSL; the CUDA one was deleted when the
DSL one matched or beat it at every size, job mem7-02) bit-exact (byte views) against the
torch reference run on the same GPU, at [8192, 8192], decode shapes [1..128, 7168], odd M for the
swizzled layout, outliers, all-zero rows, NaN/Inf (OCP MX rule, by value), tiny/huge magnitudes;
every device-amax NVFP4 launch path; launch geometries; CUDA graph capture and replay.
"""
from __future__ import annotations

import inspect
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

import dsv4.formats as F
from dsv4 import registry
from dsv4.layout import LayoutError
from dsv4.ops import dequantize_fp8_block, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from dsv4.registry import ProviderUnavailableError
from dsv4.target import Target

f32 = np.float32
FLT_MAX = f32(np.finfo(np.float32).max)
INV6 = np.array([0x3E2AAAAB], np.uint32).view(f32)[0]
INV448 = np.array([0x3B124925], np.uint32).view(f32)[0]
OPS = ("quantize_nvfp4", "quantize_mxfp4", "quantize_fp8_block", "dequantize_fp8_block")


# ============================================================================== numpy emulation
def emu_e2m1(y: np.ndarray) -> np.ndarray:
    """The kernels' E2M1 encode (one magic add, kernels_dsl/_quantize_ptx.py e2m1_rn_bits: the low byte of
    bits(a + M_E) is the level index) per element, with the NaN code, in numpy fp32 (uint32 wraps like the GPU)."""
    y = y.astype(f32)
    with np.errstate(invalid="ignore"):
        a = np.fmin(np.abs(y), f32(6))                    # fminf: NaN -> 6 (overridden below)
    u = a.view(np.uint32)
    e = np.maximum(u >> np.uint32(23), np.uint32(127))
    mb = e * np.uint32(0x800002) + np.uint32((0x4A800000 - 127 * 0x800002) & 0xFFFFFFFF)
    s = (a + mb.view(f32)).astype(f32)
    idx = s.view(np.uint32) & np.uint32(0xFF)
    code = idx | ((y.view(np.uint32) >> np.uint32(28)) & np.uint32(8))
    return np.where(np.isnan(y), F.E2M1_NAN_CODE, code).astype(np.uint8)


def emu_div_rn(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """kernels_dsl/_quantize_ptx.py div_rn_by3 (Markstein, 3 instructions, no sign fix): q0 = x*r,
    t = fma(q0, s, -x), q = fma(-t, r, q0). fma emulated in float64 (t is exact there; q may
    double-round with probability ~2^-29, negligible at these sample sizes)."""
    x = x.astype(f32)
    s = s.astype(f32)
    r = (f32(1) / s).astype(f32)
    q0 = (x * r).astype(f32)
    t = (q0.astype(np.float64) * s.astype(np.float64) - x.astype(np.float64)).astype(f32)
    return (q0.astype(np.float64) - t.astype(np.float64) * r.astype(np.float64)).astype(f32)


def _finite_absmax(x: np.ndarray, axis) -> np.ndarray:
    return np.where(np.isfinite(x), np.abs(x), f32(0)).max(axis=axis).astype(f32)


def _pack(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def emu_nvfp4(x: np.ndarray, gdec=None):
    """The NVFP4 kernel path in numpy: returns (data, scale bytes, g_dec, g_enc). NaN rule (OCP MX):
    a block with a NaN / Inf gets scale 0x7F and zero codes; a non-finite tensor amax gives NaN g."""
    M, K = x.shape
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        gnan = False
        if gdec is None:
            amax = _finite_absmax(x, None)
            gnan = not np.isfinite(x).all()
            g_enc = np.fmin((f32(2688) / amax).astype(f32), FLT_MAX).astype(f32) if amax > 0 else f32(1)
            g_enc = f32(np.nan) if gnan else g_enc
            g_dec = (f32(1) / g_enc).astype(f32)
        else:
            g_dec = f32(gdec)
            g_enc = (f32(1) / g_dec).astype(f32)
        mult = f32(g_enc * INV6)
        blk = x.reshape(M, K // 16, 16)
        vmax = _finite_absmax(blk, -1)
        sf = np.fmin((vmax * mult).astype(f32), f32(448))
        sb = sf.astype(ml_dtypes.float8_e4m3fn)
        s = sb.astype(f32)
        enc = np.fmin((f32(1) / (s * g_dec).astype(f32)).astype(f32), FLT_MAX)
        codes = emu_e2m1((blk * enc[..., None]).astype(f32))
    codes = np.where((s == 0)[..., None], codes & 8, codes)
    bad = ~np.isfinite(blk).all(-1) | gnan
    codes = np.where(bad[..., None], 0, codes)
    return _pack(codes.reshape(M, K)), np.where(bad, 0x7F, sb.view(np.uint8)).astype(np.uint8), g_dec, g_enc


def emu_mxfp4(x: np.ndarray, rule: str):
    M, K = x.shape
    blk = x.reshape(M, K // 32, 32)
    vmax = _finite_absmax(blk, -1)
    if rule == "dsv4":
        tt = (np.fmax(vmax, f32(6 * 2.0 ** -126)) * INV6).astype(f32)
        b = tt.view(np.uint32)
        byte = (b >> 23) + ((b & 0x7FFFFF) != 0)
        inv = ((254 - byte).astype(np.uint32) << 23).view(f32)
    else:
        with np.errstate(divide="ignore"):
            fl = np.where(vmax > 0, np.floor(np.log2(np.where(vmax > 0, vmax, 1).astype(np.float64))), 0)
        e = np.where(vmax > 0, fl - 2, -127).clip(-127, 127).astype(np.int64)
        byte = (e + 127).astype(np.uint32)
        inv = np.where(-e == -127, np.uint32(0x00400000), ((127 - e) << 23).astype(np.uint32)).astype(np.uint32).view(f32)
    with np.errstate(over="ignore", invalid="ignore"):
        codes = emu_e2m1((blk * inv[..., None]).astype(f32))
    bad = ~np.isfinite(blk).all(-1)                      # OCP MX: NaN / Inf block -> 0xFF, zero codes
    codes = np.where(bad[..., None], 0, codes)
    return _pack(codes.reshape(M, K)), np.where(bad, 0xFF, byte).astype(np.uint8)


def emu_fp8(x: np.ndarray, block: int, fmt: str):
    M, K = x.shape
    blk = x.reshape(M, K // block, block)
    s = (np.fmax(_finite_absmax(blk, -1), f32(1e-4)) * INV448).astype(f32)
    if fmt == "ue8m0":
        b = s.view(np.uint32)
        s = (((b >> 23) + ((b & 0x7FFFFF) != 0)).astype(np.uint32) << 23).view(f32)
    ss = np.broadcast_to(s[..., None], blk.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        q = emu_div_rn(blk, ss)
    q = np.where(np.isinf(blk), np.copysign(f32(448), blk), q)
    q = np.clip(q, -448, 448)
    qb = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    qb = np.where(np.isnan(blk), 0x7F, qb).astype(np.uint8)
    return qb.reshape(M, K), s


def _all_bits(dtype) -> torch.Tensor:
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_e2m1_encode_exhaustive(dtype):
    x = _all_bits(dtype)
    want = F.e2m1_encode(x).numpy()
    got = emu_e2m1(x.float().numpy())
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} mismatches, first x={x[bad[0]].item()} got {got[bad[0]]} want {want[bad[0]]}"


def test_emulated_e2m1_encode_fp32_dense_and_ties():
    lo, hi = np.array([0.0, 7.0], f32).view(np.uint32)
    bits = np.arange(lo, hi, 61, dtype=np.uint32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 2.0, 4.0], f32).view(np.uint32)
    near = (mids[:, None] + np.arange(-3, 4, dtype=np.int64)[None, :]).astype(np.uint32).ravel()
    y = np.concatenate([bits, near]).view(f32)
    y = np.concatenate([y, -y, np.array([np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e30], f32)])
    want = F.e2m1_encode(torch.from_numpy(np.clip(y, -6, 6))).numpy()
    np.testing.assert_array_equal(emu_e2m1(y), want)


def emu_e2m1x8_fast(y: np.ndarray) -> np.ndarray:
    """The packed E2M1 encoder (kernels_dsl/_quantize_ptx.py e2m1x8_encode_rn: per element bits(a + M_E), pairs
    packed by (s_2i+1 << 4) + s_2i, the four low bytes gathered by prmt) on y [..., 8] (already multiplied by
    enc, no NaN) -> packed uint32 words."""
    y = y.astype(f32)
    a = np.fmin(np.abs(y), f32(6))
    e = np.maximum(a.view(np.uint32) >> np.uint32(23), np.uint32(127))
    mb = e * np.uint32(0x800002) + np.uint32((0x4A800000 - 127 * 0x800002) & 0xFFFFFFFF)
    s = (a + mb.view(f32)).astype(f32).view(np.uint32)
    p = ((s[..., 1::2] << np.uint32(4)) + s[..., 0::2]) & np.uint32(0xFF)      # the low byte of each pair sum
    mag = p[..., 0] | (p[..., 1] << np.uint32(8)) | (p[..., 2] << np.uint32(16)) | (p[..., 3] << np.uint32(24))
    sh = np.arange(8, dtype=np.uint32) * np.uint32(4)
    sgn = ((y.view(np.uint32) >> np.uint32(31)) << (sh + np.uint32(3))).sum(axis=-1, dtype=np.uint64)
    return (mag | sgn).astype(np.uint32)


def test_emulated_packed_fast_encoder_matches_per_element():
    rng = np.random.default_rng(1)
    y = np.concatenate([_all_bits(torch.bfloat16).float().numpy(), _all_bits(torch.float16).float().numpy(),
                        (rng.standard_normal(1 << 18) * 4).astype(f32)])
    y = y[~np.isnan(y)]
    y = y[: y.size // 8 * 8].reshape(-1, 8)
    codes = emu_e2m1(y).astype(np.uint32)
    want = (codes << (np.arange(8, dtype=np.uint32) * 4)).sum(axis=-1, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(emu_e2m1x8_fast(y), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dsl_e2m1x8_encoder_model_exhaustive(dtype):
    """kernels_dsl/sm90/fp4.py e2m1x8_encode (the DSL quantizers' encoder, magnitudes by magic add +
    signs by prmt from the input words), bit model: every finite bf16 / fp16 value times several
    encode multipliers (powers of two, E4M3-derived, tiny / huge) equals dsv4.formats.e2m1_encode."""
    from kernels_dsl.sm90.fp4 import model_e2m1x8_encode
    x = _all_bits(dtype)
    x = x[torch.isfinite(x.float())]
    x = x[: x.numel() // 8 * 8]
    h = x.view(torch.int16).to(torch.int32).numpy().astype(np.int64) & 0xFFFF
    words = (h[0::2] | (h[1::2] << 16)).reshape(-1, 4)
    rng = np.random.default_rng(2)
    for enc in (1.0, 0.5, 2.0 ** -20, 2.0 ** 30, float(f32(1) / f32(3.25)), float(f32(6) / f32(448) * f32(1.7))):
        rows = words[rng.choice(len(words), 600, replace=False)]
        for w in rows:
            got = model_e2m1x8_encode([int(v) for v in w], enc, fp16=dtype == torch.float16)
            halves = torch.tensor([(int(v) >> (16 * k)) & 0xFFFF for v in w for k in (0, 1)], dtype=torch.int32)
            xv = halves.to(torch.int16).view(dtype).float() * torch.tensor(enc, dtype=torch.float32)
            codes = F.e2m1_encode(xv.clamp(-6, 6))
            want = sum(int(c) << (4 * i) for i, c in enumerate(codes.tolist()))
            assert got == want, (hex(got), hex(want), w, enc)
    # the sign spread (4 prmt + shift + masks), exhaustively on every word of the sweep
    from kernels_dsl.sm90.fp4 import model_e2m1x8_signs
    sg = (h >> 15) & 1
    want = (sg.reshape(-1, 8) << (np.arange(8) * 4 + 3)).sum(-1)
    got = np.array([model_e2m1x8_signs(*[int(v) for v in w]) for w in words])
    np.testing.assert_array_equal(got, want)


def _swz_off(m, k, Kt):
    return ((m >> 7) * Kt + (k >> 2)) * 512 + (m & 31) * 16 + ((m >> 5) & 3) * 4 + (k & 3)


@pytest.mark.parametrize("M,Ksf", [(1, 448), (127, 448), (129, 256), (300, 65), (1, 3), (3, 5), (256, 6)])
def test_emulated_swizzled_stores_cover_the_layout_exactly_once(M, Ksf):
    """kernels_dsl/quantize_fp4.py scale stores (real blocks) + its padding loops write every byte of the
    [Mt, Kt, 32, 4, 4] layout exactly once, at dsv4.formats.swizzled_sf_offset for real (m, k)."""
    Kt, Mt = -(-Ksf // 4), -(-M // 128)
    hits = np.zeros(Mt * Kt * 512, np.int64)
    g = np.arange(M * Ksf)
    m, k = g // Ksf, g % Ksf
    real = _swz_off(m, k, Kt)
    np.testing.assert_array_equal(real, F.swizzled_sf_offset(torch.from_numpy(m), torch.from_numpy(k), Ksf).numpy())
    np.add.at(hits, real, 1)
    # pad rows: the Kt x 128 words of the last 128-row block in memory order, word j of a cell group = row
    # 32 (j & 3) + (j >> 2) of the block, stored when that row is >= M
    b_last = Mt - 1
    i = np.arange(Kt * 128 if Mt * 128 > M else 0)
    jw = i & 127
    row = b_last * 128 + 32 * (jw & 3) + (jw >> 2)
    w = ((b_last * Kt + (i >> 7)) * 512 + jw * 4)[row >= M]
    np.testing.assert_array_equal(np.sort(w), np.sort(_swz_off(row[row >= M], 4 * (i >> 7)[row >= M], Kt)))
    for b in range(4):
        np.add.at(hits, w + b, 1)
    padc = 4 * Kt - Ksf                                           # pad columns of real rows: bytes
    i = np.arange(M * padc)
    if padc:
        mm = i // padc
        np.add.at(hits, _swz_off(mm, Ksf + (i - mm * padc), Kt), 1)
    assert (hits == 1).all(), (np.unique(hits, return_counts=True))


def test_emulated_markstein_division_is_correctly_rounded():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-20, 20, 200_000))).astype(f32)
    s = np.exp(rng.uniform(-25, 25, 200_000)).astype(f32)
    # exact-quotient cases: x = q * s with q an E4M3 midpoint and s = 3 * 2^k (x exact in fp32)
    qm = np.array([1.0625, 1.1875, 17.0, 0.0029296875, 300.0, 440.0], f32)
    s3 = (3 * 2.0 ** rng.integers(-20, 20, 600)).astype(f32)
    qq = np.tile(qm, 100)
    x = np.concatenate([x, (qq * s3).astype(f32), -(qq * s3).astype(f32), np.array([0.0, -0.0], f32)])
    s = np.concatenate([s, s3, s3, np.array([3.0, 3.0], f32)])
    got = emu_div_rn(x, s)
    want = (x / s).astype(f32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for i in rng.integers(0, x.size, 300):   # exact rational check of numpy's own division
        assert f32(Fraction(float(x[i])) / Fraction(float(s[i]))) == want[i] or not np.isfinite(want[i])


def _data(M, K, seed, dtype=torch.bfloat16, specials=False, scale=1.0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=device)
    x = x * (1 + 60 * (torch.rand(K, generator=g, device=device) < 0.02))   # outlier channels
    x = x * torch.exp(torch.randn(M, 1, generator=g, device=device))          # per-row magnitude
    x[::5] = 0                                                                # all-zero rows
    x[:, :16] = 0                                                             # all-zero blocks
    x = (x * scale).to(dtype)
    if specials:
        n = x.numel()
        idx = torch.randint(0, n, (max(4, n // 500),), generator=g, device=device)
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, -float("nan")], dtype=dtype,
                            device=device)
        x.view(-1)[idx] = vals[torch.arange(idx.numel(), device=device) % vals.numel()]
        if K >= 64:
            x[1 % M, 32:48] = float("inf")                                    # a block of Inf only
            x[2 % M, 48:64] = float("nan")                                    # a block of NaN only
    return x


CASES = [(0, False, 1.0), (1, True, 1.0), (2, False, 1e-36), (3, False, 1e36), (4, True, 3e-3)]


@pytest.mark.parametrize("seed,specials,scale", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_nvfp4_matches_formats(seed, specials, scale, dtype):
    if dtype == torch.float16 and scale != 1.0 and scale != 3e-3:
        pytest.skip("out of fp16 range")
    x = _data(37, 256, seed, dtype, specials, scale)
    for gdec in (None, 0.0123):
        ref = F.quantize_nvfp4(x, None if gdec is None else torch.tensor(gdec, dtype=torch.float32))
        d, s, gd, ge = emu_nvfp4(x.float().numpy(), gdec)
        np.testing.assert_array_equal(d, ref.data.numpy())
        np.testing.assert_array_equal(s, ref.scale.view(torch.uint8).numpy())
        assert f32(gd).view(np.uint32) == ref.global_scale.numpy().view(np.uint32)
        assert f32(ge).view(np.uint32) == ref.global_encode_scale.numpy().view(np.uint32)


@pytest.mark.parametrize("seed,specials,scale", CASES)
@pytest.mark.parametrize("rule", ["dsv4", "ocp"])
def test_emulated_mxfp4_matches_formats(seed, specials, scale, rule):
    x = _data(37, 256, seed, torch.bfloat16, specials, scale)
    rd, rs = F.quantize_mxfp4(x, rule)
    d, s = emu_mxfp4(x.float().numpy(), rule)
    np.testing.assert_array_equal(d, rd.numpy())
    np.testing.assert_array_equal(s, rs.view(torch.uint8).numpy())


@pytest.mark.parametrize("seed,specials,scale", CASES)
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("fmt", ["fp32", "ue8m0"])
def test_emulated_fp8_matches_formats(seed, specials, scale, block, fmt):
    x = _data(21, 512, seed, torch.bfloat16, specials, scale)
    rq, rs = F.quantize_fp8_block(x, block, fmt)
    q, s = emu_fp8(x.float().numpy(), block, fmt)
    rqb = rq.view(torch.uint8).numpy()
    nan = np.isnan(x.float().numpy())
    # torch CPU keeps a NaN's sign (0xFF for -NaN); the GPU (and the kernel) give 0x7F
    np.testing.assert_array_equal(np.where(nan, 0x7F, rqb), q)
    assert ((rqb[nan] & 0x7F) == 0x7F).all()
    np.testing.assert_array_equal(s.view(np.uint32), rs.numpy().view(np.uint32))


# ============================================================================== validation / registry
def test_validation_names_the_argument():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="'x'.*K % 16|K must be a multiple of 16"):
        quantize_nvfp4(torch.randn(4, 40, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="'x'"):
        quantize_nvfp4(x.to(torch.int32))
    with pytest.raises(LayoutError, match="'x'.*contiguous"):
        quantize_nvfp4(torch.randn(64, 4, dtype=torch.bfloat16).t())
    with pytest.raises(LayoutError, match="'global_scale'"):
        quantize_nvfp4(x, global_scale=torch.ones(2))
    with pytest.raises(LayoutError, match="'global_scale'"):
        quantize_nvfp4(x, global_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="sf_layout"):
        quantize_nvfp4(x, sf_layout="tiled")
    with pytest.raises(LayoutError, match="at least one row"):
        quantize_nvfp4(torch.randn(0, 64, dtype=torch.bfloat16))
    with pytest.raises(LayoutError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rule"):
        quantize_mxfp4(x, rule="floor")
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_block(x, block=16)
    with pytest.raises(LayoutError, match="multiple of block"):
        quantize_fp8_block(torch.randn(4, 96, dtype=torch.bfloat16), block=64)
    with pytest.raises(ValueError, match="scale_fmt='ue8m0'"):
        quantize_fp8_block(x, block=32, scale_dtype=torch.float8_e8m0fnu)
    q, s = quantize_fp8_block(x, block=32)
    with pytest.raises(LayoutError, match="'scale'"):
        dequantize_fp8_block(q, s[:, :1], block=32)
    with pytest.raises(LayoutError, match="'q'"):
        dequantize_fp8_block(q.view(torch.uint8), s, block=32)
    with pytest.raises(ValueError, match="out_dtype"):
        dequantize_fp8_block(q, s, block=32, out_dtype=torch.int8)


def test_public_api_matches_formats_on_cpu():
    x = _data(130, 256, 7, torch.bfloat16, True)
    for layout in ("linear", "swizzled"):
        t, r = quantize_nvfp4(x, sf_layout=layout), F.quantize_nvfp4(x, sf_layout=layout)
        assert torch.equal(t.data, r.data) and torch.equal(t.scale.view(torch.uint8), r.scale.view(torch.uint8))
        assert torch.equal(t.global_scale, r.global_scale) or (t.global_scale.isnan() and r.global_scale.isnan())
        assert t.global_scale.dim() == 0
    d, s = quantize_mxfp4(x.reshape(2, 65, 256), rule="ocp")
    rd, rs = F.quantize_mxfp4(x.reshape(2, 65, 256), "ocp")
    assert torch.equal(d, rd) and torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    q, s = quantize_fp8_block(x, block=64, scale_fmt="ue8m0", scale_dtype=torch.float8_e8m0fnu)
    rq, rs = F.quantize_fp8_block(x, 64, "ue8m0")
    assert torch.equal(F.ue8m0_decode(s), rs)
    y = dequantize_fp8_block(q, s, block=64, out_dtype=torch.float32)
    assert torch.equal(y.nan_to_num(), F.dequantize_fp8_block(rq, rs, 64).nan_to_num())


def test_registry_gpu_providers_refuse_cpu_and_fp32():
    t = Target.of("cpu")
    hop = Target("cuda", "sm_90a", "H200", 132, 0)
    for name in OPS:
        op = registry.get_op(name)
        rows = {r["provider"]: r for r in op.table(t)}
        assert rows["torch"]["chosen"]
        for kind in ("dsl", "cuda"):
            if kind in rows:
                assert not rows[kind]["ok"], (name, kind, rows[kind])
    p = registry.get_op("quantize_nvfp4").provider("dsl")
    if not isinstance(p, registry.Support):
        import kernels_dsl.quantize as kq
        prob = {"in_dtype": "float32", "K": 64, "sf_layout": "linear", "global_scale": False, "M": 4}
        assert not p.supports(prob, hop)                         # fp32 input: the kernels read bf16/fp16
        assert not p.supports(dict(prob, in_dtype="bfloat16"), Target("cuda", "sm_100a", "B200", 148, 0))
        if kq.VALIDATED["quantize_nvfp4"]:
            assert p.supports(dict(prob, in_dtype="bfloat16"), hop)
    with registry.use(quantize_mxfp4="cuda"):
        with pytest.raises(ProviderUnavailableError, match="cuda"):
            quantize_mxfp4(torch.randn(2, 64, dtype=torch.bfloat16))
    with registry.use(quantize_mxfp4="dsl"):
        with pytest.raises(ProviderUnavailableError, match="dsl"):
            quantize_mxfp4(torch.randn(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("module", ["kernels_dsl.quantize"])
def test_gpu_providers_have_no_host_sync(module):
    import importlib
    try:
        kq = importlib.import_module(module)
    except ModuleNotFoundError:
        pytest.skip(f"{module} does not exist")
    src = inspect.getsource(kq)
    for bad in (".item(", ".cpu(", ".tolist(", "synchronize(", ".numpy(", "nonzero(", "bool("):
        assert bad not in src, bad


def test_dsl_kernels_wait_for_the_preceding_grid_before_any_global_access():
    """Programmatic dependent launch (kernels_dsl/_quantize_ptx.py pdl_*): in the PTX of the providers' kernels
    (large class: trigger at the end; decode class: at the start) ``griddepcontrol.wait`` comes before every
    global load / store / bulk copy / atomic, and the large class triggers the next launch only after its stores."""
    import re
    pytest.importorskip("cutlass")
    import kernels_dsl.quantize as kq
    names = ["nvfp4-swz-amax-8192x8192", "fp8-b128-ue8m0-16x7168", "dequant-b128-bf16-8192x8192"]
    for name, ptx in kq.compile_check(only=names).items():
        body = ptx[ptx.index(".entry"):]
        first = min(m.start() for m in re.finditer(r"\b(ld|st|atom|red)\.global|cp\.async\.bulk", body))
        assert body.index("griddepcontrol.wait") < first, name
        trig = body.index("griddepcontrol.launch_dependents")
        if "8192x8192" in name:
            assert trig > max(m.start() for m in re.finditer(r"\bst\.global", body)), name
        else:
            assert trig < first, name


def test_dsl_providers_config_is_their_plan():
    """Each DSL quantize provider's ``config(problem, target)`` is the frozen :class:`Plan` its ``run`` launches
    (one heuristic: :func:`plan_nvfp4` ...), and ``explain()`` names it."""
    import dataclasses

    from dsv4.target import Target
    pytest.importorskip("cutlass")
    import kernels_dsl.quantize as kq
    h200 = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
    for op in ("quantize_nvfp4", "quantize_mxfp4", "quantize_fp8_block", "dequantize_fp8_block"):
        o = registry.get_op(op)
        p = o.provider("dsl")
        if isinstance(p, registry.Support):
            pytest.skip(f"dsl provider unavailable: {p.reason}")
        for M in (1, 16, 8192):
            prob = dataclasses.replace(o.example_problem(h200), M=M)
            cfg = p.config(prob, h200)
            assert isinstance(cfg, kq.Plan) and cfg.__dataclass_params__.frozen, (op, cfg)
            assert cfg == p.config(prob, Target.of("cpu")), op          # no SMs: explained for the H200's 132
            assert "config: Plan(" in registry.Choice("dsl", "sm_90a", config=cfg).explain()
    nv = registry.get_op("quantize_nvfp4")
    prob = dataclasses.replace(nv.example_problem(h200), M=16)
    assert nv.provider("dsl").config(prob, h200) == kq.plan_nvfp4("bfloat16", True, False, 16, 7168, 132)


def test_dsl_plans_are_frozen_configs_by_size_class():
    """The DSL launch geometry is a frozen Plan chosen from the problem (no environment switches):
    the measured LARGE geometry from two waves of warp tiles, short 4-warp tiles at decode sizes, the
    one-launch NVFP4 device-amax paths for small tensors."""
    import dataclasses
    import inspect as _inspect

    import kernels_dsl.quantize as kq
    assert "env_" not in _inspect.getsource(kq)
    big = kq.plan_nvfp4("bfloat16", True, True, 8192, 8192, 132)
    assert dataclasses.is_dataclass(big) and big.path == "given"
    assert dict(qj=big.cfg.qj, warps=big.cfg.warps) == {k: kq.LARGE["nvfp4"][k] for k in ("qj", "warps")}
    with pytest.raises(dataclasses.FrozenInstanceError):
        big.ctas_per_sm = 1
    small = kq.plan_mxfp4("bfloat16", "dsv4", 16, 7168, 132).cfg
    assert small.warps == 4 and small.qj == 1 and small.pipe == 0
    # programmatic dependent launch: the next kernel may start early at decode sizes, as this one drains when large
    assert not big.cfg.pdl_early and small.pdl_early
    assert not kq.plan_dequant(128, False, "bfloat16", 8192, 8192, 132).cfg.pdl_early
    assert kq.plan_dequant(128, False, "bfloat16", 16, 7168, 132).cfg.pdl_early
    assert kq.plan_nvfp4("bfloat16", True, False, 16, 7168, 132).cfg.pdl_early
    assert kq.plan_nvfp4("bfloat16", True, False, 8192, 8192, 132).path == "partials"
    assert kq.plan_nvfp4("bfloat16", True, False, 16, 7168, 132).path == "grid"
    assert kq.plan_nvfp4("bfloat16", False, False, 1, 7168, 132).path == "fused"
    assert kq.plan_nvfp4("bfloat16", True, False, 1, 7168, 132).path == "grid"
    for M in (1, 16, 128, 2048, 8192):
        assert kq.plan_fp8(128, 0, "bfloat16", M, 7168, 132) == kq.plan_fp8(128, 0, "bfloat16", M, 7168, 132)
        dq = kq.plan_dequant(128, False, "bfloat16", M, 7168, 132)
        assert 32 * dq.cfg.units * dq.cfg.warps <= max(M * 7168 // 8, 32 * 4)


@pytest.mark.parametrize("name,args", [
    ("quantize_nvfp4", lambda x: (x, None, "swizzled")),
    ("quantize_mxfp4", lambda x: (x, "dsv4")),
    ("quantize_fp8_block", lambda x: (x, 64, "ue8m0", torch.float8_e8m0fnu)),
])
def test_torch_library_opcheck(name, args):
    x = _data(8, 128, 3, torch.bfloat16)
    torch.library.opcheck(getattr(torch.ops.dsv4, name).default, args(x),
                          test_utils=("test_schema", "test_faketensor"))


# ============================================================================== GPU
gpu = pytest.mark.gpu


def _kinds(op: str) -> list:
    """The GPU provider kinds of ``op`` that exist (CuTe DSL first)."""
    o = registry.get_op(op)
    return [k for k in ("dsl", "cuda") if not isinstance(o.provider(k), registry.Support)]


KINDS = ("dsl",)


def _need(op: str, kind: str):
    if kind not in _kinds(op):
        pytest.skip(f"no {kind} provider for {op}")


def _tuning(kind: str) -> dict:
    """The launch-choice dict of the DSL provider (its ``OVERRIDE`` hook: plan fields per kernel
    family; never changes results)."""
    import kernels_dsl.quantize as m
    return m.OVERRIDE


def _dsl_override(over: dict) -> dict:
    """DSL ``OVERRIDE`` for launch choices given as flat keys (``kernels_dsl.quantize.flat_override``)."""
    from kernels_dsl.quantize import flat_override
    return flat_override(over)


class _tuned:
    """Temporarily change the DSL provider's launch choices (see :func:`_dsl_override`)."""

    def __init__(self, kind, **over):
        self.t = _tuning(kind)
        self.over = _dsl_override(over)

    def __enter__(self):
        self.old = dict(self.t)
        self.t.update(self.over)

    def __exit__(self, *a):
        self.t.clear()
        self.t.update(self.old)


def _eq(a: torch.Tensor, b: torch.Tensor, what: str, nan_ok: bool = False):
    """Byte equality; ``nan_ok``: fp32 tensors where both sides may hold a NaN (any payload)."""
    if nan_ok and a.dtype == torch.float32:
        if torch.isnan(a).any() or torch.isnan(b).any():
            assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{what}: NaN positions differ ({a} vs {b})"
            a, b = torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if not torch.equal(ab, bb):
        bad = (ab != bb).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} bytes differ; first at {i}: got {ab[i]:#x} want {bb[i]:#x}")


def _check_nvfp4(x, layout, gdec=None, kind="dsl"):
    gs = None if gdec is None else torch.tensor([gdec], dtype=torch.float32, device=x.device)
    with registry.use(quantize_nvfp4=kind):
        got = quantize_nvfp4(x, global_scale=gs, sf_layout=layout)
    ref = F.quantize_nvfp4(x, None if gs is None else gs.reshape(()), sf_layout=layout)
    _eq(got.data, ref.data, f"{kind} data")
    _eq(got.scale, ref.scale, f"{kind} scale")
    _eq(got.global_scale.reshape(1), ref.global_scale.reshape(1), f"{kind} global_scale", nan_ok=True)
    _eq(got.global_encode_scale.reshape(1), ref.global_encode_scale.reshape(1), f"{kind} global_encode_scale",
        nan_ok=True)


NV_SHAPES = [(8192, 8192), (1, 7168), (2, 7168), (16, 7168), (64, 7168), (128, 7168), (127, 7168),
             (129, 4096), (300, 1040), (1, 48), (3, 80)]


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", NV_SHAPES, ids=str)
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_gpu_nvfp4_bitexact(shape, layout, kind):
    _need("quantize_nvfp4", kind)
    x = _data(*shape, seed=11, dtype=torch.bfloat16, specials=shape[0] % 2 == 1, device="cuda")
    _check_nvfp4(x, layout, kind=kind)
    _check_nvfp4(x, layout, gdec=0.00431, kind=kind)


#: device-amax NVFP4 launch paths: two launches (amax partials + quantize), one single-CTA launch,
#: one grid-synchronized launch (DSL, tensors up to one CTA of 4 warps per SM)
#: NVFP4 device-amax launch paths (the forced path of the DSL plan)
NV_PATHS = {"two-launch": dict(path="partials"), "single-cta": dict(path="fused"), "grid-sync": dict(path="grid")}


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", list(NV_PATHS))
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_nvfp4_paths_specials_magnitudes(path, case, dtype, kind):
    _need("quantize_nvfp4", kind)
    seed, specials, scale = case
    if dtype == torch.float16 and scale not in (1.0, 3e-3):
        pytest.skip("out of fp16 range")
    x = _data(300, 1024, seed, dtype, specials, scale, device="cuda")
    with _tuned(kind, **NV_PATHS[path]):
        for layout in ("linear", "swizzled"):
            _check_nvfp4(x, layout, kind=kind)
            if not specials:
                _check_nvfp4(x, layout, gdec=0.0021, kind=kind)


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_nvfp4_all_zero_and_reverse_off(kind):
    _need("quantize_nvfp4", kind)
    _check_nvfp4(torch.zeros(129, 256, dtype=torch.bfloat16, device="cuda"), "swizzled", kind=kind)
    _check_nvfp4(torch.zeros(4096, 1024, dtype=torch.bfloat16, device="cuda"), "linear", kind=kind)
    with _tuned(kind, reverse=0, path="partials"):
        _check_nvfp4(_data(2048, 4096, 5, device="cuda"), "swizzled", kind=kind)


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_fp4_nan_inf_rule_by_value(kind):
    """OCP MX rule (issue 19 item 13) on the kernels, by value: a NaN / Inf block decodes to NaN
    (scale 0x7F / 0xFF, zero codes), its neighbours do not; a non-finite device amax -> NaN global."""
    _need("quantize_mxfp4", kind)
    x = torch.randn(4, 128, device="cuda").to(torch.bfloat16)
    x[0, 5], x[1, 70], x[3, 127] = float("nan"), float("inf"), -float("inf")
    with registry.use(quantize_mxfp4=kind):
        d, s = quantize_mxfp4(x)
    sb = s.view(torch.uint8).cpu()
    bad = torch.zeros(4, 4, dtype=torch.bool)
    bad[0, 0] = bad[1, 2] = bad[3, 3] = True
    assert sb[bad].tolist() == [0xFF] * 3 and not (sb[~bad] == 0xFF).any()
    deq = F.dequantize_mxfp4(d, s).reshape(4, 4, 32).cpu()
    assert torch.isnan(deq[bad]).all() and torch.isfinite(deq[~bad]).all()
    with registry.use(quantize_nvfp4=kind):
        t = quantize_nvfp4(x, global_scale=torch.tensor([0.001], device="cuda"))
        u = quantize_nvfp4(x)
    nb = t.scale.view(torch.uint8).cpu().reshape(4, 8)
    bad16 = torch.zeros(4, 8, dtype=torch.bool)
    bad16[0, 0] = bad16[1, 4] = bad16[3, 7] = True
    assert nb[bad16].tolist() == [0x7F] * 3 and not (nb[~bad16] == 0x7F).any()
    deq = F.dequantize_nvfp4(t).reshape(4, 8, 16).cpu()
    assert torch.isnan(deq[bad16]).all() and torch.isfinite(deq[~bad16]).all()
    assert torch.isnan(u.global_scale).item() and (u.scale.view(torch.uint8) == 0x7F).all()
    assert torch.isnan(F.dequantize_nvfp4(u)).all()


MX_SHAPES = [(8192, 8192), (1, 7168), (16, 7168), (128, 7168), (129, 4096), (300, 1056)]


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", MX_SHAPES, ids=str)
@pytest.mark.parametrize("rule", ["dsv4", "ocp"])
def test_gpu_mxfp4_bitexact(shape, rule, kind):
    _need("quantize_mxfp4", kind)
    for case in CASES if shape[0] == 300 else CASES[:2]:
        seed, specials, scale = case
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.float16 and (scale not in (1.0, 3e-3) or shape[0] == 8192):
                continue
            x = _data(*shape, seed, dtype, specials, scale, device="cuda")
            with registry.use(quantize_mxfp4=kind):
                d, s = quantize_mxfp4(x, rule=rule)
            rd, rs = F.quantize_mxfp4(x, rule)
            _eq(d, rd, f"{kind} data {case} {dtype}")
            _eq(s, rs, f"{kind} scale {case} {dtype}")


FP8_SHAPES = [(8192, 8192), (1, 7168), (16, 7168), (128, 7168), (300, 1024)]


def _check_fp8(x, block, fmt, sdt, kind="dsl"):
    with registry.use(quantize_fp8_block=kind):
        q, s = quantize_fp8_block(x, block=block, scale_fmt=fmt, scale_dtype=sdt)
    rq, rs = F.quantize_fp8_block(x, block, fmt)
    nan = torch.isnan(x)
    qb, rqb = q.view(torch.uint8), rq.view(torch.uint8)
    assert ((qb[nan] & 0x7F) == 0x7F).all() and ((rqb[nan] & 0x7F) == 0x7F).all(), "NaN must stay E4M3 NaN"
    _eq(torch.where(nan, 0x7F, qb).to(torch.uint8), torch.where(nan, 0x7F, rqb).to(torch.uint8), f"{kind} q")
    _eq(s, F.ue8m0_ceil(rs) if sdt == torch.float8_e8m0fnu else rs, f"{kind} scale")
    return q, s


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=str)
@pytest.mark.parametrize("block", [128, 64, 32])
def test_gpu_fp8_block_bitexact(shape, block, kind):
    _need("quantize_fp8_block", kind)
    cases = CASES if shape[0] == 300 else CASES[:2]
    for seed, specials, scale in cases:
        for dtype in (torch.bfloat16, torch.float16):
            if dtype == torch.float16 and (scale not in (1.0, 3e-3) or shape[0] == 8192):
                continue
            x = _data(*shape, seed, dtype, specials, scale, device="cuda")
            for fmt, sdt in (("fp32", torch.float32), ("ue8m0", torch.float32), ("ue8m0", torch.float8_e8m0fnu)):
                if shape[0] == 8192 and (dtype, fmt, sdt) != (torch.bfloat16, "fp32", torch.float32) and block != 128:
                    continue
                _check_fp8(x, block, fmt, sdt, kind)


@gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(8192, 8192), (1, 7168), (128, 7168), (300, 1024)], ids=str)
@pytest.mark.parametrize("block", [128, 64, 32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_dequant_fp8_bitexact(shape, block, out_dtype, kind):
    _need("dequantize_fp8_block", kind)
    g = torch.Generator(device="cuda").manual_seed(3)
    qb = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    qb = torch.where((qb & 0x7F) == 0x7F, torch.zeros_like(qb), qb)                   # no NaN codes
    q = qb.view(torch.float8_e4m3fn)
    e = torch.randint(100, 150, (shape[0], shape[1] // block), dtype=torch.uint8, device="cuda", generator=g)
    s32 = F.ue8m0_decode(e.view(torch.float8_e8m0fnu)) * (1 + torch.rand(e.shape, device="cuda", generator=g))
    for scale in (s32, e.view(torch.float8_e8m0fnu)):
        with registry.use(dequantize_fp8_block=kind):
            y = dequantize_fp8_block(q, scale, block=block, out_dtype=out_dtype)
        sref = F.ue8m0_decode(scale) if scale.dtype == torch.float8_e8m0fnu else scale
        _eq(y, F.dequantize_fp8_block(q, sref, block, out_dtype), f"{kind} dequant {scale.dtype}")


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_cuda_graph_capture_and_replay(kind):
    for op in OPS:
        _need(op, kind)
    xs = [_data(512, 7168, 20 + i, device="cuda") for i in range(3)]
    xd = [_data(1, 7168, 30 + i, device="cuda") for i in range(3)]
    xm = [_data(16, 7168, 40 + i, device="cuda") for i in range(3)]
    static, static_d, static_m = xs[0].clone(), xd[0].clone(), xm[0].clone()

    def step():
        return (quantize_nvfp4(static, sf_layout="swizzled"), quantize_nvfp4(static_d),
                quantize_mxfp4(static), quantize_fp8_block(static, scale_fmt="ue8m0"), quantize_nvfp4(static_m))

    with registry.use({"*": kind}):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()   # warm-up: compile + module load outside capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    for a, b, c in zip(xs[1:], xd[1:], xm[1:]):
        static.copy_(a)
        static_d.copy_(b)
        static_m.copy_(c)
        graph.replay()
        torch.cuda.synchronize()
        r = F.quantize_nvfp4(a, sf_layout="swizzled")
        _eq(out[0].data, r.data, "graph nvfp4 data")
        _eq(out[0].scale, r.scale, "graph nvfp4 scale")
        _eq(out[0].global_scale.reshape(1), r.global_scale.reshape(1), "graph nvfp4 gs", nan_ok=True)
        rd = F.quantize_nvfp4(b)
        _eq(out[1].data, rd.data, "graph nvfp4 decode data")
        _eq(out[1].global_scale.reshape(1), rd.global_scale.reshape(1), "graph nvfp4 decode gs", nan_ok=True)
        md, ms = F.quantize_mxfp4(a)
        _eq(out[2][0], md, "graph mxfp4")
        _eq(out[2][1], ms, "graph mxfp4 scale")
        fq, fs = F.quantize_fp8_block(a, 128, "ue8m0")
        _eq(out[3][0], fq, "graph fp8")
        _eq(out[3][1], fs, "graph fp8 scale")
        rm = F.quantize_nvfp4(c)
        _eq(out[4].data, rm.data, "graph nvfp4 16-row data")
        _eq(out[4].scale, rm.scale, "graph nvfp4 16-row scale")


#: launch-geometry knobs per provider (tile size, CTAs per SM, register bound / software pipelining)
GEOMETRIES = {"dsl": [dict(qj=4), dict(ctas_per_sm=2), dict(ctas_per_sm=8, qj=4), dict(min_blocks=4),
                      dict(warps=4, qj=4, min_blocks=4), dict(min_blocks=3, ctas_per_sm=3, lut=0),
                      dict(pipe=2, qj=8, warps=4, min_blocks=4, ctas_per_sm=2), dict(pipe=4, qj=4, lut=1),
                      dict(qj=1, warps=4, dq_units=1, dq_warps=4), dict(qj=2, warps=4, lut=1)]}


@gpu
@pytest.mark.parametrize("kind,tuning", [(k, t) for k, ts in GEOMETRIES.items() for t in ts], ids=str)
def test_gpu_launch_geometry_never_changes_results(kind, tuning):
    """TUNING knobs only move work between threads: results stay bit-exact."""
    _need("quantize_nvfp4", kind)
    with _tuned(kind, **tuning):
        for shape in ((129, 7168), (1024, 4096), (3, 80), (2048, 7168)):
            x = _data(*shape, seed=7, specials=True, device="cuda")
            _check_nvfp4(x, "swizzled", kind=kind)
            _check_nvfp4(x, "linear", gdec=0.0021, kind=kind)
            if shape[1] % 32 == 0:                     # MXFP4 needs K % 32 == 0 (checked before launch)
                with registry.use(quantize_mxfp4=kind):
                    d, s = quantize_mxfp4(x)
                rd, rs = F.quantize_mxfp4(x)
                _eq(d, rd, "mxfp4 data")
                _eq(s, rs, "mxfp4 scale")
            if shape[1] % 128 == 0:
                _check_fp8(x, 128, "fp32", torch.float32, kind)
