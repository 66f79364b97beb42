"""relpos_ext.hf against Hugging Face transformers' own relative-key attention.

transformers' Wav2Vec2-BERT and SeamlessM4T v2 speech encoder compute Shaw's relative key term
with asymmetric clipping in eager PyTorch; use_fused_attention swaps in rel_attention. Outputs and
every parameter's gradient must match transformers' eager attention, on the attention module
alone and through a whole model with its padding mask.
"""

from __future__ import annotations

import os

import pytest
import torch

import relpos_ext
from relpos_ext import hf

if os.environ.get("RELPOS_REQUIRE_TRANSFORMERS") == "1":  # CI: a missing package is a failure
    import transformers
else:
    transformers = pytest.importorskip("transformers")

from transformers.models.fastspeech2_conformer import (  # noqa: E402
    modeling_fastspeech2_conformer as fastspeech2,
)
from transformers.models.nemotron_asr_streaming import (  # noqa: E402
    modeling_nemotron_asr_streaming as nemotron,
)
from transformers.models.parakeet import modeling_parakeet as parakeet  # noqa: E402
from transformers.models.seamless_m4t import modeling_seamless_m4t as seamless_v1  # noqa: E402
from transformers.models.seamless_m4t_v2 import modeling_seamless_m4t_v2 as seamless  # noqa: E402
from transformers.models.speecht5 import modeling_speecht5 as speecht5  # noqa: E402
from transformers.models.vits import modeling_vits as vits  # noqa: E402
from transformers.models.wav2vec2_bert import modeling_wav2vec2_bert as w2v  # noqa: E402
from transformers.models.wav2vec2_conformer import (  # noqa: E402
    modeling_wav2vec2_conformer as conformer,
)
from transformers.models.wavlm import modeling_wavlm as wavlm  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _w2v_config(left, right, attn_implementation="eager"):
    return transformers.Wav2Vec2BertConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        position_embeddings_type="relative_key", left_max_position_embeddings=left,
        right_max_position_embeddings=right, feature_projection_input_dim=16,
        output_hidden_size=32, conv_depthwise_kernel_size=3,
        attn_implementation=attn_implementation)


def _attention(kind, left, right, dtype):
    torch.manual_seed(0)
    if kind == "wav2vec2_bert":
        module = w2v.Wav2Vec2BertSelfAttention(_w2v_config(left, right))
    else:
        config = transformers.SeamlessM4Tv2Config(
            hidden_size=32, speech_encoder_attention_heads=4, position_embeddings_type="relative_key",
            left_max_position_embeddings=left, right_max_position_embeddings=right,
            attn_implementation="eager")
        module = seamless.SeamlessM4Tv2ConformerSelfAttention(config)
    with torch.no_grad():  # nn.Embedding starts N(0, 1): scale it like the projections
        module.distance_embedding.weight.mul_(0.3)
    return module.to(dtype).eval()  # eval: no attention dropout


# Transformer-XL ("relative") attention: name -> (config maker, attention class, position class)
XL = {
    "wav2vec2_bert": (lambda: _w2v_config(0, 0), w2v.Wav2Vec2BertSelfAttention,
                      w2v.Wav2Vec2BertRelPositionalEmbedding),
    "wav2vec2_conformer": (lambda: transformers.Wav2Vec2ConformerConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        conv_depthwise_kernel_size=3, attn_implementation="eager"),
        conformer.Wav2Vec2ConformerSelfAttention, conformer.Wav2Vec2ConformerRelPositionalEmbedding),
    "seamless_m4t": (lambda: transformers.SeamlessM4TConfig(
        hidden_size=32, speech_encoder_attention_heads=4, attn_implementation="eager"),
        seamless_v1.SeamlessM4TConformerSelfAttention,
        seamless_v1.SeamlessM4TConformerRelPositionalEmbedding),
}


def _xl_attention(kind, dtype):
    """A "relative" (Transformer-XL) attention module with random u and v biases, and its
    relative position embedding module."""
    make_config, attention, positions = XL[kind]
    config = make_config()
    config.position_embeddings_type = "relative"
    torch.manual_seed(0)
    module = attention(config)
    with torch.no_grad():  # transformers initialises them later (xavier); zeros would hide them
        module.pos_bias_u.normal_(0, 0.3)
        module.pos_bias_v.normal_(0, 0.3)
    return module.to(dtype).eval(), positions(config)  # eval: no attention dropout


def _padding_mask(lengths, length, dtype):
    """transformers' eager 4-D additive mask [B, 1, L, L]: 0, or finfo.min on padded keys."""
    keep = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.zeros(len(lengths), 1, length, length, dtype=dtype)
    return mask.masked_fill(~keep[:, None, None, :], torch.finfo(dtype).min)


def _assert_same_grads(fused, model, **tol):
    """Every parameter's gradient in the fused model equals the one in transformers' (default
    tolerance: float64's)."""
    tol = tol or dict(atol=1e-10, rtol=1e-8)
    for (name, p), q in zip(fused.named_parameters(), model.parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


def _grads(module, x, out, upstream):
    (out * upstream).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def _check_swap(module, x, **call_kw):
    """transformers' forward, then use_fused_attention and ours, on input x and call_kw: the
    outputs and the gradients of x and every parameter must match. Returns ours' output."""
    upstream = torch.randn_like(x)
    x_hf = x.clone().requires_grad_()
    exp, _ = module(x_hf, **call_kw)
    exp_grads = _grads(module, x_hf, exp, upstream)
    module.zero_grad()
    assert hf.use_fused_attention(module) == [""]
    x_ours = x.clone().requires_grad_()
    got, weights = module(x_ours, **call_kw)
    assert weights is None
    got_grads = _grads(module, x_ours, got, upstream)
    torch.testing.assert_close(got, exp, **TOL[x.dtype])
    names = ["input"] + [n for n, _ in module.named_parameters()]
    for name, g, e in zip(names, got_grads, exp_grads):
        torch.testing.assert_close(g, e, **TOL[x.dtype], msg=name)
    return exp.detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("left,right", [(5, 2), (2, 5), (64, 8), (0, 0)])
@pytest.mark.parametrize("kind", ["wav2vec2_bert", "seamless_m4t_v2"])
def test_attention_module_matches_transformers(kind, left, right, dtype):
    """One attention module, L = 37 (clipped on both sides unless K >= L), two sequences with
    padding: output and the gradients of the input and every parameter (distance_embedding
    included) equal transformers' eager forward."""
    module = _attention(kind, left, right, dtype)
    x = torch.randn(2, 37, 32, dtype=dtype)
    mask = _padding_mask([37, 29], 37, dtype)
    exp = _check_swap(module, x, attention_mask=mask)
    del module.forward  # transformers' forward again
    torch.testing.assert_close(module(x, attention_mask=mask)[0], exp, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 37])
@pytest.mark.parametrize("kind", list(XL))
def test_transformer_xl_attention_matches_transformers(kind, length, dtype):
    """A "relative" (Transformer-XL) attention module: output and the gradients of the input and
    every parameter (linear_pos, pos_bias_u and pos_bias_v included) equal transformers' eager
    forward, padding mask included."""
    module, positions = _xl_attention(kind, dtype)
    x = torch.randn(2, length, 32, dtype=dtype)
    rel = positions(x).to(dtype)
    assert rel.shape == (1, 2 * length - 1, 32)
    mask = _padding_mask([length, max(1, length - 8)], length, dtype)
    assert {"linear_pos.weight", "pos_bias_u", "pos_bias_v"} <= dict(module.named_parameters()).keys()
    _check_swap(module, x, attention_mask=mask, relative_position_embeddings=rel)
    with pytest.raises(ValueError, match=r"relative_position_embeddings must be \[1, 2L - 1, E\]"):
        module(x, attention_mask=mask, relative_position_embeddings=rel[:, 1:])


def test_layer_with_asymmetric_clipping_is_wav2vec2_bert_attention():
    """RelativeMultiheadAttention(max_distance=(left, right), rel_values=False) holding a
    Wav2Vec2-BERT relative_key module's weights computes that module's attention: the layer's
    own clipping agrees with transformers' clamp(j - i, -left, right)."""
    module = _attention("wav2vec2_bert", 6, 3, torch.float32)
    layer = relpos_ext.nn.RelativeMultiheadAttention(32, 4, (6, 3), rel_values=False)
    with torch.no_grad():
        for ours, theirs in ((layer.q_proj, module.linear_q), (layer.k_proj, module.linear_k),
                             (layer.v_proj, module.linear_v), (layer.out_proj, module.linear_out)):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
        layer.rel_k.copy_(module.distance_embedding.weight)
    x = torch.randn(2, 23, 32)
    mask = _padding_mask([23, 17], 23, torch.float32)
    exp, _ = module(x, attention_mask=mask)
    got, _ = layer(x, key_padding_mask=mask[:, 0, 0] < 0)
    torch.testing.assert_close(got, exp, atol=2e-5, rtol=2e-5)


def test_transformer_xl_inputs_identity():
    """transformer_xl_inputs: ((q + u) k^T + (q + u) pos[r]) scale + rel_bias[r] is ((q + u) k^T +
    (q + v) pos[r]) scale for every (i, j), in float64."""
    g = torch.Generator().manual_seed(0)
    b, h, length, d, scale = 2, 3, 5, 4, 0.7
    q, k = (torch.randn(b, h, length, d, dtype=torch.float64, generator=g) for _ in range(2))
    pos = torch.randn(h, 2 * length - 1, d, dtype=torch.float64, generator=g)
    u, w = (torch.randn(h, d, dtype=torch.float64, generator=g) for _ in range(2))
    q2, bias = hf.transformer_xl_inputs(q, pos, u, w, scale)
    assert q2.shape == q.shape and bias.shape == (h, 2 * length - 1)
    r = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    rows = pos[:, r + length - 1]  # [H, L, L, D]
    want = ((q + u[:, None]) @ k.transpose(-1, -2)
            + torch.einsum("bhid,hijd->bhij", q + w[:, None], rows)) * scale
    got = ((q2 @ k.transpose(-1, -2) + torch.einsum("bhid,hijd->bhij", q2, rows)) * scale
           + bias[:, r + length - 1])
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_half_precision_no_less_accurate_than_transformers():
    """bfloat16 and float16 modules (relative_key and relative): against the float64 module,
    the fused output's error is within 1.5x transformers' own error in that dtype."""
    for half in (torch.bfloat16, torch.float16):
        for kind in ("relative_key", "relative"):
            if kind == "relative_key":
                module, kw = _attention("wav2vec2_bert", 5, 2, torch.float64), {}
                x = torch.randn(2, 37, 32, dtype=torch.float64)
            else:
                module, positions = _xl_attention("wav2vec2_conformer", torch.float64)
                x = torch.randn(2, 37, 32, dtype=torch.float64)
                kw = {"relative_position_embeddings": positions(x).double()}
            mask = _padding_mask([37, 29], 37, torch.float64)
            with torch.no_grad():
                exact, _ = module(x, attention_mask=mask, **kw)
                low = module.to(half)
                args = (x.to(half),)
                lkw = {n: t.to(half) for n, t in kw.items()}
                theirs, _ = low(*args, attention_mask=mask.to(half), **lkw)
                hf.use_fused_attention(low)
                ours, _ = low(*args, attention_mask=mask.to(half), **lkw)
            err_theirs = (theirs.double() - exact).abs().max().item()
            err_ours = (ours.double() - exact).abs().max().item()
            assert err_ours <= 1.5 * err_theirs + 1e-6, (half, kind, err_ours, err_theirs)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_whole_model_matches_transformers(impl):
    """A two-layer Wav2Vec2-BERT model with a padding attention_mask: the fused model's hidden
    states equal transformers' on the kept positions, both layers' attention is swapped, and a
    training step's gradients agree. The masks come from the model's own mask code: float
    (eager) or bool (sdpa)."""
    torch.manual_seed(0)
    model = transformers.Wav2Vec2BertModel(_w2v_config(5, 2, impl)).eval()
    fused = transformers.Wav2Vec2BertModel(_w2v_config(5, 2, impl)).eval()
    fused.load_state_dict(model.state_dict())
    names = hf.use_fused_attention(fused)
    assert names == ["encoder.layers.0.self_attn", "encoder.layers.1.self_attn"]
    feats = torch.randn(2, 30, 16)
    keep = torch.ones(2, 30, dtype=torch.long)
    keep[1, 21:] = 0
    exp = model(feats, attention_mask=keep).last_hidden_state
    got = fused(feats, attention_mask=keep).last_hidden_state
    torch.testing.assert_close(got[0], exp[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1, :21], exp[1, :21], atol=2e-5, rtol=2e-5)
    exp[1, :21].square().sum().backward()
    got[1, :21].square().sum().backward()
    _assert_same_grads(fused, model, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 37])
