"""Measurement shared by ``dsv4 run`` (dsv4/pipeline.py, dsv4/cli.py) and the benchmarks
(bench/_util.py): the timer, the copy-bandwidth roofline, the measured peaks, strict JSON.

* :func:`time_us`: median microseconds per call. CUDA: warm-up, then the call is captured in a
  CUDA graph (on a side stream) and its replays are timed with CUDA events, one pair per replay:
  kernel time without Python / launch overhead. If capture fails (and ``fallback``), the call is
  timed eagerly, events around each call, and the returned "how" says so. CPU: wall clock, mean
  of the repetitions.
* :func:`copy_bandwidth`: the measured device-to-device copy bandwidth (bytes read + written),
  the memory roofline; timed eagerly: inside a CUDA graph a D2D ``copy_`` becomes a memcpy node
  run by the DMA copy engine (~2.7 TB/s on the H200) instead of the SM copy kernel (~4.2 TB/s).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

import torch

__all__ = ["time_us", "copy_bandwidth", "json_safe", "FP8_PEAK_TFLOPS", "BF16_PEAK_TFLOPS"]

#: Dense tensor-core peaks measured on the project's H200 (shared/reference/anchors.md section 4 and
#: cutedsl_guide.md: CUTLASS CuTe DSL Hopper GEMM at 8192^3): the FLOP rooflines. Benchmarks that
#: can afford it re-measure with ``torch._scaled_mm`` / ``torch.matmul`` in the same run.
FP8_PEAK_TFLOPS = 1716.0
BF16_PEAK_TFLOPS = 790.0


def _events(run: Callable[[], Any], reps: int) -> float:
    pairs = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        pairs.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


def time_us(fn: Callable[[], Any], device: torch.device | str = "cuda", reps: int = 20, *, warmup: int = 1,
            graph: bool = True, fallback: bool = True) -> tuple[float, str]:
    """``(microseconds per call, how)``; ``how`` is ``"graph"``, ``"eager"`` or ``"wall"`` (CPU).

    Raises whatever ``fn`` or the capture raises when ``fallback`` is False."""
    if torch.device(device).type != "cuda":
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6, "wall"
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if not graph:
        return _events(fn, reps), "eager"
    try:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                 # module loads / compiles off the capture
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        return _events(g.replay, reps), "graph"
    except Exception:  # noqa: BLE001 - not capturable: time it eagerly and say so
        if not fallback:
            raise
        torch.cuda.synchronize()
        return _events(fn, reps), "eager"


_BW: dict[tuple, float] = {}


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int | None = None) -> float:
    """Copy bandwidth of ``device`` in GB/s, bytes read + written (memoized per device and size).
    Default size: 2 GiB on CUDA (far beyond L2), 64 MiB on CPU."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    n = nbytes or ((2 << 30) if device.type == "cuda" else (64 << 20))
    key = (str(device), n)
    if key not in _BW:
        a = torch.empty(n // 4, dtype=torch.float32, device=device).uniform_()
        b = torch.empty_like(a)
        if device.type == "cuda":
            for _ in range(10):                                 # let the clocks ramp up first
                b.copy_(a)
            us = _events(lambda: b.copy_(a), 20)
        else:
            us, _ = time_us(lambda: b.copy_(a), device, 3, warmup=0)
        _BW[key] = 2 * n / (us * 1e-6) / 1e9
        del a, b
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return _BW[key]


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf) replaced by ``None`` (recursively through
    dicts, lists and tuples), so that ``json.dump`` writes valid JSON (``null``) instead of ``NaN``."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
