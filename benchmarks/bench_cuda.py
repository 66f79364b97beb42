#!/usr/bin/env python
"""Benchmark ``rel_attention`` on a CUDA GPU against SDPA, FlexAttention and eager PyTorch.

B=2, H=16, D=64 by default, bfloat16, self-attention of L positions, not causal. Forms, each
forward and forward + backward (w.r.t. q, k, v and the tables / bias):

* ``ours_shaw`` -- ``rel_attention`` with Shaw's key and value tables (shared, K=64);
* ``ours_keys`` -- the key table alone (what FlexAttention can express);
* ``ours_bias`` -- a per-head scalar bias per bucket, T5-style (K=128, ``rel_bias``);
* ``ours_c2p_p2c`` -- the key table and the key-side table ``rel_q`` (DeBERTa's content-to-position
  and position-to-content terms, shared tables, K=64);
* ``flex_keys`` / ``flex_bias`` / ``flex_c2p_p2c`` -- FlexAttention (compiled) with a ``score_mod``
  reading the same key table (``q . rel_k[bucket]``), bias, or both key tables
  (``q . rel_k[bucket] + k . rel_q[bucket]``); FlexAttention cannot express the value table;
* ``eager_shaw`` -- ``reference.shaw_attention_gather`` (``[L, L]`` logits; skipped above
  ``--eager-max-l``);
* ``sdpa_bias`` -- ``F.scaled_dot_product_attention`` with the bias gathered to ``[1, H, L, L]``;
* ``sdpa`` -- SDPA with no relative term (flash attention): the floor.

Times are CUDA-event medians (``torch.utils.benchmark`` ``blocked_autorange``); memory is the
peak allocated during one call beyond what was allocated before it (inputs excluded). Writes
JSON. Needs a CUDA build of relpos_ext and a GPU.

Usage::

    python benchmarks/bench_cuda.py --out benchmarks/results/bench_cuda_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tbench


def _inputs(args, length: int, train: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = getattr(torch, args.dtype)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dt).requires_grad_(train)

    b, h, d = args.batch, args.heads, args.dim
    return dict(q=t(b, h, length, d), k=t(b, h, length, d), v=t(b, h, length, d),
                rel_k=t(2 * args.k + 1, d, scale=0.5), rel_v=t(2 * args.k + 1, d, scale=0.5),
                rel_q=t(2 * args.k + 1, d, scale=0.5),
                bias=t(h, 2 * args.bias_k + 1))


def _form(name: str, x: dict, args, length: int):
    """(function of no arguments returning the output, the tensors it differentiates)."""
    import relpos_ext
    from relpos_ext import reference

    q, k, v, rk, rv, bias = x["q"], x["k"], x["v"], x["rel_k"], x["rel_v"], x["bias"]
    rq = x["rel_q"]
    if name == "ours_shaw":
        return lambda: relpos_ext.rel_attention(q, k, v, rk, rv, args.k), [q, k, v, rk, rv]
    if name == "ours_keys":
        return lambda: relpos_ext.rel_attention(q, k, v, rk, None, args.k), [q, k, v, rk]
    if name == "ours_c2p_p2c":
        return (lambda: relpos_ext.rel_attention(q, k, v, rk, None, args.k, rel_q=rq),
                [q, k, v, rk, rq])
    if name == "ours_bias":
        return (lambda: relpos_ext.rel_attention(q, k, v, None, None, args.bias_k, rel_bias=bias),
                [q, k, v, bias])
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v), [q, k, v]
    if name == "eager_shaw":
        return lambda: reference.shaw_attention_gather(q, k, v, rk, rv, args.k), [q, k, v, rk, rv]
    if name == "sdpa_bias":
        buckets = reference.shaw_buckets(length, length, args.bias_k, device="cuda")
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, buckets][None]),
                [q, k, v, bias])
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, fullgraph=True)
    scale = args.dim ** -0.5
    if name == "flex_keys":  # q rel_k^T [B, H, L, 2K+1] first, gathered in the score_mod
        kk = args.k

        def keys(q, k, v, rk):
            qe = torch.matmul(q, rk.transpose(-1, -2))

            def key_term(score, b, h, qi, ki):
                return score + qe[b, h, qi, torch.clamp(ki - qi, -kk, kk) + kk] * scale

            return flex_attention(q, k, v, score_mod=key_term)

        compiled = torch.compile(keys, fullgraph=True)
        return lambda: compiled(q, k, v, rk), [q, k, v, rk]
    if name == "flex_c2p_p2c":  # q rel_k^T and k rel_q^T [B, H, L, 2K+1] first, both gathered
        kk = args.k

        def both(q, k, v, rk, rq):
            qe = torch.matmul(q, rk.transpose(-1, -2))
            ke = torch.matmul(k, rq.transpose(-1, -2))

            def key_terms(score, b, h, qi, ki):
                bucket = torch.clamp(ki - qi, -kk, kk) + kk
                return score + (qe[b, h, qi, bucket] + ke[b, h, ki, bucket]) * scale

            return flex_attention(q, k, v, score_mod=key_terms)

        compiled = torch.compile(both, fullgraph=True)
        return lambda: compiled(q, k, v, rk, rq), [q, k, v, rk, rq]
    kb = args.bias_k

    def bias_term(score, b, h, qi, ki):
        return score + bias[h, torch.clamp(ki - qi, -kb, kb) + kb]

    return lambda: flex(q, k, v, score_mod=bias_term), [q, k, v, bias]


def measure(name: str, mode: str, length: int, args) -> dict:
    train = mode == "fwd+bwd"
    x = _inputs(args, length, train)
    fn, wrt = _form(name, x, args, length)
    if train:
        grad = torch.randn(args.batch, args.heads, length, args.dim, device="cuda",
                           dtype=getattr(torch, args.dtype))

        def run():
            return torch.autograd.grad(fn(), wrt, grad)
    else:
        def run():
            with torch.no_grad():
                return fn()
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    m = tbench.Timer("run()", globals={"run": run}).blocked_autorange(min_run_time=args.min_run_time)
    return {"time_ms": m.median * 1e3, "iqr_ms": m.iqr * 1e3, "peak_extra_mib": peak / 2**20,
            "first_call_s": first_s}


FORMS = ("ours_shaw", "ours_keys", "ours_bias", "ours_c2p_p2c", "flex_keys", "flex_bias",
         "flex_c2p_p2c", "eager_shaw", "sdpa_bias", "sdpa")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", "-L", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--k", type=int, default=64, help="K of the Shaw tables")
    p.add_argument("--bias-k", type=int, default=128, help="K of the bias")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--forms", nargs="+", default=list(FORMS))
    p.add_argument("--eager-max-l", type=int, default=4096)
    p.add_argument("--min-run-time", type=float, default=0.5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import relpos_ext

    info = relpos_ext.build_info()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} relpos {info}")
    print(f"B={args.batch} H={args.heads} D={args.dim} {args.dtype} K={args.k} bias K={args.bias_k}")
    rows = []
    for length in args.lengths:
        for mode in ("fwd", "fwd+bwd"):
            for name in args.forms:
                if name == "eager_shaw" and length > args.eager_max_l:
                    continue
                try:
                    res = measure(name, mode, length, args)
                except Exception as e:  # report it and go on: one form's failure is a result
                    res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                row = {"L": length, "mode": mode, "form": name, **res}
                rows.append(row)
                cell = (f"{res['time_ms']:9.3f} ms  {res['peak_extra_mib']:9.1f} MiB"
                        if "time_ms" in res else res["error"])
                print(f"L={length:6d} {mode:8s} {name:11s} {cell}", flush=True)
                torch.cuda.empty_cache()
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump({"benchmark": "bench_cuda", "device": torch.cuda.get_device_name(),
                                   "torch_version": torch.__version__, "build_info": info,
                                   "config": {k: v for k, v in vars(args).items() if k != "out"},
                                   "env": {k: os.environ[k] for k in ("RELPOS_CUDA_TC",)
                                           if k in os.environ},
                                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
