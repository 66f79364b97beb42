"""Eager PyTorch oracle for every relpos op, written for clarity, not speed.

The compiled kernels are tested against these functions. Conventions follow DESIGN.md §1:
``r(i, j) = (k_offset + j) - (q_offset + i)`` ("key minus query", Shaw et al. 2018 /
tensor2tensor / T5) and ``bucket = clamp(r, -K, K) + K`` with ``K = max_distance``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "shaw_buckets",
    "rel_gather",
    "skew",
    "skew_t2t",
    "rel_logits",
    "rel_logits_gather",
    "dropout_keep",
    "dropout_factors",
    "visible_keys",
    "shaw_attention",
    "shaw_attention_gather",
    "rope_rotate",
    "rope_rotated",
    "rope",
    "RelativeMultiheadAttentionReference",
]


def shaw_buckets(
    q_len: int,
    k_len: int,
    max_distance: int,
    q_offset: int = 0,
    k_offset: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Bucket index of every (query, key) pair: ``[Lq, Lk]`` int64 in ``[0, 2K]``."""
    pos_q = torch.arange(q_len, device=device) + q_offset
    pos_k = torch.arange(k_len, device=device) + k_offset
    r = pos_k[None, :] - pos_q[:, None]
    return r.clamp(-max_distance, max_distance) + max_distance


def rel_gather(
    table: Tensor, q_len: int, k_len: int, max_distance: int, q_offset: int = 0, k_offset: int = 0
) -> Tensor:
    """``A[(h,) i, j, :] = table[(h,) bucket(i, j), :]``.

    table: ``[2K+1, D]`` or ``[H, 2K+1, D]``; returns ``[Lq, Lk, D]`` or ``[H, Lq, Lk, D]``.
    """
    b = shaw_buckets(q_len, k_len, max_distance, q_offset, k_offset, table.device)
    return table[b] if table.dim() == 2 else table[:, b]


def skew_t2t(x: Tensor) -> Tensor:
    """tensor2tensor's pad/reshape/slice skew, generalised to ``Lq != Lk``.

    x: ``[..., Lq, Lq+Lk-1]`` (column c holds distance ``c - (Lq-1)``) -> ``[..., Lq, Lk]``.
    Follows ``_relative_position_to_absolute_position_unmasked`` in tensor2tensor's
    ``layers/common_attention.py``: pad one column, flatten, pad, reshape, slice.
    """
    *lead, q_len, width = x.shape
    k_len = width - q_len + 1
    if q_len == 0:  # no rows: the reshapes below would lose Lk
        return x.new_empty(*lead, 0, k_len)
    x = torch.nn.functional.pad(x, (0, 1))  # [..., Lq, W+1]
    x = x.reshape(*lead, q_len * (width + 1))
    x = torch.nn.functional.pad(x, (0, width - q_len))  # now (Lq+1) * W elements
    x = x.reshape(*lead, q_len + 1, width)
    return x[..., :q_len, q_len - 1 : q_len - 1 + k_len]


def skew_t2t_masked(x: Tensor) -> Tensor:
    """tensor2tensor's causal skew (``_relative_position_to_absolute_position_masked``).

    x: ``[..., L, L]`` with column c holding distance ``c - (L-1)``; the lower triangle of the
    result is the skewed x. Above the diagonal t2t leaves whatever the reshape put there (the
    paper masks it away); :func:`skew` with ``causal=True`` zeroes it.
    """
    *lead, length, _ = x.shape
    x = torch.nn.functional.pad(x, (1, 0))  # [..., L, L+1]
    x = x.reshape(*lead, length + 1, length)
    return x[..., 1:, :]


def skew(x: Tensor, causal: bool = False) -> Tensor:
    """Music Transformer skew: ``y[..., i, j] = x[..., i, j - i + Lq - 1]``.

    Non-causal: x ``[..., Lq, Lq+Lk-1]`` -> ``[..., Lq, Lk]``. Causal: x ``[..., L, L]`` ->
    ``[..., L, L]``, lower-triangular, zeros above the diagonal.
    """
    if not causal:
        return skew_t2t(x)
    length = x.shape[-1]
    keep = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    return skew_t2t_masked(x).masked_fill(~keep, 0)


def rel_logits(
    q: Tensor,
    table: Tensor,
    max_distance: int,
    k_len: int,
    q_offset: int = 0,
    k_offset: int = 0,
) -> Tensor:
    """``S[b, h, i, j] = q[b, h, i, :] . table[(h,) bucket(i, j), :]`` the memory-hungry way.

    q: ``[B, H, Lq, D]``; table ``[2K+1, D]`` or ``[H, 2K+1, D]``; returns ``[B, H, Lq, Lk]``.
    Materialises the ``[Lq, Lk, D]`` gather (tensor2tensor's ``_relative_attention_inner``).
    """
    a = rel_gather(table, q.shape[2], k_len, max_distance, q_offset, k_offset)
    if table.dim() == 2:
        return torch.einsum("bhid,ijd->bhij", q, a)
    return torch.einsum("bhid,hijd->bhij", q, a)


