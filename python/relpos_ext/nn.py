"""``nn.Module``s built on the relpos ops, ready to drop into models."""

from __future__ import annotations

import math
import operator

import torch
from torch import Tensor, nn

from . import ops

__all__ = ["KVCache", "RelativeMultiheadAttention", "ShawRelativeAttention", "clipped_table"]


def _distance(value: object, what: str) -> int:
    """``value`` as an int (an integer type: not a float, which would cut a fraction off)."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


def _table(
    shape: tuple[int, ...], device: torch.device | str | None, dtype: torch.dtype | None
) -> nn.Parameter:
    """A learnable relative-embedding table, uninitialised: :func:`_init_table` fills it."""
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype))


@torch.no_grad()
def _init_table(table: Tensor | None) -> None:
    """N(0, 1/D) in place, the same draws as the layers' initialisation has always made."""
    if table is not None:  # in place, as randn(...) * D^-0.5 draws: also for sharded DTensors
        table.normal_().mul_(table.shape[-1] ** -0.5)


def clipped_table(table: Tensor, left: int, right: int) -> Tensor:
    """A table clipped to ``[-left, right]`` as a Shaw table of ``K = max(left, right)``.

    ``table``: ``[..., left + right + 1, D]`` (row ``r + left`` for distance r; e.g. ``[R, D]``
    or per head ``[H, R, D]``). Returns ``[..., 2K + 1, D]`` whose row ``clamp(r, -K, K) + K``
    (:func:`relpos_ext.rel_attention`'s bucket) is ``table[..., clamp(r, -left, right) + left, :]``
    for every distance r: the shorter side's last row repeated. Differentiable: the gradients of
    the repeated rows add up in the original row.
    """
    if left < 0 or right < 0:
        raise ValueError(f"left and right must be >= 0, got {left} and {right}")
    if table.dim() < 2 or table.shape[-2] != left + right + 1:
        raise ValueError(f"the table must be [..., left + right + 1, D] = [..., {left + right + 1}, "
                         f"D], got {tuple(table.shape)}")
    k = max(left, right)
    rows = torch.arange(-k, k + 1, device=table.device).clamp(-left, right) + left
    return table.index_select(table.dim() - 2, rows)


def additive_mask_hidden(mask: Tensor, name: str) -> Tensor:
    """Which keys a float (additive) attention mask hides: bool, True = hidden.

    Such a mask can only hide or keep keys here: every entry 0 (keep), or -inf or a large
    negative value (hide; at most ``finfo.min / 2``: transformers' masks hold ``finfo.min``).
    Any other value would be a bias the kernels do not add, so it raises
    (``torch._assert_async``: checked in eager and inside ``torch.compile`` alike, without a
    graph break).
    """
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    torch._assert_async((hidden | (mask == 0)).all(),
                        f"a float {name} must hold only 0 (keep) and -inf or large negative "
                        f"values (ignore); additive biases are not supported")
    return hidden


