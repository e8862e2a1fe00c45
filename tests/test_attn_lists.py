"""attn_lists: the torch provider (window_slots / compressed_slots / hca_slots) against an independent
Python loop oracle on random (hypothesis) and adversarial inputs, the bad-input contract, registry
wiring (CPU); the CuTe DSL kernel against the torch provider bit for bit, bad ids / pages on the
device, and CUDA-graph capture (GPU). The DSL compile check (sm_90a PTX) is in tests/test_compile_dsl.py.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from dsv4 import registry
from dsv4.layout import LayoutError
from dsv4.ops.attn_lists import attn_lists
from dsv4.target import Target

I32_MAX = 2 ** 31 - 1


# ------------------------------------------------------------------------------ oracle
def _slot(bt, r, l, bs, nb):
    """One logical slot -> physical slot, by the documented rule, in Python ints."""
    R = len(bt)
    P = len(bt[0]) if R else 0
    if l < 0 or not 0 <= r < R or l // bs >= P:
        return -1
    page = bt[r][l // bs]
    if page < 0 or (nb is not None and page >= nb):
        return -1
    s = page * bs + l % bs
    return s if s <= I32_MAX else -1


def _wrap32(v):
    return (v + 2 ** 31) % 2 ** 32 - 2 ** 31


def oracle(positions, req_idx, swa_block_table, swa_block_size, *, kind="swa", window=128, ring=128, first=0,
           swa_num_blocks=None, block_table=None, block_size=None, entries=None, lens=None, max_entries=None,
           ratio=128, num_blocks=None):
    pos, req = positions.tolist(), req_idx.tolist()
    sbt = swa_block_table.tolist()
    fst = first.tolist() if isinstance(first, torch.Tensor) else [first] * len(pos)
    ws, wl, cs, cl = [], [], [], []
    for t, p in enumerate(pos):
        n = max(0, min(window, p + 1, p - fst[t] + 1))
        row = []
        for j in range(window):
            if j < n:
                x = p - n + 1 + j
                row.append(_slot(sbt, req[t], x % ring if ring is not None else x, swa_block_size, swa_num_blocks))
            else:
                row.append(-1)
        ws.append(row)
        wl.append(n)
        if kind == "csa":
            e = entries[t].tolist()
            cs.append([_slot(block_table.tolist(), req[t], x, block_size, num_blocks) for x in e])
            cl.append(_wrap32(int(lens[t])) if lens is not None else len(e))
        elif kind == "hca":
            m = min(max(p + 1, 0) // ratio, max_entries)
            cs.append([_slot(block_table.tolist(), req[t], j, block_size, num_blocks) if j < m else -1
                       for j in range(max_entries)])
            cl.append(m)
    return ws, wl, cs, cl


def _check(kw, *, dev="cpu"):
    r = attn_lists(**kw)
    ws, wl, cs, cl = oracle(**kw)
    T = kw["positions"].shape[0]
    assert r.swa_slots.dtype == torch.int32 and tuple(r.swa_slots.shape) == (T, kw.get("window", 128))
    assert r.swa_slots.tolist() == ws and r.swa_lens.tolist() == wl
    if kw.get("kind", "swa") == "swa":
        assert r.slots is None and r.lens is None
    else:
        K = kw["entries"].shape[1] if kw["kind"] == "csa" else kw["max_entries"]
        assert tuple(r.slots.shape) == (T, K) and r.slots.dtype == torch.int32 and r.lens.dtype == torch.int32
        assert r.slots.tolist() == (cs if T else []) and r.lens.tolist() == cl
    return r


# ------------------------------------------------------------------------------ cases
def make_case(kind, seed, *, T=11, R=3, Ps=3, P=6, swa_bs=64, bs=16, window=128, ring=128, K=37,
              pos_dtype=torch.int64, req_dtype=torch.int32, first="int", lens_dtype=None, ratio=4,
              num_blocks=True, bad=True, device="cpu"):
    """A random problem with (``bad``) out-of-range request ids, negative / too large page values,
    entries past the table, padding rows, and positions before ``first``."""
    g = torch.Generator().manual_seed(seed)
    hi = 8 * P * bs + 40
    pos = torch.randint(-1 if bad else 0, hi, (T,), generator=g)
    req = torch.randint(-1 if bad else 0, R + (1 if bad else 0), (T,), generator=g)
    sbt = torch.randint(-1 if bad else 0, 2 * R * Ps + 3, (R, Ps), generator=g).to(torch.int32)
    kw = dict(positions=pos.to(pos_dtype).to(device), req_idx=req.to(req_dtype).to(device),
              swa_block_table=sbt.to(device), swa_block_size=swa_bs, kind=kind, window=window, ring=ring,
              swa_num_blocks=2 * R * Ps if num_blocks else None)
    if first == "int":
        kw["first"] = int(torch.randint(0, 300, (1,), generator=g))
    elif first is not None:
        kw["first"] = (pos - torch.randint(-5, 200, (T,), generator=g)).to(first).to(device)
    if kind != "swa":
        bt = torch.randint(-1 if bad else 0, 2 * R * P + 3, (R, P), generator=g).to(torch.int32)
        kw.update(block_table=bt.to(device), block_size=bs, num_blocks=2 * R * P if num_blocks else None)
    if kind == "csa":
        kw["entries"] = torch.randint(-1, P * bs + 20, (T, K), generator=g, dtype=torch.int32).to(device)
        if lens_dtype is not None:
            kw["lens"] = torch.randint(0, K + 1, (T,), generator=g).to(lens_dtype).to(device)
    elif kind == "hca":
        kw.update(max_entries=K, ratio=ratio)
    return kw


def adversarial_cases(device="cpu"):
    """Named edge cases (each is a kwargs dict of attn_lists)."""
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    out = {}
    # huge int64 positions (no int32 truncation anywhere), before `first`, padding rows
    pos = torch.tensor([2 ** 40, 2 ** 40 + 127, -1, -5, 0, 127, 128, 2 ** 33 + 7], **i64)
    req = torch.zeros(8, **i32)
    out["int64-positions-ring"] = dict(positions=pos, req_idx=req, swa_block_table=torch.tensor([[5, 9]], **i32),
                                       swa_block_size=64, first=2 ** 40 - 3)
    out["int64-positions-linear"] = dict(positions=pos, req_idx=req, swa_block_table=torch.tensor([[5, 9]], **i32),
                                         swa_block_size=64, ring=None)
    # slots above 2^31 - 1 (no num_blocks check): -1, never a wrapped int32
    out["slot-overflow"] = dict(positions=torch.tensor([3, 200, 1000], **i64), req_idx=torch.zeros(3, **i32),
                                swa_block_table=torch.tensor([[2 ** 30, I32_MAX]], **i32), swa_block_size=4,
                                window=8, ring=8, kind="hca",
                                block_table=torch.tensor([[2 ** 26, 3, 2 ** 31 - 1]], **i32), block_size=32,
                                max_entries=9, ratio=16)
    # empty block tables (R = 0 / P = 0): every entry -1
    out["empty-tables"] = dict(positions=torch.tensor([5, 600], **i64), req_idx=torch.zeros(2, **i32),
                               swa_block_table=torch.empty((0, 2), **i32), swa_block_size=64, kind="csa",
                               block_table=torch.empty((1, 0), **i32), block_size=16,
                               entries=torch.tensor([[0, 3, -1], [7, 1, 2]], **i32))
    # bad request ids (negative, >= R, int64 beyond int32)
    out["bad-req"] = dict(positions=torch.tensor([50, 51, 52, 53], **i32),
                          req_idx=torch.tensor([-1, 2, 2 ** 40, -(2 ** 40)], **i64), first=torch.zeros(4, **i32),
                          swa_block_table=torch.tensor([[0, 1], [2, 3]], **i32), swa_block_size=64, kind="hca",
                          block_table=torch.tensor([[0], [1]], **i32), block_size=64, max_entries=4, ratio=4)
    # per-row first, T and K not multiples of 4, int64 lens (low 32 bits kept)
    out["first-tensor-lens-int64"] = dict(
        positions=torch.tensor([300, 298, 10, 4000, 299], **i64), req_idx=torch.tensor([0, 1, 0, 1, 1], **i32),
        swa_block_table=torch.tensor([[0, 1], [3, 2]], **i32), swa_block_size=64,
        first=torch.tensor([173, 173, 20, -(2 ** 40), 299], **i64), kind="csa",
        block_table=torch.tensor([[4, 0, 7], [1, -3, 2]], **i32), block_size=8, num_blocks=7,
        entries=torch.tensor([[0, 8, 16, 23, 24, -1, 9]] * 5, **i32),
        lens=torch.tensor([7, 0, 2 ** 32 + 3, -1, 5], **i64))
    # K = 0 (empty compressed lists) and window 1
    out["k0-window1"] = dict(positions=torch.tensor([0, 9, -1], **i64), req_idx=torch.zeros(3, **i32),
                             swa_block_table=torch.tensor([[1]], **i32), swa_block_size=16, window=1, ring=4,
                             kind="hca", block_table=torch.tensor([[0]], **i32), block_size=4, max_entries=0, ratio=2)
    # T = 0
    out["t0"] = dict(positions=torch.empty(0, **i64), req_idx=torch.empty(0, **i32),
                     swa_block_table=torch.tensor([[0, 1]], **i32), swa_block_size=64, kind="csa",
                     block_table=torch.tensor([[0]], **i32), block_size=4, entries=torch.empty((0, 5), **i32))
    return out


def pipeline_cases(device="cpu", B=8, next_n=2, context=131072, topk=512):
    """The ``dsv4 run`` lists (decode ring of 128, first = context - 128, page 64)."""
    i32 = dict(dtype=torch.int32, device=device)
    swa_bt = torch.arange(B * 2, **i32).view(B, 2)
    t_row = torch.arange(context - next_n, context, device=device).repeat(B)
    req = torch.arange(B, **i32).repeat_interleave(next_n)
    base = dict(positions=t_row, req_idx=req, swa_block_table=swa_bt, swa_block_size=64, first=context - 128,
                swa_num_blocks=B * 2)
    S4, S128 = context // 4, context // 128
    g = torch.Generator().manual_seed(7)
    bt4 = torch.randperm(B * S4 // 64, generator=g).to(torch.int32).view(B, S4 // 64).to(device)
    bt128 = torch.randperm(B * S128 // 64, generator=g).to(torch.int32).view(B, S128 // 64).to(device)
    ent = torch.randint(-1, S4, (B * next_n, topk), generator=g, dtype=torch.int32).to(device)
    return {"swa": base,
            "csa": dict(base, kind="csa", block_table=bt4, block_size=64, entries=ent, num_blocks=B * S4 // 64),
            "hca": dict(base, kind="hca", block_table=bt128, block_size=64, max_entries=S128, ratio=128,
                        num_blocks=B * S128 // 64)}


# ------------------------------------------------------------------------------ CPU: torch provider vs oracle
@pytest.mark.parametrize("name", sorted(adversarial_cases()))
def test_torch_provider_matches_oracle_adversarial(name):
    _check(adversarial_cases()[name])


@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_provider_matches_oracle_random(kind, seed):
    for kw in (make_case(kind, seed), make_case(kind, seed + 10, ring=None, first=torch.int64, lens_dtype=torch.int32),
               make_case(kind, seed + 20, pos_dtype=torch.int32, req_dtype=torch.int64, window=7, ring=9,
                         first=None, num_blocks=False, swa_bs=3, bs=5)):
        _check(kw)


def test_pipeline_lists_match_oracle():
    for kind, kw in pipeline_cases(B=2, context=8192, topk=64).items():
        r = _check(kw)
        assert r.swa_lens.tolist() == [127, 128] * 2        # the ring holds context-128 .. context-1


def test_known_values():
    """Hand-checked rows: ring wrap across two pages, HCA count, CSA entry past the table."""
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    r = attn_lists(torch.tensor([130]), torch.tensor([0]), bt, 64, kind="hca",
                   block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32), block_size=4, max_entries=6, ratio=16)
    # positions 3..130 -> ring slots 3..127 (page 1 of the ring is bt 1), then 0..2 (page 0 = bt 3)
    assert r.swa_slots[0, :2].tolist() == [3 * 64 + 3, 3 * 64 + 4]
    assert r.swa_slots[0, 61:63].tolist() == [1 * 64 + 0, 1 * 64 + 1] and r.swa_slots[0, -1].item() == 3 * 64 + 2
    assert r.lens.tolist() == [6] and r.slots[0].tolist() == [8, 9, 10, 11, 0, 1]
    c = attn_lists(torch.tensor([5]), torch.tensor([0]), bt, 64, kind="csa",
                   block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32), block_size=4,
                   entries=torch.tensor([[3, -1, 11, 12]], dtype=torch.int32), num_blocks=3)
    assert c.slots.tolist() == [[11, -1, 7, -1]] and c.lens.tolist() == [4] and c.swa_lens.tolist() == [6]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["swa", "csa", "hca"]), T=st.integers(0, 9), R=st.integers(0, 3),
       Ps=st.integers(1, 3), P=st.integers(0, 4), swa_bs=st.sampled_from([1, 3, 64]), bs=st.sampled_from([1, 4, 7]),
       window=st.sampled_from([1, 5, 128]), ring_extra=st.sampled_from([None, 0, 3]), K=st.integers(0, 9),
       first=st.integers(-50, 400), nb=st.booleans(), ratio=st.sampled_from([1, 4, 128]),
       data=st.data())
def test_torch_provider_matches_oracle_hypothesis(kind, T, R, Ps, P, swa_bs, bs, window, ring_extra, K, first, nb,
                                                  ratio, data):
    ints = lambda lo, hi, n: torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)),
                                          dtype=torch.int64)
    kw = dict(positions=ints(-3, 700, T), req_idx=ints(-1, R, T).to(torch.int32),
              swa_block_table=ints(-2, 12, R * Ps).view(R, Ps).to(torch.int32), swa_block_size=swa_bs, kind=kind,
              window=window, ring=None if ring_extra is None else window + ring_extra, first=first,
              swa_num_blocks=10 if nb else None)
    if kind != "swa":
        kw.update(block_table=ints(-2, 12, R * P).view(R, P).to(torch.int32), block_size=bs,
                  num_blocks=10 if nb else None)
    if kind == "csa":
        kw["entries"] = ints(-3, 40, T * K).view(T, K).to(torch.int32)
        if data.draw(st.booleans()):
            kw["lens"] = ints(-1, K + 2, T).to(torch.int32)
    if kind == "hca":
        kw.update(max_entries=K, ratio=ratio)
    _check(kw)


def test_existing_helpers_are_the_reference():
    """attn_lists' torch provider is window_slots + compressed_slots / hca_slots, unchanged."""
    from dsv4.ops.sparse_attention import compressed_slots, hca_slots, window_slots
    kw = make_case("csa", 5, first=torch.int64, lens_dtype=torch.int32)
    r = attn_lists(**kw)
    ws, wl = window_slots(kw["positions"], kw["req_idx"], kw["swa_block_table"], 64, first=kw["first"],
                          num_blocks=kw["swa_num_blocks"])
    cs, cl = compressed_slots(kw["entries"], kw["req_idx"], kw["block_table"], 16, lens=kw["lens"],
                              num_blocks=kw["num_blocks"])
    assert torch.equal(r.swa_slots, ws) and torch.equal(r.swa_lens, wl) and torch.equal(r.slots, cs)
    assert torch.equal(r.lens, cl) and r.lens.data_ptr() != kw["lens"].data_ptr()   # a fresh tensor
    kh = make_case("hca", 6)
    h = attn_lists(**kh)
    hs, hl = hca_slots(kh["positions"], kh["req_idx"], kh["block_table"], 16, kh["max_entries"], ratio=4,
                       num_blocks=kh["num_blocks"])
    assert torch.equal(h.slots, hs) and torch.equal(h.lens, hl)


