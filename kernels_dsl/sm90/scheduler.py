"""Device-side tile scheduling of the sm_90a persistent GEMMs (CuTe DSL device functions): the ids every
persistent CTA starts from (:func:`cta_ids`, also used by kernels_dsl/fp8_gemm.py) and the grouped GEMMs'
expert tile schedule.

Grouped layout contract (``dsv4.ops.moe.MoEGrouped``, from ``moe_permute``): expert ``e`` owns
grouped rows ``[row_start[e], row_start[e] + row_count[e])``. The *contiguous* layout (rows
sorted by expert) and the *masked* layout (``row_start[e] = e * max_m``, counts <= max_m) are the
same thing to the kernel: it only reads ``row_start`` / ``row_count``, so one scheduler serves
both, and an expert with no rows costs nothing (it owns no work unit).

Work units: expert ``e`` has ``ceil(c_e / tile_m)`` M-tiles of token rows; the units of a launch
are (global M-tile, N-tile) pairs enumerated M-tile-major (the N-tiles of one token tile are
consecutive: the CTAs working at the same time share the token tile through L2 and sweep the
expert's weight tiles together). Persistent CTAs take units ``bid, bid + grid, ...``.

Bad input (documented, tested): ``c_e = clamp(row_count[e], 0, R - row_start[e])`` when
``0 <= row_start[e] < R``, else 0: a tile never reads activation rows outside ``[0, R)`` (the TMA
box is clipped by the hardware and zero-filled), never stores outside the expert's valid rows,
and only ever addresses weights of experts ``0 <= e < E`` (the unit's expert comes from the
table, never from data), so no row_start / row_count value can fault the device. Overlapping
ranges (invalid input) give unspecified (but in-bounds) results.

The table lives in shared memory (``3 * e_cap + 4`` int32, built by every CTA at launch, no
global workspace, no host sync): ``prefix[0..E]`` (M-tile prefix sums), ``rstart[e]``, ``count[e]``.
"""
from __future__ import annotations

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    _HAVE_DSL = True
except Exception:  # noqa: BLE001
    _HAVE_DSL = False

__all__ = ["cta_ids", "sched_words", "build_schedule", "unit_lookup"]


def sched_words(e_cap: int) -> int:
    """int32 words of the shared-memory schedule table."""
    return 3 * e_cap + 4


if _HAVE_DSL:

    def cta_ids():
        """``(tidx, bidx, gdim, warp, wg)`` at the top of a persistent kernel: the thread in the CTA, the CTA,
        the grid size (the persistent stride), the warp and the warpgroup, both made warp-uniform (the role
        branches test them). Trace-time code, no control flow."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // 128)
        return tidx, bidx, gdim, warp, wg

    @cute.jit
    def build_schedule(mRS: cute.Tensor, mRC: cute.Tensor, sSched: cute.Tensor, R: Int32, E: Int32,
                       tile_m: cutlass.Constexpr[int], e_cap: cutlass.Constexpr[int], tidx: Int32,
                       nthreads: cutlass.Constexpr[int]):
        """Every thread of the CTA calls this (it contains two ``__syncthreads``). Fills ``sSched``:
        ``[0, e_cap]`` prefix, ``[e_cap + 1, 2 e_cap + 1)`` rstart, ``[2 e_cap + 1, 3 e_cap + 1)``
        clamped counts."""
        o_rs = e_cap + 1
        o_cn = 2 * e_cap + 1
        for i in cutlass.range(tidx, E, nthreads, unroll=1):
            rs = Int32(mRS[i])
            rc = Int32(mRC[i])
            ok = (rs >= 0) & (rs < R) & (rc > 0)
            c = cutlass.select_(ok, cutlass.min(rc, R - rs), Int32(0))
            sSched[o_rs + i] = cutlass.select_(ok, rs, Int32(0))
            sSched[o_cn + i] = c
            sSched[i + 1] = (c + (tile_m - 1)) // tile_m          # tiles; prefix-summed below
        cute.arch.sync_threads()
        warp = tidx // 32
        lane = tidx % 32
        if warp == 0:
            running = Int32(0)
            for base in cutlass.range(0, E, 32, unroll=1):
                i = base + lane
                v = Int32(0)
                if i < E:
                    v = sSched[i + 1]
                for d in cutlass.range_constexpr(5):
                    t = cute.arch.shuffle_sync_up(v, 1 << d)
                    v = v + cutlass.select_(lane >= (1 << d), t, Int32(0))
                if i < E:
                    sSched[i + 1] = running + v
                running = running + cute.arch.shuffle_sync(v, 31)
            if lane == 0:
                sSched[0] = Int32(0)
        cute.arch.sync_threads()

    @cute.jit
    def unit_lookup(u: Int32, n_tiles: Int32, sSched: cute.Tensor, E: Int32, tile_m: cutlass.Constexpr[int],
                    e_cap: cutlass.Constexpr[int]):
        """Unit ``u`` -> ``(e, nt, row0, nrows)``: expert, N-tile, first grouped row of the token
        tile, valid rows in it (1..tile_m). Binary search of the prefix table (log2(e_cap) steps)."""
        mt_glob = u // n_tiles
        nt = u - mt_glob * n_tiles
        lo = Int32(0)
        hi = E
        for _ in cutlass.range_constexpr(int(e_cap).bit_length()):
            mid = (lo + hi) // 2
            go = sSched[mid] <= mt_glob
            lo = cutlass.select_(go, mid, lo)
            hi = cutlass.select_(go, hi, mid)
        e = lo
        mt = mt_glob - sSched[e]
        row0 = sSched[e_cap + 1 + e] + mt * tile_m
        nrows = cutlass.min(sSched[2 * e_cap + 1 + e] - mt * tile_m, Int32(tile_m))
        return e, nt, row0, nrows