def test_fastspeech2_conformer_attention_matches_transformers(length, dtype):
    """FastSpeech2-Conformer's ESPnet attention (Transformer-XL positions, a [B, 1, L] keep-mask,
    fully masked rows give zeros): output and every gradient equal transformers'."""
    config = transformers.FastSpeech2ConformerConfig(hidden_size=32)
    module_config = {"num_attention_heads": 4, "attention_dropout_rate": 0.0,
                     "positional_dropout_rate": 0.0}
    torch.manual_seed(0)
    module = fastspeech2.FastSpeech2ConformerAttention(config, module_config)
    with torch.no_grad():  # created uninitialised (torch.Tensor): give them values
        module.pos_bias_u.normal_(0, 0.3)
        module.pos_bias_v.normal_(0, 0.3)
    module = module.to(dtype)
    positions = fastspeech2.FastSpeech2ConformerRelPositionalEncoding(config, module_config)
    x = torch.randn(2, length, 32, dtype=dtype)
    _, pos_emb = positions(x)
    keep = torch.ones(2, 1, length, dtype=torch.long)
    keep[1, :, max(1, length - 8):] = 0
    _check_swap(module, x, attention_mask=keep, pos_emb=pos_emb)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, 1, L\]"):
        module(x, attention_mask=keep[:, 0], pos_emb=pos_emb)


