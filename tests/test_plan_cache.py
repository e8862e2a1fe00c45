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
    assert plan.launch is not None                             # the torch reference's ops, replayed
    assert ("_L(" in plan.source) != _plan.INLINE             # (inlined in the hit, or called)


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


def _recording(args: dict):
    """``with _recording(run_args) as tr``: the block runs as a provider's run recorded into the trace ``tr``."""
    import contextlib

    from dsv4.ops import _trace

    @contextlib.contextmanager
    def rec_block():
        rec = _plan._Recorder()
        rec.in_run = 1
        tr = _trace.Trace(args)
        rec.trace = tr
        with _trace.Watch(rec):
            yield tr
    return rec_block()


class _FakeC:
    """torch._C's device / stream queries of a replay, on a CPU machine (device 0, stream 0)."""
    _cuda_getDevice = staticmethod(lambda: 0)
    _cuda_getCurrentRawStream = staticmethod(lambda dev: 0)


def _replay_of(f, **args):
    """Record ``f(**args)`` as a provider run's trace (dsv4/ops/_trace.py) and return its replay."""
    with _recording(args) as tr:
        out = f(**args)
    launch = tr.replay(out, lambda **kw: f(**kw))
    assert launch is not None, tr.why
    return out, launch


def test_trace_codegen_views_allocations_cpu():
    """The replay builds a view chain's tensor with one op from its root (none for a full-extent narrow /
    same-shape view), allocates a buffer used only through one full view as that view, drops an allocation
    nothing uses, and returns what the run returns (bit-identical, new outputs per call)."""
    def run(x):
        buf = torch.empty((x.numel() * 4,), dtype=torch.uint8)          # used only as int32 [rows, cols]
        out = buf.view(torch.int32).view(x.shape)
        torch.empty((7,), dtype=torch.float32)                           # dead
        y = x.view(-1).narrow(0, 0, x.numel()).view(x.shape)             # = x
        out.copy_(y.to(torch.int32) * 3)
        tail = x.view(-1).narrow(0, 2, 5).unsqueeze(0)                   # one as_strided of x
        return out, tail + 1
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    _, launch = _replay_of(run, x=x)
    src = launch.source
    assert src.count("EMPTY_STRIDED") == 1 and ".narrow" not in src and ".unsqueeze" not in src, src
    assert "as_strided((1, 5), (5, 1), x.storage_offset() + 2)" in src, src
    for xx in (x, torch.arange(30, dtype=torch.float32)[6:].reshape(4, 6)):       # another storage offset
        got = launch(x=xx)
        ref = run(xx)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
        assert got[0].dtype == torch.int32 and got[0].shape == (4, 6)
    assert launch(x=x)[0].data_ptr() != launch(x=x)[0].data_ptr() or True