# ------------------------------------------------------------------------------ CPU: bad input
def _base():
    return make_case("csa", 3)


@pytest.mark.parametrize("change, exc, match", [
    (dict(kind="dense"), ValueError, "'kind'"),
    (dict(window=0), ValueError, "'window'"),
    (dict(ring=64), ValueError, "'ring'"),
    (dict(swa_block_size=0), ValueError, "'swa_block_size'"),
    (dict(block_size=0), ValueError, "'block_size'"),
    (dict(block_size=2 ** 31), ValueError, "'block_size'"),
    (dict(swa_block_size=2 ** 40), ValueError, "'swa_block_size'"),
    (dict(block_size=None), ValueError, "'block_size'"),
    (dict(entries=None), ValueError, "'entries'"),
    (dict(max_entries=4), ValueError, "'max_entries'"),
    (dict(num_blocks=-1), ValueError, "'num_blocks'"),
    (dict(swa_num_blocks=-2), ValueError, "'swa_num_blocks'"),
    (dict(first=1.5), ValueError, "'first'"),
    (dict(first=torch.zeros(11)), LayoutError, "'first'"),
    (dict(first=torch.zeros(4, dtype=torch.int64)), LayoutError, "'first'"),
    (dict(positions=torch.zeros(11)), LayoutError, "'positions'"),
    (dict(positions=torch.zeros(11, 1, dtype=torch.int64)), LayoutError, "'positions'"),
    (dict(req_idx=torch.zeros(10, dtype=torch.int32)), LayoutError, "'req_idx'"),
    (dict(entries=torch.zeros(11, 4, dtype=torch.int64)), LayoutError, "'entries'"),
    (dict(entries=torch.zeros(10, 4, dtype=torch.int32)), LayoutError, "'entries'"),
    (dict(lens=torch.zeros(11, dtype=torch.float32)), LayoutError, "'lens'"),
    (dict(block_table=torch.zeros(3, 6, dtype=torch.int64)), LayoutError, "'block_table'"),
    (dict(swa_block_table=torch.zeros(3, 0, dtype=torch.int32)), LayoutError, "'swa_block_table'"),
    (dict(swa_block_table=torch.zeros(3, dtype=torch.int32)), LayoutError, "'swa_block_table'"),
])
def test_bad_inputs_name_the_argument(change, exc, match):
    kw = dict(_base(), **change)
    with pytest.raises(exc, match=match):
        attn_lists(**kw)


