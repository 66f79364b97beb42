"""Other relative-position schemes as :func:`relpos_ext.rel_attention`'s tables and bias.

T5's bucketed bias and ALiBi add a scalar that depends only on the distance ``r = j - i`` (key
minus query) to each logit. Both are constant beyond some distance K, so each becomes a
``[H, 2K+1]`` table, entry ``r + K`` for ``r`` in ``[-K, K]``, which the kernels read by the same
clamped bucket as the Shaw tables: the ``[B, H, Lq, Lk]`` bias tensor is never formed.
DeBERTa's log-bucketed relative embeddings become ``[H, 2K+1, D]`` tables the same way
(:func:`deberta_buckets`): its content-to-position term is ``rel_k``, its position-to-content
term the key-side table ``rel_q``.

Rotary embeddings (RoPE) take no table: :func:`rope_inv_freq` gives the frequencies (with the
linear, dynamic-NTK, YaRN, Llama 3 and LongRoPE scalings), :func:`rope_cos_sin` the cosines and
sines at given positions, and :func:`relpos_ext.rope` turns queries and keys by them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["alibi_bias_table", "alibi_slopes", "deberta_buckets", "deberta_max_distance",
           "rope_cos_sin", "rope_inv_freq", "t5_bias_table", "t5_buckets"]


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


def _t5_table_defined(num_buckets: int, bidirectional: bool, max_distance: int) -> bool:
    """Whether ``max_distance`` exceeds T5's exact distances (``num_buckets // 4``,
    unidirectional ``// 2``, at least 1): what :func:`t5_bias_table` needs."""
    exact = num_buckets // (4 if bidirectional else 2)
    return 0 < exact < max_distance


