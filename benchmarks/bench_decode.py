#!/usr/bin/env python
"""Benchmark ``relpos_ext.rel_attention`` when decoding: a few new query rows against a cache.

Generation with a relative-position model (Music Transformer sampling, a Shaw-attention
decoder) calls the attention once per step with ``Lq`` new rows (1 when sampling, a few for
speculative decoding) against ``Lk`` cached keys and values, the new rows at positions
``Lk - Lq .. Lk - 1`` (``q_offset = Lk - Lq``, causal). For ``q, k, v [B=1, H=8, *, D=64]`` and
shared tables ``rel_k, rel_v [2K+1, D]``, float32 (``--dtype`` bfloat16 or float16), forward
only, it times:

* ``(1) ours`` -- ``relpos_ext.rel_attention(q, k, v, rel_k, rel_v, K, causal=True,
  q_offset=Lk - Lq)``.
* ``(2) eager`` -- ``relpos_ext.reference.shaw_attention`` with the same arguments: the tables
  gathered to ``[Lq, Lk, D]``, which for a few rows is what eager decoding code does.
* ``(3) SDPA, no rel`` -- ``F.scaled_dot_product_attention(q, k, v)``, no relative term: the
  floor (every row sees the whole cache, as in a causal step).

Each measurement runs in its own forked process (``_common.measure_call``); ``x ours`` is the
method's time over ours. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_decode.py     # ~1 min
    python benchmarks/bench_decode.py --lk 4096 --lq 1 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import relpos_ext
from relpos_ext import reference as ref

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, add_common_args, check_platform, error_cell, in_child, measure_call,
    print_environment, timestamp, write_json,
)

BATCH, HEADS, DIM = 1, 8, 64
METHODS = ("ours", "eager", "sdpa")
SHORT = {"ours": "(1) ours", "eager": "(2) eager [Lq,Lk,D]", "sdpa": "(3) SDPA, no rel"}


def measure(method: str, lq: int, lk: int, k: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: time (and peak extra memory) of one decoding step."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    dt = getattr(torch, args.dtype)
    q = torch.randn(BATCH, args.heads, lq, DIM, generator=g).to(dt)
    kk, v = (torch.randn(BATCH, args.heads, lk, DIM, generator=g).to(dt) for _ in range(2))
    rk, rv = ((torch.randn(2 * k + 1, DIM, generator=g) * DIM**-0.5).to(dt) for _ in range(2))
    kw = dict(causal=True, q_offset=lk - lq)
    if method == "ours":
        def run():
            return relpos_ext.rel_attention(q, kk, v, rk, rv, k, **kw)
    elif method == "eager":
        def run():
            return ref.shaw_attention(q, kk, v, rk, rv, k, **kw)
    else:
        def run():
            return F.scaled_dot_product_attention(q, kk, v)
    with torch.no_grad():
        if method != "sdpa":  # the two Shaw forms agree
            diff = (run() - ref.shaw_attention(q.double(), kk.double(), v.double(), rk.double(),
                                               rv.double(), k, **kw)).abs().max().item()
        else:
            diff = None
        res = measure_call(run, args)
    return res | {"max_abs_err_vs_float64": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lk", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="cache lengths (default 1024 4096 16384)")
    p.add_argument("--lq", type=int, nargs="+", default=[1, 16],
                   help="new query rows per step (default 1 16)")
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="of q, k, v and the tables (default float32; the other dtypes write "
                        "bench_decode_<dtype>.json unless --out says otherwise)")
    p.add_argument("--heads", type=int, default=HEADS,
                   help=f"query and kv heads H (default {HEADS}; with fewer than 64 (batch, head) "
                        "pairs our kernel splits a long cache across threads; other values write "
                        "bench_decode_h<H>.json unless --out says otherwise)")
    add_common_args(p, RESULTS / "bench_decode.json")
    args = p.parse_args(argv)
    if args.out == RESULTS / "bench_decode.json":
        suffix = ("" if args.dtype == "float32" else f"_{args.dtype}") + \
            ("" if args.heads == HEADS else f"_h{args.heads}")
        args.out = RESULTS / f"bench_decode{suffix}.json"
    args.min_run_time = min(args.min_run_time, 0.5)
    check_platform("bench_decode.py")
    info, mach = print_environment(args.threads)
    print(f"shape: B={BATCH} H={args.heads} D={DIM}, K={args.max_distance}, {args.dtype}, causal, "
          "q_offset = Lk - Lq, forward only\n")
    head = f"{'Lk':>6} {'Lq':>4}  {'method':<21}{'time us':>10}{'x ours':>8}{'max err':>10}"
    print(head)
    print("-" * len(head))
    rows = []
    t0 = time.perf_counter()
    for lk in args.lk:
        for lq in args.lq:
            ours_us = None
            for method in METHODS:
                res = in_child(measure, method, lq, lk, args.max_distance, args)
                row = {"lk": lk, "lq": lq, "method": method}
                if "error" in res:
                    row["error"] = res["error"]
                    print(f"{lk:>6} {lq:>4}  {SHORT[method]:<21}{error_cell(res)}")
                else:
                    us = res["time_ms"] * 1e3
                    ours_us = us if method == "ours" else ours_us
                    ratio = us / ours_us if ours_us else None
                    err = res["max_abs_err_vs_float64"]
                    row |= {"time_us": us, "min_us": res["min_ms"] * 1e3, "ratio_vs_ours": ratio,
                            "max_abs_err_vs_float64": err,
                            "peak_extra_mib": res["peak_extra_bytes"] / 2**20}
                    print(f"{lk:>6} {lq:>4}  {SHORT[method]:<21}{us:>10.1f}"
                          f"{ratio if ratio is not None else float('nan'):>8.2f}"
                          + (f"{err:>10.1e}" if err is not None else f"{'-':>10}"))
                rows.append(row)
            print()
    elapsed = time.perf_counter() - t0
    write_json({
        "benchmark": "bench_decode", "timestamp": timestamp(), "torch_version": torch.__version__,
        "build_info": info, "machine": mach,
        "config": {"batch": BATCH, "heads": args.heads, "dim": DIM, "dtype": args.dtype,
                   "max_distance": args.max_distance, "lk": args.lk, "lq": args.lq,
                   "min_run_time": args.min_run_time},
        "methods": SHORT, "elapsed_s": elapsed, "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
