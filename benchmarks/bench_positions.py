#!/usr/bin/env python
"""Benchmark ``rel_attention``'s ``rel_bias`` on T5's bucketed bias and on ALiBi (CPU, float32).

One attention core, B=1, H=8, D=64, against the forms a user has today, all handed the same
``[H, 2K+1]`` table (``relpos_ext.positions``):

* ``fused`` -- ``rel_attention(q, k, v, None, None, K, rel_bias=table)``; the table is built
  from the learned embedding (T5) inside the timed call, O(L) memory;
* ``sdpa`` -- ``F.scaled_dot_product_attention`` with the bias gathered to ``[1, H, L, L]`` as a
  float mask (ALiBi: -inf above the diagonal as well). The gather is made once, outside the timed
  call, as models share it across layers (in training it is a leaf that takes a gradient, so the
  T5 bias is learned);
* ``eager`` -- ``softmax(q k^T scale + bias) v`` with that same prebuilt bias;
* ``flex`` -- FlexAttention (compiled) with a ``score_mod`` reading the table; forward only
  (FlexAttention has no CPU backward).

Positions: ``t5`` (32 buckets, max distance 128, bidirectional as T5's encoder, scale 1; K =
128) and ``alibi`` (causal, slopes of 8 heads, exact: K = L - 1). Modes: ``inference`` (forward
under ``torch.no_grad``) and ``train`` (forward + backward w.r.t. q, k, v and the bias). Each
measurement runs in a forked child (``_common.measure_call``): peak extra memory of one call,
then the median time.

Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_positions.py     # ~5 min
    python benchmarks/bench_positions.py --position alibi -L 1024 2048
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from _common import (  # benchmarks/_common.py, beside this script
    RESULTS, add_common_args, check_platform, in_child, measure_call, measure_grid,
    print_environment, timestamp, write_json,
)

HEADS, DIM, T5_BUCKETS, T5_MAX = 8, 64, 32, 128
METHODS = ("fused", "sdpa", "eager", "flex")
MODES = ("inference", "train")


def _setup(position: str, length: int, train: bool):
    """q, k, v [1, H, L, D], the learnable thing (T5's [32, H] embedding, or None for ALiBi),
    a function building the [H, 2K+1] table from it, K, the scale and causality."""
    import relpos_ext

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, length, DIM, generator=g).requires_grad_(train)
               for _ in range(3))
    if position == "t5":
        weight = torch.randn(T5_BUCKETS, HEADS, generator=g).requires_grad_(train)
        return (q, k, v, weight, lambda: relpos_ext.t5_bias_table(weight, True, T5_MAX), T5_MAX,
                1.0, False)
    table = relpos_ext.alibi_bias_table(relpos_ext.alibi_slopes(HEADS), length - 1)
    return q, k, v, None, lambda: table, length - 1, DIM ** -0.5, True


def _dense_bias(table: torch.Tensor, kmax: int, length: int, causal: bool) -> torch.Tensor:
    r = torch.arange(length)[None, :] - torch.arange(length)[:, None]
    bias = table[:, r.clamp(-kmax, kmax) + kmax][None]  # [1, H, L, L]
    return bias.masked_fill(r > 0, float("-inf")) if causal else bias


def measure(method: str, mode: str, length: int, args: argparse.Namespace) -> dict:
    """Runs in a forked child: the warm-up, then memory and time of one call."""
    import relpos_ext

    torch.set_num_threads(args.threads)
    train = mode == "train"
    q, k, v, weight, make_table, kmax, scale, causal = _setup(args.position, length, train)
    wrt = [q, k, v] + ([weight] if weight is not None else [])
    if method == "fused":
        def core():
            return relpos_ext.rel_attention(q, k, v, None, None, kmax, causal=causal, scale=scale,
                                            rel_bias=make_table())
    else:
        with torch.no_grad():
            dense = _dense_bias(make_table(), kmax, length, causal)
        if train and weight is not None:  # the prebuilt bias is a leaf that learns
            dense.requires_grad_()
            wrt = [q, k, v, dense]
        if method == "sdpa":
            def core():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
        elif method == "eager":
            def core():
                s = torch.matmul(q, k.transpose(-1, -2)) * scale + dense
                return torch.matmul(torch.softmax(s, -1), v)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            table = make_table().detach()

            def score_mod(score, b, h, qi, ki):
                bias = table[h, (ki - qi).clamp(-kmax, kmax) + kmax]
                if causal:
                    return torch.where(ki > qi, float("-inf"), score + bias)
                return score + bias

            flex = torch.compile(flex_attention, fullgraph=True)

            def core():
                return flex(q, k, v, score_mod=score_mod, scale=scale)
    if not train:
        def run():
            with torch.no_grad():
                return core()
    else:
        upstream = torch.randn(1, HEADS, length, DIM)

        def run():
            return torch.autograd.grad(core(), wrt, upstream)
    run()
    return measure_call(run, args, trim=True)


def check(position: str, length: int) -> dict:
    """Runs in a forked child: each form's output against the eager form's, float32."""
    import relpos_ext

    q, k, v, _, make_table, kmax, scale, causal = _setup(position, length, False)
    with torch.no_grad():
        table = make_table()
        dense = _dense_bias(table, kmax, length, causal)
        want = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + dense, -1), v)
        fused = relpos_ext.rel_attention(q, k, v, None, None, kmax, causal=causal, scale=scale,
                                         rel_bias=table)
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale)
    return {"fused": (fused - want).abs().max().item(), "sdpa": (sdpa - want).abs().max().item()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--position", choices=["t5", "alibi"], default="t5")
    add_common_args(p, RESULTS / "bench_positions_t5.json", rep_budget_s=20.0)
    args = p.parse_args(argv)
    if args.out == RESULTS / "bench_positions_t5.json" and args.position == "alibi":
        args.out = RESULTS / "bench_positions_alibi.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_platform("bench_positions.py")
    info, mach = print_environment(args.threads)
    print(f"{args.position}: B=1 H={HEADS} D={DIM} float32")
    errors = in_child(check, args.position, 300)
    print("max |out - eager| at L=300: " + ", ".join(f"{m} {e:.2e}" for m, e in errors.items())
          if "error" not in errors else f"check failed: {errors['error']}")

    def skip(method: str, mode: str, length: int) -> str | None:
        return "n/a" if method == "flex" and mode == "train" else None  # no CPU backward

    rows = measure_grid(measure, args, MODES, METHODS, skip)
    write_json({
        "benchmark": "bench_positions", "timestamp": timestamp(), "torch_version": torch.__version__,
        "build_info": info, "machine": mach,
        "config": {"position": args.position, "heads": HEADS, "dim": DIM, "dtype": "float32",
                   "batch": 1, "lengths": args.lengths, "threads": args.threads,
                   "t5": {"buckets": T5_BUCKETS, "max_distance": T5_MAX}},
        "max_abs_error_vs_eager_L300": errors, "methods": list(METHODS), "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