def test_whole_transformer_xl_model_matches_transformers():
    """A two-layer Wav2Vec2-Conformer with "relative" positions and padding: the fused model's
    hidden states and a training step's gradients equal transformers'. In float64: some of
    these gradients are sums that cancel to ~1e-7, below float32's rounding of their terms
    (transformers' own float32 gradients are 1e-4 off there)."""
    torch.manual_seed(0)
    config = XL["wav2vec2_conformer"][0]()
    config.position_embeddings_type = "relative"
    config.conv_dim, config.conv_stride, config.conv_kernel = (16, 16), (5, 2), (10, 3)
    config.num_feat_extract_layers = 2
    model = transformers.Wav2Vec2ConformerModel(config).eval().double()
    fused = transformers.Wav2Vec2ConformerModel(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert len(hf.use_fused_attention(fused)) == 2
    audio = torch.randn(2, 400, dtype=torch.float64)
    keep = torch.ones(2, 400, dtype=torch.long)
    keep[1, 300:] = 0
    exp = model(audio, attention_mask=keep).last_hidden_state
    got = fused(audio, attention_mask=keep).last_hidden_state
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
    exp.square().sum().backward()
    got.square().sum().backward()
    _assert_same_grads(fused, model)


def test_other_position_types_left_alone():
    """Rotary attention (and none) keep transformers' forward."""
    for position in ("rotary", None):
        config = _w2v_config(5, 2)
        config.position_embeddings_type = position
        module = w2v.Wav2Vec2BertSelfAttention(config)
        assert hf.use_fused_attention(module) == []
        assert "forward" not in vars(module)


def test_clipped_table():
    """relpos_ext.nn.clipped_table's bucket rows are transformers' clamp(r, -left, right) + left
    rows (per-head tables too), and the repeated rows' gradients add up."""
    weight = torch.randn(5 + 2 + 1, 4, requires_grad=True)
    table = relpos_ext.nn.clipped_table(weight, 5, 2)
    assert table.shape == (11, 4)
    for r in range(-9, 10):
        ours = table[max(-5, min(5, r)) + 5]
        theirs = weight[max(-5, min(2, r)) + 5]
        assert torch.equal(ours, theirs), r
    table.sum().backward()
    assert weight.grad[:, 0].tolist() == [1, 1, 1, 1, 1, 1, 1, 4]
    per_head = torch.randn(3, 8, 4)
    torch.testing.assert_close(relpos_ext.nn.clipped_table(per_head, 5, 2)[1],
                               relpos_ext.nn.clipped_table(per_head[1], 5, 2), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"must be \[\.\.\., left \+ right \+ 1, D\] = "
                                         r"\[\.\.\., 7, D\], got \(8, 4\)"):
        relpos_ext.nn.clipped_table(weight, 4, 2)
    with pytest.raises(ValueError, match="left and right must be >= 0"):
        relpos_ext.nn.clipped_table(weight, -1, 8)


def test_masks_and_bad_masks():
    """transformers' bool masks (True = attend) and -inf masks work like finfo.min ones; a mask
    with other values (a bias) raises; output_attentions runs transformers' own forward."""
    module = _attention("wav2vec2_bert", 3, 3, torch.float32)
    hf.use_fused_attention(module)
    x = torch.randn(2, 9, 32)
    mask = _padding_mask([9, 6], 9, torch.float32)
    want, _ = module(x, attention_mask=mask)
    got_bool, _ = module(x, attention_mask=mask == 0)
    got_inf, _ = module(x, attention_mask=mask.masked_fill(mask < 0, float("-inf")))
    torch.testing.assert_close(got_bool, want, atol=0, rtol=0)
    torch.testing.assert_close(got_inf, want, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match=r"a float attention mask must hold only 0 \(keep\) "
                                           r"and -inf or large negative values"):
        module(x, attention_mask=mask - 1.0)
    # weights asked for: transformers' own forward, weights included
    theirs, theirs_w = w2v.Wav2Vec2BertSelfAttention.forward(module, x, attention_mask=mask,
                                                             output_attentions=True)
    with_w, w = module(x, attention_mask=mask, output_attentions=True)
    assert w is not None and w.shape == (2, 4, 9, 9)
    torch.testing.assert_close(w, theirs_w, atol=0, rtol=0)
    torch.testing.assert_close(with_w, want, atol=1e-5, rtol=1e-5)


def test_dropout_follows_training_mode():
    """The module's attention dropout applies in training mode only, as in transformers."""
    module, positions = _xl_attention("wav2vec2_conformer", torch.float32)
    assert module.dropout.p == 0.1
    hf.use_fused_attention(module)
    x = torch.randn(2, 40, 32)
    rel = positions(x)
    evals = [module(x, relative_position_embeddings=rel)[0] for _ in range(2)]
    torch.testing.assert_close(evals[0], evals[1], atol=0, rtol=0)
    module.train()
    trains = [module(x, relative_position_embeddings=rel)[0] for _ in range(2)]
    assert not torch.allclose(trains[0], evals[0]) and not torch.allclose(trains[0], trains[1])


def test_fused_module_compiles():
    """The swapped forward compiles with fullgraph=True (the mask check is an op)."""
    torch._dynamo.reset()
    module = _attention("seamless_m4t_v2", 4, 2, torch.float32)
    x = torch.randn(2, 11, 32)
    mask = _padding_mask([11, 7], 11, torch.float32)
    want, _ = module(x, attention_mask=mask)
    hf.use_fused_attention(module)
    compiled = torch.compile(lambda x, m: module(x, attention_mask=m)[0], fullgraph=True)
    torch.testing.assert_close(compiled(x, mask)[1, :7], want[1, :7], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(compiled(x, mask)[0], want[0], atol=2e-5, rtol=2e-5)
    assert relpos_ext.hf is hf


# ------------------------------------------------------------------------------------------ T5
def _t5_config(impl, **kw):
    base = dict(vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                num_decoder_layers=2, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, dropout_rate=0.0,
                attn_implementation=impl, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5Config(**(base | kw))


def _t5_pair(cls, config):
    torch.manual_seed(0)
    model = cls(config).eval().double()
    fused = cls(config).eval().double()
    fused.load_state_dict(model.state_dict())
    return model, fused


def _seq2seq_batch():
    """300 source and 140 target tokens (past T5's max distance of 128, so its last buckets are
    read), padding in both: (src, src_keep, tgt, tgt_keep)."""
    src = torch.randint(1, 97, (2, 300))
    src_keep = torch.ones(2, 300, dtype=torch.long)
    src_keep[1, 250:] = 0
    tgt = torch.randint(1, 97, (2, 140))
    tgt_keep = torch.ones(2, 140, dtype=torch.long)
    tgt_keep[0, 120:] = 0
    return src, src_keep, tgt, tgt_keep


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("cls_name", ["T5Model", "MT5Model"])
def test_t5_model_matches_transformers(cls_name, impl):
    """A two-layer T5 (and mT5) encoder-decoder, 300 source and 140 target positions (past T5's
    max distance of 128, so the last buckets are read), padding in both, float64: the fused
    model's encoder and decoder states equal transformers' on the kept positions, and so do a
    training step's gradients (the bias embeddings' included). Every self-attention is swapped;
    cross-attention keeps transformers' forward."""
    model, fused = _t5_pair(getattr(transformers, cls_name), _t5_config(impl))
    names = hf.use_fused_attention(fused)
    assert len(names) == 4 and all(n.endswith("SelfAttention") for n in names)
    src, src_keep, tgt, tgt_keep = _seq2seq_batch()
    kw = dict(input_ids=src, attention_mask=src_keep, decoder_input_ids=tgt,
              decoder_attention_mask=tgt_keep, use_cache=False)
    exp, got = model(**kw), fused(**kw)
    enc_keep, dec_keep = src_keep.bool(), tgt_keep.bool()
    torch.testing.assert_close(got.encoder_last_hidden_state[enc_keep],
                               exp.encoder_last_hidden_state[enc_keep], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got.last_hidden_state[dec_keep], exp.last_hidden_state[dec_keep],
                               atol=1e-10, rtol=1e-10)
    exp.last_hidden_state[dec_keep].square().sum().backward()
    got.last_hidden_state[dec_keep].square().sum().backward()
    _assert_same_grads(fused, model, atol=1e-9, rtol=1e-8)


def _count_fused_calls(monkeypatch):
    """A list that gets, for each rel_attention call relpos_ext.hf makes, ``(Lq, Lk,
    q_offset)``."""
    calls = []
    real = relpos_ext.ops.rel_attention

    def counted(q, k, *args, **kw):
        calls.append((q.shape[2], k.shape[2], kw.get("q_offset", 0)))
        return real(q, k, *args, **kw)
    monkeypatch.setattr(relpos_ext.ops, "rel_attention", counted)
    return calls


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5_generation_and_attention_outputs_unchanged(cache, monkeypatch):
    """generate() gives the unfused model's tokens. With the default (dynamic) cache every
    decoder step is fused: one new row per layer at q_offset = the cached length against all
    cached keys. A static cache's first step is fused (its length is an int 0 there); its later
    steps (the length a tensor) run transformers' forward. output_attentions falls back to
    transformers' forward and returns its weights."""
    model, fused = _t5_pair(transformers.T5ForConditionalGeneration, _t5_config("eager"))
    hf.use_fused_attention(fused)
    src = torch.randint(1, 97, (2, 150))
    keep = torch.ones(2, 150, dtype=torch.long)
    keep[0, 130:] = 0
    kw = dict(input_ids=src, attention_mask=keep, max_new_tokens=12, do_sample=False,
              cache_implementation=cache)
    calls = _count_fused_calls(monkeypatch)
    assert torch.equal(fused.generate(**kw), model.generate(**kw))
    assert calls[:2] == [(150, 150, 0)] * 2  # the encoder
    if cache == "dynamic":
        assert calls[2:] == [(1, n + 1, n) for n in range(12) for _ in range(2)]
    else:
        assert calls[2:] == [(1, 12, 0)] * 2
    out = fused(input_ids=src, attention_mask=keep, decoder_input_ids=src[:, :5],
                output_attentions=True)
    want = model(input_ids=src, attention_mask=keep, decoder_input_ids=src[:, :5],
                 output_attentions=True)
    for got, exp in zip(out.encoder_attentions + out.decoder_attentions,
                        want.encoder_attentions + want.decoder_attentions, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_t5_decoder_with_a_cache_matches_transformers(impl, monkeypatch):
    """A forward without labels makes a KV cache by default (use_cache): the decoder runs fused
    with it, and the logits and a training step's gradients equal transformers' on the kept
    positions. Then, with an explicit cache, chunks of 7, 1, 22 and 1 target positions (rows
    past T5's max distance of 128 in the last ones) give transformers' logits step by step."""
    model, fused = _t5_pair(transformers.T5ForConditionalGeneration, _t5_config(impl))
    hf.use_fused_attention(fused)
    src, src_keep, tgt, tgt_keep = _seq2seq_batch()
    calls = _count_fused_calls(monkeypatch)
    kw = dict(input_ids=src, attention_mask=src_keep, decoder_input_ids=tgt,
              decoder_attention_mask=tgt_keep)
    exp, got = model(**kw), fused(**kw)
    assert got.past_key_values.get_seq_length() == 140
    assert calls == [(300, 300, 0)] * 2 + [(140, 140, 0)] * 2
    keep = tgt_keep.bool()
    torch.testing.assert_close(got.logits[keep], exp.logits[keep], atol=1e-10, rtol=1e-10)
    exp.logits[keep].square().sum().backward()
    got.logits[keep].square().sum().backward()
    _assert_same_grads(fused, model, atol=1e-9, rtol=1e-8)

    enc = model.get_encoder()(input_ids=src, attention_mask=src_keep)
    caches = [transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                               transformers.DynamicCache()) for _ in range(2)]
    calls.clear()
    with torch.no_grad():
        for start, stop in [(0, 7), (7, 8), (8, 130), (130, 131)]:
            step = dict(encoder_outputs=enc, attention_mask=src_keep, use_cache=True,
                        decoder_input_ids=tgt[:, start:stop])
            want = model(**step, past_key_values=caches[0]).logits
            have = fused(**step, past_key_values=caches[1]).logits
            torch.testing.assert_close(have, want, atol=1e-10, rtol=1e-10)
    assert calls == [(stop - start, stop, start) for start, stop in
                     [(0, 7), (7, 8), (8, 130), (130, 131)] for _ in range(2)]


T5_FAMILY = {  # model class: (config class, extra config, extra inputs, modules fused, encoder's)
    "LongT5ForConditionalGeneration": ("LongT5Config", {}, {}, 2, 0),  # encoder: local attention
    "SwitchTransformersForConditionalGeneration": (
        "SwitchTransformersConfig", dict(num_experts=2, num_sparse_encoder_layers=1,
                                         num_sparse_decoder_layers=1, expert_capacity=64), {}, 4, 2),
    "Pop2PianoForConditionalGeneration": ("Pop2PianoConfig", {}, {}, 4, 2),
    # UDOP's encoder bias is [B, H, L, L] (with a 2-D layout term): transformers' forward runs
    "UdopForConditionalGeneration": ("UdopConfig", {}, dict(bbox=torch.rand(2, 40, 4)), 4, 0),
}


@pytest.mark.parametrize("cls_name", sorted(T5_FAMILY))
def test_t5_family_decoders_with_a_cache(cls_name, monkeypatch):
    """The other models with T5Attention copies, float64: a forward that makes a KV cache
    (use_cache, the default) and then chunks of 5, 1 and 14 target positions with an explicit
    cache give transformers' logits, with every decoder self-attention fused at the cached
    length; so is every step of generate(), which gives the same tokens (Pop2Piano's generate
    takes audio features, and Switch Transformers' encoder refuses an explicit use_cache, so
    those two skip a part)."""
    config_name, extra, inputs, n_fused, n_encoder = T5_FAMILY[cls_name]
    config = getattr(transformers, config_name)(
        vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
        num_decoder_layers=2, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, **extra)
    model, fused = _t5_pair(getattr(transformers, cls_name), config)
    assert len(hf.use_fused_attention(fused)) == n_fused
    inputs = {k: v.double() for k, v in inputs.items()}
    src = torch.randint(2, 97, (2, 40))
    keep = torch.ones(2, 40, dtype=torch.long)
    keep[0, 30:] = 0
    tgt = torch.randint(2, 97, (2, 20))
    calls = _count_fused_calls(monkeypatch)
    with torch.no_grad():
        kw = dict(input_ids=src, attention_mask=keep, decoder_input_ids=tgt, **inputs)
        torch.testing.assert_close(fused(**kw).logits, model(**kw).logits, atol=1e-10, rtol=1e-10)
        assert calls == [(40, 40, 0)] * n_encoder + [(20, 20, 0)] * 2
        steps = [] if cls_name.startswith("Switch") else [(0, 5), (5, 6), (6, 20)]
        caches = [transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                                   transformers.DynamicCache()) for _ in range(2)]
        calls.clear()
        for start, stop in steps:
            step = dict(input_ids=src, attention_mask=keep, decoder_input_ids=tgt[:, start:stop],
                        use_cache=True, **inputs)
            want = model(**step, past_key_values=caches[0]).logits
            have = fused(**step, past_key_values=caches[1]).logits
            torch.testing.assert_close(have, want, atol=1e-10, rtol=1e-10)
        assert calls == [call for start, stop in steps for call in
                         [(40, 40, 0)] * n_encoder + [(stop - start, stop, start)] * 2]
    if not cls_name.startswith("Pop2Piano"):
        calls.clear()
        gen = dict(input_ids=src, attention_mask=keep, max_new_tokens=6, min_new_tokens=6,
                   do_sample=False, **inputs)
        assert torch.equal(fused.generate(**gen), model.generate(**gen))
        assert calls == [(40, 40, 0)] * n_encoder + [(1, n + 1, n) for n in range(6)
                                                      for _ in range(2)]


def test_t5_max_distance_within_the_exact_buckets_is_left_alone():
    """relative_attention_max_distance at or below T5's exact distances (6 < 32 // 4): its
    buckets beyond are not a table's (transformers' own formula gives buckets below the exact
    ones there), so use_fused_attention leaves the attention to transformers, whose outputs the
    model keeps."""
    config = _t5_config("eager", relative_attention_max_distance=6)
    model, fused = _t5_pair(transformers.T5EncoderModel, config)
    assert hf.use_fused_attention(fused) == []
    ids = torch.randint(1, 97, (1, 10))
    torch.testing.assert_close(fused(input_ids=ids).last_hidden_state,
                               model(input_ids=ids).last_hidden_state, atol=0, rtol=0)


def test_fused_model_saves_and_loads(tmp_path, monkeypatch):
    """torch.save of a whole fused model (pickle, not a state dict) loads back, still fused and
    with the same outputs: the swapped-in forwards pickle (functools.partial of relpos_ext.hf's
    functions)."""
    model, fused = _t5_pair(transformers.T5ForConditionalGeneration, _t5_config("eager"))
    hf.use_fused_attention(fused)
    torch.save(fused, tmp_path / "t5.pt")
    loaded = torch.load(tmp_path / "t5.pt", weights_only=False)
    src, src_keep, tgt, tgt_keep = _seq2seq_batch()
    kw = dict(input_ids=src, attention_mask=src_keep, decoder_input_ids=tgt,
              decoder_attention_mask=tgt_keep)
    calls = _count_fused_calls(monkeypatch)
    with torch.no_grad():
        got, want = loaded(**kw).logits, model(**kw).logits
    assert len(calls) == 4
    keep = tgt_keep.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-10, rtol=1e-10)


def test_t5_encoder_training_compiles():
    """A T5 encoder with the fused attention, compiled (fullgraph) in training mode with
    attention dropout: no graph break, finite gradients reaching the bias embedding."""
    torch.manual_seed(0)
    config = _t5_config("sdpa")
    config.dropout_rate = 0.1
    encoder = transformers.T5EncoderModel(config).train()
    hf.use_fused_attention(encoder)
    ids = torch.randint(1, 97, (2, 40))
    torch._dynamo.reset()
    step = torch.compile(lambda ids: encoder(input_ids=ids).last_hidden_state.square().sum(),
                         fullgraph=True)
    step(ids).backward()
    grad = encoder.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ DeBERTa
def _deberta_config(**kw):
    base = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=512, relative_attention=True,
                position_buckets=16, max_relative_positions=40, pos_att_type=["p2c", "c2p"],
                share_att_key=True, norm_rel_ebd="layer_norm", hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, type_vocab_size=0)
    base.update(kw)
    return transformers.DebertaV2Config(**base)


def _deberta_pair(config):
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(config).eval().double()
    fused = transformers.DebertaV2Model(config).eval().double()
    fused.load_state_dict(model.state_dict())
    return model, fused


@pytest.mark.parametrize("variant", ["v3", "separate_proj_c2p", "separate_proj_p2c", "exact_buckets",
                                     "no_relative", "odd_buckets"])
def test_deberta_v2_model_matches_transformers(variant):
    """A two-layer DeBERTa-v2 in float64, 90 positions with padding: past the log buckets'
    saturation (position_buckets 16, max_relative_positions 40: rows constant from distance 40
    on), so every clamped row is read. The fused model's hidden states equal transformers' on
    the kept positions, and so do every parameter's gradients (the relative embeddings' too).
    Variants: DeBERTa-v3's layout (shared projections, both terms); separate pos_key_proj /
    pos_query_proj with one term each; exact (unbucketed) distances; no relative attention;
    7 buckets up to 20 (the odd bucket count's rows still move up to distance 48, far past
    max_relative_positions)."""
    kw = {"v3": {},
          "separate_proj_c2p": dict(share_att_key=False, pos_att_type=["c2p"]),
          "separate_proj_p2c": dict(share_att_key=False, pos_att_type=["p2c"]),
          "exact_buckets": dict(position_buckets=-1, max_relative_positions=24),
          "no_relative": dict(relative_attention=False, pos_att_type=["p2c", "c2p"]),
          "odd_buckets": dict(position_buckets=7, max_relative_positions=20)}[variant]
    model, fused = _deberta_pair(_deberta_config(**kw))
    names = hf.use_fused_attention(fused)
    assert len(names) == 2 and all(n.endswith("attention.self") for n in names)
    ids = torch.randint(1, 97, (2, 90))
    keep = torch.ones(2, 90, dtype=torch.long)
    keep[1, 70:] = 0
    exp = model(input_ids=ids, attention_mask=keep).last_hidden_state
    got = fused(input_ids=ids, attention_mask=keep).last_hidden_state
    k = keep.bool()
    torch.testing.assert_close(got[k], exp[k], atol=1e-10, rtol=1e-10)
    exp[k].square().sum().backward()
    got[k].square().sum().backward()
    _assert_same_grads(fused, model, atol=1e-9, rtol=1e-8)


