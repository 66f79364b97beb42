"""Typed Python entry points of the ``torch.ops.relpos`` operators.

Each op has: a wrapper with a docstring, a fake (meta) kernel for ``torch.compile`` and
``torch.library.opcheck``, and, where differentiable, autograd through a backward that is itself
a ``relpos`` op. Conventions (DESIGN.md §1): ``r = pos_k - pos_q`` with ``pos_q(i) = q_offset + i``
and ``pos_k(j) = k_offset + j``; ``bucket = clamp(r, -K, K) + K`` with ``K = max_distance``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, overload

import torch
from torch import Tensor
from torch.autograd import forward_ad as _fwAD

from . import _C  # noqa: F401  (loading the module registers torch.ops.relpos.*)
from . import reference

__all__ = [
    "rel_gather",
    "rel_gather_backward",
    "skew",
    "skew_backward",
    "rel_logits",
    "rel_logits_backward",
    "rel_attention",
    "rel_attention_backward",
    "rope",
]

IntLike = int | torch.SymInt  # torch.SymInt under torch.compile with dynamic shapes


# torch.library.register_autograd builds an autograd.Function whose forward takes ctx, a form
# torch.func's transforms (grad, vjp, jacrev, vmap over grad: per-sample gradients) refuse
# ("must override the setup_context staticmethod", pytorch/pytorch#168393), and it has no
# forward-mode derivative: a dual tensor's tangent was silently dropped. So each op's
# setup_context and backward are registered twice: with torch.library, for autograd,
# torch.compile and opcheck, and in a Function of the form torch.func takes, which _apply uses
# only while one of its transforms or forward-mode AD (torch.autograd.forward_ad) is active
# (never while compiling: torch.compile traces the op itself, and where forward-mode AD is
# active there, _apply breaks the graph). Both run the same two functions, so there is one
# backward per op. The Function also carries the op's jvp, where it has one.
_FUNC_FUNCTIONS: dict[Any, type[torch.autograd.Function]] = {}
# The same two functions once more, in a leaner Function that _apply takes in plain eager
# autograd (_plain_eager): torch.library's autograd kernel refills the schema's defaults on every
# call by a loop that is quadratic in the schema's length (torch's fill_defaults reads
# schema.arguments, a fresh list of every argument, once per argument): 75 us a rel_attention
# forward on the CPU, where the kernel of a small call takes 7.
_EAGER_FUNCTIONS: dict[Any, type[torch.autograd.Function]] = {}
# private in torch (every version we admit has it); were it gone, no transform would be seen
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_SAVED = object()  # marks, in a Function's ctx.jvp_values, an entry kept by save_for_forward


def _forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (a module global of torch's)."""
    return getattr(_fwAD, "_current_level", -1) >= 0


def _register_autograd(op: Any, backward: Any, setup_context: Any, jvp: Any) -> None:
    """``torch.library.register_autograd(op, backward, setup_context=...)``, and the same two
    functions as ``op``'s Function for torch.func and forward-mode AD (:func:`_apply`).

    ``jvp(inputs, outputs, tangents)`` gives the outputs' tangents (a tuple when the op returns
    one) from the inputs' (None where an input has none)."""
    torch.library.register_autograd(op, backward, setup_context=setup_context)
    name = op._opname

    class _Function(torch.autograd.Function):
        generate_vmap_rule = True  # vmap of forward/backward/jvp: the ops' own batching

        @staticmethod
        def forward(*args: Any) -> Any:
            # Runs below the transforms, on plain (or vmap-batched) tensors: the op itself.
            return op(*args)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
            setup_context(ctx, inputs, output)
            # jvp reads inputs and outputs back from save_for_forward (saved_tensors there);
            # the rest of them, non-tensors or None, ride in ctx.jvp_values.
            values = (*inputs, *(output if isinstance(output, tuple) else (output,)))
            ctx.jvp_values = tuple(_SAVED if isinstance(x, Tensor) else x for x in values)
            ctx.jvp_inputs = len(inputs)
            ctx.save_for_forward(*(x for x in values if isinstance(x, Tensor)))

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            return backward(ctx, *grads)

        @staticmethod
        def jvp(ctx: Any, *tangents: Any) -> Any:
            saved = iter(ctx.saved_tensors)
            values = tuple(next(saved) if x is _SAVED else x for x in ctx.jvp_values)
            return jvp(values[:ctx.jvp_inputs], values[ctx.jvp_inputs:], tangents)

    _Function.__name__ = f"{name}_function"
    _FUNC_FUNCTIONS[op] = _Function

    def eager_forward(ctx: Any, *args: Any) -> Any:
        with _below_autograd():
            output = op(*args)
        setup_context(ctx, args, output)
        return output

    # made by type() so that its graph node is named after the op: <name>_eagerBackward
    _EAGER_FUNCTIONS[op] = type(f"{name}_eager", (torch.autograd.Function,), {
        "forward": staticmethod(eager_forward),
        "backward": staticmethod(backward),
    })


# Tensor types _plain_eager admits: a Parameter (a learnable table) dispatches as a Tensor does;
# other subclasses (DTensor, fake or functional tensors) keep the dispatcher's path.
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
# The argument types of a usual call, checked by one set lookup each (0.5 us for rel_attention's
# 20 arguments, where isinstance(x, Tensor), which goes through Tensor's metaclass, takes 1.3):
# any other type takes the isinstance loop.
_PLAIN_ARG_TYPES = frozenset((*_PLAIN_TENSORS, int, float, bool, type(None)))
# Dispatches past the autograd keys, to the kernel (torch.library's own autograd kernels use it
# to redispatch). It and the three queries _plain_eager asks are private in torch, as
# _transforms_active: were one of them gone, _plain_eager would always say no.
_below_autograd = (torch._C._AutoDispatchBelowAutograd
                   if all(hasattr(torch._C, n) for n in ("_AutoDispatchBelowAutograd",
                                                          "_is_torch_function_mode_enabled",
                                                          "_len_torch_dispatch_stack",
                                                          "_get_tracing_state"))
                   else None)


def _plain_eager(args: tuple) -> bool:
    """Whether an op's call on ``args`` (outside torch.compile and torch.func) may skip the
    dispatcher's autograd kernel: every tensor argument plain, and nothing that should see the
    call before autograd does (autocast casts the inputs first; a torch function or dispatch
    mode may replace the call; torch.jit.trace would record the Function in the op's place).
    :func:`_apply` then runs the op's :data:`_EAGER_FUNCTIONS` entry when a gradient is needed,
    the kernel directly when not."""
    if _below_autograd is None or not (args[0].is_cpu or args[0].is_cuda):  # meta: fake
        return False
    if not _PLAIN_ARG_TYPES.issuperset(map(type, args)):
        for x in args:
            if isinstance(x, Tensor) and type(x) not in _PLAIN_TENSORS:
                return False
    return (not torch.is_autocast_enabled("cuda" if args[0].is_cuda else "cpu")
            and not torch._C._is_torch_function_mode_enabled()
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._get_tracing_state() is None)  # torch.jit.trace records the op itself


def _apply(op: Any, *args: Any) -> Any:
    """``op(*args)``, through its Function while a torch.func transform or forward AD is active,
    past the dispatcher's autograd kernel in plain eager calls (:func:`_plain_eager`)."""
    if getattr(args[0], "is_nested", False):  # q, table, x or grad
        # the dispatcher would say only "NotImplementedError: relpos.<op>.default"
        if op is torch.ops.relpos.rope.default:
            hint = ("rotate the packed tokens, x.values() [total, ..., D], with cos and sin "
                    "made from each token's own position")
        else:
            hint = ("pack the sequences into one call with q_segment_ids / k_segment_ids "
                    "(packed documents, O(sum L^2)), or pad them and pass key_padding_mask")
        raise NotImplementedError(
            f"relpos::{op._opname} does not take nested (jagged) tensors: {hint}")
    if torch.compiler.is_compiling():
        if _forward_ad_active():
            # Traced, the op would get a zero tangent (a torch.library op has no forward-mode
            # formula), silently. Raising makes Dynamo break the graph here and run the op
            # eagerly, through its Function; under fullgraph=True the compile fails with this.
            raise NotImplementedError(
                f"{op._opname}: forward-mode AD (torch.func.jvp, jacfwd, forward_ad) of a relpos "
                "op cannot be traced by torch.compile; without fullgraph=True the op runs "
                "eagerly, or call torch.func.jvp outside torch.compile"
            )
        return op(*args)
    if _transforms_active() or _forward_ad_active():
        return _FUNC_FUNCTIONS[op].apply(*args)
    if _plain_eager(args):
        # (every tensor argument is one of _PLAIN_TENSORS here)
        if torch.is_grad_enabled() and any(x.requires_grad for x in args if type(x) in _PLAIN_TENSORS):
            return _EAGER_FUNCTIONS[op].apply(*args)
        with _below_autograd():
            return op(*args)
    return op(*args)


