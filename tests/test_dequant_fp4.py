"""dequant_fp4: reference vs an independent oracle, validation, registry, compile checks, GPU parity.

Oracle (independent of dsv4): ``ml_dtypes`` decodes E2M1 (float4_e2m1fn), UE8M0
(float8_e8m0fnu) and E4M3 (float8_e4m3fn); math in numpy fp32 in the contract's order
(mxfp4 ``v * s``, nvfp4 ``(v * s) * g``), one rounding (ml_dtypes bfloat16 is RNE).
Results are compared bit for bit; NaN positions must agree (NaN payloads are not compared:
they differ between numpy, torch CPU and the GPU).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from dsv4 import registry
from dsv4.layout import LayoutError
from dsv4.ops import dequant_fp4
from dsv4.reference.dequant_fp4 import dequant_fp4_ref
from dsv4.registry import ProviderUnavailableError

E8, E4 = torch.float8_e8m0fnu, torch.float8_e4m3fn
SF = {"mxfp4": 32, "nvfp4": 16}
OUTS = (torch.bfloat16, torch.float32)
_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


# ------------------------------------------------------------------------------ oracle
def oracle(data: np.ndarray, scale_bytes: np.ndarray, fmt: str, g: float | None, out_dtype):
    """Independent numpy/ml_dtypes dequantization; returns (output bits uint16/uint32, NaN mask)."""
    lo, hi = data & 0x0F, data >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(data.shape[0], -1)           # element 2i = low nibble
    vals = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    sdt = ml_dtypes.float8_e8m0fnu if fmt == "mxfp4" else ml_dtypes.float8_e4m3fn
    s = scale_bytes.astype(np.uint8).view(sdt).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):   # 6 * 2^127 overflows to inf, as in fp32
        out = vals * np.repeat(s, SF[fmt], axis=1)
        if fmt == "nvfp4":
            out = out * np.float32(g)
    if out_dtype == torch.bfloat16:
        return out.astype(ml_dtypes.bfloat16).view(np.uint16), np.isnan(out)
    return out.view(np.uint32), np.isnan(out)


def assert_bits_equal(got: torch.Tensor, want_bits: np.ndarray, want_nan: np.ndarray):
    got = got.cpu()
    nan = torch.isnan(got.float()).numpy()
    np.testing.assert_array_equal(nan, want_nan, err_msg="NaN positions differ")
    gb = got.view(_BITS[got.dtype]).numpy().view(want_bits.dtype)
    bad = (gb != want_bits) & ~want_nan
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{bad.sum()} mismatching elements; first at {i}: got {gb[i]:#x}, want {want_bits[i]:#x}")


def make_inputs(M: int, K: int, fmt: str, *, gen: torch.Generator, scale_bytes=None, device="cpu",
                nan_scales: bool = True):
    data = torch.randint(0, 256, (M, K // 2), dtype=torch.uint8, generator=gen)
    ns = K // SF[fmt]
    if scale_bytes is None:
        if fmt == "mxfp4":   # the whole UE8M0 range, incl. subnormal 2^-127 (0), 2^-126 (1), 2^127 (254)
            sb = torch.randint(0, 255, (M, ns), dtype=torch.uint8, generator=gen)
            sb.view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)[: sb.numel()]
            if nan_scales and sb.numel() > 8:
                sb.view(-1)[5] = 0xFF
        else:                # every E4M3 byte incl. subnormals, +-0, and (optionally) NaN 0x7F / 0xFF
            sb = torch.randint(0, 256, (M, ns), dtype=torch.uint8, generator=gen)
            if not nan_scales:
                sb[(sb & 0x7F) == 0x7F] = 0x7E
    else:
        sb = scale_bytes
    scale = sb.view(E8 if fmt == "mxfp4" else E4)
    g = torch.tensor([0.3721], dtype=torch.float32) if fmt == "nvfp4" else None
    if device != "cpu":
        data, scale = data.to(device), scale.to(device)
        g = g.to(device) if g is not None else None
    return data, scale, g


# ------------------------------------------------------------------------------ CPU: reference vs oracle
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("out_dtype", OUTS)
def test_reference_all_bytes_all_scales(fmt, out_dtype):
    """Every data byte (all nibble pairs) against every scale byte (incl. NaN and subnormals)."""
    sfb = SF[fmt]
    # row r: scale byte r; data: all 256 bytes repeated to fill K (K = 512 -> 256 bytes per row)
    K = 512
    data = torch.arange(256, dtype=torch.uint8).repeat(256, 1)                     # [256, 256]
    sb = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, K // sfb)          # [256, K/SF]
    scale = sb.view(E8 if fmt == "mxfp4" else E4)
    g = torch.tensor([1.0], dtype=torch.float32) if fmt == "nvfp4" else None
    got = dequant_fp4_ref(data, scale, fmt, g, out_dtype)
    want, nan = oracle(data.numpy(), sb.numpy(), fmt, 1.0 if g is not None else None, out_dtype)
    assert_bits_equal(got, want, nan)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("out_dtype", OUTS)
@pytest.mark.parametrize("M,K", [(1, 32), (7, 96), (64, 1024), (33, 7168)])
def test_reference_random_matches_oracle(fmt, out_dtype, M, K):
    gen = torch.Generator().manual_seed(M * 131 + K)
    data, scale, g = make_inputs(M, K, fmt, gen=gen)
    got = dequant_fp4(data, scale, fmt=fmt, global_scale=g, out_dtype=out_dtype)
    want, nan = oracle(data.numpy(), scale.view(torch.uint8).numpy(), fmt,
                       float(g) if g is not None else None, out_dtype)
    assert_bits_equal(got, want, nan)


def test_subnormal_ue8m0_scales_are_not_flushed():
    """UE8M0 byte 0 is 2^-127 (an fp32 subnormal) and byte 1 is 2^-126: results must be exact."""
    data = torch.tensor([[0x21, 0x77] + [0] * 14], dtype=torch.uint8)   # 0.5, 1.0, 6.0, 6.0 (low, high nibbles)
    for b, sc in ((0, 2.0 ** -127), (1, 2.0 ** -126)):
        scale = torch.tensor([[b]], dtype=torch.uint8).view(E8)
        out = dequant_fp4(data, scale, out_dtype=torch.float32)
        exp = torch.tensor([0.5, 1.0, 6.0, 6.0], dtype=torch.float64) * sc
        assert torch.equal(out[0, :4].double(), exp), (b, out[0, :4])
        assert out[0, 0] != 0


def test_nan_scale_bytes_give_nan_blocks():
    data = torch.full((2, 32), 0x11, dtype=torch.uint8)                  # all 0.5
    mx = dequant_fp4(data, torch.tensor([[0xFF, 127], [127, 0xFF]], dtype=torch.uint8).view(E8))
    assert torch.isnan(mx[0, :32]).all() and not torch.isnan(mx[0, 32:]).any()
    assert torch.isnan(mx[1, 32:]).all() and not torch.isnan(mx[1, :32]).any()
    nv = dequant_fp4(data, torch.tensor([[0x7F, 0x38, 0xFF, 0x38]] * 2, dtype=torch.uint8).view(E4), fmt="nvfp4",
                     global_scale=torch.ones(1))
    assert torch.isnan(nv[:, :16]).all() and torch.isnan(nv[:, 32:48]).all()
    assert (nv[:, 16:32] == 0.5).all() and (nv[:, 48:] == 0.5).all()


@pytest.mark.parametrize("g", [float("inf"), float("-inf"), 0.0, -0.0, -1.5])
def test_bad_cpu_global_scale_raises_value_error(g):
    """Issue 19 item 4: the rule of quantize_nvfp4 (finite, > 0), checked where it is free."""
    d, s, _ = _ok("nvfp4")
    with pytest.raises(ValueError, match="'global_scale' must be finite and > 0"):
        dequant_fp4(d, s, fmt="nvfp4", global_scale=torch.tensor([g]))


def test_nan_global_scale_decodes_every_element_to_nan():
    """NaN global scale = the encoding of a non-finite tensor (issue 19 item 13): all NaN."""
    data = torch.full((2, 32), 0x21, dtype=torch.uint8)
    s = torch.full((2, 4), 0x38, dtype=torch.uint8).view(E4)
    for out_dtype in OUTS:
        out = dequant_fp4(data, s, fmt="nvfp4", global_scale=torch.tensor([float("nan")]), out_dtype=out_dtype)
        assert torch.isnan(out.float()).all()


def test_e2m1_is_a_level_lookup_not_nibble_arithmetic():
    """Seed 000: nibble index i means E2M1_LEVELS[i] (1 -> 0.5, 5 -> 3.0, 7 -> 6.0), sign in bit 3."""
    data = torch.tensor([[0x10 * ((2 * i + 1) % 16) + (2 * i) % 16 for i in range(8)] + [0] * 8], dtype=torch.uint8)
    out = dequant_fp4(data, torch.tensor([[127]], dtype=torch.uint8).view(E8), out_dtype=torch.float32)
    levels = [0, .5, 1, 1.5, 2, 3, 4, 6]
    want = [levels[c & 7] * (-1 if c & 8 else 1) for c in range(16)]
    assert out[0, :16].tolist() == want
    assert torch.signbit(out[0, 8])                                          # nibble 0x8 is -0.0


# ------------------------------------------------------------------------------ CPU: the kernels' LUT algorithm
def _prmt(a, b, sel):
    """numpy model of PTX prmt.b32 (default mode): result byte i = pool{b:a}[sel nibble i & 7] (no sign mode)."""
    a, b, sel = (np.asarray(x, dtype=np.uint64) for x in (a, b, sel))
    pool = (b << np.uint64(32)) | a
    r = np.zeros(np.broadcast(pool, sel).shape, dtype=np.uint64)
    for i in range(4):
        s = (np.asarray(sel, dtype=np.uint64) >> np.uint64(4 * i)) & np.uint64(0xF)
        assert not (s & np.uint64(8)).any(), "selector uses sign-replicate mode"
        byte = (pool >> (np.uint64(8) * s)) & np.uint64(0xFF)
        r |= byte << np.uint64(8 * i)
    return r.astype(np.uint32)


def test_prmt_lut_algorithm_decodes_every_word():
    """The DSL kernel's decoder (kernels_dsl/sm90/fp4.py e2m1x8_to_bf16x8 == common.cuh's) prmt LUT +
    sign moves, run in numpy on all byte patterns."""
    from types import SimpleNamespace

    from kernels_dsl.sm90 import fp4
    k = SimpleNamespace(_E2M1_LO_A=fp4._BF16_LO_A, _E2M1_LO_B=fp4._BF16_LO_B, _E2M1_HI_A=fp4._BF16_HI_A,
                        _E2M1_HI_B=fp4._BF16_HI_B)
    rng = np.random.default_rng(0)
    words = np.concatenate([np.arange(256, dtype=np.uint32) * np.uint32(0x01010101),   # every byte, replicated
                            rng.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)])
    idx = words & np.uint32(0x77777777)
    lo_a = _prmt(k._E2M1_LO_A, k._E2M1_LO_B, idx)
    hi_a = _prmt(k._E2M1_HI_A, k._E2M1_HI_B, idx)
    lo_b = _prmt(k._E2M1_LO_A, k._E2M1_LO_B, idx >> np.uint32(16))
    hi_b = _prmt(k._E2M1_HI_A, k._E2M1_HI_B, idx >> np.uint32(16))
    sg = (words & np.uint32(0x88888888)).astype(np.uint64)
    M15, M31 = np.uint64(0x8000), np.uint64(0x80000000)
    u = lambda x: x.astype(np.uint64)  # noqa: E731
    p = [u(_prmt(lo_a, hi_a, 0x5140)) | ((sg << np.uint64(12)) & M15) | ((sg << np.uint64(24)) & M31),
         u(_prmt(lo_a, hi_a, 0x7362)) | ((sg << np.uint64(4)) & M15) | ((sg << np.uint64(16)) & M31),
         u(_prmt(lo_b, hi_b, 0x5140)) | ((sg >> np.uint64(4)) & M15) | ((sg << np.uint64(8)) & M31),
         u(_prmt(lo_b, hi_b, 0x7362)) | ((sg >> np.uint64(12)) & M15) | (sg & M31)]
    bf16 = np.stack([[(x & np.uint64(0xFFFF)), (x >> np.uint64(16)) & np.uint64(0xFFFF)] for x in p], 0)  # [4, 2, n]
    got = bf16.transpose(2, 0, 1).reshape(-1, 8).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    nib = (words[:, None] >> (np.arange(8, dtype=np.uint32) * np.uint32(4))) & np.uint32(0xF)
    want = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # incl. -0.0


# ------------------------------------------------------------------------------ CPU: validation
def _ok(fmt="mxfp4", M=4, K=64):
    data = torch.zeros(M, K // 2, dtype=torch.uint8)
    scale = torch.zeros(M, K // SF[fmt], dtype=torch.uint8).view(E8 if fmt == "mxfp4" else E4)
    return data, scale, (torch.ones(1) if fmt == "nvfp4" else None)


@pytest.mark.parametrize("case,arg", [
    ("data_dtype", "data"), ("data_rank", "data"), ("data_noncontig", "data"),
    ("scale_dtype_u8", "scale"), ("scale_wrong_fp8", "scale"), ("scale_shape", "scale"),
    ("scale_noncontig", "scale"), ("scale_rows", "scale"),
    ("global_missing", "global_scale"), ("global_extra", "global_scale"), ("global_shape", "global_scale"),
    ("global_dtype", "global_scale"),
])
def test_validation_names_the_argument(case, arg):
    fmt = "nvfp4" if case in ("global_missing", "global_shape", "global_dtype", "scale_noncontig") else "mxfp4"
    d, s, g = _ok(fmt)
    if case == "data_dtype":
        d = d.to(torch.int8)
    elif case == "data_rank":
        d = d.view(-1)
    elif case == "data_noncontig":
        d = torch.zeros(64, 4, dtype=torch.uint8).t()
        s = torch.zeros(4, 2, dtype=torch.uint8).view(E8)
    elif case == "scale_dtype_u8":
        s = s.view(torch.uint8)
    elif case == "scale_wrong_fp8":
        s = s.view(torch.uint8).view(E4)
    elif case == "scale_shape":
        s = torch.zeros(4, 4, dtype=torch.uint8).view(E8)
    elif case == "scale_noncontig":
        s = torch.zeros(4, 8, dtype=torch.uint8)[:, ::2].view(E4)
    elif case == "scale_rows":
        s = torch.zeros(5, 2, dtype=torch.uint8).view(E8)
    elif case == "global_missing":
        g = None
    elif case == "global_extra":
        g = torch.ones(1)
    elif case == "global_shape":
        g = torch.ones(2)
    elif case == "global_dtype":
        g = torch.ones(1, dtype=torch.float64)
    with pytest.raises(LayoutError, match=f"'{arg}'"):
        dequant_fp4(d, s, fmt=fmt, global_scale=g)


@pytest.mark.parametrize("fmt,Kp", [("mxfp4", 8), ("mxfp4", 24), ("nvfp4", 12)])
def test_k_not_multiple_of_sf_is_rejected(fmt, Kp):
    d = torch.zeros(4, Kp, dtype=torch.uint8)
    s = torch.zeros(4, 2 * Kp // SF[fmt], dtype=torch.uint8).view(E8 if fmt == "mxfp4" else E4)
    with pytest.raises(LayoutError, match="multiple of the scale block SF"):
        dequant_fp4(d, s, fmt=fmt, global_scale=torch.ones(1) if fmt == "nvfp4" else None)


def test_bad_params_raise_value_error():
    d, s, _ = _ok()
    with pytest.raises(ValueError, match="fmt"):
        dequant_fp4(d, s, fmt="fp4")
    with pytest.raises(ValueError, match="out_dtype"):
        dequant_fp4(d, s, out_dtype=torch.float16)


# ------------------------------------------------------------------------------ CPU: registry
def test_env_override_to_torch_and_last_choice(monkeypatch):
    monkeypatch.setenv("DSV4_OPS", "dequant_fp4=torch")
    d, s, _ = _ok()
    dequant_fp4(d, s)
    ch = registry.last_choice("dequant_fp4")
    assert ch.kind == "torch" and ch.forced


def test_default_choice_on_cpu_is_torch_with_reasons(monkeypatch):
    monkeypatch.delenv("DSV4_OPS", raising=False)
    d, s, _ = _ok()
    dequant_fp4(d, s)
    ch = registry.last_choice("dequant_fp4")
    assert ch.kind == "torch" and not ch.forced
    skipped = dict(ch.skipped)
    assert set(skipped) == {"dsl", "cuda"} and all(skipped.values())


@pytest.mark.parametrize("kind", ["cuda", "dsl"])
def test_forcing_a_gpu_provider_on_cpu_raises_with_reason(kind, monkeypatch):
    """dsl: not on a CUDA device; cuda: there is no cuda provider (kernels_cuda/dequant_fp4.cu was
    deleted once the DSL kernel beat it on the H200, docs/benchmarks.md)."""
    monkeypatch.delenv("DSV4_OPS", raising=False)
    d, s, _ = _ok()
    with registry.use(dequant_fp4=kind):
        with pytest.raises(ProviderUnavailableError, match=rf"{kind}.*(CUDA|cuda|not importable|does not exist)"):
            dequant_fp4(d, s)
    monkeypatch.setenv("DSV4_OPS", f"dequant_fp4={kind}")
    with pytest.raises(ProviderUnavailableError, match=kind):
        dequant_fp4(d, s)


def test_dsl_provider_support_reasons():
    from dsv4.target import Target
    from kernels_dsl.dequant_fp4 import DslDequantFp4
    p = DslDequantFp4(registry.get_op("dequant_fp4"))
    h = Target("cuda", "sm_90a", "H200", 132, 0)
    ok = {"fmt": "nvfp4", "out_dtype": "bfloat16", "K": 7168, "device": "cuda"}
    assert p.supports(ok, h)
    assert "multiple of 32" in p.supports(dict(ok, K=48), h).reason
    b200 = p.supports(ok, Target("cuda", "sm_100a", "B200", 148, 0))
    assert not b200 and "sm_90a" in b200.reason and "sm_100a" in b200.reason
    assert not p.supports(ok, Target.of("cpu"))


def test_there_is_no_cuda_provider():
    """The CUDA kernel was deleted (the DSL provider beats it at every measured size, 2026-12-01)."""
    assert registry.get_op("dequant_fp4").provider("cuda").reason.startswith("no cuda provider")


# ------------------------------------------------------------------------------ GPU: providers agree bit-exactly
GPU_SHAPES = [(8192, 7168), (1, 32), (3, 96), (257, 4160), (1000, 2048)]


def _providers_on_gpu():
    op = registry.get_op("dequant_fp4")
    from dsv4.target import Target
    t = Target.of("cuda")
    return [k for k in ("dsl", "cuda", "torch")
            if op.check(k, {"fmt": "mxfp4", "out_dtype": "bfloat16", "K": 64, "device": "cuda"}, t)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("out_dtype", OUTS)
@pytest.mark.parametrize("M,K", GPU_SHAPES)
def test_gpu_providers_bit_exact(fmt, out_dtype, M, K):
    kinds = _providers_on_gpu()
    assert {"dsl", "torch"} <= set(kinds), f"providers available on this GPU: {kinds}"
    gen = torch.Generator().manual_seed(M + 7 * K)
    d, s, g = make_inputs(M, K, fmt, gen=gen, device="cuda")
    ref_cpu = dequant_fp4_ref(d.cpu(), s.cpu(), fmt, g.cpu() if g is not None else None, out_dtype)
    want_nan = torch.isnan(ref_cpu.float())
    want_bits = ref_cpu.view(_BITS[out_dtype])
    for kind in kinds:
        with registry.use(dequant_fp4=kind):
            out = dequant_fp4(d, s, fmt=fmt, global_scale=g, out_dtype=out_dtype)
        assert registry.last_choice("dequant_fp4").kind == kind
        torch.cuda.synchronize()
        out = out.cpu()
        assert torch.equal(torch.isnan(out.float()), want_nan), f"{kind}: NaN positions differ"
        fin = ~want_nan
        assert torch.equal(out.view(_BITS[out_dtype])[fin], want_bits[fin]), \
            f"{kind}: bits differ at {(out.view(_BITS[out_dtype]) != want_bits)[fin].sum()} finite elements"


@pytest.mark.gpu
def test_gpu_dsl_is_chosen_and_runs_without_nan_scales():
    """Default selection on the H200 and exact torch.equal of bit views on NaN-free data."""
    kinds = _providers_on_gpu()
    gen = torch.Generator().manual_seed(1)
    for fmt in ("mxfp4", "nvfp4"):
        d, s, g = make_inputs(2048, 7168, fmt, gen=gen, device="cuda", nan_scales=False)
        ref = dequant_fp4_ref(d, s, fmt, g, torch.bfloat16)
        out = dequant_fp4(d, s, fmt=fmt, global_scale=g)
        ch = registry.last_choice("dequant_fp4")
        assert ch.kind == kinds[0], ch.explain()
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
def test_gpu_k_not_multiple_of_32_uses_torch_with_reason():
    gen = torch.Generator().manual_seed(2)
    d, s, g = make_inputs(16, 48, "nvfp4", gen=gen, device="cuda")
    out = dequant_fp4(d, s, fmt="nvfp4", global_scale=g)
    ch = registry.last_choice("dequant_fp4")
    assert ch.kind == "torch" and any("multiple of 32" in r for _, r in ch.skipped), ch.explain()
    want = dequant_fp4_ref(d.cpu(), s.cpu(), "nvfp4", g.cpu(), torch.bfloat16)
    assert torch.equal(torch.isnan(out.cpu().float()), torch.isnan(want.float()))


@pytest.mark.gpu
def test_gpu_misaligned_data_is_rejected():
    buf = torch.zeros(4 * 32 + 1, dtype=torch.uint8, device="cuda")
    d = buf[1:].view(4, 32)
    s = torch.zeros(4, 2, dtype=torch.uint8, device="cuda").view(E8)
    with pytest.raises(LayoutError, match="'data'.*aligned"):
        dequant_fp4(d, s)
