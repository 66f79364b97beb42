"""The wrappers' eager path (relpos_ext.ops._apply): in plain eager autograd each op runs through a
lean autograd.Function of the package's own (ops._EAGER_FUNCTIONS) and calls its kernel past the
dispatcher's autograd kernel, because torch.library's autograd kernel refills the schema's
defaults on every call at a cost quadratic in the schema's length. Whatever must see a call
before autograd does (autocast, torch function and dispatch modes, tensor subclasses) keeps the
dispatcher's path. Both paths must give the same results and gradients, bitwise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import relpos_ext
from relpos_ext import ops

K = 3


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_()

    return {
        "q": leaf(2, 2, 5, 8), "k": leaf(2, 2, 7, 8), "v": leaf(2, 2, 7, 8),
        "rel_k": leaf(2 * K + 1, 8), "rel_v": leaf(2, 2 * K + 1, 8), "rel_bias": leaf(2 * K + 1),
        "rel_q": leaf(2 * K + 1, 8), "x": leaf(2, 5, 11), "cos": torch.rand(5, 8, generator=g),
        "sin": torch.rand(5, 8, generator=g),
    }


# Each op by its wrapper and by torch.ops.relpos directly (the dispatcher's autograd kernel, as
# torch.compile and users of torch.ops see it), on the inputs of _inputs: (wrapper call, direct
# call, names of the inputs it differentiates).
def _rel_attention(t, direct):
    mask = torch.tensor([[False] * 6 + [True], [False] * 7])
    if direct:
        return torch.ops.relpos.rel_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], K,
                                              True, 0.3, 2, 0, mask, rel_bias=t["rel_bias"],
                                              rel_q=t["rel_q"])[0]
    return relpos_ext.rel_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], K, True, 0.3,
                                    2, 0, mask, rel_bias=t["rel_bias"], rel_q=t["rel_q"])


def _rel_logits(t, direct):
    f = torch.ops.relpos.rel_logits if direct else relpos_ext.rel_logits
    return f(t["q"], t["rel_v"], K, 7, 1, 0)


def _rel_gather(t, direct):
    f = torch.ops.relpos.rel_gather if direct else relpos_ext.rel_gather
    return f(t["rel_k"], 5, 7, K, 0, 2)


def _skew(t, direct):
    f = torch.ops.relpos.skew if direct else relpos_ext.skew
    return f(t["x"], False)


def _rope(t, direct):
    f = torch.ops.relpos.rope if direct else relpos_ext.rope
    return f(t["q"], t["cos"], t["sin"], False, False)


OPS: dict[str, tuple[Callable, str, tuple[str, ...]]] = {
    "rel_attention": (_rel_attention, "rel_attention",
                      ("q", "k", "v", "rel_k", "rel_v", "rel_bias", "rel_q")),
    "rel_logits": (_rel_logits, "rel_logits", ("q", "rel_v")),
    "rel_gather": (_rel_gather, "rel_gather", ("rel_k",)),
    "skew": (_skew, "skew", ("x",)),
    "rope": (_rope, "rope", ("q",)),
}


def _run(name: str, direct: bool, t: dict) -> tuple[torch.Tensor, list, str]:
    fn, _, wrt = OPS[name]
    out = fn(t, direct)
    grads = torch.autograd.grad(out, [t[w] for w in wrt], torch.ones_like(out))
    return out, list(grads), type(out.grad_fn).__name__


@pytest.mark.parametrize("name", OPS)
def test_eager_path_matches_the_dispatcher_bitwise(cpu_isa, name):
    """Wrapper (own Function, kernel below autograd) and torch.ops (torch.library's autograd
    kernel) give the same output and gradients, and each takes the path it should."""
    out, grads, node = _run(name, False, _inputs())
    out_d, grads_d, node_d = _run(name, True, _inputs())
    assert node == f"{OPS[name][1]}_eagerBackward"
    assert not node_d.startswith(OPS[name][1] + "_eager")
    torch.testing.assert_close(out, out_d, rtol=0, atol=0)
    for g, gd in zip(grads, grads_d):
        torch.testing.assert_close(g, gd, rtol=0, atol=0)


def test_eager_path_takes_parameters_and_gives_none_where_no_grad():
    """nn.Parameter tables stay on the eager path; an input that needs no gradient gets none."""
    t = _inputs()
    t["rel_k"] = torch.nn.Parameter(t["rel_k"].detach())
    t["k"] = t["k"].detach()
    out = _rel_attention(t, direct=False)
    assert type(out.grad_fn).__name__ == "rel_attention_eagerBackward"
    out.sum().backward()
    assert t["rel_k"].grad is not None and t["q"].grad is not None and t["k"].grad is None
    ref = _rel_attention({**t, "rel_k": t["rel_k"].detach().requires_grad_()}, direct=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_eager_path_without_grad_has_no_node():
    """Under no_grad (and with no input needing one) the kernel runs directly: no graph."""
    t = _inputs()
    with torch.no_grad():
        out = _rel_attention(t, direct=False)
    assert out.grad_fn is None
    plain = {n: x.detach() for n, x in t.items()}
    out2 = _rel_attention(plain, direct=False)
    assert out2.grad_fn is None
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_eager_path_double_backward():
    """create_graph=True: the backward op runs through its own eager Function, and the second
    derivative equals the one through torch.ops."""
    def second(direct: bool) -> list[torch.Tensor]:
        t = _inputs(1)
        out = _rel_attention(t, direct)
        gq, = torch.autograd.grad(out, t["q"], torch.ones_like(out), create_graph=True)
        return list(torch.autograd.grad((gq * gq).sum(), [t["q"], t["rel_k"], t["rel_v"]]))

    for a, b in zip(second(False), second(True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-6)


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_keeps_the_dispatcher_path():
    """A dispatch mode sees the op as it would through torch.ops; the graph is torch.library's."""
    t = _inputs()
    with _Recorder() as rec:
        out = _rel_attention(t, direct=False)
    assert any("relpos.rel_attention" in s for s in rec.seen)
    assert not type(out.grad_fn).__name__.startswith("rel_attention_eager")
    torch.testing.assert_close(out, _rel_attention(_inputs(), direct=True), rtol=0, atol=0)


