"""Registry logic: lazy providers, Support reasons, selection order, overrides, records."""
from __future__ import annotations

import contextlib
import types
from typing import Optional

import pytest
import torch

from dsv4 import registry
from dsv4.layout import OpSpec
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


_TOY: list[str] = []


@pytest.fixture(autouse=True)
def _unregister_toy_ops():
    """Toy ops are registered (registry.use / DSV4_OPS accept registered names only) for one test."""
    yield
    while _TOY:
        registry._REGISTRY.pop(_TOY.pop(), None)


def _make(name, answers):
    """An op whose providers answer from ``answers[kind](problem, target) -> Support`` (registered
    for the current test only)."""
    op = registry.register(Op(name, OpSpec(name, "test op", ()), kinds=tuple(answers)))
    _TOY.append(name)
    for kind, fn in answers.items():
        if fn is None:
            op._providers[kind] = Support.no(f"no {kind} provider (test)", absent=True)
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


def test_dequant_fp4_is_registered_with_lazy_providers():
    """The CUDA provider was deleted (the DSL kernel beats it, job mem2-02): its row says so."""
    op = registry.get_op("dequant_fp4")
    assert op.kinds == ("dsl", "cuda", "torch")
    rows = op.table(CPU)
    assert [r["provider"] for r in rows] == ["dsl", "cuda", "torch"]
    assert all(r["reason"] for r in rows)
    cuda_row = next(r for r in rows if r["provider"] == "cuda")
    assert not cuda_row["ok"] and cuda_row["reason"].startswith("no cuda provider")


# ----------------------------------------------------------------------------- issue 19 item 5
def test_use_rejects_an_unknown_op_name_listing_the_known_ones():
    """``registry.use(dequnt_fp4="torch")`` (a typo) used to be accepted and do nothing."""
    with pytest.raises(ValueError, match=r"unknown op 'dequnt_fp4'.*dequant_fp4"):
        with registry.use(dequnt_fp4="torch"):
            pass
    with pytest.raises(ValueError, match="unknown op 'nosuchop'"):
        with registry.use({"nosuchop": "torch", "dequant_fp4": "torch"}):
            pass
    with registry.use({"*": "torch", "dequant_fp4": "torch"}):      # '*' and real names are fine
        pass


