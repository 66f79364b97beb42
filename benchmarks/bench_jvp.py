#!/usr/bin/env python
"""Benchmark forward mode through ``relpos_ext.rel_attention``: ``torch.func.jvp`` with tangents
for q, k, v and both Shaw tables (what JVP-regularised losses of consistency and MeanFlow models
take through every attention layer).

* ``(1) jvp`` -- ``torch.func.jvp`` of the op: the primal by the fused kernel, the tangent in
  eager PyTorch by blocks of query rows (``relpos_ext/ops.py``, ``_rel_attention_jvp``).
* ``(2) forward`` -- the op's forward alone, the floor.
* ``(3) eager jvp`` -- ``torch.func.jvp`` of ``reference.shaw_attention_gather``, the "efficient
  eager" form (``[L, L]`` logits and probabilities), forward mode through torch's own ops
  (L <= 2048: beyond, its ``[L, L]`` tensors take GiBs).

The methods take turns, ``--rounds`` times after a warm-up round; the table gives medians and each
method's time over (2)'s. Before them, each in a fresh (spawned) interpreter, the peak RSS growth
of one call of (1) at each length, inputs and tangents excluded (glibc's per-thread arenas keep freed blocks
resident, so this is above the tensors alive at once). float32, B=1, H=8, D=64, K=64, not
causal. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_jvp.py    # ~2 min
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

METHODS = {"jvp": "(1) jvp", "forward": "(2) forward", "eager_jvp": "(3) eager jvp"}
LENGTHS = [512, 1024, 2048, 4096, 8192]
EAGER_MAX_L = 2048


def methods_for(length: int, b: int = 1, h: int = 8, d: int = 64,
                k: int = 64) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    primals = (*(torch.randn(b, h, length, d) for _ in range(3)),
               torch.randn(2 * k + 1, d), torch.randn(2 * k + 1, d))
    tangents = tuple(torch.randn_like(x) for x in primals)

    def ours(q, kk, v, rel_k, rel_v):
        return relpos_ext.rel_attention(q, kk, v, rel_k, rel_v, k)

    def eager(q, kk, v, rel_k, rel_v):
        return reference.shaw_attention_gather(q, kk, v, rel_k, rel_v, k)

    fns = {"jvp": lambda: torch.func.jvp(ours, primals, tangents),
           "forward": lambda: ours(*primals)}
    if length <= EAGER_MAX_L:
        fns["eager_jvp"] = lambda: torch.func.jvp(eager, primals, tangents)
    return fns


def jvp_memory(length: int, threads: int) -> dict:
    """Peak RSS growth of one jvp call (after a warm-up at a small length), in this process."""
    torch.set_num_threads(threads)
    methods_for(256)["jvp"]()
    return call_peak_extra_mib(methods_for(length)["jvp"])


def main(argv: list[str] | None = None) -> int:
    args, lengths, rounds = parse_rounds_args(argv, __doc__, RESULTS / "bench_jvp.json", LENGTHS,
                                              rounds=5)
    check_platform("bench_jvp.py")
    info, mach = print_environment(args.threads)
    head = f"{'L':>6}  {'method':<16}{'ms':>10}{'x fwd':>8}"
    print(head)
    print("-" * len(head))
    rows = []
    t_start = time.perf_counter()
    memory = {length: in_spawned_child(jvp_memory, length, args.threads) for length in lengths}
    for length in lengths:
        fns = methods_for(length)
        times = time_rounds(fns, rounds)
        del fns
        forward_ms = statistics.median(times["forward"]) * 1e3
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            row = {"length": length, "method": name, "time_ms": ms, "min_ms": min(ts) * 1e3,
                   "ratio_vs_forward": ms / forward_ms}
            if name == "jvp":
                row["peak_extra_mib"] = memory[length].get("peak_extra_mib")
            rows.append(row)
            print(f"{length:>6}  {METHODS[name]:<16}{ms:>10.1f}{ms / forward_ms:>8.2f}")
        mib = memory[length].get("peak_extra_mib")
        print(f"{'':>6}  (1) peak RSS growth: "
              + (f"{mib:.0f} MiB" if mib is not None else f"error: {memory[length]}"))
        print()
    write_json({
        "benchmark": "bench_jvp", "timestamp": timestamp(),
        "torch_version": torch.__version__, "build_info": info, "machine": mach,
        "config": {"dtype": "float32", "batch": 1, "heads": 8, "dim": 64, "max_distance": 64,
                   "causal": False, "tangents": "q, k, v, rel_k, rel_v", "rounds": rounds,
                   "threads": args.threads, "eager_max_l": EAGER_MAX_L},
        "methods": METHODS, "memory_method": "VmHWM after clear_refs, in a spawned child",
        "elapsed_s": time.perf_counter() - t_start, "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
