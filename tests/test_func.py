"""torch.func transforms over the ops: grad, jacrev, vmap, and vmap over grad (per-sample
gradients), against plain autograd through the same ops, sample by sample; forward mode (jvp,
jacfwd, torch.autograd.forward_ad) against forward mode through relpos_ext.reference."""

from __future__ import annotations

import warnings

import pytest
import torch

import relpos_ext
from relpos_ext import ops
from relpos_ext import reference as ref
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
    """grad of grad (torch.func.grad twice, jacrev of jacrev) and torch.func.hessian (jacfwd of
    jacrev: the backward ops' forward mode) through rel_logits and rel_attention, against the
    same through the reference."""
    q, t = _t(1, 2, 4, 5), _t(5, 5)
    fn = lambda q: relpos_ext.rel_logits(q, t, 2, 6).sin().sum()  # noqa: E731
    got = torch.func.grad(lambda q: torch.func.grad(fn)(q).square().sum())(q)
    qq = q.detach().requires_grad_()
    (g,) = torch.autograd.grad(fn(qq), qq, create_graph=True)
    (want,) = torch.autograd.grad(g.square().sum(), qq)
    torch.testing.assert_close(got, want)

    k, v, eb = _t(1, 1, 6, 5), _t(1, 1, 6, 5), _t(2, 5)

    def att(impl):
        return lambda q, t, eb: impl(q, k, v, t, t, 2, causal=True, q_offset=2,
                                     rel_bias=eb).sin().sum()

    ours, want = att(relpos_ext.rel_attention), att(ref.shaw_attention)
    grad_grad = lambda f: torch.func.grad(  # noqa: E731
        lambda *x: torch.func.grad(f, argnums=(0, 1, 2))(*x)[1].square().sum(), argnums=(0, 1, 2))
    _assert_all_close(grad_grad(ours)(q, t, eb), grad_grad(want)(q, t, eb))
    for transform in (torch.func.hessian,
                      lambda f, argnums: torch.func.jacrev(torch.func.jacrev(f, argnums), argnums)):
        for argnums in (0, 1, 2):
            _assert_all_close([transform(ours, argnums=argnums)(q, t, eb)],
                              [transform(want, argnums=argnums)(q, t, eb)])


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
    # rope: 4-D samples (folded into x's first dim), and batched tables
    "rope": (lambda x, c, s: relpos_ext.rope(x, c, s), [(2, 3, 5, 8), (5, 6), (5, 6)],
             [0, None, None]),
    "rope_tables": (lambda x, c, s: relpos_ext.rope(x, c, s, True, True),
                    [(2, 5, 8), (2, 1, 8), (2, 1, 8)], [None, 0, 0]),
    "rope_all": (lambda x, c, s: relpos_ext.rope(x, c, s), [(3, 4), (3, 4), (3, 4)], [0, 0, 0]),
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


# --------------------------------------------------------------------------- forward mode
# rel_attention's option mixes: (q heads, kv heads, Lq, Lk, K, tables per head, options)
JVP_CASES = {
    "plain": (2, 2, 5, 6, 2, False, {}),
    "per_head_causal_offsets": (4, 2, 6, 8, 3, True, {"causal": True, "q_offset": 3,
                                                       "k_offset": 1}),
    "k_beyond_lengths": (2, 1, 4, 3, 9, False, {"scale": 0.7}),
    "no_buckets": (2, 2, 3, 5, 0, True, {}),
    "masks_window_segments": (2, 2, 7, 6, 2, False, {
        "window_left": 3, "window_right": 2,
        "q_segment_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]]),
        "k_segment_ids": torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]])}),
    "padding_and_empty_rows": (2, 2, 5, 6, 2, True, {"causal": True, "k_offset": 2}),
    "attn_mask_per_head": (4, 4, 6, 6, 2, False, {}),
    "dropout": (2, 1, 9, 7, 2, True, {"dropout_p": 0.3, "dropout_seed": torch.tensor([11])}),
    # blocks see only some keys: their columns of the dropout mask
    "causal_window_dropout": (2, 2, 9, 11, 2, False, {
        "causal": True, "window_left": 3, "k_offset": -2, "dropout_p": 0.4,
        "dropout_seed": torch.tensor([5])}),
}
# which of (q, k, v, rel_k, rel_v, rel_bias, rel_q) carry a tangent
JVP_TANGENTS = {"all": (True,) * 7, "q_and_tables": (True, False, False, True, True, True, True),
                "k_v": (False, True, True, False, False, False, False)}


