"""torch.func transforms over the ops: grad, jacrev, vmap, and vmap over grad (per-sample
gradients), against plain autograd through the same ops, sample by sample."""

from __future__ import annotations

import warnings

import pytest
import torch

import relpos_ext
from relpos_ext import ops
from relpos_ext.nn import RelativeMultiheadAttention

F64 = torch.float64
# torch's vmap fallback for an op without a batching rule warns with this (BatchedFallback.cpp)
_FALLBACK_WARNING = ".*performance drop because we have not yet implemented the batching rule"


def _t(*shape):
    return torch.randn(*shape, dtype=F64)


def _autograd_grads(fn, inputs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    return torch.autograd.grad(fn(*inputs), inputs)


def _assert_all_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-11, rtol=1e-11)


# (loss of the op's output, its differentiable inputs)
GRAD_CASES = {
    "rel_gather": (lambda t: relpos_ext.rel_gather(t, 4, 6, 2, 1, 0).sin().sum(), [(2, 5, 3)]),
    "skew": (lambda x: relpos_ext.skew(x).sin().sum(), [(2, 4, 9)]),
    "skew_causal": (lambda x: relpos_ext.skew(x, True).sin().sum(), [(2, 4, 4)]),
    "rel_logits": (lambda q, t: relpos_ext.rel_logits(q, t, 2, 7, 0, 1).sin().sum(),
                   [(2, 2, 4, 5), (5, 5)]),
    "rel_attention": (
        lambda q, k, v, ek, ev, eb, eq: relpos_ext.rel_attention(
            q, k, v, ek, ev, 2, causal=True, q_offset=3, rel_bias=eb, rel_q=eq).sin().sum(),
        [(2, 4, 5, 8), (2, 2, 8, 8), (2, 2, 8, 8), (4, 5, 8), (5, 8), (4, 5), (5, 8)],
    ),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_func_grad_is_autograd(cpu_isa, case):
    """torch.func.grad runs each op's registered backward: the gradients of plain autograd."""
    fn, shapes = GRAD_CASES[case]
    inputs = [_t(*s) for s in shapes]
    got = torch.func.grad(fn, argnums=tuple(range(len(inputs))))(*inputs)
    _assert_all_close(got, _autograd_grads(fn, inputs))


def test_func_jacrev_rel_attention(cpu_isa):
    q, k, v, ek = _t(1, 2, 3, 4), _t(1, 2, 5, 4), _t(1, 2, 5, 4), _t(3, 4)

    def fn(ek):
        return relpos_ext.rel_attention(q, k, v, ek, ek, 1)

    jac = torch.func.jacrev(fn)(ek)
    rows = [_autograd_grads(lambda e: fn(e).flatten()[i], [ek])[0] for i in range(q.numel())]
    torch.testing.assert_close(jac, torch.stack(rows).view(*q.shape, *ek.shape))


def test_func_second_order(cpu_isa):
    """grad of grad through rel_logits (its backward is differentiable); rel_attention says it
    has no double backward rather than returning a wrong one."""
    q, t = _t(1, 2, 4, 5), _t(5, 5)
    fn = lambda q: relpos_ext.rel_logits(q, t, 2, 6).sin().sum()  # noqa: E731
    got = torch.func.grad(lambda q: torch.func.grad(fn)(q).square().sum())(q)
    qq = q.detach().requires_grad_()
    (g,) = torch.autograd.grad(fn(qq), qq, create_graph=True)
    (want,) = torch.autograd.grad(g.square().sum(), qq)
    torch.testing.assert_close(got, want)

    k, v = _t(1, 2, 6, 5), _t(1, 2, 6, 5)
    att = lambda q: relpos_ext.rel_attention(q, k, v, t, t, 2).sin().sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="does not support double backward"):
        torch.func.grad(lambda q: torch.func.grad(att)(q).square().sum())(q)
    with pytest.raises(NotImplementedError, match="jvp"):
        torch.func.jvp(att, (q,), (q,))


