#!/usr/bin/env python
"""Benchmark one decoding step of ``relpos_ext.nn.RelativeMultiheadAttention`` with a KV cache.

A step feeds one new position (``[B=1, 1, E]``) to a layer whose ``relpos_ext.nn.KVCache``
already holds ``T`` positions: the layer projects the row, appends its keys and values to the
cache and attends to all ``T + 1`` positions (causal, ``q_offset = T``). Under
``torch.inference_mode`` it times:

* ``(1) buffer`` -- ``relpos_ext.nn.KVCache``: a preallocated ``[B, Hkv, capacity, D]`` buffer;
  the step writes its row, and ``rel_attention`` reads ``[:, :, :T + 1]`` views in place.
* ``(2) cat`` -- the same layer with a cache that grows by ``torch.cat`` (the behaviour before
  the buffer): every step copies all ``T`` cached keys and values.
* ``(3) sliding`` -- with ``--window W`` (every method's layer then has ``window=(W - 1, 0)``, a
  sliding window of W positions): ``KVCache(sliding=True)``, which holds only the last
  ``W - 1`` positions, so its buffer (``capacity``) stays at a few windows however large ``T``.

Every timed call first puts the cache back at ``T`` positions (attribute assignments), so the
length does not drift over the repetitions. Each measurement runs in its own forked process
(``_common.measure_call``); ``x buffer`` is the method's time over the buffer's. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_kv_cache.py     # ~30 s
    python benchmarks/bench_kv_cache.py --lk 4096 --out /tmp/kv.json
    python benchmarks/bench_kv_cache.py --window 1024 --lk 2048 8192 32768 --out /tmp/kvw.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import Tensor

import relpos_ext
from relpos_ext.nn import KVCache, RelativeMultiheadAttention

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, add_common_args, check_platform, error_cell, in_child, measure_call,
    print_environment, timestamp, write_json,
)

METHODS = ("buffer", "cat")
SHORT = {"buffer": "(1) buffer", "cat": "(2) torch.cat", "sliding": "(3) sliding"}


class CatCache(KVCache):
    """A KVCache that always grows by torch.cat (its path under autograd and torch.compile, and
    its only one before the buffer): the baseline (2)."""

    def append(self, k: Tensor, v: Tensor, recorded: bool | None = None) -> tuple[Tensor, Tensor]:
        return self._append_by_cat(k, v)


def measure(method: str, t: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: time (and peak extra memory) of one step after t positions."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    window = None if args.window is None else (args.window - 1, 0)
    layer = RelativeMultiheadAttention(args.embed_dim, args.heads, args.max_distance,
                                       window=window).eval()
    prompt = torch.randn(1, t, args.embed_dim)
    row = torch.randn(1, 1, args.embed_dim)
    with torch.inference_mode():
        cache = {"buffer": KVCache, "cat": CatCache,
                 "sliding": lambda: KVCache(sliding=True)}[method]()
        layer(prompt, is_causal=True, cache=cache)
        state = (cache.k, cache.v, cache.offset, cache._start)

        def run():
            # back to t positions (the buffer keeps its capacity)
            cache.k, cache.v, cache.offset, cache._start = state
            with torch.inference_mode():
                return layer(row, is_causal=True, cache=cache)[0]

        run()
        res = measure_call(run, args)
    res["capacity"] = cache.capacity
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lk", type=int, nargs="+", default=[512, 2048, 8192],
                   help="cached positions T before the step (default 512 2048 8192)")
    p.add_argument("--embed-dim", type=int, default=512, help="E (default 512)")
    p.add_argument("--heads", type=int, default=8, help="H (default 8)")
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--window", type=int, default=None,
                   help="W: a sliding window of W positions (window=(W - 1, 0)) for every method,"
                   " and the sliding cache (3) besides")
    add_common_args(p, RESULTS / "bench_kv_cache.json")
    args = p.parse_args(argv)
    if args.window is not None and args.window < 1:
        p.error("--window must be at least 1")
    methods = METHODS + (("sliding",) if args.window is not None else ())
    args.min_run_time = min(args.min_run_time, 0.5)
    check_platform("bench_kv_cache.py")
    info, mach = print_environment(args.threads)
    print(f"layer: RelativeMultiheadAttention(E={args.embed_dim}, H={args.heads}, "
          f"K={args.max_distance}"
          + (f", window=({args.window - 1}, 0)" if args.window is not None else "")
          + "), float32, B=1, one new position per step, inference_mode\n")
    head = f"{'T':>6}  {'method':<15}{'time us':>10}{'x buffer':>10}{'capacity':>10}"
    print(head)
    print("-" * len(head))
    rows = []
    t0 = time.perf_counter()
    for t in args.lk:
        base_us = None
        for method in methods:
            res = in_child(measure, method, t, args)
            row = {"lk": t, "method": method}
            if "error" in res:
                row["error"] = res["error"]
                print(f"{t:>6}  {SHORT[method]:<15}{error_cell(res)}")
            else:
                us = res["time_ms"] * 1e3
                base_us = us if method == "buffer" else base_us
                ratio = us / base_us if base_us else None
                row |= {"time_us": us, "min_us": res["min_ms"] * 1e3, "ratio_vs_buffer": ratio,
                        "capacity": res["capacity"],
                        "peak_extra_mib": res["peak_extra_bytes"] / 2**20}
                print(f"{t:>6}  {SHORT[method]:<15}{us:>10.1f}"
                      f"{ratio if ratio is not None else float('nan'):>10.2f}{res['capacity']:>10}")
            rows.append(row)
        print()
    write_json({
        "benchmark": "bench_kv_cache", "timestamp": timestamp(), "torch_version": torch.__version__,
        "relpos_ext": relpos_ext.__name__, "build_info": info, "machine": mach,
        "config": {"batch": 1, "embed_dim": args.embed_dim, "heads": args.heads,
                   "max_distance": args.max_distance, "lk": args.lk, "dtype": "float32",
                   "window": args.window,
                   "min_run_time": args.min_run_time},
        "methods": {m: SHORT[m] for m in methods}, "elapsed_s": time.perf_counter() - t0,
        "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
