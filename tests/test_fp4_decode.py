"""kernels_dsl/sm90/fp4.py: the shared E2M1 -> E4M3 / BF16 decode of the DSL kernels.

CPU: the bit models (the same instruction sequences as the DSL functions) against independent
oracles (ml_dtypes E4M3, torch bf16) on every nibble value and every exponent offset d.
GPU: the DSL device functions (Fp4DecodeProbe) bit for bit against the models.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels_dsl.sm90 import fp4

ml_dtypes = pytest.importorskip("ml_dtypes")

LEVELS = np.array(fp4.E2M1_LEVELS)


def _e2m1(n: int) -> float:
    v = LEVELS[n & 7]
    return -v if n & 8 else v


def _e4m3(b: int) -> float:
    return float(np.array([b], np.uint8).view(ml_dtypes.float8_e4m3fn)[0].astype(np.float32))


def _words(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    # every byte value appears in every byte position, plus random words
    w = [b * 0x01010101 for b in range(256)]
    return w + [r.getrandbits(32) for _ in range(n)]


def _bytes_of(o0: int, o1: int) -> list[int]:
    return [((o0 if j < 4 else o1) >> (8 * (j % 4))) & 0xFF for j in range(8)]


def test_prmt_model_matches_ptx_semantics():
    a, b = 0x33221100, 0x77665544
    assert fp4.model_prmt(a, b, 0x3210) == a
    assert fp4.model_prmt(a, b, 0x7654) == b
    assert fp4.model_prmt(a, b, 0x0123) == 0x00112233
    assert fp4.model_prmt(0x80, 0, 0x0008) & 0xFF == 0xFF          # msb replicate mode


@pytest.mark.parametrize("d", range(-12, 10))
def test_e2m1_to_e4m3_with_folded_exponent(d):
    lo, hi = fp4.model_e4m3_lut(d)
    exact_range = fp4.FOLD_EXACT_RANGE[0] <= d <= fp4.FOLD_EXACT_RANGE[1]
    for w in _words(64, d):
        for j, byte in enumerate(_bytes_of(*fp4.model_e2m1x8_to_e4m3x8(w, lo, hi))):
            n = (w >> (4 * j)) & 0xF
            want = _e2m1(n) * 2.0 ** d
            got = _e4m3(byte)
            if exact_range:
                assert got == want and np.signbit(got) == bool(n & 8), (hex(w), j, d, got, want)
            else:   # RNE + saturation: the nearest E4M3 value (ties to even), never NaN
                assert not np.isnan(got)
                ref = float(np.float32(min(abs(want), 448.0)).astype(ml_dtypes.float8_e4m3fn))
                assert abs(got) == ref, (hex(w), j, d, got, ref)


@pytest.mark.parametrize("d", range(fp4.SHIFT_RANGE[0], fp4.SHIFT_RANGE[1] + 1))
def test_shift_lut_equals_exact_lut_in_its_range(d):
    assert fp4.model_e4m3_lut_shift(d) == fp4.model_e4m3_lut(d)


def test_plain_lut_is_d0():
    assert (fp4.E4M3_LUT_LO, fp4.E4M3_LUT_HI) == fp4.model_e4m3_lut(0)


@pytest.mark.parametrize("d", range(-12, 10))
def test_sign_mask_decode_equals_spread_decode(d):
    """e2m1x8_to_e4m3x8_sm (signs by two sign-replicate prmt, 9 instructions) gives the bits of
    e2m1x8_to_e4m3x8 (signs by a byte spread, 12) for every LUT the kernels build (exact, shift),
    and each byte is the E4M3 value of its code (exact range)."""
    luts = [fp4.model_e4m3_lut(d)]
    if fp4.SHIFT_RANGE[0] <= d <= fp4.SHIFT_RANGE[1]:
        luts.append(fp4.model_e4m3_lut_shift(d))
    for lo, hi in luts:
        assert not (lo | hi) & 0x80808080                       # the sign-mask decode's precondition
        for w in _words(512, 100 + d):
            got = fp4.model_e2m1x8_to_e4m3x8_sm(w, lo, hi)
            assert got == fp4.model_e2m1x8_to_e4m3x8(w, lo, hi), (hex(w), d)
            if fp4.FOLD_EXACT_RANGE[0] <= d <= fp4.FOLD_EXACT_RANGE[1]:
                for j, byte in enumerate(_bytes_of(*got)):
                    n = (w >> (4 * j)) & 0xF
                    assert _e4m3(byte) == _e2m1(n) * 2.0 ** d and bool(byte & 0x80) == bool(n & 8), (hex(w), j, d)
    assert fp4.model_e2m1x8_to_e4m3x8_sm(0x89ABCDEF) == fp4.model_e2m1x8_to_e4m3x8(0x89ABCDEF)   # plain LUT


def test_e2m1_to_bf16_exact():
    for w in _words(256, 7):
        pairs = fp4.model_e2m1x8_to_bf16x8(w)
        halves = torch.tensor([(p >> (16 * h)) & 0xFFFF for p in pairs for h in (0, 1)], dtype=torch.int32)
        vals = halves.to(torch.int16).view(torch.bfloat16).float()
        for j in range(8):
            n = (w >> (4 * j)) & 0xF
            assert vals[j].item() == _e2m1(n) and bool(torch.signbit(vals[j])) == bool(n & 8), (hex(w), j)


def test_probe_reference_shape():
    rows = fp4.probe_reference([0x12345678, 0xFFFFFFFF], [0, -3])
    assert len(rows) == 2 and all(len(r) == 12 for r in rows)
    assert rows[0][11] == 127 << 23 and rows[1][11] == 124 << 23     # ue8m0(127 + d)


@pytest.mark.gpu
def test_dsl_decode_matches_models_on_gpu():
    words = _words(4096, 11)
    r = random.Random(5)
    ds = [r.randint(-12, 9) for _ in words]
    got = fp4.run_probe(words, ds)
    want = torch.tensor(fp4.probe_reference(words, ds), dtype=torch.int64)
    bad = (got != want).any(dim=1).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        cols = (got[i] != want[i]).nonzero().flatten().tolist()
        pytest.fail(f"{bad.numel()} of {len(words)} words differ; first: word {words[i]:#010x} d={ds[i]} "
                    f"columns {cols}: got {[hex(int(x)) for x in got[i]]} want {[hex(int(x)) for x in want[i]]}")
