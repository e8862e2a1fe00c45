"""Torch references for the DSV4 MoE ops (also the ``torch`` providers).

* :func:`moe_layer_ref`: the full routed-expert layer from the spec formulas (dsv4_spec.md 2.5),
  on **checkpoint-layout** weights (plain concat W13 = [gate; up], linear scales): FP32 dequant
  + FP32 matmul, the same quantization points as DSV4 (act_quant(x, 128, ue8m0) for W4A8,
  bf16 rounding of the w1/w3 outputs and of h, act_quant(h, 128, ue8m0) before w2). It is
  independent of ``moe_prepare_weights`` and of the grouped layouts, so it checks both.
* :func:`gemm1_swiglu_ref` / :func:`gemm2_ref`: the grouped ops on the prepared layout
  (oracle providers: they loop over experts on the host and synchronize; never for production).
  They undo the prepared W13 row order with their own code (:func:`prepared_w13_rows`, written
  from the documented layout), not with ``dsv4.ops.moe``'s permutation they check. Bad grouping
  metadata follows the kernels' rule (:func:`expert_rows`).
* :func:`route_ref`, :func:`permute_ref`, :func:`combine_ref`: the layer glue (device-side torch,
  no host sync, CUDA-graph capturable); the torch providers of ``moe_route`` / ``moe_permute`` /
  ``moe_combine`` (registered through dsv4/reference/moe_glue.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import dequantize_fp8_block, e2m1_decode, quantize_fp8_block, ue8m0_decode, unpack_e2m1
from ..registry import TorchProvider


def dequant_fp4_weight(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[..., N, K/2]`` packed E2M1 + scales (float8 dtypes or raw uint8 bytes) -> fp32 ``[..., N, K]``."""
    vals = e2m1_decode(unpack_e2m1(data))
    sf = 32 if fmt == "mxfp4" else 16
    if scale.dtype == torch.uint8:  # raw bytes: reinterpret, never convert (seed 003)
        scale = scale.view(torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn)
    s = ue8m0_decode(scale) if fmt == "mxfp4" else scale.float()  # exact decodes
    return vals * s.repeat_interleave(sf, dim=-1)


