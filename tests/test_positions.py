"""relpos_ext.positions: T5's bucketed bias and ALiBi as rel_attention's rel_bias, checked against
an explicit [H, Lq, Lk] float bias through F.scaled_dot_product_attention and against
transformers' own T5 and BLOOM code."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import relpos_ext
from relpos_ext import positions
from relpos_ext import reference as ref

try:
    import transformers  # noqa: F401
    HAVE_TRANSFORMERS = True
except ImportError:  # pragma: no cover - CI installs it (scripts/test.sh)
    HAVE_TRANSFORMERS = False
    if os.environ.get("RELPOS_REQUIRE_TRANSFORMERS") == "1":
        raise

needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")


def _attention_backend(backend):
    if backend.name == "cuda-emu" and not torch._C._dispatch_has_kernel_for_dispatch_key(
        "relpos_emu::rel_attention", "CPU"
    ):
        pytest.skip("no CUDA rel_attention kernel in this build yet")
    return backend


def _explicit_bias(table: torch.Tensor, k: int, lq: int, lk: int, q_offset: int = 0) -> torch.Tensor:
    """table [H, 2K+1] gathered to the [H, Lq, Lk] bias it stands for."""
    return table[:, ref.shaw_buckets(lq, lk, k, q_offset)]


def _op_and_sdpa(backend, q, k, v, table, kmax, causal, scale, q_offset=0):
    """(out, grads) of rel_attention with rel_bias=table on `backend`, and of SDPA with the
    explicit float bias (and the causal limit, as -inf, for the offset queries)."""
    lq, lk = q.shape[2], k.shape[2]
    bias = _explicit_bias(table, kmax, lq, lk, q_offset)
    if causal:
        r = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - q_offset
        bias = bias.masked_fill(r > 0, float("-inf"))
    leaves = [x.detach().requires_grad_() for x in (q, k, v, table)]
    want = F.scaled_dot_product_attention(*leaves[:3], attn_mask=_explicit_bias(
        leaves[3], kmax, lq, lk, q_offset).masked_fill(bias.isinf(), float("-inf")), scale=scale)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, g)
    dev = [backend.tensor(x.detach()) for x in (q, k, v, table)]
    out, lse = backend.op("rel_attention")(*dev[:3], None, None, kmax, causal, scale, q_offset, 0,
                                          None, 0.0, None, None, None, None, -1, -1, dev[3])
    grads = backend.op("rel_attention_backward")(
        backend.tensor(g), *dev[:3], None, None, out, lse, kmax, causal, scale, q_offset, 0, None,
        0.0, None, None, None, None, -1, -1, dev[3])
    got_grads = (grads[0], grads[1], grads[2], grads[5])
    return (out.cpu(), [x.cpu() for x in got_grads]), (want, want_grads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_matches_an_explicit_bias(backend, heads, causal):
    """ALiBi with K = L - 1 (exact): rel_attention's output and its q, k, v and table
    gradients equal SDPA's with the [H, L, L] float bias, on 150 positions (several tiles)."""
    _attention_backend(backend)
    g = torch.Generator().manual_seed(heads)
    length, d = 150, 32
    q, k, v = (torch.randn(2, heads, length, d, generator=g) for _ in range(3))
    table = positions.alibi_bias_table(positions.alibi_slopes(heads), length - 1)
    (out, grads), (want, want_grads) = _op_and_sdpa(backend, q, k, v, table, length - 1, causal,
                                                    d ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_table_matches_an_explicit_bias(backend, bidirectional):
    """T5 buckets (32, max distance 128, so some pairs saturate at L = 300), scale 1: the
    fused output and gradients equal SDPA's with the gathered bias; decoding (a query offset)
    included for the unidirectional (decoder) form."""
    _attention_backend(backend)
    g = torch.Generator().manual_seed(7)
    heads, d, kmax = 4, 16, 128
    weight = torch.randn(32, heads, generator=g)
    table = positions.t5_bias_table(weight, bidirectional, kmax)
    for lq, lk, q_offset in ((300, 300, 0), (3, 290, 287)):
        q = torch.randn(1, heads, lq, d, generator=g) * 0.3
        k, v = (torch.randn(1, heads, lk, d, generator=g) * 0.3 for _ in range(2))
        (out, grads), (want, want_grads) = _op_and_sdpa(backend, q, k, v, table, kmax,
                                                        not bidirectional, 1.0, q_offset)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
        for got, exp in zip(grads, want_grads):
            torch.testing.assert_close(got, exp, atol=5e-4, rtol=5e-4)


def test_t5_table_is_differentiable_in_the_embedding():
    """The table is an index of the embedding: gradients reach every bucket used."""
    weight = torch.randn(32, 2, requires_grad=True)
    table = positions.t5_bias_table(weight, True, 128)
    table.sum().backward()
    counts = torch.bincount(positions.t5_buckets(torch.arange(-128, 129)), minlength=32)
    torch.testing.assert_close(weight.grad, counts[:, None].float().expand(32, 2))


def test_alibi_slopes_known_values():
    torch.testing.assert_close(positions.alibi_slopes(8),
                               torch.tensor([2.0 ** -(h + 1) for h in range(8)]))
    six = positions.alibi_slopes(6)  # 4 of 2^(-2 (h+1)), then 2^(-1), 2^(-3)
    torch.testing.assert_close(six, torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                                  2.0 ** -1, 2.0 ** -3]))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_heads must be > 0"):
        positions.alibi_slopes(0)
    with pytest.raises(ValueError, match="max_distance must be >= 0"):
        positions.alibi_bias_table(torch.ones(2), -1)
    with pytest.raises(ValueError, match=r"weight must be \[num_buckets, H\]"):
        positions.t5_bias_table(torch.ones(32), True, 128)
    # max_distance at or below T5's exact distances (32 // 4 = 8; a decoder's 32 // 2 = 16)
    for bidirectional, max_distance in ((True, 8), (True, 6), (False, 16)):
        with pytest.raises(ValueError, match="T5's buckets need max_distance > num_buckets"):
            positions.t5_bias_table(torch.ones(32, 2), bidirectional, max_distance)
    assert positions.t5_bias_table(torch.ones(32, 2), False, 17).shape == (2, 35)