def test_deberta_v2_undefined_buckets_left_alone():
    """position_buckets // 2 == max_relative_positions - 1: DeBERTa's log buckets divide by
    log 1 there (transformers gets garbage rows too), so use_fused_attention leaves the
    attention to transformers: the model's outputs stay bitwise its own."""
    model, fused = _deberta_pair(_deberta_config(position_buckets=64, max_relative_positions=33))
    assert hf.use_fused_attention(fused) == []
    ids = torch.randint(1, 97, (1, 20))
    torch.testing.assert_close(fused(input_ids=ids).last_hidden_state,
                               model(input_ids=ids).last_hidden_state, atol=0, rtol=0)


def test_deberta_v2_float32_and_attention_outputs():
    """float32 within float rounding of transformers; output_attentions falls back to
    transformers' forward and returns its weights."""
    config = _deberta_config()
    torch.manual_seed(0)
    model = transformers.DebertaV2Model(config).eval()
    fused = transformers.DebertaV2Model(config).eval()
    fused.load_state_dict(model.state_dict())
    hf.use_fused_attention(fused)
    ids = torch.randint(1, 97, (3, 130))
    exp = model(input_ids=ids, output_attentions=True)
    got = fused(input_ids=ids)
    torch.testing.assert_close(got.last_hidden_state, exp.last_hidden_state, **TOL[torch.float32])
    got_att = fused(input_ids=ids, output_attentions=True).attentions
    for g, e in zip(got_att, exp.attentions, strict=True):
        torch.testing.assert_close(g, e, **TOL[torch.float32])


def test_deberta_v2_sequence_classification_training_compiles():
    """DeBERTa-v2 for sequence classification, fused, compiled (fullgraph) in training mode with
    attention dropout: no graph break, finite gradients reaching the relative embeddings."""
    config = _deberta_config(attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1,
                             num_labels=3)
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(config).train()
    assert len(hf.use_fused_attention(model)) == 2
    ids = torch.randint(1, 97, (2, 50))
    labels = torch.tensor([0, 2])
    loss = torch.nn.CrossEntropyLoss()  # transformers' own loss has a data-dependent branch
    torch._dynamo.reset()
    step = torch.compile(lambda ids: loss(model(input_ids=ids).logits, labels), fullgraph=True)
    step(ids).backward()
    grad = model.deberta.encoder.rel_embeddings.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("terms", [1, 2, 3])
def test_deberta_scale_is_transformers_scale(dtype, terms):
    """The fused layer's scale is transformers' sqrt(D * factor), taken in float32 and rounded
    to the model's dtype (13.875 rather than 13.856 in bfloat16 for D = 64 and both terms)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import scaled_size_sqrt

    want = scaled_size_sqrt(torch.empty(1, 1, 64, dtype=dtype), terms).to(dtype)
    assert hf._deberta_scales(64, terms)[dtype] == 1.0 / want.item()


def test_deberta_v1_and_sew_d_left_alone():
    """DeBERTa v1 and SEW-D have classes named DisentangledSelfAttention with other maths or
    signatures: use_fused_attention leaves them alone."""
    config = transformers.DebertaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, intermediate_size=32,
                                        relative_attention=True, pos_att_type=["p2c", "c2p"])
    assert hf.use_fused_attention(transformers.DebertaModel(config)) == []
    sew = transformers.SEWDConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2),
                                  conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                  num_conv_pos_embedding_groups=4)
    assert hf.use_fused_attention(transformers.SEWDModel(sew)) == []


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_umt5_model_matches_transformers(impl, monkeypatch):
    """UMT5 (a T5 bias in every self-attention layer): a two-layer encoder-decoder in float64,
    300 source and 140 target positions with padding; hidden states and every gradient (each
    layer's bias embedding included) equal transformers' on the kept positions. generate()
    gives the same tokens, every decoder step fused, and output_attentions transformers'
    weights."""
    config = transformers.UMT5Config(
        vocab_size=97, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
        num_decoder_layers=2, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, dropout_rate=0.0, attn_implementation=impl,
        decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.UMT5ForConditionalGeneration(config).eval().double()
    fused = transformers.UMT5ForConditionalGeneration(config).eval().double()
    fused.load_state_dict(model.state_dict())
    names = hf.use_fused_attention(fused)
    assert len(names) == 4 and all(n.endswith("SelfAttention") for n in names)
    src, src_keep, tgt, tgt_keep = _seq2seq_batch()
    kw = dict(input_ids=src, attention_mask=src_keep, decoder_input_ids=tgt,
              decoder_attention_mask=tgt_keep, use_cache=False, output_hidden_states=True)
    exp, got = model(**kw), fused(**kw)
    enc_keep, dec_keep = src_keep.bool(), tgt_keep.bool()
    torch.testing.assert_close(got.encoder_last_hidden_state[enc_keep],
                               exp.encoder_last_hidden_state[enc_keep], atol=1e-10, rtol=1e-10)
    got_dec, exp_dec = got.decoder_hidden_states[-1], exp.decoder_hidden_states[-1]
    torch.testing.assert_close(got_dec[dec_keep], exp_dec[dec_keep], atol=1e-10, rtol=1e-10)
    exp_dec[dec_keep].square().sum().backward()
    got_dec[dec_keep].square().sum().backward()
    _assert_same_grads(fused, model, atol=1e-9, rtol=1e-8)
    assert sum(name.endswith("relative_attention_bias.weight") and p.grad is not None
               for name, p in model.named_parameters()) == 4
    gen = dict(input_ids=src[:, :60], attention_mask=src_keep[:, :60], max_new_tokens=8,
               do_sample=False)
    calls = _count_fused_calls(monkeypatch)
    assert torch.equal(fused.generate(**gen), model.generate(**gen))
    assert calls == [(60, 60, 0)] * 2 + [(1, n + 1, n) for n in range(8) for _ in range(2)]
    att_kw = dict(input_ids=src[:, :50], decoder_input_ids=tgt[:, :5], output_attentions=True)
    out, want = fused(**att_kw), model(**att_kw)
    for g, e in zip(out.encoder_attentions + out.decoder_attentions,
                    want.encoder_attentions + want.decoder_attentions, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


# -------------------------------------------------------------------------------------- MPNet
def _mpnet_pair(cls=None, **kw):
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=514, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0)
    config = transformers.MPNetConfig(**(base | kw))
    cls = cls or transformers.MPNetModel
    torch.manual_seed(0)
    model = cls(config).eval().double()
    fused = cls(config).eval().double()
    fused.load_state_dict(model.state_dict())
    return model, fused


def _padded_tokens(length):
    ids = torch.randint(1, 97, (2, length))
    keep = torch.ones(2, length, dtype=torch.long)
    keep[1, length - 50:] = 0
    return ids, keep


@pytest.mark.parametrize("whole", [True, False])
def test_mpnet_model_matches_transformers(whole):
    """A two-layer MPNet in float64, 300 positions with padding (past the bias's max distance of
    128, so its last buckets are read): the fused model's hidden states equal transformers' on
    the kept positions, and so do every parameter's gradients (the bias embedding's included).
    whole: use_fused_attention on the model (the encoder makes the [H, 257] table); else on one
    attention layer only, which then reads transformers' [B, H, L, L] bias through its own
    forward."""
    model, fused = _mpnet_pair()
    if whole:
        names = hf.use_fused_attention(fused)
        assert names == ["encoder", "encoder.layer.0.attention.attn",
                         "encoder.layer.1.attention.attn"]
    else:
        assert hf.use_fused_attention(fused.encoder.layer[0]) == ["attention.attn"]
    ids, keep = _padded_tokens(300)
    exp = model(input_ids=ids, attention_mask=keep).last_hidden_state
    got = fused(input_ids=ids, attention_mask=keep).last_hidden_state
    k = keep.bool()
    torch.testing.assert_close(got[k], exp[k], atol=1e-10, rtol=1e-10)
    upstream = torch.randn_like(exp[k])  # not square().sum(): LayerNorm makes that constant
    (exp[k] * upstream).sum().backward()
    (got[k] * upstream).sum().backward()
    _assert_same_grads(fused, model, atol=1e-9, rtol=1e-8)
    assert model.encoder.relative_attention_bias.weight.grad.abs().sum() > 0


def test_mpnet_heads_attention_outputs_and_float32():
    """MPNet's task heads are fused through their MPNetModel; output_attentions falls back to
    transformers' forward (on the bias expanded from the table) and returns its weights; float32
    within float rounding of transformers."""
    model, fused = _mpnet_pair(transformers.MPNetForMaskedLM)
    assert len(hf.use_fused_attention(fused)) == 3
    ids, keep = _padded_tokens(140)
    kw = dict(input_ids=ids, attention_mask=keep, output_attentions=True)
    for g, e in zip(fused(**kw).attentions, model(**kw).attentions, strict=True):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=1e-12)
    model, fused = model.float(), fused.float()
    k = keep.bool()
    torch.testing.assert_close(fused(input_ids=ids, attention_mask=keep).logits[k],
                               model(input_ids=ids, attention_mask=keep).logits[k],
                               **TOL[torch.float32])


def test_mpnet_training_compiles():
    """MPNet for sequence classification, fused, compiled (fullgraph) in training mode with
    attention dropout: no graph break, finite gradients reaching the bias embedding."""
    model, _ = _mpnet_pair(transformers.MPNetForSequenceClassification, num_labels=3,
                           attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.1)
    model = model.float().train()
    assert len(hf.use_fused_attention(model)) == 3
    ids = torch.randint(1, 97, (2, 50))
    labels = torch.tensor([0, 2])
    loss = torch.nn.CrossEntropyLoss()
    torch._dynamo.reset()
    step = torch.compile(lambda ids: loss(model(input_ids=ids).logits, labels), fullgraph=True)
    step(ids).backward()
    grad = model.mpnet.encoder.relative_attention_bias.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


# ----------------------------------------------------------------------------------- Parakeet
def _parakeet_config(impl="eager", **kw):
    return transformers.ParakeetEncoderConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        conv_kernel_size=3, subsampling_conv_channels=8, num_mel_bins=16, layerdrop=0.0,
        attn_implementation=impl, **kw)


def _parakeet_attention(dtype, impl="eager"):
    """A ParakeetEncoderAttention with random u and v biases (zeros in its constructor) and
    its position embedding module."""
    torch.manual_seed(0)
    config = _parakeet_config(impl)
    module = parakeet.ParakeetEncoderAttention(config, 0)
    with torch.no_grad():
        module.bias_u.normal_(0, 0.3)
        module.bias_v.normal_(0, 0.3)
    return module.to(dtype).eval(), parakeet.ParakeetEncoderRelPositionalEncoding(config)


# transformers' eager attention takes its softmax in float32 (float64 there is float32-exact
# only), its SDPA form does not: float64 against SDPA
@pytest.mark.parametrize("dtype,impl", [(torch.float32, "eager"), (torch.float32, "sdpa"),
                                        (torch.float64, "sdpa")])
@pytest.mark.parametrize("length", [1, 37])
def test_parakeet_attention_matches_transformers(length, dtype, impl):
    """ParakeetEncoderAttention (FastConformer, Transformer-XL positions): output and the
    gradients of the input and every parameter (relative_k_proj, bias_u and bias_v included)
    equal transformers' forward, with a key padding mask in its bool [B, 1, L, L] form."""
    module, positions = _parakeet_attention(dtype, impl)
    x = torch.randn(2, length, 32, dtype=dtype)
    pos = positions(x)
    assert pos.shape == (2, 2 * length - 1, 32)
    keep = torch.arange(length)[None, :] < torch.tensor([[length], [max(1, length - 8)]])
    mask = keep[:, None, None, :].expand(2, 1, length, length)
    assert {"relative_k_proj.weight", "bias_u", "bias_v"} <= dict(module.named_parameters()).keys()
    _check_swap(module, x, position_embeddings=pos, attention_mask=mask)
    with pytest.raises(ValueError, match=r"position_embeddings must be \[B, 2L - 1, E\]"):
        module(x, position_embeddings=pos[:, 1:], attention_mask=mask)


