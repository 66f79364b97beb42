#!/usr/bin/env python
"""Per-kernel CUDA times of ``rel_attention`` forward+backward, tensor-core kernels on and off.

``torch.profiler`` over a few forward+backward steps (B=2, H=16, bfloat16, K=64, Shaw's key and
value tables, or the key table and ``rel_q`` with ``--rel-q``), for each head dim and each setting
of ``RELPOS_CUDA_TC``: prints each kernel's mean time a step, largest first, and writes JSON.
Needs a CUDA build of relpos_ext and a GPU; ``bench_cuda.py`` times whole calls, this says which
kernel the time goes to.

Usage::

    python benchmarks/profile_cuda.py -L 4096 --dims 64 128 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def profile_case(length: int, dim: int, tc: bool, rel_q: bool, args) -> dict:
    """Mean CUDA time a forward+backward step of each kernel, in ms, for one configuration."""
    import relpos_ext

    os.environ["RELPOS_CUDA_TC"] = "1" if tc else "0"
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, args.dtype)

    def t(*shape: int, scale: float = 1.0) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, device="cuda") * scale
        return x.to(dt).requires_grad_()

    b, h, k = args.batch, args.heads, args.k
    q, kk, v = t(b, h, length, dim), t(b, h, length, dim), t(b, h, length, dim)
    rk, rv, rq = (t(2 * k + 1, dim, scale=0.5) for _ in range(3))
    if rel_q:
        wrt = [q, kk, v, rk, rq]

        def fn() -> torch.Tensor:
            return relpos_ext.rel_attention(q, kk, v, rk, None, k, rel_q=rq)
    else:
        wrt = [q, kk, v, rk, rv]

        def fn() -> torch.Tensor:
            return relpos_ext.rel_attention(q, kk, v, rk, rv, k)
    grad = torch.randn(b, h, length, dim, device="cuda", dtype=dt)

    def step() -> None:
        torch.autograd.grad(fn(), wrt, grad)

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total / args.steps / 1e3 for e in prof.key_averages()
               if e.device_time_total > 0}
    return {"L": length, "dim": dim, "tensor_cores": tc, "rel_q": rel_q,
            "total_ms": sum(kernels.values()),
            "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[4096])
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rel-q", action="store_true", help="the key table and rel_q instead of Shaw's")
    p.add_argument("--no-simt", action="store_true", help="skip RELPOS_CUDA_TC=0")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_cuda.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for length in args.lengths:
        for dim in args.dims:
            for tc in (True,) if args.no_simt else (True, False):
                row = profile_case(length, dim, tc, args.rel_q, args)
                rows.append(row)
                print(f"== L={length} D={dim} tensor cores {'on' if tc else 'off'}"
                      f"{' rel_q' if args.rel_q else ''}: {row['total_ms']:.3f} ms a step")
                for name, ms in list(row["kernels_ms"].items())[:6]:
                    print(f"  {ms:9.3f} ms  {name[:100]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "profile_cuda", "device": torch.cuda.get_device_name(),
                       "torch_version": torch.__version__,
                       "config": {k: v for k, v in vars(args).items() if k != "out"},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
