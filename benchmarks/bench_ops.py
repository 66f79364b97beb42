#!/usr/bin/env python
"""Benchmark ``relpos_ext.rel_logits`` against the two eager PyTorch ways of computing it.

For every (L, K) it times the forward and the forward+backward (gradients w.r.t. ``q`` and the
table) of three methods computing ``S[b, h, i, j] = q[b, h, i] . E[bucket(i, j)]``:

* ``ours``  -- ``relpos_ext.rel_logits``: the fused skewed matmul, never ``[Lq, Lk, D]``.
* ``(a)``   -- ``relpos_ext.reference.rel_logits``: materialised gather ``E[bucket]`` of shape
  ``[Lq, Lk, D]`` then einsum (tensor2tensor's ``_relative_attention_inner``).
* ``(b)``   -- ``relpos_ext.reference.rel_logits_gather``: eager ``q @ E^T`` (``[.., Lq, 2K+1]``)
  then ``torch.gather`` with an ``[Lq, Lk]`` int64 bucket index.

Each measurement runs in its own process, forked from this one after ``torch`` is imported (the
parent never runs a kernel, so no thread pool is inherited), so that one measurement's freed
memory cannot hide another's peak. Peak extra memory is the growth of the resident set: the child
allocates its inputs (and the upstream gradient), resets the kernel's peak-RSS counter
(``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), runs the method once and reads ``VmHWM``
(``_common.measure_call``). That counts every page touched (torch tensors and a kernel's private
scratch alike), including the ``[B, H, Lq, Lk]`` output and the gradients. Where ``clear_refs`` is
not writable it falls back to the ``ru_maxrss`` delta, a lower bound (the JSON records which). The
analytic size of each method's largest intermediate is printed beside it.

Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_ops.py            # full (~10 min, 2 cores)
    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_ops.py --quick    # smoke run (~30 s)
    python benchmarks/bench_ops.py --lengths 1024 2048 --ks 64 --dtype float64 --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import relpos_ext
from relpos_ext import reference as ref

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, GiB, MiB, add_common_args, check_platform, error_cell, in_child, loglog_axes,
    measure_call, print_environment, timestamp, write_json,
)

BATCH, HEADS, DIM = 1, 8, 64
WSUM_CHUNK_BYTES = 32 << 20  # OpsImpl::kWsumChunkBytes (csrc/common/ops_impl.h)
METHODS = ("ours", "gather_einsum", "matmul_gather")
LABELS = {
    "ours": "ours: relpos_ext.rel_logits",
    "gather_einsum": "(a) gather [Lq,Lk,D] + einsum",
    "matmul_gather": "(b) q@E^T + torch.gather",
}
SHORT = {"ours": "ours", "gather_einsum": "(a) gather+einsum", "matmul_gather": "(b) q@E^T+gather"}
MODES = ("fwd", "fwd+bwd")
TARGET_L, TARGET_SPEEDUP = 2048, 2.0


# --------------------------------------------------------------------------- the methods
def method_fn(method: str) -> Callable[..., torch.Tensor]:
    """The function ``f(q, table, K, Lk) -> [B, H, Lq, Lk]`` benchmarked under ``method``."""
    return {
        "ours": relpos_ext.rel_logits,
        "gather_einsum": ref.rel_logits,
        "matmul_gather": ref.rel_logits_gather,
    }[method]


def parse_k(spec: str, length: int) -> int:
    """A K spec is an int or ``L-1`` (the unclipped Music Transformer case)."""
    return length - 1 if spec.replace(" ", "").upper() == "L-1" else int(spec)


def analytic_intermediate(method: str, mode: str, length: int, k: int, itemsize: int) -> dict:
    """Bytes of the largest tensor a method creates besides the ``[B, H, Lq, Lk]`` output.

    (a): the gathered ``[Lq, Lk, D]`` (and its gradient, alive at the same time, in backward).
    (b): ``q @ E^T`` ``[B, H, Lq, 2K+1]`` or the ``[Lq, Lk]`` int64 bucket index, the larger.
    ours: forward none (O(D) per row on the stack); backward the per-row bucket sums ``wsum``
    ``[Lq, min(2K+1, Lq+Lk-1)]`` in float32/float64 for a group of heads at a time: as many as
    fit in 32 MiB, at least one (``OpsImpl::rel_logits_backward``).
    """
    rows = 2 * k + 1
    if method == "gather_einsum":
        one = length * length * DIM * itemsize
        return {
            "bytes": one * (2 if mode == "fwd+bwd" else 1),
            "what": "[Lq,Lk,D]" + (" + its grad" if mode == "fwd+bwd" else ""),
        }
    if method == "matmul_gather":
        qe = BATCH * HEADS * length * rows * itemsize
        index = length * length * 8
        return (
            {"bytes": qe, "what": "q@E^T [B,H,Lq,2K+1]"}
            if qe >= index
            else {"bytes": index, "what": "index [Lq,Lk] int64"}
        )
    if mode == "fwd":
        return {"bytes": 0, "what": "none (O(D) per row)"}
    cols = min(rows, 2 * length - 1)
    head = length * cols * max(itemsize, 4)
    group = max(1, min(HEADS, WSUM_CHUNK_BYTES // head))
    return {"bytes": group * head, "what": f"wsum [{group} heads,Lq,C]"}


# --------------------------------------------------------------------------- measuring
def _make_inputs(length: int, k: int, dtype: torch.dtype, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, length, DIM, generator=g, dtype=dtype)
    table = torch.randn(2 * k + 1, DIM, generator=g, dtype=dtype)
    go = torch.randn(BATCH, HEADS, length, length, generator=g, dtype=dtype) if grad else None
    return q.requires_grad_(grad), table.requires_grad_(grad), go


def _runner(method: str, mode: str, length: int, k: int, dtype: torch.dtype) -> Callable[[], Any]:
    f = method_fn(method)
    q, table, go = _make_inputs(length, k, dtype, grad=mode == "fwd+bwd")
    if mode == "fwd":
        return lambda: f(q, table, k, length)
    return lambda: torch.autograd.grad(f(q, table, k, length), (q, table), go)


def measure(method: str, mode: str, length: int, k: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: peak extra memory of one call, then its time."""
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    _runner(method, mode, 32, min(k, 31), dtype)()  # load lazy state: thread pool, dispatch
    return measure_call(_runner(method, mode, length, k, dtype), args)