def _bool_mask(mask: Tensor | None, name: str) -> Tensor | None:
    """An nn.MultiheadAttention mask as the kernels take it: bool, True = ignore; a float one
    (``nn.Transformer.generate_square_subsequent_mask``'s 0 / -inf) by
    :func:`additive_mask_hidden`."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise ValueError(f"{name} must be bool (True = ignore) or float (0 = keep, -inf = ignore), "
                         f"got {mask.dtype}")
    return additive_mask_hidden(mask, name)


class ShawRelativeAttention(nn.Module):
    """Multi-head self-attention with Shaw et al. (2018) relative key and value embeddings.

    The key term uses the fused skewed matmul (:func:`relpos_ext.rel_logits`, O(L*D) extra
    memory); the value term uses :func:`relpos_ext.rel_gather` and is O(L^2 * D). Input and output
    are ``[B, L, E]`` (batch first).

    Args:
        embed_dim: model width ``E``; must be divisible by ``num_heads``.
        num_heads: ``H``.
        max_distance: ``K``, the clipping distance; tables have ``2K+1`` rows of ``E / H``.
        causal: mask keys after the query.
        rel_values: also add the relative value term ``sum_j p_ij EV[b(i, j)]``.
        per_head_tables: one table per head (``[H, 2K+1, D]``) instead of one shared table.
        bias: whether the input and output projections have biases (as ``nn.Linear``).
        dropout: dropout on the attention probabilities in training mode (both terms).
        device, dtype: where and in what dtype the parameters are made (as ``nn.Linear``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_distance: int,
        causal: bool = False,
        rel_values: bool = True,
        per_head_tables: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        self.dropout = dropout
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
                             f" > 0")
        max_distance = _distance(max_distance, "max_distance")
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.embed_dim, self.num_heads, self.max_distance = embed_dim, num_heads, max_distance
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        shape = (num_heads,) if per_head_tables else ()
        shape = (*shape, 2 * max_distance + 1, self.head_dim)
        self.rel_k = _table(shape, **factory)
        self.rel_v = _table(shape, **factory) if rel_values else None
        _init_table(self.rel_k)
        _init_table(self.rel_v)

    def reset_parameters(self) -> None:
        """Initialise every parameter again, with the same draws as the constructor.

        For a layer made on ``device="meta"`` and moved by ``to_empty()``: with the same seed,
        ``reset_parameters()`` then gives the weights the constructor would have given.
        """
        self.qkv.reset_parameters()
        self.out_proj.reset_parameters()
        _init_table(self.rel_k)
        _init_table(self.rel_v)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, E]`` -> ``[B, L, E]``."""
        if x.dim() != 3 or x.shape[2] != self.embed_dim:
            raise ValueError(f"x must be [B, L, E] with E = embed_dim = {self.embed_dim}; got "
                             f"{tuple(x.shape)}")
        batch, length, _ = x.shape
        q, k, v = (
            self.qkv(x).view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )
        logits = torch.matmul(q, k.transpose(-1, -2))
        logits = logits + ops.rel_logits(q.contiguous(), self.rel_k, self.max_distance, length)
        logits = logits * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        p = nn.functional.dropout(p, self.dropout, self.training)
        out = torch.matmul(p, v)
        if self.rel_v is not None:
            a = ops.rel_gather(self.rel_v, length, length, self.max_distance)
            eq = "bhij,ijd->bhid" if self.rel_v.dim() == 2 else "bhij,hijd->bhid"
            out = out + torch.einsum(eq, p, a)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))


class KVCache:
    """The projected keys and values of the positions a :class:`RelativeMultiheadAttention` has
    already seen, for decoding step by step without projecting them again.

    Use one cache per layer and pass it to every call of that layer (``cache=``): each call
    appends the keys and values of its ``query`` rows, which take the positions from
    :attr:`length` on, and attends to everything cached so far. :attr:`k` and :attr:`v` are
    ``[B, Hkv, T, D]``.

    Under ``torch.no_grad()`` / ``torch.inference_mode()`` (decoding) the positions live in a
    preallocated ``[B, Hkv, capacity, D]`` buffer that doubles when full: a step writes only its
    new rows, and ``rel_attention`` reads the ``[:, :, :T]`` views in place, so a step costs
    O(new rows) in copies instead of the whole cache. When autograd records the attention over
    them (anything in the call requires grad: the keys may be saved for its backward even where
    they need no gradient themselves), and inside ``torch.compile``, the cache grows with
    ``torch.cat`` (new tensors, which the next step does not overwrite, as autograd and tracing
    need); nothing is detached.

    The cache also keeps the cached positions' key padding (:attr:`key_padding_mask`, for
    batched decoding of prompts of different lengths, padded on the left) and segment ids
    (:attr:`segment_ids`, packed sequences) once a call gives them, so each later call passes
    only its new rows' (or nothing: new rows are not padding). Both ``[B, held]``, or None.
    :meth:`reorder` follows beam search, :meth:`crop` takes back rejected draft rows.

    Args:
        sliding: for a layer with a left window (``window=(left, right)``, ``left >= 0``): after
            each call the layer drops the positions that the window hides from every later
            query, keeping the last ``left`` (plus ``spare``), so the cache holds O(window)
            positions however long the sequence grows (the buffer as well: when full, the kept
            rows move to the front instead of the buffer doubling). The results are those of a
            cache that keeps everything. :attr:`k`, :attr:`v`, :attr:`key_padding_mask` and
            :attr:`segment_ids` then hold the positions from :attr:`offset` on.
        spare: with ``sliding``, positions kept beyond the window, so that :meth:`crop` can take
            back up to ``spare`` of the latest (speculative decoding's rejected draft rows).
    """

    def __init__(self, sliding: bool = False, spare: int = 0) -> None:
        if spare < 0 or (spare and not sliding):
            raise ValueError(f"spare={spare}: positions kept beyond a sliding cache's window, "
                             f">= 0 and only with sliding=True")
        self.sliding = bool(sliding)
        self.spare = int(spare)
        self._left: int | None = None  # the window a sliding cache last slid by
        self.k: Tensor | None = None  # the held positions, [B, Hkv, T - offset, D]
        self.v: Tensor | None = None
        self._k_buf: Tensor | None = None  # k and v are views of these when not None
        self._v_buf: Tensor | None = None
        self._start = 0  # k = _k_buf[:, :, _start:_start + held]
        self.offset = 0  # position of the first held key (positions dropped by a sliding cache)
        self.key_padding_mask: Tensor | None = None  # [B, T - offset] bool, True = ignore
        self.segment_ids: Tensor | None = None  # [B, T - offset] integers

    @property
    def length(self) -> int:
        """Number of positions seen ``T``: the next row's position (:attr:`offset` + the held
        ones; without ``sliding``, every one is held)."""
        return self.offset + self.held

    @property
    def held(self) -> int:
        """Number of positions whose keys the cache holds, ``k.shape[2]``."""
        return 0 if self.k is None else self.k.shape[2]

    @property
    def capacity(self) -> int:
        """Positions the buffer holds before it grows (``held`` when there is no buffer)."""
        return self._k_buf.shape[2] if self._k_buf is not None else self.held

    def append(self, k: Tensor, v: Tensor, recorded: bool | None = None) -> tuple[Tensor, Tensor]:
        """Add ``[B, Hkv, n, D]`` keys and values; returns all the held ones,
        ``[B, Hkv, held + n, D]``. ``recorded``: whether autograd may save the returned tensors
        (the attention that reads them records a graph: its queries or tables require grad);
        then they are new tensors that later appends leave alone. Default: grad mode is on and
        ``k`` or ``v`` requires grad."""
        if self.k is not None and self.v is not None and (
            k.shape[:2] != self.k.shape[:2] or k.shape[3] != self.k.shape[3]
        ):
            raise ValueError(f"keys of shape {tuple(k.shape)} do not extend the cached "
                             f"{tuple(self.k.shape)} ([B, Hkv, T, D])")
        if recorded is None:
            recorded = k.requires_grad or v.requires_grad
        if (torch.is_grad_enabled() and recorded) or torch.compiler.is_compiling():
            return self._append_by_cat(k, v)
        t, n, s = self.held, k.shape[2], self._start
        # a buffer made under inference_mode cannot be written outside it: start a new one
        stale = self._k_buf is not None and self._k_buf.is_inference() and not (
            torch.is_inference_mode_enabled())
        kb, vb = self._k_buf, self._v_buf
        if kb is None or vb is None or stale or s + t + n > kb.shape[2]:
            kb, vb = self._rebuffer(max(2 * (t + n), 16), k, v)
            s = 0
        kb[:, :, s + t:s + t + n] = k
        vb[:, :, s + t:s + t + n] = v
        self.k, self.v = kb[:, :, s:s + t + n], vb[:, :, s:s + t + n]
        return self.k, self.v

    def _rebuffer(self, capacity: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New ``[B, Hkv, capacity, D]`` buffers (like ``k``, ``v``) that hold the held positions
        at their front, ``k`` and ``v`` their views; returns the buffers."""
        t, (b, h, _, d) = self.held, k.shape
        kb, vb = k.new_empty(b, h, capacity, d), v.new_empty(b, h, capacity, d)
        if self.k is not None and self.v is not None:
            kb[:, :, :t] = self.k
            vb[:, :, :t] = self.v
        self._k_buf, self._v_buf, self._start = kb, vb, 0
        self.k, self.v = kb[:, :, :t], vb[:, :, :t]
        return kb, vb

    def _append_by_cat(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """append into new tensors (no buffer): what autograd and torch.compile's tracing need."""
        self._k_buf = self._v_buf = None
        self._start = 0
        if self.k is None or self.v is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def slide(self, left: int) -> None:
        """What the layer of a ``sliding`` cache calls after each call, with its window's
        ``left``: forget the positions before ``length - left - spare`` (keys, values, padding,
        segment ids), which no later row can see; the rest keep their positions."""
        self._left = left
        drop = min(max(self.length - left - self.spare - self.offset, 0), self.held)
        if drop == 0 or self.k is None or self.v is None:
            return
        self.k, self.v = self.k[:, :, drop:], self.v[:, :, drop:]
        if self._k_buf is not None and self._v_buf is not None:
            self._start += drop
            if self._k_buf.shape[2] > 4 * max(self.held, 16):  # after a long prompt: let it go
                self._rebuffer(max(2 * self.held, 16), self.k, self.v)
        if self.key_padding_mask is not None:
            self.key_padding_mask = self.key_padding_mask[:, drop:]
        if self.segment_ids is not None:
            self.segment_ids = self.segment_ids[:, drop:]
        self.offset += drop

    def crop(self, length: int) -> None:
        """Forget the positions from ``length`` on, so that the next row takes position
        ``length``: speculative decoding's rejected draft rows. A sliding cache goes back at
        most ``spare`` positions past what it has dropped: the rows after ``length`` need the
        ``left`` positions before it."""
        first = self.offset if self.offset == 0 or self._left is None else self.offset + self._left
        if not first <= length <= self.length:
            raise ValueError(f"crop({length}): this cache crops to lengths {first} to "
                             f"{self.length}" + (f" (it keeps spare={self.spare} positions beyond "
                                                 f"its window of {self._left})" if first else ""))
        keep = length - self.offset
        if self.k is None or self.v is None or keep == self.held:
            return
        self.k, self.v = self.k[:, :, :keep], self.v[:, :, :keep]
        if self.key_padding_mask is not None:
            self.key_padding_mask = self.key_padding_mask[:, :keep]
        if self.segment_ids is not None:
            self.segment_ids = self.segment_ids[:, :keep]

    def reorder(self, indices: Tensor) -> None:
        """Make batch row ``b`` the cached row ``indices[b]`` (integer ``[B']``, any ``B'``):
        beam search's reordering of its hypotheses. Keys, values, padding and segment ids alike;
        the buffer keeps its capacity."""
        if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise ValueError(f"reorder takes integer indices [B'], got {indices.dtype} of shape "
                             f"{tuple(indices.shape)}")
        if self.k is None or self.v is None:
            return
        idx = indices.to(self.k.device)
        if self._k_buf is not None and self._v_buf is not None:
            end = self._start + self.held
            self._k_buf = self._k_buf.index_select(0, idx)
            self._v_buf = self._v_buf.index_select(0, idx)
            self.k, self.v = self._k_buf[:, :, self._start:end], self._v_buf[:, :, self._start:end]
        else:
            self.k, self.v = self.k.index_select(0, idx), self.v.index_select(0, idx)
        if self.key_padding_mask is not None:
            self.key_padding_mask = self.key_padding_mask.index_select(0, idx)
        if self.segment_ids is not None:
            self.segment_ids = self.segment_ids.index_select(0, idx)

    def padding_after(self, mask: Tensor | None, n: int) -> Tensor | None:
        """The key padding ``[B, held + n]`` of every held position once ``n`` rows are appended
        (the cache is not changed: the layer stores the result after the append).

        ``mask``: bool, True = ignore; ``[B, n]`` (the new rows), ``[B, held + n]`` (every held
        position, replacing what the cache held) or None (the new rows are not padding). None
        while no call has given a mask.
        """
        t = self.held + n
        if mask is None:
            if self.key_padding_mask is None:
                return None
            mask = self.key_padding_mask.new_zeros(self.key_padding_mask.shape[0], n)
        if mask.dim() != 2 or mask.shape[1] not in (n, t):
            raise ValueError(f"with cache=, key_padding_mask must be [B, {n}] (the new rows) or "
                             f"[B, {t}] (every held position after the append), got "
                             f"{tuple(mask.shape)}")
        if mask.shape[1] == t:
            return mask
        old = self.key_padding_mask
        if old is None:
            old = mask.new_zeros(mask.shape[0], t - n)
        return torch.cat([old, mask], dim=1)

    def segment_ids_after(self, ids: Tensor, n: int) -> Tensor:
        """The segment ids ``[B, held + n]`` of every held position once ``n`` rows with ids
        ``ids`` ``[B, n]`` are appended (the cache is not changed); the cache must have had ids
        since its first row."""
        if ids.dim() != 2 or ids.shape[1] != n:
            raise ValueError(f"with cache=, one segment_ids tensor holds the new rows' ids, "
                             f"[B, {n}]; got {tuple(ids.shape)}")
        if self.segment_ids is None:
            if self.length > 0:
                raise ValueError(f"this cache holds {self.length} positions without segment ids: "
                                 f"give segment_ids from the first call on, or pass "
                                 f"(q_segment_ids, k_segment_ids [B, {self.held + n}])")
            return ids
        return torch.cat([self.segment_ids, ids], dim=1)

    def reset(self) -> None:
        """Forget every cached position (a new sequence)."""
        self.k = self.v = self._k_buf = self._v_buf = None
        self.key_padding_mask = self.segment_ids = None
        self._start = self.offset = 0
        self._left = None


class RelativeMultiheadAttention(nn.Module):
    """Multi-head attention with Shaw et al. (2018) relative key/value embeddings, fused.

    A drop-in for ``nn.MultiheadAttention(batch_first=True)`` whose attention core is
    :func:`relpos_ext.rel_attention`: O(L) memory, no ``[L, L]`` matrix, forward and backward.
    Self-attention when ``key``/``value`` are None; cross-attention (``Lq != Lk``) otherwise.
    :meth:`from_multihead_attention` converts a trained ``nn.MultiheadAttention``.

    Args:
        embed_dim: model width ``E``; must be divisible by ``num_heads``.
        num_heads: query heads ``H``.
        max_distance: ``K``; the tables have ``2K+1`` rows of ``E / H``. Or ``(left, right)``:
            distances clipped to ``[-left, right]`` (e.g. w2v-BERT's ``(64, 8)``), tables of
            ``left + right + 1`` rows (:func:`clipped_table` makes the Shaw table each call).
        num_kv_heads: key/value heads (grouped-query attention); must divide ``H``. Default ``H``.
        rel_keys, rel_values: learn the relative key / value table (either may be off).
        per_head_tables: ``[H, 2K+1, D]`` tables instead of one shared ``[2K+1, D]``.
        bias: bias in the projections.
        batch_first: must be True (inputs are ``[B, L, E]``); kept for nn.MultiheadAttention parity.
        kdim, vdim: feature sizes of ``key`` and ``value`` (default ``E``), as in
            nn.MultiheadAttention: cross-attention to a memory of another width. When either
            differs from ``E``, ``key`` and ``value`` must be passed (no self-attention, no cache).
        dropout: attention dropout in training mode, as nn.MultiheadAttention's ``dropout``:
            fused into the kernels (``rel_attention(dropout_p=...)``), a fresh seed per call from
            torch's default generator; off in ``eval()``.
        device, dtype: where and in what dtype the parameters are made, as in
            nn.MultiheadAttention (e.g. ``device="cuda", dtype=torch.bfloat16``).
        window: ``(left, right)``: local attention, query i sees only the keys at relative
            positions ``-left <= r <= right`` (``rel_attention``'s ``window_left`` /
            ``window_right``; -1 leaves a side unbounded). With ``is_causal``, ``(w - 1, 0)``
            is a sliding window of w positions. Default: none.
        rel_bias: also learn a scalar per head and (clipped) distance added to the logits
            after the scale (``rel_attention``'s ``rel_bias``; T5-style, with one bucket per
            distance), ``[H, 2K+1]`` (or ``[H, left + right + 1]``), starting at zero. Costs
            next to nothing in the kernels.
        rel_queries: also learn a key-side table ``EQ`` (shaped like the key table), whose term
            ``k_j . EQ[b(i, j)]`` joins the logits before the scale (``rel_attention``'s
            ``rel_q``): with ``rel_keys``, DeBERTa's disentangled attention (content-to-position
            and position-to-content), learned per clipped distance.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_distance: int | tuple[int, int],
        num_kv_heads: int | None = None,
        rel_keys: bool = True,
        rel_values: bool = True,
        per_head_tables: bool = False,
        bias: bool = True,
        batch_first: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        window: tuple[int, int] | None = None,
        rel_bias: bool = False,
        rel_queries: bool = False,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
        self.dropout = dropout
        if window is not None and (len(window) != 2 or min(window) < -1):
            raise ValueError(f"window must be (left, right), each >= 0 or -1 (that side "
                             f"unbounded); got {window}")
        self.window = (-1, -1) if window is None else (int(window[0]), int(window[1]))
        if not batch_first:
            raise ValueError("RelativeMultiheadAttention supports batch_first=True only")
        if num_heads <= 0 or embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
                             f" > 0")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        # clip: (left, right) when the clipping is asymmetric, else None; max_distance: the K
        # of the Shaw tables the kernels see
        if isinstance(max_distance, (tuple, list)):
            if len(max_distance) != 2:
                raise ValueError(
                    f"max_distance must be an int or (left, right), got {max_distance}")
            self.clip = (_distance(max_distance[0], "max_distance (left, right)"),
                         _distance(max_distance[1], "max_distance (left, right)"))
        else:
            self.clip = None
            max_distance = _distance(max_distance, "max_distance")
        if self.clip is not None:
            if min(self.clip) < 0:
                raise ValueError(f"max_distance (left, right) must be >= 0, got {max_distance}")
            max_distance = max(self.clip)
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.max_distance = max_distance
        self.head_dim = embed_dim // num_heads
        self.batch_first = True
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.k_proj = nn.Linear(self.kdim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        rows = 2 * max_distance + 1 if self.clip is None else sum(self.clip) + 1
        shape = ((num_heads,) if per_head_tables else ()) + (rows, self.head_dim)
        self.rel_k = _table(shape, **factory) if rel_keys else None
        self.rel_v = _table(shape, **factory) if rel_values else None
        self.rel_bias = nn.Parameter(torch.empty(num_heads, rows, **factory)) if rel_bias else None
        self.rel_q = _table(shape, **factory) if rel_queries else None
        self._init_tables()

    def _init_tables(self) -> None:
        for table in (self.rel_k, self.rel_v, self.rel_q):
            _init_table(table)
        if self.rel_bias is not None:
            with torch.no_grad():
                self.rel_bias.zero_()

    def reset_parameters(self) -> None:
        """Initialise every parameter again, with the same draws as the constructor.

        For a layer made on ``device="meta"`` (``torch.device("meta")``, FSDP's deferred
        initialisation) and moved by ``to_empty()``: with the same seed, ``reset_parameters()``
        then gives the weights the constructor would have given (projections as ``nn.Linear``,
        tables N(0, 1/D), the bias zero).
        """
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            proj.reset_parameters()
        self._init_tables()

    @classmethod
    def from_multihead_attention(
        cls,
        mha: nn.MultiheadAttention,
        max_distance: int | tuple[int, int],
        rel_keys: bool = True,
        rel_values: bool = True,
        per_head_tables: bool = False,
        window: tuple[int, int] | None = None,
        rel_bias: bool = False,
        rel_queries: bool = False,
    ) -> RelativeMultiheadAttention:
        """A layer holding ``mha``'s projections (copied) and relative tables of zeros.

        With zero tables the layer computes what ``mha`` computes, up to rounding, so relative
        positions can be added to a trained model and learned from there. Widths (``kdim``,
        ``vdim``), biases, dropout, device and dtype follow ``mha``. The new layer takes
        batch-first inputs (or unbatched ones), whatever ``mha.batch_first`` was.

        Args:
            mha: the layer to convert; ``add_bias_kv`` and ``add_zero_attn`` are not supported.
            max_distance, rel_keys, rel_values, per_head_tables, window, rel_bias, rel_queries:
                as in the constructor (the bias and the key-side table start at zero too).
        """
        if mha.bias_k is not None or mha.bias_v is not None or mha.add_zero_attn:
            raise ValueError("from_multihead_attention: add_bias_kv and add_zero_attn are not "
                             "supported")
        weight = mha.out_proj.weight
        layer = cls(mha.embed_dim, mha.num_heads, max_distance, rel_keys=rel_keys,
                    rel_values=rel_values, per_head_tables=per_head_tables,
                    bias=mha.in_proj_bias is not None, kdim=mha.kdim, vdim=mha.vdim,
                    dropout=mha.dropout, device=weight.device, dtype=weight.dtype, window=window,
                    rel_bias=rel_bias, rel_queries=rel_queries)
        if mha.in_proj_weight is not None:  # one packed [3E, E] weight when kdim == vdim == E
            weights = mha.in_proj_weight.chunk(3)
        else:
            weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        projections = (layer.q_proj, layer.k_proj, layer.v_proj)
        biases = (None,) * 3 if mha.in_proj_bias is None else mha.in_proj_bias.chunk(3)
        with torch.no_grad():
            for proj, w, b in zip(projections, weights, biases):
                proj.weight.copy_(w)
                if b is not None:
                    proj.bias.copy_(b)
            layer.out_proj.weight.copy_(weight)
            if mha.out_proj.bias is not None:
                layer.out_proj.bias.copy_(mha.out_proj.bias)
            for table in (layer.rel_k, layer.rel_v, layer.rel_q):
                if table is not None:
                    table.zero_()
        return layer

    def tables(self) -> tuple[Tensor | None, Tensor | None]:
        """``(rel_k, rel_v)`` as the kernels take them: ``[2K+1, D]`` (or ``[H, 2K+1, D]``)
        Shaw tables, made from the ``left + right + 1`` learned rows when clipping is
        asymmetric."""
        if self.clip is None:
            return self.rel_k, self.rel_v
        return tuple(None if t is None else clipped_table(t, *self.clip)
                     for t in (self.rel_k, self.rel_v))

    def key_side_table(self) -> Tensor | None:
        """The learned key-side table as the kernels take it (``rel_q``), like :meth:`tables`,
        or None."""
        if self.rel_q is None or self.clip is None:
            return self.rel_q
        return clipped_table(self.rel_q, *self.clip)

    def bias_table(self) -> Tensor | None:
        """The learned ``rel_bias`` as the kernels take it, ``[H, 2K+1]`` (clipped rows repeated
        when clipping is asymmetric), or None."""
        if self.rel_bias is None or self.clip is None:
            return self.rel_bias
        return clipped_table(self.rel_bias.unsqueeze(-1), *self.clip).squeeze(-1)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        key_padding_mask: Tensor | None,
        causal: bool,
        q_offset: int,
        k_offset: int,
        dropout_p: float = 0.0,
        dropout_seed: Tensor | None = None,
        attn_mask: Tensor | None = None,
        segment_ids: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The attention core on ``[B, H, L, D]`` heads (overridden by the reference module);
        segment_ids: ``(q_segment_ids, k_segment_ids)`` or None."""
        q_seg, k_seg = segment_ids if segment_ids is not None else (None, None)
        rel_k, rel_v = self.tables()
        return ops.rel_attention(
            q, k, v, rel_k, rel_v, self.max_distance, causal, None, q_offset, k_offset,
            key_padding_mask, dropout_p=dropout_p, dropout_seed=dropout_seed, attn_mask=attn_mask,
            q_segment_ids=q_seg, k_segment_ids=k_seg, window_left=self.window[0],
            window_right=self.window[1], rel_bias=self.bias_table(), rel_q=self.key_side_table(),
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = False,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        q_offset: int = 0,
        k_offset: int = 0,
        cache: KVCache | None = None,
        segment_ids: Tensor | tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """query ``[B, Lq, E]``, key/value ``[B, Lk, E]`` (default: query) -> ``([B, Lq, E], weights)``.

        Unbatched inputs, as nn.MultiheadAttention takes them: query ``[Lq, E]``, key/value
        ``[Lk, E]``, key_padding_mask ``[Lk]``, segment ids ``[L]`` (or a pair), attn_mask
        ``[Lq, Lk]`` or ``[H, Lq, Lk]``; the output is ``[Lq, E]`` and the weights lose their
        batch dimension.

        key_padding_mask: ``[B, Lk]``, bool (True = ignore) or float (0 = keep, -inf = ignore),
        as nn.MultiheadAttention takes it.
        attn_mask: ``[Lq, Lk]`` or ``[B * H, Lq, Lk]`` (nn.MultiheadAttention's shapes;
        ``[B, H, Lq, Lk]`` too), bool (True = query i ignores key j) or float holding only 0
        and -inf (``nn.Transformer.generate_square_subsequent_mask``) or large negative values
        (transformers' ``finfo.min``); a float mask with other values would be an additive
        bias, which is not supported and raises. Read by the fused
        kernel, combined with ``is_causal`` and the padding.
        is_causal: key j visible to query i iff ``k_offset + j <= q_offset + i``.
        need_weights: also return the attention weights, as nn.MultiheadAttention does (after
        dropout): ``[B, Lq, Lk]`` averaged over heads, or ``[B, H, Lq, Lk]`` with
        ``average_attn_weights=False``. The fused kernel never forms them, so they come from a
        separate eager pass with O(Lq Lk) memory (``rel_logits`` for the key term); the default
        False skips it and returns None, which is what makes the layer O(L) in memory.
        cache: self-attention decoding (key, value None; offsets 0): the query rows are the
        positions after the ``cache.length`` cached ones; their keys and values are appended to
        the cache and the rows attend to all of it. With ``is_causal=True``, feeding a sequence
        in pieces gives the rows of one call on the whole sequence. The cache keeps the padding
        and segment ids it is given: ``key_padding_mask`` is then ``[B, Lq]`` for the new rows
        (or ``[B, cache.held]`` after the append, for every held position; or None once given:
        the new rows are not padding), and one ``segment_ids`` tensor is ``[B, Lq]``, the new
        rows' ids. The keys are the held ones (``Lk = cache.held`` after the append, for
        ``attn_mask`` and the weights), from position ``cache.offset`` on; a
        ``KVCache(sliding=True)`` keeps only those the layer's left window lets later rows see.
        segment_ids: integer ``[B, L]`` for self-attention on packed documents (query i sees key
        j only when their ids are equal), or ``(q_segment_ids [B, Lq], k_segment_ids [B, Lk])``
        (cross-attention; with ``cache``, ``Lk`` is ``cache.held`` after the append). O(L),
        where the same pattern as ``attn_mask`` is ``[L, L]``.
        """
        if query.dim() == 2:
            return self._forward_unbatched(query, key, value, key_padding_mask, need_weights,
                                           attn_mask, average_attn_weights, is_causal, q_offset,
                                           k_offset, cache, segment_ids)
        if query.dim() != 3:
            raise ValueError(f"query must be [B, Lq, E] or unbatched [Lq, E], got "
                             f"{tuple(query.shape)}")
        if (key is None or value is None) and not self.kdim == self.vdim == self.embed_dim:
            raise ValueError(f"with kdim={self.kdim}, vdim={self.vdim} and embed_dim="
                             f"{self.embed_dim}, key and value must both be given")
        if cache is not None:
            if key is not None or value is not None:
                raise ValueError("cache= is for self-attention: key and value must be None")
            if q_offset != 0 or k_offset != 0:
                raise ValueError("with cache=, positions come from the cache: q_offset and "
                                 "k_offset must be 0")
            if cache.sliding and self.window[0] < 0:
                raise ValueError("a sliding KVCache drops the positions the layer's window hides: "
                                 "it needs window=(left, right) with left >= 0")
        key = query if key is None else key
        value = key if value is None else value
        key_padding_mask = _bool_mask(key_padding_mask, "key_padding_mask")
        attn_mask = _bool_mask(attn_mask, "attn_mask")
        q = self._heads(self.q_proj(query), self.num_heads)
        k = self._heads(self.k_proj(key), self.num_kv_heads)
        v = self._heads(self.v_proj(value), self.num_kv_heads)
        if cache is not None:
            # checked before anything changes, stored after the append succeeds
            key_padding_mask = cache.padding_after(key_padding_mask, q.shape[2])
            if isinstance(segment_ids, Tensor):  # the new rows' ids
                segment_ids = (segment_ids, cache.segment_ids_after(segment_ids, q.shape[2]))
            elif segment_ids is None and cache.segment_ids is not None:
                raise ValueError("this cache holds segment ids: pass the new rows' segment_ids")
            q_offset = cache.length  # the new rows follow the cached positions
            k_offset = cache.offset  # the first held one (a sliding cache drops the older)
            learned = (self.rel_k, self.rel_v, self.rel_bias, self.rel_q)
            recorded = q.requires_grad or k.requires_grad or v.requires_grad or any(
                t is not None and t.requires_grad for t in learned)
            k, v = cache.append(k, v, recorded=recorded)
            cache.key_padding_mask = key_padding_mask
            if segment_ids is not None:  # (q ids, ids of every position)
                cache.segment_ids = segment_ids[1]
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # nn.MultiheadAttention's [B * H, Lq, Lk]
                if attn_mask.shape[0] != q.shape[0] * self.num_heads:
                    raise ValueError(f"a 3-D attn_mask must be [B * H, Lq, Lk] = "
                                     f"[{q.shape[0] * self.num_heads}, ...]; got "
                                     f"{tuple(attn_mask.shape)}")
                attn_mask = attn_mask.view(q.shape[0], self.num_heads, *attn_mask.shape[1:])
        if isinstance(segment_ids, Tensor):
            if q.shape[2] != k.shape[2]:
                raise ValueError(f"one segment_ids tensor is for self-attention (Lq = Lk); with Lq = "
                                 f"{q.shape[2]}, Lk = {k.shape[2]} pass (q_segment_ids, "
                                 f"k_segment_ids)")
            segment_ids = (segment_ids, segment_ids)
        dropout_p = self.dropout if self.training else 0.0
        seed = ops._draw_dropout_seed() if dropout_p > 0 else None
        z = self.attend(q, k, v, key_padding_mask, is_causal, q_offset, k_offset, dropout_p, seed,
                        attn_mask, segment_ids)
        weights = None
        if need_weights:
            weights = self.attention_weights(q, k, key_padding_mask, is_causal, q_offset, k_offset,
                                             dropout_p, seed, attn_mask, segment_ids)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        if cache is not None and cache.sliding:  # no later query sees a key before length - left
            cache.slide(self.window[0])
        batch, q_len = query.shape[0], query.shape[1]
        return self.out_proj(z.transpose(1, 2).reshape(batch, q_len, self.embed_dim)), weights

    def _forward_unbatched(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
        q_offset: int,
        k_offset: int,
        cache: KVCache | None,
        segment_ids: Tensor | tuple[Tensor, Tensor] | None,
    ) -> tuple[Tensor, Tensor | None]:
        """forward() on nn.MultiheadAttention's unbatched shapes: a batch of one, squeezed."""
        wants = (("key", key, 2), ("value", value, 2), ("key_padding_mask", key_padding_mask, 1))
        for name, t, dim in wants:
            if t is not None and t.dim() != dim:
                raise ValueError(f"with an unbatched query [Lq, E], {name} must be "
                                 f"{'[Lk, E]' if dim == 2 else '[Lk]'}, got {tuple(t.shape)}")
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise ValueError(f"with an unbatched query, attn_mask must be [Lq, Lk] or [H, Lq, Lk], "
                             f"got {tuple(attn_mask.shape)}")

        def batch(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.unsqueeze(0)

        if isinstance(segment_ids, Tensor):
            segment_ids = batch(segment_ids)
        elif segment_ids is not None:
            segment_ids = (batch(segment_ids[0]), batch(segment_ids[1]))
        out, weights = self.forward(batch(query), batch(key), batch(value), batch(key_padding_mask),
                                    need_weights, attn_mask, average_attn_weights, is_causal,
                                    q_offset, k_offset, cache, segment_ids)
        return out.squeeze(0), None if weights is None else weights.squeeze(0)

    def attention_weights(
        self,
        q: Tensor,
        k: Tensor,
        key_padding_mask: Tensor | None,
        causal: bool,
        q_offset: int,
        k_offset: int,
        dropout_p: float = 0.0,
        dropout_seed: Tensor | None = None,
        attn_mask: Tensor | None = None,
        segment_ids: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The probabilities ``[B, H, Lq, Lk]`` the attention core applies to ``q`` ``[B, H, Lq, D]``
        and ``k`` ``[B, Hkv, Lk, D]`` (dropout mask and ``1 / (1 - p)`` included), in eager
        PyTorch: ``[L, L]`` tensors, the key term by ``rel_logits``. Rows with no visible key
        are 0."""
        from . import reference  # late: reference's module subclasses this one

        q_len, k_len = q.shape[2], k.shape[2]
        k = k.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)
        logits = torch.matmul(q, k.transpose(-1, -2))
        rel_k = self.tables()[0]
        if rel_k is not None:
            logits = logits + ops.rel_logits(q.contiguous(), rel_k, self.max_distance, k_len,
                                             q_offset, k_offset)
        rel_q = self.key_side_table()
        if rel_q is not None:  # k_j . EQ[b(i, j)]: the key term of the keys, read transposed
            # (from key j, query i lies at the reversed distance: row 2K - b of the flipped table)
            logits = logits + ops.rel_logits(k.contiguous(), rel_q.flip(-2), self.max_distance,
                                             q_len, k_offset, q_offset).transpose(-1, -2)
        q_seg, k_seg = segment_ids if segment_ids is not None else (None, None)
        visible = reference.visible_keys(q.shape[0], q_len, k_len, causal, q_offset, k_offset,
                                         key_padding_mask, q.device, attn_mask, q_seg, k_seg,
                                         *self.window)
        logits = logits * self.head_dim**-0.5
        bias = self.bias_table()
        if bias is not None:
            buckets = reference.shaw_buckets(q_len, k_len, self.max_distance, q_offset, k_offset,
                                             q.device)
            logits = logits + bias[:, buckets]
        logits = logits.masked_fill(~visible, float("-inf"))
        any_visible = visible.any(-1, keepdim=True)  # rows with no visible key give 0, not NaN
        weights = torch.softmax(logits.masked_fill(~any_visible, 0.0), dim=-1) * any_visible
        if dropout_p > 0:  # the kernels' mask, in PyTorch
            weights = weights * reference.dropout_factors(dropout_seed, q.shape[0], q.shape[1],
                                                          q_len, k_len, dropout_p, q.device,
                                                          weights.dtype)
        return weights
