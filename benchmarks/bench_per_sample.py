#!/usr/bin/env python
"""Benchmark per-sample gradients of ``relpos_ext.rel_attention`` (differential privacy, Opacus's
functorch mode): the gradients of q, k, v and both Shaw tables for each of N samples.

* ``(1) vmap fold`` -- ``torch.func.vmap(torch.func.grad(loss))``: the op's vmap rules put the N
  samples into the heads, one kernel call for all of them (``relpos_ext/ops.py``).
* ``(2) vmap loop`` -- the same, with the rules made to run the op once per sample (what they do
  for batched masks or dropout, and what torch's fallback does without a rule).
* ``(3) autograd loop`` -- a Python loop of ``torch.autograd.grad``, one sample at a time.

The methods take turns, ``--rounds`` times after a warm-up round; the table gives medians and
each method's time over (1)'s. float32, causal, one batch row per sample. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_per_sample.py    # ~1 min
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import relpos_ext
from relpos_ext import ops

from _common import (RESULTS, check_platform, print_environment, time_rounds, timestamp,
                     write_json)

METHODS = {"fold": "(1) vmap fold", "vmap_loop": "(2) vmap loop",
           "autograd_loop": "(3) autograd loop"}
# (samples N, heads H, length L, head dim D, max distance K)
SHAPES = [(256, 4, 32, 32, 8), (32, 8, 256, 64, 64)]


def methods_for(n: int, h: int, length: int, d: int, k: int) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    q, kk, v = (torch.randn(n, 1, h, length, d) for _ in range(3))
    rel_k, rel_v = torch.randn(2 * k + 1, d), torch.randn(2 * k + 1, d)

    def loss(q, kk, v, rel_k, rel_v):
        return relpos_ext.rel_attention(q, kk, v, rel_k, rel_v, k, causal=True).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2, 3, 4)),
                                 in_dims=(0, 0, 0, None, None))

    def vmap_loop():
        real = ops._foldable
        ops._foldable = lambda *a, **kw: False  # the rules' one-call-per-sample path
        try:
            return per_sample(q, kk, v, rel_k, rel_v)
        finally:
            ops._foldable = real

    def autograd_loop():
        grads = []
        for i in range(n):
            xs = [t.detach().requires_grad_() for t in (q[i], kk[i], v[i], rel_k, rel_v)]
            grads.append(torch.autograd.grad(loss(*xs), xs))
        return grads

    return {"fold": lambda: per_sample(q, kk, v, rel_k, rel_v), "vmap_loop": vmap_loop,
            "autograd_loop": autograd_loop}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--quick", action="store_true", help="small shapes, 2 rounds (a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_per_sample.json")
    args = p.parse_args(argv)
    check_platform("bench_per_sample.py")
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)
    shapes = [(8, 2, 16, 16, 4)] if args.quick else SHAPES
    rounds = 2 if args.quick else args.rounds
    head = f"{'N':>4}{'H':>3}{'L':>5}{'D':>4}{'K':>4}  {'method':<20}{'ms':>9}{'x fold':>8}"
    print(head)
    print("-" * len(head))
    rows = []
    t_start = time.perf_counter()
    for shape in shapes:
        fns = methods_for(*shape)
        times = time_rounds(fns, rounds)
        fold_ms = statistics.median(times["fold"]) * 1e3
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            rows.append({"shape": dict(zip("NHLDK", shape)), "method": name, "time_ms": ms,
                         "min_ms": min(ts) * 1e3, "ratio_vs_fold": ms / fold_ms})
            print(f"{shape[0]:>4}{shape[1]:>3}{shape[2]:>5}{shape[3]:>4}{shape[4]:>4}  "
                  f"{METHODS[name]:<20}{ms:>9.1f}{ms / fold_ms:>8.2f}")
        print()
    write_json({
        "benchmark": "bench_per_sample", "timestamp": timestamp(),
        "torch_version": torch.__version__, "build_info": info, "machine": mach,
        "config": {"dtype": "float32", "causal": True, "batch_per_sample": 1, "rounds": rounds,
                   "threads": args.threads},
        "methods": METHODS, "elapsed_s": time.perf_counter() - t_start, "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