def _padded_features():
    """Two sequences of 400 log-mel frames (16 bins, float64), the second padded after 250:
    ``(features, keep)``."""
    features = torch.randn(2, 400, 16, dtype=torch.float64)
    keep = torch.ones(2, 400, dtype=torch.long)
    keep[1, 250:] = 0
    return features, keep


def _random_uv_pair(build, fused_names):
    """A model from ``build()`` (float64, eval) with random Transformer-XL u and v biases in its
    Parakeet attention (zeros in their constructor), and a second one, fused, with the same
    weights; ``use_fused_attention`` must name ``fused_names``."""
    torch.manual_seed(0)
    model = build().eval().double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, parakeet.ParakeetEncoderAttention):
                m.bias_u.normal_(0, 0.3)
                m.bias_v.normal_(0, 0.3)
    fused = build().eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == fused_names
    return model, fused


def _check_padded_encoder(model, fused, frames, **call_kw):
    """Two sequences of 400 log-mel frames, the second padded after 250, through transformers'
    encoder and the fused one (float64): hidden states at the kept frames (``frames`` of them
    after subsampling) and every parameter's gradient of a loss on them must match."""
    features, keep = _padded_features()
    exp = model(features, attention_mask=keep, **call_kw)
    got = fused(features, attention_mask=keep, **call_kw)
    kept = exp.attention_mask.bool()
    assert kept.shape == (2, frames) and not kept[1].all()
    torch.testing.assert_close(got.last_hidden_state[kept], exp.last_hidden_state[kept],
                               atol=1e-10, rtol=1e-10)
    exp.last_hidden_state[kept].square().sum().backward()
    got.last_hidden_state[kept].square().sum().backward()
    _assert_same_grads(fused, model)


def test_parakeet_encoder_matches_transformers():
    """A two-layer Parakeet encoder, float64 (SDPA), on a padded batch of log-mel features: the fused
    encoder's hidden states at the kept frames and a step's gradients of every parameter equal
    transformers'. (A padded frame's query sees no key; ours gives zeros there, transformers
    averages all values; the convolution module zeroes those frames, so kept frames never
    read them.)"""
    model, fused = _random_uv_pair(lambda: parakeet.ParakeetEncoder(_parakeet_config("sdpa")),
                                   ["layers.0.self_attn", "layers.1.self_attn"])
    _check_padded_encoder(model, fused, 50)


def test_parakeet_fallbacks():
    """output_attentions and position dropout in training (per-sequence positions) run
    transformers' forward: the same outputs, attention weights returned."""
    torch.manual_seed(0)
    config = _parakeet_config(dropout_positions=0.1)
    model = parakeet.ParakeetEncoder(config).double()
    fused = parakeet.ParakeetEncoder(config).double()
    fused.load_state_dict(model.state_dict())
    hf.use_fused_attention(fused)
    features = torch.randn(2, 120, 16, dtype=torch.float64)
    out = fused.eval()(features, output_attentions=True)
    want = model.eval()(features, output_attentions=True)
    assert len(out.attentions) == 2
    for g, e in zip(out.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    for m in (model, fused):
        m.train()
        torch.manual_seed(1)
        m.out = m(features).last_hidden_state
    torch.testing.assert_close(fused.out, model.out, atol=0, rtol=0)


def test_parakeet_ctc_training_compiles():
    """ParakeetForCTC, fused, compiled (fullgraph) in training mode with attention dropout and a
    padded batch: no graph break, a finite CTC loss (taken outside: transformers' own CTC loss
    enters a cuDNN flags context, a graph break of its own), gradients reaching bias_u and
    bias_v."""
    torch.manual_seed(0)
    config = transformers.ParakeetCTCConfig(encoder_config=_parakeet_config().to_dict(),
                                            vocab_size=12, pad_token_id=11)
    model = transformers.ParakeetForCTC(config).float().train()
    assert len(hf.use_fused_attention(model)) == 2
    features = torch.randn(2, 160, 16)
    keep = torch.ones(2, 160, dtype=torch.long)
    keep[1, 100:] = 0
    torch._dynamo.reset()
    logits = torch.compile(lambda f, m: model(input_features=f, attention_mask=m).logits,
                           fullgraph=True)(features, keep)
    frames = model.encoder._get_output_attention_mask(keep, target_length=logits.shape[1]).sum(-1)
    loss = torch.nn.functional.ctc_loss(logits.log_softmax(-1).transpose(0, 1),
                                        torch.randint(0, 11, (2, 4)), frames,
                                        torch.tensor([4, 4]), blank=11)
    loss.backward()
    assert torch.isfinite(loss)
    for m in model.modules():
        if isinstance(m, parakeet.ParakeetEncoderAttention):
            assert m.bias_u.grad is not None and m.bias_u.grad.abs().sum() > 0
            assert torch.isfinite(m.bias_v.grad).all() and m.bias_v.grad.abs().sum() > 0


# ---------------------------------------------------------------------- NemotronAsrStreaming
# chunks of 3 frames (lookahead 2), left context 10 frames: 3 earlier chunks, a cache of 10
NEMOTRON_LOOKAHEAD = 2


def _nemotron_pair(impl="sdpa", ref_impl="sdpa", **kw):
    """transformers' NemotronAsrStreamingEncoder (two layers, float64, random u and v biases,
    attention implementation ``ref_impl``) and a fused copy with the same weights (``impl``)."""
    torch.manual_seed(0)
    config = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                  conv_kernel_size=3, subsampling_conv_channels=8, num_mel_bins=16, layerdrop=0.0,
                  sliding_window=11, default_num_lookahead_tokens=NEMOTRON_LOOKAHEAD, **kw)
    model = nemotron.NemotronAsrStreamingEncoder(transformers.NemotronAsrStreamingEncoderConfig(
        attn_implementation=ref_impl, **config)).eval().double()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nemotron.NemotronAsrStreamingEncoderAttention):
                m.bias_u.normal_(0, 0.3)
                m.bias_v.normal_(0, 0.3)
    fused = nemotron.NemotronAsrStreamingEncoder(transformers.NemotronAsrStreamingEncoderConfig(
        attn_implementation=impl, **config)).eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == ["", "layers.0.self_attn", "layers.1.self_attn"]
    return model, fused


# transformers' eager form of this model inverts a float mask (its ``attention_mask.logical_not()``
# is meant for bool masks; with eager attention it gets 0 / finfo.min ones): its SDPA form is the
# reference; the fused eager-configured model reads the float mask right
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_nemotron_streaming_encoder_matches_transformers(impl, monkeypatch):
    """A two-layer NemotronAsrStreaming encoder, float64, offline (no cache) on a padded batch,
    with its chunked limited-context mask: hidden states at the kept frames and every
    parameter's gradient equal transformers' (SDPA). The fused layers take tables of the
    distances the mask lets through (chunks of 3, each seeing 3 chunks back: K = 11 of the
    50 distances of 51 frames); a lookahead of 60 frames lets every distance through. (Not
    with the eager configuration: there transformers' encoder reads its float mask's fully
    visible rows as fully masked, ``all(mask == 0.0)``, and its convolution zeroes those frames,
    fused or not.)"""
    model, fused = _nemotron_pair(impl)
    calls = _count_rel_attention(monkeypatch)

    def tables():  # (table rows, max_distance) of each call
        return [(a[3].shape[-2], a[5]) for a, _ in calls]

    _check_padded_encoder(model, fused, 51, num_lookahead_tokens=NEMOTRON_LOOKAHEAD)
    assert tables() == [(23, 11)] * 2
    if impl == "sdpa":
        calls.clear()
        _check_padded_encoder(model, fused, 51, num_lookahead_tokens=60)
        assert tables() == [(101, 50)] * 2


def _stream(model, features, chunks):
    """Cache-aware streaming as NemotronAsrStreamingForRNNT.generate feeds it: a first chunk of
    ``1 + 8 * lookahead`` mel frames, then ``8 * (lookahead + 1)``; the encoder's outputs
    concatenated, and the length of the K/V cache after each chunk."""
    cache = padding = None
    outs, cached = [], []
    start = 0
    for i in range(chunks):
        n = 1 + 8 * NEMOTRON_LOOKAHEAD if i == 0 else 8 * (NEMOTRON_LOOKAHEAD + 1)
        out = model(features[:, start:start + n], past_key_values=cache, padding_cache=padding,
                    use_cache=True, num_lookahead_tokens=NEMOTRON_LOOKAHEAD)
        cache, padding = out.past_key_values, out.padding_cache
        outs.append(out.last_hidden_state)
        cached.append(cache.layers[0].keys.shape[-2])
        start += n
    return torch.cat(outs, 1), cached


def test_nemotron_streaming_chunks_match_transformers():
    """Chunk-by-chunk streaming with the sliding-window K/V cache (queries after cached frames:
    q_offset = cache length; the cache is trimmed to the window once full): every chunk's
    output and every parameter's gradient equal transformers', and the streamed frames equal
    the offline encoder's."""
    model, fused = _nemotron_pair()
    features = torch.randn(1, 17 + 24 * 7, 16, dtype=torch.float64)
    exp, exp_cached = _stream(model, features, 8)
    got, cached = _stream(fused, features, 8)
    assert cached == exp_cached and cached[0] == 3 and max(cached) == 10  # grown, then trimmed
    assert got.shape == (1, 24, 32)
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
    offline = fused(features, num_lookahead_tokens=NEMOTRON_LOOKAHEAD).last_hidden_state
    torch.testing.assert_close(got, offline[:, :24], atol=1e-10, rtol=1e-10)
    exp.square().sum().backward()
    got.square().sum().backward()
    _assert_same_grads(fused, model)
    layer, cache = fused.layers[0].self_attn, transformers.DynamicCache()
    cache.update(*torch.randn(2, 1, 4, 16, 8, dtype=torch.float64), 0)
    with pytest.raises(ValueError, match=r"must be \[B, 2L - 1, E\] = \[1, 41, E\] for L = 21 "
                                         r"keys \(16 of them cached\), got \(1, 9, 32\)"):
        layer(torch.randn(1, 5, 32, dtype=torch.float64), past_key_values=cache,
              position_embeddings=torch.randn(1, 9, 32, dtype=torch.float64))