def rel_logits_gather(
    q: Tensor,
    table: Tensor,
    max_distance: int,
    k_len: int,
    q_offset: int = 0,
    k_offset: int = 0,
) -> Tensor:
    """The same logits as :func:`rel_logits` via ``q @ table^T`` and ``torch.gather``.

    The "efficient eager" form: O(Lq * (2K+1)) for the matmul, then an index gather.
    """
    qe = torch.matmul(q, table.transpose(-1, -2))  # [B, H, Lq, 2K+1]
    b = shaw_buckets(q.shape[2], k_len, max_distance, q_offset, k_offset, q.device)
    return torch.gather(qe, -1, b.expand(*qe.shape[:-1], k_len))


_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2^32`` for int64 tensors holding uint32 values, in halves of c so that no
    int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """The 32-bit finaliser of csrc/common/dropout.h on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(
    seed: int | Tensor,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dropout_p: float,
    device: torch.device | str | None = None,
    row_start: int = 0,
    col_start: int = 0,
) -> Tensor:
    """Which attention probabilities ``rel_attention`` keeps under dropout: ``[B, H, Lq, Lk]`` bool.

    The counter-based hash of csrc/common/dropout.h, in int64 arithmetic: ``(seed, b * H + h, i,
    j)`` -> 32 bits ``u``; kept iff ``u >> 1 >= min(floor(p * 2^31), 2^31 - 1)``. The same mask
    in the forward and the backward, whatever the tiling. ``i`` is the query row of the call
    (not its position ``q_offset + i``), ``j`` its key column; ``row_start`` and ``col_start``
    give rows ``row_start ..`` and columns ``col_start ..`` of a call's mask, so that a block
    can be taken alone.
    """
    if not isinstance(seed, Tensor):  # as the op takes it: int64, two's complement
        seed = torch.tensor((int(seed) + 2**63) % 2**64 - 2**63, dtype=torch.int64)
    seed = seed.reshape(())  # tensor arithmetic only: no .item(), traceable
    seed = seed if device is None else seed.to(device)
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    threshold = min(math.floor(dropout_p * 2.0**31), 2**31 - 1)
    bh = torch.arange(batch * heads, dtype=torch.int64, device=device)
    head = _mix32((_mix32(bh ^ hi) + lo) & _MASK32)
    i = torch.arange(row_start, row_start + q_len, dtype=torch.int64, device=device)
    row = _mix32(head[:, None] ^ _mul32(i, 0x9E3779B9)[None, :])  # [B*H, Lq]
    j = torch.arange(col_start, col_start + k_len, dtype=torch.int64, device=device)
    u = _mix32((row[:, :, None] + _mul32(j, 0x85EBCA6B)) & _MASK32)
    return ((u >> 1) >= threshold).view(batch, heads, q_len, k_len)


def visible_keys(
    batch: int,
    q_len: int,
    k_len: int,
    causal: bool = False,
    q_offset: int = 0,
    k_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    device: torch.device | str | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
) -> Tensor:
    """``[B, 1 or H, Lq, Lk]`` bool: key j visible to query i (causal: ``k_offset + j <= q_offset
    + i``; key_padding_mask ``[B, Lk]`` and attn_mask ``[Lq, Lk]`` or ``[B or 1, H or 1, Lq,
    Lk]``, True = ignore; segment ids ``[B, Lq]`` and ``[B, Lk]``: only within a segment; a
    window: only ``-window_left <= r <= window_right`` where a bound is >= 0)."""
    r = ((torch.arange(k_len, device=device) + k_offset)[None, :]
         - (torch.arange(q_len, device=device) + q_offset)[:, None])
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        visible = r <= 0
    if window_left >= 0:
        visible = visible & (r >= -window_left)
    if window_right >= 0:
        visible = visible & (r <= window_right)
    visible = visible.expand(batch, 1, q_len, k_len)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        visible = visible & ~attn_mask
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("q_segment_ids and k_segment_ids go together")
    if q_segment_ids is not None:
        visible = visible & (q_segment_ids[:, None, :, None] == k_segment_ids[:, None, None, :])
    return visible


def dropout_factors(
    seed: int | Tensor,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    dropout_p: float,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    row_start: int = 0,
    col_start: int = 0,
) -> Tensor:
    """What dropout multiplies each probability by: ``dropout_keep / (1 - p)`` (0 for p = 1),
    ``[B, H, Lq, Lk]`` in ``dtype`` (float64 keeps ``1 / (1 - p)`` exact for gradcheck);
    ``row_start`` and ``col_start`` as for :func:`dropout_keep`."""
    keep = dropout_keep(seed, batch, heads, q_len, k_len, dropout_p, device, row_start,
                        col_start).to(dtype)
    return keep * (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)


def shaw_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None,
    rel_v: Tensor | None,
    max_distance: int,
    causal: bool = False,
    scale: float | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Shaw et al. 2018 attention with relative keys and values, fully materialised.

    ``e = (q k^T + q . EK[b] + k . EQ[b]) * scale + bias[b]``, ``p = softmax(e)``,
    ``z = p v + sum_j p_ij EV[b(i, j)]``.
    q: ``[B, H, Lq, D]``; k, v: ``[B, Hkv, Lk, D]`` (Hkv divides H: grouped-query attention);
    tables ``[2K+1, D]`` or ``[H, 2K+1, D]``; key_padding_mask ``[B, Lk]`` and attn_mask
    ``[Lq, Lk]`` or ``[B or 1, H or 1, Lq, Lk]``, bool, True = ignore; segment ids ``[B, Lq]``
    and ``[B, Lk]``: query i sees key j only when their ids are equal; a window keeps only
    ``-window_left <= r <= window_right`` (a negative bound: none). Causal masking keeps key j for query i iff ``k_offset + j <= q_offset + i``. Rows with no
    visible key give zeros (and ``lse = +inf``). With return_lse, also returns the
    log-sum-exp of the scaled logits, ``[B, H, Lq]``. With ``dropout_p > 0`` the probabilities
    ``p`` of both terms are multiplied by ``dropout_keep(dropout_seed, ...) / (1 - p)`` (0 for
    ``p = 1``); the log-sum-exp is the one without dropout. ``rel_bias`` ``[2K+1]`` or
    ``[H, 2K+1]`` (or None) is a scalar per bucket added after the scale (T5, ALiBi).
    ``rel_q`` (``EQ``, shaped like the tables, or None) is the key-side table: ``k_j . EQ[b(i, j)]``
    is DeBERTa's position-to-content term.
    """
    q_len, k_len, dim = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1  # no heads at all: nothing to repeat
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    # the kernels' default, 1 / sqrt(max(D, 1)): D = 0 has no logits to scale
    scale = 1.0 / math.sqrt(max(dim, 1)) if scale is None else scale
    logits = torch.matmul(q, k.transpose(-1, -2))
    if rel_k is not None:
        logits = logits + rel_logits(q, rel_k, max_distance, k_len, q_offset, k_offset)
    if rel_q is not None:  # S[b, h, i, j] = k[b, h, j, :] . EQ[(h,) bucket(i, j), :]
        a = rel_gather(rel_q, q_len, k_len, max_distance, q_offset, k_offset)
        eq = "bhjd,ijd->bhij" if rel_q.dim() == 2 else "bhjd,hijd->bhij"
        logits = logits + torch.einsum(eq, k, a)
    logits = logits * scale
    if rel_bias is not None:
        logits = logits + rel_bias[..., shaw_buckets(q_len, k_len, max_distance, q_offset,
                                                     k_offset, q.device)]
    visible = visible_keys(q.shape[0], q_len, k_len, causal, q_offset, k_offset,
                           key_padding_mask, q.device, attn_mask, q_segment_ids, k_segment_ids,
                           window_left, window_right)
    logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    any_visible = visible.any(-1, keepdim=True)
    p = torch.softmax(logits.masked_fill(~any_visible, 0.0), dim=-1) * any_visible
    if dropout_p > 0:
        if dropout_seed is None:
            raise ValueError("dropout_p > 0 needs dropout_seed")
        p = p * dropout_factors(dropout_seed, q.shape[0], q.shape[1], q_len, k_len, dropout_p,
                                q.device, p.dtype)
    out = torch.matmul(p, v)
    if rel_v is not None:
        a = rel_gather(rel_v, q_len, k_len, max_distance, q_offset, k_offset)
        eq = "bhij,ijd->bhid" if rel_v.dim() == 2 else "bhij,hijd->bhid"
        out = out + torch.einsum(eq, p, a)
    if return_lse:
        return out, lse.masked_fill(~any_visible[..., 0], float("inf"))
    return out


