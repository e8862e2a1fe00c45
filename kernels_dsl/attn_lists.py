"""CuTe DSL provider of ``attn_lists``: the SWA window lists and the CSA / HCA compressed lists of
every query row, with their lengths, in one launch.

Contract: docs/layouts/attn_lists.md (``dsv4.ops.attn_lists.SPEC``); the semantics are those of
the torch provider (:func:`dsv4.ops.sparse_attention.window_slots`, ``compressed_slots``,
``hca_slots``), bit for bit. Elementwise: the flat outputs are cut in chunks of 4 int32 (16
bytes) and each thread owns one chunk:

* chunks ``[0, n_a)``: ``swa_slots`` (flat ``[T * window]``). Element ``(t, j)``:
  ``n = min(clamp(p + 1, 0, window), max(p - first + 1, 0))``; ``j < n`` -> position
  ``p - n + 1 + j``, logical slot ``pos % ring`` (ring) or ``pos`` (linear), else -1;
* chunks ``[n_a, n_a + n_b)``: ``slots`` (flat ``[T * K]``): CSA ``l = entries[t, j]`` (the 4
  entries of the chunk come in one 16-byte load), HCA ``l = j < min(max(p + 1, 0) // ratio,
  max_entries) ? j : -1``;
* chunks ``[n_a + n_b, n_a + n_b + n_c)``: 4 rows each of ``swa_lens`` and ``lens`` (CSA: the
  given ``lens`` converted to int32, or K; HCA: the entry count).

Logical slot ``l`` -> physical slot ``block_table[r, l // bs] * bs + l % bs`` where every check
comes first: ``l < 0``, a request ``r`` outside ``[0, R)``, a page index ``>= max_pages``, a page
value ``< 0`` or ``>= num_blocks`` (when given) or a slot above ``2^31 - 1`` give -1, so a bad
position, request id or block-table value is never dereferenced outside the table. Positions,
request ids, ``first`` and page math are int64 (positions may be int64 tensors); full chunks
are stored with ``st.global.v4.b32``, the tail of each output with scalar stores.

Walls: none. One compile per ``(kind, positions / req_idx / first / lens dtypes, arch)``; every
size is a runtime value.

Bit-identical to the torch provider (tests/test_attn_lists.py, GPU: adversarial int64 / bad-id /
empty-table / slot-overflow cases, random, the ``dsv4 run`` shapes, T = 4099 x K = 1024, strided
entries, CUDA-graph capture + replay); timings: docs/benchmarks.md. At T = 16 rows the launch has
only 2-10 CTAs and is latency-bound: each thread's 4 elements do dependent position -> request ->
block-table loads (hoisting the per-row loads once per chunk and one element per thread are the
next steps).
"""
from __future__ import annotations

from typing import Optional

from dsv4.registry import Support

from ._compile import (DslProvider, compile_cached, compile_options, compile_variants, dl, dsl_target_support,
                       launch_on)
from ._compile import i32 as _i32, i64 as _i64   # (i32 / i64 are local names below)

try:  # the DSL is optional at import time: the provider then reports "unavailable"
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["AttnListsKernel", "DslAttnLists", "PROVIDERS", "compile_check", "PTX_PATTERNS", "THREADS"]

#: what every compiled variant's PTX must contain (tests/test_compile_dsl.py): sm_90a, 16-byte stores
PTX_PATTERNS = (r"\.target\s+sm_90a", r"st\.global\.v4\.(b|u|s)32")
#: threads per CTA (one 4-element chunk each)
THREADS = 256
#: int32 slot ids: a larger physical slot is -1
_I32_MAX = 2 ** 31 - 1
KINDS = ("swa", "csa", "hca")
#: element alignment of the 1-D inputs (int64: one 8-byte load, not two 4-byte ones)
_ALIGN = {"int32": 4, "int64": 8}

