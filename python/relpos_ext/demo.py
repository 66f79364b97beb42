"""A first look at relpos_ext: correctness and speed of Shaw relative attention in one minute.

Run it with ``python -m relpos_ext.demo`` (``--help`` for options). It

1. prints what this build contains (:func:`relpos_ext.build_info`);
2. builds a :class:`relpos_ext.nn.ShawRelativeAttention` layer, non-causal and causal, and checks
   its output and every gradient against the plain eager oracle
   (:func:`relpos_ext.reference.shaw_attention` with the layer's own projections), printing the
   largest error and PASS/FAIL (the exit code is 1 on any FAIL);
3. times the layer against the same attention done in eager PyTorch two ways: (a) with the
   materialised ``[L, L, D]`` gathers of the relative tables (tensor2tensor style) and (b) with
   ``q @ EK^T`` + ``torch.gather`` for the keys and a ``scatter_add`` of the probabilities into
   buckets + ``@ EV`` for the values (the lean eager form);
4. times :func:`relpos_ext.rel_logits` alone against (b)'s key term at a few sizes;
5. checks the fused layer :class:`relpos_ext.nn.RelativeMultiheadAttention` (core:
   :func:`relpos_ext.rel_attention`) against
   :class:`relpos_ext.reference.RelativeMultiheadAttentionReference` holding the same state dict,
   output and every gradient, PASS/FAIL, and times it against the reference and against the same
   projections around ``F.scaled_dot_product_attention`` with no relative terms (the floor).

(b) is :func:`relpos_ext.reference.shaw_attention_gather`, the efficient eager form.

The timings use ``torch.utils.benchmark`` with short runs: they show orders of magnitude, not
careful numbers (``benchmarks/bench_ops.py`` and ``benchmarks/bench_attention.py`` are the
careful benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relpos_ext
from relpos_ext import reference as ref
from relpos_ext.nn import RelativeMultiheadAttention, ShawRelativeAttention

# Layer shape checked and timed (batch, length, embed_dim, heads, max_distance).
BATCH, LENGTH, EMBED, HEADS, MAX_DISTANCE = 2, 256, 256, 8, 16
# rel_logits-alone sizes (length, K) at B=1, H=8, D=64 (the shape of benchmarks/bench_ops.py).
OP_SIZES = ((512, 64), (1024, 64), (1024, 1023))
OP_DIM = 64
# Pass if max |got - want| <= TOL * max(1, max |want|), per tensor (float32).
TOL = 1e-4


# --------------------------------------------------------------------------- eager versions
def project(layer: ShawRelativeAttention, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's own q, k, v projections: x ``[B, L, E]`` -> three ``[B, H, L, D]``."""
    batch, length, _ = x.shape
    qkv = layer.qkv(x).view(batch, length, 3, layer.num_heads, layer.head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return q, k, v


def merge(layer: ShawRelativeAttention, z: Tensor) -> Tensor:
    """Heads back to ``[B, L, E]`` and the output projection: z ``[B, H, L, D]``."""
    batch, _, length, _ = z.shape
    return layer.out_proj(z.transpose(1, 2).reshape(batch, length, layer.embed_dim))


def eager_materialised(layer: ShawRelativeAttention, x: Tensor) -> Tensor:
    """(a) The layer in eager PyTorch, relative tables gathered to ``[L, L, D]`` (the oracle)."""
    q, k, v = project(layer, x)
    z = ref.shaw_attention(q, k, v, layer.rel_k, layer.rel_v, layer.max_distance, layer.causal)
    return merge(layer, z)


def eager_gather(layer: ShawRelativeAttention, x: Tensor) -> Tensor:
    """(b) The layer in lean eager PyTorch (:func:`relpos_ext.reference.shaw_attention_gather`): no ``[L, L, D]``."""
    q, k, v = project(layer, x)
    z = ref.shaw_attention_gather(q, k, v, layer.rel_k, layer.rel_v, layer.max_distance, layer.causal)
    return merge(layer, z)


# --------------------------------------------------------------------------- correctness
@dataclass
class Check:
    """One compared tensor: its name, max abs error, the scale it is judged against."""

    name: str
    err: float
    scale: float

    @property
    def ok(self) -> bool:
        return self.err <= TOL * max(1.0, self.scale)


def compare(
    got_fn: Callable[[Tensor], Tensor],
    got_module: nn.Module,
    want_fn: Callable[[Tensor], Tensor],
    want_module: nn.Module,
    x: Tensor,
) -> list[Check]:
    """Output and gradients (w.r.t. x and every parameter) of ``got_fn(x)`` vs ``want_fn(x)``.

    Parameters are paired by name: ``got_fn`` differentiates through ``got_module``'s,
    ``want_fn`` through ``want_module``'s (the same module for the Shaw layer's eager forms).
    """
    x = x.detach().requires_grad_()
    got_params = dict(got_module.named_parameters())
    want_params = dict(want_module.named_parameters())
    names = list(got_params)
    got, want = got_fn(x), want_fn(x)
    g_out = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (x, *got_params.values()), g_out)
    want_grads = torch.autograd.grad(want, (x, *(want_params[n] for n in names)), g_out)
    checks = [Check("output", (got - want).abs().max().item(), want.abs().max().item())]
    for name, g, w in zip(("x", *names), got_grads, want_grads):
        checks.append(Check(f"d{name}", (g - w).abs().max().item(), w.abs().max().item()))
    return checks