def test_nemotron_streaming_fallback_and_training_compiles():
    """output_attentions runs transformers' forward (eager: the same weights, bitwise); a fused
    encoder compiles (fullgraph) in training mode with attention dropout and padding, gradients
    reaching bias_u and bias_v."""
    model, fused = _nemotron_pair("eager", "eager", attention_dropout=0.1)
    features = torch.randn(2, 120, 16, dtype=torch.float64)
    out = fused(features, output_attentions=True, num_lookahead_tokens=NEMOTRON_LOOKAHEAD)
    want = model(features, output_attentions=True, num_lookahead_tokens=NEMOTRON_LOOKAHEAD)
    assert len(out.attentions) == 2
    for g, e in zip(out.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    fused = fused.float().train()
    keep = torch.ones(2, 120, dtype=torch.long)
    keep[1, 70:] = 0
    torch._dynamo.reset()
    hidden = torch.compile(
        lambda f, m: fused(f, attention_mask=m,
                           num_lookahead_tokens=NEMOTRON_LOOKAHEAD).last_hidden_state,
        fullgraph=True)(features.float(), keep)
    hidden.square().mean().backward()
    for m in fused.modules():
        if isinstance(m, nemotron.NemotronAsrStreamingEncoderAttention):
            assert m.bias_u.grad is not None and m.bias_u.grad.abs().sum() > 0
            assert torch.isfinite(m.bias_v.grad).all() and m.bias_v.grad.abs().sum() > 0


# (transformers warns that generate's max_length is its default: RNNT decoding ends with the frames)
# Nemotron 3.5 ASR (nemotron-3.5-asr-streaming) is the same encoder with a language prompt mixed
# into its output: its own model class and config, the same attention modules
NEMOTRON_RNNT = {
    "NemotronAsrStreaming": (transformers.NemotronAsrStreamingConfig, {}),
    "Nemotron3_5Asr": (transformers.Nemotron3_5AsrConfig,
                       dict(num_prompts=8, prompt_intermediate_size=16, default_prompt_id=3)),
}


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")
@pytest.mark.parametrize("family", list(NEMOTRON_RNNT))
def test_nemotron_streaming_rnnt_generate(family):
    """NemotronAsrStreamingForRNNT.generate and Nemotron3_5AsrForRNNT.generate, the entry points:
    streaming from a generator of mel chunks (the encoder's K/V cache between chunks) and
    offline; the fused model's encoder outputs, chunk by chunk, and token sequences (float64,
    random weights) equal transformers' (SDPA)."""
    config_class, extra = NEMOTRON_RNNT[family]
    model_class = getattr(transformers, f"{family}ForRNNT")
    torch.manual_seed(0)
    encoder = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                   intermediate_size=64, conv_kernel_size=3, subsampling_conv_channels=8,
                   num_mel_bins=16, layerdrop=0.0, sliding_window=11,
                   default_num_lookahead_tokens=NEMOTRON_LOOKAHEAD, attn_implementation="sdpa")
    config = config_class(
        encoder_config=encoder, vocab_size=12, decoder_hidden_size=16, blank_token_id=11,
        pad_token_id=11, bos_token_id=11, decoder_start_token_id=11, **extra)
    model = model_class(config).eval().double()
    fused = model_class(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == ["encoder", "encoder.layers.0.self_attn",
                                             "encoder.layers.1.self_attn"]
    first, rest = 1 + 8 * NEMOTRON_LOOKAHEAD, 8 * (NEMOTRON_LOOKAHEAD + 1)
    features = torch.randn(1, first + 9 * rest, 16, dtype=torch.float64)

    def chunks():
        yield features[:, :first]
        for i in range(9):
            yield features[:, first + i * rest:first + (i + 1) * rest]

    encoded = {model: [], fused: []}
    for m in (model, fused):
        m.encoder.register_forward_hook(
            lambda mod, args, out, seen=encoded[m]: seen.append(out.last_hidden_state))
    with torch.no_grad():
        for streaming in (True, False):
            exp, got = (m.generate(chunks() if streaming else features,
                                   num_lookahead_tokens=NEMOTRON_LOOKAHEAD)
                        for m in (model, fused))
            assert len(exp.sequences.unique()) > 2  # more than blanks and one token
            torch.testing.assert_close(got.sequences, exp.sequences, atol=0, rtol=0)
    assert len(encoded[model]) == 11  # 10 chunks, then the whole recording
    for g, e in zip(encoded[fused], encoded[model], strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


# ---------------------------------------------------- models built around a fused encoder
# transformers models that build a Parakeet or w2v-BERT 2.0 encoder with AutoModel.from_config:
# use_fused_attention reaches its attention modules inside them; these tests check that the way
# each model calls its encoder (masks, generation, no_grad) leaves the results transformers'.
_ASR_DECODER = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=8)


@pytest.mark.parametrize("family", ["Canary", "CohereAsr"])
def test_asr_models_with_a_parakeet_encoder(family, monkeypatch):
    """CanaryForConditionalGeneration and CohereAsrForConditionalGeneration (a Parakeet encoder,
    a transformer decoder), float64, on a padded batch of log-mel features: the loss (eval mode),
    every parameter's gradient, and greedy generate's tokens and scores equal transformers'
    (SDPA), with the encoder's layers through rel_attention."""
    encoder = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                   intermediate_size=64, conv_kernel_size=3, subsampling_conv_channels=8,
                   num_mel_bins=16, layerdrop=0.0, attn_implementation="sdpa")
    if family == "Canary":
        config = transformers.CanaryConfig(encoder_config=encoder, decoder_config=_ASR_DECODER,
                                           vocab_size=_ASR_DECODER["vocab_size"])
    else:
        config = transformers.CohereAsrConfig(encoder_config=encoder, decoder_start_token_id=7,
                                              **_ASR_DECODER)
    model_class = getattr(transformers, f"{family}ForConditionalGeneration")
    # (in eval mode: training would draw dropout masks)
    model, fused = _random_uv_pair(lambda: model_class(config),
                                   ["model.encoder.layers.0.self_attn",
                                    "model.encoder.layers.1.self_attn"])
    calls = _count_rel_attention(monkeypatch)
    features, keep = _padded_features()
    labels = torch.randint(5, 40, (2, 6))
    losses = [m(input_features=features, attention_mask=keep, labels=labels).loss
              for m in (model, fused)]
    assert len(calls) == 2
    torch.testing.assert_close(losses[1], losses[0], atol=1e-10, rtol=1e-10)
    for loss in losses:
        loss.backward()
    _assert_same_grads(fused, model)
    with torch.no_grad():
        exp, got = (m.generate(input_features=features, attention_mask=keep, max_new_tokens=12,
                               output_scores=True, return_dict_in_generate=True)
                    for m in (model, fused))
    torch.testing.assert_close(got.sequences, exp.sequences, atol=0, rtol=0)
    assert len(got.scores) == len(exp.scores) == 12
    assert not torch.allclose(exp.scores[0][0], exp.scores[0][1])  # the audio decides them
    for g, e in zip(got.scores, exp.scores, strict=True):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10)


def test_nemotron_h_omni_audio_tower(monkeypatch):
    """Nemotron-H Omni's audio tower (a Parakeet encoder in a vision-audio-language model),
    float64: get_audio_features on a padded batch of clips gives transformers' audio embeddings,
    with the tower's layers through rel_attention."""
    from transformers.models.nemotron_h_omni import modeling_nemotron_h_omni as omni

    audio = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                 conv_kernel_size=3, subsampling_conv_channels=8, num_mel_bins=16, layerdrop=0.0,
                 attn_implementation="sdpa", projection_hidden_size=32, projection_bias=False)
    text = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, hybrid_override_pattern="M*",
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1)
    vision = dict(video_temporal_patch_size=2, hidden_size=32, num_hidden_layers=1,
                  num_attention_heads=4, intermediate_size=64)
    model_class = omni.NemotronH_Omni_Reasoning_V3
    config = model_class.config_class(audio_config=audio, text_config=text, vision_config=vision,
                                      projector_hidden_size=32, vision_hidden_size=32)
    model, fused = _random_uv_pair(lambda: model_class(config),
                                   ["audio_tower.layers.0.self_attn",
                                    "audio_tower.layers.1.self_attn"])
    calls = _count_rel_attention(monkeypatch)
    features, keep = _padded_features()
    with torch.no_grad():
        exp, got = (m.get_audio_features(features, keep).pooler_output for m in (model, fused))
    assert len(calls) == 2 and exp.shape == (82, 32)  # 50 + 32 kept frames after subsampling
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family", ["NeuCodec", "Xcodec2"])
def test_codecs_with_a_w2v_bert_encoder(family):
    """NeuCodecModel.encode and Xcodec2Model.encode (a w2v-BERT 2.0 semantic encoder, run under
    no_grad, and an acoustic encoder), float64, with a padded feature mask: the semantic
    encoder's hidden states at the kept frames and the audio codes equal transformers'."""
    semantic = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                    intermediate_size=64, feature_projection_input_dim=16, output_hidden_size=32,
                    conv_depthwise_kernel_size=3, left_max_position_embeddings=64,
                    right_max_position_embeddings=8)
    # the acoustic encoder's width, 1 * 2**5, must be hidden_size; the quantizer reads both;
    # weights ~N(0, 0.5), so that the codes are not all one
    config = getattr(transformers, f"{family}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, semantic_model_config=semantic,
        encoder_hidden_size=1, quantization_dim=64, initializer_range=0.5)
    model_class = getattr(transformers, f"{family}Model")
    torch.manual_seed(0)
    model = model_class(config).eval().double()
    fused = model_class(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == ["semantic_encoder.encoder.layers.0.self_attn",
                                             "semantic_encoder.encoder.layers.1.self_attn"]
    semantic_out = {model: [], fused: []}
    for m in (model, fused):
        m.semantic_encoder.register_forward_hook(
            lambda mod, args, out, seen=semantic_out[m]: seen.append(out.last_hidden_state))
    audio = torch.randn(2, 1, 16000, dtype=torch.float64)
    features = torch.randn(2, 50, 16, dtype=torch.float64)
    keep = torch.ones(2, 50, dtype=torch.long)
    keep[1, 40:] = 0
    exp, got = (m.encode(audio, features, input_features_mask=keep) for m in (model, fused))
    (e,), (g,) = semantic_out[model], semantic_out[fused]
    kept = keep.bool()
    torch.testing.assert_close(g[kept], e[kept], atol=1e-10, rtol=1e-10)
    assert exp.audio_codes.shape == (2, 1, 50) and len(exp.audio_codes.unique()) > 10
    torch.testing.assert_close(got.audio_codes, exp.audio_codes, atol=0, rtol=0)


# ---------------------------------------------------------------------- SpeechT5
# encoder_max_relative_position M = 6: distances clipped to [-5, 6] (r = j - i) within L = 37
def _speecht5_config(**kw):
    config = dict(hidden_size=32, encoder_attention_heads=4, encoder_layers=2, encoder_ffn_dim=64,
                  decoder_attention_heads=4, decoder_layers=2, decoder_ffn_dim=64,
                  encoder_max_relative_position=6, vocab_size=40, encoder_layerdrop=0.0,
                  decoder_layerdrop=0.0, num_mel_bins=16, conv_dim=(16, 16),
                  conv_stride=(2, 2), conv_kernel=(3, 3), num_conv_pos_embeddings=8,
                  num_conv_pos_embedding_groups=4, speech_decoder_prenet_units=32,
                  speech_decoder_postnet_units=32, speech_decoder_postnet_layers=2,
                  speech_decoder_postnet_kernel=3, max_text_positions=64,
                  max_speech_positions=512)
    config.update(kw)
    return transformers.SpeechT5Config(**config)


def _speecht5_encoder_pair(dtype):
    """transformers' SpeechT5Encoder (two layers; its table scaled like the projections) and a
    fused copy with the same weights."""
    torch.manual_seed(0)
    model = speecht5.SpeechT5Encoder(_speecht5_config()).eval().to(dtype)
    with torch.no_grad():
        model.embed_positions.pe_k.weight.mul_(0.3)
    fused = speecht5.SpeechT5Encoder(_speecht5_config()).eval().to(dtype)
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == ["layers.0.attention", "layers.1.attention",
                                             "embed_positions"]
    return model, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 5, 37])