# --------------------------------------------------------------------------- per-sample grads
# Each sample is a batch of two: [2, H, L, D]. kw: rel_attention's options; batched: option name ->
# per-sample tensor (vmapped with q, k, v); fold: whether the vmap rules fold the samples into
# the heads (True) or run the op once per sample.
def _per_sample_case(name):
    n, h, hkv, lq, lk, d, k = 3, 2, 2, 5, 6, 8, 2
    per_head = name in ("per_head", "gqa_bias_rel_q")
    tables = {"rel_k": _t(*((h,) if per_head else ()), 2 * k + 1, d),
              "rel_v": _t(*((h,) if per_head else ()), 2 * k + 1, d)}
    kw, batched, fold = {"max_distance": k}, {}, True
    if name == "gqa_bias_rel_q":
        h, hkv = 4, 2
        tables = {"rel_k": _t(h, 2 * k + 1, d), "rel_v": _t(h, 2 * k + 1, d),
                  "rel_bias": _t(h, 2 * k + 1), "rel_q": _t(2 * k + 1, d)}
        kw.update(causal=True, q_offset=2, k_offset=1)
    elif name == "attn_mask_window_segments":
        kw.update(attn_mask=torch.rand(lq, lk) < 0.3, window_left=3, window_right=2,
                  q_segment_ids=torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]),
                  k_segment_ids=torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]))
    elif name == "attn_mask_per_head":
        kw["attn_mask"] = torch.rand(1, h, lq, lk) < 0.3
        fold = False
    elif name == "padding_per_sample":
        pad = torch.zeros(n, 2, lk, dtype=torch.bool)
        pad[0, 0, -2:] = pad[2, 1, 0] = True
        batched["key_padding_mask"] = pad
        fold = False
    elif name == "dropout":
        kw.update(dropout_p=0.3, dropout_seed=torch.tensor([7]))
        fold = False
    qkv = (_t(n, 2, h, lq, d), _t(n, 2, hkv, lk, d), _t(n, 2, hkv, lk, d))
    return qkv, tables, kw, batched, fold


PER_SAMPLE = ["shared", "per_head", "gqa_bias_rel_q", "attn_mask_window_segments",
              "attn_mask_per_head", "padding_per_sample", "dropout"]


@pytest.fixture
def loops(monkeypatch):
    """Counts the vmap rules' fallbacks to one call per sample."""
    calls = []
    real = ops._vmap_loop

    def counted(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(ops, "_vmap_loop", counted)
    return calls


@pytest.mark.parametrize("name", PER_SAMPLE)
def test_per_sample_grads_rel_attention(cpu_isa, loops, name):
    (q, k, v), tables, kw, batched, fold = _per_sample_case(name)
    names = list(tables)

    def loss(q, k, v, batch_opts, *tabs):
        out = relpos_ext.rel_attention(q, k, v, **dict(zip(names, tabs)), **kw, **batch_opts)
        return out.sin().sum()

    argnums = tuple(i for i in range(4 + len(names)) if i != 3)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_FALLBACK_WARNING)
        got = torch.func.vmap(torch.func.grad(loss, argnums=argnums),
                              in_dims=(0, 0, 0, 0, *([None] * len(names))))(
            q, k, v, batched, *tables.values())
    for i in range(q.shape[0]):
        opts = {key: t[i] for key, t in batched.items()}
        want = _autograd_grads(lambda q, k, v, *tabs: loss(q, k, v, opts, *tabs),
                               [q[i], k[i], v[i], *tables.values()])
        _assert_all_close([g[i] for g in got], want)
    assert (len(loops) == 0) == fold, loops


