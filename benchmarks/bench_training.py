#!/usr/bin/env python
"""Benchmark ``relpos_ext.rel_attention`` in training: attention dropout and attention masks.

For ``q, k, v [B=1, H=8, L, D=64]`` and shared tables ``rel_k, rel_v [2K+1, D]`` (the shapes of
``bench_attention.py``), the time of one forward+backward (gradients w.r.t. ``q, k, v`` and, where
there are tables, ``rel_k, rel_v``) with dropout ``p`` (``--dropout``, default 0.1) on the
probabilities and, with ``--docs N``, a block-diagonal attention mask of N packed documents of
``L / N`` positions (True = ignore) and, with ``--window W``, a local window ``|r| <= W`` (given
to ours as ``window_left = window_right = W``, to the others as an ``[L, L]`` mask), of:

* ``ours p=0`` -- ``relpos_ext.rel_attention`` with the mask and without dropout (what dropout
  costs on top);
* ``ours`` -- ``relpos_ext.rel_attention(..., dropout_p=p, attn_mask=mask)``: the dropout mask
  hashed in the kernels and recomputed by the backward, never stored; key tiles the attention
  mask hides whole are skipped;
* ``ours segments`` (with ``--docs``) -- ``ours`` with the documents given as segment ids
  ``[1, L]`` (``q_segment_ids = k_segment_ids``) instead of the ``[L, L]`` mask;
* ``eager`` -- ``reference.shaw_attention_gather(..., dropout_p=p, attn_mask=mask)``:
  bench_attention's (3) with ``F.dropout`` on the ``[B, H, L, L]`` probabilities;
* ``compiled`` -- ``torch.compile(fullgraph=True)`` of that, compile time excluded;
* ``sdpa`` -- ``F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, dropout_p=p)``, no
  relative terms.

Each measurement runs in a forked child (``_common.measure_call``); then ``--rounds`` interleaved
pairs of ``ours`` and ``eager`` at each L give the speed-up as a median of ratios.

Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_training.py            # ~3 min
    python benchmarks/bench_training.py --dropout 0 --docs 4   # -> bench_training_docs4.json
    python benchmarks/bench_training.py -L 1024 --dropout 0.3 --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import relpos_ext
from relpos_ext.reference import shaw_attention_gather

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, add_common_args, check_platform, in_child, measure_call, print_environment,
    timestamp, write_json,
)
from bench_attention import BATCH, DIM, HEADS, _child_setup, _make_inputs

METHODS = ("ours p=0", "ours", "eager", "compiled", "sdpa")
SEGMENTS = "ours segments"  # with --docs only
TABLES = ("ours p=0", "ours", SEGMENTS, "eager", "compiled")  # gradients w.r.t. the tables too


def methods(docs: int) -> tuple[str, ...]:
    return METHODS[:2] + (SEGMENTS,) + METHODS[2:] if docs else METHODS


def doc_mask(length: int, docs: int) -> Tensor | None:
    """``[L, L]`` bool, True = ignore: `docs` packed documents of ``L / docs`` positions (None for
    docs = 0)."""
    if docs == 0:
        return None
    doc = doc_ids(length, docs)[0]
    return doc[:, None] != doc[None, :]


def doc_ids(length: int, docs: int) -> Tensor:
    """``[1, L]`` int64: the document of each position (`docs` of ``L / docs`` positions)."""
    return (torch.arange(length) * max(docs, 1) // length)[None, :]


def window_mask(length: int, window: int) -> Tensor:
    """``[L, L]`` bool, True = ignore: the keys farther than `window` positions away."""
    r = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    return r.abs() > window


def method_fn(method: str, k: int, p: float, mask: Tensor | None, docs: int = 0,
              window: int = -1, length: int = 0) -> Callable[..., Tensor]:
    """``f(q, k, v, rel_k, rel_v) -> [B, H, L, D]`` for ``method`` with dropout ``p`` and the
    attention mask of the documents (True = ignore), or (``ours segments``) their segment ids,
    and the window (ours: ``window_left = window_right = window``, the others: its mask)."""
    win = dict(window_left=window, window_right=window)
    if method == SEGMENTS:
        ids = doc_ids(length, docs)
        return lambda q, k_, v, rk, rv: relpos_ext.rel_attention(
            q, k_, v, rk, rv, k, dropout_p=p, q_segment_ids=ids, k_segment_ids=ids, **win)
    if method == "ours p=0":
        return lambda q, k_, v, rk, rv: relpos_ext.rel_attention(q, k_, v, rk, rv, k,
                                                                 attn_mask=mask, **win)
    if method == "ours":
        return lambda q, k_, v, rk, rv: relpos_ext.rel_attention(q, k_, v, rk, rv, k, dropout_p=p,
                                                                 attn_mask=mask, **win)
    if window >= 0:  # the others take the window as a mask
        wmask = window_mask(length, window)
        mask = wmask if mask is None else mask | wmask
    if method == "eager":
        return lambda q, k_, v, rk, rv: shaw_attention_gather(q, k_, v, rk, rv, k, dropout_p=p,
                                                              attn_mask=mask)
    if method == "compiled":
        compiled = torch.compile(shaw_attention_gather, fullgraph=True)
        return lambda q, k_, v, rk, rv: compiled(q, k_, v, rk, rv, k, dropout_p=p, attn_mask=mask)
    if method == "sdpa":
        keep = None if mask is None else ~mask  # SDPA's bool mask: True = take part
        return lambda q, k_, v, rk, rv: F.scaled_dot_product_attention(q, k_, v, attn_mask=keep,
                                                                       dropout_p=p)
    raise ValueError(f"unknown method {method!r}")


def _runner(method: str, length: int, k: int, p: float, docs: int,
            window: int = -1) -> Callable[[], object]:
    fn = method_fn(method, k, p, doc_mask(length, docs), docs, window, length)
    inputs, go = _make_inputs(length, k, grad=True)
    wrt = inputs if method in TABLES else inputs[:3]
    return lambda: torch.autograd.grad(fn(*inputs), wrt, go)


def measure(method: str, length: int, k: int, p: float, args: argparse.Namespace) -> dict:
    """Runs in a forked child: the warm-up (compiling, for `compiled`), then time and memory."""
    _child_setup(args.threads, compiles=method == "compiled")
    run = _runner(method, length, k, p, args.docs, args.window)
    run()
    return measure_call(run, args, trim=True)


def paired_rounds(length: int, k: int, p: float, args: argparse.Namespace) -> dict:
    """Runs in a forked child: `args.rounds` interleaved timings of ours and eager; the ratios."""
    _child_setup(args.threads, compiles=False)
    runs = {m: _runner(m, length, k, p, args.docs, args.window) for m in ("ours", "eager")}
    for run in runs.values():
        run()
    ratios = []
    for _ in range(args.rounds):
        t = {}
        for m, run in runs.items():
            t0 = time.perf_counter()
            run()
            t[m] = time.perf_counter() - t0
        ratios.append(t["eager"] / t["ours"])
    return {"eager_over_ours": ratios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout_p (default 0.1)")
    p.add_argument("--docs", type=int, default=0,
                   help="attention mask of this many packed documents (default 0: no mask)")
    p.add_argument("--window", type=int, default=-1,
                   help="local window |r| <= W (default -1: none)")
    p.add_argument("--rounds", type=int, default=5,
                   help="interleaved ours/eager pairs per L for the median ratio (default 5)")
    add_common_args(p, RESULTS / "bench_training.json", rep_budget_s=10.0)
    args = p.parse_args(argv)
    if args.out == RESULTS / "bench_training.json":  # bench_training_<what>.json
        what = ([f"dropout{args.dropout:g}"] if args.dropout else []) + (
            [f"docs{args.docs}"] if args.docs else []) + (
            [f"window{args.window}"] if args.window >= 0 else [])
        args.out = RESULTS / f"bench_training_{'_'.join(what) or 'plain'}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_platform("bench_training.py")
    info, mach = print_environment(args.threads)
    k, p = args.max_distance, args.dropout
    print(f"shape: B={BATCH} H={HEADS} D={DIM} Lq=Lk=L, K={k}, float32, dropout_p={p}, "
          f"attention mask: {f'{args.docs} packed documents' if args.docs else 'none'}, "
          f"window: {args.window if args.window >= 0 else 'none'}; "
          "forward+backward")
    rows = []
    names = methods(args.docs)
    print(f"{'L':>5}  " + "".join(f"{m:>14}" for m in names) + "   eager/ours (pairs)")
    for length in args.lengths:
        row = {"L": length, "time_ms": {}, "peak_extra_mib": {}}
        for method in names:
            res = in_child(measure, method, length, k, p, args)
            row["time_ms"][method] = res.get("time_ms")
            row["peak_extra_mib"][method] = res.get("peak_extra_bytes", 0) / 2**20
            if "error" in res:
                row.setdefault("errors", {})[method] = res["error"]
        pairs = in_child(paired_rounds, length, k, p, args) if args.rounds > 0 else {}
        row["eager_over_ours_pairs"] = pairs.get("eager_over_ours")
        ratio = statistics.median(row["eager_over_ours_pairs"]) if row["eager_over_ours_pairs"] else None
        row["eager_over_ours_median"] = ratio
        cells = "".join(f"{row['time_ms'][m]:>14.1f}" if row["time_ms"][m] else f"{'error':>14}"
                        for m in names)
        print(f"{length:>5}  {cells}   {ratio:.2f}" if ratio else f"{length:>5}  {cells}", flush=True)
        rows.append(row)
    write_json({
        "benchmark": "bench_training", "timestamp": timestamp(), "torch_version": torch.__version__,
        "build_info": info, "machine": mach,
        "config": {"batch": BATCH, "heads": HEADS, "dim": DIM, "dtype": "float32",
                   "max_distance": k, "dropout_p": p, "docs": args.docs, "window": args.window,
                   "lengths": args.lengths,
                   "rounds": args.rounds, "threads": args.threads},
        "methods": list(names), "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
