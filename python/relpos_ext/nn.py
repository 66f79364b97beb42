"""``nn.Module``s built on the relpos ops, ready to drop into models."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import ops

__all__ = ["ShawRelativeAttention"]


class ShawRelativeAttention(nn.Module):
    """Multi-head self-attention with Shaw et al. (2018) relative key and value embeddings.

    The key term uses the fused skewed matmul (:func:`relpos_ext.rel_logits`, O(L*D) extra
    memory); the value term uses :func:`relpos_ext.rel_gather` and is O(L^2 * D). Input and output
    are ``[B, L, E]`` (batch first).

    Args:
        embed_dim: model width ``E``; must be divisible by ``num_heads``.
        num_heads: ``H``.
        max_distance: ``K``, the clipping distance; tables have ``2K+1`` rows of ``E / H``.
        causal: mask keys after the query.
        rel_values: also add the relative value term ``sum_j p_ij EV[b(i, j)]``.
        per_head_tables: one table per head (``[H, 2K+1, D]``) instead of one shared table.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        max_distance: int,
        causal: bool = False,
        rel_values: bool = True,
        per_head_tables: bool = False,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if max_distance < 0:
            raise ValueError(f"max_distance must be >= 0, got {max_distance}")
        self.embed_dim, self.num_heads, self.max_distance = embed_dim, num_heads, max_distance
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        shape = (num_heads,) if per_head_tables else ()
        shape = (*shape, 2 * max_distance + 1, self.head_dim)
        self.rel_k = nn.Parameter(torch.randn(shape) * self.head_dim**-0.5)
        self.rel_v = nn.Parameter(torch.randn(shape) * self.head_dim**-0.5) if rel_values else None

    def forward(self, x: Tensor) -> Tensor:
        """x: ``[B, L, E]`` -> ``[B, L, E]``."""
        batch, length, _ = x.shape
        q, k, v = (
            self.qkv(x).view(batch, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )
        logits = torch.matmul(q, k.transpose(-1, -2))
        logits = logits + ops.rel_logits(q.contiguous(), self.rel_k, self.max_distance, length)
        logits = logits * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            mask = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        p = torch.softmax(logits, dim=-1)
        out = torch.matmul(p, v)
        if self.rel_v is not None:
            a = ops.rel_gather(self.rel_v, length, length, self.max_distance)
            eq = "bhij,ijd->bhid" if self.rel_v.dim() == 2 else "bhij,hijd->bhid"
            out = out + torch.einsum(eq, p, a)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