def test_speecht5_encoder_matches_transformers(length, dtype):
    """SpeechT5's encoder (Shaw's key term, distances clipped to [1 - M, M]) on a padded batch:
    hidden states at every frame (a padded frame's query still sees the kept keys) and the
    gradients of the input and every parameter (pe_k included) equal transformers'."""
    model, fused = _speecht5_encoder_pair(dtype)
    x = torch.randn(2, length, 32, dtype=dtype)
    keep = torch.ones(2, length, dtype=torch.long)
    keep[1, max(1, length - 9):] = 0
    upstream = torch.randn_like(x)
    outs = []
    for m in (model, fused):
        xm = x.clone().requires_grad_()
        out = m(xm, attention_mask=keep).last_hidden_state
        (out * upstream).sum().backward()
        outs.append((out, xm.grad))
    (exp, exp_dx), (got, got_dx) = outs
    torch.testing.assert_close(got, exp, **TOL[dtype])
    torch.testing.assert_close(got_dx, exp_dx, **TOL[dtype])
    _assert_same_grads(fused, model, **TOL[dtype])
    if length > 1:  # (one frame: softmax over one key, whose logit has no gradient)
        assert fused.embed_positions.pe_k.weight.grad.abs().sum() > 0


def test_speecht5_fallbacks():
    """output_attentions, and a fused layer given transformers' ``[L, L, D]`` bias (its encoder
    left unfused), run transformers' forward: the same outputs and attention weights."""
    model, fused = _speecht5_encoder_pair(torch.float64)
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    out = fused(x, output_attentions=True)
    want = model(x, output_attentions=True)
    assert len(out.attentions) == 2
    for g, e in zip(out.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    torch.testing.assert_close(out.last_hidden_state, want.last_hidden_state, atol=0, rtol=0)
    del fused.embed_positions.forward  # transformers' [L, L, D] gather again
    torch.testing.assert_close(fused(x).last_hidden_state, want.last_hidden_state,
                               atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore:Using the model-agnostic default `max_length`")
def test_speecht5_speech_to_text_matches_transformers():
    """SpeechT5ForSpeechToText (ASR), float64, on a padded batch of raw audio: the loss and
    every parameter's gradient of a training step equal transformers', and so do greedy
    generate's tokens (the decoder, with its KV cache, is left alone)."""
    torch.manual_seed(0)
    model = transformers.SpeechT5ForSpeechToText(_speecht5_config()).double()
    with torch.no_grad():
        model.speecht5.encoder.wrapped_encoder.embed_positions.pe_k.weight.mul_(0.3)
    fused = transformers.SpeechT5ForSpeechToText(_speecht5_config()).double()
    fused.load_state_dict(model.state_dict())
    names = hf.use_fused_attention(fused)
    assert names == [f"speecht5.encoder.wrapped_encoder.layers.{i}.attention" for i in (0, 1)] \
        + ["speecht5.encoder.wrapped_encoder.embed_positions"]
    audio = torch.randn(2, 200, dtype=torch.float64)
    keep = torch.ones(2, 200, dtype=torch.long)
    keep[1, 120:] = 0
    labels = torch.randint(1, 40, (2, 6))
    for m in (model, fused):
        m.eval()  # no dropout: the two must be comparable
        m.loss = m(input_values=audio, attention_mask=keep, labels=labels).loss
        m.loss.backward()
    torch.testing.assert_close(fused.loss, model.loss, atol=1e-10, rtol=1e-10)
    _assert_same_grads(fused, model)
    with torch.no_grad():
        exp, got = (m.generate(input_values=audio, attention_mask=keep, max_new_tokens=6)
                    for m in (model, fused))
    assert len(exp.unique()) > 2
    torch.testing.assert_close(got, exp, atol=0, rtol=0)


def test_speecht5_text_to_speech_generate_matches_transformers():
    """SpeechT5ForTextToSpeech.generate_speech (speecht5_tts's entry point), float64, on a
    padded batch of token ids: the fused encoder's outputs and the generated spectrograms (a
    fixed number of frames: the stop threshold is out of reach) equal transformers'."""
    torch.manual_seed(0)
    config = _speecht5_config(speaker_embedding_dim=8, reduction_factor=2)
    model = transformers.SpeechT5ForTextToSpeech(config).eval().double()
    with torch.no_grad():
        model.speecht5.encoder.wrapped_encoder.embed_positions.pe_k.weight.mul_(0.3)
    fused = transformers.SpeechT5ForTextToSpeech(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert len(hf.use_fused_attention(fused)) == 3
    ids = torch.randint(4, 40, (2, 17))
    keep = torch.ones(2, 17, dtype=torch.long)
    keep[1, 11:] = 0
    speakers = torch.randn(2, 8, dtype=torch.float64)
    encoded = {model: [], fused: []}
    for m in (model, fused):
        m.speecht5.encoder.register_forward_hook(
            lambda mod, args, out, seen=encoded[m]: seen.append(out.last_hidden_state))
    with torch.no_grad():
        exp, got = [], []
        for m, out in ((model, exp), (fused, got)):
            torch.manual_seed(1)  # the decoder prenet's dropout is on in eval mode too
            out.append(m.generate_speech(ids, speakers, attention_mask=keep, threshold=2.0,
                                         maxlenratio=1.0))
        (exp,), (got,) = exp, got
    assert exp.shape == (2, 16, 16)  # maxlenratio * 17 tokens / reduction 2 steps of 2 frames
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
    (g,), (e,) = encoded[fused], encoded[model]
    torch.testing.assert_close(g[keep.bool()], e[keep.bool()], atol=1e-10, rtol=1e-10)


# (SpeechT5's encoder asks whether FSDP manages it, an lru_cache'd call dynamo traces through)
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_speecht5_encoder_training_compiles():
    """A fused SpeechT5 encoder compiles (fullgraph) in training mode with attention dropout
    (only; the output differs from eval mode's) and a padded batch; the gradient reaches the
    position table pe_k."""
    torch.manual_seed(0)
    encoder = speecht5.SpeechT5Encoder(_speecht5_config(
        attention_dropout=0.1, hidden_dropout=0.0, activation_dropout=0.0)).train()
    assert len(hf.use_fused_attention(encoder)) == 3
    x = torch.randn(2, 30, 32)
    keep = torch.ones(2, 30, dtype=torch.long)
    keep[1, 18:] = 0
    torch._dynamo.reset()
    hidden = torch.compile(lambda x, m: encoder(x, attention_mask=m).last_hidden_state,
                           fullgraph=True)(x, keep)
    hidden.square().mean().backward()
    with torch.no_grad():
        eval_out = encoder.eval()(x, attention_mask=keep).last_hidden_state
        assert (hidden - eval_out).abs().max() > 1e-3  # the dropped weights, not float noise
    grad = encoder.embed_positions.pe_k.weight.grad
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0


# ---------------------------------------------------------------------- VITS
def _vits_config(**kw):
    """A tiny VITS (MMS-TTS) with a window of 2: sequences of 9+ tokens have distances past it."""
    config = dict(vocab_size=20, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  window_size=2, ffn_dim=32, flow_size=8, spectrogram_bins=9,
                  upsample_initial_channel=16, upsample_rates=[4, 2], upsample_kernel_sizes=[8, 4],
                  resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3]],
                  prior_encoder_num_flows=2, prior_encoder_num_wavenet_layers=2,
                  duration_predictor_num_flows=2, duration_predictor_filter_channels=16,
                  depth_separable_num_layers=2, layerdrop=0.0)
    config.update(kw)
    return transformers.VitsConfig(**config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 3, 23])
def test_vits_text_encoder_matches_transformers(length, dtype):
    """VITS's text encoder (Shaw's key and value terms within the window, zero beyond) on a
    padded batch: hidden states at every token and every parameter's gradient (emb_rel_k and
    emb_rel_v included) equal transformers'."""
    torch.manual_seed(0)
    model = vits.VitsTextEncoder(_vits_config()).eval().to(dtype)
    fused = vits.VitsTextEncoder(_vits_config()).eval().to(dtype)
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused) == ["encoder.layers.0.attention",
                                             "encoder.layers.1.attention"]
    ids = torch.randint(1, 20, (2, length))
    keep = torch.ones(2, length, dtype=torch.long)
    keep[1, max(1, length - 7):] = 0
    upstream = torch.randn(2, length, 16, dtype=dtype)
    for m in (model, fused):
        m.out = m(ids, keep[..., None].to(dtype), attention_mask=keep).last_hidden_state
        (m.out * upstream).sum().backward()
    torch.testing.assert_close(fused.out, model.out, **TOL[dtype])
    _assert_same_grads(fused, model, **TOL[dtype])
    rel = fused.encoder.layers[0].attention
    assert rel.emb_rel_k.grad.abs().sum() > 0 and rel.emb_rel_v.grad.abs().sum() > 0


def test_vits_model_waveform_and_fallbacks():
    """VitsModel (text to waveform; its samplers seeded alike), float64, on a padded batch: the
    same waveform as transformers'. output_attentions runs transformers' forward (the same
    weights); a module without relative embeddings (window_size=0) is left alone."""
    torch.manual_seed(0)
    model = transformers.VitsModel(_vits_config()).eval().double()
    fused = transformers.VitsModel(_vits_config()).eval().double()
    fused.load_state_dict(model.state_dict())
    assert len(hf.use_fused_attention(fused)) == 2
    ids = torch.randint(1, 20, (2, 14))
    keep = torch.ones(2, 14, dtype=torch.long)
    keep[1, 9:] = 0
    with torch.no_grad():
        exp, got = [], []
        for m, out in ((model, exp), (fused, got)):
            torch.manual_seed(1)
            out.append(m(ids, attention_mask=keep).waveform)
            out.append(m.text_encoder(ids, keep[..., None].double(), attention_mask=keep,
                                      output_attentions=True).attentions)
    assert exp[0].shape[0] == 2 and exp[0].shape[1] > 100
    torch.testing.assert_close(got[0], exp[0], atol=1e-10, rtol=1e-10)
    assert len(got[1]) == 2
    for g, e in zip(got[1], exp[1], strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert hf.use_fused_attention(vits.VitsAttention(_vits_config(window_size=0))) == []


def test_vits_attention_training_compiles():
    """A fused VitsAttention compiles (fullgraph) in training mode with attention dropout (the
    output differs from eval mode's) and a padding mask; the gradients reach emb_rel_k and
    emb_rel_v."""
    torch.manual_seed(0)
    config = _vits_config(attention_dropout=0.1)
    module = vits.VitsAttention(config).train()
    assert hf.use_fused_attention(module) == [""]
    x = torch.randn(2, 12, 16)
    mask = torch.zeros(2, 1, 12, 12)
    mask[1, ..., 8:] = torch.finfo(torch.float32).min
    torch._dynamo.reset()
    out, _ = torch.compile(module, fullgraph=True)(x, attention_mask=mask)
    out.square().mean().backward()
    with torch.no_grad():
        assert (out - module.eval()(x, attention_mask=mask)[0]).abs().max() > 0.05
    for p in (module.emb_rel_k, module.emb_rel_v):
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["speecht5", "vits"])
def test_speecht5_vits_half_precision_no_less_accurate_than_transformers(kind, half):
    """bfloat16 and float16 SpeechT5 and VITS attention layers (weights and tables of unit-ish
    scale, so that the attention, not the input's rounding, sets the error) with a padding
    mask: against float64, the fused output's error is within 1.5x transformers' own error in
    that dtype."""
    torch.manual_seed(0)
    if kind == "speecht5":
        encoder = speecht5.SpeechT5Encoder(_speecht5_config()).eval().double()
        module, positions = encoder.layers[0].attention, encoder.embed_positions
    else:
        encoder = vits.VitsEncoder(_vits_config()).eval().double()
        module = positions = encoder.layers[0].attention
    with torch.no_grad():
        for p in list(module.parameters()) + list(positions.parameters()):
            p.normal_(0, 0.3)
    x = torch.randn(2, 37, module.embed_dim, dtype=torch.float64)
    mask = _padding_mask([37, 29], 37, torch.float64)

    def run(dtype):
        kw = {"position_bias": positions(x.to(dtype))} if kind == "speecht5" else {}
        return module(x.to(dtype), attention_mask=mask.to(dtype), **kw)[0].double()

    with torch.no_grad():
        exact = run(torch.float64)
        encoder.to(half)
        theirs = run(half)
        assert len(hf.use_fused_attention(encoder)) == (3 if kind == "speecht5" else 2)
        ours = run(half)
    err_theirs = (theirs - exact).abs().max().item()
    err_ours = (ours - exact).abs().max().item()
    assert 0 < err_ours <= 1.5 * err_theirs + 1e-6, (err_ours, err_theirs)