def _jvp_case(name, b=2, d=8):
    h, hkv, lq, lk, k, per_head, kw = JVP_CASES[name]
    kw = {"max_distance": k, **kw}
    if name == "padding_and_empty_rows":  # causal with k_offset 2: rows 0-1 see no key
        pad = torch.zeros(b, lk, dtype=torch.bool)
        pad[0, 3:] = True
        kw["key_padding_mask"] = pad
    if name == "attn_mask_per_head":
        kw["attn_mask"] = torch.rand(b, h, lq, lk) < 0.4
    table = lambda *s: _t(*((h,) if per_head else ()), 2 * k + 1, *s)  # noqa: E731
    args = (_t(b, h, lq, d), _t(b, hkv, lk, d), _t(b, hkv, lk, d), table(d), table(d), table(),
            table(d))
    return args, kw


def _attention(impl, kw):
    names = ("rel_k", "rel_v", "rel_bias", "rel_q")

    def fn(q, k, v, *tables):
        out, lse = impl(q, k, v, **dict(zip(names, tables)), **kw, return_lse=True)
        return out, lse
    return fn


@pytest.mark.parametrize("which", list(JVP_TANGENTS))
@pytest.mark.parametrize("name", list(JVP_CASES))
def test_jvp_rel_attention(cpu_isa, monkeypatch, name, which):
    """torch.func.jvp and torch.autograd.forward_ad give the output tangent of forward mode
    through the reference; blocks of 2 query rows (dropout's rows and the masks' rows are taken
    per block). lse, non-differentiable as in reverse mode, gets no
    tangent."""
    torch.manual_seed(0)
    args, kw = _jvp_case(name)
    batch, heads, _, _ = args[0].shape
    monkeypatch.setattr(ops, "_JVP_BLOCK_ENTRIES", 2 * batch * heads * args[1].shape[2])
    ours, oracle = _attention(relpos_ext.rel_attention, kw), _attention(ref.shaw_attention, kw)
    tangents = tuple(torch.randn_like(a) if keep else torch.zeros_like(a)
                     for a, keep in zip(args, JVP_TANGENTS[which]))
    (out, lse), (t_out, t_lse) = torch.func.jvp(ours, args, tangents)
    (want_out, _), (want, _) = torch.func.jvp(oracle, args, tangents)
    _assert_all_close([out, t_out], [want_out, want])
    assert not t_lse.any()
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(a, t) if keep else a
                 for a, t, keep in zip(args, tangents, JVP_TANGENTS[which])]
        out, lse = ours(*duals)
        got = torch.autograd.forward_ad.unpack_dual(out).tangent
        assert torch.autograd.forward_ad.unpack_dual(lse).tangent is None
    _assert_all_close([got], [want])


