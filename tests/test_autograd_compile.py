"""gradcheck (float64, CPU), opcheck on every op, and torch.compile(fullgraph, dynamic)."""

from __future__ import annotations

import pytest
import torch

import relpos_ext
from relpos_ext import reference as ref


def _f64(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


# --------------------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("offsets", [(0, 0), (2, -1)])
def test_gradcheck_rel_gather(per_head, offsets):
    table = _f64(*((2,) if per_head else ()), 5, 3)
    fn = lambda t: relpos_ext.rel_gather(t, 4, 6, 2, *offsets)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (table,))
    assert torch.autograd.gradgradcheck(fn, (table,))


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_skew(causal):
    x = _f64(2, 4, 4 if causal else 8)
    assert torch.autograd.gradcheck(lambda t: relpos_ext.skew(t, causal), (x,))
    assert torch.autograd.gradgradcheck(lambda t: relpos_ext.skew(t, causal), (x,))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("k,lk,offsets", [(2, 6, (0, 0)), (5, 5, (0, 0)), (1, 4, (3, 1))])
def test_gradcheck_rel_logits(per_head, k, lk, offsets):
    q = _f64(2, 2, 4, 5)
    table = _f64(*((2,) if per_head else ()), 2 * k + 1, 5)
    fn = lambda a, b: relpos_ext.rel_logits(a, b, k, lk, *offsets)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, table))
    assert torch.autograd.gradgradcheck(fn, (q, table))


# ----------------------------------------------------------------------------------- opcheck
def _opcheck_cases(requires_grad: bool):
    rg = requires_grad
    t = lambda *s: torch.randn(*s, requires_grad=rg)  # noqa: E731
    return [
        ("rel_gather", (t(5, 8), 4, 6, 2, 1, 0)),
        ("rel_gather", (t(3, 5, 8), 3, 3, 2, 0, 0)),
        ("rel_gather_backward", (t(4, 6, 8), 2, 1, 0)),
        ("skew", (t(2, 3, 4, 9), False)),
        ("skew", (t(2, 5, 5), True)),
        ("skew_backward", (t(2, 4, 6), False)),
        ("skew_backward", (t(3, 4, 4), True)),
        ("skew_backward", (t(2, 0, 0), False)),  # no rows, no keys: Lq + Lk - 1 clamps to 0
        ("skew_backward", (t(2, 0, 3), False)),
        ("rel_logits", (t(2, 3, 5, 8), t(7, 8), 3, 6, 0, 2)),
        ("rel_logits", (t(1, 3, 4, 8), t(3, 5, 8), 2, 4, 0, 0)),
        ("rel_logits_backward", (t(2, 3, 5, 6), t(2, 3, 5, 8), t(7, 8), 3, 0, 2)),
    ]


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(cpu_isa, requires_grad):
    for name, args in _opcheck_cases(requires_grad):
        op = getattr(torch.ops.relpos, name).default
        torch.library.opcheck(op, args)


# ----------------------------------------------------------------------------- torch.compile
class TinyRelModel(torch.nn.Module):
    """Uses all three ops: rel_logits (key term), skew (Music Transformer logits), rel_gather."""

    def __init__(self, dim: int = 8, k: int = 3) -> None:
        super().__init__()
        self.k = k
        self.rel = torch.nn.Parameter(torch.randn(2 * k + 1, dim))
        self.music = torch.nn.Parameter(torch.randn(64, dim))  # covers distances up to L = 32

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        length = q.shape[2]
        s = relpos_ext.rel_logits(q, self.rel, self.k, length)
        e = self.music[32 - length : 31 + length]  # rows for distances -(L-1)..L-1
        s = s + relpos_ext.skew(torch.matmul(q, e.transpose(0, 1)))
        a = relpos_ext.rel_gather(self.rel, length, length, self.k)
        return torch.softmax(s, -1) + torch.einsum("bhid,ijd->bhij", q, a)


