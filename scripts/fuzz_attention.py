#!/usr/bin/env python3
"""Differential fuzz of rel_attention (forward and backward) against relpos_ext.reference.

Each seed draws one configuration that mixes every option at once (grouped-query heads, Lq != Lk,
offsets, causal, per-head or shared tables, rel_q, rel_bias, key padding, an attention mask,
segment ids, a window, dropout, an explicit scale, strided views, sharp logits) and checks the
output, the log-sum-exp and all seven gradients of each backend against the float64 reference
run on the same rounded inputs. The test suite's cases are hand-picked, one or two options at a
time; this looks for the combinations nobody picked.

    python scripts/fuzz_attention.py --seeds 0:500                       # the CPU kernels
    python scripts/fuzz_attention.py --seeds 0:200 --backends cuda-emu   # after build_cuda_emu.sh
    python scripts/fuzz_attention.py --seeds 0:2000 --backends cuda --dtypes float32 bfloat16
    python scripts/fuzz_attention.py --seeds 0:100 --shapes decode       # new rows, long cache

Error measure: max |got - want| / max(max |want|, 1) per tensor, against a tolerance per dtype
(float32 2e-4, float64 1e-9, float16 1.5e-3, bfloat16 1e-2; grown with log2(Lk) and with the
square root of the logits' spread, and 3x for the gradients, which sum over many pairs).
Low-precision gradients: the kernels read ``D_i = dO_i . O_i`` from the rounded output they are
handed (as FlashAttention does), which moves every ``dS_ij`` by ``-p_ij (D_i - D_i^true)``.
That is the gradient of the log-sum-exp, so the reference backpropagates
``-dO_i . (O_i^rounded - O_i)`` into its lse as well and the comparison sees the kernels' own
arithmetic, not that rounding (which, where the true gradients cancel, as for a row with one
visible key, would swamp them).
A float32 tensor over its tolerance still passes when its error is within 4x that of the
reference itself run in float32 on the same inputs: where a table gradient's true value cancels
to almost nothing, float32 cannot do better than its rounding of the terms (eager_float32_errors).

Prints each failing seed with its configuration and the errors over tolerance, and a summary;
exits 1 if any seed failed. ``--time-limit`` stops early (the GPU check's time box).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

import relpos_ext
from relpos_ext import reference as ref

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EMU = ROOT / "build" / "cuda_emu" / "librelpos_cuda_emu.so"
BACKENDS = ("cpu-scalar", "cpu-avx2", "cpu-avx512", "cuda-emu", "cuda")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1.5e-3, torch.bfloat16: 1e-2}
GRADS = ("dq", "dk", "dv", "drel_k", "drel_v", "drel_bias", "drel_q")


def draw(seed: int, shapes: str = "mixed") -> dict:
    """One random configuration with B x H x Lq x Lk x D at most MAX_SIZE (the reference holds
    [B, H, Lq, Lk, D] gathers). ``shapes``: "mixed", sizes around the kernels' tile edges (8,
    32/33, 64, 128); "decode", a few new rows against a cache of about 2000-4100 keys, where the
    CPU forward splits the keys into chunks (flash-decoding) and reads k and v in place, also as
    the first Lk rows of a larger buffer (``cache_view``)."""
    r = random.Random(seed)
    while True:
        c = SHAPES[shapes](r)
        if c["B"] * c["H"] * c["Lq"] * c["Lk"] * c["D"] <= MAX_SIZE:
            return c


MAX_SIZE = 16_000_000  # 128 MB of float64


def _draw_mixed(r: random.Random) -> dict:
    hkv = r.choice([1, 1, 2, 3])
    lq = r.choice([1, 2, 5, 17, 33, 64, 65, 100, 129, 200, 300])
    lk = r.choice([lq, lq, 1, 3, 31, 64, 70, 128, 129, 257, 600])
    window = r.choice([None, None, None, (r.randint(-1, 40), r.randint(-1, 40))])
    return dict(
        B=r.choice([1, 1, 2, 3]), H=hkv * r.choice([1, 1, 2, 4]), Hkv=hkv, Lq=lq, Lk=lk,
        D=r.choice([1, 8, 13, 16, 24, 32, 37, 64, 80, 96, 128]),
        K=r.choice([0, 1, 2, 5, 16, 40, 64, 300]),
        causal=r.random() < 0.4, q_offset=r.choice([0, 0, 0, lk - lq, 7, -3, 50]),
        k_offset=r.choice([0, 0, 0, 2, 11]), per_head=r.random() < 0.4,
        rel_k=r.random() < 0.8, rel_v=r.random() < 0.8, rel_q=r.random() < 0.25,
        rel_bias=r.random() < 0.25, padding=r.random() < 0.3,
        attn_mask=r.choice([None, None, None, None, "2d", "4d"]), segments=r.random() < 0.2,
        window=window, dropout_p=r.choice([0.0, 0.0, 0.0, 0.0, 0.3]),
        scale=r.choice([None, None, 0.3, 1.0]), strided=r.random() < 0.3,
        q_scale=r.choice([1.0, 1.0, 4.0]), cache_view=False)


def _draw_decode(r: random.Random) -> dict:
    # the CPU forward splits keys once there are 32 key tiles of 64 (Lk > 1984) and at most 32
    # rows (cpu/register_cpu.cpp); 33 and 48 rows take the unsplit path over the same cache
    hkv = r.choice([1, 1, 2])
    lq = r.choice([1, 1, 2, 3, 4, 7, 8, 9, 16, 17, 31, 32, 33, 48])
    lk = r.choice([1985, 2048, 2049, 2111, 2600, 3100, 4097])
    window = r.choice([None, None, None, (r.randint(-1, 3000), r.randint(-1, 40))])
    layout = r.choice(["contiguous", "strided", "cache_view", "cache_view"])
    return dict(
        B=r.choice([1, 1, 2]), H=hkv * r.choice([1, 2, 4, 8]), Hkv=hkv, Lq=lq, Lk=lk,
        D=r.choice([8, 13, 32, 37, 64, 80, 128]),
        K=r.choice([0, 3, 64, 300, 2500, 5000]),
        causal=r.random() < 0.7, q_offset=r.choice([lk - lq, lk - lq, lk - lq, 0, lk - lq - 100]),
        k_offset=r.choice([0, 0, 0, 5]), per_head=r.random() < 0.4,
        rel_k=r.random() < 0.8, rel_v=r.random() < 0.8, rel_q=r.random() < 0.2,
        rel_bias=r.random() < 0.25, padding=r.random() < 0.3,
        attn_mask=r.choice([None, None, None, None, "2d", "4d"]), segments=r.random() < 0.2,
        window=window, dropout_p=r.choice([0.0, 0.0, 0.0, 0.0, 0.3]),
        scale=r.choice([None, None, 0.3, 1.0]), strided=layout == "strided",
        q_scale=r.choice([1.0, 1.0, 4.0]), cache_view=layout == "cache_view")


SHAPES = {"mixed": _draw_mixed, "decode": _draw_decode}


def make(c: dict, seed: int) -> tuple[dict, dict, torch.Tensor]:
    """float64 inputs (q, k, v and the tables), the op's other arguments, and grad_out."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, s: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=g) * s

    b, h, hkv, lq, lk, d, k = (c[n] for n in ("B", "H", "Hkv", "Lq", "Lk", "D", "K"))
    table = ((h,) if c["per_head"] else ()) + (2 * k + 1, d)
    tensors = dict(q=randn(b, h, lq, d, s=c["q_scale"]), k=randn(b, hkv, lk, d),
                   v=randn(b, hkv, lk, d),
                   rel_k=randn(*table) if c["rel_k"] else None,
                   rel_v=randn(*table) if c["rel_v"] else None,
                   rel_bias=randn(*table[:-1]) if c["rel_bias"] else None,
                   rel_q=randn(*table) if c["rel_q"] else None)
    kw = dict(max_distance=k, causal=c["causal"], scale=c["scale"], q_offset=c["q_offset"],
              k_offset=c["k_offset"])
    if c["padding"]:
        kw["key_padding_mask"] = torch.rand(b, lk, generator=g) < 0.2
    if c["attn_mask"] == "2d":
        kw["attn_mask"] = torch.rand(lq, lk, generator=g) < 0.3
    elif c["attn_mask"] == "4d":
        kw["attn_mask"] = torch.rand(b, 1, lq, lk, generator=g) < 0.3
    if c["segments"]:
        kw["q_segment_ids"] = torch.randint(0, 3, (b, lq), generator=g).sort(dim=1).values
        kw["k_segment_ids"] = torch.randint(0, 3, (b, lk), generator=g).sort(dim=1).values
    if c["window"]:
        kw["window_left"], kw["window_right"] = c["window"]
    if c["dropout_p"]:
        kw["dropout_p"] = c["dropout_p"]
        kw["dropout_seed"] = seed
    return tensors, kw, randn(b, h, lq, d)


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in every other column of a buffer twice as wide (not contiguous)."""
    y = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)[..., ::2]
    return y.copy_(x)


def cache_rows(x: torch.Tensor) -> torch.Tensor:
    """The same values as the first rows (dim 2) of a buffer with 37 more, which hold NaN: a
    decoding cache preallocated to a capacity, read through ``buf[:, :, :T]``."""
    buf = torch.full((*x.shape[:2], x.shape[2] + 37, *x.shape[3:]), math.nan, dtype=x.dtype,
                     device=x.device)
    return buf[:, :, :x.shape[2]].copy_(x)


Results = tuple[torch.Tensor, torch.Tensor, list]  # out, lse, the seven gradients


def run_backend(backend: str, tensors: dict, kw: dict, grad: torch.Tensor,
                use_strided: bool, cache_view: bool = False) -> Results:
    """(out, lse, seven gradients) of torch.ops.relpos(_emu) on the backend's device; floating
    tensors of two or more dims as strided views with ``use_strided``, k and v as views of a
    larger cache buffer with ``cache_view``."""
    ns = torch.ops.relpos_emu if backend == "cuda-emu" else torch.ops.relpos
    dev = "cuda" if backend == "cuda" else "cpu"

    def put(name: str, x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        x = x.to(dev)
        if cache_view and name in ("k", "v"):
            return cache_rows(x)
        return strided(x) if use_strided and x.is_floating_point() and x.dim() > 1 else x

    # by the schemas' argument names (csrc/schemas.h), so no argument order is restated here
    args = {n: put(n, x) if isinstance(x, torch.Tensor) or x is None else x
            for n, x in {"key_padding_mask": None, **tensors, **kw}.items()}
    if "dropout_seed" in args:
        args["dropout_seed"] = torch.tensor([args["dropout_seed"]], dtype=torch.int64)
    out, lse = ns.rel_attention.default(**args)
    grads = ns.rel_attention_backward.default(grad_out=put("grad_out", grad), out=out,
                                              logsumexp=lse, **args)
    return out.cpu(), lse.cpu(), [x.cpu() for x in grads]


NAMES = ("q", "k", "v", "rel_k", "rel_v", "rel_bias", "rel_q")  # the gradients' tensors, in order


def reference_forward(tensors: dict, kw: dict,
                      dtype: torch.dtype) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """relpos_ext.reference in `dtype`: (leaves, out, lse), the leaves copies of `tensors` that
    require grad (None where a tensor is absent)."""
    leaves = {n: None if x is None else x.detach().to(dtype, copy=True).requires_grad_()
              for n, x in tensors.items()}
    kwd = {n: (x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
           for n, x in kw.items()}
    out, lse = ref.shaw_attention(leaves["q"], leaves["k"], leaves["v"], leaves["rel_k"],
                                  leaves["rel_v"], return_lse=True, rel_bias=leaves["rel_bias"],
                                  rel_q=leaves["rel_q"], **kwd)
    return leaves, out, lse


def reference_grads(leaves: dict, loss: torch.Tensor) -> list:
    """d loss / d leaf for each of NAMES: None where the leaf is absent, zeros where unused."""
    wrt = [leaves[n] for n in NAMES if leaves[n] is not None]
    got = iter(torch.autograd.grad(loss, wrt, allow_unused=True))
    grads = []
    for n in NAMES:
        if leaves[n] is None:
            grads.append(None)
        else:
            x = next(got)
            grads.append(torch.zeros_like(leaves[n]) if x is None else x)
    return grads


def run_reference(tensors: dict, kw: dict, grad: torch.Tensor, out_used: torch.Tensor) -> Results:
    """float64 (out, lse, gradients) of the reference; `out_used` is the output the kernel's
    backward was handed (see the module docstring)."""
    leaves, out, lse = reference_forward(tensors, kw, torch.float64)
    g = grad.double()
    delta = (g * (out_used.double() - out.detach())).sum(-1)
    # (rows that see no key have lse = inf and no gradient)
    lse_term = -(lse.masked_fill(~torch.isfinite(lse), 0.0) * delta).sum()
    grads = reference_grads(leaves, (out * g).sum() + lse_term)
    return out.detach(), lse.detach(), grads


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, 1); inf where they disagree on which are finite."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return math.inf
    if not finite.any():
        return 0.0
    return ((got - want)[finite].abs().max() / max(want[finite].abs().max().item(), 1.0)).item()


def check(seed: int, backend: str, dtype: torch.dtype, shapes: str = "mixed") -> dict:
    """The errors over tolerance of one seed (of the ``shapes`` draws) on one backend and dtype
    ({} if none)."""
    c = draw(seed, shapes)
    tensors, kw, grad = make(c, seed)
    rounded = {n: None if x is None else x.to(dtype) for n, x in tensors.items()}
    grad = grad.to(dtype)
    isa = os.environ.get("RELPOS_CPU_ISA")
    if backend.startswith("cpu-"):
        os.environ["RELPOS_CPU_ISA"] = backend[4:]
    try:
        out, lse, grads = run_backend(backend, rounded, kw, grad, c["strided"], c["cache_view"])
    except RuntimeError as e:
        return {"exception": str(e).splitlines()[0][:300]}
    finally:
        if isa is None:
            os.environ.pop("RELPOS_CPU_ISA", None)
        else:
            os.environ["RELPOS_CPU_ISA"] = isa
    want_out, want_lse, want_grads = run_reference(rounded, kw, grad, out)
    # the logits' spread: their rounding errors grow with it (scale 1 on queries of norm 4 sqrt(D)
    # gives logits of ~36 at D = 80, and gradients that cancel to a part in 1e3 in float32)
    spread = abs(1 / math.sqrt(c["D"]) if c["scale"] is None else c["scale"]) * c["q_scale"] \
        * math.sqrt(c["D"])
    tol = TOLERANCE[dtype] * (1 + 0.2 * math.log2(max(c["Lk"], 2))) * max(1.0, spread) ** 0.5
    errors = {"out": (error(out, want_out), tol), "lse": (error(lse, want_lse), tol)}
    for name, got, want in zip(GRADS, grads, want_grads):
        if want is None:
            if got.numel() != 0:
                errors[name] = (math.inf, 0.0)
            continue
        errors[name] = (error(got, want), 3 * tol)
    over = {n: e for n, (e, t) in errors.items() if not e <= t}
    if over and dtype == torch.float32:
        eager = eager_float32_errors(rounded, kw, grad)
        over = {n: e for n, e in over.items() if not e <= EAGER_FACTOR * eager.get(n, 0.0)}
    return over


# A float32 error over the tolerance passes if it is within this factor of eager PyTorch's own
# float32 error on the same inputs (eager_float32_errors).
EAGER_FACTOR = 4.0


def eager_float32_errors(rounded: dict, kw: dict, grad: torch.Tensor) -> dict:
    """Each tensor's error (as check measures it) of relpos_ext.reference run in float32 on the
    same float32 inputs: how well float32 arithmetic can do on this draw at all. The table
    gradients sum every (query, key) pair of their bucket, and where their true value cancels to
    almost nothing (K = 0: one bucket, and a dS row sums to 0), float32's rounding of the terms
    is what is left: seed 755356 (K = 0, sharp logits) gives drel_k errors of 0.0074 (scalar
    kernel), 0.0090 (AVX2, AVX-512) and 0.0079 (eager float32), against a tolerance of 0.0075."""
    leaves, out, lse = reference_forward(rounded, kw, torch.float32)
    grads = reference_grads(leaves, (out * grad).sum())
    want_out, want_lse, want_grads = run_reference(rounded, kw, grad, out.detach())
    errors = {"out": error(out.detach(), want_out), "lse": error(lse.detach(), want_lse)}
    for name, got, want in zip(GRADS, grads, want_grads):
        if got is not None:
            errors[name] = error(got, want)
    return errors


def available(backend: str, emu_lib: Path) -> str | None:
    """None if the backend can run here, else why not."""
    info = relpos_ext.build_info()
    if backend == "cpu-avx2" and "avx2" not in info["cpu_kernels"]:
        return "no AVX2 kernels in this build"
    if backend == "cpu-avx512":
        isa = os.environ.pop("RELPOS_CPU_ISA", None)
        in_use = relpos_ext.build_info()["cpu_kernel_in_use"]
        if isa is not None:
            os.environ["RELPOS_CPU_ISA"] = isa
        if in_use != "avx512":
            return "no AVX-512 kernels for this build/CPU"
    if backend == "cuda-emu":
        if not emu_lib.is_file():
            return f"no emulator library at {emu_lib} (bash scripts/build_cuda_emu.sh)"
        torch.ops.load_library(str(emu_lib))
    if backend == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0:200", help="START:COUNT (default 0:200)")
    ap.add_argument("--backends", nargs="+", default=["cpu-scalar", "cpu-avx2", "cpu-avx512"],
                    choices=BACKENDS)
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES),
                    help="float64 runs on cpu-scalar only (default float32)")
    ap.add_argument("--emu-lib", type=Path,
                    default=Path(os.environ.get("RELPOS_CUDA_EMU_LIB", DEFAULT_EMU)))
    ap.add_argument("--shapes", default="mixed", choices=list(SHAPES),
                    help="mixed: sizes around the tile edges (default); decode: a few rows"
                    " against a long cache")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds; stop after the seed"
                    " that crosses it")
    args = ap.parse_args(argv)
    start, count = (int(x) for x in args.seeds.split(":"))
    runs = []
    for backend in args.backends:
        why = available(backend, args.emu_lib)
        if why:
            print(f"skip {backend}: {why}")
            continue
        runs += [(backend, DTYPES[d]) for d in args.dtypes
                 if d != "float64" or backend == "cpu-scalar"]
    if not runs:
        print("nothing to run")
        return 1
    t0 = time.monotonic()
    failed, done = 0, 0
    for seed in range(start, start + count):
        for backend, dtype in runs:
            bad = check(seed, backend, dtype, args.shapes)
            if bad:
                failed += 1
                print(f"FAIL seed {seed} {backend} {str(dtype)[6:]}: "
                      + ", ".join(f"{n} {e:.3g}" if isinstance(e, float) else f"{n}: {e}"
                                  for n, e in bad.items()))
                print(f"     {draw(seed, args.shapes)}", flush=True)
        done += 1
        if args.time_limit is not None and time.monotonic() - t0 > args.time_limit:
            break
    runs_text = ", ".join(f"{b} {str(d)[6:]}" for b, d in runs)
    print(f"{done} {args.shapes} seeds x [{runs_text}]: {failed} failures "
          f"({time.monotonic() - t0:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