def _exception_chain(e):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def test_jvp_under_torch_compile():
    """torch.compile would trace the op with a zero tangent, silently: instead the op breaks
    the graph and runs eagerly with its jvp, and fullgraph=True fails saying why. A dual
    tensor passed into a compiled function gets its tangent too."""
    torch._dynamo.reset()
    args, kw = _jvp_case("plain", b=1, d=4)
    q, rest = args[0], args[1:]
    tq = torch.randn_like(q)
    fn = lambda q: _attention(relpos_ext.rel_attention, kw)(q, *rest)[0]  # noqa: E731
    _, want = torch.func.jvp(lambda q: _attention(ref.shaw_attention, kw)(q, *rest)[0], (q,),
                             (tq,))
    jvp = lambda q: torch.func.jvp(fn, (q,), (tq,))[1]  # noqa: E731
    _assert_all_close([torch.compile(jvp, backend="eager")(q)], [want])
    with torch.autograd.forward_ad.dual_level():
        out = torch.compile(fn, backend="eager")(torch.autograd.forward_ad.make_dual(q, tq))
        _assert_all_close([torch.autograd.forward_ad.unpack_dual(out).tangent], [want])
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda q: torch.func.jvp(fn, (q,), (tq,))[1], backend="eager",
                      fullgraph=True)(q)
    assert any("forward-mode AD" in str(e) for e in _exception_chain(info.value))
    torch._dynamo.reset()


def test_jacfwd_rel_attention(cpu_isa):
    """jacfwd (vmap over the jvp) is jacrev: forward and reverse mode agree."""
    args, kw = _jvp_case("per_head_causal_offsets", b=1, d=4)
    for argnum in range(7):
        fn = lambda *xs: _attention(relpos_ext.rel_attention, kw)(*xs)[0]  # noqa: E731
        _assert_all_close([torch.func.jacfwd(fn, argnums=argnum)(*args)],
                          [torch.func.jacrev(fn, argnums=argnum)(*args)])