def test_compile_fullgraph_dynamic_matches_eager(cpu_isa):
    torch._dynamo.reset()
    model = TinyRelModel()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for length in (5, 7, 12):
        q = torch.randn(2, 2, length, 8, requires_grad=True)
        eager = model(q)
        got = compiled(q)
        torch.testing.assert_close(got, eager)
        (g_eager,) = torch.autograd.grad(eager.sum(), q)
        (g_got,) = torch.autograd.grad(compiled(q).sum(), q)
        torch.testing.assert_close(g_got, g_eager)


def test_compile_without_graph_breaks():
    torch._dynamo.reset()
    model = TinyRelModel()
    explanation = torch._dynamo.explain(model)(torch.randn(1, 2, 6, 8))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


# --------------------------------------------------------------------------------- nn module
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_shaw_module_matches_reference(cpu_isa, causal, per_head):
    m = relpos_ext.nn.ShawRelativeAttention(32, 4, 3, causal=causal, per_head_tables=per_head)
    x = torch.randn(2, 9, 32)
    got = m(x)
    b, length, _ = x.shape
    q, k, v = m.qkv(x).view(b, length, 3, 4, 8).permute(2, 0, 3, 1, 4)
    z = ref.shaw_attention(q, k, v, m.rel_k, m.rel_v, 3, causal=causal)
    expected = m.out_proj(z.transpose(1, 2).reshape(b, length, 32))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert m.rel_k.grad is not None and m.rel_v.grad is not None


def test_shaw_module_dropout():
    """dropout= drops attention probabilities in training mode only: two training calls differ,
    eval() calls equal the module without dropout."""
    m = relpos_ext.nn.ShawRelativeAttention(32, 4, 3, dropout=0.5)
    x = torch.randn(2, 9, 32)
    assert not torch.equal(m(x), m(x))
    m.eval()
    undropped = m(x)
    m.dropout = 0.0
    m.train()
    assert torch.equal(m(x), undropped)