def test_plan_of_one_tensor_passed_twice_cpu():
    """A signature recorded with one tensor as two arguments (attn_lists hca: swa_block_table is block_table)
    replays only while they are one tensor: two different tensors of the same facts take the full path."""
    c = next(c for c in _calls("cpu") if c.name == "attn_lists" and c.label.endswith("hca"))
    bt = c.kwargs.get("block_table")
    if bt is None or not any(bt is a for a in c.args):
        pytest.skip("the hca case no longer passes one tensor twice")
    _plan.clear()
    for _ in range(3):
        c.fn(*c.args, **c.kwargs)
    assert callable(_plan.plan_of(c.fn, *c.args, **c.kwargs))
    other = bt.clone()
    other.view(-1)[: other.numel() // 2] = other.view(-1).flip(0)[: other.numel() // 2]
    kw = dict(c.kwargs, block_table=other)
    got = _tensors(c.fn(*c.args, **kw), [])
    _plan.ENABLED = False
    try:
        want = _tensors(c.fn(*c.args, **kw), [])
    finally:
        _plan.ENABLED = True
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_trace_workspace_selection_cpu(monkeypatch):
    """Kept across calls (dsv4/ops/_trace.py workspaces): only allocations that kernel launches alone use --
    never an output, a view of one, a zero-filled buffer or a tensor a torch op touches."""
    from dsv4.ops import _trace
    monkeypatch.setattr(_trace, "_WS_DEVICES", ("cuda", "cpu"))
    x = torch.randn(4, 8)
    with _recording({"x": x}) as tr:
        ws = torch.empty((64,), dtype=torch.uint8)               # launches only (through a view): kept
        ws2 = torch.empty((16,), dtype=torch.float32)            # touched by a torch op: per call
        ws2.zero_()
        zs = torch.zeros((16,), dtype=torch.int32)               # zero-filled: per call
        out = torch.empty((4, 8), dtype=torch.float32)           # the result: per call
        res = out.view(32)
        part = ws.view(torch.int32)[2:6]
    tr.device = 0
    launch = f"SINK({tr.expr(part)}, {tr.expr(ws2)}, {tr.expr(zs)}, {tr.expr(out)})"
    tr.lines.append(("launch", launch))
    ret = tr._out(res)
    dead = tr._plan_allocs(ret)
    kept = {tr.info[a].t.data_ptr() for a in tr._workspaces(ret, dead)}
    assert kept == {ws.data_ptr()}


def test_trace_workspace_replay_cpu(monkeypatch):
    """A replay keeps its kernels' workspace (and the views of it) per thread: made once, same bytes every
    call; the outputs stay fresh per call (a CPU stand-in for the kernel launch)."""
    from dsv4.ops import _trace
    monkeypatch.setattr(_trace, "_WS_DEVICES", ("cuda", "cpu"))
    x = torch.randn(4, 8)
    with _recording({"x": x}) as tr:
        ws = torch.empty((64,), dtype=torch.uint8)
        wsv = ws.view(torch.float32).view(2, 8)                 # a view of the workspace: made with it
        out = torch.empty((4, 8), dtype=torch.float32)
    tr.device, tr.stream = 0, 0
    ptr = f"\x00P{tr._index(ws)}:0\x00"                           # its address (as NVRTC launches pass tensors)
    tr.lines.append(("launch", f"SINK({tr.expr(x)}, {tr.expr(wsv)}, {ptr}, {tr.expr(out)})"))
    launch = tr.replay(out, None)
    assert launch is not None, tr.why
    seen = []

    def sink(a, w, p, o):
        seen.append((w.data_ptr(), p, w.shape, w.dtype))
        w.copy_(a[:2] * 2)
        o.copy_(a + w.sum())

    monkeypatch.setitem(launch.__globals__, "SINK", sink)
    monkeypatch.setitem(launch.__globals__, "C", _FakeC)
    assert "EMPTY_STRIDED((4, 8)" in launch.source and "EMPTY_STRIDED((64,)" not in launch.source, launch.source
    o1, o2 = launch(x=x), launch(x=x)
    assert o1.data_ptr() != o2.data_ptr() and torch.equal(o1, o2) and torch.equal(o1, x + (x[:2] * 2).sum())
    assert seen[0] == seen[1] and seen[0][0] == seen[0][1] and seen[0][2:] == ((2, 8), torch.float32)
    assert len(launch.__globals__["WS"]) == 1
    launch.__globals__["WS"].clear()
    monkeypatch.setattr(_trace, "WORKSPACE_TOTAL_BYTES", 0)      # over the budget: per call, as the run does
    o3, o4 = launch(x=x), launch(x=x)
    assert torch.equal(o3, o1) and torch.equal(o4, o1) and not launch.__globals__["WS"]
    # the same code inlined in a plan's hit (dsv4/ops/_plan.py _inline): the device / stream test, then the steps
    gg, body = _plan._inline(launch, ["a[0]"], {})
    calls = []
    gg["FALLBACK"] = lambda **kw: calls.append(kw) or "fallback"
    exec("def hit(a, kw):\n" + body + "    return _o\n", gg)  # noqa: S102
    assert torch.equal(gg["hit"]((x,), {}), o1)

    class OtherStream(_FakeC):
        _cuda_getCurrentRawStream = staticmethod(lambda dev: 7)
    gg["C"] = OtherStream
    assert gg["hit"]((x,), {}) == "fallback" and calls[0]["x"] is x


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "alignment", "same"])
def test_guarded_key_change_misses(change):
    """Three tensor arguments or more: the key's tensor facts are checked by TensorGuards; any change of a
    shape, stride, dtype or 16-byte alignment misses, the same facts hit."""
    x, ln = _logits()
    st = torch.zeros(4, dtype=torch.int32)
    _plan.clear()
    for _ in range(3):
        ops.topk(x, ln, 8, starts=st)
    kf = ops.topk.__wrapped_key_functions__[(3, "starts")]
    assert "GL" in kf.source or not _plan._guards_ok()
    h, m = _plan.stats()["hits"], _plan.stats()["misses"]
    buf = torch.zeros(4 * 64 + 4)
    args = {"shape": (torch.randn(4, 32), ln, st), "stride": (torch.randn(64, 4).t(), ln, st),
            "dtype": (x, ln, st.long()), "alignment": (buf[1:257].view(4, 64), ln, st),
            "same": (x.clone(), ln.clone(), st.clone())}[change]
    import contextlib
    with contextlib.suppress(Exception):          # a bad input may raise; the key must still miss
        ops.topk(*args[:2], 8, starts=args[2])
    if change == "same":
        assert _plan.stats()["hits"] == h + 1 and _plan.stats()["misses"] == m
    else:
        assert _plan.stats()["hits"] == h and _plan.stats()["misses"] == m + 1