def test_grad_of_jvp_rel_attention(cpu_isa):
    """Reverse over forward (torch.func.grad of a jvp, as the JVP-regularised losses of
    consistency and MeanFlow models take it): the jvp's own ops are differentiated."""
    args, kw = _jvp_case("per_head_causal_offsets", b=1, d=4)
    tangents = tuple(torch.randn_like(a) for a in args)

    def loss(impl):
        fn = lambda *xs: _attention(impl, kw)(*xs)[0]  # noqa: E731
        return lambda *xs: torch.func.jvp(fn, xs, tangents)[1].sin().sum()

    argnums = tuple(range(len(args)))
    _assert_all_close(torch.func.grad(loss(relpos_ext.rel_attention), argnums=argnums)(*args),
                      torch.func.grad(loss(ref.shaw_attention), argnums=argnums)(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_jvp_rel_attention_low_precision(cpu_isa, dtype):
    """Tangents of float32/bfloat16/float16 calls (computed in float32) against the float64
    reference on the same rounded inputs."""
    args, kw = _jvp_case("per_head_causal_offsets", d=64)
    args = tuple(a.to(dtype) for a in args)
    tangents = tuple(torch.randn_like(a) for a in args)
    _, (t_out, _) = torch.func.jvp(_attention(relpos_ext.rel_attention, kw), args, tangents)
    _, (want, _) = torch.func.jvp(_attention(ref.shaw_attention, kw),
                                  tuple(a.double() for a in args),
                                  tuple(t.double() for t in tangents))
    assert t_out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}[dtype]
    torch.testing.assert_close(t_out.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_jvp_module(cpu_isa):
    """torch.func.jvp through the layer, with respect to its input and to all its parameters,
    against the plain-PyTorch reference layer with the same parameters."""
    torch.manual_seed(0)
    kw = dict(embed_dim=16, num_heads=4, max_distance=3, num_kv_heads=2, per_head_tables=True,
              rel_bias=True, dtype=F64)
    layer = RelativeMultiheadAttention(**kw)
    oracle = ref.RelativeMultiheadAttentionReference(**kw)
    oracle.load_state_dict(layer.state_dict())
    params = {name: p.detach() for name, p in layer.named_parameters()}
    tangents = {name: torch.randn_like(p) for name, p in params.items()}
    x, tx = _t(2, 7, 16), _t(2, 7, 16)

    def run(module):
        def fn(params, x):
            out = torch.func.functional_call(module, params, (x, x, x), {"is_causal": True})
            return out[0] if isinstance(out, tuple) else out
        return torch.func.jvp(fn, (params, x), (tangents, tx))

    _assert_all_close(run(layer), run(oracle))


def _ref_adjoint(fn, *primals):
    """The adjoint of the reference's linear map fn at primals: g -> vjp(fn, *primals)(g)."""
    return lambda g: torch.func.vjp(fn, *primals)[1](g)


# op -> (our op, the reference, shapes of its inputs)
JVP_OPS = {
    "rel_gather": (lambda t: relpos_ext.rel_gather(t, 4, 6, 2, 1, 0),
                   lambda t: ref.rel_gather(t, 4, 6, 2, 1, 0), [(2, 5, 3)]),
    "skew": (relpos_ext.skew, ref.skew, [(2, 4, 9)]),
    "skew_causal": (lambda x: relpos_ext.skew(x, True), lambda x: ref.skew(x, True),
                    [(2, 4, 4)]),
    "rel_logits": (lambda q, t: relpos_ext.rel_logits(q, t, 2, 7, 0, 1),
                   lambda q, t: ref.rel_logits(q, t, 2, 7, 0, 1), [(2, 2, 4, 5), (2, 5, 5)]),
    "rel_gather_backward": (
        lambda g: relpos_ext.rel_gather_backward(g, 2, 0, 1),
        lambda g: _ref_adjoint(lambda t: ref.rel_gather(t, 4, 6, 2, 0, 1), _t(5, 3))(g)[0],
        [(4, 6, 3)]),
    "skew_backward": (relpos_ext.skew_backward,
                      lambda g: _ref_adjoint(ref.skew, _t(2, 4, 9))(g)[0], [(2, 4, 6)]),
    "rel_logits_backward": (
        lambda g, q, t: _flat(relpos_ext.rel_logits_backward(g, q, t, 2, 1, 0)),
        lambda g, q, t: _flat(_ref_adjoint(lambda q, t: ref.rel_logits(q, t, 2, 6, 1, 0),
                                           q, t)(g)),
        [(2, 2, 4, 6), (2, 2, 4, 5), (2, 5, 5)]),
    "rope": (lambda x, c, s: relpos_ext.rope(x, c, s, True), lambda x, c, s: ref.rope(x, c, s, True),
             [(2, 3, 5, 8), (5, 6), (5, 6)]),
    "rope_inverse": (lambda x, c, s: relpos_ext.rope(x, c, s, False, True),
                     lambda x, c, s: ref.rope(x, c, s, False, True), [(2, 5, 8), (2, 1, 8), (2, 1, 8)]),
}


@pytest.mark.parametrize("case", list(JVP_OPS))
def test_jvp_other_ops(cpu_isa, case):
    """Forward mode through rel_gather, skew, rel_logits and their backwards (whose jvp makes
    forward-over-reverse second derivatives work: torch.func.hessian)."""
    fn, oracle, shapes = JVP_OPS[case]
    primals = tuple(_t(*s) for s in shapes)
    tangents = tuple(_t(*s) for s in shapes)
    _, got = torch.func.jvp(fn, primals, tangents)
    _, want = torch.func.jvp(oracle, primals, tangents)
    _assert_all_close([got], [want])
    with torch.autograd.forward_ad.dual_level():
        duals = [torch.autograd.forward_ad.make_dual(p, t) for p, t in zip(primals, tangents)]
        _assert_all_close([torch.autograd.forward_ad.unpack_dual(fn(*duals)).tangent], [want])


@pytest.mark.parametrize("name", ["per_head_causal_offsets", "dropout"])
def test_gradcheck_forward_ad_rel_attention(cpu_isa, name):
    """torch.autograd.gradcheck's forward-mode check: the jvp's Jacobian against finite
    differences (its batched form runs torch's legacy vmap, which lacks rules for slicing;
    test_jacfwd_rel_attention vmaps the jvp with torch.func)."""
    args, kw = _jvp_case(name, b=1, d=4)
    args = tuple(a.requires_grad_() for a in args)
    fn = lambda *xs: _attention(relpos_ext.rel_attention, kw)(*xs)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, args, check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False)


def test_hessian_rel_logits(cpu_isa):
    q, t = _t(1, 2, 3, 4), _t(2, 5, 4)
    loss = lambda q, t: relpos_ext.rel_logits(q, t, 2, 5).sin().sum()  # noqa: E731
    want = lambda q, t: ref.rel_logits(q, t, 2, 5).sin().sum()  # noqa: E731
    for argnum in (0, 1):
        _assert_all_close([torch.func.hessian(loss, argnums=argnum)(q, t)],
                          [torch.func.hessian(want, argnums=argnum)(q, t)])


# --------------------------------------------------------------------------- second order
@pytest.mark.parametrize("which", list(JVP_TANGENTS))
@pytest.mark.parametrize("name", list(JVP_CASES))
def test_double_backward_rel_attention(cpu_isa, monkeypatch, name, which):
    """grad of grad (create_graph=True, as gradient penalties take it): the gradients of a loss
    of the first gradients (of the inputs in `which`) with respect to every input, against the
    same through the reference. The output gradient, cos(out), depends on the inputs too, so
    the second derivative through it is checked as well. Blocks of 2 query rows."""
    torch.manual_seed(0)
    args, kw = _jvp_case(name)
    batch, heads, _, _ = args[0].shape
    monkeypatch.setattr(ops, "_JVP_BLOCK_ENTRIES", 2 * batch * heads * args[1].shape[2])
    weights = [torch.randn_like(a) if keep else None for a, keep in zip(args, JVP_TANGENTS[which])]

    def second(impl):
        xs = [a.detach().requires_grad_() for a in args]
        out, _ = _attention(impl, kw)(*xs)
        grads = torch.autograd.grad(out.sin().sum(), xs, create_graph=True)
        penalty = sum((g * w).sum() for g, w in zip(grads, weights) if w is not None)
        return torch.autograd.grad(penalty, xs, allow_unused=True, materialize_grads=True)

    _assert_all_close(second(relpos_ext.rel_attention), second(ref.shaw_attention))


def test_head_dim_0_forward_mode_and_double_backward():
    """D = 0 (empty rows: zero outputs, the default scale 1 / sqrt(max(D, 1)) as the kernels
    take it): forward mode and grad of grad run, as the first backward does, and give the
    reference's (empty or zero) results."""
    q = torch.randn(1, 2, 3, 0, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 0, dtype=torch.float64, requires_grad=True)
    table = torch.randn(5, 0, dtype=torch.float64, requires_grad=True)
    for impl in (relpos_ext.rel_attention, ref.shaw_attention):
        fn = lambda q, t: impl(q, k, k, t, t, 2)  # noqa: E731,B023
        out, tangent = torch.func.jvp(fn, (q, table), (torch.ones_like(q), torch.ones_like(table)))
        assert out.shape == tangent.shape == (1, 2, 3, 0)
        grads = torch.autograd.grad(fn(q, table).sum(), (q, k, table), create_graph=True,
                                    allow_unused=True, materialize_grads=True)
        second = torch.autograd.grad(sum(g.sum() for g in grads), (q, k, table),
                                     allow_unused=True, materialize_grads=True)
        assert [g.shape for g in second] == [q.shape, k.shape, table.shape]


def test_per_sample_gradient_penalty(cpu_isa):
    """vmap over grad of grad: each sample's gradient penalty differentiated (the double
    backward under vmap's generated rules), against the reference's."""
    args, kw = _jvp_case("per_head_causal_offsets", b=1, d=4)
    samples = tuple(torch.randn(3, *a.shape, dtype=F64) for a in args[:3])

    def per_sample(impl):
        loss = lambda q, k, v: _attention(impl, kw)(q, k, v, *args[3:])[0].sin().sum()  # noqa: E731

        def penalty(q, k, v):
            return sum(g.square().sum() for g in torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v))
        return torch.func.vmap(torch.func.grad(penalty, argnums=(0, 1, 2)))(*samples)

    _assert_all_close(per_sample(relpos_ext.rel_attention), per_sample(ref.shaw_attention))


