#!/usr/bin/env python
"""Benchmark ``relpos_ext.rel_attention`` (fused Shaw attention) against eager, compiled and
FlexAttention forms of the same attention, and against SDPA with no relative terms.

For every L it times the forward and the forward+backward (gradients w.r.t. ``q, k, v, rel_k,
rel_v``) of, for ``q, k, v [B=1, H=8, L, D=64]`` and shared tables ``rel_k, rel_v [2K+1, D]``:

* ``(1) ours`` -- ``relpos_ext.rel_attention(q, k, v, rel_k, rel_v, K)``: online softmax over
  key tiles, the relative terms as skewed bands; no ``[L, L]`` tensor, forward or backward.
* ``(2)`` -- ``relpos_ext.reference.shaw_attention``: both tables gathered to ``[L, L, D]``
  (tensor2tensor). Only for L <= 1024.
* ``(3)`` -- ``relpos_ext.reference.shaw_attention_gather``: the lean eager form. Keys: ``q @ rel_k^T``
  then ``torch.gather`` by bucket; values: per-bucket probability mass ``W`` by ``scatter_add``,
  then ``W @ rel_v``. The softmax holds ``[B, H, L, L]`` logits and probabilities.
* ``(4)`` -- ``torch.compile(fullgraph=True)`` of (3); compiled and warmed up at the measured
  shape first, compile time excluded (reported in the JSON).
* ``(5)`` -- FlexAttention (compiled) with a ``score_mod`` adding the key term only, indexing a
  precomputed ``QE = q @ rel_k^T [B, H, L, 2K+1]``. A ``score_mod`` changes one score; the value
  term ``sum_j p_ij rel_v[bucket(i, j)]`` changes the output, so FlexAttention cannot express
  it, and FlexAttention has no CPU backward: forward only, and it does less work than (1)-(4).
* ``(6)`` -- ``F.scaled_dot_product_attention(q, k, v)`` with no relative term: the floor.

Each measurement runs in its own forked process (``_common.measure_call``, as in
``bench_ops.py``). Peak extra memory is the resident-set growth over one call, inputs (and the
upstream gradient) excluded; it includes the output and the gradients. ``working`` subtracts
those (analytic sizes), leaving the memory the method needs beyond inputs, outputs and
gradients. (3)/(4) are skipped where their analytic ``[L, L]``-style live set exceeds
``--mem-cap-gib``.

Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_attention.py          # ~10-15 min
    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_attention.py --quick  # smoke run
    python benchmarks/bench_attention.py --lengths 1024 2048 --out /tmp/a.json --no-plot
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

import relpos_ext
from relpos_ext import reference as ref
from relpos_ext.reference import shaw_attention_gather

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, GiB, MiB, add_common_args, check_platform, error_cell, in_child, loglog_axes,
    measure_call, print_environment, timestamp, write_json,
)

BATCH, HEADS, DIM, ITEMSIZE = 1, 8, 64, 4  # float32
METHODS = ("ours", "materialised", "eager", "compiled", "flex", "sdpa")
LABELS = {
    "ours": "(1) ours: relpos_ext.rel_attention",
    "materialised": "(2) reference.shaw_attention, tables gathered to [L,L,D] (L <= 1024)",
    "eager": "(3) eager q@rel_k^T + gather, scatter_add bucket mass @ rel_v, [L,L] softmax",
    "compiled": "(4) torch.compile(fullgraph=True) of (3), compile time excluded",
    "flex": "(5) FlexAttention (compiled), score_mod adds the key term only; forward only",
    "sdpa": "(6) F.scaled_dot_product_attention, no relative term (the floor)",
}
SHORT = {
    "ours": "(1) ours", "materialised": "(2) [L,L,D]", "eager": "(3) eager",
    "compiled": "(4) compiled", "flex": "(5) flex, keys", "sdpa": "(6) SDPA, no rel",
}
MODES = ("fwd", "fwd+bwd")
COMPILED = ("compiled", "flex")
TABLES = ("ours", "materialised", "eager", "compiled")  # gradients w.r.t. rel_k and rel_v too
MATERIALISED_MAX_L = 1024
TARGET_L, MAX_VS_SDPA, MIN_SPEEDUP = 2048, 1.5, 4.0
MEMORY_L, MAX_WORKING_MIB = 8192, 64.0
FLEX_NO_BACKWARD = "n/a: FlexAttention has no CPU backward"


# --------------------------------------------------------------------------- the methods
def flex_shaw_keys(q: Tensor, k: Tensor, v: Tensor, rel_k: Tensor, max_distance: int) -> Tensor:
    """(5) FlexAttention with Shaw's key term as a ``score_mod``; no value term.

    q, k, v: ``[B, H, L, D]``; rel_k ``[2K+1, D]``. FlexAttention passes the already-scaled
    ``score = q_i . k_j / sqrt(D)``, so the key term is scaled in the ``score_mod``. (Scaling
    ``QE`` before the call instead fails to lower on CPU in torch 2.14: NoValidChoicesError.)
    """
    qe = torch.matmul(q, rel_k.transpose(-1, -2))  # [B, H, L, 2K+1]
    scale = q.shape[-1] ** -0.5

    def key_term(score, b, h, i, j):
        # bucket(i, j) of reference.shaw_buckets, written on the scalar indices score_mod gets
        bucket = torch.clamp(j - i, -max_distance, max_distance) + max_distance
        return score + qe[b, h, i, bucket] * scale

    return flex_attention(q, k, v, score_mod=key_term)


def method_fn(method: str, max_distance: int) -> Callable[..., Tensor]:
    """``f(q, k, v, rel_k, rel_v) -> [B, H, L, D]`` for ``method`` (compiling where it says so)."""
    kd = max_distance
    if method == "ours":
        return lambda q, k, v, rk, rv: relpos_ext.rel_attention(q, k, v, rk, rv, kd)
    if method == "materialised":
        return lambda q, k, v, rk, rv: ref.shaw_attention(q, k, v, rk, rv, kd)
    if method == "eager":
        return lambda q, k, v, rk, rv: shaw_attention_gather(q, k, v, rk, rv, kd)
    if method == "compiled":
        compiled = torch.compile(shaw_attention_gather, fullgraph=True)
        return lambda q, k, v, rk, rv: compiled(q, k, v, rk, rv, kd)
    if method == "flex":
        compiled = torch.compile(flex_shaw_keys, fullgraph=True)
        return lambda q, k, v, rk, rv: compiled(q, k, v, rk, kd)
    if method == "sdpa":
        return lambda q, k, v, rk, rv: F.scaled_dot_product_attention(q, k, v)
    raise ValueError(f"unknown method {method!r}")


def analytic_live_set(method: str, mode: str, length: int, k: int, threads: int) -> dict:
    """Bytes of a method's largest live set of ``[L, L]``-style intermediates, and what it is.

    ``[B, H, L, L]`` float32 tensors, the ``[L, L]`` int64 bucket index and, where used,
    ``QE = q @ rel_k^T`` and the bucket mass ``W``, both ``[B, H, L, 2K+1]``. (3) (and, as an
    upper bound, (4)): the forward holds the logits and the probabilities (the in-place
    gather-add and the pre-scaled q avoid a third); in forward+backward the saved probabilities,
    their gradient (from ``p @ v`` plus the ``scatter_add``'s gather) and the softmax's
    gradient. Measured on 2 cores at L = 1024-2048: about 2.2 and 3.3 ``[B, H, L, L]``
    respectively. (2) gathers each table to ``[L, L, D]``; (5) holds ``QE``; (1) holds O(tile)
    scratch, plus in backward per thread a run of keys (their transposed key and value tiles, key
    rows and dK, dV accumulators: about 640 KiB) and ten floats per query row.
    """
    ll = BATCH * HEADS * length * length * ITEMSIZE
    index = length * length * 8
    band = BATCH * HEADS * length * (2 * k + 1) * ITEMSIZE
    if method in ("eager", "compiled"):
        n = 2 if mode == "fwd" else 3
        return {"bytes": n * ll + index + 2 * band,
                "what": f"{n} x [B,H,L,L] + [L,L] int64 + QE, W"}
    if method == "materialised":
        n = 1 if mode == "fwd" else 2  # backward keeps both gathers alive (einsum saves them)
        return {"bytes": n * length * length * DIM * ITEMSIZE + 2 * ll,
                "what": f"{n} x [L,L,D] + 2 x [B,H,L,L]"}
    if method == "flex":
        return {"bytes": band, "what": "QE [B,H,L,2K+1]"}
    if method == "ours" and mode == "fwd+bwd":
        return {"bytes": threads * ((640 << 10) + 10 * length * 4),
                "what": f"640 KiB key run + 10 floats/row per thread ({threads})"}
    return {"bytes": 0, "what": "none (tiles)" if method == "ours" else "none (flash kernel)"}


def io_bytes(method: str, mode: str, length: int, k: int) -> int:
    """Bytes of the output and, in forward+backward, the gradients (what 'working' excludes)."""
    head = BATCH * HEADS * length * DIM * ITEMSIZE
    if mode == "fwd":
        return head
    tables = 2 * (2 * k + 1) * DIM * ITEMSIZE if method in TABLES else 0
    return head + 3 * head + tables  # out, dq, dk, dv (+ drel_k, drel_v)


# --------------------------------------------------------------------------- measuring
def _make_inputs(length: int, k: int, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k_, v = (torch.randn(BATCH, HEADS, length, DIM, generator=g) for _ in range(3))
    rk, rv = (torch.randn(2 * k + 1, DIM, generator=g) * DIM**-0.5 for _ in range(2))
    go = torch.randn(BATCH, HEADS, length, DIM, generator=g) if grad else None
    return tuple(t.requires_grad_(grad) for t in (q, k_, v, rk, rv)), go


def _runner(method: str, mode: str, length: int, k: int,
            fn: Callable[..., Tensor] | None = None) -> Callable[[], Any]:
    fn = fn or method_fn(method, k)
    inputs, go = _make_inputs(length, k, grad=mode == "fwd+bwd")
    if mode == "fwd":
        return lambda: fn(*inputs)
    wrt = inputs if method in TABLES else inputs[:3]
    return lambda: torch.autograd.grad(fn(*inputs), wrt, go)


def _child_setup(threads: int, compiles: bool) -> None:
    torch.set_num_threads(threads)
    if compiles:  # importing inductor takes seconds: only where it is used
        from torch._inductor import config as inductor_config

        # Compile in this process: a worker pool would compete for the cores and outlive the
        # child (and on 2 cores compiling here is faster: ~5 s instead of ~15 s).
        inductor_config.compile_threads = 1


def measure(method: str, mode: str, length: int, k: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: peak extra memory of one call, then its time."""
    _child_setup(args.threads, compiles=method in COMPILED)
    if method in COMPILED:
        # Compile (and warm up) at the measured shape, so no recompile happens while timing;
        # measure_call then gives the warm-up's freed memory back before resetting the peak.
        run = _runner(method, mode, length, k)
        t0 = time.perf_counter()
        run()
        compile_s = time.perf_counter() - t0
        return measure_call(run, args, trim=True) | {"compile_and_first_call_s": compile_s}
    _runner(method, mode, 64, min(k, 31))()  # load lazy state: thread pool, dispatch
    return measure_call(_runner(method, mode, length, k), args, trim=True)


def sanity_check(threads: int, length: int = 160, k: int = 16) -> dict:
    """Max errors of every method against ``reference.shaw_attention`` at a small shape.

    (1), (3), (4): output and gradients (one backward). (5) against the reference without the
    value table; its backward is tried and the error recorded. (6) against the reference with
    no tables. Runs in a child: it compiles.
    """
    _child_setup(threads, compiles=True)
    (q, k_, v, rk, rv), go = _make_inputs(length, k, grad=True, seed=1)
    out: dict[str, Any] = {"L": length, "K": k}

    def errors(got: Tensor, want: Tensor, wrt: tuple[Tensor, ...]) -> dict:
        res = {"out": (got - want).abs().max().item()}
        if wrt:
            g_got = torch.autograd.grad(got, wrt, go)
            g_want = torch.autograd.grad(want, wrt, go)
            res["grad"] = max((a - b).abs().max().item() for a, b in zip(g_got, g_want))
        return res

    def why(e: Exception) -> str:  # dynamo wraps the real error: report the innermost cause
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        return f"{type(e).__name__}: {str(root).splitlines()[0] if str(root) else ''}"

    inputs = (q, k_, v, rk, rv)
    for method in ("ours", "eager", "compiled"):
        try:
            got = method_fn(method, k)(*inputs)
            out[method] = errors(got, ref.shaw_attention(*inputs, k), inputs)
        except Exception as e:  # noqa: BLE001  (report it in the table, do not stop the run)
            out[method] = {"error": why(e)}
    plain = tuple(t.detach() for t in inputs)
    try:
        got = method_fn("flex", k)(*plain)
        out["flex"] = errors(got, ref.shaw_attention(*plain[:4], None, k), ())
    except Exception as e:  # noqa: BLE001
        out["flex"] = {"error": why(e)}
    try:  # the documented limitation, shown rather than assumed
        method_fn("flex", k)(*inputs).sum().backward()
        out["flex_backward"] = "ran"
    except Exception as e:  # noqa: BLE001
        out["flex_backward"] = why(e)
    got = method_fn("sdpa", k)(*plain)
    out["sdpa"] = errors(got, ref.shaw_attention(*plain[:3], None, None, k), ())
    return out


# --------------------------------------------------------------------------- the roofline
# Matmuls of L x L x D per (b, h) that an attention without an [L, L] buffer cannot avoid:
# forward S = Q K^T and O = P V; backward the recomputed S, dP = dO V^T, dV = P^T dO, dQ = dS K
# and dK = dS^T Q. Those are the bound any attention kernel faces, FlexAttention's included.
MATMULS = {"fwd": 2, "fwd+bwd": 7}
# Matmuls of L x min(2K+1, 2L-1) x D per (b, h) that Shaw's two terms add without an [L, L, D]
# buffer (ours, DESIGN.md §1): forward QE = Q rel_k^T and W rel_v; backward QE again,
# dO rel_v^T, W_dS rel_k (dQ), W_dS^T Q (drel_k) and W_P^T dO (drel_v). At L = 2048, K = 64 they
# are 6.3% of the flops above. (5) computes the first (QE, before its score_mod), not the second.
REL_MATMULS = {"fwd": 2, "fwd+bwd": 7}
PEAK_SHAPES = ((1024, 1024, 1024), (2048, 64, 2048), (2048, 2048, 64))  # (m, k, n) of m x k @ k x n


def attention_flop(mode: str, length: int) -> float:
    """Floating-point operations of the unavoidable ``L x L x D`` matmuls of one call."""
    return MATMULS[mode] * 2.0 * BATCH * HEADS * length * length * DIM


def band_width(length: int, max_distance: int) -> int:
    """Buckets a query row can reach, the band matmuls' width: 2K+1, or 2L-1 when K >= L."""
    return min(2 * max_distance + 1, 2 * length - 1)


def relative_flop(mode: str, length: int, max_distance: int) -> float:
    """Floating-point operations of the relative terms' band matmuls (:data:`REL_MATMULS`)."""
    return REL_MATMULS[mode] * 2.0 * BATCH * HEADS * length * band_width(length, max_distance) * DIM


def _mm_rates(threads: int) -> dict:
    torch.set_num_threads(threads)
    rates = {}
    for m, k, n in PEAK_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        reps = max(1, int(1e9 / (2 * m * k * n)))  # ~1 GFLOP per timed block
        for _ in range(2):
            torch.mm(a, b)
        best = float("inf")
        for _ in range(10):
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.mm(a, b)
            best = min(best, (time.perf_counter() - t0) / reps)
        rates[f"{m}x{k}@{k}x{n}"] = 2 * m * k * n / best / 1e9
    return rates


def machine_peak(threads: int) -> dict:
    """Runs in a forked child: this machine's float32 peak, in GFLOP/s, two ways, each at
    ``threads`` threads and as ``threads`` x the one-thread rate, the higher counting (on these
    shared machines a second core is sometimes partly busy elsewhere, which only lowers the
    multi-thread figure):

    - ``fma_gflops``: independent FMAs of the selected kernel path's width (8-lane AVX2, 16-lane
      on the AVX-512 path) and nothing else (``relpos_ext._C._fma_peak_gflops``): what the FMA
      units can do at all, so ``FLOP / fma_gflops`` is a floor on the time of any float32 method
      that does those FLOPs at that width. None on the scalar path.
    - ``mm_gflops``: the best ``torch.mm`` rate over a square and the two attention-shaped
      products (best of 10 timed blocks each): what the vendor GEMM reaches, for reference.

    ``gflops`` is the roofline's peak: the FMA rate where measured, else the ``torch.mm`` rate
    (``basis`` says which). The run measures all this before and after the methods and keeps the
    higher."""
    multi = _mm_rates(threads)
    single = _mm_rates(1) if threads > 1 else multi
    best_multi, best_single = max(multi.values()), max(single.values())
    mm = max(best_multi, threads * best_single)
    fma_multi = relpos_ext._C._fma_peak_gflops(threads)
    fma_single = relpos_ext._C._fma_peak_gflops(1) if threads > 1 else fma_multi
    fma = max(fma_multi, threads * fma_single) if fma_multi and fma_single else None
    return {"gflops": fma or mm, "basis": "fma" if fma else "torch.mm", "threads": threads,
            "fma_gflops": fma, "fma_multi_thread_gflops": fma_multi,
            "fma_single_thread_gflops": fma_single, "mm_gflops": mm,
            "mm_multi_thread_gflops": best_multi, "mm_single_thread_gflops": best_single,
            "mm_by_shape": multi}


# --------------------------------------------------------------------------- the run
@dataclass
class Row:
    length: int
    mode: str
    method: str
    time_ms: float | None = None
    ratio_vs_ours: float | None = None
    peak_extra_mib: float | None = None
    working_mib: float | None = None
    io_mib: float = 0.0
    analytic_mib: float = 0.0
    analytic_what: str = ""
    skipped: str | None = None
    raw: dict = field(default_factory=dict)


def skip_reason(method: str, mode: str, length: int, analytic: int, cap_gib: float) -> str | None:
    if method == "flex" and mode == "fwd+bwd":
        return FLEX_NO_BACKWARD
    if method == "materialised" and length > MATERIALISED_MAX_L:
        return f"skipped (L > {MATERIALISED_MAX_L}; {analytic / GiB:.1f} GiB)"
    if method in ("eager", "compiled") and analytic > cap_gib * GiB:
        return f"skipped ({analytic / GiB:.1f} GiB)"
    return None


def run_all(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    for length in args.lengths:
        for mode in MODES:
            ours_ms = None
            for method in METHODS:
                an = analytic_live_set(method, mode, length, args.max_distance, args.threads)
                io = io_bytes(method, mode, length, args.max_distance)
                row = Row(length, mode, method, io_mib=io / MiB, analytic_mib=an["bytes"] / MiB,
                          analytic_what=an["what"])
                row.skipped = skip_reason(method, mode, length, an["bytes"], args.mem_cap_gib)
                if row.skipped is None:
                    t0 = time.perf_counter()
                    res = in_child(measure, method, mode, length, args.max_distance, args)
                    row.raw = res
                    if "error" in res:
                        row.skipped = error_cell(res)
                    else:
                        row.time_ms = res["time_ms"]
                        row.peak_extra_mib = res["peak_extra_bytes"] / MiB
                        row.working_mib = (res["peak_extra_bytes"] - io) / MiB
                        if method == "ours":
                            ours_ms = row.time_ms
                        if ours_ms:
                            row.ratio_vs_ours = row.time_ms / ours_ms
                    if args.verbose:
                        print(f"  [{time.perf_counter() - t0:6.1f}s] L={length} {mode} {method}: "
                              f"{row.time_ms or row.skipped}", flush=True)
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- reporting
def format_table(rows: list[Row]) -> str:
    head = (f"{'L':>5} {'mode':<8}{'method':<17}{'time ms':>10}{'x ours':>8}{'peak extra MiB':>16}"
            f"{'working MiB':>13}   [L,L]-style live set (analytic)")
    lines = [head, "-" * (len(head) + 14)]
    prev = None
    for r in rows:
        if prev is not None and (r.length, r.mode) != prev:
            lines.append("")
        prev = (r.length, r.mode)
        lead = f"{r.length:>5} {r.mode:<8}{SHORT[r.method]:<17}"
        tail = f"   {r.analytic_mib:10.1f} MiB {r.analytic_what}"
        if r.skipped:
            lines.append(f"{lead}{r.skipped:>47}{tail}")
            continue
        x = f"{r.ratio_vs_ours:.2f}" if r.ratio_vs_ours is not None else "-"
        lines.append(f"{lead}{r.time_ms:>10.2f}{x:>8}{r.peak_extra_mib:>16.1f}"
                     f"{r.working_mib:>13.1f}{tail}")
    return "\n".join(lines)


def format_rates(rows: list[Row], peak_gflops: float | None) -> str:
    """Rate of the unavoidable matmuls (:data:`MATMULS`) for (1) and (6), both flash-style
    (SDPA's backward recomputes the probabilities too), as GFLOP/s and share of the peak."""
    lines = [f"matmul rate, GFLOP/s (share of the peak): {MATMULS['fwd']} L x L x D matmuls "
             f"forward, {MATMULS['fwd+bwd']} forward+backward"]
    for r in rows:
        if r.method in ("ours", "sdpa") and r.time_ms:
            rate = attention_flop(r.mode, r.length) / (r.time_ms * 1e-3) / 1e9
            share = f" ({100 * rate / peak_gflops:.0f}%)" if peak_gflops else ""
            lines.append(f"  L={r.length:<5} {r.mode:<8}{SHORT[r.method]:<17}{rate:6.0f}{share}")
    return "\n".join(lines)


def _get(rows: list[Row], length: int, mode: str, method: str) -> Row | None:
    return next((r for r in rows if (r.length, r.mode, r.method) == (length, mode, method)), None)


def _time(rows: list[Row], length: int, mode: str, method: str) -> float | None:
    r = _get(rows, length, mode, method)
    return r.time_ms if r is not None else None


def roofline_note(mode: str, baseline_ms: float | None, ours_ms: float | None,
                  peak_gflops: float | None,
                  max_distance: int | None = None) -> tuple[float | None, float | None, str]:
    """For a "baseline / ours >= x" target: the largest ratio any float32 kernel that does the
    unavoidable matmuls (:data:`MATMULS`) could reach on this machine, ``baseline / floor``
    with ``floor = FLOP / measured peak`` (:func:`machine_peak`); the same for a kernel that
    also does the relative terms' band matmuls (:data:`REL_MATMULS`, given ``max_distance``),
    as any kernel computing both of Shaw's terms without ``[L, L, D]`` does; and a sentence
    saying so. Both leave out the softmax, whose exponentials take the same FMA units."""
    if not (baseline_ms and ours_ms and peak_gflops):
        return None, None, ""
    flop = attention_flop(mode, TARGET_L)
    floor_ms = flop / (peak_gflops * 1e9) * 1e3
    ours_rate = flop / (ours_ms * 1e-3) / 1e9
    bound = baseline_ms / floor_ms
    note = (f"roofline: {MATMULS[mode]} matmuls of L x L x D = {flop / 1e9:.1f} GFLOP take "
            f">= {floor_ms:.1f} ms at the measured peak {peak_gflops:.0f} GFLOP/s, so "
            f"no float32 kernel gets beyond {bound:.2f}x here; ours runs at "
            f"{ours_rate:.0f} GFLOP/s ({100 * ours_rate / peak_gflops:.0f}% of that peak)")
    if max_distance is None:
        return bound, None, note
    rel = relative_flop(mode, TARGET_L, max_distance)
    shaw_ms = (flop + rel) / (peak_gflops * 1e9) * 1e3
    shaw_bound = baseline_ms / shaw_ms
    note += (f"; with Shaw's {REL_MATMULS[mode]} band matmuls of "
             f"L x {band_width(TARGET_L, max_distance)} x D "
             f"({rel / 1e9:.2f} GFLOP) too, >= {shaw_ms:.1f} ms: at most {shaw_bound:.2f}x, "
             f"ours at {100 * shaw_ms / ours_ms:.0f}% of that floor")
    return bound, shaw_bound, note


def best_fwd_baseline(rows: list[Row]) -> str | None:
    """The fastest of (3)/(4)/(5) in the table's forward at ``TARGET_L``, or None."""
    best = {m: _time(rows, TARGET_L, "fwd", m) for m in ("eager", "compiled", "flex")}
    best = {m: t for m, t in best.items() if t is not None}
    return min(best, key=best.get) if best else None


def _round_entry(method: str, got: dict) -> str:
    """One method's part of a round's line: its time and, for a baseline, the ratio its target
    takes (baseline / ours, or ours / SDPA for the time target)."""
    name = "ours" if method == "ours" else SHORT[method]
    if not got[method]:
        return f"{name} failed"
    text = f"{name} {got[method]:.1f} ms"
    if method == "ours" or not got["ours"]:
        return text
    if method == "sdpa":
        return text + f" (ours takes {got['ours'] / got[method]:.2f}x its time)"
    return text + f": {got[method] / got['ours']:.2f}x"


def target_rounds(rows: list[Row], args: argparse.Namespace) -> dict:
    """After the table: ``args.rounds`` more paired timings of ours and the baseline of each
    target at ``TARGET_L`` (forward: the fastest of (3)/(4)/(5) in the table, and (6) SDPA for
    the time target; forward + backward: (3)), each in a fresh child as in the table, in an order
    that turns round from one round to the next. A slow spell of this shared machine then lands
    in one pair instead of in one method, and the verdict takes the median ratio over the pairs.
    Returns key -> {"baseline", "pairs": [[ours_ms, baseline_ms], ...]}, the table's own pair
    first, with keys "fwd", "fwd+bwd" and "fwd/sdpa" (the forward's rounds also time SDPA, against
    the same timing of ours)."""
    out: dict = {}
    for mode, baseline in (("fwd", best_fwd_baseline(rows)), ("fwd+bwd", "eager")):
        ours = _time(rows, TARGET_L, mode, "ours")
        bases = [baseline] if baseline else []
        if mode == "fwd":
            bases.append("sdpa")
        keys = {baseline: mode, "sdpa": "fwd/sdpa"}
        for b in list(bases):
            base = _time(rows, TARGET_L, mode, b)
            if ours and base:
                out[keys[b]] = {"baseline": b, "pairs": [[ours, base]]}
            else:
                bases.remove(b)
        if not bases:
            continue
        for rnd in range(args.rounds):
            order = (*bases, "ours") if rnd % 2 == 0 else ("ours", *reversed(bases))
            got = {m: in_child(measure, m, mode, TARGET_L, args.max_distance, args).get("time_ms")
                   for m in order}
            for b in bases:
                if got["ours"] and got[b]:
                    out[keys[b]]["pairs"].append([got["ours"], got[b]])
            print(f"  round {rnd + 1}: L={TARGET_L} {mode:<8} "
                  + ", ".join(_round_entry(m, got) for m in ("ours", *bases)), flush=True)
    return out


def target_verdicts(rows: list[Row], peak_gflops: float | None = None,
                    rounds: dict | None = None, max_distance: int | None = None) -> list[dict]:
    """The four targets, each PASS, FAIL or N/A (not measured in this run). The three speed
    targets take the median ratio over the table's pair and the extra ``rounds``
    (:func:`target_rounds`) where there are any; the two speed-up targets also carry
    ``bound``: the ratio the roofline allows on this machine, and ``bound_shaw``: the same with
    the relative terms' matmuls (given ``max_distance``; see :func:`roofline_note`), None where
    the peak was not measured."""
    out = []
    rounds = rounds or {}

    def paired(key: str, ours_ms: float | None, base_ms: float | None,
               ours_over_base: bool = False) -> tuple:
        """(ratio, ours ms, baseline ms, note): medians over the pairs of ``rounds[key]``, or the
        table's pair. The ratio is baseline / ours, or ours / baseline with ours_over_base."""
        def ratio(o: float, b: float) -> float:
            return o / b if ours_over_base else b / o

        pairs = rounds.get(key, {}).get("pairs", [])
        if len(pairs) < 2 or not (ours_ms and base_ms):
            return (ratio(ours_ms, base_ms) if ours_ms and base_ms else None), ours_ms, base_ms, ""
        ratios = [ratio(o, b) for o, b in pairs]
        note = (f"median of {len(pairs)} paired timings (the table's and {len(pairs) - 1} "
                f"interleaved rounds): " + ", ".join(f"{r:.2f}" for r in ratios))
        return (statistics.median(ratios), statistics.median(o for o, _ in pairs),
                statistics.median(b for _, b in pairs), note)

    def verdict(name: str, value: float | None, ok: Callable[[float], bool], need: str,
                detail: str = "", bound: float | None = None,
                bound_shaw: float | None = None) -> None:
        out.append({"target": name, "value": value, "need": need, "detail": detail,
                    "bound": bound, "bound_shaw": bound_shaw,
                    "verdict": "N/A" if value is None else ("PASS" if ok(value) else "FAIL")})

    ours_f, sdpa_f = _time(rows, TARGET_L, "fwd", "ours"), _time(rows, TARGET_L, "fwd", "sdpa")
    ratio, _, _, pnote = paired("fwd/sdpa", ours_f, sdpa_f, ours_over_base=True)
    verdict(f"fwd L={TARGET_L}: ours / (6) SDPA time", ratio, lambda x: x <= MAX_VS_SDPA,
            f"<= {MAX_VS_SDPA}x", pnote)
    b = best_fwd_baseline(rows)
    ratio, o_ms, b_ms, pnote = paired("fwd", ours_f, _time(rows, TARGET_L, "fwd", b) if b else None)
    bound, bound_shaw, note = roofline_note("fwd", b_ms, o_ms, peak_gflops, max_distance)
    verdict(f"fwd L={TARGET_L}: best of (3)/(4)/(5) / ours", ratio, lambda x: x >= MIN_SPEEDUP,
            f">= {MIN_SPEEDUP}x",
            "; ".join(x for x in (f"best is {SHORT[b]}" if b else "", pnote, note) if x), bound,
            bound_shaw)
    ours_b = _time(rows, TARGET_L, "fwd+bwd", "ours")
    eager_b = _time(rows, TARGET_L, "fwd+bwd", "eager")
    ratio, o_ms, b_ms, pnote = paired("fwd+bwd", ours_b, eager_b)
    bound, bound_shaw, note = roofline_note("fwd+bwd", b_ms, o_ms, peak_gflops, max_distance)
    verdict(f"fwd+bwd L={TARGET_L}: (3) eager / ours", ratio, lambda x: x >= MIN_SPEEDUP,
            f">= {MIN_SPEEDUP}x", "; ".join(x for x in (pnote, note) if x), bound, bound_shaw)
    mem = _get(rows, MEMORY_L, "fwd+bwd", "ours")
    others = []
    for m in ("eager", "compiled", "sdpa"):
        r = _get(rows, MEMORY_L, "fwd+bwd", m)
        if r is not None:
            others.append(f"{SHORT[m]}: " + (r.skipped if r.skipped else
                                             f"{r.peak_extra_mib:.0f} MiB incl. out/grads, "
                                             f"{r.working_mib:.0f} working"))
    detail = ""
    if mem is not None and mem.working_mib is not None:
        detail = (f"incl. output and gradients {mem.peak_extra_mib:.1f} MiB "
                  f"(of which out+grads {mem.io_mib:.1f}); " + "; ".join(others))
    verdict(f"fwd+bwd L={MEMORY_L}: ours working memory (peak - inputs - out - grads), MiB",
            mem.working_mib if mem is not None else None, lambda x: x < MAX_WORKING_MIB,
            f"< {MAX_WORKING_MIB:.0f} MiB", detail)
    return out


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ours": "tab:blue", "materialised": "tab:red", "eager": "tab:green",
              "compiled": "tab:olive", "flex": "tab:purple", "sdpa": "tab:gray"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, mode in zip(axes, MODES):
        for method in METHODS:
            pts = sorted((r.length, r.time_ms) for r in rows
                         if r.mode == mode and r.method == method and r.time_ms is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if method == "sdpa" else "-",
                        marker="o", color=colors[method], label=SHORT[method])
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
                   help="sequence lengths, Lq = Lk (default: 512 1024 2048 4096 8192; "
                        "--quick: 256 512)")
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~2 min, most of it compiling): small L, short timings")
    p.add_argument("--rounds", type=int, default=3,
                   help="extra paired timings of ours and the baseline of each speed target "
                        "at L=2048, interleaved; the verdicts take the median ratio (default 3)")
    p.add_argument("--mem-cap-gib", type=float, default=6.0,
                   help="skip (3)/(4) where their analytic [L,L]-style live set exceeds this "
                        "(default 6)")
    p.add_argument("--float32-matmul-precision", choices=["highest", "high", "medium"],
                   default="highest",
                   help="torch.set_float32_matmul_precision for every method (default highest). "
                        "'medium' lets CPU float32 matmuls compute in bfloat16: torch's own where "
                        "oneDNN has a bfloat16 kernel for the CPU, and ours (AVX512-BF16 dot "
                        "products, as for bfloat16 inputs) on CPUs with AVX512-BF16; the roofline "
                        "bounds then assume float32 FMAs that (1) no longer uses")
    add_common_args(p, RESULTS / "bench_attention.json", rep_budget_s=20.0)
    args = p.parse_args(argv)
    if args.quick:
        args.min_run_time, args.slow_reps = 0.1, 1
    args.lengths = args.lengths or ([256, 512] if args.quick else [512, 1024, 2048, 4096, 8192])
    return args


