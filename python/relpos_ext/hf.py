"""Fused attention for Hugging Face transformers models with relative positions.

Two position types of transformers' speech encoders are Shaw-style relative keys, which
:func:`use_fused_attention` routes through :func:`relpos_ext.rel_attention` with the module's own
parameters (nothing is copied; checkpoints load and save as before):

* ``position_embeddings_type="relative_key"`` (Wav2Vec2-BERT / w2v-BERT 2.0, the SeamlessM4T v2
  speech encoder; transformers' ``modeling_wav2vec2_bert.py``
  ``_apply_relative_key_position_encoding``): Shaw et al.'s key term with asymmetric clipping. The
  distance ``r = j - i`` (key minus query, our convention) is clamped to ``[-left, right]`` (64
  and 8 in the released checkpoints) and indexes a ``[left + right + 1, D]`` embedding.
  transformers gathers it to an ``[L, L, D]`` tensor (4 GiB at L = 4096, D = 64, float32).
* ``position_embeddings_type="relative"`` (Wav2Vec2-Conformer, Wav2Vec2-BERT, the SeamlessM4T v1
  speech encoder; ``modeling_wav2vec2_conformer.py`` ``_apply_relative_position_encoding``; and
  FastSpeech2-Conformer's ESPnet attention, ``FastSpeech2ConformerAttention``, the same maths):
  Transformer-XL's ``(q_i + u) . k_j + (q_i + v) . R[r]`` with projected sinusoids ``R`` for
  every distance of the sequence, computed there as ``[B, H, L, 2L - 1]`` scores and a rel-shift.
  That is Shaw's key term, unclipped (K = L - 1), with per-head tables ``R``, on the queries
  ``q + u``, plus the scalar ``(v - u) . R[r]`` per head and distance as ``rel_bias``
  (:func:`transformer_xl_inputs`).

T5's bucketed scalar bias (T5, mT5, Switch Transformers, LongT5's decoder, Pop2Piano, UDOP's
decoder: their ``T5Attention`` copies) is ``rel_bias``: :func:`relpos_ext.t5_bias_table` expands
the ``[num_buckets, H]`` embedding to one entry per distance up to
``relative_attention_max_distance`` (beyond it T5's last bucket holds), and the fused first layer
hands that ``[H, 2K+1]`` table to the others in place of the ``[1, H, L, L]`` ``position_bias``
transformers passes down the stack. Self-attention is fused: encoders, and decoders in training,
in scoring and in generation, where a step's new rows follow the cached ones (``q_offset``) and
read the keys transformers' KV cache returns (a ``DynamicCache``, in generation the self-attention
half of an ``EncoderDecoderCache``). Cross-attention, ``output_attentions``, a sliding-window cache,
a cache whose length is a tensor (a ``StaticCache`` once written to) and a ``[B, H, L, L]``
position_bias made by transformers (UDOP's encoder, which adds a 2-D layout bias) run transformers'
own forward. UMT5 (``UMT5Attention``) has such a bias in every self-attention layer; each of its
layers makes its own table.

DeBERTa's disentangled attention (DeBERTa-v2, DeBERTa-v3, mDeBERTa: transformers'
``modeling_deberta_v2.py`` ``DisentangledSelfAttention``) is Shaw attention with two tables and
no value term: its content-to-position term ``q_i . Kr[row(i, j)]`` is ``rel_k`` and its
position-to-content term ``k_j . Qr[row(i, j)]`` the key-side table ``rel_q``, both the projected
relative embeddings expanded by :func:`relpos_ext.positions.deberta_buckets` to one row per
distance up to :func:`relpos_ext.positions.deberta_max_distance` (512 for DeBERTa-v3), scaled by
``1 / sqrt(D * (1 + number of terms))`` as there. transformers forms the ``[B, H, L, L]`` scores
of each term (and an ``[L, L]`` int64 index); the fused form none. The relative positions are
rebuilt from the length (the ``relative_pos`` transformers' encoder passes is exactly that).

MPNet (``MPNetModel`` and its task heads; sentence-transformers' all-mpnet-base-v2 among
others; transformers' ``modeling_mpnet.py``) adds T5's bidirectional bucketed bias (32 buckets,
max distance 128, ``MPNetEncoder.relative_position_bucket``) after the ``1/sqrt(D)`` scale. Its
encoder builds that bias once as a ``[B, H, L, L]`` tensor (``compute_position_bias``, expanded
and made contiguous) for every layer; fused, the encoder makes the ``[H, 257]`` table instead and
each ``MPNetSelfAttention`` passes it to ``rel_attention`` as ``rel_bias``. ``output_attentions``
runs transformers' forward on the bias expanded from the table.

SpeechT5 (``SpeechT5ForSpeechToText``, ``SpeechT5ForTextToSpeech``, ``SpeechT5ForSpeechToSpeech``;
transformers' ``modeling_speecht5.py``) has Shaw's key term in its encoder: its
``SpeechT5RelativePositionalEncoding`` gathers an embedding of 2M rows (M =
``encoder_max_relative_position``, 160) by ``clamp(i - j, -M, M - 1)`` into an ``[L, L, D]``
tensor for the whole stack (1 GiB at L = 2048, D = 64, float32), and each encoder
``SpeechT5Attention`` multiplies its queries by it. Fused, the positional encoding returns the
``[2M + 1, D]`` table instead and each encoder layer passes it to ``rel_attention`` as ``rel_k``.
The decoder's attention has no relative positions and is left alone.

VITS (``VitsModel``: MMS-TTS's text-to-speech models in over 1000 languages; transformers'
``modeling_vits.py`` ``VitsAttention``) has both of Shaw's terms, key and value, in its text
encoder: ``emb_rel_k`` and ``emb_rel_v`` (``[1, 2w + 1, D]``, shared by the heads, w =
``window_size``, 4) for distances up to w, zero beyond. transformers forms ``[B H, L, 2L - 1]``
relative logits and skews them, and skews the probabilities back for the value term. Fused,
each table gains a zero row at either end (K = w + 1) and goes to ``rel_attention`` as
``rel_k`` and ``rel_v``.

WavLM (``WavLMModel`` and its heads: wavlm-base-plus, wavlm-large; transformers'
``modeling_wavlm.py`` ``WavLMAttention``) adds T5's bidirectional bucketed bias (320 buckets,
max distance 800) times a gate per query and head, a function of that query's input. Its first
layer builds the bias as ``[B H, L, L]`` for the whole stack, each layer gates it, and
``F.multi_head_attention_forward`` forms the ``[B H, L, L]`` weights (``need_weights``). Fused,
the first layer makes the ``[H, 1601]`` table, and the gated bias is ``q . rel_k`` with one more
feature: ``q`` gains a column ``gate / scaling``, ``rel_k`` is the table in that column (zeros
elsewhere), ``k`` and ``v`` gain zeros (head dimension 64 -> 65). That extra feature costs a band
matmul per query tile that a plain bias does not, so below ``wavlm_min_length`` frames
(:func:`use_fused_attention`; :data:`WAVLM_MIN_LENGTH` by default), where transformers' own
attention is as fast or faster, the fused layers call it instead.

Parakeet (NVIDIA's FastConformer ASR encoders: ``ParakeetForCTC``, ``ParakeetForRNNT``,
``ParakeetForTDT``, ``ParakeetEncoder``; transformers' ``modeling_parakeet.py``
``ParakeetEncoderAttention``) has Transformer-XL's attention too: ``relative_k_proj`` of the
encoder's sinusoids is the per-head table, ``bias_u``/``bias_v`` are ``u``/``v``. transformers
forms ``[B, H, L, 2L - 1]`` and ``[B, H, L, L]`` scores for it; a padded frame neither attends nor
is attended (its bool ``[B, 1, L, L]`` mask), and the fused form gives such a frame zeros where
transformers averages every value (its convolution module then zeroes those frames).
NVIDIA's cache-aware streaming FastConformer (nemotron-speech-streaming:
``NemotronAsrStreamingForRNNT``, ``NemotronAsrStreamingEncoder``; its
``NemotronAsrStreamingEncoderAttention``; Nemotron 3.5 ASR's ``Nemotron3_5AsrForRNNT`` has the
same encoder) is that attention with a sliding-window K/V cache: a
chunk's queries come after the cached frames (``q_offset``), the table spans cache and chunk,
and a chunked limited-context mask (each chunk sees itself and a few chunks before) makes the
``attn_mask`` block-sparse, so the fused kernels skip its hidden tiles. The fused encoder
(``NemotronAsrStreamingEncoder``'s forward) passes its layers the farthest distance that mask
lets through, and on a whole recording they project only those distances' embeddings. Offline
(a whole recording in one call) and chunk by chunk with the cache, it matches transformers'
SDPA form.
transformers' eager form of this model applies ``logical_not`` to the float mask its encoder
gives eager attention, so it attends the masked keys (NaN when streaming); the fused module reads
either mask form right.

This file imports nothing from transformers: it recognises the modules by class name and
attributes, so the package does not depend on it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from . import ops, reference
from .nn import additive_mask_hidden, clipped_table
from .positions import _t5_table_defined, deberta_buckets, deberta_max_distance, t5_bias_table

__all__ = ["SUPPORTED_CLASSES", "apply_rotary_pos_emb", "apply_rotary_pos_emb_single",
           "WAVLM_MIN_LENGTH", "transformer_xl_inputs", "use_fused_attention"]

#: The default ``wavlm_min_length`` of :func:`use_fused_attention`: the shortest input (frames, 50
#: per second of audio) for which a fused WavLM encoder runs rel_attention, without and with
#: autograd recording; shorter inputs run transformers' own attention, bitwise as unfused. The fused
#: form's extra query feature costs it a band matmul that the crossover reflects: on
#: wavlm-base-plus's encoder (``bench_hf.py --position wavlm``, 2-core Zen 4, float32, one or two
#: runs per length) it ran 0.95-0.99x transformers' speed at 250-400 frames and 1.02-1.16x at
#: 500-600 without gradients; with autograd recording ("training"), 0.86-0.97x up to 600 frames,
#: 0.98-1.04x at 800 and 1.12-1.14x at 1000.
WAVLM_MIN_LENGTH: Mapping[str, int] = types.MappingProxyType({"inference": 500, "training": 1000})

# transformers attention classes -> the position types whose forward use_fused_attention replaces
# (the module's position_embeddings_type; None: the class has no such attribute, one fixed type)
SUPPORTED_CLASSES = {
    "Wav2Vec2BertSelfAttention": ("relative_key", "relative"),
    "SeamlessM4Tv2ConformerSelfAttention": ("relative_key",),
    "Wav2Vec2ConformerSelfAttention": ("relative",),
    "SeamlessM4TConformerSelfAttention": ("relative",),
    "FastSpeech2ConformerAttention": (None,),  # always Transformer-XL positions (ESPnet)
    # T5's bucketed bias; the same forward in each model (transformers' "Copied from")
    "T5Attention": (None,),
    "MT5Attention": (None,),
    "SwitchTransformersAttention": (None,),
    "LongT5Attention": (None,),
    "Pop2PianoAttention": (None,),
    "UdopAttention": (None,),
    "UMT5Attention": (None,),  # a bias in every layer, its own forward signature
    # DeBERTa-v2/v3's disentangled attention (DeBERTa v1's class of the same name differs: it
    # has in_proj and no query_proj, and is left alone)
    "DisentangledSelfAttention": (None,),
    # MPNet: the encoder makes the bias table, each self-attention layer reads it
    "MPNetEncoder": (None,),
    "MPNetSelfAttention": (None,),
    # SpeechT5's encoder (ASR, TTS, voice conversion): the positional encoding makes the table,
    # each encoder self-attention layer reads it (the decoder's layers have no positions)
    "SpeechT5RelativePositionalEncoding": (None,),
    "SpeechT5Attention": (None,),
    # VITS / MMS-TTS text encoder: Shaw's key and value terms within a window
    "VitsAttention": (None,),
    # WavLM: T5's bias gated per query; the first layer makes the table, the others read it
    "WavLMAttention": (None,),
    # NVIDIA's FastConformer ASR encoders (Parakeet CTC/RNNT/TDT): Transformer-XL positions
    "ParakeetEncoderAttention": (None,),
    # its cache-aware streaming sibling (nemotron-speech-streaming): the same attention, a K/V
    # cache; the encoder tells its layers how far apart its chunked mask lets frames see
    "NemotronAsrStreamingEncoderAttention": (None,),
    "NemotronAsrStreamingEncoder": (None,),
}
T5_CLASSES = ("T5Attention", "MT5Attention", "SwitchTransformersAttention", "LongT5Attention",
              "Pop2PianoAttention", "UdopAttention")


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                         unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``
    (``modeling_llama.py`` and the many models that copy it; with ``cos`` narrower than the head
    dim, ``modeling_gpt_neox.py``'s partial rotary): each of ``q`` and ``k`` in one pass of
    :func:`relpos_ext.rope` instead of eager slices, a negation, a concatenation, two products
    and a sum, each with its temporary.

    ``cos`` and ``sin`` are the rotary embedding module's ``[B, L, R]`` outputs (``R`` up to the
    head dim; the rest of each head passes through). A model uses it where it calls its
    module's ``apply_rotary_pos_emb``, e.g.
    ``transformers.models.llama.modeling_llama.apply_rotary_pos_emb = relpos_ext.hf.apply_rotary_pos_emb``.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return ops.rope(q, cos, sin), ops.rope(k, cos, sin)


def apply_rotary_pos_emb_single(x: Tensor, cos: Tensor, sin: Tensor,
                                unsqueeze_dim: int = 1) -> Tensor:
    """Drop-in for the one-tensor ``apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1)`` of
    transformers' Gemma 4 (``modeling_gemma4.py``, which rotates queries and keys in separate
    calls, on ``[B, L, H, D]`` with ``unsqueeze_dim=2``): :func:`apply_rotary_pos_emb` for one
    tensor, e.g.
    ``transformers.models.gemma4.modeling_gemma4.apply_rotary_pos_emb = relpos_ext.hf.apply_rotary_pos_emb_single``.
    """
    return ops.rope(x, cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim))


def _hidden_keys(attention_mask: Tensor | None) -> Tensor | None:
    """transformers' attention mask as rel_attention's bool attn_mask (True = ignore): a bool
    mask there means True = attend; a float one is added to the scores (0 or ``finfo.min``),
    read by :func:`relpos_ext.nn.additive_mask_hidden`."""
    if attention_mask is None:
        return None
    if attention_mask.dtype == torch.bool:
        return ~attention_mask
    return additive_mask_hidden(attention_mask, "attention mask")


def transformer_xl_inputs(
    q: Tensor, pos: Tensor, pos_bias_u: Tensor, pos_bias_v: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Transformer-XL attention as Shaw attention with per-head tables and a bias per distance.

    ``q``: ``[B, H, L, D]``; ``pos``: ``[H, 2L - 1, D]``, the projected position embedding of
    distance ``r = j - i`` in row ``r + L - 1``; ``pos_bias_u, pos_bias_v``: ``[H, D]``.
    ``((q_i + u) . k_j + (q_i + v) . pos[r]) scale`` is ``((q_i + u) . k_j + (q_i + u) . pos[r])
    scale + (v - u) . pos[r] scale``, so this returns ``(q + u, rel_bias)`` with ``rel_bias[h,
    r + L - 1] = scale (v_h - u_h) . pos[h, r]``, and ``rel_attention(q + u, k, v, pos, None,
    L - 1, scale=scale, rel_bias=rel_bias)`` is the attention. Differentiable in every input.
    """
    u, v = pos_bias_u.to(q.dtype), pos_bias_v.to(q.dtype)
    rel_bias = torch.einsum("hrd,hd->hr", pos, v - u) * scale
    return q + u[:, None, :], rel_bias