def t5_bias_table(weight: Tensor, bidirectional: bool = True, max_distance: int = 128) -> Tensor:
    """T5's relative attention bias as a ``rel_bias`` table, ``[H, 2 max_distance + 1]``.

    ``weight``: the ``relative_attention_bias`` embedding, ``[num_buckets, H]``. Every distance
    of at least ``max_distance`` falls in a last bucket, so with ``K = max_distance``
    ``rel_attention(q, k, v, None, None, K, scale=1.0, rel_bias=table)`` adds exactly T5's
    ``position_bias`` (T5 does not scale its logits). Differentiable in ``weight``.
    ``max_distance`` must exceed T5's exact distances (``num_buckets // 4``, unidirectional
    ``num_buckets // 2``): at or below them T5's log-spaced buckets are not defined (they come
    out below the exact ones, and negative for long distances, where transformers' embedding
    lookup fails), so no table of any width holds them.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [num_buckets, H], got {tuple(weight.shape)}")
    if not _t5_table_defined(weight.shape[0], bidirectional, max_distance):
        exact = weight.shape[0] // (4 if bidirectional else 2)
        raise ValueError(f"T5's buckets need max_distance > num_buckets // "
                         f"{4 if bidirectional else 2} = {exact} > 0 (its exact distances); got "
                         f"max_distance={max_distance} with {weight.shape[0]} buckets")
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


def deberta_buckets(distance: Tensor, position_buckets: int = -1,
                    max_relative_positions: int = 512) -> Tensor:
    """DeBERTa's (v2, v3) relative-embedding row for each distance ``r = j - i`` (int64, in
    ``[0, 2 span)`` with ``span = position_buckets`` if it is positive, else
    ``max_relative_positions``).

    DeBERTa counts ``i - j`` (query minus key). With ``position_buckets > 0`` that distance goes
    through its log buckets: exact within ``position_buckets // 2``, then log-spaced up to
    ``max_relative_positions`` (computed in float32 as transformers does, which decides the
    edges); the row is ``clamp(bucket + span, 0, 2 span - 1)``. Its content-to-position and
    position-to-content terms of self-attention both read this row for the pair ``(i, j)``. As
    ``make_log_bucket_position`` and ``DisentangledSelfAttention.disentangled_attention_bias``
    in transformers' ``modeling_deberta_v2.py``.
    """
    rel = -distance  # DeBERTa's i - j
    if position_buckets > 0:
        span, mid = position_buckets, position_buckets // 2
        far = rel.abs().clamp_min(mid - 1)  # |i - j| below mid is exact: any value <= mid will do
        scaled = torch.log(far.to(torch.float32) / mid) / torch.log(
            torch.tensor((max_relative_positions - 1) / mid, dtype=torch.float32))
        log_bucket = (torch.ceil(scaled * (mid - 1)) + mid).long()
        bucket = torch.where(far <= mid, rel, log_bucket * torch.sign(rel))
    else:
        span, bucket = max_relative_positions, rel
    return (bucket + span).clamp(0, 2 * span - 1)


def deberta_max_distance(position_buckets: int = -1, max_relative_positions: int = 512) -> int:
    """The smallest K beyond which :func:`deberta_buckets` no longer changes (on both sides):
    ``rel_attention``'s ``max_distance`` for DeBERTa's tables, exact for every length.

    Past ``position_buckets // 2`` the log buckets move monotonically with the distance until
    the row clamps (at ``0`` or ``2 span - 1``; with ``position_buckets`` 2 or 3 they stay
    put), so K is the first distance where both sides hold their final rows; found by doubling
    and bisection, as it can lie far beyond
    ``max_relative_positions`` (an odd ``position_buckets``: 7 buckets up to 512 clamp from
    6670 on; the released checkpoints, 256 up to 512, from 512). Raises ValueError where
    DeBERTa's log buckets are undefined (``position_buckets`` 1, or ``position_buckets // 2 ==
    max_relative_positions - 1``: a division by log 1) or still move at 2^40."""
    mid = position_buckets // 2
    if position_buckets > 0 and (mid < 1 or mid == max_relative_positions - 1):
        raise ValueError(f"DeBERTa's log buckets are undefined for position_buckets="
                         f"{position_buckets}, max_relative_positions={max_relative_positions}")
    far = 2 ** 40

    def rows(r: int) -> Tensor:
        return deberta_buckets(torch.tensor([r, -r]), position_buckets, max_relative_positions)

    limit = rows(far)

    def clamped(r: int) -> bool:  # false, then true from K on: the rows move monotonically
        return torch.equal(rows(r), limit)

    hi = 1
    while not clamped(hi):
        hi *= 2
        if hi > far:
            raise ValueError(f"DeBERTa buckets still change at distance {far} (position_buckets"
                             f"={position_buckets}, max_relative_positions="
                             f"{max_relative_positions})")
    lo = hi // 2  # not clamped (or 0)
    while hi - lo > 1:
        mid_r = (lo + hi) // 2
        lo, hi = (lo, mid_r) if clamped(mid_r) else (mid_r, hi)
    return 0 if clamped(0) else hi


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")


def rope_inv_freq(
    dim: int,
    base: float = 10000.0,
    rope_type: str = "default",
    *,
    factor: float | None = None,
    max_position_embeddings: int | None = None,
    original_max_position_embeddings: int | None = None,
    seq_len: int | Tensor | None = None,
    beta_fast: float | None = 32.0,
    beta_slow: float | None = 1.0,
    attention_factor: float | None = None,
    mscale: float | None = None,
    mscale_all_dim: float | None = None,
    truncate: bool = True,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    long_factor: list[float] | None = None,
    short_factor: list[float] | None = None,
    partial_rotary_factor: float | None = None,
) -> tuple[Tensor, float]:
    """RoPE's inverse frequencies ``[dim // 2]`` (float32) and the factor to scale cos and sin
    by, as transformers' ``ROPE_INIT_FUNCTIONS`` compute them (``modeling_rope_utils.py``),
    operation for operation.

    Args:
        dim: the rotary dim ``R`` (head dim times ``partial_rotary_factor``), even.
        base: ``rope_theta``.
        rope_type: ``"default"`` ``1 / base^(2f / R)``; ``"linear"`` (position interpolation)
            divides them by ``factor``; ``"dynamic"`` (dynamic NTK) raises the base for
            ``seq_len`` beyond ``max_position_embeddings``; ``"yarn"`` blends interpolated and
            extrapolated frequencies over the band ``beta_fast``..``beta_slow`` rotations within
            ``original_max_position_embeddings`` and returns YaRN's attention factor (or
            DeepSeek's from ``mscale``/``mscale_all_dim``); ``"llama3"`` (Llama 3.1) scales the
            low frequencies by ``factor`` and smooths between ``low_freq_factor`` and
            ``high_freq_factor``; ``"longrope"`` (Phi-3) divides each frequency by its entry of
            ``long_factor`` when ``seq_len`` exceeds ``original_max_position_embeddings``, else
            of ``short_factor``, and returns LongRoPE's attention factor; ``"proportional"``
            (Gemma 4's global layers) takes ``dim`` as the whole head dim: its first
            ``int(partial_rotary_factor * dim // 2)`` frequencies are the default ones of a
            ``dim``-wide rotation, divided by ``factor``, and the rest are zero (those pairs
            pass through, cos 1 and sin 0).
        seq_len: ``"dynamic"`` and ``"longrope"``: the sequence length the frequencies are for.
            transformers' rotary modules pass ``max(position_ids) + 1``, a 0-d int64 tensor, and
            compute the dynamic base in float32 from it, but in float64 from an int (as a direct
            call of ``ROPE_INIT_FUNCTIONS`` with an int does): pass the same kind to get their
            bits.
        beta_fast, beta_slow: ``"yarn"``; None takes the default (32, 1), as transformers reads
            a config's missing or None entries.
        attention_factor: ``"yarn"`` and ``"longrope"``: the factor to return; None computes
            it (YaRN's ``0.1 ln(factor) + 1``, or DeepSeek's ratio from ``mscale`` and
            ``mscale_all_dim`` when both are given; LongRoPE's
            ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``).
        truncate: ``"yarn"``: round the ramp's ends to whole dims (floor and ceil), as YaRN and
            transformers do by default; False keeps them fractional (gpt-oss's config).
        factor: the scaling factor; by default 1, or for ``"yarn"`` and ``"longrope"``
            ``max_position_embeddings / original_max_position_embeddings`` when both are given
            (as transformers does for Phi-3 and DeepSeek-V3).
        partial_rotary_factor: ``"proportional"`` only (default 1): the share of the head dim
            that rotates. The other types take the rotary dim itself as ``dim``.

    Returns:
        ``(inv_freq, attention_factor)``; pass both to :func:`rope_cos_sin`.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"rope_inv_freq: dim must be even and positive, got {dim}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_inv_freq: rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if partial_rotary_factor is not None and rope_type != "proportional":
        raise ValueError("rope_inv_freq: partial_rotary_factor is for 'proportional' only; for "
                         f"{rope_type!r} pass the rotary dim (head dim times the factor) as dim")
    if rope_type == "proportional":
        return _proportional_inv_freq(dim, base, 1.0 if factor is None else factor,
                                      1.0 if partial_rotary_factor is None else partial_rotary_factor)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim
    if factor is None and rope_type in ("yarn", "longrope") and max_position_embeddings and \
            original_max_position_embeddings:  # as transformers (Phi-3, DeepSeek-V3)
        factor = max_position_embeddings / original_max_position_embeddings
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, base, exponents, factor, original_max_position_embeddings,
                                  seq_len, attention_factor, long_factor, short_factor)
    factor = 1.0 if factor is None else factor
    if rope_type == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("rope_inv_freq: 'dynamic' needs max_position_embeddings")
        if isinstance(seq_len, Tensor):  # transformers' two branches, each operation as there
            seq_len = torch.maximum(seq_len, torch.tensor(max_position_embeddings,
                                                          dtype=seq_len.dtype, device=seq_len.device))
        else:
            seq_len = max(seq_len or 0, max_position_embeddings)
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, factor, original_max_position_embeddings,
                              32.0 if beta_fast is None else beta_fast,
                              1.0 if beta_slow is None else beta_slow, attention_factor, mscale,
                              mscale_all_dim, truncate)
    if rope_type == "llama3":
        if original_max_position_embeddings is None:
            raise ValueError("rope_inv_freq: 'llama3' needs original_max_position_embeddings")
        low_wavelen = original_max_position_embeddings / low_freq_factor
        high_wavelen = original_max_position_embeddings / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return inv_freq, 1.0


def _proportional_inv_freq(dim: int, base: float, factor: float,
                           partial_rotary_factor: float) -> tuple[Tensor, float]:
    """Proportional RoPE (Gemma 4), as ``_compute_proportional_rope_parameters`` in transformers'
    ``modeling_rope_utils.py``: ``dim // 2`` frequencies of which the first
    ``int(partial_rotary_factor * dim // 2)`` rotate."""
    if not 0.0 <= partial_rotary_factor <= 1.0:
        raise ValueError("rope_inv_freq: partial_rotary_factor must be in [0, 1], got "
                         f"{partial_rotary_factor}")
    angles = int(partial_rotary_factor * dim // 2)
    # transformers' own arange of `angles` exponents, not a slice of the default frequencies:
    # a vectorised pow may round an element differently at another position in a longer tensor
    rotated = 1.0 / (base ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(
        dtype=torch.float) / dim))
    inv_freq = torch.cat((rotated, torch.zeros(dim // 2 - angles, dtype=torch.float32)))
    return inv_freq / factor, 1.0


def _longrope_inv_freq(dim: int, base: float, exponents: Tensor, factor: float | None,
                       original_max: int | None,
                       seq_len: int | None, attention_factor: float | None,
                       long_factor: list[float] | None,
                       short_factor: list[float] | None) -> tuple[Tensor, float]:
    """LongRoPE (Ding et al. 2024), as ``_compute_longrope_parameters`` in transformers'
    ``modeling_rope_utils.py``."""
    if original_max is None or long_factor is None or short_factor is None:
        raise ValueError("rope_inv_freq: 'longrope' needs original_max_position_embeddings, "
                         "long_factor and short_factor")
    for name, f in (("long_factor", long_factor), ("short_factor", short_factor)):
        if len(f) != dim // 2:
            raise ValueError(f"rope_inv_freq: {name} must have dim // 2 = {dim // 2} entries, "
                             f"got {len(f)}")
    if factor is None:
        raise ValueError("rope_inv_freq: 'longrope' needs factor, or max_position_embeddings "
                         "with original_max_position_embeddings")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0 else
                            math.sqrt(1 + math.log(factor) / math.log(original_max)))
    long = bool(seq_len and seq_len > original_max)
    ext = torch.tensor(long_factor if long else short_factor, dtype=torch.float32)
    return 1.0 / (ext * base ** exponents), attention_factor


def _yarn_inv_freq(dim: int, base: float, factor: float, original_max: int | None,
                   beta_fast: float, beta_slow: float, attention_factor: float | None,
                   mscale: float | None, mscale_all_dim: float | None,
                   truncate: bool) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023), as ``_compute_yarn_parameters`` in transformers'
    ``modeling_rope_utils.py``."""
    if original_max is None:
        raise ValueError("rope_inv_freq: 'yarn' needs original_max_position_embeddings")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
                            if mscale and mscale_all_dim else get_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def rope_cos_sin(
    inv_freq: Tensor,
    positions: Tensor,
    attention_factor: float = 1.0,
    interleaved: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """The cosines and sines :func:`relpos_ext.rope` takes, ``[..., R]`` for positions
    ``[...]`` (e.g. HF's ``position_ids [B, L]``, or ``arange(L) + offset``).

    As transformers' rotary embedding modules (``LlamaRotaryEmbedding.forward``): angles
    ``position * inv_freq`` in float32, each angle on both features of its pair (``cat((f, f))``,
    or ``repeat_interleave(2)`` when ``interleaved``), times ``attention_factor``, cast to
    ``dtype`` (default float32). Queries ``[B, H, L, D]`` with ``positions [B, L]`` take
    ``cos[:, None]``; positions ``[L]`` broadcast over the batch as they are.
    """
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device,
                                                                 dtype=torch.float32)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * attention_factor, emb.sin() * attention_factor
    dtype = torch.float32 if dtype is None else dtype
    return cos.to(dtype), sin.to(dtype)

