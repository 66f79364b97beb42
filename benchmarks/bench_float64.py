#!/usr/bin/env python
"""Benchmark float64 ``relpos_ext.rel_attention`` on the CPU: its two kernel builds and eager Shaw.

float64 has no hand-written vector kernel. It runs the scalar attention kernels, built for
baseline x86-64 (``RELPOS_CPU_ISA=scalar``) or, on CPUs with AVX2, the same kernels compiled
again with AVX2 and FMA (``csrc/cpu/rel_attention_f64.cpp``; ``build_info()
["cpu_float64_attention"] == "avx2"``). For ``q, k, v [B=1, H=8, L, D=64]`` and shared tables
``rel_k, rel_v [2K+1, D]``, forward and forward+backward, it times:

* ``scalar`` -- ``rel_attention`` with ``RELPOS_CPU_ISA=scalar``;
* ``avx2`` -- ``rel_attention`` on the default path (the AVX2 build where there is one);
* ``eager`` -- bench_attention.py's efficient eager Shaw (``q @ rel_k^T`` and a gather, the
  value term per bucket), not causal only.

The three alternate call by call in one process, ``--rounds`` times; the medians and their
ratios go to the JSON (no plot: the point is the ratios at one or two lengths). Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_float64.py          # ~1 min
    python benchmarks/bench_float64.py -L 1024 --causal --out /tmp/f64.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

import relpos_ext

from _common import RESULTS, print_environment, time_interleaved, timestamp, write_json  # beside this script
from bench_attention import method_fn


def time_case(length: int, k: int, causal: bool, rounds: int) -> dict:
    """Median seconds of each method's forward and forward+backward at one length."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, k_, v = (leaf(1, 8, length, 64) for _ in range(3))
    rk, rv = leaf(2 * k + 1, 64), leaf(2 * k + 1, 64)
    grad = torch.randn(1, 8, length, 64, generator=gen, dtype=torch.float64)

    def ours() -> torch.Tensor:
        return relpos_ext.rel_attention(q, k_, v, rk, rv, k, causal=causal)

    methods: dict[str, tuple[str, Callable[[], torch.Tensor]]] = {
        "scalar": ("scalar", ours), "avx2": ("auto", ours)}
    if not causal:
        eager = method_fn("eager", k)
        methods["eager"] = ("auto", lambda: eager(q, k_, v, rk, rv))
    med = time_interleaved(methods, "RELPOS_CPU_ISA", grad, rounds)
    ratios = {f"scalar/avx2 {mode}": med["scalar"][mode] / med["avx2"][mode] for mode in ("fwd", "fwdbwd")}
    if "eager" in med:
        ratios.update({f"eager/avx2 {mode}": med["eager"][mode] / med["avx2"][mode]
                       for mode in ("fwd", "fwdbwd")})
    return {"L": length, "causal": causal, "median_s": med, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--causal", action="store_true", help="causal attention (no eager column)")
    p.add_argument("--rounds", type=int, default=7, help="calls of each method per length")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_float64.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)
    if info["cpu_float64_attention"] == "scalar":
        print("note: float64 attention runs the scalar kernels on every path of this build/CPU")
    rows = []
    for length in args.lengths:
        row = time_case(length, args.max_distance, args.causal, args.rounds)
        rows.append(row)
        cells = "  ".join(f"{m} {1e3 * t['fwd']:.1f} / {1e3 * t['fwdbwd']:.1f} ms"
                          for m, t in row["median_s"].items())
        ratios = "  ".join(f"{name} {x:.2f}x" for name, x in row["ratios"].items())
        print(f"L={length}{' causal' if args.causal else ''} (fwd / fwd+bwd): {cells}\n  {ratios}")
    write_json({"benchmark": "bench_float64", "time": timestamp(), "build_info": info,
                "machine": mach, "args": {k: str(v) for k, v in vars(args).items()},
                "results": rows}, args.out)


if __name__ == "__main__":
    main()