# --------------------------------------------------------------------------------- autocast
# Under torch.autocast the ops with several floating inputs cast them to the autocast dtype
# (csrc/autocast.cpp): the results and the gradients of the float32 leaves must be exactly those
# of casting by hand outside autocast.
def _attention_inputs():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 16, requires_grad=True)
    k = torch.randn(2, 2, 11, 16, requires_grad=True)
    v = torch.randn(2, 2, 11, 16, requires_grad=True)
    rel_k = torch.randn(4, 7, 16, requires_grad=True)  # per-head
    rel_v = torch.randn(7, 16, requires_grad=True)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 8:] = True
    return (q, k, v, rel_k, rel_v), mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_rel_attention_casts_like_by_hand(cpu_isa, dtype):
    leaves, mask = _attention_inputs()
    kwargs = dict(max_distance=3, causal=True, q_offset=2, key_padding_mask=mask, return_lse=True)
    with torch.autocast("cpu", dtype=dtype):
        out, lse = relpos_ext.rel_attention(*leaves, **kwargs)
    want, want_lse = relpos_ext.rel_attention(*(t.to(dtype) for t in leaves), **kwargs)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    go = torch.randn_like(want)
    grads = torch.autograd.grad(out, leaves, go)
    want_grads = torch.autograd.grad(want, leaves, go)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_rel_logits_casts_like_by_hand(cpu_isa, dtype):
    q = torch.randn(2, 3, 6, 8, requires_grad=True)
    table = torch.randn(3, 5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        got = relpos_ext.rel_logits(q, table, 2, 7, 1, 0)
    want = relpos_ext.rel_logits(q.to(dtype), table.to(dtype), 2, 7, 1, 0)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    go = torch.randn_like(want)
    grads = torch.autograd.grad(got, (q, table), go)
    for g, w in zip(grads, torch.autograd.grad(want, (q, table), go)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_autocast_leaves_float64_alone():
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    table = torch.randn(5, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = relpos_ext.rel_attention(q, q, q, table, table, 2)
    assert out.dtype == torch.float64
    want = relpos_ext.rel_attention(q, q, q, table, table, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_autocast_registered_for_cuda_too():
    # the same template as the CPU kernels; it cannot run without a CUDA device
    for op in ("relpos::rel_attention", "relpos::rel_logits"):
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)


def test_autocast_module_compiled_fullgraph_dynamic(cpu_isa):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = relpos_ext.nn.RelativeMultiheadAttention(32, 4, 3, batch_first=True)
    compiled = torch.compile(m, fullgraph=True, dynamic=True)
    for length in (6, 9):
        x = torch.randn(2, length, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager, _ = m(x, x, x, need_weights=False)
            got, _ = compiled(x, x, x, need_weights=False)
        assert got.dtype == eager.dtype == torch.bfloat16
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
        want_grads = torch.autograd.grad(eager.float().sum(), (m.rel_k, m.rel_v))
        grads = torch.autograd.grad(got.float().sum(), (m.rel_k, m.rel_v))
        for g, w in zip(grads, want_grads):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------ torch.export, AOTInductor
class ExportModel(torch.nn.Module):
    """All four ops with a dynamic length: TinyRelModel's three and ``rel_attention`` with every
    optional tensor (tables, bias, key-side table, padding mask) and offsets."""

    def __init__(self, dim: int = 8, k: int = 3) -> None:
        super().__init__()
        self.tiny = TinyRelModel(dim, k)
        self.k = k
        self.rel_k = torch.nn.Parameter(torch.randn(2 * k + 1, dim))
        self.rel_v = torch.nn.Parameter(torch.randn(2, 2 * k + 1, dim))
        self.rel_q = torch.nn.Parameter(torch.randn(2 * k + 1, dim))
        self.rel_bias = torch.nn.Parameter(torch.randn(2, 2 * k + 1))

    def forward(self, q: torch.Tensor, kv: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        out, _ = relpos_ext.rel_attention(
            q, kv, kv.flip(-1), self.rel_k, self.rel_v, self.k, causal=True, q_offset=1,
            key_padding_mask=pad, rel_bias=self.rel_bias, rel_q=self.rel_q,
        )
        return out + self.tiny(q).sum(-1, keepdim=True)


def _export_inputs(length: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, 2, length, 8)
    kv = torch.randn(2, 1, length + 1, 8)
    pad = torch.zeros(2, length + 1, dtype=torch.bool)
    pad[1, -2:] = True
    return q, kv, pad


def _export(model: torch.nn.Module) -> torch.export.ExportedProgram:
    length = torch.export.Dim("length", min=2, max=31)
    shapes = {"q": {2: length}, "kv": {2: length + 1}, "pad": {1: length + 1}}
    return torch.export.export(model, _export_inputs(5), dynamic_shapes=shapes)


def test_export_dynamic_matches_eager(cpu_isa, tmp_path):
    torch.manual_seed(0)
    model = ExportModel()
    program = _export(model)
    ops = {str(n.target) for n in program.run_decompositions().graph.nodes}
    names = ("rel_attention", "rel_logits", "skew", "rel_gather")
    assert {f"relpos.{name}.default" for name in names} <= ops, ops  # kept whole, not decomposed
    torch.export.save(program, tmp_path / "model.pt2")
    for exported in (program.module(), torch.export.load(tmp_path / "model.pt2").module()):
        for length in (5, 12):
            inputs = _export_inputs(length)
            torch.testing.assert_close(exported(*inputs), model(*inputs), rtol=0, atol=0)
    # the exported graph differentiates through the ops' autograd
    inputs = _export_inputs(7)
    exported = program.module()
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in exported.named_parameters()]
    want = torch.autograd.grad(model(*inputs).square().sum(), list(model.parameters()))
    got = torch.autograd.grad(exported(*inputs).square().sum(), list(exported.parameters()))
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_aoti_package_matches_eager(tmp_path):
    # AOTInductor compiles the exported graph to C++ that calls the ops through torch's proxy
    # executor: a deployment without Python's op registration beyond loading the library
    torch.manual_seed(0)
    model = ExportModel().eval()
    path = torch._inductor.aoti_compile_and_package(
        _export(model), package_path=str(tmp_path / "model_aoti.pt2")
    )
    compiled = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        for length in (5, 12):
            inputs = _export_inputs(length)
            torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-6, atol=1e-6)
