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

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import relpos_ext
from relpos_ext import reference

from _common import (MiB, RESULTS, check_platform, peak_rss_bytes, print_environment,
                     reset_peak_rss, time_rounds, timestamp, write_json)

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
    run = methods_for(length)["jvp"]
    resettable = reset_peak_rss()
    base = peak_rss_bytes(resettable)
    out = run()
    peak = peak_rss_bytes(resettable)
    del out
    return {"peak_extra_mib": max(peak - base, 0) / MiB}


def measure_memory(length: int, threads: int) -> dict:
    """:func:`jvp_memory` in a fresh interpreter (spawned, not forked: a child forked from a
    process whose OpenMP threads are up, as here after the timings or inside pytest, hangs in
    its first parallel region)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(jvp_memory, (length, threads))
        except Exception as e:  # noqa: BLE001  (report it in the table, keep going)
            return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    p.add_argument("--quick", action="store_true", help="L = 128 and 256, 2 rounds (a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_jvp.json")
    args = p.parse_args(argv)
    check_platform("bench_jvp.py")
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)
    lengths = [128, 256] if args.quick else args.lengths
    rounds = 2 if args.quick else args.rounds
    head = f"{'L':>6}  {'method':<16}{'ms':>10}{'x fwd':>8}"
    print(head)
    print("-" * len(head))
    rows = []
    t_start = time.perf_counter()
    memory = {length: measure_memory(length, args.threads) for length in lengths}
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