def report_checks(label: str, checks: list[Check], width: int) -> bool:
    """Print one result row (output error, worst gradient error, PASS/FAIL) and any failures."""
    worst = max(checks[1:], key=lambda c: c.err / max(1.0, c.scale))
    ok = all(c.ok for c in checks)
    worst_txt = f"{worst.err:.2e} ({worst.name})"
    print(f"  {label:<{width}}{checks[0].err:>11.2e}{worst_txt:>28}  {'PASS' if ok else 'FAIL'}")
    for c in checks:
        if not c.ok:
            print(f"      {c.name}: max|err| {c.err:.3e} > {TOL:g} * {max(1.0, c.scale):.3g}")
    return ok


def run_checks(device: torch.device) -> bool:
    """Check the layer against the oracle (and the lean eager form (b)); True when all pass."""
    print(f"Correctness: ShawRelativeAttention(E={EMBED}, H={HEADS}, K={MAX_DISTANCE}) on "
          f"x [B={BATCH}, L={LENGTH}, E={EMBED}], float32, {device}")
    print(f"  PASS when max|err| <= {TOL:g} * max(1, max|reference|) for the output and every gradient\n")
    print(f"  {'layer vs':<30}{'causal':<8}{'output err':>11}{'worst grad err':>28}  result")
    all_ok = True
    for causal in (False, True):
        torch.manual_seed(0)
        layer = ShawRelativeAttention(EMBED, HEADS, MAX_DISTANCE, causal=causal).to(device)
        x = torch.randn(BATCH, LENGTH, EMBED, device=device)
        for label, other in (("(a) reference.shaw_attention", eager_materialised),
                             ("(b) eager q@E^T + gather", eager_gather)):
            checks = compare(layer, layer, lambda x: other(layer, x), layer, x)
            all_ok &= report_checks(f"{label:<30}{causal!s:<8}", checks, 38)
    print()
    return all_ok


# Cases for the fused layer: (label, RelativeMultiheadAttention kwargs, forward kwargs).
MHA_CASES = (
    ("self-attention, shared tables", {}, {}),
    ("causal, GQA 8q/2kv, per-head tables, key padding mask",
     {"num_kv_heads": 2, "per_head_tables": True}, {"is_causal": True, "padding": 40}),
)


def mha_pair(device: torch.device, **kwargs) -> tuple[RelativeMultiheadAttention, nn.Module]:
    """The fused layer and the reference layer holding the same state dict."""
    torch.manual_seed(0)
    fused = RelativeMultiheadAttention(EMBED, HEADS, MAX_DISTANCE, **kwargs).to(device)
    reference = ref.RelativeMultiheadAttentionReference(EMBED, HEADS, MAX_DISTANCE, **kwargs)
    reference.load_state_dict(fused.state_dict())
    return fused, reference.to(device)