@pytest.mark.parametrize("name", ["per_head_causal_offsets", "masks_window_segments", "dropout"])
def test_gradgradcheck_rel_attention(cpu_isa, name):
    """torch.autograd.gradgradcheck: the double backward against finite differences of the
    backward (fast mode: u^T J v for random u, v)."""
    args, kw = _jvp_case(name, d=4)
    args = tuple(a.requires_grad_() for a in args)
    fn = lambda *xs: _attention(relpos_ext.rel_attention, kw)(*xs)[0]  # noqa: E731
    assert torch.autograd.gradgradcheck(fn, args, fast_mode=True)


def test_third_derivative_rel_attention(cpu_isa):
    """create_graph=True through the double backward too: a third derivative, against the
    reference's."""
    args, kw = _jvp_case("per_head_causal_offsets", b=1, d=4)

    def third(impl):
        xs = [a.detach().requires_grad_() for a in args]
        out, _ = _attention(impl, kw)(*xs)
        (dq,) = torch.autograd.grad(out.sin().sum(), xs[0], create_graph=True)
        (ddk,) = torch.autograd.grad(dq.square().sum(), xs[1], create_graph=True)
        return torch.autograd.grad(ddk.sin().sum(), xs)

    _assert_all_close(third(relpos_ext.rel_attention), third(ref.shaw_attention))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_double_backward_rel_attention_low_precision(cpu_isa, dtype):
    """A gradient penalty's gradients for float32/bfloat16/float16 inputs (the second derivative
    computed in float32) against the float64 reference on the same rounded inputs, each in its
    input's dtype."""
    args, kw = _jvp_case("per_head_causal_offsets", d=64)
    args = tuple(a.to(dtype) for a in args)

    def second(impl, xs):
        xs = [a.detach().requires_grad_() for a in xs]
        out, _ = _attention(impl, kw)(*xs)
        grads = torch.autograd.grad(out.float().sin().sum(), xs, create_graph=True)
        penalty = sum(g.float().square().sum() for g in grads)
        return torch.autograd.grad(penalty, xs)

    got = second(relpos_ext.rel_attention, args)
    want = second(ref.shaw_attention, [a.double() for a in args])
    tol = {torch.float32: 2e-4, torch.bfloat16: 8e-2, torch.float16: 2e-2}[dtype]
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.isfinite(g).all()
        assert (g.double() - w).abs().max() <= tol * w.abs().max(), (dtype, g.shape)


