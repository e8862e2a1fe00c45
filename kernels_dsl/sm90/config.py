"""Configurations of the FP4-weight grouped GEMM (:mod:`kernels_dsl.sm90.grouped_gemm`) and the
heuristic that picks one per problem (pure host code: no DSL import, testable on the CPU).

A configuration is a frozen dataclass (:class:`GroupedGemmConfig`); :func:`choose` maps a
problem (rows, experts, N, K, activation / weight formats, epilogue, the per-expert row hint)
to one, and :meth:`GroupedGemmConfig.explain` is the line that ``registry.last_choice(op)
.explain()`` and ``dsv4 ops`` show. The shared-memory budget is computed, not guessed:
:func:`smem_bytes` lists every buffer of the kernel, :func:`max_stages` is the deepest TMA ring
that fits the sm_90 opt-in capacity (227 KiB per CTA, or half the SM's 228 KiB with two CTAs per
SM).

Heuristic (the timings behind each choice: docs/benchmarks.md, "MoE grouped GEMMs in CuTe DSL"):

* ``tile_m`` (token rows per CTA tile = 64 x consumer warpgroups): 128 when the largest expert
  holds more than 64 rows, else 64 (decode: one consumer warpgroup then decodes the whole
  256-row weight tile; 128-row tiles are slower there).
  The decision uses the real per-expert maximum when the caller passes it (``max_m``, the
  DeepGEMM ``expected_m_per_group`` idea), else the masked-layout ``max_m`` / ``R / E``.
* ``stages``: the deepest TMA ring (activation tile + packed E2M1 tile per stage) that fits next
  to the double-buffered decoded-weight tile, at most 8.
* ``ctas_per_sm``: 2 for ``tile_m = 64`` when two CTAs fit (never with the current buffers: 1).
* ``scale_tma``: the weight scale bytes ride in the TMA stage whenever ``K / SF % 16 == 0`` (the
  DSV4 shapes); else the consumers load them from global memory one K block ahead.
* No swap-AB variant: token rows stay the WGMMA M operand and one kernel serves prefill and decode
  (the tile rows beyond an expert's count are TMA zero-fill and are never stored). In the decode
  regime the 64-row MMA does not overlap the operand decode; there the cuda decode kernel
  (kernels_cuda/moe_decode.cu, swap-AB) is faster and is the registry's choice at <= 16 rows per
  expert.
* No split-K: GEMM1's SwiGLU needs the complete sum; GEMM2 runs whole-K per tile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["GroupedGemmConfig", "choose", "smem_bytes", "max_stages", "SMEM_OPTIN", "SMEM_PER_SM",
           "TILE_N", "HALF_N", "e_cap_for"]

#: sm_90 opt-in dynamic shared memory per block / per SM (bytes)
SMEM_OPTIN = 232448
SMEM_PER_SM = 233472
#: weight rows per CTA tile (two WGMMA halves of 128); GEMM1: 256 W13 rows = 128 h columns
TILE_N = 256
HALF_N = 128
_MAX_STAGES = 8


def e_cap_for(E: int) -> int:
    """Schedule-table capacity (compile-time) for ``E`` experts: 256 (DSV4-Flash) up to 256 experts,
    else the next power of two (Pro: 512); few distinct values = few compiles, 3 KiB of smem."""
    c = 256
    while c < E:
        c *= 2
    return c


@dataclass(frozen=True)
class GroupedGemmConfig:
    """One specialization of :class:`kernels_dsl.sm90.grouped_gemm.Fp4GroupedGemmKernel`.

    Attributes:
        stage: 1 = GEMM1 (W13) + clamped SwiGLU * routing weight (+ FP8 1x128 UE8M0 requant),
            2 = GEMM2 (W2), fp32 rows.
        act: ``'fp8'`` (W4A8: E4M3 activations with fp32 1x128 scales, FP8 WGMMA, per-128-K
            promotion into fp32) or ``'bf16'`` (W4A16: BF16 WGMMA, exact BF16 weights).
        fmt: ``'mxfp4'`` (UE8M0 / 32) or ``'nvfp4'`` (E4M3 / 16; under W4A8 each decoded weight is
            split into hi + lo E4M3 parts, two WGMMAs per K step).
        tile_m: token rows per CTA tile, 64 (one consumer warpgroup) or 128 (two).
        stages: TMA ring depth (activation + packed-weight tile per stage).
        e_cap: experts the on-chip schedule table holds (power of two >= E).
        ctas_per_sm: 1 or 2 (occupancy the registers / shared memory are budgeted for).
        scale_tma: the weight scale bytes of each K block ride in the TMA stage (one 16-byte box per
            weight row; needs ``K / SF % 16 == 0`` and a 16-byte aligned scale tensor), else the
            consumers load them from global memory one K block ahead.
    """

    stage: int
    act: str
    fmt: str
    tile_m: int
    stages: int
    e_cap: int
    ctas_per_sm: int = 1
    scale_tma: bool = False

    # ---- derived -------------------------------------------------------------------------
    @property
    def consumers(self) -> int:
        """Consumer (WGMMA + decode) warpgroups."""
        return self.tile_m // 64

    @property
    def threads(self) -> int:
        """Warpgroup 0 = TMA producer (one warp issues), then the consumer warpgroups."""
        return 128 * (1 + self.consumers)

    @property
    def block_k(self) -> int:
        """K per pipeline stage: 128 E4M3 (one FP8 promotion block) or 64 bf16 (128 B rows)."""
        return 128 if self.act == "fp8" else 64

    @property
    def parts(self) -> int:
        """Decoded E4M3 parts per weight (NVFP4 under W4A8: hi + lo)."""
        return 2 if (self.act == "fp8" and self.fmt == "nvfp4") else 1

    @property
    def sf(self) -> int:
        return 32 if self.fmt == "mxfp4" else 16

    @property
    def regs(self) -> tuple[int, int]:
        """(warpgroup 0 = TMA producer + transform warps, consumer) ``setmaxnreg`` targets.

        The launch gives every thread the kernel's register count ``L`` (ptxas: 65536 / threads,
        rounded down to 8: 168 for 384 threads); ``setmaxnreg.inc`` takes registers only from what
        ``setmaxnreg.dec`` released, so ``(L - prod) * 128 >= (cons - L) * 128 * consumers`` must
        hold or the consumers block forever. W4A8: 24 / 240 (no spill in the consumer K loop;
        timings of both splits: docs/benchmarks.md); W4A16: 40 / 232."""
        L = min(255, 65536 // self.ctas_per_sm // self.threads) // 8 * 8
        prod = 24 if self.act == "fp8" else 40
        cons = min(240 if self.act == "fp8" else 232, (L * (1 + self.consumers) - prod) // self.consumers // 8 * 8)
        return prod, cons

    def key(self) -> tuple:
        return (self.stage, self.act, self.fmt, self.tile_m, self.stages, self.e_cap, self.ctas_per_sm, self.scale_tma)

    def explain(self) -> str:
        what = "gemm1+swiglu" + ("+fp8 requant" if self.act == "fp8" else "") if self.stage == 1 else "gemm2"
        prec = ("fp8 wgmma, fp32 promotion per 128-K block" if self.act == "fp8" else "bf16 wgmma (exact weights)")
        hl = ", nvfp4 hi+lo e4m3 split" if self.parts == 2 else ""
        return (f"dsl {what} {self.act}/{self.fmt}: tile {self.tile_m}x{TILE_N}x{self.block_k}, "
                f"{self.stages}-stage TMA ring{' (+scales)' if self.scale_tma else ''} + 2x decoded tile, "
                f"{self.consumers} consumer wg decoding their rows while the wgmma runs, "
                f"{self.ctas_per_sm} cta/sm, {prec}{hl}")


def smem_bytes(cfg: GroupedGemmConfig, stages: Optional[int] = None) -> int:
    """Shared memory of the kernel for ``cfg`` (bytes, with the 1 KiB alignment pads)."""
    s = cfg.stages if stages is None else stages
    asz = 1 if cfg.act == "fp8" else 2
    a_tile = cfg.tile_m * cfg.block_k * asz
    p_tile = TILE_N * cfg.block_k // 2
    d_tiles = 2 * 2 * cfg.parts * HALF_N * cfg.block_k * asz     # 2 slots x 2 halves x parts
    sched = 4 * (3 * cfg.e_cap + 4)
    fixed = 16 * s + sched + 2 * 2 * 4 * TILE_N + 3 * 1024       # mbarriers, schedule, 2 colscale + rowbase
    s_tile = TILE_N * 16 if cfg.scale_tma else 0
    return fixed + s * (a_tile + p_tile + s_tile) + d_tiles


def max_stages(cfg: GroupedGemmConfig) -> int:
    cap = SMEM_OPTIN if cfg.ctas_per_sm == 1 else SMEM_PER_SM // cfg.ctas_per_sm - 1024
    s = _MAX_STAGES
    while s > 2 and smem_bytes(cfg, s) > cap:
        s -= 1
    return s


def choose(*, stage: int, act: str, fmt: str, R: int, E: int, N: int, K: int,
           max_m: Optional[int] = None) -> GroupedGemmConfig:
    """The configuration for one grouped GEMM call (see the module docstring for the rules).

    Args: ``stage`` 1 | 2, ``act`` 'fp8' | 'bf16', ``fmt`` 'mxfp4' | 'nvfp4', ``R`` grouped rows,
    ``E`` experts, ``N`` weight rows per expert, ``K`` reduction size, ``max_m`` the largest
    per-expert row count if the caller knows it (masked layout: its ``max_m``).
    """
    m = max_m if max_m is not None else -(-R // max(E, 1))
    tile_m = 64 if m <= 64 else 128
    st = (K // (32 if fmt == "mxfp4" else 16)) % 16 == 0
    cps = 1
    if tile_m == 64:
        two = GroupedGemmConfig(stage, act, fmt, 64, 3, e_cap_for(E), 2, st)
        if smem_bytes(two) <= SMEM_PER_SM // 2 - 1024:
            cps = 2
    cfg = GroupedGemmConfig(stage, act, fmt, tile_m, 2, e_cap_for(E), cps, st)
    return GroupedGemmConfig(stage, act, fmt, tile_m, max_stages(cfg), e_cap_for(E), cps, st)