def run_mha_checks(device: torch.device) -> bool:
    """The fused layer vs RelativeMultiheadAttentionReference (same state dict); True if all pass."""
    print(f"Correctness: nn.RelativeMultiheadAttention(E={EMBED}, H={HEADS}, K={MAX_DISTANCE}) "
          "vs reference.RelativeMultiheadAttentionReference\n  with the same state dict, "
          f"x [B={BATCH}, L={LENGTH}, E={EMBED}], float32, {device}; same PASS rule\n")
    width = max(len(c[0]) for c in MHA_CASES) + 2
    print(f"  {'case':<{width}}{'output err':>11}{'worst grad err':>28}  result")
    all_ok = True
    for label, layer_kw, call_kw in MHA_CASES:
        fused, reference = mha_pair(device, **layer_kw)
        x = torch.randn(BATCH, LENGTH, EMBED, device=device)
        kw = {"is_causal": call_kw.get("is_causal", False)}
        if call_kw.get("padding"):  # the last keys of the last batch entry are padding
            mask = torch.zeros(BATCH, LENGTH, dtype=torch.bool, device=device)
            mask[-1, -call_kw["padding"]:] = True
            kw["key_padding_mask"] = mask
        checks = compare(lambda x: fused(x, **kw)[0], fused,
                         lambda x: reference(x, **kw)[0], reference, x)
        all_ok &= report_checks(label, checks, width)
    print()
    return all_ok


# --------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median milliseconds per call of ``fn`` (torch.utils.benchmark, current thread count)."""
    # torch.utils.benchmark imports cpp_extension, which warns about CUDA_HOME without a GPU.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils import benchmark

    fn()  # warm-up
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def fwd_and_bwd(forward: Callable[[], Tensor], wrt: tuple[Tensor, ...], min_run_time: float):
    """(forward ms, forward+backward ms); the backward is w.r.t. ``wrt``."""
    with torch.no_grad():
        fwd = time_ms(forward, min_run_time)
    out = forward()
    g = torch.randn_like(out)
    both = time_ms(lambda: torch.autograd.grad(forward(), wrt, g), min_run_time)
    return fwd, both


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def fmt(cells: tuple[str, ...]) -> str:
        return "  " + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    print(title)
    print(fmt(header))
    print("  " + "-" * (sum(widths) + 2 * (len(widths) - 1)))
    for r in rows:
        print(fmt(r))
    print()


def time_layer(device: torch.device, min_run_time: float) -> None:
    """The layer vs the two eager forms, forward and forward+backward (w.r.t. x and params)."""
    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        layer = ShawRelativeAttention(EMBED, HEADS, MAX_DISTANCE, causal=causal).to(device)
        x = torch.randn(BATCH, LENGTH, EMBED, device=device, requires_grad=True)
        wrt = (x, *layer.parameters())
        base = None
        for label, fn in (
            ("relpos_ext layer", lambda: layer(x)),
            ("(a) eager, [L,L,D] gathers", lambda: eager_materialised(layer, x)),
            ("(b) eager, q@E^T + gather", lambda: eager_gather(layer, x)),
        ):
            fwd, both = fwd_and_bwd(fn, wrt, min_run_time)
            base = base or (fwd, both)
            rows.append((label, str(causal), f"{fwd:.2f}", f"{fwd / base[0]:.2f}x",
                         f"{both:.2f}", f"{both / base[1]:.2f}x"))
    print_table(
        f"Timing: the layer, B={BATCH} L={LENGTH} E={EMBED} H={HEADS} K={MAX_DISTANCE} "
        f"(ms, median; 'x' = time / layer's time)",
        ("", "causal", "fwd ms", "x", "fwd+bwd ms", "x"),
        rows,
    )


class SdpaMultiheadAttention(RelativeMultiheadAttention):
    """The fused layer's projections around ``F.scaled_dot_product_attention``, no relative terms.

    The floor for :func:`time_mha`: what the layer would cost without relative positions.
    """

    def attend(self, q, k, v, key_padding_mask, causal, q_offset, k_offset, dropout_p=0.0,
               dropout_seed=None, attn_mask=None, segment_ids=None):
        if (key_padding_mask is not None or attn_mask is not None or segment_ids is not None
                or dropout_p > 0 or q_offset != 0 or k_offset != 0):
            raise NotImplementedError("the SDPA floor takes no masks, dropout or offsets")
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1])