def _add(*terms: Tensor | None) -> Tensor | None:
    """The sum of the terms that are not None (None if all are): tangents of absent inputs."""
    present = [t for t in terms if t is not None]
    return sum(present[1:], present[0]) if present else None


def _concat_pairs(pairs: list) -> tuple[Tensor | None, Tensor | None]:
    """``sum_p x_p . y_p`` as one product ``[x_1 | x_2 ..] . [y_1 | y_2 ..]``: the pairs with
    both factors present, concatenated along the features (None, None if there are none)."""
    pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
    if len(pairs) <= 1:
        return pairs[0] if pairs else (None, None)
    return torch.cat([x for x, _ in pairs], -1), torch.cat([y for _, y in pairs], -1)


def _linear_jvp(op: Any) -> Any:
    """The jvp of an op linear in its first argument (rel_gather, skew and their adjoints).
    Like every jvp here it calls the ops through _apply, so that transforms above the jvp
    (torch.func.grad of a jvp: reverse over forward) differentiate them."""
    def jvp(inputs: tuple, outputs: tuple, tangents: tuple) -> Tensor | None:
        return None if tangents[0] is None else _apply(op, tangents[0], *inputs[1:])
    return jvp


# --------------------------------------------------------------------------- rel_gather
def rel_gather(
    table: Tensor,
    q_len: IntLike,
    k_len: IntLike,
    max_distance: IntLike,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
) -> Tensor:
    """Gather relative embeddings: ``A[(h,) i, j, :] = table[(h,) bucket(i, j), :]``.

    Args:
        table: ``[2K+1, D]`` (shared by all heads) or ``[H, 2K+1, D]`` (per head).
        q_len, k_len: number of queries ``Lq`` and keys ``Lk``.
        max_distance: ``K``; distances are clipped to ``[-K, K]``.
        q_offset, k_offset: absolute position of query 0 and key 0.

    Returns:
        ``[Lq, Lk, D]`` or ``[H, Lq, Lk, D]``. This is the O(L^2 D) form; prefer
        :func:`rel_logits` for attention logits. Differentiable w.r.t. ``table`` (a
        deterministic scatter-add).
    """
    return _apply(
        torch.ops.relpos.rel_gather.default, table, q_len, k_len, max_distance, q_offset, k_offset
    )


def rel_gather_backward(
    grad: Tensor, max_distance: IntLike, q_offset: IntLike = 0, k_offset: IntLike = 0
) -> Tensor:
    """Adjoint of :func:`rel_gather`: sum ``grad [(H,) Lq, Lk, D]`` into ``[(H,) 2K+1, D]``."""
    return _apply(
        torch.ops.relpos.rel_gather_backward.default, grad, max_distance, q_offset, k_offset
    )


@torch.library.register_fake("relpos::rel_gather")
def _rel_gather_fake(table, q_len, k_len, max_distance, q_offset=0, k_offset=0):
    torch._check(table.dim() in (2, 3), lambda: f"table must be 2-D or 3-D, got {table.dim()}-D")
    torch._check(max_distance >= 0, lambda: "max_distance must be >= 0")
    torch._check(table.shape[-2] == 2 * max_distance + 1, lambda: "table must have 2K+1 rows")
    return table.new_empty((*table.shape[:-2], q_len, k_len, table.shape[-1]))


@torch.library.register_fake("relpos::rel_gather_backward")
def _rel_gather_backward_fake(grad, max_distance, q_offset=0, k_offset=0):
    torch._check(grad.dim() in (3, 4), lambda: f"grad must be 3-D or 4-D, got {grad.dim()}-D")
    torch._check(max_distance >= 0, lambda: "max_distance must be >= 0")
    return grad.new_empty((*grad.shape[:-3], 2 * max_distance + 1, grad.shape[-1]))


def _rel_gather_setup(ctx, inputs, output) -> None:
    _, ctx.q_len, ctx.k_len, ctx.max_distance, ctx.q_offset, ctx.k_offset = inputs


def _rel_gather_bwd(ctx, grad: Tensor):
    dtable = rel_gather_backward(grad, ctx.max_distance, ctx.q_offset, ctx.k_offset)
    return dtable, None, None, None, None, None


def _rel_gather_backward_setup(ctx, inputs, output) -> None:
    grad, ctx.max_distance, ctx.q_offset, ctx.k_offset = inputs
    ctx.q_len, ctx.k_len = grad.shape[-3], grad.shape[-2]


def _rel_gather_backward_bwd(ctx, ggrad: Tensor):
    # rel_gather_backward is linear; its adjoint is rel_gather (double backward).
    g = rel_gather(ggrad, ctx.q_len, ctx.k_len, ctx.max_distance, ctx.q_offset, ctx.k_offset)
    return g, None, None, None


_register_autograd(
    torch.ops.relpos.rel_gather.default, _rel_gather_bwd, setup_context=_rel_gather_setup,
    jvp=_linear_jvp(torch.ops.relpos.rel_gather.default),
)
_register_autograd(
    torch.ops.relpos.rel_gather_backward.default,
    _rel_gather_backward_bwd,
    setup_context=_rel_gather_backward_setup,
    jvp=_linear_jvp(torch.ops.relpos.rel_gather_backward.default),
)


# --------------------------------------------------------------------------- skew
def skew(x: Tensor, causal: bool = False) -> Tensor:
    """Music Transformer skew (Huang et al. 2018): ``y[..., i, j] = x[..., i, j - i + Lq - 1]``.

    Args:
        x: ``[..., Lq, Lq+Lk-1]`` relative logits, column ``c`` holding distance ``c - (Lq-1)``;
            with ``causal=True``, ``[..., L, L]`` holding distances ``-(L-1)..0``.
        causal: the paper's masked form: lower-triangular result, zeros above the diagonal.

    Returns:
        ``[..., Lq, Lk]`` absolute-position logits, bit-identical to tensor2tensor's
        pad/reshape/slice on the same input (see :func:`relpos_ext.reference.skew_t2t`).
    """
    return _apply(torch.ops.relpos.skew.default, x, causal)


def skew_backward(grad: Tensor, causal: bool = False) -> Tensor:
    """Adjoint of :func:`skew` ("unskew"): ``[..., Lq, Lk]`` -> ``[..., Lq, Lq+Lk-1]``."""
    return _apply(torch.ops.relpos.skew_backward.default, grad, causal)


@torch.library.register_fake("relpos::skew")
def _skew_fake(x, causal=False):
    torch._check(x.dim() >= 2, lambda: "x must have at least 2 dims")
    q_len, width = x.shape[-2], x.shape[-1]
    if causal:
        torch._check(width == q_len, lambda: "causal skew needs a square x")
        return x.new_empty(x.shape)
    torch._check(width - q_len + 1 >= 0, lambda: "x must be [..., Lq, Lq+Lk-1]")
    return x.new_empty((*x.shape[:-1], width - q_len + 1))


@torch.library.register_fake("relpos::skew_backward")
def _skew_backward_fake(grad, causal=False):
    torch._check(grad.dim() >= 2, lambda: "grad must have at least 2 dims")
    q_len, k_len = grad.shape[-2], grad.shape[-1]
    if causal:
        torch._check(q_len == k_len, lambda: "causal skew_backward needs a square grad")
        return grad.new_empty(grad.shape)
    return grad.new_empty((*grad.shape[:-1], torch.sym_max(q_len + k_len - 1, 0)))


def _skew_setup(ctx, inputs, output) -> None:
    ctx.causal = inputs[1]


_register_autograd(
    torch.ops.relpos.skew.default,
    lambda ctx, g: (skew_backward(g, ctx.causal), None),
    setup_context=_skew_setup,
    jvp=_linear_jvp(torch.ops.relpos.skew.default),
)
def _skew_backward_setup(ctx, inputs, output) -> None:
    ctx.causal, ctx.k_len = inputs[1], inputs[0].shape[-1]


def _skew_backward_bwd(ctx, g: Tensor):
    if g.shape[-2] == 0:  # no rows: the width max(Lq + Lk - 1, 0) = 0 does not tell Lk = 0 from 1
        return g.new_zeros((*g.shape[:-1], ctx.k_len)), None
    return skew(g, ctx.causal), None


_register_autograd(
    torch.ops.relpos.skew_backward.default,
    _skew_backward_bwd,
    setup_context=_skew_backward_setup,
    jvp=_linear_jvp(torch.ops.relpos.skew_backward.default),
)