def test_autocast_keeps_the_dispatcher_path():
    """Under autocast the inputs are cast before autograd records the op: the eager Function,
    which would record the uncast inputs, is not used."""
    t = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _rel_attention(t, direct=False)
    assert out.dtype == torch.bfloat16
    assert not type(out.grad_fn).__name__.startswith("rel_attention_eager")
    out.float().sum().backward()
    assert t["q"].grad.dtype == torch.float32


class _Sub(torch.Tensor):
    pass


def test_tensor_subclass_keeps_the_dispatcher_path():
    t = _inputs()
    q = t["q"].detach().as_subclass(_Sub).requires_grad_()
    assert not ops._plain_eager((q, t["k"]))
    out = relpos_ext.rel_attention(q, t["k"], t["v"], t["rel_k"], t["rel_v"], K)
    assert not type(out.grad_fn).__name__.startswith("rel_attention_eager")
    ref = relpos_ext.rel_attention(t["q"], t["k"], t["v"], t["rel_k"], t["rel_v"], K)
    torch.testing.assert_close(out.as_subclass(torch.Tensor), ref, rtol=0, atol=0)


def test_meta_tensors_keep_the_dispatcher_path():
    """Meta tensors (shapes only: the fake kernels) never take the eager path."""
    q = torch.empty(1, 2, 5, 8, device="meta", requires_grad=True)
    table = torch.empty(2 * K + 1, 8, device="meta", requires_grad=True)
    assert not ops._plain_eager((q, table))
    out = relpos_ext.rel_attention(q, q, q, table, table, K)
    assert out.shape == (1, 2, 5, 8) and out.device.type == "meta"


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:FutureWarning")  # deprecated, still used
def test_jit_trace_records_the_op():
    """torch.jit.trace records relpos::rel_attention as before, not the eager Function."""

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(2 * K + 1, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return relpos_ext.rel_attention(x, x, x, self.table, None, K)

    layer, q = Layer(), torch.randn(1, 2, 5, 8)
    traced = torch.jit.trace(layer, (q,), check_trace=False)
    graph = str(traced.graph)
    assert "relpos::rel_attention" in graph and "rel_attention_eager" not in graph
    torch.testing.assert_close(traced(q), layer(q), rtol=0, atol=0)
