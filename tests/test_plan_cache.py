"""The per-signature plan cache of the eager path (dsv4/ops/_plan.py, issue 17).

A planned call (the signature's second and later calls) must return what the full path returns, for
every op; any change of a key component must miss; a bad input after a good one must raise the same
error as without the cache; registry overrides and ``clear_cache`` must invalidate; tracing / fake /
compile paths must bypass it. CPU (torch providers) on CI; the GPU test does the same on the H200's
providers. No timing here (bench/bench_eager.py measures)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4 import ops, registry
from dsv4.layout import LayoutError
from dsv4.ops import _plan


def _tensors(x, out):
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _tensors(v, out)
    elif dataclasses.is_dataclass(type(x)) and hasattr(x, "__dict__"):
        for v in x.__dict__.values():
            _tensors(v, out)
    return out


def _bytes(ts):
    return [t.detach().reshape(-1).contiguous().view(torch.uint8).cpu() for t in ts]


def _calls(device):
    from bench.bench_eager import collect_cases, record
    out = []
    for case in collect_cases(torch.device(device)):
        case.run()
        out += record(case)
    return out


def check_hit_equals_full(c) -> str:
    """Run ``c`` on the full path, then twice with plans (miss, hit), restoring its inputs before each
    run; every output and every (mutated) input must be bit-identical. Returns 'planned' / 'unplanned'."""
    ins = _tensors((c.args, c.kwargs), [])
    snap = [t.clone() for t in ins]

    def run():
        for t, s in zip(ins, snap):
            t.copy_(s)
        r = c.fn(*c.args, **c.kwargs)
        return type(r), _bytes(_tensors(r, []) + ins)

    prev = _plan.ENABLED
    try:
        _plan.ENABLED = False
        want = run()
        _plan.ENABLED = True
        _plan.clear()
        first = run()                                   # the signature's first call: the full path
        second = run()                                  # the second: recorded (plan, trace of the run)
        plan = _plan.plan_of(c.fn, *c.args, **c.kwargs)
        h0 = _plan.stats()["hits"]
        third = run()                                   # planned
        hit = _plan.stats()["hits"] > h0
    finally:
        _plan.ENABLED = prev
    for got in (first, second, third):
        assert got[0] is want[0], c.label
        assert len(got[1]) == len(want[1])
        for a, b in zip(got[1], want[1]):
            assert torch.equal(a, b), f"{c.name} [{c.label}]: planned result differs from the full path"
    assert hit == callable(plan), (c.name, c.label, plan)
    if not hit:
        return "unplanned"
    return "replayed" if plan.launch is not None else "planned"


# ------------------------------------------------------------------------------------------ CPU
@pytest.fixture(params=[False, True], ids=["run", "replay"])
def trace(request, monkeypatch):
    """Plans that call the provider's run, and plans that replay its recorded trace."""
    monkeypatch.setattr(_plan, "TRACE", request.param)
    _plan.clear()
    yield request.param
    _plan.clear()


def test_hit_equals_full_path_every_op_cpu(trace):
    kinds = {}
    for c in _calls("cpu"):
        kinds[(c.name, c.label)] = check_hit_equals_full(c)
    planned = {k for k, v in kinds.items() if v != "unplanned"}
    # every op with a graph case is planned on CPU except those whose checks read CPU tensor values
    assert {n for n, _ in planned} >= {"topk", "attn_lists", "kv_cache_append", "kv_gather", "moe_permute",
                                        "moe_combine", "quantize_mxfp4", "quantize_nvfp4", "sparse_attention"}
    assert ("kv_compress_prefill", "kv_compress_prefill-c4-d512") not in planned   # cu_seqlens read on the host
    if trace:                                     # the references that read no values on the host replay
        assert {n for (n, _), v in kinds.items() if v == "replayed"} >= {"topk", "attn_lists", "moe_permute"}


def _logits(rows=4, n=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, n, generator=g).to(dtype), torch.full((rows,), n, dtype=torch.int32)


