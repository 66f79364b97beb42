"""A user's code, type-checked by ``mypy --strict`` in tests/test_typing.py (not run).

Lines ending in ``# error: [code]`` misuse the API on purpose: mypy must report exactly those,
which it can only do when it reads the package's hints (``py.typed``).
"""

from __future__ import annotations

import torch
from torch import Tensor

import relpos_ext
import relpos_ext.hf
from relpos_ext.nn import KVCache, RelativeMultiheadAttention, ShawRelativeAttention, clipped_table
from relpos_ext.positions import alibi_bias_table, alibi_slopes, deberta_buckets, t5_bias_table


def attend(q: Tensor, k: Tensor, v: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    out: Tensor = relpos_ext.rel_attention(q, k, v, table, None, 4, causal=True)
    pair: tuple[Tensor, Tensor] = relpos_ext.rel_attention(
        q, k, v, table, None, 4, q_offset=2, return_lse=True,
        rel_bias=alibi_bias_table(alibi_slopes(2), 4))
    flag = bool(out.shape[0])
    either: Tensor | tuple[Tensor, Tensor] = relpos_ext.rel_attention(q, k, v, return_lse=flag)
    assert either is not None
    return out + pair[0], pair[1]


def layers(x: Tensor) -> Tensor:
    layer = RelativeMultiheadAttention(16, 2, max_distance=(4, 2), rel_bias=True)
    layer.reset_parameters()
    y, weights = layer.forward(x, need_weights=False)
    cache = KVCache()
    step: Tensor
    with torch.no_grad():
        step, _ = layer.forward(x[:, -1:], is_causal=True, cache=cache)
    cached: int = cache.length
    sliding = KVCache(sliding=True, spare=2)
    sliding.reorder(torch.tensor([0]))
    sliding.crop(0)
    held: int = sliding.held + sliding.offset
    z: Tensor = ShawRelativeAttention(16, 2, 3).forward(x)
    table: Tensor = clipped_table(torch.zeros(7, 8), 4, 2)
    logits: Tensor = relpos_ext.rel_logits(x.view(1, 1, *x.shape[1:]), table, 4, x.shape[1])
    gathered: Tensor = relpos_ext.rel_gather(table, 3, 3, 4)
    skewed: Tensor = relpos_ext.skew(torch.zeros(1, 3, 5))
    bias: Tensor = t5_bias_table(torch.zeros(32, 2), True, 128)
    buckets: Tensor = deberta_buckets(torch.arange(-3, 4), 256, 512)
    info: dict[str, object] = relpos_ext.build_info()
    changed: list[str] = relpos_ext.hf.use_fused_attention(torch.nn.Linear(2, 2))
    assert weights is None and info and not changed
    return (y + step + z.sum() + logits.sum() + gathered.sum() + skewed.sum() + bias.sum() + cached
            + held)


def misuse(x: Tensor) -> None:
    n: int = relpos_ext.rel_gather(x, 3, 3, 1)  # error: [assignment]
    relpos_ext.rel_attention(x, x, x, None, None, "4")  # error: [call-overload]
    pair: tuple[Tensor, Tensor] = relpos_ext.rel_attention(x, x, x)  # error: [assignment]
    RelativeMultiheadAttention(16, 2, max_distance=2.5)  # error: [arg-type]
    KVCache().length = 3  # error: [misc]
    KVCache(sliding="yes")  # error: [arg-type]
    slopes: list[float] = alibi_slopes(4)  # error: [assignment]
    relpos_ext.hf.use_fused_attention("model")  # error: [arg-type]
