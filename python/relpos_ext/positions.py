"""Scalar position biases as :func:`relpos_ext.rel_attention`'s ``rel_bias``.

T5's bucketed bias and ALiBi add a scalar that depends only on the distance ``r = j - i`` (key
minus query) to each logit. Both are constant beyond some distance K, so each becomes a
``[H, 2K+1]`` table, entry ``r + K`` for ``r`` in ``[-K, K]``, which the kernels read by the same
clamped bucket as the Shaw tables: the ``[B, H, Lq, Lk]`` bias tensor is never formed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["alibi_bias_table", "alibi_slopes", "t5_bias_table", "t5_buckets"]


def t5_buckets(distance: Tensor, bidirectional: bool = True, num_buckets: int = 32,
               max_distance: int = 128) -> Tensor:
    """T5's bucket of each distance ``r = j - i`` (int64, in ``[0, num_buckets)``).

    Bidirectional: half the buckets for ``r > 0``, half for ``r <= 0``; unidirectional (a
    decoder): every ``r > 0`` shares bucket 0. Of each half, the first half of the buckets are
    the exact distances ``0 .. n/2 - 1``, the rest log-spaced up to ``max_distance``, beyond
    which the last bucket holds. As ``T5Attention._relative_position_bucket`` in transformers.
    """
    n = num_buckets
    bucket = torch.zeros_like(distance)
    if bidirectional:
        n //= 2
        bucket = bucket + (distance > 0).long() * n
        d = distance.abs()
    else:
        d = (-distance).clamp_min(0)
    exact = n // 2
    # the log-spaced buckets, computed in float32 as transformers does (it decides the edges)
    far = exact + (torch.log(d.float() / exact) / math.log(max_distance / exact)
                   * (n - exact)).long()
    far = far.clamp_max(n - 1)
    return bucket + torch.where(d < exact, d, far)


def t5_bias_table(weight: Tensor, bidirectional: bool = True, max_distance: int = 128) -> Tensor:
    """T5's relative attention bias as a ``rel_bias`` table, ``[H, 2 max_distance + 1]``.

    ``weight``: the ``relative_attention_bias`` embedding, ``[num_buckets, H]``. Every distance
    of at least ``max_distance`` falls in a last bucket, so with ``K = max_distance``
    ``rel_attention(q, k, v, None, None, K, scale=1.0, rel_bias=table)`` adds exactly T5's
    ``position_bias`` (T5 does not scale its logits). Differentiable in ``weight``.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_buckets, H], got {tuple(weight.shape)}")
    r = torch.arange(-max_distance, max_distance + 1, device=weight.device)
    buckets = t5_buckets(r, bidirectional, weight.shape[0], max_distance)
    return weight[buckets].t()


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al. 2022), float32 ``[H]``: ``2^(-8 (h+1) / n)`` for
    the ``n`` heads when ``n`` is a power of two; otherwise those of the largest power of two
    below ``n`` followed by every other slope of twice that many, as the reference code and
    transformers' BLOOM do."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be > 0, got {num_heads}")
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    extra = [2.0 ** (-4.0 * (h + 1) / n) for h in range(0, 2 * (num_heads - n), 2)]
    return torch.tensor(slopes + extra, dtype=torch.float32)


def alibi_bias_table(slopes: Tensor, max_distance: int) -> Tensor:
    """ALiBi as a ``rel_bias`` table: ``-slope_h |r|``, ``[H, 2 max_distance + 1]``.

    ALiBi grows without bound, so ``max_distance`` must reach the longest distance attended
    (``L - 1`` for self-attention of length L; ``rel_attention``'s K) for exact ALiBi; beyond it
    the bias would stay at ``-slope K``. Under a causal mask only ``r <= 0`` is read, where
    this equals BLOOM's ``slope * key_position`` up to a per-row constant, which the softmax
    ignores."""
    if max_distance < 0:
        raise ValueError(f"max_distance must be >= 0, got {max_distance}")
    r = torch.arange(-max_distance, max_distance + 1, device=slopes.device, dtype=slopes.dtype)
    return -slopes[:, None] * r.abs()[None, :]