def test_env_override_with_an_unknown_op_raises_at_dispatch(monkeypatch):
    from dsv4.ops import dequant_fp4
    monkeypatch.setenv("DSV4_OPS", "nosuchop=torch")
    d = torch.zeros(2, 16, dtype=torch.uint8)
    s = torch.full((2, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="DSV4_OPS: unknown op 'nosuchop'.*dequant_fp4"):
        dequant_fp4(d, s)


# ----------------------------------------------------------------------------- issue 19 item 8
def test_summary_states_plainly_which_provider_ran_and_why():
    op = _make("t_sum", {"dsl": None, "cuda": lambda p, t: Support.no("cuda: no CUDA device"),
                         "torch": lambda p, t: Support.yes("reference, any device")})
    _, ch = op.select({}, CPU)
    assert ch.absent == ("dsl",)
    s = ch.summary()
    assert s == "torch: reference, any device; no dsl kernel for this op; cuda not used: no CUDA device", s
    assert "does not exist" not in s and "skipped" not in s
    op2 = _make("t_sum2", {"cuda": lambda p, t: Support.yes("sm_90a, k <= 2048"), "torch": lambda p, t: Support.yes("r")})
    assert op2.select({}, H200)[1].summary() == "cuda: sm_90a, k <= 2048"
    with registry.use(t_sum2="torch"):
        assert op2.select({}, H200)[1].summary() == "torch (forced by DSV4_OPS / registry.use): r"


def test_real_op_marks_missing_kinds_as_not_implemented():
    rows = registry.get_op("topk").table(CPU)
    dsl = next(r for r in rows if r["provider"] == "dsl")
    assert dsl["implemented"] is False and not dsl["ok"]
    torch_row = next(r for r in rows if r["provider"] == "torch")
    assert torch_row["chosen"] and "using torch" in torch_row["explain"]


# ----------------------------------------------------------------------------- issue 17 items 1, 3
def test_last_choice_explain_shows_the_recorded_config():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        tile: int = 128
        stages: int = 4

    class P(Provider):
        kind = "torch"

        def supports(self, problem, target):
            return Support.yes("reference")

        def run(self, problem, **args):
            self.op.record_config(Cfg(tile=problem["K"] // 2))
            return 1

    op = registry.register(Op("t_cfg", OpSpec("t_cfg", "x", ()), kinds=("torch",)))
    _TOY.append("t_cfg")
    op._providers["torch"] = P(op)
    assert op.dispatch({"K": 256}, CPU) == 1
    ch = registry.last_choice("t_cfg")
    assert ch.config == Cfg(tile=128) and "config: " in ch.explain() and "tile=128" in ch.explain()
    op.dispatch({"K": 64}, CPU)
    assert registry.last_choice("t_cfg").config == Cfg(tile=32)


def test_selection_is_cached_per_problem_and_clear_cache_redecides():
    n = {"c": 0}

    def ans(p, t):
        n["c"] += 1
        return Support.yes("ok")
    op = _make("t_hot", {"torch": ans})
    p1, c1 = op.select({"K": 1, "fmt": "x"}, CPU)
    for _ in range(4):
        p2, c2 = op.select({"K": 1, "fmt": "x"}, CPU)
    assert p1 is p2 and c1 is c2 and n["c"] == 1
    op.select({"K": 2, "fmt": "x"}, CPU)          # another problem: decided once more
    op.select({"K": 2, "fmt": "x"}, CPU)
    assert n["c"] == 2
    n["c"] = 1
    assert c1.problem == {"K": 1, "fmt": "x"} and c1.target is CPU
    op.select({"K": [1, 2]}, CPU)                 # unhashable problem values still work
    assert n["c"] == 2
    op.clear_cache()                              # what supports() depends on changed: re-decided
    op.select({"K": 1, "fmt": "x"}, CPU)
    assert n["c"] == 3


def test_provider_config_is_explained_without_a_recorded_one():
    """A provider's config(problem, target) (its heuristic's frozen dataclass) is what last_choice and
    the dsv4 ops table explain when run() recorded none; a failing config() is shown, never raised."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        stages: int

    class P(Provider):
        kind = "torch"

        def supports(self, problem, target):
            return Support.yes("reference")

        def config(self, problem, target):
            if problem["K"] < 0:
                raise ValueError("negative K")
            return Cfg(stages=problem["K"] // 64)

        def run(self, problem, **args):
            return 2

    op = registry.register(Op("t_cfg2", OpSpec("t_cfg2", "x", ()), kinds=("torch",),
                              example_problem=lambda t: {"K": 512}))
    _TOY.append("t_cfg2")
    op._providers["torch"] = P(op)
    assert op.dispatch({"K": 256}, CPU) == 2
    ch = registry.last_choice("t_cfg2")
    assert ch.config == Cfg(4) and "config: " in ch.explain() and "stages=4" in ch.explain()
    row = op.table(CPU)[0]
    assert row["chosen"] and "stages=8" in row["explain"]
    op.dispatch({"K": -1}, CPU)
    assert "config not available: ValueError: negative K" in registry.last_choice("t_cfg2").explain()


def test_target_of_is_memoized_per_device():
    assert Target.of("cpu") is Target.of(torch.device("cpu")) is Target.of(torch.zeros(1).device)


def test_custom_op_defines_a_lean_torch_library_op():
    """registry.custom_op: same schema inference as torch.library.custom_op, fake kernel for
    tracing, mutation declared in the schema, eager call straight to the function."""
    @registry.custom_op("dsv4test::scale_add", mutates_args=("acc",))
    def scale_add(acc: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], k: int) -> torch.Tensor:
        acc.add_(x * k)
        return x * 2 if w is None else x * w

    @scale_add.register_fake
    def _(acc, x, w, k):
        return torch.empty_like(x)

    schema = str(torch.ops.dsv4test.scale_add.default._schema)
    assert "Tensor(a0!) acc" in schema and "Tensor? w" in schema and ("SymInt k" in schema or "int k" in schema)
    acc, x = torch.zeros(3), torch.arange(3.0)
    out = torch.ops.dsv4test.scale_add(acc, x, None, 3)
    assert torch.equal(out, x * 2) and torch.equal(acc, x * 3)
    torch.library.opcheck(torch.ops.dsv4test.scale_add.default, (torch.zeros(3), x, None, 3),
                          test_utils=("test_schema", "test_faketensor"))
    f = torch.compile(lambda a, b: torch.ops.dsv4test.scale_add(a, b, None, 2) + 1, backend="aot_eager",
                      fullgraph=True)
    acc2 = torch.zeros(3)
    assert torch.equal(f(acc2, x), x * 2 + 1) and torch.equal(acc2, x * 2)


_DIRECT_CALLS: list[str] = []


@registry.custom_op("dsv4test::twice", mutates_args=())
def _twice(x: torch.Tensor, w: Optional[torch.Tensor], k: int) -> torch.Tensor:
    _DIRECT_CALLS.append("kernel")
    return x * (2 * k) if w is None else x * w


@_twice.register_fake
def _(x, w, k):
    _DIRECT_CALLS.append("fake")
    return torch.empty_like(x)


def _count_dispatcher(monkeypatch, handle) -> list:
    seen = []
    packet = handle._packet

    def counting(*a, **k):
        seen.append(1)
        return packet(*a, **k)
    monkeypatch.setattr(handle, "_packet", counting)
    return seen


def test_custom_op_eager_call_skips_the_dispatcher_and_matches_it(monkeypatch):
    """Issue 17: in plain eager mode the handle calls the kernel directly (no dispatcher round
    trip); the result is the dispatcher's; ``EAGER_DIRECT = False`` restores the dispatcher call."""
    seen = _count_dispatcher(monkeypatch, _twice)
    x = torch.arange(4.0)
    _DIRECT_CALLS.clear()
    assert torch.equal(_twice(x, None, 3), torch.ops.dsv4test.twice(x, None, 3)) and not seen
    assert _DIRECT_CALLS == ["kernel", "kernel"]
    w = torch.nn.Parameter(torch.ones(4))                          # a Parameter is a plain tensor here
    assert torch.equal(_twice(x, w, 1), x) and not seen
    monkeypatch.setattr(registry, "EAGER_DIRECT", False)
    assert torch.equal(_twice(x, None, 3), x * 6) and len(seen) == 1
    monkeypatch.setattr(registry, "EAGER_DIRECT", True)
    assert torch.equal(_twice(x, None, k=3), x * 6) and len(seen) == 2     # kwargs: the dispatcher


def test_custom_op_goes_through_the_dispatcher_when_tracing_or_transforming(monkeypatch):
    """FakeTensorMode, a FakeTensor outside its mode, meta tensors, make_fx, torch.compile, vmap and
    the profiler all see the op itself (fake kernel / graph node / profiler event)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    seen = _count_dispatcher(monkeypatch, _twice)
    x = torch.arange(4.0)
    _DIRECT_CALLS.clear()
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        assert _twice(fx, None, 2).shape == (4,)
    assert _twice(fx, None, 2).shape == (4,)                       # a FakeTensor after its mode ended
    assert _twice(x.to("meta"), None, 2).device.type == "meta"
    assert _DIRECT_CALLS == ["fake"] * 3 and len(seen) == 3
    g = make_fx(lambda a: _twice(a, None, 2) + 1)(x)
    assert any("dsv4test.twice" in str(n.target) for n in g.graph.nodes)
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes)
        return gm
    f = torch.compile(lambda a: _twice(a, None, 2) + 1, backend=backend, fullgraph=True)
    assert torch.equal(f(x), x * 4 + 1) and any("dsv4test.twice" in t for t in targets)
    n = len(seen)
    with torch.profiler.profile() as prof:
        _twice(x, None, 1)
    assert len(seen) == n + 1 and any("dsv4test::twice" in e.name for e in prof.events())
    with torch.device("cpu"):                                      # a torch function mode
        _twice(x, None, 1)
    assert len(seen) == n + 2
    with contextlib.suppress(Exception):     # no batching rule: the dispatcher says so; what matters is who ran
        torch.vmap(lambda a: _twice(a, None, 1))(x.reshape(2, 2))
    assert len(seen) == n + 3


def test_public_op_eager_direct_equals_the_dispatcher_path(monkeypatch):
    from dsv4.ops import dequant_fp4
    data = torch.randint(0, 256, (4, 64), dtype=torch.uint8)
    scale = torch.randint(110, 130, (4, 4), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    direct = dequant_fp4(data, scale, out_dtype=torch.float32)
    monkeypatch.setattr(registry, "EAGER_DIRECT", False)
    assert torch.equal(direct, dequant_fp4(data, scale, out_dtype=torch.float32))


def test_use_overrides_are_per_thread():
    import threading
    _make("t_thr", {"dsl": lambda p, t: Support.yes("d"), "torch": lambda p, t: Support.yes("t")})
    seen = {}

    def other():
        seen["other"] = registry._forced_kind("t_thr")
    with registry.use(t_thr="torch"):
        th = threading.Thread(target=other)
        th.start()
        th.join()
        seen["here"] = registry._forced_kind("t_thr")
    assert seen == {"other": None, "here": "torch"} and registry._forced_kind("t_thr") is None


def test_selection_cache_is_per_target_object_and_bounded():
    op = _make("t_tgt", {"torch": lambda p, t: Support.yes("any")})
    a = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)
    b = Target("cuda", "sm_90a", "NVIDIA H200", 132, 0)            # equal, another object
    _, ca = op.select({"K": 1}, a)
    assert op.select({"K": 1}, a)[1] is ca and op.select({"K": 1}, b)[1] is not ca
    assert op.select({"K": 1}, b)[1].target is b
    for _ in range(100):                                           # Targets built per call do not pile up
        op.select({"K": 1}, Target("cuda", "sm_90a", "NVIDIA H200", 132, 0))
    assert len(op._by_target) <= 64


def test_every_op_problem_is_a_frozen_dataclass():
    """Issue 17 item 3: each op's problem is a frozen dataclass (hashable, the selection-cache key),
    not a dict: every registered op's example problem (what ``dsv4 ops`` shows) is a Problem."""
    import dataclasses
    for op in registry.all_ops():
        if op.name in _TOY or op.example_problem is None:
            continue
        p = op.example_problem(CPU)
        assert isinstance(p, registry.Problem) and dataclasses.is_dataclass(p), (op.name, type(p))
        assert type(p).__dataclass_params__.frozen and hash(p) == hash(dataclasses.replace(p)), op.name
        assert dict(p) == {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}, op.name


def test_kernel_configs_are_frozen_dataclasses_from_their_heuristics():
    """Issue 17 item 3: the providers that name their tunables return a frozen config dataclass for a
    problem (CPU: no GPU needed, the heuristics are host code), the one ``explain()`` shows."""
    import dataclasses

    from dsv4.ops import indexer, moe
    cases = [("moe_gemm1_swiglu", "cuda", moe.GemmProblem("mxfp4", "fp8", 256, 4096, 4096, 256, 256, None, "cuda"),
              "DecodeConfig"),
             ("moe_gemm2", "cuda", moe.GemmProblem("nvfp4", "bf16", 256, 4096, 2048, 2048, 2048, 8, "cuda"),
              "DecodeConfig"),
             ("moe_gemm1_swiglu", "dsl", moe._ex_gemm(H200), "GroupedGemmConfig"),
             ("indexer_logits_paged", "dsl", indexer.PagedProblem("fp8", 2, 64, 32768, "cuda"), "PagedConfig")]
    for name, kind, problem, cls in cases:
        p = registry.get_op(name).provider(kind)
        if isinstance(p, Support):
            pytest.skip(f"{name} {kind}: {p.reason}")
        cfg = p.config(problem, H200)
        assert type(cfg).__name__ == cls and dataclasses.is_dataclass(cfg), (name, kind, cfg)
        assert type(cfg).__dataclass_params__.frozen and hash(cfg) == hash(dataclasses.replace(cfg))
        assert p.config(problem, H200) == cfg                      # deterministic
    big = moe.GemmProblem("mxfp4", "fp8", 256, 4096, 4096, 24576, 24576, None, "cuda")
    assert registry.get_op("moe_gemm1_swiglu").provider("cuda").config(big, H200) is None   # not decode-sized
