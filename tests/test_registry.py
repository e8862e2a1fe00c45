"""Registry logic: lazy providers, Support reasons, selection order, overrides, records."""
from __future__ import annotations

import types

import pytest
import torch

from dsv4 import registry
from dsv4.layout import OpSpec, TensorSpec
from dsv4.registry import Op, Provider, ProviderUnavailableError, Support
from dsv4.target import Target

CPU = Target.of("cpu")
H200 = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
B200 = Target("cuda", "sm_100a", "NVIDIA B200", 148, 0)


class _P(Provider):
    calls = 0

    def run(self, problem, **args):
        type(self).calls += 1
        return self.kind


def _make(name, answers):
    """An op whose providers answer from ``answers[kind](problem, target) -> Support``."""
    op = Op(name, OpSpec(name, "test op", ()), kinds=tuple(answers))
    for kind, fn in answers.items():
        if fn is None:
            op._providers[kind] = Support.no(f"no {kind} provider (test)")
            continue
        cls = type(f"P_{kind}", (_P,), {"kind": kind, "supports": lambda self, p, t, fn=fn: fn(p, t)})
        op._providers[kind] = cls(op)
    return op


def test_support_requires_reason():
    assert Support.yes()
    assert not Support.no("x")
    with pytest.raises(ValueError):
        Support.no("")


def test_first_supporting_provider_wins_and_reasons_are_recorded():
    op = _make("t_sel", {
        "dsl": lambda p, t: Support.no("dsl: head_dim 512 exceeds WGMMA N=256"),
        "cuda": lambda p, t: Support.yes("sm_90a") if t.arch == "sm_90a" else Support.no(f"cuda: {t.arch}"),
        "torch": lambda p, t: Support.yes("reference"),
    })
    prov, ch = op.select({"d": 512}, H200)
    assert prov.kind == "cuda" and ch.kind == "cuda"
    assert ch.skipped == [("dsl", "dsl: head_dim 512 exceeds WGMMA N=256")]
    assert "exceeds WGMMA" in ch.explain() and "using cuda" in ch.explain()
    _, ch2 = op.select({"d": 512}, B200)   # arch-aware: no sm_100a kernel -> torch
    assert ch2.kind == "torch" and ("cuda", "cuda: sm_100a") in ch2.skipped
    assert op.last is ch2 and registry.last_choice("t_sel") is ch2


def test_forced_provider_never_falls_back(monkeypatch):
    op = _make("t_force", {"dsl": None, "cuda": lambda p, t: Support.no("cuda: no CUDA device"),
                           "torch": lambda p, t: Support.yes("reference")})
    with registry.use(t_force="cuda"):
        with pytest.raises(ProviderUnavailableError, match="no CUDA device"):
            op.select({}, CPU)
    monkeypatch.setenv("DSV4_OPS", "t_force=dsl")
    with pytest.raises(ProviderUnavailableError, match="no dsl provider"):
        op.select({}, CPU)
    monkeypatch.setenv("DSV4_OPS", "*=torch")
    _, ch = op.select({}, CPU)
    assert ch.kind == "torch" and ch.forced


def test_context_manager_beats_env_and_nests(monkeypatch):
    op = _make("t_nest", {"cuda": lambda p, t: Support.yes("c"), "torch": lambda p, t: Support.yes("t")})
    monkeypatch.setenv("DSV4_OPS", "t_nest=cuda")
    assert op.select({}, H200)[1].kind == "cuda"
    with registry.use({"*": "torch"}):
        assert op.select({}, H200)[1].kind == "torch"
        with registry.use(t_nest="cuda"):
            assert op.select({}, H200)[1].kind == "cuda"
        assert op.select({}, H200)[1].kind == "torch"


def test_bad_override_values_are_rejected(monkeypatch):
    op = _make("t_bad", {"torch": lambda p, t: Support.yes("t")})
    monkeypatch.setenv("DSV4_OPS", "t_bad=triton")
    with pytest.raises(ValueError, match="DSV4_OPS"):
        op.select({}, CPU)
    monkeypatch.setenv("DSV4_OPS", "t_bad")
    with pytest.raises(ValueError, match="op=provider"):
        op.select({}, CPU)
    with pytest.raises(ValueError):
        with registry.use(t_bad="fast"):
            pass
    monkeypatch.setenv("DSV4_OPS", "t_bda=torch")            # a misspelled op name is an error, not ignored
    with pytest.raises(ValueError, match="unknown op 't_bda'"):
        op.select({}, CPU)


def test_no_provider_at_all_lists_every_reason():
    op = _make("t_none", {"dsl": None, "cuda": lambda p, t: Support.no("cuda: nope")})
    with pytest.raises(ProviderUnavailableError, match="no dsl provider.*cuda: nope"):
        op.select({}, CPU)


def test_lazy_import_reports_missing_and_broken_modules(monkeypatch):
    import sys
    op = Op("t_lazy_xyz", OpSpec("t_lazy_xyz", "x", ()))
    s = op.provider("cuda")
    assert isinstance(s, Support) and not s and "does not exist" in s.reason
    broken = types.ModuleType("kernels_dsl.t_lazy_broken")
    broken.PROVIDERS = {}
    monkeypatch.setitem(sys.modules, "kernels_dsl.t_lazy_broken", broken)
    op2 = Op("t_lazy_other", OpSpec("t_lazy_other", "x", ()), module="t_lazy_broken")
    s2 = op2.provider("dsl")
    assert not s2 and "has no provider for t_lazy_other" in s2.reason


def test_selection_is_cached_per_problem():
    n = {"c": 0}

    def ans(p, t):
        n["c"] += 1
        return Support.yes("ok")
    op = _make("t_cache", {"torch": ans})
    for _ in range(5):
        op.select({"K": 128}, CPU)
    assert n["c"] == 1
    op.select({"K": 256}, CPU)
    assert n["c"] == 2


def test_dequant_fp4_is_registered_with_lazy_providers():
    op = registry.get_op("dequant_fp4")
    assert op.kinds == ("dsl", "cuda", "torch")
    rows = op.table(CPU)
    assert [r["provider"] for r in rows] == ["dsl", "cuda", "torch"]
    assert all(r["reason"] for r in rows)
    cuda_row = next(r for r in rows if r["provider"] == "cuda")
    if not torch.cuda.is_available():
        assert not cuda_row["ok"] and "no CUDA device" in cuda_row["reason"]