# --------------------------------------------------------------------------- rel_logits
def rel_logits(
    q: Tensor,
    table: Tensor,
    max_distance: IntLike,
    k_len: IntLike,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
) -> Tensor:
    """Relative logits by the fused skewed matmul: ``S[b, h, i, j] = q[b, h, i] . table[bucket(i, j)]``.

    Never materialises ``[Lq, Lk, D]``: each query row takes one dot product per reachable
    bucket and the skew places them. Works for clipped tables (``2K+1 << Lk``) and for the
    unclipped Music Transformer case (``K >= max(Lq, Lk) - 1``).

    Args:
        q: ``[B, H, Lq, D]``.
        table: ``[2K+1, D]`` or ``[H, 2K+1, D]``, same dtype and device as ``q`` (under
            ``torch.autocast`` both are cast to the autocast dtype first).
        max_distance: ``K``.
        k_len: number of keys ``Lk``.
        q_offset, k_offset: absolute position of query 0 and key 0.

    Returns:
        ``[B, H, Lq, Lk]``. Differentiable w.r.t. ``q`` and ``table``.
    """
    return _apply(
        torch.ops.relpos.rel_logits.default, q, table, max_distance, k_len, q_offset, k_offset
    )


def rel_logits_backward(
    grad: Tensor,
    q: Tensor,
    table: Tensor,
    max_distance: IntLike,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`rel_logits`: ``(dq [B, H, Lq, D], dtable like table)``.

    Uses O(Lq * (Lq + Lk)) extra memory (per-row bucket sums of ``grad``), never ``[Lq, Lk, D]``.
    """
    return _apply(
        torch.ops.relpos.rel_logits_backward.default,
        grad, q, table, max_distance, q_offset, k_offset
    )


@torch.library.register_fake("relpos::rel_logits")
def _rel_logits_fake(q, table, max_distance, k_len, q_offset=0, k_offset=0):
    torch._check(q.dim() == 4, lambda: f"q must be [B, H, Lq, D], got {q.dim()}-D")
    torch._check(table.dim() in (2, 3), lambda: "table must be 2-D or 3-D")
    torch._check(table.dtype == q.dtype, lambda: "table dtype must match q dtype")
    torch._check(table.device == q.device, lambda: "table must be on the device of q")
    torch._check(table.shape[-1] == q.shape[-1], lambda: "table's last dim must equal D")
    torch._check(table.shape[-2] == 2 * max_distance + 1, lambda: "table must have 2K+1 rows")
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], k_len))


@torch.library.register_fake("relpos::rel_logits_backward")
def _rel_logits_backward_fake(grad, q, table, max_distance, q_offset=0, k_offset=0):
    torch._check(grad.dim() == 4, lambda: "grad must be [B, H, Lq, Lk]")
    torch._check(
        grad.device == q.device and table.device == q.device,
        lambda: "grad, q and table must be on one device",
    )
    return torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        table, memory_format=torch.contiguous_format
    )


def _rel_logits_setup(ctx, inputs, output) -> None:
    q, table, ctx.max_distance, _, ctx.q_offset, ctx.k_offset = inputs
    ctx.save_for_backward(q, table)


def _rel_logits_bwd(ctx, grad: Tensor):
    q, table = ctx.saved_tensors
    dq, dtable = rel_logits_backward(grad, q, table, ctx.max_distance, ctx.q_offset, ctx.k_offset)
    return dq, dtable, None, None, None, None


def _rel_logits_backward_setup(ctx, inputs, output) -> None:
    grad, q, table, ctx.max_distance, ctx.q_offset, ctx.k_offset = inputs
    ctx.save_for_backward(grad, q, table)


def _rel_logits_backward_bwd(ctx, ddq: Tensor | None, ddtable: Tensor | None):
    # (dq, dtable) is bilinear in (grad, q) and (grad, table): differentiate each side with the
    # same ops (double backward, e.g. for gradient penalties).
    grad, q, table = ctx.saved_tensors
    k, qo, ko = ctx.max_distance, ctx.q_offset, ctx.k_offset
    k_len = grad.shape[-1]
    dgrad = torch.zeros_like(grad)
    dq = torch.zeros_like(q)
    dtable = torch.zeros_like(table)
    if ddq is not None:
        dgrad = dgrad + rel_logits(ddq.contiguous(), table, k, k_len, qo, ko)
        dtable = dtable + rel_logits_backward(grad, ddq.contiguous(), table, k, qo, ko)[1]
    if ddtable is not None:
        dgrad = dgrad + rel_logits(q, ddtable.contiguous(), k, k_len, qo, ko)
        dq = dq + rel_logits_backward(grad, q, ddtable.contiguous(), k, qo, ko)[0]
    return dgrad, dq, dtable, None, None, None


def _rel_logits_jvp(inputs: tuple, outputs: tuple, tangents: tuple) -> Tensor | None:
    # bilinear in (q, table)
    q, table, *rest = inputs
    tq, ttable = tangents[:2]
    return _add(None if tq is None else rel_logits(tq, table, *rest),
                None if ttable is None else rel_logits(q, ttable, *rest))


def _rel_logits_backward_jvp(inputs: tuple, outputs: tuple, tangents: tuple):
    # dq is bilinear in (grad, table), dtable in (grad, q)
    grad, q, table, *rest = inputs
    tgrad, tq, ttable = tangents[:3]
    op = rel_logits_backward
    by_grad = (None, None) if tgrad is None else op(tgrad, q, table, *rest)
    dq = None if ttable is None else op(grad, q, ttable, *rest)[0]
    dtable = None if tq is None else op(grad, tq, table, *rest)[1]
    return _add(by_grad[0], dq), _add(by_grad[1], dtable)


_register_autograd(
    torch.ops.relpos.rel_logits.default, _rel_logits_bwd, setup_context=_rel_logits_setup,
    jvp=_rel_logits_jvp,
)
_register_autograd(
    torch.ops.relpos.rel_logits_backward.default,
    _rel_logits_backward_bwd,
    setup_context=_rel_logits_backward_setup,
    jvp=_rel_logits_backward_jvp,
)


# --------------------------------------------------------------------------- rel_attention
# The overloads give type checkers the result's type from return_lse: the output alone, or
# (output, log-sum-exp).
@overload
def rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None = None,
    rel_v: Tensor | None = None,
    max_distance: IntLike = 0,
    causal: bool = False,
    scale: float | None = None,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
    key_padding_mask: Tensor | None = None,
    return_lse: Literal[False] = False,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> Tensor: ...


@overload
def rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None = None,
    rel_v: Tensor | None = None,
    max_distance: IntLike = 0,
    causal: bool = False,
    scale: float | None = None,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
    key_padding_mask: Tensor | None = None,
    *,
    return_lse: Literal[True],
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> tuple[Tensor, Tensor]: ...


@overload
def rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None = None,
    rel_v: Tensor | None = None,
    max_distance: IntLike = 0,
    causal: bool = False,
    scale: float | None = None,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]: ...


def rel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None = None,
    rel_v: Tensor | None = None,
    max_distance: IntLike = 0,
    causal: bool = False,
    scale: float | None = None,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
    key_padding_mask: Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused Shaw et al. (2018) attention with relative key and value embeddings, O(L) memory.

    ``s_ij = (q_i . k_j + q_i . rel_k[b] + k_j . rel_q[b]) * scale + rel_bias[b]`` with
    ``b = b(i, j)``, ``p = softmax_j(s)``,
    ``out_i = sum_j p_ij (v_j + rel_v[b(i, j)])`` with ``b(i, j) = clamp(r, -K, K) + K``.
    Never holds an ``[Lq, Lk]`` or ``[Lq, Lk, D]`` tensor; the backward recomputes the
    probabilities from the saved log-sum-exp. The CPU kernels are deterministic (bitwise, for any
    thread count); on CUDA the gradients of ``rel_k`` / ``rel_v`` are summed with float atomics
    in whatever order the query tiles run, except under ``torch.use_deterministic_algorithms``,
    where one block per (batch, head) adds its query tiles' shares in order (bitwise
    reproducible, with far fewer blocks in flight). Under
    ``torch.autocast`` the floating inputs are cast to the autocast dtype first (float64 excepted),
    as for ``F.scaled_dot_product_attention``; float32 tables then get float32 gradients.
    On CPUs with AVX512-BF16 the CPU kernels take bfloat16 inputs' matmuls (``q k^T``, ``p v``,
    the relative terms' and the backward's) by bfloat16 dot products with float32 sums (``p``,
    its gradient and their sums per bucket rounded to bfloat16, as flash-attention does on
    GPUs), about 1.5-1.7x faster; on CPUs with AMX those products run on AMX tiles (from 8 query
    rows on), 3-4x faster again (``RELPOS_CPU_AMX=0`` keeps the AVX512-BF16 instructions);
    ``RELPOS_CPU_BF16_DOT=0`` keeps float32 matmuls there. Intel CPUs whose dots cannot run on
    AMX tiles, where the dots are slower than float32 matmuls, take them only when decoding (at
    most 32 query rows against at least 256 keys; ``build_info()["cpu_bf16_dot_decode_only"]``;
    ``RELPOS_CPU_BF16_DOT=1`` takes them in every call). Float32 inputs with more than 32
    query rows take the same dot products where those serve such calls (``q``, ``k``, ``v`` and
    the upstream gradient rounded to bfloat16 a tile at a time, the tables once per call;
    outputs and gradients stay float32), and only where the user allows float32 matmuls in
    bfloat16:
    ``torch.set_float32_matmul_precision("medium")``, or
    ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``, as torch's own CPU matmuls do.
    Forward mode (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``) computes the
    output's tangent in eager PyTorch by blocks of query rows (no fused kernel: 9-16x the
    forward's time at L = 512-8192, never ``[Lq, Lk, D]``); the log-sum-exp,
    non-differentiable, gets none.
    Second derivatives (grad of grad with ``create_graph=True``, as gradient penalties take
    it; ``torch.func.hessian``; higher orders too) are reverse mode through those blocks of the
    tangent, in eager PyTorch (no fused kernel: a gradient penalty takes 7-10x the time of the
    forward+backward at L = 512-4096, O(L) memory beyond the blocks' ``[rows, Lk]`` tensors).

    Args:
        q: ``[B, H, Lq, D]``.
        k, v: ``[B, Hkv, Lk, D]``; ``Hkv`` divides ``H`` (grouped-query attention).
        rel_k, rel_v: ``[2K+1, D]`` or ``[H, 2K+1, D]``, or None to drop that term.
        max_distance: ``K``.
        causal: key j is visible to query i iff ``k_offset + j <= q_offset + i``.
        scale: defaults to ``1 / sqrt(D)``.
        q_offset, k_offset: absolute positions of query 0 and key 0 (decoding with a cache).
        key_padding_mask: ``[B, Lk]`` bool, True = ignore that key (as nn.MultiheadAttention).
        return_lse: also return the log-sum-exp ``[B, H, Lq]`` (float32; float64 for float64).
        dropout_p: attention dropout in ``[0, 1]``, as ``F.scaled_dot_product_attention``'s: each
            probability ``p_ij`` (of both the key/value and the relative value term) is zeroed
            with probability ``dropout_p`` and the kept ones are scaled by ``1 / (1 - dropout_p)``;
            the log-sum-exp is the one without dropout. The mask is a counter-based hash of
            ``(dropout_seed, b, h, i, j)`` (:func:`relpos_ext.reference.dropout_keep`), recomputed
            by the backward, never stored. Pass 0 at inference.
        dropout_seed: a CPU int64 tensor of one element choosing the mask; by default one is
            drawn from torch's default generator (so ``torch.manual_seed`` makes it repeatable).
        attn_mask: bool ``[Lq, Lk]`` or ``[B or 1, H or 1, Lq, Lk]``, True = query i ignores
            key j (nn.MultiheadAttention's convention, the opposite of SDPA's bool mask), on top
            of ``causal`` and ``key_padding_mask``; read tile by tile, never copied beyond
            ``contiguous()``. Any pattern: prefix-LM, packed documents, local windows. Tiles it
            hides wholly are skipped (on the CPU, the relative terms' band too).
        q_segment_ids, k_segment_ids: integer ``[B, Lq]`` and ``[B, Lk]``, both or neither:
            query i sees key j only when ``q_segment_ids[b, i] == k_segment_ids[b, j]``, on top
            of the other masks. Packed documents in O(L) rather than an ``[L, L]``
            ``attn_mask``; for self-attention pass the same tensor twice. Relative positions stay
            those of the packed sequence, which within a document are the document's own. Key
            tiles no query of a query tile can see are skipped (exactly so for sorted ids).
        window_left, window_right: a local (sliding) window: key j is visible to query i only
            when ``-window_left <= r <= window_right``, ``r = (k_offset + j) - (q_offset + i)``
            (flash-attention's ``window_size``); -1 leaves that side unbounded. With ``causal``,
            ``window_left = w - 1`` keeps the last w positions (Mistral's sliding window). Key
            tiles wholly outside the window are skipped, and the relative terms' ``q . rel_k``
            band covers only the keys a query tile sees, so the cost grows with L times the
            window, not L^2, even with an unclipped table (K = L - 1).
        rel_bias: ``[2K+1]`` or ``[H, 2K+1]``, or None: a scalar per bucket added to the
            logits after the scale, as T5's bucketed position bias or ALiBi's slopes (expanded to
            one entry per clipped distance: :func:`relpos_ext.t5_bias_table`,
            :func:`relpos_ext.alibi_bias_table`). It costs next to nothing: the kernels add it to
            the ``q . rel_k`` band they compute per query tile anyway. Needs a nonzero ``scale``.
        rel_q: ``[2K+1, D]`` or ``[H, 2K+1, D]``, or None: the key-side table, whose term
            ``k_j . rel_q[b(i, j)]`` joins the logits before the scale: DeBERTa's
            position-to-content term (``rel_k`` is its content-to-position term). Its gradient
            flows to ``k`` and to the table. Every kernel computes it (scalar, AVX2, CUDA); it
            costs about 10-25% on the AVX2 path (more when K reaches L).

    Returns:
        ``out [B, H, Lq, D]`` (rows with no visible key are 0), or ``(out, lse)``.
    """
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = _draw_dropout_seed()
    out, lse = _apply(
        torch.ops.relpos.rel_attention.default,
        q, k, v, rel_k, rel_v, max_distance, causal, scale, q_offset, k_offset, key_padding_mask,
        dropout_p, dropout_seed, attn_mask, q_segment_ids, k_segment_ids, window_left,
        window_right, rel_bias, rel_q,
    )
    return (out, lse) if return_lse else out


def _draw_dropout_seed() -> Tensor:
    """A fresh dropout seed for :func:`rel_attention`: a CPU int64 tensor of one element drawn
    from torch's default CPU generator (traced, not a graph break, under ``torch.compile``)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device="cpu")


def rel_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rel_k: Tensor | None,
    rel_v: Tensor | None,
    out: Tensor,
    lse: Tensor,
    max_distance: IntLike,
    causal: bool = False,
    scale: float | None = None,
    q_offset: IntLike = 0,
    k_offset: IntLike = 0,
    key_padding_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
    attn_mask: Tensor | None = None,
    q_segment_ids: Tensor | None = None,
    k_segment_ids: Tensor | None = None,
    window_left: int = -1,
    window_right: int = -1,
    rel_bias: Tensor | None = None,
    rel_q: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dq, dk, dv, drel_k, drel_v, drel_bias, drel_q)`` of :func:`rel_attention`
    (None for absent tables); the masks, segment ids, window, bias and ``dropout_p`` /
    ``dropout_seed`` must be those of the forward. Its own derivatives (second derivatives of
    :func:`rel_attention`) treat ``out`` and ``lse`` as the forward's outputs for these inputs:
    they are computed through q, k, v and the tables, and ``out`` and ``lse`` get none."""
    dq, dk, dv, drk, drv, drb, drq = _apply(
        torch.ops.relpos.rel_attention_backward.default,
        grad_out, q, k, v, rel_k, rel_v, out, lse, max_distance, causal, scale, q_offset,
        k_offset, key_padding_mask, dropout_p, dropout_seed, attn_mask, q_segment_ids,
        k_segment_ids, window_left, window_right, rel_bias, rel_q,
    )
    return (dq, dk, dv, (drk if rel_k is not None else None),
            (drv if rel_v is not None else None), (drb if rel_bias is not None else None),
            (drq if rel_q is not None else None))


def _check_q_device(q: Tensor, **tensors: Tensor | None) -> None:
    """Every given tensor on ``q``'s device, as the kernels check. A fake kernel must check it
    too: where one argument is on the meta device and the others are not, the dispatcher runs
    the fake kernel, which would hand back uninitialised memory on the others' device."""
    for name, t in tensors.items():
        if t is not None:
            torch._check(t.device == q.device,
                         lambda name=name, t=t: f"{name} must be on the device of q "
                                                f"({q.device}); got {t.device}")


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.register_fake("relpos::rel_attention")
def _rel_attention_fake(q, k, v, rel_k, rel_v, max_distance, causal=False, scale=None,
                        q_offset=0, k_offset=0, key_padding_mask=None, dropout_p=0.0,
                        dropout_seed=None, attn_mask=None, q_segment_ids=None,
                        k_segment_ids=None, window_left=-1, window_right=-1, rel_bias=None,
                        rel_q=None):
    _check_q_device(q, k=k, v=v, rel_k=rel_k, rel_v=rel_v, key_padding_mask=key_padding_mask,
                    attn_mask=attn_mask, q_segment_ids=q_segment_ids,
                    k_segment_ids=k_segment_ids, rel_bias=rel_bias, rel_q=rel_q)
    torch._check(q.dim() == 4 and k.dim() == 4, lambda: "q and k must be 4-D")
    torch._check(v.shape == k.shape, lambda: "v must have the shape of k")
    torch._check(k.dtype == q.dtype and v.dtype == q.dtype, lambda: "k/v dtype must match q")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "k heads must divide q heads")
    for t in (rel_k, rel_v, rel_q):
        if t is not None:
            torch._check(t.shape[-2] == 2 * max_distance + 1, lambda: "tables need 2K+1 rows")
    if rel_bias is not None:
        torch._check(rel_bias.shape[-1] == 2 * max_distance + 1, lambda: "rel_bias needs 2K+1 columns")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(q.shape[:3], dtype=_lse_dtype(q))
    return out, lse


