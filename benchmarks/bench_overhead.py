#!/usr/bin/env python
"""Per-call overhead of the ops' Python layer: small calls, where the kernel is short.

For each op at a tiny shape (and ``rel_attention`` also at a small training shape, B=1, H=8,
L=128, D=64, K=16), in eager mode (on the CPU, or the GPU with ``--device cuda``), it times
three kinds of call:

* ``fwd`` -- the forward under ``torch.no_grad()``;
* ``fwd, grad`` -- the forward with inputs that require grad (records the graph);
* ``fwd+bwd`` -- that forward and ``torch.autograd.grad`` of its output,

each by two routes:

* ``(1) wrapper`` -- ``relpos_ext.<op>``: plain eager calls take the package's own
  autograd.Function and call the kernel past the dispatcher's autograd kernel
  (``relpos_ext.ops._apply``);
* ``(2) torch.ops`` -- ``torch.ops.relpos.<op>``: torch.library's autograd kernel, what
  ``torch.compile`` traces and what the wrapper ran before (it refills the schema's defaults on
  every call, at a cost quadratic in the schema's length);

and, as the floor of an op whose autograd is C++, ``F.scaled_dot_product_attention`` at the
attention shapes. The routes take turns call by call (``_common.time_rounds``, many rounds);
the table gives medians in microseconds. ``--device cuda`` puts the tensors on the GPU and
waits for it at the end of each call. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_overhead.py     # ~20 s
    python benchmarks/bench_overhead.py --rounds 200 --out /tmp/o.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import relpos_ext

from _common import RESULTS, print_environment, timestamp, time_rounds, write_json


def cases(device: str = "cpu") -> dict[str, tuple[Callable, Callable, list[torch.Tensor]]]:
    """name -> (call through the wrapper, call through torch.ops, inputs to differentiate);
    each call returns one tensor."""
    g = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    out: dict[str, tuple[Callable, Callable, list[torch.Tensor]]] = {}
    for label, (b, h, length, d, k) in {"tiny": (1, 1, 4, 8, 2),
                                        "B1 H8 L128 D64": (1, 8, 128, 64, 16)}.items():
        q, kk, v = (leaf(b, h, length, d) for _ in range(3))
        rk, rv = (leaf(2 * k + 1, d) for _ in range(2))
        out[f"rel_attention {label}"] = (
            lambda q=q, kk=kk, v=v, rk=rk, rv=rv, k=k: relpos_ext.rel_attention(q, kk, v, rk, rv, k),
            lambda q=q, kk=kk, v=v, rk=rk, rv=rv, k=k: torch.ops.relpos.rel_attention(
                q, kk, v, rk, rv, k)[0],
            [q, kk, v, rk, rv])
        out[f"SDPA, no rel {label}"] = (
            lambda q=q, kk=kk, v=v: F.scaled_dot_product_attention(q, kk, v), None, [q, kk, v])
    q = leaf(1, 1, 4, 8)
    table = leaf(5, 8)
    x = leaf(1, 4, 7)
    cos, sin = (torch.rand(4, 8, generator=g).to(device) for _ in range(2))
    out["rel_logits tiny"] = (lambda: relpos_ext.rel_logits(q, table, 2, 4),
                              lambda: torch.ops.relpos.rel_logits(q, table, 2, 4), [q, table])
    out["rel_gather tiny"] = (lambda: relpos_ext.rel_gather(table, 4, 4, 2),
                              lambda: torch.ops.relpos.rel_gather(table, 4, 4, 2), [table])
    out["skew tiny"] = (lambda: relpos_ext.skew(x), lambda: torch.ops.relpos.skew(x), [x])
    out["rope tiny"] = (lambda: relpos_ext.rope(q, cos, sin),
                        lambda: torch.ops.relpos.rope(q, cos, sin), [q])
    return out


def kinds(fn: Callable, wrt: list[torch.Tensor], sync: Callable[[], None]
          ) -> dict[str, Callable[[], object]]:
    """The three kinds of call of ``fn``, each ending with ``sync`` (the GPU's queue drained)."""
    def fwd() -> object:
        with torch.no_grad():
            y = fn()
        sync()
        return y

    def fwd_grad() -> object:
        y = fn()
        sync()
        return y

    def fwd_bwd() -> object:
        y = fn()
        grads = torch.autograd.grad(y, wrt, torch.ones_like(y), allow_unused=True)
        sync()
        return grads

    return {"fwd": fwd, "fwd, grad": fwd_grad, "fwd+bwd": fwd_bwd}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1000,
                   help="timed calls per route and kind (default 1000)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the tensors live (cuda: each call waits for the GPU)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_overhead.json")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_overhead.py --device cuda: torch sees no GPU here")
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)

    rows = []
    print(f"\n{'case':<28} {'call':<10} {'(1) wrapper':>12} {'(2) torch.ops':>14} {'(2)/(1)':>8}   us")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for name, (wrapper, direct, wrt) in cases(args.device).items():
        by_route = {"wrapper": kinds(wrapper, wrt, sync)}
        if direct is not None:
            by_route["torch.ops"] = kinds(direct, wrt, sync)
        for kind in ("fwd", "fwd, grad", "fwd+bwd"):
            times = time_rounds({r: calls[kind] for r, calls in by_route.items()}, args.rounds)
            med = {r: statistics.median(t) * 1e6 for r, t in times.items()}
            row = {"case": name, "call": kind} | {f"{r}_us": v for r, v in med.items()}
            rows.append(row)
            ops_cell = f"{med['torch.ops']:14.1f} {med['torch.ops'] / med['wrapper']:8.2f}" \
                if "torch.ops" in med else f"{'':14} {'':8}"
            print(f"{name:<28} {kind:<10} {med['wrapper']:12.1f} {ops_cell}")

    write_json({"benchmark": "bench_overhead", "timestamp": timestamp(), "torch": torch.__version__,
                "build_info": info, "machine": mach, "device": args.device,
                "rounds": args.rounds, "rows": rows},
               args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
