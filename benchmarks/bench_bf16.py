#!/usr/bin/env python
"""Benchmark bfloat16 ``relpos_ext.rel_attention`` on the CPU: AMX tiles and AVX512-BF16 dots against float32 matmuls.

On CPUs with AVX512-BF16 the AVX-512 kernels take bfloat16 inputs' matmuls (forward
``S = Q K^T``, ``P V`` and the relative terms' band matmuls, the backward's likewise) by bfloat16
dot products (``build_info()["cpu_bf16_dot"]``; ``RELPOS_CPU_BF16_DOT=0`` switches them off),
on AMX tiles where the CPU has AMX (``build_info()["cpu_amx"]``; ``RELPOS_CPU_AMX=0`` keeps
the AVX512-BF16 instructions).
For ``q, k, v [B=1, H, L, D=64]`` (H=8 by default) and tables ``[2K+1, D]`` (shared, or
``[H, 2K+1, D]`` with ``--per-head``): ``rel_k`` and ``rel_v`` (Shaw), or with ``--terms kq``
``rel_k`` and the key-side ``rel_q`` (DeBERTa), all bfloat16, forward and forward+backward, it
times (with ``--lq N``, decoding: N new query rows at the end of L cached keys, causal):

* ``amx`` -- ``rel_attention`` with the dots on AMX tiles (only where ``cpu_amx``);
* ``dot`` -- ``rel_attention`` with the dots by AVX512-BF16 instructions (``RELPOS_CPU_AMX=0``);
* ``float`` -- ``rel_attention`` with float32 matmuls (``RELPOS_CPU_BF16_DOT=0``), bitwise the
  AVX2 kernels' results;
* ``sdpa`` -- ``F.scaled_dot_product_attention`` in bfloat16 without relative terms (the floor).

The methods alternate call by call in one process, ``--rounds`` times; the medians and their
ratios go to the JSON. Usage::

    PYTHONPATH=build/dev-bench/stage python benchmarks/bench_bf16.py          # ~1 min
    python benchmarks/bench_bf16.py -L 2048 --causal --out /tmp/bf16.json
    python benchmarks/bench_bf16.py -L 512 1024 -K 256 --heads 12 --per-head --terms kq \
        --out benchmarks/results/bench_bf16_deberta.json
    python benchmarks/bench_bf16.py -L 4096 --lq 16 --out benchmarks/results/bench_bf16_decode.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import relpos_ext

from _common import RESULTS, print_environment, time_interleaved, timestamp, write_json  # beside this script


def time_case(length: int, k: int, causal: bool, rounds: int, heads: int = 8,
              per_head: bool = False, terms: str = "kv", lq: int | None = None,
              amx: bool = False) -> dict:
    """Median seconds of each method's forward and forward+backward at one length; terms "kv":
    rel_k and rel_v, "kq": rel_k and rel_q; lq: that many query rows decoding against the
    length's keys (causal, q_offset = length - lq; SDPA without a mask); amx: time the AMX
    tiles too."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16).requires_grad_()

    rows = length if lq is None else lq
    q = leaf(1, heads, rows, 64)
    k_, v = leaf(1, heads, length, 64), leaf(1, heads, length, 64)
    table = (heads,) if per_head else ()
    rk, second = leaf(*table, 2 * k + 1, 64), leaf(*table, 2 * k + 1, 64)
    rv, rq = (second, None) if terms == "kv" else (None, second)
    grad = torch.randn(1, heads, rows, 64, generator=gen).to(torch.bfloat16)

    def ours() -> torch.Tensor:
        return relpos_ext.rel_attention(q, k_, v, rk, rv, k, causal=causal or lq is not None,
                                        q_offset=length - rows, rel_q=rq)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k_, v, is_causal=causal and lq is None)

    methods: dict[str, tuple[dict[str, str], Callable[[], torch.Tensor]]] = {
        "dot": ({"RELPOS_CPU_BF16_DOT": "1", "RELPOS_CPU_AMX": "0"}, ours),
        "float": ({"RELPOS_CPU_BF16_DOT": "0"}, ours), "sdpa": ({}, sdpa)}
    if amx:
        methods["amx"] = ({"RELPOS_CPU_BF16_DOT": "1", "RELPOS_CPU_AMX": "1"}, ours)
    med = time_interleaved(methods, "RELPOS_CPU_BF16_DOT", grad, rounds)
    ratios = {}
    for mode in ("fwd", "fwdbwd"):
        ratios[f"float/dot {mode}"] = med["float"][mode] / med["dot"][mode]
        ratios[f"sdpa/dot {mode}"] = med["sdpa"][mode] / med["dot"][mode]
        if amx:
            ratios[f"dot/amx {mode}"] = med["dot"][mode] / med["amx"][mode]
            ratios[f"sdpa/amx {mode}"] = med["sdpa"][mode] / med["amx"][mode]
    return {"L": length, "lq": rows, "causal": causal, "median_s": med, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--max-distance", "-K", type=int, default=64, help="K (default 64)")
    p.add_argument("--causal", action="store_true", help="causal attention")
    p.add_argument("--heads", type=int, default=8, help="H (default 8)")
    p.add_argument("--per-head", action="store_true", help="per-head tables [H, 2K+1, D]")
    p.add_argument("--terms", choices=["kv", "kq"], default="kv",
                   help="kv: rel_k and rel_v (default); kq: rel_k and rel_q")
    p.add_argument("--lq", type=int, nargs="+", default=None,
                   help="decoding: query rows against L cached keys (each L, each count)")
    p.add_argument("--rounds", type=int, default=7, help="calls of each method per length")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", type=Path, default=RESULTS / "bench_bf16.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    info, mach = print_environment(args.threads)
    if not info["cpu_bf16_dot"]:
        print("note: no bfloat16 dots on this build/CPU (AVX-512 path with AVX512-BF16 only): "
              "dot and float time the same kernels")
    rows = []
    for length in args.lengths:
        for lq in args.lq or [None]:
            row = time_case(length, args.max_distance, args.causal, args.rounds, args.heads,
                            args.per_head, args.terms, lq, amx=bool(info.get("cpu_amx")))
            rows.append(row)
            cells = "  ".join(f"{m} {1e3 * t['fwd']:.2f} / {1e3 * t['fwdbwd']:.2f} ms"
                              for m, t in row["median_s"].items())
            ratios = "  ".join(f"{name} {x:.2f}x" for name, x in row["ratios"].items())
            where = f"L={length}" + (f" Lq={lq}" if lq is not None else "")
            print(f"{where}{' causal' if args.causal else ''} (fwd / fwd+bwd): {cells}\n  {ratios}")
    write_json({"benchmark": "bench_bf16", "time": timestamp(), "build_info": info,
                "machine": mach, "args": {k: str(v) for k, v in vars(args).items()},
                "results": rows}, args.out)


if __name__ == "__main__":
    main()