if _HAVE_DSL:

    def _dtype(name: str):
        return {"int32": Int32, "int64": Int64}[name]

    class AttnListsKernel:
        """All attention index lists of one step (module docstring), one launch.

        ``__call__(mPos, mReq, mFirst, mSwaBt, mWs, mWl, mEnt, mLensIn, mBt, mCs, mCl, window, ring,
        first_s, swa_bs, swa_nb, swa_rows, width, bs, nb, rows, ratio, n_a, n_b, n_c, n_blk, stream)``:

        * ``mPos``, ``mReq``: ``[T]`` Int32/Int64; ``mFirst``: ``[T]`` Int32/Int64 or ``None``
          (then ``first_s``, Int64);
        * ``mSwaBt`` Int32 ``[Rs, Ps]`` row-major (``swa_rows`` = Rs, 0 = empty table);
        * ``mWs`` Int32 ``[T, window]`` row-major, ``mWl`` Int32 ``[T]`` (outputs, 16-byte aligned;
          written flat through their base pointers);
        * CSA / HCA: ``mBt`` Int32 ``[R, P]`` (``rows`` = R), ``mCs`` Int32 ``[T, width]`` row-major,
          ``mCl`` Int32 ``[T]``; CSA also ``mEnt`` Int32 flat ``[T * width]`` (16-byte aligned)
          and ``mLensIn`` ``[T]`` Int32/Int64 or ``None`` (then ``lens = width``);
        * ``ring``: Int64, 0 = linear window; ``swa_nb`` / ``nb``: pages of each cache (2^63 - 1 =
          no check); ``bs`` / ``swa_bs``, ``ratio``: Int64 >= 1; ``n_a, n_b, n_c``: chunk counts,
          ``n_blk = ceil((n_a + n_b + n_c) / THREADS)``.

        Constraints: ``T * window`` and ``T * width`` < 2^31 (flat int32 offsets).
        """

        def __init__(self, kind: str, pos_dtype, req_dtype, first_dtype, lens_dtype):
            if kind not in KINDS:
                raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
            self.kind = kind
            self.pos_dtype, self.req_dtype = pos_dtype, req_dtype
            self.has_first = first_dtype is not None
            self.has_lens = lens_dtype is not None

        @cute.jit
        def __call__(self, mPos: cute.Tensor, mReq: cute.Tensor, mFirst: Optional[cute.Tensor], mSwaBt: cute.Tensor,
                     mWs: cute.Tensor, mWl: cute.Tensor, mEnt: Optional[cute.Tensor], mLensIn: Optional[cute.Tensor],
                     mBt: Optional[cute.Tensor], mCs: Optional[cute.Tensor], mCl: Optional[cute.Tensor],
                     window: Int32, ring: Int64, first_s: Int64, swa_bs: Int64, swa_nb: Int64, swa_rows: Int32,
                     width: Int32, bs: Int64, nb: Int64, rows: Int32, ratio: Int64,
                     n_a: Int32, n_b: Int32, n_c: Int32, n_blk: Int32, stream: cuda.CUstream):
            self.kernel(mPos, mReq, mFirst, mSwaBt, mWs, mWl, mEnt, mLensIn, mBt, mCs, mCl, window, ring, first_s,
                        swa_bs, swa_nb, swa_rows, width, bs, nb, rows, ratio, n_a, n_b, n_c).launch(
                grid=[n_blk, 1, 1], block=[THREADS, 1, 1], stream=stream)

        # -------------------------------------------------------------------------- per element
        @cute.jit
        def _page_slot(self, mBt: cute.Tensor, rows: Int32, r: Int64, l: Int64, bs: Int64, nb: Int64) -> Int32:
            """Logical slot ``l`` of request ``r`` -> physical slot, or -1 (every check before the load)."""
            out = Int32(-1)
            if l >= Int64(0) and r >= Int64(0) and r < Int64(rows):
                pi = l // bs
                if pi < Int64(mBt.shape[1]):
                    page = Int64(mBt[Int32(r), Int32(pi)])
                    if page >= Int64(0) and page < nb:
                        s = page * bs + (l - pi * bs)
                        if s <= Int64(_I32_MAX):
                            out = Int32(s)
            return out

        @cute.jit
        def _first(self, mFirst: Optional[cute.Tensor], first_s: Int64, t: Int32) -> Int64:
            f = first_s
            if cutlass.const_expr(self.has_first):
                f = Int64(mFirst[t])
            return f

        @cute.jit
        def _window_len(self, p: Int64, f: Int64, window: Int32) -> Int64:
            """``min(clamp(p + 1, 0, window), max(p - f + 1, 0))`` (two's-complement int64, as torch)."""
            a = cutlass.min(cutlass.max(p + Int64(1), Int64(0)), Int64(window))
            b = cutlass.max(p - f + Int64(1), Int64(0))
            return Int64(cutlass.min(a, b))

        @cute.jit
        def _hca_len(self, p: Int64, ratio: Int64, width: Int32) -> Int64:
            return Int64(cutlass.min(cutlass.max(p + Int64(1), Int64(0)) // ratio, Int64(width)))

        @cute.jit
        def _swa_slot(self, mPos, mReq, mFirst, mSwaBt, t: Int32, j: Int32, window: Int32, ring: Int64,
                      first_s: Int64, swa_bs: Int64, swa_nb: Int64, swa_rows: Int32) -> Int32:
            p = Int64(mPos[t])
            n = self._window_len(p, self._first(mFirst, first_s, t), window)
            out = Int32(-1)
            if Int64(j) < n:
                pos = p - n + Int64(1) + Int64(j)
                l = pos
                if ring > Int64(0):
                    l = pos % ring
                out = self._page_slot(mSwaBt, swa_rows, Int64(mReq[t]), l, swa_bs, swa_nb)
            return out

        # -------------------------------------------------------------------------- kernel
        @cute.kernel
        def kernel(self, mPos: cute.Tensor, mReq: cute.Tensor, mFirst: Optional[cute.Tensor], mSwaBt: cute.Tensor,
                   mWs: cute.Tensor, mWl: cute.Tensor, mEnt: Optional[cute.Tensor], mLensIn: Optional[cute.Tensor],
                   mBt: Optional[cute.Tensor], mCs: Optional[cute.Tensor], mCl: Optional[cute.Tensor],
                   window: Int32, ring: Int64, first_s: Int64, swa_bs: Int64, swa_nb: Int64, swa_rows: Int32,
                   width: Int32, bs: Int64, nb: Int64, rows: Int32, ratio: Int64,
                   n_a: Int32, n_b: Int32, n_c: Int32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            g = bidx * THREADS + tidx
            ntok = mPos.shape[0]
            st16 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
            rS = cute.make_rmem_tensor((4,), Int32)
            if g < n_a:
                # ---- SWA window slots, flat [T * window]
                N = ntok * window
                e0 = g * 4
                for i in cutlass.range_constexpr(4):
                    e = e0 + i
                    v = Int32(-1)
                    if e < N:
                        t = e // window
                        v = self._swa_slot(mPos, mReq, mFirst, mSwaBt, t, e - t * window, window, ring, first_s,
                                           swa_bs, swa_nb, swa_rows)
                    rS[i] = v
                self._store4(st16, mWs, rS, e0, N)
            else:
                if cutlass.const_expr(self.kind != "swa"):
                    c = g - n_a
                    if c < n_b:
                        # ---- compressed slots, flat [T * width]
                        N = ntok * width
                        e0 = c * 4
                        rE = cute.make_rmem_tensor((4,), Int32)
                        if cutlass.const_expr(self.kind == "csa"):
                            rE.fill(-1)
                            if e0 + 4 <= N:
                                gE = cute.zipped_divide(cute.make_tensor(mEnt.iterator, cute.make_layout(N)), (4,))
                                ld16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), Int32, num_bits_per_copy=128,
                                                           invariant=True)
                                cute.copy(ld16, gE[(None, c)], rE)
                            else:
                                for i in cutlass.range_constexpr(4):
                                    if e0 + i < N:
                                        rE[i] = mEnt[e0 + i]
                        for i in cutlass.range_constexpr(4):
                            e = e0 + i
                            v = Int32(-1)
                            if e < N:
                                t = e // width
                                j = e - t * width
                                l = Int64(-1)
                                if cutlass.const_expr(self.kind == "csa"):
                                    l = Int64(rE[i])
                                else:
                                    if Int64(j) < self._hca_len(Int64(mPos[t]), ratio, width):
                                        l = Int64(j)
                                v = self._page_slot(mBt, rows, Int64(mReq[t]), l, bs, nb)
                            rS[i] = v
                        self._store4(st16, mCs, rS, e0, N)
                    else:
                        self._lens_chunk(st16, rS, mPos, mFirst, mWl, mLensIn, mCl, c - n_b, n_c, window, first_s,
                                         width, ratio)
                else:
                    self._lens_chunk(st16, rS, mPos, mFirst, mWl, mLensIn, mCl, g - n_a, n_c, window, first_s,
                                     width, ratio)

        @cute.jit
        def _lens_chunk(self, st16, rS: cute.Tensor, mPos: cute.Tensor, mFirst: Optional[cute.Tensor],
                        mWl: cute.Tensor, mLensIn: Optional[cute.Tensor], mCl: Optional[cute.Tensor], c: Int32,
                        n_c: Int32, window: Int32, first_s: Int64, width: Int32, ratio: Int64):
            """Rows ``4c .. 4c + 3``: ``swa_lens`` and (CSA / HCA) ``lens``."""
            if c < n_c:
                ntok = mPos.shape[0]
                t0 = c * 4
                for i in cutlass.range_constexpr(4):
                    t = t0 + i
                    v = Int32(0)
                    if t < ntok:
                        v = Int32(self._window_len(Int64(mPos[t]), self._first(mFirst, first_s, t), window))
                    rS[i] = v
                self._store4(st16, mWl, rS, t0, ntok)
                if cutlass.const_expr(self.kind != "swa"):
                    for i in cutlass.range_constexpr(4):
                        t = t0 + i
                        v = Int32(0)
                        if t < ntok:
                            if cutlass.const_expr(self.kind == "hca"):
                                v = Int32(self._hca_len(Int64(mPos[t]), ratio, width))
                            elif cutlass.const_expr(self.has_lens):
                                v = Int32(mLensIn[t])       # int64 lens: low 32 bits, as torch's .to(int32)
                            else:
                                v = width
                        rS[i] = v
                    self._store4(st16, mCl, rS, t0, ntok)

        @cute.jit
        def _store4(self, st16, mOut: cute.Tensor, rS: cute.Tensor, e0: Int32, N: Int32):
            """Elements ``e0 .. e0 + 3`` of an int32 output seen flat (``N`` elements from its base pointer;
            a row-major 2-D output too): one 16-byte store, scalar at the tail."""
            gF = cute.make_tensor(mOut.iterator, cute.make_layout(N))
            if e0 + 4 <= N:
                gO = cute.zipped_divide(gF, (4,))
                cute.copy(st16, rS, gO[(None, e0 // 4)])
            else:
                for i in cutlass.range_constexpr(4):
                    if e0 + i < N:
                        gF[e0 + i] = rS[i]


# ---------------------------------------------------------------------------------- compile
def _fake(kind: str, pos: str, req: str, first: Optional[str], lens: Optional[str]):
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    t = cute.sym_int32(symbol="T")
    mpos = make_fake_compact_tensor(_dtype(pos), (t,), assumed_align=_ALIGN[pos])
    mreq = make_fake_compact_tensor(_dtype(req), (t,), assumed_align=_ALIGN[req])
    mfirst = make_fake_compact_tensor(_dtype(first), (t,), assumed_align=_ALIGN[first]) if first else None
    swa_bt = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="RS"), cute.sym_int32(symbol="PS")),
                                      stride_order=(1, 0), assumed_align=4)
    # the outputs as allocated ([T, window], [T, width] row-major): the kernel only takes their base pointers
    ws = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="WT"), cute.sym_int32(symbol="WW")),
                                  stride_order=(1, 0), assumed_align=16)
    wl = make_fake_compact_tensor(Int32, (t,), assumed_align=16)
    ent = lens_in = bt = cs = cl = None
    if kind != "swa":
        bt = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="R"), cute.sym_int32(symbol="P")),
                                      stride_order=(1, 0), assumed_align=4)
        cs = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="CT"), cute.sym_int32(symbol="CW")),
                                      stride_order=(1, 0), assumed_align=16)
        cl = make_fake_compact_tensor(Int32, (t,), assumed_align=16)
        if kind == "csa":
            ent = make_fake_compact_tensor(Int32, (cute.sym_int32(symbol="NE"),), assumed_align=16)
            if lens:
                lens_in = make_fake_compact_tensor(_dtype(lens), (t,), assumed_align=_ALIGN[lens])
    i32, i64 = Int32(1), Int64(1)
    return (mpos, mreq, mfirst, swa_bt, ws, wl, ent, lens_in, bt, cs, cl, i32, i64, i64, i64, i64, i32, i32, i64, i64,
            i32, i64, i32, i32, i32, i32, make_fake_stream())


