"""kernels_cuda/nvrtc.py launch helpers that need no GPU: argument conversion and checks, the cached
launch shapes (the launch itself runs in every GPU test of a cuda provider)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_cuda import nvrtc


def test_launch_rejects_bare_python_numbers_before_anything_else():
    with pytest.raises(TypeError, match="bare Python int"):
        nvrtc.launch(object(), 1, 32, np.int32(1), 5)
    with pytest.raises(TypeError, match="bare Python float"):
        nvrtc.launch(object(), 1, 32, 1.0)
    with pytest.raises(TypeError, match="argument 0 is a bare Python bool"):
        nvrtc.launch(object(), 1, 32, True)


def test_launch_passes_tensors_as_pointers_and_keeps_the_rest(monkeypatch):
    seen = []
    monkeypatch.setattr(nvrtc, "_core_launch", lambda *a: seen.append(a))
    monkeypatch.setattr(nvrtc, "_stream", lambda: "stream")
    monkeypatch.setattr(nvrtc, "_config", lambda *a: a)
    x = torch.zeros(4)
    desc = object()                                     # e.g. a TensorMapDescriptor: passed through
    nvrtc.launch("k", 3, 64, x, np.int32(-7), np.int64(1 << 40), desc, x[1:], smem=128, cluster=2)
    (a,) = seen
    assert a[:3] == ("stream", (3, 64, 128, 2, False), "k")
    assert a[3] == x.data_ptr() and a[4] == np.int32(-7) and type(a[4]) is np.int32 and type(a[5]) is np.int64
    assert a[6] is desc and a[7] == x.data_ptr() + 4


def test_launch_configs_are_built_once_per_shape(monkeypatch):
    import cuda.core
    built = []

    class LC:
        def __init__(self, **kw):
            built.append(kw)
    monkeypatch.setattr(cuda.core, "LaunchConfig", LC)
    monkeypatch.setattr(nvrtc, "_configs", {})
    c1 = nvrtc._config(4, 128, 0, None)
    assert nvrtc._config(4, 128, 0, None) is c1 and len(built) == 1
    c2 = nvrtc._config([2, 2], (128, 1), 1024, [2, 1])   # lists are keyed as tuples
    assert nvrtc._config((2, 2), [128, 1], 1024, (2, 1)) is c2 and c2 is not c1
    assert built[1] == {"grid": [2, 2], "block": (128, 1), "shmem_size": 1024, "cluster": [2, 1]}
    c3 = nvrtc._config(4, 128, 0, None, True)            # programmatic dependent launch: its own config
    assert c3 is not c1 and nvrtc._config(4, 128, 0, None, True) is c3 and len(built) == 3
    assert built[2] == {"grid": 4, "block": 128, "shmem_size": 0, "programmatic_stream_serialization": True}


def test_pdl_launch_reaches_the_config_and_records_plainly(monkeypatch):
    """``pdl=True`` selects the programmatic-stream-serialization config; a recording plan's hook sees the
    same (kernel, grid, block, args, smem, cluster) as for a plain launch (its replay launches plainly)."""
    seen, hooked = [], []
    monkeypatch.setattr(nvrtc, "_core_launch", lambda *a: seen.append(a))
    monkeypatch.setattr(nvrtc, "_stream", lambda: "stream")
    monkeypatch.setattr(nvrtc, "_config", lambda *a: a)
    monkeypatch.setattr(nvrtc, "_launch_hook", lambda *a: hooked.append(a))
    x = torch.zeros(4)
    for pdl in (True, False):
        nvrtc.launch("k", 2, 32, x, np.int32(3), smem=64, cluster=None, pdl=pdl)
    assert [a[1] for a in seen] == [(2, 32, 64, None, True), (2, 32, 64, None, False)]
    assert hooked[0] == hooked[1] == ("k", 2, 32, (x, np.int32(3)), 64, None)