# --------------------------------------------------------------------------- the run
@dataclass
class Row:
    length: int
    k: int
    mode: str
    method: str
    time_ms: float | None = None
    ratio_vs_ours: float | None = None
    peak_extra_mib: float | None = None
    analytic_mib: float = 0.0
    analytic_what: str = ""
    skipped: str | None = None
    raw: dict = field(default_factory=dict)


def sanity_check(dtype_name: str, length: int = 96, k: int = 7) -> dict:
    """Max |ours - (b)| at a small shape, so a broken build does not produce fast numbers."""
    q, table, _ = _make_inputs(length, k, getattr(torch, dtype_name), grad=False, seed=1)
    got = relpos_ext.rel_logits(q, table, k, length)
    want = ref.rel_logits_gather(q, table, k, length)
    return {"max_abs_err": (got - want).abs().max().item()}


def run_all(args: argparse.Namespace) -> list[Row]:
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    rows: list[Row] = []
    for length in args.lengths:
        ks = sorted({parse_k(s, length) for s in args.ks})
        for k in ks:
            for mode in MODES:
                ours_ms = None
                for method in METHODS:
                    an = analytic_intermediate(method, mode, length, k, itemsize)
                    row = Row(length, k, mode, method, analytic_mib=an["bytes"] / MiB,
                              analytic_what=an["what"])
                    if method == "gather_einsum" and an["bytes"] > args.mem_cap_gib * GiB:
                        row.skipped = f"skipped ({an['bytes'] / GiB:.1f} GiB)"
                    else:
                        t0 = time.perf_counter()
                        res = in_child(measure, method, mode, length, k, args)
                        row.raw = res
                        if "error" in res:
                            row.skipped = error_cell(res)
                        else:
                            row.time_ms = res["time_ms"]
                            row.peak_extra_mib = res["peak_extra_bytes"] / MiB
                            if method == "ours":
                                ours_ms = row.time_ms
                            if ours_ms:
                                row.ratio_vs_ours = row.time_ms / ours_ms
                        if args.verbose:
                            print(f"  [{time.perf_counter() - t0:6.1f}s] L={length} K={k} {mode} "
                                  f"{method}: {row.time_ms or row.skipped}", flush=True)
                    rows.append(row)
    return rows