def fold_fp4_weight_w4a8(data: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the W4A8 kernel multiplies: FP4 * block scale folded into E4M3 relative to a per-(row,
    128-K block) base, times 2^base (fp32 ``[..., N, K]``).

    mxfp4: base = max exponent - 6; shift d = e - base in [-8, 6] is exact, d < -8 flushes to 0.
    nvfp4: base = floor(log2(max sf)) - 5; value = e4m3_rn(level * sf * 2^-base) (exact for
    power-of-two sf). This single-rounding NVFP4 fold is what the first CUDA kernels did before the
    hi + lo split; kept as the "before" comparison of the exactness tests. The current W4A8
    kernel (the CuTe DSL grouped GEMM) adds lo = e4m3_rn(v - hi) for general scales.
    """
    vals = e2m1_decode(unpack_e2m1(data))
    K = vals.shape[-1]
    nb = K // 128
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu if fmt == "mxfp4" else torch.float8_e4m3fn)
    if fmt == "mxfp4":
        e = scale.view(torch.uint8).to(torch.int32).view(*scale.shape[:-1], nb, 4)
        emax = e.amax(-1, keepdim=True)
        d = e - emax + 6
        f = torch.where(d < -8, torch.zeros_like(d, dtype=torch.float32), torch.exp2(d.float()))
        base = torch.exp2((emax - 127 - 6).float())
        q = vals.view(*vals.shape[:-1], nb, 4, 32) * f.unsqueeze(-1)
        return (q * base.unsqueeze(-1)).reshape(vals.shape)
    sf = scale.float().view(*scale.shape[:-1], nb, 8)
    sm = sf.amax(-1, keepdim=True)
    base = torch.where(sm > 0, torch.floor(torch.log2(sm.clamp_min(1e-30))) - 5, torch.zeros_like(sm))
    q = vals.view(*vals.shape[:-1], nb, 8, 16) * (sf * torch.exp2(-base)).unsqueeze(-1)
    q = q.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * torch.exp2(base).unsqueeze(-1)).reshape(vals.shape)


def route_ref(x, gate_weight, bias, input_ids, tid2eid, topk: int, route_scale: float):
    """DSV4 Gate: ``s = sqrt(softplus(x W^T))``; ``idx = topk(s + bias)`` or ``tid2eid[ids]``;
    ``w = s[idx] / sum * route_scale`` (fp32; the sum in slot order).

    Hash layers: an ``input_ids`` value outside ``[0, V)`` or a ``tid2eid`` value outside
    ``[0, E)`` gives a dropped slot (``idx = -1``, ``w = 0``; the other slots are normalized over
    the valid ones); a token whose valid scores sum to 0 gets weights 0. Device-side, no sync."""
    logits = x.float() @ gate_weight.float().t()
    s = torch.sqrt(F.softplus(logits))
    E = gate_weight.shape[0]
    if tid2eid is not None:
        V = tid2eid.shape[0]
        ids = input_ids.long()
        ok_id = (ids >= 0) & (ids < V)
        if V == 0:
            e = torch.full((ids.shape[0], topk), -1, dtype=torch.int64, device=x.device)
        else:
            e = tid2eid[ids.clamp(0, V - 1)].long()
        valid = ok_id.unsqueeze(1) & (e >= 0) & (e < E)
        idx = torch.where(valid, e, torch.full_like(e, -1))
    else:
        sel = s + bias.float() if bias is not None else s
        # ties -> lower expert id first (the documented contract; torch.topk does not promise it)
        idx = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :topk]
        valid = torch.ones_like(idx, dtype=torch.bool)
    w = s.gather(1, idx.clamp(0, E - 1))
    w = torch.where(valid, w, torch.zeros_like(w))
    tot = torch.zeros_like(w[:, 0])
    for j in range(w.shape[1]):   # slot order (what the kernels do)
        tot = tot + w[:, j]
    keep = valid & (tot > 0).unsqueeze(1)
    w = torch.where(keep, w / tot.unsqueeze(1) * route_scale, torch.zeros_like(w))
    return idx.to(torch.int32), w.float()


def permute_ref(x, topk_idx, topk_w, num_experts: int, act: str, layout: str, max_m: int):
    """Torch body of ``moe_permute`` (device-side, no host sync, no loop over experts).

    Stable sort of the ``T * k`` assignments by expert (rows of an expert keep assignment order
    ``t * k + j``); out-of-range expert ids (negative or ``>= num_experts``) are dropped
    (``pos = -1``, no row, not counted). act='fp8': ``quantize_fp8_block(x, 128, 'ue8m0')``.
    Rows holding no assignment are zero here (the contract leaves them unspecified).

    Returns ``(a, a_s, row_start, row_count, route_w, pos)``; ``a_s`` is an empty fp32 ``[0]``
    for act='bf16'."""
    T, D = x.shape
    k = topk_idx.shape[1]
    E = num_experts
    dev = x.device
    flat = topk_idx.reshape(-1).long()
    n = flat.numel()
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))   # dropped sort last
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - starts[skey]
    if layout == "contiguous":
        R = n
        valid = skey < E
        dest = torch.arange(n, device=dev)
        row_start = starts[:E].to(torch.int32)
        row_count = counts[:E].to(torch.int32)
    else:
        R = E * max_m
        valid = (skey < E) & (rank < max_m)
        dest = skey * max_m + rank
        row_start = (torch.arange(E, device=dev) * max_m).to(torch.int32)
        row_count = counts[:E].clamp(max=max_m).to(torch.int32)
    dest = torch.where(valid, dest, torch.full_like(dest, R))     # row R: scratch, dropped
    if act == "fp8":
        xq, xs = quantize_fp8_block(x, 128, "ue8m0")
    else:
        xq, xs = x.to(torch.bfloat16), None
    src_tok = order // k
    xb = xq.view(torch.uint8) if xq.dtype == torch.float8_e4m3fn else xq  # byte view (bit exact)
    a = torch.zeros((R + 1, D), dtype=xb.dtype, device=dev)
    a.index_copy_(0, dest, xb.index_select(0, src_tok))
    a = a[:R].view(xq.dtype)
    if xs is not None:
        a_s = torch.zeros((R + 1, D // 128), dtype=torch.float32, device=dev)
        a_s.index_copy_(0, dest, xs.index_select(0, src_tok))
        a_s = a_s[:R]
    else:
        a_s = torch.empty(0, dtype=torch.float32, device=dev)
    rw = torch.zeros(R + 1, dtype=torch.float32, device=dev)
    rw.index_copy_(0, dest, topk_w.reshape(-1).float()[order])
    pos = torch.empty(n, dtype=torch.int64, device=dev)
    pos[order] = torch.where(valid, dest, torch.full_like(dest, -1))
    return a, a_s, row_start, row_count, rw[:R], pos


def combine_ref(y, pos, num_tokens: int, topk: int, out_dtype=torch.float32):
    """Torch body of ``moe_combine``: ``out[t] = sum_j y[pos[t*k + j]]``, fp32, in slot order from
    0.0 (a ``pos`` outside ``[0, R)`` adds 0), rounded once to ``out_dtype``."""
    R, D = y.shape
    valid = (pos >= 0) & (pos < R)
    acc = torch.zeros((num_tokens, D), dtype=torch.float32, device=y.device)
    if R == 0 or num_tokens == 0:
        return acc.to(out_dtype)
    rows = y.float().index_select(0, torch.where(valid, pos, torch.zeros_like(pos)))
    rows = torch.where(valid.unsqueeze(1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    rows = rows.view(num_tokens, topk, D)
    for j in range(topk):
        acc = acc + rows[:, j]
    return acc.to(out_dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
    gate = gate.to(torch.bfloat16).float().clamp(max=10.0)
    up = up.to(torch.bfloat16).float().clamp(-10.0, 10.0)
    return (F.silu(gate) * up * rw.unsqueeze(-1)).to(torch.bfloat16)


def moe_layer_ref(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, *, fmt: str, gate_weight: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None, topk: int = 6, route_scale: float = 1.5,
                  w13_global: Optional[torch.Tensor] = None, w2_global: Optional[torch.Tensor] = None,
                  act: str = "fp8", input_ids=None, tid2eid=None, topk_idx=None, topk_w=None,
                  kernel_fold: bool = False) -> torch.Tensor:
    """Routed-expert layer in FP32 from checkpoint tensors (loops over experts; oracle only).

    Args: checkpoint tensors as :func:`dsv4.ops.moe.moe_prepare_weights` (W13 rows = [gate; up]);
    router args as ``moe_route``, or a given routing (``topk_idx``, ``topk_w``); ``act``: 'fp8'
    (W4A8: activations and h through act_quant(128, ue8m0)) or 'bf16' (W4A16).
    ``kernel_fold``: use the W4A8 kernel's E4M3 weight fold (:func:`fold_fp4_weight_w4a8`)
    instead of the exact dequant (only differs for general NVFP4 scales or > 14-binade spreads).
    Returns fp32 ``[T, D]``.
    """
    deq = fold_fp4_weight_w4a8 if (kernel_fold and act == "fp8") else dequant_fp4_weight
    T, D = x.shape
    E, N13, _ = w13.shape
    I = N13 // 2
    if topk_idx is None:
        topk_idx, topk_w = route_ref(x, gate_weight, bias, input_ids, tid2eid, topk, route_scale)
    g13 = w13_global.float() if w13_global is not None else torch.ones(E, 2, device=x.device)
    g2 = w2_global.float() if w2_global is not None else torch.ones(E, device=x.device)
    if act == "fp8":
        xq, xs = quantize_fp8_block(x, 128, "ue8m0")
        xd = dequantize_fp8_block(xq, xs, 128)
    else:
        xd = x.to(torch.bfloat16).float()
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    idx = topk_idx.long()
    for e in range(E):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w13d = deq(w13[e], w13_scale[e], fmt)
        wg_, wu_ = w13d[:I] * g13[e, 0], w13d[I:] * g13[e, 1]   # plain concat [gate; up]
        xe = xd[tok]
        h = _swiglu(xe @ wg_.t(), xe @ wu_.t(), topk_w[tok, slot].float())
        if act == "fp8":
            hq, hs = quantize_fp8_block(h, 128, "ue8m0")
            hd = dequantize_fp8_block(hq, hs, 128)
        else:
            hd = h.float()
        y = hd @ (deq(w2[e], w2_scale[e], fmt) * g2[e]).t()
        out.index_add_(0, tok, y)
    return out


def prepared_w13_rows(I: int) -> list[int]:
    """Checkpoint W13 row of each prepared W13 row, written out from the documented layout
    (docs/layouts/moe_prepare_weights.md): prepared tile t (256 rows, I columns [128t, 128t + 128))
    holds gate rows 128t..128t+63, up rows 128t..128t+63, gate rows 128t+64..128t+127, up rows
    128t+64..128t+127, where checkpoint row ``i`` is gate column ``i`` and row ``I + i`` up column
    ``i`` (plain concat). Independent of ``dsv4.ops.moe.w13_tile_permutation`` (the oracle must not
    share the code it checks)."""
    rows: list[int] = []
    for t in range(I // 128):
        for half in (0, 64):
            first = 128 * t + half
            rows.extend(range(first, first + 64))            # gate columns
            rows.extend(range(I + first, I + first + 64))    # up columns
    return rows


def _unpermute_w13(w13p: torch.Tensor, I: int) -> torch.Tensor:
    """Prepared W13 rows (dim 1, any trailing dims) back in checkpoint order [gate; up]."""
    out = torch.empty_like(w13p)
    out[:, torch.tensor(prepared_w13_rows(I), device=w13p.device)] = w13p
    return out


def expert_rows(row_start: torch.Tensor, row_count: torch.Tensor, R: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each expert under the bad-input rule every grouped-GEMM provider
    follows (kernels_dsl/sm90/scheduler.py, kernels_cuda/moe_decode.cu ``md_rows``): rows
    ``[s, s + min(c, R - s))`` when ``0 <= s < R`` and ``c > 0`` (``s = row_start[e]``,
    ``c = row_count[e]``), else none. Host lists (syncs)."""
    out = []
    for s, c in zip(row_start.tolist(), row_count.tolist()):
        out.append((s, min(c, R - s)) if (0 <= s < R and c > 0) else (0, 0))
    return out


def gemm1_swiglu_ref(a, a_s, w13, w13_scale, g13, row_start, row_count, route_w, fmt):
    """Oracle of ``moe_gemm1_swiglu`` on the prepared layout (host loop over experts, syncs).
    Rows outside every expert's (clamped, :func:`expert_rows`) range are 0."""
    R = a.shape[0]
    I = w13.shape[1] // 2
    fp8 = a.dtype == torch.float8_e4m3fn
    ad = dequantize_fp8_block(a, a_s, 128) if fp8 else a.float()
    h = torch.zeros(R, I, dtype=torch.bfloat16, device=a.device)
    for e, (s0, c) in enumerate(expert_rows(row_start, row_count, R)):
        if c == 0:
            continue
        w = _unpermute_w13(dequant_fp4_weight(w13[e:e + 1], w13_scale[e:e + 1], fmt), I)[0]
        xe = ad[s0:s0 + c]
        h[s0:s0 + c] = _swiglu(xe @ (w[:I] * g13[e, 0]).t(), xe @ (w[I:] * g13[e, 1]).t(), route_w[s0:s0 + c])
    if fp8:
        return quantize_fp8_block(h, 128, "ue8m0")
    return h, torch.empty(0, dtype=torch.float32, device=a.device)


def gemm2_ref(h, h_s, w2, w2_scale, g2, row_start, row_count, fmt):
    """Oracle of ``moe_gemm2`` (host loop over experts, syncs). Rows outside every expert's
    (clamped, :func:`expert_rows`) range are 0."""
    R = h.shape[0]
    D = w2.shape[1]
    hd = dequantize_fp8_block(h, h_s, 128) if h.dtype == torch.float8_e4m3fn else h.float()
    y = torch.zeros(R, D, dtype=torch.float32, device=h.device)
    for e, (s0, c) in enumerate(expert_rows(row_start, row_count, R)):
        if c == 0:
            continue
        y[s0:s0 + c] = hd[s0:s0 + c] @ (dequant_fp4_weight(w2[e], w2_scale[e], fmt) * g2[e]).t()
    return y


class TorchMoERoute(TorchProvider):
    describe = "torch: fp32 router GEMM, sqrt(softplus), topk (device-side, no sync)"
    support_reason = "torch, any device"

    def run(self, problem, *, x, gate_weight, bias, input_ids, tid2eid, topk, route_scale):
        return route_ref(x, gate_weight, bias, input_ids, tid2eid, topk, route_scale)


class TorchMoEPermute(TorchProvider):
    describe = "torch: stable sort + scatter_add counts + quantize_fp8_block + index_copy (device-side, no sync)"
    support_reason = "torch, any device"

    def run(self, problem, *, x, topk_idx, topk_w, num_experts, act, layout, max_m):
        return permute_ref(x, topk_idx, topk_w, num_experts, act, layout, max_m)


class TorchMoECombine(TorchProvider):
    describe = "torch: index_select of the k rows + slot-order fp32 sum (device-side, no sync)"
    support_reason = "torch, any device"

    def run(self, problem, *, y, pos, num_tokens, topk, out_dtype):
        return combine_ref(y, pos, num_tokens, topk, out_dtype)


class TorchMoEPrepare(TorchProvider):
    """The one provider of ``moe_prepare_weights``: the op body (``dsv4.ops.moe.prepare_impl``, an
    index_select by ``w13_tile_permutation``). Not an oracle: the oracles above never read that code
    (:func:`prepared_w13_rows`), and :func:`moe_layer_ref` never sees the prepared layout."""
    describe = "torch: index_select tile reordering + .view(uint8) scale bytes"
    support_reason = "torch, any device"

    def run(self, problem, **kw):
        from ..ops.moe import prepare_impl
        return prepare_impl(problem, **kw)


class TorchMoEGemm1(TorchProvider):
    describe = "torch oracle: fp32 dequant + matmul per expert (host loop; syncs)"

    def run(self, problem, *, a, a_s, w13, w13_scale, g13, row_start, row_count, route_w):
        return gemm1_swiglu_ref(a, a_s, w13, w13_scale, g13, row_start, row_count, route_w, problem["fmt"])


class TorchMoEGemm2(TorchProvider):
    describe = "torch oracle: fp32 dequant + matmul per expert (host loop; syncs)"

    def run(self, problem, *, h, h_s, w2, w2_scale, g2, row_start, row_count):
        return gemm2_ref(h, h_s, w2, w2_scale, g2, row_start, row_count, problem["fmt"])


#: the layer glue (moe_route, moe_permute, moe_combine) is registered under module ``moe_glue``:
#: its torch providers are listed in dsv4/reference/moe_glue.py
PROVIDERS = {"moe_prepare_weights": TorchMoEPrepare, "moe_gemm1_swiglu": TorchMoEGemm1, "moe_gemm2": TorchMoEGemm2}
GLUE_PROVIDERS = {"moe_route": TorchMoERoute, "moe_permute": TorchMoEPermute, "moe_combine": TorchMoECombine}