@torch.library.register_fake("relpos::rel_attention_backward")
def _rel_attention_backward_fake(grad_out, q, k, v, rel_k, rel_v, out, lse, max_distance,
                                 causal, scale, q_offset, k_offset, key_padding_mask,
                                 dropout_p=0.0, dropout_seed=None, attn_mask=None,
                                 q_segment_ids=None, k_segment_ids=None, window_left=-1,
                                 window_right=-1, rel_bias=None, rel_q=None):
    _check_q_device(q, grad_out=grad_out, k=k, v=v, rel_k=rel_k, rel_v=rel_v, out=out, lse=lse,
                    key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                    q_segment_ids=q_segment_ids, k_segment_ids=k_segment_ids, rel_bias=rel_bias,
                    rel_q=rel_q)

    def like(t):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    def table_grad(t):
        return q.new_empty((0,)) if t is None else like(t)

    return (like(q), like(k), like(v), table_grad(rel_k), table_grad(rel_v),
            table_grad(rel_bias), table_grad(rel_q))


def _rel_attention_setup(ctx, inputs, output) -> None:
    (q, k, v, rel_k, rel_v, ctx.max_distance, ctx.causal, ctx.scale, ctx.q_offset, ctx.k_offset,
     mask, ctx.dropout_p, seed, attn_mask, q_seg, k_seg, ctx.window_left, ctx.window_right,
     rel_bias, rel_q) = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, rel_k, rel_v, out, lse, mask, seed, attn_mask, q_seg, k_seg,
                          rel_bias, rel_q)