def _compile(kind, pos, req, first, lens, arch, extra=""):
    kern = AttnListsKernel(kind, _dtype(pos), _dtype(req), _dtype(first) if first else None,
                           _dtype(lens) if lens else None)
    return cute.compile(kern, *_fake(kind, pos, req, first, lens), options=compile_options(arch, extra))


#: specializations compiled by :func:`compile_check`: the three ``dsv4 run`` layers (int64
#: positions, int32 request ids, scalar ``first``) plus per-row ``first`` and int64 ``lens``
CHECK_VARIANTS = {
    "swa-pos_int64-req_int32": lambda a, x: _compile("swa", "int64", "int32", None, None, a, x),
    "csa-pos_int64-req_int32": lambda a, x: _compile("csa", "int64", "int32", None, None, a, x),
    "hca-pos_int64-req_int32": lambda a, x: _compile("hca", "int64", "int32", None, None, a, x),
    "csa-pos_int32-req_int64-first_int32-lens_int64":
        lambda a, x: _compile("csa", "int32", "int64", "int32", "int64", a, x),
}


def compile_check(dump_dir: Optional[str] = None, arch: str = "sm_90a", variants=None) -> dict[str, str]:
    """Compile the :data:`CHECK_VARIANTS` for ``arch`` without a GPU; ``{variant: PTX text}``."""
    return compile_variants("attn_lists", CHECK_VARIANTS, dump_dir, arch, variants)