def test_kind_specific_arguments():
    kw = make_case("swa", 1)
    with pytest.raises(ValueError, match="'entries' does not apply"):
        attn_lists(**kw, entries=torch.zeros(11, 2, dtype=torch.int32))
    kh = make_case("hca", 1)
    with pytest.raises(ValueError, match="'lens' does not apply"):
        attn_lists(**kh, lens=torch.zeros(11, dtype=torch.int32))
    with pytest.raises(ValueError, match="'max_entries'"):
        attn_lists(**dict(kh, max_entries=None))


# ------------------------------------------------------------------------------ CPU: registry
def test_registry_offers_dsl_on_sm90a_only():
    op = registry.get_op("attn_lists")
    assert op.kinds == ("dsl", "torch")
    problem = {"kind": "csa", "T": 16, "window": 128, "width": 512, "device": "cuda"}
    h200 = Target("cuda", "sm_90a", "H200", 132, 0)
    assert op.check("dsl", problem, h200)
    assert not op.check("dsl", problem, Target("cuda", "sm_100a", "B200", 148, 0))
    assert not op.check("dsl", dict(problem, device="cpu"), Target.of("cpu"))
    big = op.check("dsl", dict(problem, T=2 ** 22, width=2 ** 10), h200)
    assert not big and "2^31" in big.reason
    attn_lists(**make_case("hca", 2))
    assert registry.last_choice("attn_lists").kind == "torch"      # CPU tensors


