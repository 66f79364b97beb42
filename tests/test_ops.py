"""One parametrised suite per op: backend x dtype x shape, against relpos_ext.reference."""

from __future__ import annotations

import pytest
import torch

from relpos_ext import reference as ref
from conftest import assert_close, assert_concurrent_calls_match, skip_unless_avx512

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def randn(*shape, dtype, noncontig=False):
    """Random tensor; with noncontig, a transposed view of the same values (not contiguous)."""
    if not noncontig or len(shape) < 2:
        return torch.randn(*shape, dtype=torch.float64).to(dtype)
    t = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64).to(dtype)
    return t.transpose(-1, -2)


# ------------------------------------------------------------------------------------ rel_gather
# (heads or None for a shared table, Lq, Lk, D, K, q_offset, k_offset)
GATHER_CASES = [
    (None, 5, 7, 3, 2, 0, 0),  # Lq != Lk, D not a multiple of 8
    (3, 6, 4, 13, 3, 2, 0),  # per-head table, query offset
    (None, 1, 1, 8, 0, 0, 0),  # L = 1, K = 0
    (2, 3, 9, 5, 20, 0, 0),  # K >= L
    (None, 4, 6, 16, 1, -3, 5),  # both offsets, negative
    (None, 9, 9, 1, 3, 0, 0),  # D = 1
    (None, 0, 5, 4, 1, 0, 0),  # empty Lq
    (2, 5, 0, 4, 2, 0, 0),  # empty Lk
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("noncontig", [False, True])
def test_rel_gather(backend, dtype, case, noncontig):
    heads, lq, lk, d, k, qo, ko = case
    shape = (2 * k + 1, d) if heads is None else (heads, 2 * k + 1, d)
    table = randn(*shape, dtype=dtype, noncontig=noncontig)
    out = backend.op("rel_gather")(backend.tensor(table), lq, lk, k, qo, ko)
    expected = ref.rel_gather(table, lq, lk, k, qo, ko)
    assert out.shape == expected.shape
    assert torch.equal(out.cpu(), expected), "gather must copy exactly"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GATHER_CASES)
def test_rel_gather_backward(backend, dtype, case):
    heads, lq, lk, d, k, qo, ko = case
    shape = (2 * k + 1, d) if heads is None else (heads, 2 * k + 1, d)
    table = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    expected_out = ref.rel_gather(table, lq, lk, k, qo, ko)
    grad = torch.randn(expected_out.shape, dtype=torch.float64).to(dtype)
    (expected,) = torch.autograd.grad(expected_out, table, grad.double())
    got = backend.op("rel_gather_backward")(backend.tensor(grad), k, qo, ko)
    # up to Lq * Lk terms land in the clamped buckets
    assert_close(got, expected, dtype, scale=max(1.0, (lq * lk) ** 0.5))


def test_rel_gather_backward_is_deterministic(backend):
    table_shape = (2, 7, 24)
    grad = torch.randn(2, 33, 40, 24)
    fn = backend.op("rel_gather_backward")
    first = fn(backend.tensor(grad), 3, 0, 0)
    for _ in range(3):
        assert torch.equal(fn(backend.tensor(grad), 3, 0, 0), first)
    assert first.shape == table_shape


# ------------------------------------------------------------------------------------------ skew
# (leading dims, Lq, Lk)
SKEW_CASES = [((2, 3), 4, 6), ((), 1, 1), ((5,), 7, 3), ((1,), 6, 6), ((2,), 1, 9), ((3,), 0, 2)]
CAUSAL_CASES = [((2,), 5), ((), 1), ((2, 2), 8), ((1,), 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SKEW_CASES)
@pytest.mark.parametrize("noncontig", [False, True])
def test_skew_matches_tensor2tensor_bitwise(backend, dtype, case, noncontig):
    lead, lq, lk = case
    x = randn(*lead, lq, lq + lk - 1, dtype=dtype, noncontig=noncontig)
    out = backend.op("skew")(backend.tensor(x), False)
    expected = ref.skew_t2t(x)
    assert out.shape == (*lead, lq, lk)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CAUSAL_CASES)