def _fmt_sanity(res: dict) -> str:
    if "error" in res:
        return res["error"].splitlines()[0][:100]
    return f"out {res['out']:.1e}" + (f", grads {res['grad']:.1e}" if "grad" in res else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # before any child is forked: every method's process inherits it
    torch.set_float32_matmul_precision(args.float32_matmul_precision)
    check_platform("bench_attention.py")
    info, mach = print_environment(args.threads)
    if args.threads > 1 and mach["load_average_at_start"][0] + args.threads > (os.cpu_count() or 1):
        print(f"note: {args.threads} threads on {os.cpu_count()} busy CPUs: every parallel region "
              "waits for descheduled threads, which costs the eager forms (many short ops) more\n"
              "      than the fused kernels (few long ones); compare with --threads 1")
    print(f"shape: B={BATCH} H={HEADS} D={DIM} Lq=Lk=L, K={args.max_distance}, float32, "
          "shared tables rel_k, rel_v [2K+1, D]; backward w.r.t. q, k, v (and rel_k, rel_v)")
    if args.float32_matmul_precision != "highest":
        print(f"float32 matmul precision: {args.float32_matmul_precision} for every method "
              "(bfloat16 matmuls where 'medium' and the CPU allow); the roofline bounds below "
              "assume float32 FMAs")
    sanity = in_child(sanity_check, args.threads)
    print("sanity: max |method - reference.shaw_attention|"
          + (f" at L={sanity['L']}, K={sanity['K']}:" if "L" in sanity else ": ")
          + (sanity["error"].splitlines()[0] if "error" in sanity else ""))
    for m in ("ours", "eager", "compiled", "flex", "sdpa"):
        if m in sanity:
            what = {"flex": " (vs the reference without rel_v)",
                    "sdpa": " (vs the reference without tables)"}.get(m, "")
            print(f"  {SHORT[m]:<17}{_fmt_sanity(sanity[m])}{what}")
    if "flex_backward" in sanity:
        print(f"  (5) backward on CPU: {sanity['flex_backward']}")
    print("methods:")
    for m in METHODS:
        print(f"  {LABELS[m]}")
    print("memory: peak RSS growth during one call, each in a fresh forked process; inputs and "
          "upstream grad excluded,\n        output and grads included ('peak extra'); "
          "'working' = peak extra - output - grads (analytic)")
    print(f"targets: fwd L={TARGET_L} ours <= {MAX_VS_SDPA}x SDPA and >= {MIN_SPEEDUP:.0f}x faster "
          f"than the best of (3)/(4)/(5); fwd+bwd L={TARGET_L} >= {MIN_SPEEDUP:.0f}x faster than "
          f"(3);\n         fwd+bwd L={MEMORY_L} ours working memory < {MAX_WORKING_MIB:.0f} MiB")
    print(flush=True)

    t0 = time.perf_counter()
    peak_before = in_child(machine_peak, args.threads)
    rows = run_all(args)
    if args.rounds > 0 and TARGET_L in args.lengths:
        print(f"interleaved rounds at L={TARGET_L} (ours and the baseline of each speed target):",
              flush=True)
    rounds = target_rounds(rows, args) if args.rounds > 0 else {}
    peak_after = in_child(machine_peak, args.threads)
    elapsed = time.perf_counter() - t0
    peaks = [p for p in (peak_before, peak_after) if "error" not in p]
    peak = max(peaks, key=lambda p: p["gflops"]) if peaks else peak_before
    peak = peak | {"before_gflops": peak_before.get("gflops"), "after_gflops": peak_after.get("gflops")}
    if "error" in peak:
        print("peak: not measured:", peak["error"].splitlines()[0])
    else:
        fma = (f"{peak['fma_gflops']:.0f} GFLOP/s ({args.threads} threads "
               f"{peak['fma_multi_thread_gflops']:.0f}, 1 thread "
               f"{peak['fma_single_thread_gflops']:.0f})" if peak["fma_gflops"] else "not measured")
        isa = relpos_ext.build_info()["cpu_kernel_in_use"]
        print(f"float32 peak (the higher of {args.threads} threads and {args.threads} x 1 thread, "
              f"before and after the run; the roofline uses {peak['basis']}):\n"
              f"    FMA units (independent {isa} FMAs): {fma}\n"
              f"    torch.mm (best shape): {peak['mm_gflops']:.0f} GFLOP/s ({args.threads} threads "
              f"{peak['mm_multi_thread_gflops']:.0f}: "
              + ", ".join(f"{k} {v:.0f}" for k, v in peak["mm_by_shape"].items())
              + f"; 1 thread {peak['mm_single_thread_gflops']:.0f})\n"
              f"    before {peak_before.get('gflops') or 0:.0f}, after "
              f"{peak_after.get('gflops') or 0:.0f}")
    print(format_table(rows))
    print()
    print(format_rates(rows, peak.get("gflops")))
    print()
    verdicts = target_verdicts(rows, peak.get("gflops"), rounds, args.max_distance)
    if args.float32_matmul_precision == "medium":
        for v in verdicts:
            if v.get("bound") is not None:
                v["detail"] += ("; under matmul precision 'medium' ours takes bfloat16 dot products "
                                "where the CPU has them, which those float32 bounds do not cover")
    for v in verdicts:
        val = "not measured" if v["value"] is None else f"{v['value']:.2f}"
        print(f"target {v['target']} = {val} (need {v['need']}): {v['verdict']}"
              + (f"\n    {v['detail']}" if v["detail"] else ""))
    load_end = list(os.getloadavg())
    print(f"total {elapsed:.0f} s; load average at start {mach['load_average_at_start'][0]:.1f}, "
          f"at end {load_end[0]:.1f}")

    mem_methods = {r.raw.get("memory_method") for r in rows if r.raw.get("memory_method")}
    doc = {
        "benchmark": "bench_attention",
        "timestamp": timestamp(),
        "torch_version": torch.__version__,
        "build_info": info,
        "machine": mach | {"load_average_at_end": load_end},
        "config": {
            "batch": BATCH, "heads": HEADS, "dim": DIM, "dtype": "float32",
            "float32_matmul_precision": args.float32_matmul_precision,
            "max_distance": args.max_distance, "lengths": args.lengths, "quick": args.quick,
            "mem_cap_gib": args.mem_cap_gib, "materialised_max_l": MATERIALISED_MAX_L,
            "min_run_time": args.min_run_time, "slow_s": args.slow_s, "rounds": args.rounds,
            "slow_reps": args.slow_reps, "rep_budget_s": args.rep_budget_s,
        },
        "memory_method": sorted(mem_methods),
        "memory_note": "peak_extra: RSS growth over one call, inputs and upstream grad excluded, "
                       "output and grads included; working: peak_extra - io (output + grads)",
        "methods": LABELS,
        "sanity": sanity,
        "peak": peak,
        "matmuls": MATMULS,
        "relative_matmuls": REL_MATMULS,
        "target_rounds": rounds,
        "verdicts": verdicts,
        "elapsed_s": elapsed,
        "rows": [
            {k: v for k, v in asdict(r).items() if k != "raw"}
            | {"min_ms": r.raw.get("min_ms"), "times_ms": r.raw.get("times_ms"),
               "first_call_ms": r.raw.get("first_call_ms"),
               "compile_and_first_call_s": r.raw.get("compile_and_first_call_s"),
               "error": r.raw.get("error")}
            for r in rows
        ],
    }
    write_json(doc, args.out)
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        prec = "" if args.float32_matmul_precision == "highest" else f" ({args.float32_matmul_precision} matmuls)"
        plot(rows, png, f"Shaw attention, B={BATCH} H={HEADS} D={DIM} K={args.max_distance} "
                        f"float32{prec}, {args.threads} threads, {info['cpu_kernel_in_use']} kernel, "
                        f"{mach['cpu']}, load average {mach['load_average_at_start'][0]:.1f}")
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