def time_mha(device: torch.device, min_run_time: float) -> None:
    """RelativeMultiheadAttention vs its reference and vs SDPA without relative terms."""
    fused, reference = mha_pair(device)
    floor = SdpaMultiheadAttention(EMBED, HEADS, MAX_DISTANCE, rel_keys=False, rel_values=False)
    floor.load_state_dict(fused.state_dict(), strict=False)  # drops rel_k, rel_v
    floor.to(device)
    x = torch.randn(BATCH, LENGTH, EMBED, device=device, requires_grad=True)
    rows, base = [], None
    for label, layer in (("nn.RelativeMultiheadAttention", fused),
                         ("RelativeMultiheadAttentionReference", reference),
                         ("SDPA, no relative terms (floor)", floor)):
        fwd, both = fwd_and_bwd(lambda: layer(x)[0], (x, *layer.parameters()), min_run_time)
        base = base or (fwd, both)
        rows.append((label, f"{fwd:.2f}", f"{fwd / base[0]:.2f}x", f"{both:.2f}",
                     f"{both / base[1]:.2f}x"))
    print_table(
        f"Timing: RelativeMultiheadAttention, B={BATCH} L={LENGTH} E={EMBED} H={HEADS} "
        f"K={MAX_DISTANCE}, non-causal (ms, median; 'x' = time / fused layer's time)",
        ("", "fwd ms", "x", "fwd+bwd ms", "x"),
        rows,
    )


def time_rel_logits(device: torch.device, min_run_time: float) -> None:
    """``rel_logits`` alone vs eager ``q @ E^T`` + ``torch.gather`` (backward w.r.t. q, table)."""
    rows = []
    for length, kmax in OP_SIZES:
        q = torch.randn(1, HEADS, length, OP_DIM, device=device, requires_grad=True)
        table = torch.randn(2 * kmax + 1, OP_DIM, device=device, requires_grad=True)
        ours = fwd_and_bwd(lambda: relpos_ext.rel_logits(q, table, kmax, length), (q, table),
                           min_run_time)
        eager = fwd_and_bwd(lambda: ref.rel_logits_gather(q, table, kmax, length), (q, table),
                            min_run_time)
        rows.append((f"L={length} K={kmax}", f"{ours[0]:.2f}", f"{eager[0]:.2f}",
                     f"{eager[0] / ours[0]:.2f}x", f"{ours[1]:.2f}", f"{eager[1]:.2f}",
                     f"{eager[1] / ours[1]:.2f}x"))
    print_table(
        f"Timing: rel_logits alone vs eager q@E^T + gather, q [1, {HEADS}, L, {OP_DIM}], "
        f"table [2K+1, {OP_DIM}] (ms; speedup = eager / ours)",
        ("", "fwd ours", "fwd eager", "speedup", "fwd+bwd ours", "fwd+bwd eager", "speedup"),
        rows,
    )


# --------------------------------------------------------------------------- entry point
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relpos_ext.demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--min-run-time", type=float, default=0.3,
                   help="seconds per timing (blocked_autorange; default 0.3)")
    p.add_argument("--no-timing", action="store_true", help="only the correctness checks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit code (1 when a correctness check fails)."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = relpos_ext.build_info()
    print(f"relpos_ext {relpos_ext.__version__} on torch {torch.__version__} "
          f"({torch.get_num_threads()} CPU threads)")
    for key, value in info.items():
        print(f"  {key:<18}{value}")
    print()

    ok = run_checks(device)
    ok &= run_mha_checks(device)
    if not args.no_timing:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if load > 0.5 * (os.cpu_count() or 1):
            print(f"note: load average {load:.1f} on {os.cpu_count()} CPUs: other work is running, "
                  "so the timings below are noisy.\n")
        time_layer(device, args.min_run_time)
        time_rel_logits(device, args.min_run_time)
        time_mha(device, args.min_run_time)
        if info.get("cpu_kernel_in_use") == "scalar" and device.type == "cpu":
            print("note: this build runs the portable scalar CPU kernels (no AVX2 path compiled in "
                  "or selected; see cpu_kernels above).\n")
    print("all checks PASS" if ok else "some checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