def test_planned_call_matches_and_records_choice(monkeypatch):
    monkeypatch.setattr(_plan, "TRACE", True)
    x, ln = _logits()
    _plan.clear()
    a = ops.topk(x, ln, 8, return_scores=True)
    ops.topk(x, ln, 8, return_scores=True)
    h = _plan.stats()["hits"]
    b = ops.topk(x, ln, 8, return_scores=True)
    assert _plan.stats()["hits"] == h + 1
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert registry.last_choice("topk").kind == "torch"
    plan = _plan.plan_of(ops.topk, x, ln, 8, return_scores=True)
    assert "L(" in plan.source and plan.launch is not None     # the torch reference's ops, replayed


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "k", "k_float", "bool_as_int", "kwarg_name"])
def test_key_change_misses_and_bad_input_still_raises(change):
    x, ln = _logits()
    _plan.clear()
    for _ in range(3):
        ops.topk(x, ln, 8)                                 # first, recorded, planned
    h, m = _plan.stats()["hits"], _plan.stats()["misses"]
    wide = torch.randn(4, 128)
    args, kw, err = {
        "shape": ((torch.randn(4, 32), ln, 8), {}, None),
        "stride": ((wide[:, ::2], ln, 8), {}, LayoutError),                   # same shape, strides (2, 1)... no: (128, 2)
        "dtype": ((x.double(), ln, 8), {}, LayoutError),
        "k": ((x, ln, 4000), {}, ValueError),
        "k_float": ((x, ln, 8.0), {}, ValueError),                             # 8.0 == 8: the type is in the key
        "bool_as_int": ((x, ln, 8), {"sorted": 1}, ValueError),
        "kwarg_name": ((x, ln, 8), {"sorted": False}, None),
    }[change]
    if err is None:
        ops.topk(*args, **kw)
    else:
        with pytest.raises(err):
            ops.topk(*args, **kw)
        _plan.ENABLED = False
        try:                                                # the same error as without the cache
            with pytest.raises(err):
                ops.topk(*args, **kw)
        finally:
            _plan.ENABLED = True
    assert _plan.stats()["hits"] == h and _plan.stats()["misses"] == m + 1


def test_same_shape_different_alignment_misses():
    buf = torch.randn(4 * 64 + 1)
    a, b = buf[:256].view(4, 64), buf[1:257].view(4, 64)            # data_ptr % 16: 0 vs 4
    k = _plan._k
    assert k(a) != k(b) and k(a) == k(buf[:256].view(4, 64))


def test_value_checks_are_never_planned():
    """A call whose checks read tensor values on the host (CPU ``global_scale`` of dequant_fp4) keeps the
    full path: a bad value after a good one with the same signature still raises."""
    data = torch.randint(0, 256, (4, 32), dtype=torch.uint8)
    scale = torch.randint(100, 120, (4, 4), dtype=torch.uint8).view(torch.float8_e4m3fn)
    good, bad = torch.ones(1), torch.full((1,), float("inf"))
    _plan.clear()
    for _ in range(3):
        ops.dequant_fp4(data, scale, fmt="nvfp4", global_scale=good)
    assert _plan.plan_of(ops.dequant_fp4, data, scale, fmt="nvfp4", global_scale=good) is False
    with pytest.raises(ValueError, match="global_scale"):
        ops.dequant_fp4(data, scale, fmt="nvfp4", global_scale=bad)
    assert "host" in _plan.WHY_NOT["dequant_fp4"]


def test_data_dependent_shapes_in_checks_are_never_planned():
    """kv_compress_decode checks CPU positions with ``nonzero`` (a value-dependent shape, no scalar read):
    found by the recording's dispatch mode, so a bad position after good ones of the same signature raises."""
    c = next(c for c in _calls("cpu") if c.name == "kv_compress_decode")
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    assert _plan.plan_of(c.fn, *c.args, **c.kwargs) is False
    pos = c.args[5]
    saved = pos.clone()
    pos.fill_(-5)
    try:
        with pytest.raises(ValueError):
            c.fn(*c.args, **c.kwargs)
    finally:
        pos.copy_(saved)


def test_registry_use_and_env_and_clear_cache_invalidate(monkeypatch):
    x, ln = _logits()
    _plan.clear()
    for _ in range(3):
        ops.topk(x, ln, 8)
    m = _plan.stats()["misses"]
    with registry.use(topk="torch"):                        # another registry state: a new plan
        for _ in range(3):
            ops.topk(x, ln, 8)
            assert registry.last_choice("topk").forced
        assert _plan.stats()["misses"] == m + 2
    with registry.use(topk="cuda"), pytest.raises(registry.ProviderUnavailableError):
        ops.topk(x, ln, 8)                                  # forced and impossible: raises, never a stale plan
    ops.topk(x, ln, 8)                                      # back outside: the first plan again
    assert not registry.last_choice("topk").forced
    assert _plan.stats()["misses"] == m + 3                 # (the forced-cuda call: one more miss)
    monkeypatch.setenv("DSV4_OPS", "topk=cuda")
    with pytest.raises(registry.ProviderUnavailableError):
        ops.topk(x, ln, 8)
    monkeypatch.delenv("DSV4_OPS")
    ops.topk(x, ln, 8)
    assert _plan.stats()["entries"] > 0
    registry.get_op("topk").clear_cache()
    assert _plan.stats()["entries"] == 0