# ---------------------------------------------------------------------------------- provider
_dl = dl


def _pages(num_blocks: int) -> int:
    """-1 (no range check) -> 2^63 - 1, so the kernel's check is one compare."""
    return num_blocks if num_blocks >= 0 else 2 ** 63 - 1


def _dt(t) -> str:
    return str(t.dtype).replace("torch.", "")


class DslAttnLists(DslProvider):
    describe = ("CuTe DSL AttnListsKernel: SWA window + CSA top-k / HCA dense lists and lengths in one "
                "elementwise launch (16-byte stores, int64 page math, bad ids never dereferenced)")

    def supports(self, problem, target):
        no = dsl_target_support(target)
        if no is not None:
            return no
        if problem["T"] * max(problem["window"], problem["width"]) >= 2 ** 31:
            return Support.no("dsl: T * max(window, K) >= 2^31 (flat int32 offsets)")
        return Support.yes("sm_90a")

    def run(self, problem, *, positions, req_idx, swa_block_table, swa_block_size, window, ring, first, first_scalar,
            swa_num_blocks, kind, block_table, block_size, entries, lens, max_entries, ratio, num_blocks):
        import torch

        from dsv4.target import Target
        dev = positions.device
        T = positions.shape[0]
        K = 0 if kind == "swa" else (entries.shape[1] if kind == "csa" else max_entries)
        i32 = dict(dtype=torch.int32, device=dev)
        ws = torch.empty((T, window), **i32)
        wl = torch.empty((T,), **i32)
        cs = torch.empty((T, K), **i32)
        cl = torch.empty((T if kind != "swa" else 0,), **i32)
        if T == 0:
            return ws, wl, cs, cl
        dummy = torch.empty((4,), **i32)      # stands in for an empty tensor: never read or written (no launch)

        def table(bt):
            bt = bt.contiguous()
            if bt.numel() == 0:
                return _dl(dummy.view(1, 4), 4), 0
            return _dl(bt, 4), bt.shape[0]

        swa_t, swa_rows = table(swa_block_table)
        bt_t, rows = (None, 0) if kind == "swa" else table(block_table)
        ent_t = None
        if kind == "csa":
            e = entries.contiguous().view(-1)
            if e.numel() == 0:
                e = dummy
            elif e.data_ptr() % 16:
                e = e.clone()
            ent_t = _dl(e, 16)
        lens_t = _dl(lens.contiguous(), _ALIGN[_dt(lens)]) if (kind == "csa" and lens is not None) else None
        first_t = _dl(first.contiguous(), _ALIGN[_dt(first)]) if first is not None else None
        n_a = -(-T * window // 4)
        n_b = -(-T * K // 4)
        n_c = -(-T // 4)
        n_blk = -(-(n_a + n_b + n_c) // THREADS)
        arch = Target.of(dev).arch
        key = ("attn_lists", kind, _dt(positions), _dt(req_idx), _dt(first) if first is not None else None,
               _dt(lens) if lens_t is not None else None, arch)
        fn = compile_cached(key, lambda: _compile(kind, key[2], key[3], key[4], key[5], arch))
        args = (_dl(positions.contiguous(), _ALIGN[key[2]]), _dl(req_idx.contiguous(), _ALIGN[key[3]]), first_t,
                swa_t, _dl(ws if ws.numel() else dummy.view(1, 4), 16),
                _dl(wl, 16), ent_t, lens_t, bt_t,
                None if kind == "swa" else _dl(cs if cs.numel() else dummy.view(1, 4), 16),
                None if kind == "swa" else _dl(cl, 16),
                _i32(window), _i64(ring), _i64(first_scalar), _i64(swa_block_size), _i64(_pages(swa_num_blocks)),
                _i32(swa_rows), _i32(K), _i64(block_size), _i64(_pages(num_blocks)), _i32(rows), _i64(ratio),
                _i32(n_a), _i32(n_b), _i32(n_c), _i32(n_blk))
        launch_on(dev, fn, *args)
        return ws, wl, cs, cl


PROVIDERS = {"attn_lists": DslAttnLists}