def _heads(hidden_states: Tensor, projections: tuple[nn.Module, nn.Module, nn.Module],
           heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k, v ``projections`` of ``[B, L, E]`` as ``[B, H, L, head_dim]``."""
    batch, length, _ = hidden_states.shape
    q, k, v = (proj(hidden_states).view(batch, length, heads, head_dim).transpose(1, 2)
               for proj in projections)
    return q, k, v


def _merge(self: nn.Module, out: Tensor, head_dim: int) -> Tensor:
    """``[B, H, L, head_dim]`` heads, merged and projected out."""
    batch, _, length, _ = out.shape
    out = out.transpose(1, 2).reshape(batch, length, self.num_heads * head_dim)
    return self.linear_out(out)


def _xl_table(self: nn.Module, pos_emb: Tensor | None, length: int, dtype: torch.dtype) -> Tensor:
    """The module's projected Transformer-XL position embeddings ``[1, 2L - 1, E]`` as per-head
    tables ``[H, 2L - 1, D]``."""
    if pos_emb is None or pos_emb.shape[:2] != (1, 2 * length - 1):
        got = None if pos_emb is None else tuple(pos_emb.shape)
        raise ValueError(f"relpos_ext.hf: relative_position_embeddings must be [1, 2L - 1, E] = "
                         f"[1, {2 * length - 1}, E], got {got}")
    return _per_head_table(self.linear_pos, pos_emb[0], self.num_heads, length, dtype)


def _per_head_table(proj: nn.Module, pos: Tensor, heads: int, length: int,
                    dtype: torch.dtype) -> Tensor:
    """Transformer-XL position embeddings ``[2L - 1, E]`` (rows for ``i - j`` from ``L - 1`` down
    to ``1 - L``) projected by ``proj`` into per-head tables ``[H, 2L - 1, D]``: row ``r + L - 1``
    is distance ``r = j - i``, rel_attention's unclipped table (K = L - 1)."""
    return proj(pos).to(dtype).view(2 * length - 1, heads, -1).transpose(0, 1)


def _fused_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    relative_position_embeddings: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """The attention module's forward with the core done by rel_attention: the same projections
    and relative terms as the module's ``position_embeddings_type``, the module's dropout in
    training. Returns ``(output, None)``: the fused kernel never forms the attention weights;
    a call that asks for them (``output_attentions``) runs transformers' own forward instead."""
    if kwargs.get("output_attentions"):
        return type(self).forward(self, hidden_states, attention_mask,
                                  relative_position_embeddings, **kwargs)
    length = hidden_states.shape[1]
    q, k, v = _heads(hidden_states, (self.linear_q, self.linear_k, self.linear_v),
                     self.num_heads, self.head_size)
    if self.position_embeddings_type == "relative_key":
        left, right = self.left_max_position_embeddings, self.right_max_position_embeddings
        table = clipped_table(self.distance_embedding.weight, left, right).to(q.dtype)
        max_distance = max(left, right)
        bias = None
    else:  # "relative": Transformer-XL
        table = _xl_table(self, relative_position_embeddings, length, q.dtype)
        q, bias = transformer_xl_inputs(q, table, self.pos_bias_u, self.pos_bias_v, self.scaling)
        max_distance = length - 1
    out = ops.rel_attention(q, k, v, table, None, max_distance, scale=self.scaling,
                            attn_mask=_hidden_keys(attention_mask),  # [B, 1, Lq, Lk] or None
                            dropout_p=self.dropout.p if self.training else 0.0, rel_bias=bias)
    return _merge(self, out, self.head_size), None


def _fused_espnet_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    pos_emb: Tensor | None = None,
    output_attentions: bool = False,
) -> tuple[Tensor, None]:
    """FastSpeech2ConformerAttention's forward (ESPnet's RelPositionMultiHeadedAttention) with
    the core done by rel_attention. ``attention_mask``: ``[B, 1, Lk]``, nonzero = keep. With
    ``output_attentions``, transformers' own forward (the fused kernel forms no weights)."""
    if output_attentions:
        return type(self).forward(self, hidden_states, attention_mask, pos_emb, output_attentions)
    batch, length, _ = hidden_states.shape
    q, k, v = _heads(hidden_states, (self.linear_q, self.linear_k, self.linear_v),
                     self.num_heads, self.head_dim)
    table = _xl_table(self, pos_emb, length, q.dtype)
    scale = self.dim_key ** -0.5
    q, bias = transformer_xl_inputs(q, table, self.pos_bias_u, self.pos_bias_v, scale)
    padding = None
    if attention_mask is not None:
        if attention_mask.shape != (batch, 1, length):
            raise ValueError(f"relpos_ext.hf: attention_mask must be [B, 1, L] = "
                             f"[{batch}, 1, {length}], got {tuple(attention_mask.shape)}")
        padding = attention_mask[:, 0, :] == 0
    out = ops.rel_attention(q, k, v, table, None, length - 1, scale=scale,
                            key_padding_mask=padding, rel_bias=bias,
                            dropout_p=self.dropout.p if self.training else 0.0)
    return _merge(self, out, self.head_dim), None