def shaw_attention_gather(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None,
    rel_v: Tensor | None,
    max_distance: int,
    causal: bool = False,
    dropout_p: float = 0.0,
    attn_mask: Tensor | None = None,
) -> Tensor:
    """Shaw et al. (2018) attention in lean eager PyTorch: ``[L, L]`` tensors, never ``[L, L, D]``.

    q, k, v: ``[B, H, L, D]`` (self-attention, ``Lq = Lk``); rel_k, rel_v: ``[2K+1, D]`` or
    ``[H, 2K+1, D]``, or None to drop that term. Returns ``[B, H, L, D]``, equal to
    :func:`shaw_attention`. The "efficient eager" baseline of the benchmarks.

    Keys: ``q @ rel_k^T`` (``[B, H, L, 2K+1]``) then ``torch.gather`` by bucket. Values: the
    transpose, ``out_i += sum_b W[i, b] rel_v[b]`` where ``W[i, b]`` is the probability mass of
    row i in bucket b, summed with ``scatter_add`` (DESIGN.md §1). The softmax still holds the
    ``[B, H, L, L]`` logits and probabilities, plus the ``[L, L]`` int64 bucket index. With
    ``dropout_p > 0``, ``F.dropout`` on the probabilities (torch's own mask, not
    :func:`dropout_keep`'s), and a bool ``attn_mask`` (True = ignore; every row must keep a
    key): the eager baseline of ``benchmarks/bench_training.py``.
    """
    length = q.shape[2]
    q = q * max(q.shape[-1], 1) ** -0.5  # scale q, not the [L, L] logits: one temporary fewer
    buckets = shaw_buckets(length, length, max_distance, device=q.device)  # [L, L] int64
    logits = torch.matmul(q, k.transpose(-1, -2))
    if rel_k is not None:
        qe = torch.matmul(q, rel_k.transpose(-1, -2))  # [B, H, L, 2K+1]
        # In place: the matmul's backward needs q and k, not its output; one [L, L] fewer.
        logits += torch.gather(qe, -1, buckets.expand_as(logits))
    if causal:
        after = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(after, float("-inf"))
    if attn_mask is not None:
        logits = logits.masked_fill(attn_mask, float("-inf"))
    p = torch.softmax(logits, dim=-1)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p, training=True)
    out = torch.matmul(p, v)
    if rel_v is not None:
        w = p.new_zeros((*p.shape[:-1], rel_v.shape[-2]))  # [B, H, L, 2K+1]
        w = w.scatter_add(-1, buckets.expand_as(p), p)
        out = out + torch.matmul(w, rel_v)
    return out



