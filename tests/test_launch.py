"""kernels_cuda/nvrtc.py launch helpers that need no GPU: the cached launch shapes and the
parameter packing of the direct driver path (``FAST_LAUNCH``; its GPU check is job shape-02)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kernels_cuda import nvrtc


@pytest.mark.parametrize("codes,values", [
    (("P", "q", "i", "P", "i", "f"), [0x1234, -(1 << 40), 7, 0xDEADBEEF00, -1, 1.5]),
    (("i", "P"), [3, 0x10]),                      # pointer after an int: padded to 8
    (("B", "H", "I", "Q", "f", "?"), [200, 60000, 4000000000, (1 << 63) + 5, 2.25, True]),
    ((), []),
])
def test_packer_places_each_parameter_at_its_natural_alignment(codes, values):
    p = nvrtc._Packer(codes)
    params = p.pack(values)
    ct = {"P": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float, "B": ctypes.c_uint8,
          "H": ctypes.c_uint16, "I": ctypes.c_uint32, "Q": ctypes.c_uint64, "?": ctypes.c_bool}
    base = ctypes.addressof(p.buf)
    for i, (c, v) in enumerate(zip(codes, values)):
        addr = params[i]
        assert (addr - base) % ctypes.sizeof(ct[c]) == 0, (c, addr - base)
        assert ct[c].from_address(addr).value == v, (c, v)
    assert p.pack(values) is params                # the buffer is reused (the driver copies at launch)


def test_launch_rejects_bare_python_numbers_before_anything_else():
    with pytest.raises(TypeError, match="bare Python int"):
        nvrtc.launch(object(), 1, 32, np.int32(1), 5)
    with pytest.raises(TypeError, match="bare Python float"):
        nvrtc.launch(object(), 1, 32, 1.0)


def test_dims_pad_to_three():
    assert nvrtc._dims(4) == (4, 1, 1) and nvrtc._dims((2, 3)) == (2, 3, 1) and nvrtc._dims([1, 2, 3]) == (1, 2, 3)