def _rel_attention_bwd(ctx, grad_out: Tensor, _grad_lse: Tensor | None):
    # saved_tensors gives back None for the absent tables / masks / seed
    (q, k, v, rel_k, rel_v, out, lse, mask, seed, attn_mask, q_seg, k_seg, rel_bias,
     rel_q) = ctx.saved_tensors
    dq, dk, dv, drk, drv, drb, drq = _apply(
        torch.ops.relpos.rel_attention_backward.default,
        grad_out.contiguous(), q, k, v, rel_k, rel_v, out, lse, ctx.max_distance, ctx.causal,
        ctx.scale, ctx.q_offset, ctx.k_offset, mask, ctx.dropout_p, seed, attn_mask, q_seg, k_seg,
        ctx.window_left, ctx.window_right, rel_bias, rel_q,
    )
    return (dq, dk, dv, drk if rel_k is not None else None, drv if rel_v is not None else None,
            *([None] * 13), drb if rel_bias is not None else None,
            drq if rel_q is not None else None)


# Forward-mode derivative (torch.func.jvp, jacfwd, torch.autograd.forward_ad), in eager PyTorch
# by blocks of query rows: no fused kernel computes it yet. With s the scaled, masked logits,
# p = softmax(s), f the dropout factors, x_ij = v_j + rel_v[b(i, j)] and ts the logits' tangent
# (bilinear: each factor's tangent against the others),
#     c_i = sum_j p_ij ts_ij  (the tangent of lse, which like its gradient is not given:
#                              lse is marked non-differentiable),
#     t_out_i = sum_j f_ij p_ij ((ts_ij - c_i) x_ij + tv_j + t_rel_v[b(i, j)]).
# The sums over rel_v rows are rel_logits_backward's dq (sum_j g_ij table[b(i, j)]) and
# k_j . rel_q[b(i, j)] is rel_logits from the keys' side with the table's rows reversed
# (bucket 2K - b), so nothing [Lq, Lk, D] is built. A block holds a few [B, H, rows, Lk]
# tensors of at most _JVP_BLOCK_ENTRIES entries each, in float32 (float64 for float64 inputs).
_JVP_BLOCK_ENTRIES = 1 << 20


def _rel_attention_jvp(inputs: tuple, outputs: tuple, tangents: tuple):
    out, _ = outputs
    if all(tangents[i] is None for i in _REL_ATTENTION_DIFF):
        return None, None
    blocks = list(_rel_attention_tangent_blocks(inputs, tangents))
    if not blocks:  # no queries
        return torch.zeros_like(out), None
    return torch.cat(blocks, dim=2).to(out.dtype), None