def test_custom_op_traces_under_torch_compile():
    kw = make_case("csa", 4)
    want = attn_lists(**kw)
    torch._dynamo.reset()
    f = torch.compile(lambda: attn_lists(**kw).slots + 1, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(), want.slots + 1)


# ------------------------------------------------------------------------------ GPU: dsl vs torch
def _both(kw):
    with registry.use(attn_lists="dsl"):
        a = attn_lists(**kw)
        assert registry.last_choice("attn_lists").kind == "dsl"
    with registry.use(attn_lists="torch"):
        b = attn_lists(**kw)
    return a, b


def _equal(a, b, label):
    for name, x, y in zip(a._fields, a, b):
        if x is None or y is None:
            assert x is None and y is None, (label, name)
            continue
        assert x.dtype == y.dtype == torch.int32 and x.shape == y.shape, (label, name, x.shape, y.shape)
        bad = (x != y).nonzero()
        assert bad.numel() == 0, f"{label}: {name} differs at {bad[:4].tolist()}: dsl {x[tuple(bad[0])].item()} " \
                                 f"vs torch {y[tuple(bad[0])].item()}"


def _gpu_cases():
    cases = {f"adv-{k}": v for k, v in adversarial_cases("cuda").items()}
    # a last value no int64 can take one step past: p + 1 and p - first + 1 wrap identically in both providers
    i32, i64 = dict(dtype=torch.int32, device="cuda"), dict(dtype=torch.int64, device="cuda")
    ext = torch.tensor([2 ** 63 - 1, -(2 ** 63), 2 ** 62, 5], **i64)
    cases["adv-int64-extremes"] = dict(positions=ext, req_idx=torch.zeros(4, **i32),
                                       swa_block_table=torch.tensor([[1, 2]], **i32), swa_block_size=64, kind="hca",
                                       first=torch.tensor([-(2 ** 63), 2 ** 63 - 1, -(2 ** 62), 0], **i64),
                                       block_table=torch.tensor([[0, 1]], **i32), block_size=64, max_entries=16,
                                       ratio=1)
    for kind in ("swa", "csa", "hca"):
        cases[f"rand-{kind}"] = make_case(kind, 1, T=37, K=203, device="cuda")
        cases[f"rand-{kind}-lin"] = make_case(kind, 2, T=1, K=5, ring=None, first=torch.int64, device="cuda",
                                              lens_dtype=torch.int64)
        cases[f"rand-{kind}-i32"] = make_case(kind, 3, T=300, K=64, pos_dtype=torch.int32, req_dtype=torch.int64,
                                              window=7, ring=9, first=torch.int32, num_blocks=False, swa_bs=3, bs=5,
                                              lens_dtype=torch.int32, device="cuda")
    for kind, kw in pipeline_cases("cuda").items():
        cases[f"pipe-{kind}-k512"] = kw
    cases["pipe-csa-k1024"] = pipeline_cases("cuda", topk=1024)["csa"]
    cases["pipe-csa-prefill"] = dict(pipeline_cases("cuda", B=64, next_n=1, topk=512)["csa"])
    big = make_case("csa", 9, T=4099, K=1024, R=16, P=128, device="cuda")
    cases["big-csa"] = big
    # misaligned entries (a column slice view): copied, same result
    cases["csa-strided-entries"] = dict(big, entries=make_case("csa", 9, T=4099, K=1025, R=16, P=128,
                                                               device="cuda")["entries"][:, 1:])
    return cases


