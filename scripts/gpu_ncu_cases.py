"""One forward and backward of the tensor-core kernels at a training size, for Nsight Compute.

scripts/gpu_check.sh runs this under ``ncu`` (limited to the ``rel_attention_tc`` kernels, one
launch of each): where each kernel's time goes (warp stall reasons, issue slots, occupancy and
what limits it, shared-memory traffic), which whole-call timings cannot say. B=2, H=16, L=2048,
bfloat16, K=64, Shaw's two tables, not causal; head dim 64, or those given.
"""

from __future__ import annotations

import argparse

import torch

import relpos_ext


def run_case(dim: int, length: int = 2048, heads: int = 16, batch: int = 2, k: int = 64) -> None:
    """One forward and one backward (the forward kernel, then dq and dk/dv)."""
    g = torch.Generator(device="cuda").manual_seed(dim)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, device="cuda") * scale
        return x.bfloat16().requires_grad_()

    q, kk, v = (t(batch, heads, length, dim) for _ in range(3))
    rk, rv = t(2 * k + 1, dim, scale=0.5), t(2 * k + 1, dim, scale=0.5)
    out = relpos_ext.rel_attention(q, kk, v, rk, rv, k)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"ok: D={dim} L={length}", flush=True)


def main(argv: list[str] | None = None) -> None:
    """Runs one case per head dim."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[64])
    p.add_argument("--length", "-L", type=int, default=2048)
    args = p.parse_args(argv)
    for dim in args.dims:
        run_case(dim, args.length)


if __name__ == "__main__":
    main()
