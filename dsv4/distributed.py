"""Multi-GPU DSV4 layers over ``torch.distributed`` (issue 18): expert-parallel (EP) MoE and
tensor-parallel (TP) heads for the indexer and the sparse attention.

This module adds no transport of its own: it calls ``torch.distributed`` collectives
(``all_to_all_single``, ``all_reduce``, ``all_gather_into_tensor``) on the process group the engine
gives it (NCCL on GPUs, gloo on CPU, where CI runs the same code), and the single-GPU ops of this
library for the local work.

Expert parallel (``moe_experts_ep`` / ``moe_forward_ep``). ``world`` ranks each own ``E / world``
consecutive experts (rank ``r``: experts ``[r * E_loc, (r + 1) * E_loc)``, :func:`shard_moe_weights`).
Every rank routes its own tokens (the router weight is replicated), then:

1. dispatch (:func:`ep_dispatch`): one row per (token, destination rank) pair -- a token whose top-k
   experts live on 3 ranks is sent 3 times, not k times -- carrying the token's hidden state, its
   expert ids local to that rank (``-1`` for the top-k slots owned elsewhere: dropped assignments of
   the local :func:`dsv4.ops.moe.moe_experts`) and its routing weights;
2. the local experts (:func:`dsv4.ops.moe.moe_experts` on the received rows: permute, GEMM1 +
   SwiGLU, GEMM2, combine over the rank's own experts);
3. combine (:func:`ep_combine`): the per-rank partial sums go back to the token's rank and are added
   in rank order (fp32).

Two dispatch modes:

* ``low_latency=False`` (default): exact splits. The per-destination counts are exchanged on the
  device (``all_to_all_single`` of a ``[world]`` tensor), then read to the host once, because
  ``all_to_all_single`` takes its split sizes as Python ints: one host sync per layer, as DeepEP's
  normal mode. Any token count per rank.
* ``low_latency=True``: every rank sends a fixed ``[world, T, D]`` buffer (the token's row to every
  rank, with all ids ``-1`` where the rank owns none of its experts: those rows cost no GEMM work,
  only bandwidth), like DeepEP's low-latency mode with ``num_max_dispatch_tokens_per_rank = T``.
  No host sync, CUDA-graph capturable; every rank must pass the same ``T`` (not checked: that would
  need a collective; unequal ``T`` is a usage error the collective reports or hangs on).

Precision: the result equals the single-GPU :func:`dsv4.ops.moe.moe_experts` on the same weights
up to the fp32 summation order of the top-k contributions (each rank sums its own experts'
contributions, then the ranks' partial sums are added in rank order): within 1e-5 relative of the
single-GPU output (tested), bitwise for ``world == 1``. The FP8 activation quantization (``act='fp8'``)
is per token and 128-channel block, so every rank quantizes a token to the same bytes.

Tensor parallel heads. DSV4's attention shares one compressed KV over all heads (MQA on the latent),
so splitting the 64 (Flash) / 128 (Pro) query heads over ranks needs no communication inside the
attention: rank ``r`` runs :func:`dsv4.ops.sparse_attention.sparse_attention` on its heads
``[r * H / world, (r + 1) * H / world)`` (:func:`split_heads`; the output projection that follows is
row-parallel and reduces there, in the engine). The indexer's logits are a sum over heads,
``I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . K[s])``: :func:`indexer_logits_paged_tp` computes each
rank's partial head sum and ``all_reduce``-s it before the top-k. The indexer kernels are built for
the DSV4 indexer's 64 heads, so a rank runs them with its heads in place and zeros elsewhere (ReLU(0)
x 0 adds exactly 0): the decode indexer reads the whole key cache whatever the head count (it is
memory-bound on the cache), so splitting its heads saves little time on a rank; replicating the
indexer (all-gather of the 64 x 128 query bytes, no reduction of [rows, context] logits) is the
cheaper deployment for decode, and this function exists for engines that shard the indexer's q
projection.

Source: issue 18; DeepEP (normal / low-latency dispatch); dsv4_spec.md 2.2 (attention), 2.4 (indexer),
2.5 (MoE).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from .ops.moe import MoEWeights, moe_experts, moe_route

__all__ = ["shard_moe_weights", "expert_range", "ep_dispatch", "ep_combine", "EPDispatch", "moe_experts_ep",
           "moe_forward_ep", "split_heads", "indexer_logits_paged_tp", "indexer_topk_paged_tp"]


def _world_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dsv4.distributed: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first, e.g. backend='nccl' or 'gloo')")
    return dist.get_world_size(group), dist.get_rank(group)


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """Experts ``[start, stop)`` owned by ``rank`` of ``world`` (contiguous, ``num_experts / world``
    each). Raises ValueError unless ``num_experts % world == 0`` and ``0 <= rank < world``."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"expert_range: need 0 <= rank < world, got rank={rank}, world={world}")
    if num_experts % world:
        raise ValueError(f"expert_range: num_experts={num_experts} must be a multiple of world={world} "
                         f"(contiguous expert shards)")
    n = num_experts // world
    return rank * n, (rank + 1) * n


