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

# (head dim, length, rel_q instead of rel_v, causal)
CASES = [(64, 200, False, False), (128, 136, False, True), (64, 150, True, False),
         (32, 70, True, True), (96, 130, False, False)]


def run_case(dim: int, length: int, rel_q: bool, causal: bool) -> None:
    """One forward and backward through the tensor-core kernels."""
    g = torch.Generator(device="cuda").manual_seed(dim + length)

    def t(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=g, device="cuda") * 0.5
        return x.bfloat16().requires_grad_()

    k_max = 40
    q, k, v = t(1, 2, length, dim), t(1, 2, length, dim), t(1, 2, length, dim)
    rk, rv, rq = t(2 * k_max + 1, dim), t(2 * k_max + 1, dim), t(2 * k_max + 1, dim)
    out = relpos_ext.rel_attention(q, k, v, rk, None if rel_q else rv, k_max, causal=causal,
                                   rel_q=rq if rel_q else None)
    out.float().square().sum().backward()
    torch.cuda.synchronize()
    print(f"ok: D={dim} L={length} rel_q={rel_q} causal={causal}", flush=True)


def main() -> None:
    """Runs every case."""
    for case in CASES:
        run_case(*case)


if __name__ == "__main__":
    main()
