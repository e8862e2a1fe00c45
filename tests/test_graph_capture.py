"""Every public op under CUDA graph capture + replay, and under torch.compile.

A *graph case* is a small object with static input tensors and fields ``label``, ``op`` (the
registry op name, so each provider can be forced), ``run()`` (calls the public op on the static
inputs, returns a tensor), ``refresh()`` (rewrites the inputs' contents in place: new random
data, same shapes) and ``problem`` (a problem dict for the providers' ``supports``). Cases come
from ``CASES`` below, or from the op module itself: any ``dsv4/ops/<module>.py`` may define
``graph_cases(device) -> list`` of such objects (so a new op adds itself without editing this
file). The GPU test fails for a registered op that has no case.

Checks, per case and per GPU provider available (dsl, cuda; the torch references are oracles, not required to be capturable):
capture once, refresh the inputs, replay, and compare bit for bit with an eager call on the
refreshed inputs (the graph must read the new data: no host-side state, no sync).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import dsv4.ops
from dsv4 import registry
from dsv4.target import Target


@dataclass
class GraphCase:
    label: str
    op: str
    run: Callable[[], torch.Tensor]
    refresh: Callable[[], None]
    problem: dict  # a problem dict for provider availability checks


# --------------------------------------------------------------------------------------- cases
def _dequant_fp4_cases(device) -> list[GraphCase]:
    from dsv4.ops import dequant_fp4
    cases = []
    M, K = (1024 if torch.device(device).type == "cuda" else 64), 7168
    for fmt, sf, sdt in (("mxfp4", 32, torch.float8_e8m0fnu), ("nvfp4", 16, torch.float8_e4m3fn)):
        for out_dtype in (torch.bfloat16, torch.float32):
            data = torch.empty(M, K // 2, dtype=torch.uint8, device=device)
            sbytes = torch.empty(M, K // sf, dtype=torch.uint8, device=device)
            scale = sbytes.view(sdt)
            g = torch.empty(1, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
            gen = torch.Generator(device="cpu").manual_seed(hash((fmt, str(out_dtype))) % 2 ** 31)

            def refresh(data=data, sbytes=sbytes, g=g, gen=gen, fmt=fmt):
                data.copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=gen))
                hi = 255 if fmt == "mxfp4" else 0x7F          # no NaN scale bytes: bit compare stays exact
                s = torch.randint(0, hi, sbytes.shape, dtype=torch.uint8, generator=gen)
                if fmt == "nvfp4":
                    s |= torch.randint(0, 2, s.shape, dtype=torch.uint8, generator=gen) << 7
                    s[(s & 0x7F) == 0x7F] = 0
                sbytes.copy_(s)
                if g is not None:
                    g.copy_(torch.rand(1, generator=gen) + 0.25)

            def run(data=data, scale=scale, g=g, fmt=fmt, out_dtype=out_dtype):
                return dequant_fp4(data, scale, fmt=fmt, global_scale=g, out_dtype=out_dtype)

            refresh()
            cases.append(GraphCase(f"dequant_fp4-{fmt}-{str(out_dtype).split('.')[-1]}", "dequant_fp4", run, refresh,
                                   {"fmt": fmt, "out_dtype": str(out_dtype).split(".")[-1], "K": K,
                                    "device": torch.device(device).type}))
    return cases


CASES: dict[str, Callable[[object], list[GraphCase]]] = {"dequant_fp4": _dequant_fp4_cases}


def _registered_ops() -> list[str]:
    return sorted(op.name for op in registry.all_ops())


def _cases(device) -> list[GraphCase]:
    """CASES plus every ``graph_cases(device)`` hook found in a ``dsv4.ops`` module."""
    out = []
    for op, build in sorted(CASES.items()):
        out.extend(build(device))
    for m in sorted(pkgutil.iter_modules(dsv4.ops.__path__), key=lambda m: m.name):
        if m.name.startswith("_"):
            continue
        hook = getattr(importlib.import_module(f"dsv4.ops.{m.name}"), "graph_cases", None)
        if hook is not None:
            out.extend(c for c in hook(device) if c.op not in CASES)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# --------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("fullgraph", [False, True])
def test_torch_compile_public_dequant_fp4_cpu(fullgraph):
    """torch.compile of the public function (torch provider on CPU; aot_eager keeps CI fast)."""
    c = _dequant_fp4_cases("cpu")[2]   # nvfp4 bf16
    torch._dynamo.reset()
    f = torch.compile(lambda: c.run() * 2, backend="aot_eager", fullgraph=fullgraph)
    assert torch.equal(_bits(f()), _bits(c.run() * 2))


def test_torch_compile_custom_op_fullgraph_cpu():
    """``torch.ops.dsv4.dequant_fp4`` (custom op + fake impl) traces without a graph break."""
    gen = torch.Generator().manual_seed(0)
    d = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=gen)
    s = torch.randint(100, 150, (64, 4), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    torch._dynamo.reset()
    f = torch.compile(lambda d, s: torch.ops.dsv4.dequant_fp4(d, s, None, "mxfp4", torch.float32) + 1,
                      backend="aot_eager", fullgraph=True)
    assert torch.equal(f(d, s), torch.ops.dsv4.dequant_fp4(d, s, None, "mxfp4", torch.float32) + 1)


# --------------------------------------------------------------------------------------- GPU
def _kinds(case: GraphCase) -> list[str]:
    """Providers that can run the case: from its problem dict, or (problem None) by running it."""
    op = registry.get_op(case.op)
    if case.problem is not None:
        t = Target.of("cuda")
        return [k for k in op.kinds if op.check(k, case.problem, t)]
    kinds = []
    for k in op.kinds:
        try:
            with registry.use({case.op: k}):
                case.run()
            kinds.append(k)
        except registry.ProviderUnavailableError:
            pass
    return kinds


def _not_graph_ops() -> dict[str, str]:
    """Ops exempt by design (``NOT_GRAPH_OPS`` in their module), with the reason."""
    out = {}
    for m in pkgutil.iter_modules(dsv4.ops.__path__):
        if not m.name.startswith("_"):
            out.update(getattr(importlib.import_module(f"dsv4.ops.{m.name}"), "NOT_GRAPH_OPS", {}))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dsl", "cuda"])
def test_cuda_graph_capture_and_replay(kind):
    """Per GPU provider: capture once, refresh inputs in place, replay, compare with eager bit for
    bit. The torch references are correctness oracles and are not required to be capturable
    (several build constants on the host or sync); what runs on a GPU in production is dsl/cuda."""
    results = []
    for case in _cases("cuda"):
        if kind not in _kinds(case):
            results.append((case.label, kind, "n/a"))
            continue
        case.refresh()
        with registry.use({case.op: kind}):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):            # warm up (compile, module load) off the capture
                case.run()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = case.run()
            assert registry.last_choice(case.op).kind == kind
            case.refresh()                         # new data in the same buffers
            graph.replay()
            want = case.run()                      # eager, same provider, new data
            torch.cuda.synchronize()
            assert torch.equal(_bits(out), _bits(want)), f"{case.label} [{kind}]: graph replay differs from eager"
            case.refresh()
            graph.replay()                         # replays are repeatable and read the new data
            want = case.run()
            torch.cuda.synchronize()
            assert torch.equal(_bits(out), _bits(want)), f"{case.label} [{kind}]: second replay differs"
            results.append((case.label, kind, "ok"))
    print("\n".join(f"graph {lbl:28s} {k:6s} {r}" for lbl, k, r in results))
    if not any(r == "ok" for _, _, r in results):
        pytest.skip(f"provider {kind} is not available for any case here "
                    f"({registry.get_op('dequant_fp4').check(kind, _cases('cuda')[0].problem, Target.of('cuda')).reason})")


@pytest.mark.gpu
def test_every_registered_op_has_a_graph_case():
    missing = sorted(set(_registered_ops()) - {c.op for c in _cases("cuda")} - set(_not_graph_ops()))
    assert not missing, (f"registered ops without a CUDA-graph case: {missing}; add a builder to "
                         "tests/test_graph_capture.py CASES or define graph_cases(device) in the op's dsv4/ops module")


@pytest.mark.gpu
def test_torch_compile_public_op_gpu():
    """torch.compile (inductor) around each public op on the GPU, default provider."""
    for case in [c for c in _cases("cuda") if c.op == "dequant_fp4"]:   # one op family: inductor compiles are slow
        torch._dynamo.reset()
        fn = torch.compile(lambda case=case: case.run().float() * 2)
        got = fn()
        want = case.run().float() * 2
        torch.cuda.synchronize()
        assert torch.equal(_bits(got), _bits(want)), case.label


@pytest.mark.gpu
def test_torch_compile_custom_op_fullgraph_gpu_with_cudagraphs():
    """``torch.ops.dsv4.dequant_fp4`` under inductor fullgraph + mode='reduce-overhead' (CUDA graphs)."""
    gen = torch.Generator().manual_seed(3)
    d = torch.randint(0, 256, (4096, 3584), dtype=torch.uint8, generator=gen).cuda()
    s = torch.randint(0, 0x7F, (4096, 448), dtype=torch.uint8, generator=gen).cuda().view(torch.float8_e4m3fn)
    g = torch.tensor([0.7], device="cuda")
    torch._dynamo.reset()
    f = torch.compile(lambda d, s, g: torch.ops.dsv4.dequant_fp4(d, s, g, "nvfp4", torch.bfloat16).float() * 2,
                      fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        got = f(d, s, g).clone()
    want = torch.ops.dsv4.dequant_fp4(d, s, g, "nvfp4", torch.bfloat16).float() * 2
    torch.cuda.synchronize()
    assert torch.equal(_bits(got), _bits(want))              # x2 is exact: bit-exact comparison
    assert registry.last_choice("dequant_fp4").kind in ("dsl", "cuda")


def test_graph_cases_run_on_cpu_and_are_idempotent():
    """Each graph case's run() is repeatable (same inputs -> same bytes) and refresh() changes
    its output: the GPU test's graph-vs-eager comparison is meaningful (CPU, torch providers)."""
    with registry.use({"*": "torch"}):
        for case in _cases("cpu"):
            a = case.run().clone()
            assert torch.equal(_bits(a), _bits(case.run())), case.label
            case.refresh()
            assert not torch.equal(_bits(a), _bits(case.run())), f"{case.label}: refresh() did not change the output"


def test_every_registered_op_has_a_graph_case_or_a_reason():
    covered = {c.op for c in _cases("cpu")} | set(_not_graph_ops())
    assert set(_registered_ops()) <= covered, sorted(set(_registered_ops()) - covered)
    assert all(_not_graph_ops().values())
