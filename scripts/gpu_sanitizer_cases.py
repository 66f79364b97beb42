"""Small forward+backward cases of the tensor-core kernels, for compute-sanitizer on a GPU.

scripts/gpu_check.sh runs this under ``compute-sanitizer --tool racecheck`` and ``--tool
memcheck`` (limited to the ``rel_attention_tc`` kernels): shared-memory hazards between warps and
out-of-bounds accesses, which the emulator (DESIGN.md) cannot see in full, for instance a
``cp.async`` read before it has landed. Each case is bfloat16, B=1, H=2, K=40, with lengths that
leave partial tiles; prints one line a case.
"""

from __future__ import annotations

import torch

import relpos_ext

# (head dim, length, tables beside rel_k: "v" rel_v, "q" rel_q, "vq" both, causal). At D = 128
# with rel_v, and at D = 64 with rel_v and rel_q, the forward stages rel_v's band rows in rel_k's
# buffer (TcTile::share_band in csrc/cuda/rel_attention_tc.cuh); the backward shares one buffer
# between the two tables at D = 128 (both kernels) and with rel_q at D = 64 (the dk/dv kernel;
# TcBwdTile/TcBwdKvTile::share_tables in csrc/cuda/rel_attention_tc_bwd.cuh).
CASES = [(64, 200, "v", False), (128, 136, "v", True), (64, 150, "q", False),
         (32, 70, "q", True), (96, 130, "v", False), (64, 140, "vq", True)]


def run_case(dim: int, length: int, tables: str, causal: bool) -> None:
    """One forward and backward through the tensor-core kernels."""
    g = torch.Generator(device="cuda").manual_seed(dim + length)

    def t(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, device="cuda") * 0.5
        return x.bfloat16().requires_grad_()

    k_max = 40
    q, k, v = t(1, 2, length, dim), t(1, 2, length, dim), t(1, 2, length, dim)
    rk, rv, rq = t(2 * k_max + 1, dim), t(2 * k_max + 1, dim), t(2 * k_max + 1, dim)
    out = relpos_ext.rel_attention(q, k, v, rk, rv if "v" in tables else None, k_max,
                                   causal=causal, rel_q=rq if "q" in tables else None)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    print(f"ok: D={dim} L={length} tables=k{tables} causal={causal}", flush=True)


def main() -> None:
    """Runs every case."""
    for case in CASES:
        run_case(*case)


if __name__ == "__main__":
    main()