def rope_rotate(x: Tensor, interleaved: bool = False) -> Tensor:
    """HF transformers' ``rotate_half`` (models/llama/modeling_llama.py): ``cat(-x2, x1)`` of the
    halves; interleaved, ``rotate_every_two`` (models/gptj/modeling_gptj.py): pairs
    ``(x[2f], x[2f+1]) -> (-x[2f+1], x[2f])``."""
    if interleaved:
        # reshape, not flatten(-2): batched gradients (is_grads_batched) have no flatten rule
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_rotated(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
                 inverse: bool = False) -> Tensor:
    """The rotated features, in the dtype of the operands (no casts, no pass-through):
    ``x * cos + rotate(x) * sin`` (HF's apply_rotary_pos_emb), or the adjoint
    ``x * cos - rotate(x * sin)``."""
    if inverse:
        return x * cos - rope_rotate(x * sin, interleaved)
    return x * cos + rope_rotate(x, interleaved) * sin


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False,
         inverse: bool = False) -> Tensor:
    """Oracle of ``relpos::rope``: the first ``R = cos.shape[-1]`` features of ``x`` rotated
    (:func:`rope_rotated`), the rest passed through; cos and sin cast to ``x``'s dtype as HF
    does, the arithmetic in float32 (float64 for float64) and rounded once."""
    r = cos.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = rope_rotated(x[..., :r].to(acc), cos.to(x.dtype).to(acc), sin.to(x.dtype).to(acc),
                     interleaved, inverse)
    return torch.cat((y.to(x.dtype), x[..., r:]), dim=-1)


def _reference_module_base():
    from .nn import RelativeMultiheadAttention  # late import: nn depends on the compiled ops

    return RelativeMultiheadAttention


class RelativeMultiheadAttentionReference(_reference_module_base()):
    """:class:`relpos_ext.nn.RelativeMultiheadAttention` with the core done by :func:`shaw_attention`.

    Same parameters and projections; plain PyTorch attention, O(L^2 D) memory. For tests.
    """

    def attend(self, q, k, v, key_padding_mask, causal, q_offset, k_offset, dropout_p=0.0,
               dropout_seed=None, attn_mask=None, segment_ids=None):
        q_seg, k_seg = segment_ids if segment_ids is not None else (None, None)
        rel_k, rel_v = self.tables()
        return shaw_attention(
            q, k, v, rel_k, rel_v, self.max_distance, causal, None, q_offset, k_offset,
            key_padding_mask, dropout_p=dropout_p, dropout_seed=dropout_seed, attn_mask=attn_mask,
            q_segment_ids=q_seg, k_segment_ids=k_seg, window_left=self.window[0],
            window_right=self.window[1], rel_bias=self.bias_table(), rel_q=self.key_side_table(),
        )