def _tangent_block_rows(q: Tensor, k: Tensor) -> int:
    """Query rows per block of the tangent: [B, H, rows, Lk] of at most _JVP_BLOCK_ENTRIES."""
    batch, heads, _, _ = q.shape
    return max(1, _JVP_BLOCK_ENTRIES // max(1, batch * heads * k.shape[2]))


def _rel_attention_tangent_blocks(inputs: tuple, tangents: tuple,
                                  only: int | None = None) -> Iterator[Tensor]:
    """The output's tangent by blocks of query rows (``_tangent_block_rows`` each, in order):
    ``[B, H, rows, D]`` in float32 (float64 for float64 inputs); with ``only``, just the block
    whose rows start there. Each block is differentiable (eager ops and rel_logits) and reads
    only its own slice of the keys, which the second derivatives use."""
    (q, k, v, rel_k, rel_v, max_distance, causal, scale, q_offset, k_offset, mask, dropout_p,
     seed, attn_mask, q_seg, k_seg, window_left, window_right, rel_bias, rel_q) = inputs
    tq, tk, tv, trk, trv = tangents[:5]
    trb, trq = tangents[18:20]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    group = heads // k.shape[1] if k.shape[1] else 1
    scale = max(dim, 1) ** -0.5 if scale is None else scale  # the kernels' default

    def cast(t: Tensor | None, flip: bool = False) -> Tensor | None:
        return None if t is None else (t.to(acc).flip(-2) if flip else t.to(acc))

    def heads_of_q(t: Tensor | None) -> Tensor | None:  # grouped-query attention
        if t is None:
            return None
        return t.to(acc) if group == 1 else t.to(acc).repeat_interleave(group, dim=1)

    rk, rv, rb, trk_, trv_, trb_ = map(cast, (rel_k, rel_v, rel_bias, trk, trv, trb))
    rq, trq_ = cast(rel_q, flip=True), cast(trq, flip=True)
    logits, adjoint = rel_logits, rel_logits_backward  # through _apply: transforms above jvp
    masked = (causal or mask is not None or attn_mask is not None or q_seg is not None
              or window_left >= 0 or window_right >= 0)
    rows = _tangent_block_rows(q, k)
    for i0 in range(0, q_len, rows) if only is None else (only,):
        n = min(rows, q_len - i0)
        q_pos = q_offset + i0
        # the keys that causal and the window leave to some row of the block: [j0, j1)
        j0 = 0 if window_left < 0 else min(max(0, q_pos - window_left - k_offset), k_len)
        j1 = k_len
        if causal:
            j1 = min(j1, max(0, q_pos + n - k_offset))
        if window_right >= 0:
            j1 = min(j1, max(0, q_pos + n + window_right - k_offset))
        j1 = max(j0, j1)
        kb_len, kb_pos = j1 - j0, k_offset + j0

        def keys(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[:, :, j0:j1]

        kb, vb, tkb, tvb = (heads_of_q(keys(t)) for t in (k, v, tk, tv))
        def raw(dense: list, by_rel_k: list, by_rel_q: list,
                bias: Tensor | None) -> Tensor | None:
            """scale * (sum a . b + sum a . ek[bucket] + sum b . eq[bucket]) + bias over the
            lists' pairs (a: this block's queries, b: keys). Each sum is one product of factors
            concatenated along the features, with the scale on the small factor, and the dense
            one adds the others in (baddbmm): [rows, Lk] passes are what this costs."""
            (a, b), (a2, ek), (b2, eq) = map(_concat_pairs, (dense, by_rel_k, by_rel_q))
            rel = _add(
                None if a2 is None else logits(a2 * scale, ek, max_distance, kb_len, q_pos,
                                               kb_pos),
                None if b2 is None else logits(b2 * scale, eq, max_distance, n, kb_pos,
                                               q_pos).transpose(-1, -2),
                bias,
            )
            if a is None:
                return rel
            a, b_t = (a * scale).flatten(0, 1), b.flatten(0, 1).transpose(-1, -2)
            if rel is None:
                return (a @ b_t).unflatten(0, (batch, heads))
            rel = rel.expand(batch, heads, n, kb_len).flatten(0, 1)
            return torch.baddbmm(rel, a, b_t).unflatten(0, (batch, heads))

        qb = q[:, :, i0:i0 + n].to(acc)
        tqb = None if tq is None else tq[:, :, i0:i0 + n].to(acc)
        buckets = reference.shaw_buckets(n, kb_len, max_distance, q_pos, kb_pos, q.device)
        s = raw([(qb, kb)], [(qb, rk)], [(kb, rq)], None if rb is None else rb[..., buckets])
        ts = raw([(tqb, kb), (qb, tkb)], [(tqb, rk), (qb, trk_)], [(tkb, rq), (kb, trq_)],
                 None if trb_ is None else trb_[..., buckets])
        if masked:
            visible = reference.visible_keys(
                batch, n, kb_len, causal, q_pos, kb_pos,
                None if mask is None else mask[:, j0:j1], q.device,
                None if attn_mask is None else attn_mask[..., i0:i0 + n, j0:j1],
                None if q_seg is None else q_seg[:, i0:i0 + n],
                None if k_seg is None else k_seg[:, j0:j1], window_left, window_right)
            any_visible = visible.any(-1, keepdim=True)
            p = torch.softmax(s.masked_fill(~visible, float("-inf")).masked_fill(~any_visible,
                                                                                  0.0),
                              dim=-1) * any_visible
            ts = None if ts is None else torch.where(visible, ts, 0.0)
        else:  # every key visible to every query: no [rows, Lk] masking passes
            p = torch.softmax(s, dim=-1)
        if dropout_p > 0:
            pd = p * reference.dropout_factors(seed, batch, heads, n, kb_len, dropout_p,
                                               q.device, acc, row_start=i0, col_start=j0)
        else:
            pd = p
        terms = []
        if ts is not None:
            w = pd * (ts - (p * ts).sum(-1, keepdim=True))
            terms.append(w @ vb)
            if rv is not None:
                terms.append(adjoint(w, qb, rv, max_distance, q_pos, kb_pos)[0])
        if tvb is not None:
            terms.append(pd @ tvb)
        if trv_ is not None:
            terms.append(adjoint(pd, qb, trv_, max_distance, q_pos, kb_pos)[0])
        yield _add(*terms) if terms else torch.zeros_like(qb)


_register_autograd(
    torch.ops.relpos.rel_attention.default, _rel_attention_bwd, setup_context=_rel_attention_setup,
    jvp=_rel_attention_jvp,
)


# Second derivatives (grad of grad, torch.func.hessian), in eager PyTorch. The backward is
# dx = J(x)^T g (J the forward's Jacobian, g the output's gradient, x = q, k, v and the tables).
# By the symmetry of second derivatives, for cotangents u of dx (reverse over reverse)
#     d<u, dx>/dg = J(x) u               (the forward's tangent along u: the jvp's blocks above)
#     d<u, dx>/dx = grad_x <g, J(x) u>    (reverse mode through those blocks),
# and for tangents (tg, tx) of (g, x) (forward over reverse) dx's tangent is
#     J(x)^T tg + grad_x <g, J(x) tx>     (the backward op on tg, plus the same gradient).
# out and lse, inputs of the backward op, are functions of x: the formulas take the whole
# derivative through x and give out and lse none (so a backward op called with an out or lse
# that is not its forward's would get a wrong second derivative). The blocks are
# differentiated one at a time, each holding its [B, H, rows, Lk] tensors only meanwhile.
def _rel_attention_second_order(inputs: tuple, grad_out: Tensor,
                                tangents: tuple) -> tuple[Tensor, dict[int, Tensor | None]]:
    """``(J(x) u, {slot: grad_x <grad_out, J(x) u>})`` for rel_attention's ``inputs`` and the
    tangents ``u`` (both in rel_attention's argument order; slots of ``_REL_ATTENTION_DIFF``
    with an input). ``J(x) u`` is ``[B, H, Lq, D]`` in grad_out's dtype; each gradient has its
    input's dtype, None where it does not depend on it.

    Each block goes through its own torch.func.vjp, which differentiates with respect to x
    alone while autograd above it (create_graph=True: third derivatives) and torch.func
    transforms around it still see how the result depends on x, u and grad_out."""
    wrt = [i for i in _REL_ATTENTION_DIFF if inputs[i] is not None]
    grads: dict[int, Tensor | None] = dict.fromkeys(wrt)
    t_blocks = []
    for i0 in range(0, inputs[0].shape[2], _tangent_block_rows(inputs[0], inputs[1])):
        def block(*diff: Tensor, i0: int = i0) -> Tensor:
            xs = list(inputs)
            for i, x in zip(wrt, diff):
                xs[i] = x
            return next(_rel_attention_tangent_blocks(tuple(xs), tangents, only=i0))

        t, vjp = torch.func.vjp(block, *(inputs[i] for i in wrt))
        t_blocks.append(t)
        got = vjp(grad_out[:, :, i0:i0 + t.shape[2]].to(t.dtype))
        for i, d in zip(wrt, got):
            grads[i] = _add(grads[i], d)
    t_out = torch.cat(t_blocks, dim=2) if t_blocks else torch.zeros_like(grad_out)
    return t_out.to(grad_out.dtype), grads


# rel_attention's differentiable inputs: q, k, v, rel_k, rel_v, rel_bias, rel_q (the order of
# the backward op's outputs)
_REL_ATTENTION_DIFF = (0, 1, 2, 3, 4, 18, 19)


def _backward_inputs_split(inputs: tuple) -> tuple[Tensor, tuple]:
    """rel_attention_backward's inputs as (grad_out, rel_attention's inputs): out and lse,
    its 7th and 8th, dropped."""
    return inputs[0], (*inputs[1:6], *inputs[8:])


def _backward_slot(slot: int) -> int:
    """Where rel_attention's input ``slot`` sits among rel_attention_backward's inputs."""
    return slot + 1 if slot < 5 else slot + 3


def _rel_attention_backward_setup(ctx, inputs, output) -> None:
    ctx.values = tuple(_SAVED if isinstance(x, Tensor) else x for x in inputs)
    # The tensors _register_autograd's Function keeps with save_for_forward, in its order
    # (inputs, then outputs): torch.func's generated vmap rules take both saves to be the same.
    ctx.save_for_backward(*(x for x in (*inputs, *output) if isinstance(x, Tensor)))


def _rel_attention_double_backward(ctx, *grads: Tensor | None):
    saved = iter(ctx.saved_tensors)
    grad_out, inputs = _backward_inputs_split(
        tuple(next(saved) if x is _SAVED else x for x in ctx.values))
    tangents: list[Tensor | None] = [None] * len(inputs)
    for slot, u in zip(_REL_ATTENTION_DIFF, grads):
        tangents[slot] = None if inputs[slot] is None else u
    t_out, dx = _rel_attention_second_order(inputs, grad_out, tuple(tangents))
    result: list[Tensor | None] = [None] * len(ctx.values)
    result[0] = t_out
    for slot, d in dx.items():
        result[_backward_slot(slot)] = d
    return tuple(result)


def _rel_attention_backward_jvp(inputs: tuple, outputs: tuple, tangents: tuple):
    grad_out, fwd_inputs = _backward_inputs_split(inputs)
    tx = [None] * len(fwd_inputs)
    for slot in _REL_ATTENTION_DIFF:
        tx[slot] = tangents[_backward_slot(slot)]
    result: list[Tensor | None] = [None] * len(_REL_ATTENTION_DIFF)
    if tangents[0] is not None:  # linear in grad_out: the backward op itself
        result = list(_apply(torch.ops.relpos.rel_attention_backward.default,
                             tangents[0].contiguous(), *inputs[1:]))
    if any(t is not None for t in tx):
        _, dx = _rel_attention_second_order(fwd_inputs, grad_out, tuple(tx))
        for j, slot in enumerate(_REL_ATTENTION_DIFF):
            if fwd_inputs[slot] is not None:
                result[j] = _add(result[j], dx[slot])
    return tuple(result)


_register_autograd(
    torch.ops.relpos.rel_attention_backward.default,
    _rel_attention_double_backward,
    setup_context=_rel_attention_backward_setup,
    jvp=_rel_attention_backward_jvp,
)


# --------------------------------------------------------------------------- rope
def rope(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    interleaved: bool = False,
    inverse: bool = False,
) -> Tensor:
    """Rotary position embedding (Su et al. 2021) in one pass: HF transformers'
    ``apply_rotary_pos_emb`` for one tensor, ``x * cos + rotate_half(x) * sin``.

    The first ``R = cos.shape[-1]`` features of each row of ``x`` turn in pairs by the angles
    whose cosines and sines ``cos`` and ``sin`` hold; the other ``D - R`` features (partial
    rotary, as in GPT-NeoX or Phi) pass through unchanged. Pairs are ``(f, f + R/2)``
    (``rotate_half``: Llama, Mistral, Qwen, GPT-NeoX) or, with ``interleaved``, ``(2f, 2f+1)``
    (``rotate_every_two``: GPT-J, RoFormer). For pair ``(a, b)``::

        y[a] = x[a] cos[a] - x[b] sin[a],   y[b] = x[b] cos[b] + x[a] sin[b]

    Args:
        x: ``[..., D]`` with 1 to 4 dims, e.g. queries ``[B, H, L, D]`` or ``[B, L, H, D]``;
            any strides.
        cos, sin: ``[..., R]``, the same shape, broadcastable to ``x[..., :R]``: ``[L, R]``,
            HF's ``[B, 1, L, R]`` (``unsqueeze_dim=1``) or ``[B, L, 1, R]`` for ``[B, L, H, D]``
            queries. Cast to ``x``'s dtype first, as HF does. Tables with the same angle at
            ``a`` and ``b`` (``cat((freqs, freqs))``, or ``repeat_interleave(2)`` when
            interleaved: :func:`relpos_ext.positions.rope_cos_sin` makes them) make a rotation.
        interleaved: the pairing, see above.
        inverse: apply the adjoint instead, ``y = x * cos - rotate_half(x * sin)``: the
            rotation back by the same angles (what the backward of ``x`` computes).

    Returns:
        A contiguous tensor like ``x``, computed in float32 (float64 for float64) and rounded
        once; on the CPU in float32, bitwise what transformers' eager code gives (products
        rounded before their sum, no fused multiply-adds). Differentiable in ``x``, ``cos`` and
        ``sin``.
    """
    return _apply(torch.ops.relpos.rope.default, x, cos, sin, interleaved, inverse)


@torch.library.register_fake("relpos::rope")
def _rope_fake(x, cos, sin, interleaved=False, inverse=False):
    torch._check(1 <= x.dim() <= 4, lambda: f"x must have 1 to 4 dims, got {x.dim()}")
    torch._check(cos.shape == sin.shape, lambda: "cos and sin must have the same shape")
    torch._check(1 <= cos.dim() <= x.dim(), lambda: "cos must have 1 to x.dim() dims")
    torch._check(
        cos.device == x.device and sin.device == x.device,
        lambda: "cos and sin must be on x's device",
    )
    torch._check(cos.shape[-1] % 2 == 0, lambda: "the rotary dim R = cos.shape[-1] must be even")
    torch._check(cos.shape[-1] <= x.shape[-1], lambda: "R = cos.shape[-1] must be <= x.shape[-1]")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rope_cos_sin_terms(x: Tensor, tcos: Tensor | None, tsin: Tensor | None,
                        interleaved: bool, inverse: bool) -> Tensor | None:
    """The tangent of ``rope(x, cos, sin)`` from those of cos and sin: rope is linear in
    (cos, sin) jointly for a fixed ``x``, zero on the pass-through features."""
    if tcos is None and tsin is None:
        return None
    tcos = torch.zeros_like(tsin) if tcos is None else tcos
    tsin = torch.zeros_like(tcos) if tsin is None else tsin
    r = tcos.shape[-1]
    y = reference.rope_rotated(x[..., :r], tcos.to(x.dtype), tsin.to(x.dtype), interleaved, inverse)
    return torch.nn.functional.pad(y, (0, x.shape[-1] - r))


def _rope_table_grads(grad: Tensor, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool,
                      inverse: bool) -> tuple[Tensor, Tensor]:
    """``(dcos, dsin)`` of ``rope(x, cos, sin)``, summed over the dims cos and sin broadcast
    over, in float32 (float64 for float64): ``dcos = g x`` and ``dsin = g rotate(x)``, or for the
    inverse ``dsin = x rotate(g)`` (``rotate`` is HF's rotate_half, or rotate_every_two)."""
    r = cos.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    g, xr = grad[..., :r].to(acc), x[..., :r].to(acc)
    rotate = reference.rope_rotate
    dsin = xr * rotate(g, interleaved) if inverse else g * rotate(xr, interleaved)
    dcos = (g * xr).sum_to_size(cos.shape)
    return dcos.to(cos.dtype), dsin.sum_to_size(sin.shape).to(sin.dtype)


def _rope_setup(ctx, inputs, output) -> None:
    x, cos, sin, ctx.interleaved, ctx.inverse = inputs
    ctx.save_for_backward(x, cos, sin)


def _rope_bwd(ctx, grad: Tensor):
    x, cos, sin = ctx.saved_tensors
    dx = dcos = dsin = None
    if ctx.needs_input_grad[0]:
        dx = rope(grad, cos, sin, ctx.interleaved, not ctx.inverse)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        dcos, dsin = _rope_table_grads(grad, x, cos, sin, ctx.interleaved, ctx.inverse)
    return dx, dcos, dsin, None, None


def _rope_jvp(inputs: tuple, outputs: tuple, tangents: tuple) -> Tensor | None:
    x, cos, sin, interleaved, inverse = inputs
    tx, tcos, tsin = tangents[:3]
    by_x = None if tx is None else rope(tx, cos, sin, interleaved, inverse)
    return _add(by_x, _rope_cos_sin_terms(x, tcos, tsin, interleaved, inverse))


_register_autograd(torch.ops.relpos.rope.default, _rope_bwd, setup_context=_rope_setup,
                   jvp=_rope_jvp)


# --------------------------------------------------------------------------- vmap
# torch.vmap rules (also what torch.func.vmap(torch.func.grad(f)) runs: per-sample gradients).
# The vmapped dimension N joins the heads: N samples' [B, H, L, D] become one call on
# [B, N*H, L, D], with tables per head ([N*H, 2K+1, D]: repeated, or the samples' own). Head
# n*H + h reads kv head n*Hkv + h // (H / Hkv), so grouped-query attention keeps its groups. The
# backwards make every table per head, so that each sample gets its own table gradient. For
# rel_attention, batched masks, segment ids or dropout seeds, an attn_mask with a head dimension,
# or dropout (its mask hashes the head index) run the op once per sample instead, as torch's
# fallback would, without its warning. rel_gather and skew take the samples as heads or as a
# leading dimension.
def _vmap_loop(op: Any, info: Any, in_dims: tuple, args: tuple) -> tuple[Any, Any]:
    """``op`` once per sample of the vmapped dimension, outputs stacked along dim 0."""
    if info.batch_size == 0:  # no samples: the outputs' shapes from one sample of zeros
        one = op(*(a if d is None else a.new_zeros(a.shape[:d] + a.shape[d + 1:])
                   for a, d in zip(args, in_dims)))
        return tuple(t.new_empty((0, *t.shape)) for t in one), (0,) * len(one)
    outs = [
        op(*(a if d is None else a.select(d, n) for a, d in zip(args, in_dims)))
        for n in range(info.batch_size)
    ]
    stacked = tuple(torch.stack(parts) for parts in zip(*outs))
    return stacked, (0,) * len(stacked)


def _with_defaults(op: Any, args: tuple, in_dims: tuple) -> tuple[tuple, tuple]:
    """``args`` with the defaults the dispatcher dropped put back, and ``in_dims`` to match."""
    missing = op._schema.arguments[len(args):]
    return (*args, *(a.default_value for a in missing)), (*in_dims, *([None] * len(missing)))


def _fold_heads(t: Tensor, dim: int | None, n: int) -> Tensor:
    """``[B, H, ...]`` batched at ``dim`` (or shared by the ``n`` samples) -> ``[B, n*H, ...]``."""
    t = t.movedim(dim, 1) if dim is not None else t.unsqueeze(1).expand(-1, n, *t.shape[1:])
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])  # no -1: L may be 0