def test_fake_meta_function_mode_compile_and_dispatcher_bypass():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x, ln = _logits()
    _plan.clear()
    for _ in range(3):
        ops.topk(x, ln, 8)
    h = _plan.stats()["hits"]
    with FakeTensorMode() as mode:
        fx, fl = mode.from_tensor(x), mode.from_tensor(ln)
        out = ops.topk(fx, fl, 8)
        assert out.shape == (4, 8)
    out = ops.topk(x.to("meta"), ln.to("meta"), 8)
    assert out.device.type == "meta"
    with torch.device("cpu"):                               # a torch function mode
        ops.topk(x, ln, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.topk(x, ln, 8)                                  # the profiler sees the op by name
    assert any("dsv4::topk" in e.key for e in prof.key_averages())
    f = torch.compile(lambda a, b: ops.topk(a, b, 8), backend="eager", fullgraph=True)
    assert torch.equal(f(x, ln), ops.topk(x, ln, 8))
    assert _plan.stats()["hits"] == h + 1                   # only the last plain call
    monkeypatch_direct = registry.EAGER_DIRECT
    registry.EAGER_DIRECT = False
    try:
        ops.topk(x, ln, 8)
    finally:
        registry.EAGER_DIRECT = monkeypatch_direct
    assert _plan.stats()["hits"] == h + 1


def test_lru_bound(monkeypatch):
    monkeypatch.setattr(_plan, "MAX_PLANS", 3)
    monkeypatch.setattr(_plan, "_HALF", 1)
    sig = {n: _logits(n=n) for n in (16, 24, 32, 40)}
    for n in (16, 24, 32):
        for _ in range(3):
            ops.topk(*sig[n], 8)
    ops.topk(*sig[16], 8)                            # a hit: the most recently used now
    ops.topk(*sig[40], 8)                            # a fourth signature: the least recently used (24) goes
    assert len(ops.topk.__wrapped_plan_cache__) == 3
    assert callable(_plan.plan_of(ops.topk, *sig[16], 8)) and callable(_plan.plan_of(ops.topk, *sig[32], 8))
    assert _plan.plan_of(ops.topk, *sig[24], 8) is None


def test_outputs_are_fresh_per_call():
    x, ln = _logits()
    _plan.clear()
    a = ops.topk(x, ln, 8)
    b = ops.topk(x, ln, 8)
    c = ops.topk(x, ln, 8)
    assert b.data_ptr() != c.data_ptr() or b is not c
    assert torch.equal(a, c)


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_hit_equals_full_path_every_op_gpu(trace):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    res, bad = {}, []
    for c in _calls("cuda"):
        try:
            res[f"{c.name}[{c.label}]"] = check_hit_equals_full(c)
        except AssertionError as e:                 # every op is checked; the failures are listed at the end
            bad.append(f"{c.name}[{c.label}]: {str(e)[:200]}")
        p = _plan.plan_of(c.fn, *c.args, **c.kwargs)
        if callable(p) and p.launch is not None:
            print(f"SOURCE {c.name}[{c.label}]\n{p.launch.source}")
    for k, v in res.items():
        print(f"PLAN {k:60s} {v}")
    print("PLAN not planned:", _plan.WHY_NOT)
    print("PLAN not replayed:", _plan.WHY_NOT_REPLAYED)
    assert not bad, bad
    assert sum(v != "unplanned" for v in res.values()) >= len(res) - 2


@pytest.mark.gpu
def test_gpu_replay_small(monkeypatch):
    """Small shapes (the sanitizer subset): a replayed DSL launch (dequant_fp4) and NVRTC launch (topk) write
    what the full path writes, and a replay on another stream falls back to the provider's run."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setattr(_plan, "TRACE", True)
    dev = torch.device("cuda")
    data = torch.randint(0, 256, (3, 48), dtype=torch.uint8, device=dev)
    scale = torch.randint(100, 130, (3, 3), dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu)
    x = torch.randn(5, 300, device=dev)
    ln = torch.tensor([300, 7, 0, 150, 299], dtype=torch.int32, device=dev)
    calls = [lambda: ops.dequant_fp4(data, scale, fmt="mxfp4"), lambda: ops.topk(x, ln, 16, return_scores=True)]
    for f in calls:
        _plan.ENABLED = False
        try:
            want = _bytes(_tensors(f(), []))
        finally:
            _plan.ENABLED = True
        for _ in range(3):
            got = _bytes(_tensors(f(), []))
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            got = _tensors(f(), [])
        s.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(_bytes(got), want))