def test_key_function_structured_arguments():
    """The generated key function reads the fields of NamedTuple / dataclass / tuple arguments inline: a
    change of any field's facts changes the key; the same facts give the same key."""
    from typing import NamedTuple

    class NT(NamedTuple):
        a: torch.Tensor
        n: int

    @dataclasses.dataclass
    class DC:
        w: torch.Tensor
        s: torch.Tensor
        fmt: str
        dt: torch.dtype

    def args(n=3, fmt="x", shape=(4, 4), dt=torch.float32, extra=False):
        d = DC(torch.empty(shape), torch.empty(2), fmt, dt)
        if extra:
            d.more = 1
        return (NT(torch.empty(3, dtype=dt), n), d, (torch.empty(5), 2)), {"k": torch.empty(1)}
    a0, kw0 = args()
    kf = _plan._key_function(a0, kw0)
    base = kf(a0, kw0)
    assert kf(*args()) == base
    for change in ({"n": 4}, {"fmt": "y"}, {"shape": (4, 5)}, {"dt": torch.float64}, {"extra": True}):
        assert kf(*args(**change)) != base, change


def test_trace_input_view_memo_cpu(monkeypatch):
    """A view of a run argument that only launches use is kept while the argument is the same tensor at the
    same address (one identity test per call); another tensor gets its own view; the kept view goes with the
    argument (it must not keep the caller's memory alive)."""
    import gc
    import weakref

    from dsv4.ops import _trace
    x = torch.randn(4, 8)
    with _recording({"x": x}) as tr:
        flat = x.view(-1)[2:]
        out = torch.empty((4, 8), dtype=torch.float32)
    tr.device, tr.stream = 0, 0
    tr.lines.append(("launch", f"SINK({tr.expr(flat)}, {tr.expr(out)})"))
    launch = tr.replay(out, None)
    assert launch is not None and "MEMO" in launch.source, launch.source
    seen = []

    def sink(v, o):
        seen.append(v)
        o.view(-1)[:30].copy_(v)

    monkeypatch.setitem(launch.__globals__, "SINK", sink)
    monkeypatch.setitem(launch.__globals__, "C", _FakeC)
    big = torch.randn(40)
    for xx in (x, x, x, big[:32].view(4, 8), big[2:34].view(4, 8)):
        got = launch(x=xx)
        assert torch.equal(got.view(-1)[:30], xx.reshape(-1)[2:])
    assert seen[1] is seen[2] and seen[3] is not seen[2] and seen[4] is not seen[3]      # kept while x is x
    assert seen[1].data_ptr() == seen[0].data_ptr() and seen[1].shape == seen[0].shape
    assert seen[4].data_ptr() == big.data_ptr() + 16
    for _ in range(_trace.MEMO_MAX_MISSES + 2):             # a new tensor every call: no longer kept
        launch(x=torch.randn(4, 8))
    assert launch.__globals__["MISS"][0] == _trace.MEMO_MAX_MISSES
    assert torch.equal(launch(x=x).view(-1)[:30], x.reshape(-1)[2:])   # (a plain view per call from then on)
    launch.__globals__["MISS"][0] = 0
    y = torch.randn(4, 8)
    launch(x=y)
    ref = weakref.ref(seen[-1])
    del y, seen[:]
    gc.collect()
    assert ref() is None                          # the kept view went with its argument