def test_dropout_keep_row_start():
    """A block of rows and columns of the dropout mask, alone, is that block of the whole mask."""
    whole = ref.dropout_keep(5, 2, 3, 9, 7, 0.4)
    torch.testing.assert_close(ref.dropout_keep(5, 2, 3, 4, 7, 0.4, row_start=3), whole[:, :, 3:7])
    torch.testing.assert_close(ref.dropout_keep(5, 2, 3, 4, 3, 0.4, row_start=3, col_start=2),
                               whole[:, :, 3:7, 2:5])


# --------------------------------------------------------------------------- on a GPU
def _cuda_transform(case):
    """(function of CPU-or-CUDA tensors returning a tuple of tensors, its float64 inputs)."""
    torch.manual_seed(0)
    if case in ("jvp_rel_attention", "jvp_float32", "grad_of_jvp", "grad_of_grad", "hessian"):
        args, kw = _jvp_case("per_head_causal_offsets", d=16)
        n = len(args)
        fn = lambda *xs: _attention(relpos_ext.rel_attention, kw)(*xs)[0]  # noqa: E731
        if case == "hessian":  # of rel_bias: jacfwd of jacrev, the backward op's forward mode
            return (lambda *xs: (torch.func.hessian(lambda *ys: fn(*ys).sin().sum(),
                                                    argnums=5)(*xs),), args)
        if case == "grad_of_grad":
            def grad_of_grad(*xs):  # a gradient penalty's gradients, as autograd takes them
                xs = [a.detach().requires_grad_() for a in xs]
                grads = torch.autograd.grad(fn(*xs).sin().sum(), xs, create_graph=True)
                return torch.autograd.grad(sum(g.square().sum() for g in grads), xs)
            return grad_of_grad, args
        tangents = tuple(torch.randn_like(a) for a in args)
        if case == "grad_of_jvp":
            loss = lambda *xs: torch.func.jvp(fn, xs[:n], xs[n:])[1].sin().sum()  # noqa: E731
            return (lambda *xs: torch.func.grad(loss, argnums=tuple(range(n)))(*xs),
                    (*args, *tangents))
        return (lambda *xs: torch.func.jvp(fn, xs[:n], xs[n:]), (*args, *tangents))
    if case == "per_sample_grads":
        (q, k, v), tables, kw, _, _ = _per_sample_case("gqa_bias_rel_q")
        names = list(tables)

        def sample_loss(q, k, v, *tabs):
            return relpos_ext.rel_attention(q, k, v, **dict(zip(names, tabs)), **kw).sin().sum()

        per_sample = torch.func.vmap(torch.func.grad(sample_loss,
                                                     argnums=tuple(range(3 + len(names)))),
                                     in_dims=(0, 0, 0, *([None] * len(names))))
        return per_sample, (q, k, v, *tables.values())
    if case == "vmap_forward":
        ek, eb = _t(4, 5, 8), _t(5)
        fn = lambda q, k, v: relpos_ext.rel_attention(  # noqa: E731
            q, k, v, ek.to(q.device), ek[0].to(q.device), 2, return_lse=True,
            rel_bias=eb.to(q.device))
        return torch.func.vmap(fn, in_dims=(3, 4, 0)), (_t(2, 4, 5, 3, 8), _t(2, 2, 6, 8, 3),
                                                        _t(3, 2, 2, 6, 8))
    fn, _, shapes = JVP_OPS[case.removeprefix("jvp_")]
    n = len(shapes)
    return (lambda *xs: torch.func.jvp(fn, xs[:n], xs[n:]),
            tuple(_t(*s) for s in shapes + shapes))