@pytest.mark.parametrize("kind,reach", [("speecht5", 1), ("speecht5", 2), ("speecht5", 40),
                                        ("vits", 1), ("vits", 4), ("vits", 30)])
def test_speecht5_vits_table_edges(kind, reach):
    """The tables' edges: SpeechT5 with M = 1 (distances clipped to [0, 1]: every earlier key
    reads the distance-0 row) and M past the sequence; VITS with a window of 1 and one past the
    sequence (23 tokens): float64 outputs equal transformers'."""
    torch.manual_seed(0)
    if kind == "speecht5":
        config = _speecht5_config(encoder_max_relative_position=reach)
        make, x = speecht5.SpeechT5Encoder, (torch.randn(2, 23, 32, dtype=torch.float64),)
    else:
        config = _vits_config(window_size=reach)
        make = vits.VitsTextEncoder
        x = (torch.randint(1, 20, (2, 23)), torch.ones(2, 23, 1, dtype=torch.float64))
    model = make(config).eval().double()
    fused = make(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused)
    with torch.no_grad():
        torch.testing.assert_close(fused(*x).last_hidden_state, model(*x).last_hidden_state,
                                   atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------- WavLM
# 16 buckets up to distance 40: sequences of 98 frames reach past it
FUSE_EVERY_LENGTH = {"inference": 0, "training": 0}  # the tests' 98 frames are below the default


def _wavlm_config(**kw):
    """A two-layer WavLM of width 32 (4 heads), 16 buckets up to distance 40."""
    return transformers.WavLMConfig(
        hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_buckets=16, max_bucket_distance=40, layerdrop=0.0,
        **kw)


def _count_rel_attention(monkeypatch):
    """A list that gains an entry at every call of rel_attention from hf: the call's
    ``(args, kwargs)``."""
    calls = []
    rel_attention = hf.ops.rel_attention
    monkeypatch.setattr(hf.ops, "rel_attention",
                        lambda *a, **kw: calls.append((a, kw)) or rel_attention(*a, **kw))
    return calls


def _wavlm_pair(stable, min_length=FUSE_EVERY_LENGTH, **kw):
    """transformers' WavLMModel (two layers, float64, random gate constants) and a fused copy
    with the same weights, fused from ``min_length`` frames on. ``stable``: the pre-norm encoder
    (wavlm-large's)."""
    config = _wavlm_config(do_stable_layer_norm=stable,
                           feat_extract_norm="layer" if stable else "group", **kw)
    torch.manual_seed(0)
    model = transformers.WavLMModel(config).eval().double()
    with torch.no_grad():  # ones in its constructor; vary them per head
        for m in model.modules():
            if isinstance(m, wavlm.WavLMAttention):
                m.gru_rel_pos_const.normal_(1, 0.5)
    fused = transformers.WavLMModel(config).eval().double()
    fused.load_state_dict(model.state_dict())
    assert hf.use_fused_attention(fused, wavlm_min_length=min_length) == [
        f"encoder.layers.{i}.attention" for i in (0, 1)]
    return model, fused


# (transformers' WavLM passes F.multi_head_attention_forward a bool padding mask and a float bias)
@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("stable", [False, True])
def test_wavlm_matches_transformers(stable):
    """WavLMModel (T5's bucketed bias gated per query and head), float64, on a padded batch of
    raw audio: hidden states at every frame and every parameter's gradient of a loss on the kept
    frames (rel_attn_embed, gru_rel_pos_linear and gru_rel_pos_const included) equal
    transformers'."""
    model, fused = _wavlm_pair(stable)
    audio = torch.randn(2, 2000, dtype=torch.float64)
    keep = torch.ones(2, 2000, dtype=torch.long)
    keep[1, 1400:] = 0
    exp = model(audio, attention_mask=keep).last_hidden_state
    got = fused(audio, attention_mask=keep).last_hidden_state
    assert exp.shape == (2, 98, 32)
    kept = model._get_feature_vector_attention_mask(98, keep).bool()
    assert not kept[1].all()
    torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
    exp[kept].square().sum().backward()
    got[kept].square().sum().backward()
    _assert_same_grads(fused, model)
    first = fused.encoder.layers[0].attention
    for p in (first.rel_attn_embed.weight, first.gru_rel_pos_const, first.gru_rel_pos_linear.weight,
              fused.encoder.layers[1].attention.gru_rel_pos_const):
        assert p.grad.abs().sum() > 0


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_wavlm_attention_outputs_and_training_compiles():
    """output_attentions runs transformers' forward (its weights, bitwise); a fused WavLMModel,
    its feature encoder frozen, compiles (fullgraph) in training mode with attention dropout
    (the output differs from eval mode's) and a padded batch, gradients reaching the bias table
    and the gates."""
    model, fused = _wavlm_pair(False, attention_dropout=0.2, hidden_dropout=0.0,
                               activation_dropout=0.0, feat_proj_dropout=0.0,
                               mask_time_prob=0.0)
    audio = torch.randn(2, 2000, dtype=torch.float64)
    want = model(audio, output_attentions=True)
    out = fused(audio, output_attentions=True)
    assert len(out.attentions) == 2
    for g, e in zip(out.attentions, want.attentions, strict=True):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    fused = fused.float().train()
    fused.freeze_feature_encoder()  # as fine-tuning does (its requires_grad switch is a break)
    keep = torch.ones(2, 2000, dtype=torch.long)
    keep[1, 1400:] = 0
    torch._dynamo.reset()
    hidden = torch.compile(lambda a, m: fused(a, attention_mask=m).last_hidden_state,
                           fullgraph=True)(audio.float(), keep)
    hidden.square().mean().backward()
    first = fused.encoder.layers[0].attention
    for p in (first.rel_attn_embed.weight, first.gru_rel_pos_const):
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    with torch.no_grad():
        dropped = hidden - fused.eval()(audio.float(), attention_mask=keep).last_hidden_state
    assert dropped.abs().max() > 1e-3  # the dropped weights, not float noise


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("grads", [False, True], ids=["inference", "training"])
def test_wavlm_short_inputs_run_transformers_attention(monkeypatch, grads):
    """Below ``wavlm_min_length`` frames (its entry for whether autograd records) a fused WavLM
    runs transformers' attention, bitwise the unfused model's, gradients included; from it on,
    rel_attention. The default is hf.WAVLM_MIN_LENGTH."""
    calls = _count_rel_attention(monkeypatch)
    audio = torch.randn(2, 2000, dtype=torch.float64)
    mode, other = ("training", "inference") if grads else ("inference", "training")
    for length, fused_calls in [(99, 0), (98, 2), (None, 0)]:
        limits = None if length is None else {mode: length, other: 0 if length > 98 else 999}
        model, fused = _wavlm_pair(False, min_length=limits)
        if length is None:
            assert fused.encoder.layers[0].attention._relpos_min_length == hf.WAVLM_MIN_LENGTH
            with pytest.raises(ValueError, match="wavlm_min_length takes the keys"):
                hf.use_fused_attention(fused, wavlm_min_length={"train": 0})
        calls.clear()
        with torch.set_grad_enabled(grads):
            got = fused(audio).last_hidden_state
            exp = model(audio).last_hidden_state
        assert len(calls) == fused_calls
        if fused_calls:
            torch.testing.assert_close(got, exp, atol=1e-10, rtol=1e-10)
            continue
        assert torch.equal(got, exp)
        if grads:
            got.square().sum().backward()
            exp.square().sum().backward()
            for (name, a), b in zip(fused.named_parameters(), model.parameters(), strict=True):
                assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_wavlm_half_precision_no_less_accurate_than_transformers(half):
    """A bfloat16 / float16 WavLM attention layer (the first, which makes the bias; weights,
    table and gates of unit-ish scale, so that the attention, not the input's rounding, sets the
    error; q's gate column is rounded to that dtype too), with padding: against float64, the
    fused output's error at kept frames is within 1.5x transformers' own error in that dtype."""
    model, _ = _wavlm_pair(False)
    module = model.encoder.layers[0].attention
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 98, 32, dtype=torch.float64)
    keep = torch.ones(2, 98, dtype=torch.bool)
    keep[1, 70:] = False

    def run(dtype):
        return module(x.to(dtype), attention_mask=keep)[0].double()

    with torch.no_grad():
        exact = run(torch.float64)
        module.to(half)
        theirs = run(half)
        assert hf.use_fused_attention(module, wavlm_min_length=FUSE_EVERY_LENGTH) == [""]
        ours = run(half)
    err_theirs = (theirs - exact)[keep].abs().max().item()
    err_ours = (ours - exact)[keep].abs().max().item()
    assert 0 < err_ours <= 1.5 * err_theirs + 1e-6, (err_ours, err_theirs)


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask")
@pytest.mark.parametrize("head", ["WavLMForCTC", "WavLMForSequenceClassification",
                                  "WavLMForXVector"])
def test_wavlm_task_heads_with_gradient_checkpointing(head, monkeypatch):
    """The fused attention inside WavLM's task heads, trained with gradient checkpointing (each
    encoder layer re-run in the backward, the first returning the table): float64 loss and every
    gradient equal transformers'."""
    config = _wavlm_config(vocab_size=12, hidden_dropout=0.0, attention_dropout=0.0,
                           activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                           mask_time_prob=0.0)
    torch.manual_seed(0)
    make = getattr(transformers, head)
    model = make(config).double().train()
    fused = make(config).double().train()
    fused.load_state_dict(model.state_dict())
    assert len(hf.use_fused_attention(fused, wavlm_min_length=FUSE_EVERY_LENGTH)) == 2
    for m in (model, fused):
        m.activation_checkpointing_enable()
    audio = torch.randn(2, 2000, dtype=torch.float64)
    labels = torch.randint(1, 12, (2, 10)) if head == "WavLMForCTC" else torch.tensor([0, 1])
    calls = _count_rel_attention(monkeypatch)
    want = model(audio, labels=labels).loss
    got = fused(audio, labels=labels).loss
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    want.backward()
    got.backward()
    assert len(calls) == 4  # two layers, each run again in the backward
    _assert_same_grads(fused, model)