def _fused_parakeet_forward(
    self: nn.Module,
    hidden_states: Tensor,
    position_embeddings: Tensor | None = None,
    attention_mask: Tensor | None = None,
    past_key_values: object | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """ParakeetEncoderAttention's forward (FastConformer's relative positional attention,
    Transformer-XL's), and NemotronAsrStreamingEncoderAttention's (the same with a sliding-window
    K/V cache for cache-aware streaming), with the core done by rel_attention.
    The chunk's ``L`` queries follow the ``C`` cached frames that ``past_key_values.update``
    returns before its keys (``q_offset = C``; no cache: ``C = 0``). ``position_embeddings``:
    ``[B, 2(C + L) - 1, E]`` from the encoder's relative positional encoding, rows for ``i - j``
    from ``C + L - 1`` down to ``1 - C - L``, the same for every sequence of the batch (as the
    encoder makes them; the table is read from the first), the unclipped table (K = C + L - 1).
    ``attention_mask``: ``[B, 1, L, C + L]``, bool (True = attend) or additive float: the padding,
    and for streaming models the chunked limited-context mask. A query row that sees no key gives
    zeros (transformers averages every value there, or gives NaN; the encoder's convolution
    module zeroes those frames).
    ``relpos_max_distance`` (passed down by a fused NemotronAsrStreamingEncoder, whose chunked
    mask hides every pair of frames further apart): without a cache, the table covers only the
    distances up to it (K), instead of all ``2L - 1``; the mask hides the clamped pairs beyond.
    Returns ``(output, None)``. ``output_attentions``, and position dropout in training (which
    makes the sequences' positions differ), run transformers' forward."""
    max_distance = kwargs.pop("relpos_max_distance", None)
    if kwargs.get("output_attentions") or (self.training and self.config.dropout_positions > 0):
        if past_key_values is not None:  # (Parakeet's forward has no such argument)
            kwargs["past_key_values"] = past_key_values
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  **kwargs)
    batch, length, _ = hidden_states.shape
    heads, dim = self.config.num_attention_heads, self.head_dim
    q = self.q_proj(hidden_states).view(batch, length, heads, dim).transpose(1, 2)
    k, v = (proj(hidden_states).view(batch, length, -1, dim).transpose(1, 2)
            for proj in (self.k_proj, self.v_proj))
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    total = k.shape[2]
    if position_embeddings is None or position_embeddings.shape[1] != 2 * total - 1:
        got = None if position_embeddings is None else tuple(position_embeddings.shape)
        raise ValueError(f"relpos_ext.hf: position_embeddings must be [B, 2L - 1, E] = "
                         f"[{batch}, {2 * total - 1}, E] for L = {total} keys "
                         f"({total - length} of them cached), got {got}")
    pos = position_embeddings[0]
    if max_distance is None or past_key_values is not None or max_distance >= total - 1:
        max_distance = total - 1
    else:  # the rows for i - j from K down to -K (the whole recording in one call)
        pos = pos[total - 1 - max_distance:total + max_distance]
    table = _per_head_table(self.relative_k_proj, pos, heads, max_distance + 1, q.dtype)
    q, bias = transformer_xl_inputs(q, table, self.bias_u, self.bias_v, self.scaling)
    out = ops.rel_attention(q, k, v, table, None, max_distance, scale=self.scaling,
                            q_offset=total - length, attn_mask=_hidden_keys(attention_mask),
                            dropout_p=self.attention_dropout if self.training else 0.0,
                            rel_bias=bias)
    return self.o_proj(out.transpose(1, 2).reshape(batch, length, heads * dim)), None


