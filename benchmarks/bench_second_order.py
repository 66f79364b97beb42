#!/usr/bin/env python
"""Benchmark second derivatives through ``relpos_ext.rel_attention``: a gradient penalty (the
squared norm of the gradients with respect to q, k and v, taken with ``create_graph=True``, as
R1 / WGAN-GP penalties and MAML take them), differentiated with respect to q, k, v and both
Shaw tables.

* ``(1) penalty`` -- through the op: its fused forward and backward, then the double backward
  in eager PyTorch by blocks of query rows (``relpos_ext/ops.py``,
  ``_rel_attention_second_order``).
* ``(2) fwd+bwd`` -- the op's forward and backward of a plain loss, the floor.
* ``(3) eager penalty`` -- the same penalty through ``reference.shaw_attention_gather``, the
  "efficient eager" form (``[L, L]`` logits and probabilities) and torch's own double backward
  (L <= 2048: beyond, its ``[L, L]`` tensors take GiBs).

The methods take turns, ``--rounds`` times after a warm-up round; the table gives medians and each
method's time over (2)'s. Before them, each in a fresh (spawned) interpreter, the peak RSS growth
of one call of (1) and of (3) at each length, inputs excluded. float32, B=1, H=8, D=64, K=64, not
causal. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_second_order.py    # ~3 min
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

import torch

import relpos_ext
from relpos_ext import reference

from _common import (RESULTS, call_peak_extra_mib, check_platform, in_spawned_child,
                     parse_rounds_args, print_environment, time_rounds, timestamp, write_json)

METHODS = {"penalty": "(1) penalty", "fwd_bwd": "(2) fwd+bwd", "eager_penalty": "(3) eager penalty"}
LENGTHS = [512, 1024, 2048, 4096]
EAGER_MAX_L = 2048


def methods_for(length: int, b: int = 1, h: int = 8, d: int = 64,
                k: int = 64) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    inputs = [x.requires_grad_() for x in (*(torch.randn(b, h, length, d) for _ in range(3)),
                                           torch.randn(2 * k + 1, d), torch.randn(2 * k + 1, d))]

    def penalty(attention: Callable[..., torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            out = attention(*inputs, k)
            grads = torch.autograd.grad(out.square().sum(), inputs[:3], create_graph=True)
            return torch.autograd.grad(sum(g.square().sum() for g in grads), inputs)
        return run

    def fwd_bwd() -> object:
        return torch.autograd.grad(relpos_ext.rel_attention(*inputs, k).square().sum(), inputs)

    fns = {"penalty": penalty(relpos_ext.rel_attention), "fwd_bwd": fwd_bwd}
    if length <= EAGER_MAX_L:
        fns["eager_penalty"] = penalty(reference.shaw_attention_gather)
    return fns


def penalty_memory(method: str, length: int, threads: int) -> dict:
    """Peak RSS growth of one call of ``method`` (after a warm-up at a small length)."""
    torch.set_num_threads(threads)
    methods_for(256)[method]()
    return call_peak_extra_mib(methods_for(length)[method])


def main(argv: list[str] | None = None) -> int:
    args, lengths, rounds = parse_rounds_args(argv, __doc__, RESULTS / "bench_second_order.json",
                                              LENGTHS, rounds=3)
    check_platform("bench_second_order.py")
    info, mach = print_environment(args.threads)
    head = f"{'L':>6}  {'method':<20}{'ms':>10}{'x fwd+bwd':>11}{'peak MiB':>10}"
    print(head)
    print("-" * len(head))
    rows = []
    t_start = time.perf_counter()
    memory = {(m, length): in_spawned_child(penalty_memory, m, length, args.threads)
              for length in lengths for m in ("penalty", "eager_penalty")
              if m == "penalty" or length <= EAGER_MAX_L}
    for length in lengths:
        fns = methods_for(length)
        times = time_rounds(fns, rounds)
        del fns
        floor_ms = statistics.median(times["fwd_bwd"]) * 1e3
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            mem = memory.get((name, length), {})
            row = {"length": length, "method": name, "time_ms": ms, "min_ms": min(ts) * 1e3,
                   "ratio_vs_fwd_bwd": ms / floor_ms, "peak_extra_mib": mem.get("peak_extra_mib")}
            if "error" in mem:
                row["memory_error"] = mem["error"]
            rows.append(row)
            cell = ("" if not mem else f"{mem['peak_extra_mib']:.0f}" if "error" not in mem
                    else "error")
            print(f"{length:>6}  {METHODS[name]:<20}{ms:>10.1f}{ms / floor_ms:>11.2f}{cell:>10}")
        print()
    write_json({
        "benchmark": "bench_second_order", "timestamp": timestamp(),
        "torch_version": torch.__version__, "build_info": info, "machine": mach,
        "config": {"dtype": "float32", "batch": 1, "heads": 8, "dim": 64, "max_distance": 64,
                   "causal": False, "penalty": "sum of squared gradients of q, k, v",
                   "differentiated": "q, k, v, rel_k, rel_v", "rounds": rounds,
                   "threads": args.threads, "eager_max_l": EAGER_MAX_L},
        "methods": METHODS, "memory_method": "VmHWM after clear_refs, in a spawned child",
        "elapsed_s": time.perf_counter() - t_start, "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