@needs_transformers
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64), (64, 256)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    r = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    want = T5Attention._relative_position_bucket(r, bidirectional, num_buckets, max_distance)
    assert torch.equal(positions.t5_buckets(r, bidirectional, num_buckets, max_distance), want)


def _t5_config(is_decoder: bool):
    from transformers import T5Config

    return T5Config(d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=32,
                    relative_attention_max_distance=128, dropout_rate=0.0, is_decoder=is_decoder,
                    attn_implementation="eager")


@needs_transformers
@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_table_is_transformers_position_bias(is_decoder):
    """t5_bias_table gathered by rel_attention's bucket is T5Attention.compute_bias, for
    prefill and for a decoding step past 200 cached tokens."""
    from transformers.models.t5.modeling_t5 import T5Attention

    module = T5Attention(_t5_config(is_decoder), has_relative_attention_bias=True, layer_idx=0)
    table = positions.t5_bias_table(module.relative_attention_bias.weight, not is_decoder,
                                    module.relative_attention_max_distance)
    k = module.relative_attention_max_distance
    for lq, lk, past in ((300, 300, 0), (1, 201, 200)):
        want = module.compute_bias(lq, lk, past_seen_tokens=past)[0]
        torch.testing.assert_close(_explicit_bias(table, k, lq, lk, past), want, atol=0, rtol=0)


@needs_transformers
@pytest.mark.parametrize("is_decoder", [False, True])
def test_t5_attention_layer_through_rel_attention(is_decoder):
    """transformers' T5Attention (self-attention, 300 positions, float64) against its own
    projections around rel_attention(q, k, v, None, None, 128, scale=1, rel_bias=table): the
    outputs and the gradients of every weight, the bias embedding included."""
    from transformers.models.t5.modeling_t5 import T5Attention

    torch.manual_seed(0)
    config = _t5_config(is_decoder)
    module = T5Attention(config, has_relative_attention_bias=True, layer_idx=0).double()
    x = torch.randn(2, 300, 32, dtype=torch.float64)
    mask = None
    if is_decoder:  # transformers' additive causal mask, [B, 1, L, L]
        mask = torch.full((300, 300), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
        mask = mask[None, None].expand(2, 1, 300, 300)
    want = module(x, mask=mask)[0]
    g = torch.randn_like(want)
    params = [p for _, p in sorted(module.named_parameters())]
    want_grads = torch.autograd.grad(want, params, g)

    def heads(proj):
        return proj(x).view(2, 300, 4, 8).transpose(1, 2)

    table = relpos_ext.t5_bias_table(module.relative_attention_bias.weight, not is_decoder, 128)
    out = relpos_ext.rel_attention(heads(module.q), heads(module.k), heads(module.v), None, None,
                                   128, causal=is_decoder, scale=1.0, rel_bias=table)
    got = module.o(out.transpose(1, 2).reshape(2, 300, 32))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    for a, b in zip(torch.autograd.grad(got, params, g), want_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@needs_transformers
@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 12, 16, 20, 24])
def test_alibi_slopes_match_bloom(heads):
    """BLOOM's build_alibi_tensor is slope x key position: at position 1 it is the slope."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    alibi = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)  # [H, 1, 2]
    torch.testing.assert_close(positions.alibi_slopes(heads), alibi[:, 0, 1])


@needs_transformers
@pytest.mark.parametrize("position_buckets, max_relative_positions",
                         [(256, 512), (16, 40), (32, 128), (-1, 24), (-1, 512), (2, 10),
                          # odd buckets, and more buckets than distances: the rows clamp far
                          # beyond max_relative_positions (from 48, 2115 and 12)
                          (7, 20), (512, 128), (9, 10)])
def test_deberta_buckets_match_transformers(position_buckets, max_relative_positions):
    """deberta_buckets(r) is the row transformers' DeBERTa-v2 reads for the distance r = j - i
    (its relative_pos is i - j: log buckets, then clamp(rel + span, 0, 2 span - 1)), over every
    distance of a 4096-long sequence; beyond deberta_max_distance (and only from there) the row
    stays that of +-K."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    length = 4096
    x = torch.empty(1, length, 1)
    rel = build_relative_position(x, x, position_buckets, max_relative_positions)[0, 0]  # i = 0
    span = position_buckets if position_buckets > 0 else max_relative_positions
    want = (rel + span).clamp(0, 2 * span - 1)  # j = 0 .. L-1: r = j
    rel_rows = build_relative_position(x, x, position_buckets, max_relative_positions)[0, :, 0]
    want_neg = (rel_rows + span).clamp(0, 2 * span - 1)  # i = 0 .. L-1, j = 0: r = -i
    r = torch.arange(length)
    assert torch.equal(positions.deberta_buckets(r, position_buckets, max_relative_positions), want)
    assert torch.equal(positions.deberta_buckets(-r, position_buckets, max_relative_positions),
                       want_neg)
    k = positions.deberta_max_distance(position_buckets, max_relative_positions)
    assert k < length and (want[k:] == want[k]).all() and (want_neg[k:] == want_neg[k]).all()
    assert k == 0 or not ((want[k - 1:] == want[k - 1]).all() and
                          (want_neg[k - 1:] == want_neg[k - 1]).all())