def _chunked_mask_max_distance(sliding_window: int, lookahead: int) -> int | None:
    """The farthest apart two frames see each other under transformers'
    ``chunked_limited_mask_function`` (NemotronAsrStreaming) with left context
    ``sliding_window - 1`` and right context ``lookahead``: chunks of ``lookahead + 1`` frames,
    each seeing itself and the ``(sliding_window - 1) // chunk`` chunks before. None: no limit
    (a negative context)."""
    left, chunk = sliding_window - 1, lookahead + 1
    if left < 0 or lookahead < 0:
        return None
    return (left // chunk + 1) * chunk - 1


def _nemotron_encoder_forward(
    self: nn.Module,
    input_features: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    past_key_values: object | None = None,
    output_attention_mask: bool = True,
    use_cache: bool | None = None,
    padding_cache: object | None = None,
    num_lookahead_tokens: int | None = None,
    **kwargs: object,
) -> object:
    """NemotronAsrStreamingEncoder's forward, passing its layers ``relpos_max_distance``: the
    farthest apart two frames its chunked limited-context mask lets see each other
    (:func:`_chunked_mask_max_distance` of the config and ``num_lookahead_tokens``, read as its
    ``_resolve_attn_context`` reads them). The fused attention then projects the position
    embeddings of those distances only."""
    lookahead = (self.config.default_num_lookahead_tokens if num_lookahead_tokens is None
                 else num_lookahead_tokens)
    limit = _chunked_mask_max_distance(self.config.sliding_window, lookahead)
    if limit is not None:
        kwargs["relpos_max_distance"] = limit
    return type(self).forward(self, input_features, attention_mask=attention_mask,
                              position_ids=position_ids, past_key_values=past_key_values,
                              output_attention_mask=output_attention_mask, use_cache=use_cache,
                              padding_cache=padding_cache,
                              num_lookahead_tokens=num_lookahead_tokens, **kwargs)


def _fused_t5_forward(
    self: nn.Module,
    hidden_states: Tensor,
    mask: Tensor | None = None,
    key_value_states: Tensor | None = None,
    position_bias: Tensor | None = None,
    past_key_values: object | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None, None]:
    """T5Attention's forward for self-attention, the core done by rel_attention with T5's bias
    as ``rel_bias``, appending to ``past_key_values`` where one is given (see
    :func:`_position_cache`). Returns ``(output, position_bias, None)`` where position_bias is
    the ``[H, 2K+1]`` table (made by the layer that owns the bias embedding, passed down the
    stack to the others). Cross-attention, a cache whose keys are not positions ``0, 1, ...``,
    ``output_attentions`` or a ``[1, H, Lq, Lk]`` position_bias made by transformers run
    transformers' forward."""
    cache = None if past_key_values is None else _position_cache(past_key_values, self.layer_idx)
    if (key_value_states is not None or (past_key_values is not None and cache is None)
            or kwargs.get("output_attentions")
            or (position_bias is not None and position_bias.dim() != 2)):
        return type(self).forward(self, hidden_states, mask, key_value_states, position_bias,
                                  past_key_values, **kwargs)
    if position_bias is None and self.has_relative_attention_bias:
        position_bias = _t5_table(self)
    out = _t5_self_attention(self, hidden_states, mask, position_bias, cache)
    return out, position_bias, None


def _position_cache(past_key_values: object, layer_idx: int) -> object | None:
    """The cache a decoder's self-attention layer ``layer_idx`` appends to (an
    ``EncoderDecoderCache``'s self-attention half, or the cache itself), where the keys its
    ``update`` returns are positions ``0, 1, ...`` in order, so that a step's queries follow at
    ``q_offset`` = the cached length: a full (not sliding) cache layer whose length is an int,
    dynamic, or static before its first write (it returns its whole buffer; transformers' mask
    and causality hide the slots not yet written). None otherwise (a sliding window, a length
    held in a tensor, a cache of another kind), and transformers' forward runs."""
    cache = getattr(past_key_values, "self_attention_cache", past_key_values)
    layers = getattr(cache, "layers", None)
    if layers is None or not callable(getattr(cache, "update", None)):
        return None
    layer = (layers[layer_idx] if layer_idx < len(layers)
             else getattr(cache, "layer_class_to_replicate", None))
    if layer is None or getattr(layer, "is_sliding", True) is not False:
        return None
    return cache if isinstance(cache.get_seq_length(layer_idx), int) else None


def _t5_table(self: nn.Module) -> Tensor:
    """A T5 / UMT5 attention module's bias embedding as the ``[H, 2K+1]`` rel_bias table."""
    return t5_bias_table(self.relative_attention_bias.weight, not self.is_decoder,
                         self.relative_attention_max_distance)


def _t5_self_attention(self: nn.Module, hidden_states: Tensor, mask: Tensor | None,
                       table: Tensor | None, cache: object | None = None) -> Tensor:
    """T5's (and UMT5's) self-attention through rel_attention: causal in a decoder, no scaling
    (T5 does not scale its logits), its dropout (a float there) in training; ``cache``: from
    :func:`_position_cache`, the decoder's KV cache to append to."""
    return _self_attention(hidden_states, (self.q, self.k, self.v), self.o, self.n_heads,
                           self.key_value_proj_dim, mask, rel_bias=table, causal=self.is_decoder,
                           scale=1.0, dropout_p=self.dropout if self.training else 0.0,
                           cache=cache, layer_idx=self.layer_idx)


def _self_attention(hidden_states: Tensor, projections: tuple[nn.Module, nn.Module, nn.Module],
                    output: nn.Module, heads: int, dim: int, mask: Tensor | None, *,
                    rel_k: Tensor | None = None, rel_v: Tensor | None = None,
                    rel_bias: Tensor | None = None, causal: bool = False,
                    scale: float | None = None, dropout_p: float = 0.0,
                    cache: object | None = None, layer_idx: int = 0) -> Tensor:
    """Self-attention of a module's q, k, v ``projections`` and ``output`` projection (T5, UMT5,
    MPNet, SpeechT5, VITS) through rel_attention, its tables cast to the activations' dtype
    (K read from their ``2K + 1`` rows; none: K = 0); ``mask``: transformers' attention
    mask. ``cache``: a KV cache whose layer ``layer_idx`` holds positions ``0, 1, ...``
    (:func:`_position_cache`): the new keys and values are appended to it, and the queries
    follow the cached positions."""
    batch, length, _ = hidden_states.shape
    q, k, v = _heads(hidden_states, projections, heads, dim)
    cached = 0
    if cache is not None:
        cached = cache.get_seq_length(layer_idx)
        k, v = cache.update(k, v, layer_idx)
    rows = (rel_bias.shape[-1] if rel_bias is not None else rel_k.shape[-2] if rel_k is not None
            else rel_v.shape[-2] if rel_v is not None else 1)
    rel_k, rel_v, rel_bias = (None if t is None else t.to(q.dtype)
                              for t in (rel_k, rel_v, rel_bias))
    padding, attn_mask = _padding_or_mask(mask, batch)
    out = ops.rel_attention(q, k, v, rel_k, rel_v, rows // 2, causal=causal, scale=scale,
                            q_offset=cached, key_padding_mask=padding, attn_mask=attn_mask,
                            dropout_p=dropout_p, rel_bias=rel_bias)
    return output(out.transpose(1, 2).reshape(batch, length, heads * dim))


def _per_pair(table: Tensor, length: int, axis: int) -> Tensor:
    """A distance table's ``axis`` (``2K + 1`` rows) expanded to every (query, key) pair of a
    self-attention over ``length`` positions, ``[..., L, L, ...]``: transformers' form of it,
    for the fallbacks to its forward."""
    buckets = reference.shaw_buckets(length, length, table.shape[axis] // 2, device=table.device)
    return table[(slice(None),) * axis + (buckets,)]


def _fused_umt5_forward(
    self: nn.Module,
    hidden_states: Tensor,
    encoder_hidden_states: Tensor | None = None,
    past_key_values: object | None = None,
    attention_mask: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """UMT5Attention's forward for self-attention, the core done by rel_attention with the
    layer's own T5 bias as ``rel_bias``, appending to ``past_key_values`` where one is given
    (:func:`_position_cache`). Returns ``(output, None)``. Cross-attention, a cache whose keys
    are not positions ``0, 1, ...`` and ``output_attentions`` run transformers' forward."""
    cache = None if past_key_values is None else _position_cache(past_key_values, self.layer_idx)
    if (encoder_hidden_states is not None or (past_key_values is not None and cache is None)
            or kwargs.get("output_attentions")):
        return type(self).forward(self, hidden_states, encoder_hidden_states, past_key_values,
                                  attention_mask, **kwargs)
    table = _t5_table(self) if self.has_relative_attention_bias else None
    return _t5_self_attention(self, hidden_states, attention_mask, table, cache), None


def _padding_or_mask(mask: Tensor | None, batch: int) -> tuple[Tensor | None, Tensor | None]:
    """transformers' attention mask as rel_attention's ``(key_padding_mask, attn_mask)``: one
    row for all queries (``[B, 1, 1, Lk]``) is key padding, O(L); anything else an attn_mask."""
    hidden = _hidden_keys(mask)  # [B, 1, Lq or 1, Lk] or None
    if hidden is not None and hidden.shape[-2] == 1:
        return hidden.reshape(batch, hidden.shape[-1]), None
    return None, hidden


def _deberta_scales(dim: int, factor: int) -> dict[torch.dtype, float]:
    """``1 / sqrt(dim * factor)`` as transformers' DeBERTa applies it, per dtype: it takes the
    square root in float32 and rounds it to the model's dtype before dividing. Computed once
    per module, so that the forward reads a constant (no tensor-to-float under torch.compile)."""
    root = torch.sqrt(torch.tensor(dim * factor, dtype=torch.float32))
    return {dt: 1.0 / root.to(dt).item()
            for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def _fused_deberta_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor,
    output_attentions: bool = False,
    query_states: Tensor | None = None,
    relative_pos: Tensor | None = None,
    rel_embeddings: Tensor | None = None,
) -> tuple[Tensor, None]:
    """DeBERTa-v2's DisentangledSelfAttention forward with the core done by rel_attention: the
    module's projections, its c2p term as ``rel_k`` and its p2c term as ``rel_q`` (per-head
    tables from the relative embeddings, see the module docstring), its dropouts in training.
    ``attention_mask``: ``[B, 1, L, L]`` or ``[B, L, L]``, nonzero = attend. Returns
    ``(context, None)``; with ``output_attentions`` or separate ``query_states`` (the enhanced
    mask decoder), transformers' own forward."""
    if output_attentions or query_states is not None:
        return type(self).forward(self, hidden_states, attention_mask, output_attentions,
                                  query_states, relative_pos, rel_embeddings)
    batch, length, _ = hidden_states.shape
    heads, dim = self.num_attention_heads, self.attention_head_size
    q, k, v = _heads(hidden_states, (self.query_proj, self.key_proj, self.value_proj), heads, dim)
    rel_k = rel_q = None
    kmax = 0
    if self.relative_attention and rel_embeddings is not None:
        kmax = min(self._relpos_max_distance, max(length - 1, 0))
        rows = deberta_buckets(torch.arange(-kmax, kmax + 1, device=q.device),
                               self.position_buckets, self.max_relative_positions)
        rel = self.pos_dropout(rel_embeddings)[: 2 * self.pos_ebd_size]

        def table(proj: nn.Module) -> Tensor:  # [2 span, E] -> [H, 2K+1, D]
            # index_select, not [rows]: its backward is index_add_, not the slower index_put_
            # with accumulate (DeBERTa-v3-base at L=512: 0.8 vs 1.25 ms per table, CPU)
            return proj(rel).index_select(0, rows).view(-1, heads, dim).transpose(0, 1).to(q.dtype)

        if "c2p" in self.pos_att_type:
            rel_k = table(self.key_proj if self.share_att_key else self.pos_key_proj)
        if "p2c" in self.pos_att_type:
            rel_q = table(self.query_proj if self.share_att_key else self.pos_query_proj)
    mask = attention_mask if attention_mask.dim() == 4 else attention_mask.unsqueeze(1)
    out = ops.rel_attention(q, k, v, rel_k, None, kmax, scale=self._relpos_scales[q.dtype],
                            attn_mask=~mask.bool(), rel_q=rel_q,
                            dropout_p=self.dropout.p if self.training else 0.0)
    return out.transpose(1, 2).reshape(batch, length, heads * dim), None


# MPNetEncoder.compute_position_bias's defaults (it is never called with others)
MPNET_BUCKETS, MPNET_MAX_DISTANCE = 32, 128


def _mpnet_position_bias(self: nn.Module, x: Tensor, position_ids: Tensor | None = None,
                         num_buckets: int = MPNET_BUCKETS) -> Tensor:
    """MPNetEncoder.compute_position_bias as the ``[H, 2K+1]`` rel_bias table (K = 128: every
    distance past it is in the last bucket), where transformers makes ``[B, H, L, L]``. Other
    arguments than the encoder's run transformers' own."""
    if position_ids is not None or num_buckets != MPNET_BUCKETS:
        return type(self).compute_position_bias(self, x, position_ids, num_buckets)
    weight = self.relative_attention_bias.weight[:num_buckets]
    return t5_bias_table(weight, True, MPNET_MAX_DISTANCE)


def _fused_mpnet_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: object,
) -> tuple[Tensor, ...]:
    """MPNetSelfAttention's forward with the core done by rel_attention: the module's q, k, v
    and o projections, ``position_bias`` the encoder's ``[H, 2K+1]`` table as ``rel_bias``,
    transformers' attention mask, its dropout in training. Returns ``(output,)``. A
    ``[B, H, L, L]`` position_bias (an encoder left unfused) runs transformers' forward, and so
    does ``output_attentions``, on the bias expanded from the table."""
    table = position_bias is not None and position_bias.dim() == 2
    if output_attentions or (position_bias is not None and not table):
        if table:  # the fused encoder's [H, 2K+1] table as transformers' [1, H, L, L] bias
            position_bias = _per_pair(position_bias, hidden_states.shape[1], 1).unsqueeze(0)
        return type(self).forward(self, hidden_states, attention_mask, position_bias,
                                  output_attentions, **kwargs)
    out = _self_attention(hidden_states, (self.q, self.k, self.v), self.o,
                          self.num_attention_heads, self.attention_head_size, attention_mask,
                          rel_bias=position_bias,
                          dropout_p=self.dropout.p if self.training else 0.0)
    return (out,)


def _speecht5_table(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """SpeechT5RelativePositionalEncoding's forward as the ``[2M + 1, D]`` rel_k table (Shaw's
    K = M, ``max_length``), where transformers gathers ``[L, L, D]``. Its embedding ``pe_k``
    has row ``clamp(i - j, -M, M - 1) + M``, i.e. ``M - r`` for ``r = j - i`` clamped to
    ``[1 - M, M]``: flipped, that is a table clipped to ``[-(M - 1), M]``."""
    m = self.max_length
    return clipped_table(self.pe_k.weight.flip(0), m - 1, m)


def _fused_speecht5_forward(
    self: nn.Module,
    hidden_states: Tensor,
    key_value_states: Tensor | None = None,
    past_key_values: object | None = None,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
    output_attentions: bool = False,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """SpeechT5Attention's forward in SpeechT5's encoder with the core done by rel_attention:
    the module's projections, ``position_bias`` the fused encoder's ``[2M + 1, D]`` table
    (:func:`_speecht5_table`) as ``rel_k``, transformers' attention mask, its dropout in
    training. Returns ``(output, None)``. No position_bias or an ``[L, L, D]`` one (an encoder
    left unfused), a cache, cross-attention and ``output_attentions`` run transformers' forward
    (on the ``[L, L, D]`` bias expanded from the table)."""
    table = position_bias is not None and position_bias.dim() == 2
    if not table or output_attentions or key_value_states is not None \
            or past_key_values is not None:
        if table:  # the fused encoder's [2K+1, D] table as transformers' [L, L, D] gather
            position_bias = _per_pair(position_bias, hidden_states.shape[1], 0)
        return type(self).forward(self, hidden_states, key_value_states, past_key_values,
                                  attention_mask, position_bias, output_attentions, **kwargs)
    return _shaw_self_attention(self, hidden_states, attention_mask, position_bias, None), None


def _shaw_self_attention(self: nn.Module, hidden_states: Tensor, mask: Tensor | None,
                         rel_k: Tensor, rel_v: Tensor | None) -> Tensor:
    """Self-attention of a module with ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``,
    ``scaling`` and a float ``dropout`` (SpeechT5, VITS) with the Shaw tables ``rel_k`` /
    ``rel_v`` (``[2K + 1, D]``)."""
    return _self_attention(hidden_states, (self.q_proj, self.k_proj, self.v_proj), self.out_proj,
                           self.num_heads, self.head_dim, mask, rel_k=rel_k, rel_v=rel_v,
                           scale=self.scaling,
                           dropout_p=self.dropout if self.training else 0.0)


def _windowed_table(emb: Tensor) -> Tensor:
    """VITS's ``[1, 2w + 1, D]`` relative embedding (rows for ``r = j - i`` in ``[-w, w]``, zero
    beyond: transformers pads it with zeros) as a ``[2w + 3, D]`` Shaw table of K = w + 1 whose
    two edge rows are zero, so that clamping every longer distance there gives zero."""
    return nn.functional.pad(emb[0], (0, 0, 1, 1))


def _fused_vits_forward(
    self: nn.Module,
    hidden_states: Tensor,
    key_value_states: Tensor | None = None,
    attention_mask: Tensor | None = None,
    output_attentions: bool = False,
) -> tuple[Tensor, None]:
    """VitsAttention's forward (VITS / MMS-TTS text encoder: Shaw's key and value terms within a
    window of ``window_size`` distances, none beyond) with the core done by rel_attention: the
    module's projections, ``emb_rel_k`` / ``emb_rel_v`` as ``rel_k`` / ``rel_v``
    (:func:`_windowed_table`), transformers' attention mask, its dropout in training. Returns
    ``(output, None)``; ``output_attentions`` runs transformers' forward. (``key_value_states``
    is unused there too: VITS only self-attends.)"""
    if output_attentions:
        return type(self).forward(self, hidden_states, key_value_states, attention_mask,
                                  output_attentions)
    return _shaw_self_attention(self, hidden_states, attention_mask,
                                _windowed_table(self.emb_rel_k),
                                _windowed_table(self.emb_rel_v)), None


def _wavlm_gate(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """WavLMAttention's gate of the position bias, per query and head, ``[B, H, L]``: its
    ``gru_rel_pos_linear`` of each head's slice of the input, as transformers computes it."""
    batch, length, _ = hidden_states.shape
    sliced = hidden_states.view(batch, length, self.num_heads, -1).transpose(1, 2)
    proj = self.gru_rel_pos_linear(sliced).view(batch, self.num_heads, length, 2, 4).sum(-1)
    gate_a, gate_b = torch.sigmoid(proj).chunk(2, dim=-1)
    return (gate_a * (gate_b * self.gru_rel_pos_const - 1.0) + 2.0)[..., 0]


def _fused_wavlm_forward(
    self: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    position_bias: Tensor | None = None,
    index: int = 0,
    **kwargs: object,
) -> tuple[Tensor, None, Tensor]:
    """WavLMAttention's forward with the core done by rel_attention. WavLM adds T5's bucketed
    bias (bidirectional, ``num_buckets``, ``max_distance``) times a gate ``g[b, h, i]`` per
    query (:func:`_wavlm_gate`). The first layer makes the ``[H, 2K+1]`` table
    (:func:`relpos_ext.t5_bias_table`, K = ``max_distance``) and returns it as
    ``position_bias`` for the others, where transformers passes ``[B H, L, L]``.
    ``g_i . bias[r]`` is ``q_i . rel_k[r]`` with one more feature: ``q`` gains a column
    ``g / scaling``, ``rel_k`` is the table in that column and zeros elsewhere, ``k`` and ``v``
    gain zeros (head dimension D + 1). ``attention_mask``: ``[B, L]``, 1 = kept frame. Returns
    ``(output, None, table)``. ``output_attentions``, or a ``[B H, L, L]`` position_bias (an
    unfused first layer), run transformers' forward (on the bias expanded from the table). So
    does a first layer given fewer than ``_relpos_min_length`` frames (use_fused_attention's
    ``wavlm_min_length``); its ``[B H, L, L]`` bias then sends the other layers there too."""
    table = position_bias
    if table is None and hasattr(self, "rel_attn_embed"):
        grads = torch.is_grad_enabled() and (hidden_states.requires_grad or any(
            p.requires_grad for p in self.parameters()))
        if hidden_states.shape[1] < self._relpos_min_length["training" if grads else "inference"]:
            return type(self).forward(self, hidden_states, attention_mask, None, index, **kwargs)
        table = t5_bias_table(self.rel_attn_embed.weight, True, self.max_distance)
    if kwargs.get("output_attentions") or table is None or table.dim() != 2:
        if table is not None and table.dim() == 2:  # as transformers' [B H, L, L] bias
            batch, length, _ = hidden_states.shape
            table = _per_pair(table, length, 1).repeat(batch, 1, 1)
        return type(self).forward(self, hidden_states, attention_mask, table, index, **kwargs)
    batch, length, _ = hidden_states.shape
    heads, dim = self.num_heads, self.head_dim
    gate = _wavlm_gate(self, hidden_states)
    q, k, v = _heads(hidden_states, (self.q_proj, self.k_proj, self.v_proj), heads, dim)
    q = torch.cat([q, (gate / self.scaling).to(q.dtype)[..., None]], dim=-1)
    k, v = (nn.functional.pad(t, (0, 1)) for t in (k, v))
    rel_k = nn.functional.pad(table.to(q.dtype)[..., None], (dim, 0))
    out = ops.rel_attention(q, k, v, rel_k, None, table.shape[-1] // 2, scale=self.scaling,
                            key_padding_mask=None if attention_mask is None
                            else attention_mask.ne(1),
                            dropout_p=self.dropout if self.training else 0.0)
    out = out[..., :dim].transpose(1, 2).reshape(batch, length, heads * dim)
    return self.out_proj(out), None, table


def _bind(fn: Callable[..., object], module: nn.Module) -> Callable[..., object]:
    """``fn`` with ``module`` as its first argument, to set as the module's method. A partial
    of a module-level function pickles (``torch.save`` of a whole model); a bound method of a
    function the class does not have does not load back."""
    return functools.partial(fn, module)


def _is_deberta_v2(module: nn.Module) -> bool:
    """DeBERTa-v2's DisentangledSelfAttention, not DeBERTa v1's (in_proj, talking heads) or
    SEW-D's copy (another forward signature and dropout) of the same name."""
    return (type(module).__name__ == "DisentangledSelfAttention"
            and type(module).__module__.endswith("modeling_deberta_v2"))


def use_fused_attention(model: nn.Module,
                        wavlm_min_length: Mapping[str, int] | None = None) -> list[str]:
    """Route every supported relative-position attention module of ``model`` through
    :func:`relpos_ext.rel_attention`, in place; returns the names of the modules changed.

    Supported: the classes and position types of :data:`SUPPORTED_CLASSES` (others, e.g.
    rotary positions, are left alone). The outputs match transformers' eager attention to float
    rounding, except on a query row whose every key is masked (ours gives zeros there, as
    FastSpeech2-Conformer does). A call with ``output_attentions`` runs transformers' own
    forward, which forms the weights (O(L^2) memory).
    ``wavlm_min_length``: ``{"inference": frames, "training": frames}``, the shortest WavLM input
    that runs fused, without and with autograd recording (a key left out, or None: that of
    :data:`WAVLM_MIN_LENGTH`, the crossovers measured here); shorter ones run transformers'
    attention, faster there. 0 fuses every length.
    Call it after loading the weights; ``model.to(...)`` works before or after. The swap is an
    instance attribute: ``del module.forward`` gives a module its own back (an MPNet encoder's
    is ``compute_position_bias``; give it back, or a SpeechT5 positional encoding's ``forward``,
    together with its layers' ``forward``; a Nemotron streaming encoder's ``forward`` only tells
    its layers a distance limit, and either can be given back alone).
    """
    if wavlm_min_length is not None and not set(wavlm_min_length) <= set(WAVLM_MIN_LENGTH):
        raise ValueError(f"wavlm_min_length takes the keys {sorted(WAVLM_MIN_LENGTH)}; got "
                         f"{sorted(wavlm_min_length)}")
    changed = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if getattr(module, "position_embeddings_type", None) not in SUPPORTED_CLASSES.get(cls, ()):
            continue
        if (cls in T5_CLASSES or cls == "UMT5Attention") and module.is_decoder \
                and not getattr(module, "is_causal", True):
            continue  # T5's cross-attention: no position bias, nothing to fuse
        if (cls in T5_CLASSES or cls == "UMT5Attention") and not _t5_table_defined(
                module.relative_attention_num_buckets, not module.is_decoder,
                module.relative_attention_max_distance):
            continue  # buckets t5_bias_table cannot hold (transformers' own go wrong past them)
        if cls == "DisentangledSelfAttention":
            if not _is_deberta_v2(module):
                continue
            if module.relative_attention:
                try:
                    kmax = deberta_max_distance(module.position_buckets,
                                                module.max_relative_positions)
                except ValueError:
                    continue  # buckets DeBERTa's formula leaves undefined: transformers' forward
                module._relpos_max_distance = kmax
            factor = 1 + ("c2p" in module.pos_att_type) + ("p2c" in module.pos_att_type)
            module._relpos_scales = _deberta_scales(module.attention_head_size, factor)
        if cls == "WavLMAttention":
            module._relpos_min_length = {**WAVLM_MIN_LENGTH, **(wavlm_min_length or {})}
        if cls == "SpeechT5Attention" and module.is_decoder:
            continue  # the decoder's self- and cross-attention have no relative positions
        if cls == "VitsAttention" and not module.window_size:
            continue  # no relative embeddings (transformers' own forward fails there)
        if cls == "SpeechT5RelativePositionalEncoding":
            module.forward = _bind(_speecht5_table, module)
            changed.append(name)
            continue
        if cls == "NemotronAsrStreamingEncoder":
            module.forward = _bind(_nemotron_encoder_forward, module)
            changed.append(name)
            continue
        if cls == "MPNetEncoder":
            if module.relative_attention_bias.num_embeddings < MPNET_BUCKETS:
                continue  # transformers' own bias would fail to index it; leave it so
            module.compute_position_bias = _bind(_mpnet_position_bias, module)
            changed.append(name)
            continue
        fused = (_fused_espnet_forward if cls == "FastSpeech2ConformerAttention"
                 else _fused_t5_forward if cls in T5_CLASSES
                 else _fused_umt5_forward if cls == "UMT5Attention"
                 else _fused_deberta_forward if cls == "DisentangledSelfAttention"
                 else _fused_mpnet_forward if cls == "MPNetSelfAttention"
                 else _fused_speecht5_forward if cls == "SpeechT5Attention"
                 else _fused_vits_forward if cls == "VitsAttention"
                 else _fused_wavlm_forward if cls == "WavLMAttention"
                 else _fused_parakeet_forward if cls in ("ParakeetEncoderAttention",
                                                         "NemotronAsrStreamingEncoderAttention")
                 else _fused_forward)
        module.forward = _bind(fused, module)
        changed.append(name)
    return changed
