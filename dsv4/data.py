"""Seeded, realistic synthetic inputs for the indexer / sparse-attention kernels.

Fixed on 2026-11-29 BEFORE any recall / cosine was measured; never tuned to a metric. Change
it only with a new version number (``GENERATOR_VERSION``) and re-measure everything.

What real DSV4 indexer activations look like, and how each trait is produced here
(all draws from one ``torch.Generator`` seeded with ``seed``, on CPU, then moved):

1. **Heavy tails**: every noise term is Student-t with ``df = 4`` (finite variance, kurtosis
   far above Gaussian), the usual fit of LLM activations.
2. **Outlier channels**: ``n_outliers = 4`` of the 128 channels (chosen by the seed, among the
   64 non-RoPE dims) are multiplied by a per-channel factor drawn uniformly in ``[10, 30]``,
   in both q and K (activation outliers sit in fixed channels). This is what makes FP4 block
   scales hard: one channel dominates its 32-block.
3. **Non-trivial top-k structure**: entries belong to ``n_topics = 64`` latent topics (Student-t
   directions ``U [64, 128]``). Key ``s`` = ``a_s * U[z_s] + noise`` with topic ``z_s`` uniform and
   strength ``a_s = |t_4|`` (a few keys are very strong). Query token ``t`` attends to
   ``3`` topics; head ``h`` of query t = ``sum_j c_{t,h,j} U[topic_j] + noise`` with coefficients
   ``c ~ N(0, 1)`` per head (heads disagree, so ReLU and the head-weighted sum matter). Keys
   of a query's topics score high; the rest form a heavy-tailed background, so the top-512 /
   top-1024 boundary is crowded (realistic for recall), neither trivially separable nor random.
4. **RoPE** (interleaved pairs, DSV4 compressed-layer YaRN table, ``dsv4.reference.rope``) on
   the LAST 64 dims: queries at their token positions, entry ``s`` at position ``4 s`` (the
   first token of its C4 block).
5. **Head weights** ``w[t, h] = (N(0.25, 1)) * 128^-0.5 * 64^-0.5`` (weights_proj output with
   DSV4's ``softmax_scale * n_heads^-0.5`` folding, dsv4_spec.md 2.4); about 40% are negative.
6. q and K are rounded to bf16 (what the indexer sees); overall scales are O(1) per channel
   before the outliers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GENERATOR_VERSION", "IndexerInputs", "indexer_inputs", "attention_kv"]

GENERATOR_VERSION = 1


@dataclass
class IndexerInputs:
    """q bf16 ``[T, 64, 128]``, k bf16 ``[S, 128]``, w fp32 ``[T, 64]``, q_pos int64 ``[T]``
    (token positions), k_pos int64 ``[S]`` (= 4 s), outlier channel ids ``[n_outliers]``."""

    q: torch.Tensor
    k: torch.Tensor
    w: torch.Tensor
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    outliers: torch.Tensor


def _student_t(g: torch.Generator, shape, df: float = 4.0) -> torch.Tensor:
    z = torch.randn(shape, generator=g)
    # chi-square(df) as a sum of df squared normals (df integer; generator-aware)
    c = torch.zeros(shape)
    for _ in range(int(df)):
        c += torch.randn(shape, generator=g) ** 2
    return z / torch.sqrt(c / df)


def indexer_inputs(n_queries: int, n_entries: int, *, seed: int = 0, heads: int = 64, dim: int = 128,
                   n_outliers: int = 4, n_topics: int = 64, q_positions: torch.Tensor | None = None,
                   device=None) -> IndexerInputs:
    """Generate one realistic indexer problem (see the module docstring for every choice).

    Args:
        n_queries: T query tokens. n_entries: S compressed entries.
        seed: generator seed. heads / dim: 64 / 128 (DSV4).
        q_positions: int ``[T]`` token positions; default the last T tokens of a sequence of
            ``4 * n_entries`` tokens (positions ``4S - T .. 4S - 1``, clamped at 0).
        device: where the tensors go.

    Returns:
        :class:`IndexerInputs`.
    """
    from .reference.rope import apply_rope, rope_cos_sin_table
    g = torch.Generator().manual_seed(int(seed))
    T, S, H, D = n_queries, n_entries, heads, dim
    U = _student_t(g, (n_topics, D))
    U = U / U.norm(dim=1, keepdim=True) * math.sqrt(D)                    # unit-ish per channel
    # keys: topic * heavy-tailed strength + heavy-tailed noise
    z = torch.randint(0, n_topics, (S,), generator=g)
    a = _student_t(g, (S, 1)).abs()
    k = a * U[z] * 0.5 + _student_t(g, (S, D))
    # queries: 3 topics per token, per-head mixing, noise
    topics = torch.randint(0, n_topics, (T, 3), generator=g)
    c = torch.randn((T, H, 3), generator=g)
    q = torch.einsum("thj,tjd->thd", c, U[topics]) * 0.5 + _student_t(g, (T, H, D))
    # outlier channels among the non-rope dims
    outl = torch.randperm(D // 2, generator=g)[:n_outliers]
    fac = 10.0 + 20.0 * torch.rand((n_outliers,), generator=g)
    k[:, outl] *= fac
    q[:, :, outl] *= fac
    # RoPE on the last 64 dims
    if q_positions is None:
        q_positions = (torch.arange(T) + max(0, 4 * S - T)).clamp_min(0)
    q_pos = q_positions.long().cpu()
    k_pos = torch.arange(S) * 4
    table = rope_cos_sin_table(int(max(int(q_pos.max()) + 1 if T else 1, int(k_pos.max()) + 1 if S else 1)), 64)
    rd = D - 64
    q[..., rd:] = apply_rope(q[..., rd:].reshape(T, H, 64), q_pos, table)
    k[:, rd:] = apply_rope(k[:, rd:], k_pos, table)
    w = (torch.randn((T, H), generator=g) + 0.25) * (D ** -0.5) * (H ** -0.5)
    return IndexerInputs(q=q.to(torch.bfloat16).to(device), k=k.to(torch.bfloat16).to(device),
                         w=w.float().to(device), q_pos=q_pos.to(device), k_pos=k_pos.to(device),
                         outliers=outl.to(device))


def attention_kv(inp: IndexerInputs, *, seed: int = 0, dim: int = 512, temperature: float = 4.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSA attention inputs consistent with an indexer draw (the indexer is trained to predict
    attention, so attention scores must correlate with indexer scores):

    * a fixed random projection ``P [128, 512]`` (seeded) maps indexer K to the 512-d latent:
      ``kv[s] = normalize(K[s] P + 0.5 * t_4 noise) * sqrt(512)`` (rows of equal norm, noise
      Student-t), bf16;
    * ``q_att[t, h] = normalize(q[t, h] P) * sqrt(512) * temperature / sqrt(512)`` so that with
      DSV4's ``softmax_scale = 512^-0.5`` the score of an entry is ``temperature * cos(.,.)``
      (``temperature = 4``: scores spread over a few nats);
    * sink ``[64] ~ N(0, 1)``.

    Returns (q ``[T, 64, 512]`` bf16, kv ``[S, 512]`` bf16, sink ``[64]`` fp32) on the inputs' device.
    """
    g = torch.Generator().manual_seed(int(seed) + 1_000_003)
    dev = inp.k.device
    D = inp.k.shape[1]
    P = (torch.randn((D, dim), generator=g) / math.sqrt(D)).to(dev)
    noise = _student_t(g, (inp.k.shape[0], dim)).to(dev)
    kv = inp.k.float() @ P
    kv = kv / kv.norm(dim=1, keepdim=True) + 0.5 * noise / noise.norm(dim=1, keepdim=True)
    kv = kv / kv.norm(dim=1, keepdim=True) * math.sqrt(dim)
    qa = inp.q.float() @ P
    qa = qa / qa.norm(dim=-1, keepdim=True) * temperature
    sink = torch.randn((inp.q.shape[1],), generator=g).to(dev)
    return qa.to(torch.bfloat16), kv.to(torch.bfloat16), sink.float()
