"""gradcheck (float64, CPU), opcheck on every op, and torch.compile(fullgraph, dynamic)."""

from __future__ import annotations

import pytest
import torch

import relpos_ext
from relpos_ext import reference as ref


@pytest.fixture(params=["scalar", "avx2"])
def cpu_isa(request, monkeypatch):
    if request.param == "avx2" and "avx2" not in relpos_ext.build_info()["cpu_kernels"]:
        pytest.skip("AVX2 kernels not built")
    monkeypatch.setenv("RELPOS_CPU_ISA", request.param)
    return request.param


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
