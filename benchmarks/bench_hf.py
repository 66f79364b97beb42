#!/usr/bin/env python
"""Benchmark ``relpos_ext.hf.use_fused_attention`` on a transformers Wav2Vec2-BERT attention layer.

One ``Wav2Vec2BertSelfAttention`` at the width of the released w2v-BERT 2.0 checkpoint (E=1024,
H=16, D=64), float32, B=1, L audio frames (50 per second: L=4000 is 80 s), with a padding mask
(the last 5% of frames). ``--position relative_key`` (default; w2v-BERT 2.0's): Shaw keys clipped
to ``[-64, 8]``; ``--position relative``: Transformer-XL positions (Wav2Vec2-Conformer's), every
distance of the sequence; ``--position t5``: instead, a ``T5Attention`` encoder layer at t5-base's
width (E=768, H=12, D=64), T5's bucketed bias (32 buckets, max distance 128), L tokens;
``--position deberta``: a DeBERTa-v2 ``DisentangledSelfAttention`` at deberta-v3-base's width
(E=768, H=12, D=64, 256 log buckets up to 512, shared projections, c2p and p2c), L tokens, its
relative positions and embeddings made outside the call as its encoder does (no SDPA form
there); ``--position mpnet``: a whole ``MPNetModel`` as all-mpnet-base-v2's (12 layers, E=768,
H=12, D=64; T5's bidirectional bias, 32 buckets, max distance 128, made once by its encoder), on
input embeddings, ``--batch`` sequences of L tokens (MPNet's positions end at 512), no SDPA form
there either; ``--position parakeet``: a ``ParakeetEncoderAttention`` at parakeet-tdt-0.6b-v2's
width (E=1024, H=8, D=128; FastConformer, Transformer-XL positions over every distance), L
frames (80 ms each after its 8x subsampling: L=4000 is 320 s of audio), the padding mask in the
bool ``[B, 1, L, L]`` form its encoder makes (padded frames neither attend nor are attended);
``--position nemotron``: a ``NemotronAsrStreamingEncoderAttention`` at
nemotron-speech-streaming-en-0.6b's width (E=1024, H=8, D=128; Parakeet's attention with a
streaming cache) run offline on L frames, as its encoder runs a whole recording: the chunked
limited-context mask of its default lookahead (chunks of 14 frames, each query sees its own
chunk and the 5 before: at most 84 keys) and the padding, bool ``[B, 1, L, L]``; no eager form
(transformers' eager form inverts the float mask its encoder gives it). With ``--encoder``
(parakeet and nemotron only): the whole encoder at its default size instead of one layer (24
layers, E=1024, H=8, FFN 4096, conv kernel 9, random weights, as parakeet-tdt-0.6b-v2 and
nemotron-speech-streaming-en-0.6b), on ``8 L`` mel frames (L encoder frames of 80 ms; default
750 and 3000, 60 and 240 s of audio), no padding, fused against SDPA, forward only.
``--position speecht5``: a whole ``SpeechT5Encoder`` as speecht5_asr's (12 layers, E=768, H=12,
D=64, FFN 3072; Shaw keys clipped to ``[-159, 160]``, gathered once by its encoder into an
``[L, L, D]`` tensor for all layers), on L frames of its speech prenet's output (50 per second),
the last 5% padded; eager only (the model has no SDPA form). ``--position vits``: one
``VitsAttention`` at MMS-TTS's width (E=192, H=2, D=96; Shaw keys and values within a window of
4 distances, zero beyond), L text tokens, the last 5% padded; eager only. ``--position
wavlm``: a whole ``WavLMEncoder`` as wavlm-base-plus's (12 layers, E=768, H=12, D=64, FFN 3072;
T5's bias, 320 buckets up to 800, gated per query; transformers' only form, which forms the
attention weights), on L frames of its feature encoder's output (50 per second), the last 5%
padded; fused at every length (``use_fused_attention``'s ``wavlm_min_length`` 0; its default,
``hf.WAVLM_MIN_LENGTH``, below which inputs stay unfused, is set from this crossover).
``--position wavlm_large``: the same at wavlm-large's size (24 layers, E=1024, H=16, D=64, FFN
4096, pre-norm: ``WavLMEncoderStableLayerNorm``).
Three forms:

* ``eager`` -- transformers' eager attention (``attn_implementation="eager"``): relative_key
  gathers the keys' embeddings to ``[L, L, D]``, relative forms ``[B, H, L, 2L - 1]`` scores and
  rel-shifts them; then ``[B, H, L, L]`` scores;
* ``sdpa`` -- transformers' SDPA path (its default where supported): the same position scores,
  handed to ``F.scaled_dot_product_attention`` as a ``[B, H, L, L]`` float mask;
* ``fused`` -- the same module after ``relpos_ext.hf.use_fused_attention``: ``rel_attention``
  with the module's own parameters, O(L) memory.

Modes: ``inference`` (forward under ``torch.no_grad``) and ``train`` (forward + backward w.r.t.
the input and every parameter). Each measurement runs in a forked child
(``_common.measure_call``): peak extra memory of one call, then the median time. A form whose
analytic live set exceeds ``--mem-cap-gib`` is skipped.

Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_hf.py     # ~5 min, needs transformers
    python benchmarks/bench_hf.py --position relative    # -> bench_hf_relative.json
    python benchmarks/bench_hf.py --position deberta -L 512 1024 2048   # -> bench_hf_deberta.json
    python benchmarks/bench_hf.py --position mpnet -B 32 -L 128 256 512  # -> bench_hf_mpnet.json
    python benchmarks/bench_hf.py --position parakeet   # -> bench_hf_parakeet.json
    python benchmarks/bench_hf.py --position nemotron   # -> bench_hf_nemotron.json
    python benchmarks/bench_hf.py --position parakeet --encoder   # -> bench_hf_parakeet_encoder.json
    python benchmarks/bench_hf.py --position speecht5   # -> bench_hf_speecht5.json
    python benchmarks/bench_hf.py --position vits -L 100 500 1000 4000   # -> bench_hf_vits.json
    python benchmarks/bench_hf.py --position wavlm -L 250 500 800 1000 2000 4000   # -> bench_hf_wavlm.json
    python benchmarks/bench_hf.py --position wavlm_large -L 500 1000 1500   # -> bench_hf_wavlm_large.json
    python benchmarks/bench_hf.py -L 500 1000 --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, add_common_args, check_platform, in_child, measure_call, measure_grid,
    print_environment, timestamp, write_json,
)

EMBED, HEADS, LEFT, RIGHT = 1024, 16, 64, 8
METHODS = ("fused", "eager", "sdpa")
MODES = ("inference", "train")


T5_EMBED, T5_HEADS = 768, 12
PARAKEET_EMBED, PARAKEET_HEADS = 1024, 8
MPNET_LAYERS, MPNET_FFN = 12, 3072
# E, H, layers, FFN: wavlm-base-plus's and wavlm-large's encoders
WAVLM_SIZES = {"wavlm": (T5_EMBED, T5_HEADS, MPNET_LAYERS, MPNET_FFN),
               "wavlm_large": (1024, 16, 24, 4096)}
SPEECHT5_MAX_DISTANCE = 160  # encoder_max_relative_position
VITS_EMBED, VITS_HEADS, VITS_WINDOW = 192, 2, 4


def live_gib(method: str, mode: str, length: int, position: str, batch: int = 1) -> float:
    """The largest live set of a transformers form (relative_key's [L, L, D] gather, relative's
    [H, L, 2L] scores or T5's [H, L, L] bias, and a few [H, L, L] score tensors; the backward
    keeps about twice as much), in GiB; 0 for ours."""
    if method == "fused":
        return 0.0
    if position == "mpnet":  # the [B, H, L, L] bias, and scores, probabilities per layer
        return (3 * batch * T5_HEADS * length * length * 4
                * (MPNET_LAYERS if mode == "train" else 1) / 2**30)
    if position == "speecht5":  # the [L, L, D] gather (and its gradient), scores per layer
        per_layer = 3 * T5_HEADS * length * length * 4
        gather = length * length * (T5_EMBED // T5_HEADS) * 4
        return (2 * gather + MPNET_LAYERS * per_layer if mode == "train"
                else gather + per_layer) / 2**30
    if position in WAVLM_SIZES:  # [B H, L, L] bias, gated bias, scores, weights
        _, heads, layers, _ = WAVLM_SIZES[position]
        per_layer = 4 * heads * length * length * 4
        return per_layer * (layers if mode == "train" else 1) / 2**30
    if position == "vits":  # [H, L, 2L - 1] relative logits and probabilities, [H, L, L] scores
        return 7 * VITS_HEADS * length * length * 4 * (2 if mode == "train" else 1) / 2**30
    if position == "t5":
        return 4 * T5_HEADS * length * length * 4 * (2 if mode == "train" else 1) / 2**30
    if position == "deberta":  # c2p, p2c, scores, probabilities [H, L, L] and an int64 index
        return (6 * T5_HEADS * length * length * 4 + 8 * length * length) \
            * (2 if mode == "train" else 1) / 2**30
    heads = PARAKEET_HEADS if position in ("parakeet", "nemotron") else HEADS
    if position == "relative_key":
        positions = length * length * (EMBED // HEADS) * 4
    else:
        positions = 2 * heads * length * 2 * length * 4
    scores = 3 * heads * length * length * 4
    return (positions + scores) * (2 if mode == "train" else 1) / 2**30


def _layer(method: str, length: int, position: str, batch: int = 1, encoder: bool = False):
    """The attention module (``encoder``: the whole encoder), its input, upstream gradient and
    the keyword arguments of a call (the padding mask among them)."""
    import transformers
    from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

    import relpos_ext.hf

    torch.manual_seed(0)
    if position == "t5":
        return _t5_layer(method, length)
    if position == "deberta":
        return _deberta_layer(method, length)
    if position == "mpnet":
        return _mpnet_model(method, length, batch)
    if position == "speecht5":
        return _speecht5_encoder(method, length)
    if position == "vits":
        return _vits_layer(method, length)
    if position in WAVLM_SIZES:
        return _wavlm_encoder(method, length, position)
    if position in ("parakeet", "nemotron"):
        if encoder:
            return _fastconformer_encoder(method, length, position == "nemotron")
        return _fastconformer_layer(method, length, position == "nemotron")
    from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import (
        Wav2Vec2BertRelPositionalEmbedding,
    )

    config = transformers.Wav2Vec2BertConfig(
        hidden_size=EMBED, num_attention_heads=HEADS, position_embeddings_type=position,
        left_max_position_embeddings=LEFT, right_max_position_embeddings=RIGHT,
        attention_dropout=0.0, attn_implementation="sdpa" if method == "sdpa" else "eager")
    module = Wav2Vec2BertSelfAttention(config)
    if position == "relative":  # transformers initialises u and v by xavier_uniform_
        torch.nn.init.xavier_uniform_(module.pos_bias_u)
        torch.nn.init.xavier_uniform_(module.pos_bias_v)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(module)
    x = torch.randn(1, length, EMBED)
    mask = torch.zeros(1, 1, length, length)
    mask[..., length - length // 20:] = torch.finfo(torch.float32).min  # padded frames
    if method == "sdpa":  # what transformers' mask code makes for SDPA: bool, True = attend
        mask = mask == 0
    kw = {"attention_mask": mask}
    if position == "relative":  # made once per model by the encoder, shared by its layers
        kw["relative_position_embeddings"] = Wav2Vec2BertRelPositionalEmbedding(config)(x)
    return module, x, kw, torch.randn(1, length, EMBED)


def _fastconformer_layer(method: str, length: int, streaming: bool):
    """A ParakeetEncoderAttention (``streaming``: a NemotronAsrStreamingEncoderAttention, run
    offline: no cache) with random u and v biases (its model's initialisation), the encoder's
    position embeddings and its bool mask: the last 5% of the frames padded (Parakeet: they
    neither attend nor are attended), and for the streaming model the chunked limited-context
    mask of its default lookahead (chunks of ``lookahead + 1`` frames, each seeing itself and
    ``(sliding_window - 1) // chunk`` chunks before; the fused layer is told the farthest
    distance that lets through, ``relpos_max_distance``, as a fused encoder tells its layers)."""
    from transformers.models.nemotron_asr_streaming import modeling_nemotron_asr_streaming as nm
    from transformers.models.parakeet import modeling_parakeet as parakeet

    import relpos_ext.hf

    kind = nm.NemotronAsrStreamingEncoder if streaming else parakeet.ParakeetEncoder
    config = kind.config_class(
        hidden_size=PARAKEET_EMBED, num_attention_heads=PARAKEET_HEADS, attention_dropout=0.0,
        attn_implementation="sdpa" if method == "sdpa" else "eager")
    attention = (nm.NemotronAsrStreamingEncoderAttention if streaming
                 else parakeet.ParakeetEncoderAttention)
    module = attention(config, 0)
    torch.nn.init.normal_(module.bias_u, std=config.initializer_range)
    torch.nn.init.normal_(module.bias_v, std=config.initializer_range)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(module)
    x = torch.randn(1, length, PARAKEET_EMBED)
    keep = torch.arange(length) < length - length // 20
    if streaming:
        chunk = config.default_num_lookahead_tokens + 1
        back = (torch.arange(length)[:, None] // chunk) - (torch.arange(length)[None, :] // chunk)
        mask = (back >= 0) & (back <= (config.sliding_window - 1) // chunk) & keep[None, :]
        positions = nm.NemotronAsrStreamingEncoderRelPositionalEncoding(config)
    else:
        mask = keep[:, None] & keep[None, :]
        positions = parakeet.ParakeetEncoderRelPositionalEncoding(config)
    kw = {"attention_mask": mask[None, None], "position_embeddings": positions(x)}
    if streaming and method == "fused":  # as a fused encoder passes its layers (hf.py)
        kw["relpos_max_distance"] = relpos_ext.hf._chunked_mask_max_distance(
            config.sliding_window, config.default_num_lookahead_tokens)
    return module, x, kw, torch.randn(1, length, PARAKEET_EMBED)


def _fastconformer_encoder(method: str, length: int, streaming: bool):
    """A whole ParakeetEncoder (``streaming``: NemotronAsrStreamingEncoder, offline, its default
    lookahead) at its default size, random weights and u, v biases, on ``8 length`` mel frames:
    ``length`` encoder frames after its 8x subsampling. No upstream gradient: forward only."""
    from transformers.models.nemotron_asr_streaming import modeling_nemotron_asr_streaming as nm
    from transformers.models.parakeet import modeling_parakeet as parakeet

    import relpos_ext.hf

    kind = nm.NemotronAsrStreamingEncoder if streaming else parakeet.ParakeetEncoder
    config = kind.config_class(attention_dropout=0.0, attn_implementation="sdpa")
    model = kind(config).eval()
    for name, p in model.named_parameters():
        if name.endswith(("bias_u", "bias_v")):
            torch.nn.init.normal_(p, std=config.initializer_range)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(model)
    x = torch.randn(1, 8 * length, config.num_mel_bins)
    kw = {"num_lookahead_tokens": config.default_num_lookahead_tokens} if streaming else {}
    return model, x, kw, None


def _t5_layer(method: str, length: int):
    """A T5Attention encoder layer (it owns the bias embedding), with padding on the last 5% of
    the tokens in the form transformers' mask code gives each implementation."""
    import transformers
    from transformers.models.t5.modeling_t5 import T5Attention

    import relpos_ext.hf

    config = transformers.T5Config(
        d_model=T5_EMBED, num_heads=T5_HEADS, d_kv=T5_EMBED // T5_HEADS, dropout_rate=0.0,
        attn_implementation="sdpa" if method == "sdpa" else "eager")
    module = T5Attention(config, has_relative_attention_bias=True)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(module)
    x = torch.randn(1, length, T5_EMBED)
    keep = torch.arange(length) < length - length // 20
    if method == "sdpa":
        mask = keep[None, None, None, :]  # bool, True = attend
    else:
        mask = torch.zeros(1, 1, 1, length).masked_fill(~keep, torch.finfo(torch.float32).min)
    return module, x, {"mask": mask}, torch.randn(1, length, T5_EMBED)


def _deberta_layer(method: str, length: int):
    """DeBERTa-v3-base's attention module (DeBERTa-v2 code), with padding on the last 5% of the
    tokens as its encoder's [B, 1, L, L] mask, and the relative positions and the layer-normed
    relative embeddings its encoder hands every layer."""
    import transformers
    from transformers.models.deberta_v2 import modeling_deberta_v2 as deberta

    import relpos_ext.hf

    config = transformers.DebertaV2Config(
        hidden_size=T5_EMBED, num_attention_heads=T5_HEADS, relative_attention=True,
        position_buckets=256, max_relative_positions=512, pos_att_type=["p2c", "c2p"],
        share_att_key=True, norm_rel_ebd="layer_norm", hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    module = deberta.DisentangledSelfAttention(config)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(module)
    x = torch.randn(1, length, T5_EMBED)
    keep = (torch.arange(length) < length - length // 20).long()[None]
    mask = keep[:, None, None, :] * keep[:, None, :, None]  # the encoder's get_attention_mask
    rel_pos = deberta.build_relative_position(x, x, 256, 512)
    rel_emb = torch.nn.functional.layer_norm(torch.randn(512, T5_EMBED), (T5_EMBED,))
    return (module, x, {"attention_mask": mask, "relative_pos": rel_pos,
                        "rel_embeddings": rel_emb}, torch.randn(1, length, T5_EMBED))


class _LastHidden(torch.nn.Module):
    """A model called on its input (``input_name``: MPNetModel's ``inputs_embeds``, an encoder's
    ``hidden_states``) and a ``[B, L]`` padding mask, its last hidden state first, as the other
    layers' outputs. ``clone``: pass a copy (WavLM's encoder zeroes padded frames in place)."""

    def __init__(self, model: torch.nn.Module, input_name: str, clone: bool = False) -> None:
        super().__init__()
        self.model, self.input_name, self.clone = model, input_name, clone

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor]:
        x = x.clone() if self.clone else x
        out = self.model(**{self.input_name: x}, attention_mask=attention_mask)
        return (out.last_hidden_state,)


def _mpnet_model(method: str, length: int, batch: int):
    """all-mpnet-base-v2's MPNetModel (no pooler), random weights, ``batch`` sequences with
    padding on the last 5% of the tokens (the model makes its own mask from the [B, L] one, as
    for token ids)."""
    import transformers

    import relpos_ext.hf

    config = transformers.MPNetConfig(
        hidden_size=T5_EMBED, num_attention_heads=T5_HEADS, num_hidden_layers=MPNET_LAYERS,
        intermediate_size=MPNET_FFN, max_position_embeddings=514, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    model = transformers.MPNetModel(config, add_pooling_layer=False).eval()
    model.embeddings.word_embeddings.requires_grad_(False)  # unused: the input is embeddings
    if method == "fused":
        relpos_ext.hf.use_fused_attention(model)
    x = torch.randn(batch, length, T5_EMBED)
    keep = (torch.arange(length) < length - length // 20).long()[None].expand(batch, -1)
    return (_LastHidden(model, "inputs_embeds"), x, {"attention_mask": keep},
            torch.randn(batch, length, T5_EMBED))


def _speecht5_encoder(method: str, length: int):
    """speecht5_asr's SpeechT5Encoder (the stack after its speech prenet), random weights, on L
    frames with the last 5% padded (the model makes its ``[B, 1, L, L]`` mask)."""
    import transformers
    from transformers.models.speecht5 import modeling_speecht5 as speecht5

    import relpos_ext.hf

    config = transformers.SpeechT5Config(
        hidden_size=T5_EMBED, encoder_attention_heads=T5_HEADS, encoder_layers=MPNET_LAYERS,
        encoder_ffn_dim=MPNET_FFN, encoder_max_relative_position=SPEECHT5_MAX_DISTANCE,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        encoder_layerdrop=0.0)
    model = speecht5.SpeechT5Encoder(config).eval()
    if method == "fused":
        relpos_ext.hf.use_fused_attention(model)
    keep = (torch.arange(length) < length - length // 20).long()[None]
    return (_LastHidden(model, "hidden_states"), torch.randn(1, length, T5_EMBED),
            {"attention_mask": keep}, torch.randn(1, length, T5_EMBED))


def _wavlm_encoder(method: str, length: int, position: str):
    """wavlm-base-plus's WavLMEncoder (the stack after its feature encoder and projection), or
    wavlm-large's pre-norm WavLMEncoderStableLayerNorm, random weights, on L frames with the
    last 5% padded (its ``[B, L]`` bool mask)."""
    import transformers
    from transformers.models.wavlm import modeling_wavlm as wavlm

    import relpos_ext.hf

    embed, heads, layers, ffn = WAVLM_SIZES[position]
    large = position == "wavlm_large"
    config = transformers.WavLMConfig(
        hidden_size=embed, num_attention_heads=heads, num_hidden_layers=layers,
        intermediate_size=ffn, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, do_stable_layer_norm=large)
    model = (wavlm.WavLMEncoderStableLayerNorm if large else wavlm.WavLMEncoder)(config).eval()
    if method == "fused":  # the fused form at every length, below hf.WAVLM_MIN_LENGTH too
        relpos_ext.hf.use_fused_attention(model, wavlm_min_length={"inference": 0, "training": 0})
    keep = (torch.arange(length) < length - length // 20)[None]
    return (_LastHidden(model, "hidden_states", clone=True), torch.randn(1, length, embed),
            {"attention_mask": keep}, torch.randn(1, length, embed))


def _vits_layer(method: str, length: int):
    """MMS-TTS's VitsAttention (a text encoder layer's), the last 5% of the tokens padded, as
    the ``[B, 1, L, L]`` additive mask its encoder makes."""
    import transformers
    from transformers.models.vits import modeling_vits as vits

    import relpos_ext.hf

    config = transformers.VitsConfig(hidden_size=VITS_EMBED, num_attention_heads=VITS_HEADS,
                                     window_size=VITS_WINDOW, attention_dropout=0.0)
    module = vits.VitsAttention(config)
    if method == "fused":
        relpos_ext.hf.use_fused_attention(module)
    mask = torch.zeros(1, 1, length, length)
    mask[..., length - length // 20:] = torch.finfo(torch.float32).min
    return (module, torch.randn(1, length, VITS_EMBED), {"attention_mask": mask},
            torch.randn(1, length, VITS_EMBED))


def measure(method: str, mode: str, length: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: the warm-up, then memory and time of one call."""
    torch.set_num_threads(args.threads)
    module, x, kw, upstream = _layer(method, length, args.position, args.batch, args.encoder)
    if mode == "inference":
        def run():
            with torch.no_grad():
                return module(x, **kw)[0]
    else:
        x.requires_grad_()
        wrt = [x, *(p for p in module.parameters() if p.requires_grad)]

        def run():
            return torch.autograd.grad(module(x, **kw)[0], wrt, upstream)
    run()
    return measure_call(run, args, trim=True)


def check(length: int, position: str, batch: int = 1, encoder: bool = False) -> dict:
    """Runs in a forked child: the other forms' outputs against eager's (SDPA's where there is
    no eager form) on the kept positions (DeBERTa and Parakeet mask padded query rows too,
    where the forms legitimately differ)."""
    outs = {}
    kept = length - length // 20
    methods = _methods(position, encoder)
    for method in methods:
        module, x, kw, _ = _layer(method, length, position, batch, encoder)
        with torch.no_grad():
            outs[method] = module(x, **kw)[0][:, :kept]
    ref = _reference(methods)
    return {m: (outs[m] - outs[ref]).abs().max().item() for m in outs if m != ref}


def _methods(position: str, encoder: bool = False) -> tuple[str, ...]:
    if position == "nemotron" or encoder:
        return ("fused", "sdpa")
    return (("fused", "eager") if position in ("deberta", "mpnet", "speecht5", "vits", *WAVLM_SIZES)
            else METHODS)


def _reference(methods: tuple[str, ...]) -> str:
    """The form the others' outputs are checked against: eager, or SDPA where there is none."""
    return "eager" if "eager" in methods else "sdpa"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", "-L", type=int, nargs="+",
                   help="sequence lengths (default 500 1000 2000 4000; --encoder: 750 3000)")
    p.add_argument("--position",
                   choices=["relative_key", "relative", "t5", "deberta", "mpnet", "parakeet",
                            "nemotron", "speecht5", "vits", *WAVLM_SIZES],
                   default="relative_key",
                   help="position_embeddings_type (default relative_key), or t5, deberta, "
                        "mpnet, parakeet, nemotron, speecht5, vits, wavlm, wavlm_large")
    p.add_argument("--encoder", action="store_true",
                   help="parakeet, nemotron: the whole encoder at its default size, forward only")
    p.add_argument("--batch", "-B", type=int, default=1,
                   help="sequences per call, mpnet only (the others run B=1)")
    p.add_argument("--mem-cap-gib", type=float, default=12.0,
                   help="skip a form whose analytic live set exceeds this (default 12)")
    add_common_args(p, RESULTS / "bench_hf.json", rep_budget_s=20.0)
    args = p.parse_args(argv)
    if args.batch != 1 and args.position != "mpnet":
        p.error("--batch is for --position mpnet; the other layers run B=1")
    if args.encoder and args.position not in ("parakeet", "nemotron"):
        p.error("--encoder is for --position parakeet or nemotron")
    if args.lengths is None:
        args.lengths = [750, 3000] if args.encoder else [500, 1000, 2000, 4000]
    if args.out == RESULTS / "bench_hf.json" and args.position != "relative_key":
        args.out = RESULTS / f"bench_hf_{args.position}{'_encoder' if args.encoder else ''}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_platform("bench_hf.py")
    import transformers

    info, mach = print_environment(args.threads)
    if args.position == "t5":
        embed, heads = T5_EMBED, T5_HEADS
        print(f"transformers {transformers.__version__}; T5Attention E={embed} H={heads} "
              f"D={embed // heads}, 32 buckets, max distance 128, float32, B=1")
    elif args.position == "mpnet":
        embed, heads = T5_EMBED, T5_HEADS
        print(f"transformers {transformers.__version__}; MPNetModel {MPNET_LAYERS} layers "
              f"E={embed} H={heads} D={embed // heads} FFN={MPNET_FFN}, 32 buckets, max "
              f"distance 128, float32, B={args.batch}")
    elif args.position in ("parakeet", "nemotron"):
        embed, heads = PARAKEET_EMBED, PARAKEET_HEADS
        name = {("parakeet", False): "ParakeetEncoderAttention",
                ("nemotron", False): "NemotronAsrStreamingEncoderAttention (offline, chunked mask)",
                ("parakeet", True): "ParakeetEncoder 24 layers FFN=4096,",
                ("nemotron", True): "NemotronAsrStreamingEncoder (offline) 24 layers FFN=4096,",
                }[args.position, args.encoder]
        print(f"transformers {transformers.__version__}; {name} E={embed} "
              f"H={heads} D={embed // heads}, Transformer-XL positions, float32, B=1")
    elif args.position == "speecht5":
        embed, heads = T5_EMBED, T5_HEADS
        print(f"transformers {transformers.__version__}; SpeechT5Encoder {MPNET_LAYERS} layers "
              f"E={embed} H={heads} D={embed // heads} FFN={MPNET_FFN}, Shaw keys clipped to "
              f"[-{SPEECHT5_MAX_DISTANCE - 1}, {SPEECHT5_MAX_DISTANCE}], float32, B=1")
    elif args.position in WAVLM_SIZES:
        embed, heads, layers, ffn = WAVLM_SIZES[args.position]
        norm = "StableLayerNorm" if args.position == "wavlm_large" else ""
        print(f"transformers {transformers.__version__}; WavLMEncoder{norm} {layers} layers "
              f"E={embed} H={heads} D={embed // heads} FFN={ffn}, T5 bias (320 buckets, max "
              f"distance 800) gated per query, float32, B=1")
    elif args.position == "vits":
        embed, heads = VITS_EMBED, VITS_HEADS
        print(f"transformers {transformers.__version__}; VitsAttention E={embed} H={heads} "
              f"D={embed // heads}, Shaw keys and values within {VITS_WINDOW}, float32, B=1")
    elif args.position == "deberta":
        embed, heads = T5_EMBED, T5_HEADS
        print(f"transformers {transformers.__version__}; DeBERTa-v2 DisentangledSelfAttention "
              f"E={embed} H={heads} D={embed // heads}, 256 log buckets up to 512, c2p + p2c, "
              f"float32, B=1")
    else:
        embed, heads = EMBED, HEADS
        where = f" [-{LEFT}, {RIGHT}]" if args.position == "relative_key" else " (Transformer-XL)"
        print(f"transformers {transformers.__version__}; Wav2Vec2BertSelfAttention E={EMBED} "
              f"H={HEADS} D={EMBED // HEADS}, {args.position}{where}, float32, B=1")
    methods = _methods(args.position, args.encoder)
    errors = in_child(check, 300, args.position, min(args.batch, 2), args.encoder)
    ref = _reference(methods)
    print(f"max |out - {ref}| at L=300: " + ", ".join(f"{m} {e:.2e}" for m, e in errors.items())
          if "error" not in errors else f"check failed: {errors['error']}")

    def skip(method: str, mode: str, length: int) -> str | None:
        need = live_gib(method, mode, length, args.position, args.batch)
        return f"skip ({need:.1f} GiB)" if need > args.mem_cap_gib else None

    modes = ("inference",) if args.encoder else MODES
    rows = measure_grid(measure, args, modes, methods, skip, width=22)
    write_json({
        "benchmark": "bench_hf", "timestamp": timestamp(), "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "build_info": info, "machine": mach,
        "config": {"embed_dim": embed, "heads": heads, "position": args.position,
                   "encoder": args.encoder, "left": LEFT, "right": RIGHT,
                   "dtype": "float32", "batch": args.batch, "lengths": args.lengths,
                   "threads": args.threads, "mem_cap_gib": args.mem_cap_gib},
        "max_abs_error_vs_eager_L300": errors, "error_reference": ref, "methods": list(methods),
        "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