def _unfold_heads(t: Tensor, n: int, heads: int) -> Tensor:
    """``[B, n*H, ...]`` -> ``[B, n, H, ...]``: the vmapped dimension at 1."""
    return t.view(t.shape[0], n, heads, *t.shape[2:])


def _heads_of(t: Tensor, dim: int | None) -> int:
    """``H`` of a ``[B, H, ...]`` argument batched at ``dim``."""
    return t.shape[1 + (dim is not None and dim <= 1)]


def _shared(t: Tensor, dim: int | None, shared_dims: int) -> bool:
    """Whether a table is shared by the heads (``shared_dims`` dims) rather than per head."""
    return t.dim() - (dim is not None) == shared_dims


def _table_for_heads(t: Tensor | None, dim: int | None, shared_dims: int, n: int, heads: int,
                     keep_shared: bool = False) -> Tensor | None:
    """A table for the ``n * heads`` folded heads, ``[n*H, ...]``, from a shared
    (``shared_dims`` dims) or per-head ``[H, ...]`` table, batched at ``dim`` or common to the
    samples; with ``keep_shared``, a common shared table stays as it is (a forward: no gradient
    to split per sample)."""
    if t is None:
        return None
    if dim is None:
        if _shared(t, dim, shared_dims):
            return t if keep_shared else t.expand(n * heads, *t.shape)
        return t.repeat(n, *([1] * shared_dims))
    t = t.movedim(dim, 0)
    if _shared(t, 0, shared_dims):
        t = t.unsqueeze(1).expand(n, heads, *t.shape[1:])
    return t.reshape(n * heads, *t.shape[2:])