def test_skew_causal(backend, dtype, case):
    lead, length = case
    x = randn(*lead, length, length, dtype=dtype)
    out = backend.op("skew")(backend.tensor(x), True).cpu()
    lower = torch.ones(length, length, dtype=torch.bool).tril()
    # lower triangle bit-for-bit equal to tensor2tensor's masked skew, zeros above the diagonal
    assert torch.equal(out.masked_select(lower), ref.skew_t2t_masked(x).masked_select(lower))
    assert not out.masked_select(~lower).any()
    assert torch.equal(out, ref.skew(x, causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_skew_backward_is_the_adjoint(backend, dtype, causal):
    lq, lk = (6, 6) if causal else (5, 8)
    width = lk if causal else lq + lk - 1
    x = torch.randn(2, 3, lq, width, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, lq, lk, dtype=torch.float64).to(dtype)
    (expected,) = torch.autograd.grad(ref.skew(x, causal), x, grad.double())
    got = backend.op("skew_backward")(backend.tensor(grad), causal)
    assert torch.equal(got.cpu(), expected.to(dtype))


# ------------------------------------------------------------------------------------ rel_logits
# (B, H, Lq, Lk, D, K, q_offset, k_offset, per_head)
LOGITS_CASES = [
    (2, 3, 5, 7, 16, 2, 0, 0, False),  # Lq != Lk, clipped
    (1, 2, 6, 6, 13, 5, 0, 0, True),  # unclipped (K = L - 1), per-head, odd D
    (1, 1, 4, 9, 8, 20, 0, 0, False),  # K >= L
    (2, 2, 5, 6, 64, 1, 3, 0, True),  # decoding-style query offset
    (1, 2, 7, 4, 24, 2, -2, 6, False),  # both offsets
    (1, 1, 1, 1, 8, 0, 0, 0, False),  # L = 1, K = 0
    (1, 3, 9, 12, 80, 0, 0, 0, True),  # K = 0: every key shares one bucket
    (0, 2, 4, 4, 8, 1, 0, 0, False),  # empty batch
    (1, 1, 3, 0, 8, 1, 0, 0, False),  # no keys
]


def _logits_inputs(case, dtype, noncontig=False):
    b, h, lq, lk, d, k, qo, ko, per_head = case
    if noncontig:  # [B, Lq, H, D] viewed as [B, H, Lq, D]
        q = torch.randn(b, lq, h, d, dtype=torch.float64).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, lq, d, dtype=torch.float64).to(dtype)
    table = torch.randn(*((h,) if per_head else ()), 2 * k + 1, d, dtype=torch.float64).to(dtype)
    return q, table, k, lk, qo, ko


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LOGITS_CASES)
@pytest.mark.parametrize("noncontig", [False, True])
def test_rel_logits(backend, dtype, case, noncontig):
    q, table, k, lk, qo, ko = _logits_inputs(case, dtype, noncontig)
    out = backend.op("rel_logits")(backend.tensor(q), backend.tensor(table), k, lk, qo, ko)
    expected = ref.rel_logits(q.double(), table.double(), k, lk, qo, ko)
    assert out.shape == expected.shape
    assert_close(out, expected, dtype, scale=q.shape[-1] ** 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LOGITS_CASES)
def test_rel_logits_backward(backend, dtype, case):
    q, table, k, lk, qo, ko = _logits_inputs(case, dtype)
    q64 = q.double().requires_grad_()
    t64 = table.double().requires_grad_()
    out = ref.rel_logits(q64, t64, k, lk, qo, ko)
    grad = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    dq_ref, dt_ref = torch.autograd.grad(out, (q64, t64), grad.double(), allow_unused=True)
    dq, dt = backend.op("rel_logits_backward")(
        backend.tensor(grad), backend.tensor(q), backend.tensor(table), k, qo, ko
    )
    scale = max(1.0, (q.shape[0] * q.shape[2] * max(lk, 1)) ** 0.5)
    assert_close(dq, torch.zeros_like(q64) if dq_ref is None else dq_ref, dtype, scale)
    assert_close(dt, torch.zeros_like(t64) if dt_ref is None else dt_ref, dtype, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", LOGITS_CASES + [
    (2, 3, 70, 90, 64, 89, 0, 0, True),  # unclipped, 12 register tiles of rows, 6 panels
    (1, 2, 33, 100, 37, 40, 5, 0, False),  # clipped, odd D, a query offset
])
def test_rel_logits_avx512_is_bitwise_avx2(monkeypatch, dtype, case):
    """rel_logits' AVX-512 build differs from the AVX2 one only in the width of its register
    tile (panels of 32 buckets instead of 16), whose entries are the same FMA chains: forward
    and backward must be bitwise those of the AVX2 kernels."""
    skip_unless_avx512(monkeypatch)
    q, table, k, lk, qo, ko = _logits_inputs(case, dtype)
    grad = torch.randn(*q.shape[:3], lk).to(dtype)
    results = []
    for isa in ("avx2", "avx512"):
        monkeypatch.setenv("RELPOS_CPU_ISA", isa)
        out = torch.ops.relpos.rel_logits(q, table, k, lk, qo, ko)
        results.append((out, *torch.ops.relpos.rel_logits_backward(grad, q, table, k, qo, ko)))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_rel_logits_backward_in_head_groups():
    """Unclipped and long enough that the per-row bucket sums of one head pass the 32 MiB chunk
    of OpsImpl::rel_logits_backward: heads go one at a time (the glue is shared by CPU and CUDA,
    so the CPU op covers it), and the result must not depend on it."""
    b, h, length, d = 2, 3, 1500, 4
    q = torch.randn(b, h, length, d)
    table = torch.randn(h, 2 * (length - 1) + 1, d) * 0.1
    grad = torch.randn(b, h, length, length)
    q64, t64 = q.double().requires_grad_(), table.double().requires_grad_()
    out = ref.rel_logits(q64, t64, length - 1, length, 0, 0)
    dq_ref, dt_ref = torch.autograd.grad(out, (q64, t64), grad.double())
    dq, dt = torch.ops.relpos.rel_logits_backward(grad, q, table, length - 1, 0, 0)
    assert_close(dq, dq_ref, torch.float32, scale=length**0.5)
    assert_close(dt, dt_ref, torch.float32, scale=(b * length) ** 0.5)