# --------------------------------------------------------------------------- reporting
def format_table(rows: list[Row]) -> str:
    head = (f"{'L':>5} {'K':>5} {'mode':<8}{'method':<18}{'time ms':>10}{'x ours':>8}"
            f"{'peak extra MiB':>16}   largest intermediate (analytic)")
    lines = [head, "-" * len(head) + "-" * 12]
    prev = None
    for r in rows:
        key = (r.length, r.k)
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        if r.skipped:
            lines.append(f"{r.length:>5} {r.k:>5} {r.mode:<8}{SHORT[r.method]:<18}{r.skipped:>34}"
                         f"   {r.analytic_mib:10.1f} MiB {r.analytic_what}")
            continue
        x = f"{r.ratio_vs_ours:.2f}" if r.ratio_vs_ours is not None else "-"
        lines.append(
            f"{r.length:>5} {r.k:>5} {r.mode:<8}{SHORT[r.method]:<18}{r.time_ms:>10.2f}{x:>8}"
            f"{r.peak_extra_mib:>16.1f}   {r.analytic_mib:10.1f} MiB {r.analytic_what}"
        )
    return "\n".join(lines)


def target_verdicts(rows: list[Row]) -> list[dict]:
    """rel_logits forward must be >= 2x faster than (b) at L=2048, per K."""
    out = []
    fwd = {(r.length, r.k, r.method): r for r in rows if r.mode == "fwd"}
    for (length, k, method), r in sorted(fwd.items()):
        if length != TARGET_L or method != "ours":
            continue
        b = fwd.get((length, k, "matmul_gather"))
        if r.time_ms is None or b is None or b.time_ms is None:
            out.append({"L": length, "K": k, "speedup": None, "verdict": "N/A"})
            continue
        speedup = b.time_ms / r.time_ms
        out.append({"L": length, "K": k, "speedup": speedup,
                    "verdict": "PASS" if speedup >= TARGET_SPEEDUP else "FAIL"})
    return out


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "tab:blue", "gather_einsum": "tab:red", "matmul_gather": "tab:green"}

    def ks_kind(r: Row) -> str:
        return "K=L-1" if r.k == r.length - 1 else f"K={r.k}"

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, mode in zip(axes, MODES):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if r.mode == mode and r.time_ms is not None:
                series.setdefault((r.method, ks_kind(r)), []).append((r.length, r.time_ms))
        kinds = sorted({k for _, k in series}, key=lambda s: (s != "K=L-1", s))
        styles = {k: s for k, s in zip(kinds, ["-", "--", ":", "-."] * 4)}
        order = sorted(series.items(), key=lambda kv: (METHODS.index(kv[0][0]), kinds.index(kv[0][1])))
        for (method, kind), pts in order:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[kind], marker="o",
                    color=colors[method], label=f"{SHORT[method]}, {kind}")
        loglog_axes(ax, sorted({r.length for r in rows}), mode)
    axes[0].set_ylabel("time (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", "-L", type=int, nargs="+",
                   help="sequence lengths, Lq = Lk (default: 512 1024 2048 4096; --quick: 128 256)")
    p.add_argument("--ks", "-K", nargs="+",
                   help="max distances K; 'L-1' means unclipped (default: 64 L-1; --quick: 16 L-1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--quick", action="store_true",
                   help="tiny smoke run (~30 s): small L, short timings")
    p.add_argument("--mem-cap-gib", type=float, default=4.0,
                   help="skip (a) where its live [Lq,Lk,D] tensors exceed this (default 4)")
    add_common_args(p, RESULTS / "bench_ops.json")
    args = p.parse_args(argv)
    if args.quick:
        args.min_run_time, args.slow_reps = 0.1, 1
    args.lengths = args.lengths or ([128, 256] if args.quick else [512, 1024, 2048, 4096])
    args.ks = args.ks or (["16", "L-1"] if args.quick else ["64", "L-1"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_platform("bench_ops.py")
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    info, mach = print_environment(args.threads)
    print(f"shape: B={BATCH} H={HEADS} D={DIM} Lq=Lk=L, dtype={args.dtype}, shared table [2K+1, D]")
    sanity = in_child(sanity_check, args.dtype)
    err = sanity.get("max_abs_err")
    print(f"sanity: max |ours - (b)| at L=96, K=7: "
          + (f"{err:.2e}" if err is not None else sanity["error"].splitlines()[0]))
    print("methods:")
    for m in METHODS:
        print(f"  {LABELS[m]}")
    print("memory: peak RSS growth during one call, each in a fresh forked process; inputs and "
          "upstream grad excluded,\n        output and grads included (the output [B,H,L,L] is "
          f"{BATCH * HEADS * 2048**2 * itemsize / MiB:.0f} MiB at L=2048, for every method)")
    print(f"target: rel_logits forward >= {TARGET_SPEEDUP:.0f}x faster than (b) at L={TARGET_L}, per K")
    print(flush=True)

    t0 = time.perf_counter()
    rows = run_all(args)
    elapsed = time.perf_counter() - t0
    print(format_table(rows))
    print()
    verdicts = target_verdicts(rows)
    if not verdicts:
        print(f"target: N/A (L={TARGET_L} not in this run)")
    for v in verdicts:
        s = f"{v['speedup']:.2f}x" if v["speedup"] is not None else "not measured"
        print(f"target L={v['L']} K={v['K']}: ours fwd vs (b) fwd = {s} "
              f"(need >= {TARGET_SPEEDUP:.1f}x): {v['verdict']}")
    print(f"total {elapsed:.0f} s")

    mem_methods = {r.raw.get("memory_method") for r in rows if r.raw.get("memory_method")}
    doc = {
        "benchmark": "bench_ops",
        "timestamp": timestamp(),
        "torch_version": torch.__version__,
        "build_info": info,
        "machine": mach,
        "config": {
            "batch": BATCH, "heads": HEADS, "dim": DIM, "dtype": args.dtype,
            "lengths": args.lengths, "ks": args.ks, "quick": args.quick,
            "mem_cap_gib": args.mem_cap_gib, "min_run_time": args.min_run_time,
            "slow_s": args.slow_s, "slow_reps": args.slow_reps,
        },
        "memory_method": sorted(mem_methods),
        "methods": LABELS,
        "target": {"L": TARGET_L, "min_speedup_fwd_vs_b": TARGET_SPEEDUP, "verdicts": verdicts},
        "sanity_max_abs_err": err,
        "elapsed_s": elapsed,
        "results": [
            {k: v for k, v in asdict(r).items() if k != "raw"}
            | {"min_ms": r.raw.get("min_ms"), "times_ms": r.raw.get("times_ms"),
               "first_call_ms": r.raw.get("first_call_ms"),
               "error": r.raw.get("error")}
            for r in rows
        ],
    }
    write_json(doc, args.out)
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        plot(rows, png, f"rel_logits, B={BATCH} H={HEADS} D={DIM} {args.dtype}, "
                        f"{args.threads} threads, {info['cpu_kernel_in_use']} kernel, "
                        f"{mach['cpu']}")
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