def shard_moe_weights(w: MoEWeights, rank: int, world: int) -> MoEWeights:
    """The experts of ``rank`` (:func:`expert_range`) out of prepared weights of all ``w.E`` experts.

    Slices every per-expert tensor along its first dim (views, no copy); the result is a
    :class:`~dsv4.ops.moe.MoEWeights` with ``E = w.E / world`` whose expert ``j`` is global expert
    ``start + j``. In a real deployment each rank prepares only its own experts' checkpoint tensors
    with :func:`~dsv4.ops.moe.moe_prepare_weights`; the layout is the same."""
    if not isinstance(w, MoEWeights):
        raise TypeError(f"shard_moe_weights: argument 'w' must be MoEWeights, got {type(w).__name__}")
    try:
        a, b = expert_range(w.E, rank, world)
    except ValueError as e:
        raise ValueError(f"shard_moe_weights: {e.args[0].removeprefix('expert_range: ')}") from None
    return replace(w, w13=w.w13[a:b], w13_scale=w.w13_scale[a:b], w2=w.w2[a:b], w2_scale=w.w2_scale[a:b],
                   g13=w.g13[a:b], g2=w.g2[a:b], E=b - a)


@dataclass
class EPDispatch:
    """What :func:`ep_dispatch` received and what :func:`ep_combine` needs to send it back.

    Attributes:
        x: ``[N, D]`` rows received by this rank (hidden states, the input dtype).
        topk_idx: int32 ``[N, k]`` expert ids local to this rank, ``-1`` = owned by another rank.
        topk_w: fp32 ``[N, k]`` routing weights (0 where ``topk_idx`` is -1).
        num_tokens: ``T`` of this rank's own tokens.
        token_of_sent: int64 ``[P]`` (exact mode) the local token of each row this rank sent, in send order.
        send_splits, recv_splits: per-rank row counts (exact mode; host ints), None in low-latency mode.
        low_latency: the mode.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    num_tokens: int
    token_of_sent: Optional[torch.Tensor]
    send_splits: Optional[list]
    recv_splits: Optional[list]
    low_latency: bool


def _check_routing(op: str, x, topk_idx, topk_w, experts_per_rank: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: argument 'x' must be a [T, D] tensor, got "
                         f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    for name, t in (("topk_idx", topk_idx), ("topk_w", topk_w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != x.shape[0]:
            raise ValueError(f"{op}: argument '{name}' must be a [T, k] tensor with T = x.shape[0] = {x.shape[0]}, "
                             f"got {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{op}: argument '{name}' is on {t.device}, x on {x.device}")
    if topk_idx.shape != topk_w.shape:
        raise ValueError(f"{op}: 'topk_idx' {list(topk_idx.shape)} and 'topk_w' {list(topk_w.shape)} must match")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: argument 'topk_idx' must be int32 or int64, got {topk_idx.dtype}")
    if not isinstance(experts_per_rank, int) or experts_per_rank < 1:
        raise ValueError(f"{op}: 'experts_per_rank' must be an int >= 1, got {experts_per_rank!r}")


def ep_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, *, experts_per_rank: int,
                group=None, low_latency: bool = False) -> EPDispatch:
    """Send every token to the ranks that own its experts (module docstring: modes, layout).

    Args:
        x: ``[T, D]`` this rank's hidden states (bf16 / fp16 / fp32).
        topk_idx: int32/int64 ``[T, k]`` global expert ids in ``[0, world * experts_per_rank)``; an id
            outside it is a dropped assignment (sent nowhere, contributes nothing), as in
            :func:`dsv4.ops.moe.moe_experts`.
        topk_w: float ``[T, k]`` routing weights.
        experts_per_rank: ``E_loc``: rank ``r`` owns global experts ``[r * E_loc, (r + 1) * E_loc)``.
        group: the process group (None: the default group).
        low_latency: fixed-size buffers, no host sync (module docstring).

    Returns:
        :class:`EPDispatch`.

    Raises:
        RuntimeError: torch.distributed not initialized. ValueError: argument shapes / dtypes.
    """
    _check_routing("ep_dispatch", x, topk_idx, topk_w, experts_per_rank)
    world, _ = _world_rank(group)
    T, k = topk_idx.shape
    dev = x.device
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < world * experts_per_rank)
    dest = torch.where(valid, idx // experts_per_rank, torch.full_like(idx, -1))         # [T, k]
    ranks = torch.arange(world, device=dev)
    hit = dest[:, None, :] == ranks[None, :, None]                                        # [T, world, k]
    local = torch.where(hit, idx[:, None, :] - ranks[None, :, None] * experts_per_rank,
                        torch.full_like(hit, -1, dtype=torch.long))                      # [T, world, k] local ids
    wts = torch.where(hit, topk_w.float()[:, None, :], torch.zeros((), device=dev))       # [T, world, k]
    meta = torch.cat([local.float(), wts], dim=2)                                         # [T, world, 2k]
    if low_latency:
        send_x = x.unsqueeze(0).expand(world, T, x.shape[1]).contiguous()                 # [world, T, D]
        send_m = meta.transpose(0, 1).contiguous()                                        # [world, T, 2k]
        recv_x = torch.empty_like(send_x)
        recv_m = torch.empty_like(send_m)
        dist.all_to_all_single(recv_x, send_x, group=group)
        dist.all_to_all_single(recv_m, send_m, group=group)
        recv_m = recv_m.view(world * T, 2 * k)
        return EPDispatch(recv_x.view(world * T, -1), recv_m[:, :k].to(torch.int32), recv_m[:, k:].contiguous(),
                          T, None, None, None, True)
    pair = hit.any(dim=2)                                                                 # [T, world]
    r_of, t_of = pair.t().nonzero(as_tuple=True)                                          # sorted by rank, then token
    send_counts = pair.sum(dim=0)                                                         # [world] int64
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    both = torch.stack([send_counts, recv_counts]).cpu()                                  # the one host sync
    send_splits, recv_splits = both[0].tolist(), both[1].tolist()
    send_x = x[t_of]
    send_m = meta[t_of, r_of]
    recv_x = x.new_empty((sum(recv_splits), x.shape[1]))
    recv_m = meta.new_empty((sum(recv_splits), 2 * k))
    dist.all_to_all_single(recv_x, send_x, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    dist.all_to_all_single(recv_m, send_m, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return EPDispatch(recv_x, recv_m[:, :k].to(torch.int32), recv_m[:, k:].contiguous(), T, t_of,
                      send_splits, recv_splits, False)


def ep_combine(y: torch.Tensor, d: EPDispatch, *, group=None) -> torch.Tensor:
    """Return each received row's result ``y`` (fp32 ``[N, D]``, e.g. the local ``moe_experts`` of
    ``d.x``) to its token's rank and add the ranks' parts in rank order: fp32 ``[T, D]``."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != d.x.shape[0]:
        raise ValueError(f"ep_combine: argument 'y' must be [N, D] with N = {d.x.shape[0]} received rows, got "
                         f"{list(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    world, _ = _world_rank(group)
    y = y.float().contiguous()
    if d.low_latency:
        back = torch.empty_like(y)
        dist.all_to_all_single(back, y, group=group)
        return back.view(world, d.num_tokens, -1).sum(dim=0)
    back = y.new_empty((sum(d.send_splits), y.shape[1]))
    dist.all_to_all_single(back, y, output_split_sizes=d.send_splits, input_split_sizes=d.recv_splits, group=group)
    out = y.new_zeros((d.num_tokens, y.shape[1]))
    # rows are ordered by rank, then token: index_add_ in that order adds the ranks' parts in rank order
    return out.index_add_(0, d.token_of_sent, back)


def moe_experts_ep(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_local: MoEWeights, *,
                   group=None, act: str = "fp8", low_latency: bool = False) -> torch.Tensor:
    """Expert-parallel :func:`dsv4.ops.moe.moe_experts`: dispatch -> local experts -> combine.

    Args:
        x: ``[T, D]`` this rank's tokens; topk_idx / topk_w: their routing over the GLOBAL experts
            (``world * w_local.E``), as :func:`dsv4.ops.moe.moe_experts` takes them.
        w_local: this rank's experts (:func:`shard_moe_weights`, or prepared from its checkpoint shard).
            Its ``E`` defines the sharding (``world * w_local.E`` global experts, rank ``r`` owning
            ``[r * E, (r + 1) * E)``): passing the unsharded weights on every rank is not detected
            (it would need a collective) and silently sends every assignment to the low ranks.
        group, low_latency: as :func:`ep_dispatch`. act: ``'fp8'`` (W4A8) or ``'bf16'`` (W4A16).

    Returns:
        fp32 ``[T, D]``, the single-GPU result up to the fp32 summation order (module docstring).
    """
    if not isinstance(w_local, MoEWeights):
        raise TypeError(f"moe_experts_ep: argument 'w_local' must be MoEWeights, got {type(w_local).__name__}")
    d = ep_dispatch(x, topk_idx, topk_w, experts_per_rank=w_local.E, group=group, low_latency=low_latency)
    y = moe_experts(d.x, d.topk_idx, d.topk_w, w_local, act=act)
    return ep_combine(y, d, group=group)


def moe_forward_ep(x: torch.Tensor, w_local: MoEWeights, gate_weight: torch.Tensor, *, group=None, topk: int = 6,
                   route_scale: float = 1.5, bias: Optional[torch.Tensor] = None,
                   input_ids: Optional[torch.Tensor] = None, tid2eid: Optional[torch.Tensor] = None,
                   act: str = "fp8", low_latency: bool = False, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert-parallel :func:`dsv4.ops.moe.moe_forward`: route locally (``gate_weight`` ``[E, D]``
    replicated, ``E = world * w_local.E``), then :func:`moe_experts_ep`; ``out_dtype`` float32 /
    bfloat16 / float16 (rounded once at the end). Raises ValueError if ``gate_weight`` does not have
    ``world * w_local.E`` rows."""
    world, _ = _world_rank(group)
    if not isinstance(gate_weight, torch.Tensor) or gate_weight.dim() != 2 or gate_weight.shape[0] != world * w_local.E:
        raise ValueError(f"moe_forward_ep: argument 'gate_weight' must be [E, D] with E = world * w_local.E = "
                         f"{world} * {w_local.E}, got "
                         f"{list(gate_weight.shape) if isinstance(gate_weight, torch.Tensor) else type(gate_weight).__name__}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"moe_forward_ep: 'out_dtype' must be float32, bfloat16 or float16, got {out_dtype}")
    idx, wt = moe_route(x, gate_weight, topk=topk, route_scale=route_scale, bias=bias, input_ids=input_ids,
                        tid2eid=tid2eid)
    out = moe_experts_ep(x, idx, wt, w_local, group=group, act=act, low_latency=low_latency)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


# ------------------------------------------------------------------------------------------
# tensor-parallel heads
def split_heads(t: torch.Tensor, *, dim: int, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along its head dim ``dim`` (``H / world`` heads; raises
    ValueError unless ``H % world == 0``). Use it for the attention's ``q [T, H, 512]`` (dim 1) and
    ``sink [H]`` (dim 0): :func:`dsv4.ops.sparse_attention.sparse_attention` runs at any head count."""
    world, rank = _world_rank(group)
    H = t.shape[dim]
    if H % world:
        raise ValueError(f"split_heads: {H} heads (dim {dim}) are not a multiple of world={world}")
    n = H // world
    return t.narrow(dim, rank * n, n)


def _pad_heads(op: str, q_data, q_sf, w, group):
    from .ops.indexer import HEADS
    world, rank = _world_rank(group)
    if HEADS % world:
        raise ValueError(f"{op}: the indexer's {HEADS} heads are not a multiple of world={world}")
    n = HEADS // world
    for name, t, d in (("q_data", q_data, 2), ("q_sf", q_sf, 2), ("w", w, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() <= d or t.shape[d] != n:
            raise ValueError(f"{op}: argument '{name}' must hold this rank's {n} heads in dim {d} "
                             f"({HEADS} heads / world {world}), got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    def pad(t, d):
        shape = list(t.shape)
        shape[d] = HEADS
        full = t.new_zeros(shape)
        full.narrow(d, rank * n, n).copy_(t)
        return full
    return pad(q_data, 2), pad(q_sf, 2), pad(w, 1)


def indexer_logits_paged_tp(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                            context_lens: torch.Tensor, block_table: torch.Tensor, *, group=None, fmt: str = "mxfp4",
                            max_ctx: Optional[int] = None, q_global: Optional[torch.Tensor] = None,
                            k_global: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tensor-parallel :func:`dsv4.ops.indexer.indexer_logits_paged`: this rank's heads, partial head
    sum, ``all_reduce`` (SUM) over the group.

    Args:
        q_data: uint8 ``[B, next_n, 64 / world, VB]``, q_sf ``[B, next_n, 64 / world, SB|0]``, w fp32
            ``[B*next_n, 64 / world]``: this rank's heads ``[rank * 64 / world, (rank + 1) * 64 / world)``
            (the same bytes :func:`dsv4.ops.indexer.indexer_q_quant` gives for those heads: its
            quantization is per head). cache, context_lens, block_table, fmt, max_ctx, q_global,
            k_global: as :func:`~dsv4.ops.indexer.indexer_logits_paged` (replicated on every rank).

    Returns:
        fp32 ``[B*next_n, max_ctx]`` on every rank: the single-GPU logits up to the summation order
        of the heads (within the op's 2e-3 x row-max contract); ``-inf`` where the op masks.
    """
    qd, qs, wf = _pad_heads("indexer_logits_paged_tp", q_data, q_sf, w, group)
    from .ops.indexer import indexer_logits_paged
    logits = indexer_logits_paged(qd, qs, wf, cache, context_lens, block_table, fmt=fmt, max_ctx=max_ctx,
                                  q_global=q_global, k_global=k_global)
    dist.all_reduce(logits, op=dist.ReduceOp.SUM, group=group)
    return logits


def indexer_topk_paged_tp(q_data: torch.Tensor, q_sf: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                          context_lens: torch.Tensor, block_table: torch.Tensor, k: int, *, group=None,
                          fmt: str = "mxfp4", max_ctx: Optional[int] = None, q_global: Optional[torch.Tensor] = None,
                          k_global: Optional[torch.Tensor] = None, map_to_slots: bool = False) -> torch.Tensor:
    """:func:`indexer_logits_paged_tp`, then :func:`dsv4.ops.topk.topk` on the reduced logits: int32
    ``[B*next_n, k]`` on every rank, the contract of :func:`dsv4.ops.indexer.indexer_topk_paged`
    (sorted, ties by lower position, -1 padding; ``map_to_slots``: physical cache slots)."""
    from .ops.topk import topk
    logits = indexer_logits_paged_tp(q_data, q_sf, w, cache, context_lens, block_table, group=group, fmt=fmt,
                                     max_ctx=max_ctx, q_global=q_global, k_global=k_global)
    B, next_n = q_data.shape[0], q_data.shape[1]
    lens = context_lens if context_lens.dim() == 2 else context_lens[:, None].expand(B, next_n)
    lens = lens.reshape(-1).to(torch.int32).clamp(max=logits.shape[1])
    if map_to_slots:
        return topk(logits, lens, k, block_table=block_table, block_size=cache.shape[1], rows_per_seq=next_n,
                    num_blocks=cache.shape[0])
    return topk(logits, lens, k)