@pytest.mark.parametrize("in_dims", [(0, 0, 0), (2, None, None), (None, 1, 1), (3, 4, 0)])
def test_vmap_rel_attention_forward(cpu_isa, loops, in_dims):
    """vmap of the forward alone, batched along any dimension of any of q, k, v."""
    n, shape_q, shape_kv = 3, [2, 4, 5, 8], [2, 2, 6, 8]
    args = []
    for shape, d in zip((shape_q, shape_kv, shape_kv), in_dims):
        args.append(_t(*shape) if d is None else _t(*shape[:d], n, *shape[d:]))
    ek, eb = _t(4, 5, 8), _t(5)

    def fn(q, k, v):
        return relpos_ext.rel_attention(q, k, v, ek, ek[0], 2, return_lse=True, rel_bias=eb)

    out, lse = torch.func.vmap(fn, in_dims=in_dims)(*args)
    for i in range(n):
        want = fn(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
        _assert_all_close([out[i], lse[i]], want)
    assert not loops


def test_per_sample_grads_module(cpu_isa):
    """The layer's per-sample gradients (torch.func.functional_call, as Opacus's functorch mode
    computes them) are each sample's own backward."""
    torch.manual_seed(0)
    layer = RelativeMultiheadAttention(16, 4, 3, num_kv_heads=2, per_head_tables=True,
                                       rel_bias=True, dtype=F64)
    x = _t(3, 1, 7, 16)
    params = {name: p.detach() for name, p in layer.named_parameters()}

    def loss(params, x):
        out = torch.func.functional_call(layer, params, (x, x, x), {"is_causal": True})
        return (out[0] if isinstance(out, tuple) else out).square().sum()

    got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        layer.zero_grad()
        out = layer(x[i], x[i], x[i], is_causal=True)
        (out[0] if isinstance(out, tuple) else out).square().sum().backward()
        for name, p in layer.named_parameters():
            torch.testing.assert_close(got[name][i], p.grad, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("per_head", [False, True])
def test_per_sample_grads_rel_attention_own_tables(cpu_isa, loops, per_head):
    """Each sample with its own tables (all batched): folded, each sample's own gradients."""
    n, h, d, k = 3, 4, 8, 2
    tab = lambda *s: _t(n, *((h,) if per_head else ()), *s)  # noqa: E731
    args = (_t(n, 2, h, 5, d), _t(n, 2, 2, 6, d), _t(n, 2, 2, 6, d), tab(2 * k + 1, d),
            tab(2 * k + 1, d), tab(2 * k + 1), tab(2 * k + 1, d))

    def loss(q, kk, v, ek, ev, eb, eq):
        return relpos_ext.rel_attention(q, kk, v, ek, ev, k, causal=True, rel_bias=eb,
                                        rel_q=eq).sin().sum()

    argnums = tuple(range(len(args)))
    got = torch.func.vmap(torch.func.grad(loss, argnums=argnums))(*args)
    for i in range(n):
        _assert_all_close([g[i] for g in got], _autograd_grads(loss, [a[i] for a in args]))
    assert not loops


def _flat(tensors):
    return torch.cat([t.flatten() for t in tensors])


# case -> (the op, shapes of its differentiable inputs, vmapped at 0 or common to all samples)
VMAP_OPS = {
    "rel_gather": (lambda t: relpos_ext.rel_gather(t, 4, 6, 2, 1, 0), [(5, 3)], [0]),
    "rel_gather_per_head": (lambda t: relpos_ext.rel_gather(t, 3, 5, 2), [(2, 5, 3)], [0]),
    "skew": (lambda x: relpos_ext.skew(x), [(2, 4, 9)], [0]),
    "skew_causal": (lambda x: relpos_ext.skew(x, True), [(4, 4)], [0]),
    "rel_logits_q": (lambda q, t: relpos_ext.rel_logits(q, t, 2, 7, 0, 1),
                     [(2, 2, 4, 5), (5, 5)], [0, None]),
    "rel_logits_table": (lambda q, t: relpos_ext.rel_logits(q, t, 2, 6),
                         [(2, 2, 4, 5), (2, 5, 5)], [None, 0]),
    "rel_logits_both": (lambda q, t: relpos_ext.rel_logits(q, t, 3, 5, 2, 0),
                        [(1, 3, 4, 5), (7, 5)], [0, 0]),
    # the backward ops themselves (differentiable too: double backward)
    "rel_gather_backward": (lambda g: relpos_ext.rel_gather_backward(g, 2, 0, 1),
                            [(4, 6, 3)], [0]),
    "rel_gather_backward_per_head": (lambda g: relpos_ext.rel_gather_backward(g, 1),
                                     [(2, 3, 5, 3)], [0]),
    "skew_backward": (lambda g: relpos_ext.skew_backward(g), [(2, 4, 6)], [0]),
    "rel_logits_backward": (lambda g, q, t: _flat(relpos_ext.rel_logits_backward(g, q, t, 2)),
                            [(2, 2, 4, 6), (2, 2, 4, 5), (5, 5)], [0, None, None]),
    "rel_logits_backward_all": (lambda g, q, t: _flat(relpos_ext.rel_logits_backward(g, q, t, 1)),
                                [(1, 2, 3, 4), (1, 2, 3, 5), (2, 3, 5)], [0, 0, 0]),
}


@pytest.mark.parametrize("last", [False, True], ids=["dim0", "last_dim"])
@pytest.mark.parametrize("case", list(VMAP_OPS))
def test_vmap_and_per_sample_grads_other_ops(cpu_isa, case, last):
    """vmap of each op and of its gradient (the samples along dim 0 or the last dim), against
    the op sample by sample, with no 'performance drop' warning from torch's
    one-sample-at-a-time fallback."""
    fn, shapes, dims = VMAP_OPS[case]
    n = 3
    inputs = [_t(n, *s) if d == 0 else _t(*s) for s, d in zip(shapes, dims)]
    if last:
        inputs = [x if d is None else x.movedim(0, -1) for x, d in zip(inputs, dims)]
        dims = [None if d is None else x.dim() - 1 for x, d in zip(inputs, dims)]
    loss = lambda *xs: fn(*xs).sin().sum()  # noqa: E731
    argnums = tuple(range(len(inputs)))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=_FALLBACK_WARNING)
        out = torch.func.vmap(fn, in_dims=tuple(dims))(*inputs)
        grad = torch.func.grad(loss, argnums=argnums)
        grads = torch.func.vmap(grad, in_dims=tuple(dims))(*inputs)
    for i in range(n):
        sample = [x if d is None else x.select(d, i) for x, d in zip(inputs, dims)]
        _assert_all_close([out[i]], [fn(*sample)])  # table sums: other order
        _assert_all_close([g[i] for g in grads], _autograd_grads(loss, sample))


@pytest.mark.parametrize("padding", [False, True], ids=["fold", "loop"])
def test_vmap_no_samples(loops, padding):
    """Zero samples (a Poisson-sampled private batch can be empty): empty outputs and
    gradients of the right shapes, on both paths of the rules."""
    q, ek = _t(0, 2, 4, 5, 8), _t(4, 5, 8)
    mask = torch.zeros(0, 2, 5, dtype=torch.bool) if padding else None

    def loss(q, m, ek):
        return relpos_ext.rel_attention(q, q, q, ek, ek[0], 2, key_padding_mask=m).sum()

    mask_dim = 0 if padding else None
    out = torch.func.vmap(lambda q, m: relpos_ext.rel_attention(q, q, q, ek, ek[0], 2,
                                                                key_padding_mask=m),
                          in_dims=(0, mask_dim))(q, mask)
    dq, dek = torch.func.vmap(torch.func.grad(loss, argnums=(0, 2)),
                              in_dims=(0, mask_dim, None))(q, mask, ek)
    assert out.shape == dq.shape == q.shape and dek.shape == (0, *ek.shape)
    assert (len(loops) > 0) == padding
    for fn, x in [(lambda t: relpos_ext.rel_gather(t, 3, 4, 2), _t(0, 5, 8)),
                  (relpos_ext.skew, _t(0, 3, 3, 5)),
                  (lambda q: relpos_ext.rel_logits(q, ek[0], 2, 6), _t(0, 1, 2, 5, 8))]:
        assert torch.func.vmap(torch.func.grad(lambda x: fn(x).sum()))(x).shape == x.shape


def test_vmap_empty_lengths(loops):
    """Samples with no queries or no keys (L = 0) fold as any others."""
    ek = _t(5, 8)
    for lq, lk in [(0, 4), (3, 0), (0, 0)]:
        q, k = _t(2, 1, 2, lq, 8), _t(2, 1, 2, lk, 8)

        def loss(q, k, ek):
            return relpos_ext.rel_attention(q, k, k, ek, ek, 2).sum()

        dq, dk, dek = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)),
                                      in_dims=(0, 0, None))(q, k, ek)
        assert dq.shape == q.shape and dk.shape == k.shape and dek.shape == (2, *ek.shape)
        assert not dq.any() and not dk.any() and not dek.any()
        logits = torch.func.vmap(lambda q: relpos_ext.rel_logits(q, ek, 2, lk))(q)
        assert logits.shape == (2, 1, 2, lq, lk)
        dtable = torch.func.vmap(lambda g: relpos_ext.rel_gather_backward(g, 2))(_t(2, lq, lk, 8))
        assert dtable.shape == (2, 5, 8)
    assert not loops