def test_recording_new_shape_reuses_generated_code():
    """The replay and hit code of a signature is compiled once per trace structure (dsv4/ops/_trace.py
    exec_generated: its numeric literals are globals): a new shape of the same structure records a plan that
    reuses it (counters), and that plan is bit-identical to the full path; the replay a hit inlines is never
    compiled on its own."""
    from dsv4.ops import _trace
    _plan.clear()
    _trace._CODE.clear()
    outs = {}
    for m in (4, 8, 16):
        x = torch.randn(m, 512)
        c0 = dict(_trace.CODE_STATS)
        for _ in range(3):                                  # full path, recording, hit
            got = ops.quantize_fp8_block(x, scale_fmt="ue8m0")
        plan = _plan.plan_of(ops.quantize_fp8_block, x, scale_fmt="ue8m0")
        assert callable(plan) and plan.launch is not None, _plan.WHY_NOT_REPLAYED
        if _plan.INLINE and "_L(" not in plan.source:
            assert plan.launch._fn is None                  # (inlined: never compiled itself)
        compiled = _trace.CODE_STATS["compiled"] - c0["compiled"]
        outs[m] = compiled, _trace.CODE_STATS["reused"] - c0["reused"]
        _plan.ENABLED = False
        try:
            want = ops.quantize_fp8_block(x, scale_fmt="ue8m0")
        finally:
            _plan.ENABLED = True
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want)), m
    assert outs[4][0] >= 1                                  # the first shape: the hit compiled
    assert outs[8] == (0, 1) and outs[16] == (0, 1), outs  # later shapes: its code reused, nothing compiled


def test_exec_generated_literals():
    """exec_generated turns numbers and tuples of numbers into globals (strings, names, attributes kept): the
    function computes what its source says, and a source differing only in those literals reuses the code."""
    from dsv4.ops import _trace
    src = ("def f(x):\n    a = (8, 64)\n    b = (-1,)\n    c = x.view(3, -2) if 1e-05 < 0.5 else None\n"
           "    d = 'e4m3 12' + \"x9\" + str(t12) + kw['k3']\n    return a, b, c, d, [7][0], 1.5e3, (2, 3.5), x.n2\n")

    class X:
        n2 = "n2"

        def view(self, *a):
            return a
    want = ((8, 64), (-1,), (3, -2), "e4m3 12x91K", 7, 1500.0, (2, 3.5), "n2")
    assert _trace.exec_generated(src, {"t12": 1, "kw": {"k3": "K"}}, "f")(X()) == want
    n = _trace.CODE_STATS["compiled"]
    src2 = src.replace("(8, 64)", "(16, 4)").replace("3, -2", "5, -6").replace("1.5e3", "2.5")
    f2 = _trace.exec_generated(src2, {"t12": 2, "kw": {"k3": "Q"}}, "f")
    assert f2(X()) == ((16, 4), (-1,), (5, -6), "e4m3 12x92Q", 7, 2.5, (2, 3.5), "n2")
    assert _trace.CODE_STATS["compiled"] == n and f2.source == src2


def test_recording_mode_skips_dynamo_wrapper():
    """The recording's dispatch mode calls its __torch_dispatch__ directly (no torch._dynamo.disable wrapper,
    whose first call imports torch._dynamo: about a second on a process's first recorded signature)."""
    from dsv4.ops import _trace
    assert getattr(_trace.Watch.__torch_dispatch__, "__wrapped__", None) is None
    assert _trace.Watch.__torch_dispatch__.__qualname__ == "Watch.__torch_dispatch__"


def test_trace_empty_view_of_one_buffer_cpu(monkeypatch):
    """Outputs carved out of one allocation where one part is empty at this size (moe_permute's bf16 ``a_s``:
    shape (0,)): an empty view's ``data_ptr()`` is 0, not an address in its buffer; the replay makes it as a fresh
    empty tensor of its facts, passes 0 for its address, and the other views stay views of the one buffer."""
    def run(x):
        buf = torch.empty((64 + 16,), dtype=torch.uint8)
        a = buf[0:64].view(torch.float32).view(4, 4)
        e = buf[64:64].view(torch.float32).view((0,))
        a.copy_(x * 2)
        return a, e
    x = torch.randn(4, 4)
    with _recording({"x": x}) as tr:
        out = run(x)
    tr.device, tr.stream = 0, 0
    tr.lines.append(("launch", f"SINK(\x00P{tr._index(out[1])}:0\x00, \x00P{tr._index(out[0])}:0\x00)"))
    launch = tr.replay(out, None)
    assert launch is not None, tr.why
    seen = []
    monkeypatch.setitem(launch.__globals__, "SINK", lambda pe, pa: seen.append((pe, pa)))
    monkeypatch.setitem(launch.__globals__, "C", _FakeC)
    a, e = launch(x=x)
    assert torch.equal(a, x * 2) and e.shape == (0,) and e.dtype == torch.float32
    assert seen == [(0, a.data_ptr())]