def _table_grad(g: Tensor, t: Tensor, dim: int | None, shared_dims: int, n: int,
                heads: int) -> Tensor:
    """The folded heads' gradient ``[n*H, ...]`` of table ``t`` -> each sample's, dim 0."""
    g = g.view(n, heads, *g.shape[1:])
    return g.sum(1) if _shared(t, dim, shared_dims) else g


def _positions(op: Any, *names: str) -> tuple[int, ...]:
    """Where ``op``'s schema (csrc/schemas.h) puts the arguments called ``names``."""
    index = {a.name: i for i, a in enumerate(op._schema.arguments)}
    return tuple(index[name] for name in names)


_TABLES = ("rel_k", "rel_v", "rel_bias", "rel_q")
_TABLE_SHARED_DIMS = (2, 2, 1, 2)  # each table's dims when the heads share it


def _foldable(in_dims: tuple, heads_like: tuple[int, ...], attn_mask: Tensor | None,
              dropout_p: float) -> bool:
    """Whether only the arguments at ``heads_like`` are batched and the heads can take N."""
    return (all(d is None for i, d in enumerate(in_dims) if i not in heads_like)
            and (attn_mask is None or attn_mask.dim() == 2 or attn_mask.shape[1] == 1)
            and dropout_p == 0)


@torch.library.register_vmap("relpos::rel_attention")
def _rel_attention_vmap(info, in_dims, *args):
    op = torch.ops.relpos.rel_attention.default
    args, in_dims = _with_defaults(op, args, in_dims)
    tables = dict(zip(_positions(op, *_TABLES), _TABLE_SHARED_DIMS))
    heads_like = _positions(op, "q", "k", "v")
    mask, p = _positions(op, "attn_mask", "dropout_p")
    if not _foldable(in_dims, (*heads_like, *tables), attn_mask=args[mask], dropout_p=args[p]):
        return _vmap_loop(op, info, in_dims, args)
    n, heads = info.batch_size, _heads_of(args[0], in_dims[0])
    new = list(args)
    for i in heads_like:
        new[i] = _fold_heads(args[i], in_dims[i], n)
    for i, shared_dims in tables.items():
        new[i] = _table_for_heads(args[i], in_dims[i], shared_dims, n, heads, keep_shared=True)
    out, lse = op(*new)
    return (_unfold_heads(out, n, heads), _unfold_heads(lse, n, heads)), (1, 1)


@torch.library.register_vmap("relpos::rel_attention_backward")
def _rel_attention_backward_vmap(info, in_dims, *args):
    op = torch.ops.relpos.rel_attention_backward.default
    args, in_dims = _with_defaults(op, args, in_dims)
    tables = dict(zip(_positions(op, *_TABLES), _TABLE_SHARED_DIMS))
    heads_like = _positions(op, "grad_out", "q", "k", "v", "out", "logsumexp")
    mask, p = _positions(op, "attn_mask", "dropout_p")
    if not _foldable(in_dims, (*heads_like, *tables), attn_mask=args[mask], dropout_p=args[p]):
        return _vmap_loop(op, info, in_dims, args)
    n, heads = info.batch_size, _heads_of(args[1], in_dims[1])
    new = list(args)
    for i in heads_like:
        new[i] = _fold_heads(args[i], in_dims[i], n)
    for i, shared_dims in tables.items():
        new[i] = _table_for_heads(args[i], in_dims[i], shared_dims, n, heads)
    grads = op(*new)
    table_grads = [
        g if args[i] is None else _table_grad(g, args[i], in_dims[i], shared_dims, n, heads)
        for g, (i, shared_dims) in zip(grads[3:], tables.items())
    ]  # an absent table's gradient is the op's empty placeholder, not batched
    out_dims = (1, 1, 1, *(None if args[i] is None else 0 for i in tables))
    kv_heads = _heads_of(args[2], in_dims[2])
    dq, dk, dv = (_unfold_heads(g, n, h) for g, h in zip(grads[:3], (heads, kv_heads, kv_heads)))
    return (dq, dk, dv, *table_grads), out_dims


@torch.library.register_vmap("relpos::rel_logits")
def _rel_logits_vmap(info, in_dims, q, table, *rest):
    n, heads = info.batch_size, _heads_of(q, in_dims[0])
    out = torch.ops.relpos.rel_logits.default(
        _fold_heads(q, in_dims[0], n),
        _table_for_heads(table, in_dims[1], 2, n, heads, keep_shared=True), *rest)
    return _unfold_heads(out, n, heads), 1


@torch.library.register_vmap("relpos::rel_logits_backward")
def _rel_logits_backward_vmap(info, in_dims, grad, q, table, *rest):
    n, heads = info.batch_size, _heads_of(q, in_dims[1])
    dq, dtable = torch.ops.relpos.rel_logits_backward.default(
        _fold_heads(grad, in_dims[0], n), _fold_heads(q, in_dims[1], n),
        _table_for_heads(table, in_dims[2], 2, n, heads), *rest)
    dtable = _table_grad(dtable, table, in_dims[2], 2, n, heads)
    return (_unfold_heads(dq, n, heads), dtable), (1, 0)


@torch.library.register_vmap("relpos::rel_gather")
def _rel_gather_vmap(info, in_dims, table, *rest):
    # the samples' tables as heads: [N, 2K+1, D] or [N*H, 2K+1, D]
    t = table.movedim(in_dims[0], 0)
    out = torch.ops.relpos.rel_gather.default(t.reshape(t.shape[:-2].numel(), *t.shape[-2:]),
                                              *rest)
    return out.view(*t.shape[:-2], *out.shape[1:]), 0


@torch.library.register_vmap("relpos::rel_gather_backward")
def _rel_gather_backward_vmap(info, in_dims, grad, *rest):
    g = grad.movedim(in_dims[0], 0)
    out = torch.ops.relpos.rel_gather_backward.default(
        g.reshape(g.shape[:-3].numel(), *g.shape[-3:]), *rest)
    return out.view(*g.shape[:-3], *out.shape[1:]), 0


@torch.library.register_vmap("relpos::skew")
def _skew_vmap(info, in_dims, x, *rest):
    return torch.ops.relpos.skew.default(x.movedim(in_dims[0], 0), *rest), 0


@torch.library.register_vmap("relpos::skew_backward")
def _skew_backward_vmap(info, in_dims, grad, *rest):
    return torch.ops.relpos.skew_backward.default(grad.movedim(in_dims[0], 0), *rest), 0


@torch.library.register_vmap("relpos::rope")
def _rope_vmap(info, in_dims, x, cos, sin, *rest):
    # The samples N join x's first dim: x [N, *xs] -> [N * b0, b1, b2, D] with xs padded to
    # 4-D, and cos and sin [N or 1, c0, c1, c2, R] expanded over N and b0 to match.
    n = info.batch_size
    xd, cd, sd = in_dims[:3]
    xs = x.shape[:xd] + x.shape[xd + 1:] if xd is not None else x.shape
    x5 = x.movedim(xd, 0) if xd is not None else x.unsqueeze(0).expand(n, *xs)
    x5 = x5.reshape(n, *([1] * (4 - len(xs))), *xs)

    def table(t: Tensor, d: int | None) -> Tensor:
        t = t.movedim(d, 0) if d is not None else t.unsqueeze(0)
        t = t.reshape(t.shape[0], *([1] * (5 - t.dim())), *t.shape[1:])
        return t.expand(n, x5.shape[1], *t.shape[2:]).reshape(n * x5.shape[1], *t.shape[2:])

    out = torch.ops.relpos.rope.default(
        x5.reshape(n * x5.shape[1], *x5.shape[2:]), table(cos, cd), table(sin, sd), *rest
    )
    return out.reshape(n, *xs), 0