CUDA_TRANSFORMS = ["jvp_rel_attention", "jvp_float32", "grad_of_jvp", "grad_of_grad", "hessian",
                   "per_sample_grads", "vmap_forward", *(f"jvp_{op}" for op in JVP_OPS)]


@pytest.mark.parametrize("case", CUDA_TRANSFORMS)
def test_transforms_cuda(case):
    """On a GPU (scripts/gpu_check.sh runs these): forward mode, reverse over forward, grad of
    grad, a hessian, per-sample gradients and vmap on CUDA tensors give what they give on the
    CPU, whose paths the tests above check against the reference. float64, and one float32 jvp
    against float64."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    fn, args = _cuda_transform(case)
    want = torch.utils._pytree.tree_leaves(fn(*args))
    if case == "jvp_float32":
        args = tuple(a.float() for a in args)
    got = torch.utils._pytree.tree_leaves(fn(*(a.cuda() for a in args)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device.type == "cuda" and g.dtype == args[0].dtype
        if g.dtype == F64:
            torch.testing.assert_close(g.cpu(), w, atol=1e-9, rtol=1e-9)
        else:
            torch.testing.assert_close(g.cpu().double(), w, rtol=1e-4,
                                       atol=2e-5 * max(w.abs().max().item(), 1.0))