@pytest.mark.gpu
def test_gpu_dsl_bit_identical_to_torch():
    ok, bad = [], []
    for label, kw in _gpu_cases().items():
        try:
            a, b = _both(kw)
            torch.cuda.synchronize()
            _equal(a, b, label)
            ok.append(label)
        except Exception as e:  # noqa: BLE001 - report every case, fail at the end
            bad.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
    print(f"\nattn_lists dsl == torch: {len(ok)} cases ok: {ok}")
    print("\n".join(f"FAIL {x}" for x in bad))
    assert not bad, bad
    # the context survives every bad id / page above: another launch still runs
    assert int(torch.ones(4, device="cuda").sum()) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["swa", "csa", "hca"])
def test_gpu_cuda_graph_capture(kind):
    """Capture the dsl launch once; refresh the inputs in place (positions, ids, tables); replays match the
    torch provider on the new data."""
    kw = make_case(kind, 11, T=19, K=77, first=torch.int64, lens_dtype=torch.int64, device="cuda")
    src = [make_case(kind, s, T=19, K=77, first=torch.int64, lens_dtype=torch.int64, device="cuda") for s in (12, 13)]
    with registry.use(attn_lists="dsl"):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            attn_lists(**kw)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = attn_lists(**kw)
    for new in src:
        for k, v in new.items():
            if isinstance(v, torch.Tensor):
                kw[k].copy_(v)
        g.replay()
        with registry.use(attn_lists="torch"):
            want = attn_lists(**kw)
        torch.cuda.synchronize()
        _equal(out, want, f"graph-{kind}")
