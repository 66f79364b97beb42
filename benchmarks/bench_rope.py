#!/usr/bin/env python
"""Benchmark rotary position embedding: ``relpos_ext.rope`` against transformers' eager
``apply_rotary_pos_emb`` and its ``torch.compile``.

Llama 3 8B's attention shapes: queries ``[B, 32, L, 128]``, keys ``[B, 8, L, 128]`` (grouped
queries), ``cos``/``sin`` ``[B, L, 128]`` from the rotary module, made once outside the timings
(a model makes them once per forward and shares them by all layers).

* ``(1) fused`` -- ``relpos_ext.hf.apply_rotary_pos_emb``: one ``relpos::rope`` call each for
  q and k (one read and one write of each; the backward is the same kernel, rotating back).
* ``(2) eager`` -- transformers' ``apply_rotary_pos_emb`` (``modeling_llama.py``):
  ``q * cos + rotate_half(q) * sin`` (slices, a negation, a concatenation, two products, a sum).
* ``(3) compiled`` -- ``torch.compile`` of (2) (Inductor fuses it into one loop per tensor),
  compiled for each shape and dtype in the warm-up round (compile time excluded).

Forward (under no_grad) and forward+backward (gradients of q and k), the methods taking turns
``--rounds`` times after a warm-up round; the table gives medians and each method's time over
(1)'s. Usage::

    python benchmarks/bench_rope.py              # ~1 min
    python benchmarks/bench_rope.py --quick      # a smoke test
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
from relpos_ext import reference

from _common import RESULTS, check_platform, print_environment, time_rounds, timestamp, write_json

METHODS = {"fused": "(1) fused", "eager": "(2) eager", "compiled": "(3) compiled"}
LENGTHS = [512, 2048, 8192]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def hf_apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' modeling_llama.apply_rotary_pos_emb (unsqueeze_dim=1), op for op."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotate_half = reference.rope_rotate
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def methods_for(length: int, dtype: torch.dtype, batch: int = 1, heads: int = 32,
                kv_heads: int = 8, dim: int = 128) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    torch._dynamo.reset()  # a fresh compile per shape and dtype (no recompile limit to hit)
    q = torch.randn(batch, heads, length, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, dtype=dtype, requires_grad=True)
    inv_freq, factor = relpos_ext.positions.rope_inv_freq(dim, 500000.0)
    positions = torch.arange(length).expand(batch, length)
    cos, sin = relpos_ext.positions.rope_cos_sin(inv_freq, positions, factor, dtype=dtype)
    gq, gk = torch.randn_like(q), torch.randn_like(k)
    impls = {"fused": relpos_ext.hf.apply_rotary_pos_emb, "eager": hf_apply_rotary_pos_emb,
             "compiled": torch.compile(hf_apply_rotary_pos_emb, dynamic=False)}
    fns: dict[str, Callable[[], object]] = {}
    for name, fn in impls.items():
        def fwd(fn=fn):
            with torch.no_grad():
                return fn(q, k, cos, sin)

        def fwdbwd(fn=fn):
            oq, ok = fn(q, k, cos, sin)
            return torch.autograd.grad((oq, ok), (q, k), (gq, gk))

        fns[f"{name}/fwd"] = fwd
        fns[f"{name}/fwdbwd"] = fwdbwd
    return fns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--quick", action="store_true", help="L = 64 and 128, 2 rounds (a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_rope.json")
    args = p.parse_args(argv)
    check_platform("bench_rope.py")
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)
    lengths = [64, 128] if args.quick else args.lengths
    rounds = 2 if args.quick else args.rounds
    head = f"{'dtype':<9}{'L':>6}  {'method':<14}{'fwd ms':>9}{'x (1)':>7}{'fwd+bwd ms':>12}{'x (1)':>7}"
    print(head)
    print("-" * len(head))
    rows = []
    t_start = time.perf_counter()
    for dtype_name in args.dtypes:
        for length in lengths:
            times = time_rounds(methods_for(length, DTYPES[dtype_name]), rounds)
            ms = {key: statistics.median(ts) * 1e3 for key, ts in times.items()}
            for name in METHODS:
                fwd, fb = ms[f"{name}/fwd"], ms[f"{name}/fwdbwd"]
                rows.append({"dtype": dtype_name, "length": length, "method": name,
                             "fwd_ms": fwd, "fwdbwd_ms": fb,
                             "fwd_ratio_vs_fused": fwd / ms["fused/fwd"],
                             "fwdbwd_ratio_vs_fused": fb / ms["fused/fwdbwd"]})
                print(f"{dtype_name:<9}{length:>6}  {METHODS[name]:<14}{fwd:>9.2f}"
                      f"{fwd / ms['fused/fwd']:>7.2f}{fb:>12.2f}{fb / ms['fused/fwdbwd']:>7.2f}")
            print()
    write_json({
        "benchmark": "bench_rope", "timestamp": timestamp(),
        "torch_version": torch.__version__, "build_info": info, "machine": mach,
        "config": {"batch": 1, "heads": 32, "kv_heads": 8, "dim": 128, "rope_theta": 500000.0,
                   "rounds": rounds, "threads": args.threads},
        "methods": METHODS, "elapsed_s": time.perf_counter() - t_start, "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
