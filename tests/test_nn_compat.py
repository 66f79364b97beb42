"""RelativeMultiheadAttention as a drop-in for torch.nn.MultiheadAttention.

A layer made by ``from_multihead_attention`` (the same projections, zero relative tables) must
compute what torch's layer computes, on every call form torch's layer takes: self- and
cross-attention, kdim/vdim, bool and float (0 / -inf) masks, unbatched inputs, weights averaged
or per head; and the same gradients w.r.t. the inputs and the projections.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import relpos_ext

E, H = 32, 4


def _pair(dtype=torch.float32, **mha_kw):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype, **mha_kw)
    ours = relpos_ext.nn.RelativeMultiheadAttention.from_multihead_attention(mha, max_distance=3)
    return mha, ours


def _padding(batch, keys, dtype):
    """[B, S]: the last keys of the second batch entry hidden; bool or float 0 / -inf."""
    hide = torch.zeros(batch, keys, dtype=torch.bool)
    hide[-1, -3:] = True
    return hide if dtype == torch.bool else torch.zeros(batch, keys).masked_fill(hide, float("-inf"))


def _random_mask(shape, dtype):
    """random hidden entries, the diagonal kept (torch's layer gives NaN on a row with no key)."""
    g = torch.Generator().manual_seed(3)
    hide = torch.rand(shape, generator=g) < 0.3
    hide &= ~torch.eye(shape[-2], shape[-1], dtype=torch.bool)
    return hide if dtype == torch.bool else torch.zeros(shape).masked_fill(hide, float("-inf"))


# name -> (torch layer kwargs, builder of (args, kwargs) for a call); B=2, L=7, S=9 unless unbatched
CALLS = {
    "self": ({}, lambda: ((torch.randn(2, 7, E),), {})),
    "self_no_bias": ({"bias": False}, lambda: ((torch.randn(2, 7, E),), {})),
    "causal_float_mask": ({}, lambda: ((torch.randn(2, 7, E),), dict(
        attn_mask=nn.Transformer.generate_square_subsequent_mask(7), is_causal=True))),
    "causal_float_mask_no_hint": ({}, lambda: ((torch.randn(2, 7, E),), dict(
        attn_mask=nn.Transformer.generate_square_subsequent_mask(7)))),
    "padding_bool": ({}, lambda: ((torch.randn(2, 7, E),), dict(
        key_padding_mask=_padding(2, 7, torch.bool)))),
    "padding_float": ({}, lambda: ((torch.randn(2, 7, E),), dict(
        key_padding_mask=_padding(2, 7, torch.float32)))),
    "cross_mask_3d_bool": ({}, lambda: ((torch.randn(2, 7, E), torch.randn(2, 9, E),
                                         torch.randn(2, 9, E)), dict(
        attn_mask=_random_mask((2 * H, 7, 9), torch.bool),
        key_padding_mask=_padding(2, 9, torch.bool)))),
    "cross_mask_2d_float_kdim_vdim": ({"kdim": 24, "vdim": 40}, lambda: (
        (torch.randn(2, 7, E), torch.randn(2, 9, 24), torch.randn(2, 9, 40)),
        dict(attn_mask=_random_mask((7, 9), torch.float32)))),
    "unbatched": ({}, lambda: ((torch.randn(7, E),), {})),
    "unbatched_cross_masks": ({}, lambda: ((torch.randn(7, E), torch.randn(9, E),
                                            torch.randn(9, E)), dict(
        attn_mask=_random_mask((H, 7, 9), torch.float32),
        key_padding_mask=_padding(1, 9, torch.float32)[0]))),
}


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("name", list(CALLS))
def test_matches_torch_multihead_attention(name, average):
    mha_kw, make = CALLS[name]
    mha, ours = _pair(**mha_kw)
    torch.manual_seed(1)
    args, kw = make()
    args_ours = [a.clone().requires_grad_() for a in args]
    args_mha = [a.clone().requires_grad_() for a in args]
    got, got_w = ours(*args_ours, need_weights=True, average_attn_weights=average, **kw)
    exp, exp_w = mha(*args_mha if len(args) == 3 else args_mha * 3, need_weights=True,
                     average_attn_weights=average, **kw)
    assert got.shape == exp.shape and got_w.shape == exp_w.shape
    torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_w, exp_w, atol=1e-6, rtol=1e-5)
    upstream = torch.randn_like(exp)
    (got * upstream).sum().backward()
    (exp * upstream).sum().backward()
    for a, b in zip(args_ours, args_mha):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    if mha.in_proj_weight is not None:
        proj_grad = torch.cat([p.weight.grad for p in (ours.q_proj, ours.k_proj, ours.v_proj)])
        torch.testing.assert_close(proj_grad, mha.in_proj_weight.grad, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(ours.k_proj.weight.grad, mha.k_proj_weight.grad,
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.out_proj.weight.grad, mha.out_proj.weight.grad,
                               atol=1e-5, rtol=1e-5)
    # the zero tables are where the relative positions will be learned: they get gradients
    assert ours.rel_k.grad.abs().sum() > 0 and ours.rel_v.grad.abs().sum() > 0


def test_converted_layer_learns_relative_positions():
    """After one optimiser step on the tables the layer no longer equals torch's: the relative
    terms are live, not just zero-initialised parameters the kernels ignore."""
    mha, ours = _pair()
    x = torch.randn(2, 7, E)
    opt = torch.optim.SGD([ours.rel_k, ours.rel_v], lr=1.0)
    ours(x, is_causal=True)[0].square().sum().backward()
    opt.step()
    with torch.no_grad():
        gap = (ours(x, is_causal=True)[0] - mha(x, x, x, need_weights=False)[0]).abs().max()
    assert gap > 1e-3


def test_from_multihead_attention_copies_layout():
    """dtype, device-free metadata, dropout, widths and the optional tables follow the call."""
    mha = nn.MultiheadAttention(E, H, dropout=0.25, bias=False, kdim=16, vdim=8,
                                dtype=torch.float64)
    ours = relpos_ext.nn.RelativeMultiheadAttention.from_multihead_attention(
        mha, 5, rel_values=False, per_head_tables=True, window=(4, 0))
    assert ours.dropout == 0.25 and ours.kdim == 16 and ours.vdim == 8 and ours.window == (4, 0)
    assert ours.q_proj.bias is None and ours.out_proj.bias is None and ours.rel_v is None
    assert ours.rel_k.shape == (H, 11, E // H) and ours.rel_k.dtype == torch.float64
    assert not ours.rel_k.any()
    torch.testing.assert_close(ours.v_proj.weight, mha.v_proj_weight, atol=0, rtol=0)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn are not supported"):
        relpos_ext.nn.RelativeMultiheadAttention.from_multihead_attention(
            nn.MultiheadAttention(E, H, add_bias_kv=True), 3)


def test_float_masks_compiled_fullgraph():
    """A float 0 / -inf mask goes through torch.compile(fullgraph=True) (the value check is an
    op, not a graph break) and gives the output of the equivalent bool mask."""
    torch._dynamo.reset()
    _, ours = _pair()
    x = torch.randn(2, 7, E)
    fmask = _random_mask((7, 7), torch.float32)
    step = torch.compile(lambda x, m: ours(x, attn_mask=m)[0], fullgraph=True)
    torch.testing.assert_close(step(x, fmask), ours(x, attn_mask=fmask == float("-inf"))[0],
                               atol=1e-6, rtol=1e-5)
    bias = fmask.clone()
    bias[0, 0] = 0.5
    with pytest.raises(RuntimeError, match="must hold only 0 \\(keep\\) and -inf"):
        step(x, bias)


def test_large_negative_float_masks():
    """transformers-style additive masks (0 / finfo.min) hide like -inf, in every float dtype;
    -1e9 is a bias, not a hidden key, and raises."""
    _, ours = _pair()
    x = torch.randn(2, 7, E)
    hide = _random_mask((7, 7), torch.bool)
    want = ours(x, attn_mask=hide)[0]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        fmask = torch.zeros(7, 7, dtype=dtype).masked_fill(hide, torch.finfo(dtype).min)
        torch.testing.assert_close(ours(x, attn_mask=fmask)[0], want, atol=0, rtol=0)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, -2:] = True
    torch.testing.assert_close(
        ours(x, key_padding_mask=torch.zeros(2, 7).masked_fill(pad, torch.finfo().min))[0],
        ours(x, key_padding_mask=pad)[0], atol=0, rtol=0)


BAD_CALLS = [
    ("additive bias", lambda m, x: m(x, attn_mask=torch.full((7, 7), -1e9)), RuntimeError,
     r"a float attn_mask must hold only 0 \(keep\) and -inf or large negative values "
     r"\(ignore\); additive biases are not supported"),
    ("padding bias", lambda m, x: m(x, key_padding_mask=torch.ones(2, 7)), RuntimeError,
     r"a float key_padding_mask must hold only 0"),
    ("int mask", lambda m, x: m(x, attn_mask=torch.zeros(7, 7, dtype=torch.int64)), ValueError,
     r"attn_mask must be bool \(True = ignore\) or float"),
    ("4-D query", lambda m, x: m(x[None]), ValueError,
     r"query must be \[B, Lq, E\] or unbatched \[Lq, E\]"),
    ("unbatched query, batched key", lambda m, x: m(x[0], x, x), ValueError,
     r"with an unbatched query \[Lq, E\], key must be \[Lk, E\]"),
    ("unbatched query, batched padding", lambda m, x: m(x[0], key_padding_mask=torch.zeros(
        1, 7, dtype=torch.bool)), ValueError, r"key_padding_mask must be \[Lk\]"),
    ("unbatched query, 4-D mask", lambda m, x: m(x[0], attn_mask=torch.zeros(
        1, H, 7, 7, dtype=torch.bool)), ValueError, r"attn_mask must be \[Lq, Lk\] or \[H, Lq, Lk\]"),
]


@pytest.mark.parametrize("desc,call,exc,pattern", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_calls(desc, call, exc, pattern):
    _, ours = _pair()
    with pytest.raises(exc, match=pattern):
        call(ours, torch.randn(2, 7, E))