def test_rel_logits_backward_in_row_blocks():
    """Unclipped, with one head's per-row bucket sums (2100 rows x 3103 buckets, float64: 52 MB)
    beyond the 32 MiB chunk: the glue goes by blocks of rows, each with the band of buckets its
    rows reach. The results match the reference, and no buffer the op allocates passes the chunk
    (the profiler's record of its allocations)."""
    b, h, lq, lk, d, qo, ko = 1, 2, 2100, 1000, 8, 3, 1
    k = lq + qo  # beyond every distance
    q = torch.randn(b, h, lq, d, dtype=torch.float64)
    table = torch.randn(h, 2 * k + 1, d, dtype=torch.float64) * 0.1
    grad = torch.randn(b, h, lq, lk, dtype=torch.float64)
    q64, t64 = q.clone().requires_grad_(), table.clone().requires_grad_()
    out = ref.rel_logits_gather(q64, t64, k, lk, qo, ko)
    dq_ref, dt_ref = torch.autograd.grad(out, (q64, t64), grad)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        dq, dt = torch.ops.relpos.rel_logits_backward(grad, q, table, k, qo, ko)
    assert_close(dq, dq_ref, torch.float64, scale=lk**0.5)
    assert_close(dt, dt_ref, torch.float64, scale=(b * lq) ** 0.5)
    assert max(e.cpu_memory_usage for e in prof.events()) <= (32 << 20) + (1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rel_logits_backward_ignores_autocast(dtype):
    """A backward that runs inside a CPU autocast region (loss.backward() within the block):
    the op's own matmuls stay in its float32 accumulation, so the gradients are bitwise those
    outside (autocast used to cast them to bfloat16: 4e-3 off for float32 inputs)."""
    q = torch.randn(2, 3, 40, 16).to(dtype)
    table = torch.randn(3, 2 * 9 + 1, 16).to(dtype)
    grad = torch.randn(2, 3, 40, 50).to(dtype)
    want = torch.ops.relpos.rel_logits_backward(grad, q, table, 9, 2, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.relpos.rel_logits_backward(grad, q, table, 9, 2, 0)
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g, w)


def test_rel_logits_unclipped_music_transformer(backend):
    """K >= max(Lq, Lk) - 1: every distance has its own row (Huang et al. 2018)."""
    lq = lk = 33
    q = torch.randn(1, 2, lq, 32)
    table = torch.randn(2 * (lq - 1) + 1, 32)
    out = backend.op("rel_logits")(backend.tensor(q), backend.tensor(table), lq - 1, lk, 0, 0)
    qe = q @ table.T  # [.., Lq, 2L-1], column c = distance c - (L-1)
    assert_close(out, ref.skew_t2t(qe.double()), torch.float32, scale=6)


@pytest.mark.parametrize("source", ["aten", "gomp", "std"])
def test_ops_concurrent_calls(monkeypatch, cpu_isa, source):
    """rel_gather, skew and rel_logits, forward and backward, called from several Python threads
    at once, each on two torch threads of its own split: every call gets bitwise the results it
    gets alone (test_attention.py's test_rel_attention_cpu_concurrent_calls for the attention)."""
    ops = torch.ops.relpos
    jobs = []
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, lq, lk, d, k, qo, ko, per_head in [(2, 4, 300, 400, 64, 12, 3, 0, True),
                                                    (1, 8, 130, 200, 37, 199, 0, 5, False)]:
            q, table, k, lk, qo, ko = _logits_inputs((b, h, lq, lk, d, k, qo, ko, per_head), dtype)
            grad = torch.randn(b, h, lq, lk).to(dtype)
            jobs.append(lambda q=q, t=table, g=grad, k=k, lk=lk, qo=qo, ko=ko: (
                ops.rel_logits(q, t, k, lk, qo, ko), *ops.rel_logits_backward(g, q, t, k, qo, ko)))
        table = torch.randn(3, 2 * 7 + 1, 24).to(dtype)
        grad = torch.randn(3, 150, 200, 24).to(dtype)
        jobs.append(lambda t=table, g=grad: (ops.rel_gather(t, 150, 200, 7, 2, 0),
                                             ops.rel_gather_backward(g, 7, 2, 0)))
        x = torch.randn(2, 3, 150, 150 + 200 - 1).to(dtype)
        jobs.append(lambda x=x: (ops.skew(x), ops.skew_backward(ops.skew(x)),
                                 ops.skew(x[..., :150], True)))

    assert_concurrent_calls_match(monkeypatch, source, jobs)
