"""Shared benchmark helpers: timing with CUDA events (median), the measured copy-bandwidth
roofline, the ratio table and JSON output. Import as ``from bench._util import ...`` (run
benchmarks from the repo root with ``PYTHONPATH=.`` or through ``dsv4 bench OP``).

Method (shared/reference + the device METHOD.md): warm up, then time many repetitions with
CUDA events and report the median; rotate among several input sets whose total size exceeds
the 60 MB L2 so that the cache does not flatter memory-bound kernels; measure the device
copy bandwidth (bytes read + written) in the same process and use it as the ceiling.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from typing import Any, Callable, Sequence

import torch

from dsv4.measure import BF16_PEAK_TFLOPS, FP8_PEAK_TFLOPS, json_safe, time_us  # noqa: F401  (re-exported)
from dsv4.measure import copy_bandwidth as _copy_bandwidth

__all__ = ["time_cuda", "time_graph", "CallGraph", "event_us", "time_flush_l2", "copy_bandwidth", "env_info", "print_table", "save_json",
           "json_safe", "FP8_PEAK_TFLOPS", "BF16_PEAK_TFLOPS", "rotating"]



def time_cuda(fn: Callable[[], Any], *, warmup: int = 5, iters: int = 50, graph: bool = False) -> float:
    """Median time of ``fn()`` in microseconds, timed with CUDA events per call
    (:func:`dsv4.measure.time_us`, the timer ``dsv4 run`` uses).

    With ``graph=True`` the call is captured in a CUDA graph and replays are timed (hides
    launch overhead; use for multi-launch sequences when measuring the kernels themselves).
    """
    return time_us(fn, "cuda", iters, warmup=warmup, graph=graph, fallback=False)[0]


class CallGraph:
    """A CUDA graph of ``n`` back-to-back calls ``fns[i % len(fns)]()``, built after one eager warm-up call of each
    ``fns[:warm]`` and one call on a side stream (module loads, compiles, allocator pools stay off the capture);
    ``ctx`` (a context-manager factory, e.g. a tvm-ffi stream context) is entered around the calls.
    :meth:`time` = median microseconds per call over ``reps`` replays (rotate ``fns`` over input copies larger
    than L2 for memory-bound kernels)."""

    def __init__(self, fns: Sequence[Callable[[], Any]], n: int, ctx: Callable[[], Any] | None = None,
                 warm: int | None = None):
        import contextlib
        ctx = ctx or contextlib.nullcontext
        with ctx():
            for f in fns[:warm]:
                f()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), ctx():
            fns[0]()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.g, self.n = torch.cuda.CUDAGraph(), n
        with torch.cuda.graph(self.g), ctx():
            for i in range(n):
                fns[i % len(fns)]()
        self.g.replay()
        torch.cuda.synchronize()

    def time(self, reps: int) -> float:
        ts = [event_us(self.g.replay) / self.n for _ in range(reps)]
        return statistics.median(ts)


def event_us(fn: Callable[[], Any]) -> float:
    """Microseconds of one call ``fn()`` between two CUDA events on the current stream (host time between
    them included: for one eager call, that is what a caller waits)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def time_graph(fns: Sequence[Callable[[], Any]], iters: int = 40, reps: int = 15) -> float:
    """Median microseconds per call of ``fns[i % len(fns)]`` replayed inside one CUDA graph of
    ``iters`` calls (:class:`CallGraph`)."""
    return CallGraph(fns, iters).time(reps)


def time_flush_l2(fn: Callable[[], Any], *, warmup: int = 3, rep: int = 20) -> float:
    """Median time of ``fn()`` in microseconds with the L2 cache flushed before every call
    (``triton.testing.do_bench``, ``return_mode="median"``; ``warmup`` / ``rep`` are its budgets in
    milliseconds). Use for single large kernels whose inputs would otherwise stay L2-resident."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def rotating(make: Callable[[int], Any], total_bytes_each: int, min_total: int = 256 << 20) -> list:
    """Build enough input sets (``make(i)``) that together they exceed ``min_total`` bytes (> L2)."""
    n = max(1, min(16, -(-min_total // max(1, total_bytes_each))))
    return [make(i) for i in range(n)]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + written
    (:func:`dsv4.measure.copy_bandwidth`, memoized)."""
    return _copy_bandwidth("cuda", nbytes)


def env_info() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, cc=f"{p.major}.{p.minor}")
    return info


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str = "") -> None:
    """Plain fixed-width table (the device tool returns the tail of stdout)."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    w = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(columns)]
    if title:
        print(title)
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(columns)))
    for x in cells:
        print("  ".join(v.ljust(w[i]) for i, v in enumerate(x)))


def save_json(path: str | None, payload: dict) -> None:
    """Write ``{"env": env_info(), **payload}`` to ``path`` (no-op when ``path`` is empty) as strict
    JSON: NaN / inf become ``null`` (:func:`json_safe`), other non-JSON values their ``str()``."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_safe(dict(env=env_info(), **payload)), f, indent=1, default=str, allow_nan=False)
